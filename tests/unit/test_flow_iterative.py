"""flows/iterative.py: the settings hash of each iterative-DPO round's pairs job."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.flow_helpers import flow_ctx, outcome, perturbed


def pairs_keys(tmp_path, monkeypatch, iterative, prep=None, parent="parent-run") -> list[str]:
    """The config hash of each round's pairs job, from `run_rounds` with every job faked."""
    return [job.config_hash for job in round_jobs(tmp_path, monkeypatch, iterative, prep, parent) if job.stage == "pairs"]


def round_jobs(tmp_path, monkeypatch, iterative, prep=None, parent="parent-run", promote=lambda *a: (False, None),
               result=None, rollout_gpus: float = 0, pairs_made=lambda r: 4) -> list:
    """Every job `run_rounds` submits, each faked (`promote`: the registry's answer; `result`: a dict
    that gets `run_rounds`' return value; `pairs_made(round)`: how many pairs that round's job made)."""
    from flows import iterative as iterative_flow
    from flows.params import EvalParams, PipelineDPOConfig, PipelineSettings, PrepParams
    from orchestration import lineage

    monkeypatch.setattr(lineage, "alias_version", lambda *a: None)  # no champion yet: start from SFT
    monkeypatch.setattr(lineage, "register_once", lambda *a: SimpleNamespace(name="rlhf-policy", version="1"))
    monkeypatch.setattr(lineage, "promote", promote)
    monkeypatch.setattr(iterative_flow, "publish_eval_report", lambda *a: {"markdown": ""})
    jobs = []

    def run(job):
        jobs.append(job)
        if job.stage == "pairs":
            return outcome(job.name, tmp_path, {"pairs/num_pairs": pairs_made(int(job.name.removeprefix("pairs-round"))),
                                                "pairs/mean_reward": 0.0})
        return outcome(job.name, tmp_path, {"eval/dpo/sampled_accuracy": 1.0})

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
    ctx = flow_ctx(tmp_path)
    ctx.parent_run_id, ctx.rollout_gpus = parent, rollout_gpus
    out = iterative_flow.run_rounds(ctx, PipelineSettings(), prep or PrepParams(), PipelineDPOConfig(), EvalParams(),
                                    iterative, upstream.__getitem__, run, {})
    if result is not None:
        result.update(out)
    return jobs


def test_pairs_key_moves_with_every_iterative_field_the_round_uses(tmp_path, monkeypatch):
    from flows.iterative import PAIRS_NOT_IN_KEY
    from flows.params import IterativeDPOParams, PrepParams

    # widening this needs a reason
    assert PAIRS_NOT_IN_KEY == {"rounds", "start_from", "seed", "learning_rate", "stop_early"}
    for base_params in (IterativeDPOParams(), IterativeDPOParams(seed=5)):
        (base,) = pairs_keys(tmp_path, monkeypatch, base_params)
        assert pairs_keys(tmp_path, monkeypatch, base_params.model_copy()) == [base]
        for name in IterativeDPOParams.model_fields:
            first_round = pairs_keys(tmp_path, monkeypatch, perturbed(base_params, name))[0]
            # `seed` is excluded as a field but enters as the round's sampling seed, which it changes
            assert (first_round != base) == (name not in {"rounds", "start_from", "learning_rate", "stop_early"}), \
                (name, base_params)
        assert pairs_keys(tmp_path, monkeypatch, base_params, prep=perturbed(PrepParams(), "task")) != [base]

    class Later(IterativeDPOParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert pairs_keys(tmp_path, monkeypatch, Later()) != pairs_keys(tmp_path, monkeypatch, Later(new_knob=1))
    two = pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(rounds=2, seed=5))
    assert two[0] == pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5))[0] and two[1] != two[0]
    # unpinned, the sampling seed is drawn per pipeline run; pinned, it is the same in every run
    assert pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(), parent="other-run") != \
        pairs_keys(tmp_path, monkeypatch, IterativeDPOParams())
    assert pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5), parent="other-run") == \
        pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5))


