"""``exo-tui serve --coordinators HOST:PORT,... --coordinator-port PORT --state-dir DIR``: one
coordinator of a set (docs/coordinators.md).

The API listens at once, on every coordinator; Raft elects a leader, which runs the coordinator
(:mod:`exo_tui.cluster.leadership`); the others stand by and forward (:mod:`exo_tui.api.forwarding`).
Nodes are not started here (``--local-nodes`` is refused): they run as ``exo-tui node`` on their
own, so that they outlive any one coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("exo_tui.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinators", default=None, metavar="HOST:PORT,...",
                   help="every coordinator's Raft address, this one's included: with it, this is one of a set of "
                        "coordinators (one leads, the others stand by and take over); default coordinators.peers")
    p.add_argument("--coordinator-port", type=int, default=None, metavar="PORT",
                   help="this coordinator's Raft port (its entry in --coordinators; default coordinators.port, 52418)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where this coordinator keeps its Raft journal (default coordinators.state_dir, "
                        "<exo home>/coordinator)")
    p.add_argument("--join", default=None, metavar="TOKEN",
                   help="join a set of coordinators as a standby with a token from `exo-tui join-token --coordinator` "
                        "(made where the set's leader runs): it gets the cluster's secrets and the set's members")


def wanted(args: argparse.Namespace, config: Any) -> bool:
    """Whether ``serve`` runs as one of a set (flags, else the config)."""
    if args.coordinators is not None:
        config.coordinators.peers = [p.strip() for p in args.coordinators.split(",") if p.strip()]
    if args.coordinator_port is not None:
        config.coordinators.port = args.coordinator_port
    if args.state_dir is not None:
        config.coordinators.state_dir = args.state_dir
    return bool(config.coordinators.peers) or bool(args.join) or _members_file(config).exists()


def _members_file(config: Any) -> Path:
    """Where a coordinator that joined with a token keeps the set's members (a restart reads it)."""
    from exo_tui.paths import exo_home

    return Path(config.coordinators.state_dir or exo_home() / "coordinator") / "members.json"


async def serve_set(args: argparse.Namespace, config: Any, sock: socket.socket, host: str, port: int) -> int:
    from exo_tui.commands.serve import READY_PREFIX

    if args.local_nodes:
        print(f"exo-tui serve: {NO_LOCAL_NODES}", file=sys.stderr)
        return 2
    member = SetMember(config, sock, host, port, model=args.model, peers=list(args.peer), strategy=args.strategy,
                       discover=args.discover, join=args.join, quiet=args.log_level != "debug", draft=args.draft,
                       speculative=args.speculative)
    try:
        await member.start()
    except MemberError as exc:
        print(f"exo-tui serve: {exc}", file=sys.stderr)
        return 2
    try:
        print(f"{READY_PREFIX}{member.server_url}/v1 — coordinator {member.address} of a set of {member.size} "
              f"(Raft on {member.address}; GET /health says who leads)", flush=True)
        await asyncio.Event().wait()
    finally:
        log.info("stopping")
        await member.stop()
    return 0


NO_LOCAL_NODES = ("a coordinator set starts no local nodes (--local-nodes): run `exo-tui node` on each node's host, "
                  "and give them to the coordinators with --peer, so that they outlive any one coordinator")


LEADER_WAIT_S = 30.0  # the console waits this long for the set to serve (an election takes about a second)


class MemberError(Exception):
    """This process cannot be a member of the set (a join refused): one sentence saying why."""


