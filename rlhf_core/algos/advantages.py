"""Rollout-side RL math: reward shaping, KL in the reward, returns, advantages, KL controllers.

Pure tensor functions (plus two tiny stateful KL controllers): no model, no engine, no I/O. The
math is specified in docs/algorithms.md; the tests are tests/unit/test_advantages.py.

Shapes: B rollout samples, T response positions. Per-token tensors are `(B, T)` with a `mask`
that is 1 on response tokens (responses are right-padded; the last set position of a row is its
last response token). Scalar rewards are `(B,)`, laid out prompt-major: the n samples of one prompt
are adjacent, so sample i belongs to group i // n.

Choices, and why:
- The flow follows OpenRLHF's experience maker, step by step (`compute_advantages`): shape the
  scalar reward within its group, clip it if asked, put it on the last response token and charge
  β·KL on every token, turn the token rewards into returns (GAE with a critic, otherwise
  cumulative sums), then whiten the advantages over the batch for `gae`, `reinforce` and
  `reinforce_baseline` only.
- `returns` are never whitened: for `gae` they are A + V before whitening (the critic's target);
  for the other estimators they equal the advantages before whitening.
- The group estimators force γ = 1, as OpenRLHF does; a scalar outcome reward spread over tokens
  by discounting would otherwise favour short answers.
- GRPO's group standard deviation is the unbiased one (Bessel's n − 1, `torch.std`'s default,
  which OpenRLHF and verl both use), plus 1e-9.
- `std_norm=False` drops every division by a standard deviation and keeps the mean-centring: in
  the batch whitening (OpenRLHF's `--algo.advantage.no_std_norm`) and in `group_norm`, which then
  equals `dr_grpo` (verl's `norm_adv_by_std_in_grpo=False`). OpenRLHF's flag leaves `group_norm`
  alone; we do not silently ignore a flag the caller set.
- Whitening uses the population variance over every response token of the batch, and floors the
  variance at eps before the square root (OpenRLHF: rsqrt(max(var, eps))); verl's
  `masked_whiten` uses the unbiased variance and rsqrt(var + eps). The two agree to within
  1/N_tokens relative.
- Every per-token output is exactly 0 outside `mask` (OpenRLHF leaves whatever arithmetic gave
  there), so padding can never leak into a loss even if a caller forgets to mask.
- Positions inside a response whose mask is 0 (none in single-turn rollouts) are treated as
  OpenRLHF does: value 0 and reward 0 there, the recursion runs through them. verl instead skips
  them; the two agree for right-padded responses.
- The KL controllers live here, not in losses.py: they hold state across steps, are updated once
  per rollout batch from the measured KL, and set the β that `token_level_rewards` charges;
  losses.py stays stateless. With `use_kl_loss` the KL term's coefficient is a plain constant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf_core.algos.names import AdvantageEstimator

__all__ = [
    "GROUP_STD_EPS",
    "WHITEN_EPS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "compute_advantages",
    "cumulative_returns",
    "dynamic_filter_mask",
    "gae",
    "kl_controller",
    "shape_group_rewards",
    "shape_group_step_rewards",
    "token_level_rewards",
    "whiten",
]

GROUP_STD_EPS = 1e-9  # GRPO: (r − mean) / (std + GROUP_STD_EPS); verl uses 1e-6
WHITEN_EPS = 1e-8  # floor on the batch variance before whitening


def _f32(x: Tensor | float) -> Tensor:
    """`x` as a tensor of at least float32 precision (float64 stays float64)."""
    x = torch.as_tensor(x)
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _mask_f32(mask: Tensor, like: Tensor) -> Tensor:
    """`mask` as 0/1 in `like`'s dtype and device."""
    return (torch.as_tensor(mask) != 0).to(dtype=like.dtype, device=like.device)


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with every position where `mask` is 0 set to exactly 0 (even inf or NaN there)."""
    return torch.where(torch.as_tensor(mask, device=x.device) != 0, x, torch.zeros_like(x))


# --- estimators -------------------------------------------------------------------------------


def _rloo(r: Tensor, std_norm: bool) -> Tensor:
    n = r.size(-1)
    return r - (r.sum(-1, keepdim=True) - r) / (n - 1)


def _minus_mean(r: Tensor, std_norm: bool) -> Tensor:
    return r - r.mean(-1, keepdim=True)


def _group_norm(r: Tensor, std_norm: bool) -> Tensor:
    centred = r - r.mean(-1, keepdim=True)
    if not std_norm:
        return centred
    return centred / (r.std(-1, keepdim=True) + GROUP_STD_EPS)  # unbiased std (n − 1)


# Each maps grouped scalar rewards (B // n, n) and std_norm to shaped rewards (B // n, n).
_GROUP_SHAPERS: dict[AdvantageEstimator, Callable[[Tensor, bool], Tensor]] = {
    AdvantageEstimator.RLOO: _rloo,
    AdvantageEstimator.REINFORCE_BASELINE: _minus_mean,
    AdvantageEstimator.GROUP_NORM: _group_norm,
    AdvantageEstimator.DR_GRPO: _minus_mean,
}


def _check_groups(batch: int, n: int) -> None:
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be at least 1, got {n}")
    if batch % n:
        raise ValueError(f"batch of {batch} samples does not split into groups of n = {n}")


def shape_group_rewards(
    rewards: Tensor, n: int, estimator: AdvantageEstimator | str, std_norm: bool = True
) -> Tensor:
    """Subtract the group baseline from each sample's scalar reward.

    rewards: `(B,)` one scalar per sample, prompt-major (sample i is in group i // n).
    n: samples per prompt; B must be a multiple of n, and n ≥ 2 for a group estimator.
    Returns `(B,)` float32:
      rloo:                       r_i − (Σ_j r_j − r_i)/(n − 1)
      reinforce_baseline, dr_grpo: r_i − mean(r)
      group_norm:                 (r_i − mean(r)) / (std(r) + 1e-9), std unbiased;
                                  r_i − mean(r) when std_norm is False
      gae, reinforce:             r_i unchanged
    """
    estimator = AdvantageEstimator(estimator)
    rewards = _f32(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    _check_groups(rewards.numel(), n)
    shaper = _GROUP_SHAPERS.get(estimator)
    if shaper is None:
        return rewards.clone()
    if n < 2:
        raise ValueError(f"{estimator.value!r} compares samples of one prompt and needs n ≥ 2, got {n}")
    return shaper(rewards.view(-1, n), std_norm).reshape(-1)


def shape_group_step_rewards(
    step_rewards: Tensor, step_mask: Tensor, n: int, estimator: AdvantageEstimator | str, std_norm: bool = True
) -> Tensor:
    """Process rewards (one per step, at the token that completes it) shaped within each prompt's group.

    step_rewards: `(B, T)`, a step's reward at its position, 0 elsewhere; step_mask: `(B, T)`, set
    where a step reward sits (a reward may be 0). Prompt-major groups of n.
    Returns `(B, T)` float32, 0 outside `step_mask`:
      group_norm:           (r − mean) / (std + 1e-9) over every step reward of the group's n
                            samples (std unbiased; 0 with fewer than two), DeepSeekMath's process
                            supervision; r − mean without std_norm
      dr_grpo:              r − mean over the group's step rewards
      gae, reinforce:       r unchanged (the returns sum the rewards after each token)
      rloo, reinforce_baseline: ValueError (their baselines are of one scalar per sample)
    """
    estimator = AdvantageEstimator(estimator)
    rewards, present = _f32(step_rewards), torch.as_tensor(step_mask) != 0
    if rewards.dim() != 2 or present.shape != rewards.shape:
        raise ValueError(f"step rewards and their mask must both be (B, T), got {tuple(rewards.shape)} and "
                         f"{tuple(present.shape)}")
    _check_groups(rewards.size(0), n)
    if estimator in (AdvantageEstimator.GAE, AdvantageEstimator.REINFORCE):
        return _zero_outside(rewards, present)
    if estimator not in (AdvantageEstimator.GROUP_NORM, AdvantageEstimator.DR_GRPO):
        raise ValueError(f"{estimator.value!r} takes one reward per sample, not a reward per step")
    if n < 2:
        raise ValueError(f"{estimator.value!r} compares samples of one prompt and needs n ≥ 2, got {n}")
    groups, where = rewards.view(-1, n * rewards.size(1)), present.view(-1, n * rewards.size(1)).float()
    count = where.sum(-1, keepdim=True)
    mean = (groups * where).sum(-1, keepdim=True) / count.clamp(min=1)
    shaped = groups - mean
    if estimator == AdvantageEstimator.GROUP_NORM and std_norm:
        var = ((shaped * where) ** 2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
        std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
        shaped = shaped / (std + GROUP_STD_EPS)
    return _zero_outside(shaped.view_as(rewards), present)


def dynamic_filter_mask(scores: Tensor, n: int, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Which prompt groups dynamic filtering keeps: low < mean(group scores) < high, strictly.

    scores: `(B,)` per-sample scores (in [0, 1] for a verifier), prompt-major groups of n.
    Returns a bool `(B // n,)`: True for a group to keep. With the default (0, 1), groups whose
    samples all failed or all passed are dropped; they carry no learning signal for group
    baselines. `mask.float().mean()` is the pass rate to log.
    """
    if not low < high:
        raise ValueError(f"dynamic filtering range needs low < high, got ({low}, {high})")
    scores = _f32(scores)
    _check_groups(scores.numel(), n)
    mean = scores.view(-1, n).mean(-1)
    return (mean > low) & (mean < high)


# --- token rewards, returns, GAE, whitening ---------------------------------------------------


def _last_token_onehot(mask: Tensor) -> Tensor:
    """`(B, T)` bool, True at each row's last set position (all False for an empty row)."""
    mask = torch.as_tensor(mask) != 0
    T = mask.size(-1)
    positions = torch.arange(1, T + 1, device=mask.device).expand_as(mask)
    last = (positions * mask).argmax(-1, keepdim=True)  # index of the largest set position
    onehot = torch.zeros_like(mask).scatter_(-1, last, True)
    return onehot & mask


def token_level_rewards(
    rewards: Tensor,
    kl: Tensor,
    mask: Tensor,
    kl_coef: float,
    reward_clip: float | tuple[float, float] | None = None,
) -> Tensor:
    """Per-token rewards: the scalar reward on the last response token, minus β·KL on every token.

    rewards: `(B,)` scalar reward per sample (already group-shaped, if any).
    kl: `(B, T)` per-token KL estimate (`losses.kl_penalty`); ignored outside `mask`.
    mask: `(B, T)` response-token mask.
    kl_coef: β ≥ 0 (pass 0 when the KL goes into the loss instead, `use_kl_loss`).
    reward_clip: clip the scalar to [−reward_clip, reward_clip], or to [low, high] for a pair,
        before placing it (OpenRLHF clips the shaped reward, default ±10); None leaves it alone.
    Returns `(B, T)` float32: r·1[t = last] − β·KL_t where mask is set, exactly 0 elsewhere. A row
    with no response token gets nothing.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be ≥ 0, got {kl_coef}")
    kl = _f32(kl)
    rewards = _f32(rewards).to(kl.device)
    rewards = _clipped(rewards, reward_clip)
    last = _last_token_onehot(mask).to(kl.device)
    token_rewards = torch.where(last, rewards.unsqueeze(-1).to(kl.dtype), torch.zeros_like(kl))
    if kl_coef:
        token_rewards = token_rewards - kl_coef * kl
    return _zero_outside(token_rewards, mask)


def _clipped(rewards: Tensor, reward_clip: float | tuple[float, float] | None) -> Tensor:
    """`rewards` clipped to [−reward_clip, reward_clip], or to [low, high] for a pair; None: as they are."""
    if reward_clip is None:
        return rewards
    low, high = reward_clip if isinstance(reward_clip, (tuple, list)) else (-reward_clip, reward_clip)
    return rewards.clamp(low, high)


def cumulative_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go: R_t = Σ_{s ≥ t} γ^(s−t) · r_s (REINFORCE++ returns).

    token_rewards, mask: `(B, T)`; rewards outside the mask count as 0.
    Returns `(B, T)` float32, 0 outside the mask.
    """
    rewards = _zero_outside(_f32(token_rewards), mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return _zero_outside(returns, mask)


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lambd: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation.

    token_rewards, values, mask: `(B, T)`; values are the critic's V_t at rollout time.
    δ_t = r_t + γ·V_{t+1} − V_t,  A_t = δ_t + γλ·A_{t+1},  with V and r taken as 0 outside the
    mask (so V after the last response token is 0 and the episode ends there).
    Returns `(advantages, returns)`, each `(B, T)` float32 and 0 outside the mask;
    returns = A + V (the critic's regression target).
    """
    rewards = _zero_outside(_f32(token_rewards), mask)
    values = _zero_outside(_f32(values).to(rewards.device), mask)
    T = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
    advantages = _zero_outside(advantages, mask)
    return advantages, _zero_outside(advantages + values, mask)


def whiten(
    x: Tensor, mask: Tensor, eps: float = WHITEN_EPS, shift_mean: bool = True, std_norm: bool = True
) -> Tensor:
    """Normalise `x` by the mean and standard deviation of its masked entries, over the whole tensor.

    x, mask: `(B, T)`; statistics use only positions where mask is set (all of them, as one
    population: pass the whole rollout batch, not a micro-batch).
    var = Σ mask·(x − μ)² / Σ mask (population variance), floored at eps.
    Returns `(B, T)` float32, 0 outside the mask:
      (x − μ) / sqrt(max(var, eps))          by default,
      the same plus μ                         with shift_mean=False (rescale only, verl's meaning),
      x − μ (plus μ with shift_mean=False)    with std_norm=False (OpenRLHF's no_std_norm).
    """
    x = _f32(x)
    m = _mask_f32(mask, x)
    count = m.sum().clamp(min=1)
    xm = _zero_outside(x, m)
    mean = xm.sum() / count
    out = x - mean
    if std_norm:
        var = (_zero_outside(out, m) ** 2).sum() / count
        out = out * var.clamp(min=eps).rsqrt()
    if not shift_mean:
        out = out + mean
    return _zero_outside(out, m)


# --- the whole flow ---------------------------------------------------------------------------


@torch.no_grad()
def compute_advantages(
    estimator: AdvantageEstimator | str,
    rewards: Tensor,
    kl: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    n: int,
    gamma: float = 1.0,
    lambd: float = 1.0,
    values: Tensor | None = None,
    std_norm: bool = True,
    reward_clip: float | tuple[float, float] | None = None,
    step_rewards: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns for one rollout batch, OpenRLHF's order of operations.

    estimator: an `AdvantageEstimator` or its name.
    rewards: `(B,)` scalar rewards, prompt-major groups of n.
    kl: `(B, T)` per-token KL to the reference; mask: `(B, T)` response tokens.
    kl_coef: β for the KL in the reward (the controller's `.value`; 0 with use_kl_loss).
    values: `(B, T)` critic values at rollout time; required by `gae`, ignored otherwise.
    gamma, lambd: discount and GAE λ; the group estimators use γ = 1 whatever is passed.
    std_norm: False keeps mean-centring but skips dividing by a standard deviation (in the batch
        whitening and in group_norm).
    reward_clip: clip the shaped scalar reward to ±reward_clip (OpenRLHF's default is 10).
    step_rewards: `(rewards, mask)`, each `(B, T)`: a process reward per step at the token that
        completes it, used instead of `rewards` (`shape_group_step_rewards`, then clipped, then the
        KL charged as for a scalar reward).

    1. r ← shape_group_rewards(r)  2. token rewards ← token_level_rewards(r, kl)
    3. gae → (A, R = A + V); otherwise R = cumulative_returns, A = R
    4. A ← whiten(A) for gae, reinforce, reinforce_baseline.
    Returns `(advantages, returns)`, each `(B, T)` float32, detached, 0 outside the mask; the
    returns are never whitened.
    """
    estimator = AdvantageEstimator(estimator)
    if estimator.needs_critic and values is None:
        raise ValueError(f"{estimator.value!r} needs critic values")
    if step_rewards is None:
        shaped = shape_group_rewards(rewards, n, estimator, std_norm=std_norm)
        token_rewards = token_level_rewards(shaped, kl, mask, kl_coef, reward_clip=reward_clip)
    else:
        token_rewards = _step_token_rewards(*step_rewards, kl, mask, kl_coef, n, estimator, std_norm, reward_clip)
    if estimator.needs_critic:
        advantages, returns = gae(token_rewards, values, mask, gamma, lambd)
    else:
        returns = cumulative_returns(token_rewards, mask, 1.0 if estimator.is_group else gamma)
        advantages = returns.clone()
    if estimator.whitens:
        advantages = whiten(advantages, mask, std_norm=std_norm)
    return advantages, returns


def _step_token_rewards(step_rewards: Tensor, step_mask: Tensor, kl: Tensor, mask: Tensor, kl_coef: float, n: int,
                        estimator: AdvantageEstimator, std_norm: bool,
                        reward_clip: float | tuple[float, float] | None) -> Tensor:
    """`token_level_rewards` for process rewards: each shaped step reward at its token, minus β·KL."""
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be ≥ 0, got {kl_coef}")
    kl = _f32(kl)
    shaped = _clipped(shape_group_step_rewards(step_rewards, step_mask, n, estimator, std_norm).to(kl.device),
                      reward_clip)
    return _zero_outside(shaped - kl_coef * kl if kl_coef else shaped, mask)


# --- KL coefficient controllers ---------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient β. `update` does nothing.

    Its state is configuration: `load_state_dict` keeps the configured value, so a run resumed
    with a new `init_kl_coef` uses the new one.
    """

    def __init__(self, value: float):
        if value < 0:
            raise ValueError(f"KL coefficient must be ≥ 0, got {value}")
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; here so both controllers are driven the same way."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the configured value (a fixed β is configuration, not training state)."""


class AdaptiveKLController:
    """β that tracks a KL target (Ziegler et al. 2019, as in OpenRLHF and verl).

    After a rollout batch of `n_steps` samples whose measured KL is `current_kl`:
        β ← β · (1 + clip(current_kl / target − 1, −0.2, 0.2) · n_steps / horizon)
    so β grows while the KL is above target and shrinks while below, at most 20% per horizon.
    `state_dict()` holds β, which the trainer checkpoints; `load_state_dict` restores it (target
    and horizon are configuration and come from the constructor).
    """

    def __init__(self, init: float, target: float, horizon: int = 10000):
        if init < 0:
            raise ValueError(f"KL coefficient must be ≥ 0, got {init}")
        if target <= 0:
            raise ValueError(f"kl_target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"kl_horizon must be > 0, got {horizon}")
        self.value = float(init)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def kl_controller(
    init_kl_coef: float, kl_target: float | None = None, kl_horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """The controller a config asks for: adaptive when a `kl_target` is set, fixed otherwise."""
    if kl_target:
        return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
    return FixedKLController(init_kl_coef)
