"""The RL terms of rlhf_core.algos.losses: policy, value and entropy losses and loss aggregation."""

import math
import random

import pytest
import torch

from rlhf_core.algos.losses import (
    aggregate_loss,
    cispo_loss,
    corrected_policy_loss,
    entropy_from_logits,
    gspo_loss,
    is_correction_weights,
    loss_units,
    policy_loss,
    sapo_loss,
    surrogate_loss,
    value_loss,
)
from rlhf_core.algos.names import LossAggMode

LN2 = math.log(2.0)
MODES = list(LossAggMode)


def assert_close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


def right_padded_mask(lengths, T):
    return (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


# --- policy loss ------------------------------------------------------------------------------


def test_policy_loss_clip_cases_hand_computed():
    ratios = [1.5, 1.5, 0.5, 0.5, 1.0]
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    logp = torch.log(torch.tensor([ratios]))
    loss, clipped = policy_loss(logp, torch.zeros(1, 5), adv, torch.ones(1, 5))
    # ratio 1.5, A>0: min(1.5, 1.2) → clipped; A<0: min(−1.5, −1.2) = −1.5, not clipped;
    # ratio 0.5, A>0: min(0.5, 0.8) = 0.5; A<0: min(−0.5, −0.8) → clipped; ratio 1: −A.
    assert_close(loss, [[-1.2, 1.5, -0.5, 0.8, -2.0]])
    assert_close(clipped, [[1.0, 0.0, 0.0, 1.0, 0.0]])


def test_policy_loss_asymmetric_clip_and_ratio_clamp():
    logp = torch.log(torch.tensor([[1.25, 0.75]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, clipped = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), eps_low=0.2, eps_high=0.28)
    assert_close(loss, [[-1.25, 0.8]])  # 1.25 < 1.28 is inside; 0.75 < 0.8 is clipped (A < 0)
    assert_close(clipped, [[0.0, 1.0]])
    # A log-ratio of 50 is clamped to 20 before exp.
    loss, _ = policy_loss(torch.tensor([[50.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert_close(loss, [[math.exp(20.0)]], rtol=1e-5)


def test_policy_loss_dual_clip_hand_computed():
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0, 0.5]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    loss, clipped = policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), dual_clip=3.0)
    # ratio 5, A = −1: PPO gives 5, dual clip caps at 3. ratio 2: 2 < 3 stays.
    # ratio 5, A = +1: PPO clip to 1.2, dual clip does not apply. ratio 0.5, A = −2: PPO clip, 1.6.
    assert_close(loss, [[3.0, 2.0, -1.2, 1.6]])
    assert_close(clipped, [[1.0, 0.0, 1.0, 1.0]])
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), dual_clip=1.0)


def test_policy_loss_mask_gradient_and_dtype():
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.1, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 2.0, -1.0, 3.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipped = policy_loss(logp.bfloat16(), old, adv, mask)
    assert loss.dtype == clipped.dtype == torch.float32
    assert loss[0, 3].item() == 0.0 and clipped[0, 3].item() == 0.0  # NaN outside the mask
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # d(−ratio·A)/dlogπ = −ratio·A where unclipped; 0 where clipped or masked.
    assert grad[0, 0].item() == 0.0 and grad[0, 3].item() == 0.0
    assert_close(grad[0, 1:3], [-2.0, 1.1 * 1.0], rtol=1e-2)  # bf16 rounding of logπ


@pytest.mark.parametrize("dual_clip", [None, 2.5])
def test_policy_loss_matches_loop_reference(dual_clip):
    rng = random.Random(11)
    B, T, el, eh = 4, 6, 0.2, 0.3
    logp = [[rng.uniform(-1, 0.2) for _ in range(T)] for _ in range(B)]
    old = [[x + rng.uniform(-1.2, 1.2) for x in row] for row in logp]
    adv = [[rng.uniform(-2, 2) for _ in range(T)] for _ in range(B)]
    lengths = [6, 2, 4, 5]
    exp_loss = [[0.0] * T for _ in range(B)]
    exp_clip = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(lengths[b]):
            ratio = math.exp(max(-20.0, min(20.0, logp[b][t] - old[b][t])))
            a = adv[b][t]
            s1, s2 = ratio * a, min(max(ratio, 1 - el), 1 + eh) * a
            loss = -min(s1, s2)
            hit = s2 < s1
            if dual_clip is not None and a < 0 and -dual_clip * a < loss:
                loss, hit = -dual_clip * a, True
            exp_loss[b][t], exp_clip[b][t] = loss, float(hit)
    loss, clipped = policy_loss(
        torch.tensor(logp, dtype=torch.float64), torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64), right_padded_mask(lengths, T), el, eh, dual_clip,
    )
    assert_close(loss, exp_loss, atol=1e-12, rtol=1e-12)
    assert_close(clipped, exp_clip)
    assert 0 < sum(map(sum, exp_clip)) < sum(lengths)  # some tokens clipped, some not


