"""Tools an agent's environment runs for the policy, in a sandbox with a time limit.

`ToolSandbox` keeps one worker process (a fresh interpreter, `python -I`: no site packages, no
environment variables read, no current directory on the path) that evaluates tool calls sent as
JSON lines. The worker runs under resource limits (CPU seconds, address space, no files written
or opened beyond a few descriptors, no child processes where the user is not root) and each call
has a deadline: a call that runs past it gets the worker killed and a fresh one started, so a
tool that hangs or crashes costs its episode, never the run. A worker is also replaced every
`CALLS_PER_WORKER` calls, so its CPU-seconds limit bounds a stretch of calls, not a whole run.
Not isolated: the network. Tools are pure functions of their argument text defined in the
worker's source (`TOOLS_SOURCE`, registered in its `TOOLS`); today one: `calc`, exact integer
arithmetic. `ToolSandbox(extra_source=...)` adds tools of one's own the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

# The worker's tools: functions of their argument text, by name in TOOLS.
TOOLS_SOURCE = r'''
import ast, json, operator, resource, sys

def limits(cpu_s, memory_mb):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (8, 8))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
       ast.Mod: operator.mod, ast.Pow: operator.pow}

def calc(text):
    """Integer arithmetic: + - * // % ** and parentheses over whole numbers."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        raise ValueError("not integer arithmetic: " + ast.dump(node)[:80])
    return str(value(ast.parse(text.strip(), mode="eval").body))

TOOLS = {"calc": calc}
'''

# The worker's loop: reads {"tool": name, "arg": text} per line, answers {"ok": value} or {"error": text}.
SERVE_SOURCE = r'''
limits(int(sys.argv[1]), int(sys.argv[2]))
for line in sys.stdin:
    request = json.loads(line)
    try:
        answer = {"ok": TOOLS[request["tool"]](request["arg"])}
    except Exception as e:
        answer = {"error": type(e).__name__ + ": " + str(e)[:200]}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
'''


CALLS_PER_WORKER = 10_000


class ToolError(Exception):
    """A tool call that failed: the tool raised, or ran past its deadline (then the worker was replaced)."""


class ToolSandbox:
    """One worker process at a time; calls are serialised (a lock) and each has `timeout_s`."""

    def __init__(self, timeout_s: float = 5.0, cpu_s: int = 600, memory_mb: int = 512, extra_source: str = ""):
        self.timeout_s, self.cpu_s, self.memory_mb = timeout_s, cpu_s, memory_mb
        self.source = TOOLS_SOURCE + extra_source + SERVE_SOURCE
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._calls = 0  # by the current worker
        self.restarts = 0

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-I", "-c", self.source, str(self.cpu_s), str(self.memory_mb)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1, env={"PATH": os.environ.get("PATH", "")}, cwd="/")

    def call(self, tool: str, arg: str) -> str:
        """The tool's answer; `ToolError` when it raised or ran past the deadline."""
        with self._lock:
            if self._calls >= CALLS_PER_WORKER:
                self._stop_worker()
            if self._proc is None or self._proc.poll() is not None:
                self._proc, self._calls = self._start(), 0
            self._calls += 1
            proc = self._proc
            answer: list[str] = []
            reader = threading.Thread(target=lambda: answer.append(proc.stdout.readline()), daemon=True)
            try:
                proc.stdin.write(json.dumps({"tool": tool, "arg": arg}) + "\n")
                proc.stdin.flush()
            except OSError as e:
                self._stop_worker(restart=True)
                raise ToolError(f"{tool}: the sandbox died ({e})") from None
            reader.start()
            reader.join(self.timeout_s)
            late = reader.is_alive()
            if late or not answer or not answer[0]:
                self._stop_worker(restart=True)
                raise ToolError(f"{tool}: no answer within {self.timeout_s:g} s" if late else f"{tool}: the sandbox died")
            reply = json.loads(answer[0])
        if "error" in reply:
            raise ToolError(f"{tool}: {reply['error']}")
        return reply["ok"]

    def _stop_worker(self, restart: bool = False) -> None:
        """The worker killed (`restart`: because it failed; the next call starts another)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            self.restarts += restart

    def close(self) -> None:
        with self._lock:
            self._stop_worker()
