"""Reading llama-architecture GGUF files: the model config, the tokenizer fields, and the
weights of any layer range (only those tensors are read; the file is memory-mapped)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import LayerWeights, ModelConfig, QuantizedWeight, ShardWeights, Weight
from exo_tui.models.gguf_header import GGUFHeader, type_name

SUPPORTED_ARCHITECTURES = ("llama",)
# Block formats kept quantized (affine blocks of 32); other types are dequantized at load.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
}


class ModelFileError(Exception):
    """A model file cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first: (out, in) for matrices
    nbytes: int


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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelFileError(
                f"{self.path} has architecture {self.architecture or 'unknown'!r}; exo-tui runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models: choose a llama-architecture GGUF"
            )
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

    def _required(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ModelFileError(f"{self.path} lacks metadata {key}: the file is incomplete or not a llama model")
        return value

    @cached_property
    def config(self) -> ModelConfig:
        a = self.architecture
        hidden = int(self._required(f"{a}.embedding_length"))
        n_heads = int(self._required(f"{a}.attention.head_count"))
        head_dim = int(self.field(f"{a}.attention.key_length", hidden // n_heads))
        vocab = self.field(f"{a}.vocab_size")
        if vocab is None:
            vocab = self.tensor_info("token_embd.weight").shape[0]
        return ModelConfig(
            n_layers=int(self._required(f"{a}.block_count")),
            hidden_size=hidden,
            intermediate_size=int(self._required(f"{a}.feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(self.field(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            rms_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            context_length=int(self.field(f"{a}.context_length", 2048)),
            arch=a,
        )

    @property
    def name(self) -> str:
        return str(self.field("general.name", self.path.stem))

    @property
    def tied_embeddings(self) -> bool:
        return "output.weight" not in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path} lacks tensor {name}: the file is incomplete or not a llama model")
        return TensorInfo(name, type_name(t.type_id), tuple(reversed(t.dims)), t.n_bytes)

    def _check_complete(self) -> None:
        cfg = self.config
        names = ["token_embd.weight", "output_norm.weight"]
        names += [f"blk.{i}.{n}.weight" for i in range(cfg.n_layers) for n in _LAYER_TENSORS.values()]
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise ModelFileError(
                f"{self.path} lacks {len(missing)} tensors (first: {missing[0]}): the file is incomplete"
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
        return sum(self.tensor_info(f"blk.{layer}.{n}.weight").nbytes for n in _LAYER_TENSORS.values())

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

    def raw_tensor(self, name: str) -> tuple[TensorInfo, np.ndarray]:
        """A tensor's bytes exactly as stored in the file (quantized blocks stay blocks)."""
        info = self.tensor_info(name)
        return info, self._header.tensor_bytes(self._tensors[name])

    def tensor(self, name: str) -> Weight:
        """A tensor as a float32 vector/matrix or a :class:`QuantizedWeight`."""
        info, raw = self.raw_tensor(name)
        try:
            return tensor_from_raw(info, raw)
        except ModelFileError:
            raise
        except Exception as exc:
            raise ModelFileError(f"{self.path}: tensor {name} cannot be read ({exc}); the file may be corrupt") from exc

    def shard_tensor_names(self, start: int, end: int) -> list[str]:
        """The names of the tensors a shard of layers ``[start, end)`` needs."""
        names = ["token_embd.weight"] if start == 0 else []
        names += [f"blk.{i}.{n}.weight" for i in range(start, end) for n in _LAYER_TENSORS.values()]
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
        tensors = {name: self.tensor(name) for name in self.shard_tensor_names(start, end)}
        return assemble_shard(self.config, start, end, tensors)


def assemble_shard(config: ModelConfig, start: int, end: int, tensors: dict[str, Weight]) -> ShardWeights:
    """Shard weights from tensors by GGUF name (read from a file or streamed over the wire)."""

    def get(name: str) -> Weight:
        if name not in tensors:
            raise ModelFileError(f"shard [{start}, {end}) is missing tensor {name}")
        return tensors[name]

    layers = []
    for i in range(start, end):
        ws = {f: get(f"blk.{i}.{n}.weight") for f, n in _LAYER_TENSORS.items()}
        for norm in ("attn_norm", "ffn_norm"):
            ws[norm] = _dense_vector(ws[norm])
        layers.append(LayerWeights(**ws))
    embed = get("token_embd.weight") if start == 0 else None
    norm = output = None
    if end == config.n_layers:
        norm = _dense_vector(get("output_norm.weight"))
        output = tensors["output.weight"] if "output.weight" in tensors else get("token_embd.weight")
    return ShardWeights(start, end, layers, embed, norm, output)


def tensor_from_raw(info: TensorInfo, raw: np.ndarray) -> Weight:
    """Decode a tensor's stored bytes (``raw``, uint8) given its type and shape."""
    import gguf

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
    if info.type_name in _BLOCK_BYTES:
        rows = info.shape[0] if len(info.shape) > 1 else 1
        return unpack_blocks(raw.reshape(rows, -1), info.type_name, info.shape)
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


def unpack_blocks(rows: np.ndarray, type_name: str, shape: tuple[int, ...]) -> QuantizedWeight:
    """GGUF Q4_0 / Q4_1 / Q8_0 byte rows ``(rows, nblocks * block_bytes)`` as affine codes."""
    n_rows = rows.shape[0]
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    if len(shape) == 1:
        n_rows = 1
    nb = cols // 32
    blocks = np.ascontiguousarray(rows).reshape(n_rows, nb, _BLOCK_BYTES[type_name])
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if type_name == "Q8_0":
        q = (blocks[:, :, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = -128.0 * d
        bits = 8
    else:
        if type_name == "Q4_1":
            bias = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
            qs = blocks[:, :, 4:20]
        else:  # Q4_0
            bias = -8.0 * d
            qs = blocks[:, :, 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        bits = 4
    return QuantizedWeight(
        q=np.ascontiguousarray(q.reshape(n_rows, cols)),
        scales=np.ascontiguousarray(d),
        biases=np.ascontiguousarray(bias.astype(np.float32)),
        bits=bits,
        group=32,
        source_type=type_name,
    )


def _dequantize_other(raw: np.ndarray, qtype: Any, info: TensorInfo) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise ModelFileError(
            f"tensor {info.name} has type {info.type_name}, which exo-tui cannot read: "
            "use a GGUF quantized as F32, F16, Q8_0, Q4_0 or Q4_1 (or another type gguf can dequantize)"
        ) from exc
    return np.asarray(values, dtype=np.float32).reshape(info.shape)
