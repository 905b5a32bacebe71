"""SFT and DPO step speed, this project against TRL, on the same model, data and batch.

Both sides train the `rlhf prep` Llama (`--model_size` small by default; tiny; or 100m, ~113M
parameters besides the embeddings) on a built-in task (`--task`, default sort, the pipeline's) with
the same tokenizer and chat template, the same rows in the same order (TRL gets the dataset
reordered by our `BatchPlan` and a sequential sampler), the same global batch, micro batch,
max_len, bf16 autocast on fp32 weights, torch AdamW and number of optimizer steps. Each side
uses what its users get by default otherwise: ours packs samples, runs DeepSpeed as the CLI
does (ZeRO-2 asked for; one CPU rank runs it as stage 0) and loads the model with our attention
(`rlhf_sdpa`), TRL pads (and, as a second SFT run, trains padding-free) and gets transformers'
default SDPA (a diagnostic run hands it our attention).

Choices, and why:
- Every run is a fresh subprocess (`--side ours|trl --stage sft|dpo`): DeepSpeed and
  torch.distributed keep per-process state, and a fresh process has no warm caches to share.
- Runs alternate (ours, trl, ours, trl, ...) and medians are reported: the machine is shared and
  noisy, so drift hits every setup alike instead of whichever happened to run last. Next to the
  usual throughput (tokens / total time) the table gives one from each run's 20th-percentile
  step, which estimates the speed when other work leaves the cores alone.
- Every run imports a copy of rlhf_core taken when the driver starts, so a long benchmark in a
  tree other people are editing compares one version of our code, not several.
- Only optimizer steps are timed, after warm-up steps: loading, tokenization and DeepSpeed setup
  are one-off costs. A step is the wall time from the end of one optimizer step to the end of the
  next, so batch collation, the forward/backward passes, clipping, the optimizer and each side's
  per-step bookkeeping are all inside it.
- Tokens are the real (non-pad) tokens of prompt+response in the step's batches, counted the
  same way on both sides; DPO counts chosen and rejected sequences. pairs/s is steps x global
  batch / time.
- Scale figures (`benchmarks/scale.py`): each table also gives every run's achieved model FLOP/s
  (FLOPs per token x tokens/s; FLOPs per token from the model's counts and the rows' token-weighted
  mean length, counted by the driver on the rows the run trains) and its MFU against the bf16 or
  fp32 peak of a square matmul measured by the driver before and after the runs on `--threads`
  threads. Whole runs (`--mode process`) divide the rows' tokens by the process's wall time.
- Nothing is asserted about time: the script prints throughput and ratios (benchmarks/README.md).

Usage: python benchmarks/bench_vs_trl.py [--stages sft,dpo] [--steps 20] [--repeats 3]
       [--model_size tiny|small|100m] [--mode steps|process|both]
(see benchmarks/README.md). Needs TRL: pip install -e '.[bench]'; exits 2 without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale import (
    counts_line,
    flops_per_token,
    formula,
    gflops,
    length_stats,
    measured_peaks,
    mfu,
    model_counts,
    peak_line,
    row_lengths,
)

RESULT_PREFIX = "BENCH_RESULT "

# What each named run is. "ours" (packed, the CLI's engine) is the reference every TRL run is compared to;
# the other "ours-*" runs are diagnostics that split our step time into its causes.
VARIANTS: dict[str, dict] = {
    "ours": {"side": "ours", "packing": True, "zero_stage": 2},
    "ours-padded": {"side": "ours", "packing": False, "zero_stage": 2},
    # What a real ZeRO-2 costs on one rank (the CLI runs one CPU rank's ZeRO-1/2 as stage 0).
    "ours-zero2": {"side": "ours", "packing": True, "zero_stage": 2, "force_zero": True},
    "trl": {"side": "trl", "padding_free": False},
    "trl-padding-free": {"side": "trl", "padding_free": True},  # SFT only: TRL 1.x disables it for DPO
    # Diagnostic: TRL handed a model loaded by our loader (attention `rlhf_sdpa`, models/attention.py).
    "trl-our-attention": {"side": "trl", "padding_free": False, "our_attention": True},
}
DEFAULT_VARIANTS = {"sft": ["ours", "trl", "trl-padding-free", "trl-our-attention"], "dpo": ["ours", "trl", "trl-our-attention"]}
LEARNING_RATE = {"sft": 1e-4, "dpo": 5e-7}
# `--micro_train_batch_size 0` (whole processes only): each side at its defaults. Ours is given no
# micro-batch flag (micro-batches by a token budget); TRL's per-device batch is TrainingArguments' own
# default, accumulated up to the global batch.
TRL_DEFAULT_MICRO = 8
SEED = 42  # our configs' default seed; it fixes the row order both sides train on
# Rows of a whole run (one epoch) by model size: a 100m step takes seconds on a 2-core CPU (tens of times a
# small one's), so its whole runs train 100 SFT / 50 DPO steps of 32, still most of the process's time.
PROCESS_ROWS = {"nano": {"sft": 16000, "dpo": 8000}, "tiny": {"sft": 16000, "dpo": 8000},
                "small": {"sft": 16000, "dpo": 8000}, "100m": {"sft": 3200, "dpo": 1600},
                "500m": {"sft": 3200, "dpo": 1600}}


# ---------------------------------------------------------------------------------------------
# Child processes: one side, one stage, one JSON line on stdout.

def forward_probe(model) -> dict:
    """Record what the forward really gets: autocast state and the attention-mask layout.

    Autocast is read on the first decoder layer, not on the model: accelerate enters autocast
    inside a wrapped `forward`, after the model's own pre-hooks have run.
    """
    import torch

    seen: dict = {}
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))

    def on_layer(_module, _inputs):
        if "autocast" not in seen:
            seen["autocast"] = (str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
                                if torch.is_autocast_enabled("cpu") else "off")

    def on_model(_module, _args, kwargs):
        if "attention_mask" not in seen:
            mask = kwargs.get("attention_mask")
            seen["attention_mask"] = "none" if mask is None else f"{mask.dim()}D {str(mask.dtype).removeprefix('torch.')}"
            seen["first_batch_shape"] = list(kwargs["input_ids"].shape) if "input_ids" in kwargs else None

    layer.register_forward_pre_hook(on_layer)
    model.register_forward_pre_hook(on_model, with_kwargs=True)
    return seen


def lean_probe(seen: dict) -> None:
    """The same record for our lean supervised forward (`models/lean_train.py`), which reads the
    model's weights without calling its `forward` (so the hooks above never fire there)."""
    import torch

    from rlhf_core.models import forward

    inner = forward.selected_hidden

    def probed(lean, input_ids, position_ids, attention_mask, select):
        if "attention_mask" not in seen:
            seen["forward"] = "lean"
            seen["autocast"] = (str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
                                if torch.is_autocast_enabled("cpu") else "off")
            seen["attention_mask"] = ("none" if attention_mask is None
                                      else f"{attention_mask.dim()}D {str(attention_mask.dtype).removeprefix('torch.')}")
            seen["first_batch_shape"] = list(input_ids.shape)
        return inner(lean, input_ids, position_ids, attention_mask, select)

    forward.selected_hidden = probed


