"""Partition strategies on hand-made clusters: exo's own example, the rules of thumb, constraints,
infeasible requests, predictions and ring order."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from exo_tui.scheduler import (
    Constraints,
    DeviceProfile,
    InfeasiblePlan,
    Link,
    ModelSpec,
    Pin,
    Plan,
    make_plan,
    predict,
    synthetic_spec,
)
from exo_tui.scheduler.order import brute_force_order, ring_order, tour_cost
from exo_tui.scheduler.partition import exo_map_partitions, exo_ring_partitions, exo_ring_shards

GB = 1024**3
MB = 1024**2


def mem_node(nid: str, mb: int) -> DeviceProfile:
    return DeviceProfile(nid, ram_total_bytes=mb * MB, ram_available_bytes=mb * MB)


# ------------------------------------------------------------------ exo's behaviour


def test_exo_ring_reproduces_exos_own_example() -> None:
    """exo/topology/test_ring_memory_weighted_partitioning_strategy.py: node1 3000, node2 1000,
    node3 6000 MB -> [node3 0.0-0.6, node1 0.6-0.9, node2 0.9-1.0]; over 32 layers exo's
    map_partitions_to_shards gives node3 layers 0-18, node1 19-27, node2 28-31."""
    nodes = [mem_node("node1", 3000), mem_node("node2", 1000), mem_node("node3", 6000)]
    assert exo_ring_partitions(nodes) == [("node3", 0.0, 0.6), ("node1", 0.6, 0.9), ("node2", 0.9, 1.0)]
    assert exo_ring_shards(nodes, 32) == [("node3", 0, 19), ("node1", 19, 28), ("node2", 28, 32)]


def test_exo_map_partitions_matches_exos_tests() -> None:
    """exo/topology/test_map_partitions.py (end inclusive there, exclusive here)."""
    parts = [("node1", 0.0, 0.42857), ("node2", 0.42857, 0.71428), ("node3", 0.71428, 0.99999)]
    assert exo_map_partitions(parts, 32) == [("node1", 0, 13), ("node2", 13, 22), ("node3", 22, 32)]
    parts = [("node1", 0.0, 0.1), ("node2", 0.1, 0.2), ("node3", 0.2, 1.0)]
    assert exo_map_partitions(parts, 32) == [("node1", 0, 3), ("node2", 3, 6), ("node3", 6, 32)]
    assert exo_map_partitions([("node1", 0.0, 1.0)], 32) == [("node1", 0, 32)]
    assert exo_map_partitions([], 32) == []


def test_exo_ring_strategy_plan_on_exos_example() -> None:
    nodes = [mem_node("node1", 3000 * 1024), mem_node("node2", 1000 * 1024), mem_node("node3", 6000 * 1024)]
    spec = ModelSpec("m", 32, 10 * MB, 10 * MB, 10 * MB, 0, 64, 16)
    plan = make_plan(nodes, spec, "exo-ring", now=0.0)
    assert [(s.node_id, s.start, s.end) for s in plan.shards] == [("node3", 0, 19), ("node1", 19, 28), ("node2", 28, 32)]


def test_exo_ring_over_memory_is_an_error_naming_the_node() -> None:
    nodes = [mem_node("big", 64 * 1024), mem_node("tiny", 3 * 1024)]  # tiny: 3 GB total, ~0.7 GB usable
    spec = ModelSpec("m", 20, 1 * GB, 0, 0, 0, 64, 16)
    with pytest.raises(InfeasiblePlan) as e:
        make_plan(nodes, spec, "exo-ring", now=0.0)
    assert e.value.constraint == "memory" and "tiny" in str(e.value) and "over by" in str(e.value)
    plan = make_plan(nodes, spec, "exo-ring", now=0.0, check_memory=False)
    assert not plan.predictions.fits_memory
    assert any("over its memory" in r for r in plan.reasons)


# ------------------------------------------------------------------ rules of thumb


def speed_node(nid: str, free_gb: float, bw: float, **kw) -> DeviceProfile:
    return DeviceProfile(nid, ram_total_bytes=int(200 * GB), ram_available_bytes=int((free_gb + 2 + 20) * GB),
                         memory_bandwidth_bytes_per_s=bw, **kw)


SPEC = ModelSpec("m", 40, 1 * GB, 0, 0, 0, 4096, 16)


def test_latency_fills_the_fastest_node_and_leaves_a_slow_one_unused_with_a_reason() -> None:
    fast = speed_node("fast", 30.5, 400e9, links={"slow": Link(0.005, 100e6)})
    slow = speed_node("slow", 30.5, 10e9, links={"fast": Link(0.005, 100e6)})
    medium = speed_node("medium", 30.5, 100e9, links={"fast": Link(0.005, 100e6)})
    plan = make_plan([fast, slow, medium], SPEC, "latency", now=0.0)
    layers = {s.node_id: s.n_layers for s in plan.shards}
    assert layers["fast"] == 30 and layers["medium"] == 10 and "slow" not in layers
    reason = next(r for r in plan.reasons if r.startswith("slow left unused"))
    assert "would slow one stream by" in reason and "ms/token" in reason


def test_throughput_balances_stage_times() -> None:
    a = speed_node("a", 40.5, 200e9)
    b = speed_node("b", 40.5, 100e9)
    plan = make_plan([a, b], SPEC, "throughput", now=0.0)
    layers = {s.node_id: s.n_layers for s in plan.shards}
    # stage time ∝ layers / bandwidth: 27 x 1/200 vs 13 x 1/100 is the most even split
    assert layers == {"a": 27, "b": 13}
    lat = make_plan([a, b], SPEC, "latency", now=0.0)
    assert plan.predictions.tok_per_s_saturated > lat.predictions.tok_per_s_saturated
    assert lat.predictions.tok_per_s_single >= plan.predictions.tok_per_s_single


def test_memory_strategy_is_proportional_and_capped() -> None:
    a = DeviceProfile("a", ram_total_bytes=100 * GB, ram_available_bytes=int((2 + 10 + 30) * GB))
    b = DeviceProfile("b", ram_total_bytes=100 * GB, ram_available_bytes=int((2 + 10 + 10) * GB))
    plan = make_plan([a, b], SPEC, "memory", now=0.0)
    assert {s.node_id: s.n_layers for s in plan.shards} == {"a": 30, "b": 10}


def test_single_node_plan_has_no_hops_and_equal_single_and_saturated() -> None:
    plan = make_plan([speed_node("only", 50, 100e9)], SPEC, "latency", now=0.0)
    p = plan.predictions
    assert len(plan.shards) == 1 and p.nodes[0].hop_s == 0
    assert p.tok_per_s_single == pytest.approx(p.tok_per_s_saturated)
    assert p.load_balance_coefficient == 0
    # 40 layers of 1 GiB at 100 GB/s x 0.6 efficiency
    assert p.decode_s_per_token == pytest.approx(40 * GB / 60e9)


def test_predictions_add_compute_hops_head_and_prefill() -> None:
    spec = ModelSpec("m", 4, 100 * MB, 50 * MB, 200 * MB, 1000, 1000, 100)
    fast = 1e12  # memory: the measured times are above the time to stream the layers
    a = DeviceProfile("a", ram_total_bytes=10 * GB, ram_available_bytes=10 * GB,
                      decode_s_per_layer={"onnx": 0.010}, prefill_s_per_layer_token={"onnx": 0.001},
                      memory_bandwidth_bytes_per_s=fast, links={"b": Link(0.002, 1e6)})
    b = DeviceProfile("b", ram_total_bytes=10 * GB, ram_available_bytes=10 * GB,
                      decode_s_per_layer={"onnx": 0.020}, memory_bandwidth_bytes_per_s=fast,
                      links={"a": Link(0.003, 1e6)})
    pr = predict([("a", 0, 1), ("b", 1, 4)], {"a": a, "b": b}, spec, prompt_tokens=10)
    hop_ab = 0.002 + 4000 / 1e6  # hidden 1000 x 4 bytes
    hop_ba = 0.003 + 8 / 1e6  # the token id back
    head = 0.020 * 2  # head bytes = 2 mean layers
    assert pr.nodes[0].compute_s == pytest.approx(0.010)
    assert pr.nodes[1].compute_s == pytest.approx(0.060 + head)
    assert pr.decode_s_per_token == pytest.approx(0.010 + hop_ab + 0.060 + head + hop_ba)
    assert pr.tok_per_s_saturated == pytest.approx(1 / (0.060 + head + hop_ba))
    prefill_b = 0.020 / 4 * 10 * 3  # not measured: decode / 4 per token
    assert pr.ttft_s == pytest.approx(0.001 * 10 + (0.002 + 40000 / 1e6) + prefill_b + head)
    stages = np.array([0.010 + hop_ab, 0.060 + head + hop_ba])
    assert pr.load_balance_coefficient == pytest.approx(stages.std() / stages.mean())
    assert pr.nodes[0].memory_bytes == spec.range_bytes(0, 1) == 100 * MB + 50 * MB + 1000 * 100
    assert pr.nodes[1].memory_bytes == 300 * MB + 200 * MB + 3 * 1000 * 100


def test_load_slows_a_node() -> None:
    idle = speed_node("x", 50, 100e9)
    busy = speed_node("x", 50, 100e9, load_factor=0.5)
    assert busy.layer_s(SPEC) == pytest.approx(1.5 * idle.layer_s(SPEC))


def test_measured_compute_scales_with_layer_size() -> None:
    d = DeviceProfile("x", decode_s_per_layer={"mlx": 0.004, "onnx": 0.006}, compute_ref_layer_bytes=int(0.5 * GB),
                      backends=("mlx", "onnx"), memory_bandwidth_bytes_per_s=1e12)
    assert d.best_backend() == "mlx"
    assert d.layer_s(SPEC) == pytest.approx(0.008)  # 1 GiB layers: twice the reference


def test_a_cpu_decodes_no_faster_than_its_weights_stream() -> None:
    """A node measures a few layers, which fit in its caches; a whole shard's decode step streams
    every layer from memory, so on a CPU the step is at least bytes / (bandwidth x efficiency).
    A GPU's or Apple chip's own memory is not what the node's CPU copy measured."""
    measured = {"onnx": 0.001}
    cpu = DeviceProfile("x", decode_s_per_layer=measured, compute_ref_layer_bytes=SPEC.mean_layer_bytes,
                        memory_bandwidth_bytes_per_s=20e9)
    streamed = SPEC.mean_layer_bytes / (20e9 * 0.6)
    assert streamed > 0.001 and cpu.layer_s(SPEC) == pytest.approx(streamed)
    assert replace(cpu, memory_bandwidth_bytes_per_s=1e15).layer_s(SPEC) == pytest.approx(0.001)
    for device in ("apple", "cuda"):
        assert replace(cpu, device_type=device).layer_s(SPEC) == pytest.approx(0.001)


