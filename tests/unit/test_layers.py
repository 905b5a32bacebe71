"""The layers of the code base (docs/architecture.md), read off every module's imports, the ones
inside functions included: an import runs down the order or stays in its layer, never up, and
no set of modules imports itself round in a circle. The library (`rlhf_core`) never imports the
orchestration layer or Prefect, so a Ray job's `rlhf train` runs where Prefect is not installed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "orchestration")
# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS = (
    ("pure math", ("rlhf_core.algos",)),
    ("infrastructure", ("rlhf_core.infra",)),
    ("configuration, data and models", ("rlhf_core.flags", "rlhf_core.config", "rlhf_core.rl_config", "rlhf_core.data",
                                        "rlhf_core.models")),
    ("distributed", ("rlhf_core.distributed",)),
    ("rollout and rewards", ("rlhf_core.rollout", "rlhf_core.rewards")),
    ("RL and trainers", ("rlhf_core.rl", "rlhf_core.trainers")),
    ("stages", ("rlhf_core.stages",)),
    ("the library's CLI", ("rlhf_core.cli", "rlhf_core")),
    ("orchestration", ("flows", "orchestration")),
)
ORCHESTRATION_ONLY = ("flows", "orchestration", "prefect")  # never imported by rlhf_core


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module name an import statement anywhere in the file names (absolute form)."""
    names = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            # `from a.b import c` imports module a.b.c when there is one, else a name of a.b
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> project modules it imports, module -> every name it imports)."""
    mods = modules()
    graph, raw = {}, {}
    for name, path in mods.items():
        raw[name] = imported_names(name, path, mods)
        targets = set()
        for imported in raw[name]:
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph, raw


def layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()[0]) == []


def test_every_import_runs_down_the_layers():
    graph, _ = import_graph()
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))
    assert upward == []


def test_the_library_never_imports_orchestration_or_prefect():
    _, raw = import_graph()
    found = sorted(f"{m} imports {n}" for m, names in raw.items() if m.split(".")[0] == "rlhf_core"
                   for n in names if n.split(".")[0] in ORCHESTRATION_ONLY)
    assert found == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """Not vacuous: the same functions catch what they are there to catch."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer_of("rlhf_core.infra.storage") < layer_of("rlhf_core.trainers.sft") < layer_of("flows.pipeline")
    graph, raw = import_graph()
    assert "rlhf_core.infra.settings" in graph["rlhf_core.infra.storage"], "function-local imports are read too"
    assert any(n.startswith("prefect") for n in raw["flows.pipeline"])


def test_flows_and_orchestration_never_import_torch():
    import subprocess

    code = ("import sys, flows.pipeline, flows.cli, orchestration.stages; from rlhf_core.infra.manifests import code_version; "
            "code_version(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
