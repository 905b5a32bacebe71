"""Direct preference optimisation and its variants (IPO, cDPO via label smoothing, hinge).

Chosen and rejected sequences go through the policy in one forward; the frozen reference's
log-probs for the same batch are computed once, without grad. Besides the loss, evaluation
reports the implicit-reward accuracy/margin and the policy's own preference: how often, and by
how much, it gives the chosen response a higher log-prob than the rejected one.
"""

from __future__ import annotations

import torch

from rlhf_core.algos.losses import dpo_loss
from rlhf_core.config import DPOConfig
from rlhf_core.data.examples import load_pairs
from rlhf_core.distributed.engine import EngineSettings, initialize, initialize_frozen
from rlhf_core.models.forward import loss_token_logprobs, per_sample_sum
from rlhf_core.models.loading import load_causal_lm, model_options
from rlhf_core.trainers.common import (
    StageData,
    load_stage_data,
    local_model_path,
    pair_batch_builder,
    prepare_trainable,
    report_forward,
    run_training,
    save_stage,
    start_stage,
)
from rlhf_core.trainers.loop import total_steps


def load_data(cfg: DPOConfig):
    return load_stage_data(cfg, load_pairs)


class DPORecipe:
    def __init__(self, cfg: DPOConfig):
        self.cfg = cfg

    def setup(self, data: StageData | None = None) -> None:
        cfg = self.cfg
        self.data = data if data is not None else load_data(cfg)
        self.ctx = start_stage(cfg, self.data)
        policy = prepare_trainable(load_causal_lm(local_model_path(cfg.pretrain), **model_options(cfg.ds)), cfg)
        self.to_batch = pair_batch_builder(cfg, self.data.tokenizer, self.ctx.device)
        self.engine = initialize(policy, EngineSettings.of(cfg), total_steps(cfg, len(self.data.train)))
        report_forward(self.ctx, "policy", self.engine)
        self.reference = initialize_frozen(load_causal_lm(local_model_path(cfg.ref_pretrain), **model_options(cfg.ds)),
                                           EngineSettings.of(cfg), offload=cfg.ref.offload)

    def count(self, examples) -> int:
        return len(examples)

    def micro_step(self, model, examples):
        n = len(examples)
        seqs = [e.chosen for e in examples] + [e.rejected for e in examples]
        batch = self.to_batch(seqs[:n], seqs[n:])
        token_lp = loss_token_logprobs(model, batch)
        logps = per_sample_sum(token_lp, batch)
        with torch.no_grad():
            ref_logps = per_sample_sum(loss_token_logprobs(self.reference, batch), batch)
        losses, chosen_r, rejected_r = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], self.cfg.model.beta,
                                                self.cfg.model.loss_type.value, self.cfg.model.label_smoothing)
        if self.cfg.model.nll_loss_coef > 0:
            lengths = torch.tensor([sum(s.loss_mask) for s in seqs[:n]], device=logps.device, dtype=logps.dtype)
            losses = losses + self.cfg.model.nll_loss_coef * (-logps[:n] / lengths)
        logp_margin = (logps[:n] - logps[n:]).detach()
        stats = {"loss": losses.sum(), "reward_accuracy": (chosen_r > rejected_r).float().sum(),
                 "reward_margin": (chosen_r - rejected_r).sum(), "chosen_reward": chosen_r.sum(),
                 "rejected_reward": rejected_r.sum(), "logp_accuracy": (logp_margin > 0).float().sum(),
                 "logp_margin": logp_margin.sum()}
        return losses.sum(), stats, sum(len(s.input_ids) for s in seqs)  # data tokens: a shared prompt counts twice

    def train(self) -> dict:
        self.metrics = run_training(self)
        return self.metrics

    def save(self) -> dict | None:
        inputs = {"pretrain": self.cfg.pretrain, "ref_pretrain": self.cfg.ref_pretrain,
                  "datasets": self.data.sources}
        return save_stage(self.ctx, self.engine.module, self.data.tokenizer, self.metrics, inputs)
