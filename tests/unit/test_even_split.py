"""The "even" strategy (exo_tui.scheduler.even): layers dealt evenly in the given node order, unpinned
nodes shared among the ranges of layers that pins leave free."""

from __future__ import annotations

import pytest

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler import Constraints, DeviceProfile, InfeasiblePlan, ModelSpec, Pin
from exo_tui.scheduler.even import even_plan, share


@pytest.mark.parametrize(
    ("nodes", "sizes", "want"),
    [
        (["a", "b", "c"], [30], [["a", "b", "c"]]),
        (["a", "b", "c"], [10, 20], [["a"], ["b", "c"]]),  # the larger range gets the spare node
        (["a", "b"], [1, 1], [["a"], ["b"]]),
        (["a", "b", "c", "d"], [1, 2], [["a"], ["b", "c"]]),  # never more nodes than layers
        (["a"], [], []),
    ],
)
def testshare(nodes, sizes, want):
    assert share(nodes, sizes) == want


def test_every_range_gets_a_node_and_every_node_at_most_one_range():
    nodes = [f"n{i}" for i in range(7)]
    for sizes in ([5, 1, 9], [1, 1, 1, 1, 1, 1, 1], [3, 30], [2, 2, 2]):
        groups = share(nodes, sizes)
        assert all(1 <= len(g) <= s for g, s in zip(groups, sizes, strict=True))
        dealt = [n for g in groups for n in g]
        assert dealt == nodes[: len(dealt)] and len(dealt) == min(len(nodes), sum(sizes))


def _plan(order, pins=(), n_layers=30):
    spec = ModelSpec("m", n_layers, 10 * 1024**2, 10 * 1024**2, 10 * 1024**2, 0, 64, 16)
    profiles = {n: DeviceProfile(n, ram_total_bytes=64 * 1024**3, ram_available_bytes=64 * 1024**3) for n in order}
    return even_plan(order, {n: "onnx" for n in order}, profiles, spec, Constraints(pins=tuple(pins)), SchedulerConfig(), 7)


def test_even_plan_deals_the_layers_in_the_given_order():
    plan = _plan(["c", "a", "b"])
    assert [(s.node_id, s.start, s.end, s.backend) for s in plan.shards] == [
        ("c", 0, 10, "onnx"), ("a", 10, 20, "onnx"), ("b", 20, 30, "onnx")]
    assert (plan.strategy, plan.version, plan.n_layers) == ("even", 7, 30)
    assert plan.predictions is not None and plan.predictions.tok_per_s_single > 0


def test_even_plan_keeps_pins_and_shares_the_free_ranges():
    plan = _plan(["a", "b", "c"], pins=[Pin("b", 10, 14)])
    assert [(s.node_id, s.start, s.end) for s in plan.shards] == [("a", 0, 10), ("b", 10, 14), ("c", 14, 30)]
    # a pin on a node that is not in the order is left out
    assert [(s.node_id, s.start, s.end) for s in _plan(["a", "b"], pins=[Pin("gone", 0, 5)]).shards] == [
        ("a", 0, 15), ("b", 15, 30)]


def test_even_plan_says_what_is_missing():
    with pytest.raises(InfeasiblePlan, match="no live node") as e:
        _plan([])
    assert e.value.constraint == "eligibility"
    with pytest.raises(InfeasiblePlan, match="2 ranges of layers unheld but only 1 unpinned") as e:
        _plan(["a", "b"], pins=[Pin("b", 10, 14)])
    assert e.value.constraint == "pins"
