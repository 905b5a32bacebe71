"""The plumbing our small HTTP servers share (the reward server, the policy's OpenAI-compatible
endpoint): JSON bodies under a size limit, a bearer token compared in constant time, and logs of
the request line only, never headers."""

from __future__ import annotations

import hmac
import json
import logging
from http.server import BaseHTTPRequestHandler

log = logging.getLogger(__name__)


class BearerJsonHandler(BaseHTTPRequestHandler):
    """Subclasses set `token` (bytes) and `max_body_bytes`."""

    protocol_version = "HTTP/1.1"
    sys_version = ""
    timeout = 60  # seconds a connection may stall (a body that never comes) before its thread is freed
    token: bytes = b""
    max_body_bytes: int = 2**20

    def read_length(self) -> int | None:
        """The request's Content-Length, or None after answering 411/413 (none usable)."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.reply(411, {"error": "Content-Length required"}, close=True)
            return None
        if length < 0 or length > self.max_body_bytes:
            self.reply(413, {"error": f"body over {self.max_body_bytes} bytes: send smaller chunks"}, close=True)
            return None
        return length

    def drain(self, length: int) -> None:
        # Read a small unwanted body before answering: closing on unread data resets the
        # connection, and the client could lose the answer that says what was wrong.
        if length <= 2**20:
            self.rfile.read(length)

    def authorized(self) -> bool:
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token)

    def reply(self, code: int, payload: dict, close: bool = False, extra: dict | None = None) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # the request line and status only, never headers
        log.info("%s %s", self.address_string(), format % args)
