"""Dataset specs on S3 (s3fs against a local moto server): a single `.jsonl` or `.parquet` object,
and a `json@` prefix, load like their local twins; the download cache holds each once."""

import os

import pytest

from rlhf_core.infra import storage

pytestmark = pytest.mark.integration

ROWS = b'{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n'


def test_single_object_and_prefix_dataset_specs_load_from_s3(s3_endpoint, tmp_path, monkeypatch):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.data.loading import DataError, load_mixture, resolve_source

    fsspec.config.conf.clear()
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "state"))
    storage.release_cache_pins()
    fs = fsspec.filesystem("s3")
    fs.pipe("s3://models/datasets/sft/train.jsonl", ROWS)
    fs.pipe("s3://models/datasets/sft/test.jsonl", ROWS)
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["p1", "p2", "p3"], "response": ["r1", "r2", "r3"]}), table)
    fs.put_file(str(table), "s3://models/datasets/pq/rows.parquet")

    def responses(spec, split="train"):
        ds, described = load_mixture(spec, split, None, 100, 0, ["prompt", "response"], lambda ds, where: None)
        return [r["response"] for r in ds], described

    assert responses("s3://models/datasets/sft/train.jsonl")[0] == ["b", "d"]
    got, described = responses("s3://models/datasets/pq/rows.parquet")
    assert got == ["r1", "r2", "r3"] and described[0]["path"].endswith("rows.parquet")
    assert responses("json@s3://models/datasets/sft", "test")[0] == ["b", "d"]
    mixed, _ = responses("s3://models/datasets/sft/train.jsonl,s3://models/datasets/pq/rows.parquet")
    assert set(mixed) == {"b", "d", "r1", "r2", "r3"}  # interleaved until both are exhausted
    downloads = tmp_path / "state" / "cache" / "downloads"
    assert len([p for p in downloads.iterdir() if not p.name.startswith(".")]) == 3  # each once
    local = resolve_source("s3://models/datasets/sft/train.jsonl").data_files["train"]
    assert os.path.dirname(local).startswith(str(downloads)) and open(local, "rb").read() == ROWS
    with pytest.raises(DataError, match="s3://models/datasets/sft/nope.jsonl: not found"):
        resolve_source("s3://models/datasets/sft/nope.jsonl")
    storage.release_cache_pins()