# ------------------------------------------------------------------ constraints


def four() -> list[DeviceProfile]:
    ids = ["a", "b", "c", "d"]
    return [speed_node(n, 25.5, bw, links={o: Link(0.001, 1e9) for o in ids if o != n})
            for n, bw in zip(ids, [400e9, 200e9, 100e9, 50e9], strict=True)]


def test_pins_are_honoured() -> None:
    pins = (Pin("d", 10, 20), Pin("c", 30, 40))
    for strategy in ("latency", "throughput", "memory"):
        plan = make_plan(four(), SPEC, strategy, Constraints(pins=pins), now=0.0)
        assert (plan.shard_of("d").start, plan.shard_of("d").end) == (10, 20)
        assert (plan.shard_of("c").start, plan.shard_of("c").end) == (30, 40)
        assert plan.shard_of("d").pinned and plan.shard_of("c").pinned


def test_pin_parse() -> None:
    assert Pin.parse("studio:0-40") == Pin("studio", 0, 40)
    assert Pin.parse("host:with:colon:3-5") == Pin("host:with:colon", 3, 5)
    with pytest.raises(ValueError, match="NODE:START-END"):
        Pin.parse("studio")


def test_drained_and_failed_nodes_hold_nothing() -> None:
    plan = make_plan(four(), SPEC, "throughput", Constraints(drained=frozenset({"a"}), failed=frozenset({"b"})), now=0.0)
    assert set(plan.node_ids) <= {"c", "d"}
    assert any(r.startswith("a holds nothing: drained") for r in plan.reasons)
    assert any(r.startswith("b holds nothing: failed") for r in plan.reasons)


