"""Checkpoint folders a stage may resume from: only the stage config that wrote them may read them.

A retried attempt of a long stage resumes from its newest checkpoint in the run's output area
(a local folder, or a prefix on S3 when the pipeline's output root is `s3://`). Before every
attempt the folder is claimed with the stage's cache key in `rlhf-stage-key.json`; an attempt with
another key is refused (naming both keys and the folder) rather than continue another
configuration's training state.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.infra import storage

MARKER = "rlhf-stage-key.json"


class CheckpointMismatch(ValueError):
    """The checkpoint folder holds the training state of another stage configuration."""


def claim(folder: str, cache_key: str, stage_name: str) -> bool:
    """Mark `folder` as `cache_key`'s checkpoints; True when an earlier attempt of the same key left
    it (the attempt resumes), False when it is new. CheckpointMismatch when another key wrote it."""
    marker, others = _look(folder)
    if marker is not None:
        recorded = json.loads(marker)
        if recorded.get("cache_key") != cache_key:
            raise CheckpointMismatch(
                f"{stage_name}: the checkpoint folder {folder} was written by another configuration of this stage "
                f"(cache key {recorded.get('cache_key')}, this attempt {cache_key}); resuming from it would "
                f"continue that run's training state. Remove the folder, or rerun with the configuration "
                f"that wrote it")
        return True
    if others:
        raise CheckpointMismatch(f"{stage_name}: the checkpoint folder {folder} holds files but no {MARKER}: "
                                 f"they belong to no known configuration; remove the folder to start over")
    text = json.dumps({"cache_key": cache_key, "stage_name": stage_name})
    if storage.is_remote(folder):
        storage._fs(folder).pipe_file(f"{folder.rstrip('/')}/{MARKER}", text.encode())
    else:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text(text)
    return False


def _look(folder: str) -> tuple[str | None, bool]:
    """(the marker's text or None, whether anything else is in `folder`)."""
    if not storage.is_remote(folder):
        path = Path(folder)
        marker = path / MARKER
        text = marker.read_text() if marker.exists() else None
        return text, path.exists() and any(p.name != MARKER for p in path.iterdir())
    if folder.startswith("s3://"):  # a store that is away: StoreUnavailable (retried), not the client's minutes
        from rlhf_core.infra.reachability import s3_endpoint, store_wait_s, wait_until_reachable

        wait_until_reachable("S3 endpoint", s3_endpoint(), store_wait_s(), "RLHF_STORE_WAIT_S",
                             f"when the stage claimed its checkpoint folder {folder}")
    fs = storage._fs(folder)
    root = folder.rstrip("/")
    fs.invalidate_cache(root)
    try:
        found = [p.rstrip("/") for p in fs.ls(root, detail=False)]  # one level, as the local branch looks
    except FileNotFoundError:
        found = []
    marker = f"{fs._strip_protocol(root).rstrip('/')}/{MARKER}"
    text = fs.cat_file(f"{root}/{MARKER}").decode() if marker in found else None
    return text, any(p != marker for p in found)
