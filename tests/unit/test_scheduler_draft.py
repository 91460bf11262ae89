"""A draft model in the plan (exo_tui.scheduler.draft, issue 42): counted on the node that runs it,
placed where it costs the ring least, the shards moved where no node has room beside them, and
said so where none can hold it."""

from __future__ import annotations

from exo_tui.scheduler import Constraints, DeviceProfile, DraftNeed, Plan, make_plan
from exo_tui.scheduler.spec import synthetic_spec

GB = 1024**3
TARGET = synthetic_spec("8b", context_length=2048)  # 5.6 GB with its caches
DRAFT = DraftNeed("draft-1b", synthetic_spec("1b", context_length=2048))  # 0.9 GB with one stream's cache


def node(nid: str, free_gb: float, bw: float) -> DeviceProfile:
    """A node with ``free_gb`` usable after the default reserves, reading memory at ``bw`` bytes/s."""
    return DeviceProfile(nid, name=nid, ram_total_bytes=200 * GB, ram_available_bytes=int((free_gb + 22) * GB),
                         memory_bandwidth_bytes_per_s=bw)


def memory(plan: Plan) -> dict[str, tuple[int, int]]:
    assert plan.predictions is not None
    return {n.node_id: (n.memory_bytes, n.usable_bytes) for n in plan.predictions.nodes}


def test_the_draft_goes_where_it_costs_the_ring_least_and_is_counted_there() -> None:
    """a holds the whole model (one stream's fastest plan); b, outside the ring and three
    quarters as fast, drafts beside nothing: cheaper than a, whose stage is the whole ring."""
    nodes = [node("a", 20, 40e9), node("b", 20, 30e9), node("c", 20, 10e9)]
    bare = make_plan(nodes, TARGET, "latency", now=0.0)
    plan = make_plan(nodes, TARGET, "latency", Constraints(draft=DRAFT), now=0.0)
    assert plan.shards == bare.shards and plan.layout == "a[0,32)"
    assert plan.draft is not None and plan.draft.node_id == "b" and plan.draft.nbytes == DRAFT.spec.total_bytes
    assert plan.reasons[-1].startswith("draft model draft-1b on b: 0.9 GB")
    # throughput: every node's stage works; the draft goes to the node where a draft token is cheapest
    plan = make_plan(nodes, TARGET, "throughput", Constraints(draft=DRAFT), now=0.0)
    assert plan.draft is not None and plan.draft.node_id == "a"
    used, usable = memory(plan)["a"]
    assert used == memory(make_plan(nodes, TARGET, "throughput", now=0.0))["a"][0] + plan.draft.nbytes <= usable
    assert Plan.from_dict(plan.to_dict()) == plan


def test_where_no_node_has_room_beside_the_shards_the_plan_makes_it() -> None:
    """a's 5.8 GB hold the model but not the draft beside it; b's 0.5 GB hold neither: the plan
    moves a layer to b, and a holds the rest and the draft within its memory."""
    nodes = [node("a", 5.8, 40e9), node("b", 0.5, 20e9)]
    assert make_plan(nodes, TARGET, "latency", now=0.0).layout == "a[0,32)"
    plan = make_plan(nodes, TARGET, "latency", Constraints(draft=DRAFT), now=0.0)
    assert plan.layout == "b[0,1), a[1,32)"
    assert plan.draft is not None and plan.draft.node_id == "a"
    used, usable = memory(plan)["a"]
    assert used <= usable and "no node had room beside the shards" in plan.reasons[-1]


def test_a_draft_no_plan_can_hold_is_named_and_runs_nowhere() -> None:
    nodes = [node("a", 5.8, 40e9), node("b", 0.5, 20e9)]
    plan = make_plan(nodes, TARGET, "latency", Constraints(draft=DraftNeed("huge", TARGET)), now=0.0)
    assert plan.layout == "a[0,32)" and plan.draft is not None and plan.draft.node_id == ""
    assert plan.reasons[-1].startswith("draft model huge runs nowhere: it needs 5.6 GB")
