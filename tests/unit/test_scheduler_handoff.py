"""The hand-off in the predictions: a token handed from the last stage straight to the first pays
that link, the coordinator's way only on the steps it sends (scheduler/context.py's way_back)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from exo_tui.cluster.calibrate import Calibrator
from exo_tui.cluster.metrics import StepSample
from exo_tui.config import SchedulerConfig
from exo_tui.net.protocol import PlanEntry, RingPlan
from exo_tui.net.timing import HopTiming
from exo_tui.scheduler import Constraints, DeviceProfile, DraftNeed, Link, make_plan, predict, synthetic_spec
from exo_tui.scheduler.calibration import LinkMeasure, Measurements, calibrate, measured_constraints
from exo_tui.scheduler.context import TOKEN_BYTES, make_context
from exo_tui.scheduler.plan import LEASE_TOKENS, Predictions

SPEC = synthetic_spec("1b", context_length=1024)
L = SPEC.n_layers
H = 1.0 - 1.0 / LEASE_TOKENS  # a lease's share of tokens handed on
FAST, SLOW = 0.001, 0.030
# the coordinator's own 2 ms on a step it sends, 0.5 ms to the first stage and from the last
COORD = (0.002, (("coordinator", "a", 0.0005), ("coordinator", "c", 0.0005),
                 ("a", "coordinator", 0.0005), ("b", "coordinator", 0.0005), ("c", "coordinator", 0.0005)))
COORD_WAY = 0.003


def _node(nid: str, links: dict[str, float], ram_gb: float = 24) -> DeviceProfile:
    return DeviceProfile(nid, ram_total_bytes=32 << 30, ram_available_bytes=int(ram_gb * (1 << 30)), cpu_cores=8,
                         decode_s_per_layer={"onnx": 1e-3}, compute_ref_layer_bytes=int(SPEC.mean_layer_bytes),
                         memory_bandwidth_bytes_per_s=1e12, last_heartbeat=0.0,
                         links={p: Link(s, 1e9) for p, s in links.items()})


def _cluster(ram_gb: float = 24) -> dict[str, DeviceProfile]:
    """a, b, c: every link 1 ms but c -> a, 30 ms (a -> c is fast)."""
    out = {}
    for n in "abc":
        out[n] = _node(n, {p: (SLOW if (n, p) == ("c", "a") else FAST) for p in "abc" if p != n}, ram_gb)
    return out


def test_a_handed_token_pays_the_last_to_first_link_and_the_coordinators_way_only_on_the_steps_it_sends() -> None:
    nodes = _cluster()
    ring = [("a", 0, L // 2), ("c", L // 2, L)]  # c hands its tokens back to a over the slow link
    handed = predict(ring, nodes, SPEC, coordinator_s=COORD[0], coordinator_links=COORD[1], handed_share=H)
    back = nodes["c"].link_to("a").hop_s(TOKEN_BYTES)
    assert handed.node("c").hop_s == pytest.approx(H * back + (1 - H) * COORD_WAY)
    # a stream that drafts takes no lease: every token by the coordinator, none over c -> a
    drafting = predict(ring, nodes, SPEC, coordinator_s=COORD[0], coordinator_links=COORD[1], handed_share=0.0)
    assert drafting.node("c").hop_s == pytest.approx(COORD_WAY)
    assert drafting.decode_s_per_token < handed.decode_s_per_token
    # the coordinator not measured: the link alone, as before any measurement
    assert predict(ring, nodes, SPEC).node("c").hop_s == pytest.approx(back)


def test_a_plan_that_drafts_is_predicted_with_no_token_handed_on_unless_measured() -> None:
    nodes = _cluster()
    config = SchedulerConfig()
    draft = DraftNeed("draft", synthetic_spec("1b", context_length=1024))
    assert make_context(nodes, SPEC, config, Constraints()).handed_share == pytest.approx(H)
    assert make_context(nodes, SPEC, config, Constraints(draft=draft)).handed_share == 0.0
    assert make_context(nodes, SPEC, config, Constraints(draft=draft, handed_share=0.5)).handed_share == 0.5


def test_one_node_pays_only_the_coordinators_steps_and_a_ring_whose_last_is_close_to_its_first_pays_less() -> None:
    """One node hands its tokens to itself (no link): its way back is the coordinator's share of the
    steps it sends. Of two rings through the same nodes, the one whose way back is the slow link
    pays it on every handed token."""
    nodes = _cluster()

    def measured(ring: list[tuple[str, int, int]]) -> Predictions:
        return predict(ring, nodes, SPEC, coordinator_s=COORD[0], coordinator_links=COORD[1], handed_share=H)

    alone = measured([("a", 0, L)])
    assert alone.node("a").hop_s == pytest.approx((1 - H) * COORD_WAY)
    third = L // 3
    slow_back = measured([("a", 0, third), ("b", third, 2 * third), ("c", 2 * third, L)])
    fast_back = measured([("a", 0, third), ("c", third, 2 * third), ("b", 2 * third, L)])
    gap = slow_back.decode_s_per_token - fast_back.decode_s_per_token
    assert gap == pytest.approx(H * (nodes["c"].link_to("a").hop_s(TOKEN_BYTES) - nodes["b"].link_to("a").hop_s(TOKEN_BYTES)))


def test_the_latency_plan_keeps_the_slow_link_off_the_tokens_way_when_every_node_is_needed() -> None:
    """Each node holds about half the model: the plan needs all three, and of the rings through them
    the one that hands tokens back over c -> a (or sends activations over it) is slower."""
    nodes = _cluster()
    need = SPEC.range_bytes(0, L, nodes["a"].kv_bytes_per_layer(SPEC, "onnx"), "onnx")
    rr = SchedulerConfig().resource_reservation  # what a node keeps back, beside 0.45 of the model
    room = int(0.45 * need + rr.system_reserved_ram * 1024**3 + rr.emergency_reserve * (32 << 30))
    small = {n: p.with_(ram_available_bytes=room) for n, p in nodes.items()}
    measured = Measurements({}, {(a, b): LinkMeasure(s, 8, 5) for a, b, s in COORD[1]}, COORD[0], handed_share=H)
    plan = make_plan(list(small.values()), SPEC, "latency", measured_constraints(Constraints(), measured), now=0.0)
    order = plan.node_ids
    assert len(order) == 3
    pairs = {(order[i], order[(i + 1) % 3]) for i in range(3)}
    assert ("c", "a") not in pairs
    worst = predict([(n, s.start, s.end) for n, s in zip(("a", "b", "c"), plan.shards, strict=True)], small, SPEC,
                    coordinator_s=COORD[0], coordinator_links=COORD[1], handed_share=H)
    assert plan.predictions.decode_s_per_token < worst.decode_s_per_token


def _ring() -> RingPlan:
    return RingPlan(1, L, (PlanEntry("a", "127.0.0.1", 1, 0, L // 2), PlanEntry("b", "127.0.0.1", 2, L // 2, L)))


def _leases(ring: RingPlan, hops_at: Callable[[float], tuple[HopTiming, ...]], handed_in: float) -> Calibrator:
    """A calibrator given 5 leases on ``ring``: each one step the coordinator sends (4 ms of its
    own, 1 ms to the first stage, 1 ms back from the last), then 15 the ring runs on its own, its
    first stage reached ``handed_in`` after the last stage handed the token before on (its clock).
    ``hops_at``: a step's hops, the first stage reached at the given time."""
    clock = [0.0]
    c = Calibrator(clock=lambda: clock[0])
    for i in range(5 * LEASE_TOKENS):
        clock[0] += 0.01
        handed = i % LEASE_TOKENS != 0
        hops = hops_at(handed_in if handed else 0.001)
        if handed:
            sample = StepSample("r", 1, 1, 0.0, 0.0, hops[-1].out_wall, None, hops, 100, handed=True)
        else:
            recv = hops[-1].out_wall + 0.001
            sample = StepSample("r", 1, 1, 0.0, recv, recv, 0.004, hops, 100)
        c.step(sample, ring, SPEC, 1, SPEC.activation_bytes_per_token)
    return c


