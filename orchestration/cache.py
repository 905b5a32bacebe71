"""Cache keys: a stage is skipped when nothing that determines its output has changed.

The key hashes the stage name, its config hash (the semantic fields only, see
`rlhf_core.infra.manifests.config_hash`), the cache keys of the stages it consumes (which already cover
their own inputs, transitively), the content digests of datasets given directly, and the code
version. Prep's key is its parameters and the code version: prep is deterministic per seed.
Hub datasets and hub models cannot be digested offline; they enter the key by name, so a hub
dataset that changes upstream under the same name is not detected (pin a revision in the name).
"""

from __future__ import annotations

import hashlib
import json


def dataset_digest(specs: str | None) -> dict[str, str]:
    """`{spec: digest}` for comma-separated dataset specs: file bytes for local data, the name for hub data."""
    from rlhf_core.data.loading import file_digest, resolve_source

    if not specs:
        return {}
    digests = {}
    for spec in (s.strip() for s in specs.split(",") if s.strip()):
        source = resolve_source(spec)
        if source.data_files is None:
            digests[spec] = f"hub:{spec}"
            continue
        parts = [f"{split}={file_digest(path)}" for split, path in sorted(source.data_files.items())]
        digests[spec] = "sha256:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return digests


def cache_key(stage: str, config_hash: str, upstream: dict[str, str], datasets: dict[str, str],
              code_version: str) -> str:
    payload = {"stage": stage, "config": config_hash, "upstream": dict(sorted(upstream.items())),
               "datasets": dict(sorted(datasets.items())), "code": code_version}
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
