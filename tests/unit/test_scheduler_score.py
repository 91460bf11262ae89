"""Each rule of the device score and of the dynamic weights (SCHEDULER.md), one test each."""

from __future__ import annotations

import pytest

from exo_tui.config import SchedulerConfig, ScoringConfig
from exo_tui.scheduler import (
    ClusterState,
    DeviceProfile,
    Link,
    Work,
    cluster_state,
    dynamic_weights,
    score_node,
    score_nodes,
    score_parts,
    synthetic_spec,
)
from exo_tui.scheduler.score import REFERENCE_WEIGHTS, Weights

GB = 1024**3
DEFAULT = SchedulerConfig()
W0 = dynamic_weights(DEFAULT, ClusterState())


def node(**kw) -> DeviceProfile:
    base = dict(node_id="a", device_type="cpu", ram_total_bytes=32 * GB, ram_available_bytes=16 * GB,
                cpu_cores=8, cpu_utilization=0.0, benchmark_score=1.0, load_factor=0.0)
    base.update(kw)
    return DeviceProfile(**base)


WORK = Work(vram_needed=8 * GB, ram_needed=8 * GB, cpu_cores_needed=2, min_performance=1.0,
            communication_heavy=False)


# ------------------------------------------------------------------ parts


def test_vram_fit_full_points_with_modest_headroom() -> None:
    # 16 GB available for 8 GB needed: ratio 2, 2/2 = 1 -> 40
    assert score_parts(node(), WORK)["vram_fit"] == pytest.approx(40)


def test_vram_fit_decreases_with_large_headroom() -> None:
    # 32 GB available for 8 GB: 40 * 2/4 = 20
    assert score_parts(node(ram_available_bytes=32 * GB), WORK)["vram_fit"] == pytest.approx(20)


def test_vram_fit_zero_when_it_does_not_fit() -> None:
    assert score_parts(node(ram_available_bytes=7 * GB), WORK)["vram_fit"] == 0


def test_vram_fit_uses_vram_on_discrete_gpus_and_ram_on_unified_memory() -> None:
    gpu = node(device_type="cuda", vram_total_bytes=24 * GB, vram_available_bytes=4 * GB, ram_available_bytes=64 * GB)
    assert score_parts(gpu, WORK)["vram_fit"] == 0  # 4 GB of VRAM < 8 GB, RAM does not count
    mac = node(device_type="apple", unified_memory=True, ram_available_bytes=12 * GB)
    assert score_parts(mac, WORK)["vram_fit"] == pytest.approx(40)  # unified: RAM is the VRAM


def test_cpu_points_need_enough_free_cores() -> None:
    assert score_parts(node(cpu_cores=4, cpu_utilization=0.5), WORK)["cpu"] == 20  # 2 free >= 2
    assert score_parts(node(cpu_cores=4, cpu_utilization=0.75), WORK)["cpu"] == 0  # 1 free < 2


def test_ram_points() -> None:
    assert score_parts(node(ram_available_bytes=8 * GB), WORK)["ram"] == 15
    assert score_parts(node(ram_available_bytes=8 * GB - 1), WORK)["ram"] == 0


def test_device_type_points_only_for_the_preferred_type() -> None:
    w = Work(preferred_device_type="cuda")
    assert score_parts(node(device_type="cuda"), w)["device_type"] == 10
    assert score_parts(node(device_type="cpu"), w)["device_type"] == 0
    assert score_parts(node(device_type="cpu"), Work())["device_type"] == 0


def test_performance_points_scale_with_benchmark_and_cap_at_25() -> None:
    w = Work(min_performance=4.0)
    assert score_parts(node(benchmark_score=1.0), w)["performance"] == pytest.approx(6.25)
    assert score_parts(node(benchmark_score=4.0), w)["performance"] == pytest.approx(25)
    assert score_parts(node(benchmark_score=40.0), w)["performance"] == pytest.approx(25)


def test_load_balance_points() -> None:
    assert score_parts(node(load_factor=0.0), WORK)["load_balance"] == pytest.approx(30)
    assert score_parts(node(load_factor=0.25), WORK)["load_balance"] == pytest.approx(22.5)
    assert score_parts(node(load_factor=1.0), WORK)["load_balance"] == 0


def test_network_points_only_for_communication_heavy_work() -> None:
    links = {"b": Link(0.010), "c": Link(0.030)}  # average 20 ms -> 20 * 0.8 = 16
    d = node(links=links)
    heavy = Work(communication_heavy=True, related_nodes=("b", "c"))
    assert score_parts(d, heavy)["network"] == pytest.approx(16)
    assert score_parts(d, Work(communication_heavy=False, related_nodes=("b", "c")))["network"] == 0
    slow = node(links={"b": Link(0.150)})
    assert score_parts(slow, Work(communication_heavy=True, related_nodes=("b",)))["network"] == 0


def test_score_is_the_sum_of_parts_at_default_weights() -> None:
    s = score_node(node(), WORK, W0, DEFAULT, now=0.0)
    assert s.score == pytest.approx(sum(s.parts.values()))
    assert s.weighted_parts == s.parts
    assert s.weights == REFERENCE_WEIGHTS
    # 40 + 20 + 15 + 0 + 25 + 30 + 0
    assert s.score == pytest.approx(130)


def test_power_state_not_active_halves_the_score() -> None:
    active = score_node(node(), WORK, W0, DEFAULT, now=0.0)
    sleepy = score_node(node(power_state="battery"), WORK, W0, DEFAULT, now=0.0)
    assert sleepy.score == pytest.approx(active.score * 0.5)
    assert "x0.5" in sleepy.penalty


