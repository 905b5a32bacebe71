"""Stage outputs: where a stage may write (`check_destination`, `publish_dir`), and `local_copy`.

Object storage here is an in-memory fsspec filesystem that lists like S3 (a content ETag per
object) under its own protocol, so `storage.is_remote`/`storage._fs` treat it as object storage
with no server. The same paths against s3fs and a moto server: tests/integration."""

from __future__ import annotations

import hashlib
import json
import re
import socket
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from rlhf_core.config import SFTConfig
from rlhf_core.infra import storage
from rlhf_core.infra.settings import ConfigError

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


def test_a_tokenizer_copy_of_a_model_folder_leaves_its_weights_behind(remote, tmp_path):
    """What reads only a tokenizer (the verifier's prompt formatter in batch inference) fetches the
    folder's top-level files without the weights, cached by those files alone."""
    fs, _ = remote
    uri = f"{PROTOCOL}://bucket/run/models/sft"
    for name, body in (("tokenizer.json", b"{}"), ("tokenizer_config.json", b'{"a": 1}'), ("config.json", b"{}"),
                       ("chat_template.jinja", b"{{ x }}"), ("model.safetensors", b"W" * 64),
                       ("pytorch_model.bin", b"B" * 64), ("checkpoints/step-1/optim.pt", b"O")):
        fs.pipe(f"{uri}/{name}", body)
    first = storage.local_copy(uri, tmp_path, keep=storage.tokenizer_file)
    got = sorted(p.name for p in Path(first).iterdir() if not p.name.startswith("."))
    assert got == ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]
    fs.pipe(f"{uri}/model.safetensors", b"V" * 64)  # new weights: the tokenizer's copy still holds
    assert storage.local_copy(uri, tmp_path, keep=storage.tokenizer_file) == first
    fs.pipe(f"{uri}/tokenizer_config.json", b'{"a": 2}')  # a new tokenizer: fetched again
    second = storage.local_copy(uri, tmp_path, keep=storage.tokenizer_file)
    assert second != first and read(second, "tokenizer_config.json") == b'{"a": 2}'
    whole = storage.local_copy(uri, tmp_path)  # the model itself: everything
    assert read(whole, "model.safetensors") == b"V" * 64 and read(whole, "checkpoints/step-1/optim.pt") == b"O"
    fs.pipe(f"{PROTOCOL}://bucket/run/models/weights-only/model.safetensors", b"W")
    with pytest.raises(FileNotFoundError, match="weights-only: none of its files"):
        storage.local_copy(f"{PROTOCOL}://bucket/run/models/weights-only", tmp_path, keep=storage.tokenizer_file)


def test_dataset_digest_follows_a_rewritten_remote_folder(remote, tmp_path, monkeypatch):
    from orchestration.cache import dataset_digest

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


# --- where a stage may write: `storage.check_destination` and the publish step --------------------


def output(folder, stage: str, files: dict[str, str] | None = None):
    """A finished output of `stage` at `folder` (its files, then stage.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {"model.safetensors": "weights"}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    (folder / storage.MANIFEST).write_text(json.dumps({"stage": stage}))
    return folder


def built(tmp_path, files: dict[str, str] | None = None, name: str = "built"):
    """A stage's finished local build, to publish."""
    src = tmp_path / name
    src.mkdir(exist_ok=True)
    for name, text in (files or {"model.safetensors": "new weights"}).items():
        (src / name).write_text(text)
    return src


