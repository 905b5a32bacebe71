"""rlhf_core.algos.advantages against hand-computed values and plain-Python loop references."""

import math
import random

import pytest
import torch

from rlhf_core.algos.advantages import (
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    cumulative_returns,
    dynamic_filter_mask,
    gae,
    kl_controller,
    shape_group_rewards,
    shape_group_step_rewards,
    token_level_rewards,
    whiten,
)
from rlhf_core.algos.names import AdvantageEstimator

E = AdvantageEstimator
GROUP = [E.RLOO, E.REINFORCE_BASELINE, E.GROUP_NORM, E.DR_GRPO]


def assert_close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


def right_padded_mask(lengths, T):
    return (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def step_rewards_of(steps, B, T):
    """`(rewards, mask)` from {sample: [(position, reward), ...]}."""
    rewards, mask = torch.zeros(B, T), torch.zeros(B, T)
    for i, pairs in steps.items():
        for t, r in pairs:
            rewards[i, t], mask[i, t] = r, 1
    return rewards, mask


# --- the enum ---------------------------------------------------------------------------------


def test_estimator_properties():
    assert [e for e in E if e.needs_critic] == [E.GAE]
    assert {e for e in E if e.is_group} == set(GROUP)
    assert {e for e in E if e.whitens} == {E.GAE, E.REINFORCE, E.REINFORCE_BASELINE}
    assert E("group_norm") is E.GROUP_NORM
    with pytest.raises(ValueError):
        E("grpo")


# --- group shaping ----------------------------------------------------------------------------


def test_shape_group_rewards_hand_computed():
    # Group 1: [1, 2, 6], mean 3, unbiased var (4 + 1 + 9) / 2 = 7. Group 2: all 0.
    r = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 0.0])
    assert_close(shape_group_rewards(r, 3, "rloo"), [1 - 8 / 2, 2 - 7 / 2, 6 - 3 / 2, 0, 0, 0])
    assert_close(shape_group_rewards(r, 3, "dr_grpo"), [-2, -1, 3, 0, 0, 0])
    assert_close(shape_group_rewards(r, 3, "reinforce_baseline"), [-2, -1, 3, 0, 0, 0])
    s7 = math.sqrt(7)
    assert_close(shape_group_rewards(r, 3, "group_norm"), [-2 / s7, -1 / s7, 3 / s7, 0, 0, 0])
    assert_close(shape_group_rewards(r, 3, "group_norm", std_norm=False), [-2, -1, 3, 0, 0, 0])
    for name in ("gae", "reinforce"):
        assert_close(shape_group_rewards(r, 3, name), r)


def test_shape_group_rewards_rejects_bad_groups():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="groups"):
        shape_group_rewards(r, 4, "rloo")
    with pytest.raises(ValueError, match="groups"):
        shape_group_rewards(r, 4, "gae")
    for estimator in GROUP:
        with pytest.raises(ValueError, match="n ≥ 2"):
            shape_group_rewards(r, 1, estimator)
    assert_close(shape_group_rewards(r, 1, "reinforce"), r)  # n = 1 is fine without a group baseline


@pytest.mark.parametrize("estimator", list(E))
def test_shape_group_rewards_matches_loop_reference(estimator):
    rng = random.Random(int.from_bytes(estimator.value.encode(), "little") % 1000)
    n, groups = 4, 5
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(n * groups)]
    expected = []
    for g in range(groups):
        rs = rewards[g * n : (g + 1) * n]
        mean = sum(rs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1))
        for x in rs:
            if estimator is E.RLOO:
                expected.append(x - (sum(rs) - x) / (n - 1))
            elif estimator in (E.REINFORCE_BASELINE, E.DR_GRPO):
                expected.append(x - mean)
            elif estimator is E.GROUP_NORM:
                expected.append((x - mean) / (std + 1e-9))
            else:
                expected.append(x)
    out = shape_group_rewards(torch.tensor(rewards, dtype=torch.float64), n, estimator)
    assert_close(out, expected, atol=1e-9, rtol=1e-9)


def test_rloo_equals_verls_rescaled_mean_baseline():
    # verl writes RLOO as n/(n−1)·(r − mean); algebraically the same leave-one-out baseline.
    torch.manual_seed(0)
    n = 5
    r = torch.randn(4 * n, dtype=torch.float64)
    grouped = r.view(-1, n)
    verl_form = (n / (n - 1) * (grouped - grouped.mean(-1, keepdim=True))).reshape(-1)
    assert_close(shape_group_rewards(r, n, "rloo"), verl_form, atol=1e-12, rtol=1e-12)


