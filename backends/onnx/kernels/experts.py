"""``Experts`` (``experts.c``), exo-tui's op for a mixture of experts whose matrices stay in GGUF's
blocks: the router's top-k and each chosen expert's SwiGLU MLP, on the tiles ``QLinear`` runs.

ONNX Runtime's own CPU ``MoE`` takes float32 experts only, which is 7x a Q4_K file's bytes; its
``QMoE`` (1.32) has integer zero points, so it cannot hold Q4_1's, Q4_K's or Q5_K's float mins,
and runs its 8-bit experts on int8 activations at every accuracy level. ``Experts`` holds each
layer's experts as two stacks of ``QLinear`` tiles, ``(E, tiles, bytes)``: every expert's gate
rows then its up rows as one matrix, and its down matrix, each in the format of its file (a
layer's experts share one type: GGUF stacks them in one tensor). Per step it groups the rows by
chosen expert and runs each chosen expert once on its rows, reading only those experts' tiles.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from backends.onnx.kernels import (
    BLOCK,
    DOMAIN,
    KQUANT,
    KernelUnavailable,
    float_reference,
    integer_reference,
    kernel_format,
    op_attributes,
    pack,
    random_kquant,
)
from backends.weights import BLOCK_TYPES, QuantizedWeight, Weight

OP = "Experts"


def runs_on_experts_op(gate: list[Weight], up: list[Weight], down: list[Weight]) -> bool:
    """Whether ``Experts`` takes these experts: gate and up in one ``QLinear`` format, down in one
    (each the same for every expert), with the shapes the op needs (widths multiples of 32, of 256
    along a K-quant matrix's K)."""
    fused = {kernel_format(w) for w in (*gate, *up)}
    downs = {kernel_format(w) for w in down}
    if None in fused or None in downs or len(fused) != 1 or len(downs) != 1:
        return False
    f, h = gate[0].shape
    return f % BLOCK == 0 and h % BLOCK == 0


def expert_codes(xbits: int) -> int:
    """The integer codes (bits) ``Experts`` rounds activations to at a precision whose other
    matrices take ``xbits``: the int8 precision's experts take int16 codes. With int8 ones the
    MoE fixture's Q4_K_M file moved farther from transformers' float32 logits than llama.cpp on
    the same file (RMS 0.3343 against 0.3337); with int16 ones it is as close as with float32
    experts (0.3337), and a decode step, which reads the weights once whatever the codes, is no
    slower (:data:`backends.onnx.PRECISIONS`: int16 and int8 decode alike)."""
    return 16 if xbits == 8 else xbits


def attributes(gate: QuantizedWeight, down: QuantizedWeight) -> dict[str, int]:
    """The op's format attributes: ``bits1`` (``kquant1``) for gate/up, ``bits2`` (``kquant2``) for down."""
    a, b = op_attributes(gate), op_attributes(down)
    out = {"bits1": a["bits"], "bits2": b["bits"]}
    if "kquant" in a:
        out["kquant1"] = a["kquant"]
    if "kquant" in b:
        out["kquant2"] = b["kquant"]
    return out


def pack_experts(gate: list[QuantizedWeight], up: list[QuantizedWeight], down: list[QuantizedWeight],
                 xbits: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(W1, W2)``: each expert's gate and up rows as one ``QLinear`` matrix, and its down matrix,
    stacked over the experts ``(E, tiles, bytes)`` in the codes' layout of precision ``xbits``;
    packed one expert at a time into the result (no second copy of the layer)."""
    stacks = []
    for mats in ([[g, u] for g, u in zip(gate, up, strict=True)], [[d] for d in down]):
        first = pack(mats[0], xbits)
        out = np.empty((len(mats), first.shape[0], first.shape[1] * first.shape[2]), np.uint8)
        out[0] = first.reshape(first.shape[0], -1)
        for e in range(1, len(mats)):
            out[e] = pack(mats[e], xbits).reshape(first.shape[0], -1)
        stacks.append(out)
    return stacks[0], stacks[1]


def route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's chosen experts ``(M, k)`` (the largest softmax probability first, ties to the
    lower index) and their weights (renormalised to sum to 1 when ``norm``), in float64."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, chosen, -1)
    return chosen, w / w.sum(-1, keepdims=True) if norm else w


def reference(x: np.ndarray, logits: np.ndarray, gate: list[QuantizedWeight], up: list[QuantizedWeight],
              down: list[QuantizedWeight], k: int, norm: bool, xbits: int = 0) -> np.ndarray:
    """What ``Experts`` computes, in float64: each row through its chosen experts (the products as
    ``QLinear``'s at precision ``xbits``: :func:`~backends.onnx.kernels.integer_reference`)."""
    product = (lambda a, w: integer_reference(a.astype(np.float32), w, xbits)) if xbits else float_reference
    chosen, weights = route(logits, k, norm)
    y = np.zeros(x.shape, np.float64)
    for r in range(x.shape[0]):
        for e, w in zip(chosen[r], weights[r], strict=True):
            g, u = product(x[r : r + 1], gate[e]), product(x[r : r + 1], up[e])
            y[r] += w * product(g / (1 + np.exp(-g)) * u, down[e])[0]
    return y


def call(lib: ctypes.CDLL, x: np.ndarray, logits: np.ndarray, w1: np.ndarray, w2: np.ndarray, k: int, norm: bool,
         attrs: dict[str, int], xbits: int = 0) -> np.ndarray:
    """The library's ``Experts`` called directly (one thread, no ONNX Runtime)."""
    x, logits = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(logits, np.float32)
    (m, h), e, f = x.shape, logits.shape[1], 16 * w1.shape[1]  # w1: 2F / 32 tiles
    y = np.empty((m, h), np.float32)
    p, i = ctypes.c_void_p, ctypes.c_int64
    if lib.exo_experts(p(x.ctypes.data), p(logits.ctypes.data), p(w1.ctypes.data), p(w2.ctypes.data), p(y.ctypes.data),
                       i(m), i(e), i(h), i(f), i(k), i(int(norm)), i(attrs["bits1"]), i(attrs.get("kquant1", 0)),
                       i(attrs["bits2"]), i(attrs.get("kquant2", 0)), i(xbits)):
        raise KernelUnavailable("Experts cannot run this (no integer products in this build, or out of memory)")
    return y


def run_in_session(path: str | Path, x: np.ndarray, logits: np.ndarray, w1: np.ndarray, w2: np.ndarray, k: int,
                   norm: bool, attrs: dict[str, Any], xbits: int = 0, threads: int = 1) -> np.ndarray:
    """``Experts`` in a one-node ONNX Runtime session on ``threads`` threads; ``x`` ``(M, H)``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    h, e, f = x.shape[-1], logits.shape[-1], 16 * w1.shape[1]
    node = helper.make_node(OP, ["x", "l", "w1", "w2"], ["y"], domain=DOMAIN, H=h, F=f, k=k, norm=int(norm),
                            xbits=xbits, **attrs)
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "check",
        [helper.make_tensor_value_info("x", f32, ["m", h]), helper.make_tensor_value_info("l", f32, ["m", e])],
        [helper.make_tensor_value_info("y", f32, ["m", h])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    try:
        options.register_custom_ops_library(str(path))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, {"x": np.ascontiguousarray(x, np.float32), "l": np.ascontiguousarray(logits, np.float32)})[0]
    except Exception as exc:  # onnxruntime raises its own exception types
        raise KernelUnavailable(f"ONNX Runtime cannot use the Experts op ({exc})") from exc


def random_experts(rng: np.random.Generator, n: int, rows: int, cols: int, type_name: str) -> list[QuantizedWeight]:
    """``n`` random ``(rows, cols)`` matrices of GGUF type ``type_name``: a K-quant's super-blocks,
    or for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 codes of the type's bits with random float16 scales and
    biases (:meth:`QuantizedWeight.random`)."""
    if type_name in KQUANT:
        return [random_kquant(rng, rows, cols, type_name) for _ in range(n)]
    return [QuantizedWeight.random(rng, rows, cols, BLOCK_TYPES[type_name]) for _ in range(n)]


def check(lib: ctypes.CDLL, path: str | Path, integer: bool) -> None:
    """``Experts`` must agree with NumPy on random experts (a K-quant gate/up with a Q6_K down, and
    Q4 blocks with Q8_0), called directly and in a session; raises :class:`KernelUnavailable`."""
    rng = np.random.default_rng(1)
    for t1, t2, h, f in (("Q4_K", "Q6_K", 256, 256), ("Q4_1", "Q8_0", 64, 96)):
        e, k, m = 4, 2, 5
        gate, up = random_experts(rng, e, f, h, t1), random_experts(rng, e, f, h, t1)
        down = random_experts(rng, e, h, f, t2)
        x = rng.standard_normal((m, h)).astype(np.float32)
        logits = rng.standard_normal((m, e)).astype(np.float32)
        attrs = attributes(gate[0], down[0])
        for xbits in (0, 16) if integer else (0,):
            w1, w2 = pack_experts(gate, up, down, xbits)
            got = call(lib, x, logits, w1, w2, k, True, attrs, xbits)
            want = reference(x, logits, gate, up, down, k, True, xbits)
            if np.abs(got - want).max() > 1e-4 * np.abs(want).max():
                raise KernelUnavailable(f"the Experts op built here disagrees with NumPy ({t1} and {t2}, "
                                        f"{f'int{xbits}' if xbits else 'float32'}, off by {np.abs(got - want).max():.3g})")
            if not np.array_equal(run_in_session(path, x, logits, w1, w2, k, True, attrs, xbits), got):
                raise KernelUnavailable("the Experts op gives other results inside ONNX Runtime than called directly")
