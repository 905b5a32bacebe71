"""Faults under a running stage: the Ray cluster dies, or one rank's actor is killed mid-step.

Each fails the attempt as retryable within a bound, names what failed, leaves no process waiting
forever, and the retry (Prefect's, in the flow) completes from the attempt's checkpoint. Tiny
models, a few dozen steps. Run under `flock /tmp/rlhf-ray.lock`: every test starts a local Ray.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.integration.test_pipeline import harness, mlflow_client, params  # noqa: F401 - `harness` is a fixture

pytestmark = pytest.mark.integration

BOUND_S = 10  # RLHF_RAY_UNREACHABLE_S for these tests (default 60)
CKPT = 10  # a checkpoint (and an eval line "[step N]") every CKPT steps
# Long enough that the strike (once the job's log shows step 20) lands while the rank still trains:
# with 40 steps a fast machine had finished and published by the time the watcher read step 20.
SFT = {"max_steps": 120, "max_epochs": 40, "eval_steps": CKPT, "max_eval_samples": 8}


# -- a rank that dies inside a collective: the error names it, not the rank left waiting -----------

class Collective:
    def join(self):
        return self._role_init_process_group("gloo", 60)

    def raise_then_die(self):
        """Rank 0's error reaches the controller first, rank 1 dies half a second later (the order a
        survivor's gloo error and Ray's death report often arrive in)."""
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:12345")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    def all_reduce_or_die(self, dying_rank: int):
        import torch
        import torch.distributed as dist

        if dist.get_rank() == dying_rank:
            time.sleep(0.5)  # the others are inside the all_reduce by now
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(1)
        dist.all_reduce(t)  # the survivor: gloo raises once its peer's socket closes
        return t.item()


def test_a_rank_killed_inside_a_collective_is_named_and_the_survivor_does_not_hang(monkeypatch):
    import ray

    from rlhf_core.distributed.cluster import ensure_ray
    from rlhf_core.distributed.role_group import RoleError, RoleGroup

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = ensure_ray()
    survivors = []
    try:
        for method, args in (("all_reduce_or_die", (1,)), ("raise_then_die", ())):
            deadline = time.monotonic() + 60  # the last group's placement group is given back asynchronously
            while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
            group = RoleGroup(Collective, 2, name="train", timeout_s=60)
            try:
                assert group.call_all("join") == [(0, 2), (1, 2)]
                survivors.append(group.info[0]["pid"])
                begun = time.monotonic()
                with pytest.raises(RoleError) as err:
                    group.call_all(method, *args)
                assert time.monotonic() - begun < 20, "the survivor's wait in the collective did not hang the call"
                # The root cause, not the survivor's error: rank 1 died; rank 0's failure (when it
                # came first) is mentioned after it.
                assert err.value.rank == 1 and err.value.cause is None, str(err.value)[:500]
                assert str(err.value).startswith(f"role 'train' rank 1: the actor died during {method}()")
            finally:
                group.shutdown()
        assert "(then role 'train' rank 0 failed too: raise_then_die() raised RuntimeError: Connection closed" \
            in str(err.value)
    finally:
        if started:
            ray.shutdown()
    import psutil

    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) for p in survivors) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in survivors), "shutdown killed the surviving ranks"


# -- the flow: a prep run to start from, a watcher that strikes once the SFT job has checkpoints ------

@pytest.fixture(scope="module")
def sft_inputs(harness, prepared) -> dict:  # noqa: F811
    """The SFT stage's model and data, given directly (no prep stage to run first)."""
    return {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}"}


def _watch(stop: threading.Event, addresses: list, ready, strike, out: dict) -> None:
    """Once the flow's running SFT job's log satisfies `ready`, call `strike(address, job, log)` once;
    what it returns (and any error) lands in `out`."""
    from ray.job_submission import JobSubmissionClient

    try:
        while not stop.is_set():
            if addresses:
                client = JobSubmissionClient(addresses[0])
                for job in client.list_jobs():
                    if not (job.submission_id or "").startswith("rlhf-sft") or job.status.value != "RUNNING":
                        continue
                    log = client.get_job_logs(job.submission_id)
                    if ready(log) and job.driver_info:
                        out.update(strike(addresses[0], job, log), submission_id=job.submission_id,
                                   at=time.time())
                        return
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = repr(e)


def _past_two_checkpoints(log: str) -> bool:
    return any(int(step) >= 2 * CKPT for step in re.findall(r"\[step (\d+)\]", log))


def _run_and_strike(monkeypatch, ready, strike, **sections) -> tuple[dict, dict]:
    """The flow's result, and what the watcher did (`raised`: the stage attempts' exceptions, whole:
    MLflow's `rlhf.error` tag keeps only their last 5000 characters; `raised_at`: when each was raised)."""
    import contextlib

    import flows.pipeline
    import orchestration.stages
    from flows.pipeline import rlhf
    from orchestration.ray_jobs import RayJobRunner

    stop, addresses, out = threading.Event(), [], {"raised": []}

    class RecordingRunner(RayJobRunner):
        def run(self, *args, **kwargs):
            try:
                return super().run(*args, **kwargs)
            except Exception as e:
                out["raised"].append(e)
                out.setdefault("raised_at", []).append(time.time())  # when the attempt failed, not when MLflow heard
                raise

    monkeypatch.setattr(orchestration.stages, "RayJobRunner", RecordingRunner)
    real_cluster = flows.pipeline.ray_cluster

    @contextlib.contextmanager
    def recorded_cluster():
        with real_cluster() as address:
            addresses.append(address)
            yield address

    monkeypatch.setattr(flows.pipeline, "ray_cluster", recorded_cluster)
    watcher = threading.Thread(target=_watch, args=(stop, addresses, ready, strike, out), daemon=True)
    watcher.start()
    try:
        result = rlhf(**params(**sections))
    finally:
        stop.set()
    assert "error" not in out and "at" in out, f"the watcher never struck: {out.get('error')}"
    return result, out


