"""Stage outputs on local disk or object storage (s3:// through s3fs, via fsspec).

A stage is finished when its `stage.json` exists, and `stage.json` is always written last
(locally the directory is built aside and renamed into place; on S3 it is uploaded after the
files), so a crash never leaves something that looks finished.

Nothing is removed that a stage did not write: `check_destination` (run by the driver before
anything trains, and again before publishing) lets a stage replace only an earlier output of the
same stage kind (its `stage.json`), an unfinished one (its `.rlhf-writing.json` marker, written
before anything else and removed after `stage.json`), or an empty folder.

A full disk (or quota) while saving raises `DiskFullError` (exit 2) naming the flag and path;
everything is written beside its place and renamed in when whole, so what was there stays as it
was (`saving`, `trainers/checkpoints.py`). Remote inputs are downloaded into a bounded cache,
`$RLHF_HOME/cache/downloads/<key>/` (`local_copy`, `cache_bounds`, `evict_cache`). S3 endpoints
and credentials come from the AWS variables, which s3fs reads itself, never our configs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from rlhf_core.infra.redaction import redact
from rlhf_core.infra.settings import ConfigError, env_number, state_dir

MANIFEST = "stage.json"
WRITING = ".rlhf-writing.json"  # "being written by stage X": a retry of X may replace what is there
CHECKPOINTS = "rlhf-checkpoints.json"  # the checkpoint tags each run wrote (rlhf_core/trainers/checkpoints.py)
_MARKS = (MANIFEST, WRITING, CHECKPOINTS)

# What a stage may write over (anything else is refused).
NEW, EMPTY, EARLIER, UNFINISHED = "new", "empty folder", "earlier output", "unfinished output"


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def normalize_uri(uri: str) -> str:
    """Absolute local path, or the remote URI without a trailing slash."""
    if is_remote(uri):
        return uri.rstrip("/")
    return str(Path(uri.removeprefix("file://")).expanduser().resolve())


def _fs(uri: str):
    import fsspec

    return fsspec.core.url_to_fs(uri)[0]


# --- where a stage may write -------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """What is at a location. `entries` are relative POSIX paths: every file below it when it holds
    an output (a `stage.json` or marker at its top), else only its top-level entries."""

    kind: str  # "missing" | "file" (anything but a folder) | "folder"
    entries: tuple[str, ...] = ()
    stage: str | None = None  # the stage its top-level stage.json names
    writing: str | None = None  # the stage its top-level marker names


@dataclass(frozen=True)
class Destination:
    uri: str  # normalized
    state: str  # NEW, EMPTY, EARLIER or UNFINISHED
    found: Found


def destination_state(found: Found, stage: str, replaces: Iterable[str] | None = None) -> str:
    """NEW, EMPTY, EARLIER or UNFINISHED when `stage` may write its output over `found`, else ConfigError.

    `replaces`: the top-level entries the stage rewrites (prep rewrites its own folders in place);
    None: the whole folder. Another output inside what would be replaced (a `stage.json`, a marker
    or a checkpoint record below the top) is refused: it is not this stage's to remove.
    """
    if found.kind == "missing":
        return NEW
    if found.kind == "file":
        raise ConfigError("is a file, not a folder")
    if found.stage is None and found.writing is None:
        if not found.entries:
            return EMPTY
        raise ConfigError(f"is a folder with other content ({_some(found.entries)}), not an output of {stage}")
    if found.stage is not None and found.stage != stage:
        raise ConfigError(f"holds the output of stage {found.stage}, not of {stage}")
    if found.writing is not None and found.writing != stage:
        raise ConfigError(f"is being written by stage {found.writing}, not by {stage}")
    scope = None if replaces is None else tuple(replaces)
    nested = [e for e in found.entries if "/" in e and e.rsplit("/", 1)[1] in _MARKS
              and (scope is None or e.split("/", 1)[0] in scope)]
    if nested:
        raise ConfigError(f"holds other outputs inside it ({_some(nested)})")
    return EARLIER if found.stage is not None else UNFINISHED


def check_destination(uri: str, stage: str, inputs: Iterable[tuple[str, str]] = (), *, flag: str = "--save_path",
                      replaces: Iterable[str] | None = None) -> Destination:
    """Whether `stage` may write its output at `uri`; ConfigError (exit 2) naming `flag` when not.

    Refused: a file; a folder that is not an output of `stage` (`destination_state`); a location
    that is or contains one of `inputs` (`(flag, location)` pairs, `stage_inputs`); an output a
    registered MLflow model version points at. Reads nothing beyond what these rules need.
    """
    target = normalize_uri(uri)
    for name, location in inputs:
        if _contains(target, normalize_uri(location)):
            raise ConfigError(f"{flag} {uri}: is or contains the input {name} {location}; a stage never writes "
                              "over what it reads")
    found = _look(target)
    try:
        state = destination_state(found, stage, replaces)
    except ConfigError as e:
        raise ConfigError(f"{flag} {uri}: {e}; nothing was written or removed (choose another location, or move "
                          "it away yourself)") from None
    if state == NEW and not is_remote(target):
        _check_parent_is_a_folder(target, flag, uri)
    if state in (EARLIER, UNFINISHED):
        versions = registered_versions(target)
        if versions:
            raise ConfigError(f"{flag} {uri}: registered model version {', '.join(versions)} points at this output "
                              "(MLflow tag rlhf.output_uri); it is kept; choose another location")
    return Destination(target, state, found)


def check_output_file(uri: str, inputs: Iterable[tuple[str, str]] = (), *, flag: str = "--output_path") -> None:
    """Whether a command may write one file at `uri` (written whole or not at all,
    `write_text_atomic`); ConfigError (exit 2) naming `flag` when not: it is or lies inside one of
    `inputs`, or holds one of them (a dataset folder), it is a folder, or (local) the folder it
    would go in is a file."""
    target = normalize_uri(uri)
    for name, location in inputs:
        location = normalize_uri(location)
        if _contains(location, target) or _contains(target, location):
            raise ConfigError(f"{flag} {uri}: is, holds or lies inside the input {name} {location}; a command never "
                              "writes over what it reads")
    if is_remote(target):
        return
    if Path(target).is_dir():
        raise ConfigError(f"{flag} {uri}: is a folder; name the file to write")
    _check_parent_is_a_folder(target, flag, uri)


def _check_parent_is_a_folder(target: str, flag: str, uri: str) -> None:
    """A local path's nearest existing ancestor must be a folder (else nothing can be written there)."""
    parent = next(p for p in Path(target).parents if p.exists())
    if not parent.is_dir():
        raise ConfigError(f"{flag} {uri}: {parent} is a file, not a folder")