# --- dynamic filtering ------------------------------------------------------------------------


def test_dynamic_filter_mask_hand_computed():
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert dynamic_filter_mask(scores, 2).tolist() == [False, False, True, True]
    assert dynamic_filter_mask(scores, 2, low=0.5, high=1.0).tolist() == [False, False, False, False]
    assert dynamic_filter_mask(scores, 4).tolist() == [True, True]
    with pytest.raises(ValueError):
        dynamic_filter_mask(scores, 3)
    with pytest.raises(ValueError):
        dynamic_filter_mask(scores, 2, low=1.0, high=0.0)


def test_dynamic_filter_mask_matches_loop_reference():
    rng = random.Random(3)
    n = 4
    scores = [rng.choice([0.0, 1.0]) for _ in range(n * 50)]
    expected = [0.1 < sum(scores[g * n : (g + 1) * n]) / n < 0.9 for g in range(50)]
    got = dynamic_filter_mask(torch.tensor(scores), n, low=0.1, high=0.9)
    assert got.dtype == torch.bool and got.tolist() == expected
    assert 0 < sum(expected) < 50  # both outcomes occur


# --- token rewards ----------------------------------------------------------------------------


def test_token_level_rewards_hand_computed():
    rewards = torch.tensor([2.0, -1.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, float("nan")], [0.5, 0.6, 0.7, 0.8], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    out = token_level_rewards(rewards, kl, mask, kl_coef=0.5)
    assert_close(out, [[-0.05, -0.1, 2 - 0.15, 0], [-0.25, -1 - 0.3, 0, 0], [0, 0, 0, 0]])
    clipped = token_level_rewards(rewards, kl, mask, kl_coef=0.0, reward_clip=1.5)
    assert_close(clipped, [[0, 0, 1.5, 0], [0, -1, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError):
        token_level_rewards(rewards, kl, mask, kl_coef=-0.1)


def test_token_level_rewards_matches_loop_reference():
    rng = random.Random(4)
    B, T = 6, 7
    lengths = [7, 1, 4, 0, 3, 6]
    rewards = [rng.uniform(-3, 3) for _ in range(B)]
    kl = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    expected = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(lengths[b]):
            expected[b][t] = -0.07 * kl[b][t] + (rewards[b] if t == lengths[b] - 1 else 0.0)
    out = token_level_rewards(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64),
        right_padded_mask(lengths, T), kl_coef=0.07,
    )
    assert_close(out, expected, atol=1e-12, rtol=1e-12)


# --- returns, GAE, whitening ------------------------------------------------------------------


def test_cumulative_returns_hand_computed():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert_close(cumulative_returns(rewards, mask, gamma=0.5), [[2.75, 3.5, 3.0, 0.0]])
    assert_close(cumulative_returns(rewards, mask), [[6.0, 5.0, 3.0, 0.0]])


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 9.0]])  # 9 is padding: V after the last token is 0
    mask = torch.tensor([[1, 1, 1, 0]])
    # γ = λ = 1: δ = [0.2 − 0.5, 0.4 − 0.2, 1 − 0.4] = [−0.3, 0.2, 0.6]; A = reward-to-go − V.
    adv, ret = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    assert_close(adv, [[0.5, 0.8, 0.6, 0.0]])
    assert_close(ret, [[1.0, 1.0, 1.0, 0.0]])
    # γ = 0.9, λ = 0.5: δ = [0.9·0.2 − 0.5, 0.9·0.4 − 0.2, 0.6] = [−0.32, 0.16, 0.6], γλ = 0.45.
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.5)
    assert_close(adv, [[-0.32 + 0.45 * 0.43, 0.16 + 0.45 * 0.6, 0.6, 0.0]])
    assert_close(ret, [[-0.1265 + 0.5, 0.43 + 0.2, 0.6 + 0.4, 0.0]])


