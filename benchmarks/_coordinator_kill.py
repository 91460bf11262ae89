"""``resilience.py``'s "coordinator kill -9": three ``exo-tui serve --coordinators`` processes over
three node agents (the default model, loopback); a greedy stream through a standby; ``kill -9`` of
the leader at a token. Measured: the longest gap of the client's stream (the stall), and the time
from the kill until another coordinator leads and is in charge (its ``/health``, polled every 20 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from exo_tui.cluster.local_nodes import spawn_node, stop_node, wait_ready
from exo_tui.commands.serve import READY_PREFIX
from exo_tui.net.security import ensure_cluster, write_node_bundle


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(url: str) -> dict | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return httpx.get(f"{url}/health", timeout=2).json()
    return None


def run(backend: str, tokens: int, at: int, home: Path) -> tuple[float, float, float, float]:
    """(normal gap, stall, time to a new leader in charge, the stream's re-issue after the kill) in seconds."""
    cluster = ensure_cluster(home)
    nodes = []
    for i in range(3):
        bundle = write_node_bundle(home / "nodes" / f"b{i}.bundle", cluster.node_bundle(f"b{i}"))
        nodes.append(spawn_node(f"b{i}", backend=backend, key_file=str(bundle), log_dir=home / "logs",
                                env={"EXO_TUI_HOME": str(home)}))
    procs: list[subprocess.Popen[str]] = []
    try:
        asyncio.run(_ready(nodes))
        rafts, apis = [_port() for _ in range(3)], [_port() for _ in range(3)]
        urls = [f"http://127.0.0.1:{p}" for p in apis]
        config = home / "config.yaml"
        config.write_text("network:\n  join:\n    enabled: false\n")
        env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(config)}
        for i in range(3):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "exo_tui.cli", "serve", "--strategy", "even", "--api-port", str(apis[i]),
                 "--coordinators", ",".join(f"127.0.0.1:{p}" for p in rafts), "--coordinator-port", str(rafts[i]),
                 "--state-dir", str(home / f"raft{i}"), *sum((["--peer", f"127.0.0.1:{n.port}"] for n in nodes), [])],
                stdout=subprocess.PIPE, stderr=open(home / f"c{i}.err", "w"), text=True, env=env, start_new_session=True))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().startswith(READY_PREFIX)
        lead = _leader(urls, range(3))
        standby = (lead + 1) % 3
        body = {"model": "smollm2-135m", "max_tokens": tokens, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
        stamps, killed, found = [], 0.0, []
        watcher = threading.Thread(target=lambda: found.append(_leader(urls, [i for i in range(3) if i != lead],
                                                                        time.perf_counter)))
        with httpx.stream("POST", f"{urls[standby]}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (ch := json.loads(line[6:])["choices"]) and ch[0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
                    if len(stamps) == at:
                        os.killpg(procs[lead].pid, signal.SIGKILL)
                        killed = time.perf_counter()
                        watcher.start()
        watcher.join()
        in_charge = found[0][1] - killed
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        after = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > killed]
        resumed = next((t for t in stamps if t > killed), killed) - killed
        return statistics.median(gaps[2: at - 1]), max(after), float(in_charge), resumed
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
        for n in nodes:
            stop_node(n)


async def _ready(nodes: list) -> None:
    await asyncio.gather(*(wait_ready(n, timeout_s=300) for n in nodes))


def _leader(urls: list[str], among, clock=None):  # noqa: ANN001, ANN202
    """The coordinator among ``among`` that leads and is in charge (with ``clock()`` when seen)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for i in among:
            h = _health(urls[i])
            if h is not None and h.get("role") == "leader" and h.get("ready"):
                return (i, clock()) if clock is not None else i
        time.sleep(0.02)
    raise TimeoutError("no coordinator took charge in 120 s")
