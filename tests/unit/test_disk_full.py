"""A full disk while saving: the stage fails with a clear error (exit 2, not retried), and what was
there before (the published output, the earlier checkpoints, `latest`) stays as it was.

No small filesystem can be mounted here without root, so ENOSPC is injected at the lowest write
each path uses (`torch.save` for checkpoints, DeepSpeed's included; safetensors' `save_file` for the
model; `shutil.copyfile` for the publish copy): the patched write first puts half of the bytes on
disk, as a real full disk does, then raises `OSError(ENOSPC)`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.infra import storage
from rlhf_core.rl.ahead import RolloutsAhead
from rlhf_core.rl.checkpoint import BestMetric
from rlhf_core.trainers import checkpoints


def full_disk(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def half_written(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def digests(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below `root` (what "byte-identical" compares)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def failing_torch_save(monkeypatch, when):
    """torch.save that half-writes and raises ENOSPC for a target path where `when(path)` is true."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)) and when(str(f)):
            buffer = io.BytesIO()
            real(obj, buffer, *args, **kwargs)
            half_written(f, buffer.getvalue())
            raise full_disk(f)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


# --- the pieces, without training ------------------------------------------------------------------


def built(tmp_path: Path, files: dict[str, bytes], name: str) -> Path:
    src = tmp_path / name
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    return src


def test_publish_on_a_full_disk_keeps_the_earlier_output_byte_identical(tmp_path, monkeypatch):
    dest = tmp_path / "out" / "sft"
    storage.publish_dir(built(tmp_path, {"model.safetensors": b"old" * 1000, "config.json": b"{}"}, "a"),
                        str(dest), {"stage": "sft", "n": 1})
    before = digests(dest)
    real_copyfile = shutil.copyfile

    def copyfile(src, dst, *args, **kwargs):
        if os.fspath(src).endswith("model.safetensors"):
            half_written(dst, Path(src).read_bytes())
            raise full_disk(dst)
        return real_copyfile(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copyfile)
    new = built(tmp_path, {"model.safetensors": b"new" * 2000, "config.json": b'{"n": 2}'}, "b")
    with pytest.raises(storage.DiskFullError) as failed:
        storage.publish_dir(new, str(dest), {"stage": "sft", "n": 2})
    message = str(failed.value)
    assert message.startswith(f"--save_path {dest}: the disk is full") and "previous output there is as it was" in message
    assert digests(dest) == before and json.loads((dest / "stage.json").read_text())["n"] == 1
    assert sorted(p.name for p in dest.parent.iterdir()) == ["sft"]  # no staging folder left behind
    monkeypatch.undo()  # space again: the same publish goes through
    storage.publish_dir(new, str(dest), {"stage": "sft", "n": 2})
    assert json.loads((dest / "stage.json").read_text())["n"] == 2


def test_a_full_disk_is_recognised_through_a_ranks_error_and_its_causes():
    from rlhf_core.distributed.role_group import RoleError
    from rlhf_core.stages.launch import StageFailed

    inner = full_disk("/x/model.pt")
    assert storage.is_disk_full(StageFailed(RoleError("train", [1], "run_stage", "raised", cause=inner)))
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("DeepSpeed could not save") from e
    except RuntimeError as wrapped:
        assert storage.is_disk_full(wrapped)
    assert storage.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not storage.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not storage.is_disk_full(RuntimeError("no"))
    # What safetensors (Rust) and torch.save's zip writer raise on a real full disk (measured on a tmpfs):
    assert storage.is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not storage.is_disk_full(short)  # no errno: a full disk only where the filesystem is (nearly) full
    assert not storage.is_disk_full(short, "/tmp")


def test_a_short_torch_write_is_a_full_disk_when_the_filesystem_is_full(tmp_path, monkeypatch):
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(storage, "_free_bytes", lambda path: 4096)
    assert storage.is_disk_full(short, tmp_path / "ckpt")
    removed = []
    with pytest.raises(storage.DiskFullError, match=r"--ckpt_path .*ckpt: the disk is full"):
        with storage.saving("--ckpt_path", tmp_path / "ckpt", "checkpoint global_step2", "kept",
                            cleanup=lambda: removed.append(storage._free_bytes(tmp_path))):
            raise short
    assert removed == [4096]
    monkeypatch.setattr(storage, "_free_bytes", lambda path: 10 << 30)  # plenty of room: some other failure
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with storage.saving("--ckpt_path", tmp_path / "ckpt", "checkpoint global_step2", "kept"):
            raise short