def test_gae_and_returns_match_loop_reference():
    rng = random.Random(5)
    B, T, gamma, lambd = 5, 8, 0.97, 0.9
    lengths = [8, 3, 1, 6, 0]
    rewards = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    values = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    exp_adv = [[0.0] * T for _ in range(B)]
    exp_ret = [[0.0] * T for _ in range(B)]
    exp_cum = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = lengths[b]
        for t in range(L):
            # A_t = Σ_k (γλ)^k δ_{t+k}, written out as a sum rather than a recursion.
            a = 0.0
            for k in range(L - t):
                s = t + k
                v_next = values[b][s + 1] if s + 1 < L else 0.0
                a += (gamma * lambd) ** k * (rewards[b][s] + gamma * v_next - values[b][s])
            exp_adv[b][t] = a
            exp_ret[b][t] = a + values[b][t]
            exp_cum[b][t] = sum(gamma ** (s - t) * rewards[b][s] for s in range(t, L))
    r64, v64 = torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)
    mask = right_padded_mask(lengths, T)
    adv, ret = gae(r64, v64, mask, gamma, lambd)
    assert_close(adv, exp_adv, atol=1e-12, rtol=1e-12)
    assert_close(ret, exp_ret, atol=1e-12, rtol=1e-12)
    assert_close(cumulative_returns(r64, mask, gamma), exp_cum, atol=1e-12, rtol=1e-12)


def test_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    s = math.sqrt(2 / 3)  # population std of [1, 2, 3]
    assert_close(whiten(x, mask), [[-1 / s, 0.0, 1 / s, 0.0]])
    assert_close(whiten(x, mask, shift_mean=False), [[2 - 1 / s, 2.0, 2 + 1 / s, 0.0]])
    assert_close(whiten(x, mask, std_norm=False), [[-1.0, 0.0, 1.0, 0.0]])
    # Constant input: the variance floor keeps it finite (0, not NaN).
    assert_close(whiten(torch.full((2, 3), 4.0), torch.ones(2, 3)), torch.zeros(2, 3))


def test_whiten_matches_loop_reference():
    rng = random.Random(6)
    B, T = 4, 6
    lengths = [6, 2, 5, 3]
    x = [[rng.uniform(-5, 5) for _ in range(T)] for _ in range(B)]
    vals = [x[b][t] for b in range(B) for t in range(lengths[b])]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    expected = [[(x[b][t] - mean) / std if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)]
    out = whiten(torch.tensor(x, dtype=torch.float64), right_padded_mask(lengths, T))
    assert_close(out, expected, atol=1e-12, rtol=1e-12)


# --- the whole flow ---------------------------------------------------------------------------


def test_compute_advantages_group_norm_hand_computed():
    # rewards [1, 0] in one group: mean 0.5, unbiased std sqrt(0.5) → shaped ±1/sqrt(2).
    kl = torch.tensor([[0.1, 0.2], [0.3, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_advantages(
        "group_norm", torch.tensor([1.0, 0.0]), kl, mask, kl_coef=0.1, n=2, gamma=0.5
    )
    h = 1 / math.sqrt(2)
    # token rewards: [[−0.01, h − 0.02], [−h − 0.03, 0]], γ forced to 1, no whitening.
    assert_close(ret, [[h - 0.03, h - 0.02], [-h - 0.03, 0.0]])
    assert_close(adv, ret)


def test_compute_advantages_gae_returns_are_not_whitened():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.zeros(2, 3)
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.1, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("gae", rewards, kl, mask, kl_coef=0.0, n=1, values=values)
    raw_adv = torch.tensor([[0.5, 0.8, 0.6], [-0.1, -0.1, 0.0]])
    assert_close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert_close(adv, whiten(raw_adv, mask))
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", rewards, kl, mask, kl_coef=0.0, n=1)


def reference_flow(estimator, rewards, kl, lengths, kl_coef, n, gamma, lambd, values, std_norm):
    """The OpenRLHF flow as plain Python lists."""
    B, T = len(kl), len(kl[0])
    shaped = list(rewards)
    if estimator.is_group:
        for g in range(B // n):
            rs = rewards[g * n : (g + 1) * n]
            mean = sum(rs) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1))
            for i, x in enumerate(rs):
                if estimator is E.RLOO:
                    shaped[g * n + i] = x - (sum(rs) - x) / (n - 1)
                elif estimator is E.GROUP_NORM and std_norm:
                    shaped[g * n + i] = (x - mean) / (std + 1e-9)
                else:
                    shaped[g * n + i] = x - mean
        gamma = 1.0
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = lengths[b]
        tok = [-kl_coef * kl[b][t] + (shaped[b] if t == L - 1 else 0.0) for t in range(L)]
        running_a, running_r = 0.0, 0.0
        for t in reversed(range(L)):
            running_r = tok[t] + gamma * running_r
            if estimator is E.GAE:
                v_next = values[b][t + 1] if t + 1 < L else 0.0
                running_a = tok[t] + gamma * v_next - values[b][t] + gamma * lambd * running_a
                adv[b][t], ret[b][t] = running_a, running_a + values[b][t]
            else:
                adv[b][t] = ret[b][t] = running_r
    if estimator.whitens:
        vals = [adv[b][t] for b in range(B) for t in range(lengths[b])]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if std_norm else 1.0
        adv = [[(adv[b][t] - mean) / std if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("estimator", list(E))
def test_compute_advantages_matches_loop_reference(estimator, std_norm):
    rng = random.Random(7)
    n, B, T = 3, 9, 6
    lengths = [rng.randint(1, T) for _ in range(B)]
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-1, 1)]) for _ in range(B)]
    kl = [[rng.uniform(-0.5, 0.5) for _ in range(T)] for _ in range(B)]
    values = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    kwargs = dict(kl_coef=0.05, n=n, gamma=0.9, lambd=0.8, std_norm=std_norm)
    exp_adv, exp_ret = reference_flow(estimator, rewards, kl, lengths, values=values, **kwargs)
    adv, ret = compute_advantages(
        estimator, torch.tensor(rewards, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64),
        right_padded_mask(lengths, T), values=torch.tensor(values, dtype=torch.float64), **kwargs,
    )
    assert_close(adv, exp_adv, atol=1e-10, rtol=1e-10)
    assert_close(ret, exp_ret, atol=1e-10, rtol=1e-10)
    mask = right_padded_mask(lengths, T).bool()
    if estimator.whitens:
        assert abs(adv[mask].mean().item()) < 1e-10
        if std_norm:
            assert abs(adv[mask].var(unbiased=False).item() - 1) < 1e-10
    else:
        assert_close(adv, ret)


