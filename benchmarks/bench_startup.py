"""Start-up of a CLI stage: seconds from process start to its first optimizer step, and to exit.

Each stage is `rlhf train <stage>` at its defaults on the tiny built-in model and data (`rlhf prep`
into a scratch folder), run as a user runs it: a fresh process, one rank, MLflow on (the default
SQLite store, already created by an earlier run, as on any machine after its first stage), five
steps. The first step starts when the trainer's progress bar first appears (`<stage> steps:`),
which the loop prints right before it. Rounds alternate stages; medians are reported.

`--compare_env VAR=VALUE` runs every stage a second time per round with that variable set and
prints both, e.g. `--compare_env RLHF_TRANSFORMERS_SKLEARN=1` for the start-up before
infra/lean_imports.py. Nothing is asserted: the script prints (benchmarks/README.md, "Start-up").

Usage: python benchmarks/bench_startup.py [--repeats 3] [--stages sft,rm,dpo] [--compare_env VAR=VALUE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RLHF = str(Path(sys.executable).with_name("rlhf"))
DATA = {"sft": "sft/train.jsonl", "rm": "preference/train.jsonl", "dpo": "preference/train.jsonl"}


def first_step(cmd: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """(seconds to the progress bar, seconds to exit) of one process."""
    marker = f"{cmd[2]} steps:".encode()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    seen, first = b"", None
    while chunk := proc.stderr.read1(65536):
        seen += chunk
        if first is None and marker in seen:
            first = time.perf_counter() - start
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{seen.decode(errors='replace')[-3000:]}")
    return first, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", default="sft,rm,dpo")
    parser.add_argument("--compare_env", default=None, help="VAR=VALUE: also run each stage with it set")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlhf-startup-"))
    env = {**os.environ, "RLHF_HOME": str(work / "home")}
    subprocess.run([RLHF, "prep", "--out", str(work / "prep"), "--n_train", "512", "--n_test", "32"], check=True,
                   cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    variants = {"default": env}
    if args.compare_env:
        name, _, value = args.compare_env.partition("=")
        variants[args.compare_env] = {**env, name: value}
    stages = args.stages.split(",")
    times = {(v, s): [] for v in variants for s in stages}
    for round_ in range(args.repeats + 1):  # round 0 creates the MLflow store and warms the file cache
        for stage in stages:
            for variant, variant_env in variants.items():
                out = work / "out" / stage
                shutil.rmtree(out, ignore_errors=True)
                cmd = [RLHF, "train", stage, "--pretrain", str(work / "prep" / "base"),
                       "--dataset", str(work / "prep" / "data" / DATA[stage]), "--save_path", str(out),
                       "--max_steps", "5"]
                result = first_step(cmd, variant_env, work)
                if round_:
                    times[variant, stage].append(result)
    from rlhf_core.infra.precision import describe_hardware

    print(f"Machine: {describe_hardware()}, {os.cpu_count()} cores; medians of {args.repeats} runs")
    print(f"{'stage':6} {'variant':34} {'first step s':>13} {'exit s':>8}")
    for stage in stages:
        for variant in variants:
            runs = times[variant, stage]
            print(f"{stage:6} {variant:34} {statistics.median(r[0] for r in runs):13.2f} "
                  f"{statistics.median(r[1] for r in runs):8.2f}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
