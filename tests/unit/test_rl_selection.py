"""When the RL stage evaluates during training and on which held-out prompts (`rl/selection.py`)."""

from rlhf_core.rl.selection import beats_the_last, eval_every, selection_split


def test_evaluations_during_training_come_every_tenth_of_the_run_where_a_check_is_watched():
    assert eval_every(5, 100, watched=False) == 5  # given: as given
    assert eval_every(-1, 100, watched=False) == 0  # OpenRLHF's -1: before and after only
    assert eval_every(-1, 100, watched=True) == 10
    assert eval_every(-1, 64, watched=True) == 7  # at most ten evaluations
    assert eval_every(-1, 19, watched=True) == 2
    assert eval_every(-1, 9, watched=True) == 0  # too short a run to look back over


def test_the_selection_share_is_seeded_disjoint_from_the_reported_prompts_and_never_all_of_them():
    chosen, reported = selection_split(267, 0.25, seed=0)
    assert len(chosen) == 67 and len(reported) == 200
    assert sorted(chosen + reported) == list(range(267))
    assert chosen != list(range(67))  # spread over the set, not its head
    assert selection_split(267, 0.25, seed=0) == (chosen, reported)
    assert selection_split(267, 0.25, seed=1) != (chosen, reported)
    assert selection_split(200, 0.0, seed=0) == ([], list(range(200)))  # off
    assert selection_split(1, 0.25, seed=0) == ([], [0])  # nothing left to set aside
    assert selection_split(12, 0.25, seed=0) == ([], list(range(12)))  # 3 prompts: too few to choose on
    assert len(selection_split(16, 0.25, seed=0)[0]) == 4
    assert selection_split(2, 0.9, seed=0) == ([], [0, 1])  # nothing left to report on


def test_the_best_is_published_over_the_last_only_when_it_beat_it_by_more_than_the_noise():
    # 100 responses each: the standard error of the difference at 0.83 against 0.80 is 0.055
    assert not beats_the_last(0.83, 0.80, "eval/sampled_accuracy", 100)
    assert beats_the_last(0.66, 0.07, "eval/sampled_accuracy", 100)  # a collapse is no draw
    assert beats_the_last(0.83, 0.80, "eval/sampled_accuracy", 10_000)
    assert beats_the_last(0.9, 0.8, "eval/sampled_reward", 100) and not beats_the_last(0.8, 0.8, "eval/sampled_reward", 100)


def test_a_gold_reward_beats_the_last_only_beyond_the_spread_of_its_scores():
    """A gold reward model's score has no spread of its own (an accuracy's is p(1 - p)): the
    evaluations log it (`_gold_reward_std`), and the same rule, twice the standard error of the
    difference of two means, reads it; without it, any gain counts."""
    gold = "eval/sampled_gold_reward"
    assert beats_the_last(1.0, 0.5, gold, 100, (1.0, 1.0))  # 0.5 against 2 x 0.14
    assert not beats_the_last(1.0, 0.5, gold, 100, (3.0, 3.0))  # against 2 x 0.42: a draw
    assert beats_the_last(1.0, 0.5, gold, 10_000, (3.0, 3.0))
    assert beats_the_last(1.0, 0.99, gold, 100) and beats_the_last(1.0, 0.99, gold, 100, (None, 1.0))
    assert not beats_the_last(0.5, 0.5, gold, 100, (0.0, 0.0))