def test_the_coordinators_share_is_measured_on_the_steps_it_sends_and_the_share_handed_on_beside_it() -> None:
    """A lease: one step the coordinator sends (4 ms of its own, 1 ms to a, 1 ms back from b), then
    15 the ring runs on its own (b -> a in 2 ms). The coordinator's figures are the sent steps'
    alone (a handed token's 0 no longer dilutes them), the share handed on 15/16."""
    c = _leases(_ring(), lambda a_in: (HopTiming("a", 0.0, 0.001, a_in, a_in + 0.001),
                                       HopTiming("b", 0.0, 0.001, a_in + 0.0015, a_in + 0.0025)), handed_in=0.002)
    m = c.measurements()
    assert m.coordinator_s == pytest.approx(0.004)
    assert m.handed_share == pytest.approx(1 - 1 / LEASE_TOKENS)
    assert m.links[("coordinator", "a")].hop_s == pytest.approx(0.001)
    assert m.links[("b", "coordinator")].hop_s == pytest.approx(0.001)
    assert m.links[("b", "a")].hop_s == pytest.approx(0.002)
    constraints = measured_constraints(Constraints(), m)
    assert constraints.handed_share == pytest.approx(1 - 1 / LEASE_TOKENS)
    # predicted on those figures, a token's way back: b -> a for 15 of 16, the coordinator's for 1
    nodes = calibrate([_node("a", {"b": FAST}), _node("b", {"a": FAST})], SPEC, m)
    pred = predict([("a", 0, L // 2), ("b", L // 2, L)], {p.node_id: p for p in nodes}, SPEC,
                   coordinator_s=constraints.coordinator_s, coordinator_links=constraints.coordinator_links,
                   handed_share=constraints.handed_share)
    b_to_a = next(p for p in nodes if p.node_id == "b").link_to("a").hop_s(TOKEN_BYTES)
    assert pred.node("b").hop_s == pytest.approx(H * b_to_a + (1 - H) * (0.004 + 0.001 + 0.001))


def test_one_node_measures_its_hand_off_to_itself_and_its_plan_is_predicted_with_it() -> None:
    """A ring of one node: 4 ms a step; a token it hands itself starts its next step 0.8 ms after
    the token before left (written to the coordinator first); one step in 16 the coordinator sends
    (4 ms of its own, 1 ms each way). No link holds that 0.8 ms: measured as the node's hand-off,
    the one-node plan is predicted at the measured token (without it, 15 % too fast); a node of
    the same host not measured alone takes it too."""
    c = _leases(RingPlan(1, L, (PlanEntry("a", "127.0.0.1", 1, 0, L),)),
                lambda a_in: (HopTiming("a", 0.0, 0.004, a_in, a_in + 0.004),), handed_in=0.0008)
    m = c.measurements()
    assert m.handoff == {"a": pytest.approx(0.0008)}
    measured = c.measured_tok_per_s(1)
    assert measured is not None
    constraints = measured_constraints(Constraints(), m)
    host = {p.node_id: p.with_(host_id="h") for p in calibrate([_node("a", {}), _node("b", {})], SPEC, m)}

    def alone(node: str) -> Predictions:
        return predict([(node, 0, L)], host, SPEC, coordinator_s=constraints.coordinator_s,
                       coordinator_links=constraints.coordinator_links, handed_share=constraints.handed_share)

    assert alone("a").tok_per_s_single == pytest.approx(measured[0], rel=0.01)
    assert alone("b").node("b").hop_s == pytest.approx(alone("a").node("a").hop_s)


def test_a_node_behind_a_slow_link_does_not_lend_its_coordinator_link_to_the_others() -> None:
    """A ring measured the coordinator's link to its first stage a (0.5 ms) and from its last c, behind
    a 10 ms relay (10.5 ms). A one-node plan on b, whose links to the coordinator were never measured,
    pays b's own: the others' beyond their reach, plus b's (before: c's 10.5 ms, the median of the way
    back measured, and slow-link's one-node plans measured 1.19-1.21 of their prediction)."""
    relay = 0.010
    nodes = {n: _node(n, {p: (relay if "c" in (n, p) else FAST) for p in "abc" if p != n}) for n in "abc"}
    links = (("coordinator", "a", 0.0005), ("c", "coordinator", relay + 0.0005))
    ctx = make_context(nodes, SPEC, SchedulerConfig(), Constraints(coordinator_s=0.002, coordinator_links=links))
    assert ctx.reach["c"] == pytest.approx(relay) and ctx.reach["b"] == pytest.approx(FAST)
    to_b = 0.0005 - FAST + FAST  # what the measured way took beyond its node's reach, plus b's
    back_b = (relay + 0.0005) - relay + FAST
    assert ctx.coordinator_hop("b", "b") == pytest.approx(0.002 + to_b + back_b)  # 4 ms, against 13 before
    assert ctx.coordinator_hop("c", "c") == pytest.approx(0.002 + 2 * (relay + 0.0005))  # its own, both ways
