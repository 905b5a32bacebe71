"""Checkpoint folders a stage may resume from: only the stage config that wrote them may read them.

A retried attempt of a long stage resumes from its newest checkpoint in the run's output area.
Before every attempt the folder is claimed with the stage's cache key in `rlhf-stage-key.json`;
an attempt with another key is refused (naming both keys and the folder) rather than continue
another configuration's training state. Local folders only.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "rlhf-stage-key.json"


class CheckpointMismatch(ValueError):
    """The checkpoint folder holds the training state of another stage configuration."""


def claim(folder: str, cache_key: str, stage_name: str) -> bool:
    """Mark `folder` as `cache_key`'s checkpoints; True when an earlier attempt of the same key left
    it (the attempt resumes), False when it is new. CheckpointMismatch when another key wrote it."""
    path = Path(folder)
    marker = path / MARKER
    if marker.exists():
        recorded = json.loads(marker.read_text())
        if recorded.get("cache_key") != cache_key:
            raise CheckpointMismatch(
                f"{stage_name}: the checkpoint folder {folder} was written by another configuration of this stage "
                f"(cache key {recorded.get('cache_key')}, this attempt {cache_key}); resuming from it would "
                f"continue that run's training state. Remove the folder, or rerun with the configuration "
                f"that wrote it")
        return True
    if path.exists() and any(p.name != MARKER for p in path.iterdir()):
        raise CheckpointMismatch(f"{stage_name}: the checkpoint folder {folder} holds files but no {MARKER}: "
                                 f"they belong to no known configuration; remove the folder to start over")
    path.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"cache_key": cache_key, "stage_name": stage_name}))
    return False
