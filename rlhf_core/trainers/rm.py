"""Reward model: Bradley-Terry on (chosen, rejected) pairs, scored at the last token.

Chosen and rejected sequences of a micro-batch go through the model together (one forward of
2B sequences). After training, one forward pass over the training set measures the reward
mean/std, stored in the saved config (`reward_mean`, `reward_std`) for later normalisation.
"""

from __future__ import annotations

import sys

import torch

from rlhf_core.algos.losses import pairwise_reward_loss
from rlhf_core.config import RMConfig
from rlhf_core.data.examples import load_pairs
from rlhf_core.distributed.engine import EngineSettings, all_reduce_sum, autocast, initialize, precision_of
from rlhf_core.distributed.sharding import share
from rlhf_core.models.forward import reward_scores
from rlhf_core.models.loading import give_reward_model_its_own_pad, load_reward_model, model_options
from rlhf_core.trainers.common import (
    StageData,
    batch_builder,
    load_stage_data,
    local_model_path,
    pair_batch_builder,
    prepare_trainable,
    report_forward,
    run_training,
    save_stage,
    start_stage,
)
from rlhf_core.trainers.loop import no_grad_chunks, total_steps


def load_data(cfg: RMConfig):
    return load_stage_data(cfg, load_pairs)


class RewardModelRecipe:
    def __init__(self, cfg: RMConfig):
        self.cfg = cfg

    def setup(self, data: StageData | None = None) -> None:
        cfg = self.cfg
        self.data = data if data is not None else load_data(cfg)
        self.ctx = start_stage(cfg, self.data)
        # A new score head starts the same on every rank (ranks are seeded apart, and a tensor-parallel
        # group's ranks get no broadcast from one another)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            model = load_reward_model(local_model_path(cfg.pretrain), self.data.tokenizer.pad_token_id,
                                      cfg.ds.value_head_prefix, **model_options(cfg.ds))
        if give_reward_model_its_own_pad(model, self.data.tokenizer) and self.ctx.is_main:
            print(f"the tokenizer pads with EOS: the reward model gets its own pad token "
                  f"{self.data.tokenizer.pad_token!r}, so transformers reads its score at EOS as we do",
                  file=sys.stderr, flush=True)
        model = prepare_trainable(model, cfg, is_reward_model=True)
        self.to_batch = batch_builder(cfg, self.data.tokenizer, self.ctx.device)
        self.to_pair_batch = pair_batch_builder(cfg, self.data.tokenizer, self.ctx.device)
        self.engine = initialize(model, EngineSettings.of(cfg), total_steps(cfg, len(self.data.train)))
        report_forward(self.ctx, "reward_model", self.engine, sequence_classifier=True)

    def scores(self, model, sequences) -> torch.Tensor:
        return reward_scores(model, self.to_batch(sequences))

    def count(self, examples) -> int:
        return len(examples)

    def micro_step(self, model, examples):
        n = len(examples)
        rewards = reward_scores(model, self.to_pair_batch([e.chosen for e in examples], [e.rejected for e in examples]))
        chosen, rejected = rewards[:n], rewards[n:]
        margin = torch.tensor([e.margin for e in examples], device=rewards.device) if self.cfg.data.margin_key else None
        losses = pairwise_reward_loss(chosen, rejected, self.cfg.model.loss_type.value, margin)
        tokens = sum(len(e.chosen.input_ids) + len(e.rejected.input_ids) for e in examples)
        stats = {"loss": losses.sum(), "accuracy": (chosen > rejected).float().sum(),
                 "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum()}
        return losses.sum(), stats, tokens

    def train(self) -> dict:
        self.metrics = run_training(self)
        return self.metrics

    @torch.no_grad()
    def reward_statistics(self) -> tuple[float, float]:
        """Mean and std of the rewards of all training sequences (chosen and rejected)."""
        self.engine.eval()
        duplicates = self.cfg.ds.duplicates  # a ring's ranks share batches
        # as the loop's evaluation shards (distributed/sharding.py)
        mine = share(self.data.train, self.ctx.rank // duplicates, self.ctx.world_size // duplicates)
        total = torch.zeros(3, dtype=torch.float64)
        for chunk in no_grad_chunks(self.cfg, mine):
            with autocast(precision_of(self.cfg.ds)):
                r = self.scores(self.engine, [e.chosen for e in chunk] + [e.rejected for e in chunk]).double().cpu()
            total += torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=torch.float64)])
        s, s2, n = (all_reduce_sum(total) / duplicates).tolist()
        mean = s / n
        return mean, max(s2 / n - mean * mean, 0.0) ** 0.5

    def save(self) -> dict | None:
        mean, std = self.reward_statistics()
        self.metrics.update({"reward_mean": mean, "reward_std": std})
        inputs = {"pretrain": self.cfg.pretrain, "datasets": self.data.sources}
        updates = {"reward_mean": mean, "reward_std": std, "value_head_prefix": "score"}
        return save_stage(self.ctx, self.engine.module, self.data.tokenizer, self.metrics, inputs, updates)
