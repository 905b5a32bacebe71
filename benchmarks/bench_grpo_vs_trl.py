"""GRPO speed, this project's `rlhf train ppo` against TRL's `GRPOTrainer`, on the same model,
prompts, group size, lengths and precision; samples per second and the time of each phase.

Both sides start from one SFT policy (the `rlhf prep` Llama, tiny by default, small, or with
`--model_size 100m`, ~113M parameters besides the embeddings; fine-tuned for a
few hundred steps on the RL setting's noisy `sort` demonstrations, so it ends its answers and, at
tiny, gets about two in three right under sampling), sample `--n` responses for each of `--prompts` prompts per
rollout at temperature 1 with at most `--max_new_tokens` tokens, score them with the task's
exact verifier, and train on the rollout in optimizer steps of `--train_batch_size` samples
(micro batch `--micro_batch_size`): group-normalised advantages, PPO clip 0.2, token-mean loss
(TRL's `dapo`), a k3 KL term to a frozen reference with coefficient `--kl_coef` (TRL's `beta`),
AdamW betas (0.9, 0.95), gradient clipping 1.0, one pass over each rollout. A rollout of 128
samples in optimizer steps of 64 is two steps, so both sides compute the rollout policy's
log-probs before training (TRL does so when `steps_per_generation > gradient_accumulation_steps`).

Choices, and why:
- Every run is a fresh subprocess, runs alternate (ours, trl, ours, ...), medians are reported
  and each round's ratio too: the machine is shared and noisy.
- Only rollout steps after `--warmup` untimed ones count: a step is the wall time from the end of
  one rollout step's training to the end of the next (generation, rewards, the rollout policy's
  and the reference's log-probs, advantages, the optimizer steps, weight sync, bookkeeping).
- Phases: ours reports its own (`time/generate_s`, ...); TRL's are timed by wrapping its
  `_generate` (generation), `_calculate_rewards` (rewards) and `_generate_and_score_completions`
  (the rest of it: log-probs and advantages = experience); training is what remains of the step.
- Each side generates as its users get it: ours with its sampler (one prefill per prompt shared
  by the prompt's samples, a static KV cache, the lean Llama forward, fp32 weights under the
  trainer's autocast), TRL with `model.generate` under its precision. Training precision is the same on both sides (`--param_dtype`, default `auto`).
- Training passes' MFU (`benchmarks/scale.py`): each side counts the real prompt+response tokens
  of every sample it trains on (ours from its samples, TRL from its prompt and completion masks);
  tokens x FLOPs per token (forward and backward, at the run's token-weighted mean length) over the
  `train` phase's time is the training passes' model FLOP/s, against the matmul peak the driver
  measures in the run's precision. Generation's share of a step is printed beside it.
- `--mode process`: whole runs as users start them, timed from process start to exit: ours is
  `rlhf train ppo` with the same settings (flags), TRL a script that loads the policy, trains
  `--process_steps` rollouts with GRPOTrainer and saves; no held-out evaluation on either side.
- Nothing is asserted about time: the script prints throughput and ratios (benchmarks/README.md).

Usage: python benchmarks/bench_grpo_vs_trl.py [--steps 8] [--repeats 3] [--n 4] [--prompts 32]
       [--model_size tiny|small|100m] [--mode steps|process|both]
Needs TRL: pip install -e '.[bench]'; exits 2 without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import clock, take_snapshot, versions_line  # noqa: E402
from scale import (  # noqa: E402
    counts_line,
    flops_per_token,
    formula,
    gflops,
    measured_peaks,
    mfu,
    model_counts,
    peak_line,
)

RESULT_PREFIX = "BENCH_RESULT "
TASK = "sort"
SEED = 42
PHASES = ("generate", "reward", "experience", "train", "sync")
# By model size: the starting policy's SFT steps and learning rate (a 100m SFT step takes seconds on a 2-core
# CPU), and the rollout steps of a whole run (`--mode process`; 40 is the README's GRPO run).
SFT_STEPS = {"nano": 300, "tiny": 300, "small": 300, "100m": 100, "500m": 100}
SFT_LR = {"nano": 1e-3, "tiny": 1e-3, "small": 1e-3, "100m": 3e-4, "500m": 3e-4}
PROCESS_STEPS = {"nano": 40, "tiny": 40, "small": 40, "100m": 10, "500m": 10}


# ---------------------------------------------------------------------------------------------
# Child processes: one side, one JSON line on stdout.

def summarize(args, ends: list[tuple[float, float]], phases: list[dict], lengths: list[float], setup: dict,
              sequences: list[tuple[int, int]]) -> dict:
    """Timed rollout steps: `ends` has one clock reading before the first and after each;
    `sequences` per timed step (sum of T, sum of T^2) over its samples' prompt+response tokens."""
    steps = len(ends) - 1
    elapsed, cpu = ends[-1][0] - ends[0][0], ends[-1][1] - ends[0][1]
    samples = steps * args.prompts * args.n
    tokens = sum(t for t, _ in sequences)
    return {"side": args.side, "steps": steps, "seconds": elapsed, "samples_per_s": samples / elapsed,
            "train_tokens_per_step": tokens / steps if sequences else None,
            "mean_len": sum(q for _, q in sequences) / tokens if tokens else None,
            "s_per_step": elapsed / steps, "cpu_s_per_step": cpu / steps,
            "step_s": [round(b[0] - a[0], 3) for a, b in itertools.pairwise(ends)],
            "phases_s": {k: statistics.fmean(p.get(k, 0.0) for p in phases) for k in PHASES},
            "response_length": statistics.fmean(lengths) if lengths else None,
            "load_1m": os.getloadavg()[0], "setup": setup}


