"""Discovery with real zeroconf on loopback, and the static sources through the Discovery service."""

from __future__ import annotations

import asyncio
import secrets
import socket
from pathlib import Path

import pytest
from zeroconf.asyncio import AsyncServiceInfo

from exo_tui.discovery import Discovery, NodeAdvertiser
from exo_tui.discovery.mdns import make_zeroconf
from exo_tui.events import (
    Event,
    EventBus,
    HostDiscovered,
    HostGone,
    NodeDiscovered,
    NodeGone,
    NodeStateChanged,
    NodeUpdated,
)

LOOPBACK = ["127.0.0.1"]


async def wait_for(sub, pred, timeout: float = 15.0) -> Event:  # noqa: ANN001
    async def loop() -> Event:
        while True:
            ev = await sub.get()
            if pred(ev):
                return ev

    return await asyncio.wait_for(loop(), timeout)


def discovery(bus: EventBus, **kw) -> Discovery:  # noqa: ANN003
    opts = dict(interfaces=LOOPBACK, ssh_config=False, environ={}, tailscale_command="/nonexistent/tailscale",
                browse_interval_s=0.3, connect_timeout_s=1.0)
    opts.update(kw)
    return Discovery(bus, **opts)


async def test_advertised_node_is_discovered_updated_and_gone() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    node_id = f"n-test-{secrets.token_hex(4)}"
    async with discovery(bus, cluster_fingerprint="cafe01"):
        adv = NodeAdvertiser(node_id, "alpha node", 52999, interfaces=LOOPBACK, backends=["onnx", "mlx"],
                             memory_bytes=8 << 30, cluster="cafe01")
        async with adv:
            found = await wait_for(sub, lambda e: isinstance(e, NodeDiscovered) and e.node_id == node_id)
            assert (found.name, found.address, found.port) == ("alpha node", "127.0.0.1", 52999)
            assert found.backends == ("onnx", "mlx") and found.memory_bytes == 8 << 30
            assert found.source == "mdns" and found.version
            assert not found.foreign  # claims our cluster; the handshake still has to prove it

            await adv.update(memory_bytes=4 << 30, name="alpha")
            upd = await wait_for(sub, lambda e: isinstance(e, NodeUpdated) and e.node_id == node_id)
            assert upd.name == "alpha"
        gone = await wait_for(sub, lambda e: isinstance(e, NodeGone) and e.node_id == node_id)
        assert gone.name == "alpha"


async def test_a_node_of_another_cluster_is_foreign_until_settled() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    ids = [f"n-test-{secrets.token_hex(4)}" for _ in range(2)]
    async with discovery(bus, cluster_fingerprint="cafe01") as d:
        async with (
            NodeAdvertiser(ids[0], "other", 52998, interfaces=LOOPBACK, cluster="beef02"),
            NodeAdvertiser(ids[1], "fresh", 52997, interfaces=LOOPBACK),
        ):
            seen = {}
            while len(seen) < 2:
                ev = await wait_for(sub, lambda e: isinstance(e, NodeDiscovered) and e.node_id in ids)
                seen[ev.node_id] = ev
            assert seen[ids[0]].foreign and seen[ids[1]].foreign
            d.mark_member(ids[1])  # e.g. after a bootstrap gave it our key and it proved it
            st = await wait_for(sub, lambda e: isinstance(e, NodeStateChanged) and e.node_id == ids[1])
            assert st.state == "discovered" and not d.nodes[ids[1]].foreign
            d.mark_foreign(ids[0])
            st = await wait_for(sub, lambda e: isinstance(e, NodeStateChanged) and e.node_id == ids[0])
            assert st.state == "foreign" and d.nodes[ids[0]].verified


