"""The README's main job, shrunk: `rlhf demo` runs prep -> SFT -> RM -> DPO through Ray and reports."""

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_runs_all_stages_and_reports(tmp_path):
    config = tmp_path / "demo.yaml"
    small = {"max_steps": 4, "max_eval_samples": 32}
    config.write_text(yaml.safe_dump({"prep": {"n_train": 512, "n_test": 32}, "sft": small, "rm": small,
                                      "dpo": small}))
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "demo", "--out", str(out), "--config",
                             str(config)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "demo_report.json").read_text())
    assert set(report["models"]) == {"sft", "rm", "dpo"}
    for stage in ("sft", "rm", "dpo"):
        assert (out / "models" / stage / "stage.json").exists()
    assert "exact match" in result.stdout and "MLflow UI" in result.stdout
    rm_manifest = json.loads((out / "models" / "rm" / "stage.json").read_text())
    assert rm_manifest["inputs"]["pretrain"] == str(out / "models" / "sft")


def test_demo_rejects_unknown_section(tmp_path, capsys):
    from rlhf_core.cli import main

    config = tmp_path / "demo.yaml"
    config.write_text("ppo: {beta: 1}\n")
    assert main(["demo", "--out", str(tmp_path / "d"), "--config", str(config)]) == 2
    assert "unknown section(s) ['ppo']" in capsys.readouterr().err
