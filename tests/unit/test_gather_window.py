"""A node's batching rules (exo_tui.node.batching), with made-up times: how long a batch waits
for the steps of other requests due back, and when it runs at once."""

from __future__ import annotations

import pytest

from exo_tui.net.protocol import PlanEntry, RingPlan
from exo_tui.node.batching import Batching, GatherPolicy, decodes_first, one_step_a_key

POLICY = GatherPolicy()


def _ring(*hosts: str) -> RingPlan:
    return RingPlan(1, len(hosts), tuple(PlanEntry(f"n{i}", h, 52416 + i, i, i + 1) for i, h in enumerate(hosts)))


def test_a_ring_reached_on_loopback_is_on_one_machine() -> None:
    assert _ring("127.0.0.1", "127.0.0.1", "127.0.0.1").on_loopback()
    assert _ring("127.0.0.1", "::1", "localhost", "127.0.1.1").on_loopback()
    assert not _ring("127.0.0.1", "192.168.1.20").on_loopback()  # one hop on another machine
    assert not _ring("studio.local").on_loopback()


def test_nodes_sharing_cores_wait_up_to_a_whole_run_to_merge_batches() -> None:
    b = Batching()
    b.ran(0.012)
    assert b.window_s() == pytest.approx(POLICY.fraction * 0.012)  # a quarter run
    b.shared_cores = True
    assert b.window_s() == pytest.approx(0.012)  # a whole run
    b.run_s = 0.5
    assert b.window_s() == pytest.approx(POLICY.shared_scale * POLICY.max_s)
    b.shared_cores = False
    assert b.window_s() == pytest.approx(POLICY.max_s)
    b.run_s = 0.0
    assert b.window_s() == pytest.approx(POLICY.min_s)


def test_a_run_time_is_a_moving_average_and_busy_time_adds_up() -> None:
    b = Batching()
    b.ran(0.010)
    b.ran(0.020)
    assert b.run_s == pytest.approx(0.7 * 0.010 + 0.3 * 0.020)
    assert b.busy_s == pytest.approx(0.030)


def _away(b: Batching, key: tuple[str, int], left: float, back: float) -> None:
    """One round of a request: here at ``left``, gone, back at ``back``."""
    b.arrived(key, left)
    b.left(key, left)
    b.arrived(key, back)


def test_a_request_learns_its_time_away_and_is_due_back() -> None:
    b = Batching(policy=GatherPolicy(min_s=0.2, max_s=0.2))
    _away(b, ("r", 0), 10.0, 10.1)
    assert b.visits["r", 0].away_s == pytest.approx(0.1)
    b.left(("r", 0), 11.0)
    assert b.visits["r", 0].due_s() == pytest.approx(11.1)
    assert b.due(11.05, 11.2)  # expected back by the end of the window
    assert not b.due(11.0, 11.05)  # not by then
    assert not b.due(11.5, 11.6)  # due more than a window ago: not waited for
    b.arrived(("r", 0), 11.3)  # a longer round moves the estimate half way
    assert b.visits["r", 0].away_s == pytest.approx(0.2)


def test_a_batch_waits_the_window_for_a_step_due_back_and_no_longer() -> None:
    b = Batching(policy=GatherPolicy(min_s=0.2, max_s=0.2))
    for i in range(4):
        _away(b, (f"r{i}", 0), 1.0, 1.1)
    for i in range(4):
        b.left((f"r{i}", 0), 2.0)  # all four left together; due back at 2.1
    b.arrived(("r0", 0), 2.1)
    deadline = 2.1 + b.window_s()
    wait = b.gather_wait(2.1, deadline, burst=False, queued=[("r0", 0)])
    assert wait == pytest.approx(0.2)  # the others are due: wait up to the window's end
    assert b.gather_wait(deadline, deadline, burst=False, queued=[("r0", 0)]) is None  # never past it


