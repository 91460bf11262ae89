"""GGUF files: loading layer ranges, and one clear error for each kind of bad file."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from backends.weights import QuantizedWeight, dense
from exo_tui.models.catalog import resolve_model
from exo_tui.models.gguf_file import GGUFModel, ModelFileError, tensor_from_raw
from exo_tui.models.gguf_header import GGUFFormatError, GGUFHeader
from tests.conftest import WEIGHT_TYPES
from tests.factory import write_tiny_llama


def test_loads_only_the_requested_layers(tiny_models: dict[str, Path]) -> None:
    model = GGUFModel(tiny_models["Q4_1"])
    mid = model.shard_weights(1, 3)
    assert (mid.start, mid.end, len(mid.layers)) == (1, 3, 2)
    assert mid.embed is None and mid.output is None and mid.norm is None
    first = model.shard_weights(0, 1)
    assert first.embed is not None and first.output is None
    last = model.shard_weights(3, 4)
    assert last.embed is None and last.norm is not None
    # Tied embeddings: the head of the last shard is the token embedding.
    assert np.array_equal(dense(last.output), dense(first.embed))
    assert isinstance(mid.layers[0].wq, QuantizedWeight) and mid.layers[0].wq.source_type == "Q4_1"


@pytest.mark.parametrize("wt", WEIGHT_TYPES)
def test_weights_equal_gguf_dequantization(tiny_models: dict[str, Path], wt: str) -> None:
    """Quantized blocks unpack to exactly what gguf's own dequantizer gives."""
    model = GGUFModel(tiny_models[wt])
    t = next(t for t in gguf.GGUFReader(tiny_models[wt]).tensors if t.name == "blk.2.ffn_down.weight")
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(model.tensor_info(t.name).shape)
    assert np.array_equal(dense(model.tensor(t.name)), expected.astype(np.float32))


@pytest.mark.parametrize("wt", WEIGHT_TYPES)
def test_the_header_reads_as_ggufs_own_reader_does(tiny_models: dict[str, Path], wt: str) -> None:
    """Every metadata value and every tensor's place, type and bytes, as gguf's GGUFReader has them."""
    header = GGUFHeader(tiny_models[wt])
    theirs = gguf.GGUFReader(tiny_models[wt])
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # its own: version and counts
    assert keys == list(header.fields)
    for k in keys:
        ours = header.fields[k]
        assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == pytest.approx(theirs.fields[k].contents()), k
    assert [t.name for t in theirs.tensors] == list(header.tensors)
    for t in theirs.tensors:
        e = header.tensors[t.name]
        assert (e.dims, e.type_id, e.offset, e.n_bytes) == (tuple(int(d) for d in t.shape), int(t.tensor_type),
                                                            int(t.data_offset), int(t.n_bytes))
        assert np.array_equal(header.tensor_bytes(e), np.asarray(t.data).reshape(-1).view(np.uint8))


def _header(*parts: bytes) -> bytes:
    return b"GGUF" + b"".join(parts)


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(("data", "why"), [
    (_header(struct.pack("<I", 1)), "version 1; exo-tui reads versions 2 and 3"),
    (_header(struct.pack(">I", 3)), "big-endian GGUF: convert it again"),
    (_header(struct.pack("<IQQ", 3, 0, 1 << 40)), "counts of fields and tensors exceed the file"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("k"), struct.pack("<I", 99), b"\0" * 16), "unknown value type 99"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("k"), struct.pack("<I", 8), _s(b"\xff\xfe")), "is not UTF-8"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("k"), struct.pack("<IIQ", 9, 6, 1 << 50)), "array of .* exceeds the file"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("k"), struct.pack("<IIQ", 9, 8, 1 << 40)), "array of .* exceeds the file"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("k" * 20)[:15]), "ends inside its header"),
    (_header(struct.pack("<IQQ", 3, 1, 0), _s("t"), struct.pack("<IQIQ", 1, 33, 2, 0)), "33 elements, not whole blocks of 32"),
    (_header(struct.pack("<IQQ", 3, 1, 0), _s("t"), struct.pack("<IQIQ", 1, 4, 250, 0)), "unknown type 250"),
    (_header(struct.pack("<IQQ", 3, 0, 1), _s("general.alignment"), struct.pack("<II", 4, 24), b"\0" * 16),
     "alignment 24 is not a power of two"),
])
def test_a_bad_header_says_what_is_wrong(tmp_path: Path, data: bytes, why: str) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=why):
        GGUFHeader(p)
    with pytest.raises(ModelFileError, match=f"{p} is truncated or corrupt .*{why}.*copy the file again"):
        GGUFModel(p)


def test_raw_bytes_round_trip(tiny_models: dict[str, Path]) -> None:
    """What weight streaming sends (a tensor's stored bytes) decodes to the same weight."""
    model = GGUFModel(tiny_models["Q8_0"])
    info, raw = model.raw_tensor("blk.0.attn_q.weight")
    again = tensor_from_raw(info, np.frombuffer(raw.tobytes(), np.uint8))
    assert np.array_equal(dense(again), dense(model.tensor("blk.0.attn_q.weight")))
    with pytest.raises(ModelFileError, match="bytes, expected"):
        tensor_from_raw(info, raw[:-1])