# --- GSPO, CISPO, SAPO -------------------------------------------------------------------------


def test_gspo_one_ratio_per_sequence_hand_computed():
    # Row 0: token ratios 2 and 0.5 (geometric mean 1), the pad's log-ratio 9 is left out. Row 1:
    # ratios 1.5 and 1.5 → s = 1.5, clipped to 1.2 where A > 0. Row 2: one token of ratio 0.5, A < 0.
    logp = torch.log(torch.tensor([[2.0, 0.5, math.exp(9.0)], [1.5, 1.5, 1.0], [0.5, 1.0, 1.0]]))
    adv = torch.tensor([[1.0, -2.0, 5.0], [1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = right_padded_mask([2, 2, 1], 3)
    loss, clipped = gspo_loss(logp, torch.zeros(3, 3), adv, mask)
    assert_close(loss, [[-1.0, 2.0, 0.0], [-1.2, -1.2, 0.0], [0.8, 0.0, 0.0]])
    assert_close(clipped, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # dual clip as PPO's: s = 5 for a row with A = −1 is capped at 3
    loss, clipped = gspo_loss(torch.log(torch.tensor([[5.0, 5.0]])), torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]),
                              torch.ones(1, 2), dual_clip=3.0)
    assert_close(loss, [[3.0, 3.0]])
    assert_close(clipped, [[1.0, 1.0]])


def test_gspo_gradient_is_the_sequence_ratio_over_its_length_times_the_advantage():
    logp = torch.log(torch.tensor([[1.1, 0.9, 1.0, 1.0]])).requires_grad_()
    mask = right_padded_mask([3], 4)
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    loss, clipped = gspo_loss(logp, torch.zeros(1, 4), adv, mask)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    s = (1.1 * 0.9) ** (1 / 3)  # inside [0.8, 1.2]
    # Σ over the row's 3 tokens of −s·A, each d s/d logπ_t = s/3
    assert_close(grad, [[-s * 2.0, -s * 2.0, -s * 2.0, 0.0]], rtol=1e-5)
    assert not clipped.any()


def test_cispo_weights_reinforce_by_the_clipped_detached_ratio():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipped = cispo_loss(logp, torch.zeros(1, 4), adv, mask)
    # w = clip(r, 0.8, 1.2): 1.2, 0.8, 1.1; L = −w·A·logπ
    expected = [-1.2 * 1.0 * math.log(1.5), -0.8 * -1.0 * math.log(0.5), -1.1 * 2.0 * math.log(1.1), 0.0]
    assert_close(loss, [expected], rtol=1e-5)
    assert_close(clipped, [[1.0, 1.0, 0.0, 0.0]])
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # a clipped token keeps a gradient, at its clipped weight (PPO's would be 0): −w·A
    assert_close(grad, [[-1.2, 0.8, -2.2, 0.0]], rtol=1e-5)


def test_sapo_soft_gate_hand_computed_and_ppo_gradient_on_policy():
    logp = torch.log(torch.tensor([[1.0, 1.0, 1.5, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -2.0]])
    loss, clipped = sapo_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4))

    def gate(r, tau):
        return 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))

    assert_close(loss, [[-gate(1.0, 1.0), gate(1.0, 1.05), -gate(1.5, 1.0), 2.0 * gate(0.5, 1.05)]], rtol=1e-5)
    assert not clipped.any()
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # at r = 1 the gradient is PPO's, −A; away from 1 it fades: 4σ(1 − σ)·r·(−A)
    sig = 1.0 / (1.0 + math.exp(-0.5))
    assert_close(grad[0, :2], [-1.0, 1.0], rtol=1e-5)
    assert_close(grad[0, 2], -4 * sig * (1 - sig) * 1.5, rtol=1e-5)
    with pytest.raises(ValueError):
        sapo_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), tau_pos=0.0)


