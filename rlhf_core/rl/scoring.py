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
    """Reward models on a role group, read by `method`: `RewardModelRole.scores` (the models trained
    against: the score is the reward) or `check_scores` (the gold reward model that checks
    held-out responses, `--eval.reward_model_name_or_path`: a metric, never a reward)."""

    def __init__(self, group, method: str = "scores"):
        self.group, self.method = group, method

    def scores(self, samples: list[RolloutSample]) -> list[float]:
        return self.group.call_sharded(self.method, samples)

    def score(self, samples: list[RolloutSample], labels: list) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.tensor(self.scores(samples), dtype=torch.float32)
        return raw, raw


class ProcessRewardSource:
    """A process reward model on the reward role group (`RewardModelRole.step_scores`): each sample's
    steps (the lines of its decoded response) scored after the prompt as the PRM was trained on it,
    the prompt's own text (`raw_prompts`: the dataset's, before any template) rather than the
    templated one the policy saw. The reward is the response's score by `aggregate`; with
    `per_step`, each sample also keeps `extra["step_rewards"]`: `(token index, P(right))` per step,
    at the token that completes the step (`rewards.process.step_end_tokens`)."""

    def __init__(self, group, tokenizer, raw_prompts: dict[tuple, str], aggregate: str, per_step: bool):
        self.group, self.tokenizer, self.raw_prompts = group, tokenizer, raw_prompts
        self.aggregate, self.per_step = aggregate, per_step

    def score(self, samples: list[RolloutSample], labels: list) -> tuple[torch.Tensor, torch.Tensor]:
        from rlhf_core.rewards.process import aggregate, step_end_tokens

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        texts = [(self.raw_prompts[tuple(s.prompt_ids)], decode(s.response_ids)) for s in samples]
        steps = self.group.call_sharded("step_scores", texts)
        for s, scores in zip(samples, steps, strict=True):
            if self.per_step:  # a PRM that read fewer steps (its max_len) rewards those it read; none: a 0 at the end
                pairs = list(zip(step_end_tokens(decode, s.response_ids), scores, strict=False))
                s.extra["step_rewards"] = pairs or ([(s.response_len - 1, 0.0)] if s.response_ids else [])
        raw = torch.tensor([aggregate(scores, self.aggregate) for scores in steps], dtype=torch.float32)
        return raw, raw
