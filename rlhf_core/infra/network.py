"""Ports on this machine."""

from __future__ import annotations

import socket


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
