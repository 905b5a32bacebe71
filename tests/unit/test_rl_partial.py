"""Partial rollouts (`rl/partial.py`, `RolloutsAhead.paused`): a weight sync during the sampling ahead
waits for one generation segment, not the batch; the rest of each unfinished response is sampled
by the new policy, and every token remembers which policy sampled it."""

import threading
import time

import pytest

from rlhf_core.rl.ahead import Rollout, RolloutsAhead
from rlhf_core.rl.partial import sample_in_segments, segment_len, staleness_stats
from rlhf_core.rollout.base import Sample

EOS = 0


def counting_engine(lengths: dict[int, int]):
    """Each sequence (keyed by its first token) continues counting up from its last token until it
    has `lengths[key]` response tokens, then writes EOS, within its own budget as engines do; log-prob
    -1 per token."""
    calls = []

    def generate(sequences, budgets, seed):
        calls.append((len(sequences), budgets))
        out = []
        for seq, budget in zip(sequences, budgets, strict=True):
            key, response = seq[0], seq[2:]  # prompts are two tokens here
            left = lengths[key] - len(response)
            ids = [seq[-1] + 1 + i for i in range(min(budget, left))]
            finished = len(ids) < budget or left == budget
            if len(ids) < budget and finished:
                ids.append(EOS)
            out.append(Sample(tuple(ids), tuple(-1.0 for _ in ids), finished and EOS in ids))
        return out

    return generate, calls


def test_responses_grow_segment_by_segment_and_each_token_keeps_its_policy_version():
    generate, calls = counting_engine({10: 3, 20: 11})
    versions = iter([5, 6, 6, 7])
    groups = sample_in_segments([[10, 1], [20, 1]], 1, 12, 0, generate, lambda: next(versions))
    short, long = groups[0][0], groups[1][0]
    assert segment_len(12) == 3
    assert short.token_ids == [2, 3, 4, EOS] and short.finished and short.versions == [5, 5, 5, 6]
    assert long.token_ids == [2 + i for i in range(11)] + [EOS] and long.finished
    assert long.versions == [5] * 3 + [6] * 3 + [6] * 3 + [7] * 3  # a sync came before the 2nd and 4th segments
    assert [n for n, _ in calls] == [2, 2, 1, 1]  # a finished response leaves the next segments
    assert [b for _, b in calls] == [[3, 3], [3, 3], [3], [3]]


def test_the_last_segment_asks_each_response_for_what_it_may_still_grow_by():
    """A budget of 10 in segments of 3: 3, 3, 3, then 1 (the room left, not a whole segment to be
    cut). The responses of a batch grow alike here, so this shows the room, not budgets that differ
    per response (the agents' and the endpoint's tests show those)."""
    generate, calls = counting_engine({10: 50, 20: 50})
    groups = sample_in_segments([[10, 1], [20, 1]], 1, 10, 0, generate, lambda: 0)
    assert [b for _, b in calls] == [[3, 3], [3, 3], [3, 3], [1, 1]]
    assert all(len(g[0].token_ids) == 10 and not g[0].finished for g in groups)


def test_a_response_cut_by_the_budget_is_not_finished():
    generate, _ = counting_engine({10: 50})
    (r,), = sample_in_segments([[10, 1]], 1, 8, 0, generate, lambda: 0)
    assert len(r.token_ids) == 8 and not r.finished and r.versions == [0] * 8


def test_an_engine_that_gives_nothing_ends_the_response_instead_of_looping():
    def empty(sequences, budgets, seed):
        return [Sample((), (), False) for _ in sequences]

    (r,), = sample_in_segments([[10, 1]], 1, 8, 0, empty, lambda: 0)
    assert r.token_ids == [] and r.finished


def test_staleness_is_measured_per_token():
    stats = staleness_stats([[3, 3, 4], [4, 4]], current=4)
    assert stats == {"rollout/staleness": pytest.approx(2 / 5), "rollout/staleness_max": 1.0,
                     "rollout/partial_frac": 0.5}


def test_a_weight_sync_pauses_the_sampling_ahead_at_a_segment_end_not_the_batch_end():
    """The background sampling of a 4-segment batch: the sync comes after its first segment, runs
    while the sampling is held, and the remaining segments are sampled with the new version."""
    state = {"version": 0, "generating": False}
    segment_done = threading.Event()
    ahead: RolloutsAhead

    def produce(step):
        versions = []
        for k in range(4):
            ahead.yield_point()
            versions.append(state["version"])
            state["generating"] = True
            time.sleep(0.05)
            state["generating"] = False
            if k == 0:
                segment_done.set()
                ahead._pause.wait(5)  # the sync is asked for before the next segment starts
        return Rollout(versions, {}, {}, 0)

    ahead = RolloutsAhead(produce, depth=1, partial=True)
    ahead.ready[0] = Rollout([], {}, {}, 0)
    ahead.next_step = 1
    ahead.take(0)
    ahead.start(0, last_step=2)
    segment_done.wait(5)
    started = time.perf_counter()
    with ahead.paused():
        assert not state["generating"]  # held between two segments
        state["version"] = 1
    assert time.perf_counter() - started < 0.15  # one segment at most, not the three left
    assert ahead.take(1).samples == [0, 1, 1, 1]  # the versions its four segments were sampled with


def test_without_sampling_ahead_a_pause_is_nothing_and_the_flag_needs_async():
    from rlhf_core.rl_config import PPOConfig

    ahead = RolloutsAhead(lambda step: Rollout([], {}, {}, 0), depth=1, partial=True)
    with ahead.paused():
        pass
    with pytest.raises(ValueError, match="partial_rollout_enable.*needs --train.async_enable"):
        PPOConfig.model_validate({"train": {"partial_rollout_enable": True}, "reward": {"task": "sort"}})


@pytest.mark.slow
def test_a_real_partial_rollout_run_logs_the_staleness_of_its_tokens(prepared, tmp_path, capsys, one_torch_thread):
    import json

    from rlhf_core.cli import main

    assert main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--task", "addition", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                 "--rollout_batch_size", "8", "--train_batch_size", "16", "--generate_max_len", "8",
                 "--param_dtype", "fp32", "--use_mlflow", "false", "--max_steps", "4", "--async_train",
                 "--partial_rollout", "--save_path", str(tmp_path / "out")]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert 0.0 <= metrics["rollout/staleness"] <= metrics["rollout/staleness_max"] <= 1.0
    assert 0.0 <= metrics["rollout/partial_frac"] <= 1.0
