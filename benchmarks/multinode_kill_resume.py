"""A node of a two-node Ray cluster dies mid-stage; the flow retries and resumes from S3.

The whole run that `tests/integration/test_multinode.py` leaves out for time: a Ray cluster of two
nodes simulated on this machine (`tests/integration/simulated_cluster.py`: each node its own
`ray start`, process group, temp dir, state directory and custom resource), a moto S3 server,
and one flow run of SFT (2 ranks, one per node) then PPO (GAE; actor pinned to node A, critic to
node B) with `output_root: s3://...` and inputs on S3. In each stage, once its first checkpoint
is on S3 (`checkpoints/<stage>/latest`), node B's whole process group is SIGKILLed and a
replacement node B (a new state directory: nothing of the dead node's disk survives) is started;
the flow's retry is submitted once it has joined.

Printed: when each stage's first checkpoint appeared, how long the attempt took to fail after
the kill, how long the replacement took to join, the step the retry resumed at (from the job's
log line "resumed from s3://... at step N") and the stage's `train/start_step`/`steps_run`, and
the whole run's wall time. Checked (exit 1 when one fails; times are never asserted): each stage
failed once as an infrastructure failure and was retried, the retry resumed at a step > 0 from
S3 and ran only the remaining steps, the replacement fetched the checkpoint into its own state
directory, every path in the stage configs is s3://, and no staged checkpoint part was left.

Usage: python benchmarks/multinode_kill_resume.py [--sft_steps 48] [--ppo_steps 4] [--keep]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CKPT_EVERY = 4  # SFT's settings.supervised_checkpoint_steps (PPO checkpoints every step)


def config(inputs: dict, output_root: str, sft_steps: int, ppo_steps: int) -> dict:
    return {
        "settings": {"stages": ["sft", "ppo"], "output_root": output_root, "experiment": "multinode-bench",
                     "retries": 1, "retry_delay_seconds": 0, "supervised_checkpoint_steps": CKPT_EVERY,
                     "checkpoint_steps": 1, "register_models": False},
        "sft": {"pretrain": inputs["base"], "dataset": inputs["sft"], "max_steps": sft_steps, "max_epochs": 10,
                "train_batch_size": 16, "micro_train_batch_size": 8, "num_gpus_per_node": 2, "param_dtype": "fp32",
                "max_len": 48},
        "ppo": {"train.max_steps": ppo_steps, "rollout.batch_size": 8, "rollout.n_samples_per_prompt": 4,
                "train.batch_size": 32, "train.micro_batch_size": 16, "rollout.micro_batch_size": 32,
                "eval.n_samples_per_prompt": 1, "algo.advantage.estimator": "gae", "critic.freezing_steps": 0,
                "reward.task": "addition", "ds.param_dtype": "fp32", "data.max_samples": 64,
                "data.prompt_dataset": inputs["prompts"], "eval.dataset": inputs["prompts"],
                "actor.resources": {"node_a": 1}, "critic.resources": {"node_b": 1}},
    }


class Striker:
    """For each stage in turn: once its first checkpoint is on S3, kill the node holding `node_b`
    and start a replacement; `replaced[stage]` is set once the replacement is alive."""

    def __init__(self, cluster, fs, output_root: str, stages: list[str]):
        self.cluster, self.fs, self.output_root, self.stages = cluster, fs, output_root, stages
        self.events: dict[str, dict] = {s: {} for s in stages}
        self.replaced = {s: threading.Event() for s in stages}
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        victim = "b"
        try:
            for n, stage in enumerate(self.stages, start=2):
                while not self.stop.is_set():
                    self.fs.invalidate_cache()
                    found = self.fs.glob(f"{self.output_root}/*/checkpoints/{stage}/latest")
                    if found:
                        break
                    time.sleep(0.2)
                else:
                    return
                event = self.events[stage]
                event["first_checkpoint"] = self.fs.cat(found[0]).decode()
                event["checkpoint_seen"] = time.monotonic()
                self.cluster.nodes[victim].kill()
                event["killed"], event["victim"] = time.monotonic(), victim
                victim = f"b{n}"
                self.cluster.add(victim, {"node_b": 1})
                self.cluster.wait_alive(victim)
                event["replacement"], event["joined"] = victim, time.monotonic()
                self.replaced[stage].set()
        except Exception as e:  # noqa: BLE001 - reported by main
            self.error = f"{type(e).__name__}: {e}"
            for event in self.replaced.values():
                event.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft_steps", type=int, default=48)
    parser.add_argument("--ppo_steps", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (node logs, state directories)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rlhf-mnbench-"))
    os.environ["RLHF_HOME"] = str(root / "flow-home")  # the flow's own state (Prefect, MLflow); before `flows`
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/rlhf-torch-extensions"))
    os.environ.update(RLHF_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        os.environ.pop(name, None)

    from tests.integration.simulated_cluster import (
        moto_server,
        stage_config_paths,
        staged_leftovers,
        two_node_cluster,
        upload_inputs,
    )

    began = time.monotonic()
    with moto_server(), two_node_cluster(keep=args.keep) as cluster:
        import fsspec

        from rlhf_core.stages.prep import prepare

        prepared = {k: str(v) for k, v in prepare(root / "prep", task="addition", seed=0, model_size="tiny",
                                                  n_train=1024, n_test=128).items()}
        cluster.ready()
        cluster_up = time.monotonic() - began
        fs = fsspec.filesystem("s3")
        inputs = upload_inputs(prepared, "s3://models/bench-inputs")
        output_root = f"s3://models/bench-{root.name}"
        os.environ.update(RAY_ADDRESS=cluster.dashboard, RLHF_JOB_COMMAND=f"{sys.executable} -m rlhf_core.cli",
                          RLHF_ARTIFACT_ROOT="s3://models/mlartifacts")
        result, report = run_flow(cluster, fs, inputs, output_root, args)
        checks = check(result, report, cluster, fs, args, stage_config_paths, staged_leftovers)
    wall = time.monotonic() - began
    print_report(report, checks, cluster_up, wall, args)
    if args.keep:
        print(f"kept: {root} (the flow's state, prep) and {cluster.root} (the nodes' logs and state directories)")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(ok for _, ok, _ in checks) else 1


def run_flow(cluster, fs, inputs: dict, output_root: str, args) -> tuple[dict, dict]:
    import orchestration.stages
    from flows.cli import flow_parameters
    from flows.pipeline import rlhf
    from orchestration.ray_jobs import RayJobRunner

    stages = ["sft", "ppo"]
    striker = Striker(cluster, fs, output_root, stages)
    attempts: dict[str, list[dict]] = {s: [] for s in stages}

    class RecordingRunner(RayJobRunner):
        """Times each attempt and keeps its log; a retry waits for node B's replacement."""

        def run(self, stage, args_, env, log, **kwargs):
            if attempts[stage]:
                striker.replaced[stage].wait(300)
            attempt = {"submitted": time.monotonic(), "lines": []}
            attempts[stage].append(attempt)

            def keep(line):
                attempt["lines"].append(line)
                if "resumed from" in line and "resumed" not in attempt:
                    attempt["resumed"] = time.monotonic()
                if "uploaded to" in line and "first_upload" not in attempt:
                    attempt["first_upload"] = time.monotonic()
                log(line)

            try:
                return super().run(stage, args_, env, keep, **kwargs)
            except Exception as e:
                attempt["failed"], attempt["error"] = time.monotonic(), e
                raise
            finally:
                attempt["ended"] = time.monotonic()

    orchestration.stages.RayJobRunner = RecordingRunner
    thread = threading.Thread(target=striker.run, daemon=True)
    thread.start()
    try:
        result = rlhf(**flow_parameters(config(inputs, output_root, args.sft_steps, args.ppo_steps)))
    finally:
        striker.stop.set()
    return result, {"attempts": attempts, "events": striker.events, "error": striker.error}


