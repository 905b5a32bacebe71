"""`storage.local_copy` of remote folders, against an in-memory fsspec filesystem that lists like S3
(a content ETag per object) under its own protocol, so `storage.is_remote`/`storage._fs` treat it as
object storage with no server. The same paths against s3fs and a moto server: tests/integration."""

from __future__ import annotations

import hashlib

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from rlhf_core import storage

PROTOCOL = "rlhftest-s3"


class FakeS3(MemoryFileSystem):
    """A memory filesystem of its own (not the shared `memory://` store) whose listings carry an ETag."""

    protocol = PROTOCOL
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix(f"{PROTOCOL}://"))

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        if detail:
            for name, info in found.items():
                if info["type"] == "file":
                    info["ETag"] = hashlib.md5(self.cat_file(name)).hexdigest()
        return found


@pytest.fixture
def remote(monkeypatch):
    fsspec.register_implementation(PROTOCOL, FakeS3, clobber=True)
    FakeS3.store.clear()
    FakeS3.pseudo_dirs[:] = [""]
    fs = FakeS3()
    downloads = []
    real_get = FakeS3.get

    def counting_get(self, *args, **kwargs):
        downloads.append(args[0])
        return real_get(self, *args, **kwargs)

    monkeypatch.setattr(FakeS3, "get", counting_get)
    yield fs, downloads
    FakeS3.store.clear()
    FakeS3.clear_instance_cache()


def read(folder, name) -> bytes:
    with open(f"{folder}/{name}", "rb") as f:
        return f.read()


def test_a_rewritten_data_folder_is_downloaded_again(remote, tmp_path):
    fs, downloads = remote
    uri = f"{PROTOCOL}://bucket/run/data/sft"  # a data folder: no stage.json
    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "response": "b"}\n')
    fs.pipe(f"{uri}/test.jsonl", b'{"prompt": "c", "response": "d"}\n')
    assert storage.is_remote(uri) and storage.read_manifest(uri) is None
    first = storage.local_copy(uri, tmp_path)
    assert read(first, "train.jsonl") == b'{"prompt": "a", "response": "b"}\n'
    assert storage.local_copy(uri, tmp_path) == first and len(downloads) == 1  # unchanged: cached

    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "response": "X"}\n')  # same size, new content
    second = storage.local_copy(uri, tmp_path)
    assert second != first and len(downloads) == 2
    assert read(second, "train.jsonl") == b'{"prompt": "a", "response": "X"}\n'
    assert storage.local_copy(uri, tmp_path) == second and len(downloads) == 2

    fs.pipe(f"{uri}/extra/more.jsonl", b"{}\n")  # a file added
    third = storage.local_copy(uri, tmp_path)
    assert third not in (first, second) and read(third, "extra/more.jsonl") == b"{}\n"
    fs.rm(f"{uri}/extra/more.jsonl")  # and removed again: back to the second copy
    assert storage.local_copy(uri, tmp_path) == second and len(downloads) == 3
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == sorted(
        p.rsplit("/", 1)[1] for p in (first, second, third))  # no temporary folders left behind


def test_dataset_digest_follows_a_rewritten_remote_folder(remote, tmp_path, monkeypatch):
    from tasks.cache import dataset_digest

    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "state"))
    fs, _ = remote
    uri = f"{PROTOCOL}://bucket/run/data/preference"
    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    before = dataset_digest(f"json@{uri}")
    assert dataset_digest(f"json@{uri}") == before
    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "chosen": "c", "rejected": "b"}\n')
    assert dataset_digest(f"json@{uri}") != before


def test_a_folder_rewritten_during_the_download_is_fetched_again(remote, tmp_path, monkeypatch):
    fs, downloads = remote
    uri = f"{PROTOCOL}://bucket/run/sft"
    fs.pipe(f"{uri}/weights.bin", b"old")
    real_get = MemoryFileSystem.get

    def get_then_rewrite(self, *args, **kwargs):
        real_get(self, *args, **kwargs)
        if len(downloads) == 0:
            fs.pipe(f"{uri}/weights.bin", b"new")  # a writer replaces the file under the first download
        downloads.append(args[0])

    monkeypatch.setattr(FakeS3, "get", get_then_rewrite)
    local = storage.local_copy(uri, tmp_path)
    assert read(local, "weights.bin") == b"new" and len(downloads) == 2
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == [local.rsplit("/", 1)[1]]


def test_a_missing_folder_is_not_found(remote, tmp_path):
    with pytest.raises(FileNotFoundError):
        storage.local_copy(f"{PROTOCOL}://bucket/nothing/here", tmp_path)
    assert not (tmp_path / "downloads").exists()
