"""What stand-in engines of the unit tests share: an answer cut to its budget, as engines cut it."""

from rlhf_core.rollout.base import Sample


def within_budget(ids, logprobs, budget: int, ended: bool = True) -> Sample:
    """The first `budget` tokens of an answer; finished only if it ended (`ended`) within them."""
    ids, logprobs = tuple(ids), tuple(logprobs)
    return Sample(ids[:budget], logprobs[:budget], ended and len(ids) <= budget)