def test_a_round_samples_on_its_engines_and_its_driver_holds_a_gpu_only_when_it_generates(tmp_path, monkeypatch):
    """`iterative.num_engines` reaches `rlhf pairs`; a driver whose engines are Ray actors of their own
    reserves no GPU of `settings.rollout_gpus` (its engines take theirs)."""
    from flows.params import IterativeDPOParams

    for engines, driver_gpus in ((1, 1.0), (3, 0)):
        (pairs,) = [j for j in round_jobs(tmp_path, monkeypatch, IterativeDPOParams(num_engines=engines),
                                          rollout_gpus=1.0) if j.stage == "pairs"]
        assert pairs.args[pairs.args.index("--num_engines") + 1] == str(engines)
        assert pairs.num_gpus == driver_gpus, engines


def test_a_round_trains_dpo_at_its_own_learning_rate(tmp_path, monkeypatch):
    """The round's DPO takes `iterative.learning_rate` (from a policy RL moved; the `dpo` section's is
    tuned from SFT), the rest of the `dpo` section as it is."""
    import yaml

    from flows.params import IterativeDPOParams, PipelineDPOConfig

    for lr in (2e-5, 7e-6):
        (dpo,) = [j for j in round_jobs(tmp_path, monkeypatch, IterativeDPOParams(learning_rate=lr)) if j.stage == "dpo"]
        written = yaml.safe_load(dpo.config_yaml)
        assert written["adam"]["lr"] == lr and written["model"]["beta"] == PipelineDPOConfig().model.beta
    assert PipelineDPOConfig().adam.lr == 1e-4 and IterativeDPOParams().learning_rate == 2e-5


def test_a_round_that_does_not_beat_the_champion_ends_the_run_and_says_why(tmp_path, monkeypatch):
    """With a champion that a round does not beat, the next round would start from that champion again:
    the run stops there, saying so; without a champion, or with `stop_early: false`, every round runs."""
    from flows.params import IterativeDPOParams

    def trained(**kw) -> tuple[list, dict]:
        result: dict = {}
        jobs = round_jobs(tmp_path, monkeypatch, IterativeDPOParams(rounds=3, **kw.pop("params", {})), result=result,
                          **kw)
        return [j.name for j in jobs if j.stage == "dpo"], result

    names, result = trained(promote=lambda *a: (False, 1.5))  # the champion's 1.5 beats the round's 1.0
    assert names == ["dpo-round1"] and len(result["rounds"]) == 1
    assert result["stopped_early"].startswith("round 1's policy (sampled_accuracy 1.0000) did not beat the champion "
                                              "(1.5000), which stays; round 2 would start again from the policy "
                                              "round 1 started from (")
    assert "stopped after round 1 of 3" in result["stopped_early"]
    names, result = trained(promote=lambda *a: (False, 1.5), params={"stop_early": False})
    assert names == ["dpo-round1", "dpo-round2", "dpo-round3"] and result["stopped_early"] is None
    names, result = trained(promote=lambda *a: (True, 0.5))
    assert len(names) == 3 and result["stopped_early"] is None


