"""Admission's queue and a node's KV budget, on their own (the real processes: test_admission.py
under integration)."""

from __future__ import annotations

import asyncio

import pytest

from exo_tui.cluster.admission import Admission, QueueFull, TooLarge, with_queue_notes
from exo_tui.inference.request import Request
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, KVBudget


def req(prompt: int, max_tokens: int) -> Request:
    return Request(list(range(1, prompt + 1)), max_tokens=max_tokens)


async def test_requests_run_while_they_fit_and_wait_in_order() -> None:
    adm = Admission(lambda: 300, queue_bound=1)
    a, b, c, d = (adm.ticket(req(10, 90), 1000) for _ in range(4))
    await adm.enter(a)
    await adm.enter(b)
    await adm.enter(c)
    assert adm.stats().reserved_positions == 300
    waiting = asyncio.create_task(adm.enter(d))
    await asyncio.sleep(0)
    assert adm.ahead(d.rid) == 0 and adm.stats().queued == 1
    with pytest.raises(QueueFull, match="busy") as e:  # past the bound (30 s: only fails a hung test)
        async with asyncio.timeout(30):
            await adm.enter(adm.ticket(req(10, 90), 1000))
    assert e.value.retry_after_s >= 1
    adm.leave(a)
    await waiting
    s = adm.stats()
    assert (s.running, s.queued, s.admitted, s.rejected) == (3, 0, 4, 1)


async def test_the_queue_holds_its_bound_and_refuses_the_next_at_once() -> None:
    """``queue_bound`` requests wait; the one after them is refused with QueueFull when it comes
    (not queued: its task is done after its first turn of the loop)."""
    adm = Admission(lambda: 100, queue_bound=2)
    await adm.enter(adm.ticket(req(10, 90), 1000))  # runs: the ring's room is taken
    waiting = [asyncio.create_task(adm.enter(adm.ticket(req(10, 90), 1000))) for _ in range(2)]
    await asyncio.sleep(0)
    assert adm.stats().queued == 2 and not any(t.done() for t in waiting)
    extra = asyncio.create_task(adm.enter(adm.ticket(req(10, 90), 1000)))
    await asyncio.sleep(0)
    try:
        assert extra.done(), "a request past the queue's bound was queued"
        with pytest.raises(QueueFull, match="queue's bound"):
            extra.result()
        assert adm.stats().queued == 2 and adm.stats().rejected == 1
    finally:
        for t in (*waiting, extra):
            t.cancel()
        await asyncio.gather(*waiting, extra, return_exceptions=True)


async def test_a_cancelled_wait_leaves_the_queue() -> None:
    adm = Admission(lambda: 100)
    a, b = adm.ticket(req(10, 90), 1000), adm.ticket(req(10, 90), 1000)
    await adm.enter(a)
    waiting = asyncio.create_task(adm.enter(b))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert adm.stats().queued == 0
    adm.leave(a)
    assert adm.stats().running == 0


async def test_a_request_larger_than_the_ring_is_refused_with_what_to_do() -> None:
    adm = Admission(lambda: 100)
    with pytest.raises(TooLarge, match="ask for fewer max_tokens"):
        await adm.enter(adm.ticket(req(10, 200), 1000))


async def test_unknown_capacity_runs_one_at_a_time() -> None:
    adm = Admission(lambda: None)
    a, b = adm.ticket(req(5, 5), 100), adm.ticket(req(5, 5), 100)
    await adm.enter(a)
    waiting = asyncio.create_task(adm.enter(b))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    adm.leave(a)
    await waiting
    assert adm.running(b.rid)


async def test_a_growing_request_without_room_is_preempted_and_first_in_line_again() -> None:
    adm = Admission(lambda: 100, kv_share=0.5)
    a, b = adm.ticket(req(10, 90), 1000), adm.ticket(req(10, 90), 1000)
    await adm.enter(a)
    await adm.enter(b)
    assert (a.reserved, b.reserved) == (50, 50)
    assert not adm.grow(a, 51)  # b holds the rest
    adm.preempt(a, 51)
    later = adm.ticket(req(10, 10), 1000)
    queued = [asyncio.create_task(adm.enter(a, front=True)), asyncio.create_task(adm.enter(later))]
    await asyncio.sleep(0)
    assert adm.ahead(a.rid) == 0 and adm.stats().preempted == 1
    assert adm.grow(b, 100) and b.reserved == 100  # a gave its room back: b may take it all
    adm.leave(b)
    await asyncio.gather(*queued)
    assert a.reserved == 51 and adm.running(later.rid)


async def test_kept_caches_go_when_a_request_needs_their_room() -> None:
    kept = {"n": 80}
    forgotten: list[bool] = []

    async def forget() -> None:
        forgotten.append(True)
        kept["n"] = 0

    adm = Admission(lambda: 100, kept=lambda: kept["n"], forget_kept=forget)
    await asyncio.wait_for(adm.enter(adm.ticket(req(10, 50), 1000)), 5)
    assert forgotten == [True]


async def test_queue_notes_come_before_the_first_chunk() -> None:
    notes: asyncio.Queue[int] = asyncio.Queue()

    async def chunks():  # noqa: ANN202
        notes.put_nowait(3)
        await asyncio.sleep(0.01)
        notes.put_nowait(1)
        await asyncio.sleep(0.01)
        yield "a"
        yield "b"

    assert [x async for x in with_queue_notes(chunks(), notes)] == [3, 1, "a", "b"]


