"""The scheduler's figures corrected by measurement (exo_tui/scheduler/calibration.py)."""

from __future__ import annotations

import pytest

from exo_tui.scheduler import Constraints, DeviceProfile, Link, make_plan, predict, synthetic_spec
from exo_tui.scheduler.calibration import (
    GAP,
    FollowState,
    LinkMeasure,
    Measurements,
    NodeMeasure,
    calibrate,
    follow,
    measured_constraints,
    prediction_gap,
    shard_layer_units,
)

SPEC = synthetic_spec("1b", context_length=1024)


def _node(nid: str, decode_s: float = 1e-3) -> DeviceProfile:
    return DeviceProfile(nid, ram_total_bytes=32 << 30, ram_available_bytes=24 << 30, cpu_cores=8,
                         decode_s_per_layer={"onnx": decode_s}, compute_ref_layer_bytes=int(SPEC.mean_layer_bytes),
                         memory_bandwidth_bytes_per_s=1e12, last_heartbeat=0.0,
                         links={p: Link(0.001, 1e9) for p in "abc" if p != nid})


def test_a_measured_slow_node_loses_its_layers_and_the_prediction_is_the_measured_one() -> None:
    nodes = [_node("a"), _node("b", 1.5e-3)]
    plan = make_plan(nodes, SPEC, "latency", now=0.0)
    assert plan.node_ids == ("a",)  # the fastest alone
    # a measured 10 ms a layer (a CPU quota), the coordinator's share 2 ms a token
    measured = Measurements({"a": NodeMeasure(10e-3, None, 20)}, {}, 0.002)
    calibrated = calibrate(nodes, SPEC, measured)
    a = next(p for p in calibrated if p.node_id == "a")
    assert a.layer_s(SPEC) == pytest.approx(10e-3) and a.calibrated and a.load_factor == 0.0
    assert a.benchmark_score == pytest.approx(nodes[0].benchmark_score / 10)  # re-scored by the same ratio
    again = predict(plan.shards, {p.node_id: p for p in calibrated}, SPEC, coordinator_s=0.002)
    units = shard_layer_units(SPEC, 0, SPEC.n_layers)
    assert again.decode_s_per_token == pytest.approx(units * 10e-3 + 0.002)
    moved = make_plan(calibrated, SPEC, "latency", measured_constraints(Constraints(), measured), now=0.0, current=plan)
    assert moved.node_ids == ("b",)


def test_a_measured_link_keeps_its_bandwidth_and_takes_the_measured_latency() -> None:
    nodes = [_node("a"), _node("b")]
    hop = LinkMeasure(0.021, SPEC.activation_bytes_per_token, 30)
    a, b = calibrate(nodes, SPEC, Measurements({}, {("a", "b"): hop}))
    assert a.link_to("b").latency_s == pytest.approx(0.021 - SPEC.activation_bytes_per_token / 1e9)
    assert a.link_to("b").bandwidth_bytes_per_s == 1e9 and b.link_to("a").latency_s == 0.001
    assert predict([("a", 0, 8), ("b", 8, SPEC.n_layers)], {"a": a, "b": b}, SPEC).node("a").hop_s >= 0.021


def test_the_gap_is_measured_over_predicted() -> None:
    assert prediction_gap(200.0, 18.0) == pytest.approx(-0.91)
    assert prediction_gap(0.0, 18.0) is None and prediction_gap(200.0, 0.0) is None


def test_a_rebalance_is_applied_once_the_gap_held_and_never_twice_within_the_cooldown() -> None:
    s = FollowState()
    s, go = follow(s, -0.5, 0.8, 0.0)
    assert not go  # just seen
    s, go = follow(s, -0.5, 0.8, 3.0)
    assert not go  # not held long enough
    s, go = follow(s, -0.1, 0.8, 4.0)
    assert not go and s.gap_since is None  # within GAP: the gap is gone
    s, _ = follow(s, -0.5, 0.8, 10.0)
    s, go = follow(s, -0.5, 0.05, 16.0)
    assert not go  # held, but too little to gain
    s, go = follow(s, -0.5, 0.8, 16.0)
    assert go and s.last_applied == 16.0
    for t in (17.0, 25.0, 40.0):  # the gap again at once: not before the cooldown
        s, go = follow(s, -0.5, 0.8, t)
        assert not go
    s, go = follow(s, -0.5, 0.8, 47.0)
    assert go
    assert not follow(FollowState(), GAP * 0.9, 0.8, 100.0)[1]
