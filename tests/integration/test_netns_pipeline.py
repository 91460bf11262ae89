"""A pipeline across three hosts in network namespaces (bootstrapped over SSH), and a host's link
going down in the middle of an answer (issues 5 and 7). Needs root; skipped with the reason
otherwise (the ``netns_nodes`` fixture says why)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from exo_tui.cluster.view import ChatParams
from tests.integration.cluster_helpers import cluster_config, reference_answer

pytestmark = [pytest.mark.root, pytest.mark.slow]

PROMPT = "Explain how a bicycle works."
TOKENS = 40


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> list[int]:
    return reference_answer(default_model_path, PROMPT, TOKENS)


async def _answer(c, on_token=None) -> list[int]:  # noqa: ANN001
    ids: list[int] = []
    async for chunk in c.chat([{"role": "user", "content": PROMPT}], ChatParams(temperature=0.0, max_tokens=TOKENS, seed=7)):
        ids.extend(chunk.token_ids)
        if on_token is not None:
            await on_token(len(ids))
        if chunk.finish_reason:
            assert chunk.finish_reason in ("stop", "length"), chunk.error
    return ids


def _coordinator(netns_nodes):  # noqa: ANN001, ANN202
    from exo_tui.cluster.coordinator import Coordinator

    peers = [f"{r.address}:{r.port}" for r in netns_nodes.results]
    return Coordinator(peers=peers, strategy="even", weights="stream", home=netns_nodes.home, persist=False,
                       config=cluster_config(heartbeat_timeout=3.0))


def test_pipeline_across_three_namespace_hosts(netns_nodes, reference: list[int]) -> None:  # noqa: ANN001
    async def run() -> None:
        c = _coordinator(netns_nodes)
        await c.start()
        try:
            assert c.plan is not None and len(c.plan.shards) == 3
            assert {h.host for h in c.nodes.values()} == {r.address for r in netns_nodes.results}
            assert await _answer(c) == reference
            # The scheduler sees every link of the ring, measured across the bridge.
            profiles = {p.node_id: p for p in c.device_profiles()}
            for a in c.plan.node_ids:
                for b in c.plan.node_ids:
                    if a != b:
                        assert 0 < profiles[a].links[b].latency_s < 0.5
        finally:
            await c.stop()

    asyncio.run(run())


def test_link_down_mid_generation(netns_nodes, reference: list[int]) -> None:  # noqa: ANN001
    lab = netns_nodes.lab

    async def run() -> None:
        c = _coordinator(netns_nodes)
        await c.start()
        victim_host = None
        try:
            middle = c.plan.shards[1].node_id
            address = c.nodes[middle].host
            victim_host = next(h for h in lab.hosts if h.address == address)
            fired = False

            async def cut(n: int) -> None:
                nonlocal fired
                if n >= 10 and not fired:
                    fired = True
                    victim_host.run("ip", "link", "set", victim_host.veth_ns, "down")

            assert await _answer(c, cut) == reference
            assert fired and c.nodes[middle].state == "failed"
            assert middle not in c.plan.node_ids
        finally:
            if victim_host is not None:
                victim_host.run("ip", "link", "set", victim_host.veth_ns, "up", check=False)
                victim_host.run("ip", "route", "replace", "default", "via", lab.bridge_address, check=False)
            await c.stop()

    asyncio.run(run())


def test_ring_mixes_a_local_node_with_namespace_hosts(netns_nodes, reference: list[int]) -> None:  # noqa: ANN001
    """The coordinator's own node (reached on loopback) in a ring with nodes on other hosts: they
    forward hidden states to it at this host's address on their network."""
    from exo_tui.cluster.coordinator import Coordinator

    peers = [f"{r.address}:{r.port}" for r in netns_nodes.results[:2]]

    async def run() -> None:
        c = Coordinator(peers=peers, local_nodes=1, strategy="even", weights="stream", home=netns_nodes.home,
                        persist=False, config=cluster_config())
        await c.start()
        try:
            assert c.plan is not None and len(c.plan.shards) == 3
            local = next(e for e in c.ring.ring if c.nodes[e.node_id].host == "127.0.0.1")
            assert local.host == netns_nodes.lab.bridge_address
            assert await _answer(c) == reference
        finally:
            await c.stop()

    asyncio.run(run())