def run_ours(args) -> dict:
    import torch

    from rlhf_core.distributed.cluster import prepare_environment
    from rlhf_core.rl import controller as rl_controller
    from rlhf_core.rl_config import build_ppo_config
    from rlhf_core.trainers.ppo import run_ppo

    prepare_environment()
    torch.set_num_threads(args.threads)
    cfg = build_ppo_config({
        "actor": {"model_name_or_path": args.policy, "adam": {"lr": args.lr}},
        "data": {"prompt_dataset": f"json@{args.prompts_dir}", "apply_chat_template": True},
        "reward": {"task": TASK},
        "algo": {"advantage": {"estimator": "group_norm"}, "loss_agg_mode": "token-mean",
                 # --kl_coef 0: no KL term, so no reference model (TRL's beta=0 loads none either)
                 "kl": {"use_loss": args.kl_coef > 0, "estimator": "k3", "init_coef": args.kl_coef}},
        "rollout": {"n_samples_per_prompt": args.n, "batch_size": args.prompts, "max_new_tokens": args.max_new_tokens,
                    "micro_batch_size": args.micro_batch_size or None, "temperature": 1.0},
        "train": {"batch_size": args.train_batch_size, "micro_batch_size": args.micro_batch_size or None,
                  "max_steps": args.warmup + args.steps, "seed": SEED},
        "ds": {"param_dtype": args.precision}, "ckpt": {"output_dir": str(Path(args.out_dir) / "policy")},
        "use_mlflow": False,
    }, {})
    ends, phases, lengths, sequences = [], [], [], []
    train_step, rollout = rl_controller.RLController.train_step, rl_controller.RLController.rollout

    def timed_step(self):  # instrumentation only: the controller's own step, clocked at its end
        metrics = train_step(self)
        if self.step + 1 == args.warmup:
            ends.append(clock())
        elif self.step + 1 > args.warmup:
            ends.append(clock())
            phases.append({k: metrics[f"time/{k}_s"] for k in PHASES})
            lengths.append(metrics["rollout/response_length"])
        return metrics

    def counted_rollout(self, times):  # instrumentation only: the real tokens of the samples it trains on
        samples, stats = rollout(self, times)
        if self.step + 1 > args.warmup:
            seq = [len(s.prompt_ids) + s.response_len for s in samples]
            sequences.append((sum(seq), sum(t * t for t in seq)))
        return samples, stats

    rl_controller.RLController.train_step = timed_step
    rl_controller.RLController.rollout = counted_rollout
    run_ppo(cfg, on_ray=False)
    gpu = torch.cuda.is_available()
    setup = {"precision": args.precision, "device": torch.cuda.get_device_name() if gpu else "cpu",
             "generation": "rlhf_core sampler (transformers engine), "
             + ("bf16 weights" if gpu else "fp32 weights" + (" under bf16 autocast (the trainer's math)"
                                                             if args.precision == "bf16" else ""))}
    return summarize(args, ends, phases, lengths, setup, sequences)


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    try:
        import trl
    except ImportError:
        print("TRL is not installed: pip install -e '.[bench]'  (or pip install 'trl>=1.0')", file=sys.stderr)
        sys.exit(2)
    from rlhf_core.data.synthetic import get_task
    from rlhf_core.models.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (Path(args.prompts_dir) / "train.jsonl").read_text().splitlines() if line]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
                                 for r in rows])
    verifier = get_task(TASK)
    phases: list[dict] = []  # one per rollout, in order
    lengths: list[float] = []
    sequences: list[tuple[int, int]] = []  # per rollout: sum of T, sum of T^2 (prompt+response real tokens)

    def exact_match(prompts, completions, answer, completion_ids=None, **_):
        if completion_ids is not None:
            lengths.append(statistics.fmean(len(c) for c in completion_ids))
        return [verifier.score(c[-1]["content"] if isinstance(c, list) else c, a)
                for c, a in zip(completions, answer, strict=True)]

    # --micro_batch_size 0: TRL at one forward/backward per optimizer step (its per-device batch is the step)
    micro = args.micro_batch_size or args.train_batch_size
    accumulate = args.train_batch_size // micro
    rollout = args.prompts * args.n
    config = trl.GRPOConfig(
        output_dir=str(Path(args.out_dir) / "trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulate, steps_per_generation=rollout // micro, num_generations=args.n,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=args.kl_coef,
        loss_type="dapo", epsilon=0.2, num_iterations=1, scale_rewards="group",
        max_steps=(args.process_steps if args.whole else args.warmup + args.steps) * (rollout // args.train_batch_size),
        learning_rate=args.lr,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused",
        bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, report_to="none",
        logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True, seed=SEED,
        log_completions=False, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)
    tokenizer = load_tokenizer(args.policy)
    optimizer_steps_per_rollout = rollout // args.train_batch_size
    ends: list = []

    class RolloutClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % optimizer_steps_per_rollout == 0 \
                    and state.global_step // optimizer_steps_per_rollout >= args.warmup:
                ends.append(clock())  # the end of a rollout's last optimizer step

    trainer = trl.GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[RolloutClock()])

    def timed(name, fn, new_rollout=False):
        def wrapper(*a, **k):
            if new_rollout:
                phases.append({})
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[-1][name] = phases[-1].get(name, 0.0) + time.perf_counter() - started
        return wrapper

    # Instrumentation only: TRL's own methods, clocked. A rollout starts with _generate_and_score_completions.
    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    scored = timed("scored", trainer._generate_and_score_completions, True)

    def counted(*a, **k):  # the real tokens of the sampled sequences (their masks), per rollout
        out = scored(*a, **k)
        seq = out["prompt_mask"].sum(1) + out["completion_mask"].sum(1)
        sequences.append((int(seq.sum()), int((seq * seq).sum())))
        return out

    trainer._generate_and_score_completions = counted
    torch.set_num_threads(args.threads)
    trainer.train()
    if args.whole:  # what a TRL user's script ends with: the policy and tokenizer on disk
        trainer.save_model(str(Path(args.out_dir) / "model"))
        return {"side": "trl", "steps": trainer.state.global_step}
    timed_phases = phases[args.warmup : args.warmup + args.steps]
    for p, (a, b) in zip(timed_phases, itertools.pairwise(ends), strict=True):
        scored = p.pop("scored")
        p["experience"] = scored - p.get("generate", 0.0) - p.get("reward", 0.0)
        p["train"] = (b[0] - a[0]) - scored
    setup = {"precision": args.precision, "trl": trl.__version__, "generation": "transformers generate",
             "accelerate": trainer.accelerator.distributed_type.value}
    return summarize(args, ends, timed_phases, lengths[args.warmup : args.warmup + args.steps], setup,
                     sequences[args.warmup : args.warmup + args.steps])


def child_main(args) -> None:
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Driver: prepare the policy once, alternate child runs, print the table.

def child_env(args, work: Path, snapshot: Path) -> dict:
    env = dict(os.environ, RLHF_NO_PROGRESS="1", OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", RLHF_HOME=str(work / ".rlhf"),
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rlhf-bench"
                                                                                / "torch_extensions")),
               PYTHONPATH=os.pathsep.join(p for p in (str(snapshot), os.environ.get("PYTHONPATH")) if p))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(key, None)
    return env


