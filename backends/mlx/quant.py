"""From the contract's weights to MLX arrays: affine-quantized matrices stay quantized.

:class:`~backends.base.QuantizedWeight` holds one unsigned code per element and a float32 scale
and bias per group of 32 along each row. That is exactly MLX's ``mx.quantize`` affine layout once
the codes are packed into ``uint32`` words: element ``j`` of a row lands in word
``j // (32 // bits)`` at bit ``(j % (32 // bits)) * bits`` (lowest bits first). Scales and biases
stay float32, so ``mx.quantized_matmul`` does float32 math on the very values that
``QuantizedWeight.dequantize()`` gives.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from backends.base import BackendError, QuantizedWeight, Weight

SUPPORTED_BITS = (2, 4, 8)  # bit widths whose codes fill a uint32 word exactly
SUPPORTED_GROUPS = (32, 64, 128)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``(rows, cols)`` packed into MLX's ``uint32`` layout ``(rows, cols * bits // 32)``."""
    if bits not in SUPPORTED_BITS:
        raise BackendError(f"MLX backend packs {SUPPORTED_BITS}-bit codes, not {bits}-bit")
    per_word = 32 // bits
    rows, cols = q.shape
    if cols % per_word:
        raise BackendError(f"a {bits}-bit matrix needs a multiple of {per_word} columns, got {cols}")
    if q.size and int(q.max()) >= 1 << bits:
        raise BackendError(f"codes of a {bits}-bit weight must be below {1 << bits}, found {int(q.max())}")
    words = q.reshape(rows, cols // per_word, per_word).astype(np.uint32)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    packed = np.zeros((rows, cols // per_word), dtype=np.uint32)
    for i in range(per_word):
        packed |= words[:, :, i] << shifts[i]
    return packed


_local = threading.local()


def thread_streams(n: int) -> list[mx.Stream]:
    """``n`` CPU streams of the calling thread (MLX streams belong to the thread that made them;
    each runs its ops on its own worker thread, so ops on different streams run at once)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = []
    while len(streams) < n:
        streams.append(mx.new_stream(mx.cpu))
    return streams[:n]


def split_rows(rows: int, n_parts: int) -> list[tuple[int, int]]:
    """``[0, rows)`` cut into at most ``n_parts`` near-equal row ranges."""
    n = max(1, min(n_parts, rows))
    cuts = [rows * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


class MLXQuantized:
    """A matrix ``(out, in)`` as MLX affine-quantized arrays.

    With ``n_parts > 1``, ``matmul`` cuts the output rows into that many parts and runs them at
    once on as many CPU streams (MLX's CPU kernels use one core each); the parts are views of the
    whole arrays, which ``rows`` (the embedding gather) uses.
    """

    def __init__(
        self, packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int, n_parts: int = 1
    ) -> None:
        self.packed = packed  # uint32 (out, in * bits // 32)
        self.scales = scales  # float32 (out, in // group)
        self.biases = biases  # float32 (out, in // group)
        self.bits = bits
        self.group = group
        ranges = split_rows(packed.shape[0], n_parts) if n_parts > 1 else []
        self.parts = [(packed[a:b], scales[a:b], biases[a:b]) for a, b in ranges]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 32 // self.bits)

    def arrays(self) -> list[mx.array]:
        return [self.packed, self.scales, self.biases] + [a for part in self.parts for a in part]

    def matmul(self, x: mx.array) -> mx.array:
        """``x @ W.T``."""
        if not self.parts:
            return mx.quantized_matmul(
                x, self.packed, self.scales, self.biases, transpose=True, group_size=self.group, bits=self.bits
            )
        outs = [
            mx.quantized_matmul(x, w, s, b, transpose=True, group_size=self.group, bits=self.bits, stream=st)
            for (w, s, b), st in zip(self.parts, thread_streams(len(self.parts)), strict=True)
        ]
        return mx.concatenate(outs, axis=-1)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``W[ids]`` as float32 (only those rows are dequantized)."""
        return mx.dequantize(
            self.packed[ids], self.scales[ids], self.biases[ids], group_size=self.group, bits=self.bits
        )

    def dequantize(self) -> mx.array:
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group, bits=self.bits)


class MLXDense:
    """A float32 matrix ``(out, in)``; ``n_parts`` as for :class:`MLXQuantized`."""

    def __init__(self, weight: mx.array, n_parts: int = 1) -> None:
        self.weight = weight
        ranges = split_rows(weight.shape[0], n_parts) if n_parts > 1 else []
        self.parts = [weight[a:b] for a, b in ranges]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def arrays(self) -> list[mx.array]:
        return [self.weight, *self.parts]

    def matmul(self, x: mx.array) -> mx.array:
        if not self.parts:
            return x @ self.weight.T
        outs = [mx.matmul(x, w.T, stream=st) for w, st in zip(self.parts, thread_streams(len(self.parts)), strict=True)]
        return mx.concatenate(outs, axis=-1)

    def rows(self, ids: mx.array) -> mx.array:
        return self.weight[ids]

    def dequantize(self) -> mx.array:
        return self.weight


MLXWeight = MLXQuantized | MLXDense


def to_mlx(w: Weight, name: str = "weight", n_parts: int = 1) -> MLXWeight:
    """One contract weight as MLX arrays: quantized stays quantized, dense becomes float32;
    matmuls run in ``n_parts`` row blocks at once when ``n_parts > 1``."""
    if isinstance(w, QuantizedWeight):
        rows, cols = w.shape
        if w.group not in SUPPORTED_GROUPS or cols % w.group:
            raise BackendError(
                f"{name}: MLX runs quantization groups of {SUPPORTED_GROUPS} along rows; "
                f"got group {w.group} for {cols} columns"
            )
        if w.scales.shape != (rows, cols // w.group) or w.biases.shape != w.scales.shape:
            raise BackendError(
                f"{name}: scales {w.scales.shape} / biases {w.biases.shape} do not fit a "
                f"{rows}x{cols} matrix in groups of {w.group}"
            )
        return MLXQuantized(
            packed=mx.array(pack_codes(np.asarray(w.q), w.bits)),
            scales=mx.array(np.ascontiguousarray(w.scales, dtype=np.float32)),
            biases=mx.array(np.ascontiguousarray(w.biases, dtype=np.float32)),
            bits=w.bits,
            group=w.group,
            n_parts=n_parts,
        )
    a = np.asarray(w)
    if a.ndim != 2:
        raise BackendError(f"{name}: expected a matrix, got shape {a.shape}")
    return MLXDense(mx.array(np.ascontiguousarray(a, dtype=np.float32)), n_parts)


def fuse_rows(weights: list[Weight]) -> Weight | None:
    """Several matrices with the same input stacked along their rows (``[Wq; Wk; Wv]``), so one
    matmul replaces several; ``None`` when they do not share a format (bits, group, dense)."""
    first = weights[0]
    if isinstance(first, QuantizedWeight):
        if not all(
            isinstance(w, QuantizedWeight) and w.bits == first.bits and w.group == first.group
            and w.shape[1] == first.shape[1]
            for w in weights
        ):
            return None
        return QuantizedWeight(
            q=np.concatenate([w.q for w in weights]),
            scales=np.concatenate([w.scales for w in weights]),
            biases=np.concatenate([w.biases for w in weights]),
            bits=first.bits,
            group=first.group,
            source_type=first.source_type,
        )
    if any(isinstance(w, QuantizedWeight) for w in weights):
        return None
    arrays = [np.asarray(w) for w in weights]
    if any(a.ndim != 2 or a.shape[1] != arrays[0].shape[1] for a in arrays):
        return None
    return np.concatenate([a.astype(np.float32, copy=False) for a in arrays])
