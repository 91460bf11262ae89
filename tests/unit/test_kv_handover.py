"""A finished request's caches taken over by the next turn of its conversation (``rename_kv``):
the same numbers as if the request had run the whole conversation itself, with no copy."""

from __future__ import annotations

import numpy as np
import pytest

from backends import available_backends
from backends.base import BackendError
from exo_tui.models.gguf_file import GGUFModel

PROMPT = np.array([5, 17, 30, 100, 7, 9, 11, 260, 42])


def _shard(path, backend: str):  # noqa: ANN001, ANN202
    from backends import get_backend

    model = GGUFModel(path)
    cfg = model.config
    return get_backend(backend).load_shard(cfg, model.shard_weights(0, cfg.n_layers))


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_a_renamed_cache_goes_on_as_the_old_one_would(tiny_models, backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"{backend} is not available here")
    shard = _shard(tiny_models["Q4_1"], backend)
    n = len(PROMPT)
    for rid in ("turn-1", "same"):
        shard.forward(rid, PROMPT, np.arange(n))
        shard.forward(rid, np.array([12]), np.array([n]))
    shard.rename_kv("turn-1", "turn-2")
    assert shard.kv_length("turn-2") == n + 1 and shard.kv_length("turn-1") == 0
    assert "turn-1" not in shard.requests()
    # the next turn begins with the last turn's tokens: it goes on from them, as "same" does
    nxt = np.array([40, 41, 42])
    got = shard.forward("turn-2", nxt, np.arange(n + 1, n + 4))
    want = shard.forward("same", nxt, np.arange(n + 1, n + 4))
    assert np.array_equal(got, want)
    # and batched beside another request (ONNX: the slot's owner is the new request now)
    a, b = shard.forward_batch([("turn-2", np.array([9]), np.array([n + 4])), ("same", np.array([9]), np.array([n + 4]))])
    assert np.array_equal(a, b)
    with pytest.raises(BackendError, match="has no cache here"):
        shard.rename_kv("turn-1", "turn-3")
    with pytest.raises(BackendError, match="already has a cache"):
        shard.rename_kv("same", "turn-2")
    assert shard.kv_length("same") == n + 5  # a refused hand-over changes nothing


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
    assert err <= 0.01 * scale, f"{what}: max abs difference {err:.3g} against {scale:.3g}"


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_a_cache_handed_over_lands_on_its_own_layers(tiny_models, backend: str) -> None:
    """KV of layers [1, n) imported by a shard of layers [2, n) (a node taking over part of
    another's range): each layer's keys and values land on that layer, not on the one at the same
    index of the other range, and the next step's logits are the whole model's."""
    if backend not in available_backends():
        pytest.skip(f"{backend} is not available here")
    from backends import get_backend

    model = GGUFModel(tiny_models["Q4_1"])
    cfg, n = model.config, model.config.n_layers
    shards = {(a, b): get_backend(backend).load_shard(cfg, model.shard_weights(a, b))
              for a, b in ((0, n), (0, 1), (1, n), (0, 2), (2, n))}
    whole, first, middle, head, tail = shards.values()
    pos = np.arange(len(PROMPT))
    whole.forward("r", PROMPT, pos)
    middle.forward("r", first.forward("r", PROMPT, pos), pos)
    head.forward("r", PROMPT, pos)
    tail.import_kv("r", middle.export_kv("r"))
    got, want = tail.export_kv("r"), whole.export_kv("r")
    assert (got.start, got.end, got.length) == (2, n, len(PROMPT))
    for i in range(n - 2):  # the same numbers up to the caches' storage (float16 on some paths)
        _close(got.keys[i], want.keys[i + 2], f"layer {i + 2}'s keys")
        _close(got.values[i], want.values[i + 2], f"layer {i + 2}'s values")
    token, at = np.array([12]), np.array([len(PROMPT)])
    expected = whole.forward("r", token, at)
    _close(tail.forward("r", head.forward("r", token, at), at), expected, "the next step's logits")
    for shard in shards.values():
        shard.close()
