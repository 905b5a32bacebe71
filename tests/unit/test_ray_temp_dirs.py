"""The local Ray's temp dirs (`/tmp/rlhf-ray-<pid>`) do not pile up: starting a cluster removes those
of ended clusters but the newest three, and nothing that is not such a dir."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rlhf_core.distributed.local_ray import KEEP_OLD_TEMP_DIRS, remove_stale_temp_dirs


def _gone_pids(n: int) -> list[int]:
    pids = []
    for _ in range(n):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        pids.append(child.pid)
    return pids


def _session_dir(parent, name: str, age_s: float):
    folder = parent / name
    (folder / "session_2026-11-25_10-00-00_000000_1" / "logs").mkdir(parents=True)
    (folder / "session_2026-11-25_10-00-00_000000_1" / "logs" / "raylet.out").write_text("log")
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_ended_clusters_dirs_go_but_the_newest_and_everything_not_ours_stays(tmp_path):
    gone = _gone_pids(KEEP_OLD_TEMP_DIRS + 2)
    ended = [_session_dir(tmp_path, f"rlhf-ray-{pid}", age_s=100 * (i + 1)) for i, pid in enumerate(gone)]
    live = _session_dir(tmp_path, f"rlhf-ray-{os.getpid()}", age_s=10_000)  # this process: its cluster may run
    no_session = tmp_path / f"rlhf-ray-{gone[0] + 100_000}"
    (no_session / "mine").mkdir(parents=True)  # not a Ray temp dir: someone else's folder
    not_a_pid = _session_dir(tmp_path, "rlhf-ray-keep", age_s=10_000)
    a_file = tmp_path / f"rlhf-ray-{gone[-1] + 100_001}"
    a_file.write_text("not a folder")

    removed = remove_stale_temp_dirs(str(tmp_path))

    newest, oldest = ended[:KEEP_OLD_TEMP_DIRS], ended[KEEP_OLD_TEMP_DIRS:]
    assert sorted(removed) == sorted(str(p) for p in oldest)
    for path in oldest:
        assert not path.exists(), path
    for path in (*newest, live, no_session, not_a_pid, a_file):
        assert path.exists(), path
    assert remove_stale_temp_dirs(str(tmp_path)) == []
