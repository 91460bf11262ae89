"""The scheduler's figures corrected by measurement (exo_tui/scheduler/calibration.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from exo_tui.cluster.calibrate import Calibrator
from exo_tui.cluster.metrics import StepSample
from exo_tui.net.protocol import PlanEntry, RingPlan
from exo_tui.net.timing import HopTiming
from exo_tui.scheduler import Constraints, DeviceProfile, Link, make_plan, predict, synthetic_spec
from exo_tui.scheduler.calibration import (
    GAP,
    FollowState,
    LinkMeasure,
    Measurements,
    NodeMeasure,
    calibrate,
    fit_link,
    follow,
    measured_constraints,
    prediction_gap,
    shard_layer_units,
)
from exo_tui.scheduler.plan import LEASE_TOKENS

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
    # one node hands its tokens to itself: the coordinator's 2 ms on the lease's step it sends
    assert again.decode_s_per_token == pytest.approx(units * 10e-3 + 0.002 / LEASE_TOKENS)
    moved = make_plan(calibrated, SPEC, "latency", measured_constraints(Constraints(), measured), now=0.0, current=plan)
    assert moved.node_ids == ("b",)


def test_a_measured_link_keeps_its_bandwidth_and_the_others_take_its_software_time() -> None:
    nodes = [_node("a"), _node("b")]
    hop = LinkMeasure(0.021, SPEC.activation_bytes_per_token, 30)
    a, b = calibrate(nodes, SPEC, Measurements({}, {("a", "b"): hop}))
    assert a.link_to("b").latency_s == pytest.approx(0.021 - SPEC.activation_bytes_per_token / 1e9)
    assert a.link_to("b").bandwidth_bytes_per_s == 1e9
    # b -> a, not measured: its probe and what the measured hop took beyond its own (the software's)
    assert b.link_to("a").latency_s == pytest.approx(0.001 + 0.021 - nodes[0].link_to("b").hop_s(hop.nbytes))
    assert predict([("a", 0, 8), ("b", 8, SPEC.n_layers)], {"a": a, "b": b}, SPEC).node("a").hop_s >= 0.021


def _link_step(c: Calibrator, ring: RingPlan, rows: int, link_s: float) -> None:
    """A step of ``rows`` rows around a->b whose hop a->b took ``link_s`` (1 ms each way to the coordinator)."""
    out_a = 0.001 + 0.004 * rows
    hops = (HopTiming("a", 0.0, out_a - 0.001, 0.001, out_a), HopTiming("b", 0.0, 0.004 * rows, out_a + link_s,
                                                                        out_a + link_s + 0.004 * rows))
    recv = hops[1].out_wall + 0.001
    c.step(StepSample("r", ring.version, rows, 0.0, recv, recv, None, hops, 100), ring, SPEC, 1,
           SPEC.activation_bytes_per_token)


def test_a_link_slow_for_big_steps_learns_its_bandwidth_and_predicts_a_slower_prefill() -> None:
    """a->b: 2 ms a hop and 10 MB/s (its probe: 1 ms, 1 GB/s). Decode steps alone cannot tell the
    bandwidth (the probe's holds); with prompts' steps of 64 rows it is learned, and the prefill's
    hop is predicted at it, the decode token as measured."""
    t, act, bw = [0.0], SPEC.activation_bytes_per_token, 1e7
    c = Calibrator(clock=lambda: t[0])
    ring = _ring(1, ("a", 0, 8), ("b", 8, SPEC.n_layers))
    for _ in range(10):
        t[0] += 0.1
        _link_step(c, ring, 1, 0.002 + act / bw)
    assert c.measurements().links[("a", "b")].bandwidth_bytes_per_s is None  # one size: the probe's
    for i in range(3):
        t[0] += 0.1
        _link_step(c, ring, 64, 0.002 + 64 * act / bw * (1.0 + 0.02 * i))
    lm = c.measurements().links[("a", "b")]
    assert lm.bandwidth_bytes_per_s == pytest.approx(bw, rel=0.03)
    nodes = [_node("a"), _node("b")]
    shards = [("a", 0, 8), ("b", 8, SPEC.n_layers)]
    probed = {p.node_id: p for p in calibrate(nodes, SPEC, Measurements({}, {("a", "b"): replace(lm, bandwidth_bytes_per_s=None)}))}
    learned = {p.node_id: p for p in calibrate(nodes, SPEC, Measurements({}, {("a", "b"): lm}))}
    assert learned["a"].link_to("b").latency_s == pytest.approx(0.002, rel=0.05)
    before, after = predict(shards, probed, SPEC, prompt_tokens=256), predict(shards, learned, SPEC, prompt_tokens=256)
    assert after.node("a").hop_s == pytest.approx(before.node("a").hop_s)  # a decode token: as measured
    assert after.ttft_s - before.ttft_s == pytest.approx(256 * act / bw - 256 * act / 1e9, rel=0.05)


def test_a_link_fit_needs_big_steps_that_are_slower() -> None:
    small = [(100.0, 0.002)] * 5
    assert fit_link(small, [(6400.0, 0.0021)] * 3) == pytest.approx(6300 / 0.0001)
    assert fit_link(small, [(6400.0, 0.0019)] * 3) is None  # no slower: the probe's
    assert fit_link(small, [(200.0, 0.01)] * 3) is None  # too close in size to separate the two
    assert fit_link(small, [(6400.0, 0.0021)]) is None  # one big step: too few
    # a stray hop either way moves the median slope little
    assert fit_link(small, [(6400.0, 0.0021), (6400.0, 0.5), (6400.0, 0.00211)]) == pytest.approx(6300 / 0.00011)


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


def _ring(version: int, *shards: tuple[str, int, int]) -> RingPlan:
    return RingPlan(version, SPEC.n_layers, tuple(PlanEntry(n, "127.0.0.1", 1, a, b) for n, a, b in shards))


def _step(c: Calibrator, ring: RingPlan, residences: dict[str, float], *, running: int = 1, context: int = 100) -> None:
    hops = tuple(HopTiming(e.node_id, 0.0, r, 0.0, r) for e in ring.ring for r in [residences[e.node_id]])
    c.step(StepSample("r", ring.version, 1, 0.0, 1.0, sum(residences.values()) + 0.002, None, hops, context),
           ring, SPEC, running, SPEC.activation_bytes_per_token)


def test_measured_figures_are_per_load_and_the_head_takes_the_time_it_was_measured_to_take() -> None:
    """a: 1 ms a layer; b: 2 ms a layer and its head 10 ms (5 of its layers, not its bytes' 30+);
    at a batch of 4 and 3,000 positions, a takes 3 ms a layer."""
    t = [0.0]
    c = Calibrator(clock=lambda: t[0])
    half, L = SPEC.n_layers // 2, SPEC.n_layers
    units = shard_layer_units(SPEC, 0, half)
    v1, v2 = _ring(1, ("a", 0, half), ("b", half, L)), _ring(2, ("b", 0, half), ("a", half, L))
    v3, v4 = _ring(3, ("a", 0, half), ("c", half, L)), _ring(4, ("a", 0, 2), ("c", 2, L))  # c: only with the head
    for _ in range(6):
        t[0] += 0.1
        _step(c, v1, {"a": 1e-3 * units, "b": 2e-3 * units + 0.010})
        _step(c, v2, {"b": 2e-3 * units, "a": 1e-3 * units + 0.005})
        for v in (v3, v4):
            _step(c, v, {"a": 1e-3 * shard_layer_units(SPEC, 0, v.ring[0].end),
                         "c": 4e-3 * (shard_layer_units(SPEC, v.ring[0].end, L, head_layers=0.0) + 3)})
        _step(c, v1, {"a": 3e-3 * units, "b": 6e-3 * units}, running=4, context=3000)
    one = c.measurements().at(1, 100).nodes
    assert one["a"].decode_s_per_layer == pytest.approx(1e-3) and one["b"].decode_s_per_layer == pytest.approx(2e-3)
    assert one["b"].head_layers == pytest.approx(5.0) and one["a"].head_layers == pytest.approx(5.0)
    assert one["c"].head_layers == pytest.approx(3.0) and one["c"].decode_s_per_layer == pytest.approx(4e-3)
    assert c.measurements().nodes["a"].decode_s_per_layer == pytest.approx(3e-3)  # the latest load: batch 4
    assert c.measurements().at(3, 2500).nodes["a"].decode_s_per_layer == pytest.approx(3e-3)  # its bucket
    assert c.measurements().at(2, 300).nodes["a"].decode_s_per_layer == pytest.approx(1e-3)  # the nearest measured
    b = next(p for p in calibrate([_node("a"), _node("b")], SPEC, c.measurements().at(1, 100)) if p.node_id == "b")
    full = predict([("b", 0, L)], {"b": b}, SPEC)
    assert full.decode_s_per_token == pytest.approx(2e-3 * shard_layer_units(SPEC, 0, L, head_layers=5.0))


def test_a_cpu_quota_bounds_a_token_and_nodes_of_one_host_share_its_cores() -> None:
    """Unthrottled, a's shard takes 10 ms; a quarter of a core at 1.5 CPU seconds a second of its
    runs makes a token 60 ms. Many streams: two nodes of one 2-core host at 20 ms of CPU each a
    token give at most one token each 20 ms, though each stage takes 10 ms."""
    a = _node("a").with_(decode_s_per_layer={"onnx": 10e-3 / SPEC.n_layers})
    alone = predict([("a", 0, SPEC.n_layers)], {"a": a}, SPEC)
    held = predict([("a", 0, SPEC.n_layers)], {"a": a.with_(cpu_quota_cores=0.25, cpu_per_busy_s=1.5)}, SPEC)
    assert held.decode_s_per_token == pytest.approx(alone.decode_s_per_token * 1.5 / 0.25)
    half = SPEC.n_layers // 2
    pair = {n: _node(n, 10e-3 / half).with_(cpu_per_busy_s=2.0, cpu_cores=2, links={}) for n in "ab"}
    apart = predict([("a", 0, half), ("b", half, SPEC.n_layers)], pair, SPEC)
    shared = predict([("a", 0, half), ("b", half, SPEC.n_layers)], {n: p.with_(host_id="h") for n, p in pair.items()}, SPEC)
    slowest = max(n.stage_s for n in apart.nodes)
    assert apart.tok_per_s_saturated == pytest.approx(1 / slowest)
    cpu = sum(n.compute_s for n in apart.nodes) * 2.0 / 2
    assert shared.tok_per_s_saturated == pytest.approx(1 / cpu) and cpu > slowest
    assert shared.decode_s_per_token == apart.decode_s_per_token  # one stream: one stage at a time


def test_the_token_way_back_counts_the_coordinators_links_to_the_plans_first_and_last_stage() -> None:
    """Measured on a ring a -> b that drafts (the coordinator sends every step): the coordinator's
    own 1 ms, 0.5 ms to a, 10 ms back from b (behind a slow link). A plan of b alone pays b's link
    both ways; of a alone, a's."""
    ms = {("coordinator", "a"): 0.0005, ("b", "coordinator"): 0.010}
    measured = Measurements({}, {k: LinkMeasure(v, 8, 5) for k, v in ms.items()}, 0.001, handed_share=0.0)
    c = measured_constraints(Constraints(), measured)
    nodes = {p.node_id: p for p in (_node("a"), _node("b"))}
    alone = {n: predict([(n, 0, SPEC.n_layers)], nodes, SPEC, coordinator_s=c.coordinator_s,
                        coordinator_links=c.coordinator_links, handed_share=c.handed_share).decode_s_per_token
             for n in "ab"}
    assert alone["b"] - alone["a"] == pytest.approx(0.020 - 0.001)


def test_a_node_measured_on_shards_of_two_sizes_is_predicted_between_them() -> None:
    """1 ms a layer measured on a quarter of the layers, 2 ms on all: five eighths, 1.5 ms. Another
    node measured on a quarter only is predicted to grow as this one did."""
    L = SPEC.n_layers
    curve = ((L / 4, 1e-3), (float(L), 2e-3))
    a = calibrate([_node("a")], SPEC, Measurements({"a": NodeMeasure(1e-3, None, 20, 0.0, curve)}))[0]
    for n, per_layer in ((5 * L // 8, 1.5e-3), (L // 8, 1e-3), (L, 2e-3)):
        pred = predict([("a", 0, n), ("b", n, L)], {"a": a, "b": _node("b")}, SPEC)
        assert pred.node("a").compute_s == pytest.approx(n * per_layer)
    assert make_plan([a, _node("b", 1.2e-3)], SPEC, "latency", now=0.0).node_ids != ("a",)  # not all on a at 2 ms
    # b, measured on a quarter of the layers only (1.2 ms), grows as a did: all of them, 2.4 ms a layer
    b = calibrate([_node("b")], SPEC, Measurements({"b": NodeMeasure(1.2e-3, None, 20, 0.0, ((L / 4, 1.2e-3),))}))[0]
    pred = predict([("a", 0, 1), ("b", 1, L)], {"a": a, "b": b}, SPEC)
    assert pred.node("b").compute_s == pytest.approx((L - 1) * 1.2e-3 * np.interp(L - 1, [L / 4, L], [1, 2]))


def test_the_head_of_a_node_measured_only_with_it_is_its_time_beyond_its_peers_layers() -> None:
    """A ring measures its last node with the head only (1 ms a layer, its head 5 layers' time):
    against the layer time of the node measured without it (not b's, held to a CPU quota), the
    plan that puts every layer on it is predicted at its measured speed, not by the head's bytes."""
    t = [0.0]
    c = Calibrator(clock=lambda: t[0])
    L, third = SPEC.n_layers, SPEC.n_layers // 3
    ring = _ring(1, ("a", 0, third), ("b", third, 2 * third), ("c", 2 * third, L))
    c.heartbeat("b", {"cpu_time_s": 0.0, "busy_s": 0.0, "cpu_quota_cores": 0.25})
    for _ in range(6):
        t[0] += 0.1
        _step(c, ring, {"a": 1e-3 * shard_layer_units(SPEC, 0, third), "b": 4e-3 * shard_layer_units(SPEC, third, 2 * third),
                        "c": 1e-3 * shard_layer_units(SPEC, 2 * third, L, head_layers=5.0)})
    m = c.measurements({"a": "host", "b": "host", "c": "host"})
    alone = predict([("c", 0, L)], {p.node_id: p for p in calibrate([_node(n) for n in "abc"], SPEC, m)}, SPEC)
    assert alone.node("c").compute_s == pytest.approx(1e-3 * shard_layer_units(SPEC, 0, L, head_layers=5.0))
    assert m.nodes["c"].head_layers == pytest.approx(5.0) and m.nodes["c"].decode_s_per_layer == pytest.approx(1e-3)


def test_a_node_measured_only_with_the_head_is_not_timed_against_another_machines_layers() -> None:
    """a (one machine) 1 ms a layer; c (another, 3 ms a layer, its head 5 layers' time) measured only
    with the head. Against a's layers, c came out as fast as a with a head of ~25 layers; now its
    head is its bytes' (nothing of its host measured), and it is as slow as it is."""
    t = [0.0]
    c = Calibrator(clock=lambda: t[0])
    L, half = SPEC.n_layers, SPEC.n_layers // 2
    ring = _ring(1, ("a", 0, half), ("c", half, L))
    for _ in range(6):
        t[0] += 0.1
        _step(c, ring, {"a": 1e-3 * shard_layer_units(SPEC, 0, half),
                        "c": 3e-3 * shard_layer_units(SPEC, half, L, head_layers=5.0)})
    apart = c.measurements({"a": "mac", "c": "linux-box"}).nodes
    assert apart["c"].decode_s_per_layer > 2e-3, apart["c"]
    assert apart["a"].decode_s_per_layer == pytest.approx(1e-3)
    together = c.measurements({"a": "host", "c": "host"}).nodes  # one machine: a's layers do tell
    assert together["c"].decode_s_per_layer == pytest.approx(1e-3)


def test_the_figures_are_read_on_one_thread_while_steps_add_to_them_on_another() -> None:
    """A plan made on a worker thread (a preview, the model list) reads the figures while the ring's
    steps add to them on the loop's: 'deque mutated during iteration' killed a run so."""
    import sys
    import threading

    c = Calibrator()
    L, half = SPEC.n_layers, SPEC.n_layers // 2
    ring = _ring(1, ("a", 0, half), ("b", half, L))
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                c.measurements()
                c.measured_tok_per_s(1)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns within each other's loops
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3000):
            _step(c, ring, {"a": 1e-3, "b": 2e-3})
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert not errors, errors


def test_a_node_its_quota_held_back_is_bounded_by_it_on_more_layers_and_not_twice_on_its_own() -> None:
    """b, a quarter core, holds a third of the layers and its quota holds it back (its CPU a
    second is the quota's, its steps stretched to 4 ms a layer, half of it before its runs): its
    CPU is measured over its steps' residences. The ring measured is predicted on its step times
    (the wait in them once); b given every layer, at most a third as fast as the ring's token."""
    t = [0.0]
    c = Calibrator(clock=lambda: t[0])
    L, third = SPEC.n_layers, SPEC.n_layers // 3
    ring = _ring(1, ("a", 0, third), ("b", third, 2 * third), ("c", 2 * third, L))
    res = {"a": 1e-3 * shard_layer_units(SPEC, 0, third), "b": 4e-3 * shard_layer_units(SPEC, third, 2 * third),
           "c": 1e-3 * shard_layer_units(SPEC, 2 * third, L, head_layers=5.0)}
    token_s = sum(res.values()) + 0.002  # _step's round trip
    c.heartbeat("b", {"cpu_time_s": 0.0, "busy_s": 0.0, "cpu_quota_cores": 0.25})
    resided = 0.0
    for second in (1, 2, 3):  # each second of tokens: b used its quarter core, and ran half of its steps' time
        while t[0] + token_s <= second:
            t[0] += token_s
            _step(c, ring, res)
            resided += res["b"]
        t[0] = float(second)
        c.heartbeat("b", {"cpu_time_s": 0.25 * second, "busy_s": resided / 2, "cpu_quota_cores": 0.25})
    assert c.held == {"b"}
    m = c.measurements()
    assert m.cpu_per_busy_s["b"] == pytest.approx(0.25 * token_s / res["b"], rel=0.05)
    nodes = [_node(n) for n in "ac"] + [_node("b").with_(cpu_quota_cores=0.25)]  # the quota its heartbeat says
    profiles = {p.node_id: p for p in calibrate(nodes, SPEC, m)}
    shards = [(e.node_id, e.start, e.end) for e in ring.ring]
    unbound = {**profiles, "b": profiles["b"].with_(cpu_quota_cores=None)}
    # the ring measured: its step times hold the quota's wait, counted once
    assert predict(shards, profiles, SPEC).decode_s_per_token == predict(shards, unbound, SPEC).decode_s_per_token
    alone = predict([("b", 0, L)], profiles, SPEC)
    layers = shard_layer_units(SPEC, 0, L, head_layers=0.0) / shard_layer_units(SPEC, third, 2 * third)
    assert alone.decode_s_per_token >= 0.95 * layers * token_s


def test_a_node_slowed_by_its_machines_load_does_not_send_its_layers_to_a_neighbour_as_loaded() -> None:
    """a and b share a machine; other work on it slows the one serving to 2.5x its start-up figure
    while the other, holding nothing, is not measured: it runs no faster, and the plan stays. c, on
    another machine, is not scaled, nor is the host by a node its CPU quota held back."""
    a, b, c = (replace(_node(n), host_id=h) for n, h in (("a", "box"), ("b", "box"), ("c", "other")))
    nodes = [a, b, replace(c, decode_s_per_layer={"onnx": 3e-3})]
    plan = make_plan(nodes, SPEC, "latency", now=0.0)
    (serving,) = plan.node_ids
    idle = "b" if serving == "a" else "a"
    measured = Measurements({serving: NodeMeasure(2.5e-3, None, 20)}, {}, 0.002)
    got = {p.node_id: p for p in calibrate(nodes, SPEC, measured)}
    assert got[idle].layer_s(SPEC) == pytest.approx(2.5e-3)
    assert got["c"].layer_s(SPEC) == pytest.approx(nodes[2].layer_s(SPEC))
    kept = make_plan(list(got.values()), SPEC, "latency", measured_constraints(Constraints(), measured), now=0.0,
                     current=plan)
    assert kept.node_ids == (serving,)  # before: every layer to the idle neighbour, at its start-up figure
    held = replace(measured, held_layers={serving: SPEC.n_layers})  # its quota, not the machine, held it
    assert next(p for p in calibrate(nodes, SPEC, held) if p.node_id == idle).layer_s(SPEC) == \
        pytest.approx(nodes[0].layer_s(SPEC))