def prepare_policy(args, work: Path, snapshot: Path) -> Path:
    """`rlhf prep` (sort, 30% wrong demonstrations, `--model_size`) and a short SFT: the policy both
    sides start from."""
    root = work / f"rl-{args.model_size}"
    stamp = root / "bench_policy.json"
    recipe = {"task": TASK, "model_size": args.model_size, "model_family": args.model_family, "sft_steps": args.sft_steps, "sft_lr": args.sft_lr,
              "precision": args.precision}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe and (root / "sft" / "config.json").exists():
        print(f"reusing the SFT policy in {root} (--work_dir, same recipe)", file=sys.stderr, flush=True)
        return root
    env = child_env(args, work, snapshot)
    steps = [[sys.executable, "-m", "rlhf_core.cli", "prep", "--out", str(root), "--task", TASK, "--seed", "0",
              "--model_size", args.model_size, "--demo_error_rate", "0.3"]
             + (["--model_family", args.model_family] if args.model_family else []),
             [sys.executable, "-m", "rlhf_core.cli", "train", "sft", "--pretrain", str(root / "base"),
              "--dataset", f"json@{root / 'data' / 'sft'}", "--apply_chat_template", "--max_len", "64",
              "--packing_samples", "--train_batch_size", "32", "--micro_train_batch_size", "32",
              "--learning_rate", str(args.sft_lr), "--max_steps", str(args.sft_steps), "--max_epochs", "50",
              "--param_dtype", args.precision, "--save_path", str(root / "sft"), "--use_mlflow", "false"]]
    for cmd in steps:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=snapshot)
        if proc.returncode != 0:
            raise SystemExit(f"preparing the policy failed: {' '.join(cmd[1:4])}\n{proc.stderr[-3000:]}")
    stamp.write_text(json.dumps(recipe))
    return root


