"""flows/pipeline.py: registering every evaluated policy and moving the champion alias."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.unit.flow_helpers import outcome


def test_every_policy_registers_and_champion_moves_to_the_best_of_them_and_the_champion(tmp_path, monkeypatch):
    from flows import pipeline
    from flows.params import EvalParams
    from orchestration import lineage

    versions, aliases, tags = {}, {}, {}

    def register_once(stage, uri, run_id):
        v = versions.setdefault(run_id, SimpleNamespace(name="rlhf-policy" if stage in ("dpo", "ppo") else stage,
                                                        version=str(len(versions) + 1), tags={"rlhf.output_uri": uri}))
        return v

    def alias_version(name, alias):
        number = aliases.get(alias)
        return next((SimpleNamespace(version=v.version, tags={**v.tags, **tags.get(v.version, {})})
                     for v in versions.values() if v.version == number), None)

    monkeypatch.setattr(lineage, "register_once", register_once)
    monkeypatch.setattr(lineage, "alias_version", alias_version)
    monkeypatch.setattr(lineage, "set_alias", lambda name, alias, version: aliases.__setitem__(alias, version))

    def promote(name, version, metric, value):
        tags.setdefault(version, {})[f"rlhf.eval.{metric}"] = str(value)
        champion = alias_version(name, "champion")
        previous = lineage.recorded_value(champion, metric) if champion else None
        if champion is None or previous is None or value > previous:
            aliases["champion"] = version
            return True, previous
        return False, previous

    monkeypatch.setattr(lineage, "promote", promote)

    def outcomes(dpo_value, ppo_value, tag):
        os_ = {n: outcome(n, tmp_path) for n in ("sft", "rm", "dpo", "ppo")}
        for n in ("dpo", "ppo"):
            os_[n].manifest = {"mlflow_run_id": f"{tag}-{n}"}
        os_["eval"] = outcome("eval", tmp_path, {"eval/dpo/sampled_accuracy": dpo_value,
                                                 "eval/ppo/sampled_accuracy": ppo_value})
        return os_

    first = pipeline._register(outcomes(0.70, 0.82, "a"), EvalParams(), ["dpo", "ppo"])
    assert set(first["policies"]) == {"dpo", "ppo"}
    assert first["policy"]["best"] == "ppo" and first["policy"]["champion"]
    assert aliases == {"champion": first["policies"]["ppo"]["version"], "candidate": first["policies"]["ppo"]["version"]}
    # A later run whose best (dpo, 0.80) is below the champion (0.82): candidate moves, champion stays.
    second = pipeline._register(outcomes(0.80, 0.75, "b"), EvalParams(), ["dpo", "ppo"])
    assert second["policy"]["best"] == "dpo" and not second["policy"]["champion"]
    assert aliases["champion"] == first["policies"]["ppo"]["version"]
    assert aliases["candidate"] == second["policies"]["dpo"]["version"]
    assert second["policy"]["previous_champion_value"] == 0.82
    with pytest.raises(ValueError, match="eval/dpo/greedy_accuracy.*not among"):
        pipeline._register(outcomes(0.8, 0.9, "c"), EvalParams(promote_metric="greedy_accuracy"), ["dpo", "ppo"])
