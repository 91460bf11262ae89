"""Fencing: a node obeys only the coordinator of the newest term it has seen.

A coordinator of a set (:mod:`exo_tui.cluster.leadership`) attaches with its Raft term, and every
command it sends afterwards comes on that connection, so it carries that term. The node keeps the
newest term it has seen; a command on a connection whose term is older (a deposed leader that was
frozen, or cut off, and does not know yet) is refused with an error that says so, and logged.
A connection that never attached (another node's, forwarding hidden states) carries no term and is
not fenced. A coordinator that is not one of a set attaches without a term (0): obeyed while the node
has seen no term, refused after.

Under a set, the log says which term each command obeyed came from: every control command (a load, a plan, a
KV move, ...) with its term, and of the many small ones (steps, drops, pings, a load's chunks)
the first of each kind in a term; the rest are counted, and the count is logged when a newer term
attaches.
"""

from __future__ import annotations

import logging
from typing import Any

from exo_tui.net.errors import RemoteError

log = logging.getLogger("exo_tui.node.fencing")

FREQUENT = frozenset({"forward", "draft_step", "drop", "ping", "load_chunk"})  # logged once a term each


class Fence:
    def __init__(self) -> None:
        self.term = 0  # the newest term seen
        self.commands = 0  # commands obeyed in that term
        self.refused = 0  # commands refused for an older term, ever
        self._logged: set[str] = set()  # the frequent kinds of command logged in this term

    def attach(self, conn: Any, term: Any) -> None:
        """The connection attaches with ``term`` (None: a coordinator not of a set); refuses an old one."""
        t = int(term or 0)
        conn.data["term"] = t
        if t < self.term or (t == 0 and self.term):
            self._refuse(t, "attach")
        if t > self.term:
            log.info("coordinator of term %d attached (term %d sent %d commands)", t, self.term, self.commands)
            self.term, self.commands = t, 0
            self._logged = set()

    def check(self, conn: Any, op: str) -> None:
        """Refuse ``op`` when it comes from an older term's coordinator."""
        t = conn.data.get("term")
        if t is None:
            return  # not a coordinator's connection
        if t < self.term or (t == 0 and self.term):
            self._refuse(t, op)
        self.commands += 1
        if t and (op not in FREQUENT or op not in self._logged):
            self._logged.add(op)
            log.info("obeyed %s from coordinator term %d%s", op, t, " (the first of its kind in this term)"
                     if op in FREQUENT else "")

    def _refuse(self, term: int, op: str) -> None:
        self.refused += 1
        log.warning("refused %s from coordinator term %d: term %d leads now", op, term, self.term)
        raise RemoteError(f"this node takes commands from the coordinator of term {self.term}; this one is of term "
                          f"{term} and was deposed: it must step down (a newer leader drives the cluster)",
                          code="fenced")
