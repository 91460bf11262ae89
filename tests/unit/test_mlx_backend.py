"""The MLX backend against the NumPy reference, split against whole, KV moves, packing, errors.

Tolerance: the reference dequantizes the same codes the backend keeps quantized, so the only
differences are float32 rounding (summation order, float32 vs the reference's float64
softmax/norm). Logits must agree within ``RTOL = 1e-4`` of the largest logit's magnitude
(observed: ~5e-7 on the tiny models, ~3e-6 on SmolLM2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from backends import get_backend  # noqa: E402
from backends.base import BackendError, KVCache, ModelConfig  # noqa: E402
from backends.kquants import BITS, GROUP, decode  # noqa: E402
from backends.mlx import MLXBackend  # noqa: E402
from backends.mlx import shard as mlx_shard  # noqa: E402
from backends.mlx.llama import rope, step_inputs  # noqa: E402
from backends.mlx.quant import MLXQuantized, MLXSmallGroups, pack_codes, to_mlx, unpack_codes  # noqa: E402
from backends.onnx import ONNXBackend  # noqa: E402
from backends.weights import QuantizedWeight  # noqa: E402
from exo_tui.models.gguf_file import GGUFModel  # noqa: E402
from tests.conftest import WEIGHT_TYPES  # noqa: E402
from tests.factory import random_kquant_blocks, write_tiny_llama  # noqa: E402
from tests.helpers.threads import on_another_thread  # noqa: E402
from tests.reference import ReferenceShard  # noqa: E402
from tests.reference import rope as reference_rope  # noqa: E402

RTOL = 1e-4
PROMPT = np.array([5, 17, 30, 100, 7, 9, 11, 260, 42])


def close(a: np.ndarray, b: np.ndarray, rtol: float = RTOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.abs(a - b).max())
    scale = float(np.abs(b).max())
    assert err <= rtol * scale, f"max abs difference {err:.3g} > {rtol} x {scale:.3g}"


def load(path: Path, start: int = 0, end: int | None = None, **kw):
    model = GGUFModel(path)
    cfg = model.config
    weights = model.shard_weights(start, cfg.n_layers if end is None else end)
    return cfg, weights, MLXBackend(threads=kw.pop("threads", 2), **kw).load_shard(cfg, weights)


def decode_tokens(n: int, start: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array([(31 * i + 3) % 250]), np.array([start + i])) for i in range(n)]


# ---------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("weight_type", [*WEIGHT_TYPES, "F32-untied"])
@pytest.mark.parametrize("threads", [1, 2])
def test_logits_match_reference(tiny_models, weight_type, threads):
    cfg, weights, shard = load(tiny_models[weight_type], threads=threads)
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    last = shard.forward("r2", PROMPT, pos)
    assert last.shape == (1, cfg.vocab_size) and last.dtype == np.float32
    close(last, ref.forward("r2", PROMPT, pos))
    for tok, p in decode_tokens(6, len(PROMPT)):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))
    assert shard.kv_length("r") == len(PROMPT) + 6


def test_eager_and_compiled_decode_agree(tiny_models):
    cfg, weights, compiled = load(tiny_models["Q4_1"])
    _, _, eager = load(tiny_models["Q4_1"], compile_decode=False)
    pos = np.arange(len(PROMPT))
    close(compiled.forward("r", PROMPT, pos), eager.forward("r", PROMPT, pos), 1e-6)
    for tok, p in decode_tokens(4, len(PROMPT)):
        close(compiled.forward("r", tok, p), eager.forward("r", tok, p), 1e-6)


def test_layers_with_mixed_formats(tiny_models):
    """q/k/v or gate/up in different formats (as in GGUFs that keep attn_v in Q8_0) run as
    separate matmuls; dense F16 matrices run in float32."""
    model = GGUFModel(tiny_models["Q4_1"])
    cfg = model.config
    weights = model.shard_weights(0, cfg.n_layers)
    other = GGUFModel(tiny_models["Q8_0"]).shard_weights(0, cfg.n_layers)
    f16 = GGUFModel(tiny_models["F16"]).shard_weights(0, cfg.n_layers)
    weights.layers[0].wv = other.layers[0].wv
    weights.layers[1].w_up = f16.layers[1].w_up
    weights.layers[2].wo = f16.layers[2].wo
    assert f16.layers[1].w_up.dtype == np.float16
    shard = MLXBackend(threads=2).load_shard(cfg, weights)
    assert shard.model.layers[0].self_attn.qkv_proj is None and shard.model.layers[0].self_attn.v_proj.bits == 8
    assert shard.model.layers[1].mlp.gate_up_proj is None and shard.model.layers[1].mlp.up_proj.weight.dtype == mx.float32
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    for tok, p in decode_tokens(3, len(PROMPT)):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))


def test_quantized_weights_stay_quantized(tiny_models):
    """Q4_0, Q4_1 and Q8_0 layers and the tied head run as MLX affine-quantized arrays, not floats,
    their scales held as the file's float16 (Q4_0's and Q8_0's biases implied: -8 d, -128 d): as
    many bytes as the file's blocks."""
    for weight_type, bits, bias in (("Q4_0", 4, False), ("Q4_1", 4, True), ("Q8_0", 8, False)):
        _, _, shard = load(tiny_models[weight_type])
        layer = shard.model.layers[0]
        for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(w, MLXQuantized) and w.bits == bits and w.packed.dtype == mx.uint32
            s = w.scales
            assert s.scale.dtype == mx.float16 and s.scale_codes is None and (s.bias is not None) == bias
            assert bias or s.offset == 2 ** (bits - 1)
            rows, cols = w.shape
            assert sum(a.nbytes for a in s.arrays()) + w.packed.nbytes == rows * cols * (bits + 16 / 32 * (1 + bias)) / 8
        assert shard.model.lm_head is shard.model.embed_tokens  # tied: one copy of the matrix
        assert isinstance(shard.model.lm_head, MLXQuantized)


