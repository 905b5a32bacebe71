"""The algorithms' choices by name: torch-free enums shared by the configs, the flow and the math.

Each value is the spelling a user writes (OpenRLHF's and verl's flag values). Properties say what
a choice needs from the rest of the run. The functions they select are in `losses.py` and
`advantages.py`, which import torch; the configs and `flows/` import only this module.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A named option: equal to, printed and formatted as its value, on every Python version."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RewardLossType(Choice):
    """Pairwise (Bradley–Terry) reward-model loss variants."""

    SIGMOID = "sigmoid"  # −log σ(r_c − r_r − margin)
    LOGEXP = "logexp"  # log(1 + exp(r_r − r_c + margin)); equals SIGMOID mathematically


class DPOLossType(Choice):
    """DPO-family losses on the log-ratio margin z (docs/algorithms.md)."""

    SIGMOID = "sigmoid"  # DPO, cDPO with label_smoothing > 0
    IPO = "ipo"
    HINGE = "hinge"  # SLiC

    @property
    def needs_reference_model(self) -> bool:
        # All three compare against π_ref. Reference-free variants (SimPO, ORPO) would say False.
        return True


class PolicyLossType(Choice):
    """The actor's surrogate (docs/algorithms.md, "Policy losses"): OpenRLHF's `ppo` and `gspo`,
    and verl's / TRL's `cispo` and `sapo`."""

    PPO = "ppo"  # token ratio, hard clip
    GSPO = "gspo"  # one ratio per sequence (the geometric mean of its tokens'), hard clip
    CISPO = "cispo"  # REINFORCE on log-probs weighted by the clipped, detached token ratio
    SAPO = "sapo"  # a sigmoid gate on the token ratio instead of a hard clip

    @property
    def per_sequence(self) -> bool:
        """Whether the surrogate's ratio is a sequence's: then its loss reduces per sequence
        (seq-mean-token-mean), as OpenRLHF's and verl's GSPO do, and a ring cannot split a row."""
        return self is PolicyLossType.GSPO


class ISCorrectionType(Choice):
    """OpenRLHF's correction of the engine/trainer mismatch: the per-token weight exp(logπ_old − logπ_engine),
    the trainer's probability of a sampled token over the engine's (docs/algorithms.md)."""

    TIS = "tis"  # the weight clamped to [low, high]
    ICEPOP = "icepop"  # the weight where it lies in [low, high], else 0
    SEQ_MASK_TIS = "seq-mask-tis"  # the weight, for sequences whose geometric-mean weight lies in [low, high]

    @property
    def per_sequence(self) -> bool:
        return self is ISCorrectionType.SEQ_MASK_TIS


class KLEstimator(Choice):
    """Per-token estimators of KL(π ‖ π_ref) from samples of π (Schulman's k1, k2, k3)."""

    K1 = "k1"  # Δ: unbiased, high variance, can be negative
    K2 = "k2"  # Δ²/2: biased, low variance, gradient is that of KL for on-policy samples
    K3 = "k3"  # exp(−Δ) − 1 + Δ: unbiased, non-negative


class LossAggMode(Choice):
    """How a per-token loss becomes the step's scalar (verl's `loss_agg_mode` names)."""

    TOKEN_MEAN = "token-mean"  # Σ mask·L / global token count
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # mean over sequences of each token sum
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # mean over sequences of each token mean
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # mean over sequences of token sum / L_max

    @property
    def per_token(self) -> bool:
        """Whether the global units are tokens (else sequences)."""
        return self is LossAggMode.TOKEN_MEAN


class AdvantageEstimator(Choice):
    """How advantages are estimated (OpenRLHF's `--algo.advantage.estimator` names)."""

    GAE = "gae"  # PPO with a critic
    REINFORCE = "reinforce"  # REINFORCE++: whitened cumulative returns
    REINFORCE_BASELINE = "reinforce_baseline"  # group mean baseline, then whitened
    RLOO = "rloo"  # leave-one-out group mean baseline
    GROUP_NORM = "group_norm"  # GRPO: group mean and std
    DR_GRPO = "dr_grpo"  # group mean only

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator needs value predictions (a critic model)."""
        return self is AdvantageEstimator.GAE

    @property
    def is_group(self) -> bool:
        """Whether the baseline comes from the other samples of the prompt: needs n > 1, γ = 1."""
        return self in (AdvantageEstimator.REINFORCE_BASELINE, AdvantageEstimator.RLOO,
                        AdvantageEstimator.GROUP_NORM, AdvantageEstimator.DR_GRPO)

    @property
    def whitens(self) -> bool:
        """Whether advantages are whitened over the whole rollout batch."""
        return self in (AdvantageEstimator.GAE, AdvantageEstimator.REINFORCE,
                        AdvantageEstimator.REINFORCE_BASELINE)


# How a process reward model's step scores make a response's score (`rewards/process.aggregate`).
STEP_AGGREGATES = ("min", "prod", "last", "mean")
