"""The pieces that share out what strangers and peers can take: handshake slots, the receive
budget, rate-limited warnings."""

from __future__ import annotations

import asyncio
import logging

import pytest

from exo_tui.net.budget import ReceiveBudget
from exo_tui.net.gate import HandshakeGate, Refused
from exo_tui.net.ratelog import RateLimitedLog


def _admit(gate: HandshakeGate, address: str, dropped: list[str], *, hello: bool = False, proved: bool = False):
    t = gate.admit(address, lambda: dropped.append(address))
    if hello:
        gate.hello(t, proved)
    return t


def test_strangers_fill_only_their_share_and_proved_peers_get_the_reserved_slots() -> None:
    gate = HandshakeGate(total=8, reserved=3, per_address=2)
    dropped: list[str] = []
    for i in range(5):  # five busy strangers (past their ClientHello): the strangers' share is full
        _admit(gate, f"10.9.0.{i}", dropped, hello=True)
    assert gate.under_pressure
    late = _admit(gate, "10.9.0.99", dropped)  # admitted idle, refused at its ClientHello
    with pytest.raises(Refused, match="without a proof of the cluster key"):
        gate.hello(late, False)
    assert not gate.holds(late)
    for _ in range(3):  # the coordinator (its ClientHello proves the key) still gets in, three times
        _admit(gate, "10.9.0.1", dropped, hello=True, proved=True)
    with pytest.raises(Refused, match="none of them idle"):
        _admit(gate, "10.0.0.1", dropped)
    assert not dropped


def test_idle_connections_make_room_oldest_first() -> None:
    gate = HandshakeGate(total=4, reserved=1, per_address=10)
    dropped: list[str] = []
    for i in range(4):
        _admit(gate, f"10.9.0.{i}", dropped)  # idle: no ClientHello yet
    _admit(gate, "10.9.0.7", dropped)  # a fifth: the oldest idle one goes
    assert dropped == ["10.9.0.0"] and len(gate) == 4 and gate.dropped == 1


def test_a_connection_whose_client_hello_arrived_is_not_dropped_as_idle_before_its_task_reads_it() -> None:
    """test_hostile's flood once dropped a legitimate link: its ClientHello had arrived, but on the
    flooded loop a newcomer's accept ran before the task that would read it, and the gate took the
    oldest connection it had not counted a ClientHello of as idle."""
    gate = HandshakeGate(total=3, reserved=1, per_address=10)
    dropped: list[str] = []
    arrived = {"coordinator": True}
    gate.admit("coordinator", lambda: dropped.append("coordinator"), lambda: arrived["coordinator"])
    _admit(gate, "10.9.0.1", dropped)
    _admit(gate, "10.9.0.2", dropped)
    _admit(gate, "10.9.0.3", dropped)  # full: the oldest idle one goes, not the one whose hello is in
    assert dropped == ["10.9.0.1"]
    arrived["coordinator"] = False  # had nothing arrived, it would have been first
    _admit(gate, "10.9.0.4", dropped)
    assert dropped == ["10.9.0.1", "coordinator"]


def test_one_address_loopback_too_holds_at_most_per_address_strangers() -> None:
    gate = HandshakeGate(total=100, reserved=10, per_address=2)
    dropped: list[str] = []
    a = _admit(gate, "127.0.0.1", dropped, hello=True)
    _admit(gate, "127.0.0.1", dropped, hello=True)
    third = _admit(gate, "127.0.0.1", dropped)
    with pytest.raises(Refused, match="from 127.0.0.1"):
        gate.hello(third, False)
    _admit(gate, "127.0.0.1", dropped, hello=True, proved=True)  # a proved one is not capped
    gate.release(a)
    assert not gate.holds(a)
    _admit(gate, "127.0.0.1", dropped, hello=True)  # a slot freed
    _admit(gate, "10.9.0.2", dropped, hello=True)  # other addresses are not affected


async def test_the_receive_budget_queues_in_order_and_never_starves_a_big_frame() -> None:
    budget = ReceiveBudget(100)
    first = await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        got = await budget.acquire(n)
        order.append(name)
        await asyncio.sleep(0)
        budget.release(got)

    waiters = [asyncio.create_task(take("big", 500)), asyncio.create_task(take("small", 10))]
    await asyncio.sleep(0.01)
    assert order == []  # the big one waits for everything; the small one waits behind it (fair)
    budget.release(first)
    await asyncio.gather(*waiters)
    assert order == ["big", "small"] and budget.used == 0


async def test_a_cancelled_wait_gives_its_place_back() -> None:
    budget = ReceiveBudget(10)
    held = await budget.acquire(10)
    waiter = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release(held)
    assert budget.used == 0 and await budget.acquire(10) == 10


def test_repeated_warnings_are_counted_not_written(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.ratelog"), burst=3, period_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        for i in range(1000):
            log.warning("refused", "refused %d", i)
        log.warning("other", "another kind")
        assert log.left_out("refused") == 997
        now[0] = 11
        log.warning("refused", "refused again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refused 0", "refused 1", "refused 2"] and "another kind" in lines
    assert any("997 more" in line for line in lines) and lines[-1] == "refused again"
    assert len(lines) == 6
