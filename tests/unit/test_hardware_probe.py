"""orchestration/hardware.py: a local cluster's answer is this machine's, remembered across runs
while nothing that decides it changes; a cluster of RAY_ADDRESS is asked every run."""

import json
from pathlib import Path

import pytest

from orchestration import hardware
from tests.unit.flow_helpers import hardware as answer_of


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """The probe's job replaced by a counter answering like a CPU without native bf16."""
    monkeypatch.setenv("RLHF_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "_probe", lambda address, log: calls.append(address) or answer_of(False))
    monkeypatch.setattr(hardware, "local_cluster", lambda address: object() if "local" in address else None)
    return calls


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="no boot id here: nothing is kept")
def test_a_local_clusters_answer_is_probed_once_per_machine(probes, monkeypatch, tmp_path):
    lines = []
    first = hardware.probe_cluster("http://local:8265", lines.append)
    again = hardware.probe_cluster("http://local:8266", lines.append)  # the next run's cluster
    assert first == again == answer_of(False) and probes == ["http://local:8265"]
    assert "as probed by an earlier run" in lines[-1]
    assert json.loads((tmp_path / "hardware.json").read_text()) == {hardware.machine_key(): answer_of(False)}

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what the ranks may see changed: ask again
    hardware.probe_cluster("http://local:8267", lines.append)
    assert probes == ["http://local:8265", "http://local:8267"]


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="no boot id here: nothing is kept")
def test_a_remembered_answer_without_every_precision_is_asked_again(probes, tmp_path):
    partial = {**answer_of(False), "precision": {"fp32": "fp32"}}  # from code that knew fewer precisions
    (tmp_path / "hardware.json").write_text(json.dumps({hardware.machine_key(): partial}))
    assert hardware.probe_cluster("http://local:8265", print) == answer_of(False) and len(probes) == 1


def test_a_cluster_of_ray_address_is_asked_every_run(probes, tmp_path):
    for _ in range(2):
        hardware.probe_cluster("http://head:8265", print)
    assert probes == ["http://head:8265"] * 2 and not (tmp_path / "hardware.json").exists()
