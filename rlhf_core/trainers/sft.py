"""Supervised fine-tuning: next-token NLL on response tokens (or every token with --pretrain_mode).

The loss is summed over response tokens and divided by the global count of response tokens in
the optimizer step (ALGORITHMS.md), not averaged per sample, so long answers weigh what their
tokens weigh and micro-batching does not change the result.
"""

from __future__ import annotations

from rlhf_core.config import SFTConfig
from rlhf_core.data.examples import load_sft
from rlhf_core.distributed.engine import initialize
from rlhf_core.models.forward import token_logprobs
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.trainers.common import (
    batch_builder,
    load_stage_tokenizer,
    local_model_path,
    prepare_trainable,
    save_stage,
    start_stage,
)
from rlhf_core.trainers.loop import TrainLoop, total_steps


class SFTRecipe:
    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_stage_tokenizer(cfg)
        self.train_set, self.train_sources = load_sft(cfg.data, self.tokenizer, cfg.data.dataset_split, cfg.seed,
                                                      cfg.pretrain_mode)
        self.eval_set, self.eval_sources = load_sft(cfg.data, self.tokenizer, cfg.data.eval_split, cfg.seed,
                                                    cfg.pretrain_mode)
        self.ctx = start_stage(cfg)
        self.ctx.tracker.log_datasets(self.train_sources, "training")
        self.ctx.tracker.log_datasets(self.eval_sources, "evaluation")
        model = prepare_trainable(load_causal_lm(local_model_path(cfg.pretrain), cfg.flash_attn), cfg)
        self.to_batch = batch_builder(cfg, self.tokenizer, self.ctx.device)
        self.engine = initialize(model, cfg, total_steps(cfg, len(self.train_set)))

    # Recipe protocol used by TrainLoop.
    def count(self, examples) -> int:
        return sum(sum(e.seq.loss_mask) for e in examples)

    def micro_step(self, model, examples):
        batch = self.to_batch([e.seq for e in examples])
        logprobs = token_logprobs(model, batch)
        nll_sum = -(logprobs * batch.loss_mask).sum()
        tokens = int((batch.seq_ids >= 0).sum())
        return nll_sum, {"loss": nll_sum.detach()}, tokens

    def train(self) -> dict:
        self.loop = TrainLoop(self.cfg, self.engine, self, self.train_set, self.eval_set, self.ctx.tracker,
                              self.ctx.rank, self.ctx.world_size)
        self.metrics = self.loop.run()
        return self.metrics

    def save(self) -> dict | None:
        inputs = {"pretrain": self.cfg.pretrain, "datasets": self.train_sources + self.eval_sources}
        return save_stage(self.ctx, self.engine.module, self.tokenizer, self.metrics, inputs)