async def test_an_address_change_is_reannounced() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    node_id = f"n-test-{secrets.token_hex(4)}"
    addresses = ["127.0.0.1"]
    async with discovery(bus) as d:
        adv = NodeAdvertiser(node_id, "mover", 52996, interfaces=LOOPBACK, address_source=lambda: list(addresses),
                             poll_interval_s=0.2)
        async with adv:
            await wait_for(sub, lambda e: isinstance(e, NodeDiscovered) and e.node_id == node_id)
            assert adv.announcements == 1
            addresses[:] = ["127.0.0.7"]
            await wait_for(sub, lambda e: isinstance(e, NodeUpdated) and e.node_id == node_id)
            assert adv.announcements == 2 and adv.addresses == ("127.0.0.7",)
            assert d.nodes[node_id].addresses == ("127.0.0.7",) and d.nodes[node_id].address == "127.0.0.7"


async def test_ssh_hosts_announced_over_mdns_are_hosts() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    label = f"exotest-{secrets.token_hex(3)}"
    info = AsyncServiceInfo("_ssh._tcp.local.", f"{label}._ssh._tcp.local.", port=2222, server=f"{label}.local.",
                            parsed_addresses=["127.0.0.1"])
    azc = make_zeroconf(LOOPBACK)
    try:
        async with discovery(bus):
            await (await azc.async_register_service(info))
            host = await wait_for(sub, lambda e: isinstance(e, HostDiscovered) and e.name == label)
            assert (host.host, host.port, host.source) == ("127.0.0.1", 2222, "mdns")
            await (await azc.async_unregister_service(info))
            gone = await wait_for(sub, lambda e: isinstance(e, HostGone) and e.port == 2222)
            assert gone.host == "127.0.0.1"
    finally:
        await azc.async_close()