def test_min_layers_per_shard() -> None:
    plan = make_plan(four(), SPEC, "throughput", Constraints(min_layers_per_shard=8), now=0.0)
    assert all(s.n_layers >= 8 for s in plan.shards)


def test_stale_heartbeats_exclude_a_node() -> None:
    nodes = [n.with_(last_heartbeat=100.0) for n in four()]
    nodes[0] = nodes[0].with_(last_heartbeat=90.0)
    plan = make_plan(nodes, SPEC, "latency", now=101.0)
    assert "a" not in plan.node_ids
    assert any("a holds nothing: no heartbeat for 11.0 s" in r for r in plan.reasons)


# ------------------------------------------------------------------ infeasible requests


def test_not_enough_memory_says_how_much_more_and_the_largest_node() -> None:
    nodes = [DeviceProfile("pi-4", ram_total_bytes=4 * GB, ram_available_bytes=int(3.6 * GB)),
             DeviceProfile("pi-5", ram_total_bytes=8 * GB, ram_available_bytes=int(7.5 * GB))]
    with pytest.raises(InfeasiblePlan) as e:
        make_plan(nodes, synthetic_spec("8b"), "latency", now=0.0)
    msg = str(e.value)
    assert e.value.constraint == "memory" and e.value.shortfall_bytes > 0
    assert "needs" in msg and "more" in msg and "largest free is pi-5" in msg
    assert f"{e.value.shortfall_bytes / 1e9:.1f} GB more" in msg


