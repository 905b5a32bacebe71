"""Redaction rules, and every rlhf_core boundary where text becomes a record applying them."""

import json

import pytest

from rlhf_core.infra.redaction import REDACTED, inline_secrets, is_secret_key, redact, redact_text

ENV = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "RLHF_RM_TOKEN": "planted-rm-token-123",
       "MLFLOW_TRACKING_PASSWORD": "pl4nted-pw", "SHORT_TOKEN": "abc", "HOME": "/root/planted-home",
       "RAY_AUTH_TOKEN_PATH": "/root/.ray/auth_token", "RAY_AUTH_MODE": "token", "PWD": "/work/project",
       "GOOGLE_APPLICATION_CREDENTIALS": "/etc/gcp/key.json"}


@pytest.mark.parametrize("name", ["hf_token", "HF_TOKEN", "api_key", "aws_secret_access_key", "AWS_ACCESS_KEY_ID",
                                  "password", "wandb.password", "reward.auth_token", "client_secret", "DB_PASSWD",
                                  "MLFLOW_TRACKING_PASSWORD", "credentials", "AWS_SESSION_TOKEN"])
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["input_key", "chosen_key", "label_key", "max_new_tokens", "pad_token_id",
                                  "tokenizer_chat_template", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "token_file",
                                  "SSH_AUTH_SOCK", "author", "keyword", "PWD", "OLDPWD", "RAY_AUTH",
                                  "placeholder_token", "prm.data.placeholder_token", "reward_tokens", "pad_token"])
def test_names_that_are_not_secrets(name):
    assert not is_secret_key(name)


@pytest.mark.parametrize("text,expected", [
    ("s3://AKIAxx:secretvalue@bucket/data", "s3://***@bucket/data"),
    ("json@https://user:pw@host/d.jsonl", "json@https://***@host/d.jsonl"),
    ("http://127.0.0.1:5000/get_reward?token=abc123&n=2", "http://127.0.0.1:5000/get_reward?token=***&n=2"),
    ("https://h/x?X-Amz-Signature=deadbeef&X-Amz-Credential=AK%2F1&v=1",
     "https://h/x?X-Amz-Signature=***&X-Amz-Credential=***&v=1"),
    ("https://h/x?api_key=k1&sig=s&key=k2", "https://h/x?api_key=***&sig=***&key=***"),
    ("loading hf_abcdefghijklmn now", "loading *** now"),
    ("Authorization with sk-proj-abcdefghij", "Authorization with ***"),
    ("keys AKIAIOSFODNN7EXAMPLE in a log", "keys *** in a log"),
    # Not secrets: the text stays as it is.
    ("json@/data/prep?split=train", "json@/data/prep?split=train"),
    ("s3://bucket/models/sft", "s3://bucket/models/sft"),
    ("task-abcdefghijkl and mask-abcdefghijk", "task-abcdefghijkl and mask-abcdefghijk"),
    ("user@example.com wrote it", "user@example.com wrote it"),
])
def test_redact_text(text, expected):
    assert redact_text(text, environ={}) == expected


