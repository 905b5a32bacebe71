"""A killed RL run, resumed, ends with exactly the weights of an uninterrupted one (fp32, CPU).

The kill is real: the reward function (a reward file, as users write them) SIGKILLs its own
process during the third rollout step, after the step-2 checkpoint. The resumed run must restore
the actor, the critic, both optimizers and schedulers, the KL controller (adaptive here, so its
coefficient moves every step), the prompt position and every RNG, and push the restored weights to the rollout engine: any of these missing and the
final weights differ. That it resumed rather than restarted is checked by counting rollout steps.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

REWARD_FILE = '''
import os, signal
from pathlib import Path
import torch

COUNTER = Path(__file__).with_suffix(".calls")
KILL_AT = int(os.environ.get("TEST_KILL_AT_CALL", "0"))

ABANDON_AT = int(os.environ.get("TEST_ABANDON_AT_CALL", "0"))

def reward_func(queries, prompts, labels, **kwargs):
    calls = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(calls))
    if calls == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if calls == ABANDON_AT:  # what an orchestrator that gave this attempt up does: marks its run FAILED
        from mlflow import MlflowClient
        from rlhf_core.infra.settings import tracking_uri
        client = MlflowClient(tracking_uri())
        experiment = client.get_experiment_by_name(os.environ["MLFLOW_EXPERIMENT_NAME"]).experiment_id
        for found in client.search_runs([experiment], "attributes.status = 'RUNNING'"):
            client.set_terminated(found.info.run_id, "FAILED")
    out = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):].replace("<|eos|>", "").strip()
        out.append(1.0 if response == label else 0.0)
    return torch.tensor(out)
'''


def run(prepared, tmp_path: Path, name: str, *extra, kill_at: int = 0, env=None) -> subprocess.CompletedProcess:
    reward = tmp_path / f"{name}_reward.py"
    if not reward.exists():
        reward.write_text(REWARD_FILE)
    args = [sys.executable, "-m", "rlhf_core.cli", "train", "ppo", "--pretrain", prepared["base"],
            "--prompt_data", f"json@{prepared['prompts']}", "--remote_rm_url", str(reward),
            "--advantage_estimator", "gae", "--init_kl_coef", "0.05", "--kl_target", "0.001", "--kl_horizon", "16",
            "--rollout_batch_size", "8",
            "--train_batch_size", "4", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "8",
            "--max_epochs", "2", "--generate_max_len", "5", "--actor_learning_rate", "1e-3",
            "--critic_learning_rate", "1e-3", "--param_dtype", "fp32", "--use_mlflow", "false", "--seed", "3",
            "--max_steps", "4", "--save_steps", "2", "--ckpt_path", str(tmp_path / f"{name}_ckpt"),
            "--save_path", str(tmp_path / f"{name}_out"), *extra]
    env = {**os.environ, "TEST_KILL_AT_CALL": str(kill_at), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def synchronous(prepared, tmp_path_factory) -> Path:
    """The uninterrupted synchronous run's output."""
    tmp_path = tmp_path_factory.mktemp("synchronous")
    whole = run(prepared, tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    return tmp_path / "whole_out"


def test_a_killed_run_resumes_to_the_same_weights(prepared, synchronous, tmp_path):

    killed = run(prepared, tmp_path, "split", kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = tmp_path / "split_ckpt"
    assert (ckpt / "latest").read_text() == "global_step2"
    assert not (tmp_path / "split_out" / "stage.json").exists()  # nothing half-done looks finished

    resumed = run(prepared, tmp_path, "split", "--load_checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    # Steps 3 and 4 only: 2 killed-run calls + the killed one + 2. A restart from step 0 would also
    # end with equal weights (the run is deterministic) but call the reward 4 more times.
    assert (tmp_path / "split_reward.calls").read_text() == "5"
    a, b = weights(synchronous), weights(tmp_path / "split_out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = weights(Path(prepared["base"]))
    assert not all(torch.equal(a[k], first[k]) for k in a if k in first)  # it trained at all
    manifest = json.loads((tmp_path / "split_out" / "stage.json").read_text())
    assert manifest["metrics"]["train/steps"] == 4


def test_an_async_run_trains_on_batches_sampled_ahead_and_a_killed_one_resumes_to_its_weights(
        prepared, synchronous, tmp_path):
    """--async_train: step t trains on the batch the policy of update t-1 sampled while step t-1
    trained. The checkpoint keeps that batch: the resume trains on it rather than sampling it
    again, by the restored policy (which would give other weights and one more reward call)."""
    whole = run(prepared, tmp_path, "async", "--async_train")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "staleness=1" in whole.stderr
    metrics = json.loads((tmp_path / "async_out" / "stage.json").read_text())["metrics"]
    assert metrics["rollout/staleness"] == 1.0 and metrics["train/steps"] == 4
    a, sync = weights(tmp_path / "async_out"), weights(synchronous)
    assert not all(torch.equal(a[k], sync[k]) for k in a)  # not the synchronous schedule

    # Reward calls: batches 0 (step 0), 1 (during step 0), 2 (during step 1), then the checkpoint
    # of step 2 with batch 2 waiting in it; call 4 samples batch 3 during step 2: killed there.
    killed = run(prepared, tmp_path, "async_split", "--async_train", kill_at=4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "async_split_ckpt" / "latest").read_text() == "global_step2"
    resumed = run(prepared, tmp_path, "async_split", "--async_train", "--load_checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stderr
    assert (tmp_path / "async_split_reward.calls").read_text() == "5"  # batch 3 only
    b = weights(tmp_path / "async_split_out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_attempt_its_orchestrator_gave_up_writes_no_further_checkpoint(prepared, tmp_path):
    """A driver that outlived its attempt (the flow marked its run FAILED and retries): at its next
    checkpoint it stops, exit 1 with one line, so it writes and rotates nothing more in the folder
    the retry resumes from, and publishes nothing. Here the run is ended during step 2's rollout."""
    experiment = "abandoned-rl"
    done = run(prepared, tmp_path, "abandoned", "--use_mlflow", "true", "--mlflow_experiment", experiment,
               "--save_steps", "1", env={"TEST_ABANDON_AT_CALL": "2", "MLFLOW_EXPERIMENT_NAME": experiment})
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert "was marked FAILED by another process" in errors[0] and "it stopped at step 2" in errors[0]
    assert (tmp_path / "abandoned_ckpt" / "latest").read_text() == "global_step1"  # step 2's never written
    assert (tmp_path / "abandoned_reward.calls").read_text() == "2"  # no step 3
    assert not (tmp_path / "abandoned_out" / "stage.json").exists()
