"""Which checkpoint tags under a `--ckpt_path` each training run wrote, so rotation removes only its own.

`rlhf-checkpoints.json` in the checkpoint folder maps a tag (`global_step<N>`) to the run that
wrote it: `{"tags": {tag: {"run": id, "stage": ..., "step": N}}}`. A fresh run has a new id; a
resumed run (`--load_checkpoint`) continues the id of the tag it loaded (and takes over a tag no
record lists), so `--max_ckpt_num` counts a run's checkpoints across restarts. Other runs' tags
and unlisted folders are never removed. Rank 0 writes the record, atomically.

A checkpoint is written under `.<tag>.partial` and renamed to its tag only when every rank has
written all of it; then `latest` names it, the record lists it, and rotation runs. A failed save
(a full disk, a killed rank) leaves the earlier checkpoints and `latest` as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from rlhf_core.infra.storage import CHECKPOINTS


def new_run_id() -> str:
    return uuid.uuid4().hex


def read_record(ckpt: Path) -> dict:
    """The record of `ckpt` (`{"tags": {}}` when there is none yet, or it cannot be read)."""
    try:
        record = json.loads((Path(ckpt) / CHECKPOINTS).read_text())
    except (OSError, ValueError):
        return {"tags": {}}
    return record if isinstance(record.get("tags"), dict) else {"tags": {}}


def run_of(ckpt: Path, tag: str) -> str | None:
    """The run that wrote `tag`, None when no record lists it."""
    entry = read_record(ckpt)["tags"].get(tag)
    return entry.get("run") if isinstance(entry, dict) else None


def record_tag(ckpt: Path, tag: str, run: str, stage: str, step: int) -> None:
    """Note that `run` wrote (or resumed from) `tag`."""
    record = read_record(ckpt)
    record["tags"][tag] = {"run": run, "stage": stage, "step": step}
    _write(Path(ckpt), record)


def tags_to_remove(record: dict, run: str, keep: int) -> list[str]:
    """The tags of `run` beyond its newest `keep` (by step), oldest first; other runs' tags never."""
    mine = sorted((entry["step"], tag) for tag, entry in record["tags"].items()
                  if isinstance(entry, dict) and entry.get("run") == run)
    return [tag for _, tag in mine[: max(len(mine) - keep, 0)]]


def rotate(ckpt: Path, run: str, keep: int) -> list[str]:
    """Remove the checkpoints of `run` beyond its newest `keep`; returns the tags removed."""
    ckpt = Path(ckpt)
    record = read_record(ckpt)
    removed = tags_to_remove(record, run, keep)
    for tag in removed:
        shutil.rmtree(ckpt / tag, ignore_errors=True)
        del record["tags"][tag]
    if removed:
        _write(ckpt, record)
    return removed


def partial_tag(tag: str) -> str:
    """Where `tag` is written until it is whole (the same name on every rank, as DeepSpeed requires)."""
    return f".{tag}.partial"


def begin(ckpt: Path, tag: str) -> Path:
    """The empty folder to write `tag` into (a leftover of a failed attempt is removed first)."""
    partial = Path(ckpt) / partial_tag(tag)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit(ckpt: Path, tag: str) -> None:
    """Rename the whole `partial_tag(tag)` folder to `tag`, then point `latest` at it (atomically).

    An earlier `tag` (a fresh run writing a step an older run wrote) is moved aside first and
    removed only after the new one is in place; `latest` is replaced, never rewritten in place.
    """
    ckpt = Path(ckpt)
    final, old = ckpt / tag, None
    if final.exists():
        old = ckpt / f".{tag}.old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    (ckpt / partial_tag(tag)).rename(final)
    write_latest(ckpt, tag)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def abandon(ckpt: Path, tag: str) -> None:
    """Remove what a failed save of `tag` wrote (its partial folder), freeing the space it took."""
    shutil.rmtree(Path(ckpt) / partial_tag(tag), ignore_errors=True)


def write_latest(ckpt: Path, tag: str) -> None:
    tmp = Path(ckpt) / f".latest.{os.getpid()}.tmp"
    try:
        tmp.write_text(tag)
        os.replace(tmp, Path(ckpt) / "latest")
    finally:
        tmp.unlink(missing_ok=True)


def _write(ckpt: Path, record: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / f".{CHECKPOINTS}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, ckpt / CHECKPOINTS)
    finally:
        tmp.unlink(missing_ok=True)
