"""`--use_ms` (OpenRLHF's): hub names resolve on ModelScope. No network here: a stand-in for
modelscope's `patch_hub` records which processes would fetch from ModelScope."""

from __future__ import annotations

import json
import sys
import types

import pytest

from rlhf_core.cli import main
from rlhf_core.infra import hubs


@pytest.fixture
def fake_modelscope(monkeypatch):
    calls = []
    hf_util = types.ModuleType("modelscope.utils.hf_util")
    hf_util.patch_hub = lambda: calls.append("patch_hub")
    for name, module in {"modelscope": types.ModuleType("modelscope"),
                         "modelscope.utils": types.ModuleType("modelscope.utils"),
                         "modelscope.utils.hf_util": hf_util}.items():
        module.__spec__ = types.SimpleNamespace(name=name)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(hubs, "_PATCHED", False)
    # set, then removed: monkeypatch then restores its absence, so what the test sets does not reach later
    # tests (a vLLM engine started by one would look for ModelScope)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "")
    monkeypatch.delenv("VLLM_USE_MODELSCOPE")
    return calls


def test_use_ms_patches_the_hub_in_the_process_that_loads(fake_modelscope, prepared, tmp_path, capsys, monkeypatch):
    import os

    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
                 "--apply_chat_template", "--max_len", "48", "--max_samples", "32", "--train_batch_size", "16",
                 "--max_steps", "1", "--use_ms", "--save_path", str(tmp_path / "out"), "--use_mlflow", "false"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert fake_modelscope == ["patch_hub"]  # the driver and its in-process rank: one patch
    assert os.environ["VLLM_USE_MODELSCOPE"] == "True"  # and a vLLM engine started from here reads ModelScope
    manifest = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert manifest["stage"] == "sft"


def test_use_ms_without_modelscope_is_a_clear_error(monkeypatch, tmp_path, capsys, prepared):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "modelscope" else real(name, *a))
    monkeypatch.setattr(hubs, "_PATCHED", False)
    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
                 "--apply_chat_template", "--use_ms", "--save_path", str(tmp_path / "out"), "--use_mlflow", "false"])
    assert code == 2
    assert "--use_ms needs the modelscope package: pip install modelscope" in capsys.readouterr().err
