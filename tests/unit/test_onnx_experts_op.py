"""exo-tui's ``Experts`` op (backends/onnx/kernels/experts.c): a mixture of experts on QLinear's
tiles, the experts kept in their file's blocks. Checked against NumPy in every format at every
precision, inside ONNX Runtime as called directly, each row's output whatever its batch, and a
quantized MoE file held at about its own bytes."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest

from backends.onnx.kernels import experts as X
from exo_tui.models.gguf_file import GGUFModel
from tests.unit.test_family_logits import assert_as_close_as_llama_cpp
from tests.unit.test_onnx_kernel import library  # noqa: F401 - the fixture

FIXTURES = Path(__file__).parents[1] / "fixtures" / "families"
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]


def precisions(lib) -> list[int]:
    return [0, 16, 8] if lib.integer else [0]


def case(rng: np.random.Generator, gate_type: str, down_type: str, m: int, e: int = 6):
    h, f = 256, 512  # whole super-blocks along both K
    gate, up = X.random_experts(rng, e, f, h, gate_type), X.random_experts(rng, e, f, h, gate_type)
    down = X.random_experts(rng, e, h, f, down_type)
    x = rng.standard_normal((m, h)).astype(np.float32)
    logits = (2 * rng.standard_normal((m, e))).astype(np.float32)
    return gate, up, down, x, logits


@pytest.mark.parametrize("gate_type", TYPES)
def test_every_format_matches_numpy_in_a_session_at_every_precision(library, gate_type):  # noqa: F811
    lib = ctypes.CDLL(library.path)
    rng = np.random.default_rng(TYPES.index(gate_type))
    down_type = TYPES[(TYPES.index(gate_type) + 2) % len(TYPES)]  # another format for down
    gate, up, down, x, logits = case(rng, gate_type, down_type, m=9)
    attrs = X.attributes(gate[0], down[0])
    for xbits in precisions(library):
        for norm in (True, False):
            w1, w2 = X.pack_experts(gate, up, down, xbits)
            want = X.reference(x, logits, gate, up, down, 3, norm, xbits)
            got = X.call(lib, x, logits, w1, w2, 3, norm, attrs, xbits)
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 1e-5, f"{gate_type}/{down_type} int{xbits} norm={norm}: off by {err:.3g} of the largest"
            in_session = X.run_in_session(library.path, x, logits, w1, w2, 3, norm, attrs, xbits, threads=2)
            assert np.array_equal(in_session, got)


def test_a_row_gives_the_same_output_alone_and_in_a_batch(library):  # noqa: F811
    """Rows share experts in a batch (each expert runs once on all its rows), yet each row's
    output is what it is alone, to the bit."""
    lib = ctypes.CDLL(library.path)
    rng = np.random.default_rng(7)
    gate, up, down, x, logits = case(rng, "Q4_K", "Q6_K", m=16, e=4)
    attrs = X.attributes(gate[0], down[0])
    for xbits in precisions(library):
        w1, w2 = X.pack_experts(gate, up, down, xbits)
        together = X.run_in_session(library.path, x, logits, w1, w2, 2, True, attrs, xbits, threads=2)
        alone = np.concatenate([X.call(lib, x[i : i + 1], logits[i : i + 1], w1, w2, 2, True, attrs, xbits)
                                for i in range(len(x))])
        assert np.array_equal(together, alone)
        chosen, _ = X.route(logits, 2, True)
        assert len({int(e) for e in chosen.ravel()}) == 4  # the batch used every expert, several rows each


def test_nan_logits_stay_in_their_row(library):  # noqa: F811
    """A row whose router gives NaN still gets k experts (no index past the experts) and NaN out;
    the other rows are untouched."""
    lib = ctypes.CDLL(library.path)
    rng = np.random.default_rng(2)
    gate, up, down, x, logits = case(rng, "Q4_0", "Q4_0", m=3)
    attrs = X.attributes(gate[0], down[0])
    w1, w2 = X.pack_experts(gate, up, down)
    clean = X.call(lib, x, logits, w1, w2, 2, True, attrs)
    logits[1, :] = np.nan
    got = X.call(lib, x, logits, w1, w2, 2, True, attrs)
    assert np.isnan(got[1]).all() and np.array_equal(got[[0, 2]], clean[[0, 2]])


def test_a_shape_the_op_cannot_take_is_refused_in_the_session(library):  # noqa: F811
    rng = np.random.default_rng(0)
    gate, up, down, x, logits = case(rng, "Q8_0", "Q8_0", m=2)
    w1, w2 = X.pack_experts(gate, up, down)
    with pytest.raises(X.KernelUnavailable, match="W2 must be"):
        X.run_in_session(library.path, x, logits, w1, w2[:, :-1], 2, True, X.attributes(gate[0], down[0]))


@pytest.mark.parametrize("fixture", ["qwen3moe-wide.Q4_K_M.gguf", "qwen3moe-wide.Q8_0.gguf"])
def test_a_quantized_mixture_is_held_at_about_its_files_bytes(library, fixture):  # noqa: F811
    """The shard's graph holds the experts in their blocks (one ``Experts`` op a layer, no
    float32 ``MoE``): their initializers within 6 % of the file's experts' bytes (QLinear's tiles
    keep 4.625 bits a Q4_K weight, the file 4.5; 9 a Q8_0 weight, a float16 bias beside the
    scale, the file 8.5; Q6_K's as the file), where ONNX Runtime's MoE took them as float32 (32 bits a weight)."""
    from backends.onnx.graph import build_shard_graph

    model = GGUFModel(FIXTURES / fixture)
    cfg = model.config
    graph = build_shard_graph(cfg, model.shard_weights(0, cfg.n_layers), kernel=True, xbits=16)
    ops = [n.op_type for n in graph.model.graph.node]
    assert ops.count("Experts") == cfg.n_layers and "MoE" not in ops
    held = sum(a.nbytes for n, a in graph.initializers.items() if "_exps_" in n)
    in_file = sum(model.expert_nbytes(i) for i in range(cfg.n_layers))
    assert in_file <= held <= 1.06 * in_file, (held, in_file)


MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
WIDE = next(e for e in MANIFEST if e["name"] == "qwen3moe-wide")


@pytest.mark.parametrize(("gguf", "precision"), [
    ("qwen3moe-wide.Q4_K_M.gguf", "int16"), ("qwen3moe-wide.Q8_0.gguf", "int16"),
    ("qwen3moe-wide.Q4_K_M.gguf", "int8"), ("qwen3moe-wide.Q8_0.gguf", "int8"),
])
def test_quantized_mixtures_at_the_integer_precisions_are_as_close_as_llama_cpp(library, gguf, precision):  # noqa: F811
    """The fixture's prompt and random sequences, as test_family_logits measures every file (where
    these run at every precision too); here on the ``Experts`` op's own library."""
    from backends.onnx import ONNXBackend

    quant = next(q for q in WIDE["quantized"] if q["gguf"] == gguf)
    model = GGUFModel(FIXTURES / gguf)
    sequences, want = np.array(WIDE["sequences"]), np.load(FIXTURES / WIDE["sequence_logits"])
    n = model.config.n_layers
    shard = ONNXBackend(threads=2, precision=precision).load_shard(model.config, model.shard_weights(0, n))
    pos = np.arange(sequences.shape[1])
    diff = np.stack([shard.forward(f"r{i}", t, pos, all_logits=True) for i, t in enumerate(sequences)]) - want
    shard.close()
    assert_as_close_as_llama_cpp(diff, quant["llama_cpp"], f"{gguf} at {precision}")
