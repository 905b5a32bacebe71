"""flows/online.py: online RL from the champion, with promotion only on improvement."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.flow_helpers import flow_ctx, outcome


def test_online_rl_continues_from_the_champion_against_sft_and_promotes_only_on_improvement(tmp_path, monkeypatch):
    import yaml

    from flows import online as online_flow
    from flows.params import EvalParams, OnlineRLParams, PipelinePPOConfig, PipelineSettings, PrepParams
    from orchestration import lineage
    from orchestration.stages import StageOutcome

    prompts = tmp_path / "prep" / "data" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "train.jsonl").write_text('{"prompt": "cba", "answer": "abc"}\n')
    champion = outcome("champion", tmp_path)
    monkeypatch.setattr(lineage, "alias_version", lambda *a: SimpleNamespace(run_id="run-champion"))
    monkeypatch.setattr(lineage, "get_run", lambda run_id: run_id)
    monkeypatch.setattr(StageOutcome, "from_run", classmethod(lambda cls, run, name=None: champion))
    monkeypatch.setattr(lineage, "register_once", lambda *a: SimpleNamespace(name="rlhf-policy", version="7"))
    promoted = []
    monkeypatch.setattr(lineage, "promote", lambda name, version, metric, value: (promoted.append(value) or
                                                                               (value > 0.8, 0.8)))
    monkeypatch.setattr(online_flow, "publish_eval_report", lambda *a: {"markdown": ""})

    def go(value, start_from="champion", parent="parent-run", ppo_metrics=None, **online):
        jobs = []

        def run(job):
            jobs.append(job)
            return outcome(job.name, tmp_path, {"eval/ppo/sampled_accuracy": value, **(ppo_metrics or {})})

        upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
        ctx = flow_ctx(tmp_path)
        ctx.parent_run_id = parent
        result = online_flow.run_online(ctx, PipelineSettings(), PrepParams(), PipelinePPOConfig(), EvalParams(),
                                        OnlineRLParams(start_from=start_from, **online), upstream.__getitem__, run, {})
        return result, jobs

    result, (ppo, evaluation) = go(0.9)
    cfg = yaml.safe_load(ppo.config_yaml)
    assert cfg["actor"]["model_name_or_path"] == champion.output_uri == result["policy_in"]
    assert cfg["ref"]["model_name_or_path"] == str(tmp_path / "sft")  # KL to SFT, however many runs continued
    assert ppo.upstream["model"] is champion and ppo.upstream["reference"].name == "sft"
    assert evaluation.args[evaluation.args.index("--policy_names") + 1] == "ppo" and result["promoted"]
    assert not go(0.7)[0]["promoted"] and promoted == [0.9, 0.7]  # a regression stays a candidate
    other_run = go(0.9, parent="next-scheduled-run")[1][0]
    assert yaml.safe_load(other_run.config_yaml)["train"]["seed"] != cfg["train"]["seed"]  # fresh prompts
    assert other_run.config_hash != ppo.config_hash
    assert go(0.9, start_from="sft")[0]["policy_in"] == str(tmp_path / "sft")
    # the round stops where the reward-hacking guard fires, and the summary says where
    assert cfg["eval"]["stop_on_hacking"] and result["stopped_on_hacking_at_step"] is None
    stopped, (job, _) = go(0.7, ppo_metrics={"guard/stopped_step": 48.0})
    assert stopped["stopped_on_hacking_at_step"] == 48 and not stopped["promoted"]
    assert not yaml.safe_load(go(0.9, stop_on_hacking=False)[1][0].config_yaml)["eval"]["stop_on_hacking"]
    # against the task's verifier: no reward model in the job, the critic from the policy it continues
    assert cfg["reward"]["model_name_or_path"] == str(tmp_path / "rm") and ppo.upstream["reward"].name == "rm"
    job = go(0.9, reward="verifier")[1][0]
    verified = yaml.safe_load(job.config_yaml)
    assert verified["reward"]["task"] == PrepParams().task and verified["reward"]["model_name_or_path"] is None
    assert "reward" not in job.upstream and verified["critic"]["model_name_or_path"] == champion.output_uri
    # the verifier asked for beside a reward the `ppo` section names: refused, not silently dropped
    import pytest

    from flows.jobs import PipelineError

    with pytest.raises(PipelineError, match=r"online.reward verifier: the `ppo` section names its own reward \(remote"):
        online_flow.run_online(flow_ctx(tmp_path), PipelineSettings(), PrepParams(),
                               PipelinePPOConfig.model_validate({"reward": {"remote_url": "r.py"}}), EvalParams(),
                               OnlineRLParams(reward="verifier"), {n: outcome(n, tmp_path) for n in
                                                                   ("prep", "sft", "rm")}.__getitem__, None, {})
