"""Is the tracking server or the object store there? Bounded waits for MLflow and S3.

The MLflow and S3 clients retry for minutes on their own, so an unreachable store would look like a
hung stage. Here every wait has a bound, and its end is one `StoreUnavailable` naming the store
(URI redacted), the bound and its setting:

- `RLHF_STORE_CHECK_S` (30 s): at a stage's start (before anything is read, or the flow opens a
  run) each store it uses must answer an HTTP request, retried with backoff.
- `RLHF_STORE_WAIT_S` (300 s): how long recording an output (metrics, tags, run end, S3 upload)
  waits for a store. MLflow requests get `MLFLOW_HTTP_REQUEST_TIMEOUT=20` and 0 retries of their
  own unless set (the retrying is ours), so a wait ends at most one request after the bound.
- `RLHF_METRICS_BUFFER` (100000 values): metrics held while MLflow is away; beyond it the oldest
  are dropped with a warning (`tracking.Tracker`).

An unreachable store is an infrastructure failure: exit 1 (never 2), so the pipeline retries the
stage. A wrong host name is retried too: cheaper than never retrying a briefly-down store.
"""

from __future__ import annotations

import os
import sys
import time

from rlhf_core.infra.redaction import redact_text
from rlhf_core.infra.settings import env_number

DEFAULT_STORE_CHECK_S = 30.0
DEFAULT_STORE_WAIT_S = 300.0
DEFAULT_METRICS_BUFFER = 100_000
MLFLOW_REQUEST_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
SETTINGS = ("RLHF_STORE_CHECK_S", "RLHF_STORE_WAIT_S", "RLHF_METRICS_BUFFER", *MLFLOW_REQUEST_DEFAULTS)


class StoreUnavailable(RuntimeError):
    """A store did not answer within its bound: an infrastructure failure (exit 1, retried)."""


def store_check_s() -> float:
    return env_number("RLHF_STORE_CHECK_S", DEFAULT_STORE_CHECK_S)


def store_wait_s() -> float:
    return env_number("RLHF_STORE_WAIT_S", DEFAULT_STORE_WAIT_S)


def metrics_buffer() -> int:
    return int(env_number("RLHF_METRICS_BUFFER", DEFAULT_METRICS_BUFFER, integer=True))


def bound_mlflow_requests() -> None:
    """One MLflow request may take at most MLFLOW_HTTP_REQUEST_TIMEOUT, once (where the user set nothing)."""
    for name, value in MLFLOW_REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def probe(url: str, timeout: float) -> str | None:
    """None when an HTTP server answers at `url` (any status below 500), else why not."""
    import requests

    try:
        response = requests.get(url, timeout=(timeout, timeout), allow_redirects=False)
    except requests.RequestException as e:
        return type(e).__name__
    if response.status_code >= 500:
        return f"HTTP {response.status_code}"
    return None


def wait_until_reachable(name: str, url: str, seconds: float, setting: str, doing: str) -> None:
    """Return once `url` answers; StoreUnavailable after `seconds` (retried with backoff until then)."""
    deadline = time.monotonic() + seconds
    delay = 0.25
    while True:
        left = deadline - time.monotonic()
        reason = probe(url, max(0.1, min(5.0, left)))
        if reason is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreUnavailable(
                f"{name} at {redact_text(url)} did not answer within {seconds:g} s ({setting}; last error: {reason}) "
                f"{doing}; an unreachable store is an infrastructure failure (exit 1): a pipeline retries the stage")
        time.sleep(min(delay, left))
        delay = min(delay * 2, 5.0)


def mlflow_health_url(tracking: str) -> str:
    return tracking.rstrip("/") + "/health"


def s3_endpoint() -> str:
    """The S3 endpoint s3fs will use: fsspec's s3 config, the AWS endpoint variables, else botocore's default."""
    import fsspec

    conf = fsspec.config.conf.get("s3", {})
    configured = conf.get("endpoint_url") or (conf.get("client_kwargs") or {}).get("endpoint_url")
    configured = configured or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if configured:
        return configured
    import botocore.session

    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
    return botocore.session.get_session().create_client("s3", region_name=region).meta.endpoint_url


def _s3_uris(value) -> list[str]:
    if isinstance(value, dict):
        return [u for v in value.values() for u in _s3_uris(v)]
    if isinstance(value, (list, tuple)):
        return [u for v in value for u in _s3_uris(v)]
    if isinstance(value, str) and "s3://" in value:
        return [part.strip().removeprefix("json@") for part in value.split(",") if "s3://" in part]
    return []


