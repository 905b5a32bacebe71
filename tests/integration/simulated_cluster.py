"""A Ray cluster of several nodes on one machine, for `test_multinode.py` and
`benchmarks/multinode_kill_resume.py`.

Each node is its own `ray start --block` in a process group of its own, with its own temp dir,
state directory (`RLHF_HOME`) and custom resource (`{"node_a": 1}`, ...): killing the group is the
machine going away (raylet, object store, agents and every rank it runs). Nodes see the S3
endpoint and credentials through their own environment, as a real cluster's machines would; the
compiled-op cache (`TORCH_EXTENSIONS_DIR`) is shared, as an image would ship it.

Ray on Linux rewrites a loopback address to the machine's when a node joins another, so the
nodes use this machine's address; token authentication (Ray 2.60's default) guards them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Ray marks a node whose raylet died dead after health_check_failure_threshold x period (15 s by default).
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                      "RAY_health_check_failure_threshold": "3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node: `ray start --block` in its own process group (`head_address` None: the head)."""

    def __init__(self, name: str, root: Path, resources: dict, head_address: str | None = None, cpus: int = 2):
        self.name, self.resources = name, resources
        self.home, self.temp = root / f"home-{name}", root / f"ray-{name}"
        self.home.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLHF_", "MLFLOW_", "PREFECT_"))
               or k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}  # the cluster's token, wherever it is kept
        env.update(RAY_AUTH_MODE="token", RLHF_HOME=str(self.home), RLHF_NO_PROGRESS="1",
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                       os.path.expanduser("~/.cache/rlhf-torch-extensions")),
                   TOKENIZERS_PARALLELISM="false", **FAST_HEALTH_CHECKS)
        ports = [f"--{flag}={free_port()}" for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                        "metrics-export-port", "runtime-env-agent-port")]
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", f"--num-cpus={cpus}",
               f"--resources={json.dumps(resources)}", f"--temp-dir={self.temp}", "--disable-usage-stats",
               "--object-store-memory=150000000", *ports]
        index = len(list(root.glob("ray-*")))  # worker ports of their own: all nodes share one address
        workers = f"--min-worker-port={23000 + 1000 * index}", f"--max-worker-port={23999 + 1000 * index}"
        if head_address is None:
            self.gcs_port, self.dashboard_port = free_port(), free_port()
            cmd += ["--head", f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
                    "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}", *workers]
        else:
            cmd += [f"--address={head_address}", *workers]
        self.log_path = root / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the node's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        self.kill()
        self._log.close()


class Cluster:
    """The head `a` and the nodes added since; `ids` maps each node's name to its Ray node id."""

    def __init__(self, root: Path):
        self.root, self.nodes, self.ids = root, {}, {}
        self._starting, self._failed = None, []

    def start_in_background(self, nodes: dict[str, dict]) -> None:
        """Start the head (the first of `nodes`: name -> resources), then the others; `ready()` waits."""
        import threading

        def start():
            try:
                (first, resources), *others = nodes.items()
                assert first == "a", "the head is node 'a'"
                self.start_head(resources)
                for name, more in others:
                    self.add(name, more)
                for name in nodes:
                    self.wait_alive(name)
            except BaseException as e:  # noqa: BLE001 - raised by ready()
                self._failed.append(e)

        self._starting = threading.Thread(target=start, daemon=True)
        self._starting.start()

    def ready(self) -> Cluster:
        """Wait until every node `start_in_background` started is alive."""
        if self._starting is not None:
            self._starting.join()
        if self._failed:
            raise self._failed[0]
        return self

    @property
    def head(self) -> str:
        return f"127.0.0.1:{self.nodes['a'].gcs_port}"

    @property
    def dashboard(self) -> str:
        """The Jobs API (what a flow's RAY_ADDRESS names)."""
        return f"http://127.0.0.1:{self.nodes['a'].dashboard_port}"

    def start_head(self, resources: dict) -> None:
        head = self.nodes["a"] = Node("a", self.root, resources)
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", head.gcs_port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or head.proc.poll() is not None:
                    raise RuntimeError(f"the Ray head did not start: {head.log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def add(self, name: str, resources: dict) -> Node:
        self.nodes[name] = Node(name, self.root, resources, head_address=self.head)
        return self.nodes[name]

    def wait_alive(self, name: str, timeout: float = 180) -> str:
        """Node `name`'s Ray id once the cluster lists it alive (a node of the same resources that was
        killed may still be listed: the id must be new)."""
        from ray.util.state import list_nodes

        resource = next(iter(self.nodes[name].resources))
        known = set(self.ids.values())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                for n in list_nodes(address=self.dashboard, timeout=10):
                    if n.state == "ALIVE" and resource in n.resources_total and n.node_id not in known:
                        self.ids[name] = n.node_id
                        return n.node_id
            except Exception:  # noqa: BLE001 - the dashboard is still starting
                pass
            time.sleep(0.5)
        raise RuntimeError(f"node {name} did not join within {timeout:.0f} s: {self.nodes[name].log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@contextlib.contextmanager
def two_node_cluster(keep: bool = False) -> Iterator[Cluster]:
    """Nodes `a` (the head, `{"node_a": 1}`) and `b` (`{"node_b": 1}`), 2 CPUs each, token auth on.
    They start in the background (a few tens of seconds on a busy machine): `cluster.ready()` waits.
    Afterwards the nodes' folders (logs, temp dirs, state directories) are removed unless `keep`."""
    from rlhf_core.distributed.local_ray import prepare_auth, reread_ray_config

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    prepare_auth()  # a token in place before `ray start` (which does not make one)
    reread_ray_config()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="rlhf-mn-")))  # short: Ray's socket paths live under it
    cluster.start_in_background({"a": {"node_a": 1}, "b": {"node_b": 1}})
    try:
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.ready()  # nothing may still be starting when the nodes are stopped
        cluster.stop()
        if not keep:
            import shutil

            shutil.rmtree(cluster.root, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        reread_ray_config()


def upload_inputs(prepared: dict, root: str) -> dict:
    """The prepared base model and datasets under `root` (s3://): a cluster's nodes share no disk."""
    import fsspec

    fs = fsspec.filesystem("s3")
    for name in ("base", "sft", "prompts"):
        fs.put(prepared[name].rstrip("/") + "/", f"{root}/{name}/", recursive=True)
    return {"base": f"{root}/base", "sft": f"json@{root}/sft", "prompts": f"json@{root}/prompts"}


def stage_config_paths(fs, run_root: str, stage: str) -> list[str]:
    """Every model, dataset, output and checkpoint location the stage's config (as the job got it) names."""
    import yaml

    text = json.dumps(yaml.safe_load(fs.cat(f"{run_root}/configs/{stage}.yaml")))
    return [p.removeprefix("json@") for p in re.findall(
        r'"(?:model_name_or_path|dataset|prompt_dataset|eval_dataset|output_dir|path)": "([^"]+)"', text)]


def staged_leftovers(home: Path) -> list[Path]:
    """Files left in a node's checkpoint staging folders (every save removes its own)."""
    staging = home / "staging"
    return [p for p in staging.rglob("*") if p.is_file()] if staging.exists() else []


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with bucket `models`, its endpoint and test credentials in the
    environment while it runs (`conftest.s3_endpoint` for the tests; scripts outside pytest too)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto S3 server did not listen on 127.0.0.1:{port} within 30 s (exit "
                                       f"code {proc.poll()}); is moto[server] installed?") from None
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="models")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