def test_a_round_whose_samples_give_no_pair_trains_nothing_and_says_why(tmp_path, monkeypatch):
    """A policy whose samples all score alike (the verifier finds none right) gives no pair: the round
    asks its pairs job for an empty set rather than a failure, trains and registers nothing, and the
    run stops saying why; with `stop_early: false` the next round samples again."""
    from flows.params import IterativeDPOParams

    result: dict = {}
    jobs = round_jobs(tmp_path, monkeypatch, IterativeDPOParams(rounds=3), result=result, pairs_made=lambda r: 0)
    assert [j.name for j in jobs] == ["pairs-round1"] and "--allow_no_pairs" in jobs[0].args
    (first,) = result["rounds"]
    assert first["trained"] is False and first["promoted"] is False and first["pairs"]["pairs/num_pairs"] == 0
    assert result["stopped_early"].startswith("round 1 made no preference pair: all 4 samples of each of its 512 "
                                              "prompts scored alike by the verifier (mean reward 0.0000)")
    assert "stopped after round 1 of 3" in result["stopped_early"] and result["final_policy"] == first["policy_in"]

    jobs = round_jobs(tmp_path, monkeypatch, IterativeDPOParams(rounds=3, stop_early=False), result=result,
                      pairs_made=lambda r: 4 if r == 2 else 0)
    assert [j.name for j in jobs if j.stage == "dpo"] == ["dpo-round2"] and result["stopped_early"] is None
    assert [r.get("trained", True) for r in result["rounds"]] == [False, True, False]
    assert "round 3 made no preference pair" in result["rounds"][2]["skipped"]


def test_rounds_and_scheduled_runs_sample_other_windows_of_the_training_prompts(tmp_path, monkeypatch):
    """Each round's `rlhf pairs` samples the window of `n_prompts` training prompts its seed picks:
    the rounds of one run, and runs with other seeds (every scheduled run), walk the prompts rather
    than taking the first `n_prompts` every time; a window never starts past the last prompt."""
    from flows.params import IterativeDPOParams, PrepParams

    def windows(iterative, prep=PrepParams(), parent="parent-run"):
        out = []
        for job in round_jobs(tmp_path, monkeypatch, iterative, prep, parent, promote=lambda *a: (True, None)):
            if job.stage == "pairs":
                assert "--max_samples" not in job.args
                size = int(job.args[job.args.index("--rollout_batch_size") + 1])
                out.append(int(job.args[job.args.index("--iter") + 1]))
                assert size == iterative.n_prompts and (out[-1] + 1) * size <= max(prep.n_train, size)
        return out

    three = windows(IterativeDPOParams(rounds=3, seed=7))
    assert len(set(three)) == 3  # consecutive rounds: consecutive windows
    runs = {tuple(windows(IterativeDPOParams(), parent=f"scheduled-{i}")) for i in range(6)}
    assert len(runs) > 1  # scheduled runs (a seed drawn per run) sample other prompts
    assert windows(IterativeDPOParams(rounds=2, n_prompts=4096), prep=PrepParams(n_train=4000)) == [0, 0]


def test_a_run_taking_prep_from_an_earlier_run_uses_the_settings_that_prep_was_made_with(tmp_path):
    """A scheduled round (`from_run: champion`, no prep section) reads prep's data as it was made:
    its task and its number of training prompts (the prompt windows), not this run's defaults; a
    prep field this run sets otherwise is refused, naming both values."""
    import pytest

    from flows.iterative import prompt_window_index
    from flows.jobs import PipelineError, prep_made
    from flows.params import IterativeDPOParams, PrepParams
    from tests.unit.flow_helpers import outcome

    earlier = outcome("prep", tmp_path)
    earlier.manifest["config"] = {"task": "addition", "n_train": 1024, "n_test": 32, "seed": 0, "vocab_size": 384}
    prep = prep_made(earlier, PrepParams())
    assert (prep.task, prep.n_train, prep.n_test) == ("addition", 1024, 32)
    assert all(prompt_window_index(prep, IterativeDPOParams(), seed) < 2 for seed in range(50))  # 1024 // 512
    assert prep_made(earlier, PrepParams(n_train=1024, demo_error_rate=0.1)).demo_error_rate == 0.1  # not recorded
    with pytest.raises(PipelineError, match="prep.n_train 2048 \\(its prep made 1024\\)"):
        prep_made(earlier, PrepParams(n_train=2048))
    # The Prefect UI's custom-run form submits every field at its default: those are not choices
    ui_form = PrepParams(**PrepParams().model_dump())
    assert (prep_made(earlier, ui_form).task, prep_made(earlier, ui_form).n_train) == ("addition", 1024)
