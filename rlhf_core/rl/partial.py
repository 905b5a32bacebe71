"""Partial rollouts (`--train.partial_rollout_enable` / `--partial_rollout`, with `--async_train`).

In the asynchronous loop (`rl/ahead.py`) a weight sync otherwise waits until every batch sampled
ahead is complete. With partial rollouts, generation runs in segments of about a quarter of
`--rollout.max_new_tokens` (`SEGMENTS`); between two segments the background sampling stops for a
pending weight sync (`RolloutsAhead.yield_point`), and the rest of each unfinished response is
sampled with the new weights. So a sync waits for one segment at most, never for the longest
response of a batch. OpenRLHF pauses its vLLM engines mid-request instead; there the boundary is
any token, here a segment's end, and it works with every engine.

Each sampled token remembers the policy version that sampled it (`extra["versions"]`), from
which the controller logs the tokens' staleness (mean and max) and the share of responses
sampled by more than one policy. The engine's log-probs stay those of the policy that sampled
each token, which is what the off-policy correction (`--algo.advantage.is_correction_enable`)
compares with the trainer's. Where a sync lands depends on timing, so unlike the plain
asynchronous loop a partial-rollout run is not reproducible token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf_core.rollout.base import Sample

SEGMENTS = 4  # segments per response budget: a weight sync waits for one at most


@dataclass
class Growing:
    """One response being sampled segment by segment."""

    prompt: int  # position of its prompt in the request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


def segment_len(max_new_tokens: int, segments: int = SEGMENTS) -> int:
    return max(1, math.ceil(max_new_tokens / segments))


def sample_in_segments(prompt_ids: list[list[int]], n: int, max_new_tokens: int, seed: int,
                       generate: Callable[[list[list[int]], int, int], list[Sample]],
                       between: Callable[[], int], segments: int = SEGMENTS) -> list[list[Growing]]:
    """`n` responses for each prompt, `[len(prompt_ids)][n]`, sampled in segments.

    `generate(sequences, budgets, seed)`: one `Sample` per sequence (its continuation, at most its
    budget); `between()`: called before each segment (where a pending weight sync happens) and
    returns the policy version the segment is sampled with."""
    responses = [[Growing(k) for _ in range(n)] for k in range(len(prompt_ids))]
    active = [r for group in responses for r in group]
    step = segment_len(max_new_tokens, segments)
    round_ = 0
    while active:
        version = between()
        budgets = [min(step, max_new_tokens - len(r.token_ids)) for r in active]
        out = generate([prompt_ids[r.prompt] + r.token_ids for r in active], budgets, seed + 7919 * round_)
        for r, sample in zip(active, out, strict=True):
            ids = list(sample.token_ids)
            r.token_ids += ids
            r.logprobs += list(sample.logprobs)
            r.versions += [version] * len(ids)
            r.finished = sample.finished
            if not ids:  # the engine gave nothing: the response cannot grow (never loop on it)
                r.finished = True
        active = [r for r in active if not r.finished and len(r.token_ids) < max_new_tokens]
        round_ += 1
    return responses


def staleness_stats(versions: list[list[int]], current: int) -> dict[str, float]:
    """The tokens' staleness (policy updates between sampling and training), mean and max, and the
    share of responses whose tokens come from more than one policy."""
    tokens = [current - v for vs in versions for v in vs]
    if not tokens:
        return {}
    return {"rollout/staleness": sum(tokens) / len(tokens), "rollout/staleness_max": float(max(tokens)),
            "rollout/partial_frac": sum(len(set(vs)) > 1 for vs in versions) / len(versions)}