class FakeKL:
    def state_dict(self):
        return {"coef": 0.1}


def controller(step: int, roles=None):
    return SimpleNamespace(step=step, actor=roles, critic=None, guard=None, prompts=SimpleNamespace(position=step * 4),
                           kl=FakeKL(), best=BestMetric(""), policy_version=step, evaluated_on={"all": 0},
                           ahead=RolloutsAhead(lambda s: None, 0),
                           cfg=SimpleNamespace(ckpt=SimpleNamespace(max_num=1, max_mem=None, disable_ds=False)))


class FakeRoles:
    """A role group whose ranks write a DeepSpeed-like folder; `fail` makes rank 1 hit a full disk."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def call_all_async(self, method, directory):
        from rlhf_core.distributed.role_group import RoleError

        assert method == "save_checkpoint"
        (Path(directory) / "actor").mkdir(parents=True, exist_ok=True)
        (Path(directory) / "actor" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        error = RoleError("actor", [1], method, "raised OSError", cause=full_disk(Path(directory) / "actor" / "x.pt"))
        return SimpleNamespace(per_rank=lambda: (_ for _ in ()).throw(error) if self.fail else None)


def test_rl_checkpoint_on_a_full_disk_keeps_the_earlier_one_and_latest(tmp_path, monkeypatch):
    from rlhf_core.rl import checkpoint

    ckpt = tmp_path / "ckpt"
    run = checkpoint.save(controller(2, FakeRoles()), ckpt, None)
    before = digests(ckpt / "global_step2")
    assert checkpoints.latest_tag(ckpt) == "global_step2"

    with pytest.raises(storage.DiskFullError, match=r"--ckpt.path .*: the disk is full .*checkpoint global_step4"):
        checkpoint.save(controller(4, FakeRoles(fail=True)), ckpt, run)  # a rank's own write fails
    failing_torch_save(monkeypatch, lambda p: p.endswith(checkpoint.CONTROLLER))
    with pytest.raises(storage.DiskFullError, match="earlier ones and `latest` are as they were"):
        checkpoint.save(controller(4, FakeRoles()), ckpt, run)  # the controller's own write fails
    assert checkpoints.latest_tag(ckpt) == "global_step2" and digests(ckpt / "global_step2") == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "latest", storage.CHECKPOINTS]
    assert list(checkpoints.read_record(ckpt)["tags"]) == ["global_step2"]  # max_num 1: nothing rotated away
    state = torch.load(ckpt / "global_step2" / checkpoint.CONTROLLER, weights_only=False)
    assert state["step"] == 2 and state["prompt_position"] == 8


def test_a_rewritten_tag_replaces_the_old_one_only_when_whole(tmp_path):
    """A fresh run writing a step an older run wrote: the old tag stays until the new one is whole."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "global_step4" / "old.pt").write_bytes(b"old")
    checkpoints.write_latest(ckpt, "global_step4")
    partial = checkpoints.begin(ckpt, "global_step4")
    (partial / "new.pt").write_bytes(b"new")
    assert (ckpt / "global_step4" / "old.pt").read_bytes() == b"old"  # untouched while the new one is written
    checkpoints.commit(ckpt, "global_step4")
    assert [p.name for p in (ckpt / "global_step4").iterdir()] == ["new.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step4", "latest"]


# --- a real training run: DeepSpeed's checkpoint and the published model ----------------------------


def sft_args(prepared, out: Path, ckpt: Path, steps: int, **more) -> list[str]:
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(out),
              "apply_chat_template": "true", "max_len": "48", "train_batch_size": "16",
              "micro_train_batch_size": "16", "max_samples": "64", "max_eval_samples": "16", "max_epochs": "2", "max_steps": str(steps),
              "learning_rate": "1e-3", "param_dtype": "fp32", "use_mlflow": "false", "save_steps": "2",
              "ckpt_path": str(ckpt), "max_ckpt_num": "1", "load_checkpoint": "true", **more}
    return ["train", "sft", *[a for k, v in values.items() for a in (f"--{k}", v)]]


