"""Every family's features on every backend against the NumPy reference: whole, split at two
points, and handing its KV cache to the reference mid-request (a mixed ring's hand-over)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends import available_backends, get_backend
from backends.base import BackendError
from tests.family_models import FEATURES, random_weights, sub_shard
from tests.reference import ReferenceShard

TOKENS = np.array([3, 17, 30, 91, 7, 9, 11, 60, 42, 5, 8, 13, 21, 34, 55, 89, 1, 2, 4, 16, 32, 64, 80, 95])
BACKENDS = [b for b in ("onnx", "mlx") if b in available_backends()]


def backend(name: str):
    """The backend at float32 (held to the reference's float32; ONNX's integer precisions are
    tested on their own)."""
    if name == "onnx":
        from backends.onnx import ONNXBackend

        return ONNXBackend(threads=2, precision="float32")
    return get_backend(name)


def run_all(shards, tokens: np.ndarray, rid: str = "r") -> np.ndarray:
    """All positions' logits of a prompt through ``shards`` in order, then three decode steps."""
    pos = np.arange(len(tokens))
    x = tokens
    for s in shards:
        x = s.forward(rid, x, pos, all_logits=True) if s is shards[-1] else s.forward(rid, x, pos)
    logits = [x]
    for i, tok in enumerate((5, 6, 7)):
        y = np.array([tok])
        p = np.array([len(tokens) + i])
        for s in shards:
            y = s.forward(rid, y, p)
        logits.append(y)
    return np.concatenate(logits)


def close(got: np.ndarray, want: np.ndarray, tol: float = 2e-4) -> None:
    err = float(np.abs(got - want).max())
    assert err <= tol * max(1.0, float(np.abs(want).max())), f"max abs difference {err:.3g}"


@pytest.fixture(scope="module")
def references() -> dict[str, np.ndarray]:
    out = {}
    for name, cfg in FEATURES.items():
        w = random_weights(cfg)
        out[name] = run_all([ReferenceShard(cfg, w)], TOKENS)
    return out


def test_features_change_the_answer(references):
    """Each feature set's reference differs from plain llama's on the same seed where its weights
    have the same shapes: a backend that ignored the feature would fail below."""
    plain = references["llama"]
    for name, logits in references.items():
        if name != "llama" and logits.shape == plain.shape:
            assert np.abs(logits - plain).max() > 0.05, name


@pytest.mark.parametrize("family", list(FEATURES))
@pytest.mark.parametrize("name", BACKENDS)
def test_whole_and_split_equal_the_reference(name, family, references):
    cfg = FEATURES[family]
    w = random_weights(cfg)
    b = backend(name)
    close(run_all([b.load_shard(cfg, w)], TOKENS), references[family])
    for k in (1, 3):
        shards = [b.load_shard(cfg, sub_shard(w, 0, k)), b.load_shard(cfg, sub_shard(w, k, cfg.n_layers))]
        close(run_all(shards, TOKENS), references[family])


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "phi3-longrope"])
@pytest.mark.parametrize("name", BACKENDS)
def test_kv_cache_moves_to_the_reference_and_back(name, family, references):
    """The prompt on the backend, its cache exported to the NumPy reference (another backend),
    decode there: the same logits as the reference alone."""
    cfg = FEATURES[family]
    w = random_weights(cfg)
    shard = backend(name).load_shard(cfg, w)
    pos = np.arange(len(TOKENS))
    shard.forward("r", TOKENS, pos)
    cache = shard.export_kv("r")
    ref = ReferenceShard(cfg, w)
    ref.cache["r"] = [(k, v) for k, v in zip(cache.keys, cache.values, strict=True)]
    got = ref.forward("r", np.array([5]), np.array([len(TOKENS)]))
    close(got, references[family][len(TOKENS) : len(TOKENS) + 1])
    back = backend(name).load_shard(cfg, w)
    back.import_kv("r", cache)
    close(back.forward("r", np.array([5]), np.array([len(TOKENS)])), got)


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
@pytest.mark.parametrize("order", [("onnx", "mlx"), ("mlx", "onnx")])
def test_a_ring_of_two_backends_equals_the_reference(order, family, references):
    """Layers [0, 2) on one backend, [2, 4) on the other (gemma3: windowed layers, then a global
    and a windowed one): the hidden state crosses, each keeps its own cache."""
    if not set(order) <= set(BACKENDS):
        pytest.skip("needs both ONNX Runtime and MLX")
    cfg = FEATURES[family]
    w = random_weights(cfg)
    shards = [backend(order[0]).load_shard(cfg, sub_shard(w, 0, 2)),
              backend(order[1]).load_shard(cfg, sub_shard(w, 2, cfg.n_layers))]
    close(run_all(shards, TOKENS), references[family])


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
@pytest.mark.parametrize("name", BACKENDS)
def test_batched_decode_equals_the_reference(name, family):
    """Decode steps of requests at different lengths (so their windows differ) in one batch."""
    cfg = FEATURES[family]
    w = random_weights(cfg)
    shard, ref = backend(name).load_shard(cfg, w), ReferenceShard(cfg, w)
    lengths = {"a": 3, "b": 11, "c": 24}
    for rid, n in lengths.items():
        for s in (shard, ref):
            s.forward(rid, TOKENS[:n], np.arange(n))
    for step in range(3):
        items = [(rid, np.array([(7 * step + n) % 96]), np.array([n + step])) for rid, n in lengths.items()]
        for (rid, tok, pos), got in zip(items, shard.forward_batch(items), strict=True):
            close(got, ref.forward(rid, tok, pos))


