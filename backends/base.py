"""The backend contract: what exo_tui hands a backend and what it gets back.

A backend turns plain NumPy weights of a layer range of a llama-architecture model into a
:class:`Shard` that runs those layers. Everything crossing this boundary is plain data
(dataclasses of NumPy arrays), so a shard on one backend can hand its hidden state or its KV
cache to a shard on another.

Conventions (all backends follow them exactly):

* Matrices are stored ``(out_features, in_features)`` as in GGUF/PyTorch: ``y = x @ W.T``.
* Rotary embedding rotates *adjacent* pairs ``(x[2i], x[2i+1])`` of each head (GGUF's llama
  layout: llama.cpp's converter permutes Q and K for this; mlx calls it ``traditional=True``).
  ``theta_i = position * rope_theta ** (-2i / head_dim)``.
* RMSNorm: ``x / sqrt(mean(x**2) + rms_eps) * weight``, in float32.
* Attention is causal over the request's cache plus the new tokens; grouped-query attention
  repeats each KV head ``n_heads // n_kv_heads`` times (query head ``h`` uses KV head
  ``h // (n_heads // n_kv_heads)``); scores scaled by ``1 / sqrt(head_dim)``.
* MLP: ``down(silu(gate(x)) * up(x))``. Residual adds around attention and MLP.
* Hidden states and logits are float32 NumPy arrays of shape ``(T, hidden)`` / ``(T, vocab)``.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a llama-architecture model."""

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

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """float32 K and V for one token in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``(rows, cols)`` matrix in affine-quantized blocks of ``group`` along ``cols``.

    ``w[r, c] = scales[r, c // group] * q[r, c] + biases[r, c // group]`` with ``q`` an unsigned
    code in ``0 .. 2**bits - 1``. GGUF's block formats map onto this exactly:

    * Q4_0: ``w = d * (q - 8)``            -> bits 4, scale ``d``, bias ``-8 d``
    * Q4_1: ``w = d * q + m``              -> bits 4, scale ``d``, bias ``m``
    * Q8_0: ``w = d * s`` with s signed    -> bits 8, q = s + 128, scale ``d``, bias ``-128 d``

    This is MLX's affine quantization (``mx.quantize`` layout) and, with a zero-point
    correction, ONNX Runtime's ``MatMulNBits``.
    """

    q: np.ndarray  # uint8 (rows, cols), one code per element (not packed)
    scales: np.ndarray  # float32 (rows, cols // group)
    biases: np.ndarray  # float32 (rows, cols // group)
    bits: int
    group: int = 32
    source_type: str = ""  # the GGUF type it came from, for display ("Q4_1")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Bytes this weight takes as quantized blocks (what a node must hold)."""
        rows, cols = self.q.shape
        return rows * cols * self.bits // 8 + self.scales.nbytes // 2 + self.biases.nbytes // 2

    @classmethod
    def random(cls, rng: np.random.Generator, rows: int, cols: int, bits: int = 4, half: bool = True) -> QuantizedWeight:
        """Random codes in blocks of 32 with positive scales and negative biases, for probes,
        benchmarks and tests. ``half``: scales and biases exact in float16, as GGUF's blocks have
        them, so a backend runs the matrix the way it runs a model's (ONNX's kernel takes only
        such blocks: a float32-scaled benchmark once timed its slower fallback instead)."""
        q = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
        scales = rng.random((rows, cols // 32)) * (0.1 if bits == 4 else 0.006)
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
    """One transformer block. Norm weights are float32 vectors; the rest are matrices."""

    attn_norm: np.ndarray
    wq: Weight  # (n_heads * head_dim, hidden)
    wk: Weight  # (n_kv_heads * head_dim, hidden)
    wv: Weight  # (n_kv_heads * head_dim, hidden)
    wo: Weight  # (hidden, n_heads * head_dim)
    ffn_norm: np.ndarray
    w_gate: Weight  # (intermediate, hidden)
    w_up: Weight  # (intermediate, hidden)
    w_down: Weight  # (hidden, intermediate)

    @property
    def nbytes(self) -> int:
        return sum(weight_nbytes(getattr(self, f)) for f in self.__dataclass_fields__)


@dataclass
class ShardWeights:
    """The weights of layers ``[start, end)``; the first shard has ``embed``, the last
    ``norm`` and ``output`` (``output`` is ``embed`` when the model ties them)."""

    start: int
    end: int
    layers: list[LayerWeights]
    embed: Weight | None = None  # (vocab, hidden), when start == 0
    norm: np.ndarray | None = None  # (hidden,), when end == n_layers
    output: Weight | None = None  # (vocab, hidden), when end == n_layers
    # The caller hands these over: a backend may drop each layer (``layers[i] = None``) once it
    # has made its own form of it, so a shard's load does not hold the whole shard twice.
    disposable: bool = False

    def __post_init__(self) -> None:
        if len(self.layers) != self.end - self.start:
            raise BackendError(
                f"shard [{self.start}, {self.end}) was given {len(self.layers)} layers"
            )

    @property
    def nbytes(self) -> int:
        """Stored bytes (of the layers still here: read it before a load that may drop them)."""
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
    ``(n_kv_heads, length, head_dim)``, float32, keys already rotated (RoPE applied).
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


class Shard(abc.ABC):
    """Layers ``[start, end)`` of a model loaded on one backend, with per-request KV caches."""

    def __init__(self, config: ModelConfig, start: int, end: int) -> None:
        self.config = config
        self.start = start
        self.end = end

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
        """Keep only the first ``length`` positions of the request's cache."""
        cache = self.export_kv(request_id)
        cache = KVCache(
            cache.start,
            cache.end,
            min(length, cache.length),
            [k[:, :length] for k in cache.keys],
            [v[:, :length] for v in cache.values],
        )
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

    def close(self) -> None:  # noqa: B027 - optional: shards with nothing to free inherit this
        """Free what the shard holds."""


class Backend(abc.ABC):
    """A way to run shards: MLX or ONNX Runtime."""

    name: str = ""

    def describe(self) -> dict[str, str]:
        """How this backend runs shards on this machine, for the operator (a node's profile
        carries it: the console's node detail and ``exo-tui node --print-profile`` show it)."""
        return {}

    def kv_value_bytes(self) -> int:
        """Bytes each cached K or V value takes in this backend's shards (4: float32), which the
        scheduler counts when it places layers within a node's memory."""
        return 4

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
        if x.ndim != 1 or x.shape[0] != t or not np.issubdtype(x.dtype, np.integer):
            raise BackendError(f"first shard expects {t} integer token ids, got {x.dtype} {x.shape}")
        if x.size and (x.min() < 0 or x.max() >= shard.config.vocab_size):
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
