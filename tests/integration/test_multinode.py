"""An RL stage on a Ray cluster of two nodes simulated on this machine, everything on S3 (moto).

Two `ray start` nodes, each with its own process group, temp dir, state directory (`RLHF_HOME`)
and custom resource (`node_a`, `node_b`: `simulated_cluster.py`). The flow submits to the
cluster's Jobs API (`RAY_ADDRESS`) with `output_root: s3://...` and inputs on S3, so no job is
handed a path of another machine. One PPO stage (GAE: actor, critic, reference, rollout engine)
with `--actor.resources '{"node_a": 1}'` and `--critic.resources '{"node_b": 1}'` shows:

(a) the roles of one RL stage run on different nodes, where their resources are;
(b) outputs and checkpoints are on S3 only: every model, data, output and checkpoint location in
    the stage's config is s3://; the RL checkpoint on S3 holds the actor's part (uploaded from
    node A), the critic's (from node B), the controller's state and `latest`; each node downloaded
    the models it needed into its own state directory, and no staged part is left on any node.

Killing a node mid-stage and resuming from S3 takes two more jobs than fit here (each job spends
20-50 s starting Python, Ray actors and DeepSpeed on a busy 2-core machine):
`benchmarks/multinode_kill_resume.py` runs it (SFT and PPO each lose node B past their first
checkpoint and resume from S3 on its replacement); the resume logic itself is
`test_s3_checkpoints.py`'s.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests.integration.simulated_cluster import (
    stage_config_paths,
    staged_leftovers,
    two_node_cluster,
    upload_inputs,
)
from tests.integration.test_pipeline import harness, params  # noqa: F401 - `harness` is a fixture

pytestmark = pytest.mark.integration

PPO = {"train.max_steps": 2, "rollout.batch_size": 8, "rollout.n_samples_per_prompt": 4, "train.batch_size": 32,
       "train.micro_batch_size": 16, "rollout.micro_batch_size": 32, "eval.n_samples_per_prompt": 1,
       "algo.advantage.estimator": "gae", "critic.freezing_steps": 0, "reward.task": "addition",
       "ds.param_dtype": "fp32", "data.max_samples": 64, "eval.steps": -1,
       "actor.resources": {"node_a": 1}, "critic.resources": {"node_b": 1}}


@pytest.fixture
def cluster(s3_endpoint):  # after the S3 server: the nodes' environment carries its endpoint
    with two_node_cluster() as cluster:
        yield cluster


def test_an_rl_stage_on_two_nodes_puts_its_roles_on_both_and_everything_on_s3(s3_endpoint, cluster, prepared,
                                                                               harness, monkeypatch, tmp_path):  # noqa: F811
    import fsspec

    import orchestration.stages
    from flows.pipeline import rlhf
    from orchestration.ray_jobs import RayJobRunner
    from rlhf_core.infra import storage

    cluster.ready()  # started in the background while the other fixtures were made
    started = time.monotonic()
    fsspec.config.conf.clear()
    fs = fsspec.filesystem("s3")
    inputs = upload_inputs(prepared, "s3://models/multinode-inputs")
    output_root = f"s3://models/multinode-{tmp_path.name}"
    monkeypatch.setenv("RAY_ADDRESS", cluster.dashboard)
    monkeypatch.setenv("RLHF_JOB_COMMAND", f"{sys.executable} -m rlhf_core.cli")
    monkeypatch.setenv("RLHF_ARTIFACT_ROOT", "s3://models/mlartifacts")  # what the ranks log goes to S3 too
    lines: list[str] = []

    class RecordingRunner(RayJobRunner):
        def run(self, stage, args, env, log, **kwargs):
            return super().run(stage, args, env, lambda line: (lines.append(line), log(line)), **kwargs)

    monkeypatch.setattr(orchestration.stages, "RayJobRunner", RecordingRunner)
    result = rlhf(**params(
        settings={"stages": ["ppo"], "output_root": output_root, "experiment": "multinode", "retries": 0,
                  "checkpoint_steps": 1, "register_models": False},
        ppo={**PPO, "actor.model_name_or_path": inputs["base"], "data.prompt_dataset": inputs["prompts"],
             "eval.dataset": inputs["prompts"]}))
    log = "\n".join(lines)

    # (a) the actor on node A, the critic on node B
    placed = dict(re.findall(r"role '(actor|critic|ref)': rank 0 pid \d+ on \S+ \(nodes (\w+)\)", log))
    assert set(placed) == {"actor", "critic", "ref"}, log[-3000:]
    assert cluster.ids["a"].startswith(placed["actor"]) and cluster.ids["b"].startswith(placed["critic"])

    # (b) S3 only, and each node fetched what it needed itself
    run_root = result["outputs"]["ppo"].rsplit("/", 1)[0]
    paths = stage_config_paths(fs, run_root, "ppo")
    assert len(paths) >= 6 and all(p.startswith("s3://") for p in paths), paths
    assert storage.read_manifest(result["outputs"]["ppo"])["stage"] == "ppo"
    ckpt = f"{run_root}/checkpoints/ppo"
    fs.invalidate_cache()
    assert fs.cat(f"{ckpt}/latest") == b"global_step2"
    parts = {p.rsplit("/global_step2/", 1)[1].split("/")[0] for p in fs.find(f"{ckpt}/global_step2")}
    assert {"actor", "critic", "controller.pt", "rng_actor_rank0.pt", "rng_critic_rank0.pt"} <= parts, parts
    for name, node in cluster.nodes.items():
        assert list((node.home / "cache" / "downloads").glob("*/config.json")), f"node {name} downloaded no model"
        assert not staged_leftovers(node.home), name
    print(f"multinode: {time.monotonic() - started:.0f} s for the stage (cluster up before)")