def test_gspo_cispo_sapo_match_loop_references():
    rng = random.Random(5)
    B, T, el, eh, tp, tn = 4, 6, 0.2, 0.3, 1.0, 1.05
    logp = [[rng.uniform(-1, 0.2) for _ in range(T)] for _ in range(B)]
    old = [[x + rng.uniform(-0.6, 0.6) for x in row] for row in logp]
    adv = [[rng.uniform(-2, 2) for _ in range(T)] for _ in range(B)]
    lengths = [6, 2, 4, 5]
    want = {name: [[0.0] * T for _ in range(B)] for name in ("gspo", "cispo", "sapo")}
    for b in range(B):
        s = math.exp(sum(logp[b][t] - old[b][t] for t in range(lengths[b])) / lengths[b])
        for t in range(lengths[b]):
            a, r = adv[b][t], math.exp(logp[b][t] - old[b][t])
            want["gspo"][b][t] = -min(s * a, min(max(s, 1 - el), 1 + eh) * a)
            want["cispo"][b][t] = -min(max(r, 1 - el), 1 + eh) * a * logp[b][t]
            tau = tp if a > 0 else tn
            want["sapo"][b][t] = -(4 / tau) * a / (1 + math.exp(-tau * (r - 1)))
    args = [torch.tensor(x, dtype=torch.float64) for x in (logp, old, adv)] + [right_padded_mask(lengths, T)]
    got = {"gspo": gspo_loss(*args, el, eh)[0], "cispo": cispo_loss(*args, el, eh)[0], "sapo": sapo_loss(*args, tp, tn)[0]}
    for name, loss in got.items():
        assert_close(loss, want[name], atol=1e-12, rtol=1e-12)
    assert len({round(float(v), 6) for v in got["gspo"][0][:6]}) > 1  # per-token advantages still differ


# --- the engine/trainer mismatch correction -----------------------------------------------------


