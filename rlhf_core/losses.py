"""Training losses and KL estimators as pure tensor functions.

Everything here maps tensors to tensors: no model, no engine, no I/O, so each function can be
checked against a hand computation (tests/unit/test_losses.py). The math: docs/algorithms.md.

Choices, and why:
- Inputs may be float32 or bfloat16 (or float16); every function upcasts to at least float32
  before doing arithmetic and returns float32. Log-probs of long sequences are sums of many small
  numbers, and sigmoids of small differences lose everything in bfloat16.
- Nothing reduces over the batch unless reducing is the point (`sft_loss`): pairwise, DPO and KTO
  losses come back per example, shape `(batch,)`, and the trainer aggregates them, because only
  the trainer knows the global batch size across micro-batches and data-parallel ranks.
- Token-level aggregation divides by a count the caller passes in (`num_tokens`, the number of
  response tokens in the whole global batch). Summing the micro-batch losses of every rank then
  equals the loss of one big batch, which a per-micro-batch mean does not when micro-batches hold
  different numbers of tokens.
- Variants are `str` enums (`DPOLossType`, ...) picked by name through small registries
  (`DPO_LOSSES`, ...), so a config string selects a function and a typo fails loudly.
- Log-sigmoid and softplus are used instead of `log(sigmoid(x))` / `log(1 + exp(x))`: they stay
  finite for large |x|.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "REWARD_LOSSES",
    "DPOLossType",
    "KLEstimator",
    "RewardLossType",
    "dpo_loss",
    "gather_token_logprobs",
    "kl_penalty",
    "kto_kl_estimate",
    "kto_loss",
    "masked_mean",
    "masked_sum",
    "pairwise_reward_loss",
    "sft_loss",
]

KL_CLAMP = 10.0  # |logπ − logπ_ref| beyond this is clamped before any KL estimator (docs/algorithms.md)


def _f32(x: Tensor | float) -> Tensor:
    """`x` as a tensor of at least float32 precision (float64 stays float64)."""
    x = torch.as_tensor(x)
    return x.to(torch.promote_types(x.dtype, torch.float32))


# --- token log-probs and masked reductions ----------------------------------------------------


def gather_token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under the softmax of its logits.

    logits: `(batch, seq_len, vocab)`, any float dtype.
    labels: `(batch, seq_len)` token ids. Positions the caller will mask out may hold anything
        (-100, pad ids); they are clamped into `[0, vocab)` so indexing never fails, and the value
        returned there is meaningless.
    Returns `(batch, seq_len)` float32: `logits[label] − logsumexp(logits)`.

    This never builds a full `(batch, seq_len, vocab)` log_softmax: for float32 logits the
    selected logit minus logsumexp is computed directly; for 16-bit logits one sequence at a time
    is upcast to float32, so the forward pass holds at most one `(seq_len, vocab)` float32 copy.
    """
    index = labels.long().clamp(0, logits.size(-1) - 1).unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, index).squeeze(-1)
        return selected - torch.logsumexp(logits, dim=-1)
    rows = []
    for row_logits, row_index in zip(logits, index, strict=True):  # (seq_len, vocab), (seq_len, 1)
        row_logits = row_logits.float()
        selected = row_logits.gather(-1, row_index).squeeze(-1)
        rows.append(selected - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all elements when None), in float32.

    x, mask: same shape, e.g. `(batch, seq_len)`; mask is 0/1 (bool, int or float) or float
    weights. Masked-out positions contribute exactly 0 even if `x` holds inf or NaN there.
    """
    x, mask = _f32(x), _f32(mask)
    x = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is set, over `dim` (all elements when None).

    x, mask: same shape, e.g. `(batch, seq_len)`. An empty mask gives 0, not NaN.
    """
    count = _f32(mask).sum() if dim is None else _f32(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


# --- supervised fine-tuning -------------------------------------------------------------------


def sft_loss(token_logprobs: Tensor, loss_mask: Tensor, num_tokens: int | Tensor | None = None) -> Tensor:
    """Token-level negative log-likelihood over response tokens.

    token_logprobs: `(batch, seq_len)` log-probs of the target tokens (`gather_token_logprobs`).
    loss_mask: `(batch, seq_len)`, 1 on response tokens, 0 on prompt and padding.
    num_tokens: response-token count of the whole global batch (all micro-batches on all ranks);
        None divides by this micro-batch's own count.
    Returns a float32 scalar: `−Σ mask·logp / num_tokens`.

    With the global count, summing this loss over micro-batches and ranks gives the mean NLL of
    the global batch exactly, however it was split. An engine that itself scales the loss by
    1/accumulation_steps or averages gradients over ranks must have that scaling undone by the
    caller (multiply by the factor it divides by).
    """
    total = -masked_sum(token_logprobs, loss_mask)
    if num_tokens is None:
        count = _f32(loss_mask).sum()
    else:
        count = _f32(num_tokens).to(total.device)
    return total / count.clamp(min=1)


# --- reward model -----------------------------------------------------------------------------


class RewardLossType(str, Enum):
    """Pairwise (Bradley–Terry) reward-model loss variants."""

    SIGMOID = "sigmoid"  # −log σ(r_c − r_r − margin)
    LOGEXP = "logexp"  # log(1 + exp(r_r − r_c + margin)); equals SIGMOID mathematically


def _sigmoid_reward_loss(delta: Tensor) -> Tensor:
    return -F.logsigmoid(delta)


def _logexp_reward_loss(delta: Tensor) -> Tensor:
    return F.softplus(-delta)


# Each maps delta = r_c − r_r − margin, shape (batch,), to per-pair losses (batch,).
REWARD_LOSSES: dict[RewardLossType, Callable[[Tensor], Tensor]] = {
    RewardLossType.SIGMOID: _sigmoid_reward_loss,
    RewardLossType.LOGEXP: _logexp_reward_loss,
}


def pairwise_reward_loss(
    chosen_reward: Tensor,
    rejected_reward: Tensor,
    loss_type: RewardLossType | str = RewardLossType.SIGMOID,
    margin: Tensor | float | None = None,
) -> Tensor:
    """Bradley–Terry loss for each (chosen, rejected) pair.

    chosen_reward, rejected_reward: `(batch,)` scalar scores.
    margin: `(batch,)` or a float, subtracted from r_c − r_r (Llama-2 style); None for none.
    Returns `(batch,)` float32 per-pair losses; the caller averages.
    """
    delta = _f32(chosen_reward) - _f32(rejected_reward)
    if margin is not None:
        delta = delta - _f32(margin).to(delta.device)
    return REWARD_LOSSES[RewardLossType(loss_type)](delta)


# --- direct preference optimisation -----------------------------------------------------------


class DPOLossType(str, Enum):
    """DPO-family losses on the log-ratio margin z (docs/algorithms.md)."""

    SIGMOID = "sigmoid"  # DPO, cDPO with label_smoothing > 0
    IPO = "ipo"
    HINGE = "hinge"  # SLiC

    @property
    def needs_reference_model(self) -> bool:
        # All three compare against π_ref. Reference-free variants (SimPO, ORPO) would say False.
        return True


def _sigmoid_dpo_loss(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)


def _ipo_loss(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (z - 1 / (2 * beta)) ** 2


def _hinge_loss(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return torch.relu(1 - beta * z)


# Each maps (z (batch,), beta, label_smoothing) to per-pair losses (batch,).
DPO_LOSSES: dict[DPOLossType, Callable[[Tensor, float, float], Tensor]] = {
    DPOLossType.SIGMOID: _sigmoid_dpo_loss,
    DPOLossType.IPO: _ipo_loss,
    DPOLossType.HINGE: _hinge_loss,
}


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: DPOLossType | str = DPOLossType.SIGMOID,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO / cDPO / IPO / hinge loss per preference pair.

    All four inputs: `(batch,)` sequence log-probs, summed over response tokens (pass
    length-averaged log-probs instead if you want IPO's per-token normalisation).
    z = (logπ_c − logπ_r) − (logπ_ref_c − logπ_ref_r);
      sigmoid: −(1−ε)·log σ(βz) − ε·log σ(−βz)  (ε = label_smoothing, cDPO)
      ipo:     (z − 1/(2β))²
      hinge:   max(0, 1 − βz)
    Returns `(losses, chosen_rewards, rejected_rewards)`, each `(batch,)` float32; the rewards
    β·(logπ − logπ_ref) are detached, for logging and reward accuracy.
    """
    loss_type = DPOLossType(loss_type)
    if label_smoothing and loss_type is not DPOLossType.SIGMOID:
        raise ValueError(f"label_smoothing applies to the sigmoid loss only, not {loss_type.value!r}")
    chosen_logratio = _f32(policy_chosen_logps) - _f32(ref_chosen_logps)
    rejected_logratio = _f32(policy_rejected_logps) - _f32(ref_rejected_logps)
    z = chosen_logratio - rejected_logratio
    losses = DPO_LOSSES[loss_type](z, beta, label_smoothing)
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


# --- Kahneman–Tversky optimisation ------------------------------------------------------------


def kto_kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's batch KL reference point, before clamping.

    policy_kl_logps, ref_kl_logps: `(batch,)` sequence log-probs of *mismatched* pairs (each
    prompt with another example's completion), as in the KTO paper, so the estimate does not
    reward the policy for fitting the very completions it is trained on.
    Returns a detached float32 scalar `mean(policy − ref)`; the caller all-reduces it (mean)
    across data-parallel ranks before handing it to `kto_loss`.
    """
    return (_f32(policy_kl_logps) - _f32(ref_kl_logps)).mean().detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    is_desirable: Tensor,
    kl_estimate: Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """KTO loss per example.

    policy_logps, ref_logps: `(batch,)` sequence log-probs (summed over response tokens).
    is_desirable: `(batch,)` bool, True for desirable examples.
    kl_estimate: scalar from `kto_kl_estimate` (all-reduced); z_ref = max(kl_estimate, 0).
    With r = logπ − logπ_ref:
      desirable:   λ_d·(1 − σ(β(r − z_ref)))
      undesirable: λ_u·(1 − σ(β(z_ref − r)))
    Returns `(losses (batch,), rewards (batch,), z_ref ())`, float32; rewards are β·r and z_ref
    is detached, both for logging.
    """
    logratio = _f32(policy_logps) - _f32(ref_logps)
    z_ref = _f32(kl_estimate).to(logratio.device).detach().clamp(min=0)
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (logratio - z_ref)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z_ref - logratio)))
    losses = torch.where(is_desirable.to(logratio.device).bool(), desirable, undesirable)
    return losses, beta * logratio.detach(), z_ref


# --- KL estimators ----------------------------------------------------------------------------


class KLEstimator(str, Enum):
    """Per-token estimators of KL(π ‖ π_ref) from samples of π (Schulman's k1, k2, k3)."""

    K1 = "k1"  # Δ: unbiased, high variance, can be negative
    K2 = "k2"  # Δ²/2: biased, low variance, gradient is that of KL for on-policy samples
    K3 = "k3"  # exp(−Δ) − 1 + Δ: unbiased, non-negative


# Each maps the clamped Δ = logπ − logπ_ref, (batch, seq_len), to per-token KL (batch, seq_len).
KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.K1: lambda delta: delta,
    KLEstimator.K2: lambda delta: 0.5 * delta**2,
    KLEstimator.K3: lambda delta: torch.expm1(-delta) + delta,
}


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator | str = KLEstimator.K1
) -> Tensor:
    """Per-token KL estimate between the policy and the reference.

    logprobs, ref_logprobs: `(batch, seq_len)` per-token log-probs of the sampled tokens.
    Δ = logπ − logπ_ref is clamped to ±10 before the estimator is applied, so one token with a
    vanishing reference probability cannot blow up the reward or the loss.
    Returns `(batch, seq_len)` float32, unmasked; the caller masks and aggregates.
    """
    delta = (_f32(logprobs) - _f32(ref_logprobs)).clamp(-KL_CLAMP, KL_CLAMP)
    return KL_ESTIMATORS[KLEstimator(estimator)](delta)
