"""The backend contract: what exo_tui hands a backend and what it gets back.

A backend turns plain NumPy weights of a layer range of a decoder-only transformer, described by a
:class:`ModelConfig`, into a :class:`Shard` that runs those layers. Everything crossing this
boundary is plain data (dataclasses of NumPy arrays), so a shard on one backend can hand its hidden
state or its KV cache to a shard on another.

Conventions (all backends follow them exactly; ``tests/reference.py`` is them in NumPy):

* Matrices are stored ``(out_features, in_features)`` as in GGUF/PyTorch: ``y = x @ W.T (+ b)``.
* Rotary embedding rotates *adjacent* pairs ``(x[2i], x[2i+1])`` of each head (GGUF's llama
  layout: llama.cpp's converter permutes Q and K for this; mlx calls it ``traditional=True``).
  Families whose files rotate the two halves of a head (NeoX style: qwen2, qwen3, gemma3, phi3)
  reach a backend already permuted into this layout by the model reader (the rows of Wq, Wk,
  their biases and the Q/K norm weights), which changes no score. The angles of each layer come
  from :func:`backends.rope.rope_tables` (base, scaling, frequency factors, magnitude).
* RMSNorm: ``x / sqrt(mean(x**2) + rms_eps) * weight``, in float32; with ``qk_norm`` each head of
  q and of k is normed so (over ``head_dim``) before its rotation.
* Attention is causal over the request's cache plus the new tokens; grouped-query attention
  repeats each KV head ``n_heads // n_kv_heads`` times (query head ``h`` uses KV head
  ``h // (n_heads // n_kv_heads)``); scores scaled by ``config.query_scale``; a windowed layer's
  query at position ``p`` sees keys at positions ``> p - sliding_window`` only.
* Block: ``h += post_norm(attn(norm(h)))``, ``h += post_norm(mlp(norm(h)))`` (the post norms only
  with ``post_norms``). MLP: ``down(act(gate(x)) * up(x))``, ``act`` silu or tanh-approximated GELU.
* The first shard multiplies embedding rows by ``embed_scale``; the last applies the final norm,
  the head and, with ``logit_softcap`` c, ``c * tanh(logits / c)``.
* Hidden states and logits are float32 NumPy arrays of shape ``(T, hidden)`` / ``(T, vocab)``.
"""

from __future__ import annotations

import abc
import itertools
import os
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np


