"""What a backend's shards hold of a file's tensors (``Backend.held_nbytes``), and that the plan
and a node's memory limit count that, not the file's bytes: ONNX's ``QLinear`` tiles (Q4_K 148
bytes a 256 weights against the file's 144, Q4_0 20 a 32 against 18) and compact embedding rows,
MLX's codes with each group's scale and bias as the file has them (Q4_K 0.578 bytes a weight, its
6-bit scales and mins a byte each, against 0.5625).

Each rule is checked against the arrays a real shard of each type builds: every byte of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends import get_backend
from backends.memory import LOAD_CHUNK_BYTES, load_peak_bytes
from backends.mlx import MLXBackend
from exo_tui.models.gguf_file import GGUFModel, held_nbytes
from exo_tui.models.spec import spec_from_gguf
from exo_tui.net.protocol import NoRoom
from exo_tui.node.host import ShardHost
from exo_tui.scheduler.partition import InfeasiblePlan, make_plan
from exo_tui.scheduler.profile import DeviceProfile
from tests.factory import write_tiny_llama

N_LAYERS = 3
RANGES = [(0, N_LAYERS), (0, 1), (1, N_LAYERS), (1, 2)]
TYPES = [("Q4_K", "Q6_K", True), ("Q5_K", "Q4_K", False), ("Q6_K", "Q8_0", True), ("Q4_0", "Q4_0", False),
         ("Q4_1", "Q5_K", True), ("Q8_0", "Q6_K", False), ("Q5_0", "Q5_1", False), ("Q5_1", "Q5_0", True)]
GB = 1e9
FAMILIES = Path(__file__).parent.parent / "fixtures" / "families"


def model(tmp_path: Path, weight_type: str, embed_type: str, tied: bool) -> GGUFModel:
    return GGUFModel(write_tiny_llama(tmp_path / f"{weight_type}-{embed_type}.gguf", n_layers=N_LAYERS, hidden=256,
                                      intermediate=512, n_heads=4, n_kv_heads=2, weight_type=weight_type,
                                      embed_type=embed_type, tied=tied))


def rule(m: GGUFModel, backend: str, start: int, end: int, matrices_only: bool = False) -> int:
    names = [n for n in m.shard_tensor_names(start, end) if not matrices_only or len(m.tensor_info(n).shape) > 1]
    return held_nbytes(backend, (m.tensor_info(n) for n in names), first=start == 0, last=end == m.config.n_layers)


@pytest.mark.parametrize(("weight_type", "embed_type", "tied"), TYPES, ids=[t[0] for t in TYPES])
def test_onnx_holds_its_tiles_and_embedding_rows_as_counted(tmp_path: Path, weight_type: str, embed_type: str,
                                                            tied: bool) -> None:
    m = model(tmp_path, weight_type, embed_type, tied)
    for start, end in RANGES:
        shard = get_backend("onnx").load_shard(m.config, m.shard_weights(start, end))
        try:
            if not shard.kernel:
                pytest.skip("the QLinear kernel library cannot be built here (no C compiler): MatMulNBits runs")
            tiles = sum(v.numpy().nbytes for v in shard._in_place.values())
            rows = shard._embed.nbytes if shard._embed is not None else 0
            # the norms (float32 vectors) are ONNX Runtime's own copies, which it does not show
            assert tiles + rows == rule(m, "onnx", start, end, matrices_only=True), (start, end)
            assert rule(m, "onnx", start, end) == m.held_nbytes(start, end, "onnx")
        finally:
            shard.close()


@pytest.mark.parametrize(("weight_type", "embed_type", "tied"), TYPES, ids=[t[0] for t in TYPES])
def test_mlx_holds_its_arrays_as_counted(tmp_path: Path, weight_type: str, embed_type: str, tied: bool) -> None:
    backend = MLXBackend(threads=1)  # one part a matrix: with more, each matrix lists views of itself too
    if not backend.available():
        pytest.skip("MLX is not installed here")
    m = model(tmp_path, weight_type, embed_type, tied)
    for start, end in RANGES:
        shard = backend.load_shard(m.config, m.shard_weights(start, end))
        arrays = {id(a): a for a in shard._arrays()}  # a tied head is the embedding's arrays
        assert sum(a.nbytes for a in arrays.values()) == rule(m, "mlx", start, end), (start, end)


def test_a_k_quant_file_is_held_at_about_its_bytes_on_both_backends_and_the_spec_says_so(tmp_path: Path) -> None:
    m = model(tmp_path, "Q4_K", "Q6_K", False)
    spec = spec_from_gguf(m)
    n = m.config.n_layers
    file_bytes = spec.range_bytes(0, n, 0)
    assert file_bytes == m.nbytes
    onnx, mlx = (spec.range_bytes(0, n, 0, b) for b in ("onnx", "mlx"))
    assert onnx == m.held_nbytes(0, n, "onnx") and mlx == m.held_nbytes(0, n, "mlx")
    assert file_bytes < onnx < 1.03 * file_bytes  # Q4_K's tiles 148 / 144, Q6_K's 210 / 210
    assert file_bytes < mlx < 1.03 * file_bytes  # Q4_K 0.578 / 0.5625 bytes a weight, Q6_K 0.8203 / 0.8203
    assert spec.range_bytes(0, n, 0, "a backend it does not know") == file_bytes
    assert type(spec).from_dict(spec.to_dict()) == spec  # what `exo-tui plan --json` carries


def node(nid: str, backend: str, usable: float) -> DeviceProfile:
    """A node with ``usable`` bytes for shards after the scheduler's reserves (2 GB, 10 %)."""
    total = 100 * GB
    return DeviceProfile(nid, ram_total_bytes=int(total), ram_available_bytes=int(usable + 2 * 1024**3 + 0.1 * total),
                         backends=(backend,))


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_the_plan_counts_what_each_backend_holds(tmp_path: Path, backend: str) -> None:
    """Memory for the model as the node's backend holds it, not the file's bytes: a node with room
    for the file and its caches is refused with the numbers; with room for its backend's form it
    takes the model."""
    m = model(tmp_path, "Q4_K", "Q6_K", False)
    spec = spec_from_gguf(m, context_length=64)
    need = spec.range_bytes(0, spec.n_layers, spec.kv_bytes_per_layer, backend)
    file_need = spec.range_bytes(0, spec.n_layers, spec.kv_bytes_per_layer)
    assert file_need < need
    with pytest.raises(InfeasiblePlan) as e:
        make_plan([node("a", backend, file_need)], spec, "latency", now=0.0)
    assert e.value.constraint == "memory" and e.value.shortfall_bytes > 0
    plan = make_plan([node("a", backend, need + 1024)], spec, "latency", now=0.0)
    assert [(s.node_id, s.start, s.end) for s in plan.shards] == [("a", 0, spec.n_layers)]


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_a_node_refuses_a_load_its_backend_would_hold_past_its_limit(tmp_path: Path, backend: str) -> None:
    """The room a load needs is its backend's form of the shard beside a load's peak: a node with
    room for the file's bytes and the peak, not for its backend's form, refuses the load; with
    room for that form it loads, and records what it holds."""
    m = model(tmp_path, "Q4_K", "Q6_K", False)
    n = m.config.n_layers
    peak, held = m.load_peak_nbytes(0, n, backend), m.held_nbytes(0, n, backend)
    assert held > m.nbytes
    with pytest.raises(NoRoom, match=r"needs \d+ MB"):
        ShardHost("n", backend, room=lambda: peak + m.nbytes).load_from_file(str(m.path), 0, n, backend)
    hosted = ShardHost("n", backend, room=lambda: peak + held).load_from_file(str(m.path), 0, n, backend)
    try:
        assert (hosted.held_bytes, hosted.nbytes) == (held, m.nbytes)
    finally:
        hosted.shard.close()


