"""A quantized matrix's scales and biases on MLX, held in the smallest form that gives them exactly
(:class:`GroupScales`: a K-quant's own super-block fields, the other blocks' float16, float32
otherwise) and made float32 as each product runs; and how a matrix's form is picked as its rows
are converted a chunk at a time (:class:`ScaleStaging`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from backends.kquants import superblocks as find_superblocks
from backends.weights import KQUANT_BLOCK_BYTES, QuantizedWeight


class GroupScales:
    """A quantized matrix's float32 scale and bias a group, held in the smallest form that gives
    them exactly, and made from it (a few elementwise ops, fused in a compiled step) as a product
    runs. :func:`~backends.mlx.quant.to_mlx` picks the form a matrix's values allow (:func:`chunk_form`):

    * a K-quant's own fields: ``scale = d * sc`` and ``bias = nd * m`` with ``d`` and ``nd``
      (``-dmin``) float16 a super-block of 256 and ``sc``, ``m`` integers a group (6-bit, Q6_K's
      ``sc`` int8): 2 bytes a Q4_K or Q5_K group of 32 and 4 a super-block; Q6_K 1 a group of 16
      and 2 a super-block;
    * float16 where every value is one (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks): 2 bytes a
      group each;
    * float32 otherwise (matrices made in memory).

    ``bias`` None: the bias is implied, ``-offset * scale`` with ``offset = 2**(bits - 1)`` (Q4_0's
    ``-8 d``, Q5_0's ``-16 d``, Q8_0's ``-128 d``, Q6_K's ``-32 d sc``), and not held. Each array
    has the matrix's rows as its leading axes, so :meth:`map` takes rows, a row block or experts of
    all at once.
    """

    def __init__(self, scale: mx.array, bias: mx.array | None, offset: float, scale_codes: mx.array | None = None,
                 bias_codes: mx.array | None = None) -> None:
        self.scale = scale  # (..., groups) float32 / float16, or (..., super-blocks) float16 with scale_codes
        self.bias = bias  # likewise (nd with bias_codes), or None: implied
        self.offset = offset
        self.scale_codes = scale_codes  # (..., groups) uint8 / int8, or None
        self.bias_codes = bias_codes

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.scale, self.bias, self.scale_codes, self.bias_codes) if a is not None]

    def map(self, fn: Callable[[mx.array], mx.array]) -> GroupScales:
        """The same form with ``fn`` (an indexing or a reshape of the leading axes) on each array."""
        def f(a: mx.array | None) -> mx.array | None:
            return None if a is None else fn(a)

        return GroupScales(fn(self.scale), f(self.bias), self.offset, f(self.scale_codes), f(self.bias_codes))

    def scales(self) -> mx.array:
        """The float32 scales ``(..., groups)``."""
        return widen(self.scale, self.scale_codes)

    def biases(self) -> mx.array | None:
        """The float32 biases ``(..., groups)``, or None where implied (``-offset * scale``)."""
        return None if self.bias is None else widen(self.bias, self.bias_codes)

    def pair(self) -> tuple[mx.array, mx.array]:
        """Scales and biases, an implied bias made, as MLX's quantized products take them."""
        scales, biases = self.scales(), self.biases()
        return scales, (scales * -self.offset if biases is None else biases)


Arrays = TypeVar("Arrays", mx.array, np.ndarray)  # widen works on either library's


def widen(base: Arrays, codes: Arrays | None, float32: Any = mx.float32) -> Arrays:
    """Float32 values a group: ``base`` itself, or ``base`` (one a super-block) times ``codes``
    (one a group), both exact in float32 (an 11-bit significand times an 8-bit integer). On MLX
    arrays, or on NumPy's with ``float32=np.float32``."""
    if codes is None:
        return base if base.dtype == float32 else base.astype(float32)
    *lead, groups = codes.shape
    blocks = base.shape[-1]
    per = codes.astype(float32).reshape(*lead, blocks, groups // blocks)
    return (base.astype(float32)[..., None] * per).reshape(*lead, groups)


def chunk_form(part: QuantizedWeight, offset: float) -> dict[str, np.ndarray | None]:
    """Rows ``part``'s scales and biases in the smallest exact form (:class:`GroupScales`' fields, NumPy)."""
    scales, biases = np.asarray(part.scales, np.float32), np.asarray(part.biases, np.float32)
    implied = np.array_equal(biases, np.float32(-offset) * scales)
    if part.source_type in KQUANT_BLOCK_BYTES:
        fields = part.superblocks
        if fields is None:  # a matrix made in memory: its super-blocks, where its groups are such
            fields = find_superblocks(part.source_type, scales, biases)
        if fields is not None:
            d, dmin, sc, m = fields
            nd = np.negative(dmin)  # float16: exact
            if np.array_equal(widen(d, sc, np.float32), scales) and (implied or np.array_equal(widen(nd, m, np.float32), biases)):
                return {"scale": d, "bias": None if implied else nd, "scale_codes": sc,
                        "bias_codes": None if implied else m}
    with np.errstate(over="ignore"):
        s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
    if np.array_equal(s16.astype(np.float32), scales):
        if implied:
            return {"scale": s16, "bias": None, "scale_codes": None, "bias_codes": None}
        if np.array_equal(b16.astype(np.float32), biases):
            return {"scale": s16, "bias": b16, "scale_codes": None, "bias_codes": None}
    return {"scale": scales, "bias": None if implied else biases, "scale_codes": None, "bias_codes": None}


class ScaleStaging:
    """A matrix's scales and biases as they are made a chunk of rows at a time, in the form of the
    first chunk (its arrays allocated for all rows then); a chunk in another form turns the whole
    into float32 with its biases (every form widens to it exactly)."""

    def __init__(self, rows: int, offset: float) -> None:
        self.rows = rows
        self.offset = offset
        self.arrays: dict[str, np.ndarray | None] | None = None

    def add(self, start: int, form: dict[str, np.ndarray | None]) -> None:
        codes = form["scale_codes"]
        n = len(codes if codes is not None else _required(form, "scale"))
        if self.arrays is None:
            self.arrays = {k: None if v is None else np.empty((self.rows, *v.shape[1:]), v.dtype)
                           for k, v in form.items()}
        elif any(not _same_form(a, form[k]) for k, a in self.arrays.items()):
            self.arrays = self._as_float(self.arrays, start, self.rows)
            form = self._as_float(form, n, None)
        for k, v in form.items():
            target = self.arrays[k]
            if v is not None and target is not None:
                target[start : start + n] = v

    def _as_float(self, form: dict[str, np.ndarray | None], done: int, rows: int | None) -> dict[str, np.ndarray | None]:
        """``form``'s first ``done`` rows as float32 scales and biases (``rows`` of them allocated,
        None: as many as ``done``)."""
        def rows_of(name: str) -> np.ndarray | None:
            v = form[name]
            return None if v is None else v[:done]

        scales = widen(_required(form, "scale")[:done], rows_of("scale_codes"), np.float32)
        biases = (-self.offset * scales if form["bias"] is None
                  else widen(_required(form, "bias")[:done], rows_of("bias_codes"), np.float32))
        if rows is None:
            return {"scale": scales, "bias": biases.astype(np.float32), "scale_codes": None, "bias_codes": None}
        all_scales = np.empty((rows, scales.shape[1]), np.float32)
        all_biases = np.empty((rows, scales.shape[1]), np.float32)
        all_scales[:done], all_biases[:done] = scales, biases
        return {"scale": all_scales, "bias": all_biases, "scale_codes": None, "bias_codes": None}

    def result(self) -> GroupScales:
        a = self.arrays
        assert a is not None, "no rows staged"
        def held(name: str) -> mx.array | None:
            v = a[name]
            return None if v is None else mx.array(v)

        return GroupScales(mx.array(_required(a, "scale")), held("bias"), self.offset, held("scale_codes"),
                           held("bias_codes"))


def _required(form: dict[str, np.ndarray | None], name: str) -> np.ndarray:
    v = form[name]
    if v is None:
        raise ValueError(f"a scale form without its {name}")
    return v


def _same_form(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether two of a form's arrays are held alike (both absent, or of one dtype and row shape)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype, a.shape[1:]) == (b.dtype, b.shape[1:])