def test_kv_budget_counts_positions_and_refuses_past_the_budget() -> None:
    b = KVBudget(limit_bytes=1_000_000_000)
    b.set_shards({(0, 10): 1000})
    b.observe(rss_bytes=400_000_000, available_bytes=10**10, settled=True)
    assert b.runtime_bytes == 400_000_000
    room = 600_000_000
    assert b.reserve_bytes == max(RESERVE_MIN_BYTES, int(0.2 * room)) and b.budget_bytes == room - b.reserve_bytes
    positions = b.budget_bytes // 1000
    assert b.check({("r1", (0, 10)): positions}) == {}
    b.record("r1", (0, 10), positions - 10)
    refused = b.check({("r1", (0, 10)): positions, ("r2", (0, 10)): 11})
    assert list(refused) == ["r2"] and "KV budget exceeded" in refused["r2"] and "--memory-limit" in refused["r2"]
    b.rename("r1", "r3")
    assert b.report()["requests"] == 1 and b.held("r3", (0, 10)) == positions - 10
    b.drop("r3")
    assert b.report()["used_bytes"] == 0 and b.report()["requests"] == 0
    b.observe(rss_bytes=450_000_000, available_bytes=10**10)  # nothing held: the runtime is measured again
    assert b.runtime_bytes == 450_000_000


def test_without_a_limit_the_budget_follows_free_memory() -> None:
    b = KVBudget(limit_bytes=None)
    b.set_shards({(0, 4): 100})
    b.observe(rss_bytes=100_000_000, available_bytes=2_000_000_000, settled=True)
    assert b.budget_bytes == int(0.8 * 2_000_000_000)


async def test_a_request_without_max_tokens_ends_where_the_rings_memory_ends() -> None:
    adm = Admission(lambda: 1000)
    r = req(40, 8192 - 40)  # what the API makes of a request without max_tokens: up to the context
    t = adm.ticket(r, 8192)
    assert r.max_tokens == 1000 - 40 and t.full == 1000  # it ends at finish_reason "length" there
    assert t.need == 40 + 256  # and reserves a step at a time: it is preempted, not refused, when short
    await adm.enter(t)
    assert adm.stats().reserved_positions == 296


async def test_a_ring_with_no_memory_for_caches_says_what_to_do() -> None:
    adm = Admission(lambda: 0)
    with pytest.raises(TooLarge, match="larger --memory-limit"):
        await adm.enter(adm.ticket(req(10, 10), 1000))


async def test_a_cancel_while_the_first_chunk_is_being_stopped_is_not_swallowed() -> None:
    """The consumer stops reading before the first chunk; while the stream takes its time to
    stop, the consumer's task is cancelled: the task ends cancelled, it does not carry on."""
    notes: asyncio.Queue[int] = asyncio.Queue()
    stopping, release = asyncio.Event(), asyncio.Event()
    carried_on = []

    async def chunks():  # noqa: ANN202
        notes.put_nowait(2)
        try:
            await asyncio.Event().wait()  # the first chunk never comes
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()  # a slow stop (a node to tell)
            raise
        yield "never"

    async def consume() -> None:
        stream = with_queue_notes(chunks(), notes)
        assert await anext(stream) == 2
        await stream.aclose()  # stop reading: the stream stops its first chunk
        carried_on.append(True)

    task = asyncio.ensure_future(consume())
    async with asyncio.timeout(10):
        await stopping.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    release.set()
    assert task.cancelled() and not carried_on


def test_a_verify_steps_drafted_rows_count_against_the_nodes_budget() -> None:
    """A node checks each step of a run against its KV budget with every position the step will
    hold: a verify step's drafted rows count like any others, so where the budget has room for a
    decode step but not for the drafts, that step is refused (the coordinator runs it as a plain
    step, ``AdmittedRunner.verify``) and the decode steps beside it run."""
    import numpy as np

    from exo_tui.net.frame import Frame
    from exo_tui.net.messages import Forward
    from exo_tui.node.executor import Step, StepExecutor
    from exo_tui.node.sampling_step import Samplers

    key = (0, 4)
    b = KVBudget(limit_bytes=1_000_000_000)
    b.set_shards({key: 1000})
    b.observe(rss_bytes=400_000_000, available_bytes=10**10, settled=True)
    room = b.budget_bytes // 1000
    b.record("a", key, room // 2 - 1)
    b.record("v", key, room - room // 2 - 2)  # room for three more positions: "a"'s next and two

    def step(rid: str, rows: int, draft: list[int] | None = None) -> Step:
        pos = b.held(rid, key)
        return Step(None, Frame("forward", tensor=np.zeros(rows, np.int64)),  # type: ignore[arg-type]
                    Forward(rid, 0, pos, 1, pos + 1, draft=draft))

    executor = StepExecutor(b, Samplers(), set(), deliver=None)  # type: ignore[arg-type]
    try:
        batch = [step("a", 1), step("v", 4, draft=[5, 6, 7])]
        results: list = [None, None]
        assert executor._within_budget(batch, key, [0, 1], results) == [0]
        assert results[0] is None and "KV budget exceeded" in str(results[1])
        batch = [step("a", 1), step("v", 2, draft=[5])]  # one draft: it fits beside "a"'s step
        assert executor._within_budget(batch, key, [0, 1], [None, None]) == [0, 1]
    finally:
        executor.close()
