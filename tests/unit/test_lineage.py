"""orchestration/lineage.py: reading a registered version's recorded metric."""

from __future__ import annotations

from types import SimpleNamespace


def test_a_champion_of_the_old_metric_is_compared_under_its_old_name():
    from orchestration.lineage import recorded_value

    old = SimpleNamespace(tags={"rlhf.eval.eval/policy_exact_match": "0.95"})
    assert recorded_value(old, "greedy_accuracy") == 0.95 and recorded_value(old, "sampled_accuracy") is None
