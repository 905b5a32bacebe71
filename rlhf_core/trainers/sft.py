"""Supervised fine-tuning: next-token NLL on response tokens (or every token with --pretrain_mode).

The loss is summed over response tokens and divided by the global count of response tokens in
the optimizer step (docs/algorithms.md), not averaged per sample, so long answers weigh what their
tokens weigh and micro-batching does not change the result.
"""

from __future__ import annotations

from functools import partial

from rlhf_core.algos.losses import sft_loss
from rlhf_core.config import SFTConfig
from rlhf_core.data.examples import load_sft
from rlhf_core.distributed.engine import EngineSettings, initialize
from rlhf_core.models.forward import loss_token_logprobs
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


def load_data(cfg: SFTConfig):
    return load_stage_data(cfg, partial(load_sft, pretrain_mode=cfg.model.pretrain_mode_enable))


class SFTRecipe:
    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg

    def setup(self, data: StageData | None = None) -> None:
        cfg = self.cfg
        self.data = data if data is not None else load_data(cfg)
        self.ctx = start_stage(cfg, self.data)
        self.to_batch = batch_builder(cfg, self.data.tokenizer, self.ctx.device)
        model = prepare_trainable(load_causal_lm(local_model_path(cfg.pretrain), **model_options(cfg.ds)), cfg)
        self.engine = initialize(model, EngineSettings.of(cfg), total_steps(cfg, len(self.data.train)))
        report_forward(self.ctx, "policy", self.engine)

    # Recipe protocol used by TrainLoop: loss units are response tokens.
    def count(self, examples) -> int:
        return sum(sum(e.seq.loss_mask) for e in examples)

    def micro_step(self, model, examples):
        batch = self.to_batch([e.seq for e in examples])
        nll_sum = sft_loss(loss_token_logprobs(model, batch), batch.loss_mask)
        return nll_sum, {"loss": nll_sum.detach()}, int((batch.seq_ids >= 0).sum())

    def train(self) -> dict:
        self.metrics = run_training(self)
        return self.metrics

    def inputs(self) -> dict:
        """What the stage's manifest records it was trained from."""
        return {"pretrain": self.cfg.pretrain, "datasets": self.data.sources}

    def save(self) -> dict | None:
        return save_stage(self.ctx, self.engine.module, self.data.tokenizer, self.metrics, self.inputs())