def physical_cores() -> int:
    """Physical CPU cores (the default thread count of the CPU backends)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:
        n = None
    return max(1, n or os.cpu_count() or 1)


class BackendError(RuntimeError):
    """A backend cannot do what was asked (not installed, unsupported weights, bad input)."""


KQUANT_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # per 256 weights (backends/kquants.py)
BLOCK_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}  # GGUF's blocks of 32 read as codes (their bits) and affine groups
FLOAT_BYTES = 4
MAX_DRAFT = 32
"""The most drafted positions one step may carry and a cache may then drop (speculative
decoding: ``Shard.truncate_kv``); a windowed layer's ring keeps this many rows beyond its window
(:mod:`backends.rings`), so a verify step's rejected positions can go."""
"""A weight kept in float32: F32, F16 and BF16 matrices, and the GGUF types read by dequantizing
(gguf's), which no backend keeps as blocks."""
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("none", "linear", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer and the features that tell its families apart.

    The defaults are a plain llama; every other family is the same decoder with some of these
    switched (``exo_tui.models.families`` reads them from a GGUF file). A backend builds its graph
    from this description and refuses (:func:`unsupported_features`) what it cannot run.
    """

    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    context_length: int = 2048
    arch: str = "llama"
    # --- attention
    qkv_bias: bool = False  # biases on q, k and v (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before rope (qwen3, gemma3)
    attn_scale: float = 0.0  # the queries' scale; 0: 1 / sqrt(head_dim)
    sliding_window: int = 0  # a windowed layer's query sees this many positions, itself included
    window_layers: tuple[bool, ...] = ()  # per layer: True where the layer is windowed; () none is
    # --- rotary embedding (angles: see backends/rope.py)
    rope_theta_local: float = 0.0  # windowed layers' base (gemma3); 0: rope_theta
    rope_scaling: str = "none"  # none | linear | yarn (windowed layers of gemma3 are never scaled)
    rope_factor: float = 1.0  # linear: positions / factor; yarn: the context's extension factor
    rope_original_context: int = 0  # yarn: the context the model was trained at before scaling
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_attn_factor: float = 1.0  # cos and sin multiplied by this (yarn's and longrope's magnitude)
    rope_freq_factors: tuple[float, ...] = ()  # per rotary pair: its frequency divided by it (llama3, longrope)
    # --- mixture of experts (n_experts > 0: every layer's MLP is n_experts experts and a router)
    n_experts: int = 0
    n_experts_used: int = 0  # top-k experts per token
    expert_intermediate_size: int = 0  # each expert's MLP width; 0: intermediate_size
    expert_weights_norm: bool = True  # the chosen experts' softmax weights renormalised to sum to 1
    # --- blocks
    post_norms: bool = False  # RMSNorm of the attention's and the MLP's outputs before each residual add (gemma3)
    activation: str = "silu"  # the MLP's gate: silu | gelu_tanh
    # --- ends
    embed_scale: float = 1.0  # token embeddings multiplied by it (gemma: sqrt(hidden))
    logit_softcap: float = 0.0  # logits become c * tanh(logits / c); 0: none

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """float32 K and V for one token in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * 4

    @property
    def expert_width(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def query_scale(self) -> float:
        return self.attn_scale or 1.0 / float(np.sqrt(self.head_dim))

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window (else over all its positions)."""
        return bool(self.sliding_window) and bool(self.window_layers) and self.window_layers[layer]

    def window(self, layer: int) -> int:
        """Positions a query of ``layer`` sees, itself included (0: all of them)."""
        return self.sliding_window if self.windowed(layer) else 0

    @property
    def ring_window(self) -> int:
        """Positions a windowed layer's KV cache holds at most (:mod:`backends.rings`); 0: no
        layer's cache is bounded (no windows, or none shorter than the context)."""
        bounded = self.sliding_window and self.sliding_window < self.context_length and any(self.window_layers)
        return self.sliding_window if bounded else 0

    @property
    def ring_rows(self) -> int:
        """Rows a windowed layer's ring has (0: no rings): its window and :data:`MAX_DRAFT` more,
        the positions a verify step may drop. What a bounded cache costs, per request."""
        return min(self.ring_window + MAX_DRAFT, self.context_length) if self.ring_window else 0

    def at_context(self, n: int) -> ModelConfig:
        """The model served at a context of ``n`` tokens, less than its own (a cluster's
        ``--context``): its rotary tables and caches sized for ``n``, a step past it refused.
        YaRN's frequencies stay those of the context they were computed from (its original one,
        else the file's). ``n`` of 0, or not less than the model's own: the model as it is."""
        if not 0 < n < self.context_length:
            return self
        original = self.rope_original_context or (self.context_length if self.rope_scaling == "yarn" else 0)
        return replace(self, context_length=n, rope_original_context=original)

    def to_wire(self) -> dict:
        """Plain values (msgpack and JSON carry them; :meth:`from_wire` makes the config again)."""
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_wire(cls, values: dict) -> ModelConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise BackendError(f"model config has unknown fields {unknown}: the sender runs a newer exo-tui")
        checked: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()}
        return cls(**checked)


def unsupported_features(config: ModelConfig, experts: bool = False) -> list[str]:
    """What in ``config`` a backend cannot run, one phrase each (empty: all of it runs);
    ``experts``: the backend runs mixtures of experts."""
    problems = []
    if config.n_experts and not experts:
        problems.append(f"a mixture of {config.n_experts} experts")
    if config.activation not in ACTIVATIONS:
        problems.append(f"activation {config.activation!r} (runs: {', '.join(ACTIVATIONS)})")
    if config.rope_scaling not in ROPE_SCALINGS:
        problems.append(f"rope scaling {config.rope_scaling!r} (runs: {', '.join(ROPE_SCALINGS)})")
    if config.window_layers and len(config.window_layers) != config.n_layers:
        problems.append(f"a sliding-window pattern of {len(config.window_layers)} layers for {config.n_layers}")
    if config.n_experts and not 0 < config.n_experts_used <= config.n_experts:
        problems.append(f"{config.n_experts_used} experts used of {config.n_experts}")
    if config.rope_freq_factors and len(config.rope_freq_factors) != config.head_dim // 2:
        problems.append(f"{len(config.rope_freq_factors)} rope frequency factors for {config.head_dim // 2} pairs")
    return problems


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


# A load's peak beside its shard's arrays (measured by tests/unit/test_node_memory.py): a matrix
# decoded whole takes LOAD_PEAK_DECODED times its file bytes while its layer is built (its codes a
# byte each with float32 scales and biases, and the packing's temporaries; 3.0 for a 2048-wide
# Q4_K_M layer decoded so): the types read by dequantizing to float32; a matrix a backend reads a
# chunk at a time (CHUNKED_TYPES: ONNX's tiles read blocks of 32 and K-quant super-blocks so)
# takes only a chunk's temporaries, LOAD_CHUNK_BYTES (7-12 MB measured); one it makes a chunk at a
# time and then copies whole (COPIED_TYPES: MLX's arrays, made in NumPy, then copied into MLX's
# own) takes its arrays once more besides, the matrices it stacks into one (gate and up; q, k and
# v) together: counted as a piece's two largest (a 2048-wide Q4_K layer: 22-26 MB over what it
# holds after, against 112-122 MB decoded whole).
LOAD_PEAK_DECODED = 3.5
LOAD_CHUNK_BYTES = 16 << 20
CHUNKED_TYPES = {"onnx": frozenset(KQUANT_BLOCK_BYTES) | frozenset(BLOCK_TYPES)}
COPIED_TYPES = {"mlx": frozenset(KQUANT_BLOCK_BYTES) | frozenset(BLOCK_TYPES)}

LoadPiece = list[tuple[str, int, int]]
"""What a load reads at once (a layer's tensors, the embedding, the head): each tensor's GGUF type
name ("" where decoded whole whatever it is), its bytes in the file and as the backend holds it."""


def load_peak_bytes(backend: str, pieces: list[LoadPiece], held: list[int] | None = None) -> int:
    """The bytes a load on ``backend`` takes at its peak beside its shard's arrays, its ``pieces``
    read in turn: a piece's temporaries are its matrices decoded whole, a chunk's where any is
    read or made so, and the arrays of those made a chunk at a time before they are copied.

    Without ``held``, the most any shard of such pieces may take: the largest piece's
    temporaries. With ``held`` (each piece's bytes as the backend holds them, the pieces in the
    order the load reads them), this shard's: at piece ``i`` the load holds the arrays of the
    pieces up to ``i`` and ``i``'s temporaries, which is less than all the arrays and the largest
    temporaries where a large piece comes early (the default model's embedding on ONNX)."""
    chunked = CHUNKED_TYPES.get(backend, frozenset())
    copied = COPIED_TYPES.get(backend, frozenset())

    def temporaries(piece: LoadPiece) -> float:
        whole = sum(LOAD_PEAK_DECODED * n for t, n, _ in piece
                    if t not in chunked and t not in copied)
        copies = sum(sorted((h for t, _, h in piece if t in copied), reverse=True)[:2])
        return whole + copies + (LOAD_CHUNK_BYTES if any(t in chunked or t in copied for t, _, _ in piece) else 0)

    temps = [temporaries(piece) for piece in pieces]
    if held is None:
        return int(max(temps, default=0))
    peak = max((c + t for c, t in zip(itertools.accumulate(held), temps, strict=True)), default=0)
    return max(0, int(peak) - sum(held))


# A step's temporaries. A prompt's rows run in chunks of at most PREFILL_CHUNK (a shard's
# ``prefill_chunk``); a chunk's step holds, at its peak, about STEP_ROW_VALUES float32 values a row
# per unit of the model's widths (hidden + the MLP's), the attention's scores and the new caches
# included: 4.0 measured on the default model (hidden 576, MLP 1536), 5.1-6.4 on hidden 2048 with
# an MLP of 5632, 64-512 rows (benchmarks/step_memory.py, ONNX Runtime's memory patterns off), and
# ONNX Runtime's arena keeps it for the next step. A node under a memory limit runs smaller chunks,
# whose temporaries fit its reserve (exo_tui/node/kv_budget.py); a decode step's are ~1 MB.
PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 32
FILL_QUEUED = 2
"""A long prompt's chunks that may wait at a node while it runs another of the same request: the
coordinator keeps at most this many more in flight than the one running (one a node of the ring,
up to ``FILL_QUEUED + 1``)."""
STEP_ROW_VALUES = 6.5


def step_row_bytes(config: ModelConfig) -> int:
    """The temporaries one row of a prompt's chunk takes at a step's peak, on any shard of
    ``config`` (the head's logits aside: only the last row's are computed but where a request
    asks for every position's)."""
    mlp = max(config.intermediate_size, config.expert_width * max(1, config.n_experts_used))
    return int(STEP_ROW_VALUES * 4 * (config.hidden_size + mlp))


def logit_rows(config: ModelConfig, room_bytes: int | None, most: int) -> int:
    """The rows of every-position logits (a prompt scored) a step may hold at once in
    ``room_bytes`` (None: no bound): ``most`` at most, 1 at least. A row is the vocabulary in
    float32, held twice where the shard runs the rows in chunks and joins them."""
    if room_bytes is None:
        return most
    return int(min(most, max(1, room_bytes // (2 * 4 * config.vocab_size))))


def prefill_row_bytes(config: ModelConfig) -> int:
    """What a row of a prompt's chunk takes at a node while it runs: its step's temporaries
    (:func:`step_row_bytes`) and the rows of the chunks that may wait there meanwhile (a row of
    hidden states, float32, each of ``FILL_QUEUED``)."""
    return step_row_bytes(config) + FILL_QUEUED * 4 * config.hidden_size


def prefill_rows(config: ModelConfig, room_bytes: int | None) -> int:
    """The rows of a prompt's chunk that fit in ``room_bytes`` as it runs (None: no bound;
    :func:`prefill_row_bytes`): ``PREFILL_CHUNK`` at most, ``MIN_PREFILL_CHUNK`` at least, a
    multiple of it."""
    if room_bytes is None:
        return PREFILL_CHUNK
    rows = room_bytes // prefill_row_bytes(config) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK
    return int(min(PREFILL_CHUNK, max(MIN_PREFILL_CHUNK, rows)))


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


@dataclass
class KVCache:
    """A request's KV cache for a layer range, as plain arrays (portable across backends).

    ``keys[i]`` and ``values[i]`` belong to layer ``start + i`` and have shape
    ``(n_kv_heads, held, head_dim)``, float32, keys already rotated (RoPE applied): the cache's
    last ``held`` positions, which is all ``length`` of them, except on a windowed layer
    (``ModelConfig.window``), whose backends keep only its last ``min(length, window)`` (what its
    next queries see: :mod:`backends.rings`); an importer takes any ``held`` from that to ``length``.
    """

    start: int
    end: int
    length: int
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    def slice_layers(self, start: int, end: int) -> KVCache:
        """The part of this cache for layers ``[start, end)`` (a subrange of this one)."""
        if not (self.start <= start <= end <= self.end):
            raise BackendError(f"layers [{start}, {end}) are not in cache [{self.start}, {self.end})")
        a, b = start - self.start, end - self.start
        return KVCache(start, end, self.length, self.keys[a:b], self.values[a:b])


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


class Shard(abc.ABC):
    """Layers ``[start, end)`` of a model loaded on one backend, with per-request KV caches."""

    def __init__(self, config: ModelConfig, start: int, end: int) -> None:
        self.config = config
        self.start = start
        self.end = end
        # a longer step runs in chunks of this many rows (a node under a memory limit sets it:
        # prefill_rows); the result is the same whatever it is
        self.prefill_chunk = PREFILL_CHUNK

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.config.n_layers

    @abc.abstractmethod
    def forward(
        self,
        request_id: str,
        x: np.ndarray,
        positions: np.ndarray,
        *,
        all_logits: bool = False,
    ) -> np.ndarray:
        """Run this shard's layers for ``T`` new tokens of a request and append them to its cache.

        ``x`` is int token ids ``(T,)`` on the first shard, else float32 hidden ``(T, hidden)``.
        ``positions`` are the tokens' absolute positions ``(T,)`` and must continue the cache
        (``positions[0] == kv_length(request_id)``). Returns float32 hidden ``(T, hidden)``, or on
        the last shard logits: ``(1, vocab)`` for the last token, or ``(T, vocab)`` with
        ``all_logits``.
        """

    def forward_batch(
        self, items: list[tuple[str, np.ndarray, np.ndarray]]
    ) -> list[np.ndarray]:
        """``forward`` for several requests at once; backends may fuse decode steps."""
        return [self.forward(rid, x, pos) for rid, x, pos in items]

    @abc.abstractmethod
    def kv_length(self, request_id: str) -> int:
        """Tokens in the request's cache (0 when it has none)."""

    @abc.abstractmethod
    def export_kv(self, request_id: str) -> KVCache:
        """A copy of the request's cache for this shard's layers."""

    @abc.abstractmethod
    def import_kv(self, request_id: str, cache: KVCache) -> None:
        """Replace the request's cache with ``cache`` (whose layers must cover this shard's)."""

    @abc.abstractmethod
    def drop(self, request_id: str) -> None:
        """Forget the request's cache (no error when there is none)."""

    def truncate_kv(self, request_id: str, length: int) -> None:
        """Keep only the first ``length`` positions of the request's cache. A windowed layer
        that no longer holds the keys position ``length``'s query sees cannot: BackendError
        (drop the cache and run the tokens again)."""
        cache = self.export_kv(request_id)
        n = min(length, cache.length)
        cut = [k.shape[1] - (cache.length - n) for k in cache.keys]  # each layer holds the last positions
        for i, k in enumerate(cut):
            window = self.config.window(cache.start + i)
            if k < (min(n, window) if window else n):
                raise BackendError(f"request {request_id}'s layer {cache.start + i} no longer holds the keys of "
                                   f"positions before {n}: drop its cache and run its tokens again")
        cache = KVCache(cache.start, cache.end, n, [k[:, : max(0, c)] for k, c in zip(cache.keys, cut, strict=True)],
                        [v[:, : max(0, c)] for v, c in zip(cache.values, cut, strict=True)])
        self.import_kv(request_id, cache)

    def rename_kv(self, old: str, new: str) -> None:
        """The cache of request ``old`` becomes request ``new``'s (a finished request's cache
        taken over by the next turn of its conversation). ``new`` must hold no cache."""
        if self.kv_length(new):
            raise BackendError(f"request {new} already has a cache here")
        if not self.kv_length(old):
            raise BackendError(f"request {old} has no cache here to hand over")
        self.import_kv(new, self.export_kv(old))
        self.drop(old)

    def requests(self) -> list[str]:
        """Requests that hold a cache here."""
        return []

    @property
    def ring_layers(self) -> int:
        """How many of this shard's layers keep only their last ``config.ring_window`` positions
        (a ring, :mod:`backends.rings`) rather than a request's whole cache."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional: shards with nothing to free inherit this
        """Free what the shard holds."""


class Backend(abc.ABC):
    """A way to run shards: MLX or ONNX Runtime."""

    name: str = ""
    experts: bool = False  # runs mixtures of experts (ModelConfig.n_experts)
    unavailable_reason: str = ""  # why available() is False: what failed, for the operator
    def describe(self) -> dict[str, str]:
        """How this backend runs shards on this machine, for the operator (a node's profile
        carries it: the console's node detail and ``exo-tui node --print-profile`` show it)."""
        return {}

    def kv_value_bytes(self) -> int:
        """Bytes each cached K or V value takes in this backend's shards (4: float32), which the
        scheduler counts when it places layers within a node's memory."""
        return 4

    @classmethod
    def shares_tied(cls, type_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a shard that holds both the token embedding and the output head it is tied to
        keeps one form of the matrix for both, for a matrix of GGUF type ``type_name`` and
        ``shape`` (by default it does, whatever the type)."""
        return True
    embedding_first: bool = False
    """Whether a shard's load builds its embedding before its layers (else after them, before the
    head): where a load peaks (:func:`load_peak_bytes`)."""

    @classmethod
    def held_nbytes(cls, type_name: str, shape: tuple[int, ...], *, embedding: bool = False) -> int:
        """The bytes this backend's shards hold for a file's tensor of GGUF type ``type_name`` and
        ``shape`` (rows first; a mixture's experts ``(experts, rows, cols)``): as a matrix, or as
        the token embedding rows are looked up in (``embedding``). What the scheduler plans and a
        node's memory limit counts (``exo_tui.models.gguf_file``: a shard's bytes); a backend's
        tests check it against the arrays its shards build. By default float32."""
        return FLOAT_BYTES * int(np.prod(shape))

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether this backend can run on this machine (its runtime imports and works)."""

    @abc.abstractmethod
    def load_shard(self, config: ModelConfig, weights: ShardWeights) -> Shard:
        """Build a shard from weights of layers ``[weights.start, weights.end)``."""


def validate_forward_input(shard: Shard, x: np.ndarray, positions: np.ndarray, cached: int) -> None:
    """Shared checks of ``Shard.forward``'s arguments, with errors that say what is wrong."""
    t = positions.shape[0] if positions.ndim == 1 else -1
    if t <= 0:
        raise BackendError(f"positions must be a non-empty 1-D array, got shape {positions.shape}")
    if shard.is_first:
        if x.ndim != 1 or x.shape[0] != t or x.dtype.kind not in "iu":  # signed or unsigned integers
            raise BackendError(f"first shard expects {t} integer token ids, got {x.dtype} {x.shape}")
        lo, hi = (int(x[0]),) * 2 if t == 1 else (int(x.min()), int(x.max()))  # a decode step: no reductions
        if lo < 0 or hi >= shard.config.vocab_size:
            raise BackendError(f"token id out of range 0..{shard.config.vocab_size - 1}")
    elif x.shape != (t, shard.config.hidden_size):
        raise BackendError(
            f"shard [{shard.start}, {shard.end}) expects hidden ({t}, {shard.config.hidden_size}), got {x.shape}"
        )
    if int(positions[0]) != cached:
        raise BackendError(
            f"positions start at {int(positions[0])} but the request has {cached} cached tokens"
        )
    if cached + t > shard.config.context_length:
        raise BackendError(
            f"context full: {cached + t} tokens exceed the model's {shard.config.context_length}"
        )
