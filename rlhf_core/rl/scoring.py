"""The RL stage's reward sources behind one call: `score(samples, labels) -> (rewards, scores)`.

The controller does not know which source it has. Text sources (a task verifier, a reward file, a
remote reward server: `rewards.factory`) read decoded text; reward models read the token ids on
their own role group. `rewards` is what training uses, `scores` what is reported (a verifier's
0/1 next to a shaped reward; the same numbers for a reward model).
"""

from __future__ import annotations

import torch

from rlhf_core.rl.experience import RolloutSample


class TextRewardSource:
    """A reward function of text: `reward_fn(queries, prompts, labels, responses=...)`."""

    def __init__(self, reward_fn, tokenizer):
        self.reward_fn, self.tokenizer = reward_fn, tokenizer

    def score(self, samples: list[RolloutSample], labels: list) -> tuple[torch.Tensor, torch.Tensor]:
        decode = self.tokenizer.decode
        queries = [decode(s.prompt_ids + s.response_ids, skip_special_tokens=False) for s in samples]
        prompts = [decode(s.prompt_ids, skip_special_tokens=False) for s in samples]
        responses = [decode(s.response_ids, skip_special_tokens=True) for s in samples]
        out = self.reward_fn(queries, prompts, [labels[s.prompt_index] for s in samples], responses=responses)
        return out.rewards.float(), out.scores.float()


class RewardModelSource:
    """Reward models on a role group (`RewardModelRole.scores`): the score is the reward."""

    def __init__(self, group):
        self.group = group

    def score(self, samples: list[RolloutSample], labels: list) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.tensor(self.group.call_sharded("scores", samples), dtype=torch.float32)
        return raw, raw