def test_sft_on_a_full_disk_fails_clearly_and_keeps_output_and_checkpoints(prepared, tmp_path, monkeypatch, capsys):
    """A checkpoint (DeepSpeed's model states) and then the final model hit a full disk: exit 2 with a
    message naming the flag, the path and what is kept; the earlier published output stays byte-
    identical, the earlier checkpoint whole and not rotated away; a resume starts at that checkpoint."""
    import transformers.modeling_utils

    from rlhf_core.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # one rank, in this process: the patches apply
    out, ckpt = tmp_path / "out" / "sft", tmp_path / "ckpt"
    assert main(sft_args(prepared, out, tmp_path / "ckpt0", 2)) == 0  # an earlier output at save_path
    published = digests(out)
    capsys.readouterr()

    # 1. The checkpoint of step 4 fails inside DeepSpeed's own write (step 2's is whole by then).
    kept: dict[str, str] = {}

    def at_step4(path: str) -> bool:
        if ".global_step4.partial" in path and path.endswith("model_states.pt"):
            kept.update(digests(ckpt / "global_step2"))  # what step 2's checkpoint held just before
            return True
        return False

    failing_torch_save(monkeypatch, at_step4)
    assert main(sft_args(prepared, out, ckpt, 6)) == 2
    err = capsys.readouterr().err
    assert f"rlhf: error: --ckpt_path {ckpt}: the disk is full (no space left) while writing the checkpoint " \
           "global_step4" in err and "earlier ones and `latest` are as they were" in err, err
    assert "Traceback" not in err
    assert kept and digests(ckpt / "global_step2") == kept and (ckpt / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "latest", storage.CHECKPOINTS]
    assert digests(out) == published
    monkeypatch.undo()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    # 2. Resumed from step 2 (not step 0), it trains to step 6, then the model's weights hit a full disk.
    real_save_file = transformers.modeling_utils.safe_save_file

    def save_file(tensors, filename, *args, **kwargs):
        buffer = tmp_path / "whole.safetensors"
        real_save_file(tensors, str(buffer), *args, **kwargs)
        half_written(filename, buffer.read_bytes())
        raise full_disk(filename)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    assert main(sft_args(prepared, out, ckpt, 6)) == 2
    err = capsys.readouterr().err
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in err
    assert f"rlhf: error: --save_path {out}: the disk is full (no space left) while writing the output of sft" in err
    assert "the previous output there is as it was" in err and "Traceback" not in err
    assert digests(out) == published and sorted(p.name for p in out.parent.iterdir()) == ["sft"]
    assert (ckpt / "latest").read_text() == "global_step6"
    monkeypatch.undo()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    # 3. Space again: the resumed run starts at step 6 and publishes.
    assert main(sft_args(prepared, out, ckpt, 6)) == 0
    manifest = json.loads((out / "stage.json").read_text())
    assert manifest["resume"]["start_step"] == 6 and manifest["metrics"]["train/steps"] == 6
    assert digests(out) != published


def test_a_rank_whose_checkpoint_folder_another_rank_removed_raises_a_follow_on_error(prepared, tmp_path,
                                                                                      monkeypatch, capsys):
    """What the second rank sees when the first hits a full disk and removes the partial folder under
    its writes: torch's "Parent directory ... does not exist". It is raised as a FollowOnError, so the
    group reports the first rank's full disk (tests/integration/test_role_groups.py holds the wait)."""
    from rlhf_core.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ckpt = tmp_path / "ckpt"
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)) and ".global_step2.partial" in str(f):
            shutil.rmtree(ckpt / ".global_step2.partial")  # the other rank's cleanup
            raise RuntimeError(f"Parent directory {Path(f).parent} does not exist.")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert main(sft_args(prepared, tmp_path / "out", ckpt, 2)) == 1  # not the cause: the group names the cause
    err = capsys.readouterr().err
    assert "FollowOnError: checkpoint global_step2: its folder was removed by another rank's failure while rank 0 " \
           "wrote (RuntimeError: Parent directory" in err, err[-2000:]