def check_stage_output(cfg) -> Destination:
    """`check_destination` for a stage config: its `save_path`, its stage, its inputs."""
    return check_destination(cfg.save_path, cfg.stage, stage_inputs(cfg))


def stage_inputs(cfg) -> list[tuple[str, str]]:
    """`(flag, location)` of what a stage config reads: models, dataset files and folders, checkpoints.

    Local model and data paths that do not exist are left out (hub names); `ckpt_path` stays in
    even before its first checkpoint, so an output can never be published over it.
    """
    found = [(f"--{name}", value.strip()) for name in ("pretrain", "ref_pretrain", "reward_pretrain", "critic_pretrain")
             for value in (getattr(cfg, name, None) or "").split(",") if value.strip()]
    data = getattr(cfg, "data", cfg)
    datasets = [(name, getattr(data, name, None)) for name in ("dataset", "eval_dataset", "prompt_dataset")]
    if isinstance(getattr(cfg, "eval", None), BaseModel):  # the RL config's eval section
        datasets.append(("eval.dataset", cfg.eval.dataset))
    for name, specs in datasets:
        for spec in (specs or "").split(","):
            if spec.strip():
                found.append((f"--{name}", spec.strip().removeprefix("json@")))
    found = [(n, v) for n, v in found if is_remote(v) or Path(v.removeprefix("file://")).expanduser().exists()]
    if getattr(cfg, "ckpt_path", None):
        found.append(("--ckpt_path", cfg.ckpt_path))
    return found


def _contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _some(entries: Iterable[str], shown: int = 3) -> str:
    entries = list(entries)
    more = f", ... {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more


