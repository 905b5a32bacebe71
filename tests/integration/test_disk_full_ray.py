"""A full disk under a stage of 2 Ray ranks: both write their part of a checkpoint into a real small
filesystem (a tmpfs; skipped where this process may not mount one). The stage fails with the
disk-full error (exit 2 through the CLI, so a pipeline does not retry it), no rank waits forever at
the checkpoint's barrier, and no partial checkpoint is left to hold the space.

Run under `flock /tmp/rlhf-ray.lock`: the 2-rank stage starts (and stops) a local Ray.
"""

from __future__ import annotations

import pytest

from tests.unit.test_disk_full import small_fs  # noqa: F401 - the fixture

pytestmark = [pytest.mark.integration]


def test_a_full_disk_under_two_ranks_fails_the_stage_clearly(prepared, small_fs, tmp_path, capsys):  # noqa: F811
    from rlhf_core.cli import main

    ckpt = small_fs(256 * 1024) / "ckpt"  # smaller than one rank's share of the first checkpoint
    args = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(tmp_path / "sft"),
            "apply_chat_template": "true", "max_len": "48", "train_batch_size": "16", "micro_train_batch_size": "8",
            "max_samples": "32", "max_eval_samples": "16", "max_steps": "2", "param_dtype": "fp32",
            "zero_stage": "2", "use_mlflow": "false", "save_steps": "1", "ckpt_path": str(ckpt),
            "num_gpus_per_node": "2"}
    code = main(["train", "sft", *[a for k, v in args.items() for a in (f"--{k}", v)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"rlhf: error: --ckpt_path {ckpt}: the disk is full (no space left) while writing the checkpoint " \
           "global_step1" in err, err
    assert "Traceback" not in err.split("rlhf: error:")[-1]
    assert not (ckpt / "latest").exists() and not list(ckpt.glob(".global_step*"))  # nothing half-written kept
    assert not (tmp_path / "sft").exists()
