"""What a stage's Tracker asks of MLflow, in plain data: names, numbers and strings in, a run id or
a status out, no MLflow objects either way.

`DirectOps` runs the calls in this process with an `MlflowClient`. Because nothing MLflow-shaped
crosses the interface, the same calls can run in another process (`mlflow_side.SideOps`): the
`rlhf` command keeps MLflow's imports and store off the path to a stage's first step that way.
"""

from __future__ import annotations

import os

from rlhf_core.infra.settings import artifact_root, tracking_uri


def ensure_experiment(name: str, client=None) -> str:
    """The id of experiment `name` in the tracking store, created when missing (through `client`,
    default one for `tracking_uri()`; not MLflow's fluent API, whose `set_tracking_uri` resets its
    tracing and imports OpenTelemetry: 0.15 s of a stage's start on a 2-core AMD EPYC, Zen 4 class)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = client or MlflowClient(tracking_uri=tracking_uri())
    # A tracking server keeps artifacts where it was told to; a database file has no artifact root
    # of its own (MLflow would write to ./mlruns in whatever folder the run started from).
    server = os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http://", "https://", "databricks"))
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None if server and not os.environ.get("RLHF_ARTIFACT_ROOT") else f"{artifact_root().rstrip('/')}/{name}"
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class DirectOps:
    """The Tracker's calls on an `MlflowClient` in this process. Each call is one try: the caller
    retries (`reachability.retry`), so `open_run` keeps its creation per `request` across tries."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self._creates: dict[str, object] = {}

    def open_run(self, experiment: str, run_name: str | None, tags: dict[str, str], given: str | None,
                 request: str, owner: str | None) -> str:
        """The stage's run id: `given` (an orchestrator's run) set RUNNING with `tags` and the owner,
        or a run created once for `request` (a retried create finds the run an earlier try made)."""
        from mlflow.entities import RunTag

        from rlhf_core.infra.owner import OWNER_TAG

        if given:  # the orchestrator's run: resume it, as mlflow.start_run(run_id=...) does
            self._orchestrators_run(given)
            self.client.update_run(given, status="RUNNING")
            tags = {**tags, **({OWNER_TAG: owner} if owner else {})}  # this process runs it now (owner.py)
            if tags:
                self.client.log_batch(given, tags=[RunTag(k, v) for k, v in tags.items()])
            return given
        from mlflow.tracking.context.registry import resolve_tags

        from rlhf_core.infra.reachability import create_run_once

        experiment_id = ensure_experiment(experiment, self.client)
        if request not in self._creates:
            self._creates[request] = create_run_once(self.client, run_name, resolve_tags(tags), request, owner)
        return self._creates[request](experiment_id).info.run_id

    def _orchestrators_run(self, run_id: str) -> None:
        """The run an orchestrator handed over (`MLFLOW_RUN_ID`); missing, an error that says where
        this process looked, and the usual cause: a store the orchestrator does not share."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

        from rlhf_core.infra.redaction import redact_text

        try:
            self.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise MlflowException(
                f"MLFLOW_RUN_ID {run_id} is not in the MLflow store at {redact_text(self.client.tracking_uri)}: the "
                f"orchestrator that made it records elsewhere. A job on another machine needs the orchestrator's "
                f"store, a tracking server both reach (MLFLOW_TRACKING_URI=http://...), not a database file",
                error_code=RESOURCE_DOES_NOT_EXIST) from None

    def log_batch(self, run_id: str, metrics=(), params=(), tags=()) -> None:
        """`metrics` as (key, value, timestamp ms, step), `params` and `tags` as (key, value)."""
        from mlflow.entities import Metric, Param, RunTag

        self.client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in metrics],
                              params=[Param(k, v) for k, v in params], tags=[RunTag(k, v) for k, v in tags])

    def run_status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    def set_terminated(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)

    def log_artifact(self, run_id: str, path: str) -> None:
        self.client.log_artifact(run_id, path)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)

    def log_inputs(self, run_id: str, inputs: list[tuple[str, str, str | None, str | None, str]]) -> None:
        """`inputs` as (name, digest, local path, or None with a hub URL, context)."""
        from mlflow.data.http_dataset_source import HTTPDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        datasets = []
        for name, digest, path, url, context in inputs:
            source = LocalArtifactDatasetSource(path) if path is not None else HTTPDatasetSource(url=url)
            ds = MetaDataset(source=source, name=name, digest=digest)
            datasets.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]))
        self.client.log_inputs(run_id, datasets=datasets)
