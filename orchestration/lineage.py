"""MLflow lineage for pipeline runs: parent and child runs, cache lookups, the model registry.

One parent run per pipeline run; one child run per stage, created here before its Ray job is
submitted and handed over through `MLFLOW_RUN_ID`, so the job logs into a run that already
carries its lineage tags:

    rlhf.stage, rlhf.pipeline_run_id, rlhf.prefect_flow_run_id, rlhf.code_version,
    rlhf.cache_key, rlhf.upstream_run_ids (comma-separated), rlhf.upstream.<stage>.run_id,
    rlhf.upstream.<stage>.model_uri, rlhf.input.<role> (a model no stage of the run made: `model`,
    `reference`), rlhf.output_uri (set by the job), rlhf.cached_from

Everything uses `MlflowClient` with explicit run ids (no fluent active run), so several stage
tasks share one process safely.

Registry: `rlhf-sft`, `rlhf-reward`, `rlhf-policy` (DPO and PPO alike; tag `rlhf.stage` tells
them apart); the newest version gets `candidate`; `promote` moves `champion` only when the metric
beats the champion's. A version's `source` is the output URI when remote; a tracking server
refuses local paths outside a run's artifacts, so a local output is registered as the run's
`stage.json` artifact, its folder in the version tag `rlhf.output_uri` (what consumers read).
"""

from __future__ import annotations

import time

from mlflow.exceptions import MlflowException

from rlhf_core.infra import reachability, storage
from rlhf_core.infra.mlflow_ops import ensure_experiment
from rlhf_core.infra.redaction import redact, redact_text
from rlhf_core.infra.settings import tracking_uri
from rlhf_core.infra.tracking import redact_params

POLICY_MODEL = "rlhf-policy"  # every policy stage (DPO, PPO, iterative rounds) registers here
STUDENT_MODEL = "rlhf-student"  # a smaller policy distilled from the run's policy (stage distill)
REGISTERED_NAMES = {"sft": "rlhf-sft", "rm": "rlhf-reward", "prm": "rlhf-prm", "dpo": POLICY_MODEL, "ppo": POLICY_MODEL,
                    "rejection_sampling": POLICY_MODEL, "conditional_sft": POLICY_MODEL, "distill": STUDENT_MODEL}
CANDIDATE, CHAMPION = "candidate", "champion"


