"""rlhf_core.algos.losses against hand-computed values and plain-Python loop references."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.algos.losses import (
    DPO_LOSSES,
    KL_ESTIMATORS,
    REWARD_LOSSES,
    dpo_loss,
    gather_token_logprobs,
    kl_penalty,
    kto_kl_estimate,
    kto_loss,
    masked_sum,
    pairwise_reward_loss,
    sft_loss,
)
from rlhf_core.algos.names import DPOLossType, KLEstimator, RewardLossType

LN2 = math.log(2.0)


def softplus(x: float) -> float:
    """log(1 + e^x), stable in plain Python."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def assert_close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


# --- gather_token_logprobs --------------------------------------------------------------------


def test_gather_token_logprobs_hand_computed():
    # logits [0, 0, ln2]: exp -> [1, 1, 2], sum 4, so p = [1/4, 1/4, 1/2]
    # label 2 -> ln(1/2) = -ln2; label 0 -> ln(1/4) = -2 ln2
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])
    labels = torch.tensor([[2, 0]])
    assert_close(gather_token_logprobs(logits, labels), [[-LN2, -2 * LN2]])
    # Softmax is shift-invariant; a naive exp() would overflow at +1000.
    assert_close(gather_token_logprobs(logits + 1000.0, labels), [[-LN2, -2 * LN2]], atol=1e-4)


def test_gather_token_logprobs_matches_loop_over_log_softmax():
    torch.manual_seed(0)
    B, T, V = 3, 5, 11
    logits = torch.randn(B, T, V, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, T))
    expected = torch.empty(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            row = logits[b, t].tolist()
            log_z = math.log(sum(math.exp(v) for v in row))
            expected[b, t] = row[labels[b, t]] - log_z
    assert_close(gather_token_logprobs(logits, labels), expected, atol=1e-10, rtol=1e-10)
    assert_close(gather_token_logprobs(logits.float(), labels), expected.float(), atol=1e-5, rtol=1e-5)


def test_gather_token_logprobs_bf16_computes_in_float32():
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 7) * 4).bfloat16()
    labels = torch.randint(0, 7, (2, 4))
    out = gather_token_logprobs(logits, labels)
    assert out.dtype == torch.float32
    # Same as float32 arithmetic on the bf16-rounded logits, far tighter than bf16's ~3 digits.
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_gather_token_logprobs_ignores_out_of_range_labels_and_backprops():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.tensor([[1, -100, 4], [-100, 2, 99]])
    out = gather_token_logprobs(logits, labels)
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    mask = labels.ge(0) & labels.lt(5)
    masked_sum(out, mask).backward()
    # d/dlogits of log p(y) = onehot(y) - softmax; masked positions get no gradient.
    probs = torch.softmax(logits.detach(), -1)
    assert_close(logits.grad[0, 0], F.one_hot(torch.tensor(1), 5).float() - probs[0, 0])
    assert_close(logits.grad[0, 1], torch.zeros(5))


# --- masked reductions ------------------------------------------------------------------------


def test_masked_sum_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert_close(masked_sum(x, mask), 14.0)  # 1 + 2 + 5 + 6
    assert_close(masked_sum(x, mask, dim=1), [3.0, 11.0])  # 1+2, 5+6
    assert_close(masked_sum(x, mask, dim=0), [1.0, 7.0, 6.0])


def test_masked_sum_ignores_nonfinite_masked_values():
    x = torch.tensor([[1.0, float("inf")], [float("nan"), float("-inf")]])
    mask = torch.tensor([[True, False], [False, False]])
    assert_close(masked_sum(x, mask), 1.0)
    assert_close(masked_sum(x, mask, dim=1), [1.0, 0.0])  # empty second row -> 0, not NaN


def test_masked_sum_matches_loop_reference_with_weights():
    torch.manual_seed(3)
    x = torch.randn(4, 6)
    mask = torch.rand(4, 6) * (torch.rand(4, 6) > 0.4)  # float weights with zeros
    for b in range(4):
        s = sum(x[b, t].item() * mask[b, t].item() for t in range(6))
        assert_close(masked_sum(x, mask, dim=1)[b], s, atol=1e-5)


