"""Checkpoint rotation removes only the tags its own run wrote, resumes included (`trainers/checkpoints.py`)."""

from pathlib import Path

from rlhf_core.config import SFTConfig
from rlhf_core.trainers import checkpoints
from rlhf_core.trainers.loop import TrainLoop


class FakeEngine:
    """DeepSpeed's checkpoint calls, as files: a tag folder, then `latest`."""

    def save_checkpoint(self, path, tag, client_state, save_latest=True):
        (Path(path) / tag / "model_states.pt").write_text(str(client_state["step"]))
        if save_latest:
            (Path(path) / "latest").write_text(tag)

    def load_checkpoint(self, path, tag, **kwargs):
        return str(Path(path) / tag), {"step": int((Path(path) / tag / "model_states.pt").read_text())}


def loop(ckpt: Path, keep: int, resume: bool = False) -> TrainLoop:
    cfg = SFTConfig(pretrain="m", save_path="o", data={"dataset": "d"}, train_batch_size=8, micro_train_batch_size=8,
                    ckpt_path=str(ckpt), save_steps=1, max_ckpt_num=keep, load_checkpoint=resume)
    return TrainLoop(cfg, FakeEngine(), None, list(range(64)), None, None, rank=0, world_size=1)


def saved(train: TrainLoop, *steps: int) -> None:
    for step in steps:
        train.step = step
        train.save_checkpoint()


def tags(ckpt: Path) -> list[str]:
    return sorted((p.name for p in ckpt.glob("global_step*")), key=lambda t: int(t.removeprefix("global_step")))


def test_tags_to_remove_counts_one_run_only():
    record = {"tags": {"global_step1": {"run": "a", "step": 1}, "global_step2": {"run": "b", "step": 2},
                       "global_step10": {"run": "a", "step": 10}, "global_step3": {"run": "a", "step": 3}}}
    assert checkpoints.tags_to_remove(record, "a", 2) == ["global_step1"]
    assert checkpoints.tags_to_remove(record, "a", 1) == ["global_step1", "global_step3"]
    assert checkpoints.tags_to_remove(record, "b", 1) == [] and checkpoints.tags_to_remove(record, "c", 1) == []


def test_rotation_keeps_other_runs_checkpoints_and_a_resumed_run_rotates_its_own(tmp_path):
    ckpt = tmp_path / "ckpt"
    other = loop(ckpt, keep=5)
    saved(other, 1, 2)  # another run with the same ckpt_path
    (ckpt / "global_step50").mkdir()  # a checkpoint nobody recorded (an older release, a copy)

    first = loop(ckpt, keep=2)
    saved(first, 3, 6, 9)
    assert tags(ckpt) == ["global_step1", "global_step2", "global_step6", "global_step9", "global_step50"]

    resumed = loop(ckpt, keep=2, resume=True)  # `latest` is global_step9: the first run, continued
    assert resumed.load_checkpoint() == 9 and resumed.checkpoint_run == first.checkpoint_run
    saved(resumed, 12)
    assert tags(ckpt) == ["global_step1", "global_step2", "global_step9", "global_step12", "global_step50"]

    (ckpt / "latest").write_text("global_step50")  # resuming from an unrecorded tag takes it over
    (ckpt / "global_step50" / "model_states.pt").write_text("50")
    (ckpt / "global_step50" / "rng_state_rank0.pt").write_bytes((ckpt / "global_step9" / "rng_state_rank0.pt").read_bytes())
    adopted = loop(ckpt, keep=1, resume=True)
    assert adopted.load_checkpoint() == 50
    saved(adopted, 51)
    assert tags(ckpt) == ["global_step1", "global_step2", "global_step9", "global_step12", "global_step51"]
    record = checkpoints.read_record(ckpt)["tags"]
    assert {t: e["run"] for t, e in record.items()} == {
        "global_step1": other.checkpoint_run, "global_step2": other.checkpoint_run,
        "global_step9": first.checkpoint_run, "global_step12": first.checkpoint_run,
        "global_step51": adopted.checkpoint_run}


def test_max_ckpt_mem_removes_the_oldest_until_the_run_fits_and_keeps_the_newest(tmp_path):
    """`--max_ckpt_mem` (GB, OpenRLHF's unit): beside `--max_ckpt_num`, the run's checkpoints may
    take at most that much; the oldest go first, the newest stays even when alone too big."""
    record = {"tags": {f"global_step{s}": {"run": "a", "step": s} for s in (1, 2, 3)}}
    sizes = {"global_step1": 400, "global_step2": 400, "global_step3": 400}
    assert checkpoints.tags_to_remove(record, "a", 10, sizes, 900) == ["global_step1"]
    assert checkpoints.tags_to_remove(record, "a", 10, sizes, 100) == ["global_step1", "global_step2"]
    assert checkpoints.tags_to_remove(record, "a", 2, sizes, 10_000) == ["global_step1"]

    ckpt = tmp_path / "ckpt"
    cfg = SFTConfig(pretrain="m", save_path="o", data={"dataset": "d"}, train_batch_size=8, micro_train_batch_size=8,
                    ckpt_path=str(ckpt), save_steps=1, max_ckpt_num=10)
    train = TrainLoop(cfg, FakeEngine(), None, list(range(64)), None, None, rank=0, world_size=1)
    saved(train, 1)
    one = checkpoints.tag_bytes(ckpt, ["global_step1"])["global_step1"]
    cfg.ckpt.max_mem = 2.5 * one / 1024**3  # two of these tags fit, three do not
    saved(train, 2, 3)
    assert tags(ckpt) == ["global_step2", "global_step3"]


def test_disable_ds_ckpt_writes_the_hf_model_only_and_no_latest(tmp_path, monkeypatch):
    """`--disable_ds_ckpt` with `--save_hf_ckpt`: each tag holds the Hugging Face model alone (no
    DeepSpeed state, no RNG), and `latest` names none (there is nothing to resume from); the flag
    without --save_hf_ckpt, or with --load_checkpoint, is refused."""
    import pytest

    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.models import loading

    written = []
    monkeypatch.setattr(loading, "write_hf_checkpoint",
                        lambda module, tok, folder, rank: written.append(folder) or (Path(folder) / "hf").mkdir())
    ckpt = tmp_path / "ckpt"
    cfg = SFTConfig(pretrain="m", save_path="o", data={"dataset": "d"}, train_batch_size=8, micro_train_batch_size=8,
                    ckpt_path=str(ckpt), save_steps=1, save_hf_ckpt=True, disable_ds_ckpt=True)
    engine = FakeEngine()
    engine.module = None
    train = TrainLoop(cfg, engine, None, list(range(64)), None, None, rank=0, world_size=1)
    saved(train, 1, 2)
    assert tags(ckpt) == ["global_step1", "global_step2"] and len(written) == 2
    assert [p.name for p in (ckpt / "global_step2").iterdir()] == ["hf"]
    assert checkpoints.latest_tag(ckpt) is None
    for flags in ({"save_hf_ckpt": False}, {"load_checkpoint": True}):
        with pytest.raises((ConfigError, ValueError), match="disable_ds"):
            SFTConfig(pretrain="m", save_path="o", data={"dataset": "d"}, train_batch_size=8,
                      micro_train_batch_size=8, ckpt_path=str(ckpt), save_steps=1, disable_ds_ckpt=True,
                      **{"save_hf_ckpt": True, **flags})
