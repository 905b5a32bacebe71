"""The models of an RL stage, one class per role: policy (actor), critic, reference, reward model.

An instance is one rank of its role: in the controller's process (one local rank) or a Ray actor
of a `RoleGroup`. `__init__` keeps the configuration; `setup()` builds the model once every rank
exists (their process group needs them all). Trainable roles (policy, critic) hold a DeepSpeed
engine and train with the supervised trainers' `trainers.loop.optimizer_step`: the loss is
normalised by the global count of loss units (`--algo.loss_agg_mode`), so the update does not
depend on the micro-batch or rank split.

Log-probs are at the rollout temperature (logits / T), for policy and reference alike: the policy
optimised is the one that samples. With `--rollout.top_k` / `--rollout.top_p` the engines draw from
the filtered distribution (`algos/nucleus.py`); the losses stay on logits / T (OpenRLHF's, TRL's and
verl's choice: a token the updated policy's nucleus no longer holds would have log-prob -inf), and
the policy's experience pass also returns its log-probs under the filtered distribution, the
engine's, for `rollout/logprob_mismatch` (docs/sampling.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import torch

from rlhf_core.algos.losses import (
    RATIO_LOG_CLAMP,
    aggregate_loss,
    corrected_policy_loss,
    entropy_from_logits,
    gather_token_logprobs,
    kl_penalty,
    loss_units,
    surrogate_loss,
    value_loss,
)
from rlhf_core.algos.names import LossAggMode, PolicyLossType
from rlhf_core.algos.nucleus import filter_logits
from rlhf_core.data.token_budget import balanced_groups, budget_chunks, group_count
from rlhf_core.distributed.engine import (
    EngineSettings,
    all_reduce,
    all_reduce_sum,
    autocast,
    device,
    init_distributed,
    initialize,
    precision_of,
)
from rlhf_core.infra.hubs import use_modelscope
from rlhf_core.models import ring
from rlhf_core.models.forward import response_logits, response_values
from rlhf_core.models.lean import forward_report, lean_model, partitioned, tensor_parallel
from rlhf_core.models.shapes import width_multiple
from rlhf_core.rl.experience import (
    RolloutSample,
    TensorDict,
    TensorRows,
    collate,
    old_logprob_metrics,
    old_logprob_sums,
    stack,
    unstack,
)
from rlhf_core.rollout.weight_sync import WeightSender
from rlhf_core.trainers import universal
from rlhf_core.trainers.checkpoints import rng_state
from rlhf_core.trainers.common import seed_everything
from rlhf_core.trainers.loop import optimizer_step


def engine_settings(cfg, section, world_size: int, aux_loss_coef: float = 0.0, role: str = "actor"
                    ) -> EngineSettings:
    """`role`'s engine ("actor", "critic", "ref", "reward"): its `adam` and schedule (the actor's or
    the critic's section), its ring and tensor-parallel group (`PPOConfig.ring_of`, `tensor_parallel_of`)."""
    # Micro-batches by tokens: any number a step (`optimizer_step` sets the boundary); DeepSpeed is told one
    ring, tp = cfg.ring_of(world_size), cfg.tensor_parallel_of(role, world_size)
    micro = cfg.train.micro_batch_size or cfg.train.batch_size // (world_size // (ring * tp))
    return EngineSettings(section.adam, section, cfg.ds, cfg.train.batch_size, micro, world_size,
                          section.muon if section.optim == "muon" else None, aux_loss_coef, tensor_parallel=tp,
                          ring=ring)


def units_of(samples: list[RolloutSample], mode: LossAggMode) -> float:
    """Loss units in `samples` under `mode` (`loss_units`): response tokens, or non-empty sequences."""
    return float(loss_units(torch.tensor([float(s.response_len) for s in samples]), mode))


def mean_over_epochs(epochs: list[dict[str, float]]) -> dict[str, float]:
    """Each statistic's mean over the epochs (an epoch without optimizer steps reports none)."""
    totals: dict[str, float] = {}
    for stats in epochs:
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v / len(epochs)
    return totals


def moving_average(ema: dict[str, torch.Tensor], current: dict[str, torch.Tensor], beta: float) -> None:
    """`ema <- beta * ema + (1 - beta) * current`, in place (OpenRLHF's `--ema_beta`)."""
    for name, value in current.items():
        ema[name].mul_(beta).add_(value.detach().to(ema[name].device, ema[name].dtype), alpha=1.0 - beta)


def with_lora(model, cfg, is_reward_model: bool):
    """`--ds.lora.rank > 0`: LoRA adapters on a trained role's model (`models/loading.apply_lora`)."""
    lora = cfg.ds.lora
    if lora.rank == 0:
        return model
    from rlhf_core.models.loading import apply_lora

    if cfg.actor.gradient_checkpointing_enable:
        model.enable_input_require_grads()
    return apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, is_reward_model)


