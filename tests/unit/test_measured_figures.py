"""The measured figures' arithmetic (issue 30): windows, histograms, a token's split between the
nodes, the links and the coordinator, the hop records on the wire, and the figures' JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from exo_tui import events as ev
from exo_tui.api.convert import snapshot_from_dict, snapshot_to_dict
from exo_tui.cluster.figures import ClusterFigures
from exo_tui.cluster.metrics import ClusterMetrics, Histogram, StepSample, Window, split_token
from exo_tui.cluster.view import ClusterSnapshot
from exo_tui.net.timing import HopTiming, timings_from_wire
from exo_tui.tui.widgets.cluster_strip import lay_out, spark_rows


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Req:
    id: str
    prompt_ids: list[int]
    created_s: float
    first_token_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.created_s if self.first_token_s is not None else 0.0


@dataclass
class Profile:
    memory_limit_bytes: int = 0
    ram_available_bytes: int = 6_000_000_000


@dataclass
class Handle:
    """What the figures read of a coordinator's node handle."""

    node_id: str
    name: str
    state: str = "ready"
    metrics: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)
    profile: Profile = field(default_factory=Profile)
    memory_total_bytes: int = 8_000_000_000


def test_window_keeps_its_horizon_and_gives_percentiles() -> None:
    w = Window(10.0)
    for i in range(10):
        w.add(float(i), now=float(i))
    assert w.percentile(50, now=9.0) == pytest.approx(4.5)
    assert w.count(now=15.0) == 5  # 5..9 are within 10 s of 15
    assert w.percentile(95, now=100.0) is None


def test_histogram_is_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(4.05)


def _sample(round_trip: float = 0.030, coordinator: float | None = 0.002) -> StepSample:
    # coordinator -> a (1 ms) -> a computes 10 ms -> b (2 ms) -> b computes 5 ms -> coordinator (2 ms)
    hops = (HopTiming("a", 0.0005, 0.010, 100.001, 100.0115), HopTiming("b", 0.0, 0.005, 100.0135, 100.0185))
    return StepSample("r", 3, 1, 100.0, 100.0205, round_trip, coordinator, hops)


def test_a_token_splits_into_compute_links_and_the_coordinator() -> None:
    s = _sample(round_trip=0.0205)
    t = split_token(s, ts=0.0)
    assert t.compute == {"a": 0.010, "b": 0.005}
    assert t.links[("coordinator", "a")] == pytest.approx(0.001)
    assert t.links[("a", "b")] == pytest.approx(0.002)
    assert t.links[("b", "coordinator")] == pytest.approx(0.002)
    assert t.total_s == pytest.approx(0.0225)


def test_offset_clocks_split_only_the_communication_the_round_trip_leaves() -> None:
    # b's clock is 1 s ahead: the wall times make a→b look 1 s long, b→coordinator negative
    hops = (HopTiming("a", 0.0, 0.010, 100.001, 100.0115), HopTiming("b", 0.0, 0.005, 101.0135, 101.0185))
    t = split_token(StepSample("r", 3, 1, 100.0, 100.0205, 0.0205, None, hops), ts=0.0)
    assert sum(t.links.values()) == pytest.approx(0.0205 - 0.0105 - 0.005)  # never more than measured
    assert t.links[("b", "coordinator")] == 0.0


