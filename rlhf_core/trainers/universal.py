"""DeepSpeed universal checkpoints (`--ds.use_universal_ckpt`, OpenRLHF's `--use_ds_universal_ckpt`):
resume a run on another number of ranks.

A ZeRO checkpoint holds each rank's slice of the flattened fp32 weights and optimizer moments, cut
for the rank count that wrote it. DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`)
rewrites those slices per parameter (`zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt`);
an engine with `checkpoint.load_universal` cuts them again for its own ranks. OpenRLHF leaves the
conversion to the user; here a resume with the flag converts the tag it loads, once, into
`<tag>/universal/` (each node's first rank converts, the others wait), so the same command resumes
on any rank count (`load_engine`, the one loader of the supervised trainers and the RL roles).
With the flag the ZeRO stage asked for is kept on one CPU rank too (stage 0,
which one CPU rank otherwise trains at, has no slices to convert); the engine tags the model so
DeepSpeed writes what the converter needs (`distributed/engine.mark_convertible`).

Where the math allows the resumed run equals an uninterrupted one: weights, moments, schedule and
step come back exactly, and a global batch's gradient is the same average on any rank count (its
floating-point sum order aside). Random streams do not carry over between rank counts: each rank
that wrote none keeps its seeded stream, so with dropout the runs part.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import uuid
from argparse import Namespace
from pathlib import Path

import torch

from rlhf_core.distributed.engine import barrier
from rlhf_core.models.loading import strict_load
from rlhf_core.trainers.checkpoints import set_rng_state

FOLDER = "universal"


def universal_tag(tag_dir: Path, local_rank: int, barrier) -> tuple[str, str]:
    """(load_dir, tag) for DeepSpeed's universal load of the checkpoint in `tag_dir`, converting it
    into `tag_dir/universal` first where no one has; `barrier()` waits for every rank."""
    out = Path(tag_dir) / FOLDER
    if local_rank == 0 and not out.is_dir():
        if not glob.glob(str(Path(tag_dir) / "*optim_states.pt")):
            raise RuntimeError(f"--ds.use_universal_ckpt: checkpoint {tag_dir} holds no ZeRO optimizer slices (it was "
                               "written at ZeRO stage 0, by one CPU rank without --ds.use_universal_ckpt): resume it "
                               "on the rank count that wrote it, or write checkpoints with the flag")
        partial = Path(tag_dir) / f".{FOLDER}.{uuid.uuid4().hex[:8]}.partial"
        try:
            convert(Path(tag_dir), partial)
            partial.rename(out)
        except OSError:
            if not out.is_dir():  # not another node's conversion finished first: a real failure
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    barrier()
    return str(tag_dir), FOLDER


def convert(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's converter, in this process, its progress on stderr (stdout carries the manifest)."""
    from deepspeed.checkpoint.ds_to_universal import main

    args = Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1, num_merge_workers=1,
                     keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(sys.stderr):
        main(args)
    latest = out.parent / "latest_universal"  # the converter names its output beside it: not ours to keep
    if latest.is_file():
        latest.unlink()


def load_engine(engine, tag_dir: Path, rng: Path, universal: bool, flag: str) -> dict:
    """Load the DeepSpeed checkpoint in `tag_dir` (`<load_dir>/<tag>`) into `engine` and this rank's
    random state from `rng`; returns DeepSpeed's client state. `universal`: through the universal
    format (any rank count); a rank the writing run did not have then keeps its seeded stream, and
    without it that is an error naming the flag. 4-bit weights load non-strictly (`strict_load`).
    Every rank calls it (the conversion waits for all)."""
    load_dir, tag = str(tag_dir.parent), tag_dir.name
    if universal:
        load_dir, tag = universal_tag(tag_dir, int(os.environ.get("LOCAL_RANK", "0")), barrier)
    path, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=strict_load(engine))
    if path is None:
        raise RuntimeError(f"{flag}: DeepSpeed could not load the checkpoint in {tag_dir}")
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    elif not universal:
        raise RuntimeError(f"{flag}: {tag_dir} has no {rng.name}: the checkpoint was written by fewer ranks "
                           "(--ds.use_universal_ckpt resumes on another rank count)")
    return client or {}
