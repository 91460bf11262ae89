"""Reading GGUF files of the families in :mod:`exo_tui.models.families`: the model config, the
tokenizer fields, and the weights of any layer range (only those tensors are read; the file is
memory-mapped)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from backends import backend_class, blocks, kquants
from backends.base import ModelConfig
from backends.memory import LoadPiece, load_peak_bytes
from backends.weights import LayerWeights, LazyLayers, QuantizedWeight, ShardWeights, Weight
from exo_tui.models.families import (
    CONFIG_TENSORS,
    END_TENSORS,
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    FamilyError,
    family_of,
    permute_heads,
    read_config,
    split_rows,
)
from exo_tui.models.gguf_header import GGUFHeader, type_name

__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFModel", "ModelFileError", "TensorInfo", "UnsupportedModelError",
           "held_nbytes", "lazy_shard", "load_pieces", "shard_load_peak", "tensor_from_raw"]


class ModelFileError(Exception):
    """A model file cannot be used; the message names the file and what to do."""


class UnsupportedModelError(ModelFileError):
    """A readable model file of a family, or with a feature, that exo-tui does not run (yet)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first: (out, in) for matrices
    nbytes: int


def bytes_by_type(tensors: Iterable[TensorInfo]) -> dict[str, int]:
    """The bytes of ``tensors`` by GGUF type."""
    out: dict[str, int] = {}
    for t in tensors:
        out[t.type_name] = out.get(t.type_name, 0) + t.nbytes
    return out


def _grouped(tensors: Iterable[TensorInfo]) -> list[list[TensorInfo]]:
    """``tensors`` as the pieces a load reads at once, in its order: a layer's tensors together (by
    their ``blk.N.`` prefix), the others (embedding, final norm, head) one each."""
    pieces: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        pieces.setdefault(t.name.split(".")[1] if t.name.startswith("blk.") else t.name, []).append(t)
    return list(pieces.values())


def load_pieces(tensors: Iterable[TensorInfo], backend: str) -> list[LoadPiece]:
    """A shard's ``tensors`` as the pieces its load on ``backend`` reads at once (:func:`_grouped`),
    for :func:`backends.memory.load_peak_bytes`: each tensor as (GGUF type name, file bytes, bytes
    as the backend holds it), a mixture's experts with no type name: they are decoded whole."""
    return _load_pieces(_grouped(tensors), backend)


def _load_pieces(pieces: list[list[TensorInfo]], backend: str) -> list[LoadPiece]:
    cls = backend_class(backend)
    return [[("" if "_exps." in t.name else t.type_name, t.nbytes, cls.held_nbytes(t.type_name, t.shape))
             for t in piece] for piece in pieces]


def shard_load_peak(backend: str, tensors: Iterable[TensorInfo], *, first: bool, last: bool) -> int:
    """What the load of a shard of ``tensors`` on ``backend`` takes at its peak beside the arrays
    it holds once loaded: each piece's temporaries beside the arrays of the pieces read so far
    (:func:`backends.memory.load_peak_bytes` with each piece's :func:`held_nbytes`)."""
    tensors = list(tensors)
    tied = last and not any(t.name == "output.weight" for t in tensors)  # the shard's, not a piece's
    pieces = _grouped(tensors)
    if first and not backend_class(backend).embedding_first:  # the layers, then the embedding, then the head
        embedding = [p for p in pieces if p[0].name == "token_embd.weight"]
        layers = [p for p in pieces if p[0].name.startswith("blk.")]
        pieces = layers + embedding + [p for p in pieces if p not in layers and p not in embedding]
    held = [held_nbytes(backend, piece, first=first, last=last, tied=tied) for piece in pieces]
    return load_peak_bytes(backend, _load_pieces(pieces, backend), held)


