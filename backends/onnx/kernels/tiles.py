"""QLinear's tiles: which matrices the kernel takes (:func:`kernel_format`) and how their blocks
are regrouped at load (:func:`pack`): tiles of 32 output columns, each block's float16 scale and
bias (a K-quant's super-block fields) beside its codes, the codes in lines the precision reads
(float32, int16 or int8 products). The layout is the C side's (``qlinear.c``, ``qlinear.h``).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from backends import kquants
from backends.weights import BLOCK_TYPES, QuantizedWeight

BLOCK = 32  # weights per scale and bias, along K
TILE = 32  # output columns per tile
TILE_BLOCK_BYTES = {4: 640, 5: 768, 8: 1152}  # a tile's 32 float16 scales and biases, then 32 x 32 codes
SUPER = 256  # weights per K-quant super-block, along K
KQUANT = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # the op's kquant attribute
K_HEADER = {"Q4_K": 640, "Q5_K": 640, "Q6_K": 576}  # a tile's d (dmin) and sub-block scales (mins) per super-block
K_PLANES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # planes of the codes' bits above the 4-bit lines
K_BLOCK_BYTES = {t: 512 + 128 * K_PLANES[t] for t in KQUANT}  # a block's codes, 32 columns x 32 weights
CHUNK_CODES = 1 << 20  # codes a K-quant packing step decodes and regroups at once
SUPER_BYTES = {t: K_HEADER[t] + 8 * K_BLOCK_BYTES[t] for t in KQUANT}  # 4736, 5760, 6720


def packed_nbytes(type_name: str, rows: int, cols: int) -> int | None:
    """The bytes :func:`pack` makes of a ``rows x cols`` matrix of GGUF type ``type_name`` (its
    last tile padded to 32 columns), or None where ``QLinear`` does not take that type (GGUF's
    Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks and its K-quant super-blocks it does)."""
    tiles = -(-rows // TILE)
    if type_name in KQUANT:
        return tiles * (cols // SUPER) * SUPER_BYTES[type_name] if cols % SUPER == 0 else None
    bits = BLOCK_TYPES.get(type_name)
    return tiles * (cols // BLOCK) * TILE_BLOCK_BYTES[bits] if bits and cols % BLOCK == 0 else None


def runs_on_kernel(w: object) -> bool:
    """Whether ``w`` is a matrix ``QLinear`` takes: 4-, 5- or 8-bit codes in blocks of 32 whose
    scale and bias are exact in float16 (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are), or GGUF's
    K-quant super-blocks (whose scales and biases are ``d * sc`` and ``-dmin * m``:
    :func:`backends.kquants.superblocks`)."""
    return kernel_format(w) is not None


def kernel_format(w: object) -> str | None:
    """The tile format ``QLinear`` runs ``w`` in (``"Q4"``, ``"Q5"``, ``"Q8"``, ``"Q4_K"``,
    ``"Q5_K"``, ``"Q6_K"``), or None where it does not take it: matrices share one op only in one
    format."""
    if not isinstance(w, QuantizedWeight):
        return None
    if w.source_type in KQUANT:
        t = w.source_type
        if w.bits != kquants.BITS[t] or w.group != kquants.GROUP[t] or w.shape[1] % SUPER:
            return None
        return t if _has_superblocks(w) else None
    if w.bits not in TILE_BLOCK_BYTES or w.group != BLOCK or w.shape[1] % BLOCK:
        return None
    return f"Q{w.bits}" if _exact_in_half(w.scales) and _exact_in_half(w.biases) else None


def op_attributes(w: QuantizedWeight) -> dict[str, int]:
    """``QLinear``'s ``bits`` and (for a K-quant) ``kquant`` attributes for ``w``'s format."""
    return {"bits": w.bits, "kquant": KQUANT[w.source_type]} if w.source_type in KQUANT else {"bits": w.bits}


_FIELDS: dict[int, tuple[np.ndarray, ...] | None] = {}


def _has_superblocks(w: QuantizedWeight) -> bool:
    """Whether ``w``'s groups are K-quant super-blocks: a file's matrix kept as its blocks is (read
    a chunk at a time, not all at once here), another is once its fields are found."""
    return isinstance(w, kquants.KQuantWeight) or _superblocks(w) is not None


def _fields_of(w: QuantizedWeight) -> tuple[np.ndarray, ...]:
    """A K-quant matrix's super-block fields (:func:`_superblocks`), which it always has."""
    fields = _superblocks(w)
    if fields is None:
        raise ValueError(f"a {w.source_type} matrix whose super-block fields cannot be found")
    return fields


