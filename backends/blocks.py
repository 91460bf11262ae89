"""GGUF's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) read in NumPy, and :class:`FileBlocks`, a
matrix kept as its file's blocks until it is read, which these (:class:`BlockWeight`) and the
K-quants' super-blocks (:class:`backends.kquants.KQuantWeight`) are.

A block is its float16 scale ``d`` (Q4_1 and Q5_1: then a float16 bias ``m``), for the 5-bit
types a little-endian 32-bit word of the codes' fifth bits (bit ``j`` code ``j``), then the codes:
Q8_0's 32 signed bytes, or 16 bytes whose low nibbles are codes 0-15 and high nibbles 16-31. As a
:class:`~backends.weights.QuantizedWeight`: Q4_0 and Q5_0 are ``d * (q - 8)`` and ``d * (q - 16)``,
Q8_0 ``d * (q - 128)`` with unsigned codes ``q``, Q4_1 and Q5_1 ``d * q + m``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backends.weights import BLOCK_TYPES, QuantizedWeight

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
_OWN_BIAS = ("Q4_1", "Q5_1")  # a float16 bias after d


def fields(raw: np.ndarray, type_name: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``(scales, biases)`` ``(rows, cols / 32)`` of block rows ``raw`` uint8 ``(rows, cols
    / 32 * block)``, without their codes."""
    b = _blocks(raw, type_name, cols)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name in _OWN_BIAS:
        return d, b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return d, np.float32(-(1 << (BLOCK_TYPES[type_name] - 1))) * d


def decode(raw: np.ndarray, type_name: str, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, biases)`` of block rows ``raw``: codes uint8 ``(rows, cols)``, scales and
    biases as :func:`fields` gives them, with ``weight = scale * code + bias``."""
    b = _blocks(raw, type_name, cols)
    rows = b.shape[0]
    if type_name == "Q8_0":
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        at = 4 if type_name in _OWN_BIAS else 2
        if type_name in ("Q5_0", "Q5_1"):
            high = np.unpackbits(b[..., at : at + 4], axis=-1, bitorder="little")  # (rows, blocks, 32): code j's bit 4
            at += 4
        qs = b[..., at : at + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        if type_name in ("Q5_0", "Q5_1"):
            q |= high << 4
    return (np.ascontiguousarray(q.reshape(rows, cols)), *fields(b.reshape(rows, -1), type_name, cols))


def _blocks(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a block type ({', '.join(BLOCK_BYTES)})")
    return np.ascontiguousarray(raw).reshape(raw.shape[0], cols // BLOCK, BLOCK_BYTES[type_name])


class FileBlocks(QuantizedWeight):
    """A quantized matrix that keeps its file's blocks (``raw``: uint8 rows) and decodes them when
    read: a few rows at a time through :meth:`take_rows` (what ONNX's tile packing, the
    embedding's compaction and MLX's arrays do, so a load holds one chunk decoded beside the shard,
    not a matrix at several times its file bytes), or all at once, kept, the first time ``q``,
    ``scales`` or ``biases`` is read (the fallback ops). Over a mapped file (``release``), the pages
    under what it has read go once read. A subclass names its types' bytes (``BYTES``, per
    ``WEIGHTS`` weights), codes and groups, and decodes them (``_decode``)."""

    raw: np.ndarray  # set in __init__ (the dataclass is frozen)
    cols: int
    _decoded: dict[int, Any]  # q, scales, biases by index; a subclass's own fields after them
    _release: Callable[[np.ndarray], None] | None

    BYTES: dict[str, int] = {}
    WEIGHTS = BLOCK
    BITS: dict[str, int] = {}
    GROUP: dict[str, int] = {}

    def __init__(self, raw: np.ndarray, type_name: str, cols: int,
                 release: Callable[[np.ndarray], None] | None = None) -> None:
        if type_name not in self.BYTES:
            raise ValueError(f"{type_name} is not one of {', '.join(self.BYTES)}")
        if cols % self.WEIGHTS or raw.ndim != 2 or raw.shape[1] != cols // self.WEIGHTS * self.BYTES[type_name]:
            raise ValueError(f"{raw.shape} bytes are no {type_name} rows of {cols} weights (blocks of {self.WEIGHTS})")
        for name, value in (("raw", raw), ("cols", cols), ("bits", self.BITS[type_name]), ("group", self.GROUP[type_name]),
                            ("source_type", type_name), ("_decoded", {}), ("_release", release)):
            object.__setattr__(self, name, value)

    def _decode(self) -> tuple[Any, ...]:
        """``(codes, scales, biases)`` of all rows, then anything else the type keeps."""
        raise NotImplementedError

    def release_pages(self) -> None:
        """The file's pages under these rows leave resident memory, where ``raw`` is a view of a
        mapped file (read again from the page cache if needed: nothing is lost)."""
        if self._release is not None:
            self._release(self.raw)

    def _field(self, i: int) -> np.ndarray:
        cache = self._decoded
        if 0 not in cache:
            cache.update(enumerate(self._decode()))
            self.release_pages()
        return cache[i]

    q = property(lambda self: self._field(0))
    scales = property(lambda self: self._field(1))
    biases = property(lambda self: self._field(2))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    def take_rows(self, rows: slice | np.ndarray) -> FileBlocks:
        """Rows ``rows`` as their blocks (a view for a slice), still undecoded."""
        if isinstance(rows, slice):
            return type(self)(self.raw[rows], self.source_type, self.cols, release=self._release)
        picked = type(self)(np.ascontiguousarray(self.raw[rows]), self.source_type, self.cols)
        self.release_pages()  # copied: the file's pages read for it may go
        return picked

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        if 0 in self._decoded:
            return super().dequantize(start, stop)
        part = self.take_rows(slice(start, stop))
        try:
            return QuantizedWeight.dequantize(part)
        finally:
            part.release_pages()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source_type}, {self.shape})"


class BlockWeight(FileBlocks):
    """GGUF's blocks of 32 kept as the file has them until read (:class:`FileBlocks`); their
    scales and biases alone are read without decoding the codes (kept)."""

    BYTES = BLOCK_BYTES
    BITS = BLOCK_TYPES
    GROUP = dict.fromkeys(BLOCK_BYTES, BLOCK)

    def _decode(self) -> tuple[np.ndarray, ...]:
        return decode(self.raw, self.source_type, self.cols)

    def _group_field(self, i: int) -> np.ndarray:
        cache = self._decoded
        if i not in cache:
            cache[1], cache[2] = fields(self.raw, self.source_type, self.cols)
            self.release_pages()
        return cache[i]

    scales = property(lambda self: self._group_field(1))
    biases = property(lambda self: self._group_field(2))