def held_nbytes(backend: str, tensors: Iterable[TensorInfo], *, first: bool, last: bool, tied: bool | None = None) -> int:
    """The bytes a shard of ``tensors`` (its layers', and the embedding or head at the ends) holds
    on ``backend`` (:meth:`backends.base.Backend.held_nbytes`): the token embedding as the rows the
    ``first`` shard looks up, and on a ``last`` shard of a model that ties them (no
    ``output.weight``), as the head's matrix too: on a shard with both, the head's form alone where
    the backend keeps one form for both (``Backend.shares_tied``). ``tied``: whether the model ties
    them, where ``tensors`` are part of a shard (default: whether they hold no ``output.weight``)."""
    cls = backend_class(backend)
    tensors = list(tensors)
    if tied is None:
        tied = not any(t.name == "output.weight" for t in tensors)
    tied = tied and last
    total = 0
    for t in tensors:
        if t.name != "token_embd.weight":
            total += cls.held_nbytes(t.type_name, t.shape)
            continue
        if first and tied and cls.shares_tied(t.type_name, t.shape):  # one form for both: the head's
            total += cls.held_nbytes(t.type_name, t.shape)
            continue
        if first:
            total += cls.held_nbytes(t.type_name, t.shape, embedding=True)
        if tied:
            total += cls.held_nbytes(t.type_name, t.shape)
    return total