# --- sft_loss ---------------------------------------------------------------------------------


def test_sft_loss_hand_computed():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # NLL over response tokens: 1 + 2 + 3 + 0.5 + 0.5 = 7 (the trainer divides by the step's tokens:
    # tests/unit/test_optimizer_step.py)
    assert_close(sft_loss(logps, mask), 7.0)
    # Prompt tokens (mask 0) do not count: only -3 and -0.5
    assert_close(sft_loss(logps, torch.tensor([[0, 0, 1], [1, 0, 0]])), 3.5)
    assert sft_loss(logps.bfloat16(), mask).dtype == torch.float32


def test_sft_loss_matches_loop_reference():
    torch.manual_seed(4)
    logps = -torch.rand(3, 8) * 5
    mask = torch.rand(3, 8) > 0.3
    nll = 0.0
    for b in range(3):
        for t in range(8):
            if mask[b, t]:
                nll -= logps[b, t].item()
    assert_close(sft_loss(logps, mask), nll, atol=1e-5)


# --- pairwise reward loss ---------------------------------------------------------------------


def test_pairwise_reward_loss_hand_computed():
    chosen = torch.tensor([2.0, 0.0])
    rejected = torch.tensor([1.0, 0.0])
    # -log σ(1) = log(1 + e^-1) = 0.3132617; -log σ(0) = ln 2
    expected = [0.31326168751822286, LN2]
    assert_close(pairwise_reward_loss(chosen, rejected, "sigmoid"), expected)
    # log(1 + exp(r_r - r_c)) is the same function of the difference
    assert_close(pairwise_reward_loss(chosen, rejected, RewardLossType.LOGEXP), expected)
    # margin 1: -log σ(0) = ln 2; -log σ(-1) = log(1 + e) = 1.3132617
    with_margin = [LN2, 1.3132616875182228]
    assert_close(pairwise_reward_loss(chosen, rejected, "sigmoid", margin=1.0), with_margin)
    assert_close(pairwise_reward_loss(chosen, rejected, "logexp", margin=torch.ones(2)), with_margin)


def test_pairwise_reward_loss_is_stable_for_large_gaps():
    # -log σ(-100) = 100 + log(1 + e^-100) ≈ 100; a naive log(sigmoid) gives inf
    out = pairwise_reward_loss(torch.tensor([-50.0]), torch.tensor([50.0]))
    assert_close(out, [100.0], atol=1e-4)


@pytest.mark.parametrize("loss_type", list(RewardLossType))
def test_pairwise_reward_loss_matches_loop_reference(loss_type):
    torch.manual_seed(6)
    chosen, rejected, margin = torch.randn(16) * 3, torch.randn(16) * 3, torch.rand(16)
    expected = [
        softplus(-(c - r - m)) if loss_type is RewardLossType.SIGMOID else math.log1p(math.exp(r - c + m))
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)
    ]
    assert_close(pairwise_reward_loss(chosen, rejected, loss_type, margin=margin), expected, atol=1e-5)


# --- DPO family -------------------------------------------------------------------------------

# Pair 0: z = (-10 - -20) - (-12 - -18) = 10 - 6 = 4, βz = 0.4 with β = 0.1
# Pair 1: z = (-5 - -30) - (-6 - -11) = 25 - 5 = 20, βz = 2
POLICY_C, POLICY_R = torch.tensor([-10.0, -5.0]), torch.tensor([-20.0, -30.0])
REF_C, REF_R = torch.tensor([-12.0, -6.0]), torch.tensor([-18.0, -11.0])


def test_dpo_sigmoid_hand_computed():
    losses, chosen_rewards, rejected_rewards = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1)
    # -log σ(0.4) = log(1 + e^-0.4) = 0.5130153; -log σ(2) = log(1 + e^-2) = 0.1269280
    assert_close(losses, [0.5130152523999526, softplus(-2.0)])
    # β(logπ - logπ_ref): chosen 0.1·(-10 + 12) = 0.2, 0.1·(-5 + 6) = 0.1;
    # rejected 0.1·(-20 + 18) = -0.2, 0.1·(-30 + 11) = -1.9
    assert_close(chosen_rewards, [0.2, 0.1])
    assert_close(rejected_rewards, [-0.2, -1.9])


