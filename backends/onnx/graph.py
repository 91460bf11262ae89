"""The ONNX graph of a shard: layers ``[start, end)`` of a llama model (and the head on the last
shard), written with ``onnx.helper``, one ``session.run`` per step.

Per layer::

    a      = RMSNorm(h)                                  SkipSimplifiedLayerNormalization
    qkv    = a @ [Wq; Wk; Wv].T (+ [bq; bk; bv])         QLinear or MatMulNBits (one, fused)
    (q, k  = RMSNorm per head)                           qk_norm: SimplifiedLayerNormalization
    o, K, V = Attention(qkv, past K, past V)             rotary on adjacent pairs, in-place cache,
                                                         the layer's tables, scale and window
                                                         (exo-tui's kernel, else GroupQueryAttention)
    h      = h + (RMSNorm)(o @ Wo.T)                     post_norms: the attention's output normed
    m      = RMSNorm(h)
    h      = h + (RMSNorm)((act(m @ Wg.T) * (m @ Wu.T)) @ Wd.T)
                                                         gate and up fused; silu is QuickGelu(alpha=1),
                                                         tanh-GELU is FastGelu

The residual add of each block is fused into the next norm. Layers whose rotary angles agree (see
``backends/rope.py``) share one pair of cos/sin tables. Inputs: ``hidden_in`` ``(B, T, H)``
(B requests' next T tokens: B > 1 batches decode steps of several requests, so every weight is
read once for all of them), ``seqlens_k`` ``(B,)`` int32 (each row's cached + T - 1: rows may sit
at different positions), ``total_seq_len`` scalar int32 (the largest cached + T),
``past_key_i`` / ``past_value_i`` ``(B, n_kv_heads, capacity, head_dim)`` (on exo-tui's kernel
``(S, n_kv_heads, capacity, head_dim)``, a whole pool of S cache slots, with ``slots`` ``(B,)``
int32 naming each row's: a batch is any set of the pool's requests; a windowed layer's caches
there are rings of ``window`` positions, ``(S, n_kv_heads, window, head_dim)``); on the last shard also
``logits_start`` ``(1,)`` int64 (the first position whose logits are wanted). Outputs:
``hidden_out`` or ``logits``, and ``present_key_i`` / ``present_value_i``, which the shard binds to
the same buffers as the past ones so attention appends to the cache in place.

Weights do not go into the protobuf (no serialization copy, no 2 GB protobuf limit): they are
external initializers handed to the session as NumPy-backed ``OrtValue``s.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper

from backends.base import BackendError, ModelConfig
from backends.onnx.kernels import (
    ATTENTION,
    ATTENTION_F16,
    DOMAIN,
    OP,
    gqa_window,
    kernel_format,
    op_attributes,
    pack,
    runs_on_kernel,
)
from backends.onnx.kernels.experts import OP as EXPERTS
from backends.onnx.kernels.experts import attributes as expert_attributes
from backends.onnx.kernels.experts import expert_codes, pack_experts, runs_on_experts_op
from backends.onnx.weights import (
    dense_linear,
    packed_zero_points,
    quantized_linear,
    runs_quantized,
    same_kind,
)
from backends.rope import rope_tables, table_key
from backends.weights import QuantizedWeight, ShardWeights, Weight

MS = "com.microsoft"
OPSET = 21
DENSE_HEAD_MAX_BYTES = 256 << 20  # a larger quantized head keeps one path (see _Builder.batched_head)

# QLinear's tiles of the shards alive in this process, by what they were packed from (the
# weights' source, the layer or head, the matmul, the precision), one entry per fused group: a
# shard loaded beside one that holds some of its layers (a plan change: a node's [0, 10) grows
# to [0, 15)) reads their tiles where they are, not reading, checking and packing those matrices
# again, which is most of a load (SmolLM2, 15 layers: 0.6 of 0.7 s). The tiles are read-only;
# they go with the last shard that reads them (weak references).
_Tiled = tuple[np.ndarray, int, int, dict[str, int], str]  # tiles, N, K, QLinear's attributes, format
_TILES: dict[tuple[Any, ...], tuple[tuple[weakref.ref[np.ndarray], int, int, dict[str, int], str], ...]] = {}
_TILES_LOCK = threading.Lock()
_T = TypeVar("_T")


_FORMS: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def shared_form(source: str, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """``make()``, or what a live shard of weights of ``source`` made under ``key`` (a shard's
    compact embedding: ``_TILES``' reason holds for it too). Empty ``source``: ``make()``."""
    if not source:
        return make()
    with _TILES_LOCK:
        found = _FORMS.get((source, *key))
    if found is not None:
        return found  # what make() made for this key (Any)
    made = make()
    with _TILES_LOCK, contextlib.suppress(TypeError):  # a form without weak references is not shared
        _FORMS[(source, *key)] = made
    return made


def _shared_tiles(key: tuple[Any, ...]) -> list[_Tiled] | None:
    with _TILES_LOCK:
        entry = _TILES.get(key)
        if entry is None:
            return None
        out = [(ref(), n, k, attrs, fmt) for ref, n, k, attrs, fmt in entry]
        if any(t is None for t, *_ in out):
            del _TILES[key]
            return None
    return out  # type: ignore[return-value]  # every tile is alive: checked above


def _share_tiles(key: tuple[Any, ...], made: list[_Tiled]) -> None:
    with _TILES_LOCK:
        for k in [k for k, e in _TILES.items() if any(ref() is None for ref, *_ in e)]:
            del _TILES[k]
        _TILES[key] = tuple((weakref.ref(t), n, kk, attrs, fmt) for t, n, kk, attrs, fmt in made)


@dataclass
class ShardGraph:
    """The model proto and the arrays of its external initializers.

    ``in_place``: the initializers (exo-tui's ``QLinear`` tiles: nearly all of a shard's bytes) that
    the session must read where they are, given to it with ``SessionOptions.add_initializer``;
    the proto has a one-byte placeholder for each (ONNX Runtime copies external initializers into
    buffers of its own at session creation, and those arrays would be held twice while it does,
    then once more than needed if ours stayed). ONNX Runtime's graph optimizers see placeholders
    there, which is safe only for a custom op's inputs: no optimizer of its reads them."""

    model: onnx.ModelProto
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    in_place: frozenset[str] = frozenset()
    kv_inputs: list[tuple[str, str]] = field(default_factory=list)  # (past_key_i, past_value_i)
    kv_outputs: list[tuple[str, str]] = field(default_factory=list)  # (present_key_i, present_value_i)
    output: str = "hidden_out"
    head_tiles: str | None = None  # the initializer of the output head's QLinear tiles, where it has them


def rotary_tables(config: ModelConfig, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of layer ``layer``'s angles, ``(context_length, head_dim / 2)``."""
    return rope_tables(config, layer)


class _Builder:
    def __init__(self, config: ModelConfig, accuracy_level: int, kernel: bool = False, xbits: int = 0) -> None:
        self.c = config
        self.accuracy_level = accuracy_level
        self.kernel = kernel  # GGUF's blocks (Q4_0/Q4_1/Q8_0, Q4_K/Q5_K/Q6_K) through exo-tui's QLinear
        self.xbits = xbits  # QLinear's activations as int16 or int8 codes (0: float32 products)
        self.nodes: list[onnx.NodeProto] = []
        self.arrays: dict[str, np.ndarray] = {}
        self.in_place: set[str] = set()  # arrays the session reads where they are (see ShardGraph)
        self.small: list[onnx.TensorProto] = []
        self._n = 0
        self._blocksums: dict[tuple[str, int], str] = {}
        self._indicators: dict[tuple[int, int], str] = {}
        self.source = ""  # ShardWeights.source: where empty, nothing is shared (_TILES)
        self.part: Any = None  # the layer (its index in the model) or "head" being built

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def node(self, op: str, inputs: list[str], stem: str, domain: str = "", n_out: int = 1, **attrs) -> list[str]:
        outs = [self.name(stem) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(op), domain=domain, **attrs))
        return outs

    def weight(self, stem: str, array: np.ndarray) -> str:
        """A graph initializer from an array the builder made (never the caller's own memory)."""
        name = self.name(stem)
        self.arrays[name] = np.ascontiguousarray(array)
        return name

    def const(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.small.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    # ------------------------------------------------------------------ blocks

    def rms_norm(self, x: str, weight: np.ndarray, skip: str | None = None) -> tuple[str, str]:
        """``(normed, residual_sum)``: RMSNorm of ``x + skip`` (or of ``x``) and that sum."""
        w = self.weight("norm_w", np.array(weight, dtype=np.float32, copy=True))
        if skip is None:
            (y,) = self.node("SimplifiedLayerNormalization", [x, w], "normed", axis=-1, epsilon=self.c.rms_eps)
            return y, x
        y, _, _, s = self.node(
            "SkipSimplifiedLayerNormalization", [x, skip, w], "normed", domain=MS, n_out=4, epsilon=self.c.rms_eps
        )
        return y, s

    def norm(self, x: str, weight: np.ndarray) -> str:
        """RMSNorm of ``x`` over its last axis."""
        w = self.weight("norm_w", np.array(weight, dtype=np.float32, copy=True))
        return self.node("SimplifiedLayerNormalization", [x, w], "normed", axis=-1, epsilon=self.c.rms_eps)[0]

    def head_norms(self, qkv: str, q_norm: np.ndarray, k_norm: np.ndarray, stem: str) -> str:
        """``qkv`` ``(B, T, (H + 2G) D)`` with each q and k head RMS-normed over its ``D``."""
        c = self.c
        qd, kd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        split = self.const("qkv_split", np.array([qd, kd, kd], dtype=np.int64))
        q, k, v = self.node("Split", [qkv, split], f"{stem}_split", n_out=3, axis=-1)
        heads = self.const("by_head", np.array([0, 0, -1, c.head_dim], dtype=np.int64))
        flat = self.const("by_row", np.array([0, 0, -1], dtype=np.int64))
        parts = []
        for x, w in ((q, q_norm), (k, k_norm)):
            (x4,) = self.node("Reshape", [x, heads], f"{stem}_heads")
            parts.append(self.node("Reshape", [self.norm(x4, w), flat], f"{stem}_rows")[0])
        return self.node("Concat", [*parts, v], f"{stem}_normed", axis=-1)[0]

    def experts(self, x: str, lw, stem: str) -> str:
        """A mixture of experts over ``x`` ``(B, T, H)``: the router's logits, then on the kernel
        exo-tui's ``Experts`` with the experts in their file's blocks (:mod:`backends.onnx.kernels.experts`),
        else ONNX Runtime's ``MoE`` (softmax over the router's logits, the top k, renormalised
        when the config says; each chosen expert's SwiGLU MLP once for all the rows routed to it),
        whose CPU kernel takes float32 experts, gate and up rows interleaved (``swiglu_fusion=1``):
        quantized experts are dequantized there, one layer at a time (a float file's are float32
        already)."""
        c = self.c
        h, f = c.hidden_size, c.expert_width
        router = self.weight(f"{stem}_router", dense_linear([lw.router]))
        if self.kernel and runs_on_experts_op(lw.experts_gate, lw.experts_up, lw.experts_down):
            (logits,) = self.node("MatMul", [x, router], f"{stem}_router_logits")
            xbits = expert_codes(self.xbits)
            w1, w2 = pack_experts(lw.experts_gate, lw.experts_up, lw.experts_down, xbits)
            attrs = expert_attributes(lw.experts_gate[0], lw.experts_down[0])
            return self.node(EXPERTS, [x, logits, self.weight(f"{stem}_exps_gate_up", w1),
                                       self.weight(f"{stem}_exps_down", w2)], f"{stem}_experts", domain=DOMAIN,
                             H=h, F=f, k=c.n_experts_used, norm=int(c.expert_weights_norm), xbits=xbits,
                             **attrs)[0]
        rows = self.const("moe_rows", np.array([-1, h], dtype=np.int64))
        (flat,) = self.node("Reshape", [x, rows], f"{stem}_moe_in")
        (logits,) = self.node("MatMul", [flat, router], f"{stem}_router_logits")
        fc1 = np.empty((c.n_experts, 2 * f, h), np.float32)
        fc2 = np.empty((c.n_experts, h, f), np.float32)
        for e in range(c.n_experts):
            fc1[e, 0::2] = dense_linear([lw.experts_gate[e]]).T
            fc1[e, 1::2] = dense_linear([lw.experts_up[e]]).T
            fc2[e] = dense_linear([lw.experts_down[e]]).T
        (y,) = self.node(
            "MoE", [flat, logits, self.weight(f"{stem}_fc1", fc1), "", self.weight(f"{stem}_fc2", fc2)],
            f"{stem}_moe", domain=MS, k=c.n_experts_used, activation_type="swiglu", swiglu_fusion=1,
            activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=int(c.expert_weights_norm),
        )
        (shape,) = self.node("Shape", [x], f"{stem}_moe_shape")
        return self.node("Reshape", [y, shape], f"{stem}_moe_out")[0]

    def linear(self, x: str, weights: list[Weight], stem: str) -> str:
        """``x @ concat(weights).T``; matrices of one kind run as one fused op. On the kernel, a
        matmul whose tiles a live shard of the same source holds reads them (``_TILES``)."""
        key = (self.source, self.part, stem.split("_", 1)[-1], self.xbits)
        shared = _shared_tiles(key) if self.kernel and self.source else None
        if shared is not None:
            outs = [self._tiled(x, stem, *t) for t in shared]
        else:
            # each matrix's format, found once (it reads the matrix's scales and biases)
            formats = [kernel_format(w) if self.kernel else None for w in weights]
            groups: list[list[int]] = []
            for i, w in enumerate(weights):
                if groups and same_kind(weights[groups[-1][0]], w) and formats[groups[-1][0]] == formats[i]:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            made: list[_Tiled] = []
            outs = [self._linear_group(x, [weights[i] for i in g], stem, made, formats[g[0]]) for g in groups]
            if self.source and made and len(made) == len(groups):
                _share_tiles(key, made)
        if len(outs) == 1:
            return outs[0]
        return self.node("Concat", outs, stem, axis=-1)[0]

    def _tiled(self, x: str, stem: str, blocks: np.ndarray, n: int, k: int, attributes: dict[str, int], fmt: str) -> str:
        """``x`` through ``QLinear`` over packed ``blocks`` (``N`` x ``K``), read in place."""
        w = self.weight(f"{stem}_{fmt.lower()}", blocks)
        self.in_place.add(w)
        return self.node(OP, [x, w], stem, domain=DOMAIN, K=k, N=n, xbits=self.xbits, **attributes)[0]

    def _linear_group(self, x: str, weights: list[Weight], stem: str, made: list[_Tiled], fmt: str | None) -> str:
        """One fused matmul of matrices of one format (``fmt``: their kernel format, None where
        the kernel does not run them); on the kernel its tiles are added to ``made``."""
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        if self.kernel and fmt is not None:  # one format: see linear
            blocks = pack(quantized, self.xbits)  # a kernel format: quantized, every one
            n, k = sum(w.shape[0] for w in quantized), quantized[0].shape[1]
            made.append((blocks, n, k, op_attributes(quantized[0]), fmt))
            return self._tiled(x, stem, *made[-1])
        if not runs_quantized(weights[0]):
            w = self.weight(f"{stem}_w", dense_linear(weights))
            return self.node("MatMul", [x, w], stem)[0]
        if len(quantized) != len(weights):
            raise BackendError(f"{stem}: one matmul over dense and quantized matrices")
        ql = quantized_linear(quantized)
        outs = []
        for part in ql.parts:
            b = self.weight(f"{stem}_q", part.packed)
            s = self.weight(f"{stem}_s", part.scales)
            inputs = [x, b, s]
            if part.zero_point != 8:  # 8 is MatMulNBits' default
                zp = packed_zero_points(ql.n, ql.k // ql.group, part.zero_point)
                inputs.append(self.weight(f"{stem}_zp", zp))
            outs += self.node(
                "MatMulNBits", inputs, stem, domain=MS,
                K=ql.k, N=ql.n, bits=4, block_size=ql.group, accuracy_level=self.accuracy_level,
            )
        if ql.correction is not None:
            c = self.weight(f"{stem}_c", np.ascontiguousarray(ql.correction.T))
            outs += self.node("MatMul", [self.blocksum(x, ql.k, ql.group), c], f"{stem}_corr")
        y = outs[0]
        for other in outs[1:]:
            y = self.node("Add", [y, other], stem)[0]
        return y

    def batched_head(self, x: str, output: Weight, min_rows: int) -> None:
        """``logits = x @ output.T`` two ways, chosen per run by an ``If`` on the row count.

        One row takes ``MatMulNBits`` on the quantized codes (a quarter or half the bytes of
        float32, the fastest path for a single decode step). Many rows take a dense float32 copy
        through SGEMM: on the multi-row path ``MatMulNBits`` re-dequantizes the whole vocabulary
        per run (SmolLM2's 49152 × 576 Q8_0 head: 10 ms for 8 rows against 4.4 ms dense), while
        dense rows cost little more than one. Both are float32 math on the same dequantized values."""
        rows = self.node("Shape", [x], "head_rows", start=0, end=2)[0]
        (n,) = self.node("ReduceProd", [rows], "head_n", keepdims=0)
        threshold = self.const("head_min_rows", np.array(min_rows, dtype=np.int64))
        (cond,) = self.node("GreaterOrEqual", [n, threshold], "head_batched")
        mark = len(self.nodes)
        quantized = self.linear(x, [output], "head")
        else_nodes, self.nodes = self.nodes[mark:], self.nodes[:mark]
        w = self.weight("head_dense", dense_linear([output]))
        dense_out = self.name("head_dense_out")
        then_nodes = [helper.make_node("MatMul", [x, w], [dense_out], name=self.name("MatMul"))]
        out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
        self.nodes.append(helper.make_node(
            "If", [cond], ["logits"], name=self.name("If"),
            then_branch=helper.make_graph(then_nodes, "head_dense", [], [out(dense_out)]),
            else_branch=helper.make_graph(else_nodes, "head_quantized", [], [out(quantized)]),
        ))

    def blocksum(self, x: str, k: int, group: int) -> str:
        """Sums of ``x`` ``(B, T, k)`` over blocks of ``group`` along its last axis: ``(B, T, k // group)``.

        One ``MatMul`` against a 0/1 block-indicator matrix (shared by every layer) rather than
        ``Reshape`` + ``ReduceSum``: the same float32 sums (each product is ``x * 1.0`` or ``x * 0.0``,
        exact), one op instead of two, and SGEMM's kernel instead of the generic reduction — a
        decode step of SmolLM2 (120 of these) measured 0.4 ms faster of ~12.5."""
        key = (x, group)
        if key not in self._blocksums:
            if (k, group) not in self._indicators:
                blocks = np.arange(k) // group
                self._indicators[(k, group)] = self.weight(
                    "block_ones", (blocks[:, None] == np.arange(k // group)[None, :]).astype(np.float32)
                )
            self._blocksums[key] = self.node("MatMul", [x, self._indicators[(k, group)]], "blocksum")[0]
        return self._blocksums[key]


def _dense_bytes(w: Weight) -> int:
    rows, cols = w.shape
    return int(rows) * int(cols) * 4


def build_shard_graph(
    config: ModelConfig, weights: ShardWeights, accuracy_level: int = 1, batch_head_rows: int = 0,
    kernel: bool = False, xbits: int = 0, half_kv: bool = False,
) -> ShardGraph:
    """The ONNX graph of ``weights``' layers; ``accuracy_level`` (``MatMulNBits``') 1 is float32
    math, 4 int8.

    ``kernel``: exo-tui's kernels (:mod:`backends.onnx.kernels`; the session must load their
    library): 4- and 8-bit matrices in GGUF's blocks of 32 and its K-quants' super-blocks on
    ``QLinear``, matrices fused only within one format (the rest on ``MatMulNBits``) and attention on ``Attention``; else ``MatMulNBits`` and ``GroupQueryAttention``.
    ``xbits`` 16 or 8: ``QLinear`` rounds its activations to int16 or int8 codes (0: float32).
    ``half_kv`` (with ``kernel``): the KV caches are float16, on ``AttentionF16``.

    ``batch_head_rows`` > 0: on the last shard, runs of at least that many rows (batched decode)
    take a dense float32 copy of a quantized output head (see :meth:`_Builder.batched_head`).
    ``weights.disposable``: each layer is dropped from ``weights`` once its arrays are made."""
    c = config
    is_last = weights.end == c.n_layers
    b = _Builder(c, accuracy_level, kernel, xbits)
    b.source = weights.source
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("hidden_in", f32, ["batch", "seq", c.hidden_size]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_seq_len", TensorProto.INT32, []),
    ]
    outputs = []
    graph = ShardGraph(helper.make_model(helper.make_graph([], "empty", [], [])))
    tables: dict[tuple[float, bool], tuple[str, str]] = {}
    kv_shape = ["slots" if kernel else "batch", c.n_kv_heads, "capacity", c.head_dim]
    if kernel:
        inputs.append(helper.make_tensor_value_info("slots", TensorProto.INT32, ["batch"]))
    half_kv = kernel and half_kv
    kv_type = TensorProto.FLOAT16 if half_kv else f32

    h, skip = "hidden_in", None
    for i in range(len(weights.layers)):  # by index: an iterator would hold the last layer while it makes the next
        lw = weights.layers[i]
        layer = b.part = weights.start + i
        key = table_key(c, layer)
        if key not in tables:
            cos, sin = rotary_tables(c, layer)
            tables[key] = (b.weight("rope_cos", cos), b.weight("rope_sin", sin))
        cos_name, sin_name = tables[key]
        a, h = b.rms_norm(h, lw.attn_norm, skip)
        qkv = b.linear(a, [lw.wq, lw.wk, lw.wv], f"l{i}_qkv")
        if lw.bq is not None:
            bias = b.weight(f"l{i}_qkv_bias", np.concatenate([lw.bq, lw.bk, lw.bv]).astype(np.float32))
            (qkv,) = b.node("Add", [qkv, bias], f"l{i}_qkv_b")
        if lw.q_norm is not None:
            if lw.k_norm is None:
                raise BackendError(f"layer {i} has a q_norm without a k_norm")
            qkv = b.head_norms(qkv, lw.q_norm, lw.k_norm, f"l{i}_qk")
        pk, pv, ok, ov = f"past_key_{i}", f"past_value_{i}", f"present_key_{i}", f"present_value_{i}"
        shape = kv_shape if not (kernel and c.windowed(layer)) else [kv_shape[0], c.n_kv_heads, "window", c.head_dim]
        inputs += [helper.make_tensor_value_info(n, kv_type, shape) for n in (pk, pv)]
        outputs += [helper.make_tensor_value_info(n, kv_type, shape) for n in (ok, ov)]
        graph.kv_inputs.append((pk, pv))
        graph.kv_outputs.append((ok, ov))
        attn = b.name(f"l{i}_attn")
        rest = ["seqlens_k", "total_seq_len", cos_name, sin_name]
        if kernel:  # exo-tui's own: the same math, a batch's rows at the cost of each alone
            op, domain, ins = ATTENTION_F16 if half_kv else ATTENTION, DOMAIN, [qkv, pk, pv, *rest, "slots"]
            extra: dict[str, Any] = {"scale": float(c.query_scale), "window": c.window(layer)}
        else:
            op, domain, ins = "GroupQueryAttention", MS, [qkv, "", "", pk, pv, *rest]
            extra = {"scale": float(c.query_scale), "do_rotary": 1, "rotary_interleaved": 1,
                     "local_window_size": gqa_window(c.window(layer))}
        b.nodes.append(helper.make_node(op, ins, [attn, ok, ov], name=b.name(op), domain=domain,
                                        num_heads=c.n_heads, kv_num_heads=c.n_kv_heads, **extra))
        o = b.linear(attn, [lw.wo], f"l{i}_o")
        if lw.attn_post_norm is not None:
            o = b.norm(o, lw.attn_post_norm)
        m, h = b.rms_norm(h, lw.ffn_norm, o)
        if c.n_experts:
            skip = b.experts(m, lw, f"l{i}")
            if lw.ffn_post_norm is not None:
                skip = b.norm(skip, lw.ffn_post_norm)
            if weights.disposable:
                weights.layers[i] = None  # type: ignore[call-overload]  # its arrays are built; see ShardWeights
                del lw
            continue
        if lw.w_gate is None or lw.w_up is None or lw.w_down is None:
            raise BackendError(f"layer {i} has neither experts nor its gate, up and down matrices")
        gu = b.linear(m, [lw.w_gate, lw.w_up], f"l{i}_gateup")
        split = b.const("split", np.array([c.intermediate_size, c.intermediate_size], dtype=np.int64))
        g, u = b.node("Split", [gu, split], f"l{i}_gu", n_out=2, axis=-1)
        if c.activation == "gelu_tanh":
            (act,) = b.node("FastGelu", [g], f"l{i}_gelu", domain=MS)
        else:
            (act,) = b.node("QuickGelu", [g], f"l{i}_silu", domain=MS, alpha=1.0)
        (act,) = b.node("Mul", [act, u], f"l{i}_act")
        skip = b.linear(act, [lw.w_down], f"l{i}_down")
        if lw.ffn_post_norm is not None:
            skip = b.norm(skip, lw.ffn_post_norm)
        if weights.disposable:
            weights.layers[i] = None  # type: ignore[call-overload]  # its arrays are built; see ShardWeights
            del lw  # else it lives on while the next layer is read (decoded whole, a layer is ~2.3x its file bytes)

    if is_last:
        b.part = "head"
        if weights.norm is None or weights.output is None:
            raise ValueError("the last shard needs the final norm and the output matrix")
        normed, _ = b.rms_norm(h, weights.norm, skip)
        inputs.append(helper.make_tensor_value_info("logits_start", TensorProto.INT64, [1]))
        end = b.const("slice_end", np.array([np.iinfo(np.int64).max], dtype=np.int64))
        axis = b.const("slice_axis", np.array([1], dtype=np.int64))
        (tail,) = b.node("Slice", [normed, "logits_start", end, axis], "tail")
        # On the kernel a quantized head needs no dense copy: its rows batch well (SmolLM2's Q8_0
        # head, steps of 2 / 4 / 8 / 16 rows: as fast or faster than with the copy, 113 MB less).
        on_kernel = kernel and runs_on_kernel(weights.output)
        if (batch_head_rows and runs_quantized(weights.output) and not on_kernel
                and _dense_bytes(weights.output) <= DENSE_HEAD_MAX_BYTES):
            b.batched_head(tail, weights.output, batch_head_rows)
        else:
            logits = b.linear(tail, [weights.output], "head")
            if on_kernel:
                graph.head_tiles = b.nodes[-1].input[1]
            b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits_out"))
        if c.logit_softcap:  # logits = cap * tanh(logits / cap)
            b.nodes[-1].output[0] = "raw_logits"
            cap = b.const("softcap", np.array(c.logit_softcap, dtype=np.float32))
            (scaled,) = b.node("Div", ["raw_logits", cap], "capped")
            (bent,) = b.node("Tanh", [scaled], "capped")
            b.nodes.append(helper.make_node("Mul", [bent, cap], ["logits"], name="softcap_out"))
        outputs.insert(0, helper.make_tensor_value_info("logits", f32, ["batch", "tail", c.vocab_size]))
        graph.output = "logits"
    else:
        if skip is None:
            raise BackendError("a shard with no layers has no hidden state to send on")
        b.nodes.append(helper.make_node("Add", [h, skip], ["hidden_out"], name="hidden_out"))
        outputs.insert(0, helper.make_tensor_value_info("hidden_out", f32, ["batch", "seq", c.hidden_size]))

    external = []
    for name, arr in b.arrays.items():
        if name in b.in_place:
            external.append(onnx.numpy_helper.from_array(np.zeros(1, arr.dtype), name))
            continue
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = "location", f"mem/{name}"
        external.append(t)
    g = helper.make_graph(
        b.nodes, f"llama_{weights.start}_{weights.end}", inputs, outputs, initializer=external + b.small
    )
    graph.model = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)]
        + ([helper.make_opsetid(DOMAIN, 1)] if kernel else []),
        producer_name="exo-tui",
    )
    graph.model.ir_version = 10
    graph.initializers = b.arrays
    graph.in_place = frozenset(b.in_place)
    return graph
