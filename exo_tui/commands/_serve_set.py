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
    from exo_tui.api.forwarding import CoordinatorSetApi, RemoteCluster
    from exo_tui.api.server import ApiServer, exposure_warning
    from exo_tui.cluster.consensus import CoordinatorSet, parse_coordinators
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.leadership import Leadership
    from exo_tui.commands.serve import READY_PREFIX
    from exo_tui.models.model import Model
    from exo_tui.models.spec import served_context
    from exo_tui.net.address import host_port
    from exo_tui.net.security import ensure_cluster
    from exo_tui.paths import exo_home

    if args.local_nodes:
        print("exo-tui serve: a coordinator set starts no local nodes (--local-nodes): run `exo-tui node` on each "
              "node's host, and give them to the coordinators with --peer, so that they outlive any one coordinator",
              file=sys.stderr)
        return 2
    cfg = config.coordinators
    home = exo_home()
    members = _members_file(config)
    if args.join:
        from exo_tui.discovery.join import JoinError
        from exo_tui.discovery.join_coordinator import join_set
        from exo_tui.net.security import SecurityError, install_cluster

        try:
            files, self_address, peers = await join_set(args.join, name=f"{socket.gethostname()}:{port}",
                                                        raft_port=cfg.port, api_port=port)
            await asyncio.to_thread(install_cluster, home, files)
        except (JoinError, SecurityError) as exc:
            print(f"exo-tui serve: join: {exc}", file=sys.stderr)
            return 2
        members.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        members.write_text(json.dumps({"self": self_address, "peers": peers}))
        partners = [p for p in peers if p != self_address]
        log.info("joined the set of coordinators as %s (members %s)", self_address, ", ".join(peers))
    elif not cfg.peers and members.exists():
        saved = json.loads(members.read_text())
        self_address, partners = str(saved["self"]), [p for p in saved["peers"] if p != saved["self"]]
    else:
        self_address, partners = parse_coordinators(cfg.peers, cfg.port)
    cluster = await asyncio.to_thread(ensure_cluster, home)
    key = config.network.api.key
    if warning := exposure_warning(host, key):
        print(f"exo-tui serve: {warning}", file=sys.stderr, flush=True)
    url_host = host if host not in ("0.0.0.0", "::") else self_address.rsplit(":", 1)[0]
    api_url = f"http://{host_port(url_host, port)}"
    model = await asyncio.to_thread(lambda: Model(args.model, paths=config.models.paths))
    _ = await asyncio.to_thread(lambda: model.tokenizer)
    from exo_tui.cluster.drafting import ClusterDraft, draft_model

    # each coordinator of the set is given the draft model: whichever leads runs it (refused here if unfit)
    draft = await asyncio.to_thread(lambda: draft_model(args.draft, model, config.models.paths)) if args.draft else None
    cset = CoordinatorSet(self_address, partners, state_dir=Path(cfg.state_dir or home / "coordinator"),
                          cluster_key=cluster.cluster_key, api_url=api_url, name=f"{socket.gethostname()}:{port}")
    remote = RemoteCluster(cset, model, args.model, config, served_context(model.config.context_length,
                                                                           config.models.context_length), key)
    front = CoordinatorSetApi(cset, remote, api_key=key, max_body_bytes=config.network.api.max_body_bytes)

    def make(store: Any, term: int) -> Coordinator:
        name = cset.state.model or args.model
        c = Coordinator(model=name, config=config, peers=list(args.peer), local_nodes=0, strategy=args.strategy,
                        discover=args.discover, persist=False, join=True)
        c.store, c.term = store, term
        c.coordinator_set = cset  # its join endpoint admits coordinators too
        store._on_write_error = c._state_write_error
        c.speculative = args.speculative
        if name == args.model:
            c.model = model
            if draft is not None:
                c.draft = ClusterDraft(draft, c, model)
        return c

    leadership = Leadership(cset, make, on_change=front.set_leader)
    server = ApiServer(None, host=host, port=port, api_key=key, sock=sock, app=front.guarded,
                       log_level="warning" if args.log_level != "debug" else "info")
    await server.start()
    leadership.start()
    register = asyncio.create_task(_register(cset, api_url), name="coordinator-register")
    try:
        print(f"{READY_PREFIX}{server.url}/v1 — coordinator {self_address} of a set of {len(partners) + 1} "
              f"(Raft on {self_address}; GET /health says who leads)", flush=True)
        await asyncio.Event().wait()
    finally:
        log.info("stopping")
        register.cancel()
        await server.stop()
        await leadership.stop()
        await front.aclose()
    return 0


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
