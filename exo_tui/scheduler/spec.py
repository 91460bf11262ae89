"""What the scheduler knows of a model: its layers and their sizes.

:class:`ModelSpec` is plain data. :mod:`exo_tui.models.spec` builds one from a GGUF file;
:func:`synthetic_spec` builds llama-shaped specs of well-known sizes (``synthetic:70b``) for
planning clusters without the file.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

# Bytes per weight of GGUF block formats (32 weights per block).
BYTES_PER_WEIGHT = {"F32": 4.0, "F16": 2.0, "Q8_0": 34 / 32, "Q4_1": 20 / 32, "Q4_0": 18 / 32}



def _pair(v: Any, what: str) -> tuple[int, int]:
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ValueError(f"a model spec's {what} must be two integers, not {v!r}")
    return int(v[0]), int(v[1])

@dataclass(frozen=True)
class HeldBytes:
    """What one backend's shards hold of a model, where it differs from the file's bytes: each
    layer's, the embedding's (as the first shard looks rows up in it) and the head's (the final
    norm and the output matrix, the embedding's as a matrix where tied), and whether a shard
    holding both keeps one form of a tied matrix (``backends``' ``held_nbytes``)."""

    layers: tuple[int, ...]
    embed: int
    head: int
    shares_tied_head: bool = True


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model as the scheduler needs it.

    ``layer_bytes`` holds the weight bytes of each transformer block (an int given to the
    constructor means "every layer this size"). The first shard also holds ``embed_bytes``; the
    last holds ``head_bytes`` (final norm and output matrix; with tied embeddings that matrix is
    the embedding, so a single node holding the whole model stores it once). Each layer of a
    shard also keeps a KV cache of ``kv_bytes_per_token_per_layer * context_length`` bytes, a
    windowed layer (``kv_windows``) of its window's positions only (its cache is a ring). A hop
    between stages carries ``hidden_size * 4`` bytes per token (float32 hidden state).
    """

    name: str
    n_layers: int
    layer_bytes: tuple[int, ...] | int
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_token_per_layer: int
    hidden_size: int
    context_length: int = 4096
    tied_embeddings: bool = False
    # Bytes of each layer a token reads (a mixture of experts reads only its chosen experts');
    # () means all of ``layer_bytes``. Memory counts ``layer_bytes``, time these.
    active_layer_bytes: tuple[int, ...] = ()
    experts: tuple[int, int] = (0, 0)  # (experts per layer, used per token), (0, 0) for a dense model
    # Per layer: the positions its KV cache holds at most (a sliding window's), 0 all of the
    # context; () every layer holds the whole context.
    kv_windows: tuple[int, ...] = ()
    # Per backend, what a load takes at its peak beside its shard's arrays (models/gguf_file.py's
    # load_peak_nbytes, over the whole model); () where unknown.
    load_peaks: tuple[tuple[str, int], ...] = ()
    # Per backend, what its shards hold where not the file's bytes (K-quant tiles, types read as
    # float32); memory is counted so on a node of that backend.
    held: tuple[tuple[str, HeldBytes], ...] = ()
    # Whether the layers' quantized bytes are mostly K-quant super-blocks (a Q4_K_M file): a node
    # may run those at another precision than other blocks, so its timings of such layers apply.
    kquant: bool = False
    _mean: float = field(default=0.0, init=False, repr=False, compare=False)
    _active_mean: float = field(default=0.0, init=False, repr=False, compare=False)
    _kv_prefix: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"model {self.name} has {self.n_layers} layers; it needs at least 1")
        lb = self.layer_bytes
        if isinstance(lb, int):
            lb = (lb,) * self.n_layers
        lb = tuple(int(b) for b in lb)
        if len(lb) != self.n_layers:
            raise ValueError(f"model {self.name}: {len(lb)} layer sizes for {self.n_layers} layers")
        if any(b <= 0 for b in lb):
            raise ValueError(f"model {self.name}: every layer must have a positive size in bytes")
        object.__setattr__(self, "layer_bytes", lb)
        if any(len(h.layers) != self.n_layers for _, h in self.held):
            raise ValueError(f"model {self.name}: a backend's held bytes must be one per layer")
        object.__setattr__(self, "_mean", sum(lb) / len(lb))
        active = tuple(int(b) for b in self.active_layer_bytes) or lb
        if len(active) != self.n_layers or any(a > b for a, b in zip(active, lb, strict=True)):
            raise ValueError(f"model {self.name}: active layer bytes must be one per layer, at most the layer's")
        object.__setattr__(self, "active_layer_bytes", active if active != lb else ())
        object.__setattr__(self, "_active_mean", sum(active) / len(active))
        windows = tuple(int(w) for w in self.kv_windows)
        if windows and (len(windows) != self.n_layers or any(w < 0 for w in windows)):
            raise ValueError(f"model {self.name}: KV windows must be one per layer, 0 or positive")
        object.__setattr__(self, "kv_windows", windows if any(windows) else ())
        shares = [min(w, self.context_length) / self.context_length if w else 1.0 for w in windows or (0,) * self.n_layers]
        object.__setattr__(self, "_kv_prefix", (0.0, *itertools.accumulate(shares)))

    @property
    def layers(self) -> tuple[int, ...]:
        lb = self.layer_bytes  # a tuple once __post_init__ has run
        return lb if isinstance(lb, tuple) else (lb,) * self.n_layers

    @property
    def mean_layer_bytes(self) -> float:
        return self._mean

    @property
    def mean_active_layer_bytes(self) -> float:
        """Bytes of an average layer one token reads (all of it, unless experts are chosen)."""
        return self._active_mean

    @property
    def activation_bytes_per_token(self) -> int:
        return self.hidden_size * 4

    @property
    def kv_bytes_per_layer(self) -> int:
        """KV cache of one layer at the full context length (a windowed layer holds
        :meth:`kv_layers`' share of it)."""
        return self.kv_bytes_per_token_per_layer * self.context_length

    def kv_layers(self, start: int, end: int) -> float:
        """Layers ``[start, end)``'s KV caches at the full context, in full layers' caches: a
        windowed layer counts ``window / context_length`` of one."""
        return self._kv_prefix[end] - self._kv_prefix[start]

    @property
    def weight_bytes(self) -> int:
        extra = 0 if self.tied_embeddings else self.head_bytes
        if self.tied_embeddings:
            extra = max(0, self.head_bytes - self.embed_bytes)
        return sum(self.layers) + self.embed_bytes + extra

    @property
    def total_bytes(self) -> int:
        """Weights plus the KV cache of every layer at the full context."""
        return self.weight_bytes + int(self.kv_bytes_per_layer * self.kv_layers(0, self.n_layers))

    def held_bytes(self, backend: str | None = None) -> HeldBytes:
        """What a shard on ``backend`` holds of the model (None, or a backend not known: the file's
        bytes)."""
        known = dict(self.held)
        if backend in known:
            return known[backend]
        return HeldBytes(self.layers, self.embed_bytes, self.head_bytes)

    def mean_held_layer_bytes(self, backend: str | None = None) -> float:
        layers = self.held_bytes(backend).layers
        return sum(layers) / len(layers)

    def range_bytes(self, start: int, end: int, kv_bytes_per_layer: float | None = None,
                    backend: str | None = None) -> int:
        """Memory a shard ``[start, end)`` needs: weights as ``backend``'s shards hold them (None:
        the file's bytes), KV cache (``kv_bytes_per_layer`` a layer, default float32's),
        embedding/head at the ends."""
        kv = self.kv_bytes_per_layer if kv_bytes_per_layer is None else kv_bytes_per_layer
        held = self.held_bytes(backend)
        b = sum(held.layers[start:end]) + int(kv * self.kv_layers(start, end))
        return b + self.ends_bytes(start == 0, end == self.n_layers, backend)

    def ends_bytes(self, first: bool, last: bool, backend: str | None = None) -> int:
        """What a shard holds besides its layers: the embedding on the first, the head on the last
        (one form of a tied matrix, where a backend's shard holding both keeps one)."""
        held = self.held_bytes(backend)
        if first and last and self.tied_embeddings and held.shares_tied_head:
            return held.head  # one form for both: the head's (ONNX looks the rows up in its tiles)
        return (held.embed if first else 0) + (held.head if last else 0)

    def to_dict(self) -> dict[str, Any]:
        lb = self.layers
        return {
            "name": self.name,
            "n_layers": self.n_layers,
            "layer_bytes": lb[0] if len(set(lb)) == 1 else list(lb),
            "embed_bytes": self.embed_bytes,
            "head_bytes": self.head_bytes,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "hidden_size": self.hidden_size,
            "context_length": self.context_length,
            "tied_embeddings": self.tied_embeddings,
            **({"active_layer_bytes": list(self.active_layer_bytes)} if self.active_layer_bytes else {}),
            **({"experts": list(self.experts)} if self.experts[0] else {}),
            **({"kv_windows": list(self.kv_windows)} if self.kv_windows else {}),
            **({"load_peaks": dict(self.load_peaks)} if self.load_peaks else {}),
            **({"held": {b: {"layers": list(h.layers), "embed": h.embed, "head": h.head,
                             "shares_tied_head": h.shares_tied_head} for b, h in self.held}} if self.held else {}),
            **({"kquant": True} if self.kquant else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        lb = d["layer_bytes"]
        return cls(
            name=str(d["name"]),
            n_layers=int(d["n_layers"]),
            layer_bytes=int(lb) if isinstance(lb, int | float) else tuple(int(x) for x in lb),
            embed_bytes=int(d["embed_bytes"]),
            head_bytes=int(d["head_bytes"]),
            kv_bytes_per_token_per_layer=int(d["kv_bytes_per_token_per_layer"]),
            hidden_size=int(d["hidden_size"]),
            context_length=int(d.get("context_length", 4096)),
            tied_embeddings=bool(d.get("tied_embeddings", False)),
            active_layer_bytes=tuple(int(x) for x in d.get("active_layer_bytes", ())),
            experts=_pair(d.get("experts", (0, 0)), "experts"),
            kv_windows=tuple(int(x) for x in d.get("kv_windows", ())),
            load_peaks=tuple((str(b), int(n)) for b, n in dict(d.get("load_peaks", {})).items()),
            held=tuple((str(b), HeldBytes(tuple(int(x) for x in h["layers"]), int(h["embed"]), int(h["head"]),
                                          bool(h.get("shares_tied_head", True))))
                       for b, h in dict(d.get("held", {})).items()),
            kquant=bool(d.get("kquant", False)),
        )


@dataclass(frozen=True)
class LlamaShape:
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    tied: bool
    context: int
    label: str


# Published shapes of Llama-family models (SmolLM2 is llama-architecture too).
SYNTHETIC_SHAPES: dict[str, LlamaShape] = {
    "135m": LlamaShape(30, 576, 1536, 9, 3, 49152, True, 8192, "SmolLM2-135M"),
    "1b": LlamaShape(16, 2048, 8192, 32, 8, 128256, True, 8192, "Llama-3.2-1B"),
    "3b": LlamaShape(28, 3072, 8192, 24, 8, 128256, True, 8192, "Llama-3.2-3B"),
    "8b": LlamaShape(32, 4096, 14336, 32, 8, 128256, False, 8192, "Llama-3.1-8B"),
    "13b": LlamaShape(40, 5120, 13824, 40, 40, 32000, False, 4096, "Llama-2-13B"),
    "70b": LlamaShape(80, 8192, 28672, 64, 8, 128256, False, 8192, "Llama-3.1-70B"),
    "405b": LlamaShape(126, 16384, 53248, 128, 8, 128256, False, 8192, "Llama-3.1-405B"),
}


def synthetic_spec(size: str, quant: str = "Q4_1", context_length: int | None = None) -> ModelSpec:
    """A llama-shaped spec of a published size (``"70b"``), weights at ``quant`` (default Q4_1).

    Layer bytes come from the parameter counts: attention ``h*h*2 + h*kv*2`` and MLP ``3*h*i``.
    Llama-3.1-70B at Q4_1 is 80 layers of about 0.53 GB; the KV cache is float32 as our backends
    keep it.
    """
    key = size.lower().removeprefix("synthetic:")
    shape = SYNTHETIC_SHAPES.get(key)
    if shape is None:
        raise ValueError(f"unknown synthetic model {size!r}: use one of " + ", ".join(f"synthetic:{k}" for k in SYNTHETIC_SHAPES))
    if quant not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown quantization {quant!r}: use one of {', '.join(BYTES_PER_WEIGHT)}")
    bpw = BYTES_PER_WEIGHT[quant]
    h, i = shape.hidden, shape.intermediate
    head_dim = h // shape.n_heads
    kv = shape.n_kv_heads * head_dim
    layer_params = 2 * h * h + 2 * h * kv + 3 * h * i
    norms = 2 * h * 4
    embed = int(shape.vocab * h * bpw)
    return ModelSpec(
        name=f"synthetic:{key} ({shape.label} {quant})",
        n_layers=shape.n_layers,
        layer_bytes=int(layer_params * bpw) + norms,
        embed_bytes=embed,
        head_bytes=(embed if shape.tied else int(shape.vocab * h * bpw)) + h * 4,
        kv_bytes_per_token_per_layer=2 * kv * 4,
        hidden_size=h,
        context_length=context_length or shape.context,
        tied_embeddings=shape.tied,
    )