async def test_manual_mode_probes_static_peers_and_reads_ssh_config(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host mini\n  HostName 127.0.0.1\n  Port 2201\nHost pi\n  User pi\nHost *\n  User me\n")
    bus = EventBus()
    sub = bus.subscribe(replay=True)
    d = discovery(bus, mode="manual", cli_peers=[f"127.0.0.1:{port}"], ssh_config=cfg,
                  environ={"EXO_TUI_KNOWN_PEERS": "127.0.0.1:1"})
    try:
        async with d:
            node = await wait_for(sub, lambda e: isinstance(e, NodeDiscovered))
            assert (node.node_id, node.address, node.port, node.source) == (f"peer:127.0.0.1:{port}", "127.0.0.1", port, "peer")
            hosts = {d.hosts[k].alias: d.hosts[k] for k in d.hosts}
            assert set(hosts) == {"mini", "pi"}
            assert (hosts["mini"].port, hosts["pi"].user) == (2201, "pi")
            assert d._browser is None  # nothing multicast in manual mode

            cfg.write_text("Host mini\n  HostName 127.0.0.1\n  Port 2201\n")
            gone = await wait_for(sub, lambda e: isinstance(e, HostGone))
            assert gone.host == "pi"

            listener.close()
            gone = await wait_for(sub, lambda e: isinstance(e, NodeGone))
            assert gone.node_id == f"peer:127.0.0.1:{port}"
    finally:
        listener.close()


def test_unknown_mode_is_an_error_that_names_the_choices() -> None:
    with pytest.raises(ValueError, match="mdns, manual, tailscale"):
        Discovery(EventBus(), mode="bonjour")


def test_from_config_reads_the_discovery_section() -> None:
    from exo_tui.config import Config

    cfg = Config.from_dict({"network": {"discovery": {"mode": "manual", "known_peers": ["10.0.0.5:52416"],
                                                      "browse_interval": 2, "connect_timeout": 1.5},
                                        "node_port": 6000}})
    d = Discovery.from_config(EventBus(), cfg, cli_peers=["10.0.0.6"], environ={})
    assert d.mode == "manual" and d.browse_interval_s == 2 and d.connect_timeout_s == 1.5
    assert [(p.key, p.source) for p in d.peers] == [("10.0.0.6:6000", "peer"), ("10.0.0.5:52416", "config")]


async def test_net_probe_learns_a_peers_identity_and_spots_another_cluster(tmp_path: Path) -> None:
    from exo_tui.discovery import cluster_fingerprint, net_probe
    from exo_tui.net.frame import Frame
    from exo_tui.net.security import Security, ensure_cluster
    from exo_tui.net.server import serve

    ours, theirs = ensure_cluster(tmp_path / "ours"), ensure_cluster(tmp_path / "theirs")

    async def handler(conn, frame):  # noqa: ANN001, ANN202
        assert frame.type == "profile"
        return Frame("profile", body={"profile": {"node_id": "n-probed", "name": "probed", "version": "0.1.0",
                                                  "backends": ["onnx"], "ram_available_bytes": 123}})

    ours_srv = await serve(handler, "127.0.0.1", 0, security=Security.from_bundle(ours.node_bundle("probed")))
    theirs_srv = await serve(handler, "127.0.0.1", 0, security=Security.from_bundle(theirs.node_bundle("x")))
    fp = cluster_fingerprint(ours.ca_cert_pem)
    bus = EventBus()
    sub = bus.subscribe()
    d = discovery(bus, mode="manual", cli_peers=[f"127.0.0.1:{ours_srv.port}", f"127.0.0.1:{theirs_srv.port}"],
                  probe=net_probe(ours.security(), fp), cluster_fingerprint=fp)
    try:
        async with d:
            seen = {}
            while len(seen) < 2:
                ev = await wait_for(sub, lambda e: isinstance(e, NodeDiscovered))
                seen[ev.port] = ev
            mine, other = seen[ours_srv.port], seen[theirs_srv.port]
            assert (mine.node_id, mine.name, mine.backends, mine.memory_bytes, mine.foreign) == (
                "n-probed", "probed", ("onnx",), 123, False)
            assert other.node_id == f"peer:127.0.0.1:{theirs_srv.port}" and other.foreign
    finally:
        for srv in (ours_srv, theirs_srv):
            srv.close()
            await srv.wait_closed()


async def test_the_discovery_tool_prints_what_it_finds(tmp_path: Path) -> None:
    import json
    import os
    import sys

    node_id = f"n-test-{secrets.token_hex(4)}"
    env = dict(os.environ, EXO_TUI_HOME=str(tmp_path), HOME=str(tmp_path))
    env.pop("EXO_TUI_KNOWN_PEERS", None)
    async with NodeAdvertiser(node_id, "tool", 52995, interfaces=LOOPBACK):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "exo_tui.discovery", "--interface", "127.0.0.1", "--seconds", "4",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            cwd=Path(__file__).resolve().parents[2])
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    events = [json.loads(line) for line in out.decode().splitlines()]
    mine = [e for e in events if e.get("node_id") == node_id]
    assert mine and mine[0]["type"] == "node_discovered" and mine[0]["port"] == 52995


async def test_tailscale_mode_finds_tailnet_hosts_and_probes_them_as_nodes(tmp_path: Path) -> None:
    import json

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    status = {"BackendState": "Running", "Peer": {"k": {"HostName": "tailbox", "DNSName": "tailbox.ts.net.",
                                                        "TailscaleIPs": ["127.0.0.1"], "Online": True}}}
    fake = tmp_path / "tailscale"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(status)}\nEOF\n")
    fake.chmod(0o755)
    bus = EventBus()
    sub = bus.subscribe(replay=True)
    try:
        async with discovery(bus, mode="tailscale", tailscale_command=str(fake), node_port=port) as d:
            host = await wait_for(sub, lambda e: isinstance(e, HostDiscovered))
            assert (host.host, host.port, host.source, host.name) == ("tailbox.ts.net", 22, "tailscale", "tailbox")
            node = await wait_for(sub, lambda e: isinstance(e, NodeDiscovered))
            assert (node.node_id, node.source) == (f"peer:127.0.0.1:{port}", "tailscale")
            assert d._browser is None  # no multicast in tailscale mode
    finally:
        listener.close()
