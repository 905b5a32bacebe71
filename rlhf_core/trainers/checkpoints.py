"""Which checkpoint tags under a `--ckpt_path` each training run wrote, so rotation removes only its own;
and how a checkpoint becomes whole, on local disk or on S3.

`rlhf-checkpoints.json` in the checkpoint folder maps a tag (`global_step<N>`) to the run that
wrote it: `{"tags": {tag: {"run": id, "stage": ..., "step": N}}}`. A fresh run has a new id; a
resumed run (`--load_checkpoint`) continues the id of the tag it loaded (and takes over a tag no
record lists), so `--max_ckpt_num` counts a run's checkpoints across restarts. Other runs' tags
and unlisted folders are never removed. Rank 0 writes the record, atomically.

Locally a checkpoint is written under `.<tag>.partial` and renamed to its tag only when every rank
has written all of it; then `latest` names it, the record lists it, and rotation runs. A failed
save (a full disk, a killed rank) leaves the earlier checkpoints and `latest` as they were.

On `s3://` there is no rename: each rank writes its part into a staging folder of its own on its
node (`staging_dir`, under the state directory), uploads it to `<ckpt>/<tag>/` and removes it;
once every rank has uploaded, `latest` (one PUT, the last object of the checkpoint) names the tag.
An upload cut short leaves objects that no `latest` names; the next save of that tag removes them
first (`begin_remote`). A resuming rank downloads the tag `latest` names into its node's download
cache (`fetch`), so no node reads a local path that another node wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from rlhf_core.infra import storage
from rlhf_core.infra.storage import CHECKPOINTS

LATEST = "latest"


def new_run_id() -> str:
    return uuid.uuid4().hex


def is_remote(ckpt) -> bool:
    return storage.is_remote(str(ckpt))


def _uri(ckpt) -> str:
    return str(ckpt).rstrip("/")


def _read(ckpt, name: str) -> str | None:
    """The text of `ckpt/name`, None when there is none."""
    if not is_remote(ckpt):
        try:
            return (Path(ckpt) / name).read_text()
        except FileNotFoundError:
            return None
    fs = storage._fs(_uri(ckpt))
    path = f"{_uri(ckpt)}/{name}"
    fs.invalidate_cache(path)  # listings are cached for the life of a process; another node may have written
    try:
        return fs.cat_file(path).decode()
    except FileNotFoundError:
        return None


def _replace(ckpt, name: str, text: str) -> None:
    """Write `ckpt/name` whole: locally beside it and renamed into place; on S3 one PUT."""
    if is_remote(ckpt):
        storage._fs(_uri(ckpt)).pipe_file(f"{_uri(ckpt)}/{name}", text.encode())
        return
    ckpt = Path(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / f".{name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, ckpt / name)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_tag(ckpt, tag: str) -> None:
    if not is_remote(ckpt):
        shutil.rmtree(Path(ckpt) / tag, ignore_errors=True)
        return
    fs = storage._fs(_uri(ckpt))
    try:
        fs.rm(f"{_uri(ckpt)}/{tag}", recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(_uri(ckpt))


def read_record(ckpt) -> dict:
    """The record of `ckpt` (`{"tags": {}}` when there is none yet, or it cannot be read)."""
    try:
        record = json.loads(_read(ckpt, CHECKPOINTS) or "")
    except ValueError:  # a record that is not JSON; a store that fails to answer raises (it must not erase the record)
        return {"tags": {}}
    return record if isinstance(record, dict) and isinstance(record.get("tags"), dict) else {"tags": {}}


def run_of(ckpt, tag: str) -> str | None:
    """The run that wrote `tag`, None when no record lists it."""
    entry = read_record(ckpt)["tags"].get(tag)
    return entry.get("run") if isinstance(entry, dict) else None


def record_tag(ckpt, tag: str, run: str, stage: str, step: int, best: bool = False) -> None:
    """Note that `run` wrote (or resumed from) `tag`; `best`: its best checkpoint so far (never rotated;
    `--ckpt.best_metric_key`), which replaces the run's earlier best."""
    record = read_record(ckpt)
    if best:
        for old in [t for t, e in record["tags"].items() if t != tag and _is_best_of(e, run)]:
            _remove_tag(ckpt, old)
            del record["tags"][old]
    record["tags"][tag] = {"run": run, "stage": stage, "step": step, **({"best": True} if best else {})}
    _write(ckpt, record)


def _is_best_of(entry, run: str) -> bool:
    return isinstance(entry, dict) and entry.get("run") == run and bool(entry.get("best"))


def tags_to_remove(record: dict, run: str, keep: int, sizes: dict[str, int] | None = None,
                   max_bytes: float = float("inf")) -> list[str]:
    """The tags of `run` beyond its newest `keep` (by step), then, oldest first, as many more as
    bring the rest of its tags to at most `max_bytes` (`sizes`: bytes per tag; the newest always
    stays); oldest first; other runs' tags and best checkpoints never."""
    mine = sorted((entry["step"], tag) for tag, entry in record["tags"].items()
                  if isinstance(entry, dict) and entry.get("run") == run and not entry.get("best"))
    removed = [tag for _, tag in mine[: max(len(mine) - keep, 0)]]
    kept = [tag for _, tag in mine[len(removed):]]
    if sizes is not None:
        while len(kept) > 1 and sum(sizes.get(t, 0) for t in kept) > max_bytes:
            removed.append(kept.pop(0))
    return removed