def test_rotary_is_exact_at_long_positions():
    """Angles come from float64 on the host, so keys far into a long context match the
    reference's rotation to float32 rounding (mx.fast.rope's float32 angles are ~1e-3 off at 8000)."""
    cfg = ModelConfig(n_layers=1, hidden_size=192, intermediate_size=64, n_heads=3, n_kv_heads=3, head_dim=64,
                      vocab_size=10, rope_theta=100000.0, context_length=9000)
    x = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32)  # (heads, T, head_dim)
    for start in (0, 1000, 8190):
        step = step_inputs(cfg, start, 5, start + 5)
        got = np.array(rope(mx.array(x.transpose(1, 0, 2))[None], step.cos[0], step.sin[0]))[0].transpose(1, 0, 2)
        np.testing.assert_allclose(got, reference_rope(x, np.arange(start, start + 5), cfg.rope_theta), atol=2e-6)


# ---------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_round_trips_exactly(bits):
    rng = np.random.default_rng(bits)
    rows, cols, group = 6, 128, 32
    w = QuantizedWeight(
        q=rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8),
        scales=rng.standard_normal((rows, cols // group)).astype(np.float32),
        biases=rng.standard_normal((rows, cols // group)).astype(np.float32),
        bits=bits,
    )
    m = to_mlx(w)
    assert m.packed.shape == (rows, cols * bits // 32) and m.shape == (rows, cols)
    np.testing.assert_array_equal(np.array(m.dequantize()), w.dequantize())
    # the bit order: a little-endian stream, code j of a row at bits j * bits .. (j + 1) * bits - 1
    stream = np.unpackbits(pack_codes(w.q, bits)[2].view(np.uint8), bitorder="little")
    for j in (0, 1, 7, 8, 11, cols - 1):
        assert int(stream[j * bits : (j + 1) * bits] @ (1 << np.arange(bits))) == w.q[2, j]
    np.testing.assert_array_equal(np.array(unpack_codes(m.packed, bits)), w.q)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquants_stay_packed(type_name):
    """Q4_K and Q5_K run on MLX's quantized matmul (groups of 32); Q6_K's groups of 16 keep their
    6-bit codes packed, unpacked per matmul. Each holds its super-blocks' own fields (``d`` and
    ``dmin`` a super-block, 6-bit ``sc`` and ``m`` a group; Q6_K's bias implied, -32 scale),
    found for a matrix made without them, and its values are exactly the file's."""
    rng = np.random.default_rng(1)
    rows, cols = 24, 512
    q, scales, biases = decode(random_kquant_blocks(rng, rows, cols, type_name, 0.02), type_name, cols)
    w = QuantizedWeight(q=q, scales=scales, biases=biases, bits=BITS[type_name], group=GROUP[type_name],
                        source_type=type_name)
    for n_parts in (1, 3):
        m = to_mlx(w, n_parts=n_parts)
        resident = sum(a.nbytes for a in (m.packed, *m.scales.arrays())) / (rows * cols)
        assert resident == {"Q4_K": 0.578125, "Q5_K": 0.703125, "Q6_K": 210 / 256}[type_name]
        assert isinstance(m, MLXSmallGroups if type_name == "Q6_K" else MLXQuantized)
        assert m.packed.dtype == mx.uint32 and m.scales.scale.dtype == mx.float16 and m.scales.scale_codes is not None
        np.testing.assert_array_equal(np.array(m.scales.scales()), scales)
        np.testing.assert_array_equal(np.array(m.dequantize()), w.dequantize())
        ids = np.array([3, 0, rows - 1, 3])
        np.testing.assert_array_equal(np.array(m.rows(mx.array(ids))), w.dequantize()[ids])
        x = rng.standard_normal((5, cols)).astype(np.float32)
        close(np.array(m.matmul(mx.array(x))), x @ w.dequantize().T, 1e-5)


def test_scales_no_smaller_form_gives_exactly_stay_float32(monkeypatch):
    """A matrix whose first rows are Q4_K super-blocks and whose later rows are not (a scale off
    by one float32 step) runs on float32 scales and biases, every row exact; read a row at a
    time, the first rows are staged as super-block fields, then widened."""
    import backends.mlx.quant as quant

    monkeypatch.setattr(quant, "CONVERT_CODES", 512)  # a row a chunk
    rng = np.random.default_rng(2)
    rows, cols = 6, 512
    q, scales, biases = decode(random_kquant_blocks(rng, rows, cols, "Q4_K", 0.02), "Q4_K", cols)
    scales[4, 3] = np.nextafter(scales[4, 3], np.float32(1))
    w = QuantizedWeight(q=q, scales=scales, biases=biases, bits=4, group=32, source_type="Q4_K")
    m = to_mlx(w)
    assert m.scales.scale.dtype == mx.float32 and m.scales.scale_codes is None and m.scales.bias is not None
    np.testing.assert_array_equal(np.array(m.scales.scales()), scales)
    np.testing.assert_array_equal(np.array(m.scales.biases()), biases)
    np.testing.assert_array_equal(np.array(m.dequantize()), w.dequantize())


def test_a_group_mlx_does_not_run_is_refused():
    w = QuantizedWeight(q=np.zeros((4, 96), np.uint8), scales=np.ones((4, 4), np.float32),
                        biases=np.zeros((4, 4), np.float32), bits=4, group=24)
    with pytest.raises(BackendError, match="groups of .16, 32, 64, 128. along rows"):
        to_mlx(w, "blk.0.attn_q")


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_round_trip_exactly(tiny_models, weight_type):
    weights = GGUFModel(tiny_models[weight_type]).shard_weights(0, 1)
    for w in (weights.layers[0].wq, weights.layers[0].w_down, weights.embed):
        assert isinstance(w, QuantizedWeight) and w.source_type == weight_type
        m = to_mlx(w)
        np.testing.assert_array_equal(np.array(m.dequantize()), w.dequantize())
        ids = np.array([3, 0, w.shape[0] - 1, 3])
        np.testing.assert_array_equal(np.array(m.rows(mx.array(ids))), w.dequantize()[ids])


def test_split_matmul_parts_share_the_weight(tiny_models):
    """With several threads each matmul runs in row blocks that are views of one weight."""
    w = GGUFModel(tiny_models["Q4_1"]).shard_weights(0, 1).layers[0].w_gate
    m = to_mlx(w, n_parts=3)
    assert len(m.parts) == 3 and sum(p[0].shape[0] for p in m.parts) == w.shape[0]
    x = np.random.default_rng(0).standard_normal((5, w.shape[1])).astype(np.float32)
    close(np.array(m.matmul(mx.array(x))), x @ w.dequantize().T, 1e-6)


# ---------------------------------------------------------------------------- splits


def test_long_prompts_run_in_chunks(tiny_models):
    path = tiny_models["Q4_1"]
    cfg, weights, shard = load(path)
    _, _, head = load(path, 0, 2)
    _, _, tail = load(path, 2)
    shard.prefill_chunk = head.prefill_chunk = tail.prefill_chunk = 4
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))  # 9 tokens: chunks of 4, 4, 1
    want = ref.forward("r", PROMPT, pos, all_logits=True)
    close(shard.forward("all", PROMPT, pos, all_logits=True), want)
    close(shard.forward("last", PROMPT, pos), want[-1:])
    hidden = head.forward("r", PROMPT, pos)
    assert hidden.shape == (len(PROMPT), cfg.hidden_size)
    close(tail.forward("r", hidden, pos, all_logits=True), want)
    assert shard.kv_length("last") == len(PROMPT)
    for tok, p in decode_tokens(2, len(PROMPT)):
        close(shard.forward("last", tok, p), ref.forward("r", tok, p))


def test_chunked_prefill_equals_one_prefill(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    whole = ref.forward("a", PROMPT, np.arange(len(PROMPT)), all_logits=True)
    first = shard.forward("b", PROMPT[:4], np.arange(4), all_logits=True)
    one = shard.forward("b", PROMPT[4:5], np.array([4]), all_logits=True)
    rest = shard.forward("b", PROMPT[5:], np.arange(5, len(PROMPT)), all_logits=True)
    close(np.concatenate([first, one, rest]), whole)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_split_equals_whole(tiny_models, k):
    path = tiny_models["Q4_1"]
    cfg, _, whole = load(path)
    _, _, head = load(path, 0, k)
    _, tail_w, tail = load(path, k)
    assert head.is_first and not head.is_last and tail.is_last and not tail.is_first
    pos = np.arange(len(PROMPT))
    hidden = head.forward("r", PROMPT, pos)
    assert hidden.shape == (len(PROMPT), cfg.hidden_size) and hidden.dtype == np.float32
    close(tail.forward("r", hidden, pos, all_logits=True), whole.forward("r", PROMPT, pos, all_logits=True), 1e-5)
    for tok, p in decode_tokens(4, len(PROMPT)):
        close(tail.forward("r", head.forward("r", tok, p), p), whole.forward("r", tok, p), 1e-5)
    # mixed: MLX layers [0, k) then the NumPy reference for [k, L)
    ref_tail = ReferenceShard(cfg, tail_w)
    ref_whole = ReferenceShard(cfg, GGUFModel(path).shard_weights(0, cfg.n_layers))
    close(ref_tail.forward("m", head.forward("m", PROMPT, pos), pos), ref_whole.forward("m", PROMPT, pos))


def test_three_way_split_of_the_untied_model(tiny_models):
    path = tiny_models["F32-untied"]
    cfg, _, whole = load(path)
    parts = [load(path, a, b)[2] for a, b in ((0, 1), (1, 3), (3, 4))]
    assert not parts[1].is_first and not parts[1].is_last
    pos = np.arange(len(PROMPT))
    want = whole.forward("r", PROMPT, pos)
    h = PROMPT
    for part in parts:
        h = part.forward("r", h, pos)
    close(h, want, 1e-5)
    for tok, p in decode_tokens(3, len(PROMPT)):
        h = tok
        for part in parts:
            h = part.forward("r", h, p)
        close(h, whole.forward("r", tok, p), 1e-5)


def test_kv_buffers_grow_past_capacity(tiny_models, monkeypatch):
    monkeypatch.setattr(mlx_shard, "CACHE_STEP", 4)  # grow (and retrace decode) every 4 positions
    cfg, weights, shard = load(tiny_models["Q4_0"])
    ref = ReferenceShard(cfg, weights)
    close(shard.forward("r", PROMPT[:3], np.arange(3)), ref.forward("r", PROMPT[:3], np.arange(3)))
    for tok, p in decode_tokens(7, 3):  # 3 -> 10 positions: buffers of 4, 8, 12
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))
    close(shard.forward("r", PROMPT, np.arange(10, 19)), ref.forward("r", PROMPT, np.arange(10, 19)))
    assert shard._caches["r"].capacity == 20 and shard.kv_length("r") == 19


def test_context_full(tmp_path):
    path = write_tiny_llama(tmp_path / "short.gguf", weight_type="Q4_1", context_length=12, seed=5)
    cfg, weights, shard = load(path)
    ref = ReferenceShard(cfg, weights)
    close(shard.forward("r", PROMPT, np.arange(9)), ref.forward("r", PROMPT, np.arange(9)))
    for tok, p in decode_tokens(3, 9):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))
    assert shard._caches["r"].capacity == 12  # never more than the model's context
    with pytest.raises(BackendError, match="context full"):
        shard.forward("r", np.array([1]), np.array([12]))