@pytest.mark.parametrize("name", BACKENDS)
def test_quantized_matrices_with_every_feature(name):
    cfg = FEATURES["gemma3"]
    w = random_weights(cfg, quantized=True)
    want = run_all([ReferenceShard(cfg, w)], TOKENS)
    close(run_all([backend(name).load_shard(cfg, w)], TOKENS), want)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.parametrize("name", BACKENDS)
def test_layers_whose_matrices_differ_in_format(name, family):
    """q quantized while k and v are dense (q, k, v not fused into one matmul): biases and norms
    still land on the right heads."""
    cfg = FEATURES[family]
    w = random_weights(cfg)
    quantized = random_weights(cfg, quantized=True)
    for lw, ql in zip(w.layers, quantized.layers, strict=True):
        lw.wq, lw.w_gate = ql.wq, ql.w_gate
    want = run_all([ReferenceShard(cfg, w)], TOKENS)
    close(run_all([backend(name).load_shard(cfg, w)], TOKENS), want)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_missing_or_unwanted_part_is_refused(name):
    cfg = FEATURES["qwen2"]
    w = random_weights(cfg)
    w.layers[1].bk = None
    with pytest.raises(BackendError, match="layer 1 lacks bk"):
        backend(name).load_shard(cfg, w)
    plain = random_weights(FEATURES["llama"])
    plain.layers[0].q_norm = np.ones(16, np.float32)
    with pytest.raises(BackendError, match="layer 0 has q_norm"):
        backend(name).load_shard(FEATURES["llama"], plain)
    relu = dataclasses.replace(FEATURES["llama"], activation="relu")
    with pytest.raises(BackendError, match="activation 'relu'"):
        backend(name).load_shard(relu, random_weights(FEATURES["llama"]))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "phi3-longrope", "yarn-rope"])
def test_onnx_runtime_own_ops_run_every_feature(family, references, monkeypatch):
    """Where exo-tui's kernels do not build, ONNX Runtime's GroupQueryAttention and MatMulNBits
    carry the same features (its window, scale and tables)."""
    if "onnx" not in BACKENDS:
        pytest.skip("ONNX Runtime is not installed")
    from backends.onnx import kernels

    monkeypatch.setattr(kernels, "_enabled", False)
    cfg = FEATURES[family]
    close(run_all([backend("onnx").load_shard(cfg, random_weights(cfg))], TOKENS), references[family])
