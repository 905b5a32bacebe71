"""DeepSpeed universal checkpoints (`--ds.use_universal_ckpt`, OpenRLHF's `--use_ds_universal_ckpt`):
resume a run on another number of ranks.

A ZeRO checkpoint holds each rank's slice of the flattened fp32 weights and optimizer moments, cut
for the rank count that wrote it. DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`)
rewrites those slices per parameter (`zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt`);
an engine with `checkpoint.load_universal` cuts them again for its own ranks. OpenRLHF leaves the
conversion to the user; here a resume with the flag converts the tag it loads, once, into
`<tag>/universal/` (each node's first rank converts, the others wait), so the same command resumes
on any rank count. With the flag the ZeRO stage asked for is kept on one CPU rank too (stage 0,
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


def rng_file(tag_dir: Path, name: str) -> Path | None:
    """This rank's random state in the checkpoint, or None where the run that wrote it had fewer ranks."""
    path = Path(tag_dir) / name
    return path if path.is_file() else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