def tree(folder) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_destination_rules(tmp_path):
    ok = {"missing": (tmp_path / "nothing" / "here", storage.NEW),
          "empty folder": (tmp_path / "empty", storage.EMPTY),
          "earlier sft": (output(tmp_path / "sft", "sft"), storage.EARLIER)}
    (tmp_path / "empty").mkdir()
    unfinished = tmp_path / "unfinished"
    storage.mark_writing(str(unfinished), "sft")
    (unfinished / "model-00001.safetensors").write_text("half")
    ok["unfinished sft"] = (unfinished, storage.UNFINISHED)
    for what, (where, state) in ok.items():
        assert storage.check_destination(str(where), "sft").state == state, what

    (tmp_path / "file.txt").write_text("keep")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.md").write_text("keep")
    prep = output(tmp_path / "work", "prep", {"base/config.json": "{}", "data/sft/train.jsonl": "{}\n"})
    other_writer = tmp_path / "being-written"
    storage.mark_writing(str(other_writer), "rm")
    nested = output(tmp_path / "sft-with-eval", "sft")
    output(nested / "eval", "eval")
    refused = {"file.txt": "is a file", "project": "folder with other content (notes.md)",
               "work": "holds the output of stage prep", "being-written": "is being written by stage rm",
               "sft-with-eval": "holds other outputs inside it (eval/stage.json)",
               "file.txt/below": "file.txt is a file"}
    for name, message in refused.items():
        with pytest.raises(ConfigError, match=rf"--save_path .*{name}: .*{re.escape(message)}"):
            storage.check_destination(str(tmp_path / name), "sft")
    # The run's own inputs: never written over, nor anything holding them.
    for location in (str(prep / "base"), f"json@{prep}/data/sft", str(prep)):
        cfg = SFTConfig(pretrain=str(prep / "base"), save_path=str(prep), data={"dataset": location})
        with pytest.raises(ConfigError, match="is or contains the input --"):
            storage.check_destination(str(prep), "prep", storage.stage_inputs(cfg))
    cfg = SFTConfig(pretrain=str(tmp_path / "sft"), save_path=str(tmp_path / "sft"), data={"dataset": "d.jsonl"})
    with pytest.raises(ConfigError, match="is or contains the input --pretrain"):
        storage.check_stage_output(cfg)  # an earlier sft output, but this run's starting point


def test_publish_never_replaces_a_file_or_a_foreign_folder(tmp_path):
    (tmp_path / "file.txt").write_text("keep")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.md").write_text("keep")
    prep = output(tmp_path / "work", "prep", {"base/config.json": "{}"})
    before = {p: (tree(p) if p.is_dir() else p.read_text()) for p in (tmp_path / "file.txt", project, prep)}
    for dest in before:
        with pytest.raises(ConfigError):
            storage.publish_dir(built(tmp_path), str(dest), {"stage": "sft"})
        assert (tree(dest) if dest.is_dir() else dest.read_text()) == before[dest]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "file.txt", "project", "work"]  # no debris


def test_publish_replaces_its_own_earlier_or_unfinished_output_and_an_empty_folder(tmp_path):
    sft = output(tmp_path / "sft", "sft", {"model-00001-of-00002.safetensors": "old", "old-only.bin": "old"})
    storage.publish_dir(built(tmp_path), str(sft), {"stage": "sft", "n": 2})
    assert tree(sft) == {"model.safetensors": "new weights", "stage.json": tree(sft)["stage.json"]}
    assert json.loads((sft / "stage.json").read_text())["n"] == 2
    unfinished = tmp_path / "unfinished"
    storage.mark_writing(str(unfinished), "sft")
    storage.publish_dir(built(tmp_path), str(unfinished), {"stage": "sft"})
    assert sorted(tree(unfinished)) == ["model.safetensors", "stage.json"]  # marker gone too
    (tmp_path / "empty").mkdir()
    storage.publish_dir(built(tmp_path), str(tmp_path / "empty"), {"stage": "sft"})
    assert sorted(tree(tmp_path / "empty")) == ["model.safetensors", "stage.json"]
    with pytest.raises(ConfigError, match="holds the output of stage sft"):
        storage.publish_dir(built(tmp_path), str(sft), {"stage": "dpo"})
    assert json.loads((sft / "stage.json").read_text())["n"] == 2