def check(result: dict, report: dict, cluster, fs, args, stage_config_paths, staged_leftovers) -> list:
    from orchestration.ray_jobs import StageJobError
    from rlhf_core.infra import storage

    checks = []

    def ok(name: str, passed: bool, detail: str = "") -> None:
        checks.append((name, bool(passed), detail))

    ok("the striker ran", report["error"] is None, report["error"] or "")
    run_root = result["outputs"]["sft"].rsplit("/", 1)[0]
    steps = {"sft": args.sft_steps, "ppo": args.ppo_steps}
    for stage, tries in report["attempts"].items():
        event = report["events"][stage]
        ok(f"{stage}: node B was killed past the first checkpoint", "killed" in event,
           event.get("first_checkpoint", "the stage finished first: raise its steps"))
        ok(f"{stage}: one failed attempt (infrastructure, retried), then one that succeeded",
           len(tries) == 2 and isinstance(tries[0].get("error"), StageJobError) and tries[0]["error"].retryable
           and "error" not in tries[1], f"{len(tries)} attempts")
        log = "\n".join(tries[-1]["lines"])
        resumed = re.findall(rf"resumed from (s3://\S+/checkpoints/{stage}/global_step\d+) at step (\d+)", log)
        manifest = storage.read_manifest(result["outputs"][stage]) or {}
        start = manifest.get("resume", {}).get("start_step", 0)
        run = manifest.get("metrics", {}).get("train/steps_run")
        ok(f"{stage}: the retry resumed from S3 at a step > 0 and ran only the rest",
           bool(resumed) and int(resumed[0][1]) == start > 0 and run == steps[stage] - start,
           f"resumed {resumed[0] if resumed else None}, start_step {start}, steps_run {run} of {steps[stage]}")
        event.update(resumed_step=start, steps_run=run)
        paths = stage_config_paths(fs, run_root, stage)
        ok(f"{stage}: every path in its config is on S3", paths and all(p.startswith("s3://") for p in paths),
           ", ".join(p for p in paths if not p.startswith("s3://")))
        home = cluster.nodes[event["replacement"]].home if "replacement" in event else None
        fetched = home is not None and list((home / "cache" / "downloads").glob("*/rng_*.pt"))
        ok(f"{stage}: node B's replacement fetched the checkpoint into its own state directory", fetched,
           str(home))
    for name, node in cluster.nodes.items():  # a killed node's disk went with it
        if node.proc.poll() is None:
            ok(f"node {name}: no staged checkpoint part left", not staged_leftovers(node.home))
    return checks


