"""How an ONNX shard runs its matrices: its precision, the kernel build, its caches' precision.

A shard's precision (``float32``, ``int16``, ``int8`` or ``auto``: :data:`backends.onnx.PRECISIONS`)
decides which build of exo-tui's ``QLinear`` kernel runs it (:func:`kernel_for`), the integer codes
its activations are rounded to (:func:`integer_codes`) and whether its KV caches are float16
(:func:`caches_half`); ``auto`` picks by the shard's quantized bytes (:func:`resolve_precision`).
"""

from __future__ import annotations

from dataclasses import fields

from backends.kquants import mostly_kquant
from backends.onnx import AUTO, PRECISIONS, kernels
from backends.weights import LazyLayers, QuantizedWeight, ShardWeights


def kernel_for(precision: str) -> kernels.Library | None:
    """The QLinear build a shard of this precision runs on, if any: float32 and int16 on any build
    (int16 on float32 products where the build has no integer products: as exact, not as fast),
    int8 on one with integer products (else it stays on MatMulNBits' int8 products)."""
    library = kernels.library()
    if library is None or precision != "int8":
        return library
    return library if library.integer else None


def resolve_precision(precision: str, weights: ShardWeights) -> str:
    """The precision a shard runs at: ``precision``, or for ``auto`` (:data:`~backends.onnx.AUTO`)
    int8 where most of the shard's quantized bytes (the file's, by type: ``stored_types``; else
    those of the weights in memory, without making a lazy layer) are K-quant super-blocks and the
    build has int8 products, int16 otherwise."""
    if precision != AUTO:
        return precision
    if kernel_for("int8") is None:
        return "int16"
    return "int8" if mostly_kquant(weights.stored_types or _quantized_bytes_in_memory(weights)) else "int16"


def _quantized_bytes_in_memory(weights: ShardWeights) -> dict[str, int]:
    made = [] if isinstance(weights.layers, LazyLayers) else [lw for lw in weights.layers if lw is not None]
    matrices = [getattr(lw, f.name) for lw in made for f in fields(lw)] + [weights.embed, weights.output]
    out: dict[str, int] = {}
    for w in (m for v in matrices for m in (v if isinstance(v, list) else [v])):
        if isinstance(w, QuantizedWeight):
            kind = w.source_type or ("Q8_0" if w.bits == 8 else "Q4_0")
            out[kind] = out.get(kind, 0) + w.nbytes
    return out


def caches_half(library: object, xbits: int) -> bool:
    """Whether a shard keeps float16 KV caches: with the kernels' integer products it does (they
    read them as float16); float32 math (products) keeps float32 caches."""
    return library is not None and xbits != 0


def integer_codes(precision: str, library: kernels.Library | None) -> int:
    """The bits of the integer codes QLinear rounds a shard's activations to (0: float32 products)."""
    return PRECISIONS[precision] if library is not None and library.integer else 0