def test_the_values_of_credential_environment_variables_are_redacted_wherever_they_appear():
    text = ("job env: key=wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY, tok planted-rm-token-123;"
            " pw=pl4nted-pw; home /root/planted-home; abc stays; path /root/.ray/auth_token; "
            "out /work/project/.rlhf/pipelines/x; key file /etc/gcp/key.json; mode token")
    out = redact_text(text, environ=ENV)
    for secret in ("wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "planted-rm-token-123", "pl4nted-pw"):
        assert secret not in out
    # Non-credential variables (and credential values too short to search for) are left alone.
    assert "/root/planted-home" in out and "abc stays" in out and "/root/.ray/auth_token" in out
    # The working directory (PWD) and a credential's *location* are paths the records need.
    assert "out /work/project/.rlhf/pipelines/x" in out and "key file /etc/gcp/key.json" in out
    assert out.endswith("mode token")


def test_redact_nested_values_by_name_and_by_content():
    values = {"hf_token": "anything", "data": {"input_key": "prompt", "dataset": "s3://u:p@b/d"},
              "reward": {"remote_url": "http://h/r?token=t0k3n", "auth_token": None},
              "list": ["ok", "x planted-rm-token-123 y"], "n": 3}
    assert redact(values, environ=ENV) == {
        "hf_token": REDACTED, "data": {"input_key": "prompt", "dataset": "s3://***@b/d"},
        "reward": {"remote_url": "http://h/r?token=***", "auth_token": None},
        "list": ["ok", f"x {REDACTED} y"], "n": 3}


def test_inline_secrets_names_every_path_that_carries_one(monkeypatch):
    monkeypatch.setenv("RLHF_RM_TOKEN", "planted-rm-token-123")
    params = {"settings": {"output_root": "s3://bucket/rlhf", "stages": ["sft"]},
              "sft": {"dataset": "json@s3://ak:sk@bucket/d", "learning_rate": 1e-3, "api_key": "k",
                      "input_key": "prompt"},
              "ppo": {"reward": {"remote_url": "http://h/get_reward?token=x"}, "note": "planted-rm-token-123"},
              "eval": {"hf_token": None}}
    assert inline_secrets(params) == ["sft.dataset", "sft.api_key", "ppo.reward.remote_url", "ppo.note"]
    assert inline_secrets({"settings": {"output_root": "s3://bucket/rlhf"}}) == []


def test_stage_manifest_and_its_published_copy_carry_no_secret(tmp_path, monkeypatch):
    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.infra import storage
    from rlhf_core.infra.manifests import stage_manifest

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV["AWS_SECRET_ACCESS_KEY"])
    cfg = build_config(STAGE_CONFIGS["sft"], None, {"pretrain": "s3://ak:sk@bucket/base",
                                                    "dataset": "json@https://h/d?token=t0k3n",
                                                    "save_path": str(tmp_path / "out")})
    manifest = stage_manifest(cfg, {"pretrain": cfg.pretrain, "datasets": [{"spec": cfg.data.dataset}],
                                    "note": ENV["AWS_SECRET_ACCESS_KEY"]}, {"loss": 1.0}, None)
    manifest["output_uri"] = "s3://ak:sk@bucket/out"  # as publish adds it, after the manifest is built
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w")
    storage.publish_dir(tmp_path / "model", str(tmp_path / "out"), manifest)
    written = (tmp_path / "out" / storage.MANIFEST).read_text()
    for secret in ("ak:sk", "t0k3n", ENV["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in written
    assert json.loads(written)["inputs"]["pretrain"] == "s3://***@bucket/base"


def test_the_tracker_redacts_params_tags_and_text_artifacts(tmp_path, monkeypatch):
    import mlflow

    from rlhf_core.infra import tracking

    monkeypatch.setenv("RLHF_RM_TOKEN", ENV["RLHF_RM_TOKEN"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    tracker = tracking.Tracker(True, "redaction", "run", None)
    tracker.log_params({"reward": {"remote_url": "http://u:p@h/r?api_key=k9"}, "hf_token": "hf_abcdefghijkl"})
    tracker.set_tags({"rlhf.input.model": "s3://ak:sk@b/m", "note": f"tok {ENV['RLHF_RM_TOKEN']}"})
    (tmp_path / "stage.json").write_text(json.dumps({"pretrain": "s3://ak:sk@b/m", "t": ENV["RLHF_RM_TOKEN"]}))
    (tmp_path / "weights.bin").write_bytes(b"\x00binary")
    tracker.log_artifact(str(tmp_path / "stage.json"))
    tracker.log_artifact(str(tmp_path / "weights.bin"))
    tracker.finish()
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(tracker.run_id)
    assert run.data.params == {"reward.remote_url": "http://***@h/r?api_key=***", "hf_token": REDACTED}
    assert run.data.tags["rlhf.input.model"] == "s3://***@b/m" and run.data.tags["note"] == f"tok {REDACTED}"
    artifacts = tmp_path / "artifacts"
    mlflow.artifacts.download_artifacts(run_id=tracker.run_id, dst_path=str(artifacts))
    stored = (artifacts / "stage.json").read_text()
    assert "ak:sk" not in stored and ENV["RLHF_RM_TOKEN"] not in stored and "s3://***@b/m" in stored
    assert (artifacts / "weights.bin").read_bytes() == b"\x00binary"


def test_parameters_with_an_inline_secret_are_refused_with_their_names():
    from rlhf_core.infra.redaction import refuse_inline_secrets
    from rlhf_core.infra.settings import ConfigError

    with pytest.raises(ConfigError, match=r"flow parameters: sft\.dataset, ppo\.api_key carries a credential inline"):
        refuse_inline_secrets({"sft": {"dataset": "json@s3://ak:sk@b/d"}, "ppo": {"api_key": "k"}}, "flow parameters")
    refuse_inline_secrets({"sft": {"dataset": "json@s3://b/d", "input_key": "prompt"}}, "flow parameters")


def test_a_pipeline_config_with_an_inline_secret_is_refused_before_prefect_stores_it():
    from flows.cli import flow_parameters
    from rlhf_core.infra.settings import ConfigError

    with pytest.raises(ConfigError, match=r"--config: sft\.data\.dataset carries a credential inline.*Prefect Secret"):
        flow_parameters({"sft": {"dataset": "json@s3://ak:sk@bucket/d"}})
    with pytest.raises(ConfigError, match=r"ppo\.reward\.remote_url carries"):
        flow_parameters({"ppo": {"reward": {"remote_url": "http://127.0.0.1:5000/get_reward?token=abc"}}})
    flow_parameters({"sft": {"dataset": "json@s3://bucket/d"}})  # a plain URI is fine


def test_the_flow_refuses_inline_secrets_itself(monkeypatch):
    """A deployment run's parameters never pass through `rlhf pipeline run`: the flow checks them first."""
    from flows.cli import flow_parameters
    from flows.pipeline import rlhf
    from orchestration import lineage
    from rlhf_core.infra.settings import ConfigError

    started = []
    monkeypatch.setattr(lineage, "start_pipeline_run", lambda *a, **k: started.append(a))
    params = flow_parameters({})
    params["settings"] = params["settings"].model_copy(update={"output_root": "s3://ak:sk@bucket/rlhf"})
    with pytest.raises(ConfigError, match=r"flow parameters: settings\.output_root carries a credential inline"):
        rlhf.fn(**params)
    assert started == []