def _look(target: str) -> Found:
    if is_remote(target):
        return _look_remote(_fs(target), target)
    return _look_local(Path(target))


def _look_local(path: Path) -> Found:
    if not path.exists() and not path.is_symlink():
        return Found("missing")
    if not path.is_dir():
        return Found("file")
    top = sorted(p.name for p in path.iterdir())
    stage = _named_stage(path / MANIFEST) if MANIFEST in top else None
    writing = _named_stage(path / WRITING) if WRITING in top else None
    if stage is None and writing is None:
        return Found("folder", tuple(top))
    files = [(Path(root) / name).relative_to(path).as_posix() for root, _, names in os.walk(path) for name in names]
    return Found("folder", tuple(sorted(files)), stage, writing)


def _look_remote(fs, target: str) -> Found:
    fs.invalidate_cache(target)
    if fs.isfile(target):
        return Found("file")
    base = fs._strip_protocol(target).rstrip("/")
    try:
        top = sorted({_relative(base, p) for p in fs.ls(target, detail=False)} - {""})
    except FileNotFoundError:
        top = []
    if not top:  # an empty prefix holds nothing: object stores have no empty folders
        return Found("missing")
    stage = _named_stage(f"{target}/{MANIFEST}", fs) if MANIFEST in top else None
    writing = _named_stage(f"{target}/{WRITING}", fs) if WRITING in top else None
    if stage is None and writing is None:
        return Found("folder", tuple(top))
    return Found("folder", tuple(sorted(_relative(base, p) for p in fs.find(target))), stage, writing)


def _relative(base: str, path: str) -> str:
    return path.rstrip("/")[len(base):].lstrip("/") if path.startswith(base) else path


