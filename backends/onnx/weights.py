"""Weights in the forms ONNX Runtime's own CPU kernels run fast and exactly (for matrices that
exo-tui's ``QLinear`` kernel does not take, or where it cannot be built: :mod:`backends.onnx.kernels`).

A :class:`~backends.weights.QuantizedWeight` is ``w = s * q + b`` per block of ``group`` codes.
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
from typing import Any

import numpy as np

from backends import kquants
from backends.onnx.kernels.tile_rows import TileRows
from backends.weights import QuantizedWeight, Weight


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
    return g >= 16 and g & (g - 1) == 0 and w.shape[1] % g == 0


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
    return a.bits == b.bits and a.group == b.group and a.shape[1] == b.shape[1]


EMBED_CHUNK_ROWS = 4096  # rows decoded at a time while an embedding is made compact


@dataclass
class EmbeddingRows:
    """A quantized token embedding kept small for looking rows up: codes' low 4 bits two a byte
    (low nibble first) and their bits above (Q5_K's, Q6_K's) four a byte (8-bit codes a byte
    each), and a K-quant's super-block fields rather than float32 scales and biases per group
    (other blocks' scales and biases in float16 where exact, as the file has them). A 1B
    Q4_K_M's 128256 x 2048 Q4_K embedding: 152 MB, against 328 MB as one-byte codes with float32
    groups (the file's 148 MB)."""

    low: np.ndarray  # uint8 (rows, cols // 2): bits 0-3; for 8-bit codes the codes (rows, cols)
    high: np.ndarray | None  # uint8 (rows, cols // 4): bits 4-5 of 5- and 6-bit codes
    bits: int
    group: int
    cols: int
    scales: np.ndarray | None = None  # (rows, cols // group), where there are no fields
    biases: np.ndarray | None = None
    fields: tuple[Any, ...] | None = None  # (d, dmin, sc, m) as QuantizedWeight.superblocks; Q6_K's dmin, m: None
    six_k: bool = False  # Q6_K: bias = -32 * scale (its dmin and m are not kept)

    @classmethod
    def of(cls, w: QuantizedWeight) -> EmbeddingRows:
        n, cols = w.shape
        if w.bits > 6 or cols % 4:
            low, high = w.q, None
        else:  # a few thousand rows at a time (a matrix kept as its file's super-blocks decodes only those)
            low = np.empty((n, cols // 2), np.uint8)
            high = None if w.bits <= 4 else np.empty((n, cols // 4), np.uint8)
            for r in range(0, n, EMBED_CHUNK_ROWS):
                q = w.take_rows(slice(r, r + EMBED_CHUNK_ROWS)).q
                low[r : r + len(q)] = (q[:, 0::2] & 0x0F) | (q[:, 1::2] << 4)
                if high is not None:
                    top = q >> 4
                    high[r : r + len(q)] = top[:, 0::4] | (top[:, 1::4] << 2) | (top[:, 2::4] << 4) | (top[:, 3::4] << 6)
            w.release_pages()  # the pages mapped around the chunks' as they were read (fault-around)
        if w.superblocks is not None:
            six_k = w.source_type == "Q6_K"
            d, dmin, sc, m = w.superblocks
            fields = (d, None, sc, None) if six_k else (d, dmin, sc, m)
            return cls(low, high, w.bits, w.group, cols, fields=fields, six_k=six_k)
        scales, biases = (_half_if_exact(a) for a in (w.scales, w.biases))
        return cls(low, high, w.bits, w.group, cols, scales=scales, biases=biases)

    @property
    def nbytes(self) -> int:
        parts = [self.low, self.high, *(self.fields or ()), self.scales, self.biases]
        return sum(a.nbytes for a in parts if a is not None)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Float32 rows ``ids``, exactly the matrix's (``QuantizedWeight.dequantize``'s) values."""
        t, g = len(ids), self.group
        lo = self.low[ids]
        if lo.shape[1] == self.cols:
            q = lo
        else:
            q = np.empty((t, self.cols), np.uint8)
            q[:, 0::2], q[:, 1::2] = lo & 0x0F, lo >> 4
            if self.high is not None:
                hi = self.high[ids]
                for j in range(4):
                    q[:, j::4] |= ((hi >> (2 * j)) & 3) << 4
        if self.fields is not None:
            d, dmin, sc, m = self.fields
            per = sc.shape[1] // d.shape[1]
            scales = np.repeat(d[ids].astype(np.float32), per, axis=1) * sc[ids].astype(np.float32)
            biases = (np.float32(-32.0) * scales if self.six_k
                      else -(np.repeat(dmin[ids].astype(np.float32), per, axis=1) * m[ids].astype(np.float32)))
        elif self.scales is not None and self.biases is not None:
            scales, biases = self.scales[ids].astype(np.float32), self.biases[ids].astype(np.float32)
        else:
            raise ValueError("embedding rows need their scales and biases or their super-blocks' fields")
        out = q.reshape(t, self.cols // g, g).astype(np.float32)
        out *= scales[:, :, None]
        out += biases[:, :, None]
        return out.reshape(t, self.cols)


def embedding_nbytes(type_name: str, rows: int, cols: int) -> int | None:
    """The bytes :meth:`EmbeddingRows.of` keeps of a ``rows x cols`` embedding of GGUF type
    ``type_name`` read from a file (a K-quant with its super-blocks' fields), or None where it is
    not one kept so (a float embedding stays float32)."""
    bits = kquants.CODE_BITS.get(type_name)
    if bits is None:
        return None
    if bits > 6 or cols % 4:
        codes = rows * cols
    else:
        codes = rows * cols // 2 + (rows * cols // 4 if bits > 4 else 0)
    if type_name in kquants.BITS:  # d (and dmin) in float16 a super-block, sc (and m) a byte a group
        supers, groups = cols // kquants.QK_K, cols // kquants.GROUP[type_name]
        fields = rows * (2 * supers + groups) if type_name == "Q6_K" else rows * (4 * supers + 2 * groups)
    else:  # a float16 scale and bias a block of 32 (exact: GGUF's scales are float16)
        fields = rows * (cols // 32) * 4
    return codes + fields


def compact_embedding(embed: Weight | None) -> Weight | EmbeddingRows | None:
    """The form a shard keeps its token embedding in: :class:`EmbeddingRows` for a quantized one."""
    return EmbeddingRows.of(embed) if isinstance(embed, QuantizedWeight) else embed


def _half_if_exact(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    with np.errstate(over="ignore"):
        half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a) else a


def embedding_rows(embed: Weight | EmbeddingRows | TileRows, ids: np.ndarray) -> np.ndarray:
    """Float32 rows ``embed[ids]``, dequantizing only those rows."""
    if isinstance(embed, (EmbeddingRows, TileRows)):
        return embed.rows(ids)
    if isinstance(embed, QuantizedWeight):
        g = embed.group
        q = embed.q[ids]
        t, cols = q.shape
        blocks = q.reshape(t, cols // g, g).astype(np.float32)
        rows = blocks * embed.scales[ids][:, :, None] + embed.biases[ids][:, :, None]
        return rows.reshape(t, cols)
    return np.asarray(embed[ids], dtype=np.float32)