def test_not_enough_memory_says_what_the_free_memory_is_after() -> None:
    """The reserves (2 GB RAM, ...) are for a machine's other programs; a node under a
    --memory-limit offers what its limit leaves, with the reserves given back: its message names
    the limit, not reserves it does not keep."""
    def nodes(limited: tuple[bool, bool]) -> list[DeviceProfile]:
        return [DeviceProfile("pi-4", ram_total_bytes=4 * GB, ram_available_bytes=int(3.6 * GB), memory_limited=limited[0]),
                DeviceProfile("pi-5", ram_total_bytes=8 * GB, ram_available_bytes=int(7.5 * GB), memory_limited=limited[1])]

    def message(limited: tuple[bool, bool]) -> str:
        with pytest.raises(InfeasiblePlan) as e:
            make_plan(nodes(limited), synthetic_spec("8b"), "latency", now=0.0)
        return str(e.value)

    assert "after reserves (2 GB RAM, 1 GB VRAM, 10 % kept free)" in message((False, False))
    both = message((True, True))
    assert "under their --memory-limit" in both and "reserves" not in both
    assert "under their --memory-limit, or after reserves (2 GB RAM" in message((True, False))


def test_pin_beyond_the_node_memory_names_node_and_sizes() -> None:
    with pytest.raises(InfeasiblePlan) as e:
        make_plan(four(), SPEC, "latency", Constraints(pins=(Pin("a", 0, 30),)), now=0.0)
    msg = str(e.value)
    assert msg.startswith("node a has ") and "needs" in msg and "pinned layers 0-29" in msg
    assert e.value.constraint == "memory"


@pytest.mark.parametrize(
    ("pins", "drained", "fragment"),
    [
        ((Pin("zz", 0, 4),), (), "not in the cluster"),
        ((Pin("a", 0, 50),), (), "outside the model's layers"),
        ((Pin("a", 0, 4), Pin("b", 2, 6)), (), "overlap"),
        ((Pin("a", 0, 4), Pin("a", 6, 8)), (), "pinned twice"),
        ((Pin("a", 0, 4),), ("a",), "drained"),
    ],
)
def test_bad_pins_are_explained(pins: tuple[Pin, ...], drained: tuple[str, ...], fragment: str) -> None:
    with pytest.raises(InfeasiblePlan, match=fragment) as e:
        make_plan(four(), SPEC, "latency", Constraints(pins=pins, drained=frozenset(drained)), now=0.0)
    assert e.value.constraint == "pins"