def real_tokens(inputs: dict) -> int:
    """Non-pad tokens of a TRL batch (padded batches have attention_mask; padding-free ones have none)."""
    if "attention_mask" in inputs:
        return int(inputs["attention_mask"].sum())
    return int(inputs["input_ids"].numel())


def run_ours(args) -> dict:
    import torch

    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.distributed.cluster import prepare_environment
    from rlhf_core.trainers import recipe_class
    from rlhf_core.trainers.loop import TrainLoop

    prepare_environment()
    torch.set_num_threads(args.threads)
    if args.force_zero:
        from rlhf_core.distributed import engine

        engine.effective_zero_stage = lambda stage, *_: stage
    data = Path(args.data_root) / "data" / ("sft" if args.stage == "sft" else "preference")
    cfg = build_config(STAGE_CONFIGS[args.stage], None, {
        "pretrain": str(Path(args.data_root) / "base"), "dataset": f"json@{data}", "save_path": args.out_dir,
        "apply_chat_template": True, "max_len": args.max_len, "train_batch_size": args.train_batch_size,
        "micro_train_batch_size": args.micro_train_batch_size, "learning_rate": LEARNING_RATE[args.stage],
        "param_dtype": args.precision, "zero_stage": args.zero_stage, "max_steps": args.warmup + args.steps,
        "use_mlflow": False,
        "packing_samples": args.packing, "seed": SEED,
    })
    recipe = recipe_class(args.stage)(cfg)
    recipe.setup()
    probe = forward_probe(recipe.engine.module)
    lean_probe(probe)
    loop = TrainLoop(cfg, recipe.engine, recipe, recipe.data.train, None, recipe.ctx.tracker, 0, 1)

    def step() -> int:
        _, tokens = loop.train_step()
        loop.step += 1
        return tokens

    for _ in range(args.warmup):
        step()
    ends, tokens = [clock()], 0
    for _ in range(args.steps):
        tokens += step()
        ends.append(clock())
    inner = getattr(recipe.engine.optimizer, "optimizer", recipe.engine.optimizer)
    setup = {"packing": args.packing, "zero_stage": recipe.engine.zero_optimization_stage(), **probe,
             "optimizer": f"{type(recipe.engine.optimizer).__name__}({type(inner).__name__})",
             "attention": recipe.engine.module.config._attn_implementation,
             "gradient_checkpointing": cfg.model.gradient_checkpointing_enable}
    return summarize(args, ends, tokens, setup, torch.get_num_threads())


def train_rows(data_root, stage: str) -> list[dict]:
    kind = "sft" if stage == "sft" else "preference"
    path = Path(data_root) / "data" / kind / "train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row_order(args, stage: str, n_rows: int, whole: bool, first_step: int = 0) -> list[int]:
    """Indices of the rows a run trains: a whole run the first `--process_rows` (TRL shuffles them
    itself, ours trains `--max_samples` of them); a steps run those of our BatchPlan's steps from
    `first_step` on, in its order."""
    from rlhf_core.data.batching import BatchPlan

    if whole:
        return list(range(min(n_rows, args.process_rows[stage])))
    plan = BatchPlan(n_rows, args.train_batch_size, args.micro_train_batch_size, 0, 1, SEED)
    return [i for s in range(first_step, args.warmup + args.steps) for mb in plan.micro_batches(0, s) for i in mb]


