"""flows/params.py (through flows/cli.py's flow_parameters): the flow's parameters, defaults and checks."""

from __future__ import annotations

import pytest

from rlhf_core.infra.settings import ConfigError
from tests.unit.flow_helpers import ppo_job_for


def test_flow_parameters_validate_every_section():
    from flows.cli import flow_parameters

    params = flow_parameters({"settings": {"stages": ["sft", "prep"]}, "sft": {"learning_rate": 1e-4}})
    assert [s.value for s in params["settings"].stages] == ["sft", "prep"]
    assert params["sft"].adam.lr == 1e-4 and params["sft"].pretrain is None
    assert params["sft"].data.max_len == 64  # the embedded-default sizes
    with pytest.raises(ConfigError, match="unknown section"):
        flow_parameters({"sfft": {}})
    with pytest.raises(ConfigError, match="(?s)sft.*--learning_rate"):
        flow_parameters({"sft": {"learning_rate": -1}})
    with pytest.raises(ConfigError, match="settings.stages"):
        flow_parameters({"settings": {"stages": ["sft", "ppo2"]}})
    with pytest.raises(ConfigError, match="iterative.n_samples_per_prompt"):
        flow_parameters({"iterative": {"n_samples_per_prompt": 1}})


def test_pipeline_ppo_section_reads_every_spelling_and_keeps_derived_fields_open(tmp_path):
    from flows.cli import flow_parameters
    from flows.params import PipelinePPOConfig

    ppo = flow_parameters({"ppo": {"max_steps": 3, "actor": {"adam": {"lr": 1e-4}}, "rollout.batch_size": 64}})["ppo"]
    assert (ppo.train.max_steps, ppo.actor.adam.lr, ppo.rollout.batch_size) == (3, 1e-4, 64)
    assert ppo.algo.advantage.estimator == "gae" and ppo.critic.freezing_steps == 10  # tuned defaults under it
    # Prefect stores a deployment's parameters as JSON: nothing derived from empty inputs may freeze.
    again = PipelinePPOConfig.model_validate(ppo.model_dump(mode="json"))
    assert again.rollout.max_new_tokens is None and again.critic.model_name_or_path is None
    assert ppo_job_for(tmp_path, again.model_dump(mode="json"))[3]["rollout"]["max_new_tokens"] == 16
    # and validates the instance itself when it calls the flow: nothing derived there either, nor
    # written into the instance it was given (it derived 1024 new tokens, 2048 for data.max_len)
    from flows.pipeline import rlhf

    called = rlhf.validate_parameters({"ppo": ppo})["ppo"]
    for cfg in (called, ppo):
        assert (cfg.rollout.max_new_tokens, cfg.data.max_len, cfg.critic.model_name_or_path) == (None, None, None)
    assert called.train.max_steps == 3
    assert ppo_job_for(tmp_path, called.model_dump(mode="json"))[3]["rollout"]["max_new_tokens"] == 16
    with pytest.raises(ConfigError, match=r"(?s)section ppo.*--actor.adam.lr"):
        flow_parameters({"ppo": {"actor.adam.lr": -1}})


def test_default_pipeline_is_sft_rm_ppo_eval_on_the_rl_setting():
    from flows.params import EvalParams, PipelineSettings, PrepParams

    assert [s.value for s in PipelineSettings().stages] == ["prep", "sft", "rm", "ppo", "eval"]
    assert PrepParams().demo_error_rate == 0.3 and EvalParams().promote_metric == "sampled_accuracy"


def test_old_promote_metrics_are_mapped_or_refused_with_what_to_write():
    from pydantic import ValidationError

    from flows.params import EvalParams

    assert EvalParams(n_kl_samples=2).n_samples_per_prompt == 2  # its older spelling
    with pytest.raises(ValidationError, match="older spelling"):
        EvalParams(n_kl_samples=2, n_samples_per_prompt=4)
    for old, new in (("eval/policy_exact_match", "greedy_accuracy"), ("eval/policy_reward", "reward"),
                     ("eval/win_rate", "win_rate"), ("eval/kl", "kl"), ("pass_at_4", "pass_at_4")):
        assert EvalParams(promote_metric=old).promote_metric == new
    with pytest.raises(ValidationError, match="write the metric name without `eval/<name>/`, e.g. 'sampled_accuracy'"):
        EvalParams(promote_metric="eval/ppo/sampled_accuracy")
    with pytest.raises(ValidationError, match="reference's metrics cannot promote"):
        EvalParams(promote_metric="eval/reference_exact_match")
    with pytest.raises(ValidationError, match="valid: greedy_accuracy, sampled_accuracy"):
        EvalParams(promote_metric="accuracy")
