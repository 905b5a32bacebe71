"""Micro-batches by token budget (`data/token_budget.py`)."""

import random

import pytest

from rlhf_core.data.token_budget import balanced_groups, budget_chunks, micro_batch_count


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


def test_chunks_keep_order_and_the_budget():
    assert budget_chunks([3, 3, 3, 9, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert budget_chunks([], 5) == []


def test_padded_chunks_cost_rows_times_the_longest():
    # packed, all four cost 10 and fit; padded, [2, 5] costs 2 x 5 = 10 and a third row makes 15
    assert budget_chunks([2, 5, 2, 1], 10) == [[0, 1, 2, 3]]
    assert budget_chunks([2, 5, 2, 1], 10, padded=True) == [[0, 1], [2, 3]]
    assert budget_chunks([12, 1], 10, padded=True) == [[0], [1]]  # a longer row alone
