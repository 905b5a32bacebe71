"""Training checkpoints on S3 (a local moto server): whole or not at all, rotated there, resumed from
a download, and the checkpoint folder a retried stage claims (`orchestration/resume.py`).

The engines are fakes that write DeepSpeed's files as plain text, so these run in seconds; the
real DeepSpeed ranks on two Ray nodes are `test_multinode.py`'s.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_core.config import SFTConfig
from rlhf_core.infra import storage
from rlhf_core.infra.settings import state_dir
from rlhf_core.rl.ahead import Rollout, RolloutsAhead
from rlhf_core.rl.checkpoint import BestMetric
from rlhf_core.rl.guard import HackingGuard
from rlhf_core.trainers.loop import TrainLoop
from tests.integration.simulated_cluster import staged_leftovers

pytestmark = pytest.mark.integration


class FakeEngine:
    """DeepSpeed's checkpoint calls as files: `<dir>/<tag>/model_states.pt` holds the step."""

    def __init__(self):
        self.loaded_from = None

    def save_checkpoint(self, path, tag, client_state, save_latest=True):
        (Path(path) / tag).mkdir(parents=True, exist_ok=True)
        (Path(path) / tag / "model_states.pt").write_text(str(client_state["step"]))
        (Path(path) / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script, beside the tags")

    def load_checkpoint(self, path, tag, **kwargs):
        self.loaded_from = Path(path) / tag
        return str(self.loaded_from), {"step": int((Path(path) / tag / "model_states.pt").read_text())}


def s3():
    import fsspec

    fsspec.config.conf.clear()
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


def loop(ckpt: str, keep: int = 2, resume: bool = False) -> TrainLoop:
    cfg = SFTConfig(pretrain="m", save_path="o", data={"dataset": "d"}, train_batch_size=8, micro_train_batch_size=8,
                    ckpt_path=ckpt, save_steps=1, max_ckpt_num=keep, load_checkpoint=resume)
    return TrainLoop(cfg, FakeEngine(), None, list(range(64)), None, None, rank=0, world_size=1)


def saved(train: TrainLoop, *steps: int) -> None:
    for step in steps:
        train.step = step
        train.save_checkpoint()


def listing(ckpt: str) -> list[str]:
    base = ckpt.removeprefix("s3://")
    return sorted(p[len(base) + 1:] for p in s3().find(ckpt))


def staged() -> list[Path]:
    """What is left in this machine's staging folders (each save removes its own)."""
    return staged_leftovers(state_dir())


def test_supervised_checkpoints_go_to_s3_whole_rotate_there_and_resume_from_a_download(s3_endpoint, capsys):
    ckpt = "s3://models/ckpt/sft"
    assert loop(ckpt, resume=True).load_checkpoint() == 0  # nothing there yet: step 0, said on stderr
    assert f"no checkpoint in {ckpt} yet" in capsys.readouterr().err
    first = loop(ckpt, keep=2)
    saved(first, 2, 4, 6)
    assert listing(ckpt) == ["global_step4/model_states.pt", "global_step4/rng_state_rank0.pt",
                             "global_step6/model_states.pt", "global_step6/rng_state_rank0.pt", "latest",
                             "rlhf-checkpoints.json"]  # the recovery script beside the tags stays behind
    assert s3().cat(f"{ckpt}/latest") == b"global_step6" and not staged()
    assert "checkpoint global_step6 uploaded to s3://models/ckpt/sft/global_step6" in capsys.readouterr().err

    resumed = loop(ckpt, keep=2, resume=True)
    assert resumed.load_checkpoint() == 6  # a no-op resume (step 0) fails here
    assert resumed.resume["checkpoint"] == f"{ckpt}/global_step6"
    assert f"resumed from {ckpt}/global_step6 at step 6" in capsys.readouterr().err
    downloads = state_dir() / "cache" / "downloads"
    assert resumed.engine.loaded_from.parent == downloads  # read from this node's download, not a writer's folder
    assert resumed.checkpoint_run == first.checkpoint_run  # the same run, continued: it rotates its own tags
    saved(resumed, 8)
    assert [p for p in listing(ckpt) if p.endswith("model_states.pt")] == ["global_step6/model_states.pt",
                                                                           "global_step8/model_states.pt"]


def test_a_checkpoint_whose_upload_was_cut_short_is_never_latest(s3_endpoint, monkeypatch):
    """The upload dies after its first object: `latest` still names the previous checkpoint, a resume
    loads that one, and the next save of the same step removes what the cut-short upload left."""
    ckpt = "s3://models/ckpt/cut"
    first = loop(ckpt, keep=5)
    saved(first, 2)
    real = storage.upload_folder

    def one_file_then_fail(local, uri):
        fs = s3()
        first_file = sorted(p for p in Path(local).rglob("*") if p.is_file())[0]
        fs.put_file(str(first_file), f"{uri}/{first_file.relative_to(local).as_posix()}")
        raise ConnectionError("S3 went away mid-upload")

    monkeypatch.setattr(storage, "upload_folder", one_file_then_fail)
    with pytest.raises(ConnectionError):
        saved(first, 4)
    assert s3().cat(f"{ckpt}/latest") == b"global_step2"
    assert "global_step4/model_states.pt" in listing(ckpt) and not staged()  # half of step 4 is there

    resumed = loop(ckpt, keep=5, resume=True)
    assert resumed.load_checkpoint() == 2
    monkeypatch.setattr(storage, "upload_folder", real)
    s3().pipe(f"{ckpt}/global_step4/stale-from-the-cut-upload", b"x")
    saved(resumed, 4)
    assert [p for p in listing(ckpt) if p.startswith("global_step4/")] == ["global_step4/model_states.pt",
                                                                          "global_step4/rng_state_rank0.pt"]
    assert s3().cat(f"{ckpt}/latest") == b"global_step4"


def test_rewriting_the_step_latest_names_falls_back_to_an_older_whole_checkpoint_first(s3_endpoint, monkeypatch):
    """A fresh run writing the step `latest` names: while it uploads, `latest` names the newest other
    whole checkpoint, so a crash then leaves a resumable folder, never a half-rewritten `latest`."""
    ckpt = "s3://models/ckpt/rewrite"
    saved(loop(ckpt, keep=5), 2, 4)
    seen, real = [], storage.upload_folder

    def watching(local, uri):
        seen.append(s3().cat(f"{ckpt}/latest"))
        return real(local, uri)

    monkeypatch.setattr(storage, "upload_folder", watching)
    saved(loop(ckpt, keep=5), 4)
    assert seen == [b"global_step2"] and s3().cat(f"{ckpt}/latest") == b"global_step4"


def test_rl_checkpoints_on_s3_hold_every_role_and_the_controller(s3_endpoint):
    """The RL stage's checkpoint (`rl/checkpoint.py`) with a role in this process: the role's folder
    is staged and uploaded (`distributed/folders.py`), `controller.pt` beside it, `latest` last; a
    resume downloads the role's part and reads the controller's state from S3."""
    import torch

    from rlhf_core.distributed.local_role_group import LocalRoleGroup
    from rlhf_core.rl import checkpoint

    class Role:
        def __init__(self):
            self.weights = torch.zeros(3)

        def save_checkpoint(self, directory):
            Path(directory, "actor").mkdir(parents=True, exist_ok=True)
            torch.save(self.weights, Path(directory) / "actor" / "weights.pt")

        def load_checkpoint(self, directory):
            self.weights = torch.load(Path(directory) / "actor" / "weights.pt")

    class KL:
        def __init__(self, coef):
            self.coef = coef

        def state_dict(self):
            return {"coef": self.coef}

        def load_state_dict(self, state):
            self.coef = state["coef"]

    def controller(role):
        return SimpleNamespace(actor=LocalRoleGroup(role, "actor"), critic=None, step=0,
                               prompts=SimpleNamespace(position=0), kl=KL(0.01), resume={}, best=BestMetric(""),
                               guard=HackingGuard("eval/sampled_accuracy", 3, 0.02), policy_version=0,
                               ahead=RolloutsAhead(lambda step: None, 1), evaluated_on={"all": 0},
                               cfg=SimpleNamespace(ckpt=SimpleNamespace(max_num=1, max_mem=None, disable_ds=False)))

    ckpt = "s3://models/ckpt/ppo"
    role = Role()
    writer = controller(role)
    run = None
    writer.guard.evaluated(0, {"eval/sampled_accuracy": 0.6})
    for step in (1, 2):
        role.weights = torch.full((3,), float(step))
        writer.guard.rollout(0.1 * step)
        writer.step, writer.prompts.position, writer.kl.coef = step, 8 * step, 0.01 * step
        writer.policy_version, writer.ahead.ready = step, {step: Rollout(["a sample"], {}, {}, step - 1)}
        run = checkpoint.save(writer, ckpt, run)
    assert listing(ckpt) == ["global_step2/actor/weights.pt", "global_step2/controller.pt", "latest",
                             "rlhf-checkpoints.json"] and not staged()

    reader = controller(Role())
    assert checkpoint.load(reader, ckpt) == run
    assert reader.step == 2 and reader.prompts.position == 16 and reader.kl.coef == pytest.approx(0.02)
    assert torch.equal(reader.actor.worker.weights, torch.full((3,), 2.0))
    assert reader.resume["checkpoint"] == f"{ckpt}/global_step2"
    assert reader.guard.state_dict() == writer.guard.state_dict()  # the reward-hacking guard's window
    assert reader.guard.evaluations[0].reward == 0.1 and reader.guard.rewards == [0.1, 0.2]
    assert reader.policy_version == 2 and reader.ahead.ready[2].version == 1  # an async run's batch sampled ahead


def test_a_retried_stage_claims_its_s3_checkpoint_folder_under_its_own_key(s3_endpoint):
    from orchestration.resume import MARKER, CheckpointMismatch, claim

    folder = "s3://models/run-claims/checkpoints/sft"
    assert claim(folder, "key-a", "sft") is False  # the first attempt starts from step 0
    assert claim(folder, "key-a", "sft") is True  # its retry resumes
    with pytest.raises(CheckpointMismatch, match=r"(?s)another configuration.*key-a.*key-b"):
        claim(folder, "key-b", "sft")
    s3().pipe("s3://models/run-claims/checkpoints/stray/latest", b"global_step5")
    with pytest.raises(CheckpointMismatch, match=MARKER):
        claim("s3://models/run-claims/checkpoints/stray", "key-a", "sft")
    assert storage.read_manifest(folder) is None  # a claimed folder is no stage output