def plain_state(module) -> dict[str, torch.Tensor]:
    """A whole (not ZeRO-3) model's weights by the plain model's names: LoRA merged in, out of place."""
    if hasattr(module, "peft_config"):
        from rlhf_core.models.loading import merged_lora_state

        return merged_lora_state(module)
    return {k: v.detach() for k, v in module.state_dict().items()}


def all_reduce_max(value: int) -> int:
    """The largest `value` over the role's ranks (itself with one rank)."""
    return int(all_reduce(torch.tensor([value]), torch.distributed.ReduceOp.MAX).item())


def optimizer_steps(samples: list, per_rank_batch: int, micro: int) -> list[list[list]]:
    """This rank's samples cut into optimizer steps of `per_rank_batch`, each into micro-batches."""
    return [[samples[i + j : i + j + micro] for j in range(0, per_rank_batch, micro)]
            for i in range(0, len(samples) - per_rank_batch + 1, per_rank_batch)]


class _Role:
    """Loading, batching and no-grad forward passes every role shares."""

    role: str  # its name in the config ("actor", "critic", "ref", "reward": `PPOConfig.duplicates`)

    def __init__(self, cfg, pad_id: int, rank: int = 0, world_size: int = 1):
        self.cfg, self.pad_id, self.rank, self.world_size = cfg, pad_id, rank, world_size
        use_modelscope(cfg.use_ms)  # a Ray rank's own process loads its model by name
        self.precision = precision_of(cfg.ds)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.packing = True

    def setup(self, join: bool = False) -> str:
        """Build the model (and engine): the second phase, once every rank of the role exists.
        `join`: a rank of a Ray group (`RoleGroup`) first joins the role's process group from the
        variables the group set, and seeds itself with `--train.seed` as the in-process run does.
        Returns the forward's report line (`lean.forward_report`; rank 0 prints it too)."""
        if join:
            env = os.environ
            init_distributed(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                             local_rank=int(env["LOCAL_RANK"]))
            seed_everything(self.cfg.train.seed, self.cfg.train.full_determinism_enable)
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # A ring's ranks split each row (models/ring.py); its groups form before any model loads.
        # A tensor-parallel group's ranks split each linear layer (DeepSpeed forms its groups). The
        # ranks of a ring or of a group take the same samples; DeepSpeed averages the gradients
        # over the data-parallel ranks, the ring's among them, a group's ranks apart.
        self.ring_size = self.cfg.ring_of(self.world_size)
        self.tensor_parallel = self.cfg.tensor_parallel_of(self.role, self.world_size)
        ring.setup(self.ring_size, self.cfg.ds.ring_attn_head_stride, self.tensor_parallel)
        self.duplicates = self.cfg.duplicates(self.role, self.world_size)
        self.averaged_over = self.world_size // self.tensor_parallel
        self.device = device()
        self._build()
        line = forward_report(self.name, *self._forward_model())[1]
        if self.rank == 0:
            print(line, file=sys.stderr, flush=True)
        return line

    def _build(self) -> None:
        raise NotImplementedError

    def _forward_model(self) -> tuple:
        """(the model whose forward this role's passes run, whether it is a sequence classifier)."""
        raise NotImplementedError

    def _collate(self, samples: list[RolloutSample]):
        batch, index, mask = collate(samples, self.pad_id, self.packing, row_capacity=self.row_capacity,
                                     width_multiple=self.width_multiple)
        return batch.to(self.device), index.to(self.device), mask.to(self.device)

    @property
    def row_capacity(self) -> int:
        return self.cfg.data.max_len

    @property
    def width_multiple(self) -> int:
        """Batch widths rounded up for few matmul shapes (`models/shapes.py`)."""
        return width_multiple(self.device, self.precision)

    def _chunks(self, samples: list[RolloutSample]):
        """The experience passes' chunks (no gradients): `--rollout.micro_batch_size` samples where it
        is given (and `--train.dynamic_batch_enable` is not), otherwise consecutive runs within
        `--rollout.max_tokens_per_gpu` tokens."""
        budget = experience_budget(self.cfg)
        if budget is not None:
            return [[samples[i] for i in run] for run in budget_chunks([s.sequence_len for s in samples], budget)]
        size = self.cfg.rollout.micro_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    def _micro_batches(self, samples: list[RolloutSample]) -> list[list[list[RolloutSample]]]:
        """This rank's share of an epoch in optimizer steps of micro-batches: `--train.micro_batch_size`
        samples each where it is given (and `--train.dynamic_batch_enable` is not), otherwise by
        `--train.max_tokens_per_gpu` tokens, every rank of the role in as many micro-batches as the one
        that needs most."""
        train = self.cfg.train
        per_rank = train.batch_size // (self.world_size // self.duplicates)
        if not train.dynamic_batch_enable and train.micro_batch_size is not None:
            return optimizer_steps(samples, per_rank, train.micro_batch_size)
        steps = optimizer_steps(samples, per_rank, per_rank)
        out = []
        for (step,) in steps:
            lengths = [s.sequence_len for s in step]
            count = all_reduce_max(group_count(lengths, train.max_tokens_per_gpu))
            out.append([[step[i] for i in group] for group in balanced_groups(lengths, count) if group])
        return out

    def _logprobs(self, model, samples: list[RolloutSample], sampled: bool = False) -> list[torch.Tensor]:
        """Response log-probs of `model` at the rollout temperature, chunk by chunk, without gradients.
        The weights do not change during the pass: a Llama's lean forward prepares them (projections
        concatenated, cast to autocast's dtype) once for all chunks instead of at every linear.
        `sampled`: each sample's `(2, T)`: those log-probs, then the same tokens' under the rollout's
        top-k / top-p filtered distribution (what the engines sample from and report)."""
        lean = lean_model(model)
        rollout = self.cfg.rollout
        out = TensorRows()
        with torch.no_grad(), (lean.reusing_weights() if lean is not None else contextlib.nullcontext()):
            for chunk in self._chunks(samples):
                batch, index, mask = self._collate(chunk)
                targets = batch.input_ids.reshape(-1)[index]
                with autocast(self.precision):
                    logits = response_logits(model, batch, index, self.temperature)
                    lp = gather_token_logprobs(logits, targets) * mask
                    if sampled:
                        # The drawn token stays in the set even where these logits' rounding would
                        # drop it at the edge: its log-prob is finite, the mismatch measurable.
                        kept = targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
                        filtered = filter_logits(logits.float(), rollout.top_k, rollout.top_p)
                        filtered = filtered.scatter(-1, kept, logits.float().gather(-1, kept))
                        lp = torch.stack([lp, gather_token_logprobs(filtered, targets) * mask], dim=1)
                out += unstack(lp, [s.response_len for s in chunk])
        return out