def test_no_heartbeat_beyond_timeout_scores_zero_and_says_so() -> None:
    fresh = score_node(node(last_heartbeat=100.0), WORK, W0, DEFAULT, now=103.0)  # 3 s: not more than 3
    assert fresh.score > 0 and fresh.eligible
    stale = score_node(node(last_heartbeat=100.0), WORK, W0, DEFAULT, now=103.5)
    assert stale.score == 0 and not stale.eligible
    assert "no heartbeat for 3.5 s" in stale.reason


def test_eligibility_threshold_and_reason() -> None:
    # loaded, slow, no room: 0 + 0 + 0 + 0 + 25*0.1 + 30*0.1 + 0 = 5.5
    weak = node(ram_available_bytes=1 * GB, cpu_cores=1, cpu_utilization=0.9, benchmark_score=0.1, load_factor=0.9)
    s = score_node(weak, WORK, W0, DEFAULT, now=0.0)
    assert s.score == pytest.approx(5.5)
    assert not s.eligible
    assert s.reason.startswith("score 5.5 < 60")
    assert "vram_fit 0/40" in s.reason
    cfg = SchedulerConfig(scoring=ScoringConfig(min_score_threshold=5.0))
    assert score_node(weak, WORK, W0, cfg, now=0.0).eligible


def test_drained_and_failed_nodes_are_not_eligible() -> None:
    assert score_node(node(drained=True), WORK, W0, DEFAULT, now=0.0).reason == "drained"
    assert score_node(node(failed=True), WORK, W0, DEFAULT, now=0.0).reason == "failed"


# ------------------------------------------------------------------ dynamic weights


def test_weights_start_at_the_configured_values() -> None:
    assert W0.as_dict() == {"resource": 40, "performance": 35, "load_balance": 15, "network": 10}
    assert W0.shifts == ()


def test_resource_pressure_shifts_weights() -> None:
    w = dynamic_weights(DEFAULT, ClusterState(resource_utilization=0.81))
    assert (w.resource, w.performance, w.load_balance, w.network) == (50, 30, 15, 10)
    assert dynamic_weights(DEFAULT, ClusterState(resource_utilization=0.8)).resource == 40  # > 0.8, not >=


def test_load_imbalance_shifts_weights() -> None:
    w = dynamic_weights(DEFAULT, ClusterState(load_imbalance=0.71))
    assert (w.resource, w.performance, w.load_balance, w.network) == (35, 35, 25, 10)
    assert dynamic_weights(DEFAULT, ClusterState(load_imbalance=0.7)).load_balance == 15


def test_network_congestion_shifts_weights() -> None:
    w = dynamic_weights(DEFAULT, ClusterState(network_congestion=0.61))
    assert (w.resource, w.performance, w.load_balance, w.network) == (40, 30, 15, 25)
    assert dynamic_weights(DEFAULT, ClusterState(network_congestion=0.6)).network == 10


def test_all_shifts_combine_and_never_go_negative() -> None:
    w = dynamic_weights(DEFAULT, ClusterState(0.9, 0.9, 0.9))
    assert (w.resource, w.performance, w.load_balance, w.network) == (45, 25, 25, 25)
    assert len(w.shifts) == 3
    cfg = SchedulerConfig(scoring=ScoringConfig(performance_weight=3.0))
    assert dynamic_weights(cfg, ClusterState(0.9, 0.0, 0.9)).performance == 0


def test_weights_scale_their_groups_in_the_score() -> None:
    d = node()
    w = Weights(resource=50, performance=35, load_balance=15, network=10)
    s = score_node(d, WORK, w, DEFAULT, now=0.0)
    # resource parts (vram_fit 40 + cpu 20 + ram 15) count 50/40 = 1.25 times
    assert s.weighted_parts["vram_fit"] == pytest.approx(50)
    assert s.weighted_parts["cpu"] == pytest.approx(25)
    assert s.weighted_parts["ram"] == pytest.approx(18.75)
    assert s.weighted_parts["performance"] == pytest.approx(25)
    assert s.score == pytest.approx(50 + 25 + 18.75 + 25 + 30)


def test_cluster_state_measures_memory_load_and_links() -> None:
    a = node(node_id="a", ram_total_bytes=10 * GB, ram_available_bytes=1 * GB, load_factor=0.9,
             links={"b": Link(0.080)})
    b = node(node_id="b", ram_total_bytes=10 * GB, ram_available_bytes=1 * GB, load_factor=0.1,
             links={"a": Link(0.080)})
    st = cluster_state([a, b])
    assert st.resource_utilization == pytest.approx(0.9)
    assert st.load_imbalance == pytest.approx(0.8)
    assert st.network_congestion == pytest.approx(0.8)
    w = dynamic_weights(DEFAULT, st)
    assert w.as_dict() == {"resource": 45, "performance": 25, "load_balance": 25, "network": 25}
    assert cluster_state([a, b], network_congestion=0.1).network_congestion == 0.1


def test_score_nodes_for_a_model_uses_even_shares_and_reports_every_node() -> None:
    spec = synthetic_spec("8b")
    nodes = [node(node_id="a", links={"b": Link(0.001)}), node(node_id="b", links={"a": Link(0.001)}),
             node(node_id="c", drained=True)]
    scores = score_nodes(nodes, spec, DEFAULT, now=0.0)
    assert set(scores) == {"a", "b", "c"}
    assert scores["a"].eligible and scores["b"].eligible and not scores["c"].eligible
    assert scores["a"].parts["network"] == pytest.approx(20 * (1 - 1 / 100))
    assert scores["a"].to_dict()["parts"]["vram_fit"] > 0