def test_compute_advantages_group_estimators_ignore_gamma_and_output_is_detached():
    torch.manual_seed(8)
    rewards, kl = torch.rand(4), torch.rand(4, 5)
    mask = right_padded_mask([5, 2, 3, 4], 5)
    values = torch.randn(4, 5, requires_grad=True)
    for estimator in GROUP:
        a1, _ = compute_advantages(estimator, rewards, kl, mask, kl_coef=0.1, n=2, gamma=1.0)
        a2, _ = compute_advantages(estimator, rewards, kl, mask, kl_coef=0.1, n=2, gamma=0.3)
        assert_close(a1, a2)
    a1, _ = compute_advantages("reinforce", rewards, kl, mask, kl_coef=0.1, n=2, gamma=1.0)
    a2, _ = compute_advantages("reinforce", rewards, kl, mask, kl_coef=0.1, n=2, gamma=0.3)
    assert not torch.allclose(a1, a2)  # but reinforce honours γ
    adv, ret = compute_advantages("gae", rewards, kl, mask, kl_coef=0.1, n=1, values=values)
    assert not adv.requires_grad and not ret.requires_grad


# --- KL controllers ---------------------------------------------------------------------------


def test_fixed_kl_controller():
    ctl = FixedKLController(0.01)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.01
    assert ctl.state_dict() == {"value": 0.01}
    resumed = FixedKLController(0.02)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == 0.02  # a fixed β is configuration
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_adaptive_kl_controller_direction_and_formula():
    ctl = AdaptiveKLController(init=0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 100)  # KL above target: error 1 clipped to 0.2, β grows
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000), rel=1e-12)
    before = ctl.value
    ctl.update(6.6, 500)  # error 0.1, inside the clip
    assert ctl.value == pytest.approx(before * (1 + 0.1 * 500 / 10000), rel=1e-12)
    before = ctl.value
    ctl.update(0.0, 100)  # KL below target: error −1 clipped to −0.2, β shrinks
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 100 / 10000), rel=1e-12)
    before = ctl.value
    ctl.update(6.0, 100)  # on target: unchanged
    assert ctl.value == pytest.approx(before, rel=1e-12)


def test_adaptive_kl_controller_state_round_trip_and_factory():
    ctl = AdaptiveKLController(0.05, target=1.0, horizon=100)
    for kl in (3.0, 2.0, 0.1):
        ctl.update(kl, 10)
    resumed = AdaptiveKLController(0.05, target=1.0, horizon=100)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value != 0.05
    resumed.update(3.0, 10)
    ctl.update(3.0, 10)
    assert resumed.value == ctl.value
    assert isinstance(kl_controller(0.01), FixedKLController)
    assert isinstance(kl_controller(0.01, kl_target=0.1), AdaptiveKLController)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=100)