def _named_stage(path, fs=None) -> str:
    try:
        if fs is None:
            value = json.loads(Path(path).read_text()).get("stage")
        else:
            with fs.open(path) as f:
                value = json.load(f).get("stage")
    except (OSError, ValueError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else f"(unreadable {Path(str(path)).name})"


def registered_versions(uri: str) -> list[str]:
    """`name/version` of the registered MLflow model versions whose output (tag `rlhf.output_uri`) is `uri`.

    Asked only where a tracking store is configured (`MLFLOW_TRACKING_URI`, or the embedded SQLite
    store exists) and answers; otherwise, or on an error, [] with a warning: a store that is down
    must not block a run, and one never set up has no registry.
    """
    from rlhf_core.infra.settings import tracking_uri

    if not os.environ.get("MLFLOW_TRACKING_URI") and not (state_dir() / "mlflow.db").exists():
        return []
    tracking = tracking_uri()
    if tracking.startswith(("http://", "https://")) and not _reachable(tracking):
        print(f"rlhf: warning: MLflow at {tracking} does not answer; not checked whether a registered model "
              f"points at {uri}", file=sys.stderr)
        return []
    try:
        from mlflow import MlflowClient

        # A quote cannot be escaped in a filter: match it with LIKE's one-character wildcard, compare below.
        test = "LIKE" if "'" in uri else "="
        versions = MlflowClient(tracking_uri=tracking).search_model_versions(
            f"tags.`rlhf.output_uri` {test} '{uri.replace(chr(39), '_')}'", max_results=100)
    except Exception as e:  # noqa: BLE001 - any store failure: warn and go on, as above
        print(f"rlhf: warning: could not search the MLflow model registry at {tracking} ({type(e).__name__}: "
              f"{e}); not checked whether a registered model points at {uri}", file=sys.stderr)
        return []
    return sorted(f"{v.name}/{v.version}" for v in versions if v.tags.get("rlhf.output_uri") == uri)


def _reachable(url: str, timeout: float = 2.0) -> bool:
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


# --- writing outputs ---------------------------------------------------------------------------


def mark_writing(uri: str, stage: str) -> None:
    """Say that `stage` is writing its output at `uri` (first, before anything is written in place)."""
    marker = {"stage": stage, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid()}
    if is_remote(uri):
        with _fs(uri).open(f"{uri.rstrip('/')}/{WRITING}", "w") as f:
            json.dump(marker, f)
        return
    path = Path(normalize_uri(uri))
    path.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(path / WRITING, marker)


def clear_writing(uri: str) -> None:
    """Remove the marker of `mark_writing` (last, after `stage.json`)."""
    if is_remote(uri):
        try:
            _fs(uri).rm_file(f"{uri.rstrip('/')}/{WRITING}")
        except FileNotFoundError:
            pass
        return
    (Path(normalize_uri(uri)) / WRITING).unlink(missing_ok=True)


def withdraw(uri: str, stage: str) -> None:
    """Make a published output unfinished again (its record failed): the marker first, then `stage.json` goes.
    Its files stay; a retry of `stage` replaces them (`check_destination`: UNFINISHED)."""
    mark_writing(uri, stage)
    if is_remote(uri):
        try:
            _fs(uri).rm_file(f"{uri.rstrip('/')}/{MANIFEST}")
        except FileNotFoundError:
            pass
        return
    (Path(normalize_uri(uri)) / MANIFEST).unlink(missing_ok=True)


def publish_dir(local_dir: str | Path, uri: str, manifest: dict, inputs: Iterable[tuple[str, str]] = (),
                flag: str = "--save_path") -> str:
    """Move/upload a finished local directory to `uri`, then write its manifest (`stage`: whose output) last.

    Checks `uri` again (`check_destination`) and removes only the files the check found to be this
    stage's own. Locally the old folder is moved aside, checked once more where nobody else
    writes, and removed after the new one is in place.
    """
    local_dir = Path(local_dir)
    (local_dir / MANIFEST).unlink(missing_ok=True)
    inputs = list(inputs)
    manifest = redact(manifest)  # stage.json is a record: no credential in a URI, a field or from the env
    if not is_remote(uri):
        with saving(flag, uri, f"output of {manifest['stage']}", "the previous output there is as it was"):
            return _publish_local(local_dir, Path(normalize_uri(uri)), manifest, inputs, flag)
    target = normalize_uri(uri)
    if target.startswith("s3://"):  # a store that is away gets RLHF_STORE_WAIT_S, not the clients' minutes
        from rlhf_core.infra.reachability import s3_endpoint, store_wait_s, wait_until_reachable

        wait_until_reachable("S3 endpoint", s3_endpoint(), store_wait_s(), "RLHF_STORE_WAIT_S",
                             f"when the stage had to publish its output to {target}; nothing was published")
    found = check_destination(target, manifest["stage"], inputs, flag=flag).found
    fs = _fs(target)
    mark_writing(target, manifest["stage"])
    files = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    # Only what the check saw (and found ours) is removed, stage.json first; later arrivals stay.
    old = [e for e in found.entries if e not in files and e != WRITING]
    if MANIFEST in old:
        fs.rm_file(f"{target}/{MANIFEST}")
    stale = [f"{target}/{e}" for e in old if e != MANIFEST]
    if stale:
        fs.rm(stale)
    for rel, path in files.items():
        fs.put_file(str(path), f"{target}/{rel}")
    with fs.open(f"{target}/{MANIFEST}", "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    clear_writing(target)
    return target


def staging_folder(owner: str) -> Path:
    """A new empty folder on this machine (`<state dir>/staging/<owner>-*`) for files on their way to
    object storage; the caller removes it after the upload."""
    root = state_dir() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f"{owner}-"))


def upload_folder(local_dir: str | Path, uri: str) -> list[str]:
    """Upload every file under `local_dir` to `uri/<relative path>` (one PUT each, whole or not at
    all); returns the relative paths. Nothing at `uri` is removed: who decides that a set of files
    is complete (a checkpoint's `latest`) writes its marker after this returns."""
    local_dir = Path(local_dir)
    target = uri.rstrip("/")
    fs = _fs(target)
    files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    for rel in files:
        fs.put_file(str(local_dir / rel), f"{target}/{rel}")
    return files


