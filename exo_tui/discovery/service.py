"""The coordinator's discovery: every source of nodes and hosts, published as events.

Sources, by ``network.discovery.mode``:

========== ==================================================================================
mdns       mDNS nodes (``_exo-tui._tcp``) and SSH hosts (``_ssh._tcp``, ``_sftp-ssh._tcp``),
           static peers, ``~/.ssh/config`` hosts, and tailscale peers when tailscale is logged in
manual     static peers and ``~/.ssh/config`` hosts only; nothing is multicast
tailscale  tailnet peers (as hosts, and probed on the node port as nodes), static peers and
           ``~/.ssh/config`` hosts; no multicast
========== ==================================================================================

Static peers are config ``network.discovery.known_peers``, ``EXO_TUI_KNOWN_PEERS`` and ``--peer``.

A node is *foreign* until it proves it holds our cluster key. Discovery cannot know that — the
proof is the authenticated handshake the coordinator does over :mod:`exo_tui.net` — so it gives
its best guess from the advertisement (a node whose TXT ``cluster`` fingerprint is not ours is
foreign) and the coordinator settles it with :meth:`Discovery.mark_member` or
:meth:`Discovery.mark_foreign`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exo_tui.discovery.mdns import DEFAULT_NODE_PORT, MdnsBrowser, NodeAdvertisement, SshServiceRecord
from exo_tui.discovery.static import (
    CandidateHost,
    Peer,
    ssh_config_hosts,
    static_peers,
    tailscale_hosts,
    unique,
)
from exo_tui.events import (
    EventBus,
    HostDiscovered,
    HostGone,
    NodeDiscovered,
    NodeGone,
    NodeStateChanged,
    NodeUpdated,
)

log = logging.getLogger(__name__)

MODES = ("mdns", "manual", "tailscale")
TAILSCALE_INTERVAL_S = 30.0

# Probe a static peer: return what it says it is, or None when it does not answer.
PeerProbe = Callable[[Peer, float], Awaitable[NodeAdvertisement | None]]


async def tcp_probe(peer: Peer, timeout_s: float) -> NodeAdvertisement | None:
    """The default probe: the port accepts a TCP connection within ``timeout_s``.

    It cannot learn the node's id, so the node is keyed ``peer:HOST:PORT`` until the coordinator
    connects and learns who it is. The coordinator passes a better probe (the net layer's hello).
    """
    try:
        async with asyncio.timeout(timeout_s):
            _reader, writer = await asyncio.open_connection(peer.host, peer.port)
    except (OSError, TimeoutError):
        return None
    writer.close()
    with contextlib.suppress(Exception):  # the probe got its answer; how the socket closes does not matter
        await writer.wait_closed()
    return NodeAdvertisement(
        node_id=f"peer:{peer.key}", name=peer.host, port=peer.port, version="", addresses=(peer.host,)
    )


def net_probe(security: Any, cluster: str = "") -> PeerProbe:
    """A probe over :mod:`exo_tui.net`: the authenticated handshake, then the node's profile.

    A peer that answers the handshake is of our cluster (``cluster`` is then put in its record, so
    pass :func:`~exo_tui.discovery.mdns.cluster_fingerprint` of the CA, the same value given to
    :class:`Discovery`); one that is reachable but fails the handshake is reported keyed
    ``peer:HOST:PORT`` and foreign; one that does not answer is absent.
    """

    async def probe(peer: Peer, timeout_s: float) -> NodeAdvertisement | None:
        from exo_tui.net.client import connect
        from exo_tui.net.codec import call
        from exo_tui.net.errors import ConnectError, HandshakeError
        from exo_tui.net.messages import Profile, ProfileAsk

        try:
            conn = await connect(peer.host, peer.port, security=security, timeout=timeout_s)
        except HandshakeError:  # includes AuthError and ProtocolMismatch: someone else's node
            return NodeAdvertisement(node_id=f"peer:{peer.key}", name=peer.host, port=peer.port, version="",
                                     addresses=(peer.host,))
        except (ConnectError, OSError):
            return None
        try:
            prof = (await call(conn, ProfileAsk(), Profile, timeout=timeout_s)).profile
        except Exception as exc:  # a peer that does not answer a profile is not a node of ours (yet): not listed
            log.info("peer %s:%s is not listed: it did not answer a profile (%s: %s)", peer.host, peer.port,
                     type(exc).__name__, exc)
            return None
        finally:
            await conn.aclose()
        memory = prof.get("memory_limit_bytes") or prof.get("ram_available_bytes") or 0
        return NodeAdvertisement(
            node_id=str(prof.get("node_id") or f"peer:{peer.key}"), name=str(prof.get("name") or peer.host),
            port=peer.port, version=str(prof.get("version", "")), backends=tuple(prof.get("backends") or ()),
            memory_bytes=int(memory), cluster=cluster, addresses=(peer.host,),
        )

    return probe


@dataclass
class DiscoveredNode:
    node_id: str
    name: str
    address: str
    port: int
    backends: tuple[str, ...] = ()
    memory_bytes: int = 0
    version: str = ""
    cluster: str = ""
    addresses: tuple[str, ...] = ()
    source: str = "mdns"  # mdns | config | env | peer | tailscale
    foreign: bool = True
    verified: bool = False  # the coordinator settled ``foreign`` by a handshake
    last_seen: float = field(default_factory=time.time)


class Discovery:
    """Finds nodes and hosts and publishes ``Node*``/``Host*`` events on ``bus``.

    ``interfaces``: IP addresses for mDNS (None: all; ``["127.0.0.1"]`` in tests).
    ``ssh_config``: a path, None for ``~/.ssh/config``, or False to skip it.
    ``ignore_node_ids``: nodes not to report (the coordinator's own embedded node).
    """

    def __init__(
        self,
        bus: EventBus,
        *,
        mode: str = "mdns",
        known_peers: Iterable[str] = (),
        cli_peers: Iterable[str] = (),
        environ: dict[str, str] | None = None,
        ssh_config: Path | None | bool = None,
        interfaces: Sequence[str] | None = None,
        browse_interval_s: float = 5.0,
        connect_timeout_s: float = 3.0,
        node_port: int = DEFAULT_NODE_PORT,
        cluster_fingerprint: str = "",
        ignore_node_ids: Iterable[str] = (),
        probe: PeerProbe | None = None,
        tailscale_command: str = "tailscale",
        browse_hosts: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"network.discovery.mode is {mode!r}; use one of {', '.join(MODES)}")
        self.bus = bus
        self.mode = mode
        self.peers = static_peers(
            known_peers=known_peers, cli_peers=cli_peers, environ=environ, default_port=node_port
        )
        self.ssh_config = ssh_config
        self.interfaces = list(interfaces) if interfaces else None
        self.browse_interval_s = browse_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.node_port = node_port
        self.cluster_fingerprint = cluster_fingerprint
        self.ignore_node_ids = set(ignore_node_ids)
        self.probe = probe or tcp_probe
        self.tailscale_command = tailscale_command
        self.browse_hosts = browse_hosts

        self.nodes: dict[str, DiscoveredNode] = {}
        self.hosts: dict[tuple[str, int], CandidateHost] = {}
        self._mdns_nodes: dict[str, str] = {}  # mDNS instance -> node id
        self._mdns_hosts: dict[str, tuple[str, int]] = {}  # mDNS instance -> host key
        self._host_sources: dict[tuple[str, int], set[str]] = {}  # host key -> {"mdns:inst", "ssh_config", ...}
        self._peer_nodes: dict[str, str] = {}  # peer key -> node id
        self._browser: MdnsBrowser | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._tailscale_cache: list[CandidateHost] = []
        self._tailscale_next = 0.0

    @classmethod
    def from_config(cls, bus: EventBus, config: Any, *, cli_peers: Iterable[str] = (), **kwargs: Any) -> Discovery:
        """Build from the YAML config (``config.network.discovery``, ``config.network.node_port``).

        Accepts the config object or its plain-dict form.
        """

        def get(obj: Any, name: str, default: Any = None) -> Any:
            if obj is None:
                return default
            if isinstance(obj, dict):
                return obj.get(name, default)
            return getattr(obj, name, default)

        network = get(config, "network")
        disc = get(network, "discovery")
        opts: dict[str, Any] = {
            "mode": get(disc, "mode", "mdns"),
            "known_peers": list(get(disc, "known_peers", []) or []),
            "browse_interval_s": float(get(disc, "browse_interval", 5)),
            "connect_timeout_s": float(get(disc, "connect_timeout", 3)),
            "node_port": int(get(network, "node_port", DEFAULT_NODE_PORT)),
        }
        opts.update(kwargs)
        return cls(bus, cli_peers=cli_peers, **opts)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.mode == "mdns" and self._browser is None:
            self._browser = MdnsBrowser(
                on_node=self._on_mdns_node,
                on_host=self._on_mdns_host if self.browse_hosts else None,
                interfaces=self.interfaces,
                browse_hosts=self.browse_hosts,
            )
            await self._browser.start()
        if self._loop_task is None:
            await self.refresh()
            self._loop_task = asyncio.create_task(self._poll(), name="discovery-poll")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._browser is not None:
            await self._browser.stop()
            self._browser = None

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ foreign / member

    def mark_member(self, node_id: str) -> None:
        """The node proved our cluster key (authenticated handshake)."""
        self._settle(node_id, foreign=False, reason="proved the cluster key")

    def mark_foreign(self, node_id: str, reason: str = "does not hold this cluster's key") -> None:
        """The node failed the handshake: adopt it only by bootstrap over SSH or a join token."""
        self._settle(node_id, foreign=True, reason=reason)

    def _settle(self, node_id: str, *, foreign: bool, reason: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        changed = node.foreign != foreign or not node.verified
        node.foreign, node.verified = foreign, True
        if changed:
            state = "foreign" if foreign else "discovered"
            self.bus.publish(NodeStateChanged(node_id=node_id, state=state, reason=reason))

    # ------------------------------------------------------------------ polling of static sources

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.browse_interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discovery refresh failed")

    async def refresh(self) -> None:
        """One pass over ssh_config, tailscale and static peers."""
        async with self._lock:
            hosts: list[CandidateHost] = []
            if self.ssh_config is not False:
                path = self.ssh_config if isinstance(self.ssh_config, Path) else None
                hosts += ssh_config_hosts(path)
            ts_hosts = self._tailscale_cache
            now = time.monotonic()
            if self.mode in ("mdns", "tailscale") and now >= self._tailscale_next:
                # `tailscale status` is a process start: at most every TAILSCALE_INTERVAL_S.
                ts_hosts = self._tailscale_cache = await tailscale_hosts(command=self.tailscale_command)
                self._tailscale_next = now + max(self.browse_interval_s, TAILSCALE_INTERVAL_S)
            hosts += ts_hosts
            self._set_static_hosts(unique(hosts))
            peers = list(self.peers)
            if self.mode == "tailscale":
                peers += [Peer(h.hostname, self.node_port, "tailscale") for h in ts_hosts]
            await self._probe_peers(peers)

    def _set_static_hosts(self, hosts: list[CandidateHost]) -> None:
        new = {h.key: h for h in hosts}
        for key, sources in list(self._host_sources.items()):
            for src in ("ssh_config", "tailscale"):
                if src in sources and key not in new:
                    self._drop_host_source(key, src)
        for h in new.values():
            self._add_host_source(h, h.source)

    async def _probe_peers(self, peers: list[Peer]) -> None:
        results = await asyncio.gather(*(self.probe(p, self.connect_timeout_s) for p in peers))
        for peer, ad in zip(peers, results, strict=True):
            old_id = self._peer_nodes.get(peer.key)
            if ad is None:
                if old_id is not None:
                    del self._peer_nodes[peer.key]
                    self._node_gone(old_id)
                continue
            if old_id is not None and old_id != ad.node_id:
                self._node_gone(old_id)
            self._peer_nodes[peer.key] = ad.node_id
            if not ad.addresses:
                ad = dataclasses.replace(ad, addresses=(peer.host,))
            self._node_seen(ad, source=peer.source)

    # ------------------------------------------------------------------ nodes

    async def _on_mdns_node(self, instance: str, ad: NodeAdvertisement | None) -> None:
        if ad is None:
            node_id = self._mdns_nodes.pop(instance, None)
            if node_id is not None and node_id not in self._peer_nodes.values():
                self._node_gone(node_id)
            return
        old = self._mdns_nodes.get(instance)
        if old is not None and old != ad.node_id:
            self._node_gone(old)
        self._mdns_nodes[instance] = ad.node_id
        self._node_seen(ad, source="mdns")

    def _best_address(self, addresses: Sequence[str]) -> str:
        v4 = [a for a in addresses if ":" not in a]
        return (v4 or list(addresses) or [""])[0]

    def _node_seen(self, ad: NodeAdvertisement, *, source: str) -> None:
        if ad.node_id in self.ignore_node_ids:
            return
        address = self._best_address(ad.addresses)
        foreign = not (self.cluster_fingerprint and ad.cluster == self.cluster_fingerprint)
        node = self.nodes.get(ad.node_id)
        if node is None:
            node = DiscoveredNode(
                node_id=ad.node_id,
                name=ad.name,
                address=address,
                port=ad.port,
                backends=ad.backends,
                memory_bytes=ad.memory_bytes,
                version=ad.version,
                cluster=ad.cluster,
                addresses=ad.addresses,
                source=source,
                foreign=foreign,
            )
            self.nodes[ad.node_id] = node
            self.bus.publish(
                NodeDiscovered(
                    node_id=node.node_id,
                    name=node.name,
                    address=node.address,
                    port=node.port,
                    backends=node.backends,
                    memory_bytes=node.memory_bytes,
                    version=node.version,
                    foreign=node.foreign,
                    source=source,
                )
            )
            return
        node.last_seen = time.time()
        before = (node.name, node.address, node.addresses, node.port, node.backends, node.memory_bytes,
                  node.version, node.cluster)
        # A node seen by mDNS and as a static peer: keep the advertised (richer) record.
        if source != "mdns" and node.source == "mdns" and ad.node_id.startswith("peer:"):
            return
        node.name, node.port = ad.name, ad.port
        if address and (node.address not in ad.addresses or not node.address):
            node.address = address
        node.addresses = ad.addresses or node.addresses
        node.backends, node.memory_bytes, node.version = ad.backends, ad.memory_bytes, ad.version
        if ad.cluster != node.cluster:
            node.cluster = ad.cluster
            if not node.verified:
                node.foreign = foreign
        after = (node.name, node.address, node.addresses, node.port, node.backends, node.memory_bytes,
                 node.version, node.cluster)
        if after != before:
            self.bus.publish(NodeUpdated(node_id=node.node_id, name=node.name, address=node.address, port=node.port))

    def _node_gone(self, node_id: str) -> None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self.bus.publish(NodeGone(node_id=node_id, name=node.name))

    # ------------------------------------------------------------------ hosts

    async def _on_mdns_host(self, instance: str, rec: SshServiceRecord | None) -> None:
        if rec is None:
            key = self._mdns_hosts.pop(instance, None)
            if key is not None:
                self._drop_host_source(key, f"mdns:{instance}")
            return
        server = rec.server.rstrip(".")
        address = self._best_address(rec.addresses)
        alias = address or server
        host = CandidateHost(
            alias=alias,
            hostname=address or server,
            port=rec.port,
            source="mdns",
            name=instance.split(".", 1)[0] or server,
        )
        old = self._mdns_hosts.get(instance)
        if old is not None and old != host.key:
            self._drop_host_source(old, f"mdns:{instance}")
        self._mdns_hosts[instance] = host.key
        self._add_host_source(host, f"mdns:{instance}")

    def _add_host_source(self, host: CandidateHost, tag: str) -> None:
        sources = self._host_sources.setdefault(host.key, set())
        sources.add(tag)
        if host.key not in self.hosts:
            self.hosts[host.key] = host
            self.bus.publish(HostDiscovered(host=host.alias, port=host.port, source=host.source, name=host.name))

    def _drop_host_source(self, key: tuple[str, int], tag: str) -> None:
        sources = self._host_sources.get(key)
        if sources is None:
            return
        sources.discard(tag)
        if not sources:
            del self._host_sources[key]
            host = self.hosts.pop(key, None)
            if host is not None:
                self.bus.publish(HostGone(host=host.alias, port=host.port, source=host.source))
