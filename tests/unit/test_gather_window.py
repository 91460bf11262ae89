"""How long a node's batch waits for the steps of other requests due back (see NodeAgent._window_s)."""

from __future__ import annotations

import pytest

from exo_tui.net.protocol import PlanEntry, RingPlan
from exo_tui.node import agent as agent_module
from exo_tui.node.agent import NodeAgent


def _ring(*hosts: str) -> RingPlan:
    return RingPlan(1, len(hosts), tuple(PlanEntry(f"n{i}", h, 52416 + i, i, i + 1) for i, h in enumerate(hosts)))


def test_a_ring_reached_on_loopback_is_on_one_machine() -> None:
    assert _ring("127.0.0.1", "127.0.0.1", "127.0.0.1").on_loopback()
    assert _ring("127.0.0.1", "::1", "localhost", "127.0.1.1").on_loopback()
    assert not _ring("127.0.0.1", "192.168.1.20").on_loopback()  # one hop on another machine
    assert not _ring("studio.local").on_loopback()


def test_nodes_sharing_cores_wait_up_to_a_whole_run_to_merge_batches() -> None:
    agent = NodeAgent(name="w", port=0, backend="onnx", run_benchmark=False)
    try:
        agent._run_s = 0.012
        assert agent._window_s() == pytest.approx(agent_module.GATHER_FRACTION * 0.012)  # a quarter run
        agent._shared_cores = True
        assert agent._window_s() == pytest.approx(0.012)  # a whole run
        agent._run_s = 0.5
        assert agent._window_s() == pytest.approx(agent_module.GATHER_SHARED_SCALE * agent_module.GATHER_MAX_S)
        agent._shared_cores = False
        assert agent._window_s() == pytest.approx(agent_module.GATHER_MAX_S)
        agent._run_s = 0.0
        assert agent._window_s() == pytest.approx(agent_module.GATHER_MIN_S)
    finally:
        agent._worker.shutdown()
        agent._loader.shutdown()