def test_gap_between_pins_below_min_layers() -> None:
    with pytest.raises(InfeasiblePlan, match="between pins are 2 layers") as e:
        make_plan(four(), SPEC, "latency", Constraints(pins=(Pin("a", 0, 10), Pin("b", 12, 20)), min_layers_per_shard=3), now=0.0)
    assert e.value.constraint == "min_layers_per_shard"


def test_no_eligible_node_lists_why() -> None:
    nodes = [n.with_(drained=True) for n in four()]
    with pytest.raises(InfeasiblePlan, match="no node can take layers .*a: drained") as e:
        make_plan(nodes, SPEC, "latency", now=0.0)
    assert e.value.constraint == "eligibility"


def test_exo_ring_refuses_pins() -> None:
    with pytest.raises(InfeasiblePlan, match="exo-ring cannot honour pins"):
        make_plan(four(), SPEC, "exo-ring", Constraints(pins=(Pin("a", 0, 10),)), now=0.0)


def test_unknown_strategy() -> None:
    with pytest.raises(InfeasiblePlan, match="unknown strategy 'fastest'"):
        make_plan(four(), SPEC, "fastest", now=0.0)


def test_order_matters_for_the_embedding_and_is_searched() -> None:
    """Only one node can hold the big embedding: the plan must start there."""
    spec = ModelSpec("m", 4, 100 * MB, 2 * GB, 0, 0, 64, 16)
    big = DeviceProfile("zz-big", ram_total_bytes=100 * GB, ram_available_bytes=int((12 + 2.2) * GB))
    small = DeviceProfile("aa-small", ram_total_bytes=100 * GB, ram_available_bytes=int((12 + 0.3) * GB))
    for strategy in ("memory", "latency", "throughput"):
        plan = make_plan([small, big], spec, strategy, Constraints(min_layers_per_shard=2), now=0.0)
        assert plan.shards[0].node_id == "zz-big"


# ------------------------------------------------------------------ plans as values


def test_plan_round_trips_through_json() -> None:
    plan = make_plan(four(), SPEC, "latency", Constraints(pins=(Pin("d", 0, 5),)), now=0.0, version=7)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.version == 7


def test_plan_rejects_gaps_and_overlaps() -> None:
    from exo_tui.scheduler import PlanShard

    with pytest.raises(ValueError, match="contiguous"):
        Plan("m", 10, (PlanShard("a", 0, 4), PlanShard("b", 5, 10)), "latency")
    with pytest.raises(ValueError, match="every layer"):
        Plan("m", 10, (PlanShard("a", 0, 4),), "latency")


def test_low_memory_headroom_warns() -> None:
    nodes = [DeviceProfile("x", ram_total_bytes=100 * GB, ram_available_bytes=int((12 + 44) * GB))]
    plan = make_plan(nodes, SPEC, "latency", now=0.0)
    assert any(r.startswith("warning:") and "1.3 x" in r for r in plan.reasons)


# ------------------------------------------------------------------ ring order