def test_figures_from_requests_steps_and_outcomes() -> None:
    clock = Clock()
    m = ClusterMetrics(clock=clock)
    r = Req("r", [1, 2, 3], created_s=clock.t)
    m.started(r)
    clock.t += 0.2
    r.first_token_s = clock.t
    m.token(r)
    for _ in range(4):
        clock.t += 0.05
        m.token(r)
        m.step(_sample())
    m.step(StepSample("r", 3, 12, 0, 0, 1.0, None, _sample().hops))  # a prefill: not a decode token
    m.ended(r)
    m.outcome("stop")
    m.outcome("cancelled")
    m.outcome("error")
    handles = [Handle("a", "A", metrics={"cpu_percent": 50.0, "decode_steps": 4, "decode_compute_s": 0.04,
                                           "temperature_c": 55.0}),
               Handle("b", "B", metrics={"cpu_percent": 30.0})]
    f = m.figures(handles, plan_version=3, predicted_tok_per_s=40.0)
    assert f.ttft_p50_s == pytest.approx(0.2)
    assert f.itl_p50_s == pytest.approx(0.05)
    assert m.itl_hist.count == 4 and m.ttft_hist.count == 1 and m.tokens_total == 5
    assert (f.completed, f.cancelled, f.failed, f.rejected) == (1, 1, 1, 0)
    assert f.success_rate == pytest.approx(0.5)
    assert f.running == 0
    assert f.memory_used_bytes == 2 * 2_000_000_000 and f.cpu_percent == pytest.approx(40.0)
    assert f.node("a").stage_s == pytest.approx(0.010) and f.node("b").stage_s == pytest.approx(0.005)
    assert f.node("a").own_stage_s == pytest.approx(0.010)
    assert f.balance == pytest.approx(1 / 3)  # std/mean of 10 ms and 5 ms
    assert f.token_s == pytest.approx(0.032)
    assert f.measured_tok_per_s == pytest.approx(1 / 0.032)
    assert f.node("a").temperature_c == 55.0 and f.node("b").temperature_c is None  # unknown, not zero
    assert f.node("b").power_w is None
    assert m.balance(3) == pytest.approx(1 / 3) and m.balance(4) is None  # another plan: nothing measured
    assert m.node_steps_total == {"a": 4, "b": 4}
    clock.t += 61
    assert m.figures(handles, plan_version=3).token_s is None  # out of the window


def test_queued_and_link_probes() -> None:
    m = ClusterMetrics(clock=Clock())
    m.set_queued(3)
    m.link_probed("a", "b", 0.002)
    m.link_probed("a", "b", None)
    assert m.queued == 3
    assert m.link_probe("a", "b") == (0.002, 0.5)
    assert m.link_probe("b", "a") == (None, None)


async def test_follow_counts_outcomes_from_the_bus() -> None:
    import asyncio

    m = ClusterMetrics()
    bus = ev.EventBus()
    task = asyncio.create_task(m.follow(bus))
    await asyncio.sleep(0)
    bus.publish(ev.RequestDone(request_id="x", finish_reason="length"))
    bus.publish(ev.PlanChanged(version=2))
    for _ in range(50):
        if m.outcomes_total["completed"]:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert m.outcomes_total["completed"] == 1 and m.plan_changes_total == 1


def test_hop_records_on_the_wire() -> None:
    h = HopTiming("n1", 0.001, 0.02, 5.0, 5.03)
    assert timings_from_wire([h.to_wire()]) == (h,)
    assert timings_from_wire(None) is None
    assert timings_from_wire([["n1", -1.0, 0.0, 0.0, 0.0]]) is None  # negative seconds
    assert timings_from_wire([["n1", 0.0, float("nan"), 0.0, 0.0]]) is None
    assert timings_from_wire([[1, 2, 3]]) is None
    assert timings_from_wire([h.to_wire()] * 65) is None  # no ring is that long


def test_figures_travel_in_the_snapshot_json() -> None:
    m = ClusterMetrics(clock=Clock())
    m.step(_sample())
    f = m.figures([Handle("a", "A"), Handle("b", "B", state="failed")], plan_version=3)
    snap = ClusterSnapshot(name="c", model="m", metrics=f)
    back = snapshot_from_dict(snapshot_to_dict(snap))
    assert back.metrics == f
    assert ClusterFigures.from_dict({"tok_per_s": 2.0, "new_key": 1}).tok_per_s == 2.0


def test_spark_rows_and_item_layout() -> None:
    from rich.text import Text

    high, low = spark_rows([0.0, 1.0, 2.0, 4.0], 4)
    assert low == " ▄██" and high == "   █"  # sixteen levels over two rows
    assert spark_rows([], 3) == ("   ", "   ")
    assert len(spark_rows([1.0] * 300, 40)[0]) == 40
    rows = [[Text("a" * 10), Text("b" * 10)], [Text("c" * 3)]]
    assert [t.plain for t in lay_out(rows, 30)] == ["a" * 10 + "  " + "b" * 10, "ccc"]
    assert [t.plain for t in lay_out(rows, 15)] == ["a" * 10, "b" * 10, "ccc"]