@pytest.mark.parametrize("tied", [True, False])
def test_a_whole_shards_pieces_add_up_to_what_it_holds(tmp_path: Path, tied: bool) -> None:
    """A load's peak takes each piece's bytes as the shard holds them: the embedding's piece of a
    model with its own output matrix is the embedding's rows alone (its piece has no
    ``output.weight`` in it, and is still no tied head), and the pieces add up to the shard's."""
    from exo_tui.models.gguf_file import _grouped

    m = model(tmp_path, "Q4_K", "Q5_0", tied)  # Q5_0's rows (0.875 bytes a weight) are not its tiles (0.75)
    names = m.shard_tensor_names(0, N_LAYERS)
    for backend in ("onnx", "mlx"):
        pieces = _grouped([m.tensor_info(n) for n in names])
        parts = sum(held_nbytes(backend, p, first=True, last=True, tied=tied) for p in pieces)
        assert parts == m.held_nbytes(0, N_LAYERS, backend), backend


def test_onnx_holds_a_tied_matrix_once_only_where_it_runs_on_the_kernel(tmp_path: Path) -> None:
    """A shard with both ends looks a tied embedding's rows up in the head's tiles, so a quantized
    one is held once; a float one twice (its rows as the file has them, the head as float32). The
    plan counts what the node does."""
    from backends.onnx import ONNXBackend

    assert ONNXBackend.shares_tied("Q8_0", (512, 256)) and ONNXBackend.shares_tied("Q6_K", (512, 256))
    assert not ONNXBackend.shares_tied("F16", (512, 256)) and not ONNXBackend.shares_tied("Q4_K", (512, 96))
    for embed_type, twice in (("Q8_0", False), ("F16", True)):
        m = model(tmp_path, "Q4_K", embed_type, True)
        infos = [m.tensor_info(n) for n in m.shard_tensor_names(0, N_LAYERS)]
        embed = next(t for t in infos if t.name == "token_embd.weight")
        rest = held_nbytes("onnx", [t for t in infos if t is not embed], first=True, last=True, tied=True)
        forms = ONNXBackend.held_nbytes(embed.type_name, embed.shape)
        if twice:
            forms += ONNXBackend.held_nbytes(embed.type_name, embed.shape, embedding=True)
        assert m.held_nbytes(0, N_LAYERS, "onnx") == rest + forms, embed_type
        assert spec_from_gguf(m).range_bytes(0, N_LAYERS, 0, "onnx") == rest + forms, embed_type