def test_prep_on_a_full_disk_exits_2_and_leaves_nothing_that_looks_finished(tmp_path, monkeypatch, capsys):
    """prep writes in place (marked unfinished first): a full disk says so, exit 2, no stage.json."""
    import transformers.modeling_utils

    from rlhf_core.cli import main

    def save_file(tensors, filename, *args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    out = tmp_path / "prep"
    assert main(["prep", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"rlhf: error: --out {out}: the disk is full (no space left) while writing the prep output" in err
    assert "marked unfinished" in err and "Traceback" not in err
    assert not (out / storage.MANIFEST).exists() and (out / storage.WRITING).exists()


# --- data too large for Ray's object store ---------------------------------------------------------


def test_data_the_object_store_cannot_hold_is_loaded_by_each_rank(prepared, tmp_path, monkeypatch, capsys):
    """`ray.put` of the checked data raising Ray's ObjectStoreFullError: the worker group is started
    with no data reference (each rank loads the datasets itself, `run_recipe(cfg, None)`), with a log line."""
    import ray
    from ray.exceptions import ObjectStoreFullError

    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.distributed import role_group
    from rlhf_core.distributed.pending import PendingCall
    from rlhf_core.stages import launch

    def put(value):
        raise ObjectStoreFullError("Failed to put object 00ff in object store because it is full.")

    started = []

    class Group:
        def __init__(self, worker_cls, world_size, name):
            started.append(world_size)

        def call_all_async(self, method, config, data):
            started.append(data)
            return PendingCall.resolved([{"stage": config["stage"]}] * 2)

        def shutdown(self):
            pass

    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr(launch, "ensure_ray", lambda: False)
    monkeypatch.setattr(role_group, "RoleGroup", Group)
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(tmp_path / "sft"),
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 8,
              "use_mlflow": False, "num_gpus_per_node": 2}
    assert launch.run_stage(build_config(STAGE_CONFIGS["sft"], None, values)) == {"stage": "sft"}
    assert started == [2, None]  # the group ran, and its ranks got no object-store copy to read
    err = capsys.readouterr().err
    assert "do not fit in Ray's object store (Failed to put object 00ff" in err and "each rank loads them" in err

    monkeypatch.setattr(ray, "put", lambda value: "a reference")  # room in the store: one shared copy
    started.clear()
    launch.run_stage(build_config(STAGE_CONFIGS["sft"], None, values))
    assert started == [2, "a reference"]


# --- a real small filesystem (where this process may mount one) ----------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """`mount(bytes) -> Path`: a tmpfs of that size under tmp_path, unmounted after. Needs root (or
    CAP_SYS_ADMIN); skipped elsewhere, where the injected-ENOSPC tests above cover the same paths."""
    import subprocess

    mounted = []

    def mount(size: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}): needs root "
                        "or CAP_SYS_ADMIN; ENOSPC is injected in the tests above instead")
        mounted.append(where)
        return where

    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; ENOSPC is injected in the tests above instead")
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def disk_use(root: Path) -> int:
    """Bytes a tmpfs charges for the files below `root` (whole 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in root.rglob("*") if p.is_file())


def test_sft_on_a_real_full_filesystem(prepared, small_fs, tmp_path, monkeypatch, capsys):
    """A real ENOSPC from a small tmpfs: a checkpoint that does not fit next to the earlier one, and
    an output that does not fit next to the earlier output, fail with exit 2 and keep what was there;
    the kept checkpoint loads and the run resumes from it."""
    from rlhf_core.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # A first run on the ordinary disk: the earlier output and checkpoint, and their sizes.
    first_out, first_ckpt = tmp_path / "first" / "sft", tmp_path / "first_ckpt"
    assert main(sft_args(prepared, first_out, first_ckpt, 2)) == 0
    capsys.readouterr()

    # Checkpoints: room for one and a half (rotation keeps one, but only after the next is whole).
    ckpt = small_fs(disk_use(first_ckpt) * 3 // 2) / "ckpt"
    shutil.copytree(first_ckpt, ckpt)
    kept = digests(ckpt)
    assert main(sft_args(prepared, tmp_path / "unused" / "sft", ckpt, 6)) == 2
    err = capsys.readouterr().err
    assert "resumed from" in err and "at step 2" in err
    assert f"--ckpt_path {ckpt}: the disk is full (no space left) while writing the checkpoint global_step4" in err
    assert "Traceback" not in err
    assert digests(ckpt) == kept and (ckpt / "latest").read_text() == "global_step2"

    # The output: room for the earlier output and one and a half more (a publish needs two more).
    out = small_fs(disk_use(first_out) * 5 // 2 + 64 * 1024) / "sft"
    storage.publish_dir(first_out, str(out), json.loads((first_out / "stage.json").read_text()))
    published = digests(out)
    # Resumed from the kept checkpoint, trained to the end (no more checkpoints), then a full disk.
    assert main(sft_args(prepared, out, ckpt, 6, save_steps="-1")) == 2
    err = capsys.readouterr().err
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in err
    assert f"--save_path {out}: the disk is full (no space left) while writing the output of sft" in err, err
    assert "Traceback" not in err
    assert digests(out) == published and sorted(p.name for p in out.parent.iterdir()) == ["sft"]