@pytest.mark.parametrize("compile_decode", [True, False])
def test_batched_decode_equals_one_by_one(tiny_models, monkeypatch, compile_decode):
    monkeypatch.setattr(mlx_shard, "CACHE_STEP", 8)  # requests with buffers of different sizes
    path = tiny_models["Q4_1"]
    cfg, weights, single = load(path)
    head, tail = load(path, 0, 2, compile_decode=compile_decode)[2], load(path, 2, compile_decode=compile_decode)[2]
    ref = ReferenceShard(cfg, weights)
    lengths = {"a": 3, "b": 9, "c": 12}
    for rid, n in lengths.items():
        for shard in (single, ref):
            shard.forward(rid, PROMPT[:n] if n <= len(PROMPT) else np.arange(n) % 250, np.arange(n))
        tail.forward(rid, head.forward(rid, np.arange(n) % 250 if n > len(PROMPT) else PROMPT[:n], np.arange(n)),
                     np.arange(n))
    for step in range(3):
        items = [(rid, np.array([(7 * step + len(rid) + n) % 250]), np.array([n + step])) for rid, n in lengths.items()]
        items.append(("new", np.array([40 + step]), np.array([step])))  # a request that starts with a decode step
        got = single.forward_batch(items)
        hidden = head.forward_batch(items)
        assert [h.shape for h in hidden] == [(1, cfg.hidden_size)] * len(items)
        split = tail.forward_batch([(rid, h, p) for (rid, _, p), h in zip(items, hidden, strict=True)])
        for (rid, tok, pos), g, s in zip(items, got, split, strict=True):
            want = ref.forward(rid, tok, pos)
            assert g.shape == (1, cfg.vocab_size)
            close(g, want)
            close(s, want)
    assert single.kv_length("b") == 12 and single.kv_length("new") == 3
    # a prefill in the batch: each item runs on its own
    outs = single.forward_batch([("p", PROMPT, np.arange(len(PROMPT))), ("a", np.array([1]), np.array([6]))])
    close(outs[0], ref.forward("p", PROMPT, np.arange(len(PROMPT))))
    close(outs[1], ref.forward("a", np.array([1]), np.array([6])))
    # one bad item fails the batch before any cache changes
    with pytest.raises(BackendError, match="positions start at 0"):
        single.forward_batch([("a", np.array([1]), np.array([7])), ("b", np.array([1]), np.array([0]))])
    assert single.kv_length("a") == 7 and single.kv_length("b") == 12


