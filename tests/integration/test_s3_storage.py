"""Stage outputs on S3 through s3fs, against a local moto S3 server on 127.0.0.1."""

import json
import os

import pytest

from rlhf_core.infra import storage

pytestmark = pytest.mark.integration


def test_publish_and_download_round_trip(s3_endpoint, tmp_path):
    import fsspec

    fsspec.config.conf.clear()
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(b"\x00\x01" * 1000)
    (src / "sub" / "tok.json").write_text("{}")
    uri = "s3://models/run1/sft"
    assert storage.read_manifest(uri) is None
    storage.publish_dir(src, uri, {"stage": "sft", "metrics": {"loss": 1.0}})
    assert storage.read_manifest(uri)["stage"] == "sft"
    local = storage.local_copy(uri, tmp_path / "cache")
    assert (tmp_path / "cache" / "downloads").exists()
    assert open(os.path.join(local, "weights.bin"), "rb").read() == b"\x00\x01" * 1000
    assert json.load(open(os.path.join(local, "sub", "tok.json"))) == {}
    assert storage.local_copy(uri, tmp_path / "cache") == local  # cached


def test_a_rewritten_data_prefix_is_downloaded_again(s3_endpoint, tmp_path):
    import fsspec

    fsspec.config.conf.clear()
    fs = fsspec.filesystem("s3")
    uri = "s3://models/run3/data/sft"  # a data folder: no stage.json
    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "response": "b"}\n')
    first = storage.local_copy(uri, tmp_path / "cache")
    assert storage.local_copy(uri, tmp_path / "cache") == first
    fs.pipe(f"{uri}/train.jsonl", b'{"prompt": "a", "response": "X"}\n')  # same size, new content
    second = storage.local_copy(uri, tmp_path / "cache")
    assert second != first
    assert open(os.path.join(second, "train.jsonl"), "rb").read() == b'{"prompt": "a", "response": "X"}\n'


def test_trained_stage_saves_to_s3_and_next_stage_reads_it(s3_endpoint, prepared, tmp_path):
    from rlhf_core.config import SFTConfig, build_config
    from rlhf_core.distributed.cluster import prepare_environment
    from rlhf_core.trainers import run_recipe

    prepare_environment()
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": "s3://models/run2/sft",
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 16,
              "learning_rate": 1e-3, "max_steps": 1, "use_mlflow": False, "max_eval_samples": 16}
    manifest = run_recipe(build_config(SFTConfig, None, values))
    assert manifest["output_uri"] == "s3://models/run2/sft"
    assert storage.read_manifest("s3://models/run2/sft")["config_hash"] == manifest["config_hash"]
    follow = run_recipe(build_config(SFTConfig, None, {**values, "pretrain": "s3://models/run2/sft",
                                                       "save_path": str(tmp_path / "sft2")}))
    assert follow["inputs"]["pretrain"] == "s3://models/run2/sft"


def test_an_output_replaces_only_its_own_earlier_files_on_s3(s3_endpoint, tmp_path):
    """s3fs's own listing (prefixes, no folders): old shards of the earlier output go, other objects stay."""
    import fsspec

    from rlhf_core.infra.settings import ConfigError

    fsspec.config.conf.clear()
    fs = fsspec.filesystem("s3")
    uri = "s3://models/run4/sft"
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "stage.json"):
        fs.pipe(f"{uri}/{name}", b'{"stage": "sft"}' if name == "stage.json" else b"old")
    fs.pipe("s3://models/run4/notes/readme.txt", b"keep")
    fs.pipe("s3://models/run4/object", b"keep")
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"new")
    storage.publish_dir(src, uri, {"stage": "sft"})
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(uri)) == ["model.safetensors", "stage.json"]
    for foreign, stage in (("s3://models/run4/notes", "sft"), ("s3://models/run4/object", "sft"), (uri, "dpo"),
                           ("s3://models/run4", "sft")):
        with pytest.raises(ConfigError):
            storage.publish_dir(src, foreign, {"stage": stage})
    fs.invalidate_cache()
    assert fs.cat("s3://models/run4/notes/readme.txt") == b"keep" and fs.cat("s3://models/run4/object") == b"keep"
    assert storage.read_manifest(uri) == {"stage": "sft"}


def test_batch_inference_writes_its_output_path_on_s3_whole_or_not_at_all(s3_endpoint, prepared, capsys):
    """`rlhf batch_inference --output_path s3://...` (OpenRLHF's flag; a single file): generation's rows
    land in one object, scoring reads them back from S3 as its dataset, and a run that fails (no
    prompt reaches `--min_reward`) leaves no object behind."""
    import fsspec

    from rlhf_core.cli import main

    fsspec.config.conf.clear()
    fs = fsspec.filesystem("s3")
    generated, best, none = "s3://models/bi/gen.jsonl", "s3://models/bi/rs.jsonl", "s3://models/bi/none.jsonl"
    common = ["--use_mlflow", "false", "--seed", "0"]
    assert main(["batch_inference", "--eval_task", "generate", "--pretrain", prepared["base"], "--dataset",
                 f"json@{prepared['prompts']}", "--input_key", "prompt", "--apply_chat_template", "--best_of_n", "2",
                 "--max_new_tokens", "4", "--max_samples", "6", "--output_path", generated, *common]) == 0
    rows = [json.loads(line) for line in storage.read_text(generated).splitlines()]
    assert len(rows) == 12 and all({"input", "output", "answer"} <= set(r) for r in rows)
    capsys.readouterr()
    assert main(["batch_inference", "--eval_task", "rm", "--task", "addition", "--dataset", generated,
                 "--post_processor", "rs", "--output_path", best, *common]) == 0
    kept = [json.loads(line) for line in storage.read_text(best).splitlines()]
    assert json.loads(capsys.readouterr().out)["batch_inference/rows"] == 12
    assert len(kept) == 6 and {r["input"] for r in kept} == {r["input"] for r in rows}
    # The random base model answers none right: a verifier's reward of 1 is reached by no prompt.
    assert main(["batch_inference", "--eval_task", "rm", "--task", "addition", "--dataset", generated,
                 "--post_processor", "rs", "--min_reward", "1", "--output_path", none, *common]) != 0
    assert "no prompt's best reached --min_reward 1" in capsys.readouterr().err
    fs.invalidate_cache()
    assert not fs.exists(none) and storage.read_text(none) is None


def test_an_s3_text_file_that_fails_while_being_written_leaves_nothing(s3_endpoint):
    """`write_text_atomic` on S3: text that cannot be encoded fails before anything is sent (through
    a file object, the close after the failed write would have put a partial object)."""
    import fsspec

    fsspec.config.conf.clear()
    uri = "s3://models/atomic/rows.jsonl"
    with pytest.raises(UnicodeEncodeError):
        storage.write_text_atomic(uri, '{"ok": 1}\n' * 1000 + "\ud800")
    fsspec.filesystem("s3").invalidate_cache()
    assert storage.read_text(uri) is None
    storage.write_text_atomic(uri, '{"ok": 1}\n')
    assert storage.read_text(uri) == '{"ok": 1}\n'