def run_child(args, side: str, root: Path, out_dir: Path, snapshot: Path, work: Path, whole: bool = False) -> dict:
    """One run of `side` in a fresh process. `whole`: a whole run as users start it (ours: `rlhf train
    ppo` with the same settings; TRL: a script that loads the policy, trains `--process_steps` rollouts
    with GRPOTrainer and saves), timed from process start to exit."""
    if whole and side == "ours":
        kl = args.kl_coef > 0
        cmd = [sys.executable, "-m", "rlhf_core.cli", "train", "ppo", "--actor.model_name_or_path", str(root / "sft"),
               "--actor.adam.lr", str(args.lr), "--data.prompt_dataset", f"json@{root / 'data' / 'prompts'}",
               "--data.apply_chat_template", "true", "--reward.task", TASK,
               "--algo.advantage.estimator", "group_norm", "--algo.loss_agg_mode", "token-mean",
               "--algo.kl.use_loss", str(kl).lower(), "--algo.kl.estimator", "k3",
               "--algo.kl.init_coef", str(args.kl_coef), "--rollout.n_samples_per_prompt", str(args.n),
               "--rollout.batch_size", str(args.prompts), "--rollout.max_new_tokens", str(args.max_new_tokens),
               "--rollout.temperature", "1.0", "--train.batch_size", str(args.train_batch_size),
               "--train.max_steps", str(args.process_steps), "--train.seed", str(SEED),
               "--ds.param_dtype", args.precision, "--ckpt.output_dir", str(out_dir / "policy")]
        if args.micro_batch_size:  # 0: our defaults (micro-batches by tokens)
            cmd += ["--rollout.micro_batch_size", str(args.micro_batch_size), "--train.micro_batch_size",
                    str(args.micro_batch_size)]
    else:
        cmd = [sys.executable, str(snapshot / Path(__file__).name), "--side", side, "--policy", str(root / "sft"),
               "--prompts_dir", str(root / "data" / "prompts"), "--out_dir", str(out_dir),
               "--precision", args.precision] + (["--whole"] if whole else [])
        for name in ("steps", "warmup", "n", "prompts", "max_new_tokens", "train_batch_size", "micro_batch_size",
                     "lr", "kl_coef", "threads", "process_steps"):
            cmd += [f"--{name}", str(getattr(args, name))]
    import resource

    def children_cpu() -> float:  # CPU time of every finished (waited-for) child process, all threads
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    started, cpu_before = time.perf_counter(), children_cpu()
    proc = subprocess.run(cmd, env=child_env(args, work, snapshot), capture_output=True, text=True,
                          timeout=args.timeout, cwd=snapshot)
    seconds, cpu_seconds = time.perf_counter() - started, children_cpu() - cpu_before
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not (lines or whole):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"  {side}{' whole' if whole else ''}: FAILED (exit {proc.returncode})\n{tail}", file=sys.stderr,
              flush=True)
        return {"failed": True, "exit": proc.returncode}
    if whole:
        return {"side": side, "seconds": seconds, "cpu_seconds": cpu_seconds, "rollout_steps": args.process_steps,
                "samples_per_s": args.process_steps * args.prompts * args.n / seconds, "load_1m": os.getloadavg()[0]}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["process_s"] = seconds
    return result