# ---------------------------------------------------------------------------- KV caches


def test_export_import_moves_a_request(tiny_models):
    path = tiny_models["Q8_0"]
    cfg, weights, a = load(path)
    _, _, b = load(path)
    pos = np.arange(len(PROMPT))
    a.forward("r", PROMPT, pos)
    steps = decode_tokens(5, len(PROMPT))
    for tok, p in steps[:2]:
        a.forward("r", tok, p)
    cache = a.export_kv("r")
    assert (cache.start, cache.end, cache.length) == (0, cfg.n_layers, len(PROMPT) + 2)
    assert all(k.shape == (cfg.n_kv_heads, cache.length, cfg.head_dim) and k.dtype == np.float32 for k in cache.keys)
    assert all(v.shape == (cfg.n_kv_heads, cache.length, cfg.head_dim) and v.dtype == np.float32 for v in cache.values)
    b.import_kv("moved", cache)
    assert b.kv_length("moved") == cache.length and b.requests() == ["moved"]
    for tok, p in steps[2:]:
        np.testing.assert_array_equal(b.forward("moved", tok, p), a.forward("r", tok, p))


def test_kv_layout_is_the_reference_layout(tiny_models):
    """Exported keys are rotated, (n_kv_heads, length, head_dim): a cache written by another
    backend (here the NumPy reference) continues on MLX."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    shard.forward("r", PROMPT, pos)
    ref.forward("r", PROMPT, pos)
    exported = shard.export_kv("r")
    for (rk, rv), k, v in zip(ref.cache["r"], exported.keys, exported.values, strict=True):
        close(k, rk)
        close(v, rv)
    foreign = KVCache(0, cfg.n_layers, len(PROMPT), [k for k, _ in ref.cache["r"]], [v for _, v in ref.cache["r"]])
    _, _, fresh = load(tiny_models["Q4_1"])
    fresh.import_kv("r", foreign)
    for tok, p in decode_tokens(3, len(PROMPT)):
        close(fresh.forward("r", tok, p), ref.forward("r", tok, p))


def test_kv_moves_between_onnx_and_mlx(tiny_models):
    onnx = ONNXBackend(precision="float32") if "onnx" in _available() else None  # the reference's math
    if onnx is None:
        pytest.skip("the ONNX backend is not available here")
    path = tiny_models["Q4_1"]
    model = GGUFModel(path)
    cfg = model.config
    weights = model.shard_weights(0, cfg.n_layers)
    o = onnx.load_shard(cfg, weights)
    _, _, m = load(path)
    pos = np.arange(len(PROMPT))
    o.forward("r", PROMPT, pos)
    m.forward("r", PROMPT, pos)
    m.import_kv("from-onnx", o.export_kv("r"))
    o.import_kv("from-mlx", m.export_kv("r"))
    for tok, p in decode_tokens(4, len(PROMPT)):
        want = o.forward("r", tok, p)
        close(m.forward("from-onnx", tok, p), want)
        close(o.forward("from-mlx", tok, p), want)


def _available() -> list[str]:
    from backends import available_backends

    return available_backends()


def test_import_takes_the_shards_layers_from_a_wider_cache(tiny_models):
    path = tiny_models["F16"]
    cfg, _, whole = load(path)
    _, _, tail = load(path, 2)
    pos = np.arange(len(PROMPT))
    whole.forward("r", PROMPT, pos)
    tail.import_kv("r", whole.export_kv("r"))
    exported = tail.export_kv("r")
    assert exported.start == 2 and len(exported.keys) == cfg.n_layers - 2
    np.testing.assert_array_equal(exported.keys[0], whole.export_kv("r").keys[2])
    head_cache = whole.export_kv("r").slice_layers(0, 2)
    with pytest.raises(BackendError, match="does not cover"):
        tail.import_kv("x", head_cache)


def test_drop_and_truncate(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_0"])
    pos = np.arange(len(PROMPT))
    full = shard.forward("r", PROMPT, pos, all_logits=True)
    shard.forward("other", PROMPT[:3], np.arange(3))
    assert sorted(shard.requests()) == ["other", "r"]
    shard.truncate_kv("r", 4)
    assert shard.kv_length("r") == 4 and shard.export_kv("r").length == 4
    again = shard.forward("r", PROMPT[4:], pos[4:], all_logits=True)
    close(again, full[4:], 1e-6)
    shard.truncate_kv("r", 5)  # then decode over the stale tail: it is masked, then overwritten
    for i in range(5, len(PROMPT)):
        close(shard.forward("r", PROMPT[i : i + 1], np.array([i])), full[i : i + 1], 1e-6)
    shard.drop("r")
    shard.drop("never-seen")
    assert shard.requests() == ["other"] and shard.kv_length("r") == 0
    assert shard.export_kv("r").length == 0 and len(shard.export_kv("r").keys) == cfg.n_layers
    close(shard.forward("r", PROMPT, pos, all_logits=True), full, 1e-6)
    shard.close()
    with pytest.raises(BackendError, match="closed"):
        shard.forward("r", PROMPT[:1], np.array([0]))


# ---------------------------------------------------------------------------- errors and options


def test_bad_input_raises_clear_errors(tiny_models):
    path = tiny_models["Q4_1"]
    cfg, _, first = load(path, 0, 2)
    _, _, last = load(path, 2)
    with pytest.raises(BackendError, match="integer token ids"):
        first.forward("r", np.zeros(3, np.float32), np.arange(3))
    with pytest.raises(BackendError, match="token id out of range"):
        first.forward("r", np.array([cfg.vocab_size]), np.array([0]))
    with pytest.raises(BackendError, match="expects hidden"):
        last.forward("r", np.zeros((2, cfg.hidden_size + 1), np.float32), np.arange(2))
    with pytest.raises(BackendError, match="non-empty"):
        first.forward("r", np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    with pytest.raises(BackendError, match="positions start at 3"):
        first.forward("r", np.array([1]), np.array([3]))
    with pytest.raises(BackendError, match="consecutive"):
        first.forward("r", np.array([1, 2]), np.array([0, 2]))
    assert first.kv_length("r") == 0 and first.requests() == []  # nothing was kept by the failed calls
    first.forward("r", np.array([1, 2]), np.arange(2))
    bad = KVCache(0, 2, 2, [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim + 1), np.float32)] * 2,
                  [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim), np.float32)] * 2)
    with pytest.raises(BackendError, match="expected"):
        first.import_kv("r", bad)
    short = KVCache(0, 2, 2, [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim), np.float32)],
                    [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim), np.float32)])
    with pytest.raises(BackendError, match="must hold 2"):
        first.import_kv("r", short)
    assert first.kv_length("r") == 2  # a rejected import leaves the cache alone
    with pytest.raises(BackendError, match="truncate"):
        first.truncate_kv("r", -1)


def test_bad_weights_and_options(tiny_models, monkeypatch):
    model = GGUFModel(tiny_models["Q4_0"])
    cfg = model.config
    weights = model.shard_weights(0, 2)
    weights.embed = None
    with pytest.raises(BackendError, match="token embedding"):
        MLXBackend().load_shard(cfg, weights)
    weights = model.shard_weights(2, 4)
    weights.output = None
    with pytest.raises(BackendError, match="output head"):
        MLXBackend().load_shard(cfg, weights)
    weights = model.shard_weights(0, 2)
    w = weights.layers[0].wq
    weights.layers[0].wq = QuantizedWeight(w.q, w.scales, w.biases, bits=3, group=32)
    with pytest.raises(BackendError, match="3-bit"):
        MLXBackend().load_shard(cfg, weights)
    with pytest.raises(BackendError, match="threads"):
        MLXBackend(threads=0)
    assert MLXBackend(threads=3).threads == 3
    backend = get_backend("mlx")
    assert backend.name == "mlx" and backend.available() and backend.threads >= 1


def test_runs_from_another_thread(tiny_models):
    """The node agent calls shards from worker threads: MLX state made on one thread works on another."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)

    def work() -> tuple[np.ndarray, np.ndarray]:
        return (shard.forward("r", PROMPT, np.arange(len(PROMPT))),
                shard.forward("r", np.array([3]), np.array([len(PROMPT)])))

    prefill, decode = on_another_thread(work)
    close(prefill, ref.forward("r", PROMPT, np.arange(len(PROMPT))))
    close(decode, ref.forward("r", np.array([3]), np.array([len(PROMPT)])))