@pytest.mark.parametrize("n", [4, 5, 6, 7, 8])
def test_ring_order_is_exact_for_small_rings(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(5):
        cost = rng.uniform(0.1, 10, size=(n, n))
        np.fill_diagonal(cost, 0)
        order = ring_order(cost)
        assert sorted(order) == list(range(n))
        assert tour_cost(cost, order) == pytest.approx(tour_cost(cost, brute_force_order(cost)))


def test_ring_order_heuristic_is_a_good_tour_for_large_rings() -> None:
    rng = np.random.default_rng(0)
    pts = rng.uniform(0, 1, size=(40, 2))
    cost = np.linalg.norm(pts[:, None] - pts[None, :], axis=2)
    order = ring_order(cost)
    assert sorted(order) == list(range(40))
    assert ring_order(cost) == order  # deterministic
    assert tour_cost(cost, order) < 0.5 * tour_cost(cost, list(range(40)))
    # a random Euclidean tour of 40 points in the unit square is ~0.75 * sqrt(40 * 1) ≈ 4.7 optimal
    assert tour_cost(cost, order) < 6.0


def test_latency_keeps_well_linked_nodes_adjacent() -> None:
    # two sites: a, b close together; c, d close together; 50 ms between the sites
    def lk(n: str) -> dict[str, Link]:
        near = {"a": "b", "b": "a", "c": "d", "d": "c"}[n]
        return {o: Link(0.0005 if o == near else 0.050, 1e9) for o in "abcd" if o != n}

    nodes = [speed_node(n, 10.5, 100e9, links=lk(n)) for n in "abcd"]
    plan = make_plan(nodes, SPEC, "throughput", now=0.0)
    ids = plan.node_ids
    assert len(ids) == 4
    crossings = sum(1 for i in range(4) if (ids[i] in "ab") != (ids[(i + 1) % 4] in "ab"))
    assert crossings == 2  # one trip to the far site and one back, not four


def test_a_node_that_keeps_half_precision_caches_holds_more_layers() -> None:
    """KV caches at 100 MB a layer in float32: a node whose backend keeps them in float16 (ONNX at
    its integer precisions) holds the model where one counting float32 cannot, and the plan says
    what it will take there."""
    spec = ModelSpec("m", 8, 100 * MB, 50 * MB, 50 * MB, 25600, 64, 4096)  # 8 x (100 + 100) + 100 MB
    total = 10 * GB
    usable = int(1.4 * GB)  # the weights (900 MB) and 8 float16 caches (400 MB), not float32 ones (800 MB)
    half = DeviceProfile("half", ram_total_bytes=total, ram_available_bytes=usable + 2 * GB + total // 10,
                         kv_value_bytes={"onnx": 2})
    plan = make_plan([half], spec, "latency", now=0.0)
    assert plan.predictions.nodes[0].memory_bytes == 900 * MB + 400 * MB
    with pytest.raises(InfeasiblePlan) as e:
        make_plan([replace(half, node_id="full", kv_value_bytes={})], spec, "latency", now=0.0)
    assert e.value.constraint == "memory" and "a KV cache of 0.8 GB for 4096 tokens" in str(e.value)
    # beside a float32 node with room for 2 layers, the float16 one holds the other 6 (4 at float32)
    room = {"half": int(1.0 * GB), "full": int(0.5 * GB)}
    pair = [replace(half, ram_available_bytes=room["half"] + 2 * GB + total // 10),
            replace(half, node_id="full", kv_value_bytes={}, ram_available_bytes=room["full"] + 2 * GB + total // 10)]
    plan = make_plan(pair, spec, "latency", now=0.0)
    assert {s.node_id: s.n_layers for s in plan.shards} == {"half": 6, "full": 2}
    with pytest.raises(InfeasiblePlan):
        make_plan([replace(pair[0], kv_value_bytes={}), pair[1]], spec, "latency", now=0.0)
    assert DeviceProfile.from_dict(half.to_dict()) == half


@pytest.mark.parametrize("strategy", ["throughput", "memory"])
def test_a_stage_holds_its_layers_kv_caches_beside_their_weights(strategy: str) -> None:
    """8 layers of 100 MB, each with KV caches of 100 MB (4096 tokens in float32), an embedding
    and a head of 50 MB: two nodes with room for 850 MB hold 4 layers each (4 x 200 + 50 MB); two
    with room for 840 MB cannot hold the model, though the weights alone (450 MB a node) fit."""
    spec = ModelSpec("m", 8, 100 * MB, 50 * MB, 50 * MB, 25600, 64, 4096)
    total = 10 * GB

    def node(nid: str, room_mb: int) -> DeviceProfile:  # usable: available less 2 GB and a tenth
        return DeviceProfile(nid, ram_total_bytes=total, ram_available_bytes=room_mb * MB + 2 * GB + total // 10)

    plan = make_plan([node("a", 850), node("b", 850)], spec, strategy, now=0.0)
    assert sorted(s.n_layers for s in plan.shards) == [4, 4]
    assert all(n.memory_bytes <= 850 * MB for n in plan.predictions.nodes)
    with pytest.raises(InfeasiblePlan) as e:
        make_plan([node("a", 840), node("b", 840)], spec, strategy, now=0.0)
    assert e.value.constraint == "memory"
