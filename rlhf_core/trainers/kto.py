"""KTO: learning from unpaired desirable/undesirable completions.

The reference point z_ref is a KL estimate between policy and reference on mismatched pairs
(prompt i with the completion of example i+1 in the micro-batch), not back-propagated, as in the
KTO paper. It is estimated once per optimizer step, over the mismatched pairs of every micro-batch
of every rank (`prepare_step`, before the step's first micro-batch), so the updates do not depend
on how the step is split: 2 ranks make the updates of 1 (tests/integration/test_resume_ray.py).
Evaluation estimates it once over the whole held-out set. Paired preference data is accepted and
unpaired.
"""

from __future__ import annotations

import torch

from rlhf_core.algos.losses import kto_kl_estimate, kto_loss
from rlhf_core.config import KTOConfig
from rlhf_core.data.examples import Sequence, load_unpaired
from rlhf_core.distributed.engine import EngineSettings, all_reduce_sum, initialize, initialize_frozen
from rlhf_core.models.forward import sequence_logprobs
from rlhf_core.models.loading import load_causal_lm, model_options
from rlhf_core.trainers.common import (
    StageData,
    batch_builder,
    load_stage_data,
    local_model_path,
    prepare_trainable,
    report_forward,
    run_training,
    save_stage,
    start_stage,
)
from rlhf_core.trainers.loop import total_steps


def mismatched(seqs: list[Sequence], max_len: int) -> list[Sequence]:
    """Prompt of sequence i with the completion of sequence i+1 (cyclic), cut to max_len."""
    out = []
    for i, s in enumerate(seqs):
        other = seqs[(i + 1) % len(seqs)]
        prompt, completion = s.input_ids[: s.prompt_len], other.input_ids[other.prompt_len :]
        ids = (prompt + completion)[:max_len]
        out.append(Sequence(ids, ([0] * len(prompt) + [1] * len(completion))[:max_len]))
    return out


def load_data(cfg: KTOConfig):
    return load_stage_data(cfg, load_unpaired)


class KTORecipe:
    def __init__(self, cfg: KTOConfig):
        self.cfg = cfg

    def setup(self, data: StageData | None = None) -> None:
        cfg = self.cfg
        self.data = data if data is not None else load_data(cfg)
        self.ctx = start_stage(cfg, self.data)
        policy = prepare_trainable(load_causal_lm(local_model_path(cfg.pretrain), **model_options(cfg.ds)), cfg)
        self.to_batch = batch_builder(cfg, self.data.tokenizer, self.ctx.device)
        self.engine = initialize(policy, EngineSettings.of(cfg), total_steps(cfg, len(self.data.train)))
        report_forward(self.ctx, "policy", self.engine)
        self.reference = initialize_frozen(load_causal_lm(local_model_path(cfg.ref_pretrain), **model_options(cfg.ds)),
                                           EngineSettings.of(cfg), offload=cfg.ref.offload)
        self.kl: torch.Tensor | None = None  # the current step's KL estimate (`prepare_step`)

    @torch.no_grad()
    def prepare_step(self, model, micro_batches: list) -> None:
        """KL̂ of this optimizer step (or evaluation): the mean of logπ − logπ_ref over the mismatched
        pairs of all `micro_batches` of all ranks (every rank calls this in lockstep)."""
        total = torch.zeros(2, dtype=torch.float64)
        for examples in micro_batches:
            kl_batch = self.to_batch(mismatched([e.seq for e in examples], self.cfg.data.max_len))
            mean = kto_kl_estimate(sequence_logprobs(model, kl_batch), sequence_logprobs(self.reference, kl_batch))
            total += torch.tensor([mean.double().item() * len(examples), float(len(examples))], dtype=torch.float64)
        kl_sum, n = all_reduce_sum(total).tolist()
        self.kl = torch.tensor(kl_sum / max(n, 1.0), dtype=torch.float32)

    def count(self, examples) -> int:
        return len(examples)

    def micro_step(self, model, examples):
        seqs = [e.seq for e in examples]
        batch = self.to_batch(seqs)
        logps = sequence_logprobs(model, batch)
        if self.kl is None:
            raise RuntimeError("KTO: micro_step before prepare_step (the step's KL reference point)")
        with torch.no_grad():
            ref_logps = sequence_logprobs(self.reference, batch)
        kl = self.kl.to(logps.device)
        desirable = torch.tensor([e.desirable for e in examples], device=logps.device)
        losses, rewards, z_ref = kto_loss(logps, ref_logps, desirable, kl, self.cfg.model.beta,
                                          self.cfg.model.desirable_loss_weight,
                                          self.cfg.model.undesirable_loss_weight)
        signed = torch.where(desirable, rewards, -rewards)
        stats = {"loss": losses.sum(), "kl": z_ref * len(examples), "signed_reward": signed.sum(),
                 "accuracy": (signed > 0).float().sum()}
        return losses.sum(), stats, int((batch.seq_ids >= 0).sum())

    def train(self) -> dict:
        self.metrics = run_training(self)
        return self.metrics

    def save(self) -> dict | None:
        inputs = {"pretrain": self.cfg.pretrain, "ref_pretrain": self.cfg.ref_pretrain,
                  "datasets": self.data.sources}
        return save_stage(self.ctx, self.engine.module, self.data.tokenizer, self.metrics, inputs)