class GGUFModel:
    """An opened GGUF file. Cheap to open: tensors are read when a shard asks for them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(
                f"model file {self.path} does not exist: check the path, or use a registered "
                "model name such as smollm2-135m"
            )
        if not self.path.is_file():
            raise ModelFileError(f"model path {self.path} is not a file: give the path of a .gguf file")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelFileError(
                f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
                "convert the model to GGUF (llama.cpp's convert_hf_to_gguf.py) or pick another file"
            )
        try:
            self._header = GGUFHeader(self.path)
        except Exception as exc:  # GGUFFormatError, or the OS's on a file it cannot map
            raise ModelFileError(
                f"{self.path} is truncated or corrupt ({type(exc).__name__}: {exc}): "
                "download or copy the file again"
            ) from exc
        self._fields = self._header.fields
        self._tensors = self._header.tensors
        self.architecture = str(self.field("general.architecture", ""))
        try:
            self.family = family_of(self.architecture, str(self.path))
            self.config  # noqa: B018 - read now: a feature no backend runs refuses the file before anything loads
        except FamilyError as exc:
            raise UnsupportedModelError(str(exc)) from exc
        self._check_complete()

    # ---------------------------------------------------------------- metadata

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value: a number, bool or string, or a list of them for an array."""
        value = self._fields.get(key)
        if value is None:
            return default
        return value.tolist() if isinstance(value, np.ndarray) else value

    def field_item(self, key: str, index: int) -> Any:
        """One element of an array field (e.g. one token's text)."""
        value = self._fields.get(key)
        if not isinstance(value, (list, np.ndarray)) or not 0 <= index < len(value):
            return None
        item = value[index]
        return item.item() if isinstance(item, np.generic) else item

    def field_array(self, key: str) -> np.ndarray | None:
        """A numeric array field as one NumPy array (token scores and types)."""
        value = self._fields.get(key)
        if value is None:
            return None
        return value if isinstance(value, np.ndarray) else np.asarray(value)

    @cached_property
    def config(self) -> ModelConfig:
        def shape(name: str) -> tuple[int, ...] | None:
            t = self._tensors.get(name)
            return None if t is None else tuple(reversed(t.dims))

        def values(name: str) -> np.ndarray:
            w = self.tensor(name)
            return np.asarray(w.dequantize() if isinstance(w, QuantizedWeight) else w, dtype=np.float32)

        return read_config(self.architecture, self.field, shape, values, str(self.path))

    @cached_property
    def fingerprint(self) -> str:
        """Which model this file is, for nodes to tell one model's shards from another's: a hash
        of its header (metadata and tensor directory), its size and 64 KiB of its tensor data at
        eight places (two fine-tunes of one shape share a header, not their weights)."""
        import hashlib

        data = np.memmap(self.path, mode="r")
        start = min((t.offset for t in self._tensors.values()), default=data.size)
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(data[:start]).tobytes())
        h.update(str(data.size).encode())
        for i in range(8):
            at = start + (data.size - start) * i // 8
            h.update(np.ascontiguousarray(data[at : at + (64 << 10)]).tobytes())
        return h.hexdigest()[:32]

    @property
    def name(self) -> str:
        return str(self.field("general.name", self.path.stem))

    @property
    def tied_embeddings(self) -> bool:
        return "output.weight" not in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path} lacks tensor {name}: the file is incomplete or not a model of a family exo-tui runs")
        return TensorInfo(name, type_name(t.type_id), tuple(reversed(t.dims)), t.n_bytes)

    def layer_names(self, layer: int) -> list[str]:
        """The names of ``layer``'s tensors (its family's)."""
        return [f"blk.{layer}.{n}" for n in self.family.layer_tensors(bool(self.config.n_experts)).values()]

    def _check_complete(self) -> None:
        cfg = self.config
        names = ["token_embd.weight", "output_norm.weight"]
        names += [n for i in range(cfg.n_layers) for n in self.layer_names(i)]
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise ModelFileError(
                f"{self.path} lacks {len(missing)} tensors (first: {missing[0]}): the file is incomplete"
            )
        known = set(names) | set(END_TENSORS) | set(CONFIG_TENSORS)
        unknown = sorted(n for n in self._tensors if n not in known and not n.endswith(".attn_rot_embd"))
        if unknown:
            raise UnsupportedModelError(
                f"{self.path} ({self.architecture}) holds tensor {unknown[0]}"
                + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else "")
                + " that exo-tui does not know how to run, so it is refused rather than run without it; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        size = self.path.stat().st_size
        for t in self._tensors.values():
            if t.offset + t.n_bytes > size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {t.name} ends past the end of the file "
                    f"({size} bytes); download or copy the file again"
                )

    # ---------------------------------------------------------------- sizes

    def layer_nbytes(self, layer: int) -> int:
        return sum(self.tensor_info(n).nbytes for n in self.layer_names(layer))

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of ``layer``'s experts' matrices (0 in a dense model)."""
        names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        return sum(self.tensor_info(n).nbytes for n in names if n in self._tensors)

    def load_peak_nbytes(self, start: int, end: int, backend: str) -> int:
        """What a load of layers ``[start, end)`` on ``backend`` takes at its peak beside the
        shard's arrays (:func:`shard_load_peak`)."""
        return shard_load_peak(backend, (self.tensor_info(n) for n in self.shard_tensor_names(start, end)),
                               first=start == 0, last=end == self.config.n_layers)

    def most_load_peak_nbytes(self, backend: str) -> int:
        """The most a load of any shard of this model on ``backend`` takes at its peak beside its
        arrays (what a plan leaves a node for it: :func:`backends.memory.load_peak_bytes`)."""
        names = self.shard_tensor_names(0, self.config.n_layers)
        return load_peak_bytes(backend, load_pieces((self.tensor_info(n) for n in names), backend))

    def held_nbytes(self, start: int, end: int, backend: str) -> int:
        """What a shard of layers ``[start, end)`` holds on ``backend`` (:func:`held_nbytes`)."""
        names = self.shard_tensor_names(start, end)
        return held_nbytes(backend, (self.tensor_info(n) for n in names), first=start == 0,
                           last=end == self.config.n_layers)

    @property
    def embed_nbytes(self) -> int:
        return self.tensor_info("token_embd.weight").nbytes

    @property
    def head_nbytes(self) -> int:
        """Final norm plus output matrix (the embedding again when tied)."""
        out = "token_embd.weight" if self.tied_embeddings else "output.weight"
        return self.tensor_info("output_norm.weight").nbytes + self.tensor_info(out).nbytes

    @property
    def nbytes(self) -> int:
        total = sum(self.layer_nbytes(i) for i in range(self.config.n_layers))
        total += self.embed_nbytes + self.tensor_info("output_norm.weight").nbytes
        if not self.tied_embeddings:
            total += self.tensor_info("output.weight").nbytes
        return total

    # ---------------------------------------------------------------- weights

    def release_pages(self) -> None:
        """The file's pages read so far leave this process's resident memory (see GGUFHeader)."""
        self._header.release_pages()

    def raw_tensor(self, name: str) -> tuple[TensorInfo, np.ndarray]:
        """A tensor's bytes exactly as stored in the file (quantized blocks stay blocks)."""
        info = self.tensor_info(name)
        return info, self._header.tensor_bytes(self._tensors[name])

    def tensor(self, name: str) -> Weight:
        """A tensor as a float32 vector/matrix or a :class:`QuantizedWeight`."""
        info, raw = self.raw_tensor(name)
        try:
            weight = tensor_from_raw(info, raw, release=self._header.release_view)
        except ModelFileError:
            raise
        except Exception as exc:
            raise ModelFileError(f"{self.path}: tensor {name} cannot be read ({exc}); the file may be corrupt") from exc
        # What comes back is in its own memory: the file's pages for it go, so a shard's load does
        # not hold the bytes of every tensor read so far (GGUFHeader.release_pages).
        self._header.release_pages(self._tensors[name])
        return weight

    def shard_tensor_names(self, start: int, end: int) -> list[str]:
        """The names of the tensors a shard of layers ``[start, end)`` needs."""
        names = ["token_embd.weight"] if start == 0 else []
        names += [n for i in range(start, end) for n in self.layer_names(i)]
        if end == self.config.n_layers:
            names.append("output_norm.weight")
            if not self.tied_embeddings:
                names.append("output.weight")
            elif start != 0:
                names.append("token_embd.weight")
        return names

    def shard_weights(self, start: int, end: int) -> ShardWeights:
        """The weights of layers ``[start, end)``, plus the embedding / head at the ends."""
        n = self.config.n_layers
        if not 0 <= start < end <= n:
            raise ModelFileError(f"layer range [{start}, {end}) is not within [0, {n}) of {self.path}")
        weights = lazy_shard(self.config, start, end, self.tensor, tied=self.tied_embeddings)
        infos = [self.tensor_info(n) for n in self.shard_tensor_names(start, end)]
        weights.stored_nbytes = sum(t.nbytes for t in infos)
        weights.stored_types = bytes_by_type(infos)
        return weights