def test_a_loads_peak_counts_each_piece_beside_the_arrays_read_before_it() -> None:
    """A piece's temporaries lie beside the arrays of the pieces read before it, not all of them:
    an embedding decoded first peaks with little else held."""
    # IQ4_NL is read by dequantizing it whole: its temporaries are 3.5x its bytes (LOAD_PEAK_DECODED)
    pieces = [[("IQ4_NL", 30, 128)], [("IQ4_NL", 3, 13)], [("IQ4_NL", 3, 13)]]
    held = [128, 13, 13]
    assert load_peak_bytes("onnx", pieces) == 105  # any shard: the largest piece's temporaries
    assert load_peak_bytes("onnx", pieces, held) == (128 + 105) - 154  # at the embedding, beyond the 154 held at the end
    assert load_peak_bytes("onnx", pieces[::-1], held[::-1]) == 105  # read last, beside all the rest
    for t in ("Q4_K", "Q8_0", "Q5_0"):  # read a chunk at a time
        assert load_peak_bytes("onnx", [[(t, 10, 11)]], [11]) == LOAD_CHUNK_BYTES
    # MLX makes a K-quant matrix's arrays a chunk at a time, then copies them: the two largest
    # (stacked into one: gate and up) once more, besides a chunk's temporaries
    layer = [("Q4_K", 100, 133), ("Q4_K", 100, 133), ("Q4_K", 40, 53), ("Q6_K", 80, 98)]
    assert load_peak_bytes("mlx", [layer]) == 133 + 133 + LOAD_CHUNK_BYTES


def test_mlx_builds_the_embedding_after_the_layers_and_its_load_peaks_there(tmp_path: Path) -> None:
    """MLX makes a shard's layers, then its embedding (its arrays a chunk at a time, then copied
    into MLX's own), then its final norm: the peak is the embedding's arrays once more beside
    every layer. ONNX packs every piece a chunk at a time: a chunk's temporaries (and a layer's
    float32 norms)."""
    m = GGUFModel(write_tiny_llama(tmp_path / "wide-vocab.gguf", n_layers=2, hidden=32, intermediate=32, n_heads=2,
                                   n_kv_heads=1, weight_type="Q4_0", tied=True))  # the embedding its largest piece
    n = m.config.n_layers
    embed = MLXBackend.held_nbytes("Q4_0", m.tensor_info("token_embd.weight").shape)
    norm = 4 * m.config.hidden_size  # read after it
    assert m.load_peak_nbytes(0, n, "mlx") == embed + LOAD_CHUNK_BYTES - norm
    assert LOAD_CHUNK_BYTES <= m.load_peak_nbytes(0, n, "onnx") < m.load_peak_nbytes(0, n, "mlx")


