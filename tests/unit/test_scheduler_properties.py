"""Property tests of the partition strategies over random clusters, models, pins and drains."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler import (
    STRATEGIES,
    Constraints,
    DeviceProfile,
    InfeasiblePlan,
    Link,
    ModelSpec,
    Pin,
    Plan,
    make_plan,
    predict,
)

MB = 1_000_000
AMOUNT = re.compile(r"\d+ MB|\d+\.\d GB")  # a memory refusal names its amounts (scheduler.context.gb: MB under 0.1 GB)

SETTINGS = settings(max_examples=120)


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    n = draw(st.integers(1, 32))
    uniform = draw(st.booleans())
    if uniform:
        layers: int | tuple[int, ...] = draw(st.integers(20, 600)) * MB
    else:
        layers = tuple(x * MB for x in draw(st.lists(st.integers(20, 600), min_size=n, max_size=n)))
    embed = draw(st.integers(1, 300)) * MB
    tied = draw(st.booleans())
    head = embed + 1000 if tied else draw(st.integers(1, 300)) * MB
    return ModelSpec(
        name="rand", n_layers=n, layer_bytes=layers, embed_bytes=embed, head_bytes=head,
        kv_bytes_per_token_per_layer=draw(st.sampled_from([0, 1024, 8192])), hidden_size=draw(st.sampled_from([64, 4096])),
        context_length=draw(st.sampled_from([256, 2048])), tied_embeddings=tied,
    )


@st.composite
def clusters(draw: st.DrawFn, max_nodes: int = 7) -> list[DeviceProfile]:
    k = draw(st.integers(1, max_nodes))
    ids = [f"n{i}" for i in range(k)]
    profiles = []
    for nid in ids:
        gpu = draw(st.booleans())
        ram = draw(st.integers(3, 16)) * 1000 * MB
        vram = draw(st.integers(2, 16)) * 1000 * MB if gpu else 0
        links = {
            o: Link(draw(st.floats(0.0, 0.05)), draw(st.sampled_from([20e6, 125e6, 2.5e9])))
            for o in ids if o != nid and draw(st.booleans())
        }
        profiles.append(DeviceProfile(
            node_id=nid,
            device_type="cuda" if gpu else draw(st.sampled_from(["cpu", "apple"])),
            ram_total_bytes=ram,
            ram_available_bytes=int(ram * draw(st.floats(0.3, 1.0))),
            vram_total_bytes=vram,
            vram_available_bytes=int(vram * draw(st.floats(0.3, 1.0))),
            unified_memory=False,
            cpu_cores=draw(st.integers(2, 16)),
            memory_bandwidth_bytes_per_s=draw(st.sampled_from([5e9, 20e9, 100e9, 400e9, 1000e9])),
            load_factor=draw(st.sampled_from([0.0, 0.0, 0.2, 0.5])),
            links=links,
        ))
    return profiles


@st.composite
def constraints(draw: st.DrawFn, profiles: list[DeviceProfile], spec: ModelSpec) -> Constraints:
    ids = [p.node_id for p in profiles]
    drained = frozenset(draw(st.lists(st.sampled_from(ids), max_size=min(2, len(ids) - 1), unique=True)))
    pins = []
    if draw(st.booleans()):
        free = [i for i in ids if i not in drained]
        n_pins = draw(st.integers(0, min(2, len(free), (spec.n_layers + 1) // 2)))
        cuts = sorted(draw(st.lists(st.integers(0, spec.n_layers), min_size=2 * n_pins, max_size=2 * n_pins, unique=True)))
        nodes = draw(st.permutations(free))[:n_pins]
        for j in range(n_pins):
            pins.append(Pin(nodes[j], cuts[2 * j], cuts[2 * j + 1]))
    return Constraints(pins=tuple(pins), drained=drained,
                       min_layers_per_shard=draw(st.sampled_from([None, 1, 2])), prompt_tokens=draw(st.sampled_from([1, 128])))


def usable(p: DeviceProfile, cfg: SchedulerConfig) -> int:
    rr = cfg.resource_reservation
    return p.usable_bytes(rr.system_reserved_ram * 1024**3, rr.system_reserved_vram * 1024**3, rr.emergency_reserve)


def check_plan(plan: Plan, profiles: list[DeviceProfile], spec: ModelSpec, c: Constraints) -> None:
    cfg = SchedulerConfig()
    by_id = {p.node_id: p for p in profiles}
    # every layer exactly once, contiguous, in ring order
    owners = [plan.owner(layer) for layer in range(spec.n_layers)]
    assert len(owners) == spec.n_layers
    pos = 0
    for s in plan.shards:
        assert s.start == pos and s.end > s.start
        pos = s.end
    assert pos == spec.n_layers
    assert len(set(plan.node_ids)) == len(plan.node_ids), "a node appears twice in the ring"
    # drained nodes hold nothing
    assert not set(plan.node_ids) & c.drained
    # pins honoured
    for pin in c.pins:
        sh = plan.shard_of(pin.node_id)
        assert sh is not None and (sh.start, sh.end) == (pin.start, pin.end) and sh.pinned
    # memory never exceeded
    for s in plan.shards:
        assert spec.range_bytes(s.start, s.end) <= usable(by_id[s.node_id], cfg)
    m = c.min_layers_per_shard or cfg.partition.min_layers_per_shard
    assert all(s.n_layers >= m for s in plan.shards)
    assert plan.predictions is not None and plan.predictions.fits_memory


@SETTINGS
@given(data=st.data())
def test_every_strategy_gives_a_valid_plan_or_an_explained_error(data: st.DataObject) -> None:
    spec = data.draw(specs())
    profiles = data.draw(clusters())
    c = data.draw(constraints(profiles, spec))
    for strategy in STRATEGIES:
        try:
            plan = make_plan(profiles, spec, strategy, c, now=0.0)
        except InfeasiblePlan as exc:
            assert str(exc) and exc.constraint in {"memory", "pins", "eligibility", "min_layers_per_shard"}
            if exc.constraint == "memory":
                assert AMOUNT.search(str(exc)), str(exc)
            continue
        check_plan(plan, profiles, spec, c)
        again = make_plan(profiles, spec, strategy, c, now=0.0)
        assert again.to_dict() == plan.to_dict(), "not deterministic"
        assert Plan.from_dict(plan.to_dict()) == plan


@SETTINGS
@given(data=st.data())
def test_latency_is_never_predicted_slower_than_the_baselines(data: st.DataObject) -> None:
    spec = data.draw(specs())
    profiles = data.draw(clusters())
    c = data.draw(constraints(profiles, spec))
    try:
        latency = make_plan(profiles, spec, "latency", c, now=0.0)
    except InfeasiblePlan:
        for s in ("memory", "exo-ring"):
            with pytest.raises(InfeasiblePlan):
                make_plan(profiles, spec, s, c, now=0.0)
        return
    t = latency.predictions.decode_s_per_token
    for s in ("memory", "exo-ring"):
        try:
            other = make_plan(profiles, spec, s, c, now=0.0)
        except InfeasiblePlan:
            continue
        assert t <= other.predictions.decode_s_per_token * (1 + 1e-9), (s, latency.layout, other.layout)
    try:
        thr = make_plan(profiles, spec, "throughput", c, now=0.0)
    except InfeasiblePlan:
        return
    for s in ("memory", "exo-ring", "latency"):
        try:
            other = make_plan(profiles, spec, s, c, now=0.0)
        except InfeasiblePlan:
            continue
        assert thr.predictions.tok_per_s_saturated >= other.predictions.tok_per_s_saturated * (1 - 1e-9) or s == "latency"


@st.composite
def big_cases(draw: st.DrawFn) -> tuple[list[DeviceProfile], ModelSpec]:
    """A cluster and a model larger than any one node's free memory but within their sum."""
    profiles = draw(clusters())
    cfg = SchedulerConfig()
    room = sorted(usable(p, cfg) for p in profiles)
    if len(room) < 2 or room[-1] == 0:
        profiles = profiles + [DeviceProfile("extra", ram_total_bytes=20_000 * MB, ram_available_bytes=18_000 * MB)]
        room = sorted(usable(p, cfg) for p in profiles)
    total = draw(st.floats(room[-1] * 1.05, max(room[-1] * 1.1, sum(room) * 0.98)))
    n = draw(st.integers(8, 64))
    per = int(total / (n + 2))
    spec = ModelSpec("big", n, per, per, per, 0, 4096, 256, False)
    return profiles, spec


@settings(max_examples=60)
@given(case=big_cases())
def test_models_larger_than_any_node_spread_over_several(case: tuple[list[DeviceProfile], ModelSpec]) -> None:
    profiles, spec = case
    for strategy in ("latency", "throughput", "memory"):
        try:
            plan = make_plan(profiles, spec, strategy, Constraints(), now=0.0)
        except InfeasiblePlan as exc:
            assert exc.constraint == "memory" and AMOUNT.search(str(exc)), str(exc)
            continue
        assert len(plan.shards) >= 2
        check_plan(plan, profiles, spec, Constraints())
        if strategy == "latency":
            for other in ("memory", "exo-ring"):
                try:
                    o = make_plan(profiles, spec, other, Constraints(), now=0.0)
                except InfeasiblePlan:
                    continue
                assert plan.predictions.decode_s_per_token <= o.predictions.decode_s_per_token * (1 + 1e-9)


def _any_split_fits(profiles: list[DeviceProfile], spec: ModelSpec, c: Constraints) -> bool:
    """Brute force: some order of some nodes, some contiguous split, fits memory (tiny cases)."""
    cfg = SchedulerConfig()
    room = {p.node_id: usable(p, cfg) for p in profiles if p.node_id not in c.drained}
    m = c.min_layers_per_shard or 1
    L = spec.n_layers
    for k in range(1, len(room) + 1):
        for nodes in itertools.permutations(sorted(room), k):
            for cuts in itertools.combinations(range(1, L), k - 1):
                bounds = [0, *cuts, L]
                ok = all(
                    bounds[i + 1] - bounds[i] >= m and spec.range_bytes(bounds[i], bounds[i + 1]) <= room[n]
                    for i, n in enumerate(nodes)
                )
                if ok:
                    return True
    return False


@settings(max_examples=150)
@given(data=st.data())
def test_infeasible_only_when_no_split_fits(data: st.DataObject) -> None:
    """The memory strategy finds a plan exactly when one exists (brute force on tiny clusters)."""
    n = data.draw(st.integers(1, 7))
    spec = ModelSpec(
        name="tiny", n_layers=n,
        layer_bytes=tuple(data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))),
        embed_bytes=data.draw(st.integers(0, 5)), head_bytes=data.draw(st.integers(0, 5)),
        kv_bytes_per_token_per_layer=0, hidden_size=8, context_length=1,
    )
    k = data.draw(st.integers(1, 3))
    gib = 1024**3
    cfg = SchedulerConfig()
    reserve = int(cfg.resource_reservation.system_reserved_ram * gib)
    profiles = []
    for i in range(k):
        total = 100 * gib
        free = data.draw(st.integers(0, 14))
        # available = reserve + emergency share + `free` usable bytes, exactly
        profiles.append(DeviceProfile(f"n{i}", ram_total_bytes=total,
                                      ram_available_bytes=reserve + int(0.1 * total) + free))
    c = Constraints(min_layers_per_shard=data.draw(st.sampled_from([1, 2])))
    assert all(usable(p, cfg) in range(0, 16) for p in profiles)
    exists = _any_split_fits(profiles, spec, c)
    try:
        make_plan(profiles, spec, "memory", c, now=0.0)
        found = True
    except InfeasiblePlan:
        found = False
    assert found == exists
    # predictions of any plan are self-consistent
    if found:
        plan = make_plan(profiles, spec, "latency", c, now=0.0)
        again = predict(plan.shards, {p.node_id: p for p in profiles}, spec)
        assert again == plan.predictions


@settings(max_examples=120)
@given(data=st.data())
def test_latency_is_optimal_on_uniform_links(data: st.DataObject) -> None:
    """With equal links and no embedding/head, the latency plan equals the brute-force optimum."""
    n = data.draw(st.integers(1, 9))
    layer = 100 * MB
    spec = ModelSpec("u", n, layer, 0, 0, 0, 1024, 1)
    k = data.draw(st.integers(1, 3))
    lat = data.draw(st.floats(0.0, 0.02))
    ids = [f"n{i}" for i in range(k)]
    gib = 1024**3
    profiles = [
        DeviceProfile(
            nid, ram_total_bytes=100 * gib,
            ram_available_bytes=int(2 * gib + 10 * gib + data.draw(st.integers(0, n)) * layer),
            memory_bandwidth_bytes_per_s=data.draw(st.sampled_from([1e9, 2e9, 5e9, 20e9])),
            links={o: Link(lat, 1e9) for o in ids if o != nid},
        )
        for nid in ids
    ]
    by_id = {p.node_id: p for p in profiles}
    cfg = SchedulerConfig()
    room = {p.node_id: usable(p, cfg) for p in profiles}
    best = None
    for m in range(1, k + 1):
        for nodes in itertools.permutations(ids, m):
            for cuts in itertools.combinations(range(1, n), m - 1):
                b = [0, *cuts, n]
                shards = [(nodes[i], b[i], b[i + 1]) for i in range(m)]
                if all(spec.range_bytes(s, e) <= room[x] for x, s, e in shards):
                    t = predict(shards, by_id, spec).decode_s_per_token
                    best = t if best is None else min(best, t)
    try:
        plan = make_plan(profiles, spec, "latency", Constraints(), now=0.0)
    except InfeasiblePlan:
        assert best is None
        return
    assert best is not None
    assert plan.predictions.decode_s_per_token == pytest.approx(best, rel=1e-9, abs=1e-12)
