"""Training losses, KL estimators and the RL policy/value losses as pure tensor functions.

Everything here maps tensors to tensors: no model, no engine, no I/O, so each function can be
checked against a hand computation (tests/unit/test_losses.py). The math: docs/algorithms.md.

Choices, and why:
- Inputs may be float32 or bfloat16 (or float16); every function upcasts to at least float32
  before doing arithmetic and returns float32. Log-probs of long sequences are sums of many small
  numbers, and sigmoids of small differences lose everything in bfloat16.
- Nothing here divides by a batch size. Supervised and preference losses come back summed
  (`sft_loss`) or per example (`(batch,)`: pairwise, DPO, KTO); the RL terms (`policy_loss`,
  `value_loss`, `entropy_from_logits`) per token, summed by `aggregate_loss` in the units of a
  `LossAggMode` (tokens or sequences, counted by `loss_units`). The one normaliser is the
  trainer's (`trainers.loop.optimizer_step`): it divides by the units of the whole step, every
  micro-batch of every rank, so the loss does not depend on how the step was split.
- Advantages, returns and the KL controllers, which hold rollout-side state, are in
  `advantages.py`.
- Variants are named by the torch-free enums of `names.py` (`DPOLossType`, ...) and picked
  through small registries (`DPO_LOSSES`, ...), so a config string selects a function and a typo
  fails loudly.
- Log-sigmoid and softplus are used instead of `log(sigmoid(x))` / `log(1 + exp(x))`: they stay
  finite for large |x|.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.algos.names import (
    DPOLossType,
    ISCorrectionType,
    KLEstimator,
    LossAggMode,
    PolicyLossType,
    RewardLossType,
)

__all__ = [
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "REWARD_LOSSES",
    "aggregate_loss",
    "distillation_losses",
    "dpo_loss",
    "entropy_from_logits",
    "gather_token_logprobs",
    "kl_penalty",
    "kto_kl_estimate",
    "kto_loss",
    "loss_units",
    "masked_sum",
    "pairwise_reward_loss",
    "policy_loss",
    "sft_loss",
    "value_loss",
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
    selected logit minus logsumexp is computed directly; 16-bit logits are upcast to float32 a few
    sequences at a time (`upcast_chunks`), so the forward pass holds at most about
    `UPCAST_CHUNK_ELEMENTS` float32 values of them at once.
    """
    index = labels.long().clamp(0, logits.size(-1) - 1).unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, index).squeeze(-1)
        return selected - torch.logsumexp(logits, dim=-1)
    rows = []
    for rows_logits, rows_index in zip(upcast_chunks(logits), index.split(_chunk_rows(logits)), strict=True):
        selected = rows_logits.gather(-1, rows_index).squeeze(-1)
        rows.append(selected - torch.logsumexp(rows_logits, dim=-1))
    return torch.cat(rows)


# A float32 copy of 16-bit logits is made this many values at a time at most (64 MiB): a few
# sequences of a small vocabulary at once, one sequence of a large one (still its whole length).
UPCAST_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(logits: Tensor) -> int:
    per_row = max(1, logits[0].numel()) if len(logits) else 1
    return max(1, UPCAST_CHUNK_ELEMENTS // per_row)


def upcast_chunks(logits: Tensor) -> list[Tensor]:
    """`logits (batch, ...)` in float32, as consecutive chunks of whole rows of bounded size."""
    return [chunk.float() for chunk in logits.split(_chunk_rows(logits))]


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all elements when None), in float32.

    x, mask: same shape, e.g. `(batch, seq_len)`; mask is 0/1 (bool, int or float) or float
    weights. Masked-out positions contribute exactly 0 even if `x` holds inf or NaN there.
    """
    x, mask = _f32(x), _f32(mask)
    x = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


# --- supervised fine-tuning -------------------------------------------------------------------


def sft_loss(token_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Negative log-likelihood summed over response tokens: `−Σ mask·logp`, a float32 scalar.

    token_logprobs: `(batch, seq_len)` log-probs of the target tokens (`gather_token_logprobs`).
    loss_mask: `(batch, seq_len)`, 1 on response tokens, 0 on prompt and padding.
    The trainer divides by the response tokens of the whole step, every micro-batch of every rank
    (`trainers.loop.optimizer_step`), so the loss is the global batch's mean NLL however it is
    split; a per-micro-batch mean is not when micro-batches hold different numbers of tokens.
    """
    return -masked_sum(token_logprobs, loss_mask)


