"""The weights a backend is handed: quantized matrices, a layer's tensors, a shard's.

:class:`QuantizedWeight` is a matrix in GGUF's affine blocks (kept so by both backends where they
can); :class:`LayerWeights` one transformer block's tensors; :class:`ShardWeights` a shard's, its
layers made one at a time where they come from a file (:class:`LazyLayers`). The checks here say,
before a backend builds anything, which tensor does not fit the :class:`~backends.base.ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field

import numpy as np

from backends.base import BackendError, ModelConfig

KQUANT_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # per 256 weights (backends/kquants.py)
BLOCK_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}  # GGUF's blocks of 32 read as codes (their bits) and affine groups


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``(rows, cols)`` matrix in affine-quantized blocks of ``group`` along ``cols``.

    ``w[r, c] = scales[r, c // group] * q[r, c] + biases[r, c // group]`` with ``q`` an unsigned
    code in ``0 .. 2**bits - 1``. GGUF's block formats map onto this exactly:

    * Q4_0: ``w = d * (q - 8)``            -> bits 4, scale ``d``, bias ``-8 d``
    * Q4_1: ``w = d * q + m``              -> bits 4, scale ``d``, bias ``m``
    * Q5_0, Q5_1: as Q4_0, Q4_1, 5-bit     -> bits 5, bias ``-16 d`` / ``m``
    * Q8_0: ``w = d * s`` with s signed    -> bits 8, q = s + 128, scale ``d``, bias ``-128 d``
    * Q4_K / Q5_K: sub-blocks of 32        -> bits 4 / 5, scale ``d * sc``, bias ``-dmin * m``
    * Q6_K: groups of 16                   -> bits 6, group 16, scale ``d * sc``, bias ``-32 d sc``

    (the K-quants' scales are exact in float32, not in float16: :mod:`backends.kquants`).

    This is MLX's affine quantization (``mx.quantize`` layout) and, with a zero-point
    correction, ONNX Runtime's ``MatMulNBits``.
    """

    q: np.ndarray  # uint8 (rows, cols), one code per element (not packed)
    scales: np.ndarray  # float32 (rows, cols // group)
    biases: np.ndarray  # float32 (rows, cols // group)
    bits: int
    group: int = 32
    source_type: str = ""  # the GGUF type it came from, for display ("Q4_1")
    # A K-quant's super-block fields as the file has them, ``(d, dmin, sc, m)``, each with one row
    # per row of ``q`` (see backends/kquants.py); None where the matrix came without them.
    superblocks: tuple[np.ndarray, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def take_rows(self, rows: slice | np.ndarray) -> QuantizedWeight:
        """The matrix of rows ``rows`` (a slice, or indices in any order), fields and all."""
        def pick(a: np.ndarray) -> np.ndarray:
            return a[rows] if isinstance(rows, slice) else np.ascontiguousarray(a[rows])

        fields = None if self.superblocks is None else tuple(pick(f) for f in self.superblocks)
        return QuantizedWeight(q=pick(self.q), scales=pick(self.scales), biases=pick(self.biases), bits=self.bits,
                               group=self.group, source_type=self.source_type, superblocks=fields)

    def release_pages(self) -> None:
        """Let go of the file's pages under this matrix's bytes, where it is kept over a mapped
        file (:class:`backends.kquants.KQuantWeight`); nothing for one in its own memory."""

    @property
    def nbytes(self) -> int:
        """Bytes this weight takes as quantized blocks (what a node must hold): codes, and float16
        scales and biases (the K-quants': their super-blocks' bytes)."""
        rows, cols = self.shape
        if self.source_type in KQUANT_BLOCK_BYTES:
            return rows * cols // 256 * KQUANT_BLOCK_BYTES[self.source_type]
        return rows * cols * self.bits // 8 + self.scales.nbytes // 2 + self.biases.nbytes // 2

    @classmethod
    def random(cls, rng: np.random.Generator, rows: int, cols: int, bits: int = 4, half: bool = True) -> QuantizedWeight:
        """Random codes in blocks of 32 with positive scales and negative biases, for probes,
        benchmarks and tests. ``half``: scales and biases exact in float16, as GGUF's blocks have
        them, so a backend runs the matrix the way it runs a model's (ONNX's kernel takes only
        such blocks: a float32-scaled benchmark once timed its slower fallback instead)."""
        q = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
        scales = rng.random((rows, cols // 32)) * {4: 0.1, 5: 0.05}.get(bits, 0.006)  # the top code about 1.5 over the bias
        biases = -rng.random((rows, cols // 32))
        if half:
            scales, biases = scales.astype(np.float16), biases.astype(np.float16)
        return cls(q=q, scales=scales.astype(np.float32), biases=biases.astype(np.float32), bits=bits)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Float32 rows ``[start, stop)`` (all by default), made in place: one array of the
        result's size, not three (a 49152 x 576 head is 113 MB each)."""
        q = self.q[start:stop]
        rows, cols = q.shape
        w = q.reshape(rows, cols // self.group, self.group).astype(np.float32)
        w *= self.scales[start:stop, :, None]
        w += self.biases[start:stop, :, None]
        return w.reshape(rows, cols)


Weight = np.ndarray | QuantizedWeight
"""A dense float32/float16 matrix or a quantized one."""


def dense(w: Weight) -> np.ndarray:
    """The float32 value of a weight."""
    if isinstance(w, QuantizedWeight):
        return w.dequantize()
    return np.asarray(w, dtype=np.float32)


def weight_nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else int(np.asarray(w).nbytes)


@dataclass
class LayerWeights:
    """One transformer block. Norm weights and biases are float32 vectors; the rest are matrices.
    The optional parts are there exactly when the model's config asks for them (``qkv_bias``,
    ``qk_norm``, ``post_norms``)."""

    attn_norm: np.ndarray
    wq: Weight  # (n_heads * head_dim, hidden)
    wk: Weight  # (n_kv_heads * head_dim, hidden)
    wv: Weight  # (n_kv_heads * head_dim, hidden)
    wo: Weight  # (hidden, n_heads * head_dim)
    ffn_norm: np.ndarray
    w_gate: Weight | None = None  # (intermediate, hidden); None in a mixture-of-experts layer
    w_up: Weight | None = None  # (intermediate, hidden)
    w_down: Weight | None = None  # (hidden, intermediate)
    bq: np.ndarray | None = None  # (n_heads * head_dim,)
    bk: np.ndarray | None = None  # (n_kv_heads * head_dim,)
    bv: np.ndarray | None = None  # (n_kv_heads * head_dim,)
    q_norm: np.ndarray | None = None  # (head_dim,), shared by the heads
    k_norm: np.ndarray | None = None  # (head_dim,)
    attn_post_norm: np.ndarray | None = None  # (hidden,)
    ffn_post_norm: np.ndarray | None = None  # (hidden,)
    # A mixture of experts instead of w_gate/w_up/w_down: the router, then each expert's matrices
    router: Weight | None = None  # (n_experts, hidden): the experts' logits
    experts_gate: list[Weight] | None = None  # n_experts x (expert_width, hidden)
    experts_up: list[Weight] | None = None  # n_experts x (expert_width, hidden)
    experts_down: list[Weight] | None = None  # n_experts x (hidden, expert_width)

    @property
    def nbytes(self) -> int:
        total = 0
        for f in self.__dataclass_fields__:
            w = getattr(self, f)
            if isinstance(w, list):
                total += sum(weight_nbytes(e) for e in w)
            elif w is not None:
                total += weight_nbytes(w)
        return total


class LazyLayers(MutableSequence):
    """A shard's layers made one at a time, when a backend first reads each (``make(i)`` for the
    ``i``-th): a backend that drops each layer once it has built its own form of it
    (``ShardWeights.disposable``) never holds more than one decoded layer at a time. A dropped
    layer (set to None) is not made again."""

    def __init__(self, make: Callable[[int], LayerWeights], n: int) -> None:
        self._make = make
        self._items: list[LayerWeights | None] = [None] * n
        self._dropped = [False] * n
        self.check: Callable[[int, LayerWeights], None] | None = None  # run on each layer as it is made

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - a layer, or a list for a slice
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._items[i] is None and not self._dropped[i]:
            j = i if i >= 0 else len(self) + i
            layer = self._make(j)
            if self.check is not None:
                self.check(j, layer)
            self._items[i] = layer
        return self._items[i]

    def made(self) -> list[tuple[int, LayerWeights]]:
        """The layers made (or set) so far, with their indices."""
        return [(i, lw) for i, lw in enumerate(self._items) if lw is not None]

    def __setitem__(self, i, value) -> None:  # noqa: ANN001
        self._items[i] = value
        self._dropped[i] = value is None

    def __delitem__(self, i) -> None:  # noqa: ANN001
        raise TypeError("a shard's layers cannot be removed, only dropped (set to None)")

    def insert(self, index: int, value: LayerWeights) -> None:
        raise TypeError("a shard's layers are fixed in number")


@dataclass
class ShardWeights:
    """The weights of layers ``[start, end)``; the first shard has ``embed``, the last
    ``norm`` and ``output`` (``output`` is ``embed`` when the model ties them)."""

    start: int
    end: int
    layers: list[LayerWeights] | LazyLayers
    embed: Weight | None = None  # (vocab, hidden), when start == 0
    norm: np.ndarray | None = None  # (hidden,), when end == n_layers
    output: Weight | None = None  # (vocab, hidden), when end == n_layers
    # The caller hands these over: a backend may drop each layer (``layers[i] = None``) once it
    # has made its own form of it, so a shard's load does not hold the whole shard twice.
    disposable: bool = False
    # The bytes the weights take where they come from (a file's blocks), when known: what
    # ``nbytes`` says without making every layer of a LazyLayers.
    stored_nbytes: int = 0
    # Those bytes by GGUF type ("Q4_K": ..., "F32": ...), when known, read from the file's header
    # without making a layer: what a backend may choose its math by (the ONNX backend's "auto").
    stored_types: dict[str, int] = field(default_factory=dict)
    # What the bytes are, where known (a file's path, size and modification time): two shards of
    # one source hold the same tensors for the layers they share, so a backend may share what it
    # made of them while both are loaded (empty: unknown, nothing is shared).
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.layers) != self.end - self.start:
            raise BackendError(
                f"shard [{self.start}, {self.end}) was given {len(self.layers)} layers"
            )

    @property
    def nbytes(self) -> int:
        """Stored bytes (of the layers still here: read it before a load that may drop them)."""
        if self.stored_nbytes:
            return self.stored_nbytes
        total = sum(layer.nbytes for layer in self.layers if layer is not None)
        for w in (self.embed, self.norm, self.output):
            if w is not None:
                total += weight_nbytes(w)
        if self.embed is not None and self.output is self.embed:
            total -= weight_nbytes(self.embed)
        return total


def check_layer_weights(config: ModelConfig, layer: int, lw: LayerWeights) -> None:
    """Errors for a layer's weights that do not fit ``config``: the matrices' shapes, and each
    optional part there exactly when the config asks for it, with its shape."""
    c = config
    h, qd, kvd = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    matrices = {"wq": (qd, h), "wk": (kvd, h), "wv": (kvd, h), "wo": (h, qd)}
    if not c.n_experts:
        ffn = c.intermediate_size
        matrices |= {"w_gate": (ffn, h), "w_up": (ffn, h), "w_down": (h, ffn)}
    for name, shape in matrices.items():
        value = getattr(lw, name)
        if value is None:
            raise BackendError(f"layer {layer} lacks {name}")
        if tuple(value.shape) != shape:
            raise BackendError(f"layer {layer} {name} has shape {tuple(value.shape)}, expected {shape}")
    wanted = {"attn_norm": (h,), "ffn_norm": (h,)}
    if c.qkv_bias:
        wanted |= {"bq": (qd,), "bk": (kvd,), "bv": (kvd,)}
    if c.qk_norm:
        wanted |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    if c.post_norms:
        wanted |= {"attn_post_norm": (h,), "ffn_post_norm": (h,)}
    if c.n_experts:
        check_experts(c, layer, lw)
    for name in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm"):
        value = getattr(lw, name)
        if name not in wanted:
            if value is not None:
                raise BackendError(f"layer {layer} has {name}, which the model's config does not use")
            continue
        if value is None:
            raise BackendError(f"layer {layer} lacks {name}, which the model's config needs")
        if tuple(np.shape(value)) != wanted[name]:
            raise BackendError(f"layer {layer} {name} has shape {tuple(np.shape(value))}, expected {wanted[name]}")


def check_shard_layers(config: ModelConfig, weights: ShardWeights) -> None:
    """:func:`check_layer_weights` for each of a shard's layers: now for layers given as a list, as
    each is made for a :class:`LazyLayers` (making them all here would hold the whole shard decoded
    at once: 1.8 GB for a 1B Q4_K_M model whose file is 0.74 GB)."""
    if isinstance(weights.layers, LazyLayers):
        for i, lw in weights.layers.made():
            check_layer_weights(config, weights.start + i, lw)
        start = weights.start  # (not ``weights`` in the closure: a cycle through its layers would keep the
        # whole ShardWeights, the decoded embedding with it, alive until the cyclic collector ran)
        weights.layers.check = lambda i, lw: check_layer_weights(config, start + i, lw)
        return
    for i, lw in enumerate(weights.layers):
        check_layer_weights(config, weights.start + i, lw)


def check_experts(config: ModelConfig, layer: int, lw: LayerWeights) -> None:
    c = config
    if lw.w_gate is not None or lw.w_up is not None or lw.w_down is not None:
        raise BackendError(f"layer {layer} has a dense MLP beside its {c.n_experts} experts")
    if lw.router is None or tuple(lw.router.shape) != (c.n_experts, c.hidden_size):
        raise BackendError(f"layer {layer} needs a router of shape ({c.n_experts}, {c.hidden_size})")
    f, h = c.expert_width, c.hidden_size
    for name, shape in (("experts_gate", (f, h)), ("experts_up", (f, h)), ("experts_down", (h, f))):
        experts = getattr(lw, name)
        if experts is None or len(experts) != c.n_experts:
            raise BackendError(f"layer {layer} needs {c.n_experts} {name} matrices")
        for e, w in enumerate(experts):
            if tuple(w.shape) != shape:
                raise BackendError(f"layer {layer} {name}[{e}] has shape {tuple(w.shape)}, expected {shape}")
