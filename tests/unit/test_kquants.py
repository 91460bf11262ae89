"""GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K) kept quantized: decoded exactly as gguf (and
llama.cpp) dequantize them, and run by each backend from its quantized form against the NumPy
reference of the same blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from backends import available_backends, get_backend
from backends.kquants import GROUP, decode
from backends.weights import KQUANT_BLOCK_BYTES, QuantizedWeight
from exo_tui.models.gguf_file import GGUFModel
from tests.factory import random_kquant_blocks, write_tiny_llama
from tests.reference import ReferenceShard

TYPES = list(KQUANT_BLOCK_BYTES)
BACKENDS = [b for b in ("onnx", "mlx") if b in available_backends()]


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (7, 512), (33, 1024)])
def test_decoding_is_bit_exact_with_gguf(type_name: str, rows: int, cols: int) -> None:
    rng = np.random.default_rng(rows + cols)
    raw = random_kquant_blocks(rng, rows, cols, type_name, 0.02)
    want = dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)).reshape(rows, cols)
    q, scales, biases = decode(raw, type_name, cols)
    w = QuantizedWeight(q=q, scales=scales, biases=biases, bits=int(type_name[1]), group=GROUP[type_name],
                        source_type=type_name)
    assert np.array_equal(w.dequantize(), want)
    assert np.array_equal(w.dequantize(2, 5), want[2:5])
    assert q.max() < 2 ** w.bits
    assert w.nbytes == raw.nbytes  # a node holds the file's bytes for it


@pytest.mark.parametrize("type_name", TYPES)
def test_the_super_block_fields_come_back_from_the_groups(type_name: str) -> None:
    """``superblocks`` finds a float16 ``d`` (``dmin``) per super-block and integer scales (mins) in
    their range that give the decoded groups exactly in float32 (what the ONNX kernel computes
    from them); groups that are no such super-blocks give None."""
    from backends.kquants import superblocks

    rng = np.random.default_rng(21)
    raw = random_kquant_blocks(rng, 9, 1024, type_name, 0.02).reshape(9, 4, -1)
    half = (rng.standard_normal((9, 4, 2)) * 1e-3).astype(np.float16)  # a random d (and dmin) each
    if type_name == "Q6_K":
        raw[..., 208:210] = half[..., :1].view(np.uint8)
    else:
        raw[..., 0:4] = np.abs(half).view(np.uint8).reshape(9, 4, 4)
    _, scales, biases = decode(raw.reshape(9, -1), type_name, 1024)
    d, dmin, sc, m = superblocks(type_name, scales, biases)
    per = 256 // GROUP[type_name]
    assert d.dtype == dmin.dtype == np.float16 and d.shape == (9, 4) and sc.shape == m.shape == scales.shape
    got = np.repeat(d.astype(np.float32), per, axis=1) * sc.astype(np.float32)
    assert np.array_equal(got, scales)
    if type_name == "Q6_K":
        assert sc.dtype == np.int8 and not m.any()
    else:
        assert sc.max() <= 63 and m.max() <= 63
        assert np.array_equal(-(np.repeat(dmin.astype(np.float32), per, axis=1) * m.astype(np.float32)), biases)
    assert superblocks(type_name, scales * np.float32(1 + 2**-20), biases) is None
    assert superblocks(type_name, scales, biases - np.float32(1e-3)) is None


@pytest.mark.parametrize("type_name", TYPES)
def test_the_reader_hands_over_the_files_own_super_block_fields(type_name: str) -> None:
    """The GGUF reader's K-quant matrices carry their blocks' ``d``, ``dmin``, scales and mins as
    the file has them (no search at load), in the form ``superblocks`` gives, row slices too."""
    from backends.kquants import superblocks, weight

    rng = np.random.default_rng(5)
    raw = random_kquant_blocks(rng, 6, 512, type_name, 0.02)
    w = weight(raw, type_name, 512)
    d, dmin, sc, m = w.superblocks
    per = 256 // GROUP[type_name]
    blocks = raw.reshape(6, 2, -1)
    at = slice(208, 210) if type_name == "Q6_K" else slice(0, 2)
    assert np.array_equal(d, np.ascontiguousarray(blocks[..., at]).view(np.float16)[..., 0])
    assert np.array_equal(np.repeat(d.astype(np.float32), per, axis=1) * sc.astype(np.float32), w.scales)
    if type_name != "Q6_K":
        assert np.array_equal(-(np.repeat(dmin.astype(np.float32), per, axis=1) * m.astype(np.float32)), w.biases)
    searched = superblocks(type_name, w.scales, w.biases)
    assert [f.dtype for f in searched] == [f.dtype for f in w.superblocks]
    assert [f.shape for f in searched] == [f.shape for f in w.superblocks]
    part = w.take_rows(np.array([4, 1]))
    assert np.array_equal(part.q, w.q[[4, 1]]) and np.array_equal(part.superblocks[2], sc[[4, 1]])


def test_a_row_that_is_not_whole_super_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        decode(np.zeros((1, 144), np.uint8), "Q4_K", 128)


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kquants")
    return {t: write_tiny_llama(d / f"{t}.gguf", hidden=256, intermediate=512, n_layers=3, weight_type=t,
                                embed_type="F32", tied=False) for t in TYPES}


@pytest.mark.parametrize("type_name", TYPES)
def test_the_reader_keeps_them_quantized(kquant_files: dict[str, Path], type_name: str) -> None:
    model = GGUFModel(kquant_files[type_name])
    lw = model.shard_weights(0, 1).layers[0]
    assert isinstance(lw.wq, QuantizedWeight) and lw.wq.source_type == type_name
    assert lw.wq.group == GROUP[type_name]
    assert model.layer_nbytes(0) == sum(model.tensor_info(f"blk.0.{n}").nbytes for n in model.family.layer_tensors().values())


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_backends_run_them_as_the_reference_does(kquant_files: dict[str, Path], type_name: str, name: str) -> None:
    model = GGUFModel(kquant_files[type_name])
    cfg = model.config
    tokens = np.arange(3, 40) % cfg.vocab_size
    pos = np.arange(len(tokens))
    want = ReferenceShard(cfg, model.shard_weights(0, cfg.n_layers)).forward("r", tokens, pos, all_logits=True)
    if name == "onnx":
        from backends.onnx import ONNXBackend

        engine = ONNXBackend(threads=2, precision="float32")
    else:
        engine = get_backend(name)
    first = engine.load_shard(cfg, model.shard_weights(0, 1))
    last = engine.load_shard(cfg, model.shard_weights(1, cfg.n_layers))
    got = last.forward("r", first.forward("r", tokens, pos), pos, all_logits=True)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
