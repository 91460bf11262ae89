"""Who may hold a handshake slot of a server: :class:`HandshakeGate`.

A connection holds a slot from its accept until its TLS and HMAC handshakes are done (or it is
dropped). Without credentials, anyone who can reach the port can open connections, so slots are
shared out so that strangers cannot lock out the node's coordinator and peers:

* at most ``total`` connections hold slots at once;
* a connection that has not sent its TLS ClientHello yet is *idle*: when the slots are full, a
  newcomer makes room by dropping the oldest idle one (a real client sends its ClientHello at
  once, so an idle connection is cheap to drop and a flood of idle ones cannot refuse anyone).
  Whether it has sent one is asked of what arrived (``sent``), not of how far its accept task
  got: on a loop busy with a flood, the task that would read a ClientHello already received can
  run after a newcomer's, and a legitimate connection was dropped so;
* at its ClientHello a connection is *proved* when the hello carries a valid slot cookie (a proof
  of the cluster key, :mod:`exo_tui.net.slot`): the coordinator and ring peers. A proved one always
  keeps its slot. The others are strangers: at most ``total - reserved`` of them past their
  ClientHello at once, and at most ``per_address`` from one source address — loopback included
  (issue 43: 127.0.0.1 once counted as known, so 128 silent ClientHellos from it took every slot).
  A stranger over either cap is refused at its ClientHello.

The server applies the deadlines (see :mod:`exo_tui.net.server`: a stranger's whole handshake gets
:data:`STRANGER_S` while strangers hold half their share or more); this module only counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_HANDSHAKES = 128
RESERVED = 32  # slots strangers past their ClientHello cannot take
PER_ADDRESS = 8
STRANGER_S = 2.0  # a stranger's whole handshake, from its accept, while the slots are under pressure


@dataclass(eq=False)
class Ticket:
    """One connection's slot. ``sent()``: its ClientHello has arrived, whether or not its task has
    read it yet (not idle); ``hello``: the gate has counted it; ``proved``: with a valid slot cookie."""

    address: str
    drop: Callable[[], object] = field(repr=False)
    sent: Callable[[], bool] = field(default=lambda: False, repr=False)
    hello: bool = False
    proved: bool = False


class Refused(Exception):
    """No slot for a connection; the message says why."""


class HandshakeGate:
    def __init__(self, *, total: int = MAX_HANDSHAKES, reserved: int = RESERVED,
                 per_address: int = PER_ADDRESS) -> None:
        if not 0 <= reserved < total or per_address < 1:
            raise ValueError("need 0 <= reserved < total and per_address >= 1")
        self.total, self.reserved, self.per_address = total, reserved, per_address
        self._tickets: dict[Ticket, None] = {}  # insertion order: oldest first
        self.dropped = 0  # idle connections dropped to make room

    def __len__(self) -> int:
        return len(self._tickets)

    def strangers(self, address: str | None = None) -> int:
        """Strangers past their ClientHello (from ``address``, or all)."""
        return sum(1 for t in self._tickets if t.hello and not t.proved and (address is None or t.address == address))

    @property
    def under_pressure(self) -> bool:
        """Strangers hold half their share of the slots or more."""
        return self.strangers() * 2 >= self.total - self.reserved

    def admit(self, address: str, drop: Callable[[], object], sent: Callable[[], bool] | None = None) -> Ticket:
        """An idle slot for a connection from ``address`` just accepted (``drop()`` closes it if it
        must make room later; ``sent()`` says whether its ClientHello has arrived), or
        :class:`Refused` when every slot is past its ClientHello."""
        if len(self._tickets) >= self.total and not self._drop_idle():
            raise Refused(f"{self.total} handshakes are in progress, none of them idle")
        ticket = Ticket(address, drop) if sent is None else Ticket(address, drop, sent)
        self._tickets[ticket] = None
        return ticket

    def hello(self, ticket: Ticket, proved: bool) -> None:
        """The connection's ClientHello arrived (``proved``: with a valid slot cookie); a stranger
        over its caps is :class:`Refused` (its slot released)."""
        if not proved:
            if self.strangers(ticket.address) >= self.per_address:
                self.release(ticket)
                raise Refused(f"{self.per_address} handshakes from {ticket.address} are already in progress")
            if self.strangers() >= self.total - self.reserved:
                self.release(ticket)
                raise Refused(f"{self.total - self.reserved} handshakes of connections without a proof of the "
                              "cluster key are in progress")
        ticket.hello, ticket.proved = True, proved

    def holds(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` still has its slot (``False`` once it was dropped or released)."""
        return ticket in self._tickets

    def release(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket, None)

    def _drop_idle(self) -> bool:
        for t in self._tickets:
            if not t.hello and not t.sent():
                self._tickets.pop(t, None)
                self.dropped += 1
                t.drop()
                return True
        return False
