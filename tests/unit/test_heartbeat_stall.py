"""The coordinator's heartbeat check and its own event loop (issue 43): time the loop was held —
when it could read no frame, so the nodes' heartbeats waited unread in the sockets — does not
count against the nodes; a node that is silent while the loop runs is failed as before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.config import Config
from exo_tui.node.profile import device_profile


def _coordinator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Coordinator, NodeHandle]:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    config = Config()
    config.scheduler.fault_tolerance.heartbeat_interval = 0.1
    config.scheduler.fault_tolerance.heartbeat_timeout = 0.6
    c = Coordinator(config=config, home=tmp_path, persist=False)
    profile = device_profile("n1", backends=["onnx"])
    handle = c.nodes[profile.node_id] = NodeHandle(node_id=profile.node_id, name="n1", host="127.0.0.1", port=1,
                                                    profile=profile)
    return c, handle


async def _ticks(n: int) -> None:
    from exo_tui.cluster.membership import MONITOR_INTERVAL_S

    await asyncio.sleep(n * MONITOR_INTERVAL_S)


async def test_a_held_loop_does_not_fail_the_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c, handle = _coordinator(tmp_path, monkeypatch)
    monitor = asyncio.create_task(c._monitor_loop())
    try:
        await _ticks(1)
        time.sleep(1.5)  # the loop held (a long synchronous step): no frame is read meanwhile
        await _ticks(1)
        assert handle.state == "ready", handle.reason
        handle.record_heartbeat({})  # what the read loop does with the heartbeat that waited
        await _ticks(2)
        assert handle.state == "ready", handle.reason
        deadline = time.monotonic() + 30  # silent while the loop runs: failed, as before
        while handle.state != "failed":
            assert time.monotonic() < deadline, "a silent node was never failed"
            await _ticks(1)
        assert "no heartbeat" in handle.reason
    finally:
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)