def test_dpo_label_smoothing_is_cdpo():
    losses, _, _ = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1, label_smoothing=0.1)
    # 0.9·log(1 + e^-0.4) + 0.1·log(1 + e^0.4); log(1 + e^x) = log(1 + e^-x) + x,
    # so = log(1 + e^-0.4) + 0.1·0.4 = 0.5130153 + 0.04 = 0.5530153
    assert_close(losses[0], 0.5530152523999526)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, loss_type="ipo", label_smoothing=0.1)


def test_dpo_ipo_and_hinge_hand_computed():
    ipo, _, _ = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1, loss_type="ipo")
    # (z - 1/(2β))² with 1/(2·0.1) = 5: (4 - 5)² = 1, (20 - 5)² = 225
    assert_close(ipo, [1.0, 225.0])
    hinge, _, _ = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1, loss_type=DPOLossType.HINGE)
    # max(0, 1 - βz): 1 - 0.4 = 0.6, max(0, 1 - 2) = 0
    assert_close(hinge, [0.6, 0.0])


def test_dpo_gradient_and_detached_rewards():
    policy_c = POLICY_C.clone().requires_grad_()
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_c, POLICY_R, REF_C, REF_R, beta=0.1)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad
    losses[0].backward()
    # d/dlogπ_c of -log σ(βz) = -β·σ(-βz) = -0.1·σ(-0.4) = -0.0401312
    assert_close(policy_c.grad, [-0.0401312339887548, 0.0])


@pytest.mark.parametrize("loss_type", list(DPOLossType))
def test_dpo_matches_loop_reference(loss_type):
    torch.manual_seed(7)
    pc, pr, rc, rr = (-torch.rand(8) * 50 for _ in range(4))
    beta, eps = 0.2, (0.15 if loss_type is DPOLossType.SIGMOID else 0.0)
    expected = []
    for i in range(8):
        z = (pc[i].item() - pr[i].item()) - (rc[i].item() - rr[i].item())
        if loss_type is DPOLossType.SIGMOID:
            expected.append(-(1 - eps) * math.log(sigmoid(beta * z)) - eps * math.log(sigmoid(-beta * z)))
        elif loss_type is DPOLossType.IPO:
            expected.append((z - 1 / (2 * beta)) ** 2)
        else:
            expected.append(max(0.0, 1 - beta * z))
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    assert_close(losses, expected, atol=1e-4, rtol=1e-5)
    assert loss_type.needs_reference_model


def test_dpo_label_smoothing_zero_equals_minus_logsigmoid():
    torch.manual_seed(8)
    pc, pr, rc, rr = (-torch.rand(8) * 50 for _ in range(4))
    z = (pc - pr) - (rc - rr)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.0)
    assert_close(losses, -F.logsigmoid(0.1 * z))


# --- KTO --------------------------------------------------------------------------------------


def test_kto_loss_hand_computed():
    policy, ref = torch.tensor([-5.0, -5.0]), torch.tensor([-7.0, -3.0])
    desirable = torch.tensor([True, False])
    # r = [2, -2], z_ref = max(1, 0) = 1, β = 0.1
    # desirable:   1 - σ(0.1·(2 - 1))  = 1 - σ(0.1) = 0.4750208
    # undesirable: 1 - σ(0.1·(1 + 2))  = 1 - σ(0.3) = 0.4255575
    losses, rewards, z_ref = kto_loss(policy, ref, desirable, torch.tensor(1.0), beta=0.1)
    assert_close(losses, [0.47502081252106, 0.42555748318834097])
    assert_close(rewards, [0.2, -0.2])  # β·r
    assert_close(z_ref, 1.0)
    # weights λ_d = 2, λ_u = 0.5: 0.9500416, 0.2127787
    losses, _, _ = kto_loss(
        policy, ref, desirable, 1.0, beta=0.1, desirable_weight=2.0, undesirable_weight=0.5
    )
    assert_close(losses, [0.95004162504212, 0.21277874159417048])
    # A negative KL estimate is clamped to 0: both become 1 - σ(0.2) = 0.4501660
    losses, _, z_ref = kto_loss(policy, ref, desirable, -3.0, beta=0.1)
    assert_close(losses, [0.45016600268752205, 0.45016600268752205])
    assert_close(z_ref, 0.0)


