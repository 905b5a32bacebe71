import json

from rlhf_core.infra.tracking import REDACTED, redact, redact_params


def test_secrets_are_redacted_but_config_keys_are_not():
    params = redact_params({
        "hf_token": "hf_abcdefghijkl", "data": {"chosen_key": "chosen", "tokenizer_chat_template": "{{x}}"},
        "aws_secret_access_key": "x", "api_key": "k", "wandb": {"password": "p"},
        "pretrain": "s3://user:pass@bucket/model", "note": "sk-abcdefghijklmnop", "max_len": 64,
    })
    assert params["hf_token"] == REDACTED and params["aws_secret_access_key"] == REDACTED
    assert params["api_key"] == REDACTED and params["wandb.password"] == REDACTED
    assert params["note"] == REDACTED
    assert params["pretrain"] == f"s3://{REDACTED}@bucket/model"
    assert params["data.chosen_key"] == "chosen" and params["data.tokenizer_chat_template"] == "{{x}}"
    assert params["max_len"] == "64"


def test_redact_keeps_structure():
    assert redact({"a": [{"token": "t"}], "b": None}) == {"a": [{"token": REDACTED}], "b": None}


def test_lineage_shows_the_params_a_run_changed_from_its_stage_defaults():
    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.stages.provenance import params_off_default

    cfg = build_config(STAGE_CONFIGS["dpo"], None, {
        "pretrain": "/m/sft", "dataset": "json@/d", "save_path": "/o", "beta": 0.2, "max_len": 96, "ipo": True})
    logged = redact_params(cfg.model_dump(mode="json"))
    # Paths are the tree's parents, outputs and datasets; everything else left at its default is noise.
    assert params_off_default("dpo", logged) == {"model.beta": "0.2", "data.max_len": "96", "model.ipo_enable": "True",
                                               "model.loss_type": "ipo"}
    assert params_off_default("prep", {"task": "sort", "seed": "3"}) == {"task": "sort", "seed": "3"}
    assert params_off_default("dpo", logged | {"old_flag": "1"})["old_flag"] == "1"


def test_metrics_are_buffered_and_reach_mlflow_on_flush_and_on_finish(monkeypatch, tmp_path):
    import time

    import mlflow

    from rlhf_core.infra import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/m.db")
    writes = []
    real = mlflow.MlflowClient.log_batch
    monkeypatch.setattr(mlflow.MlflowClient, "log_batch",
                        lambda self, *a, **k: (writes.append(1) if k.get("metrics") else None) or real(self, *a, **k))
    tracker = tracking.Tracker(True, "buffered", "run", None)
    for step in range(1, 301):
        tracker.log_metrics({"train/loss": 1.0 / step, "train/lr": 0.1, "train/tokens_per_s": 5.0, "x": 1.0}, step)
    assert writes == []  # 300 steps inside FLUSH_SECONDS: nothing written yet
    history = mlflow.MlflowClient().get_metric_history(tracker.run_id, "train/loss")
    assert history == []
    assert tracker.flush()
    assert len(writes) == 2  # 1200 values in batches of at most 1000
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.05)
    tracker.metrics.wake()  # the sender thread picks up the new interval after its current wait
    tracker.log_metrics({"train/loss": 0.001}, 301)  # written in the background, within the interval
    deadline = time.monotonic() + 10
    while (len(writes) < 3 or len(tracker.metrics)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(writes) == 3 and len(tracker.metrics) == 0
    tracker.log_metrics({"eval/loss": 0.5}, 302)
    tracker.finish("FAILED")  # a crashed stage keeps what it measured
    history = mlflow.MlflowClient().get_metric_history(tracker.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 302)) and history[0].value == 1.0
    assert mlflow.MlflowClient().get_metric_history(tracker.run_id, "eval/loss")[0].step == 302
    assert mlflow.get_run(tracker.run_id).info.status == "FAILED"


def test_a_tracking_database_of_the_users_keeps_artifacts_under_the_state_dir_not_the_working_dir(monkeypatch, tmp_path):
    import mlflow

    from rlhf_core.infra import mlflow_ops

    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/users.db")
    monkeypatch.chdir(tmp_path)
    experiment = mlflow_ops.ensure_experiment("artifacts-where")
    location = mlflow.MlflowClient(f"sqlite:///{tmp_path}/users.db").get_experiment(experiment).artifact_location
    assert location == f"{(tmp_path / 'home' / 'mlartifacts').as_uri()}/artifacts-where"
    assert not (tmp_path / "mlruns").exists()


def test_a_stage_that_fails_after_publishing_withdraws_its_output(monkeypatch, tmp_path):
    """Any failure after `published()` (not only an unreachable store: a refusal, a bug, a SIGTERM at
    the stage timeout) leaves no stage.json: nothing looks finished whose run did not finish."""
    import mlflow

    from rlhf_core.infra import storage, tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/m.db")
    out = tmp_path / "sft"
    out.mkdir()
    (out / storage.MANIFEST).write_text('{"stage": "sft"}')
    tracker = tracking.Tracker(True, "withdraw", "run", None)
    tracker.published(str(out), "sft")
    # The store refuses the status (not a store failure, so not retried): finish still does not raise.
    monkeypatch.setattr(mlflow.MlflowClient, "set_terminated",
                        lambda *a, **k: (_ for _ in ()).throw(mlflow.exceptions.MlflowException("INVALID_STATE")))
    tracker.finish("FAILED")
    assert not (out / storage.MANIFEST).exists()
    marker = json.loads((out / storage.WRITING).read_text())
    assert marker["stage"] == "sft"  # marked unfinished: a retry of sft may replace it