def trl_rows(args) -> list[dict]:
    """The stage's train rows as TRL conversational data, in the order our BatchPlan trains them."""
    rows = train_rows(args.data_root, args.stage)
    order = row_order(args, args.stage, len(rows), args.whole)

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text}]

    if args.stage == "sft":
        return [{"prompt": user(rows[i]["prompt"]), "completion": assistant(rows[i]["response"])} for i in order]
    return [{"prompt": user(rows[i]["prompt"]), "chosen": assistant(rows[i]["chosen"]),
             "rejected": assistant(rows[i]["rejected"])} for i in order]


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    try:
        import trl
    except ImportError:
        print("TRL is not installed: pip install -e '.[bench]'  (or pip install 'trl>=1.0')", file=sys.stderr)
        sys.exit(2)
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.loading import load_causal_lm, load_tokenizer

    def load_model(path):
        """fp32 weights; the attention TRL users get (transformers' default, SDPA), unless the
        diagnostic variant hands TRL the attention our loader picks."""
        if args.our_attention:
            return load_causal_lm(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")

    torch.set_num_threads(args.threads)
    base = str(Path(args.data_root) / "base")
    tokenizer = load_tokenizer(base)  # the same tokenizer object setup ours uses (pad token, right padding)
    model = load_model(base)
    probe = forward_probe(model)
    dataset = Dataset.from_list(trl_rows(args))

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.tokens, self.threads = [], [], 0

        def on_step_end(self, _args, state, control, **kwargs):
            self.ends.append(clock())
            self.tokens.append(counter.tokens)
            self.threads = torch.get_num_threads()

    class Counter:
        tokens = 0

    counter, step_clock = Counter(), StepClock()
    common = dict(
        output_dir=str(Path(args.out_dir) / "trl"), per_device_train_batch_size=args.micro_train_batch_size,
        gradient_accumulation_steps=args.train_batch_size // args.micro_train_batch_size,
        max_steps=-1 if args.whole else args.warmup + args.steps, num_train_epochs=1,
        learning_rate=LEARNING_RATE[args.stage], lr_scheduler_type="cosine",
        warmup_steps=math.ceil(0.03 * (len(dataset) // args.train_batch_size if args.whole
                                       else args.warmup + args.steps)), adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused", bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False, train_sampling_strategy="random" if args.whole else "sequential",
        dataloader_num_workers=0,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        seed=SEED,
    )
    if args.stage == "sft":
        # Padding-free without packing wants max_length=None (TRL would not truncate anyway); no row
        # of the data exceeds max_len, and ours fails on one that does, so nothing is cut on either side.
        config = trl.SFTConfig(**common, max_length=None if args.padding_free else args.max_len,
                               padding_free=args.padding_free, packing=False, completion_only_loss=True)
        trainer_cls = trl.SFTTrainer
        extra = {}
    else:
        config = trl.DPOConfig(**common, max_length=args.max_len, beta=0.1, loss_type=["sigmoid"],
                               precompute_ref_log_probs=False)
        trainer_cls = trl.DPOTrainer
        ref = load_model(base)  # ours also loads the reference as a second fp32 copy of --pretrain
        extra = {"ref_model": ref}

    class Counting(trainer_cls):
        def compute_loss(self, model, inputs, *a, **k):
            if self.model.training:
                counter.tokens += real_tokens(inputs)
            return super().compute_loss(model, inputs, *a, **k)

    trainer = Counting(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                       callbacks=[step_clock], **extra)
    torch.set_num_threads(args.threads)
    trainer.train()
    if args.whole:  # what a TRL user's script ends with: the model and tokenizer on disk
        trainer.save_model(str(Path(args.out_dir) / "model"))
        return {"side": "trl", "stage": args.stage, "steps": trainer.state.global_step}
    ends = step_clock.ends[args.warmup - 1:]  # the clock starts at the end of the last warm-up step
    tokens = step_clock.tokens[-1] - step_clock.tokens[args.warmup - 1]
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    setup = {"padding_free": args.padding_free, "trl": trl.__version__, **probe,
             "optimizer": f"{type(trainer.optimizer).__name__}({type(inner).__name__}, "
                          f"fused={inner.defaults.get('fused')}, foreach={inner.defaults.get('foreach')})",
             "attention": model.config._attn_implementation, "gradient_checkpointing": config.gradient_checkpointing,
             "accelerate": trainer.accelerator.distributed_type.value}
    return summarize(args, ends, tokens, setup, step_clock.threads)


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds; CPU time of this process, all threads, OpenMP threads spinning at a
    barrier included (so it grows too when other work takes the cores away)."""
    return time.perf_counter(), time.process_time()


def summarize(args, ends: list[tuple[float, float]], tokens: int, setup: dict, threads: int) -> dict:
    step_s = [b[0] - a[0] for a, b in itertools.pairwise(ends)]
    elapsed, cpu = ends[-1][0] - ends[0][0], ends[-1][1] - ends[0][1]
    return {
        "side": args.side, "stage": args.stage, "steps": len(step_s), "seconds": elapsed, "cpu_seconds": cpu,
        "ms_per_step": 1000 * elapsed / len(step_s), "median_step_ms": 1000 * statistics.median(step_s),
        "cpu_ms_per_step": 1000 * cpu / len(step_s), "step_ms": [round(1000 * t, 1) for t in step_s],
        "tokens_per_step": tokens / len(step_s), "tokens_per_s": tokens / elapsed,
        "pairs_per_s": len(step_s) * args.train_batch_size / elapsed if args.stage == "dpo" else None,
        "threads": threads, "load_1m": os.getloadavg()[0], "setup": setup,
    }


def child_main(args) -> None:
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Driver: prepare data once, alternate child runs, print the table.

def take_snapshot(work: Path) -> tuple[Path, str]:
    """Copy rlhf_core and the benchmark scripts into `work`: every run then trains the same code, even while
    the working tree changes under a long benchmark. Returns the folder and a version line."""
    import shutil

    repo = Path(__file__).resolve().parents[1]
    snapshot = work / "snapshot"
    shutil.rmtree(snapshot / "rlhf_core", ignore_errors=True)  # a kept --work_dir's copy of older code
    shutil.copytree(repo / "rlhf_core", snapshot / "rlhf_core", ignore=shutil.ignore_patterns("__pycache__"))
    for script in Path(__file__).resolve().parent.glob("*.py"):  # every benchmark (they share this module)
        shutil.copy2(script, snapshot / script.name)

    def git(*argv):
        try:
            return subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--", "rlhf_core") else ""
    return snapshot, f"rlhf_core {sha}{dirty}"


def run_child(args, stage: str, name: str, data_root: Path, out_dir: Path, snapshot: Path) -> dict:
    variant = VARIANTS[name]
    cmd = [sys.executable, str(snapshot / Path(__file__).name), "--side", variant["side"], "--stage", stage,
           "--data_root", str(data_root), "--out_dir", str(out_dir), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max_len", str(args.max_len), "--threads", str(args.threads),
           "--train_batch_size", str(args.train_batch_size),
           "--micro_train_batch_size", str(args.micro_train_batch_size),
           "--packing", str(variant.get("packing", True)), "--zero_stage", str(variant.get("zero_stage", 2)),
           "--padding_free", str(variant.get("padding_free", False)),
           "--our_attention", str(variant.get("our_attention", False)),
           "--force_zero", str(variant.get("force_zero", False)), "--precision", args.precision]
    # Compiled DeepSpeed ops (about 2 min to build, once) are cached outside the throwaway work dir.
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rlhf-bench" / "torch_extensions"))
    env = dict(os.environ, RLHF_NO_PROGRESS="1", OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TORCH_EXTENSIONS_DIR=extensions,
               RLHF_HOME=os.environ.get("RLHF_HOME", str(data_root.parent / ".rlhf")),
               PYTHONPATH=os.pathsep.join(p for p in (str(snapshot), os.environ.get("PYTHONPATH")) if p))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # each child starts its own process group
        env.pop(key, None)
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=snapshot)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"  {stage} {name}: FAILED (exit {proc.returncode})\n{tail}", file=sys.stderr, flush=True)
        return {"failed": True, "exit": proc.returncode}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["process_s"] = time.perf_counter() - started
    return result


def run_whole(args, stage: str, side: str, data_root: Path, out_dir: Path, snapshot: Path) -> dict:
    """One whole training run as a user starts it, timed from process start to exit: ours is
    `rlhf train <stage>` (Ray worker group, DeepSpeed, MLflow, held-out evaluation, save); TRL is
    a script that loads the model, trains one epoch with SFTTrainer/DPOTrainer and saves."""
    kind = "sft" if stage == "sft" else "preference"
    rows = args.process_rows[stage]
    if side == "ours":
        cmd = [sys.executable, "-m", "rlhf_core.cli", "train", stage, "--pretrain", str(data_root / "base"),
               "--dataset", f"json@{data_root / 'data' / kind}", "--apply_chat_template", "--packing_samples",
               "--max_len", str(args.max_len), "--train_batch_size", str(args.train_batch_size),
               *(["--micro_train_batch_size", str(args.micro_train_batch_size)] if args.micro_train_batch_size
                 else []), "--max_epochs", "1", "--max_samples", str(rows), "--learning_rate", str(LEARNING_RATE[stage]),
               "--param_dtype", args.precision, "--seed", str(SEED), "--save_path", str(out_dir / "model")]
    else:
        cmd = [sys.executable, str(snapshot / Path(__file__).name), "--side", "trl", "--stage", stage, "--whole",
               "--data_root", str(data_root), "--out_dir", str(out_dir), "--max_len", str(args.max_len),
               "--threads", str(args.threads), "--train_batch_size", str(args.train_batch_size),
               "--micro_train_batch_size", str(args.micro_train_batch_size or TRL_DEFAULT_MICRO),
               "--precision", args.precision, "--process_rows", json.dumps(args.process_rows)]
    # Both sides get --threads torch threads (TRL's script also sets them; ours reads the variables).
    env = dict(os.environ, RLHF_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               RLHF_HOME=os.environ.get("RLHF_HOME", str(data_root.parent / ".rlhf")),
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rlhf-bench"
                                                                                / "torch_extensions")),
               PYTHONPATH=os.pathsep.join(p for p in (str(snapshot), os.environ.get("PYTHONPATH")) if p))
    import resource

    def children_cpu() -> float:  # CPU time of every finished (waited-for) child process, all threads
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    started, cpu_before = time.perf_counter(), children_cpu()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=snapshot)
    seconds = time.perf_counter() - started
    cpu_seconds = children_cpu() - cpu_before
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"  {stage} whole {side}: FAILED (exit {proc.returncode})\n{tail}", file=sys.stderr, flush=True)
        return {"failed": True, "exit": proc.returncode}
    return {"side": side, "stage": stage, "seconds": seconds, "cpu_seconds": cpu_seconds, "rows": rows,
            "load_1m": os.getloadavg()[0]}


def report_whole(args, stage: str, results: dict[str, list[dict]]) -> list[str]:
    ok = {side: [r for r in results[side] if not r.get("failed")] for side in ("ours", "trl")}
    unit = "pairs" if stage == "dpo" else "rows"
    fl = scale_of(args, stage, "whole")
    micro = (f"micro batch {args.micro_train_batch_size}" if args.micro_train_batch_size else
             f"each side's default micro-batches (ours by tokens, TRL {TRL_DEFAULT_MICRO} a device)")
    lines = [f"### {stage.upper()} whole process: {args.process_rows[stage]} {unit}, 1 epoch, global batch "
             f"{args.train_batch_size}, {micro}, max_len {args.max_len}, {args.precision}, task {args.task}, model "
             f"{args.model_size}, medians of {args.repeats} alternating runs", ""]
    if fl:
        what = f"{fl['rows']} sequences (chosen and rejected)" if stage == "dpo" else f"{fl['rows']} rows"
        lines += [f"Tokens: the {fl['tokens']} real (non-pad) prompt+response tokens of the {what} trained, counted "
                  f"with the chat template; tokens/s and MFU are over the whole process's wall time (start, data, "
                  f"evaluation and saving included). {flops_text(args, fl)}", ""]
    lines += ["| side | runs ok | seconds (median) | per run | **TRL ÷ ours** (time) | CPU s (median) | "
              "TRL ÷ ours (CPU time) | " + ("tokens/s | model GFLOP/s | MFU | " if fl else "") + "load (1 min) |",
              "|---|---|---|---|---|---|---|" + ("---|---|---|" if fl else "") + "---|"]

    def median_of(side, key):
        values = [r[key] for r in ok[side] if r.get(key) is not None]  # CPU time: absent in older files
        return statistics.median(values) if values else None

    med = {side: median_of(side, "seconds") for side in ok}
    cpu = {side: median_of(side, "cpu_seconds") for side in ok}
    for side in ("ours", "trl"):
        ratio = f"**{med['trl'] / med['ours']:.2f}x**" if side == "trl" and med["ours"] and med["trl"] else "—"
        cpu_ratio = f"{cpu['trl'] / cpu['ours']:.2f}x" if side == "trl" and cpu["ours"] and cpu["trl"] else "—"
        shown = f"{med[side]:.1f}" if med[side] else "failed"
        load = median_of(side, "load_1m")
        per_run = ", ".join(f"{r['seconds']:.1f}" for r in ok[side])
        compute = ""
        if fl:
            rate = fl["tokens"] / med[side] if med[side] else None
            compute = (f"{rate:.0f} | {gflops(rate * fl['flops_per_token'])} | "
                       f"{100 * mfu(rate * fl['flops_per_token'], args.scale['peaks'], args.precision):.1f}% | "
                       if rate else "— | — | — | ")
        lines.append(f"| {side} | {len(ok[side])}/{len(results[side])} | {shown} | {per_run} | {ratio} | "
                     f"{f'{cpu[side]:.1f}' if cpu[side] else '—'} | {cpu_ratio} | {compute}"
                     f"{f'{load:.1f}' if load is not None else '—'} |")
    return lines + [""]


def scale_of(args, stage: str, mode: str) -> dict | None:
    """The stage's FLOPs record (`stage_flops`) for `mode` (steps, whole), if the run measured it
    (files written before the scale figures have none)."""
    info = getattr(args, "scale", None)
    return info["flops"].get(f"{stage}-{mode}") if info else None


def flops_text(args, fl: dict) -> str:
    return (f"FLOPs per token {formula(fl['passes'])} = {fl['flops_per_token'] / 1e6:.1f} MFLOP at the token-weighted "
            f"mean length T = {fl['mean_len']:.1f} ({counts_line(args.scale['counts'])})")


def stage_flops(args, stage: str, data_root: Path, counts: dict, whole: bool) -> dict:
    """Real tokens, rows and model FLOPs per token of what a run of `stage` trains (the timed steps'
    rows, or a whole run's), counted here from the data with the tokenizer both sides use."""
    from rlhf_core.models.loading import load_tokenizer

    rows = train_rows(data_root, stage)
    order = row_order(args, stage, len(rows), whole, first_step=0 if whole else args.warmup)
    stats = length_stats(row_lengths(load_tokenizer(str(data_root / "base")), [rows[i] for i in order], stage,
                                     args.max_len))
    passes = 4.0 if stage == "dpo" else 3.0  # DPO: the frozen reference's forward runs every step on both sides
    return {**stats, "passes": passes, "flops_per_token": flops_per_token(counts, stats["mean_len"], passes)}


def throughput(result: dict, stage: str) -> float:
    return result["pairs_per_s"] if stage == "dpo" else result["tokens_per_s"]


def fast_step_ms(result: dict) -> float:
    """20th percentile of the run's step times: what a step costs when other work leaves the
    cores alone. On an idle machine it is close to the mean; on a busy one the mean is mostly
    time spent waiting for the cores (see README)."""
    return statistics.quantiles(result["step_ms"], n=5)[0] if len(result["step_ms"]) > 1 else result["step_ms"][0]


def fast_throughput(result: dict, stage: str, batch: int) -> float:
    per_step = batch if stage == "dpo" else result["tokens_per_step"]
    return 1000 * per_step / fast_step_ms(result)


def describe(name: str, results: list[dict]) -> str:
    ok = [r for r in results if not r.get("failed")]
    if not ok:
        return "failed"
    s = ok[0]["setup"]
    batch = f"first batch {s['first_batch_shape']} with attention_mask {s['attention_mask']}"
    if VARIANTS[name]["side"] == "ours":
        forward = "lean forward" if s.get("forward") == "lean" else s["attention"]
        return (f"{'packed' if s['packing'] else 'padded'} ({batch}), DeepSpeed ZeRO-{s['zero_stage']}, "
                f"autocast {s['autocast']}, {s['optimizer']}, {forward}, threads {ok[0]['threads']}")
    return (f"TRL {s['trl']}, {'padding-free' if s['padding_free'] else 'padded'} ({batch}), "
            f"accelerate {s['accelerate']}, autocast {s['autocast']}, {s['optimizer']}, {s['attention']}, "
            f"threads {ok[0]['threads']}")


def report(args, stage: str, names: list[str], results: dict[str, list[dict]]) -> list[str]:
    dpo = stage == "dpo"
    unit = "pairs/s" if dpo else "tokens/s"
    ok = {name: [r for r in results[name] if not r.get("failed")] for name in names}

    def median_of(name, value):
        return statistics.median(value(r) for r in ok[name]) if ok[name] else None

    wall = {n: median_of(n, lambda r: throughput(r, stage)) for n in names}
    fast = {n: median_of(n, lambda r: fast_throughput(r, stage, args.train_batch_size)) for n in names}
    fl = scale_of(args, stage, "steps")
    lines = [f"### {stage.upper()}: {args.steps} timed steps after {args.warmup} warm-up, "
             f"global batch {args.train_batch_size}, micro batch {args.micro_train_batch_size}, "
             f"max_len {args.max_len}, {args.precision}, task {args.task}, model {args.model_size}, medians of {args.repeats} runs", ""]
    if fl:
        lines += [f"Tokens: real (non-pad) prompt+response tokens of the timed steps' batches, as each side counts "
                  f"them{' (chosen and rejected sequences)' if dpo else ''}, over the timed steps' wall time (the "
                  f"rows hold {fl['tokens'] / args.steps:.0f} a step by the driver's count). {flops_text(args, fl)}",
                  ""]
    lines += ["| run | runs ok | tokens/step | ms/step | CPU ms/step | tokens/s | " + ("pairs/s | " if dpo else "")
              + ("model GFLOP/s | MFU | " if fl else "")
              + f"**ours ÷ this** ({unit}) | per-round ours ÷ this (min–max) | fast-step ms (p20) "
              "| ours ÷ this, fast steps | ours ÷ this, per CPU second | load (1 min) |",
              "|---|---|---|---|---|---|" + ("---|" if dpo else "") + ("---|---|" if fl else "")
              + "---|---|---|---|---|---|"]

    def per_cpu_second(r):  # work per CPU second of the run's process: what a busy machine barely moves
        return (args.train_batch_size if dpo else r["tokens_per_step"]) / r["cpu_ms_per_step"]

    cpu = {n: median_of(n, per_cpu_second) for n in names}
    for name in names:
        if not ok[name]:
            lines.append(f"| {name} | 0/{len(results[name])} |" + " |" * ((11 if dpo else 10) + (2 if fl else 0)))
            continue
        ratio, spread, fast_ratio, cpu_ratio = "—", "—", "—", "—"
        if name != "ours" and wall.get("ours") and wall[name]:
            ratio = f"**{wall['ours'] / wall[name]:.2f}x**"
            rounds = [throughput(a, stage) / throughput(b, stage)
                      for a, b in zip(results["ours"], results[name], strict=False)
                      if not a.get("failed") and not b.get("failed")]
            spread = f"{min(rounds):.2f}–{max(rounds):.2f}" if rounds else "—"
            fast_ratio = f"{fast['ours'] / fast[name]:.2f}x"
            cpu_ratio = f"{cpu['ours'] / cpu[name]:.2f}x"
        pairs = f"{wall[name]:.1f} | " if dpo else ""
        rate = median_of(name, lambda r: r["tokens_per_s"])
        if fl:
            pairs += (f"{gflops(rate * fl['flops_per_token'])} | "
                      f"{100 * mfu(rate * fl['flops_per_token'], args.scale['peaks'], args.precision):.1f}% | ")
        lines.append(f"| {name} | {len(ok[name])}/{len(results[name])} | {median_of(name, lambda r: r['tokens_per_step']):.0f} "
                     f"| {median_of(name, lambda r: r['ms_per_step']):.0f} | {median_of(name, lambda r: r['cpu_ms_per_step']):.0f} "
                     f"| {rate:.0f} | {pairs}{ratio} | {spread} "
                     f"| {median_of(name, fast_step_ms):.0f} | {fast_ratio} | {cpu_ratio} "
                     f"| {median_of(name, lambda r: r['load_1m']):.1f} |")
    lines += ["", "Setups:"] + [f"- `{name}`: {describe(name, results[name])}" for name in names] + [""]
    return lines


def tables(args, header: str, raw: dict[str, dict[str, list[dict]]]) -> str:
    """The header, the measured peak and every stage's table."""
    lines = [header, ""]
    if getattr(args, "scale", None):
        lines += [peak_line(args.scale["peaks"], args.precision), ""]
    for stage, results in raw.items():
        if stage.endswith("-whole"):
            lines += report_whole(args, stage.removesuffix("-whole"), results)
        else:
            lines += report(args, stage, list(results), results)
    return "\n".join(lines)


def print_saved(path: str) -> int:
    """Print the tables of a `--json_out` file (also one a cut-short benchmark left behind)."""
    saved = json.loads(Path(path).read_text())
    print(tables(argparse.Namespace(**saved["args"]), saved["header"], saved["results"]))
    return 0


def driver_main(args) -> int:
    if importlib.util.find_spec("trl") is None:
        print("TRL is not installed, so there is nothing to compare against.\n"
              "Install the benchmark extra: pip install -e '.[bench]'  (or: pip install 'trl>=1.0')", file=sys.stderr)
        return 2
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    for stage in stages:
        if stage not in DEFAULT_VARIANTS:
            raise SystemExit(f"--stages: unknown stage {stage!r} (sft, dpo)")
    if args.micro_train_batch_size == 0 and args.mode != "process":
        raise SystemExit("--micro_train_batch_size 0 (each side's defaults) is for whole processes: --mode process")
    if args.train_batch_size % (args.micro_train_batch_size or TRL_DEFAULT_MICRO):
        raise SystemExit("--train_batch_size must be a multiple of --micro_train_batch_size")
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1")
    from rlhf_core.infra.precision import resolve_here

    # auto: what the CLI would pick on this machine; an explicit choice is measured as asked.
    args.precision = resolve_here("auto").value if args.param_dtype == "auto" else args.param_dtype
    modes = ["process", "steps"] if args.mode == "both" else [args.mode]

    keep = args.work_dir is not None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlhf-bench-vs-trl-")).resolve()
    snapshot, code = take_snapshot(work)
    roots = {}
    for mode in modes:
        roots[mode] = data_root = work / f"prep-{args.task}-{args.model_family or 'llama'}-{args.model_size}-{mode}"
        print(f"preparing data and the {args.model_size} model in {data_root} ...", file=sys.stderr, flush=True)
        n_train = max(args.process_rows.values()) if mode == "process" else None  # else prep's default
        rows = ["--n_train", str(n_train)] if n_train is not None else []
        prep = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "prep", "--out", str(data_root), "--task",
                               args.task, "--seed", "0", "--model_size", args.model_size, *rows]
                              + (["--model_family", args.model_family] if args.model_family else []),
                              capture_output=True, text=True, cwd=snapshot)
        if prep.returncode != 0:
            print(prep.stderr[-3000:], file=sys.stderr)
            return 1
    # The figures MFU needs: the model's counts, each run's tokens and FLOPs per token, the measured peak
    # (taken again after the runs; the higher reading counts).
    counts = model_counts(str(roots[modes[0]] / "base"))
    args.scale = {"counts": counts, "peaks": measured_peaks(args.threads), "flops": {
        f"{stage}-{'whole' if mode == 'process' else 'steps'}": stage_flops(args, stage, roots[mode], counts,
                                                                            mode == "process")
        for mode in modes for stage in stages}}

    raw: dict[str, dict[str, list[dict]]] = {}
    failed = False

    def save():  # after every run: a long benchmark that is cut short keeps what it measured
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": vars(args), "header": versions_line(args, code),
                                                       "results": raw}, indent=2))

    for stage in stages if "process" in modes else []:
        whole: dict[str, list[dict]] = {"ours": [], "trl": []}
        raw[f"{stage}-whole"] = whole
        for round_ in range(args.repeats):
            for side in ("ours", "trl"):
                result = run_whole(args, stage, side, roots["process"],
                                   work / "runs" / f"whole-{stage}-{side}-{round_}", snapshot)
                whole[side].append(result)
                failed |= bool(result.get("failed"))
                save()
                if not result.get("failed"):
                    print(f"  {stage} whole round {round_ + 1}/{args.repeats} {side:5s} {result['seconds']:7.1f} s",
                          file=sys.stderr, flush=True)
    for stage in stages if "steps" in modes else []:
        names = args.variants.split(",") if args.variants else DEFAULT_VARIANTS[stage]
        names = [n for n in names if not (stage == "dpo" and n == "trl-padding-free")]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
        results: dict[str, list[dict]] = {n: [] for n in names}
        raw[stage] = results
        for round_ in range(args.repeats):
            for name in names:  # alternate: ours, trl, ..., ours, trl, ...
                out_dir = work / "runs" / f"{stage}-{name}-{round_}"
                result = run_child(args, stage, name, roots["steps"], out_dir, snapshot)
                results[name].append(result)
                failed |= bool(result.get("failed"))
                save()
                if not result.get("failed"):
                    print(f"  {stage} round {round_ + 1}/{args.repeats} {name:17s} "
                          f"{result['ms_per_step']:8.1f} ms/step ({result['cpu_ms_per_step']:7.1f} CPU ms)  "
                          f"{result['tokens_per_s']:8.0f} tokens/s"
                          + (f"  {result['pairs_per_s']:7.1f} pairs/s" if stage == "dpo" else ""),
                          file=sys.stderr, flush=True)
    args.scale["peaks"] = measured_peaks(args.threads, args.scale["peaks"])
    save()
    print(tables(args, versions_line(args, code), raw))
    if not keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def versions_line(args, code: str) -> str:
    from importlib.metadata import version

    from rlhf_core.infra.precision import describe_hardware

    names = ["torch", "transformers", "deepspeed", "trl", "accelerate"]
    return (f"Machine: {describe_hardware()}; both sides in {args.precision}.\n"
            f"Versions: {code}, " + ", ".join(f"{n} {version(n)}" for n in names)
            + f"; {args.threads} torch threads per run, {os.cpu_count()} CPUs visible, "
            f"{args.repeats} alternating runs each")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="sft,dpo", help="comma-separated: sft, dpo")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated runs per stage (default sft: {','.join(DEFAULT_VARIANTS['sft'])}; "
                        f"dpo: {','.join(DEFAULT_VARIANTS['dpo'])}); known: {', '.join(VARIANTS)}")
    p.add_argument("--model_size", default="small", choices=tuple(PROCESS_ROWS),  # the sizes it has settings for
                   help="the model both sides train, an rlhf prep size: tiny, small, 100m (~113M parameters "
                        "besides the embeddings) or 500m (Qwen2.5-0.5B's shape, for a GPU)")
    p.add_argument("--model_family", default=None, help="rlhf prep --model_family of the model (default: its Llama); "
                   "qwen2 with --model_size 500m is a random-init Qwen2.5-0.5B, for a GPU")
    p.add_argument("--task", default="sort", help="built-in task whose data both sides train on (default: the "
                                                   "pipeline's task; addition has shorter, more even rows)")
    p.add_argument("--mode", choices=["steps", "process", "both"], default="steps",
                   help="steps: timed optimizer steps in steady state; process: whole runs as users start them "
                        "(ours: `rlhf train`), timed from process start to exit; both: process, then steps")
    p.add_argument("--process_rows", type=json.loads, default=None,
                   help="rows per whole run, JSON (default by model size: tiny and small "
                        f"{json.dumps(PROCESS_ROWS['small'])}, 100m {json.dumps(PROCESS_ROWS['100m'])}); one epoch each")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="runs of each setup, alternated")
    p.add_argument("--train_batch_size", type=int, default=32)
    p.add_argument("--micro_train_batch_size", type=int, default=32,
                   help="0 with --mode process: each side at its defaults (ours: by tokens; TRL: "
                        f"{TRL_DEFAULT_MICRO} a device)")
    p.add_argument("--max_len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    p.add_argument("--param_dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="precision of both sides: auto = bf16 where this CPU computes it natively, else fp32")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before a run is given up")
    p.add_argument("--work_dir", default=None, help="keep data and run folders here (default: a temp dir, removed)")
    p.add_argument("--json_out", default=None, help="write every run's raw result here (updated after each run)")
    p.add_argument("--report", default=None, metavar="JSON", help="only print the tables of a --json_out file")
    # Child-only flags (the driver passes them).
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", choices=["sft", "dpo"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--data_root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--packing", type=lambda s: s == "True", default=True, help=argparse.SUPPRESS)
    p.add_argument("--padding_free", type=lambda s: s == "True", default=False, help=argparse.SUPPRESS)
    p.add_argument("--our_attention", type=lambda s: s == "True", default=False, help=argparse.SUPPRESS)
    p.add_argument("--zero_stage", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--force_zero", type=lambda s: s == "True", default=False, help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_rows is None:
        args.process_rows = PROCESS_ROWS[args.model_size]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side:
        child_main(args)
        return 0
    return print_saved(args.report) if args.report else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
