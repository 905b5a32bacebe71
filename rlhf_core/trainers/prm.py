"""Process reward models (OpenRLHF's `train_prm`): a causal LM learns, at each step's placeholder
token, to put its next-token mass on the reward token of the step's label (`+` right, `-` wrong).

The loss is the cross-entropy over the reward tokens' logits only (or the whole vocabulary when no
reward tokens are given; probabilities as soft labels need two), read at the placeholder position
itself (the output there predicts the token after it, as in OpenRLHF). Summed over steps and
divided by the optimizer step's steps across ranks, so micro-batching does not change it (OpenRLHF
averages per micro-batch). `acc` is the share of steps whose highest reward-token logit is the label's.
A step's score at inference is the probability of the first reward token (`rewards/process.py`).
"""

from __future__ import annotations

import torch

from rlhf_core.algos.losses import process_reward_losses
from rlhf_core.config import PRMConfig
from rlhf_core.data.examples import load_steps, single_token_id
from rlhf_core.models.forward import position_logits, response_index
from rlhf_core.trainers.common import load_stage_data
from rlhf_core.trainers.sft import SFTRecipe


def load_data(cfg: PRMConfig):
    return load_stage_data(cfg, load_steps)


class PRMRecipe(SFTRecipe):
    cfg: PRMConfig

    def setup(self, data=None) -> None:
        super().setup(data if data is not None else load_data(self.cfg))
        tokens = self.cfg.data.reward_tokens or []
        self.reward_ids = [single_token_id(self.data.tokenizer, t, "--reward_tokens") for t in tokens] or None

    def count(self, examples) -> int:  # loss units: steps
        return sum(len(e.targets) for e in examples)

    def micro_step(self, model, examples):
        batch = self.to_batch([e.seq for e in examples])
        index, mask = response_index(batch)  # each sample's placeholders, in order
        logits = position_logits(model, batch, index[mask.bool()])
        device = logits.device
        targets = torch.tensor([t for e in examples for t in e.targets], device=device)
        soft = (torch.tensor([p for e in examples for p in e.soft], device=device)
                if examples[0].soft is not None else None)
        loss, right = process_reward_losses(logits, targets, self.reward_ids, soft)
        return loss, {"loss": loss.detach(), "acc": right}, int((batch.seq_ids >= 0).sum())
