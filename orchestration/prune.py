"""`rlhf prune`: delete the pipeline outputs that nothing refers to any more.

Each pipeline run keeps its outputs, checkpoints and small files under `<output_root>/<run id>/`
(default `.rlhf/pipelines`; local only). An item is deleted only when all of these hold:

- it lies in a run folder named by an MLflow run id and carries a marker of ours: a stage output
  (`stage.json`, or `.rlhf-writing.json` unfinished), a checkpoint folder (`rlhf-checkpoints.json`
  or `rlhf-stage-key.json`), `configs/<stage>.yaml` of a run the store knows, or
  `pipeline_summary.json` naming its run. Anything without a marker is never deleted;
- no registered model version points at it (tag `rlhf.output_uri`; `--keep_registered aliased`:
  only versions with an alias count);
- it is not a cache entry: per cache key under the current code version, the newest finished
  output is kept (`--keep_cache all`: any code version; `none`: none kept for being one);
- it belongs to no recent run: the newest `--keep_last` runs, those within `--keep_days`, and
  every RUNNING run keep their folder and every output their stages used. A run left RUNNING by a
  dead process of this machine counts as ended (`--yes` marks it KILLED: `rlhf_core/infra/owner.py`);
  a run folder the store does not know is recent by its newest file's age.

What is kept keeps its upstream outputs (`rlhf.upstream.<role>.model_uri`), transitively, so a
registered policy can still be evaluated and continued.

Without `--yes` it only prints what it would delete (path, size, why). A stage output loses its
`stage.json` first, so a half-deleted output never looks finished. MLflow records and artifacts
are left to MLflow (`mlflow gc`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.infra.settings import ConfigError
from rlhf_core.infra.storage import (
    CHECKPOINTS,
    MANIFEST,
    WRITING,
    is_remote,
    newest_mtime,
    normalize_uri,
    tree_bytes,
)

STAGE_KEY = "rlhf-stage-key.json"  # orchestration/resume.py: the cache key that claimed a checkpoint folder
SUMMARY = "pipeline_summary.json"
DAY_MS = 86_400_000
RUN_ID = re.compile(r"[0-9a-f]{32}")  # MLflow's run ids: the flow's `<output_root>/<pipeline run id>`


@dataclass(frozen=True)
class Item:
    """One deletable thing: `kind` is output | unfinished output | checkpoints | config | summary."""

    path: Path
    kind: str
    run: str  # the pipeline run folder it lies in
    size: int


@dataclass
class StoreView:
    """What the MLflow store says (only what prune needs)."""

    runs: dict[str, dict] = field(default_factory=dict)  # pipeline run id -> {start_ms, status, stages}
    stage_runs: list[dict] = field(default_factory=list)  # {parent, name, status, start_ms, tags}
    registered: list[dict] = field(default_factory=list)  # {name, version, output_uri, aliases}


@dataclass
class Plan:
    delete: list[tuple[Item, str]]  # (item, why it goes)
    keep: list[tuple[Item, str]]  # (item, why it stays)
    foreign: list[Path]  # entries without a marker, never touched


# ---------------------------------------------------------------------------------------------
# The tree


def _marker_kind(folder: Path) -> str | None:
    if (folder / MANIFEST).is_file():
        return "output"
    if (folder / WRITING).is_file():
        return "unfinished output"
    if (folder / CHECKPOINTS).is_file() or (folder / STAGE_KEY).is_file():
        return "checkpoints"
    return None


def _summary_names(path: Path, run: str) -> bool:
    try:
        return json.loads(path.read_text()).get("pipeline_run_id") == run
    except (OSError, ValueError, AttributeError):
        return False


def scan(root: Path, stage_names: dict[str, set[str]]) -> tuple[list[Item], list[Path]]:
    """Every item the project wrote under `root` (not looking inside an item), and the foreign entries.

    `stage_names`: pipeline run id -> the stage names the store knows for it (for `configs/<name>.yaml`).
    """
    items: list[Item] = []
    foreign: list[Path] = []

    def visit(folder: Path, run: str, depth: int) -> None:
        for entry in sorted(folder.iterdir()):
            if entry.is_symlink():
                foreign.append(entry)
            elif entry.is_dir():
                kind = _marker_kind(entry)
                if kind is not None:
                    items.append(Item(entry, kind, run, tree_bytes(entry)))
                else:
                    visit(entry, run, depth + 1)
            elif depth == 0 and entry.name == SUMMARY and _summary_names(entry, run):
                items.append(Item(entry, "summary", run, tree_bytes(entry)))
            elif (depth == 1 and folder.name == "configs" and entry.suffix == ".yaml"
                  and entry.stem in stage_names.get(run, ())):
                items.append(Item(entry, "config", run, tree_bytes(entry)))
            else:
                foreign.append(entry)

    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        # The flow names a run's folder by its MLflow run id; anything else here is someone else's.
        if (run_dir.is_dir() and not run_dir.is_symlink() and RUN_ID.fullmatch(run_dir.name)
                and _marker_kind(run_dir) is None):
            visit(run_dir, run_dir.name, 0)
        else:
            foreign.append(run_dir)
    return items, foreign


# ---------------------------------------------------------------------------------------------
# What is referenced (pure: from a StoreView)


def _local(uri: str | None) -> Path | None:
    """A local URI as the flow records it (`storage.normalize_uri`: absolute, symlinks resolved)."""
    if not uri or is_remote(uri):
        return None
    return Path(normalize_uri(uri.removeprefix("json@")))


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def references(view: StoreView, root: Path, now_ms: int, keep_last: int, keep_days: float,
               keep_registered: str, keep_cache: str, code_version: str) -> dict[Path, str]:
    """Every local path something still refers to -> why (the first reason found)."""
    refs: dict[Path, str] = {}

    def add(uri: str | None, why: str) -> None:
        path = _local(uri)
        if path is not None and path not in refs:
            refs[path] = why

    # Recent and running pipeline runs: their folder, and everything their stages used.
    ordered = sorted(view.runs.items(), key=lambda kv: kv[1]["start_ms"], reverse=True)
    recent = {}
    for i, (run_id, info) in enumerate(ordered):
        age_days = (now_ms - info["start_ms"]) / DAY_MS
        if info["status"] == "RUNNING":
            recent[run_id] = "pipeline run still RUNNING"
        elif i < keep_last:
            recent[run_id] = f"one of the {keep_last} newest pipeline runs"
        elif age_days <= keep_days:
            recent[run_id] = f"pipeline run started {age_days:.1f} days ago (--keep_days {keep_days:g})"
    for run_id, why in recent.items():
        add(str(root / run_id), f"{why} ({run_id})")
    for stage in view.stage_runs:
        if stage["parent"] in recent:
            why = f"used by {recent[stage['parent']]} ({stage['parent']})"
            for key, value in stage["tags"].items():
                if key == "rlhf.output_uri" or key.startswith(("rlhf.upstream.", "rlhf.input.")) \
                        or key == "rlhf.checkpoint_uri":
                    if key.endswith(".run_id"):
                        continue
                    for uri in value.split(","):
                        add(uri.strip(), why)

    # Registered model versions.
    for version in view.registered:
        if keep_registered == "all" or version["aliases"]:
            aliases = f" @{','.join(version['aliases'])}" if version["aliases"] else ""
            add(version["output_uri"], f"registered {version['name']} v{version['version']}{aliases}")

    # Cache entries: per cache key, the newest finished output that still exists.
    if keep_cache != "none":
        newest: dict[str, dict] = {}
        for stage in view.stage_runs:
            tags = stage["tags"]
            key, uri = tags.get("rlhf.cache_key"), tags.get("rlhf.output_uri")
            if stage["status"] != "FINISHED" or not key or not uri:
                continue
            if keep_cache == "current" and tags.get("rlhf.code_version") != code_version:
                continue
            path = _local(uri)
            if path is None or not (path / MANIFEST).is_file():
                continue
            if key not in newest or stage["start_ms"] > newest[key]["start_ms"]:
                newest[key] = stage
        for stage in newest.values():
            add(stage["tags"]["rlhf.output_uri"], f"cache entry of {stage['name']} "
                f"(code version {stage['tags'].get('rlhf.code_version')})")

    # What is kept keeps its inputs: the upstream outputs of the stage runs that wrote it.
    by_output: dict[Path, list[dict]] = {}
    for stage in view.stage_runs:
        path = _local(stage["tags"].get("rlhf.output_uri"))
        if path is not None:
            by_output.setdefault(path, []).append(stage)
    queue = list(refs)
    while queue:
        path = queue.pop()
        for stage in by_output.get(path, []):
            for key, value in stage["tags"].items():
                if (key.startswith("rlhf.upstream.") and key.endswith(".model_uri")) or key.startswith("rlhf.input."):
                    for uri in value.split(","):  # an input may name several datasets
                        upstream = _local(uri.strip())
                        if upstream is not None and upstream not in refs:
                            refs[upstream] = f"input of {path.name} ({refs[path]})"
                            queue.append(upstream)
    return refs


def plan(items: list[Item], foreign: list[Path], refs: dict[Path, str], root: Path, known_runs: Iterable[str],
         now_s: float, keep_days: float) -> Plan:
    """Which items go: those no reference reaches (a reference inside an item, to it, or around it)."""
    known = set(known_runs)
    keep: list[tuple[Item, str]] = []
    delete: list[tuple[Item, str]] = []
    unknown_recent: dict[str, bool] = {}

    def reason_to_keep(item: Item) -> str | None:
        for ref, why in refs.items():
            if _inside(ref, item.path) or _inside(item.path, ref):
                return why
        if item.run not in known:
            if item.run not in unknown_recent:
                unknown_recent[item.run] = (now_s - newest_mtime(root / item.run)) / 86400 <= keep_days
            if unknown_recent[item.run]:
                return f"folder of no known pipeline run, changed within {keep_days:g} days"
        return None

    dependent = []  # configs and summaries follow the items of their run
    for item in items:
        if item.kind in ("config", "summary"):
            dependent.append(item)
            continue
        why = reason_to_keep(item)
        (keep if why else delete).append((item, why or _why_not(item, known)))
    kept_paths = {item.path for item, _ in keep}
    kept_runs = {item.run for item, _ in keep}
    for item in dependent:
        why = reason_to_keep(item)
        if why is None and item.kind == "config" and item.path.parent.parent / item.path.stem in kept_paths:
            why = f"config of the kept output {item.path.stem}"
        if why is None and item.kind == "summary" and item.run in kept_runs:
            why = "its run keeps outputs"
        (keep if why else delete).append((item, why or _why_not(item, known)))
    return Plan(delete, keep, foreign)


def _why_not(item: Item, known: set[str]) -> str:
    run = f"pipeline run {item.run}" if item.run in known else f"folder {item.run} (no pipeline run in the store)"
    return f"{item.kind} of {run}: not registered, not a current cache entry, not recent"


# ---------------------------------------------------------------------------------------------
# I/O: the MLflow store, deleting


def read_store(client) -> StoreView:
    """What the tracking store behind `client` (`lineage.client()`: bounded, retried) says."""
    from mlflow.entities import ViewType

    view = StoreView()
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    token = None
    while experiments:
        page = client.search_runs(experiments, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                  page_token=token)
        for run in page:
            tags = run.data.tags
            if tags.get("rlhf.kind") == "pipeline":
                view.runs[run.info.run_id] = {"start_ms": run.info.start_time or 0, "status": run.info.status,
                                              "stages": set()}
            elif tags.get("mlflow.parentRunId"):
                view.stage_runs.append({"parent": tags["mlflow.parentRunId"], "status": run.info.status,
                                        "name": tags.get("rlhf.stage_name") or tags.get("rlhf.stage", "?"),
                                        "start_ms": run.info.start_time or 0, "tags": dict(tags)})
        token = page.token
        if not token:
            break
    for stage in view.stage_runs:
        if stage["parent"] in view.runs:
            view.runs[stage["parent"]]["stages"].add(stage["name"])
    aliases: dict[tuple[str, str], list[str]] = {}  # search_model_versions leaves a version's aliases out
    token = None
    while True:
        page = client.search_registered_models(max_results=200, page_token=token)
        for model in page:
            for alias, version in (model.aliases or {}).items():
                aliases.setdefault((model.name, str(version)), []).append(alias)
        token = page.token
        if not token:
            break
    token = None
    while True:
        page = client.search_model_versions(max_results=200, page_token=token)
        for v in page:
            view.registered.append({"name": v.name, "version": v.version, "output_uri": v.tags.get("rlhf.output_uri"),
                                    "aliases": sorted(aliases.get((v.name, str(v.version)), []))})
        token = page.token
        if not token:
            break
    return view


def delete_item(item: Item, root: Path) -> None:
    """Remove one item (`stage.json` first), then the folders above it that it left empty."""
    if item.path.is_dir():
        (item.path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(item.path)
    else:
        item.path.unlink(missing_ok=True)
    parent = item.path.parent
    while parent != root and _inside(parent, root):
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent


def human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


# ---------------------------------------------------------------------------------------------
# The command


HELP = ("Delete pipeline outputs and checkpoints that no registered model, cache entry or recent run refers to "
        "(a dry run without --yes)")  # `rlhf prune` (registered in pyproject.toml)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_root", default=None, help="The pipelines' output folder (default: "
                        "$RLHF_HOME/pipelines, the flow's default settings.output_root); local only")
    parser.add_argument("--keep_last", type=int, default=5, help="Keep everything of the N newest pipeline runs "
                        "(default 5)")
    parser.add_argument("--keep_days", type=float, default=7.0, help="Keep everything of pipeline runs started "
                        "within D days (default 7)")
    parser.add_argument("--keep_registered", choices=["all", "aliased"], default="all",
                        help="Registered model versions whose outputs are kept: all (default) or only those with "
                        "an alias (champion, candidate)")
    parser.add_argument("--keep_cache", choices=["current", "all", "none"], default="current",
                        help="Keep each cache key's newest output: keys of the current code version (default), "
                        "of any version, or none")
    parser.add_argument("--yes", action="store_true", help="Delete (without it, only say what would be deleted)")


def run(args: argparse.Namespace) -> int:
    from rlhf_core.infra.manifests import code_version
    from rlhf_core.infra.settings import state_dir, tracking_uri

    if args.keep_last < 0:
        raise ConfigError(f"--keep_last must be >= 0, got {args.keep_last}")
    if not args.keep_days >= 0:
        raise ConfigError(f"--keep_days must be >= 0, got {args.keep_days}")
    root_arg = args.output_root or str(state_dir() / "pipelines")
    if is_remote(root_arg):
        raise ConfigError(f"--output_root {root_arg}: rlhf prune works on a local output root only")
    # Resolved like every path the flow records (a symlinked root would otherwise match no reference).
    root = Path(normalize_uri(root_arg))
    if not root.is_dir():
        print(f"nothing to prune: {root} does not exist")
        return 0
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise ConfigError(f"no MLflow store at {uri}: prune decides what is still referenced from it; set "
                          "MLFLOW_TRACKING_URI (or RLHF_HOME) to the store the pipeline runs recorded into")
    from mlflow.entities import ViewType

    from orchestration.lineage import client, close_orphans, orphaned_runs

    store = client()
    # A run left RUNNING by a process of this machine that was killed is not running (rlhf_core/infra/owner.py).
    orphans = orphaned_runs(store, [e.experiment_id for e in store.search_experiments(view_type=ViewType.ALL)])
    if orphans:
        ids = ", ".join(run.info.run_id for run in orphans)
        if args.yes:
            close_orphans(store, orphans)
            print(f"marked {len(orphans)} MLflow run(s) KILLED: RUNNING, but their process on this machine is gone: {ids}")
        else:
            print(f"{len(orphans)} MLflow run(s) are RUNNING but their process on this machine is gone; counted as "
                  f"ended (--yes also marks them KILLED): {ids}")
    view = read_store(store)
    for run in orphans:
        if run.info.run_id in view.runs:
            view.runs[run.info.run_id]["status"] = "KILLED"
    items, foreign = scan(root, {run_id: info["stages"] for run_id, info in view.runs.items()})
    refs = references(view, root, int(time.time() * 1000), args.keep_last, args.keep_days, args.keep_registered,
                      args.keep_cache, code_version())
    result = plan(items, foreign, refs, root, view.runs, time.time(), args.keep_days)

    total = sum(item.size for item, _ in result.delete)
    verb = "deleting" if args.yes else "would delete"
    print(f"{verb} {len(result.delete)} item(s) under {root}, {human(total)}"
          + ("" if args.yes or not result.delete else " (run again with --yes to delete them)") + ":")
    for item, why in result.delete:
        print(f"  {human(item.size):>10}  {item.path}  ({why})")
        if args.yes:
            delete_item(item, root)
    kept = sum(item.size for item, _ in result.keep)
    print(f"kept {len(result.keep)} item(s), {human(kept)}:")
    for item, why in result.keep:
        print(f"  {human(item.size):>10}  {item.path}  ({why})")
    if result.foreign:
        print(f"left alone {len(result.foreign)} entr{'y' if len(result.foreign) == 1 else 'ies'} not written by "
              f"a stage or the flow, e.g. {result.foreign[0]}")
    print(f"total: {human(total)} {'deleted' if args.yes else 'to delete'}", file=sys.stdout)
    return 0
