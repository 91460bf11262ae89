"""A scheduler :class:`~exo_tui.scheduler.spec.ModelSpec` from a GGUF file, a registered model
name (``smollm2-135m``) or a synthetic size (``synthetic:70b``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from backends import BACKEND_NAMES, backend_class
from backends.kquants import mostly_kquant
from exo_tui.models.gguf_file import GGUFModel, ModelFileError, bytes_by_type, held_nbytes
from exo_tui.scheduler.spec import SYNTHETIC_SHAPES, HeldBytes, ModelSpec, synthetic_spec


def spec_from_gguf(model: GGUFModel | str | os.PathLike[str], context_length: int | None = None, *,
                   context_limit: int = 0) -> ModelSpec:
    """Layer sizes, embedding/head sizes and KV bytes as the file holds them, the caches counted at
    ``context_length`` tokens, or at the model's own context served under ``context_limit``
    (:func:`served_context`)."""
    m = model if isinstance(model, GGUFModel) else GGUFModel(model)
    cfg = m.config
    layer_bytes = tuple(m.layer_nbytes(i) for i in range(cfg.n_layers))
    active: tuple[int, ...] = ()
    if cfg.n_experts:  # a token reads its top-k experts' matrices, the rest of the layer always
        share = cfg.n_experts_used / cfg.n_experts
        active = tuple(b - int(m.expert_nbytes(i) * (1 - share)) for i, b in enumerate(layer_bytes))
    return ModelSpec(
        name=m.name,
        n_layers=cfg.n_layers,
        layer_bytes=layer_bytes,
        active_layer_bytes=active,
        experts=(cfg.n_experts, cfg.n_experts_used),
        embed_bytes=m.embed_nbytes,
        head_bytes=m.head_nbytes,
        kv_bytes_per_token_per_layer=cfg.kv_bytes_per_token_per_layer,
        hidden_size=cfg.hidden_size,
        context_length=context_length or served_context(cfg.context_length, context_limit),
        tied_embeddings=m.tied_embeddings,
        kv_windows=tuple(cfg.ring_rows if cfg.windowed(i) else 0 for i in range(cfg.n_layers)),
        load_peaks=tuple((b, m.most_load_peak_nbytes(b)) for b in BACKEND_NAMES),
        held=tuple((b, held_on(m, b)) for b in BACKEND_NAMES),
        kquant=mostly_kquant(bytes_by_type(m.tensor_info(n) for i in range(cfg.n_layers) for n in m.layer_names(i))),
    )


def held_on(m: GGUFModel, backend: str) -> HeldBytes:
    """Each layer's, the embedding's and the head's bytes as ``backend``'s shards hold them
    (:func:`exo_tui.models.gguf_file.held_nbytes`)."""
    def held(names: list[str]) -> int:
        return held_nbytes(backend, (m.tensor_info(n) for n in names), first=False, last=False)

    cls = backend_class(backend)
    embd = m.tensor_info("token_embd.weight")
    out = m.tensor_info("token_embd.weight" if m.tied_embeddings else "output.weight")
    return HeldBytes(
        layers=tuple(held(m.layer_names(i)) for i in range(m.config.n_layers)),
        embed=cls.held_nbytes(embd.type_name, embd.shape, embedding=True),
        head=held(["output_norm.weight"]) + cls.held_nbytes(out.type_name, out.shape),
        shares_tied_head=cls.shares_tied(embd.type_name, embd.shape),
    )


def resolve_spec(name_or_path: str | os.PathLike[str] | None, context_length: int | None = None, *,
                 context_limit: int = 0) -> ModelSpec:
    """``synthetic:SIZE`` (no file needed), a registered model name, or a path to a ``.gguf``; its
    caches at ``context_length`` tokens, or at its own context served under ``context_limit``."""
    text = str(name_or_path) if name_or_path is not None else None
    if text is not None and text.lower().startswith("synthetic:"):
        try:
            spec = synthetic_spec(text, context_length=context_length)
        except ValueError as exc:
            raise ModelFileError(str(exc)) from exc
        return dataclasses.replace(spec, context_length=context_length or served_context(spec.context_length, context_limit))
    from exo_tui.models.catalog import resolve_model

    path = resolve_model(text)
    return spec_from_gguf(Path(path), context_length, context_limit=context_limit)


def served_context(model_context: int, limit: int) -> int:
    """The context a model is served at: its own (``model_context``, from its file), or ``limit``
    where that is shorter (``models.context_length``, ``--context``; 0: no limit)."""
    return min(model_context, limit) if limit > 0 else model_context


SYNTHETIC_NAMES = tuple(f"synthetic:{k}" for k in SYNTHETIC_SHAPES)
