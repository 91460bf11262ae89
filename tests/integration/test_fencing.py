"""Fencing on a real node agent (in this process, on loopback): a coordinator attaches with its
term, and once a newer term has attached, every command of the older one is refused with an
error that names both terms; a node that has seen no term obeys a coordinator without one."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from exo_tui.net import Cluster, RemoteError, Security, connect, ensure_cluster
from exo_tui.node.agent import NodeAgent


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path / "home"))
    return ensure_cluster()


@contextlib.asynccontextmanager
async def agent(cluster: Cluster):
    a = NodeAgent(name="fenced", host="127.0.0.1", port=0, backend="onnx", run_benchmark=False,
                  security=Security.from_bundle(cluster.node_bundle("fenced")))
    await a.start()
    conns = []

    async def coordinator(term: int | None):
        conn = await connect("127.0.0.1", a.port, security=cluster.security())
        conns.append(conn)
        return conn, await conn.call("attach", {"term": term} if term is not None else None, timeout=10)

    try:
        yield a, coordinator
    finally:
        for c in conns:
            with contextlib.suppress(Exception):
                await c.aclose()
        await a.stop()


async def test_a_newer_term_fences_the_older_coordinator_out(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="exo_tui.node.fencing")
    async with agent(cluster) as (node, coordinator):
        old, _ = await coordinator(3)
        assert (await old.call("ping", timeout=10)).type == "pong"
        new, _ = await coordinator(4)
        with pytest.raises(RemoteError) as refused:
            await old.call("ping", timeout=10)
        assert refused.value.code == "fenced"
        assert "term 4" in str(refused.value) and "term 3" in str(refused.value)
        assert (await new.call("ping", timeout=10)).type == "pong"
        # the deposed coordinator cannot come back on a new connection either
        with pytest.raises(RemoteError, match="of term 3 and was deposed"):
            await coordinator(3)
        assert node.fence.term == 4 and node.fence.refused == 2
        assert "refused ping from coordinator term 3: term 4 leads now" in caplog.text


async def test_a_coordinator_without_a_term_is_obeyed_until_a_set_takes_over(cluster: Cluster) -> None:
    async with agent(cluster) as (node, coordinator):
        single, _ = await coordinator(None)
        assert (await single.call("ping", timeout=10)).type == "pong"
        await coordinator(1)
        with pytest.raises(RemoteError, match="term 0"):
            await single.call("ping", timeout=10)