def lazy_shard(config: ModelConfig, start: int, end: int, get: Callable[[str], Weight], *, tied: bool) -> ShardWeights:
    """Shard weights whose layers are read (``get`` by GGUF name) when a backend first reads each,
    in the backends' layout: fused matrices split, NeoX heads permuted to adjacent pairs. A backend
    that drops each layer once built holds one layer at a time beside the shard (a K-quant layer as its
    file's bytes, decoded a chunk at a time as the backend reads it: backends/kquants.py)."""
    layers = LazyLayers(lambda j: assemble_layer(config, start + j, get), end - start)
    return _with_ends(config, start, end, layers, get, tied=tied)


def _with_ends(config: ModelConfig, start: int, end: int, layers, get: Callable[[str], Weight],  # noqa: ANN001
               tied: bool) -> ShardWeights:
    """The shard with its embedding (first) and final norm and head (last; the embedding when tied)."""
    embed = get("token_embd.weight") if start == 0 else None
    norm = output = None
    if end == config.n_layers:
        norm = _dense_vector(get("output_norm.weight"))
        if tied:  # one matrix, read once: the head is the embedding (ShardWeights counts it once)
            output = embed if embed is not None else get("token_embd.weight")
        else:
            output = get("output.weight")
    return ShardWeights(start, end, layers, embed, norm, output)