class _Checkpointed:
    """Save and restore a trainable role's engine (weights, optimizer, scheduler) and this rank's RNG
    under `directory/<name>` (DeepSpeed's own format, tag = the role's name)."""

    name: str

    def save_checkpoint(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if not self.cfg.ckpt.disable_ds:  # `--ckpt.disable_ds`: the Hugging Face model alone (below)
            torch.save(rng_state(), path / f"rng_{self.name}_rank{self.rank}.pt")
            self.engine.save_checkpoint(str(path), tag=self.name)

    def load_checkpoint(self, directory: str) -> None:
        universal.load_engine(self.engine, Path(directory) / self.name,
                              Path(directory) / f"rng_{self.name}_rank{self.rank}.pt", self.cfg.ds.use_universal_ckpt,
                              "--ckpt.load_enable")

    def export(self) -> dict[str, torch.Tensor] | None:
        """The state dict of the role's model as a plain HF model (LoRA merged, fp32, on CPU) on
        rank 0, None elsewhere; call on every rank. A state dict, not the module: it crosses processes."""
        from rlhf_core.models.loading import export_model

        model = export_model(self.engine.module, self.rank)
        return None if model is None else model.state_dict()

    # `--ds.enable_sleep`: the engine's weights, gradients and optimizer states leave the GPU while
    # the rollout engines generate (DeepSpeed's offload_states, ZeRO-3), and come back before the
    # experience pass.
    def offload_states(self) -> str | None:
        """Offload; returns None, or what was missing where it could not be done (no CUDA device, an
        optimizer without DeepSpeed's offload)."""
        if not torch.cuda.is_available():
            return "a CUDA device"
        if not hasattr(self.engine.optimizer, "offload_states"):
            return "ZeRO-3 (DeepSpeed's offload_states)"
        self.engine.offload_states()
        self._states_offloaded = True
        return None

    def reload_states(self) -> None:
        if getattr(self, "_states_offloaded", False):
            self.engine.reload_states()
            self._states_offloaded = False


class PolicyRole(WeightSender, _Checkpointed, _Role):
    """The actor: recomputes the rollout's log-probs, trains with the clipped surrogate, hands out
    weights (and, on Ray, sends them to the rollout engines: `WeightSender`)."""

    name, role = "actor", "actor"

    def __init__(self, cfg, pad_id: int, total_optimizer_steps: int, rank: int = 0, world_size: int = 1):
        super().__init__(cfg, pad_id, rank, world_size)
        self.total_optimizer_steps = total_optimizer_steps

    def _build(self) -> None:
        from rlhf_core.models.loading import apply_liger_kernel, load_causal_lm, model_options

        cfg = self.cfg
        model = load_causal_lm(cfg.actor.model_name_or_path, **model_options(cfg.ds))
        if cfg.ds.use_liger_kernel:
            apply_liger_kernel(model)
        if cfg.actor.gradient_checkpointing_enable:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": cfg.actor.gradient_checkpointing_reentrant})
        model = with_lora(model, cfg, is_reward_model=False)
        model.config.use_cache = False
        self.engine = initialize(model, engine_settings(cfg, cfg.actor, self.world_size, cfg.actor.aux_loss_coef),
                                 self.total_optimizer_steps)
        # `--train.enable_ema`: an exponential moving average of the policy's weights (fp32, CPU, rank 0),
        # from the starting weights on; the output is it, the engines sample the policy itself
        self.ema = self._ema_source() if cfg.train.enable_ema else None

    def _ema_source(self) -> dict[str, torch.Tensor] | None:
        state = self.weights()  # every rank: a ZeRO-3 gather
        return {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()} if self.rank == 0 else None

    def _update_ema(self) -> None:
        current = self.weights()  # every rank (a ZeRO-3 gather); rank 0 averages them in, no copy kept
        if self.rank == 0:
            moving_average(self.ema, current, self.cfg.train.ema_beta)

    def export(self) -> dict[str, torch.Tensor] | None:
        """The output's weights: the moving average with `--train.enable_ema` (rank 0 holds it; no
        rank gathers), else the policy's (every rank takes part in the gather of split weights)."""
        if not self.cfg.train.enable_ema:
            return super().export()
        return {k: v.clone() for k, v in self.ema.items()} if self.rank == 0 else None

    # `--eval.publish_best`: the policy of the best evaluation so far, put back at the end of the run
    def keep_best(self) -> None:
        """Remember the policy's weights, on CPU: under ZeRO-3 each rank its own partition, under
        tensor parallelism its own slices, else rank 0 the whole model (`restore_best` broadcasts it)."""
        module = self.engine.module
        if partitioned(module):
            self._best = {n: p.ds_tensor.detach().to("cpu", copy=True) for n, p in module.named_parameters()}
        else:  # AutoTP's slices: each rank its own
            self._best = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()} \
                if self.rank == 0 or tensor_parallel(module) else {}

    def has_best(self) -> bool:
        """Whether this rank holds its part of kept weights (a rank other than 0 holds none of a
        whole model)."""
        from rlhf_core.models.loading import split_weights

        kept = bool(getattr(self, "_best", None))
        return kept or (not split_weights(self.engine.module) and self.rank != 0)

    @torch.no_grad()
    def restore_best(self) -> None:
        """Put the kept weights back into the model (every rank; the optimizer is done with)."""
        from rlhf_core.models.loading import split_weights

        module = self.engine.module
        split, zero3 = split_weights(module), partitioned(module)
        for name, param in module.named_parameters():
            target = param.ds_tensor if zero3 else param.data
            if split or self.rank == 0:
                target.copy_(self._best[name].to(target.device, target.dtype))
            if not split and self.world_size > 1:
                torch.distributed.broadcast(target, src=0)

    def save_checkpoint(self, directory: str) -> None:
        super().save_checkpoint(directory)
        if self.ema is not None and self.rank == 0 and not self.cfg.ckpt.disable_ds:
            torch.save(self.ema, Path(directory) / f"ema_{self.name}.pt")
        if getattr(self, "_best", None) and not self.cfg.ckpt.disable_ds:  # a resumed run can still publish it
            torch.save(self._best, Path(directory) / f"best_{self.name}_rank{self.rank}.pt")
        if self.cfg.ckpt.save_hf:  # `--ckpt.save_hf`: the policy, as transformers loads it
            from rlhf_core.models.loading import load_tokenizer, write_hf_checkpoint

            if getattr(self, "_tokenizer", None) is None:  # read once, not at every checkpoint
                self._tokenizer = load_tokenizer(self.cfg.actor.model_name_or_path)
            write_hf_checkpoint(self.engine.module, self._tokenizer, Path(directory), self.rank)

    def load_checkpoint(self, directory: str) -> None:
        super().load_checkpoint(directory)
        if self.cfg.train.enable_ema and self.rank == 0:
            self.ema = torch.load(Path(directory) / f"ema_{self.name}.pt", weights_only=True)
        kept = Path(directory) / f"best_{self.name}_rank{self.rank}.pt"
        self._best = torch.load(kept, weights_only=True) if kept.exists() else {}

    def _forward_model(self) -> tuple:
        return self.engine, False

    @torch.no_grad()
    def logprobs(self, samples: list[RolloutSample], sampled: bool = False) -> list[torch.Tensor]:
        self.engine.eval()
        return self._logprobs(self.engine, samples, sampled)

    def train_step(self, samples: list[RolloutSample], epochs: list[list[int]], kl_coef: float,
                   old_for: list[int] | None = None, sampled: bool = False) -> dict[str, float]:
        """This rank's PPO epochs over its samples (`plan.RankWork`); the stats averaged over epochs.
        `old_for` (`StepPlan.old_in_training`): first the old log-probs of the samples at those
        positions, with the step's `rollout/kl` and `rollout/logprob_mismatch` over them."""
        measured = self._old_logprobs([samples[p] for p in old_for], sampled) if old_for is not None else {}
        return {**mean_over_epochs([self._train_epoch([samples[i] for i in order], kl_coef) for order in epochs]),
                **measured}

    def _old_logprobs(self, samples: list[RolloutSample], sampled: bool) -> dict[str, float]:
        """Set each sample's old log-probs (this policy's, before its update); the KL to the
        reference (where the samples carry its log-probs) per sample and the engine/trainer
        log-prob mismatch per token, over every rank's samples (the controller's metrics)."""
        views = []
        for s, lp in zip(samples, self.logprobs(samples, sampled), strict=True):
            s.old_logprobs, view = (lp[0], lp[1]) if sampled else (lp, lp)
            views.append(view)
        with_ref = bool(samples) and samples[0].ref_logprobs is not None
        sums = old_logprob_sums([s.old_logprobs for s in samples], [s.rollout_logprobs for s in samples], views,
                                [s.ref_logprobs for s in samples] if with_ref else None, self.cfg.algo.kl.estimator)
        return old_logprob_metrics(all_reduce_sum(sums) / self.duplicates)

    def _train_epoch(self, samples: list[RolloutSample], kl_coef: float) -> dict[str, float]:
        """One pass over this rank's share of the rollout (in step order): a few optimizer steps."""
        algo = self.cfg.algo
        mode = LossAggMode(algo.loss_agg_mode)
        actor = self.cfg.actor
        eps_low, eps_high = actor.eps_clip_low_high
        surrogate = surrogate_loss(actor.policy_loss_type, eps_low, eps_high, actor.dual_clip, actor.sapo_tau_pos,
                                   actor.sapo_tau_neg)
        norm_length = self.cfg.rollout.max_new_tokens
        correction = algo.advantage
        bounds = correction.is_correction_threshold
        sequence_ratio = PolicyLossType(actor.policy_loss_type).per_sequence

        def micro_step(engine, chunk):
            batch, index, mask = self._collate(chunk)
            logits = response_logits(engine, batch, index, self.temperature)
            logprobs = gather_token_logprobs(logits, batch.input_ids.reshape(-1)[index])
            width = mask.shape[1]
            # None: a sample of the rollout's first optimizer step, whose old policy is this one
            # (`StepPlan.on_policy`): its old log-probs are this forward's, detached.
            on_policy = torch.tensor([s.old_logprobs is None for s in chunk], device=self.device)
            old = stack([s.old_logprobs if s.old_logprobs is not None else torch.zeros(0) for s in chunk],
                        width).to(self.device)
            if bool(on_policy.any()):
                old = torch.where(on_policy[:, None], logprobs.detach().float(), old)
            advantages = stack([s.advantages for s in chunk], width).to(self.device)
            stats, engine_lp, kind = {}, None, None
            if correction.is_correction_enable:  # the engine's log-probs: its sampling distribution
                engine_lp = stack([s.rollout_logprobs for s in chunk], width).to(self.device)
                stats["engine_gap_tokens"] = ((engine_lp - old) * mask).sum()  # OpenRLHF's vllm_kl
                kind = correction.is_correction_type
            loss, clipped, weights = corrected_policy_loss(surrogate, logprobs, old, advantages, mask, engine_lp, kind,
                                                           *bounds, per_sequence=sequence_ratio)
            if weights is not None:
                stats["is_weight_tokens"] = (weights * mask).sum()
                stats["is_dropped_tokens"] = ((weights == 0) * mask).sum()
            stats.update({"policy_loss": aggregate_loss(loss, mask, mode, norm_length).detach(),
                          "clip_tokens": (clipped * mask).sum(), "tokens": mask.sum(),
                          "ratio_sum": (torch.exp((logprobs - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
                                        * mask).sum().detach()})
            if algo.kl.use_loss:
                ref = stack([s.ref_logprobs for s in chunk], width).to(self.device)
                kl = kl_penalty(logprobs, ref, algo.kl.estimator)
                loss = loss + kl_coef * kl
                stats["kl_loss_tokens"] = (kl * mask).sum().detach()
            if self.cfg.actor.entropy_coef:
                entropy = entropy_from_logits(logits)
                loss = loss - self.cfg.actor.entropy_coef * entropy
            else:  # a metric only: no autograd graph for it
                with torch.no_grad():
                    entropy = entropy_from_logits(logits.detach())
            stats["entropy_tokens"] = (entropy.detach() * mask).sum()
            return aggregate_loss(loss, mask, mode, norm_length), stats, int(batch.input_ids.numel())

        totals: dict[str, float] = {}
        for micro in self._micro_batches(samples):
            sums, units, _ = optimizer_step(self.engine, micro, lambda c: units_of(c, mode), micro_step,
                                            self.averaged_over, self.precision, duplicates=self.duplicates)
            if self.cfg.train.enable_ema:  # every rank: a ZeRO-3 gather
                self._update_ema()
            tokens = max(1.0, float(sums["tokens"]))
            step = {"policy_loss": float(sums["policy_loss"] / units), "clip_frac": float(sums["clip_tokens"]) / tokens,
                    "ratio": float(sums["ratio_sum"]) / tokens, "entropy": float(sums["entropy_tokens"]) / tokens,
                    "lr": self.engine.get_lr()[0]}
            if "kl_loss_tokens" in sums:
                step["kl_loss"] = float(sums["kl_loss_tokens"]) / tokens
            if "engine_gap_tokens" in sums:  # --algo.advantage.is_correction_enable
                step["vllm_kl"] = float(sums["engine_gap_tokens"]) / tokens
            if "is_weight_tokens" in sums:
                step["is_weight"] = float(sums["is_weight_tokens"]) / tokens
                step["is_dropped_frac"] = float(sums["is_dropped_tokens"]) / tokens
            if "aux_loss" in sums:  # an MoE policy's load balancing (--aux_loss_coef)
                step["aux_loss"] = float(sums["aux_loss"] / units)
            for k, v in step.items():
                totals[k] = totals.get(k, 0.0) + v
            totals["steps"] = totals.get("steps", 0.0) + 1
        n = totals.pop("steps", 0.0)
        return {k: v / n for k, v in totals.items()} if n else {}

    def weights(self, checkpoint_format: bool = False) -> dict[str, torch.Tensor]:
        """The policy's current weights by Hugging Face name (gathered where split), on CPU; with
        `checkpoint_format`, named and laid out as a saved checkpoint holds them (vLLM's form)."""
        from rlhf_core.models.loading import split_weights, whole_state_dict

        module = self.engine.module
        if split_weights(module):
            state = whole_state_dict(module, self.rank) or {}
        else:
            state = plain_state(module) if self.rank == 0 else {}
        return TensorDict(self._as_checkpoint(state) if checkpoint_format and state else state)

    def _as_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from rlhf_core.models.loading import checkpoint_state_dict

        module = self.engine.module
        return checkpoint_state_dict(module.get_base_model() if hasattr(module, "peft_config") else module, state)

    # the weight sync's sources (`WeightSender`): every rank calls them
    def _sync_state(self) -> dict[str, torch.Tensor]:
        return self.weights()

    def _sync_state_local(self) -> dict[str, torch.Tensor]:
        """The full weights on this rank's own device (each rank feeds the engine on its GPU)."""
        module = self.engine.module
        if tensor_parallel(module):
            from rlhf_core.models.loading import _tensor_parallel_state_dict

            return _tensor_parallel_state_dict(module, self.rank, every_rank=True, device=self.device)
        if not partitioned(module):
            return plain_state(module)
        import deepspeed

        names_of: dict[int, list[str]] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(name)
        state = {}
        for _, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                full = param.detach().clone()
            for name in names_of.get(id(param), []):
                state[name] = full
        for name, tensor in module.state_dict().items():  # buffers
            state.setdefault(name, tensor.detach().to(torch.device("cuda", torch.cuda.current_device())))
        return state


class CriticRole(_Checkpointed, _Role):
    """The value model: values before each response token, trained towards the returns (clipped)."""

    name, role = "critic", "critic"

    def __init__(self, cfg, pad_id: int, model_path: str, total_optimizer_steps: int, rank: int = 0,
                 world_size: int = 1):
        super().__init__(cfg, pad_id, rank, world_size)
        self.model_path, self.total_optimizer_steps = model_path, total_optimizer_steps

    def _build(self) -> None:
        from rlhf_core.models.loading import load_reward_model, model_options
        from rlhf_core.models.moe import router_modules

        model = load_reward_model(self.model_path, self.pad_id, **model_options(self.cfg.ds))
        actor = self.cfg.actor
        if actor.gradient_checkpointing_enable:  # OpenRLHF's flag covers both trained models
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": actor.gradient_checkpointing_reentrant})
        model = with_lora(model, self.cfg, is_reward_model=True)
        model.config.use_cache = False
        # OpenRLHF's one --aux_loss_coef covers the critic too, where it is a Mixture of Experts
        aux = actor.aux_loss_coef if router_modules(model) else 0.0
        self.engine = initialize(model, engine_settings(self.cfg, self.cfg.critic, self.world_size, aux, self.role),
                                 self.total_optimizer_steps)

    def _forward_model(self) -> tuple:
        return self.engine, True

    @torch.no_grad()
    def values(self, samples: list[RolloutSample]) -> list[torch.Tensor]:
        self.engine.eval()
        out = TensorRows()
        for chunk in self._chunks(samples):
            batch, index, mask = self._collate(chunk)
            with autocast(self.precision):
                v = response_values(self.engine, batch, index) * mask
            out += unstack(v, [s.response_len for s in chunk])
        return out

    def train_step(self, samples: list[RolloutSample], epochs: list[list[int]]) -> dict[str, float]:
        """This rank's PPO epochs over its samples (`plan.RankWork`); the stats averaged over epochs."""
        return mean_over_epochs([self._train_epoch([samples[i] for i in order]) for order in epochs])

    def _train_epoch(self, samples: list[RolloutSample]) -> dict[str, float]:
        algo = self.cfg.algo
        mode = LossAggMode(algo.loss_agg_mode)
        norm_length = self.cfg.rollout.max_new_tokens

        def micro_step(engine, chunk):
            batch, index, mask = self._collate(chunk)
            values = response_values(engine, batch, index)
            width = mask.shape[1]
            old = stack([s.values for s in chunk], width).to(self.device)
            returns = stack([s.returns for s in chunk], width).to(self.device)
            loss = value_loss(values, old, returns, self.cfg.critic.value_clip)
            summed = aggregate_loss(loss, mask, mode, norm_length)
            return summed, {"value_loss": summed.detach(), "value_tokens": (values.detach() * mask).sum(),
                            "tokens": mask.sum()}, int(batch.input_ids.numel())

        losses, means, aux = [], [], []
        for micro in self._micro_batches(samples):
            sums, units, _ = optimizer_step(self.engine, micro, lambda c: units_of(c, mode), micro_step,
                                            self.averaged_over, self.precision, duplicates=self.duplicates)
            losses.append(float(sums["value_loss"] / units))
            means.append(float(sums["value_tokens"]) / max(1.0, float(sums["tokens"])))
            if "aux_loss" in sums:  # an MoE critic's load balancing (--aux_loss_coef)
                aux.append(float(sums["aux_loss"] / units))
        if not losses:
            return {}
        stats = {"value_loss": sum(losses) / len(losses), "values": sum(means) / len(means)}
        return {**stats, "value_aux_loss": sum(aux) / len(aux)} if aux else stats


class ReferenceRole(_Role):
    """The frozen reference policy (KL)."""

    name, role = "reference", "ref"

    def __init__(self, cfg, pad_id: int, model_path: str, rank: int = 0, world_size: int = 1):
        super().__init__(cfg, pad_id, rank, world_size)
        self.model_path = model_path

    def _build(self) -> None:
        from rlhf_core.distributed.engine import initialize_frozen
        from rlhf_core.models.loading import load_causal_lm, model_options

        self.model = initialize_frozen(load_causal_lm(self.model_path, **model_options(self.cfg.ds)),
                                       engine_settings(self.cfg, self.cfg.actor, self.world_size, role=self.role),
                                       offload=self.cfg.ref.offload)

    def _forward_model(self) -> tuple:
        return self.model, False

    @torch.no_grad()
    def logprobs(self, samples: list[RolloutSample]) -> list[torch.Tensor]:
        return self._logprobs(self.model, samples)


class RewardModelRole(_Role):
    """Trained reward model(s) scoring each sample at its last token (several: their sum), and the
    gold reward model that checks held-out responses (`--eval.reward_model_name_or_path`), scored
    on its own (`check_scores`)."""

    name, role = "reward_model", "reward"

    def __init__(self, cfg, pad_id: int, model_paths: list[str], check_paths: list[str] = (), rank: int = 0,
                 world_size: int = 1):
        super().__init__(cfg, pad_id, rank, world_size)
        self.model_paths, self.check_paths = model_paths, list(check_paths)

    def _build(self) -> None:
        cfg = self.cfg
        self.models, self.stats, self.prm = [], [], None
        self.checks = [self._frozen_reward_model(path) for path in self.check_paths]
        if cfg.reward.placeholder_token is not None:
            self._build_process_reward_model()
            return
        for path in self.model_paths:
            model = self._frozen_reward_model(path)
            config = getattr(model, "module", model).config
            self.stats.append((getattr(config, "reward_mean", None), getattr(config, "reward_std", None), path))
            self.models.append(model)
        if cfg.reward.normalize_enable:
            missing = [p for mean, std, p in self.stats if mean is None or not std]
            if missing:
                raise ValueError(f"--reward.normalize_enable: no reward_mean/reward_std in the config of {missing[0]} "
                                 "(saved by `rlhf train rm`)")

    def _build_process_reward_model(self) -> None:
        """A process reward model (`--reward.placeholder_token`): a causal LM read at each step's
        placeholder (`rewards.process`), frozen as a reward model is."""
        from rlhf_core.distributed.engine import initialize_frozen
        from rlhf_core.models.loading import load_causal_lm, load_tokenizer, model_options
        from rlhf_core.rewards.process import ProcessRewardModel

        cfg, (path,) = self.cfg, self.model_paths
        model = initialize_frozen(load_causal_lm(path, **model_options(cfg.ds)),
                                  engine_settings(cfg, cfg.actor, self.world_size, role=self.role),
                                  offload=cfg.reward.offload, flag="reward.offload")
        self.models = [model]
        self.prm = ProcessRewardModel(load_tokenizer(path, use_fast=not cfg.data.disable_fast_tokenizer),
                                      getattr(model, "module", model), cfg.reward.placeholder_token,
                                      cfg.reward.reward_tokens, batch_size=cfg.rollout.micro_batch_size or 32,
                                      forward_context=lambda: autocast(self.precision),
                                      max_tokens=experience_budget(cfg))  # as the other roles' passes

    def _frozen_reward_model(self, path: str):
        from rlhf_core.distributed.engine import initialize_frozen
        from rlhf_core.models.loading import load_reward_model, model_options

        cfg = self.cfg
        model = load_reward_model(path, self.pad_id, **model_options(cfg.ds))
        settings = engine_settings(cfg, cfg.actor, self.world_size, role=self.role)
        return initialize_frozen(model, settings, offload=cfg.reward.offload, flag="reward.offload")

    def _forward_model(self) -> tuple:
        if not self.models:  # a gold reward model only
            return self.checks[0], True
        return self.models[0], self.prm is None  # a PRM is a causal LM read at its placeholders

    @torch.no_grad()
    def step_scores(self, texts: list[tuple[str, str]]) -> list[list[float]]:
        """A process reward model's P(right) at each step of each (prompt, response) text."""
        return self.prm.step_scores([p for p, _ in texts], [r for _, r in texts])

    @torch.no_grad()
    def scores(self, samples: list[RolloutSample]) -> list[float]:
        """The sum over reward models of each model's score (normalised with its stored mean/std with
        `--reward.normalize`), read at the sample's last token."""
        total = torch.zeros(len(samples))
        for model, (mean, std, _) in zip(self.models, self.stats, strict=True):
            scores = self._scores(model, samples)
            if self.cfg.reward.normalize_enable:
                scores = (scores - mean) / std
            total += scores
        return total.tolist()

    @torch.no_grad()
    def check_scores(self, samples: list[RolloutSample]) -> list[float]:
        """The gold reward model's score of each sample, as it was trained (never normalised: its
        scale is its own, and only its changes over the run are read)."""
        return self._scores(self.checks[0], samples).tolist()

    def _scores(self, model, samples: list[RolloutSample]) -> torch.Tensor:
        from rlhf_core.models.forward import reward_scores

        out = []
        for chunk in self._chunks(samples):
            batch, _, _ = self._collate(chunk)
            with autocast(self.precision):
                out.append(reward_scores(model, batch).float().cpu())
        return torch.cat(out)


def experience_budget(cfg) -> int | None:
    """Tokens per chunk of the experience passes (no gradients), or None where they go by
    `--rollout.micro_batch_size` samples (given, and `--train.dynamic_batch_enable` off)."""
    if cfg.train.dynamic_batch_enable or cfg.rollout.micro_batch_size is None:
        return cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu
    return None


# The classes a role's group hosts, by role (`trainers/ppo.py` builds them in process or on Ray).
ROLE_CLASSES = {"actor": PolicyRole, "critic": CriticRole, "ref": ReferenceRole, "reward": RewardModelRole}


def total_optimizer_steps(rollout_steps: int, cfg) -> int:
    per_rollout = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.batch_size
    return max(1, math.ceil(rollout_steps * per_rollout * cfg.train.max_epochs))