def test_publish_checks_again_and_what_it_moves_aside(tmp_path, monkeypatch):
    dest = tmp_path / "sft"
    assert storage.check_destination(str(dest), "sft").state == storage.NEW  # the driver's check, then training
    dest.mkdir()
    (dest / "theirs.txt").write_text("keep")  # someone else writes there meanwhile
    with pytest.raises(ConfigError, match="folder with other content"):
        storage.publish_dir(built(tmp_path), str(dest), {"stage": "sft"})
    assert tree(dest) == {"theirs.txt": "keep"}

    # Changed between the publish step's own check and the move: found when it is moved aside, and put back.
    def stale_check(uri, stage, inputs=(), **kwargs):
        return storage.Destination(uri, storage.EARLIER, storage.Found("folder", (), stage))

    monkeypatch.setattr(storage, "check_destination", stale_check)
    with pytest.raises(ConfigError, match="changed while it was being replaced"):
        storage.publish_dir(built(tmp_path), str(dest), {"stage": "sft"})
    assert tree(dest) == {"theirs.txt": "keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "sft"]


def test_an_output_a_registered_model_version_points_at_is_kept(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    sft = output(tmp_path / "sft", "sft")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    client = MlflowClient(tracking_uri=store)  # not the process's default: an earlier test may have set one
    run = client.create_run("0")
    client.create_registered_model("rlhf-sft")
    client.create_model_version("rlhf-sft", f"runs:/{run.info.run_id}/stage.json", run.info.run_id,
                                tags={"rlhf.output_uri": str(sft)})
    with pytest.raises(ConfigError, match=r"registered model version rlhf-sft/1 points at this output"):
        storage.publish_dir(built(tmp_path), str(sft), {"stage": "sft"})
    assert tree(sft) == {"model.safetensors": "weights", "stage.json": '{"stage": "sft"}'}
    assert storage.check_destination(str(tmp_path / "elsewhere"), "sft").state == storage.NEW

    with socket.socket() as s:  # a tracking server that does not answer: warned about, not waited on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    assert storage.check_destination(str(sft), "sft").state == storage.EARLIER
    assert "does not answer" in capsys.readouterr().err


def test_remote_replacement_removes_the_old_files_and_writes_stage_json_last(remote, tmp_path, monkeypatch):
    fs, _ = remote
    uri = f"{PROTOCOL}://bucket/run/sft"
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        fs.pipe(f"{uri}/{name}", b"old")
    fs.pipe(f"{uri}/stage.json", b'{"stage": "sft"}')
    src = built(tmp_path, {"model.safetensors": "new", "config.json": "{}"})
    seen = []
    real_put = FakeS3.put_file

    def watching_put(self, lpath, rpath, **kwargs):
        seen.append(sorted(p.rsplit("/", 1)[1] for p in fs.find(uri)))
        return real_put(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(FakeS3, "put_file", watching_put)
    storage.publish_dir(src, uri, {"stage": "sft"})
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(uri)) == ["config.json", "model.safetensors", "stage.json"]
    assert all(storage.MANIFEST not in names and storage.WRITING in names for names in seen)  # marked, unfinished
    assert not any("00002" in name for names in seen for name in names)  # old shards gone before the upload


def test_remote_refuses_foreign_objects_and_a_retry_takes_over_its_unfinished_output(remote, tmp_path, monkeypatch):
    fs, _ = remote
    foreign = f"{PROTOCOL}://bucket/shared"
    fs.pipe(f"{foreign}/report.csv", b"keep")
    fs.pipe(f"{PROTOCOL}://bucket/object", b"keep")
    fs.pipe(f"{PROTOCOL}://bucket/prep/stage.json", b'{"stage": "prep"}')
    for uri in (foreign, f"{PROTOCOL}://bucket/object", f"{PROTOCOL}://bucket/prep"):
        with pytest.raises(ConfigError):
            storage.publish_dir(built(tmp_path), uri, {"stage": "sft"})
    assert fs.cat(f"{foreign}/report.csv") == b"keep" and fs.cat(f"{PROTOCOL}://bucket/object") == b"keep"
    assert len(fs.find(foreign)) == 1 and fs.find(f"{PROTOCOL}://bucket/prep") == ["/bucket/prep/stage.json"]

    uri = f"{PROTOCOL}://bucket/run/sft"
    src = built(tmp_path, {"a.bin": "a", "b.bin": "b"})
    real_put = FakeS3.put_file

    def crash_after_one(self, lpath, rpath, **kwargs):
        if rpath.endswith("b.bin"):
            raise ConnectionError("lost the network")
        return real_put(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(FakeS3, "put_file", crash_after_one)
    with pytest.raises(ConnectionError):
        storage.publish_dir(src, uri, {"stage": "sft"})
    assert storage.read_manifest(uri) is None
    assert storage.check_destination(uri, "sft").state == storage.UNFINISHED
    with pytest.raises(ConfigError, match="is being written by stage sft"):
        storage.check_destination(uri, "dpo")
    monkeypatch.setattr(FakeS3, "put_file", real_put)
    storage.publish_dir(built(tmp_path, {"c.bin": "c"}, "retry"), uri, {"stage": "sft"})  # the retry
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(uri)) == ["c.bin", "stage.json"]


# --- the commands: refused before anything runs, with exit status 2 --------------------------------


def test_cli_train_refuses_an_existing_file_as_save_path_before_training(prepared, tmp_path, monkeypatch, capsys):
    from rlhf_core.cli import main
    from rlhf_core.stages import launch

    def no_training():
        raise AssertionError("the stage started")

    monkeypatch.setattr(launch, "ensure_ray", no_training)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    common = ["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
              "--use_mlflow", "false", "--save_path"]
    assert main([*common, str(precious)]) == 2
    assert f"--save_path {precious}: is a file" in capsys.readouterr().err
    assert precious.read_text() == "keep me"
    assert main([*common, prepared["root"]]) == 2  # prep's folder: holds this run's own inputs
    assert "is or contains the input --pretrain" in capsys.readouterr().err


def test_cli_prep_refuses_a_file_or_a_foreign_folder(tmp_path, capsys):
    from rlhf_core.cli import main

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.md").write_text("keep me")
    assert main(["prep", "--out", str(precious)]) == 2
    assert f"--out {precious}: is a file" in capsys.readouterr().err
    assert main(["prep", "--out", str(project)]) == 2
    assert "folder with other content (notes.md)" in capsys.readouterr().err
    assert precious.read_text() == "keep me" and tree(project) == {"notes.md": "keep me"}


@pytest.mark.parametrize("command", ["eval", "pairs"])
def test_cli_eval_and_pairs_refuse_another_stages_output(command, prepared, tmp_path, monkeypatch, capsys):
    from rlhf_core.cli import main
    from rlhf_core.trainers import common

    def no_generation(uri):
        raise AssertionError("the stage started")

    monkeypatch.setattr(common, "local_model_path", no_generation)
    sft = output(tmp_path / "sft", "sft")
    code = main([command, "--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--task", "addition",
                 "--use_mlflow", "false", "--save_path", str(sft)])
    assert code == 2 and "holds the output of stage sft" in capsys.readouterr().err
    assert tree(sft) == {"model.safetensors": "weights", "stage.json": '{"stage": "sft"}'}


def test_publish_never_renames_over_what_appeared_after_its_check(tmp_path, monkeypatch):
    dest = tmp_path / "sft"
    real_check = storage.check_destination

    def check_then_someone_writes(uri, stage, inputs=(), **kwargs):
        found = real_check(uri, stage, inputs, **kwargs)
        dest.mkdir()
        (dest / "theirs.txt").write_text("keep")
        return found

    monkeypatch.setattr(storage, "check_destination", check_then_someone_writes)
    with pytest.raises(ConfigError, match="appeared while the output was being published"):
        storage.publish_dir(built(tmp_path), str(dest), {"stage": "sft"})
    assert tree(dest) == {"theirs.txt": "keep"}


def test_jsonl_keeps_one_row_per_line_whatever_its_text_holds():
    """A tiny policy's sampled text can decode to NEL or a Unicode line/paragraph separator, which JSON
    leaves raw outside ASCII mode and `str.splitlines` (like JavaScript and some JSON-lines readers)
    takes for a line break: a written file then read back line by line lost its rows (CI saw it)."""
    rows = [{"output": "a\x85b\u2028c\u2029d\x1ce\nf é 中"}, {"output": "next"}]
    text = storage.jsonl_text(rows)
    assert [json.loads(line) for line in text.splitlines()] == rows
    assert "é 中" in text