def test_missing_file() -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        GGUFModel("/nonexistent/model.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFModel(p)


def test_truncated_file(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    data = tiny_models["F32"].read_bytes()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelFileError, match="truncated|corrupt") as info:
        GGUFModel(p)
    assert str(p) in str(info.value)


def test_corrupt_header(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    data = bytearray(tiny_models["F32"].read_bytes())
    data[8:16] = b"\xff" * 8  # tensor count: absurd
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        GGUFModel(p)


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(p), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="architecture 'bert'.*llama"):
        GGUFModel(p)


def test_missing_tensor(tmp_path: Path) -> None:
    p = write_tiny_llama(tmp_path / "ok.gguf")
    assert GGUFModel(p).config.n_layers == 4
    w = gguf.GGUFWriter(str(tmp_path / "incomplete.gguf"), "llama")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="lacks .* tensors .*incomplete"):
        GGUFModel(tmp_path / "incomplete.gguf")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """A type gguf cannot dequantize is refused with what to use instead."""
    from exo_tui.models.gguf_file import TensorInfo

    info = TensorInfo("blk.0.attn_q.weight", "Q8_1", (256, 256), 256 * 256 * 40 // 32)
    with pytest.raises(ModelFileError, match="Q8_1.*Q4_1"):
        tensor_from_raw(info, np.zeros(info.nbytes, np.uint8))


def test_layer_range_out_of_bounds(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ModelFileError, match=r"layer range \[2, 9\)"):
        GGUFModel(tiny_models["F32"]).shard_weights(2, 9)


def test_registry() -> None:
    assert resolve_model().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("smollm2-135m") == resolve_model()
    with pytest.raises(ModelFileError, match="unknown model 'gpt-9'.*smollm2-135m"):
        resolve_model("gpt-9")
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model("/nope/x.gguf")


def test_model_is_called_what_the_operator_named_it(tiny_models: dict[str, Path]) -> None:
    """The header, the API's model ids and the plan show this name: the registered one (the default
    when none was given), not the GGUF's long ``general.name``; a path shows the file's model name."""
    from exo_tui.models.model import Model

    assert Model().name == "smollm2-135m"
    assert Model("smollm2-135m").name == "smollm2-135m"
    path = tiny_models["Q8_0"]
    assert Model(path).name == GGUFModel(path).name


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"arch": "qwen2moe"}, r"architecture 'qwen2moe' \(a mixture of experts with shared experts\), which exo-tui does not run yet; it runs llama, qwen2"),
        ({"arch": "bert"}, r"architecture 'bert', which exo-tui does not run yet"),
        ({"sampling": {"llama.expert_count": 4, "llama.expert_used_count": 2}}, r"lacks 16 tensors \(first: blk.0.ffn_gate_inp.weight\)"),
        ({"extra_tensors": {"blk.0.attn_q.bias": np.zeros(64)}}, r"holds tensor blk.0.attn_q.bias that exo-tui does not know"),
        ({"arch": "gemma3", "sampling": {"gemma3.attn_logit_softcapping": 50.0}}, r"uses attention logit soft-capping"),
        ({"sampling": {"llama.rope.dimension_count": 8}}, r"rotary embedding over 8 of each head's 16 dimensions"),
    ],
    ids=["moe-arch", "unknown-arch", "experts-missing", "unknown-tensor", "attn-softcap", "partial-rotary"],
)
def test_unsupported_families_and_features_are_refused_in_one_sentence(tmp_path, kw, says):
    """Refused before anything loads, naming what is not supported and what is: never run with a
    feature ignored."""
    path = write_tiny_llama(tmp_path / "m.gguf", **kw)
    with pytest.raises(ModelFileError, match=says) as info:
        GGUFModel(path)
    assert str(info.value).count(". ") == 0  # one sentence


@pytest.mark.parametrize(("rope", "want"), [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, ("linear", 4.0)),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 8.0,
      "llama.rope.scaling.original_context_length": 32}, ("yarn", 8.0)),
])
def test_rope_scaling_is_read(tmp_path, rope, want):
    fields = {k: v for k, v in rope.items() if not isinstance(v, str)}
    path = write_tiny_llama(tmp_path / "m.gguf", sampling=fields, strings={k: v for k, v in rope.items() if isinstance(v, str)})
    cfg = GGUFModel(path).config
    assert (cfg.rope_scaling, cfg.rope_factor) == want
    if want[0] == "yarn":
        assert cfg.rope_original_context == 32 and cfg.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(8.0))


def test_llama3_frequency_factors_are_read_from_rope_freqs(tmp_path):
    factors = np.linspace(1, 8, 8).astype(np.float32)
    path = write_tiny_llama(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": factors})
    assert GGUFModel(path).config.rope_freq_factors == tuple(float(f) for f in factors)
