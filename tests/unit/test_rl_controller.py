"""The RL controller's pure parts: prompt order, the step plan (PPO epochs, ranks, on-policy samples), reward shaping."""

import pytest
import torch

from rlhf_core.rl.controller import PromptStream, overlong_penalty
from rlhf_core.rl.plan import StepPlan, rank_orders
from rlhf_core.rl.roles import optimizer_steps


def test_prompt_stream_visits_every_prompt_once_per_episode_in_a_seeded_order():
    stream = PromptStream(10, seed=3)
    first, second = stream.take(10), stream.take(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    again = PromptStream(10, seed=3)
    assert again.take(4) + again.take(16) == first + second  # the position alone fixes what comes next
    resumed = PromptStream(10, seed=3)
    resumed.position = 14
    assert resumed.take(6) == second[4:]


def arrange_for_ranks(samples, batch_size, world_size, seed, group_size=1):
    """The samples as the ranks' contiguous shards, rank after rank."""
    return [samples[i] for rank in rank_orders(len(samples), batch_size, world_size, seed, group_size) for i in rank]


def test_two_ranks_take_the_slices_of_the_same_global_steps_as_one():
    samples = list(range(16))
    one = arrange_for_ranks(samples, batch_size=8, world_size=1, seed=5)
    two = arrange_for_ranks(samples, batch_size=8, world_size=2, seed=5)
    steps_one = [set(s[0]) for s in optimizer_steps(one, 8, 8)]
    rank0, rank1 = two[:8], two[8:]
    steps_two = [set(a[0]) | set(b[0]) for a, b in zip(optimizer_steps(rank0, 4, 4), optimizer_steps(rank1, 4, 4),
                                                        strict=True)]
    assert steps_one == steps_two and sorted(one) == samples
    assert arrange_for_ranks(samples, 8, 1, seed=6) != one


def test_a_prompts_samples_stay_together_where_each_rank_takes_whole_groups():
    samples = list(range(16))  # 4 prompts x 4 samples, each prompt's samples next to each other
    one = arrange_for_ranks(samples, batch_size=8, world_size=1, seed=5, group_size=4)
    assert sorted(one) == samples and one != samples
    assert all(one[i] // 4 == one[i + k] // 4 for i in range(0, 16, 4) for k in range(4))
    two = arrange_for_ranks(samples, batch_size=8, world_size=2, seed=5, group_size=4)
    steps_one = [set(s[0]) for s in optimizer_steps(one, 8, 8)]
    steps_two = [set(a[0]) | set(b[0]) for a, b in zip(optimizer_steps(two[:8], 4, 4), optimizer_steps(two[8:], 4, 4),
                                                        strict=True)]
    assert steps_one == steps_two
    # A rank's share of a step that cannot hold whole groups: samples are permuted one by one.
    assert arrange_for_ranks(samples, 8, 4, seed=5, group_size=4) == arrange_for_ranks(samples, 8, 4, seed=5)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("epochs", [1, 3])
def test_each_rank_gets_its_samples_once_and_every_epochs_order(world, epochs):
    plan = StepPlan(count=36, batch_size=8, group_size=4, epoch_seeds=tuple(range(7, 7 + epochs)), leave_first_step=False)
    work = plan.work(world)
    for e in range(epochs):
        for r, w in enumerate(work):  # positions into the rank's samples give exactly its slice of the epoch
            assert [w.samples[p] for p in w.epochs[e]] == plan.orders(e, world)[r]
    for w in work:
        assert len(set(w.samples)) == len(w.samples)  # each sample shipped once, however many epochs use it
    # The epochs' permutations differ, and the 4 samples past the last whole step are left out.
    orders = [sum(plan.orders(e, world), []) for e in range(epochs)]
    if epochs == 1:  # one epoch: a rank gets only its own share, and no sample goes to two ranks
        assert sorted(i for w in work for i in w.samples) == sorted(orders[0])
    assert all(len(o) == 32 for o in orders) and len({tuple(o) for o in orders}) == epochs
    assert plan.experience_order(world)[:32] == orders[0] and sorted(plan.experience_order(world)) == list(range(36))


def test_optimizer_steps_cut_whole_steps_into_micro_batches():
    assert optimizer_steps(list(range(8)), 4, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_overlong_penalty_grows_over_the_buffer_and_caps_at_the_factor():
    raw = torch.tensor([1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([10, 16, 18, 20])
    out = overlong_penalty(raw, lengths, max_new_tokens=20, overlong_buffer_len=4, overlong_penalty_factor=2.0)
    assert torch.allclose(out, torch.tensor([1.0, 1.0, 0.0, -1.0]))
    assert torch.equal(overlong_penalty(raw, lengths, 20, None, 2.0), raw)


def _plan(world_size=1, max_epochs=1, use_loss=True, ref=True, step=0, freezing_steps=0, batch_size=8, count=16):
    from types import SimpleNamespace

    from rlhf_core.rl.controller import RLController

    controller = object.__new__(RLController)
    controller.cfg = SimpleNamespace(
        train=SimpleNamespace(batch_size=batch_size, max_epochs=max_epochs, seed=1),
        critic=SimpleNamespace(freezing_steps=freezing_steps), algo=SimpleNamespace(kl=SimpleNamespace(use_loss=use_loss)),
        rollout=SimpleNamespace(n_samples_per_prompt=4))
    controller.actor, controller.ref, controller.step = SimpleNamespace(world_size=world_size), ref or None, step
    return controller.plan_step(count).on_policy(world_size)


def test_the_first_optimizer_steps_samples_are_left_to_training_only_where_nothing_else_reads_them():
    for world in (1, 2):
        plan = StepPlan(16, 8, 4, (1 * 1_000_003,), True)
        left = plan.on_policy(world)
        assert left == _plan(world_size=world)
        # Those are exactly the samples every rank trains on in its first optimizer step.
        ranks = plan.orders(0, world)
        assert left == {i for rank in ranks for micro in optimizer_steps(rank, 8 // world, 1)[0] for i in micro}
        assert len(left) == 8
    assert _plan(count=8) == set()  # one optimizer step: the metrics need a second
    assert _plan(max_epochs=2) == set()  # a later epoch revisits them
    assert _plan(use_loss=False) == set()  # the KL in the reward reads them
    assert _plan(use_loss=False, ref=False)  # no KL at all
    assert _plan(freezing_steps=2, step=1) == set()  # the actor does not train


def test_a_truncated_response_is_scaled_or_overridden_as_openrlhf_does():
    from rlhf_core.rl.controller import truncation_penalty

    rewards, finished = torch.tensor([1.0, 0.8, -0.2]), torch.tensor([True, False, False])
    assert torch.equal(truncation_penalty(rewards, finished, None), rewards)
    assert torch.allclose(truncation_penalty(rewards, finished, 0.5), torch.tensor([1.0, 0.4, -0.1]))
    assert torch.allclose(truncation_penalty(rewards, finished, -0.5), torch.tensor([1.0, -0.5, -0.5]))
    # OpenRLHF's overlong buffer is a float
    assert torch.allclose(overlong_penalty(torch.ones(2), torch.tensor([10, 20]), 20, 2.5, 1.0),
                          torch.tensor([1.0, 0.0]))


def _controller_parts(**cfg):
    """What `RLController.generate` and `.score` read, nothing more."""
    from types import SimpleNamespace

    rollout = SimpleNamespace(max_new_tokens=6, vllm_generate_batch_size=cfg.get("batch"))
    reward = SimpleNamespace(overlong_buffer_len=None, overlong_penalty_factor=1.0,
                             stop_properly_penalty_coef=cfg.get("coef"), process_enable=cfg.get("process", False))
    return SimpleNamespace(cfg=SimpleNamespace(rollout=rollout, reward=reward), labels=[None] * 8,
                           step_rewards=cfg.get("process", False))


def test_generate_batch_size_splits_the_engine_calls_with_seeds_that_keep_each_prompts_own():
    from types import SimpleNamespace

    from rlhf_core.rl.controller import RLController

    calls = []
    parts = _controller_parts(batch=3)
    parts.engines = SimpleNamespace(wake_up=lambda: None, generate_ids=lambda ids, n, t, m, seed, **kw: calls.append(
        (list(ids), seed)) or [[i] for i in ids])
    out = RLController.generate(parts, [[1], [2], [3], [4], [5]], 2, 1.0, seed=100)
    assert out == [[[1]], [[2]], [[3]], [[4]], [[5]]]
    assert calls == [([[1], [2], [3]], 100), ([[4], [5]], 103)]  # --vllm_generate_batch_size 3
    budgets = []
    parts.engines.generate_ids = lambda ids, n, t, m, seed, **kw: budgets.append(m) or [[i] for i in ids]
    RLController.generate(parts, [[1], [2], [3], [4], [5]], 1, 1.0, seed=0, max_new_tokens=[5, 4, 3, 2, 1])
    assert budgets == [[5, 4, 3], [2, 1]]  # a budget per prompt travels with its prompt


def test_engines_on_ray_shard_a_budget_per_prompt_with_the_prompts():
    from types import SimpleNamespace

    from rlhf_core.rl.engines import ENGINE_SEED_STRIDE, RayEngines

    sent = []

    def call_each_async(method, calls, ranks):
        sent.extend(calls)
        return SimpleNamespace(per_rank=lambda: [[[p] for p in args[0]] for args, _ in calls])

    engines = RayEngines(SimpleNamespace(world_size=2, call_each_async=call_each_async))
    out = engines.generate_ids([[1], [2], [3]], 1, 1.0, [7, 8, 9], 0)
    assert out == [[[1]], [[2]], [[3]]]
    assert [(args[0], args[3], args[4]) for args, _ in sent] == [([[1], [2]], [7, 8], 0),
                                                                ([[3]], [9], ENGINE_SEED_STRIDE)]


def test_scoring_applies_the_truncation_penalty_to_responses_without_eos():
    from types import SimpleNamespace

    from rlhf_core.rl.controller import RLController

    parts = _controller_parts(coef=-0.5)
    parts.reward_source = SimpleNamespace(score=lambda samples, labels: (torch.ones(len(samples)),
                                                                         torch.ones(len(samples))))
    samples = [SimpleNamespace(response_len=3, finished=f) for f in (True, False)]
    RLController.score(parts, samples)
    assert [s.reward for s in samples] == [1.0, -0.5] and [s.score for s in samples] == [1.0, 1.0]


def test_with_step_rewards_the_penalty_goes_on_the_last_token():
    """`--reward.process_enable`: a response cut off keeps its step rewards and pays the truncation
    penalty (its change to the reward) on its last token."""
    from types import SimpleNamespace

    from rlhf_core.rl.controller import RLController
    from rlhf_core.rl.experience import RolloutSample, step_reward_matrix

    parts = _controller_parts(coef=-0.5, process=True)
    parts.reward_source = SimpleNamespace(score=lambda samples, labels: (torch.full((len(samples),), 0.25),) * 2)
    samples = [RolloutSample([1], [5, 6, 7], 0, torch.zeros(3), finished=f) for f in (True, False)]
    for s in samples:
        s.extra["step_rewards"] = [(0, 0.5), (2, 0.25)]
    RLController.score(parts, samples)
    rewards, mask = step_reward_matrix(samples, 4)
    assert torch.equal(rewards, torch.tensor([[0.5, 0, 0.25, 0], [0.5, 0, 0.25 - 0.75, 0]]))
    assert torch.equal(mask, torch.tensor([[1.0, 0, 1, 0], [1, 0, 1, 0]]))
