"""Mixtures of experts on MLX against the NumPy reference: random-weight models (dense, quantized
experts in every format, gate and up in different ones), whole and split, a batch of decode steps
equal to each alone, and a ring of ONNX then MLX layers. The real files (qwen3moe, mixtral, a
llama.cpp-quantized qwen3moe) are held to transformers in test_family_logits.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from backends import available_backends  # noqa: E402
from backends.base import BackendError  # noqa: E402
from backends.kquants import BITS, GROUP, decode  # noqa: E402
from backends.mlx import MLXBackend  # noqa: E402
from backends.mlx.experts import StackedExperts, distinct  # noqa: E402
from backends.mlx.quant import MLXSmallGroups  # noqa: E402
from backends.weights import QuantizedWeight, ShardWeights  # noqa: E402
from tests.factory import random_kquant_blocks  # noqa: E402
from tests.family_models import BASE, random_weights, sub_shard  # noqa: E402
from tests.helpers.threads import on_another_thread  # noqa: E402
from tests.reference import ReferenceShard  # noqa: E402
from tests.unit.test_family_features import close  # noqa: E402
from tests.unit.test_family_features import run_all as run  # noqa: E402

MOE = dataclasses.replace(BASE, arch="qwen3moe", n_experts=6, n_experts_used=2, expert_intermediate_size=32,
                          context_length=96)
MIXTRAL = dataclasses.replace(MOE, arch="llama", n_experts=4, expert_intermediate_size=0)  # width: the dense one
WIDE = dataclasses.replace(MOE, hidden_size=256, n_heads=4, head_dim=64, expert_intermediate_size=256, n_layers=2)
TOKENS = np.array([3, 17, 30, 91, 7, 9, 11, 60, 42, 5, 8, 13, 21, 34, 55, 89, 1, 2, 4, 16])


def kquant(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> QuantizedWeight:
    q, scales, biases = decode(random_kquant_blocks(rng, rows, cols, type_name, 0.05), type_name, cols)
    return QuantizedWeight(q=q, scales=scales, biases=biases, bits=BITS[type_name], group=GROUP[type_name],
                           source_type=type_name)


def with_experts(cfg, formats=("dense", "dense", "dense"), seed: int = 0) -> ShardWeights:
    """``random_weights`` with each layer's MLP a router and ``cfg.n_experts`` experts; ``formats``:
    gate's, up's and down's (dense, q4: 4-bit groups of 32, or a K-quant type)."""
    w = random_weights(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    h, f = cfg.hidden_size, cfg.expert_width

    def matrix(rows: int, cols: int, fmt: str):
        if fmt == "dense":
            return (rng.standard_normal((rows, cols)) * (1.5 / np.sqrt(cols))).astype(np.float32)
        if fmt == "q4":
            return QuantizedWeight.random(rng, rows, cols, bits=4)
        return kquant(rng, rows, cols, fmt)

    for lw in w.layers:
        lw.w_gate = lw.w_up = lw.w_down = None
        lw.router = (rng.standard_normal((cfg.n_experts, h)) * (3.0 / np.sqrt(h))).astype(np.float32)
        lw.experts_gate = [matrix(f, h, formats[0]) for _ in range(cfg.n_experts)]
        lw.experts_up = [matrix(f, h, formats[1]) for _ in range(cfg.n_experts)]
        lw.experts_down = [matrix(h, f, formats[2]) for _ in range(cfg.n_experts)]
    return w


@pytest.mark.parametrize("cfg", [MOE, MIXTRAL], ids=["qwen3moe", "mixtral-widths"])
@pytest.mark.parametrize("threads", [1, 2])
def test_whole_and_split_equal_the_reference(cfg, threads):
    w = with_experts(cfg)
    want = run([ReferenceShard(cfg, w)], TOKENS)
    backend = MLXBackend(threads=threads)
    close(run([backend.load_shard(cfg, w)], TOKENS), want)
    shards = [backend.load_shard(cfg, sub_shard(w, 0, 1)), backend.load_shard(cfg, sub_shard(w, 1, 3)),
              backend.load_shard(cfg, sub_shard(w, 3, cfg.n_layers))]
    close(run(shards, TOKENS), want)


@pytest.mark.parametrize("formats", [("dense",) * 3, ("Q4_K", "Q4_K", "Q6_K")], ids=["dense", "Q4_K_M"])
def test_eager_decode_steps_equal_the_reference(formats):
    """Decode steps run eagerly too (``compile_decode=False``): the same experts' code out of a trace."""
    cfg = WIDE if formats[0] != "dense" else MOE
    w = with_experts(cfg, formats)
    close(run([MLXBackend(threads=1, compile_decode=False).load_shard(cfg, w)], TOKENS[:8]),
          run([ReferenceShard(cfg, w)], TOKENS[:8]))


def test_the_router_changes_the_answer():
    """Each row's own experts: the same model with another router gives other logits (an MLP that
    averaged all experts, or took the same ones for every row, would fail the tests above)."""
    cfg = MOE
    w, other = with_experts(cfg), with_experts(cfg)
    for lw in other.layers:
        lw.router = lw.router[::-1].copy()
    a = run([MLXBackend(threads=1).load_shard(cfg, w)], TOKENS)
    b = run([MLXBackend(threads=1).load_shard(cfg, other)], TOKENS)
    assert np.abs(a - b).max() > 0.05


def test_unnormalised_expert_weights():
    cfg = dataclasses.replace(MOE, expert_weights_norm=False)
    w = with_experts(cfg)
    want = run([ReferenceShard(cfg, w)], TOKENS)
    close(run([MLXBackend(threads=1).load_shard(cfg, w)], TOKENS), want)
    assert np.abs(want - run([ReferenceShard(MOE, w)], TOKENS)).max() > 0.05


@pytest.mark.parametrize("formats", [("q4", "q4", "q4"), ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q5_K"),
                                     ("Q6_K", "Q6_K", "Q6_K"), ("Q4_K", "dense", "Q6_K")],
                         ids=["q4", "Q4_K_M", "Q5_K", "Q6_K", "gate-up-differ"])
def test_quantized_experts_stay_quantized(formats):
    """The experts' matrices in their files' formats: MLX's affine groups (q4, Q4_K, Q5_K) or Q6_K's
    packed groups of 16; gate and up fused into one stacked matrix when they share a format."""
    cfg = WIDE if any(f.endswith("_K") for f in formats) else MOE
    w = with_experts(cfg, formats)
    want = run([ReferenceShard(cfg, w)], TOKENS[:10])
    backend = MLXBackend(threads=2)
    shard = backend.load_shard(cfg, w)
    close(run([shard], TOKENS[:10]), want)
    mlp = shard.model.layers[0].mlp
    fused = formats[0] == formats[1]
    assert (mlp.gate_up is not None) == fused
    down = mlp.down
    packed, scales = down.whole
    assert packed.dtype == mx.uint32 and packed.shape[0] == cfg.n_experts
    assert all(a.shape[:2] == (cfg.n_experts, cfg.hidden_size) for a in scales.arrays())
    if formats[2].endswith("_K"):  # the super-blocks' own fields, a float16 d and an integer sc
        assert scales.scale.dtype == mx.float16 and scales.scale_codes is not None
    assert (down.kind is MLXSmallGroups) == (formats[2] == "Q6_K")
    split = [backend.load_shard(cfg, sub_shard(w, 0, 1)), backend.load_shard(cfg, sub_shard(w, 1, cfg.n_layers))]
    close(run(split, TOKENS[:10]), want)


@pytest.mark.parametrize("formats", [("dense",) * 3, ("Q4_K", "Q4_K", "Q6_K")], ids=["dense", "Q4_K_M"])
def test_a_batch_of_decode_steps_equals_each_alone(formats):
    """Eight requests at different positions decode one token each in one batch (their rows'
    experts gathered together): each equals the same step alone, and the reference."""
    cfg = WIDE if formats[0] != "dense" else MOE
    w = with_experts(cfg, formats)
    batched, alone = MLXBackend(threads=2).load_shard(cfg, w), MLXBackend(threads=2).load_shard(cfg, w)
    ref = ReferenceShard(cfg, w)
    lengths = {f"r{i}": n for i, n in enumerate((1, 2, 3, 5, 8, 11, 14, 20))}
    for rid, n in lengths.items():
        for s in (batched, alone, ref):
            s.forward(rid, TOKENS[:n], np.arange(n))
    for step in range(3):
        items = [(rid, np.array([(7 * step + 3 * n) % 90]), np.array([n + step])) for rid, n in lengths.items()]
        for (rid, tok, pos), got in zip(items, batched.forward_batch(items), strict=True):
            one = alone.forward(rid, tok, pos)
            close(got, one, 1e-5)
            close(got, ref.forward(rid, tok, pos))


def test_q6k_experts_when_the_pairs_name_fewer_than_all():
    """A short prompt and a batch of three decode steps over 16 Q6_K experts: fewer (row, expert)
    pairs than experts, so only the distinct chosen ones are unpacked (each pair finds its own)."""
    cfg = dataclasses.replace(WIDE, n_experts=16)
    w = with_experts(cfg, ("Q6_K",) * 3)
    shard, ref = MLXBackend(threads=1).load_shard(cfg, w), ReferenceShard(cfg, w)
    lengths = {"a": 1, "b": 2, "c": 3}
    for rid, n in lengths.items():
        for s in (shard, ref):
            got = s.forward(rid, TOKENS[:n], np.arange(n), all_logits=True)
        close(got, ref.forward(rid + "-again", TOKENS[:n], np.arange(n), all_logits=True))
    for step in range(2):
        items = [(rid, np.array([(7 * step + n) % 90]), np.array([n + step])) for rid, n in lengths.items()]
        for (rid, tok, pos), got in zip(items, shard.forward_batch(items), strict=True):
            close(got, ref.forward(rid, tok, pos))


@pytest.mark.skipif("onnx" not in available_backends(), reason="needs ONNX Runtime")
@pytest.mark.parametrize("order", [("onnx", "mlx"), ("mlx", "onnx")])
def test_a_ring_of_onnx_and_mlx_equals_the_reference(order):
    """Layers [0, 2) on one backend and [2, 4) on the other, each running its layers' experts
    (ONNX Runtime's MoE op, MLX's gathered products)."""
    from backends.onnx import ONNXBackend

    cfg = MOE
    w = with_experts(cfg)
    make = {"onnx": ONNXBackend(threads=2, precision="float32"), "mlx": MLXBackend(threads=2)}
    shards = [make[order[0]].load_shard(cfg, sub_shard(w, 0, 2)),
              make[order[1]].load_shard(cfg, sub_shard(w, 2, cfg.n_layers))]
    close(run(shards, TOKENS), run([ReferenceShard(cfg, w)], TOKENS))


@pytest.mark.parametrize("formats", [("dense",) * 3, ("Q4_K", "Q4_K", "Q6_K")], ids=["dense", "Q4_K_M"])
def test_runs_from_another_thread(formats):
    """A node agent loads on one thread and runs steps on its workers: every expert array (each
    thread's row block of them included) is made at load, none left to the loading thread's stream."""
    cfg = WIDE if formats[0] != "dense" else MOE
    w = with_experts(cfg, formats)
    shard, ref = MLXBackend(threads=2).load_shard(cfg, w), ReferenceShard(cfg, w)
    close(on_another_thread(lambda: run([shard], TOKENS[:6])), run([ref], TOKENS[:6]))


def test_only_the_distinct_chosen_experts_are_unpacked():
    """Q6_K experts are unpacked per step for the distinct experts the sorted pairs name (all of
    them once there are as many pairs as experts); one token's top-k as they are."""
    experts = mx.array(np.array([1, 1, 4, 4, 4, 5], np.uint32))
    chosen, slot = distinct(experts, True, 8)
    chosen, slot = np.array(chosen), np.array(slot)
    assert slot.tolist() == [0, 0, 1, 1, 1, 2] and chosen[:3].tolist() == [1, 4, 5]
    assert (chosen[slot] == np.array(experts)).all()
    top = mx.array(np.array([6, 2], np.uint32))
    chosen, slot = distinct(top, False, 8)
    assert np.array(chosen).tolist() == [6, 2] and np.array(slot).tolist() == [0, 1]
    assert distinct(experts, True, 6)[0] is None


def test_experts_in_different_formats_are_refused():
    rng = np.random.default_rng(0)
    weights = [QuantizedWeight.random(rng, 32, 64, bits=4), QuantizedWeight.random(rng, 32, 64, bits=8)]
    with pytest.raises(BackendError, match="blk.0.ffn_down_exps: the experts' matrices differ in format"):
        StackedExperts(weights, "blk.0.ffn_down_exps")
    cfg = dataclasses.replace(MOE, n_experts_used=7)
    with pytest.raises(BackendError, match="7 experts used of 6"):
        MLXBackend(threads=1).load_shard(cfg, with_experts(MOE))


@pytest.mark.parametrize("fmt", ["dense", "q4", "Q6_K"])
def test_each_expert_once_on_its_rows_equals_the_pairs_to_the_bit(fmt):
    """The eager step's grouping (one product per chosen expert, on all its rows) gives what the
    gathered product of every (row, expert) pair gives, to the bit, in each kind of matrix."""
    rng = np.random.default_rng(5)
    cols = 256
    make = {"dense": lambda: (rng.standard_normal((64, cols)) * 0.1).astype(np.float32),
            "q4": lambda: QuantizedWeight.random(rng, 64, cols, bits=4), "Q6_K": lambda: kquant(rng, 64, cols, "Q6_K")}
    stacked = StackedExperts([make[fmt]() for _ in range(6)], "test", n_parts=2)
    ids = np.sort(rng.integers(0, 6, 20)).astype(np.uint32)
    x = mx.array(rng.standard_normal((20, 1, cols)).astype(np.float32))
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    runs = list(zip(ids[starts].tolist(), starts.tolist(), np.r_[starts[1:], len(ids)].tolist(), strict=True))
    assert len(runs) < len(ids)  # some experts have several rows
    pairs = stacked(x, mx.array(ids), True)
    grouped = stacked(x, mx.array(ids), True, runs)
    assert np.array_equal(np.array(pairs), np.array(grouped))


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouping is the CPU's (a GPU's gathered product reads an expert once)")
def test_a_batch_on_the_cpu_runs_each_chosen_expert_once(monkeypatch):
    """Eight decode steps in one batch: each kind of expert matrix runs once per chosen expert
    (not once per row), every expert named in one run."""
    cfg = WIDE
    w = with_experts(cfg, ("Q4_K", "Q4_K", "Q6_K"))
    shard = MLXBackend(threads=2).load_shard(cfg, w)
    lengths = {f"r{i}": n for i, n in enumerate((1, 2, 3, 5, 8, 11, 14, 20))}
    for rid, n in lengths.items():
        shard.forward(rid, TOKENS[:n], np.arange(n))
    seen: list[list[int]] = []
    real = StackedExperts.grouped

    def recording(self, x, runs):
        seen.append([e for e, _, _ in runs])
        assert sum(b - a for _, a, b in runs) == x.shape[0]  # every pair in exactly one run
        return real(self, x, runs)

    monkeypatch.setattr(StackedExperts, "grouped", recording)
    items = [(rid, np.array([3 * n % 90]), np.array([n])) for rid, n in lengths.items()]
    shard.forward_batch(items)
    assert len(seen) == 2 * cfg.n_layers  # gate/up fused, and down, in each layer
    assert all(len(set(experts)) == len(experts) for experts in seen)
    assert any(len(experts) < len(items) * cfg.n_experts_used for experts in seen)  # rows shared an expert
