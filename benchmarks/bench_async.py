"""Asynchronous against synchronous RL (`--async_train`), side by side: steps per second and the
held-out accuracy each reaches, with the rollout engine and the trainer on a core each.

The setting is the RL tests' (tests/rl_setting.py): the sort task, a tiny Llama fine-tuned on
demonstrations of which 30% are wrong, so it answers right greedily but often wrong when
sampled, and RL has room. Both sides run `rlhf train ppo` as a user would, with the same flags
and seed: GRPO against the task's verifier, 4 samples x 32 prompts a step, one optimizer step of
64 samples twice a step, no KL term (so the job has two roles: the actor and the engine), in the
precision `auto` picks on this machine (`--param_dtype` to pin one; the RL tests' setting is fp32),
micro-batches at the defaults (by token budget; `--setting_micro_batches` gives the setting's
32 / 64 instead),
`--steps` steps, evaluated before and after on 200 held-out prompts x 4 samples at temperature 1.

Where they run: a local Ray of 2 CPUs started here (`ray start --head`), `RAY_ADDRESS` pointing at
it and `RLHF_RANKS_ON_RAY=1`, so the actor and the rollout engine are Ray actors of one CPU each
(`rl/ray_roles.py` splits the cluster's CPUs over the bundles). In the synchronous loop each waits
for the other; asynchronously the engine samples the next batch while the actor trains.

Measured per run: training steps per second (each step's own time, from its log line's
`samples_per_s`: generation the trainer waited for, experience, training, weight sync), the RL
loop's steps per second with the evaluations during training in it (from the first step's log
line to the last's; both sides evaluate alike: every tenth of the run on the selection prompts),
the whole process's wall time, and the reported held-out sampled and greedy accuracy before and
after (200 prompts x 4 samples at T = 1; 67 more are the selection share). Runs
alternate (sync, async, sync, ...); every run is printed, then the medians and the ratio. Nothing
is asserted about time (benchmarks/README.md).

Usage: python benchmarks/bench_async.py [--steps 60] [--repeats 1] [--queue 1] [--partial] [--setting_micro_batches]
       [--param_dtype auto|bf16|fp32]
       [--work_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^\[rl step (\d+)/(\d+)\].*samples_per_s=([0-9.e+-]+)")
SAMPLES_PER_STEP = 128  # 32 prompts x 4 samples
# 267 held-out prompts: the evaluations during training take a quarter (67, `--eval.selection_fraction`),
# the reported ones the other 200
HELD_OUT = 267


def prepare(root: Path, env: dict) -> dict:
    """The RL setting's data and SFT model (kept in `root` between runs of this script)."""
    setting = root / "setting.json"
    if setting.exists():
        return json.loads(setting.read_text())
    code = (
        "import sys; from pathlib import Path; from rlhf_core.stages.prep import prepare; "
        "print(__import__('json').dumps(prepare(Path(sys.argv[1]), task='sort', seed=0, model_size='tiny', "
        f"n_train=4000, n_test={HELD_OUT}, demo_error_rate=0.3)))")
    paths = json.loads(subprocess.run([sys.executable, "-c", code, str(root / "prep")], env=env, check=True,
                                      capture_output=True, text=True, cwd=REPO).stdout.strip().splitlines()[-1])
    subprocess.run([sys.executable, "-m", "rlhf_core.cli", "train", "sft", "--pretrain", paths["base"], "--dataset",
                    f"json@{paths['sft']}", "--save_path", str(root / "sft"), "--train_batch_size", "32",
                    "--micro_train_batch_size", "32", "--max_steps", "1000", "--apply_chat_template", "--max_len", "64",
                    "--packing_samples", "--param_dtype", "fp32", "--lr_warmup_ratio", "0.05", "--seed", "0",
                    "--use_mlflow", "false", "--learning_rate", "1e-3", "--max_epochs", "50"],
                   env=env, check=True, capture_output=True, cwd=REPO)
    out = {"sft": str(root / "sft"), "prompts": paths["prompts"]}
    setting.write_text(json.dumps(out))
    return out


