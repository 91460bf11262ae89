"""GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K) read in NumPy: each as affine groups of codes.

A super-block holds 256 weights of a row; ``ggml-quants.c`` dequantizes it as

* Q4_K (144 bytes): ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit scales ``sc`` and mins
  ``m``, 128 bytes of 4-bit codes: weight = ``d * sc[j] * q - dmin * m[j]`` in sub-block ``j`` of 32;
* Q5_K (176 bytes): the same, with a fifth bit of each code in 32 bytes ``qh``;
* Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, ``d``:
  weight = ``d * sc[j] * (q - 32)`` in group ``j`` of 16.

So each is a :class:`~backends.weights.QuantizedWeight`: codes ``q`` with a float32 ``scale`` and
``bias`` per group (``d * sc`` and ``-dmin * m``, or ``-32 d sc``), both exact in float32 (an
11-bit float16 significand times a 6- or 8-bit integer), which is how a backend keeps the file's
blocks (MLX's affine groups of 32 are Q4_K's and Q5_K's sub-blocks exactly).
"""

from __future__ import annotations

import numpy as np

from backends.blocks import FileBlocks
from backends.weights import BLOCK_TYPES, QuantizedWeight
from backends.weights import KQUANT_BLOCK_BYTES as BLOCK_BYTES

QK_K = 256
GROUP = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
BITS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
CODE_BITS = {**BLOCK_TYPES, **BITS}
"""The GGUF types the backends keep as codes (not float32), and their codes' bits."""


def _half(raw: np.ndarray) -> np.ndarray:
    return _half16(raw).astype(np.float32)


def _half16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.ascontiguousarray(raw).view(np.float16)[..., 0])


def _scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K super-blocks, ``s`` uint8 ``(..., 12)``."""
    s = s.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


# codes, scales, biases, then the super-blocks' fields (d, dmin, sc, m)
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, ...]]


def decode(raw: np.ndarray, type_name: str, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, biases)`` of K-quant rows ``raw`` uint8 ``(rows, cols / 256 * block)``:
    codes uint8 ``(rows, cols)``, scales and biases float32 ``(rows, cols / group)``, with
    ``weight = scale * code + bias``."""
    q, scales, biases, _ = _decode(raw, type_name, cols)
    return q, scales, biases


def weight(raw: np.ndarray, type_name: str, cols: int) -> QuantizedWeight:
    """K-quant rows ``raw`` as a :class:`~backends.weights.QuantizedWeight` (see :func:`decode`) that
    carries its super-blocks' own fields (``superblocks``, as :func:`superblocks` describes them),
    so a kernel that reads them need not search for them."""
    q, scales, biases, fields = _decode(raw, type_name, cols)
    return QuantizedWeight(q=q, scales=scales, biases=biases, bits=BITS[type_name], group=GROUP[type_name],
                           source_type=type_name, superblocks=fields)


class KQuantWeight(FileBlocks):
    """A K-quant matrix that keeps its file's super-blocks (``raw``: uint8 rows of ``cols / 256``
    blocks) and decodes them when read (:class:`~backends.blocks.FileBlocks`): a few rows at a
    time through ``take_rows``, or all at once the first time ``q``, ``scales`` or ``biases`` is
    read (MLX's affine arrays, the fallback ops). Its values are :func:`weight`'s."""

    BYTES = BLOCK_BYTES
    WEIGHTS = QK_K
    BITS = BITS
    GROUP = GROUP

    def _decode(self) -> Decoded:
        return _decode(self.raw, self.source_type, self.cols)

    @property
    def superblocks(self) -> tuple[np.ndarray, ...]:
        """The file's fields ``(d, dmin, sc, m)``, read without decoding the codes (kept)."""
        cache = self._decoded
        if 3 not in cache:
            cache[3] = _fields(self.raw, self.source_type, self.cols)
            self.release_pages()
        return cache[3]


def _fields(raw: np.ndarray, type_name: str, cols: int) -> tuple[np.ndarray, ...]:
    """The super-blocks' fields ``(d, dmin, sc, m)`` of K-quant rows ``raw``, as :func:`_decode`
    gives them, without their codes."""
    rows, nb = raw.shape[0], cols // QK_K
    b = np.ascontiguousarray(raw).reshape(rows, nb, BLOCK_BYTES[type_name])
    if type_name == "Q6_K":
        return (_half16(b[..., 208:210]), np.zeros((rows, nb), np.float16),
                np.ascontiguousarray(b[..., 192:208].view(np.int8)).reshape(rows, -1), np.zeros((rows, nb * 16), np.uint8))
    sc, m = _scales_mins(b[..., 4:16])
    return _half16(b[..., 0:2]), _half16(b[..., 2:4]), sc.reshape(rows, -1), m.reshape(rows, -1)