def test_steps_that_trickle_in_wait_only_until_they_stop_coming() -> None:
    b = Batching(policy=GatherPolicy(min_s=2.0, max_s=2.0, quiet_s=0.05))
    for i in range(4):  # just after their prompts: nothing known of when they come back
        b.arrived((f"r{i}", 0), 5.9)
        b.left((f"r{i}", 0), 5.9)
    b.arrived(("r0", 0), 6.00)
    deadline = 6.0 + b.window_s()
    assert b.gather_wait(6.01, deadline, burst=False, queued=[("r0", 0)]) == pytest.approx(0.04)  # until quiet
    b.arrived(("r1", 0), 6.03)
    assert b.gather_wait(6.04, deadline, burst=False, queued=[("r0", 0), ("r1", 0)]) == pytest.approx(0.04)
    assert b.gather_wait(6.09, deadline, burst=False, queued=[("r0", 0), ("r1", 0)]) is None  # quiet: run
    # a sender that announced more steps is waited for to the window's end
    assert b.gather_wait(6.09, deadline, burst=True, queued=[("r0", 0)]) == pytest.approx(deadline - 6.09)


def test_a_lone_stream_never_waits_and_a_gone_request_stops_counting() -> None:
    b = Batching(policy=GatherPolicy(active_s=1.0))
    b.arrived(("solo", 0), 1.0)
    assert b.alone([("solo", 0)], 1.0)
    assert b.gather_wait(1.0, 1.01, burst=False, queued=[("solo", 0)]) is None
    b.arrived(("other", 0), 1.0)
    assert not b.alone([("solo", 0)], 1.0)  # the other has a step here
    b.left(("other", 0), 1.0)
    assert not b.alone([("solo", 0)], 1.5)  # left 0.5 s ago, no time away known: still active
    assert b.alone([("solo", 0)], 2.5)  # gone after active_s
    b.forget("other")
    assert b.alone([("solo", 0)], 1.0)  # ended: not expected back
    _away(b, ("third", 0), 3.0, 3.1)
    b.left(("third", 0), 4.0)
    assert not b.alone([("solo", 0)], 4.15)
    assert b.alone([("solo", 0)], 4.0 + 2 * 0.1 + b.window_s() + 1e-6)  # twice its time away, and a window


def test_visits_not_seen_for_a_while_are_forgotten() -> None:
    b = Batching(policy=GatherPolicy(visits_keep_s=30.0))
    b.arrived(("old", 0), 0.0)
    b.arrived(("new", 0), 20.0)
    b.prune(40.0)
    assert set(b.visits) == {("new", 0)}


class _S:
    def __init__(self, rows: int, deferred: bool = False, key: tuple[str, int] = ("r", 0), verify: bool = False) -> None:
        self.rows, self.deferred, self.key = rows, deferred, key
        self.prompt = rows > 1 and not verify


def test_prompts_let_waiting_decode_steps_go_first_once() -> None:
    d1, d2, p1, v = _S(1), _S(1), _S(40), _S(5, verify=True)
    now, later = decodes_first([d1, p1, v, d2])
    assert now == [d1, v, d2] and later == [p1] and p1.deferred  # a verify step decodes: it is not deferred
    now, later = decodes_first([_S(1), p1])  # deferred once already: it runs now
    assert later == [] and p1 in now
    only = [_S(30), _S(20)]
    assert decodes_first(only) == (only, [])  # no decode step waits: nothing deferred


def test_a_requests_steps_at_a_hop_run_one_a_run_in_order() -> None:
    """A long prompt's chunks come back to back (pipelined): each needs the caches the one before
    it fills, so a run takes a request's first step at each hop and leaves the rest queued, in
    order; steps of other requests, and of the same request at another hop, run beside it."""
    a1, a2, a3 = (_S(64, key=("a", 0)) for _ in range(3))
    b1, b2 = _S(64, key=("b", 0)), _S(64, key=("b", 0))
    a_hop2 = _S(64, key=("a", 2))  # the same request's earlier chunk, at its second shard here
    queued = [a1, b1, a2, a_hop2, b2, a3]
    now, left = one_step_a_key(queued, queued)
    assert now == [a1, b1, a_hop2] and left == [a2, b2, a3]
    now, left = one_step_a_key(left, left)
    assert now == [a2, b2] and left == [a3]
    # of what decodes_first chose, a step runs only if none of its key is before it in the queue
    d = _S(1, key=("d", 0))
    now, left = one_step_a_key([a2, d, a3], [d, a3])
    assert now == [d] and left == [a2, a3]