def assemble_layer(config: ModelConfig, i: int, get: Callable[[str], Weight]) -> LayerWeights:
    """Layer ``i``'s weights from its tensors (``get`` by GGUF name), in the backends' layout."""
    family = FAMILIES.get(config.arch)
    if family is None:
        raise ModelFileError(f"a shard of architecture {config.arch!r}: exo-tui runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    c = config
    # tensors, then the lists and vectors they become: LayerWeights' fields, by name
    ws: dict[str, Any] = {f: get(f"blk.{i}.{n}") for f, n in family.layer_tensors(bool(c.n_experts)).items()}
    try:
        for f in ("experts_gate", "experts_up", "experts_down"):
            if f in ws:  # a stack of the experts' matrices, one after the other
                rows = ws[f].shape[0] // c.n_experts
                ws[f] = split_rows(ws[f], [rows] * c.n_experts)
        if "wqkv" in ws:
            qd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            ws["wq"], ws["wk"], ws["wv"] = split_rows(ws.pop("wqkv"), [qd, kvd, kvd])
        if "w_gate_up" in ws:
            ws["w_gate"], ws["w_up"] = split_rows(ws.pop("w_gate_up"), [c.intermediate_size] * 2)
    except FamilyError as exc:
        raise ModelFileError(f"layer {i}: {exc}") from exc
    for f in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm"):
        if f in ws:
            ws[f] = _dense_vector(ws[f])
    if family.neox:
        ws["wq"], ws["wk"] = permute_heads(ws["wq"], c.n_heads, c.head_dim), permute_heads(ws["wk"], c.n_kv_heads, c.head_dim)
        for f, heads in (("bq", c.n_heads), ("bk", c.n_kv_heads), ("q_norm", 1), ("k_norm", 1)):
            if f in ws:
                ws[f] = permute_heads(ws[f], heads, c.head_dim)
    return LayerWeights(**ws)


def tensor_from_raw(info: TensorInfo, raw: np.ndarray, release: Callable[[np.ndarray], None] | None = None) -> Weight:
    """Decode a tensor's stored bytes (``raw``, uint8) given its type and shape. A stack of
    matrices ``(n, rows, cols)`` (a mixture's experts) comes back as one ``(n * rows, cols)``
    matrix, each matrix's rows after the previous one's. A K-quant matrix stays its super-blocks,
    over ``raw`` (:class:`backends.kquants.KQuantWeight`); ``release``, where ``raw`` is a view of a
    mapped file, lets the file's pages under bytes already read go."""
    import gguf

    if len(info.shape) == 3:
        n, rows, cols = info.shape
        info = TensorInfo(info.name, info.type_name, (n * rows, cols), info.nbytes)
    expected = _stored_nbytes(info)
    if raw.nbytes != expected:
        raise ModelFileError(f"tensor {info.name}: {raw.nbytes} bytes, expected {expected} for {info.type_name} {info.shape}")
    if info.type_name == "F32":
        return raw.view(np.float32).reshape(info.shape).copy()
    if info.type_name in ("F16", "BF16") and len(info.shape) == 1:
        return _to_float32(raw, info.type_name).reshape(info.shape)
    if info.type_name == "F16":
        return raw.view(np.float16).reshape(info.shape).copy()
    if info.type_name == "BF16":
        return _to_float32(raw, info.type_name).reshape(info.shape)
    # Blocks of 32 and K-quant super-blocks are kept as the file's: a backend decodes them a chunk
    # at a time as it builds its form of them, and the file's pages under each chunk go once read.
    if info.type_name in blocks.BLOCK_BYTES:
        rows = info.shape[0] if len(info.shape) > 1 else 1
        return blocks.BlockWeight(raw.reshape(rows, -1), info.type_name, info.shape[-1], release=release)
    if info.type_name in kquants.BLOCK_BYTES and len(info.shape) == 2:
        return kquants.KQuantWeight(raw.reshape(info.shape[0], -1), info.type_name, info.shape[1], release=release)
    qtype = getattr(gguf.GGMLQuantizationType, info.type_name)
    rows = info.shape[0] if len(info.shape) > 1 else 1
    return _dequantize_other(raw.reshape(rows, -1), qtype, info)


def _stored_nbytes(info: TensorInfo) -> int:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, info.type_name, None)
    if qtype is None:
        raise ModelFileError(f"tensor {info.name} has unknown type {info.type_name}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(info.shape)) // block * type_size


def _to_float32(raw: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float16).astype(np.float32)


def _dense_vector(w: Weight) -> np.ndarray:
    if isinstance(w, QuantizedWeight):
        return w.dequantize().reshape(-1)
    return np.asarray(w, dtype=np.float32)


def _dequantize_other(raw: np.ndarray, qtype: Any, info: TensorInfo) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise ModelFileError(
            f"tensor {info.name} has type {info.type_name}, which exo-tui cannot read: "
            "use a GGUF quantized as F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (or another "
            "type gguf can dequantize)"
        ) from exc
    return np.asarray(values, dtype=np.float32).reshape(info.shape)
