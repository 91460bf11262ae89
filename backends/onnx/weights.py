"""Weights in the forms ONNX Runtime's own CPU kernels run fast and exactly (for matrices that
exo-tui's ``QLinear`` kernel does not take, or where it cannot be built: :mod:`backends.onnx.kernels`).

A :class:`~backends.base.QuantizedWeight` is ``w = s * q + b`` per block of ``group`` codes.
``com.microsoft`` ``MatMulNBits`` computes ``(q - zp) * s`` with 4-bit codes packed two per byte
(low nibble first) and a default zero point of 8. So:

* 4-bit: ``w = s * (q - 8) + c`` with ``c = b + 8 s``. Q4_0 has ``c == 0``; for Q4_1 the ``c`` term
  is a small float matmul of the input's per-block sums (``correction``), exact.
* 8-bit (and the 5- and 6-bit codes of Q5_K and Q6_K): ``MatMulNBits`` with ``bits=8`` and float compute is very slow on CPU, so the code is split
  into nibbles ``q = 16 hi + lo`` and ``w = 16 s (hi - 8) + s (lo - 0) + c`` with ``c = b + 128 s``:
  two 4-bit ``MatMulNBits`` (the second with zero point 0) whose results add. Q8_0 has ``c == 0``.
* Anything else (F32, F16, other bit widths or groups) becomes a dense float32 matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.base import QuantizedWeight, Weight


def pack_nibbles(q: np.ndarray, group: int) -> np.ndarray:
    """``(rows, cols)`` 4-bit codes as ``MatMulNBits``' B: ``(rows, cols // group, group // 2)``."""
    rows, cols = q.shape
    q = q.reshape(rows, cols // group, group)
    return np.ascontiguousarray((q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)).astype(np.uint8)


def packed_zero_points(rows: int, blocks: int, value: int) -> np.ndarray:
    """Uint8 4-bit zero points ``(rows, ceil(blocks / 2))``, all ``value``."""
    byte = (value & 0x0F) | ((value & 0x0F) << 4)
    return np.full((rows, (blocks + 1) // 2), byte, dtype=np.uint8)


@dataclass
class NibblePart:
    """One ``MatMulNBits`` (4-bit) input set: ``y = x @ ((q - zero_point) * scales).T``."""

    packed: np.ndarray  # uint8 (N, K // group, group // 2)
    scales: np.ndarray  # float32 (N, K // group)
    zero_point: int  # 8 is MatMulNBits' default (no zero-point input)


@dataclass
class QuantizedLinear:
    """``y = sum(part(x)) + blocksum(x) @ correction.T`` for a quantized ``(N, K)`` matrix."""

    n: int
    k: int
    group: int
    parts: list[NibblePart]
    correction: np.ndarray | None  # float32 (N, K // group), None when all zero


def runs_quantized(w: Weight) -> bool:
    """Whether ``w`` stays quantized (``MatMulNBits``) rather than becoming a dense matrix."""
    if not isinstance(w, QuantizedWeight) or w.bits not in (4, 5, 6, 8):
        return False
    g = w.group
    return g >= 16 and g & (g - 1) == 0 and w.q.shape[1] % g == 0


def quantized_linear(weights: list[QuantizedWeight]) -> QuantizedLinear:
    """Stack matrices of one kind (same bits and group) along the output rows."""
    bits, group = weights[0].bits, weights[0].group
    q = np.concatenate([w.q for w in weights], axis=0) if len(weights) > 1 else weights[0].q
    s = np.concatenate([w.scales for w in weights], axis=0).astype(np.float32)
    b = np.concatenate([w.biases for w in weights], axis=0).astype(np.float32)
    n, k = q.shape
    if bits == 4:
        parts = [NibblePart(pack_nibbles(q, group), s, 8)]
        c = b + np.float32(8.0) * s
    else:
        parts = [
            NibblePart(pack_nibbles(q >> 4, group), np.float32(16.0) * s, 8),
            NibblePart(pack_nibbles(q & 0x0F, group), s, 0),
        ]
        c = b + np.float32(128.0) * s
    correction = np.ascontiguousarray(c, dtype=np.float32) if np.any(c != 0) else None
    return QuantizedLinear(n, k, group, parts, correction)


DENSE_ROWS_PER_PIECE = 4096  # dequantized at a time by dense_linear


def dense_linear(weights: list[Weight]) -> np.ndarray:
    """Stacked float32 matrices, transposed for ``MatMul``: ``(K, N)``.

    Written piece by piece into the result: the whole float32 matrix exists once, not as a
    dequantized copy, a stacked copy and a transposed copy (for SmolLM2's head, 340 MB of
    temporaries at load, against 113 MB for the result)."""
    cols = weights[0].shape[1]
    out = np.empty((cols, sum(w.shape[0] for w in weights)), dtype=np.float32)
    n0 = 0
    for w in weights:
        rows = w.shape[0]
        for a in range(0, rows, DENSE_ROWS_PER_PIECE):
            b = min(rows, a + DENSE_ROWS_PER_PIECE)
            piece = w.dequantize(a, b) if isinstance(w, QuantizedWeight) else np.asarray(w[a:b], dtype=np.float32)
            out[:, n0 + a : n0 + b] = piece.T
        n0 += rows
    return out


def same_kind(a: Weight, b: Weight) -> bool:
    """Whether two matrices can share one fused matmul."""
    qa, qb = runs_quantized(a), runs_quantized(b)
    if qa != qb:
        return False
    if not qa:
        return True
    assert isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
    return a.bits == b.bits and a.group == b.group and a.q.shape[1] == b.q.shape[1]


def embedding_rows(embed: Weight, ids: np.ndarray) -> np.ndarray:
    """Float32 rows ``embed[ids]``, dequantizing only those rows."""
    if isinstance(embed, QuantizedWeight):
        g = embed.group
        q = embed.q[ids]
        t, cols = q.shape
        blocks = q.reshape(t, cols // g, g).astype(np.float32)
        rows = blocks * embed.scales[ids][:, :, None] + embed.biases[ids][:, :, None]
        return rows.reshape(t, cols)
    return np.asarray(embed[ids], dtype=np.float32)