# ---------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_default_model_matches_reference(default_model_path):
    model = GGUFModel(default_model_path)
    cfg = model.config
    weights = model.shard_weights(0, cfg.n_layers)
    assert weights.embed.source_type == "Q8_0" and weights.layers[0].wq.source_type == "Q4_1"
    shard = MLXBackend().load_shard(cfg, weights)
    ref = ReferenceShard(cfg, weights)
    prompt = np.array([1, 9690, 314, 253, 5356, 30, 2, 198])  # any ids; the check is numerical
    pos = np.arange(len(prompt))
    got, want = shard.forward("r", prompt, pos), ref.forward("r", prompt, pos)
    close(got, want)
    token = int(got.argmax())
    assert token == int(want.argmax())
    for i in range(10):
        p = np.array([len(prompt) + i])
        got, want = shard.forward("r", np.array([token]), p), ref.forward("r", np.array([token]), p)
        close(got, want)
        assert int(got.argmax()) == int(want.argmax()), f"greedy token differs at step {i}"
        token = int(got.argmax())
    # and split in two shards of the real model
    head = MLXBackend().load_shard(cfg, model.shard_weights(0, 13))
    tail = MLXBackend().load_shard(cfg, model.shard_weights(13, cfg.n_layers))
    close(tail.forward("s", head.forward("s", prompt, pos), pos), shard.forward("s", prompt, pos), 1e-5)
