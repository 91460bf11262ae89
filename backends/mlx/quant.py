"""From the contract's weights to MLX arrays: affine-quantized matrices stay quantized.

:class:`~backends.weights.QuantizedWeight` holds one unsigned code per element and a float32 scale
and bias per group along each row. MLX's ``mx.quantize`` affine layout is that, once the codes are
packed into ``uint32`` words as a little-endian bit stream: code ``j`` of a row takes bits
``j * bits .. (j + 1) * bits - 1`` (for 2, 4 and 8 bits, word ``j // (32 // bits)`` at bit
``(j % (32 // bits)) * bits``; 3, 5 and 6-bit codes straddle words). The scales and biases are
held in the file's own form (:class:`~backends.mlx.scales.GroupScales`: a K-quant's float16 ``d``
a super-block and 6-bit ``sc`` a group; the other blocks' float16) and made float32 as each
product runs, so MLX does float32 math on the very values ``QuantizedWeight.dequantize()`` gives,
and a node holds about the file's bytes. (Float16 scales would be as small but not exact: ``d * sc`` is an 11-bit
significand times a 6-bit integer. Float32 ones, made once, held Q4_K at 0.75 bytes a weight.)

How each format runs, and what it holds resident (bytes per weight; the GGUF file's in brackets):

* groups of 32, 64 or 128 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K): :class:`MLXQuantized`,
  ``mx.quantized_matmul`` on the packed codes, its float32 scales and biases made from the held
  form first: Q4_0 0.5625 (0.5625), Q4_1 0.625 (0.625), Q5_0 0.6875 (0.6875), Q5_1 0.75 (0.75),
  Q8_0 1.0625 (1.0625), Q4_K 0.578 (0.5625), Q5_K 0.703 (0.6875): the K-quants' 6-bit scales and
  mins take a byte each. On MLX's
  CPU build making them costs a one-row product ~7 % (14336 x 4096: 40.2 against 37.4 ms) and a
  128-row one nothing measurable; decode of a 1B Q4_K_M shard was no slower (1.46-1.62 against
  1.27-1.50 tok/s, 2 threads, alternated). On a GPU, where a one-row product is bound by the
  bytes it reads, they add ~0.5 bytes a weight of float32 written and read back: not measured.
* groups of 16 (Q6_K, ``w = d * sc * (q - 32)``): MLX's quantized matmul takes no group under 32,
  so :class:`MLXSmallGroups` keeps the 6-bit codes packed and, per matmul as it runs, unpacks
  them with a few integer ops and scales them into a float32 matrix of that one weight (freed
  after the matmul; never the whole model): 0.75 for the codes, an int8 ``sc`` a group and ``d``
  a super-block: 0.8203 (0.8203); the bias ``-32 * scale`` is not stored. On MLX's CPU build a
  one-row Q6_K matmul takes ~3x a Q4_K one (2048 x 2048: ~50 against ~15 ms on a loaded machine).
* dense F32/F16/BF16: :class:`MLXDense`, float32, 4.0.

A mixture of experts' matrices are these, stacked over the experts (:mod:`backends.mlx.experts`).

A matrix's arrays are made a few rows at a time (:func:`to_mlx`), and matrices fused into one
(q/k/v, gate/up, the experts) are stacked as :class:`RowStack` without being decoded: a load holds
one chunk decoded and one matrix's NumPy arrays (while MLX copies them) beside the shard.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from backends.base import BackendError
from backends.mlx.scales import GroupScales, ScaleStaging, chunk_form
from backends.weights import QuantizedWeight, Weight

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine bit widths
SUPPORTED_GROUPS = (32, 64, 128)  # MLX's quantized matmul's groups
SMALL_GROUPS = (16,)  # groups run by unpacking the codes per matmul (Q6_K's)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``(rows, cols)`` packed into MLX's ``uint32`` layout ``(rows, cols * bits // 32)``:
    a little-endian bit stream, eight codes in ``bits`` bytes."""
    if bits not in SUPPORTED_BITS:
        raise BackendError(f"MLX backend packs {SUPPORTED_BITS}-bit codes, not {bits}-bit")
    rows, cols = q.shape
    if cols % 32:
        raise BackendError(f"a {bits}-bit matrix needs a multiple of 32 columns, got {cols}")
    if q.size and int(q.max()) >= 1 << bits:
        raise BackendError(f"codes of a {bits}-bit weight must be below {1 << bits}, found {int(q.max())}")
    eights = q.reshape(rows, cols // 8, 8)
    chunks = np.zeros((rows, cols // 8), dtype=np.uint64)  # eight codes: 8 * bits <= 64 bits
    for i in range(8):
        chunks |= eights[:, :, i].astype(np.uint64) << np.uint64(i * bits)
    stream = chunks[..., None].view(np.uint8)[..., :bits]  # the low `bits` bytes of each (little-endian)
    return np.ascontiguousarray(stream).reshape(rows, cols * bits // 8).view(np.uint32)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """:func:`pack_codes`'s inverse in MLX: uint32 ``(..., cols * bits // 32)`` to uint32 codes
    ``(..., cols)``, from the stream's smallest whole-byte chunks (6 bits: four codes in 3 bytes)."""
    *lead, words = packed.shape
    cols = words * 32 // bits
    per = 8 // math.gcd(8, bits)  # codes in a chunk of per * bits / 8 bytes
    size = per * bits // 8
    stream = mx.view(packed, mx.uint8).reshape(*lead, cols // per, size)
    wide = mx.uint64 if per * bits > 32 else mx.uint32
    chunk = stream[..., 0].astype(wide)
    for i in range(1, size):
        chunk = chunk | (stream[..., i].astype(wide) << (8 * i))
    shifts = mx.arange(0, per * bits, bits).astype(wide)
    codes = (chunk[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, cols).astype(mx.uint32)


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



def _rows(a: int, b: int) -> Callable[[mx.array], mx.array]:
    return lambda x: x[a:b]

class MLXQuantized:
    """A matrix ``(out, in)`` as MLX affine-quantized arrays: packed codes and :class:`GroupScales`.

    With ``n_parts > 1``, ``matmul`` cuts the output rows into that many parts and runs them at
    once on as many CPU streams (MLX's CPU kernels use one core each); the parts are views of the
    whole arrays, which ``rows`` (the embedding gather) uses.
    """

    def __init__(self, packed: mx.array, scales: GroupScales, bits: int, group: int, n_parts: int = 1) -> None:
        self.packed = packed  # uint32 (out, in * bits // 32)
        self.scales = scales
        self.bits = bits
        self.group = group
        ranges = split_rows(packed.shape[0], n_parts) if n_parts > 1 else []
        self.parts = [(packed[a:b], scales.map(_rows(a, b))) for a, b in ranges]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 32 // self.bits)

    def arrays(self) -> list[mx.array]:
        return [self.packed, *self.scales.arrays()] + [a for w, s in self.parts for a in (w, *s.arrays())]

    def matmul(self, x: mx.array) -> mx.array:
        """``x @ W.T``."""
        if not self.parts:
            return mx.quantized_matmul(x, self.packed, *self.scales.pair(), transpose=True, group_size=self.group,
                                       bits=self.bits)
        outs = []
        for (w, s), st in zip(self.parts, thread_streams(len(self.parts)), strict=True):
            with mx.stream(st):  # the scales made on the part's stream too
                outs.append(mx.quantized_matmul(x, w, *s.pair(), transpose=True, group_size=self.group, bits=self.bits))
        return mx.concatenate(outs, axis=-1)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``W[ids]`` as float32 (only those rows are dequantized)."""
        return mx.dequantize(self.packed[ids], *self.scales.map(lambda a: a[ids]).pair(), group_size=self.group,
                             bits=self.bits)

    def dequantize(self) -> mx.array:
        return mx.dequantize(self.packed, *self.scales.pair(), group_size=self.group, bits=self.bits)


def small_group_weights(packed: mx.array, scales: GroupScales, bits: int, group: int) -> mx.array:
    """Float32 weights ``(..., rows, cols)`` of packed codes in groups of ``group``:
    ``scale * q + bias`` (an implied bias: ``scale * (q - 2**(bits - 1))``)."""
    codes = unpack_codes(packed, bits).astype(mx.float32)
    *lead, cols = codes.shape
    codes = codes.reshape(*lead, cols // group, group)
    s, b = scales.scales(), scales.biases()
    if b is None:
        w = (codes - float(1 << (bits - 1))) * s[..., None]
    else:
        w = codes * s[..., None] + b[..., None]
    return w.reshape(*lead, cols)


class MLXSmallGroups:
    """A matrix ``(out, in)`` in quantization groups smaller than MLX's matmul takes (Q6_K's 16):
    the codes stay packed (MLX's layout) and each matmul unpacks them into a float32 matrix of
    this weight alone, ``w = scale * q + bias`` per group (Q6_K's bias implied: ``w = scale * (q - 32)``).
    ``n_parts`` as for :class:`MLXQuantized`."""

    def __init__(self, packed: mx.array, scales: GroupScales, bits: int, group: int, n_parts: int = 1) -> None:
        self.packed = packed  # uint32 (out, in * bits // 32)
        self.scales = scales
        self.bits = bits
        self.group = group
        ranges = split_rows(packed.shape[0], n_parts) if n_parts > 1 else []
        self.parts = [(packed[a:b], scales.map(_rows(a, b))) for a, b in ranges]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 32 // self.bits)

    def arrays(self) -> list[mx.array]:
        return [self.packed, *self.scales.arrays()] + [a for w, s in self.parts for a in (w, *s.arrays())]

    def matmul(self, x: mx.array) -> mx.array:
        if not self.parts:
            return x @ small_group_weights(self.packed, self.scales, self.bits, self.group).T
        outs = []
        for (w, s), st in zip(self.parts, thread_streams(len(self.parts)), strict=True):
            with mx.stream(st):
                outs.append(x @ small_group_weights(w, s, self.bits, self.group).T)
        return mx.concatenate(outs, axis=-1)

    def rows(self, ids: mx.array) -> mx.array:
        return small_group_weights(self.packed[ids], self.scales.map(lambda a: a[ids]), self.bits, self.group)

    def dequantize(self) -> mx.array:
        return small_group_weights(self.packed, self.scales, self.bits, self.group)


class MLXDense:
    """A float32 matrix ``(out, in)``; ``n_parts`` as for :class:`MLXQuantized`."""

    def __init__(self, weight: mx.array, n_parts: int = 1) -> None:
        self.weight = weight
        ranges = split_rows(weight.shape[0], n_parts) if n_parts > 1 else []
        self.parts = [weight[a:b] for a, b in ranges]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1])

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


MLXWeight = MLXQuantized | MLXSmallGroups | MLXDense


CONVERT_CODES = 1 << 22
"""Codes a conversion step decodes at once (``to_mlx``): 4 M, a few MB with their temporaries."""


def _affine_arrays(w: QuantizedWeight, name: str) -> tuple[np.ndarray, GroupScales]:
    """``w``'s codes packed in MLX's layout and its :class:`GroupScales`, made a few rows at a
    time (``take_rows``): a matrix kept as its file's super-blocks, or stacked from such
    (:class:`RowStack`), is decoded one chunk at a time, never whole beside its arrays."""
    rows, cols = w.shape
    packed = np.empty((rows, cols * w.bits // 32), np.uint32)
    staging = ScaleStaging(rows, float(1 << (w.bits - 1)))
    step = max(1, CONVERT_CODES // cols)
    for r in range(0, rows, step):
        part = w.take_rows(slice(r, min(rows, r + step)))
        n = part.shape[0]
        if part.scales.shape != (n, cols // w.group) or part.biases.shape != part.scales.shape:
            raise BackendError(
                f"{name}: scales {part.scales.shape} / biases {part.biases.shape} do not fit rows of a "
                f"{rows}x{cols} matrix in groups of {w.group}"
            )
        packed[r : r + n] = pack_codes(np.asarray(part.q), w.bits)
        staging.add(r, chunk_form(part, staging.offset))
        del part
    w.release_pages()  # the file's pages mapped around the chunks' as they were read
    return packed, staging.result()


def to_mlx(w: Weight, name: str = "weight", n_parts: int = 1) -> MLXWeight:
    """One contract weight as MLX arrays: quantized stays quantized, dense becomes float32;
    matmuls run in ``n_parts`` row blocks at once when ``n_parts > 1``."""
    if isinstance(w, QuantizedWeight):
        rows, cols = w.shape
        small = w.group in SMALL_GROUPS
        if not (w.group in SUPPORTED_GROUPS or small) or cols % max(w.group, 32):
            raise BackendError(
                f"{name}: MLX runs quantization groups of {SMALL_GROUPS + SUPPORTED_GROUPS} along rows of a "
                f"multiple of 32 columns; got group {w.group} for {cols} columns"
            )
        codes, scales = _affine_arrays(w, name)
        packed = mx.array(codes)
        del codes
        kind = MLXSmallGroups if small else MLXQuantized
        return kind(packed, scales, w.bits, w.group, n_parts)
    a = np.asarray(w)
    if a.ndim != 2:
        raise BackendError(f"{name}: expected a matrix, got shape {a.shape}")
    return MLXDense(mx.array(np.ascontiguousarray(a, dtype=np.float32)), n_parts)


class RowStack(QuantizedWeight):
    """Quantized matrices of one format stacked along their rows, as one matrix that is read a
    few rows at a time (``take_rows``, what :func:`to_mlx` does): no matrix is decoded whole, nor
    copied, to stack it. ``q``, ``scales`` and ``biases`` join the parts' whole (kept)."""

    parts: list[QuantizedWeight]  # set in __init__ (the dataclass is frozen)
    cols: int
    starts: list[int]
    _joined: dict[str, np.ndarray]

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        first = parts[0]
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.shape[0])
        for name, value in (("parts", list(parts)), ("cols", first.shape[1]), ("starts", starts), ("bits", first.bits),
                            ("group", first.group), ("source_type", first.source_type), ("superblocks", None),
                            ("_joined", {})):
            object.__setattr__(self, name, value)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.starts[-1], self.cols)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def take_rows(self, rows: slice | np.ndarray) -> QuantizedWeight:
        if not isinstance(rows, slice):
            return QuantizedWeight.take_rows(self, rows)
        lo, hi, _ = rows.indices(self.shape[0])
        pieces = [p.take_rows(slice(max(lo, a) - a, min(hi, b) - a))
                  for p, a, b in zip(self.parts, self.starts, self.starts[1:], strict=False) if max(lo, a) < min(hi, b)]
        if len(pieces) == 1:
            return pieces[0]
        fields = [p.superblocks for p in pieces]
        return QuantizedWeight(q=np.concatenate([p.q for p in pieces]), scales=np.concatenate([p.scales for p in pieces]),
                               biases=np.concatenate([p.biases for p in pieces]), bits=self.bits, group=self.group,
                               source_type=self.source_type,
                               superblocks=None if any(f is None for f in fields) else
                               tuple(np.concatenate(parts) for parts in zip(*fields, strict=True)))

    def release_pages(self) -> None:
        for p in self.parts:
            p.release_pages()

    def _field(self, name: str) -> np.ndarray:
        if name not in self._joined:
            self._joined[name] = np.concatenate([getattr(p, name) for p in self.parts])
        return self._joined[name]

    q = property(lambda self: self._field("q"))
    scales = property(lambda self: self._field("scales"))
    biases = property(lambda self: self._field("biases"))


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
        return RowStack([w for w in weights if isinstance(w, QuantizedWeight)])
    if any(isinstance(w, QuantizedWeight) for w in weights):
        return None
    arrays = [np.asarray(w) for w in weights]
    if any(a.ndim != 2 or a.shape[1] != arrays[0].shape[1] for a in arrays):
        return None
    return np.concatenate([a.astype(np.float32, copy=False) for a in arrays])