# --- process rewards (a reward per step) ------------------------------------------------------


def test_group_step_rewards_are_normalised_over_every_step_of_the_group():
    """DeepSeekMath's process supervision: each step reward of a prompt's samples, less the mean of
    all of them, over their (unbiased) standard deviation; a reward of 0 is a step too."""
    rewards, mask = step_rewards_of({0: [(1, 0.9), (4, 0.2)], 1: [(2, 0.8)], 2: [(0, 0.0)], 3: [(3, 1.0)]}, 4, 5)
    shaped = shape_group_step_rewards(rewards, mask, 2, E.GROUP_NORM)
    first = torch.tensor([0.9, 0.2, 0.8])
    expected = (first - first.mean()) / (first.std() + 1e-9)
    assert_close(shaped[0, [1, 4]], expected[:2])
    assert_close(shaped[1, 2], expected[2])
    assert_close(shaped[2, 0], -0.5 / math.sqrt(0.5))
    assert_close(shaped[3, 3], 0.5 / math.sqrt(0.5))
    assert shaped[mask == 0].abs().sum() == 0
    assert_close(shape_group_step_rewards(rewards, mask, 2, E.DR_GRPO)[0, [1, 4]], first[:2] - first.mean())
    assert_close(shape_group_step_rewards(rewards, mask, 2, E.GROUP_NORM, std_norm=False)[1, 2], 0.8 - first.mean())
    for estimator in (E.GAE, E.REINFORCE):  # their returns sum the rewards as they are
        assert torch.equal(shape_group_step_rewards(rewards, mask, 2, estimator), rewards)
    for estimator in (E.RLOO, E.REINFORCE_BASELINE):
        with pytest.raises(ValueError, match="one reward per sample"):
            shape_group_step_rewards(rewards, mask, 2, estimator)
    one, one_mask = step_rewards_of({0: [(0, 0.3)]}, 2, 3)  # a group with one step: nothing to compare it with
    assert torch.equal(shape_group_step_rewards(one, one_mask, 2, E.GROUP_NORM), torch.zeros(2, 3))


def test_a_token_is_advantaged_by_the_steps_it_leads_to():
    """Group estimators (γ = 1): a token's advantage is the sum of the shaped rewards of the steps
    completed at or after it; with KL in the reward every token pays β·KL as with a scalar reward."""
    mask = right_padded_mask([5, 3, 4, 5], 5)
    rewards, where = step_rewards_of({0: [(1, 0.9), (4, 0.2)], 1: [(2, 0.8)], 2: [(3, 0.5)], 3: [(4, 0.1)]}, 4, 5)
    kl = torch.rand(4, 5)
    advantages, returns = compute_advantages(E.GROUP_NORM, torch.zeros(4), kl, mask, kl_coef=0.1, n=2,
                                             step_rewards=(rewards, where))
    shaped = shape_group_step_rewards(rewards, where, 2, E.GROUP_NORM)
    token = (shaped - 0.1 * kl) * mask
    expected = torch.flip(torch.cumsum(torch.flip(token, [1]), 1), [1]) * mask
    assert_close(advantages, expected, atol=1e-5)
    assert torch.equal(advantages, returns)


def test_one_step_at_the_last_token_is_the_scalar_reward():
    """Process rewards generalise the scalar one: every sample's single step at its last token gives
    the scalar path's advantages and returns, for every estimator that takes steps."""
    lengths, scalar = [5, 3, 4, 2], torch.tensor([0.9, 0.1, 0.4, 0.7])
    mask = right_padded_mask(lengths, 5)
    rewards, where = step_rewards_of({i: [(n - 1, float(scalar[i]))] for i, n in enumerate(lengths)}, 4, 5)
    kl, values = torch.rand(4, 5) * 0.1, torch.rand(4, 5)
    for estimator in (E.GAE, E.REINFORCE, E.GROUP_NORM, E.DR_GRPO):
        common = dict(kl_coef=0.05, n=2, gamma=0.9 if estimator in (E.GAE, E.REINFORCE) else 1.0, lambd=0.95,
                      values=values if estimator == E.GAE else None, reward_clip=0.5)
        by_scalar = compute_advantages(estimator, scalar, kl, mask, **common)
        by_steps = compute_advantages(estimator, torch.zeros(4), kl, mask, step_rewards=(rewards, where), **common)
        for a, b in zip(by_scalar, by_steps, strict=True):
            assert_close(b, a, atol=1e-5)
