"""Planted secrets reach no record: an RL run whose reward URL carries a token, with credential variables set.

The policy is prep's untrained tiny model: what is tested is where text goes, not learning. The run talks to a real reward server (bearer token from RLHF_RM_TOKEN) through a URL that also
carries a token-like query parameter, tracks to MLflow, and publishes its model. Then every store
it wrote is searched byte for byte: the MLflow database and artifact folder, the stage output,
and everything the command printed.
"""

from pathlib import Path

import pytest

from rlhf_core.cli import main
from rlhf_core.rewards import load_reward_file
from rlhf_core.rewards.server import serve_reward

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PLANTED = {
    "RLHF_RM_TOKEN": "planted-rm-bearer-7d1e",
    "AWS_SECRET_ACCESS_KEY": "plantedAwsSecret0123456789",
    "HF_TOKEN": "hf_plantedHubToken0123",
    "MLFLOW_TRACKING_PASSWORD": "planted-mlflow-pw",
}
QUERY_TOKEN = "planted-query-token-55"
REWARD_FILE = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([float(len(q) % 2) for q in queries])
'''


def stored_files(*roots: Path):
    for root in roots:
        yield from (p for p in root.rglob("*") if p.is_file())


def test_no_planted_secret_reaches_mlflow_outputs_or_logs(prepared, tmp_path, monkeypatch, capsys):
    from rlhf_core.infra.settings import state_dir

    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    home = tmp_path / "home"
    monkeypatch.setenv("RLHF_HOME", str(home))
    # MLflow exports the tracking URI an earlier test set (MLFLOW_TRACKING_URI): name this run's store.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home}/mlflow.db")
    with serve_reward(load_reward_file(str(reward_file)), port=0, token=PLANTED["RLHF_RM_TOKEN"],
                      background=True) as server:
        url = f"{server.url}?api_key={QUERY_TOKEN}"
        code = main(["train", "ppo", "--actor.model_name_or_path", prepared["base"],
                     "--data.prompt_dataset", f"json@{prepared['prompts']}", "--reward.remote_url", url,
                     "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                     "--rollout.batch_size", "8", "--train.batch_size", "16", "--train.micro_batch_size", "16",
                     "--train.max_steps", "2", "--ds.param_dtype", "fp32", "--ckpt.output_dir",
                     str(tmp_path / "out"), "--use_mlflow", "true", "--mlflow_experiment", "secrets"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert state_dir() == home and (home / "mlflow.db").exists()
    files = list(stored_files(home, tmp_path / "out"))
    assert any(p.name == "stage.json" for p in files) and any(p.suffix == ".db" for p in files)
    secrets = [*PLANTED.values(), QUERY_TOKEN]
    for path in files:
        data = path.read_bytes()
        leaked = [s for s in secrets if s.encode() in data]
        assert not leaked, f"{leaked} found in {path}"
    for stream in (printed.out, printed.err):
        assert not [s for s in secrets if s in stream]
    # The run did record the URL it used, with the credential replaced.
    assert b"api_key=***" in (home / "mlflow.db").read_bytes()
