"""Stage outputs on local disk or object storage (s3:// through s3fs, via fsspec).

A stage is finished when its `stage.json` exists, and `stage.json` is always written last:
locally the whole directory is built under a temporary name and renamed into place; on S3 the
files are uploaded first and the manifest after them (an older manifest is removed before the
upload starts). So a crash never leaves something that looks like a finished stage.

S3 endpoints and credentials come from the usual AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, ...), which s3fs reads itself; they never pass through our configs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

MANIFEST = "stage.json"


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


def publish_dir(local_dir: str | Path, uri: str, manifest: dict) -> str:
    """Move/upload a finished local directory to `uri`, then write its manifest last."""
    local_dir = Path(local_dir)
    (local_dir / MANIFEST).unlink(missing_ok=True)
    if not is_remote(uri):
        dest = Path(uri.removeprefix("file://")).expanduser().resolve()
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        shutil.copytree(local_dir, staging)
        _write_json_atomic(staging / MANIFEST, manifest)
        if dest.exists():
            trash = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
            dest.rename(trash)
            staging.rename(dest)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staging.rename(dest)
        return str(dest)
    fs = _fs(uri)
    target = uri.rstrip("/")
    if fs.exists(f"{target}/{MANIFEST}"):
        fs.rm(f"{target}/{MANIFEST}")
    for path in sorted(local_dir.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{target}/{path.relative_to(local_dir).as_posix()}")
    with fs.open(f"{target}/{MANIFEST}", "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return target


def write_manifest(local_dir: str | Path, manifest: dict) -> None:
    """Write `stage.json` into a finished local directory, atomically (the last step of a stage)."""
    _write_json_atomic(Path(local_dir) / MANIFEST, manifest)


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


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


def local_copy(uri: str, cache_root: str | Path) -> str:
    """A local directory with the contents of `uri` (itself when local; else a cached download).

    The cache key is the URI plus the remote listing of everything under it (relative path,
    size, ETag or modification time), so a prefix rewritten in place, e.g. a data folder with
    no `stage.json`, is downloaded again instead of served stale. A download is built under a
    temporary name and renamed into place with a `.complete` marker; when the listing changes
    while files are being fetched (a writer is at work), the mixed copy is dropped and fetched again.
    """
    if not is_remote(uri):
        return str(Path(uri.removeprefix("file://")).expanduser())
    fs = _fs(uri)
    root = uri.rstrip("/")
    downloads = Path(cache_root) / "downloads"
    listing = remote_listing(fs, root)
    for _ in range(DOWNLOAD_ATTEMPTS):
        key = hashlib.sha256(json.dumps({"uri": root, "files": listing}).encode()).hexdigest()[:16]
        dest = downloads / key
        if (dest / ".complete").exists():
            return str(dest)
        downloads.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=downloads, prefix=f".{key}-"))
        try:
            fs.get(root + "/", str(tmp), recursive=True)
            after = remote_listing(fs, root)
            if after != listing:  # rewritten while we fetched it: what we hold may mix both versions
                listing = after
                continue
            (tmp / ".complete").touch()
            try:
                tmp.rename(dest)
            except OSError:  # another rank finished the same download first
                pass
            return str(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed into place
    raise RuntimeError(f"{uri} changed during each of {DOWNLOAD_ATTEMPTS} downloads; is a writer still at work?")


DOWNLOAD_ATTEMPTS = 3
# Per-file version fields, first one present wins: content ETag (S3), else a modification time.
_VERSION_FIELDS = ("ETag", "etag", "LastModified", "last_modified", "mtime", "created")


def remote_listing(fs, root: str) -> list[list]:
    """`[relative path, size, version]` for every file under `root`, sorted; FileNotFoundError when none.

    Always a fresh listing (fsspec filesystems may cache directory listings for the life of a process).
    """
    fs.invalidate_cache(root)
    base = fs._strip_protocol(root).rstrip("/")
    entries = []
    for name, info in fs.find(root, detail=True).items():
        if info.get("type", "file") == "directory":
            continue
        rel = name[len(base):].lstrip("/") if name.startswith(base) else name
        version = next((str(info[k]) for k in _VERSION_FIELDS if info.get(k) is not None), None)
        entries.append([rel, info.get("size"), version])
    if not entries:
        raise FileNotFoundError(f"{root}: no such folder, or an empty one")
    return sorted(entries)