def tag_bytes(ckpt, tags: list[str]) -> dict[str, int]:
    """The size of each checkpoint folder of `tags` (bytes; 0 for one that is gone)."""
    if is_remote(ckpt):
        fs = storage._fs(_uri(ckpt))
        return {t: fs.du(f"{_uri(ckpt)}/{t}") if fs.exists(f"{_uri(ckpt)}/{t}") else 0 for t in tags}
    return {t: sum(f.stat().st_size for f in (Path(ckpt) / t).rglob("*") if f.is_file()) for t in tags}


def rotate(ckpt, run: str, keep: int, max_gb: float | None = None) -> list[str]:
    """Remove the checkpoints of `run` beyond its newest `keep`, and its oldest ones while its own
    total passes `max_gb` GB (`--ckpt.max_mem`, OpenRLHF's unit; the newest always stays); returns
    the tags removed."""
    record = read_record(ckpt)
    sizes = None
    if max_gb is not None:
        sizes = tag_bytes(ckpt, [t for t, e in record["tags"].items() if isinstance(e, dict) and e.get("run") == run])
    removed = tags_to_remove(record, run, keep, sizes, float("inf") if max_gb is None else max_gb * 1024**3)
    for tag in removed:
        _remove_tag(ckpt, tag)
        del record["tags"][tag]
    if removed:
        _write(ckpt, record)
    return removed


def latest_tag(ckpt) -> str | None:
    """The newest whole checkpoint's tag (`latest`), None when there is none yet."""
    text = (_read(ckpt, LATEST) or "").strip()
    return text or None


def partial_tag(tag: str) -> str:
    """Where `tag` is written until it is whole (the same name on every rank, as DeepSpeed requires)."""
    return f".{tag}.partial"


def begin(ckpt: Path, tag: str) -> Path:
    """The empty folder to write `tag` into (a leftover of a failed attempt is removed first)."""
    partial = Path(ckpt) / partial_tag(tag)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit(ckpt: Path, tag: str, resumable: bool = True) -> None:
    """Rename the whole `partial_tag(tag)` folder to `tag`, then point `latest` at it (atomically);
    not a tag that holds no training state (`--ckpt.disable_ds`: nothing to resume from).

    An earlier `tag` (a fresh run writing a step an older run wrote) is moved aside first and
    removed only after the new one is in place; `latest` is replaced, never rewritten in place.
    """
    ckpt = Path(ckpt)
    final, old = ckpt / tag, None
    if final.exists():
        old = ckpt / f".{tag}.old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    (ckpt / partial_tag(tag)).rename(final)
    if resumable:
        write_latest(ckpt, tag)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def abandon(ckpt: Path, tag: str) -> None:
    """Remove what a failed save of `tag` wrote (its partial folder), freeing the space it took."""
    shutil.rmtree(Path(ckpt) / partial_tag(tag), ignore_errors=True)


def write_latest(ckpt, tag: str) -> None:
    _replace(ckpt, LATEST, tag)


def _write(ckpt, record: dict) -> None:
    _replace(ckpt, CHECKPOINTS, json.dumps(record, indent=2, sort_keys=True))


# -- checkpoints on S3 ------------------------------------------------------------------------------

def staging_dir(owner: str) -> Path:
    """A new empty folder on this node for `owner`'s part of a checkpoint before it is uploaded."""
    return storage.staging_folder(owner)


def begin_remote(ckpt: str, tag: str) -> None:
    """Make room for `tag` at the remote `ckpt`: what an upload of it that was cut short left goes.
    Where `latest` names `tag` (a fresh run writing a step an older run wrote), `latest` first
    falls back to the newest other recorded tag, or goes: it never names a tag being rewritten."""
    if latest_tag(ckpt) == tag:
        fs = storage._fs(_uri(ckpt))
        others = sorted((entry.get("step", -1), name) for name, entry in read_record(ckpt)["tags"].items()
                        if name != tag and isinstance(entry, dict) and fs.exists(f"{_uri(ckpt)}/{name}"))
        if others:
            write_latest(ckpt, others[-1][1])
        else:
            fs.rm_file(f"{_uri(ckpt)}/{LATEST}")
    _remove_tag(ckpt, tag)


def upload_part(local: Path, ckpt: str, tag: str) -> list[str]:
    """Upload one writer's part of `tag` (the files under `local`) and remove `local`."""
    try:
        return storage.upload_folder(local, f"{_uri(ckpt)}/{tag}")
    finally:
        shutil.rmtree(local, ignore_errors=True)


def fetch(ckpt: str, tag: str) -> Path:
    """A local folder holding the remote checkpoint `tag`: a download into this node's cache (shared
    by the ranks of the node, `storage.local_copy`)."""
    from rlhf_core.infra.settings import state_dir

    return Path(storage.local_copy(f"{_uri(ckpt)}/{tag}", state_dir() / "cache"))


def location(ckpt, tag: str) -> str:
    """Where `tag` is, as a path or URI for messages and `stage.json`."""
    return f"{_uri(ckpt)}/{tag}" if is_remote(ckpt) else str(Path(ckpt) / tag)


def rng_state() -> dict:
    """Every random stream a run draws from (Python, NumPy, torch, CUDA), for a checkpoint."""
    import random

    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
