"""Micro-batches by token budget (`data/token_budget.py`)."""

import random

import pytest

from rlhf_core.data.token_budget import (
    balanced_groups,
    budget_chunks,
    consecutive_chunks,
    group_count,
    micro_batch_count,
    step_micro_batches,
)


def test_the_count_is_first_fit_decreasing_and_a_long_sample_stands_alone():
    assert micro_batch_count([], 10) == 0
    assert micro_batch_count([4, 4, 4], 8) == 2
    assert micro_batch_count([6, 5, 4, 3, 2], 10) == 2  # 6+4, 5+3+2
    assert micro_batch_count([25, 3], 10) == 2  # over the budget: alone
    with pytest.raises(ValueError):
        micro_batch_count([1], 0)


def test_groups_cover_every_sample_once_in_order_with_near_equal_tokens():
    rng = random.Random(0)
    lengths = [rng.randint(5, 60) for _ in range(37)]
    groups = balanced_groups(lengths, 4)
    assert sorted(i for g in groups for i in g) == list(range(37))
    assert all(g == sorted(g) for g in groups)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths)
    assert balanced_groups([3, 1], 3) == [[0], [1], []]


def test_the_group_count_keeps_near_equal_groups_within_the_budget():
    # first-fit decreasing packs [6, 5, 4, 3, 2] into two of 10 (6+4, 5+3+2); near-equal groups of
    # two would be 6+3+2 = 11 and 5+4: three groups are needed (what the RL roles and the
    # supervised trainers both cut by)
    assert micro_batch_count([6, 5, 4, 3, 2], 10) == 2 and balanced_groups([6, 5, 4, 3, 2], 2) == [[0, 3, 4], [1, 2]]
    assert group_count([6, 5, 4, 3, 2], 10) == 3
    assert all(sum([6, 5, 4, 3, 2][i] for i in g) <= 10 for g in balanced_groups([6, 5, 4, 3, 2], 3))
    assert group_count([25, 3], 10) == 2 and group_count([], 10) == 0


def test_chunks_keep_order_and_the_budget():
    assert budget_chunks([3, 3, 3, 9, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert budget_chunks([], 5) == []


def test_padded_chunks_cost_rows_times_the_longest():
    # packed, all four cost 10 and fit; padded, [2, 5] costs 2 x 5 = 10 and a third row makes 15
    assert budget_chunks([2, 5, 2, 1], 10) == [[0, 1, 2, 3]]
    assert budget_chunks([2, 5, 2, 1], 10, padded=True) == [[0, 1], [2, 3]]
    assert budget_chunks([12, 1], 10, padded=True) == [[0], [1]]  # a longer row alone


def _slots(samples, padded):
    return len(samples) * len(samples[0]) * max(max(s) for s in samples) if padded else sum(map(sum, samples))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("sequences", [1, 2])  # SFT rows; DPO pairs
def test_a_step_s_shares_split_alike_on_every_rank_within_the_budget(padded, sequences):
    """The supervised trainers' micro-batches by tokens: every rank as many, each sample once, none
    over the budget unless a sample alone is."""
    rng = random.Random(sequences + 2 * padded)
    shares = [[tuple(rng.randint(3, 40) for _ in range(sequences)) for _ in range(16)] for _ in range(3)]
    shares[1] = [tuple(2 for _ in range(sequences))] * 16  # a share of short samples: fewer micro-batches by itself
    budget = 120
    split = [step_micro_batches(shares, r, budget, padded) for r in range(3)]
    assert len({len(groups) for groups in split}) == 1 and len(split[0]) > 1
    for share, groups in zip(shares, split, strict=True):
        assert sorted(i for g in groups for i in g) == list(range(16))
        assert all(g and g == sorted(g) for g in groups)
        assert all(_slots([share[i] for i in g], padded) <= budget or len(g) == 1 for g in groups)
    assert step_micro_batches([[(30,)] * 4], 0, 10_000, padded) == [[0, 1, 2, 3]]  # one micro-batch when all fit
    with pytest.raises(ValueError):
        step_micro_batches(shares, 0, 0, padded)


def test_padded_micro_batches_put_samples_of_similar_length_together():
    share = [(30,), (2,), (29,), (3,), (31,), (2,)]
    assert step_micro_batches([share], 0, 93, padded=True) == [[0, 2, 4], [1, 3, 5]]
    assert step_micro_batches([share], 0, 93, padded=False) != [[0, 2, 4], [1, 3, 5]]


def test_no_grad_chunks_of_pairs_count_both_sequences():
    pairs = [(5, 4), (3, 3), (1, 1)]
    assert consecutive_chunks(pairs, 12, padded=False) == [[0], [1, 2]]  # 9; 6 + 2
    assert consecutive_chunks(pairs, 12, padded=True) == [[0], [1, 2]]  # 2 x 5 = 10, 4 x 5 = 20 > 12; 2 x 3, 4 x 3
    assert consecutive_chunks(pairs, 11, padded=True) == [[0], [1], [2]]  # 4 x 3 = 12 > 11
