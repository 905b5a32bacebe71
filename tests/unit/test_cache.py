"""orchestration/cache.py: cache keys and dataset digests."""

from __future__ import annotations

from orchestration.cache import cache_key, dataset_digest


def test_cache_key_moves_with_every_input_and_nothing_else():
    base = dict(stage="sft", config_hash="sha256:a", upstream={"model": "k1"}, datasets={"d": "x"}, code_version="1")
    key = cache_key(**base)
    assert cache_key(**base) == key
    for change in ({"config_hash": "sha256:b"}, {"upstream": {"model": "k2"}}, {"datasets": {"d": "y"}},
                   {"code_version": "2"}, {"stage": "rm"}):
        assert cache_key(**{**base, **change}) != key, change


def test_dataset_digest_is_content_based(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    first = dataset_digest(f"json@{d}")
    assert dataset_digest(f"json@{d}") == first
    (d / "train.jsonl").write_text('{"prompt": "a", "response": "c"}\n')
    assert dataset_digest(f"json@{d}") != first
    assert dataset_digest("org/name") == {"org/name": "hub:org/name"}
    assert dataset_digest(None) == {}
