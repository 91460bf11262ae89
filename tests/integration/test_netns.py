"""Three hosts in network namespaces on a bridge: bootstrap over SSH, mDNS across the bridge, netem."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import pytest

from exo_tui.discovery import Discovery
from exo_tui.events import EventBus, NodeDiscovered, NodeGone

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def _events(sub, pred, n: int, timeout: float) -> list:  # noqa: ANN001
    out: list = []

    async def loop() -> None:
        while len(out) < n:
            ev = await sub.get()
            if pred(ev):
                out.append(ev)

    await asyncio.wait_for(loop(), timeout)
    return out


async def test_bootstrapped_nodes_are_discovered_across_the_bridge_and_withdraw(netns_nodes) -> None:  # noqa: ANN001
    from exo_tui.bootstrap import stop_node
    from exo_tui.net.client import connect as net_connect
    from exo_tui.net.security import ensure_cluster

    lab = netns_nodes.lab
    print(f"\nbootstrap of 3 namespace hosts in parallel: {netns_nodes.bootstrap_s:.1f} s")
    by_addr = {r.address: r for r in netns_nodes.results}
    assert set(by_addr) == {h.address for h in lab.hosts}
    assert len({r.node_id for r in netns_nodes.results}) == 3

    bus = EventBus()
    sub = bus.subscribe()
    async with Discovery(bus, interfaces=[lab.bridge_address], ssh_config=False, environ={},
                         tailscale_command="/nonexistent", cluster_fingerprint=""):
        ids = {r.node_id for r in netns_nodes.results}
        found = await _events(sub, lambda e: isinstance(e, NodeDiscovered) and e.node_id in ids, 3, 20)
        for ev in found:
            r = by_addr[ev.address]  # advertised with its namespace address, seen over the bridge
            assert (ev.node_id, ev.name, ev.port) == (r.node_id, r.node_name, 52416)

        # Each node answers the cluster's authenticated handshake at the address mDNS gave.
        security = ensure_cluster(netns_nodes.home).security()
        for ev in found:
            conn = await net_connect(ev.address, ev.port, security=security, timeout=5)
            reply = await conn.call("profile", timeout=5)
            assert reply.body["profile"]["node_id"] == ev.node_id
            await conn.aclose()

        # Stopping one node withdraws its advertisement.
        first = lab.hosts[0]
        stopped = await stop_node(first.ssh_target, netns_nodes.options())
        assert stopped.startswith("pid ")
        gone = await _events(sub, lambda e: isinstance(e, NodeGone), 1, 15)
        assert gone[0].node_id == by_addr[first.address].node_id
        # Bring it back for whoever uses the lab next (restart without reinstalling); it reappears.
        from exo_tui.bootstrap import bootstrap

        again = await bootstrap(first.ssh_target, netns_nodes.options(
            node_name=f"lab-{first.label}", node_args=["--no-benchmark"], install=False))
        assert again.node_id == by_addr[first.address].node_id and set(again.durations_s) == {
            "connect", "detect", "key", "start", "handshake"}
        back = await _events(sub, lambda e: isinstance(e, NodeDiscovered), 1, 20)
        assert back[0].node_id == again.node_id


def _tcp_rtt_ms(address: str, port: int, n: int = 15) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection((address, port), timeout=2):
            samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def test_netem_delays_links(netns_lab) -> None:  # noqa: ANN001
    from tests.helpers.netns import netem_skip_reason

    reason = netem_skip_reason()
    if reason:
        pytest.skip(reason)
    a, b, c = netns_lab.hosts
    netns_lab.set_delay(b, 2)
    netns_lab.set_delay(c, 5)
    rtt = {h.label: _tcp_rtt_ms(h.address, 22) for h in (a, b, c)}
    print(f"\nTCP connect RTT ms: {rtt}")
    assert rtt["a"] < 2
    assert 2 <= rtt["b"] < 5
    assert 5 <= rtt["c"] < 10
