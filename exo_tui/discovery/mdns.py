"""mDNS: the node agent's advertisement and the coordinator's browser.

A node advertises ``_exo-tui._tcp.local.`` with a TXT record that says who it is and what it
offers — id, name, version, port, backends, memory — and never a key or anything secret (the
optional ``cluster`` field is a fingerprint of the cluster CA's public certificate, which anyone
connecting sees anyway). It watches the host's addresses and re-announces when they change, and
withdraws the service on shutdown.

The coordinator side (:class:`MdnsBrowser`) browses node services and SSH services (``_ssh._tcp``,
``_sftp-ssh._tcp``: hosts that could be bootstrapped) and calls back with parsed records;
:class:`exo_tui.discovery.service.Discovery` turns those into events.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
from zeroconf import DNSAddress, DNSOutgoing, InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf
from zeroconf.const import _CLASS_IN_UNIQUE, _FLAGS_AA, _FLAGS_QR_RESPONSE, _TYPE_A, _TYPE_AAAA

from exo_tui import __version__

log = logging.getLogger(__name__)

NODE_SERVICE = "_exo-tui._tcp.local."
SSH_SERVICES = ("_ssh._tcp.local.", "_sftp-ssh._tcp.local.")
DEFAULT_NODE_PORT = 52416

# TXT keys a node may publish; anything else in a TXT record is ignored by the browser.
TXT_KEYS = ("id", "name", "version", "port", "backends", "memory", "cluster")


@dataclass(frozen=True)
class NodeAdvertisement:
    """What one node's TXT record says, plus the addresses its records carry."""

    node_id: str
    name: str
    port: int
    version: str = __version__
    backends: tuple[str, ...] = ()
    memory_bytes: int = 0
    cluster: str = ""  # public fingerprint of the cluster CA the node holds, "" if none
    addresses: tuple[str, ...] = ()
    instance: str = ""  # the mDNS instance name

    def txt(self) -> dict[str, str]:
        txt = {
            "id": self.node_id,
            "name": self.name,
            "version": self.version,
            "port": str(self.port),
            "backends": ",".join(self.backends),
            "memory": str(int(self.memory_bytes)),
        }
        if self.cluster:
            txt["cluster"] = self.cluster
        return txt

    @classmethod
    def from_txt(
        cls, props: dict[bytes, bytes | None], *, port: int, addresses: Sequence[str] = (), instance: str = ""
    ) -> NodeAdvertisement | None:
        """Parse a TXT record; ``None`` when it is not a usable exo-tui advertisement."""
        txt = {k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace") for k, v in props.items()}
        node_id = txt.get("id", "").strip()
        if not node_id:
            return None
        try:
            txt_port = int(txt.get("port") or port)
            memory = int(txt.get("memory") or 0)
        except ValueError:
            return None
        return cls(
            node_id=node_id,
            name=txt.get("name") or node_id,
            port=txt_port,
            version=txt.get("version", ""),
            backends=tuple(b for b in txt.get("backends", "").split(",") if b),
            memory_bytes=max(0, memory),
            cluster=txt.get("cluster", ""),
            addresses=tuple(addresses),
            instance=instance,
        )


@dataclass(frozen=True)
class SshServiceRecord:
    """A host that announces an SSH server over mDNS."""

    instance: str
    server: str  # e.g. "mac-mini.local."
    addresses: tuple[str, ...]
    port: int
    service: str


def cluster_fingerprint(ca_cert_pem: bytes) -> str:
    """The public TXT ``cluster`` value: the first 16 hex digits of SHA-256 of the CA certificate.

    Not a secret (the CA certificate is shown to anyone who connects); it lets the coordinator
    tell at a glance that an advertisement claims another cluster. Proof is the handshake.
    """
    from exo_tui.net.security import cert_fingerprint

    return cert_fingerprint(ca_cert_pem).hex()[:16]


def host_addresses(*, include_loopback: bool = False, ipv6: bool = True) -> tuple[str, ...]:
    """This host's unicast addresses, sorted (IPv4 first). Link-local IPv6 is left out."""
    out: set[str] = set()
    for _ifname, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if a.family == socket.AF_INET6 and not ipv6:
                continue
            text = a.address.split("%", 1)[0]
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
                continue
            if ip.is_loopback and not include_loopback:
                continue
            out.add(str(ip))
    return tuple(sorted(out, key=lambda s: (":" in s, s)))


def _label(text: str, limit: int = 40) -> str:
    """A DNS-label-safe form of ``text`` (letters, digits, '-')."""
    label = re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-")
    return (label or "node")[:limit]


def _ip_version(addresses: Iterable[str]) -> IPVersion:
    kinds = {":" in a for a in addresses}
    if kinds == {True}:
        return IPVersion.V6Only
    if kinds == {False}:
        return IPVersion.V4Only
    return IPVersion.All


def make_zeroconf(interfaces: Sequence[str] | None) -> AsyncZeroconf:
    """An AsyncZeroconf bound to ``interfaces`` (IP addresses), or to every interface when None.

    Binding to ``["127.0.0.1"]`` keeps mDNS on loopback (tests); a network namespace's veth
    address keeps it on that link.
    """
    if interfaces:
        return AsyncZeroconf(interfaces=list(interfaces), ip_version=_ip_version(interfaces))
    return AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)