def train_figures(args, r: dict) -> tuple[float, float, float] | None:
    """(training tokens/s, model FLOP/s, MFU) of one run's training passes: forward and backward over
    the sampled sequences' real tokens (prompt and response of every sample), in its `train` phase."""
    info = getattr(args, "scale", None)
    if not info or not r.get("train_tokens_per_step") or not r["phases_s"].get("train"):
        return None
    rate = r["train_tokens_per_step"] / r["phases_s"]["train"]
    flops = rate * flops_per_token(info["counts"], r["mean_len"], 3.0)
    return rate, flops, mfu(flops, info["peaks"], args.precision)


def model_name(args) -> str:
    return f"{getattr(args, 'model_family', None) or 'llama'} {getattr(args, 'model_size', 'tiny')}"


def report(args, results: dict[str, list[dict]]) -> list[str]:
    ok = {side: [r for r in results[side] if not r.get("failed")] for side in results}

    def med(side, key):
        return statistics.median(r[key] for r in ok[side]) if ok[side] else None

    def med_of(side, value):
        values = [v for v in (value(r) for r in ok[side]) if v is not None]
        return statistics.median(values) if values else None

    scaled = getattr(args, "scale", None) is not None
    rounds = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(results["ours"], results["trl"], strict=False)
              if not a.get("failed") and not b.get("failed")]
    lines = [f"### GRPO: {args.steps} timed rollout steps after {args.warmup} warm-up; {args.prompts} prompts x "
             f"{args.n} samples, at most {args.max_new_tokens} new tokens, temperature 1; optimizer steps of "
             f"{args.train_batch_size} (micro {args.micro_batch_size}); {args.precision}; model "
             f"{getattr(args, 'model_size', 'tiny')}; medians of {args.repeats} alternating runs", ""]
    if scaled:
        lines += ["Training passes: forward and backward over every sample's real prompt+response tokens (each "
                  "sample's whole sequence, though ours computes a group's prompt once), timed by the `train` "
                  f"phase; FLOPs per token {formula(3.0)} at the run's token-weighted mean length T. "
                  "Generation, rewards and the experience passes (old and reference log-probs) are outside it; "
                  f"`gen share` is generation's part of a step. {counts_line(args.scale['counts'])}", ""]
    lines += ["| side | runs ok | samples/s | s/step | CPU s/step | " + " | ".join(f"{p} s" for p in PHASES)
              + " | response tokens | " + ("gen share | train tokens/step | train tokens/s | train GFLOP/s | "
                                          "train MFU | " if scaled else "")
              + "**ours ÷ this** | per round (min–max) | load (1 min) |",
              "|---|---|---|---|---|" + "---|" * len(PHASES) + "---|" + ("---|" * 5 if scaled else "")
              + "---|---|---|"]
    for side in ("ours", "trl"):
        if not ok[side]:
            lines.append(f"| {side} | 0/{len(results[side])} |" + " |" * (9 + len(PHASES) + (5 if scaled else 0)))
            continue
        ratio = spread = "—"
        if side == "trl" and ok["ours"]:
            ratio = f"**{med('ours', 'samples_per_s') / med('trl', 'samples_per_s'):.2f}x**"
            spread = f"{min(rounds):.2f}–{max(rounds):.2f}" if rounds else "—"
        phase = " | ".join(f"{statistics.median(r['phases_s'][p] for r in ok[side]):.3f}" for p in PHASES)
        length = med(side, "response_length")
        compute = ""
        if scaled:
            share = med_of(side, lambda r: r["phases_s"]["generate"] / r["s_per_step"])
            figures = [train_figures(args, r) for r in ok[side]]
            figures = [f for f in figures if f]
            if figures:
                rate, flops, util = (statistics.median(f[i] for f in figures) for i in range(3))
                compute = (f"{100 * share:.0f}% | {med_of(side, lambda r: r.get('train_tokens_per_step')):.0f} | "
                           f"{rate:.0f} | {gflops(flops)} | {100 * util:.1f}% | ")
            else:
                compute = f"{100 * share:.0f}% | — | — | — | — | "
        lines.append(f"| {side} | {len(ok[side])}/{len(results[side])} | {med(side, 'samples_per_s'):.1f} | "
                     f"{med(side, 's_per_step'):.3f} | {med(side, 'cpu_s_per_step'):.3f} | {phase} | "
                     f"{length:.1f} | {compute}{ratio} | {spread} | {med(side, 'load_1m'):.1f} |")
    setups = [f"- `{side}`: " + ", ".join(f"{k} {v}" for k, v in ok[side][0]["setup"].items())
              for side in ("ours", "trl") if ok[side]]
    return lines + ["", "Setups:"] + setups + [""]


