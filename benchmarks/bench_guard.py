"""The reward-hacking guard in issue 26's setting: each RL recipe with the guard on (the defaults)
and off, printed as one table.

The setting: the sort task, a tiny Llama fine-tuned on demonstrations of which 40% are wrong
(`--demo_error_rate`; it answers right greedily but often wrong sampled), and a reward model
trained on the task's preference pairs for only `--rm_steps` steps, so it ranks about 85% of
held-out pairs right (printed): a reward a policy can game. Against it, as `rlhf train ppo`
runs them (fp32, KL coefficient 0.01, 64 steps):

- `ppo_critic`: PPO with a critic initialised from the reward model, actor lr 2e-4, critic 5e-4,
  1 sample per prompt, 64 prompts a step;
- `reinforce`: REINFORCE with baseline, actor lr 2e-4, 4 samples x 16 prompts a step;
- `ppo_low`: PPO at actor lr 5e-5, rewards normalised, 4 samples x 16 prompts a step;
- `verifier`: `ppo_low` against the task's verifier instead (cannot be hacked: the control).

Guard on: the defaults (the verifier's held-out accuracy is the check; evaluated every tenth of
the run on a quarter of the held-out prompts, the best evaluated policy published). Guard off:
`--eval.hacking_guard_enable false --eval.publish_best false`, evaluated at the same steps on
the same prompts, so the last policy is published. Both report on the same 200 held-out prompts
x 4 samples at temperature 1 (`eval_initial/` the SFT policy, `eval/` the published one).
Nothing is asserted (tests/learning/test_rl_stage.py holds the asserted proof).

Usage: python benchmarks/bench_guard.py [--recipes ppo_critic,reinforce,ppo_low,verifier] [--steps 64]
       [--rm_steps 80] [--demo_error_rate 0.4] [--work_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_async import work_and_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = 267  # a quarter (67) for the evaluations during training, 200 reported
COMMON = ["--ds.param_dtype", "fp32", "--algo.kl.init_coef", "0.01", "--train.seed", "0", "--use_mlflow", "false",
          "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "4", "--eval.task", "sort",
          "--train.micro_batch_size", "32", "--rollout.micro_batch_size", "64"]
RECIPES = {
    "ppo_critic": ["--algo.advantage.estimator", "gae", "--actor.adam.lr", "2e-4", "--critic.adam.lr", "5e-4",
                   "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "64", "--train.batch_size", "64"],
    "reinforce": ["--algo.advantage.estimator", "reinforce_baseline", "--actor.adam.lr", "2e-4",
                  "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "16", "--train.batch_size", "64"],
    "ppo_low": ["--algo.advantage.estimator", "gae", "--actor.adam.lr", "5e-5", "--reward.normalize_enable",
                "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "16", "--train.batch_size", "64"],
}
RECIPES["verifier"] = RECIPES["ppo_low"]


def cli(args: list[str], env: dict, log: Path) -> None:
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], env=env, cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"rlhf {' '.join(args[:2])} failed (exit {code}):\n{log.read_text()[-3000:]}")


def prepare(root: Path, args, env: dict) -> dict:
    """Data, SFT policy and the weak reward model (kept in `root` between runs of this script)."""
    setting = root / f"setting-{args.demo_error_rate}-{args.rm_steps}.json"
    if setting.exists():
        return json.loads(setting.read_text())
    prep = root / f"prep-{args.demo_error_rate}"
    code = ("import sys, json; from pathlib import Path; from rlhf_core.stages.prep import prepare; "
            "print(json.dumps({k: str(v) for k, v in prepare(Path(sys.argv[1]), task='sort', seed=0, "
            f"model_size='tiny', n_train=4000, n_test={HELD_OUT}, demo_error_rate={args.demo_error_rate}).items()}}))")
    paths = json.loads(subprocess.run([sys.executable, "-c", code, str(prep)], env=env, check=True,
                                      capture_output=True, text=True, cwd=REPO).stdout.strip().splitlines()[-1])
    common = ["--apply_chat_template", "--max_len", "64", "--packing_samples", "--param_dtype", "fp32",
              "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false", "--learning_rate", "1e-3",
              "--max_epochs", "50"]
    sft = root / f"sft-{args.demo_error_rate}"
    if not (sft / "stage.json").exists():
        cli(["train", "sft", "--pretrain", paths["base"], "--dataset", f"json@{paths['sft']}", "--save_path", str(sft),
             "--train_batch_size", "32", "--micro_train_batch_size", "32", "--max_steps", "1000", *common],
            env, root / "sft.log")
    rm = root / f"rm-{args.demo_error_rate}-{args.rm_steps}"
    cli(["train", "rm", "--pretrain", str(sft), "--dataset", f"json@{paths['preference']}", "--save_path", str(rm),
         "--train_batch_size", "64", "--micro_train_batch_size", "32", "--max_steps", str(args.rm_steps), *common],
        env, root / "rm.log")
    rm_accuracy = json.loads((rm / "stage.json").read_text())["metrics"]["eval/accuracy"]
    out = {"sft": str(sft), "rm": str(rm), "rm_accuracy": rm_accuracy, "prompts": paths["prompts"]}
    setting.write_text(json.dumps(out))
    return out


def run(recipe: str, guard: bool, args, setting: dict, work: Path, env: dict) -> dict:
    out = work / f"{recipe}-{'on' if guard else 'off'}"
    reward = ["--reward.task", "sort"] if recipe == "verifier" else ["--reward.model_name_or_path", setting["rm"]]
    off = [] if guard else ["--eval.hacking_guard_enable", "false", "--eval.publish_best", "false",
                            "--eval.steps", str(-(-args.steps // 10))]  # the default cadence, every tenth
    start = time.perf_counter()
    cli(["train", "ppo", "--actor.model_name_or_path", setting["sft"], "--data.prompt_dataset",
         f"json@{setting['prompts']}", "--eval.dataset", f"json@{setting['prompts']}", "--train.max_steps",
         str(args.steps), "--ckpt.output_dir", str(out), *COMMON, *RECIPES[recipe], *reward, *off],
        env, work / f"{out.name}.log")
    m = json.loads((out / "stage.json").read_text())["metrics"]
    rewards = step_rewards(work / f"{out.name}.log")
    return {"recipe": recipe, "guard": guard, "sft": m["eval_initial/sampled_accuracy"],
            "published": m["eval/sampled_accuracy"], "last_selection": m.get("select/sampled_accuracy"),
            "published_step": m.get("published/step"), "fired_step": m.get("guard/fired_step"),
            "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
            "wall_s": time.perf_counter() - start}


def step_rewards(log: Path) -> list[float]:
    """Each training step's `reward_mean`, from the step lines of a run's log (`[rl step N/M] ...`)."""
    return [float(line.split("reward_mean=")[1].split(",")[0]) for line in log.read_text().splitlines()
            if line.startswith("[rl step ") and "/" in line.split("]")[0] and "reward_mean=" in line]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rm_steps", type=int, default=80, help="reward-model training steps (fewer: a weaker model)")
    p.add_argument("--demo_error_rate", type=float, default=0.4)
    p.add_argument("--work_dir", default=None, help="kept between runs (the SFT and reward models are reused)")
    args = p.parse_args(argv)
    work, env = work_and_env(args.work_dir, "rlhf-bench-guard-")
    t = time.perf_counter()
    setting = prepare(work, args, env)
    print(f"setting ready in {time.perf_counter() - t:.0f} s: reward model {setting['rm_accuracy']:.1%} of held-out "
          "pairs ranked right", flush=True)
    results = []
    for recipe in args.recipes.split(","):
        for guard in (True, False):
            r = run(recipe, guard, args, setting, work, env)
            results.append(r)
            print(json.dumps(r), flush=True)
    from rlhf_core.infra.precision import describe_hardware

    print(f"\nMachine: {describe_hardware()}; fp32; {args.steps} steps; SFT on {args.demo_error_rate:.0%} wrong "
          f"demonstrations; reward model {setting['rm_accuracy']:.1%} pairwise ({args.rm_steps} steps)")
    print("| recipe | guard | SFT sampled accuracy | published policy (step) | last policy (selection prompts) | "
          "guard fired at | training reward first -> last step |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        last = "" if r["last_selection"] is None else f"{r['last_selection']:.1%}"
        fired = "" if r["fired_step"] is None else f"step {r['fired_step']:.0f}"
        step = "" if r["published_step"] is None else f" ({r['published_step']:.0f})"
        print(f"| {r['recipe']} | {'on' if r['guard'] else 'off'} | {r['sft']:.1%} | {r['published']:.1%}{step} | "
              f"{last} | {fired} | {r['reward_first']:.2f} -> {r['reward_last']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