# --- knowledge distillation -------------------------------------------------------------------


def distillation_losses(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor,
                        weights: Tensor) -> tuple[Tensor, Tensor]:
    """The student's NLL of the labels and its cross-entropy to the teacher's next-token
    distribution, both summed over positions: `(Σ w·−log p_S(y), Σ w·−Σ_v p_T(v) log p_S(v))`,
    float32 scalars (docs/algorithms.md, "Knowledge distillation").

    student_logits, teacher_logits: `(n, vocab)`, the logits that predict each of n loss tokens
        (the same positions in both; any float dtype, one vocabulary).
    labels: `(n,)` the tokens predicted; weights: `(n,)` the loss mask there.
    The second term is the forward KL(p_T || p_S) plus the teacher's entropy, which does not depend
    on the student (OpenRLHF's KDLoss). Where a student logit is −inf it contributes 0, as there.
    The trainer mixes them, `(1 − kd_coef)·NLL + kd_coef·distillation`, and divides by the step's
    loss tokens like the SFT loss. Computed a few rows at a time in float32 (`upcast_chunks`).
    """
    nll, distill = student_logits.new_zeros((), dtype=torch.float32), student_logits.new_zeros((), dtype=torch.float32)
    rows = _chunk_rows(student_logits)
    for s, t, y, w in zip(student_logits.split(rows), teacher_logits.split(rows), labels.split(rows),
                          _f32(weights).split(rows), strict=True):
        logp = torch.log_softmax(s.float(), dim=-1)
        p_teacher = torch.softmax(t.float(), dim=-1)
        cross = torch.where(torch.isinf(s), torch.zeros_like(logp), p_teacher * logp).sum(-1)
        nll = nll - (logp.gather(-1, y.long().unsqueeze(-1)).squeeze(-1) * w).sum()
        distill = distill - (cross * w).sum()
    return nll, distill


# --- reward model -----------------------------------------------------------------------------


