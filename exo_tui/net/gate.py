"""Who may hold a handshake slot of a server: :class:`HandshakeGate`.

A connection holds a slot from its accept until its TLS and HMAC handshakes are done (or it is
dropped). Without credentials, anyone who can reach the port can open connections, so slots are
shared out so that strangers cannot lock out the node's coordinator and peers:

* at most ``total`` connections in handshake at once, of which strangers (addresses that never
  completed a handshake here) may hold ``total - reserved``; the ``reserved`` slots are for
  addresses that authenticated before (the coordinator, ring neighbours);
* at most ``per_address`` in handshake from one stranger address;
* a connection that has not sent its TLS ClientHello yet is *idle*; when the slots a newcomer may
  use are full, the oldest idle one is dropped to make room (a real client sends its ClientHello
  at once, so an idle connection is cheap to drop and a flood of idle ones cannot refuse anyone).
  Only when no idle one is left is the newcomer refused.

The server applies the deadlines (:data:`exo_tui.net.server.PRE_TLS_S` for the ClientHello while
half the slots or more are taken, else the handshake timeout; the handshake timeout for the rest);
this module only counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_HANDSHAKES = 128
RESERVED_FOR_KNOWN = 32
PER_ADDRESS = 16
REMEMBERED = 1024  # addresses that authenticated, most recent kept


@dataclass(eq=False)
class Ticket:
    """One connection's slot. ``hello``: its ClientHello arrived (no longer idle)."""

    address: str
    known: bool
    drop: Callable[[], object] = field(repr=False)
    hello: bool = False


class Refused(Exception):
    """No slot for a newcomer; the message says why."""


class HandshakeGate:
    def __init__(self, *, total: int = MAX_HANDSHAKES, reserved: int = RESERVED_FOR_KNOWN,
                 per_address: int = PER_ADDRESS, remembered: int = REMEMBERED) -> None:
        if not 0 <= reserved < total or per_address < 1:
            raise ValueError("need 0 <= reserved < total and per_address >= 1")
        self.total, self.reserved, self.per_address, self.remembered = total, reserved, per_address, remembered
        self._tickets: dict[Ticket, None] = {}  # insertion order: oldest first
        self._known: OrderedDict[str, None] = OrderedDict()
        self.dropped = 0  # idle connections dropped to make room

    def __len__(self) -> int:
        return len(self._tickets)

    def is_known(self, address: str) -> bool:
        return address in self._known

    def authenticated(self, address: str) -> None:
        """``address`` completed a handshake: it may use the reserved slots from now on."""
        self._known[address] = None
        self._known.move_to_end(address)
        while len(self._known) > self.remembered:
            self._known.popitem(last=False)

    def admit(self, address: str, drop: Callable[[], object]) -> Ticket:
        """A slot for a connection from ``address`` (``drop()`` closes it if it must make room
        later), or :class:`Refused`."""
        known = self.is_known(address)
        if not known:
            same = [t for t in self._tickets if t.address == address]
            if len(same) >= self.per_address and not self._drop_idle(same):
                raise Refused(f"{self.per_address} handshakes from {address} are already in progress")
        pool = list(self._tickets) if known else [t for t in self._tickets if not t.known]
        limit = self.total if known else self.total - self.reserved
        if len(pool) >= limit:
            # a known peer takes a stranger's idle slot first, then any idle one
            order = [t for t in pool if not t.known] + [t for t in pool if t.known] if known else pool
            if not self._drop_idle(order):
                raise Refused(f"{limit} handshakes are in progress{'' if known else ' from unknown addresses'}, "
                              "none of them idle")
        ticket = Ticket(address, known, drop)
        self._tickets[ticket] = None
        return ticket

    def holds(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` still has its slot (``False`` once it was dropped or released)."""
        return ticket in self._tickets

    def release(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket, None)

    def _drop_idle(self, candidates: list[Ticket]) -> bool:
        for t in candidates:
            if not t.hello:
                self._tickets.pop(t, None)
                self.dropped += 1
                t.drop()
                return True
        return False
