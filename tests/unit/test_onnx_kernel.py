"""exo-tui's ONNX Runtime kernel QLinear4 (backends/onnx/kernels): built here, checked against
NumPy, the same numbers for a row whatever the batch, and a clear fallback where it cannot be built."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from backends.base import BackendError, QuantizedWeight
from backends.onnx import kernels
from tests.reference import ReferenceShard
from tests.unit.test_onnx_backend import PROMPT, close, load


def _matrix(rng: np.random.Generator, n: int, k: int) -> QuantizedWeight:
    """Q4_1-like: float16 scales and minimums."""
    return QuantizedWeight(
        q=rng.integers(0, 16, (n, k), dtype=np.uint8),
        scales=(rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32),
        biases=(-rng.random((n, k // 32)) * 0.15).astype(np.float16).astype(np.float32),
        bits=4,
    )


@pytest.fixture(scope="module")
def library() -> kernels.Library:
    lib = kernels.library()
    if lib is None:
        pytest.skip("no C compiler here to build the kernel (the fallback is tested below)")
    return lib


def test_the_kernel_is_float32_math_on_the_dequantized_matrix(library: kernels.Library) -> None:
    rng = np.random.default_rng(1)
    a, b = _matrix(rng, 40, 576), _matrix(rng, 3032, 576)  # two stacked, N not a multiple of 32
    blob = kernels.pack([a, b])
    assert blob.shape == (3072, 18, 20) and blob.dtype == np.uint8
    w = np.concatenate([a.dequantize(), b.dequantize()]).astype(np.float64)
    for m in (1, 2, 7, 8, 9, 33):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        y = kernels._run_in_session(kernels.Path(library.path), x, blob, 576, 3072)
        want = x.astype(np.float64) @ w.T
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), m


def test_a_rows_numbers_do_not_depend_on_its_batch(library: kernels.Library) -> None:
    """Each row is reduced in the same order whatever the number of rows: a request's logits are
    the same bits decoded alone or beside others."""
    rng = np.random.default_rng(2)
    w = _matrix(rng, 300, 1536)
    blob = kernels.pack([w])
    x = rng.standard_normal((13, 1536)).astype(np.float32)
    together = kernels._run_in_session(kernels.Path(library.path), x, blob, 1536, 300)
    for i in (0, 7, 12):
        alone = kernels._run_in_session(kernels.Path(library.path), x[i : i + 1], blob, 1536, 300)
        assert np.array_equal(alone[0], together[i])


def test_only_blocks_of_32_with_half_precision_scales_take_the_kernel() -> None:
    rng = np.random.default_rng(3)
    w = _matrix(rng, 8, 64)
    assert kernels.runs_on_kernel(w)
    assert not kernels.runs_on_kernel(QuantizedWeight(w.q, w.scales * np.float32(1.0001), w.biases, bits=4))
    assert not kernels.runs_on_kernel(QuantizedWeight(w.q, w.scales, w.biases, bits=8))
    assert not kernels.runs_on_kernel(np.zeros((8, 64), np.float32))


def test_without_a_compiler_the_backend_says_so_and_uses_matmulnbits(
    tiny_models, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("EXO_TUI_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.library() is None
        assert "runs 4-bit matrices with MatMulNBits" in caplog.text and "no-such-cc" in caplog.text
        cfg, weights, shard = load(tiny_models["Q4_1"])
        assert shard.kernel == ""
        ref = ReferenceShard(cfg, weights)
        pos = np.arange(len(PROMPT))
        close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    finally:
        kernels._library.cache_clear()


def test_the_kernel_can_be_turned_off_and_a_bad_setting_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_ONNX_KERNEL", "0")
    assert kernels.library() is None
    monkeypatch.setenv("EXO_TUI_ONNX_KERNEL", "maybe")
    with pytest.raises(BackendError, match="EXO_TUI_ONNX_KERNEL='maybe': use 1"):
        kernels.library()