def _sft_runs(result: dict) -> tuple:
    c = mlflow_client()
    runs = c.search_runs([c.get_experiment_by_name("rlhf").experiment_id],
                         f"tags.`mlflow.parentRunId` = '{result['pipeline_run_id']}' and tags.`rlhf.stage` = 'sft'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    failed = next(r for r in runs if r.info.status == "FAILED")
    retry = next(r for r in runs if r.info.status == "FINISHED")
    return failed, retry


def _assert_resumed(result: dict, retry) -> None:
    from rlhf_core.infra import storage

    assert retry.data.tags["rlhf.resumed_from_checkpoints"] == retry.data.tags["rlhf.checkpoint_uri"]
    metrics = storage.read_manifest(result["outputs"]["sft"])["metrics"]
    total = SFT["max_steps"]
    assert metrics["train/start_step"] >= CKPT and metrics["train/steps_run"] == total - metrics["train/start_step"]


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_ray_cluster_killed_under_a_running_stage_fails_it_retryably_within_the_bound(sft_inputs, monkeypatch):
    """The local cluster's GCS, raylet and dashboard are SIGKILLed mid-SFT: the attempt fails with
    ClusterUnreachable after RLHF_RAY_UNREACHABLE_S, the job's driver exits (Ray's GCS reconnect
    bound, set from the same variable), the retry starts a fresh local cluster and resumes from
    the checkpoint the killed attempt left."""
    from orchestration.ray_jobs import ClusterUnreachable, _kind, local_cluster

    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", str(BOUND_S))

    def kill_cluster(address, job, log):
        cluster = local_cluster(address)
        victims = [p for name, p in cluster.processes if _kind(name)]
        assert {_kind(name) for name, _ in cluster.processes} >= {"gcs_server", "raylet", "ray-dashboard-head"}
        for p in victims:
            p.kill()
        return {"driver": int(job.driver_info.pid), "old_address": cluster.address}

    result, struck = _run_and_strike(
        monkeypatch, _past_two_checkpoints, kill_cluster,
        settings={"stages": ["sft"], "retries": 1, "retry_delay_seconds": 0,
                  "force_stages": ["sft"], "supervised_checkpoint_steps": CKPT, "register_models": False},
        sft={**SFT, **sft_inputs})
    failed, retry = _sft_runs(result)
    [raised] = struck["raised"]
    assert isinstance(raised, ClusterUnreachable) and raised.retryable
    error = failed.data.tags["rlhf.error"]
    assert struck["submission_id"] + " UNREACHABLE" in error, error[:300]
    # the time without an answer is what the poll measured: the bound, or a poll interval more
    unanswered = re.search(r"did not answer for (\d+) s \(RLHF_RAY_UNREACHABLE_S=(\d+)\)", error)
    assert unanswered, error[:500]
    assert int(unanswered[2]) == BOUND_S and BOUND_S <= int(unanswered[1]) <= BOUND_S + 5, unanswered[0]
    noticed = struck["raised_at"][0] - struck["at"]
    assert BOUND_S <= noticed < BOUND_S + 15, f"the attempt failed {noticed:.1f} s after the cluster died"
    assert _gone(struck["driver"]), "the killed cluster's job driver exited"
    _assert_resumed(result, retry)


def test_a_rank_killed_mid_step_fails_the_stage_naming_it_and_the_retry_resumes(sft_inputs, monkeypatch):
    """SFT on 2 ranks; rank 1's actor is SIGKILLed mid-training: the attempt fails (retryable) with
    an error naming role 'train' rank 1, rank 0 does not stay behind in its gloo collective, and the
    retry resumes from the last checkpoint and completes."""
    from orchestration.ray_jobs import StageJobError

    def kill_rank1(address, job, log):
        ranks = re.search(r"role 'train': rank 0 pid (\d+) on \S+, rank 1 pid (\d+)", log)
        os.kill(int(ranks.group(2)), signal.SIGKILL)
        return {"rank0": int(ranks.group(1)), "rank1": int(ranks.group(2))}

    def ready(log: str) -> bool:
        return "role 'train': rank 0 pid" in log and _past_two_checkpoints(log)

    result, struck = _run_and_strike(
        monkeypatch, ready, kill_rank1,
        settings={"stages": ["sft"], "retries": 1, "retry_delay_seconds": 0,
                  "force_stages": ["sft"], "supervised_checkpoint_steps": CKPT, "register_models": False},
        sft={**SFT, **sft_inputs, "num_gpus_per_node": 2, "micro_train_batch_size": 8})
    failed, retry = _sft_runs(result)
    [raised] = struck["raised"]
    assert isinstance(raised, StageJobError) and raised.retryable and raised.submission_id == struck["submission_id"]
    headline = str(raised).splitlines()[0]
    assert headline.endswith("rlhf: error: stage failed: RoleError: role 'train' rank 1: the actor died during "
                             "run_stage():"), headline
    assert "The actor died unexpectedly" in failed.data.tags["rlhf.error"]
    noticed = struck["raised_at"][0] - struck["at"]
    assert noticed < 60, f"the attempt failed {noticed:.1f} s after rank 1 died"
    assert _gone(struck["rank0"]), "the surviving rank was killed with its group"
    _assert_resumed(result, retry)
