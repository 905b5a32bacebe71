"""The object-store download cache (`storage.local_copy`): single-object dataset specs, and the
bound on its size and age (least recently used first, never what a running stage reads).

Object storage is test_storage.py's in-memory filesystem that lists like S3; the same against s3fs
and a moto server: tests/integration/test_s3_storage.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlhf_core.infra import storage
from rlhf_core.infra.settings import ConfigError
from tests.unit.test_storage import PROTOCOL, remote  # noqa: F401 - the fixture

ROWS = b'{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n'


@pytest.fixture(autouse=True)
def unpinned():
    storage.release_cache_pins()
    yield
    storage.release_cache_pins()


def entries(cache) -> list[str]:
    return sorted(p.name for p in (cache / "downloads").iterdir() if not p.name.startswith("."))


def test_a_single_object_is_downloaded_as_a_file_and_follows_rewrites(remote, tmp_path):  # noqa: F811
    fs, downloads = remote
    uri = f"{PROTOCOL}://bucket/data/train.jsonl"
    fs.pipe(uri, ROWS)
    fs.pipe(f"{PROTOCOL}://bucket/data/other.jsonl", b"{}\n")  # a sibling: not part of it
    local = storage.local_copy(uri, tmp_path)
    assert os.path.basename(local) == "train.jsonl" and open(local, "rb").read() == ROWS
    assert sorted(os.listdir(os.path.dirname(local))) == [".complete", "train.jsonl"]
    assert storage.local_copy(uri, tmp_path) == local and len(downloads) == 0  # cached (get_file, not get)
    fs.pipe(uri, ROWS.replace(b'"b"', b'"X"'))  # same size, new content
    again = storage.local_copy(uri, tmp_path)
    assert again != local and b'"X"' in open(again, "rb").read()
    with pytest.raises(FileNotFoundError):
        storage.local_copy(f"{PROTOCOL}://bucket/data/missing.jsonl", tmp_path)


def test_single_object_dataset_specs_load(remote, tmp_path, monkeypatch):  # noqa: F811
    """`--dataset <object store>/train.jsonl` and `.parquet` load as their 'train' split; a `json@`
    prefix as before; a missing object is a DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.data.loading import DataError, load_mixture, resolve_source

    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "state"))
    fs, _ = remote
    fs.pipe(f"{PROTOCOL}://bucket/d/train.jsonl", ROWS)
    fs.pipe(f"{PROTOCOL}://bucket/d/test.jsonl", ROWS)
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["p1", "p2", "p3"], "response": ["r1", "r2", "r3"]}), table)
    fs.pipe(f"{PROTOCOL}://bucket/p/rows.parquet", table.read_bytes())

    def rows(spec):
        ds, described = load_mixture(spec, "train", None, 100, 0, ["prompt", "response"], lambda ds, where: None)
        return [r["response"] for r in ds], described

    assert rows(f"{PROTOCOL}://bucket/d/train.jsonl")[0] == ["b", "d"]
    parquet, described = rows(f"{PROTOCOL}://bucket/p/rows.parquet")
    assert parquet == ["r1", "r2", "r3"] and described[0]["digest"].startswith("sha256:")
    assert rows(f"json@{PROTOCOL}://bucket/d")[0] == ["b", "d"]
    assert resolve_source(f"{PROTOCOL}://bucket/d/train.jsonl").single_file
    with pytest.raises(DataError, match="missing.jsonl: not found"):
        resolve_source(f"{PROTOCOL}://bucket/d/missing.jsonl")


