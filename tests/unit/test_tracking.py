from rlhf_core.tracking import REDACTED, redact, redact_params


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
    from rlhf_core.lineage import params_off_default

    cfg = build_config(STAGE_CONFIGS["dpo"], None, {
        "pretrain": "/m/sft", "dataset": "json@/d", "save_path": "/o", "beta": 0.2, "max_len": 96, "ipo": True})
    logged = redact_params(cfg.model_dump(mode="json"))
    # Paths are the tree's parents, outputs and datasets; everything else left at its default is noise.
    assert params_off_default("dpo", logged) == {"beta": "0.2", "data.max_len": "96", "ipo": "True", "loss_type": "ipo"}
    assert params_off_default("prep", {"task": "sort", "seed": "3"}) == {"task": "sort", "seed": "3"}
    assert params_off_default("dpo", logged | {"old_flag": "1"})["old_flag"] == "1"