def test_kto_kl_estimate_hand_computed_and_detached():
    policy = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -1.0])
    kl = kto_kl_estimate(policy, ref)
    # differences [1, 0, -2], mean -1/3 (not clamped here; kto_loss clamps)
    assert_close(kl, -1.0 / 3.0)
    assert not kl.requires_grad


def test_kto_matches_loop_reference_and_z_ref_gets_no_gradient():
    torch.manual_seed(9)
    policy = (-torch.rand(10) * 40).requires_grad_()
    ref = -torch.rand(10) * 40
    desirable = torch.rand(10) > 0.5
    kl = (-torch.rand(10) * 40).requires_grad_()  # policy log-probs of the mismatched pairs
    ref_kl = -torch.rand(10) * 40  # the reference's
    # The reference point written out on its own (not through kto_kl_estimate): mean of the
    # mismatched pairs' log-ratios, clamped at 0 (positive here: the check below needs z_ref > 0).
    kl_mean = sum(kl[i].item() - ref_kl[i].item() for i in range(10)) / 10
    ref_kl = ref_kl - max(0.0, 1.5 - kl_mean)  # shift so the mean log-ratio is at least 1.5
    z_ref = max(sum(kl[i].item() - ref_kl[i].item() for i in range(10)) / 10, 0.0)
    assert z_ref >= 1.5 - 1e-4
    beta, wd, wu = 0.3, 1.5, 0.7
    expected = []
    for i in range(10):
        r = policy[i].item() - ref[i].item()
        if desirable[i]:
            expected.append(wd * (1 - sigmoid(beta * (r - z_ref))))
        else:
            expected.append(wu * (1 - sigmoid(beta * (z_ref - r))))
    losses, _, _ = kto_loss(policy, ref, desirable, kto_kl_estimate(kl, ref_kl), beta, wd, wu)
    assert_close(losses, expected, atol=1e-5)
    losses.sum().backward()
    assert kl.grad is None and policy.grad is not None


# --- KL estimators ----------------------------------------------------------------------------


def test_kl_penalty_hand_computed_with_clamp():
    logprobs = torch.tensor([[0.0, -1.0, 15.0, -20.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0, -5.0]])
    # Δ = [0, -1, 15, -15] clamped to [0, -1, 10, -10]
    assert_close(kl_penalty(logprobs, ref, "k1"), [[0.0, -1.0, 10.0, -10.0]])
    # Δ²/2: 0, 0.5, 50, 50
    assert_close(kl_penalty(logprobs, ref, "k2"), [[0.0, 0.5, 50.0, 50.0]])
    # exp(-Δ) - 1 + Δ: 0; e - 2 = 0.7182818; e^-10 + 9 = 9.0000454; e^10 - 11 = 22015.4658
    assert_close(
        kl_penalty(logprobs, ref, KLEstimator.K3),
        [[0.0, 0.7182818284590451, 9.000045399929762, 22015.465794806718]],
    )