class NodeAdvertiser:
    """Advertises one node agent over mDNS while it runs.

    ``interfaces``: IP addresses to bind mDNS to (None: all). The A/AAAA records carry
    ``addresses`` if given; else what ``address_source()`` returns, re-read every
    ``poll_interval_s`` seconds (a change re-announces the service); else the bound
    ``interfaces``; else the host's non-loopback IPv4 addresses, re-read the same way.

    Use as ``async with NodeAdvertiser(...)`` or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        node_id: str,
        name: str,
        port: int = DEFAULT_NODE_PORT,
        *,
        version: str = __version__,
        backends: Sequence[str] = (),
        memory_bytes: int = 0,
        cluster: str = "",
        interfaces: Sequence[str] | None = None,
        addresses: Sequence[str] | None = None,
        poll_interval_s: float = 5.0,
        address_source: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.advertisement = NodeAdvertisement(
            node_id=node_id,
            name=name,
            port=port,
            version=version,
            backends=tuple(backends),
            memory_bytes=int(memory_bytes),
            cluster=cluster,
        )
        self.interfaces = list(interfaces) if interfaces else None
        if addresses:
            self._fixed_addresses: tuple[str, ...] | None = tuple(addresses)
        elif address_source is None and interfaces:
            self._fixed_addresses = tuple(interfaces)
        else:
            self._fixed_addresses = None
        self._address_source = address_source or (lambda: host_addresses(ipv6=False))
        self.poll_interval_s = poll_interval_s
        self.instance = f"{_label(name)}-{_label(node_id, 12)}.{NODE_SERVICE}"
        self.server = f"{_label(name)}-{_label(node_id, 12)}.local."
        self._azc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        self._watch: asyncio.Task[None] | None = None
        self.addresses: tuple[str, ...] = ()
        self.announcements = 0  # how many times the service was (re-)announced

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._azc is not None:
            return
        self.addresses = self._current_addresses()
        self._azc = make_zeroconf(self.interfaces)
        self._info = self._make_info(self.addresses)
        await (await self._azc.async_register_service(self._info, allow_name_change=True))
        self.instance = self._info.name
        self.announcements += 1
        if self._fixed_addresses is None and self.poll_interval_s > 0:
            self._watch = asyncio.create_task(self._watch_addresses(), name="mdns-address-watch")
        log.info("advertising %s on %s", self.instance, ", ".join(self.addresses) or "no address")

    async def stop(self) -> None:
        """Withdraw the service (mDNS goodbye) and close the sockets."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        azc, info = self._azc, self._info
        self._azc = self._info = None
        if azc is None:
            return
        try:
            if info is not None:
                await (await azc.async_unregister_service(info))
        finally:
            await azc.async_close()

    async def __aenter__(self) -> NodeAdvertiser:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def update(self, **changes: object) -> None:
        """Change advertised fields (``memory_bytes``, ``backends``, ``name``...) and re-announce."""
        fields: dict[str, Any] = dict(changes)  # NodeAdvertisement's fields, checked by the dataclass
        if "backends" in fields:
            fields["backends"] = tuple(fields["backends"])
        self.advertisement = _replace(self.advertisement, **fields)
        await self._reannounce(self.addresses, rescan=False)

    # ------------------------------------------------------------------ internals

    def _current_addresses(self) -> tuple[str, ...]:
        if self._fixed_addresses is not None:
            return self._fixed_addresses
        return tuple(self._address_source())

    def _make_info(self, addresses: Sequence[str]) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            NODE_SERVICE,
            self.instance,
            port=self.advertisement.port,
            properties=self.advertisement.txt(),
            server=self.server,
            parsed_addresses=list(addresses),
        )

    async def _reannounce(self, addresses: tuple[str, ...], *, rescan: bool) -> None:
        if self._azc is None:
            return
        if rescan and not self.interfaces:
            # New interfaces need new sockets; zeroconf reconciles them and re-announces.
            await self._azc.async_update_interfaces()
        stale = [a for a in self.addresses if a not in addresses]
        self.addresses = addresses
        if stale:  # first, so that browsers resolving the update see only the new addresses
            self._goodbye_addresses(stale)
            await asyncio.sleep(0.05)
        self._info = self._make_info(addresses)
        self.announcements += 1
        await (await self._azc.async_update_service(self._info))
        log.info("re-announced %s on %s", self.instance, ", ".join(addresses) or "no address")

    def _goodbye_addresses(self, addresses: Sequence[str]) -> None:
        """Tell caches to drop address records we no longer hold (TTL 0), as mDNS goodbyes do."""
        assert self._azc is not None
        out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
        for a in addresses:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
            rtype = _TYPE_AAAA if ip.version == 6 else _TYPE_A
            out.add_answer_at_time(DNSAddress(self.server, rtype, _CLASS_IN_UNIQUE, 0, ip.packed), 0)
        self._azc.zeroconf.async_send(out)

    async def _watch_addresses(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                now = self._current_addresses()
                if set(now) != set(self.addresses):
                    await self._reannounce(now, rescan=True)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep advertising; the next poll tries again
                log.exception("re-announcing %s failed", self.instance)


def _replace(adv: NodeAdvertisement, **changes: Any) -> NodeAdvertisement:
    import dataclasses

    return dataclasses.replace(adv, **changes)


# ---------------------------------------------------------------------- browsing


NodeCallback = Callable[[str, NodeAdvertisement | None], Awaitable[None] | None]
HostCallback = Callable[[str, SshServiceRecord | None], Awaitable[None] | None]


@dataclass
class MdnsBrowser:
    """Browses node and SSH services; calls ``on_node(instance, ad)`` / ``on_host(instance, rec)``.

    The record is ``None`` when the service is withdrawn (goodbye or TTL expiry).
    """

    on_node: NodeCallback
    on_host: HostCallback | None = None
    interfaces: Sequence[str] | None = None
    resolve_timeout_s: float = 3.0
    browse_hosts: bool = True
    _azc: AsyncZeroconf | None = field(default=None, init=False)
    _browser: AsyncServiceBrowser | None = field(default=None, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def start(self) -> None:
        if self._azc is not None:
            return
        self._azc = make_zeroconf(self.interfaces)
        types = [NODE_SERVICE, *(SSH_SERVICES if self.browse_hosts and self.on_host else ())]
        self._browser = AsyncServiceBrowser(self._azc.zeroconf, types, handlers=[self._on_change])

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._azc is not None:
            await self._azc.async_close()
            self._azc = None

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(service_type, name, state_change))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, service_type: str, name: str, change: ServiceStateChange) -> None:
        try:
            if change is ServiceStateChange.Removed:
                await self._emit(service_type, name, None)
                return
            assert self._azc is not None
            info = AsyncServiceInfo(service_type, name)
            if not await info.async_request(self._azc.zeroconf, int(self.resolve_timeout_s * 1000)):
                log.debug("could not resolve %s", name)
                return
            addresses = tuple(info.parsed_scoped_addresses(IPVersion.All))
            if service_type == NODE_SERVICE:
                ad = NodeAdvertisement.from_txt(
                    info.properties or {}, port=info.port or 0, addresses=addresses, instance=name
                )
                if ad is None:
                    log.debug("ignoring %s: TXT has no node id", name)
                    return
                await self._emit(service_type, name, ad)
            else:
                rec = SshServiceRecord(
                    instance=name,
                    server=info.server or "",
                    addresses=addresses,
                    port=info.port or 22,
                    service=service_type,
                )
                await self._emit(service_type, name, rec)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handling mDNS change for %s failed", name)

    async def _emit(self, service_type: str, name: str, record: NodeAdvertisement | SshServiceRecord | None) -> None:
        if service_type == NODE_SERVICE and not isinstance(record, SshServiceRecord):
            result = self.on_node(name, record)
        elif self.on_host is not None and not isinstance(record, NodeAdvertisement):
            result = self.on_host(name, record)
        else:
            return
        if asyncio.iscoroutine(result):
            await result
