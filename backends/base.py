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

Here: the contract (:class:`ModelConfig`, :class:`KVCache`, :class:`Shard`, :class:`Backend` and
their errors). The weights handed over are in :mod:`backends.weights`; what a load and a step take
in memory, in :mod:`backends.memory`.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from backends.weights import ShardWeights


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


PREFILL_CHUNK = 512
"""The most rows of a prompt one step runs at once: a longer prompt runs in chunks of
``Shard.prefill_chunk`` rows, this many or fewer (:func:`backends.memory.prefill_rows`)."""
FLOAT_BYTES = 4
"""A weight kept in float32: F32, F16 and BF16 matrices, and the GGUF types read by dequantizing
(gguf's), which no backend keeps as blocks."""
MAX_DRAFT = 32
"""The most drafted positions one step may carry and a cache may then drop (speculative
decoding: ``Shard.truncate_kv``); a windowed layer's ring keeps this many rows beyond its window
(:mod:`backends.rings`), so a verify step's rejected positions can go."""
FOLD_ROWS = MAX_DRAFT + 1
"""A step of up to this many tokens (a verify step: the last accepted token and its drafts) may run
in ``Shard.forward_batch`` as rows beside other requests' decode steps: its pass over the weights
is theirs."""
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


class HeadRows:
    """The rows of a last shard's step whose logits are computed when first asked for
    (:meth:`Shard.forward_rows`). ``head(a, b)`` gives rows ``[a, b)``'s logits ``(b - a, vocab)``;
    ``at_once``: how many rows, from the one asked for, each call computes (a head that costs
    little more for several rows than for one, as on a memory-bound device: all of them)."""

    def __init__(self, n_rows: int, head: Any, at_once: int) -> None:
        self.n_rows = n_rows
        self._head = head
        self._at_once = max(1, at_once)
        self._rows: dict[int, np.ndarray] = {}

    @classmethod
    def of(cls, logits: np.ndarray) -> HeadRows:
        """Rows whose logits are all computed already."""
        rows = cls(logits.shape[0], None, logits.shape[0])
        rows._rows = dict(enumerate(np.asarray(logits)))
        return rows

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, i: int) -> np.ndarray:
        """Row ``i``'s logits ``(vocab,)`` (``-1``: the last row)."""
        if i < 0:
            i += self.n_rows
        if not 0 <= i < self.n_rows:
            raise IndexError(f"row {i} of {self.n_rows}")
        if i not in self._rows:
            b = min(self.n_rows, i + self._at_once)
            for j, row in enumerate(np.asarray(self._head(i, b), dtype=np.float32), start=i):
                self._rows.setdefault(j, row)
        return self._rows[i]

    @property
    def computed(self) -> int:
        """Rows whose logits have been computed."""
        return len(self._rows)

    def last(self, n: int) -> HeadRows:
        """The last ``n`` rows (computed, still, when asked for)."""
        if n == self.n_rows:
            return self
        if not 0 < n < self.n_rows:
            raise IndexError(f"the last {n} rows of {self.n_rows}")
        off = self.n_rows - n
        return HeadRows(n, lambda a, b: np.stack([self[off + j] for j in range(a, b)]), 1)


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
        self, items: list[tuple[str, np.ndarray, np.ndarray]], all_logits: Collection[int] = ()
    ) -> list[np.ndarray]:
        """``forward`` for several requests at once; backends may fuse decode steps. The items
        whose index is in ``all_logits`` give every row's logits (``forward``'s ``all_logits``)."""
        return [self.forward(rid, x, pos, all_logits=i in all_logits) for i, (rid, x, pos) in enumerate(items)]

    @property
    def verifies_in_batch(self) -> bool:
        """Whether a verify step on the last shard runs in ``forward_batch`` beside other requests'
        steps (its rows in their pass over the weights, every row's logits asked for) rather than
        alone through :meth:`forward_rows`. Here: alone."""
        return False

    def forward_rows(self, request_id: str, x: np.ndarray, positions: np.ndarray) -> HeadRows:
        """``forward`` of a verify step on the last shard: every row runs through the layers (and
        into the cache) now, and each row's logits are what ``forward(..., all_logits=True)`` gives,
        but a backend may run the head on a row only when its logits are first asked for (a check
        of drafted tokens stops at the first it rejects). Here: all rows' logits at once."""
        return HeadRows.of(self.forward(request_id, x, positions, all_logits=True))

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
    head): where a load peaks (:func:`backends.memory.load_peak_bytes`)."""

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
