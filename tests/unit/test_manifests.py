"""rlhf_core/infra/manifests.py: the code version, a digest of the source itself."""

from __future__ import annotations

import os
import sys

# ---------------------------------------------------------------------------------------------
# The code version: a digest of the source itself, so uncommitted edits and installs without git
# get keys of their own.

def source_copy(tmp_path):
    """A copy of the source packages (with whatever __pycache__ they hold), outside any git checkout."""
    import shutil
    from pathlib import Path

    import rlhf_core
    from rlhf_core.infra.manifests import SOURCE_PACKAGES

    here = Path(rlhf_core.__file__).resolve().parents[1]
    root = tmp_path / "src"
    for package in SOURCE_PACKAGES:
        shutil.copytree(here / package, root / package)
    return root


def test_source_digest_moves_with_source_bytes_and_nothing_else(tmp_path):
    import os
    import shutil

    from rlhf_core.infra.manifests import NOT_IN_CODE_VERSION, source_digest, source_files

    assert NOT_IN_CODE_VERSION == {"rlhf_core/stages/provenance.py", "flows/cli.py", "orchestration/reports.py", "orchestration/lineage.py"}
    root = source_copy(tmp_path)
    base = source_digest(root)
    assert source_digest(root) == base and {"rlhf_core/algos/losses.py", "flows/pipeline.py"} <= set(source_files(root))

    losses = root / "rlhf_core" / "algos" / "losses.py"
    original = losses.read_bytes()
    losses.write_bytes(original.replace(b"KL_CLAMP = 10.0", b"KL_CLAMP = 20.0"))
    assert source_digest(root) != base
    losses.write_bytes(original)
    os.utime(losses, (0, 0))  # bytes, not timestamps
    assert source_digest(root) == base

    (root / "flows" / "ppo.py").write_text("")  # a new module counts at once, even an empty one
    assert source_digest(root) != base
    (root / "flows" / "ppo.py").unlink()
    shutil.move(root / "orchestration" / "cache.py", root / "orchestration" / "keys.py")  # paths count, not only bytes
    assert source_digest(root) != base
    shutil.move(root / "orchestration" / "keys.py", root / "orchestration" / "cache.py")

    (root / "rlhf_core" / "__pycache__").mkdir(exist_ok=True)
    (root / "rlhf_core" / "__pycache__" / "losses.cpython-312.pyc").write_bytes(b"compiled")
    (root / "rlhf_core" / "notes.txt").write_text("not source")
    (root / "orchestration" / "reports.py").write_text("# only renders what the jobs wrote\n")
    assert source_digest(root) == base


def test_code_version_is_the_digest_of_the_running_source_outside_git(tmp_path):
    import subprocess
    from pathlib import Path

    import rlhf_core.infra.manifests
    from rlhf_core.infra.manifests import code_version, source_digest

    here = Path(rlhf_core.infra.manifests.__file__).resolve().parents[2]
    assert code_version().endswith(f"+src.{source_digest(here)[:12]}")

    root = source_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}

    def version_there() -> str:
        code = "import rlhf_core.infra.manifests as v; print(v.__file__); print(v.code_version())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                             env=env).stdout.split()
        assert out[0] == str(root / "rlhf_core" / "infra" / "manifests.py")
        return out[1]

    first = version_there()
    assert first == code_version()  # the same bytes give the same version wherever they live
    path = root / "rlhf_core" / "trainers" / "dpo.py"
    path.write_text(path.read_text() + "\n# an uncommitted edit\n")
    assert version_there() != first


def test_the_not_semantic_marker_keeps_places_and_tracking_out_of_config_hashes_at_every_depth():
    from pydantic import BaseModel, Field

    from rlhf_core.config import SFTConfig, with_updates
    from rlhf_core.infra.manifests import NOT_SEMANTIC, config_hash, not_semantic_paths, semantic_values

    class Section(BaseModel):
        lr: float = 1.0
        path: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)

    class Config(BaseModel):
        section: Section = Field(default_factory=Section)
        seed: int = 1
        out: str = Field("o", json_schema_extra=NOT_SEMANTIC)

    assert semantic_values(Config()) == {"section": {"lr": 1.0}, "seed": 1}
    assert not_semantic_paths(Config) == {"section.path", "out"}
    assert config_hash(Config(out="x", section=Section(path="p"))) == config_hash(Config())
    assert config_hash(Config(section=Section(lr=2.0))) != config_hash(Config())  # a semantic field moves it

    sft = SFTConfig(pretrain="/m", save_path="/o", data={"dataset": "json@/d"})
    assert config_hash(sft) == config_hash(SFTConfig(pretrain="/n", save_path="/p", use_mlflow=False,
                                                     data={"dataset": "json@/e"}))
    assert config_hash(sft) != config_hash(with_updates(sft, learning_rate=1e-3))