def stage_stores(values: dict, use_mlflow: bool) -> list[tuple[str, str]]:
    """`(name, url to probe)` of the remote stores a stage with config `values` talks to."""
    from rlhf_core.infra.settings import tracking_uri

    stores = []
    if use_mlflow and is_server(tracking_uri()):
        stores.append(("MLflow tracking server", mlflow_health_url(tracking_uri())))
    if _s3_uris(values):
        stores.append(("S3 endpoint", s3_endpoint()))
    return stores


def check_stage_stores(values: dict, use_mlflow: bool) -> None:
    """At the start of a stage: every store it uses answers within RLHF_STORE_CHECK_S, else StoreUnavailable."""
    for name, url in stage_stores(values, use_mlflow):
        wait_until_reachable(name, url, store_check_s(), "RLHF_STORE_CHECK_S", "at the start of the stage; "
                             "nothing was read, trained or written")


def check_config_stores(cfg) -> None:
    """`check_stage_stores` for a stage config (pydantic model with `use_mlflow`)."""
    check_stage_stores(cfg.model_dump(mode="json"), bool(getattr(cfg, "use_mlflow", False)))


# MLflow's answers (the store is there and said no): never retried.
ANSWERS = frozenset({"RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_PARAMETER_VALUE", "INVALID_STATE",
                     "BAD_REQUEST", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED",
                     "ENDPOINT_NOT_FOUND"})


def is_store_failure(error: BaseException) -> bool:
    """A failure to reach or hear the store (retried), not an answer of it or a bug of ours (raised at once)."""
    exceptions = sys.modules.get("mlflow.exceptions")  # an MlflowException means MLflow is loaded: never import it here
    if exceptions is not None and isinstance(error, exceptions.MlflowException):
        return error.error_code not in ANSWERS
    return isinstance(error, OSError)  # mlflow_side.StoreFailure too  # connection errors, timeouts (requests' exceptions are OSErrors)


def retry(call, what: str, store: str, seconds: float, setting: str):
    """`call()`, retried with backoff while the store fails (`is_store_failure`) for up to `seconds`;
    then StoreUnavailable naming the store, the bound and the setting."""
    deadline = time.monotonic() + seconds
    delay = 0.25
    while True:
        try:
            return call()
        except Exception as e:
            if not is_store_failure(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(f"MLflow at {redact_text(store)} did not {what} within {seconds:g} s ({setting}; "
                                       f"last error: {type(e).__name__}: {redact_text(str(e))[:300]})") from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


REQUEST_TAG = "rlhf.request_id"  # a run's creation request, so a retried create finds what it made


THIS_PROCESS = "this process"  # create_run_once's default owner


def create_run_once(client, run_name: str | None, tags: dict, request: str | None = None,
                    owner: str | None = THIS_PROCESS):
    """`call(experiment_id)` creating one run however often it is retried: the run carries a request
    id (`request`, default a new one), and every later try looks for it first (a create whose answer
    was lost may have made it; a blind second create would leave a run RUNNING forever). `owner`:
    the `rlhf.owner` of the process the run belongs to (default this one; None: not known, no tag,
    as where `owner_tag()` cannot tell; never the caller's own in its place: the MLflow process
    creates runs its command owns)."""
    import uuid

    from rlhf_core.infra.owner import OWNER_TAG, owner_tag

    request = request or uuid.uuid4().hex
    owner = owner_tag() if owner == THIS_PROCESS else owner  # a killed owner's RUNNING run is told (owner.py)
    tags = {**tags, REQUEST_TAG: request, **({OWNER_TAG: owner} if owner else {})}
    tried = False

    def call(experiment_id: str):
        nonlocal tried
        if tried:
            found = client.search_runs([experiment_id], filter_string=f"tags.`{REQUEST_TAG}` = '{request}'",
                                       max_results=1)
            if found:
                return found[0]
        tried = True
        return client.create_run(experiment_id, run_name=run_name, tags=tags)

    return call


class RetryingClient:
    """An `MlflowClient` whose every call is `retry`-ed for up to RLHF_STORE_WAIT_S (the flow's records);
    `create_run` through `create_run_once`. (Model versions are registered once by `register_once`.)"""

    def __init__(self, client, store: str):
        self._client, self._store = client, store

    def create_run(self, experiment_id: str, run_name: str | None = None, tags: dict | None = None):
        once = create_run_once(self._client, run_name, tags or {})
        return retry(lambda: once(experiment_id), "answer create_run", self._store, store_wait_s(), "RLHF_STORE_WAIT_S")

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return retry(lambda: attr(*args, **kwargs), f"answer {name}", self._store, store_wait_s(),
                         "RLHF_STORE_WAIT_S")

        return call