def run(side: str, args, setting: dict, work: Path, env: dict, index: int) -> dict:
    out = work / f"{side}{index}"
    cmd = [sys.executable, "-m", "rlhf_core.cli", "train", "ppo", "--actor.model_name_or_path", setting["sft"],
           "--data.prompt_dataset", f"json@{setting['prompts']}", "--eval.dataset", f"json@{setting['prompts']}",
           "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "4", "--eval.task", "sort",
           "--reward.task", "sort", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
           "--rollout.batch_size", "32", "--train.batch_size", "64",
           *(["--train.micro_batch_size", "32", "--rollout.micro_batch_size", "64"] if args.setting_micro_batches else []),
           "--actor.adam.lr", "1e-4", "--algo.kl.init_coef", "0",
           "--train.max_steps", str(args.steps), "--ds.param_dtype", args.param_dtype, "--train.seed", "0",
           "--logger.logging_steps", "1", "--use_mlflow", "false", "--ckpt.output_dir", str(out)]
    if side == "async":
        cmd += ["--train.async_enable", "--train.async_queue_size", str(args.queue)]
        cmd += ["--train.partial_rollout_enable"] if args.partial else []
    start = time.perf_counter()
    arrivals: dict[int, float] = {}
    step_s: list[float] = []
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with open(work / f"{side}{index}.log", "w") as log:  # the run's log, kept beside its output
        for line in proc.stderr:
            found = STEP_LINE.match(line)
            if found:
                arrivals[int(found.group(1))] = time.perf_counter()
                step_s.append(SAMPLES_PER_STEP / float(found.group(3)))  # the step's own time, evaluations apart
            tail = (tail + [line])[-40:]
            log.write(line)
    if proc.wait() != 0:
        sys.exit(f"{side} run failed:\n{''.join(tail)}")
    wall = time.perf_counter() - start
    metrics = json.loads((out / "stage.json").read_text())["metrics"]
    first, last = min(arrivals), max(arrivals)
    return {"side": side, "train_steps_per_s": len(step_s) / sum(step_s),
            "steps_per_s": (last - first) / (arrivals[last] - arrivals[first]) if last > first else 0.0,
            "wall_s": wall, "sampled_before": metrics["eval_initial/sampled_accuracy"],
            "sampled_after": metrics["eval/sampled_accuracy"], "greedy_after": metrics["eval/greedy_accuracy"],
            "staleness": metrics.get("rollout/staleness", 0.0)}


def work_and_env(work_dir: str | None, prefix: str) -> tuple[Path, dict]:
    """The benchmark's folder (`work_dir`, else a new temporary one) and the environment of the
    `rlhf` processes it starts: this checkout's code, their own RLHF_HOME in the folder, no
    progress bars, no Ray cluster inherited."""
    work = Path(work_dir or tempfile.mkdtemp(prefix=prefix)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RLHF_HOME=str(work / ".rlhf"), RLHF_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))
    env.pop("RAY_ADDRESS", None)
    return work, env


def start_ray(env: dict) -> None:
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    subprocess.run(["ray", "start", "--head", "--num-cpus", "2", "--num-gpus", "0", "--temp-dir", str(temp),
                    "--include-dashboard", "false", "--disable-usage-stats"], env=env, check=True,
                   capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--queue", type=int, default=1, help="--train.async_queue_size of the async runs")
    p.add_argument("--partial", action="store_true", help="the async runs with --train.partial_rollout_enable")
    p.add_argument("--setting_micro_batches", action="store_true",
                   help="the RL tests' micro-batches (train 32, rollout 64) instead of the default token budget")
    p.add_argument("--param_dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--work_dir", default=None, help="kept between runs (the SFT model is reused)")
    args = p.parse_args(argv)
    work, env = work_and_env(args.work_dir, "rlhf-bench-async-")
    t = time.perf_counter()
    setting = prepare(work, env)
    print(f"setting ready in {time.perf_counter() - t:.0f} s: {setting['sft']}", flush=True)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    start_ray(env)
    env.update(RAY_ADDRESS="auto", RLHF_RANKS_ON_RAY="1")
    results: list[dict] = []
    try:
        for i in range(args.repeats):
            for side in ("sync", "async"):
                r = run(side, args, setting, work, env, i)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True)
    from rlhf_core.infra.precision import describe_hardware, resolve_here

    med = {side: {k: statistics.median(r[k] for r in results if r["side"] == side)
                  for k in ("train_steps_per_s", "steps_per_s", "wall_s", "sampled_before", "sampled_after",
                            "greedy_after")}
           for side in ("sync", "async")}
    batches = "the setting's micro-batches" if args.setting_micro_batches else "default micro-batches"
    print(f"\nMachine: {describe_hardware()}; {resolve_here(args.param_dtype).value}; actor and engine on one CPU each (Ray); {args.steps} steps, "
          f"queue {args.queue}{', partial rollouts' if args.partial else ''}"
          f", {batches}, {args.repeats} run(s) a side")
    print("| side | training steps/s | RL loop steps/s (with its evaluations) | whole process s | held-out sampled "
          "accuracy before -> after | greedy after |")
    print("|---|---|---|---|---|---|")
    for side, m in med.items():
        print(f"| {side} | {m['train_steps_per_s']:.3f} | {m['steps_per_s']:.3f} | {m['wall_s']:.0f} | "
              f"{m['sampled_before']:.1%} -> {m['sampled_after']:.1%} | {m['greedy_after']:.1%} |")
    a, b = med["async"], med["sync"]
    print(f"async / sync: {a['train_steps_per_s'] / b['train_steps_per_s']:.2f}x training steps per second, "
          f"{a['steps_per_s'] / b['steps_per_s']:.2f}x with the evaluations, {b['wall_s'] / a['wall_s']:.2f}x whole "
          f"process; held-out sampled accuracy after: {100 * (a['sampled_after'] - b['sampled_after']):+.1f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