def _superblocks(w: QuantizedWeight) -> tuple[np.ndarray, ...] | None:
    """``w``'s super-block fields (d, dmin, sc, m): its own (the GGUF reader's carry them), else
    found once per matrix while it lives."""
    if w.superblocks is not None:
        return w.superblocks
    key = id(w)
    if key not in _FIELDS:
        _FIELDS[key] = kquants.superblocks(w.source_type, w.scales, w.biases)
        weakref.finalize(w, _FIELDS.pop, key, None)
    return _FIELDS[key]


def _exact_in_half(a: np.ndarray) -> bool:
    a = np.asarray(a, dtype=np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def pack(weights: list[QuantizedWeight], xbits: int = 0) -> np.ndarray:
    """Matrices of one kind stacked along their rows (output columns), as ``QLinear``'s W: tiles
    of 32 columns, ``(ceil(N / 32), K / 32, 640)`` for 4 bits, ``(…, 768)`` for 5 and ``(…, 1152)``
    for 8, the codes laid out for float32 products or (``xbits`` 16 or 8) for the int16 or int8
    precision's (the layouts are in ``qlinear.c``); the last tile is padded with zero columns.
    Packed a few tiles at a time, so a large matrix (a vocabulary's head) costs little memory
    beyond the result."""
    if weights[0].source_type in KQUANT:
        return _pack_kquant(weights, xbits)
    n, k, bits = sum(w.shape[0] for w in weights), weights[0].shape[1], weights[0].bits
    tiles, nb = -(-n // TILE), k // BLOCK
    out = np.empty((tiles, nb, TILE_BLOCK_BYTES[bits]), dtype=np.uint8)
    chunk = max(1, CHUNK_CODES // (TILE * k))  # tiles: a few MB of codes and their temporaries
    for t0 in range(0, tiles, chunk):
        t1 = min(tiles, t0 + chunk)
        count = t1 - t0
        parts = _rows(weights, t0 * TILE, t1 * TILE)  # a matrix kept as its file's blocks decodes only these
        for i, field in enumerate(("scales", "biases")):  # (tile, block, column)
            half = _stacked([getattr(p, field) for p in parts], count * TILE, np.float16)
            out[t0:t1, :, 64 * i : 64 * (i + 1)] = np.ascontiguousarray(half.reshape(count, TILE, nb).transpose(0, 2, 1)).view(np.uint8)
        codes = _stacked([p.q for p in parts], count * TILE, np.uint8)
        out[t0:t1, :, 128:] = code_bytes(codes.reshape(count, TILE, nb, BLOCK), bits, xbits)
    for w in weights:  # each chunk's pages went once read; the ones mapped around them (fault-around) go now
        w.release_pages()
    return out


def _pack_kquant(weights: list[QuantizedWeight], xbits: int) -> np.ndarray:
    """:func:`pack` for K-quant matrices of one type: ``(ceil(N / 32), K / 256, SUPER_BYTES[type])``,
    per tile and super-block the columns' float16 ``d`` (and ``dmin``), the sub-blocks' scales (and
    mins) a byte each, then the 8 blocks' codes in the lines of the precision (see ``qlinear.c``).
    The rows are read a chunk at a time (``take_rows``): a matrix kept as its file's super-blocks
    (:class:`backends.kquants.KQuantWeight`) is decoded one chunk at a time."""
    t = weights[0].source_type
    if any(w.source_type != t for w in weights):
        raise ValueError(f"one QLinear takes one format: {', '.join(sorted({w.source_type for w in weights}))}")
    if not all(_has_superblocks(w) for w in weights):
        raise ValueError(f"a {t} matrix whose scales are not its super-blocks' d * sc (see kquants.superblocks)")
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    tiles, ns, nb = -(-n // TILE), k // SUPER, k // BLOCK
    out = np.empty((tiles, ns, SUPER_BYTES[t]), dtype=np.uint8)
    chunk = max(1, CHUNK_CODES // (TILE * k))  # tiles: a few MB of codes and their temporaries
    for t0 in range(0, tiles, chunk):
        t1 = min(tiles, t0 + chunk)
        count = t1 - t0
        parts = _rows(weights, t0 * TILE, t1 * TILE)

        def columns(i: int, dtype: type, parts: list[QuantizedWeight] = parts, count: int = count) -> np.ndarray:
            """Field ``i`` of the chunk's columns, ``(tile, super-block, ..., column)``."""
            a = _stacked([_fields_of(p)[i] for p in parts], count * TILE, dtype)
            a = a.reshape(count, TILE, ns, -1).transpose(0, 2, 3, 1)
            return np.ascontiguousarray(a).reshape(count, ns, -1)

        out[t0:t1, :, 0:64] = columns(0, np.float16).view(np.uint8)
        if t == "Q6_K":
            out[t0:t1, :, 64:576] = columns(2, np.int8).view(np.uint8)
        else:
            out[t0:t1, :, 64:128] = columns(1, np.float16).view(np.uint8)
            out[t0:t1, :, 128:384] = columns(2, np.uint8)
            out[t0:t1, :, 384:640] = columns(3, np.uint8)
        codes = _stacked([p.q for p in parts], count * TILE, np.uint8).reshape(count, TILE, nb, BLOCK)
        out[t0:t1, :, K_HEADER[t]:] = code_bytes(codes, kquants.BITS[t], xbits).reshape(count, ns, -1)
    for w in weights:  # each chunk's pages went once read; the ones mapped around them (fault-around) go now
        w.release_pages()
    return out


def _rows(weights: list[QuantizedWeight], lo: int, hi: int) -> list[QuantizedWeight]:
    """Rows ``lo:hi`` of the matrices stacked along their rows, as the pieces of each they cover."""
    parts, start = [], 0
    for w in weights:
        a, b = max(lo, start), min(hi, start + w.shape[0])
        if a < b:
            rows = slice(a - start, b - start)
            part = w.take_rows(rows)
            if part.source_type in KQUANT and not isinstance(part, kquants.KQuantWeight) and part.superblocks is None:
                # found once, for the whole
                part = dataclasses.replace(part, superblocks=tuple(f[rows] for f in _fields_of(w)))
            parts.append(part)
        start += w.shape[0]
    return parts


def _stacked(arrays: list[np.ndarray], rows: int, dtype: type) -> np.ndarray:
    """``arrays`` one after the other along their rows, zeros after them up to ``rows``."""
    part: np.ndarray = np.zeros((rows, arrays[0].shape[1]), dtype)
    start = 0
    for a in arrays:
        part[start : start + a.shape[0]] = a
        start += a.shape[0]
    return part


def code_bytes(codes: np.ndarray, bits: int, xbits: int) -> np.ndarray:
    """Codes of ``bits`` bits ``(tile, column, block, k)`` as each tile block holds them for the
    precision ``xbits``, ``(tile, block, bytes)``: 8-bit codes in 8-bit lines; 4-, 5- and 6-bit
    codes' low 4 bits in 4-bit lines, then a plane of each bit above (bit 4, then 5), Q5_0's and
    Q5_1's as Q5_K's, so that one code path of the kernel adds them."""
    lines = {0: _float_lines, 16: _int16_lines, 8: _int8_lines}[xbits]
    if bits == 8:
        return lines(codes, 8)
    low = lines(codes & 0x0F, 4)
    if bits == 4:
        return low
    return np.concatenate([low, *(_bit_plane((codes >> b) & 1, xbits) for b in range(4, bits))], axis=-1)


def _bit_plane(high: np.ndarray, xbits: int) -> np.ndarray:
    """One bit plane of 5- or 6-bit codes (``high``: that bit, ``(tile, column, block, k)``) as
    ``qlinear.c`` reads it beside the 4-bit lines of the precision: 128 bytes a block, little-endian
    masks of one bit a code:
    float32: per line j two 32-bit words, bit c the code (k = j, column c), then (j + 16, c);
    int8: per half h of 16 columns and line j two 64-bit words, bit 4 c + i the code (4 j + i,
    16 h + c), then (16 + 4 j + i, 16 h + c); int16: per line j four 32-bit words for the lanes
    the kernel widens the line to, bit 2 c + t the code (2 j + t, c), (2 j + 16 + t, c),
    (2 j + t, c + 16), (2 j + 16 + t, c + 16)."""
    tiles, _, nb, _ = high.shape
    if xbits == 0:
        by_k = high.transpose(0, 2, 3, 1)  # (tile, block, k, column)
        bits = np.stack([by_k[:, :, :16], by_k[:, :, 16:]], axis=3)  # (tile, block, line, word, column)
    elif xbits == 8:
        h = high.reshape(tiles, 2, 16, nb, 2, 4, 4)  # (tile, half, column, block, k half, line, i)
        bits = h.transpose(0, 3, 1, 5, 4, 2, 6)  # (tile, block, half, line, word, column, i)
    else:
        h = high.reshape(tiles, 2, 16, nb, 2, 8, 2)  # (tile, column half, column, block, k half, line, t)
        bits = h.transpose(0, 3, 5, 1, 4, 2, 6)  # (tile, block, line, column half, k half, column, t)
    words = np.ascontiguousarray(bits).reshape(tiles, nb, -1, 32 if xbits != 8 else 64)
    return np.packbits(words, axis=-1, bitorder="little").reshape(tiles, nb, 128)


def _float_lines(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(tile, column, block, k)`` as the float32 products read them: a line of 32 columns
    per k, k and k + 16 sharing a byte for 4 bits."""
    lines = q.transpose(0, 2, 3, 1)  # (tile, block, k, column)
    if bits == 4:
        lines = (lines[:, :, :16] & 0x0F) | ((lines[:, :, 16:] & 0x0F) << 4)
    return lines.reshape(q.shape[0], q.shape[2], -1)


def _int16_lines(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(tile, column, block, k)`` as the int16 products read them: lines of 2 consecutive k,
    4 bytes per column c of the first half: (k, c), (k, c + 16), (k + 1, c), (k + 1, c + 16); k
    and k + 16 sharing a byte for 4 bits."""
    tiles, _, nb, _ = q.shape
    if bits == 4:
        q = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
    lines = q.reshape(tiles, 2, 16, nb, -1, 2)  # (tile, half, column, block, line, k of the pair)
    return lines.transpose(0, 3, 4, 2, 5, 1).reshape(tiles, nb, -1)  # (tile, block, line, column, k, half)


def _int8_lines(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(tile, column, block, k)`` as the int8 products read them: per half of 16 columns,
    lines of 4 consecutive k per column, k and k + 16 sharing a byte for 4 bits."""
    tiles, _, nb, _ = q.shape
    q = q.reshape(tiles, 2, 16, nb, BLOCK)  # (tile, half, column, block, k)
    if bits == 4:
        q = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
    lines = q.reshape(tiles, 2, 16, nb, -1, 4)  # (..., line, byte)
    return lines.transpose(0, 3, 1, 4, 2, 5).reshape(tiles, nb, -1)  # (tile, block, half, line, column, byte)
