"""The coordinator set's Raft (pysyncobj) in this process, three members on loopback: one leads,
a change is acknowledged once a majority holds it and every member applies it, a minority
refuses changes with one sentence, a member whose state dir was lost catches up, and members
without the cluster key are never let in."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path

import pytest

from exo_tui.cluster.consensus import CoordinatorSet, CoordinatorSetError, parse_coordinators
from exo_tui.cluster.replicated_state import NotAcknowledged, ReplicatedStore
from tests.helpers.sshd import free_port

KEY = bytes(range(32))
WAIT_S = 30.0  # fails a hung test only


async def until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def members(tmp_path: Path, n: int = 3, key: bytes = KEY):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    sets: list[CoordinatorSet] = []

    def start(i: int, state_dir: Path | None = None, secret: bytes = key) -> CoordinatorSet:
        s = CoordinatorSet(addresses[i], [a for a in addresses if a != addresses[i]],
                           state_dir=state_dir or tmp_path / f"c{i}", cluster_key=secret,
                           api_url=f"http://127.0.0.1:{i}", name=f"c{i}")
        s.bind_loop(asyncio.get_running_loop())
        sets.append(s)
        return s

    for i in range(n):
        start(i)
    try:
        yield sets, start
    finally:
        for s in sets:
            s.close()


def leader(sets: list[CoordinatorSet]) -> CoordinatorSet | None:
    return next((s for s in sets if s.is_leader), None)


async def test_a_change_reaches_every_member_once_a_majority_holds_it(tmp_path: Path) -> None:
    async with members(tmp_path) as (sets, _):
        await until(lambda: leader(sets) is not None, "a leader")
        lead = leader(sets)
        assert lead is not None and sum(s.is_leader for s in sets) == 1
        store = ReplicatedStore(lead.state, asyncio.get_running_loop())
        store.save_drains({"n1"})
        store.save_pins({"n2": (0, 2)})
        store.audit("drain", "n1", "ok")
        await store.settled(10.0)
        await until(lambda: all(s.state.drains == ["n1"] and s.state.pins == {"n2": (0, 2)} for s in sets),
                    "every member applied the change")
        assert [a.action for a in ReplicatedStore(sets[0].state, asyncio.get_running_loop()).audit_log()] == ["drain"]
        standby = next(s for s in sets if not s.is_leader)
        assert standby.leader_address == lead.address and standby.role == "standby"
        roles = {c.address: c.role for c in lead.status()}
        assert sorted(roles.values()) == ["leader", "standby", "standby"]


async def test_a_minority_refuses_changes_with_one_sentence(tmp_path: Path) -> None:
    async with members(tmp_path) as (sets, _):
        await until(lambda: leader(sets) is not None, "a leader")
        lead = leader(sets)
        for s in sets:
            if s is not lead:
                s.close()
        await until(lambda: not lead.is_leader, "the lone leader's lease ran out")
        with pytest.raises(NotAcknowledged, match="reaches 1 of the 3 coordinators, not a majority"):
            await lead.submit(lead.state.set_drains, ["n9"], timeout_s=2.0)
        assert lead.state.drains == []


async def test_a_member_whose_state_dir_was_lost_catches_up(tmp_path: Path) -> None:
    async with members(tmp_path) as (sets, start):
        await until(lambda: leader(sets) is not None, "a leader")
        lead = leader(sets)
        await lead.submit(lead.state.set_pins, {"n1": (1, 3)})
        lost = next(s for s in sets if not s.is_leader)
        i = sets.index(lost)
        lost.close()
        shutil.rmtree(tmp_path / f"c{i}")
        await until(lambda: leader(sets[:i] + sets[i + 1:]) is not None, "a leader of the two left")
        lead = leader(sets[:i] + sets[i + 1:])
        await lead.submit(lead.state.set_drains, ["n2"])  # made while it was gone
        back = start(i)
        await until(lambda: back.state.pins == {"n1": (1, 3)} and back.state.drains == ["n2"], "it caught up")


async def test_a_member_without_the_cluster_key_takes_no_part(tmp_path: Path) -> None:
    async with members(tmp_path, n=3) as (sets, start):
        # the third member is a stranger: another key
        sets[2].close()
        sets.pop()
        stranger = start(2, tmp_path / "stranger", secret=b"x" * 32)
        await until(lambda: leader(sets) is not None, "a leader of the two with the key")
        lead = leader(sets)
        await lead.submit(lead.state.set_drains, ["n3"])
        await until(lambda: all(s.state.drains == ["n3"] for s in sets if s is not stranger), "the two applied it")
        assert stranger.state.drains == [] and not stranger.is_leader


def test_coordinators_must_name_this_machine_once() -> None:
    me, partners = parse_coordinators("127.0.0.1:7001,10.255.0.9:7001,127.0.0.1:7002", 7001)
    assert me == "127.0.0.1:7001" and partners == ["10.255.0.9:7001", "127.0.0.1:7002"]
    with pytest.raises(CoordinatorSetError, match="must name this machine once at --coordinator-port 7003"):
        parse_coordinators("127.0.0.1:7001,127.0.0.1:7002", 7003)
    with pytest.raises(CoordinatorSetError, match="has no port"):
        parse_coordinators("127.0.0.1", 7001)