def report_whole(args, results: dict[str, list[dict]]) -> list[str]:
    ok = {side: [r for r in results[side] if not r.get("failed")] for side in ("ours", "trl")}

    def med(side, key):
        return statistics.median(r[key] for r in ok[side]) if ok[side] else None

    lines = [f"### GRPO whole process: {args.process_steps} rollout steps of {args.prompts} prompts x {args.n} "
             f"samples (at most {args.max_new_tokens} new tokens), optimizer steps of {args.train_batch_size}; "
             f"{args.precision}; model {model_name(args)}; ours `rlhf train ppo`, TRL a "
             f"GRPOTrainer script; from process start to exit (loading, every rollout, saving); medians of "
             f"{args.repeats} alternating runs", "",
             "| side | runs ok | seconds (median) | per run | samples/s | **TRL ÷ ours** (time) | CPU s (median) | "
             "TRL ÷ ours (CPU time) | load (1 min) |", "|---|---|---|---|---|---|---|---|---|"]
    for side in ("ours", "trl"):
        if not ok[side]:
            lines.append(f"| {side} | 0/{len(results[side])} |" + " |" * 7)
            continue
        both = ok["ours"] and ok["trl"]
        ratio = f"**{med('trl', 'seconds') / med('ours', 'seconds'):.2f}x**" if side == "trl" and both else "—"
        cpu_ratio = f"{med('trl', 'cpu_seconds') / med('ours', 'cpu_seconds'):.2f}x" if side == "trl" and both else "—"
        per_run = ", ".join(f"{r['seconds']:.1f}" for r in ok[side])
        lines.append(f"| {side} | {len(ok[side])}/{len(results[side])} | {med(side, 'seconds'):.1f} | {per_run} | "
                     f"{med(side, 'samples_per_s'):.1f} | {ratio} | {med(side, 'cpu_seconds'):.1f} | {cpu_ratio} | "
                     f"{med(side, 'load_1m'):.1f} |")
    return lines + [""]


