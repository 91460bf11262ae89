"""The event bus: fan-out without blocking, and a replayable history of the cluster's story."""

from __future__ import annotations

import asyncio

from exo_tui import events as ev


def test_replay_keeps_the_story_through_a_long_answer() -> None:
    """Tokens and metrics reach every subscriber but do not push the cluster's story (nodes
    joining, plans) out of what a console opening or attaching replays."""

    async def run() -> None:
        bus = ev.EventBus(history=50)
        live = bus.subscribe()
        bus.publish(ev.NodeJoined(node_id="n1", name="mac", address="10.0.0.2", port=52416))
        bus.publish(ev.PlanChanged(version=1, reason="initial plan"))
        for i in range(500):
            bus.publish(ev.TokenStreamed(request_id="r1", token_id=i, text="x"))
            bus.publish(ev.NodeMetrics(node_id="n1"))
        bus.publish(ev.RequestDone(request_id="r1", finish_reason="length", completion_tokens=500))
        replayed = bus.subscribe(replay=True)
        kinds = [replayed.get_nowait().kind for _ in range(3)]
        assert kinds == ["node_joined", "plan_changed", "request_done"] and replayed.get_nowait() is None
        got = [live.get_nowait() for _ in range(1003)]
        assert sum(e.kind == "token" for e in got) == 500 and sum(e.kind == "node_metrics" for e in got) == 500
        for i in range(60):
            bus.publish(ev.Notice(level="info", message=f"n{i}"))
        assert len(bus.history) == 50 and bus.history[-1].message == "n59"

    asyncio.run(run())