def print_report(report: dict, checks: list, cluster_up: float, wall: float, args) -> None:
    import torch

    cpu = platform.processor() or platform.machine()
    print(f"\nmultinode kill-and-resume: 2 Ray nodes on one machine ({os.cpu_count()} cores, {cpu}), S3 on moto, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"cluster and inputs up: {cluster_up:.0f} s; whole run: {wall:.0f} s")
    for stage, tries in report["attempts"].items():
        event = report["events"][stage]
        if not tries:
            continue
        first = tries[0]
        steps = {"sft": args.sft_steps, "ppo": args.ppo_steps}[stage]
        line = [f"{stage} ({steps} steps):"]
        if "checkpoint_seen" in event:
            seen = event["checkpoint_seen"] - first["submitted"]
            line.append(f"first checkpoint ({event['first_checkpoint']}) on S3 {seen:.0f} s after submission;")
        if "killed" in event and "failed" in first:
            noticed = first["failed"] - event["killed"]
            line.append(f"attempt failed {noticed:.1f} s after node {event['victim']} was killed;")
        if "joined" in event:
            line.append(f"replacement {event['replacement']} joined {event['joined'] - event['killed']:.0f} s after "
                        "the kill;")
        if len(tries) > 1 and "resumed" in tries[1]:
            retry = tries[1]
            line.append(f"retry resumed at step {event.get('resumed_step')} {retry['resumed'] - retry['submitted']:.0f} "
                        f"s after its submission, ran {event.get('steps_run')} steps, done in "
                        f"{retry['ended'] - retry['submitted']:.0f} s")
        print(" ".join(line))
    for name, passed, detail in checks:
        print(f"  [{'ok' if passed else 'FAILED'}] {name}" + (f" ({detail})" if detail and not passed else ""))


if __name__ == "__main__":
    sys.exit(main())