def driver_main(args) -> int:
    if importlib.util.find_spec("trl") is None:
        print("TRL is not installed, so there is nothing to compare against.\n"
              "Install the benchmark extra: pip install -e '.[bench]'  (or: pip install 'trl>=1.0')", file=sys.stderr)
        return 2
    if (args.prompts * args.n) % args.train_batch_size or args.train_batch_size % (args.micro_batch_size or 1):
        raise SystemExit("--prompts x --n must be a multiple of --train_batch_size, and that of --micro_batch_size")
    from rlhf_core.infra.precision import resolve_here

    args.precision = resolve_here("auto").value if args.param_dtype == "auto" else args.param_dtype
    modes = ["process", "steps"] if args.mode == "both" else [args.mode]
    keep = args.work_dir is not None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlhf-bench-grpo-")).resolve()
    import shutil

    shutil.rmtree(work / "snapshot", ignore_errors=True)  # a kept --work_dir: this run's code, not the last one's
    snapshot, code = take_snapshot(work)
    print(f"preparing the {args.model_size} SFT policy in {work} ...", file=sys.stderr, flush=True)
    root = prepare_policy(args, work, snapshot)
    args.scale = {"counts": model_counts(str(root / "sft")), "peaks": measured_peaks(args.threads)}
    raw: dict[str, dict[str, list[dict]]] = {}

    def save():
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": vars(args), "header": versions_line(args, code),
                                                       "results": raw}, indent=2))

    for mode in modes:
        results: dict[str, list[dict]] = {"ours": [], "trl": []}
        raw["grpo-whole" if mode == "process" else "grpo"] = results
        for round_ in range(args.repeats):
            for side in ("ours", "trl"):
                result = run_child(args, side, root, work / "runs" / f"{mode}-{side}-{round_}", snapshot, work,
                                   whole=mode == "process")
                results[side].append(result)
                save()
                if result.get("failed"):
                    continue
                if mode == "process":
                    print(f"  whole round {round_ + 1}/{args.repeats} {side:4s} {result['seconds']:7.1f} s",
                          file=sys.stderr, flush=True)
                else:
                    print(f"  round {round_ + 1}/{args.repeats} {side:4s} {result['samples_per_s']:7.1f} samples/s "
                          f"({result['s_per_step']:.3f} s/step, {result['response_length']:.1f} response tokens)",
                          file=sys.stderr, flush=True)
    args.scale["peaks"] = measured_peaks(args.threads, args.scale["peaks"])
    save()
    print(tables(args, versions_line(args, code), raw))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r.get("failed") for rs in raw.values() for rs_ in rs.values() for r in rs_) else 0