def _decode(raw: np.ndarray, type_name: str, cols: int) -> Decoded:
    """:func:`decode`'s three arrays, then the super-blocks' fields ``(d, dmin, sc, m)``."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a K-quant type ({', '.join(BLOCK_BYTES)})")
    if cols % QK_K:
        raise ValueError(f"a {type_name} row has a multiple of {QK_K} weights, not {cols}")
    rows = raw.shape[0]
    nb = cols // QK_K
    b = np.ascontiguousarray(raw).reshape(rows, nb, BLOCK_BYTES[type_name])
    fields = _fields(b, type_name, cols)
    if type_name == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        codes = np.empty((rows, nb, 2, 4, 32), np.uint8)  # (half of 128, quarter, l)
        for n in range(2):
            lo, hi = ql[..., 64 * n : 64 * n + 64], qh[..., 32 * n : 32 * n + 32]
            codes[:, :, n, 0] = (lo[..., :32] & 0x0F) | (((hi >> 0) & 3) << 4)
            codes[:, :, n, 1] = (lo[..., 32:] & 0x0F) | (((hi >> 2) & 3) << 4)
            codes[:, :, n, 2] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
            codes[:, :, n, 3] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
        # group g covers weights 16g..16g+15
        scales = fields[0].astype(np.float32)[..., None] * fields[2].reshape(rows, nb, 16).astype(np.float32)
        return codes.reshape(rows, cols), scales.reshape(rows, -1), (-32.0 * scales).reshape(rows, -1), fields
    d, dmin = fields[0].astype(np.float32), fields[1].astype(np.float32)
    scales = d[..., None] * fields[2].reshape(rows, nb, 8).astype(np.float32)  # (rows, nb, 8)
    biases = -(dmin[..., None] * fields[3].reshape(rows, nb, 8).astype(np.float32))
    if type_name == "Q4_K":
        qs = b[..., 16:144].reshape(rows, nb, 4, 32)  # 4 chunks of 64 weights, 32 bytes each
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (rows, nb, chunk, low/high, 32)
    else:  # Q5_K
        qh, qs = b[..., 16:48], b[..., 48:176].reshape(rows, nb, 4, 32)
        j = np.arange(4)[None, None, :, None]
        high_lo = ((qh[:, :, None, :] >> (2 * j)) & 1) << 4
        high_hi = ((qh[:, :, None, :] >> (2 * j + 1)) & 1) << 4
        codes = np.stack([(qs & 0x0F) | high_lo, (qs >> 4) | high_hi], axis=3)
    return codes.reshape(rows, cols).astype(np.uint8, copy=False), scales.reshape(rows, -1), biases.reshape(rows, -1), fields


def superblocks(type_name: str, scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """The super-block fields behind decoded ``scales`` and ``biases`` (rows of float32 groups, as
    :func:`decode` gives them): ``(d, dmin, sc, m)``, ``d`` and ``dmin`` float16 ``(rows, cols / 256)``,
    ``sc`` and ``m`` ``(rows, cols / group)`` (uint8 0..63, or for Q6_K ``sc`` int8 and ``dmin``, ``m``
    zero), such that ``scale = d * sc`` and ``bias = -dmin * m`` (Q6_K: ``-32 d sc``) exactly in
    float32, as a kernel that computes them from these fields does: found by a search, for
    matrices that come without them (the GGUF reader's carry the file's: :func:`weight`). Not always the file's own
    (``d`` and ``sc`` of even codes are also ``2 d`` and ``sc / 2``), but always its values; None
    when the groups are no such super-blocks."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a K-quant type ({', '.join(BLOCK_BYTES)})")
    scales, biases = np.asarray(scales, np.float32), np.asarray(biases, np.float32)
    rows, groups = scales.shape
    per = QK_K // GROUP[type_name]
    if groups % per:
        return None
    s = scales.reshape(rows, groups // per, per)
    if type_name == "Q6_K":
        if not np.array_equal(biases, np.float32(-32.0) * scales):
            return None
        found = _factor(s, np.array([-128] + [c for i in range(127, 0, -1) for c in (i, -i)]), -128, 127)
        if found is None:
            return None
        d, sc = found
        zero = np.zeros_like(d)
        return d, zero, sc.astype(np.int8).reshape(rows, groups), np.zeros((rows, groups), np.uint8)
    scale_part = _factor(s, np.arange(63, 0, -1), 0, 63)
    min_part = _factor(-biases.reshape(s.shape), np.arange(63, 0, -1), 0, 63)
    if scale_part is None or min_part is None:
        return None
    (d, sc), (dmin, m) = scale_part, min_part
    return d, dmin, sc.astype(np.uint8).reshape(rows, groups), m.astype(np.uint8).reshape(rows, groups)


def _factor(v: np.ndarray, candidates: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(f, c)`` with ``v == float32(f) * c`` exactly, ``f`` float16 per super-block ``(rows, blocks)``
    and ``c`` integers ``lo..hi`` ``(rows, blocks, per)``; None where no such pair exists. The
    largest value's code is tried from the largest ``candidates`` down (a quantizer gives it the
    largest code: 63, or -128), each over the super-blocks still unresolved."""
    flat = v.reshape(-1, v.shape[-1])
    f = np.zeros(flat.shape[0], np.float16)
    codes = np.zeros(flat.shape, np.int16)
    ext = flat[np.arange(flat.shape[0]), np.abs(flat).argmax(-1)].astype(np.float64)
    todo = np.flatnonzero(ext != 0)
    for c in candidates:
        if todo.size == 0:
            break
        want = ext[todo] / float(c)
        with np.errstate(over="ignore", under="ignore"):
            half = want.astype(np.float16)
        ok = np.flatnonzero((half.astype(np.float64) == want) & (half != 0))
        idx, half = todo[ok], half[ok]
        q = np.rint(flat[idx] / half.astype(np.float32)[:, None])
        good = ((q >= lo) & (q <= hi)).all(-1)
        good &= (half.astype(np.float32)[:, None] * q.astype(np.float32) == flat[idx]).all(-1)
        f[idx[good]], codes[idx[good]] = half[good], q[good].astype(np.int16)
        left = np.ones(todo.size, bool)
        left[ok[good]] = False
        todo = todo[left]
    if todo.size:
        return None
    return f.reshape(v.shape[:-1]), codes.reshape(v.shape)


def mostly_kquant(by_type: dict[str, int]) -> bool:
    """Whether quantized bytes ``by_type`` (GGUF type name -> bytes) are mostly K-quant
    super-blocks rather than the other blocks (Q4_0, Q4_1, Q8_0): a Q4_K_M file's layers are; the
    precision a backend runs them at may follow (ONNX's ``auto``), and so the figures a node times."""
    kquant = sum(n for t, n in by_type.items() if t in GROUP)
    other = sum(n for t, n in by_type.items() if t in BLOCK_TYPES)
    return kquant > other


def random_blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str, std: float) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K super-blocks (codes and 6/8-bit scales random, float16 ``d`` and
    ``dmin`` sized so the weights spread about ``std`` around 0), as uint8 rows: for timings,
    benchmarks and tests."""
    size = BLOCK_BYTES[type_name]
    nb = cols // QK_K
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)

    def half(values: np.ndarray) -> np.ndarray:
        return np.frombuffer(values.astype(np.float16).tobytes(), np.uint8).reshape(rows, nb, 2)

    if type_name == "Q6_K":  # weight = d * sc * (q - 32), sc int8, q - 32 in -32..31
        raw[..., 192:208] = rng.integers(-40, 40, (rows, nb, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = half(np.full((rows, nb), std / (40 * 18)))
    else:  # weight = d * sc * q - dmin * m, sc and m 0..63 (low bits random), q 0..15 or 0..31
        top = 15 if type_name == "Q4_K" else 31
        raw[..., 0:2] = half(np.full((rows, nb), 2 * std / (45 * top)))
        raw[..., 2:4] = half(np.full((rows, nb), std / 45))
        # each sub-block's min its scale (m = sc): weights sc * dmin * (2 q / top - 1), centred on 0
        # (independent random mins gave every sub-block its own mean: a deep random model then
        # answers one token over and over)
        raw[..., 8:12] = (raw[..., 8:12] & 0x0F) * 0x11
        raw[..., 4:8] = raw[..., 0:4]
    return raw.reshape(rows, nb * size)
