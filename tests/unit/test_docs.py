"""The documents the code cites are in the repository and cover what the code implements."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "orchestration")


def cited_documents() -> dict[str, list[str]]:
    """`{document: [file:line, ...]}` for every `*.md` the packages' source cites (in prose or comments)."""
    cited: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for m in re.finditer(r"[\w./-]+\.md\b", line):
                    before, after = line[m.start() - 1 : m.start()], line[m.end() : m.end() + 1]
                    if before and before == after and before in "\"'":
                        continue  # a quoted file name the code writes or reads ("report.md"), not a citation
                    cited.setdefault(m.group(), []).append(f"{path.relative_to(ROOT)}:{n}")
    return cited


def test_every_document_the_code_cites_exists():
    cited = cited_documents()
    assert "docs/algorithms.md" in cited
    missing = {doc: where for doc, where in cited.items() if not (ROOT / doc).is_file()}
    assert not missing, f"cited but not in the repository (paths are from the repository root): {missing}"


def test_the_algorithms_document_names_every_variant_the_registries_accept():
    from rlhf_core.algos.losses import DPO_LOSSES, KL_ESTIMATORS, REWARD_LOSSES

    text = (ROOT / "docs/algorithms.md").read_text()
    for registry in (DPO_LOSSES, KL_ESTIMATORS, REWARD_LOSSES):
        for variant in registry:
            assert re.search(rf"`{variant.value}`|\b{variant.value} =", text), variant


def test_the_algorithms_document_names_every_rl_estimator_and_aggregation_mode():
    from rlhf_core.algos.names import AdvantageEstimator, LossAggMode

    text = (ROOT / "docs/algorithms.md").read_text()
    for variant in (*AdvantageEstimator, *LossAggMode):
        assert f"`{variant.value}`" in text, variant