def process_reward_losses(logits: Tensor, targets: Tensor, reward_ids: list[int] | None = None,
                          soft: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A process reward model's loss and its right answers, summed over steps: `(Σ CE, Σ [argmax = label])`,
    float32 scalars (OpenRLHF's PRMLoss, docs/algorithms.md, "Process reward models").

    logits: `(n, vocab)`, the model's output at each of n steps' placeholder tokens (not shifted:
        the output there predicts the token after the placeholder).
    targets: `(n,)` long, hard labels: an index into `reward_ids` (with them) or a token id (without:
        the cross-entropy over the whole vocabulary).
    soft: `(n,)` probabilities that each step is right (soft labels, two reward tokens, the first
        meaning right): the cross-entropy to `[p, 1 - p]` over the two tokens' logits; `targets` is
        then ignored and a step counts as right-labelled when p >= 0.5, as OpenRLHF counts it.
    """
    z = logits.float() if reward_ids is None else logits[:, reward_ids].float()
    logp = torch.log_softmax(z, dim=-1)
    if soft is not None:
        if z.shape[-1] != 2:
            raise ValueError(f"soft labels need two reward tokens, got {z.shape[-1]}")
        p = _f32(soft)
        loss = -(p * logp[:, 0] + (1 - p) * logp[:, 1]).sum()
        labels = (p < 0.5).long()
    else:
        labels = targets.long()
        loss = -logp.gather(-1, labels.unsqueeze(-1)).sum()
    return loss, (z.argmax(-1) == labels).sum().float()


def load_balancing_loss(router_logits: list[Tensor], top_k: int) -> Tensor:
    """The Mixture-of-Experts load-balancing loss of Switch Transformer, over every routed row of
    every MoE layer: `E * sum_e f_e * P_e`, where `f_e` is the share of rows that pick expert `e`
    among their `top_k` (the shares sum to `top_k`) and `P_e` the mean router probability of `e`.
    `router_logits`: `(rows, E)` per layer, real tokens only. Balanced routing gives `top_k`; all
    rows on the same experts give up to `E`. Only `P` carries a gradient (the picks are discrete),
    which pushes probability away from the experts that get more than their share. 0 for no rows.
    The same number as transformers' `load_balancing_loss_func` on the same rows."""
    rows = [r.float() for r in router_logits if r.shape[0]]
    if not rows:
        return torch.zeros(())
    probs = torch.cat(rows).softmax(dim=-1)
    experts = probs.shape[-1]
    picks = probs.topk(top_k, dim=-1).indices.reshape(-1)
    share = torch.zeros(experts, device=probs.device).scatter_add_(0, picks, torch.ones_like(picks, dtype=probs.dtype))
    return experts * (share / probs.shape[0] * probs.mean(dim=0)).sum()


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


# --- RL: policy, value and entropy terms ------------------------------------------------------

RATIO_LOG_CLAMP = 20.0  # |logπ − logπ_old| beyond this is clamped before exp (docs/algorithms.md)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, optionally dual-clipped.

    logprobs: `(B, T)` log-probs of the sampled tokens under the policy being trained.
    old_logprobs: `(B, T)` the same under the policy that generated the rollout.
    advantages: `(B, T)`; mask: `(B, T)` response tokens.
    ratio = exp(clamp(logπ − logπ_old, −20, 20));
    L = −min(ratio·A, clip(ratio, 1 − eps_low, 1 + eps_high)·A);
    dual clip (c = dual_clip > 1): where A < 0, L = min(L, −c·A).
    Returns `(loss, clipped)`, each `(B, T)` float32 and exactly 0 outside the mask, unreduced
    (`aggregate_loss` reduces). `clipped` is 1 where a clip bound the loss, so that the token's
    gradient is 0: the PPO clip (clip(ratio)·A < ratio·A) or the dual clip (−c·A < L); the two
    never hold on the same token. Its masked mean is the clip fraction to log.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (_f32(logprobs) - _f32(old_logprobs)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    ratio = log_ratio.exp()
    advantages = _f32(advantages).to(ratio.device)
    unclipped = ratio * advantages
    clipped_surrogate = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped_surrogate)
    clip_active = clipped_surrogate < unclipped
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
        clip_active = clip_active | dual_active
    return _kept(loss, clip_active, mask)


def _kept(loss: Tensor, clipped: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    keep = torch.as_tensor(mask, device=loss.device) != 0
    zero = torch.zeros_like(loss)
    return torch.where(keep, loss, zero), torch.where(keep, clipped.to(loss.dtype), zero)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO: the PPO surrogate on one importance ratio per sequence.

    Shapes as `policy_loss`; each row is one sequence. s = exp(clamp(Σ m·(logπ − logπ_old) / max(Σ m, 1),
    −20, 20)), the geometric mean of the row's token ratios, the same for every token of the row;
    L_t = −min(s·A_t, clip(s, 1 − eps_low, 1 + eps_high)·A_t), dual clip as in `policy_loss`.
    ∇s = (s/|y|)·Σ_t ∇logπ_t, so a row's summed loss has gradient −(s/|y|)·(Σ_t A_t)·Σ_t ∇logπ_t,
    and 0 where PPO's clip binds (A > 0 above 1 + eps_high, A < 0 below 1 − eps_low; per token,
    as A_t may differ along the row). Reduce with seq-mean-token-mean (OpenRLHF and verl force it).
    Returns `(loss, clipped)`.
    """
    mask_f = _f32(torch.as_tensor(mask)).to(logprobs.device)
    lengths = mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = ((_f32(logprobs) - _f32(old_logprobs)) * mask_f).sum(-1, keepdim=True) / lengths
    log_ratio = seq_log_ratio.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).expand_as(mask_f)
    return policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, mask, eps_low, eps_high, dual_clip)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """CISPO: REINFORCE on every token, weighted by its importance ratio clipped and detached.

    Shapes as `policy_loss`. w_t = sg(clip(r_t, 1 − eps_low, 1 + eps_high)), r_t = exp(clamp(logπ −
    logπ_old, −20, 20)); L_t = −w_t·A_t·logπ_t (verl's two-sided clip; its value is not PPO's
    surrogate, its gradient at r = 1 is). Unlike the PPO clip, a clipped token keeps its gradient,
    at the clipped weight: `clipped` is 1 where the clip changed w_t. Returns `(loss, clipped)`.
    """
    logprobs = _f32(logprobs)
    ratio = (logprobs.detach() - _f32(old_logprobs)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).exp()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -weight * _f32(advantages).to(ratio.device) * logprobs
    return _kept(loss, weight != ratio, mask)


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, Tensor]:
    """SAPO: a soft gate on the token ratio in place of PPO's hard clip.

    Shapes as `policy_loss`. L_t = −(4/τ)·σ(τ·(r_t − 1))·A_t with τ = tau_pos where A_t > 0, else
    tau_neg (verl's and TRL's defaults 1.0 / 1.05). Its gradient is 4σ(1 − σ)·A·∇r: PPO's at r = 1,
    fading smoothly as r leaves 1. Nothing is clipped: `clipped` is all 0. Returns `(loss, clipped)`.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got {tau_pos}, {tau_neg}")
    ratio = (_f32(logprobs) - _f32(old_logprobs)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).exp()
    advantages = _f32(advantages).to(ratio.device)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    return _kept(loss, torch.zeros_like(loss), mask)


def surrogate_loss(kind: PolicyLossType | str, eps_low: float = 0.2, eps_high: float = 0.2,
                   dual_clip: float | None = None, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """The actor's per-token loss `(logprobs, old_logprobs, advantages, mask) -> (loss, clipped)` that
    `--actor.policy_loss_type` names, with its hyperparameters bound."""
    kind = PolicyLossType(kind)
    if kind is PolicyLossType.PPO:
        return functools.partial(policy_loss, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    if kind is PolicyLossType.GSPO:
        return functools.partial(gspo_loss, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    if kind is PolicyLossType.CISPO:
        return functools.partial(cispo_loss, eps_low=eps_low, eps_high=eps_high)
    return functools.partial(sapo_loss, tau_pos=tau_pos, tau_neg=tau_neg)


def is_correction_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                          kind: ISCorrectionType | str = ISCorrectionType.TIS, low: float = 0.5,
                          high: float = 5.0) -> Tensor:
    """Per-token weights of the policy loss that correct for the engine sampling from another
    distribution than the trainer computes (another kernel, precision or batch; OpenRLHF's
    `--vllm_is_correction_type`).

    old_logprobs: `(B, T)` the trainer's log-probs of the sampled tokens under the policy that
    sampled them; rollout_logprobs: `(B, T)` the engine's. w_t = exp(clamp(logπ_old − logπ_engine,
    −20, 20)); `tis`: clamp(w_t, low, high); `icepop`: w_t where low ≤ w_t ≤ high, else 0;
    `seq-mask-tis`: w_t, for rows whose geometric-mean weight exp(mean_t log w_t) lies in
    [low, high], else 0. Returns `(B, T)` float32, detached, 0 outside the mask.
    """
    if not 0 <= low <= high:
        raise ValueError(f"IS correction thresholds must be 0 <= low <= high, got {low}, {high}")
    kind = ISCorrectionType(kind)
    keep = torch.as_tensor(mask, device=old_logprobs.device) != 0
    log_w = torch.where(keep, (_f32(old_logprobs) - _f32(rollout_logprobs)).detach(), 0.0)
    log_w = log_w.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    weights = log_w.exp()
    if kind is ISCorrectionType.TIS:
        weights = weights.clamp(low, high)
    elif kind is ISCorrectionType.ICEPOP:
        weights = torch.where((weights >= low) & (weights <= high), weights, 0.0)
    else:
        seq = (log_w.sum(-1) / keep.sum(-1).clamp(min=1)).exp()
        weights = weights * ((seq >= low) & (seq <= high)).to(weights.dtype)[:, None]
    return torch.where(keep, weights, 0.0)


def corrected_policy_loss(
    surrogate,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logprobs: Tensor | None = None,
    correction: ISCorrectionType | str | None = None,
    low: float = 0.5,
    high: float = 5.0,
    per_sequence: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The actor's per-token policy loss, corrected for the engine sampling from another policy.

    surrogate: a `surrogate_loss(...)`; logprobs, old_logprobs, advantages, mask as `policy_loss`;
    rollout_logprobs: `(B, T)` the engine's log-probs of the sampled tokens (its sampling
    distribution: another kernel, or in asynchronous training an older policy). With no
    `correction`, the surrogate of (logprobs, old_logprobs). With one: a per-token surrogate is
    multiplied by `is_correction_weights(old_logprobs, rollout_logprobs, ...)`, so that samples
    drawn from the engine's distribution weigh as if drawn from the trainer's old policy; a
    per-sequence ratio (GSPO) takes the engine's log-probs as its old policy instead, without
    weights. Returns `(loss, clipped, weights)`; `weights` is None where none were applied.
    """
    if correction is None:
        return *surrogate(logprobs, old_logprobs, advantages, mask), None
    if rollout_logprobs is None:
        raise ValueError("an engine/trainer correction needs the engine's log-probs of the sampled tokens")
    if per_sequence:
        return *surrogate(logprobs, rollout_logprobs, advantages, mask), None
    loss, clipped = surrogate(logprobs, old_logprobs, advantages, mask)
    weights = is_correction_weights(old_logprobs, rollout_logprobs, mask, correction, low, high)
    return loss * weights, clipped, weights


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None = None
) -> Tensor:
    """Critic regression loss per token.

    values: `(B, T)` current predictions V; old_values: `(B, T)` predictions at rollout time;
    returns: `(B, T)` targets R.
    Without value_clip: 0.5·(V − R)². With it: 0.5·max((V − R)², (V_clip − R)²), where
    V_clip = V_old + clamp(V − V_old, −value_clip, value_clip).
    Returns `(B, T)` float32, unmasked and unreduced (`aggregate_loss` masks and reduces).
    """
    values, returns = _f32(values), _f32(returns).to(values.device)
    loss = (values - returns) ** 2
    if value_clip is not None:
        old_values = _f32(old_values).to(values.device)
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


def _entropy(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z over the last dim, in the dtype of `logits`."""
    probs = torch.softmax(logits, dim=-1)
    expected_logit = (probs.unsqueeze(-2) @ logits.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    return torch.logsumexp(logits, dim=-1) - expected_logit


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of each position's logits.

    logits: `(B, T, vocab)`, any float dtype.
    Returns `(B, T)` float32: −Σ_v p_v·log p_v = logsumexp(z) − Σ_v p_v·z_v, differentiable.

    As in `gather_token_logprobs`, 16-bit logits are upcast a bounded chunk of sequences at a time
    (`upcast_chunks`); float32 logits are used as they are. The expected logit is a batched dot
    product, with no `p·z` product tensor.
    """
    if logits.dtype in (torch.float32, torch.float64):
        return _entropy(logits)
    return torch.cat([_entropy(chunk) for chunk in upcast_chunks(logits)])


# --- RL: loss aggregation ---------------------------------------------------------------------


def loss_units(lengths: Tensor, mode: LossAggMode | str) -> Tensor:
    """What sequences of these response lengths add to the normaliser of `aggregate_loss`.

    lengths: `(B,)` response tokens per sequence (a response mask's row sums; float weights too).
    Returns a float32 scalar: for `token-mean` the sum of the lengths (the response tokens); for
    the seq-* modes the number of sequences with at least one response token. A sequence without
    any contributes no loss, so it is not counted either: a batch padded with empty rows has the
    same loss as one without them (as in verl and OpenRLHF).
    """
    n = _f32(lengths)
    if LossAggMode(mode).per_token:
        return n.sum()
    return (n != 0).to(n.dtype).sum()


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: LossAggMode | str,
    norm_length: int | float | None = None,
) -> Tensor:
    """A micro-batch's loss summed in the units of `mode`, before the step's normaliser.

    loss: `(B, T)` per-token loss; mask: `(B, T)` response-token mask (0/1 or float weights).
    norm_length: the constant of `seq-mean-token-sum-norm` (the maximum response length,
        Dr.GRPO); required for that mode, unused otherwise.
    With s_b = Σ_t mask·L (a sequence's token sum) and n_b = Σ_t mask (its token count):
      token-mean, seq-mean-token-sum:  Σ_b s_b
      seq-mean-token-mean:             Σ_{b: n_b>0} s_b / n_b
      seq-mean-token-sum-norm:         Σ_b s_b / norm_length
    Returns a float32 scalar. The trainer divides the step's sum by its `loss_units` over every
    micro-batch of every rank (`trainers.loop.optimizer_step`): token-mean's units are tokens, the
    seq-* modes' sequences, so the result is the whole batch's loss whatever the split.
    """
    mode = LossAggMode(mode)
    seq_sums = masked_sum(loss, mask, dim=-1)  # (B,)
    if mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        counts = _f32(mask).sum(-1).to(seq_sums.device)
        seq_sums = torch.where(counts != 0, seq_sums / counts.clamp(min=1e-8), torch.zeros_like(seq_sums))
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        if norm_length is None or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (the maximum response length)")
        seq_sums = seq_sums / norm_length
    return seq_sums.sum()