def tables(args, header: str, raw: dict[str, dict[str, list[dict]]]) -> str:
    lines = [header, ""]
    if getattr(args, "scale", None):
        lines += [peak_line(args.scale["peaks"], args.precision), ""]
    for name, results in raw.items():
        lines += report_whole(args, results) if name == "grpo-whole" else report(args, results)
    return "\n".join(lines)


def print_saved(path: str) -> int:
    """Print the tables of a `--json_out` file (also one a cut-short benchmark left behind)."""
    saved = json.loads(Path(path).read_text())
    results = saved["results"]
    if "ours" in results:  # a file written before whole runs and scale figures: one steps table
        results = {"grpo": results}
    print(tables(argparse.Namespace(**saved["args"]), saved["header"], results))
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_size", default="tiny", choices=tuple(SFT_STEPS),  # the sizes it has settings for
                   help="the policy's size, an rlhf prep size: tiny, small, 100m, or 500m (Qwen2.5-0.5B's shape, "
                        "for a GPU)")
    p.add_argument("--model_family", default=None, help="rlhf prep --model_family of the policy (default: its "
                   "Llama); qwen2 with --model_size 500m is a random-init Qwen2.5-0.5B")
    p.add_argument("--mode", choices=["steps", "process", "both"], default="steps",
                   help="steps: timed rollout steps in steady state, with phases and MFU; process: whole runs as "
                        "users start them (ours: `rlhf train ppo`), timed from process start to exit; both: "
                        "process, then steps")
    p.add_argument("--process_steps", type=int, default=None,
                   help="rollout steps of a whole run (default by model size: tiny and small "
                        f"{PROCESS_STEPS['tiny']}, 100m {PROCESS_STEPS['100m']})")
    p.add_argument("--steps", type=int, default=8, help="timed rollout steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed rollout steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternated")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the group)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout step")
    p.add_argument("--max_new_tokens", type=int, default=16, help="response budget (sort answers: at most 15 "
                                                                   "letters and EOS)")
    p.add_argument("--train_batch_size", type=int, default=64, help="samples per optimizer step")
    p.add_argument("--micro_batch_size", type=int, default=32, help="samples per forward/backward; 0: each side's "
                   "default (ours: micro-batches by tokens; TRL: its per-device batch set to --train_batch_size)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--kl_coef", type=float, default=0.01, help="k3 KL loss coefficient (TRL's beta); 0: no reference")
    p.add_argument("--sft_steps", type=int, default=None,
                   help="SFT steps of the starting policy (default by model size: "
                        + ", ".join(f"{k} {v}" for k, v in SFT_STEPS.items()) + ")")
    p.add_argument("--sft_lr", type=float, default=None,
                   help="SFT learning rate of the starting policy (default by model size: "
                        + ", ".join(f"{k} {v:g}" for k, v in SFT_LR.items()) + ")")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    p.add_argument("--param_dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="training precision of both sides: auto = bf16 where this CPU computes it natively, else fp32")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before a run is given up")
    p.add_argument("--work_dir", default=None, help="keep the policy and run folders here (default: a temp dir); "
                                                    "a policy already there from the same recipe is reused")
    p.add_argument("--json_out", default=None, help="write every run's raw result here (updated after each run)")
    p.add_argument("--report", default=None, metavar="JSON", help="only print the tables of a --json_out file")
    # Child-only flags (the driver passes them).
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_steps is None:
        args.process_steps = PROCESS_STEPS[args.model_size]
    if args.sft_steps is None:
        args.sft_steps = SFT_STEPS[args.model_size]
    if args.sft_lr is None:
        args.sft_lr = SFT_LR[args.model_size]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side:
        child_main(args)
        return 0
    return print_saved(args.report) if args.report else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
