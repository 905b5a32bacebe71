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