def test_a_mixtures_experts_are_held_as_counted_on_onnx() -> None:
    """ONNX's Experts op takes each expert's gate and up rows as one QLinear matrix and its down
    matrix, stacked over the experts (ONNX Runtime's copy of them is all the node keeps): as many
    bytes as the rule counts for the file's expert tensors."""
    from backends.onnx.kernels.experts import pack_experts

    m = GGUFModel(FAMILIES / "qwen3moe-wide.Q4_K_M.gguf")
    layer = m.shard_weights(0, 1).layers[0]
    w1, w2 = pack_experts(layer.experts_gate, layer.experts_up, layer.experts_down, xbits=16)
    names = [f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    assert w1.nbytes + w2.nbytes == held_nbytes("onnx", (m.tensor_info(n) for n in names), first=False, last=False)


@pytest.mark.parametrize("name", ["qwen3moe-wide.Q4_K_M", "qwen3-wide.Q4_K_M", "llama3-wide.Q5_K_M"])
def test_llama_cpps_quantized_files_are_held_as_counted_on_mlx(name: str) -> None:
    """Files llama.cpp's quantizer wrote (a mixture's experts among them), whole on one shard."""
    backend = MLXBackend(threads=1)
    if not backend.available():
        pytest.skip("MLX is not installed here")
    m = GGUFModel(FAMILIES / f"{name}.gguf")
    shard = backend.load_shard(m.config, m.shard_weights(0, m.config.n_layers))
    arrays = {id(a): a for a in shard._arrays()}
    assert sum(a.nbytes for a in arrays.values()) == m.held_nbytes(0, m.config.n_layers, "mlx")


def test_a_shard_loaded_beside_one_of_the_same_file_reads_the_layers_they_share_where_they_are(tmp_path: Path) -> None:
    """A node whose [0, 2) grows to [0, 3) (a plan change) packs layer 2 only: the new shard's
    tiles of layers 0 and 1 are the old shard's, and what it computes is what a shard built alone
    computes. Another file's layers (same shapes) are not taken for them."""
    path = write_tiny_llama(tmp_path / "a.gguf", n_layers=3, hidden=256, intermediate=512, weight_type="Q4_0")
    other = write_tiny_llama(tmp_path / "b.gguf", n_layers=3, hidden=256, intermediate=512, weight_type="Q4_0", seed=1)
    host = ShardHost("n", "onnx")
    small = host.load_from_file(str(path), 0, 2, "onnx", "a")
    if not small.shard.kernel:
        pytest.skip("the QLinear kernel library cannot be built here (no C compiler): MatMulNBits runs")

    def tiles(hosted) -> set[int]:  # noqa: ANN001
        return {v.data_ptr() for v in hosted.shard._in_place.values()}

    grown = host.load_from_file(str(path), 0, 3, "onnx", "a")
    stranger = host.load_from_file(str(other), 0, 2, "onnx", "b")
    assert tiles(small) < tiles(grown) and len(tiles(grown) - tiles(small)) == len(tiles(small)) // 2 + 1  # layer 2's and the head's
    assert not tiles(stranger) & tiles(grown)
    first = host.load_from_file(str(path), 0, 1, "onnx", "a")  # the compact embedding is shared too
    assert first.shard._embed is small.shard._embed is not stranger.shard._embed
    m = GGUFModel(path)
    alone = get_backend("onnx").load_shard(m.config, m.shard_weights(0, 3))  # no source: packs all its own
    try:
        assert not tiles(grown) & {v.data_ptr() for v in alone._in_place.values()}
        prompt = np.array([5, 17, 30, 100, 7])
        host.unload(0, 2, "a")  # the grown shard keeps the tiles it reads
        assert np.array_equal(grown.shard.forward("r", prompt, np.arange(5)), alone.forward("r", prompt, np.arange(5)))
    finally:
        alone.close()
        host.unload_all()
