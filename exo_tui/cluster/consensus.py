"""The coordinator set: Raft among the coordinators (pysyncobj), who leads and in which term.

``exo-tui serve --coordinator-port P --coordinators HOST:PORT,... --state-dir DIR`` (or the config's
``coordinators.*``) makes this process one of a set of coordinators. pysyncobj (a maintained Raft:
elections, terms, log replication, journal, snapshots, membership changes) runs on its own thread
and this module only reads it and submits to it: the state it replicates is
:class:`~exo_tui.cluster.replicated_state.ClusterState`; what a change of leader does is
:mod:`exo_tui.cluster.leadership`'s.

Security: Raft's port listens on this coordinator's own address in ``--coordinators`` (never
0.0.0.0), and every message is encrypted and authenticated (Fernet: AES-CBC + HMAC-SHA256) with a
password derived from the cluster key, so only holders of the key take part. pysyncobj pickles its
messages; an unauthenticated byte never reaches the unpickler.

Timing: an election timeout of 0.4-1.0 s after the last heartbeat (every 0.1 s), and a leader that
hears from no majority for 1.2 s steps down by itself (its lease), so a new leader is in charge
about a second after the old one stops answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf

from exo_tui.cluster import raft_lib  # noqa: F401  (undoes pysyncobj's patch of socket.inet_ntop)
from exo_tui.cluster.replicated_state import ClusterState, NotAcknowledged, fail_text
from exo_tui.net.address import host_port, split_host_port

log = logging.getLogger("exo_tui.cluster.consensus")

ELECTION_MIN_S = 0.4
ELECTION_MAX_S = 1.0
HEARTBEAT_S = 0.1
LEASE_S = 1.2  # a leader that hears from no majority this long steps down
SUBMIT_TIMEOUT_S = 3.0
ADMIT_WAIT_S = 2.0


class CoordinatorSetError(ValueError):
    """A coordinator set that cannot be formed as configured; the message says what to change."""


def _local_addresses() -> set[str]:
    import psutil

    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return found


def _is_here(host: str, local: set[str]) -> bool:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(resolved & local)


def parse_coordinators(text: str | list[str], port: int) -> tuple[str, list[str]]:
    """``(self, partners)`` from ``--coordinators`` (comma list or list of HOST:PORT) and
    ``--coordinator-port``: this coordinator is the entry on this machine at ``port``."""
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    addresses = []
    for item in items:
        host, p = split_host_port(item, 0)
        if not p:
            raise CoordinatorSetError(f"--coordinators entry {item!r} has no port: write HOST:PORT")
        addresses.append(host_port(host, p))
    if len(set(addresses)) != len(addresses):
        raise CoordinatorSetError(f"--coordinators names a coordinator twice: {', '.join(addresses)}")
    local = _local_addresses()
    mine = [a for a in addresses if int(a.rsplit(":", 1)[1]) == port and _is_here(a.rsplit(":", 1)[0], local)]
    if len(mine) != 1:
        raise CoordinatorSetError(
            f"--coordinators ({', '.join(addresses) or 'empty'}) must name this machine once at --coordinator-port "
            f"{port}: add this coordinator's HOST:{port} to the list given to every coordinator")
    if len(addresses) < 3:
        log.warning("a set of %d coordinators survives no failure (a majority of %d is all of them): run 3 or 5",
                    len(addresses), len(addresses))
    return mine[0], [a for a in addresses if a != mine[0]]


def raft_password(cluster_key: bytes) -> str:
    """The key pysyncobj encrypts and authenticates Raft's messages with: derived from the cluster
    key, never the key itself."""
    return hmac.new(cluster_key, b"exo-tui coordinator raft v1", hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class CoordinatorStatus:
    address: str  # its Raft address
    name: str
    api: str  # its API URL, as it registered it
    role: str  # leader | standby | unreachable
    term: int  # the term this coordinator knows of (the leader's term for the others)
    lag: int  # log entries it has not applied yet (as the one asked sees it; -1: unknown here)
    applied: int  # the last log index it applied (the leader knows each one's; -1: unknown here)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class CoordinatorSet:
    """This coordinator's place in the set: its Raft, who leads, what the state is."""

    def __init__(self, self_address: str, partners: list[str], *, state_dir: Path, cluster_key: bytes,
                 api_url: str, name: str) -> None:
        self.address = self_address
        self.partners = list(partners)
        self.api_url = api_url
        self.name = name
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.state = ClusterState()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        conf = SyncObjConf(
            password=raft_password(cluster_key),
            journalFile=str(self.state_dir / "raft.journal"),
            fullDumpFile=str(self.state_dir / "raft.dump"),
            raftMinTimeout=ELECTION_MIN_S, raftMaxTimeout=ELECTION_MAX_S, appendEntriesPeriod=HEARTBEAT_S,
            leaderFallbackTimeout=LEASE_S, connectionRetryTime=0.3, connectionTimeout=ELECTION_MAX_S,
            dynamicMembershipChange=True, onStateChanged=self._on_state_changed,
            logCompactionMinEntries=5000, logCompactionMinTime=300,
        )
        self.sync = SyncObj(self_address, self.partners, conf, consumers=[self.state])

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _on_state_changed(self, _old: int, _new: int) -> None:  # pysyncobj's thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.changed.set)

    # ---------------------------------------------------------------- reads

    @property
    def is_leader(self) -> bool:
        return bool(self.sync._isLeader())

    @property
    def term(self) -> int:
        return int(self.sync.raftCurrentTerm)

    @property
    def leader_address(self) -> str | None:
        leader = self.sync._getLeader()
        return None if leader is None else str(leader.address)

    @property
    def has_quorum(self) -> bool:
        return bool(self.sync.hasQuorum)

    def leader_api(self) -> str | None:
        """The API URL of the leader this coordinator knows of (None while none leads)."""
        addr = self.leader_address
        if addr is None:
            return None
        if addr == self.address:
            return self.api_url
        return self.state.coordinators.get(addr, {}).get("api")

    @property
    def role(self) -> str:
        return "leader" if self.is_leader else "standby"

    def minority_sentence(self) -> str:
        reached = 1 + sum(1 for p in self.partners if self._connected(p))
        return (f"this coordinator reaches {reached} of the {len(self.partners) + 1} coordinators, not a majority: "
                "it refuses changes until it reaches the others (check the network between them)")

    def _connected(self, address: str) -> bool:
        for node in self.sync.otherNodes:
            if str(node.address) == address:
                return bool(self.sync.isNodeConnected(node))
        return False

    def status(self) -> list[CoordinatorStatus]:
        """Every coordinator as this one sees it: role, term, lag (entries behind the commit)."""
        s = self.sync.getStatus()
        leader = self.leader_address
        term = int(s["raft_term"])
        out = []
        for address in [self.address, *sorted(str(n.address) for n in self.sync.otherNodes)]:
            info = self.state.coordinators.get(address, {})
            if address == self.address:
                applied = int(s["last_applied"] or 0)
                role, lag = self.role, max(0, int(s["leader_commit_idx"] or 0) - applied)
            else:
                connected = self._connected(address)
                role = "leader" if address == leader else ("standby" if connected else "unreachable")
                lag = applied = -1
                if self.is_leader:
                    match = s.get(f"match_idx_server_{address}")
                    if match is not None:
                        applied, lag = int(match), max(0, int(s["commit_idx"]) - int(match))
            out.append(CoordinatorStatus(address, str(info.get("name", "")), str(info.get("api", "")), role, term, lag,
                                         applied))
        return out

    def commit_index(self) -> int:
        return int(self.sync.raftCommitIndex)

    # ---------------------------------------------------------------- writes

    async def submit(self, method: Callable[..., Any], *args: Any, timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
        """Run a ``@replicated`` method of :attr:`state`; return once a majority holds it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def done(_result: Any, err: Any) -> None:
            def resolve() -> None:
                if future.done():
                    return
                if err == FAIL_REASON.SUCCESS:
                    future.set_result(None)
                else:
                    future.set_exception(NotAcknowledged(f"not acknowledged by a majority: {fail_text(err)}"))
            loop.call_soon_threadsafe(resolve)

        method(*args, callback=done)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            raise NotAcknowledged(f"no majority acknowledged within {timeout_s:.0f} s: {self.minority_sentence()}") from None

    async def admit(self, name: str, host: str, raft_port: int, api_port: int) -> dict[str, Any]:
        """A coordinator joins the set (with a token, :mod:`exo_tui.discovery.join_coordinator`):
        a Raft membership change; what the new member needs to start. The change is answered
        once a majority holds it (or after ``ADMIT_WAIT_S`` if it is still in the leader's log).
        Where the new member is needed for that majority (a set of 1 becoming 2; a set of 3
        becoming 4 with one of the 3 away) it is answered at once: the change commits once the
        new member starts and answers. Meanwhile this leader, short of a majority, steps down
        when its lease runs out, and is elected again with the new member's vote."""
        from exo_tui.discovery.join import NotLeader, SetRefused

        address = f"{host}:{raft_port}"
        members = [self.address, *(str(n.address) for n in self.sync.otherNodes)]
        if address not in members:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()

            def done(_result: Any, err: Any) -> None:
                def resolve() -> None:
                    if not future.done():
                        if err == FAIL_REASON.SUCCESS:
                            future.set_result(None)
                        else:
                            future.set_exception(SetRefused(f"the set did not take the new coordinator: {fail_text(err)}"))
                loop.call_soon_threadsafe(resolve)

            if not self.is_leader:
                raise NotLeader("this coordinator no longer leads the set: make the token where the leader runs")
            reachable = 1 + sum(1 for p in members[1:] if self._connected(p))
            self.sync.addNodeToCluster(address, callback=done)
            if reachable >= (len(members) + 1) // 2 + 1:  # a majority of the new set without the new member
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ADMIT_WAIT_S):
                        await future  # a refusal (the leader lost its place) raises SetRefused
            else:
                future.add_done_callback(lambda f: _log_refusal(name, f))
            members.append(address)
        log.info("coordinator %s joined the set at %s", name, address)
        return {"raft": address, "peers": members}

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until this coordinator has caught up with the log once (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not self.sync.isReady():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def close(self) -> None:
        self.sync.destroy()


def _log_refusal(name: str, future: asyncio.Future[None]) -> None:
    """A membership change answered before it committed, which the set then refused."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("coordinator %s was not taken into the set after all: %s", name, exc)
