"""Join tokens for coordinators: ``exo-tui serve --join TOKEN`` adds a standby to a set.

The operator runs ``exo-tui join-token --coordinator`` where a set's leader runs (its join endpoint
answers), then ``exo-tui serve --join TOKEN --coordinator-port P`` on the new machine. The request
is a node's (:mod:`exo_tui.discovery.join`: TLS, the certificate pinned by the token, the one-time
secret) with ``raft_port`` and ``api_port``; a token made for a node is refused. The leader adds
the new coordinator to the set (a Raft membership change, committed by a majority) and answers
with the cluster's secrets (the CA and its key, the cluster key, the coordinator certificate: a
coordinator issues node bundles and drives nodes), the new member's Raft address as the leader
sees it, and every member's: the new coordinator starts with them and catches up with the log.
"""

from __future__ import annotations

import base64
from typing import Any

from exo_tui.discovery.join import AnswerIncomplete, JoinError, JoinToken, exchange

SECRET_FILES = ("ca.crt", "ca.key", "cluster.key", "coordinator.crt", "coordinator.key")


async def answer_coordinator(server: Any, req: dict[str, Any], name: str, writer: Any) -> dict[str, Any]:
    """The join endpoint's answer to a coordinator's request (see the module doc)."""
    raft_port, api_port = req.get("raft_port"), req.get("api_port")
    if type(raft_port) is not int or not 0 < raft_port < 65536 or type(api_port) is not int or not 0 < api_port < 65536:
        return {"ok": False, "error": "a coordinator's join request needs its raft_port and api_port"}
    if server.on_coordinator is None:
        return {"ok": False, "error": "this coordinator is not one of a set: start it with --coordinators to let "
                                      "other coordinators join"}
    try:
        server.store.consume(str(req.get("id", "")), str(req.get("secret", "")), name=name, role="coordinator")
    except JoinError as exc:
        return {"ok": False, "error": str(exc), "code": exc.code}
    peer = writer.get_extra_info("peername")
    try:
        added = await server.on_coordinator(name, str(peer[0]) if peer else "", raft_port, api_port)
    except JoinError as exc:
        return {"ok": False, "error": str(exc), "code": exc.code}
    from exo_tui.net.security import cluster_dir, read_secret

    d = cluster_dir(server.home)
    files = {f: read_secret(d / f) for f in SECRET_FILES}
    return {"ok": True, "secrets": {k: base64.b64encode(v).decode() for k, v in files.items()}, **added}


async def join_set(token: JoinToken | str, *, name: str, raft_port: int, api_port: int,
                   timeout_s: float = 30.0) -> tuple[dict[str, bytes], str, list[str]]:
    """Use a coordinator's token: ``(the cluster's secret files, this coordinator's Raft address,
    every member's)``."""
    reply = await exchange(token, {"name": name, "raft_port": raft_port, "api_port": api_port}, timeout_s=timeout_s)
    try:
        files = {k: base64.b64decode(reply["secrets"][k]) for k in SECRET_FILES}
        return files, str(reply["raft"]), [str(p) for p in reply["peers"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise AnswerIncomplete(f"the leader's answer to the join lacks {exc}: is it the same version of exo-tui?") from None
