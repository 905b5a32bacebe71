"""Ports on this machine."""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS = (10002, 19999)
"""Ray's default `--min-worker-port`/`--max-worker-port`: its worker processes listen there."""


def free_port(preferred: int = 0) -> int:
    """`preferred` when nothing holds it on 127.0.0.1, else a port the system has free (0: any)."""
    for port in dict.fromkeys((preferred, 0)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from (Linux; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def rendezvous_ports(ephemeral: tuple[int, int], ray_workers: tuple[int, int] = RAY_WORKER_PORTS) -> range:
    """Where a process group's store may listen without racing anyone: above Ray's worker ports and
    below the ephemeral range. A port the kernel hands out (bind to 0) is an ephemeral one, and on a
    Ray node hundreds of outgoing gRPC connections take ephemeral ports all the time: one of them can
    take the port between our check and the store's `listen` (EADDRINUSE). Empty when the ranges
    leave no room (the caller then takes a port from the kernel)."""
    return range(ray_workers[1] + 1, ephemeral[0])


def _free_everywhere(port: int) -> bool:
    """Nothing holds `port` on any address (a TCP store listens on all of them)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port(rng: random.Random | None = None, tries: int = 64) -> int:
    """A port for a process group's TCP store (MASTER_PORT): free on every address, drawn at random
    from `rendezvous_ports` (two roles starting together draw different ones); from the kernel when
    that range is empty or full."""
    rng = rng or random.SystemRandom()
    span = rendezvous_ports(ephemeral_ports())
    if len(span):
        for _ in range(tries):
            port = rng.choice(span)
            if _free_everywhere(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