class SetMember:
    """One coordinator of a set, in this process: its API (every route, forwarded to the leader
    when this one stands by) on ``sock``, its Raft member, and the coordinator it runs while it
    leads. ``exo-tui serve`` runs one headless; the console runs one and attaches to its API
    (``local_url``), following whichever coordinator leads."""

    def __init__(self, config: Any, sock: socket.socket, host: str, port: int, *, model: str | None,
                 peers: list[str], strategy: str | None = None, discover: bool = False, join: str | None = None,
                 quiet: bool = True, draft: str | None = None, speculative: Any = "auto") -> None:
        self.config, self.sock, self.host, self.port = config, sock, host, port
        self.model, self.peers, self.strategy, self.discover, self.join = model, peers, strategy, discover, join
        self.quiet, self.draft, self.speculative = quiet, draft, speculative
        self.address = ""
        self.size = 0
        self.server_url = ""
        self._stops: list[Any] = []

    @property
    def local_url(self) -> str:
        """This member's API as a process on this machine reaches it."""
        from exo_tui.net.address import host_port

        return f"http://{host_port(self.host if self.host not in ('0.0.0.0', '::') else '127.0.0.1', self.port)}"

    async def start(self) -> None:
        from exo_tui.api.forwarding import CoordinatorSetApi, RemoteCluster
        from exo_tui.api.server import ApiServer, exposure_warning
        from exo_tui.cluster.consensus import CoordinatorSet, parse_coordinators
        from exo_tui.cluster.coordinator import Coordinator
        from exo_tui.cluster.leadership import Leadership
        from exo_tui.models.model import Model
        from exo_tui.models.spec import served_context
        from exo_tui.net.address import host_port
        from exo_tui.net.security import ensure_cluster
        from exo_tui.paths import exo_home

        config, host, port = self.config, self.host, self.port
        cfg = config.coordinators
        home = exo_home()
        members = _members_file(config)
        if self.join:
            from exo_tui.discovery.join import JoinError
            from exo_tui.discovery.join_coordinator import join_set
            from exo_tui.net.security import SecurityError, install_cluster

            try:
                files, self_address, peers = await join_set(self.join, name=f"{socket.gethostname()}:{port}",
                                                            raft_port=cfg.port, api_port=port)
                await asyncio.to_thread(install_cluster, home, files)
            except (JoinError, SecurityError) as exc:
                raise MemberError(f"join: {exc}") from exc
            members.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            members.write_text(json.dumps({"self": self_address, "peers": peers}))
            partners = [p for p in peers if p != self_address]
            log.info("joined the set of coordinators as %s (members %s)", self_address, ", ".join(peers))
        elif not cfg.peers and members.exists():
            saved = json.loads(members.read_text())
            self_address, partners = str(saved["self"]), [p for p in saved["peers"] if p != saved["self"]]
        else:
            self_address, partners = parse_coordinators(cfg.peers, cfg.port)
        self.address, self.size = self_address, len(partners) + 1
        cluster = await asyncio.to_thread(ensure_cluster, home)
        key = config.network.api.key
        if warning := exposure_warning(host, key):
            log.warning("exo-tui serve: %s", warning)
        url_host = host if host not in ("0.0.0.0", "::") else self_address.rsplit(":", 1)[0]
        api_url = f"http://{host_port(url_host, port)}"
        model = await asyncio.to_thread(lambda: Model(self.model, paths=config.models.paths))
        _ = await asyncio.to_thread(lambda: model.tokenizer)
        from exo_tui.cluster.drafting import ClusterDraft, draft_model

        # each coordinator of the set is given the draft model: whichever leads runs it (refused here if unfit)
        draft = await asyncio.to_thread(draft_model, self.draft, model, config.models.paths) if self.draft else None
        cset = CoordinatorSet(self_address, partners, state_dir=Path(cfg.state_dir or home / "coordinator"),
                              cluster_key=cluster.cluster_key, api_url=api_url, name=f"{socket.gethostname()}:{port}")
        remote = RemoteCluster(cset, model, self.model, config, served_context(model.config.context_length,
                                                                               config.models.context_length), key)
        front = CoordinatorSetApi(cset, remote, api_key=key, max_body_bytes=config.network.api.max_body_bytes)

        def make(store: Any, term: int) -> Coordinator:
            name = cset.state.model or self.model
            c = Coordinator(model=name, config=config, peers=list(self.peers), local_nodes=0, strategy=self.strategy,
                            discover=self.discover, persist=False, join=True)
            c.store, c.term = store, term
            c.coordinator_set = cset  # its join endpoint admits coordinators too
            store._on_write_error = c._state_write_error
            c.speculative = self.speculative
            if name == self.model:
                c.model = model
                if draft is not None:
                    c.draft = ClusterDraft(draft, c, model)
            return c

        leadership = Leadership(cset, make, on_change=front.set_leader)
        server = ApiServer(None, host=host, port=port, api_key=key, sock=self.sock, app=front.guarded,
                           log_level="warning" if self.quiet else "info")
        await server.start()
        self._stops.append(server.stop)
        leadership.start()
        self._stops.append(leadership.stop)
        self._stops.append(front.aclose)
        register = asyncio.create_task(_register(cset, api_url), name="coordinator-register")
        self._stops.insert(0, _cancel(register))
        self.server_url = server.url

    async def attach(self, client: Any, timeout_s: float = LEADER_WAIT_S) -> None:
        """Start ``client`` (a :class:`~exo_tui.api.client.ClusterClient` of :attr:`local_url`)
        once this member's API serves the cluster: after the election, and where this one leads,
        once it is in charge (its API answers 503 until then); the last refusal after ``timeout_s``."""
        from exo_tui.api.client import ApiClientError

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                await client.start()
                return
            except ApiClientError as exc:
                if exc.status != 503 or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        stops, self._stops = self._stops, []
        for stop in stops:
            await stop()
        self.sock.close()  # the API server closes it; a start that failed before it did not


def _cancel(task: asyncio.Task[Any]) -> Any:
    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return cancel


async def _register(cset: Any, api_url: str) -> None:
    """Put this coordinator's API URL in the replicated state (retried until a leader takes it)."""
    from exo_tui.cluster.replicated_state import NotAcknowledged

    while True:
        known = cset.state.coordinators.get(cset.address, {})
        if known.get("api") == api_url and known.get("name") == cset.name:
            return
        with contextlib.suppress(NotAcknowledged):
            await cset.submit(cset.state.put_coordinator, cset.address, api_url, cset.name)
            continue
        await asyncio.sleep(0.3)