def test_is_correction_weights_hand_computed():
    # trainer-over-engine ratios w: row 0: 2, 0.25, 8 (pad: 100); row 1: 1, 1; row 2: 6, 6
    old = torch.log(torch.tensor([[2.0, 0.25, 8.0, 100.0], [1.0, 1.0, 1.0, 1.0], [6.0, 6.0, 1.0, 1.0]]))
    engine = torch.zeros(3, 4)
    mask = right_padded_mask([3, 2, 2], 4)
    tis = is_correction_weights(old, engine, mask, "tis", 0.5, 5.0)
    assert_close(tis, [[2.0, 0.5, 5.0, 0.0], [1.0, 1.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]])
    icepop = is_correction_weights(old, engine, mask, "icepop", 0.5, 5.0)
    assert_close(icepop, [[2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # row 0's geometric mean (2 · 0.25 · 8)^(1/3) = 4^(1/3) is inside: its raw weights stay; row 2's 6 is not
    seq = is_correction_weights(old, engine, mask, "seq-mask-tis", 0.5, 5.0)
    assert_close(seq, [[2.0, 0.25, 8.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    logp = old.clone().requires_grad_()
    assert not is_correction_weights(logp, engine, mask).requires_grad  # a weight, not a path for gradients
    with pytest.raises(ValueError):
        is_correction_weights(old, engine, mask, "tis", 2.0, 1.0)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_is_correction_weights_match_loop_reference(kind):
    rng = random.Random(7)
    B, T, low, high = 5, 6, 0.6, 1.8
    old = [[rng.uniform(-2, 0) for _ in range(T)] for _ in range(B)]
    engine = [[x + rng.uniform(-0.9, 0.9) for x in row] for row in old]
    engine[3] = [x + 1.0 + rng.uniform(-0.2, 0.2) for x in old[3]]  # a row the engine rates far above the trainer
    lengths = [6, 1, 3, 4, 5]
    want = [[0.0] * T for _ in range(B)]
    for b in range(B):
        ws = [math.exp(old[b][t] - engine[b][t]) for t in range(lengths[b])]
        seq = math.exp(sum(math.log(w) for w in ws) / lengths[b])
        for t, w in enumerate(ws):
            if kind == "tis":
                want[b][t] = min(max(w, low), high)
            elif kind == "icepop":
                want[b][t] = w if low <= w <= high else 0.0
            else:
                want[b][t] = w if low <= seq <= high else 0.0
    got = is_correction_weights(torch.tensor(old, dtype=torch.float64), torch.tensor(engine, dtype=torch.float64),
                                right_padded_mask(lengths, T), kind, low, high)
    assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert 0 < sum(w == 0 for row, n in zip(want, lengths, strict=True) for w in row[:n]) < sum(lengths) or kind == "tis"


# --- value loss -------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 1.0, -1.0]])
    old = torch.tensor([[0.0, 0.8, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    # No clip: 0.5·(V − R)².
    assert_close(value_loss(values, old, returns), [[0.5, 0.5, 0.5]])
    # Clip 0.5: V_clip = [0.5, 1.0, −0.5]; max((V−R)², (V_clip−R)²) = [2.25, 1, 1].
    assert_close(value_loss(values, old, returns, value_clip=0.5), [[1.125, 0.5, 0.5]])


def test_value_loss_matches_loop_reference():
    rng = random.Random(12)
    rows = [[(rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(-2, 2)) for _ in range(5)] for _ in range(3)]
    v, o, r = (torch.tensor([[c[i] for c in row] for row in rows], dtype=torch.float64) for i in range(3))
    expected = []
    for row in rows:
        out = []
        for vi, oi, ri in row:
            vc = oi + max(-0.3, min(0.3, vi - oi))
            out.append(0.5 * max((vi - ri) ** 2, (vc - ri) ** 2))
        expected.append(out)
    assert_close(value_loss(v, o, r, value_clip=0.3), expected, atol=1e-12, rtol=1e-12)


# --- entropy ----------------------------------------------------------------------------------


def test_entropy_hand_computed():
    # p = [1/4, 1/4, 1/2]: H = 2·(1/4)·ln4 + (1/2)·ln2 = 1.5·ln2. Uniform over 3: ln3.
    logits = torch.tensor([[[0.0, 0.0, LN2], [7.0, 7.0, 7.0]]])
    assert_close(entropy_from_logits(logits), [[1.5 * LN2, math.log(3.0)]])
    assert_close(entropy_from_logits(logits + 1000.0), [[1.5 * LN2, math.log(3.0)]], atol=1e-4)


def test_entropy_matches_loop_reference_and_gradient():
    torch.manual_seed(13)
    logits = (torch.randn(2, 3, 7, dtype=torch.float64) * 3).requires_grad_()
    expected = torch.empty(2, 3, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            z = sum(math.exp(x) for x in row)
            expected[b, t] = -sum(math.exp(x) / z * (x - math.log(z)) for x in row)
    out = entropy_from_logits(logits)
    assert_close(out, expected, atol=1e-10, rtol=1e-10)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    assert_close(grad, ref_grad, atol=1e-10, rtol=1e-10)


def test_entropy_bf16_computes_in_float32():
    torch.manual_seed(14)
    logits = (torch.randn(2, 4, 9) * 4).bfloat16()
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    expected = torch.distributions.Categorical(logits=logits.float()).entropy()
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- aggregation ------------------------------------------------------------------------------


def test_aggregate_loss_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is empty
    lengths = mask.sum(-1)
    assert loss_units(lengths, "token-mean").item() == 4
    for mode in MODES[1:]:
        assert loss_units(lengths, mode).item() == 2  # the empty row is not a unit

    assert_close(aggregate_loss(loss, mask, "token-mean"), 10.0)  # sums; the trainer divides
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.0 + 4.0)

    def agg(mode, **kw):
        return aggregate_loss(loss, mask, mode, **kw) / loss_units(lengths, mode)

    assert_close(agg("token-mean"), 10 / 4)
    assert_close(agg("seq-mean-token-sum"), (6 + 4) / 2)
    assert_close(agg("seq-mean-token-mean"), (2 + 4) / 2)
    assert_close(agg("seq-mean-token-sum-norm", norm_length=3), (6 / 3 + 4 / 3) / 2)
    with pytest.raises(ValueError, match="norm_length"):
        agg("seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        LossAggMode("seq-mean")


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_matches_loop_reference(mode):
    rng = random.Random(15)
    B, T, L_max = 5, 7, 10
    lengths = [7, 1, 0, 4, 6]
    loss = [[rng.uniform(-3, 3) for _ in range(T)] for _ in range(B)]
    rows = [(sum(loss[b][: lengths[b]]), lengths[b]) for b in range(B) if lengths[b]]
    if mode is LossAggMode.TOKEN_MEAN:
        expected = sum(s for s, _ in rows) / sum(n for _, n in rows)
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_SUM:
        expected = sum(s for s, _ in rows) / len(rows)
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        expected = sum(s / n for s, n in rows) / len(rows)
    else:
        expected = sum(s / L_max for s, _ in rows) / len(rows)
    mask = right_padded_mask(lengths, T)
    got = aggregate_loss(torch.tensor(loss, dtype=torch.float64), mask, mode, L_max) / loss_units(mask.sum(-1), mode)
    assert_close(got, expected, atol=1e-12, rtol=1e-12)


def _expected_ascent(theta, behaviour, rewards, kind):
    """The policy-gradient step direction the actor's loss gives, in expectation over samples that a
    `behaviour` policy drew: one row per action, weighted (the mask) by the engine's probability of
    sampling it, with GRPO's group baseline (the sampled rewards' mean). `kind` None: no correction."""
    theta = theta.clone().requires_grad_()
    logp = theta.log_softmax(0)[:, None]
    engine_logp = behaviour.log()[:, None]
    advantages = (rewards - (behaviour * rewards).sum())[:, None]
    loss, _, weights = corrected_policy_loss(surrogate_loss("ppo"), logp, logp.detach(), advantages,
                                             behaviour[:, None], engine_logp, kind)
    aggregate_loss(loss, behaviour[:, None], "token-mean").backward()
    return -theta.grad, weights


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_stale_samples_bias_the_update_and_the_correction_removes_it(kind):
    """Asynchronous training with high staleness: the engine sampled with a policy several versions
    old. Without correction the actor's update is the old policy's gradient, which here raises an
    action that the current policy should lower (its reward 0.6 is below the current policy's mean
    0.70, above the old one's 0.48). The correction makes the update the current policy's exact
    gradient (every weight inside the thresholds, so none is clipped)."""
    rewards = torch.tensor([1.0, 0.6, 0.0, 0.0])
    theta = torch.tensor([0.58, 0.2, 0.11, 0.11]).log()  # the policy being trained
    stale = torch.tensor([0.3, 0.3, 0.2, 0.2])  # the policy the engine sampled with
    exact = theta.clone().requires_grad_()
    (exact.softmax(0) * rewards).sum().backward()  # ∇ of the current policy's expected reward
    on_policy = exact.grad

    uncorrected, no_weights = _expected_ascent(theta, stale, rewards, None)
    assert no_weights is None
    assert on_policy[1] < 0 < uncorrected[1]  # the stale update raises the action it should lower
    assert (uncorrected - on_policy).norm() > 0.3 * on_policy.norm()

    corrected, weights = _expected_ascent(theta, stale, rewards, kind)
    assert_close(weights.squeeze(1), theta.softmax(0) / stale)  # π/μ: none clipped or dropped
    assert_close(corrected, on_policy, atol=1e-6, rtol=1e-5)