@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_kl_penalty_matches_loop_reference(estimator):
    torch.manual_seed(10)
    logprobs, ref = torch.randn(3, 7) * 6, torch.randn(3, 7) * 6  # some |Δ| > 10
    out = kl_penalty(logprobs, ref, estimator)
    for b in range(3):
        for t in range(7):
            d = min(max(logprobs[b, t].item() - ref[b, t].item(), -10.0), 10.0)
            expected = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator.value]
            assert out[b, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_kl_k3_is_nonnegative_and_k1_default():
    torch.manual_seed(11)
    logprobs, ref = torch.randn(4, 16), torch.randn(4, 16)
    assert (kl_penalty(logprobs, ref, "k3") >= 0).all()
    assert_close(kl_penalty(logprobs, ref), logprobs - ref)


# --- dtypes and registries --------------------------------------------------------------------


def test_bfloat16_inputs_return_float32():
    torch.manual_seed(12)
    x = [(-torch.rand(4) * 20).bfloat16() for _ in range(4)]
    mask = torch.ones(4, dtype=torch.bool)
    outputs = [
        masked_sum(x[0], mask),
        sft_loss(x[0].view(2, 2), mask.view(2, 2)),
        pairwise_reward_loss(x[0], x[1]),
        *dpo_loss(*x),
        *kto_loss(x[0], x[1], mask, kto_kl_estimate(x[2], x[3])),
        kl_penalty(x[0], x[1], "k3"),
    ]
    assert all(out.dtype == torch.float32 for out in outputs)
    # The arithmetic is float32 on the bf16 values: βz is exact, not rounded to bf16.
    z = (x[0].float() - x[1].float()) - (x[2].float() - x[3].float())
    assert_close(dpo_loss(*x)[0], -F.logsigmoid(0.1 * z))


def test_registries_pick_by_name_and_reject_unknown_names():
    assert set(REWARD_LOSSES) == set(RewardLossType)
    assert set(DPO_LOSSES) == set(DPOLossType)
    assert set(KL_ESTIMATORS) == set(KLEstimator)
    assert DPOLossType("ipo") is DPOLossType.IPO
    with pytest.raises(ValueError):
        dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, loss_type="simpo")
    with pytest.raises(ValueError):
        kl_penalty(POLICY_C, REF_C, "k4")
    with pytest.raises(ValueError):
        pairwise_reward_loss(POLICY_C, REF_C, "hinge")


def test_distillation_losses_are_the_nll_and_the_cross_entropy_to_the_teacher():
    """By hand: NLL = −Σ w·log p_S(y); distillation = −Σ w·Σ_v p_T(v) log p_S(v), whose gradient in
    the student's logits is w·(p_S − p_T): it pulls the student's whole distribution to the
    teacher's, not only the label's probability; a −inf student logit adds nothing."""
    from rlhf_core.algos.losses import distillation_losses

    torch.manual_seed(0)
    student = torch.randn(5, 7, requires_grad=True)
    teacher = torch.randn(5, 7)
    labels = torch.tensor([0, 3, 6, 2, 2])
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])
    nll, distill = distillation_losses(student, teacher, labels, weights)
    logp = torch.log_softmax(student.detach(), -1)
    p_teacher = torch.softmax(teacher, -1)
    assert torch.allclose(nll, -(logp[torch.arange(5), labels] * weights).sum())
    assert torch.allclose(distill, -((p_teacher * logp).sum(-1) * weights).sum())
    distill.backward()
    assert torch.allclose(student.grad, weights[:, None] * (logp.exp() - p_teacher), atol=1e-6)
    # the teacher's own distribution: the cross-entropy is its entropy, the minimum over students
    _, own = distillation_losses(teacher, teacher, labels, weights)
    assert own < distill and torch.allclose(own, -((p_teacher * p_teacher.log()).sum(-1) * weights).sum())
    masked = teacher.clone()
    masked[0, 1] = float("-inf")
    _, finite = distillation_losses(masked, teacher, labels, weights)
    assert torch.isfinite(finite)
    # bf16 logits are computed in float32, and chunking rows does not change the sums
    import rlhf_core.algos.losses as losses

    chunked = losses.UPCAST_CHUNK_ELEMENTS
    losses.UPCAST_CHUNK_ELEMENTS = 14  # two rows a chunk
    try:
        again = distillation_losses(student.detach(), teacher, labels, weights)
    finally:
        losses.UPCAST_CHUNK_ELEMENTS = chunked
    assert torch.allclose(again[0], nll) and torch.allclose(again[1], distill)