def client():
    """A client for the tracking store once it answers (a server within RLHF_STORE_CHECK_S, else
    `StoreUnavailable`), every call retried up to RLHF_STORE_WAIT_S (`reachability.RetryingClient`)."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    reachability.bound_mlflow_requests()
    if reachability.is_server(uri):
        reachability.wait_until_reachable("MLflow tracking server", reachability.mlflow_health_url(uri), reachability.store_check_s(),
                                    "RLHF_STORE_CHECK_S", "when the pipeline had to record in it")
    return reachability.RetryingClient(MlflowClient(tracking_uri=uri), uri)


def start_pipeline_run(experiment: str, name: str, tags: dict[str, str], params: dict[str, str]) -> str:
    c = client()  # the flow's first word with MLflow: a store that is away fails here, within the bound
    experiment_id = ensure_experiment(experiment)
    run = c.create_run(experiment_id, run_name=name, tags=redact({"rlhf.kind": "pipeline", **tags}))
    items = list(redact_params(params).items())
    for i in range(0, len(items), 100):
        from mlflow.entities import Param

        c.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in items[i : i + 100]])
    return run.info.run_id


def start_stage_run(parent_run_id: str, stage: str, name: str, tags: dict[str, str]) -> str:
    c = client()
    experiment_id = c.get_run(parent_run_id).info.experiment_id
    run = c.create_run(experiment_id, run_name=name,
                       tags=redact({"mlflow.parentRunId": parent_run_id, "rlhf.stage": stage, **tags}))
    return run.info.run_id


def end_run(run_id: str, status: str = "FINISHED") -> None:
    """Mark a run terminated unless its job already did (a job that failed early leaves it RUNNING)."""
    c = client()
    if c.get_run(run_id).info.status == "RUNNING" or status != "FINISHED":
        c.set_terminated(run_id, status)


def orphaned_runs(c, experiment_ids: list[str]) -> list:
    """The RUNNING runs of these experiments whose owning process (tag `rlhf.owner`) ran on this
    machine and is gone (`rlhf_core.infra.owner`): killed before it could close them. Runs owned on other
    machines, or by a live process, are not among them."""
    from rlhf_core.infra.owner import OWNER_TAG, is_gone, machine

    if not experiment_ids:
        return []
    where = machine().replace("'", "")
    found, token = [], None
    while True:
        page = c.search_runs(experiment_ids, filter_string=f"attributes.status = 'RUNNING' and "
                             f"tags.`{OWNER_TAG}` LIKE '{where}|%'", max_results=1000, page_token=token)
        found += [run for run in page if is_gone(run.data.tags.get(OWNER_TAG))]
        token = page.token
        if not token:
            return found


def close_orphans(c, runs: list) -> None:
    """Mark each of `orphaned_runs`' runs KILLED, saying why in `rlhf.error` (what its owner would
    have written had it been able to)."""
    from rlhf_core.infra.owner import OWNER_TAG, parse

    for run in runs:
        parsed = parse(run.data.tags.get(OWNER_TAG))
        pid = parsed[1] if parsed else "?"
        c.set_tag(run.info.run_id, "rlhf.error", f"its process (pid {pid} on this machine) ended without closing the "
                  "run: killed (SIGKILL, out of memory) or its session ended; marked KILLED by a later process")
        c.set_terminated(run.info.run_id, "KILLED")


def close_orphans_of(experiment: str) -> list[str]:
    """`close_orphans` for one experiment, by name (none if it does not exist yet): the run ids closed."""
    c = client()
    exp = c.get_experiment_by_name(experiment)
    runs = orphaned_runs(c, [exp.experiment_id]) if exp is not None else []
    close_orphans(c, runs)
    return [run.info.run_id for run in runs]


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    c = client()
    for key, value in tags.items():
        c.set_tag(run_id, key, redact_text(str(value)))


def log_metrics(run_id: str, metrics: dict[str, float]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    c = client()
    c.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])


def get_run(run_id: str):
    return client().get_run(run_id)


def find_cached(experiment: str, cache_key: str):
    """The newest FINISHED stage run with this cache key whose output still exists, or None."""
    c = client()
    experiment_id = ensure_experiment(experiment)
    runs = c.search_runs([experiment_id], filter_string=f"tags.`rlhf.cache_key` = '{cache_key}' and "
                                "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                                max_results=20)
    for run in runs:
        uri = run.data.tags.get("rlhf.output_uri")
        if uri and storage.read_manifest(uri) is not None:
            return run
    return None


def _missing(error: MlflowException) -> bool:
    return error.error_code == "RESOURCE_DOES_NOT_EXIST"


def find_pipeline_run(experiment: str, run_ref: str):
    """A pipeline (parent) run by MLflow run id or by the Prefect flow run id it was tagged with."""
    c = client()
    try:
        run = c.get_run(run_ref)
        if run.data.tags.get("rlhf.kind") == "pipeline":
            return run
    except MlflowException as e:  # not an MLflow run id: try it as a Prefect flow run id below
        if not _missing(e) and e.error_code != "INVALID_PARAMETER_VALUE":
            raise
    experiment_id = ensure_experiment(experiment)
    runs = c.search_runs([experiment_id], filter_string=f"tags.`rlhf.prefect_flow_run_id` = '{run_ref}' and "
                         "tags.`rlhf.kind` = 'pipeline'", max_results=1)
    if not runs:
        raise ValueError(f"from_run {run_ref!r}: no pipeline run with that MLflow run id or Prefect flow run id")
    return runs[0]


def stage_runs(parent_run_id: str) -> dict[str, object]:
    """The latest FINISHED child run of each stage of a pipeline run (cached reuses included)."""
    c = client()
    experiment_id = c.get_run(parent_run_id).info.experiment_id
    runs = c.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                         "attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"])
    latest: dict[str, object] = {}
    for run in runs:
        latest[run.data.tags.get("rlhf.stage_name") or run.data.tags.get("rlhf.stage")] = run
    return latest


def register(stage: str, output_uri: str, run_id: str, tags: dict[str, str] | None = None):
    """Register a stage output as a new version of its model and point `candidate` at it."""
    name = REGISTERED_NAMES[stage]
    c = client()
    try:
        c.create_registered_model(name, description=f"rlhf lifecycle: {stage} models")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":  # a server or auth error must not pass as "exists"
            raise
    source = output_uri if storage.is_remote(output_uri) else f"runs:/{run_id}/{storage.MANIFEST}"
    version = c.create_model_version(name, source=source, run_id=run_id,
                                     tags={"rlhf.output_uri": output_uri, "rlhf.stage": stage, **(tags or {})})
    set_alias_racing(c, name, CANDIDATE, version.version)
    return version


def set_alias_racing(c, name: str, alias: str, version) -> None:
    """Point `alias` at `version`. MLflow's SQL store inserts an alias it did not find: two runs
    setting one new alias at once (two first pipeline runs) can both insert, and the second fails
    its UNIQUE constraint (a BAD_REQUEST). Tried again, it finds the alias and moves it."""
    for attempt in range(3):
        try:
            c.set_registered_model_alias(name, alias, version)
            return
        except MlflowException as e:
            if attempt == 2 or "UNIQUE constraint failed" not in str(e):
                raise


def register_once(stage: str, output_uri: str, training_run_id: str, tags: dict[str, str] | None = None):
    """The registered version of the output trained by `training_run_id`, registering it if new."""
    name = REGISTERED_NAMES[stage]
    # An unknown model name gives an empty result, not an error.
    existing = client().search_model_versions(f"name = '{name}' and run_id = '{training_run_id}'")
    if existing:
        return max(existing, key=lambda v: int(v.version))
    return register(stage, output_uri, training_run_id, tags)


def alias_version(name: str, alias: str):
    """The version `alias` points at; None when the model or the alias does not exist (and only then:
    a tracking-server error must not read as "no champion yet", or `promote` would replace it)."""
    c = client()
    try:
        model = c.get_registered_model(name)
    except MlflowException as e:
        if _missing(e):
            return None
        raise
    version = model.aliases.get(alias)
    return None if version is None else c.get_model_version(name, version)


# What a champion registered before policies were compared side by side recorded for each metric.
OLD_METRIC_TAGS = {"greedy_accuracy": "eval/policy_exact_match", "reward": "eval/policy_reward",
                   "response_len": "eval/policy_response_len", "win_rate": "eval/win_rate", "kl": "eval/kl"}


def recorded_value(version, metric: str) -> float | None:
    """A version's recorded `metric`, also under the name it had before (`eval/policy_exact_match`)."""
    raw = version.tags.get(f"rlhf.eval.{metric}")
    if raw is None and metric in OLD_METRIC_TAGS:
        raw = version.tags.get(f"rlhf.eval.{OLD_METRIC_TAGS[metric]}")
    return float(raw) if raw is not None else None


def promote(name: str, version: str, metric: str, value: float) -> tuple[bool, float | None]:
    """Make `version` the champion when `value` beats the champion's `metric` (or there is none, or
    the champion never recorded that metric: a champion of an older metric gives way).

    Returns (promoted, previous champion's value).
    """
    c = client()
    c.set_model_version_tag(name, version, f"rlhf.eval.{metric}", str(value))
    champion = alias_version(name, CHAMPION)
    previous = recorded_value(champion, metric) if champion is not None else None
    if champion is None or previous is None or value > previous:
        set_alias_racing(c, name, CHAMPION, version)
        return True, previous
    return False, previous


def set_alias(name: str, alias: str, version: str) -> None:
    set_alias_racing(client(), name, alias, version)