def folder(fs, name: str, size: int = 1000) -> str:
    uri = f"{PROTOCOL}://bucket/{name}"
    fs.pipe(f"{uri}/blob.bin", name.encode() * (size // len(name)))
    return uri


def test_the_least_recently_used_entries_go_when_the_cache_is_over_its_size(remote, tmp_path, monkeypatch):  # noqa: F811
    fs, _ = remote
    monkeypatch.setenv(storage.CACHE_MAX_GB_ENV, str(2500 / 1e9))  # room for two 1000-byte entries
    a, b, c = (folder(fs, n) for n in ("aaaa", "bbbb", "cccc"))
    first = storage.local_copy(a, tmp_path)
    second = storage.local_copy(b, tmp_path)
    storage.release_cache_pins()  # the stages that read them are over
    time.sleep(0.01)
    assert storage.local_copy(a, tmp_path) == first  # a used again: b is now the least recent
    storage.release_cache_pins()
    third = storage.local_copy(c, tmp_path)
    assert entries(tmp_path) == sorted(os.path.basename(p) for p in (first, third))
    assert not os.path.exists(second)
    assert storage.local_copy(b, tmp_path) == second and os.path.exists(second)  # fetched again when needed


def test_an_entry_a_running_stage_reads_is_never_evicted(remote, tmp_path, monkeypatch, capsys):  # noqa: F811
    fs, _ = remote
    monkeypatch.setenv(storage.CACHE_MAX_GB_ENV, str(500 / 1e9))  # smaller than any one entry
    first = storage.local_copy(folder(fs, "aaaa"), tmp_path)
    second = storage.local_copy(folder(fs, "bbbb"), tmp_path)  # this process still reads the first
    assert os.path.exists(first) and os.path.exists(second)
    assert "over its bound" in capsys.readouterr().err
    storage.release_cache_pins()

    # Another process reading the first entry (a rank of a stage): its shared lock keeps it.
    reader = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH); print('reading', flush=True); "
                               "time.sleep(120)", os.path.join(first, storage.COMPLETE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        assert storage.evict_cache(tmp_path) == [os.path.basename(second)]
        assert os.path.exists(first) and not os.path.exists(second)
    finally:
        reader.kill()
        reader.wait()
    assert storage.evict_cache(tmp_path) == [os.path.basename(first)]  # read no longer: it goes
    assert entries(tmp_path) == []


def test_entries_unused_longer_than_the_age_bound_go(remote, tmp_path, monkeypatch):  # noqa: F811
    fs, _ = remote
    monkeypatch.setenv(storage.CACHE_MAX_AGE_DAYS_ENV, "1")
    old = storage.local_copy(folder(fs, "aaaa"), tmp_path)
    recent = storage.local_copy(folder(fs, "bbbb"), tmp_path)
    storage.release_cache_pins()
    two_days_ago = time.time() - 2 * 86400
    os.utime(os.path.join(old, storage.COMPLETE), (two_days_ago, two_days_ago))
    leftover = tmp_path / "downloads" / ".0123456789abcdef-crashed"  # a crashed download's temporary folder
    leftover.mkdir()
    (leftover / "part").write_bytes(b"x")
    os.utime(leftover / "part", (two_days_ago, two_days_ago))
    os.utime(leftover, (two_days_ago, two_days_ago))
    assert storage.evict_cache(tmp_path) == [os.path.basename(old)]
    assert entries(tmp_path) == [os.path.basename(recent)] and not leftover.exists()


def test_cache_bounds_have_defaults_and_refuse_bad_values(monkeypatch):
    monkeypatch.delenv(storage.CACHE_MAX_GB_ENV, raising=False)
    monkeypatch.delenv(storage.CACHE_MAX_AGE_DAYS_ENV, raising=False)
    assert storage.cache_bounds() == (50e9, 30 * 86400)
    monkeypatch.setenv(storage.CACHE_MAX_GB_ENV, "0")  # no size bound
    assert storage.cache_bounds() == (None, 30 * 86400)
    for bad in ("-1", "lots", "nan", "inf"):
        monkeypatch.setenv(storage.CACHE_MAX_AGE_DAYS_ENV, bad)
        with pytest.raises(ConfigError, match=f"{storage.CACHE_MAX_AGE_DAYS_ENV}='{bad}': must be a number >= 0"):
            storage.cache_bounds()


def test_a_download_that_fills_the_disk_first_empties_the_unused_cache(remote, tmp_path, monkeypatch):  # noqa: F811
    import errno

    from tests.unit.test_storage import FakeS3

    fs, _ = remote
    old = storage.local_copy(folder(fs, "aaaa"), tmp_path)
    storage.release_cache_pins()  # unused now
    kept = storage.local_copy(folder(fs, "bbbb"), tmp_path)  # still read by this process
    real_get_file = FakeS3.get_file
    failures = []

    def get_file(self, rpath, lpath, *args, **kwargs):
        if os.path.exists(old) or failures == ["again"]:  # full until the unused entry is gone
            failures.append("full")
            raise OSError(errno.ENOSPC, "No space left on device", lpath)
        return real_get_file(self, rpath, lpath, *args, **kwargs)

    monkeypatch.setattr(FakeS3, "get_file", get_file)
    uri = f"{PROTOCOL}://bucket/one/train.jsonl"
    fs.pipe(uri, ROWS)
    local = storage.local_copy(uri, tmp_path)
    assert open(local, "rb").read() == ROWS and failures == ["full"]
    assert not os.path.exists(old) and os.path.exists(kept)

    failures[:] = ["again"]  # full with nothing left to remove (both entries are in use): a clear error
    fs.pipe(f"{PROTOCOL}://bucket/two/train.jsonl", ROWS)
    with pytest.raises(storage.DiskFullError, match=r"two/train.jsonl: the disk is full .* into the cache .*"
                                                    r"set RLHF_HOME to a larger disk"):
        storage.local_copy(f"{PROTOCOL}://bucket/two/train.jsonl", tmp_path)
    assert os.path.exists(kept) and os.path.exists(local)
    assert [p.name for p in (tmp_path / "downloads").iterdir() if p.name.startswith(".")] == []


def test_the_ranks_of_one_machine_download_a_prefix_once(remote, tmp_path, monkeypatch):  # noqa: F811
    """Ranks of one node asking for the same model at once take turns on a per-entry lock: one
    downloads, the others find its copy (without the lock each fetched its own)."""
    import threading

    from tests.unit.test_storage import FakeS3

    fs, downloads = remote
    uri = f"{PROTOCOL}://bucket/models/sft"
    fs.pipe(f"{uri}/model.safetensors", b"w" * 1000)
    fs.pipe(f"{uri}/config.json", b"{}")
    slow_get = FakeS3.get

    def slow(self, *args, **kwargs):  # a download long enough for the other ranks to arrive meanwhile
        time.sleep(0.3)
        return slow_get(self, *args, **kwargs)

    monkeypatch.setattr(FakeS3, "get", slow)
    got = []
    ranks = [threading.Thread(target=lambda: got.append(storage.local_copy(uri, tmp_path))) for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert len(downloads) == 1 and len(set(got)) == 1 and os.path.isfile(os.path.join(got[0], "config.json"))
