"""W&B and TensorBoard beside MLflow (`rlhf_core/infra/loggers.py`): an SFT run with OpenRLHF's
`--use_wandb KEY` and `--use_tensorboard DIR` gives both the metrics MLflow gets, at the same steps,
with W&B offline (no network here), and the key reaches no record: not MLflow, not stage.json, not
the W&B run's files, not the output."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "wandbkey-0123456789abcdef0123456789abcdef01234567"


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in folder.iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_history(run_file: Path) -> tuple[dict[str, list[tuple[int, float]]], list, dict]:
    """The metric history in a W&B run file (`run-*.wandb`: a 7-byte header, then records in LevelDB's
    log format, 32 KiB blocks, each a `Record` protobuf), and its run records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block = run_file.read_bytes(), 7, 32768
    chunks, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            chunks.append(pending)
    history: dict[str, list[tuple[int, float]]] = {}
    runs, summary = [], {}
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in record.summary.update})
        elif kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return history, runs, summary


def test_wandb_and_tensorboard_get_mlflows_metrics_and_the_key_reaches_no_record(prepared, tmp_path, monkeypatch,
                                                                                 capsys):
    from mlflow import MlflowClient

    from rlhf_core.cli import main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "")  # restored (unset) after the test: the command exports the key
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "wandb").mkdir()
    out = tmp_path / "sft"
    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
                 "--eval_dataset", f"json@{prepared['sft']}", "--max_eval_samples", "16",
                 "--save_path", str(out), "--apply_chat_template", "--max_len", "48", "--train_batch_size", "16",
                 "--micro_train_batch_size", "8", "--max_steps", "3", "--mlflow_experiment", "loggers",
                 "--use_wandb", KEY, "--wandb_project", "demo", "--wandb_run_name", "sft-run",
                 "--use_tensorboard", str(tmp_path / "tb")])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    manifest = json.loads(captured.out[captured.out.index("{"):])

    client = MlflowClient(uri)
    run = client.get_run(manifest["mlflow_run_id"])
    mlflow_metrics = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                      for key in run.data.metrics}
    assert "train/loss" in mlflow_metrics and len(mlflow_metrics["train/loss"]) == 3

    board = tensorboard_scalars(tmp_path / "tb")
    assert set(board) == set(mlflow_metrics)
    for key, history in mlflow_metrics.items():
        assert [s for s, _ in board[key]] == [s for s, _ in history], key
        assert [v for _, v in board[key]] == pytest.approx([v for _, v in history], rel=1e-6), key

    (run_file,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    history, (wandb_run,), summary = wandb_history(run_file)
    assert (wandb_run.project, wandb_run.display_name) == ("demo", "sft-run")
    # the stage's `<name>_final` metrics (logged at step 0 once it ends) are W&B's run summary
    finals = {key for key in mlflow_metrics if key.endswith("_final")}
    assert finals and set(history) == set(mlflow_metrics) - finals
    for key, steps in mlflow_metrics.items():
        if key in finals:
            assert summary[key] == pytest.approx(steps[-1][1], rel=1e-6), key
            continue
        assert [s for s, _ in history[key]] == [s for s, _ in steps], key
        assert [v for _, v in history[key]] == pytest.approx([v for _, v in steps], rel=1e-6), key

    # The key: nowhere in what the run recorded or printed.
    assert KEY not in captured.out + captured.err
    assert run.data.params["logger.wandb.key"] == "**********"
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not leaks, leaks


def test_each_stage_run_in_one_process_writes_its_wandb_run_where_wandb_dir_says_then(tmp_path, monkeypatch):
    """W&B reads the environment once per process; stages run one after another in one process (a
    notebook, these tests) each put their W&B run under the WANDB_DIR of their own start."""
    from rlhf_core.config import WandbConfig
    from rlhf_core.infra.loggers import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / name))
        sink = WandbSink(WandbConfig(key=KEY).with_defaults("sft"), name, {})
        sink.log({"train/loss": 1.0}, 1)
        sink.close()
        assert len(list((tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb"))) == 1, name