def _publish_local(local_dir: Path, dest: Path, manifest: dict, inputs: list, flag: str) -> str:
    stage = manifest["stage"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(local_dir, staging)
        _write_json_atomic(staging / MANIFEST, manifest)
        if check_destination(str(dest), stage, inputs, flag=flag).state == NEW:
            try:
                staging.rename(dest)  # fails on anything but an empty folder that appeared since the check
            except OSError as e:
                raise ConfigError(f"{flag} {dest}: appeared while the output was being published ({e.strerror}); "
                                  "it is left as it was") from None
            return str(dest)
        trash = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        dest.rename(trash)
        try:  # what was moved aside, where nobody else writes: still ours?
            destination_state(_look_local(trash), stage)
        except ConfigError as e:
            trash.rename(dest)
            raise ConfigError(f"{flag} {dest}: changed while it was being replaced: {e}; it is left as it was") from None
        staging.rename(dest)
        shutil.rmtree(trash, ignore_errors=True)
        return str(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when renamed into place


# --- a full disk while saving ---------------------------------------------------------------------

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a full disk reads where no OSError carries its errno: copytree's gathered errors, safetensors'
# (Rust) IoError, DeepSpeed's re-raised text.
_FULL_TEXTS = (*(f"[errno {n}]" for n in DISK_FULL_ERRNOS), *(f"(os error {n})" for n in DISK_FULL_ERRNOS),
               "no space left on device", "disk quota exceeded", "storagefull", "quotaexceeded")
# torch.save's zip writer reports a short write without its errno: a full disk when the filesystem
# then has (almost) nothing left (measured before the partial files are removed).
_SHORT_WRITE_TEXTS = ("unexpected pos", "file write failed", "pytorchstreamwriter failed writing")
NEARLY_FULL_BYTES = 16 << 20


class DiskFullError(ConfigError):
    """A save ran out of disk space (ENOSPC) or quota (EDQUOT). Exit status 2, not retried: the
    partial files are removed, so a retry would fail at the same save; freeing space (or another
    location) is for a person to choose."""


def _chain(e: BaseException | None):
    """`e` and the exceptions below it: `cause` (a rank's error: RoleError, StageFailed), then
    `__cause__`/`__context__`."""
    seen = set()
    while e is not None and id(e) not in seen:
        yield e
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__


def is_disk_full(e: BaseException | None, path=None) -> bool:
    """Whether `e` (or an exception below it) says the disk or quota is full; with `path`, also a
    short write (torch.save's) while the filesystem of `path` has under NEARLY_FULL_BYTES free."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in DISK_FULL_ERRNOS:
            return True
        text = str(x).lower()
        if any(t in text for t in _FULL_TEXTS):
            return True
        if path is not None and any(t in text for t in _SHORT_WRITE_TEXTS) and _free_bytes(path) < NEARLY_FULL_BYTES:
            return True
    return False


def _free_bytes(path) -> float:
    """Free bytes on the filesystem of `path` (its nearest existing folder); inf when unknown."""
    try:
        here = Path(path)
        while not here.exists() and here != here.parent:
            here = here.parent
        return shutil.disk_usage(here).free
    except OSError:
        return float("inf")


def disk_full_error(e: BaseException, flag: str, path, what: str, kept: str) -> DiskFullError:
    """The error to raise for a full disk `e` while writing `what` at `path` (given as `flag`)."""
    chain = list(_chain(e))
    quota = any(isinstance(x, OSError) and x.errno == errno.EDQUOT or "quota" in str(x).lower() for x in chain)
    reason = "the disk quota is exceeded" if quota else "the disk is full"
    filename = next((x.filename for x in chain if isinstance(x, OSError) and x.filename), None)
    if filename is None:  # copytree: [(src, dst, "[Errno 28] ..."), ...]
        filename = next((x.args[0][0][1] for x in chain if isinstance(x, shutil.Error) and x.args
                         and isinstance(x.args[0], list) and x.args[0] and len(x.args[0][0]) == 3), None)
    where = f" ({filename})" if filename else ""
    return DiskFullError(f"{flag} {path}: {reason} (no space left) while writing the {what}{where}; {kept}. Free "
                         f"space there (see `df -h`) or choose another {flag}, then run the stage again")


@contextmanager
def saving(flag: str, path, what: str, kept: str = "the previous output is as it was", cleanup=None):
    """Turn a full disk inside the block into a `DiskFullError` naming `flag`, `path` and what is kept.

    `cleanup`: called on any failure, after the disk was looked at (the partial files it removes are
    what filled it)."""
    try:
        yield
    except BaseException as e:
        full = not isinstance(e, DiskFullError) and isinstance(e, Exception) and is_disk_full(e, path)
        if cleanup is not None:
            cleanup()
        if full:
            raise disk_full_error(e, flag, path, what, kept) from e
        raise


def write_manifest(local_dir: str | Path, manifest: dict, flag: str = "--out") -> None:
    """Write `stage.json` into a finished local directory, atomically (the last step of a stage)."""
    with saving(flag, local_dir, MANIFEST, "the output there is not marked finished"):
        _write_json_atomic(Path(local_dir) / MANIFEST, redact(manifest))


# Characters that `str.splitlines` (and JavaScript, and some JSON-lines readers) take for a line break
# but JSON leaves unescaped outside ASCII mode; a sampled text can hold any of them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_text(rows: list[dict]) -> str:
    """JSON lines, one row per line for every reader: text stays readable (not ASCII-escaped), but the
    Unicode line separators a row's text may hold are escaped."""
    return "".join(json.dumps(r, ensure_ascii=False).translate(_LINE_BREAKS) + "\n" for r in rows)


def write_text_atomic(uri: str | Path, text: str) -> None:
    """All of `text` at `uri` or nothing: locally a temporary file beside it, synced and renamed into
    place; on S3 one object put (a multipart upload for a large one), which is seen only once whole.
    The text is encoded before anything is sent: a file object's close would commit a partial write."""
    if is_remote(str(uri)):
        _fs(str(uri)).pipe_file(str(uri), text.encode("utf-8"))
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_text(uri: str) -> str | None:
    """The text of the file at `uri` (a local path or s3://), or None when there is none."""
    if not is_remote(uri):
        path = Path(normalize_uri(uri))
        return path.read_text(encoding="utf-8") if path.is_file() else None
    fs = _fs(uri)
    if not fs.exists(uri):
        return None
    with fs.open(uri, "r", encoding="utf-8") as f:
        return f.read()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone already when it replaced `path`


def read_manifest(uri: str) -> dict | None:
    """The stage manifest at `uri`, or None when the stage is not finished there."""
    if not is_remote(uri):
        path = Path(uri.removeprefix("file://")).expanduser() / MANIFEST
        return json.loads(path.read_text()) if path.exists() else None
    fs = _fs(uri)
    target = f"{uri.rstrip('/')}/{MANIFEST}"
    if not fs.exists(target):
        return None
    with fs.open(target) as f:
        return json.load(f)


def local_copy(uri: str, cache_root: str | Path, keep: Callable[[str], bool] | None = None) -> str:
    """A local path with the contents of `uri` (itself when local; else a cached download): a folder
    for a prefix, a file (under its own name) for a single object such as `s3://b/data/train.jsonl`.
    `keep`: of a prefix, download only the files whose relative paths it accepts (a tokenizer's
    files of a model folder, `tokenizer_file`).

    The cache key is the URI plus the remote listing (relative path, size, ETag or modification
    time), so a prefix rewritten in place is downloaded again, not served stale. A download is
    built aside and renamed into place with a `.complete` marker; if the listing changed during
    the fetch (a writer at work), the mixed copy is dropped and fetched again.

    Each use pins the entry for the life of this process (a shared lock on its marker) and marks
    it recently used; after each new download, unpinned entries go, least recently used first,
    until the cache is within `cache_bounds`.
    """
    if not is_remote(uri):
        return str(Path(uri.removeprefix("file://")).expanduser())
    fs = _fs(uri)
    root = uri.rstrip("/")
    downloads = Path(cache_root) / "downloads"
    single = fs.isfile(root)  # one object, not a prefix
    pick = (lambda entries: entries) if keep is None or single else (
        lambda entries: [e for e in entries if keep(e[0])])
    listing = pick(remote_listing(fs, root))
    if not listing:
        raise FileNotFoundError(f"{uri}: none of its files is what is asked for here")
    made_room = False
    for _ in range(DOWNLOAD_ATTEMPTS):
        key = hashlib.sha256(json.dumps({"uri": root, "files": listing}).encode()).hexdigest()[:16]
        dest = downloads / key
        found = dest / listing[0][0] if single else dest
        downloads.mkdir(parents=True, exist_ok=True)
        with _exclusive(Path(cache_root) / "download-locks" / key):  # one download per machine: its ranks wait
            if _pin(dest):
                return str(found)
            tmp = Path(tempfile.mkdtemp(dir=downloads, prefix=f".{key}-"))
            try:
                try:
                    if single:
                        fs.get_file(root, str(tmp / listing[0][0]))
                    elif keep is not None:
                        for rel, _, _ in listing:
                            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                            fs.get_file(f"{root}/{rel}", str(tmp / rel))
                    else:
                        fs.get(root + "/", str(tmp), recursive=True)
                except Exception as e:
                    if not is_disk_full(e, downloads):
                        raise
                    shutil.rmtree(tmp, ignore_errors=True)
                    if not made_room:  # the cache itself may be what filled the disk: every unused entry goes
                        made_room = True
                        if evict_cache(cache_root, everything=True):
                            continue
                    raise DiskFullError(f"{uri}: the disk is full (no space left) while downloading it into the cache "
                                        f"{downloads}; no entry of the cache that a running stage uses is left to remove. "
                                        "Free space there (see `df -h`), or set RLHF_HOME to a larger disk") from e
                after = pick(remote_listing(fs, root))
                if after != listing:  # rewritten while we fetched it: what we hold may mix both versions
                    listing = after
                    continue
                (tmp / COMPLETE).touch()
                try:
                    tmp.rename(dest)
                except OSError:  # another rank finished the same download first
                    pass
                if not _pin(dest):  # evicted in the instant since: fetch it again
                    continue
                evict_cache(cache_root, keep=(dest,))
                return str(found)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed into place
    raise RuntimeError(f"{uri} changed during each of {DOWNLOAD_ATTEMPTS} downloads; is a writer still at work?")


DOWNLOAD_ATTEMPTS = 3
COMPLETE = ".complete"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".onnx")


def tokenizer_file(rel: str) -> bool:
    """Whether a model folder's file (its path relative to the folder) is one its tokenizer may read:
    at the top level, holding no weights."""
    return "/" not in rel and not rel.endswith(_WEIGHT_SUFFIXES)


@contextmanager
def _exclusive(lock_file: Path):
    """An exclusive lock on `lock_file` (created if missing) for the block: the processes of one
    machine take turns."""
    import fcntl

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
# Per-file version fields, first one present wins: content ETag (S3), else a modification time.
_VERSION_FIELDS = ("ETag", "etag", "LastModified", "last_modified", "mtime", "created")


def remote_listing(fs, root: str) -> list[list]:
    """`[relative path, size, version]` for every file under `root`, sorted; FileNotFoundError when none.
    For a single object `root`, one entry named by its base name.

    Always a fresh listing (fsspec filesystems may cache directory listings for the life of a process).
    """
    fs.invalidate_cache(root)
    base = fs._strip_protocol(root).rstrip("/")
    if fs.isfile(root):
        found = {base: fs.info(root)}
    else:
        found = fs.find(root, detail=True)
    entries = []
    for name, info in found.items():
        if info.get("type", "file") == "directory":
            continue
        rel = name[len(base):].lstrip("/") if name.startswith(base) else name
        version = next((str(info[k]) for k in _VERSION_FIELDS if info.get(k) is not None), None)
        entries.append([rel or base.rsplit("/", 1)[-1], info.get("size"), version])
    if not entries:
        raise FileNotFoundError(f"{root}: no such file or folder, or an empty folder")
    return sorted(entries)


# --- the bound on the download cache -------------------------------------------------------------

CACHE_MAX_GB_ENV, CACHE_MAX_AGE_DAYS_ENV = "RLHF_CACHE_MAX_GB", "RLHF_CACHE_MAX_AGE_DAYS"
DEFAULT_CACHE_MAX_GB, DEFAULT_CACHE_MAX_AGE_DAYS = 50.0, 30.0
LEFTOVER_AGE_S = 24 * 3600  # a temporary download folder untouched this long was left by a crash
_PINS: dict[str, int] = {}  # cache entry -> the descriptor of its marker that holds our shared lock


def cache_bounds() -> tuple[float | None, float | None]:
    """(max bytes, max seconds since last use) of the download cache; None: no such bound.

    `RLHF_CACHE_MAX_GB` (default 50) and `RLHF_CACHE_MAX_AGE_DAYS` (default 30); 0 turns a bound off.
    Read where the download happens (each node bounds its own cache)."""
    bounds = []
    for name, default, unit in ((CACHE_MAX_GB_ENV, DEFAULT_CACHE_MAX_GB, 1e9),
                                (CACHE_MAX_AGE_DAYS_ENV, DEFAULT_CACHE_MAX_AGE_DAYS, 86400.0)):
        value = env_number(name, default, allow_zero=True)  # 0: no bound
        bounds.append(value * unit if value > 0 else None)
    return bounds[0], bounds[1]


def _pin(dest: Path) -> bool:
    """Mark the complete cache entry `dest` used now and pin it for this process; False when there is
    none (never downloaded, or evicted)."""
    import fcntl

    marker = dest / COMPLETE
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction of this entry holds it
        if os.stat(marker).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(marker)
        os.utime(marker)  # last used: now
    except FileNotFoundError:  # evicted meanwhile (and maybe fetched again since): not this one
        os.close(fd)
        return False
    if str(dest) in _PINS:
        os.close(fd)
    else:
        _PINS[str(dest)] = fd
    return True


def release_cache_pins() -> None:
    """Unpin every cache entry this process used (done at exit anyway; for a process that outlives
    its stage, so its entries can be evicted)."""
    while _PINS:
        os.close(_PINS.popitem()[1])


def tree_bytes(path: Path) -> int:
    """The size of a file, or of every file under a folder (links not followed)."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def evict_cache(cache_root: str | Path, keep: Iterable[Path] = (), everything: bool = False) -> list[str]:
    """Remove download-cache entries beyond `cache_bounds`, least recently used first, never one a
    process has pinned or one in `keep`; returns the keys removed. `everything`: every entry that
    may go (a download found the disk full). An entry is renamed away under an exclusive lock of
    its marker (no reader sees it half removed), then deleted; leftovers of crashed downloads go
    after a day."""
    import fcntl

    max_bytes, max_age = cache_bounds()
    downloads = Path(cache_root) / "downloads"
    if not downloads.is_dir():
        return []
    now = time.time()
    keep = {str(k) for k in keep}
    entries = []
    for d in downloads.iterdir():
        if d.name.startswith("."):
            if d.is_dir() and now - newest_mtime(d) > LEFTOVER_AGE_S:
                shutil.rmtree(d, ignore_errors=True)
            continue
        try:
            entries.append((os.stat(d / COMPLETE).st_mtime, tree_bytes(d), d))
        except FileNotFoundError:
            continue
    total = sum(size for _, size, _ in entries)
    removed = []
    for last_used, size, d in sorted(entries, key=lambda e: e[0]):
        too_old = max_age is not None and now - last_used > max_age
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big or everything) or str(d) in keep:
            continue
        try:
            fd = os.open(d / COMPLETE, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # pinned: a running stage reads it
                continue
            trash = downloads / f".evict-{d.name}-{uuid.uuid4().hex[:8]}"
            try:
                d.rename(trash)
            except OSError:  # removed by another process's eviction since we listed it
                continue
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        total -= size
        removed.append(d.name)
    if max_bytes is not None and total > max_bytes:
        print(f"rlhf: warning: the download cache {downloads} holds {total / 1e9:.2f} GB, over its bound "
              f"{CACHE_MAX_GB_ENV}={max_bytes / 1e9:g}; the rest is in use by running stages", file=sys.stderr)
    return removed


def newest_mtime(path: Path) -> float:
    """The newest modification time of a path and of everything under it (links not followed)."""
    newest = path.lstat().st_mtime
    for root, dirs, names in os.walk(path):
        for name in dirs + names:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest
