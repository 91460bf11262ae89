"""Windowed layers keep only their window's positions (backends/rings.py): Gemma 3's five local
layers of six hold 8 positions of the fixture's 48 (its window is 8), on ONNX's kernel and on MLX,
whole, split and mixed, decoded token by token past the window, prefilled in chunks and batched,
every position's logits still transformers' within 1e-2; exported past the window, a cache moves
between shards and backends (through the wire's array) and the next logits are the same; the
memory a request's cache is counted at (node budget, scheduler) is bounded by the window."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest

from backends.base import MAX_DRAFT, BackendError, KVCache
from backends.onnx import kernels
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.net.protocol import kv_from_array, kv_shape, kv_to_array
from tests.unit.test_family_logits import BACKENDS, DENSE, assert_close, backend, fixture

GEMMA3 = next(e for e in DENSE if e["name"] == "gemma3")
PLANS = {"whole": [(0, 6)], "split": [(0, 1), (1, 5), (5, 6)]}


@pytest.fixture(scope="module")
def gemma3() -> tuple[GGUFModel, np.ndarray, np.ndarray]:
    model, tokens, want = fixture(GEMMA3)
    cfg = model.config
    assert cfg.sliding_window == 8 and cfg.n_layers == 6 and len(tokens) == 48 and cfg.ring_window == 8
    return model, tokens, want


def load(model: GGUFModel, name: str, start: int, end: int, precision: str = "float32"):
    return backend(name, precision).load_shard(model.config, model.shard_weights(start, end))


def run(shards: list, rid: str, tokens: np.ndarray, start: int, chunk: int) -> np.ndarray:
    """Every position's logits of ``tokens`` (at ``start ..``) through ``shards``, ``chunk`` at a time."""
    outs = []
    for a in range(0, len(tokens), chunk):
        x = tokens[a : a + chunk]
        pos = np.arange(start + a, start + a + len(x))
        for shard in shards:
            x = shard.forward(rid, x, pos, all_logits=shard.is_last)
        outs.append(x)
    return np.concatenate(outs)


def assert_bounded(shard, rid: str, length: int, window: int = 8) -> None:
    """Each windowed layer of ``shard`` holds the last ``min(length, window)`` positions, the rest all."""
    cfg = shard.config
    cache = shard.export_kv(rid)
    held = [k.shape[1] for k in cache.keys]
    want = [min(length, window) if cfg.windowed(layer) else length for layer in range(shard.start, shard.end)]
    assert cache.length == length and held == want
    assert shard.ring_layers == sum(cfg.windowed(layer) for layer in range(shard.start, shard.end))


def close_shards(shards: list) -> None:
    for shard in shards:
        shard.close()


@pytest.mark.parametrize("chunk", [1, 3, 13], ids=["token-by-token", "chunks-of-3", "chunks-of-13"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", BACKENDS)
def test_every_position_past_the_window_with_bounded_caches(gemma3, name: str, plan: str, chunk: int) -> None:
    model, tokens, want = gemma3
    shards = [load(model, name, a, b) for a, b in PLANS[plan]]
    try:
        assert_close(run(shards, "r", tokens, 0, chunk), want, f"gemma3 on {name} {plan} in chunks of {chunk}")
        for shard in shards:
            assert_bounded(shard, "r", len(tokens))
    finally:
        close_shards(shards)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs both MLX and ONNX Runtime")
def test_a_mixed_split_decodes_past_the_window(gemma3) -> None:
    model, tokens, want = gemma3
    for names in (("mlx", "onnx"), ("onnx", "mlx")):
        shards = [load(model, names[0], 0, 3), load(model, names[1], 3, 6)]
        try:
            assert_close(run(shards, "r", tokens, 0, 1), want, f"gemma3 on {names}")
        finally:
            close_shards(shards)


def test_the_default_onnx_precision_past_the_window(gemma3) -> None:
    """float16 rings (the integer precisions' caches) token by token and in chunks."""
    from backends.onnx import DEFAULT_PRECISION

    model, tokens, want = gemma3
    for chunk in (1, 5):
        shard = load(model, "onnx", 0, 6, DEFAULT_PRECISION)
        try:
            assert_close(run([shard], "r", tokens, 0, chunk), want, f"int16 in chunks of {chunk}")
            assert_bounded(shard, "r", len(tokens))
        finally:
            shard.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_batched_decode_steps_past_the_window(gemma3, name: str) -> None:
    """Requests at different positions decode in one batch, each past the window at its own step."""
    model, tokens, want = gemma3
    shard = load(model, name, 0, 6)
    try:
        starts = {"a": 3, "b": 11, "c": 20}
        got = {rid: [shard.forward(rid, tokens[:p], np.arange(p), all_logits=True)] for rid, p in starts.items()}
        pos = dict(starts)
        while any(p < len(tokens) for p in pos.values()):
            items = [(rid, tokens[p : p + 1], np.array([p])) for rid, p in pos.items() if p < len(tokens)]
            for (rid, _, _), out in zip(items, shard.forward_batch(items), strict=True):
                got[rid].append(out)
                pos[rid] += 1
        for rid in starts:
            assert_close(np.concatenate(got[rid]), want, f"request {rid} batched on {name}")
            assert_bounded(shard, rid, len(tokens))
    finally:
        shard.close()


MOVES = [(a, b) for a in BACKENDS for b in BACKENDS]


@pytest.mark.parametrize(("src", "dst"), MOVES, ids=[f"{a}-to-{b}" for a, b in MOVES])
def test_a_cache_exported_past_the_window_gives_the_same_next_logits(gemma3, src: str, dst: str) -> None:
    """20 positions run on one shard, its cache (8 positions on each windowed layer) through the
    wire's array into another, which runs the rest token by token: every later position's logits."""
    model, tokens, want = gemma3
    first, second = load(model, src, 0, 6), load(model, dst, 0, 6)
    try:
        run([first], "r", tokens[:20], 0, 20)
        cache = first.export_kv("r")
        assert [k.shape[1] for k in cache.keys] == [8, 8, 8, 8, 8, 20]
        length, held = kv_shape(cache)
        assert (length, held) == (20, [8, 8, 8, 8, 8, 20])
        moved = kv_from_array(0, 6, kv_to_array(cache), length, held)
        second.import_kv("moved", moved)
        assert second.kv_length("moved") == 20
        assert_bounded(second, "moved", 20)
        assert_close(run([second], "moved", tokens[20:], 20, 1), want[20:], f"{src} to {dst}")
    finally:
        close_shards([first, second])


def test_a_split_cache_moves_between_differently_split_shards(gemma3) -> None:
    """Layers [0, 1) and [1, 6) exported and joined (as a drain does) into one whole shard."""
    model, tokens, want = gemma3
    name = BACKENDS[0]
    head, tail, whole = load(model, name, 0, 1), load(model, name, 1, 6), load(model, name, 0, 6)
    try:
        run([head, tail], "r", tokens[:30], 0, 7)
        parts = [head.export_kv("r"), tail.export_kv("r")]
        joined = KVCache(0, 6, 30, parts[0].keys + parts[1].keys, parts[0].values + parts[1].values)
        whole.import_kv("r", kv_from_array(0, 6, kv_to_array(joined), *kv_shape(joined)))
        assert_close(run([whole], "r", tokens[30:], 30, 4), want[30:], "joined")
    finally:
        close_shards([head, tail, whole])


def test_full_length_caches_move_to_rings_and_back(gemma3, monkeypatch) -> None:
    """ONNX Runtime's GroupQueryAttention (no kernel library) keeps full-length caches: its export
    imports into rings, and a ring's export (the window only) into it."""
    model, tokens, want = gemma3
    rings = load(model, "onnx", 0, 6)
    from backends.onnx import kernels

    monkeypatch.setattr(kernels, "_enabled", False)
    full = load(model, "onnx", 0, 6)
    try:
        assert full.ring_layers == 0 and rings.ring_layers == 5
        run([full], "a", tokens[:24], 0, 24)
        assert [k.shape[1] for k in full.export_kv("a").keys] == [24] * 6
        rings.import_kv("a", full.export_kv("a"))
        assert_close(run([rings], "a", tokens[24:], 24, 1), want[24:], "full-length into rings")
        run([rings], "b", tokens[:24], 0, 24)
        full.import_kv("b", rings.export_kv("b"))
        assert_close(run([full], "b", tokens[24:], 24, 3), want[24:], "rings into full-length")
    finally:
        close_shards([rings, full])


@pytest.mark.parametrize("name", BACKENDS)
def test_a_ring_is_cut_back_only_while_it_holds_the_window_before_the_cut(gemma3, name: str) -> None:
    """Rings of 8 + MAX_DRAFT rows: 46 positions run, they hold 6..45, so the cache goes back as
    far as 14 (the window before it, 6..13, is there), not to 13."""
    model, tokens, want = gemma3
    shard = load(model, name, 0, 6)
    size = model.config.ring_rows
    assert size == 8 + MAX_DRAFT
    try:
        run([shard], "short", tokens[:7], 0, 7)
        shard.truncate_kv("short", 4)  # within the window: nothing was dropped
        assert_close(run([shard], "short", tokens[4:10], 4, 1), want[4:10], "cut back within the window")
        run([shard], "long", tokens[:46], 0, 46)
        first = 46 - size
        shard.truncate_kv("long", first + 8)  # MAX_DRAFT positions back
        assert_close(run([shard], "long", tokens[first + 8 : first + 10], first + 8, 1),
                     want[first + 8 : first + 10], f"cut back by {46 - first - 8}")
        with pytest.raises(BackendError, match=f"cannot go back to {first + 7}; drop it and run its tokens again"):
            shard.truncate_kv("long", first + 7)
        assert shard.kv_length("long") == first + 10  # untouched
    finally:
        shard.close()


def test_an_import_with_too_few_positions_is_refused(gemma3) -> None:
    model, tokens, _ = gemma3
    shard = load(model, BACKENDS[0], 0, 6)
    try:
        run([shard], "r", tokens[:20], 0, 20)
        cache = shard.export_kv("r")
        short = KVCache(0, 6, 20, [k[:, 1:] for k in cache.keys], [v[:, 1:] for v in cache.values])
        with pytest.raises(BackendError, match=r"cache layer 0 has keys \(1, 7, 32\).*expected \(1, the last 8 to 20, 32\)"):
            shard.import_kv("x", short)
    finally:
        shard.close()


# ------------------------------------------------------------------ the kernel's rings


def ring_case(case: kernels.AttentionCase, window: int, rng: np.random.Generator) -> kernels.AttentionCase:
    """``case`` (linear caches) on rings of ``window`` rows: each row's last ``window`` positions
    before its chunk at row ``p % window``, the other rows junk."""
    slots, g, _, d = case.keys.shape
    keys = rng.standard_normal((slots, g, window, d)).astype(np.float16).astype(np.float32)
    values = rng.standard_normal((slots, g, window, d)).astype(np.float16).astype(np.float32)
    t = case.qkv.shape[1]
    for row, slot in enumerate(case.slot_ids):
        first = int(case.seqlens[row]) - (t - 1)
        for pos in range(max(0, first - window), first):
            keys[slot, :, pos % window] = case.keys[slot, :, pos]
            values[slot, :, pos % window] = case.values[slot, :, pos]
    return kernels.AttentionCase(**{**case.__dict__, "keys": keys, "values": values})


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
@pytest.mark.parametrize(("rows", "tokens", "head_dim"), [(4, 1, 64), (1, 1, 256), (1, 12, 64), (2, 5, 128), (1, 3, 48)])
def test_the_kernel_on_rings_as_on_full_length_caches(half: bool, rows: int, tokens: int, head_dim: int) -> None:
    """Rows past the window (and some not yet at it), decode and chunks longer than the ring can
    take in place: the outputs of full-length caches, and each ring left with its last positions."""
    library = kernels.library()
    if library is None:
        pytest.skip(f"no kernel library here ({kernels.unavailable()})")
    window = 7
    rng = np.random.default_rng(rows * 100 + tokens + head_dim)
    case = kernels.AttentionCase.random(rng, rows, tokens, heads=8, kv_heads=2, head_dim=head_dim, capacity=60,
                                        half=half, slots=rows + 2, scale=0.3, window=window)
    case = kernels.AttentionCase(**{**case.__dict__, "seqlens": np.maximum(case.seqlens, window + tokens + 3)
                                    if rows == 1 else case.seqlens})
    want_out, want_keys, want_values = case.reference()
    ring = ring_case(case, window, rng)
    tol = {"rtol": kernels.HALF_RTOL, "atol": 1e-4} if half else {"rtol": 1e-4, "atol": 1e-5}
    lib = ctypes.CDLL(library.path)
    for out, keys, values in (ring.in_session(library.path), ring.call(lib)):
        assert np.allclose(out, want_out, **tol)
        for row, slot in enumerate(case.slot_ids):
            end = int(case.seqlens[row]) + 1
            for pos in range(max(0, end - window), end):
                assert np.allclose(keys[slot, :, pos % window].astype(np.float32), want_keys[slot, :, pos], **tol)
                assert np.allclose(values[slot, :, pos % window].astype(np.float32), want_values[slot, :, pos], **tol)


# ------------------------------------------------------------------ the memory counted


def test_the_scheduler_counts_a_windowed_layer_at_its_ring(gemma3) -> None:
    from exo_tui.models.spec import spec_from_gguf
    from exo_tui.scheduler.spec import ModelSpec

    model, _, _ = gemma3
    spec = spec_from_gguf(model, context_length=4096)
    ring = 8 + MAX_DRAFT  # the window and the positions a verify step may drop
    assert spec.kv_windows == (ring, ring, ring, ring, ring, 0)
    per_token = spec.kv_bytes_per_token_per_layer
    weights = spec.range_bytes(0, 6) - spec.kv_bytes_per_layer * spec.kv_layers(0, 6)
    assert spec.range_bytes(0, 6) - weights == per_token * (4096 + 5 * ring)
    assert spec.range_bytes(5, 6) - spec.range_bytes(5, 6, 0) == per_token * 4096
    assert spec.range_bytes(0, 5) - spec.range_bytes(0, 5, 0) == per_token * 5 * ring
    assert spec.total_bytes == spec.weight_bytes + per_token * (4096 + 5 * ring)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_the_node_budget_counts_a_windowed_layer_at_its_window() -> None:
    from exo_tui.node.kv_budget import KVBudget, shard_cost

    cost = shard_cost(n_kv_heads=1, head_dim=32, start=0, end=6, value_bytes=4, ring_layers=5, window=8)
    layer = 2 * 32 * 4  # one position of one layer
    assert cost.bytes(4) == 6 * 4 * layer and cost.bytes(4096) == (4096 + 5 * 8) * layer
    budget = KVBudget(limit_bytes=1 << 30, runtime_bytes=0)
    budget.set_shards({(0, 6): cost})
    budget.record("long", (0, 6), 4096)
    assert budget.used_bytes == (4096 + 5 * 8) * layer
    assert budget.report()["bytes_per_position"] == 6 * layer  # a position's most
    # growing past the window costs the full-length layer only
    room = budget.budget_bytes - budget.used_bytes
    assert not budget.check({("long", (0, 6)): 4096 + room // layer})
    assert budget.check({("long", (0, 6)): 4096 + room // layer + 1})


@pytest.mark.parametrize(("window", "shared", "taken"), [(0, 50, True), (8, 50, False), (8, 59, True), (8, 60, True),
                                                         (64, 50, True)])
def test_a_kept_cache_is_taken_over_only_where_its_rings_can_be_cut_back(window: int, shared: int, taken: bool) -> None:
    """A finished request's 60 kept positions and a next turn sharing ``shared`` of them: with
    rings of ``window``, the nodes hold positions 52..59 only, so the turn may start at 59 or 60
    (its first query sees 52.. or 53..), not at 50 (it would need 43..)."""
    from exo_tui.cluster.pipeline import RemotePipeline
    from exo_tui.cluster.ring_steps import Kept
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams
    from exo_tui.net.protocol import PlanEntry, RingPlan

    plan = RingPlan(1, 6, (PlanEntry("n", "127.0.0.1", 1, 0, 6),))
    pipeline = RemotePipeline(host=None)  # type: ignore[arg-type]  # _take_kept touches no host
    pipeline.window = lambda: window
    kept = tuple(range(100, 160))
    pipeline._kept["old"] = Kept(kept, 20, plan)
    request = Request([*kept[:shared], 7, 8, 9], SamplingParams(temperature=0.0), 4)
    assert pipeline._take_kept(request, plan) == (("old", shared) if taken else None)


def test_a_plan_counts_windowed_layers_at_their_window() -> None:
    """One 8 GB node: six 10 MB layers with 2 GB of KV each at the full context do not fit it;
    with five of them windowed (1024 positions of 32768) they do, on every partition strategy."""
    from dataclasses import replace

    from exo_tui.scheduler import DeviceProfile, InfeasiblePlan, ModelSpec, make_plan
    from exo_tui.scheduler.context import STRATEGIES

    mb, gb = 1 << 20, 1 << 30
    full = ModelSpec("m", 6, 10 * mb, 10 * mb, 10 * mb, 64 * 1024, 64, context_length=32768)
    windowed = replace(full, kv_windows=(1024,) * 5 + (0,))
    assert full.total_bytes - windowed.total_bytes == 5 * (32768 - 1024) * 64 * 1024
    node = [DeviceProfile("a", ram_total_bytes=8 * gb, ram_available_bytes=8 * gb)]
    for strategy in STRATEGIES:
        with pytest.raises(InfeasiblePlan):
            make_plan(node, full, strategy, now=0.0)
        plan = make_plan(node, windowed, strategy, now=0.0)
        assert [(s.start, s.end) for s in plan.shards] == [(0, 6)], strategy


def test_the_ring_holds_more_long_requests_where_windowed_layers_keep_rings() -> None:
    """A node's report (its budget, a position's bytes, the rings' bytes for a whole window, the
    full-length layers' for a position): ``r`` requests fit in the larger of budget / a position's
    bytes and (budget - r windows) / a full-length position's."""
    from types import SimpleNamespace

    from exo_tui.cluster.admission import ring_kv_capacity
    from exo_tui.node.kv_budget import KVBudget, shard_cost

    def ring_of(cost) -> tuple:
        budget = KVBudget(limit_bytes=1 << 30, runtime_bytes=0)
        budget.set_shards({(0, 6): cost})
        ring = SimpleNamespace(ring=[SimpleNamespace(node_id="a")])
        return ring, {"a": SimpleNamespace(metrics={"kv": budget.report()})}, budget.budget_bytes

    ring, nodes, b = ring_of(shard_cost(1, 32, 0, 6, 4, ring_layers=5, window=8))
    layer = 2 * 32 * 4
    assert ring_kv_capacity(ring, nodes) == (b - 5 * 8 * layer) // layer  # one request: 6x a full-length count
    assert ring_kv_capacity(ring, nodes, 10) == (b - 10 * 5 * 8 * layer) // layer
    assert ring_kv_capacity(ring, nodes, b // (5 * 8 * layer) + 1) == b // (6 * layer)  # windows past the budget
    ring, nodes, b = ring_of(shard_cost(1, 32, 0, 6, 4))
    assert ring_kv_capacity(ring, nodes) == ring_kv_capacity(ring, nodes, 10) == b // (6 * layer)
    ring, nodes, b = ring_of(shard_cost(1, 32, 0, 5, 4, ring_layers=5, window=8))  # rings only: never full
    assert ring_kv_capacity(ring, nodes, 3) > 1 << 30


async def test_admission_counts_the_requests_whose_windows_the_ring_holds() -> None:
    """``capacity_for(n)``: 1000 positions less 100 for each request's rings; running requests and
    kept caches count."""
    from exo_tui.cluster.admission import Admission
    from exo_tui.inference.request import Request

    kept = {"n": 0}
    adm = Admission(lambda: 0, capacity_for=lambda n: 1000 - 100 * n, kept_requests=lambda: kept["n"])
    a, b, c = (adm.ticket(Request(list(range(1, 11)), max_tokens=390), 10000) for _ in range(3))
    assert a.need == 400 and adm.capacity_alone() == 900
    await adm.enter(a)
    await adm.enter(b)  # 800 positions for two: 800 reserved
    assert adm.stats().capacity_positions == 800
    waiting = asyncio.create_task(adm.enter(c))
    await asyncio.sleep(0)
    assert adm.ahead(c.rid) == 0
    adm.leave(a)
    await waiting
    kept["n"] = 1  # a kept cache's window: 700 for the two running and it
    assert adm.stats().capacity_positions == 700
