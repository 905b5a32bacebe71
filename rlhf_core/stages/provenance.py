"""`rlhf lineage MODEL_URI_OR_RUN`: where did this model come from?

Walks the MLflow lineage tags that pipeline stage runs carry (`rlhf.upstream.<role>.run_id`, see
`orchestration/lineage.py`) from a model back to the prep run that built the base model and the data,
and prints each stage with its output, config hash, code version, datasets (name and digest) and
the parameters that differ from their defaults. A cached stage points at the run that trained
it (`rlhf.cached_from`). Runs made by `rlhf train` outside a pipeline have no upstream tags;
for them the walk follows `stage.json`'s inputs to the run that wrote that model, when one did.

Accepted references: an MLflow run id, `models:/NAME/VERSION`, `models:/NAME@ALIAS`, or a stage
output location (local path or s3:// URI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlhf_core.infra import storage
from rlhf_core.infra.settings import tracking_uri


class LineageError(ValueError):
    """The reference matches no run."""


@dataclass
class Node:
    role: str
    run_id: str
    stage: str
    name: str
    output_uri: str | None
    config_hash: str | None
    code_version: str | None
    status: str
    cached_from: str | None
    datasets: list[str]
    params: dict[str, str]
    parents: list[Node] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "parents"}
        d["parents"] = [p.to_dict() for p in self.parents]
        return d


def _client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri())


def resolve(ref: str):
    """The MLflow run behind a run id, a `models:/` URI or a stage output location."""
    from mlflow.exceptions import MlflowException

    c = _client()
    if ref.startswith("models:/"):
        body = ref[len("models:/") :]
        try:
            if "@" in body:
                name, alias = body.split("@", 1)
                version = c.get_model_version_by_alias(name, alias)
            else:
                name, number = body.rsplit("/", 1)
                version = c.get_model_version(name, number)
        except MlflowException as e:
            raise LineageError(f"{ref}: no such registered model version ({e.message})") from None
        return c.get_run(version.run_id)
    if "/" not in ref and ":" not in ref:
        try:
            return c.get_run(ref)
        except MlflowException as e:  # not a run id: try it as an output location below
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
    uri = storage.normalize_uri(ref)
    run = _run_by_output(uri)
    if run is None:
        raise LineageError(f"{ref}: no MLflow run with that id, registered model or output location "
                           f"(tracking URI {tracking_uri()})")
    return run


def _run_by_output(uri: str):
    c = _client()
    experiments = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(experiments, filter_string=f"tags.`rlhf.output_uri` = '{uri}'",
                         order_by=["attributes.start_time ASC"], max_results=50)
    trained = [r for r in runs if "rlhf.cached_from" not in r.data.tags]
    return (trained or runs or [None])[0]


def build(ref: str, max_depth: int = 20) -> Node:
    """The lineage tree of `ref`, upstream stages as parents."""
    return _node(resolve(ref), "model", max_depth, set())


def _node(run, role: str, depth: int, seen: set[str]) -> Node:
    from mlflow.exceptions import MlflowException

    c = _client()
    tags = run.data.tags
    source = run
    if tags.get("rlhf.cached_from"):
        source = c.get_run(tags["rlhf.cached_from"])
    stags = source.data.tags
    datasets = [f"{d.dataset.name} {d.dataset.digest}" for d in (source.inputs.dataset_inputs or [])]
    params = params_off_default(stags.get("rlhf.stage", tags.get("rlhf.stage", "")), source.data.params)
    node = Node(role, run.info.run_id, tags.get("rlhf.stage", "?"), tags.get("mlflow.runName", ""),
                tags.get("rlhf.output_uri") or stags.get("rlhf.output_uri"),
                stags.get("rlhf.config_hash"), stags.get("rlhf.code_version"), run.info.status,
                tags.get("rlhf.cached_from"), datasets, params)
    seen.add(run.info.run_id)
    if depth <= 0:
        return node
    upstream = _upstream_tags(tags) or _upstream_tags(stags)
    if not upstream:
        upstream = _upstream_from_manifest(node.output_uri)
    # One model in several roles (PPO's SFT as actor and reference, its reward model as reward and
    # critic start) is one parent whose role lists them all.
    roles: dict[str, list[str]] = {}
    for up_role, run_id in sorted(upstream.items()):
        roles.setdefault(run_id, []).append(up_role)
    # The model a stage started from first, so its branch holds the shared ancestors.
    for run_id, names in sorted(roles.items(), key=lambda item: ("model" not in item[1], item[1])):
        up_role = ", ".join(names)
        if run_id in seen:
            node.parents.append(Node(up_role, run_id, "(shown above)", "", None, None, None, "", None, [], {}))
            continue
        try:
            parent = c.get_run(run_id)
        except MlflowException as e:  # a deleted run ends that branch, visibly; other errors are errors
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            node.parents.append(Node(up_role, run_id, "(run deleted)", "", None, None, None, "", None, [], {}))
            continue
        node.parents.append(_node(parent, up_role, depth - 1, seen))
    return node


def params_off_default(stage: str, params: dict[str, str]) -> dict[str, str]:
    """The logged params of a `stage` run whose value differs from the stage config's default.

    Stages without a config class (prep) show every param. Params of another code version that
    the config no longer has are shown too: they differ from what a default run would log."""
    from rlhf_core.config import ROLLOUT_STAGE_CONFIGS, STAGE_CONFIGS
    from rlhf_core.infra.manifests import not_semantic_paths
    from rlhf_core.infra.tracking import redact_params
    from rlhf_core.rl_config import PPOConfig

    config_cls = STAGE_CONFIGS.get(stage) or ROLLOUT_STAGE_CONFIGS.get(stage) or {"ppo": PPOConfig}.get(stage)
    defaults = redact_params(config_cls.model_construct().model_dump(mode="json")) if config_cls else {}
    # Paths and tracking (NOT_SEMANTIC fields) are the tree's parents, outputs and datasets, or noise.
    hidden = not_semantic_paths(config_cls) if config_cls else set()
    return {k: v for k, v in params.items() if k not in hidden and defaults.get(k) != v}


def _upstream_tags(tags: dict) -> dict[str, str]:
    return {key.split(".")[2]: value for key, value in tags.items()
            if key.startswith("rlhf.upstream.") and key.endswith(".run_id")}


def _upstream_from_manifest(output_uri: str | None) -> dict[str, str]:
    """For runs outside a pipeline: the runs that wrote the models named in stage.json's inputs."""
    manifest = storage.read_manifest(output_uri) if output_uri else None
    found = {}
    for role in ("pretrain", "ref_pretrain", "reward_pretrain"):
        uri = (manifest or {}).get("inputs", {}).get(role)
        if uri:
            run = _run_by_output(storage.normalize_uri(uri))
            if run is not None:
                found[role] = run.info.run_id
    return found


def render(node: Node, indent: str = "") -> str:
    """A text tree: the model first, each upstream stage indented below what it fed."""
    head = f"{indent}{node.stage} [{node.role}]  run {node.run_id}  {node.status}"
    lines = [head]
    pad = indent + "    "
    if node.cached_from:
        lines.append(f"{pad}cached from run {node.cached_from}")
    if node.output_uri:
        lines.append(f"{pad}output   {node.output_uri}")
    if node.config_hash:
        lines.append(f"{pad}config   {node.config_hash}")
    if node.code_version:
        lines.append(f"{pad}code     {node.code_version}")
    for d in node.datasets:
        lines.append(f"{pad}data     {d}")
    if node.params:
        lines.append(f"{pad}params   " + ", ".join(f"{k}={v}" for k, v in sorted(node.params.items())))
    for parent in node.parents:
        lines.append(render(parent, pad))
    return "\n".join(lines)


def lineage_json(node: Node) -> str:
    return json.dumps(node.to_dict(), indent=2)