def test_drain_gives_up_at_its_deadline_while_the_threads_batch_is_still_out():
    """A send that hangs in the background thread: drain returns False at its deadline (it used to
    spin until the request ended)."""
    import threading
    import time

    from rlhf_core.infra.tracking import MetricQueue

    release = threading.Event()
    queue = MetricQueue(lambda batch: release.wait(30), capacity=100, store="test")
    queue.add([1, 2, 3])
    queue.wake()
    deadline = time.monotonic() + 5
    while queue._in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert queue._in_flight == 3
    started, cpu = time.monotonic(), time.process_time()
    assert queue.drain(0.5) is False
    assert time.monotonic() - started < 2.0
    assert time.process_time() - cpu < 0.4, "drain spun while waiting"
    release.set()
    queue.stop()


def test_lineage_of_a_ppo_run_shows_its_changed_settings_not_its_paths():
    from flows.params import PipelinePPOConfig
    from rlhf_core.infra.tracking import redact_params
    from rlhf_core.stages.provenance import params_off_default

    cfg = PipelinePPOConfig.model_validate({"pretrain": "/m/sft", "reward_pretrain": "/m/rm", "save_path": "/o",
                                            "prompt_data": "json@/d", "ckpt.path": "/c", "max_steps": 7})
    shown = params_off_default("ppo", redact_params(cfg.model_dump(mode="json")))
    assert shown["train.max_steps"] == "7" and shown["algo.advantage.lambd"] == "0.95"  # tuned, off the CLI default
    assert not [k for k in shown if k.endswith(("model_name_or_path", "output_dir", "prompt_dataset", "ckpt.path"))]


def test_a_run_its_orchestrator_ended_is_not_recorded_and_its_output_is_left_to_the_retry(monkeypatch, tmp_path):
    """A job driver that outlived its Ray cluster keeps training while the flow, which gave the attempt
    up, marks the run FAILED and retries the stage (CI saw such a driver then mark the run FINISHED).
    The driver must not publish or record: AttemptAbandoned, the run stays FAILED, and an output it
    had already published is not withdrawn (by now it may be the retry's)."""
    import mlflow
    import pytest

    from rlhf_core.infra import storage, tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    tracker = tracking.Tracker(True, "abandoned", "run", None)
    tracker.await_store()  # still RUNNING: nothing to say
    out = tmp_path / "sft"
    out.mkdir()
    storage.write_manifest(out, {"stage": "sft"})
    tracker.published(str(out), "sft")
    mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db").set_terminated(tracker.run_id, "FAILED")
    with pytest.raises(tracking.AttemptAbandoned, match="marked FAILED by another process"):
        tracker.finish("FINISHED")
    tracker.finish("FAILED")  # what a stage's error path does next
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(tracker.run_id).info.status == "FAILED"
    assert (out / storage.MANIFEST).is_file()


def test_a_checkpoint_learns_of_an_ended_run_at_once_and_never_waits_long_on_the_store(monkeypatch, tmp_path):
    """`ended_elsewhere` (asked before each checkpoint): the status of a run another process ended,
    None while it runs, and None within its bound when the store hangs (training goes on)."""
    import time

    import mlflow

    from rlhf_core.infra import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    tracker = tracking.Tracker(True, "checkpoints", "run", None)
    assert tracker.ended_elsewhere() is None
    mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db").set_terminated(tracker.run_id, "KILLED")
    assert tracker.ended_elsewhere() == "KILLED"
    monkeypatch.setattr(tracker.ops.client, "get_run", lambda run_id: time.sleep(30))  # a store that hangs
    started = time.monotonic()
    assert tracker.ended_elsewhere(wait_s=0.5) is None and time.monotonic() - started < 2
    assert tracking.Tracker(False, "checkpoints", "off", None).ended_elsewhere() is None


def test_a_stage_whose_run_fails_to_record_its_params_marks_it_failed(monkeypatch):
    """The recipe marks its run's end once it holds the stage's context; a failure while the run is
    being filled (a refused param, an unreachable store, a Ctrl-C) must not leave it RUNNING."""
    import os
    from types import SimpleNamespace

    import pytest
    import torch

    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.trainers import common

    ends = []

    class Refusing:
        def __init__(self, *args, **kwargs):
            pass

        def attach_sinks(self, sinks):
            pass

        def log_params(self, params):
            pass

        def log_datasets(self, sources, context):
            raise RuntimeError("the store refused the dataset")

        def finish(self, status="FINISHED"):
            ends.append(status)

    monkeypatch.setattr(common, "Tracker", Refusing)
    # as a rank of a started group: joining one here would leave its rank variables in this
    # worker's environment and DeepSpeed's communicator set, for every later test of the worker
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    cfg = build_config(STAGE_CONFIGS["sft"], None, {"pretrain": "/m", "dataset": "json@/d", "save_path": "/o"})
    environment = dict(os.environ)
    with pytest.raises(RuntimeError, match="refused the dataset"):
        common.start_stage(cfg, SimpleNamespace(train_sources=[], eval_sources=[]))
    assert ends == ["FAILED"] and dict(os.environ) == environment
