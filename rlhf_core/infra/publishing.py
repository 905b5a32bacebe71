"""How every stage publishes its output to `save_path`: `publish_output` (trainers, `rlhf eval`, `rlhf pairs`).

The output is built in a temporary sibling of `save_path` (same filesystem), then handed to
`storage.publish_dir`, which renames or uploads it and writes `stage.json` last, so nothing
half-written looks finished. Model weights come in through a `write` callback, so this module
needs nothing above infra.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from rlhf_core.infra import storage
from rlhf_core.infra.manifests import stage_manifest
from rlhf_core.infra.tracking import Tracker


def publish_output(cfg, tracker: Tracker, inputs: dict, metrics: dict, *,
                   write: Callable[[Path], object] | None = None, files: dict[str, str] | None = None,
                   precision: str | None = None, resume: dict | None = None, trained: bool = False) -> dict:
    """Publish a stage's output to `cfg.save_path` atomically and record it on `tracker`'s run; returns
    the manifest (`stage.json`).

    The output: what `write(folder)` puts in an empty folder, plus `files` (name -> UTF-8 text).
    `stage.json`: `stage_manifest(cfg, inputs, metrics, ...)` with `precision`, `resume` (where
    training started, when given) and `output_uri`. The run gets the tags `rlhf.output_uri` and
    `rlhf.config_hash`, the manifest's metrics at step 0, and `stage.json` and any `.json` of
    `files` as artifacts.

    `trained`: a trainer's output. A failure says its checkpoints are kept, and the final metrics
    go to the run as `<name, / as _>_final` (the step-by-step ones have the plain names).
    """
    files = files or {}
    manifest = stage_manifest(cfg, inputs, metrics, tracker.run_id, precision=precision)
    if resume is not None:
        manifest["resume"] = resume
    manifest["output_uri"] = storage.normalize_uri(cfg.save_path)
    local_parent = None if storage.is_remote(cfg.save_path) else Path(manifest["output_uri"]).parent
    if local_parent is not None:
        local_parent.mkdir(parents=True, exist_ok=True)
    not_published = f"nothing was published at {cfg.save_path}"
    if trained:
        ckpt_path = getattr(cfg, "ckpt_path", None)
        not_published += "; checkpoints are kept" + (f" in {ckpt_path}" if ckpt_path else "")
    # A full disk (DiskFullError, exit 2) removes what was built and leaves an earlier output as it was.
    with tempfile.TemporaryDirectory(dir=local_parent, prefix=".rlhf-save-") as tmp, storage.saving(
            "--save_path", cfg.save_path, f"output of {cfg.stage}", "the previous output there is as it was"):
        out = Path(tmp) / ("model" if trained else "out")
        out.mkdir()
        if write is not None:
            write(out)
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
        # The run must be able to record the output before it is published (RLHF_STORE_WAIT_S), and a
        # record that fails withdraws it (`Tracker.published`): nothing looks finished whose run did not.
        tracker.await_store(not_published)
        storage.publish_dir(out, cfg.save_path, manifest, storage.stage_inputs(cfg))
        tracker.published(manifest["output_uri"], cfg.stage)
    tracker.set_tags({"rlhf.output_uri": manifest["output_uri"], "rlhf.config_hash": manifest["config_hash"]})
    final = ({k.replace("/", "_") + "_final": v for k, v in manifest["metrics"].items()} if trained
             else manifest["metrics"])
    tracker.log_metrics(final, step=0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in {**files, storage.MANIFEST: json.dumps(manifest, indent=2, sort_keys=True)}.items():
            if name.endswith(".json"):
                (Path(tmp) / name).write_text(text, encoding="utf-8")
                tracker.log_artifact(str(Path(tmp) / name))
    return manifest
