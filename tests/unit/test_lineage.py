"""orchestration/lineage.py: reading a registered version's recorded metric."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_a_champion_of_the_old_metric_is_compared_under_its_old_name():
    from orchestration.lineage import recorded_value

    old = SimpleNamespace(tags={"rlhf.eval.eval/policy_exact_match": "0.95"})
    assert recorded_value(old, "greedy_accuracy") == 0.95 and recorded_value(old, "sampled_accuracy") is None


def test_an_alias_two_runs_insert_at_once_is_set_on_the_second_try():
    """Two first pipeline runs can both insert a new alias into MLflow's SQL store; the loser's
    UNIQUE failure is retried (it then finds the alias and moves it); other errors are raised."""
    from mlflow.exceptions import MlflowException

    from orchestration.lineage import set_alias_racing

    class Client:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), []

        def set_registered_model_alias(self, name, alias, version):
            self.calls.append((name, alias, version))
            if self.errors:
                raise self.errors.pop(0)

    racing = Client([MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases")])
    set_alias_racing(racing, "rlhf-sft", "candidate", "2")
    assert racing.calls == [("rlhf-sft", "candidate", "2")] * 2
    broken = Client([MlflowException("permission denied")])
    with pytest.raises(MlflowException, match="permission denied"):
        set_alias_racing(broken, "rlhf-sft", "candidate", "2")
    assert len(broken.calls) == 1
