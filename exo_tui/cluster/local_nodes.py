"""Node agents as child processes on loopback (``--local-nodes N``): start, wait, stop.

Each child is ``python -m exo_tui.cli node`` in its own process group, so stopping it (SIGTERM,
then SIGKILL after a grace period) takes whatever it started too. The parent registers an
``atexit`` hook as a last resort, so no child outlives a coordinator that exits normally.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_LINE = re.compile(rb"^exo-tui node .* listening on port (\d+)$", re.MULTILINE)
_live: set[subprocess.Popen[bytes]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LocalNode:
    name: str
    port: int
    backend: str
    process: subprocess.Popen[bytes]
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    log_offset: int = 0  # where this run's output starts in the (appended) log file

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def spawn_node(
    name: str,
    *,
    backend: str,
    port: int | None = None,
    key_file: str | None = None,
    memory_limit_gb: float | None = None,
    log_dir: Path,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    listen: str = "127.0.0.1",
) -> LocalNode:
    """Start a node agent. ``listen``: its listening address (``0.0.0.0`` when nodes on other
    hosts must reach it); the coordinator always reaches it on loopback. Without ``port`` the node
    binds a free port itself and :func:`wait_ready` reads which from its ready line (a port picked
    here and bound there later could be taken in between, by any outgoing connection)."""
    port = port or 0
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "exo_tui.cli", "node", "--host", listen, "--port", str(port),
           "--name", name, "--backend", backend, "--no-advertise", "--exit-with-parent", str(os.getpid())]
    if key_file:
        cmd += ["--key-file", key_file]
    if memory_limit_gb:
        cmd += ["--memory-limit", str(memory_limit_gb)]
    cmd += extra_args or []
    with open(log_path, "ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    _live.add(proc)
    return LocalNode(name, port, backend, proc, log_path, list(extra_args or []), offset)


async def wait_ready(node: LocalNode, timeout_s: float = 120.0) -> None:
    """Wait until the node prints its ready line (it is then listening on ``node.port``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not node.alive():
            raise RuntimeError(
                f"node {node.name} exited with code {node.process.returncode} before it was ready:\n{node.log_tail()}"
            )
        with contextlib.suppress(OSError), open(node.log_path, "rb") as fh:
            fh.seek(node.log_offset)
            ready = READY_LINE.search(fh.read())
            if ready:
                node.port = int(ready.group(1))
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"node {node.name} was not ready after {timeout_s:.0f} s:\n{node.log_tail()}")


def stop_node(node: LocalNode, grace_s: float = 5.0) -> None:
    """SIGTERM the node's process group, SIGKILL it if it lingers, reap it."""
    proc = node.process
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the node left in its group
    _live.discard(proc)


@atexit.register
def _stop_all() -> None:
    for proc in list(_live):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):  # SIGKILLed: the wait only reaps it; nothing is left to do
                proc.wait(5)
        _live.discard(proc)
