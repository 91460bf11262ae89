"""The node's profile: stable id, device facts, the measured layer time, the CLI's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import backends
from backends import configure_backend
from backends.onnx import kernels
from exo_tui.node.profile import (
    NodeProfile,
    _cache_key,
    benchmark,
    device_profile,
    live_metrics,
    stable_node_id,
    time_layers,
)


def test_node_id_is_stable_per_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    a = stable_node_id("pi-4")
    assert a == stable_node_id("pi-4")  # a restarted agent keeps its id
    assert a != stable_node_id("pi-5")
    assert (tmp_path / "node-ids" / "pi-4.id").read_text() == a


def test_device_profile_and_memory_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    p = device_profile("n1", memory_limit_bytes=1_000_000_000)
    assert p.ram_total_bytes > 0 and p.cpu_cores >= 1 and p.backends
    assert p.offered_memory_bytes() == min(p.ram_available_bytes, 1_000_000_000)
    assert NodeProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    m = live_metrics(memory_limit_bytes=1_000_000_000)
    assert m["ram_total_bytes"] <= 1_000_000_000 and 0 <= m["cpu_percent"] <= 100


def test_layer_timing_is_measured() -> None:
    """Of the benchmark's layers and of the same in Q4_K super-blocks, which a node may run at
    another precision (ONNX's auto: int8 against int16)."""
    t = time_layers("onnx")
    assert 0 < t.decode_layer_s < 1 and 0 < t.prefill_layer_token_s < 1
    assert 0 < t.kquant_decode_layer_s < 1 and 0 < t.kquant_prefill_layer_token_s < 1


def test_the_layers_timed_are_the_kind_a_node_runs() -> None:
    """GGUF's blocks have float16 scales; the benchmark's do too, so on ONNX they run on the
    node's kernel (with float32 scales they fell back to MatMulNBits and timed that). The K-quant
    layers are the file's super-blocks, which ``auto`` runs at int8 where the build has it."""
    from backends.onnx.precision import kernel_for, resolve_precision
    from exo_tui.node.profile import BENCH_CONFIG, KQUANT_BENCH_CONFIG, _bench_weights

    for cfg, kquant in ((BENCH_CONFIG, False), (KQUANT_BENCH_CONFIG, True)):
        weights = _bench_weights(cfg, kquant)
        layer = weights.layers[0]
        matrices = (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down)
        assert all(kernels.runs_on_kernel(w) for w in matrices)
        assert all(w.source_type == ("Q4_K" if kquant else "") for w in matrices)
        int8 = kernel_for("int8") is not None
        assert resolve_precision("auto", weights) == ("int8" if kquant and int8 else "int16")


def test_a_k_quant_model_is_planned_on_the_k_quant_timings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator gives the scheduler a node's timings of the kind of layers the planned
    model has, with the bytes of the layers they were measured on (times scale by bytes)."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.node_handle import NodeHandle
    from exo_tui.config import Config
    from exo_tui.models.spec import spec_from_gguf
    from exo_tui.node.profile import BENCH_LAYER_BYTES, KQUANT_BENCH_LAYER_BYTES, LayerTiming
    from tests.factory import write_tiny_llama

    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    profile = device_profile("n1", backends=["onnx"])
    profile.backend = "onnx"
    profile.layer_timing["onnx"] = LayerTiming(4e-4, 1e-4, 3e-4, 5e-5)
    c = Coordinator(config=Config(), home=tmp_path, persist=False)
    c.nodes[profile.node_id] = NodeHandle(node_id=profile.node_id, name="n1", host="127.0.0.1", port=1, profile=profile)
    shape = dict(n_layers=2, hidden=256, intermediate=512, n_heads=4, n_kv_heads=2)
    kquant = spec_from_gguf(write_tiny_llama(tmp_path / "k.gguf", weight_type="Q4_K", embed_type="Q6_K", **shape))
    blocks = spec_from_gguf(write_tiny_llama(tmp_path / "b.gguf", weight_type="Q4_0", **shape))
    assert kquant.kquant and not blocks.kquant
    [k] = c.device_profiles(kquant)
    assert (k.decode_s_per_layer, k.prefill_s_per_layer_token, k.compute_ref_layer_bytes) == \
        ({"onnx": 3e-4}, {"onnx": 5e-5}, KQUANT_BENCH_LAYER_BYTES)
    [b] = c.device_profiles(blocks)
    assert (b.decode_s_per_layer, b.prefill_s_per_layer_token, b.compute_ref_layer_bytes) == \
        ({"onnx": 4e-4}, {"onnx": 1e-4}, BENCH_LAYER_BYTES)
    # a profile from a node that did not time K-quant layers: its one figure, for every model
    profile.layer_timing["onnx"] = LayerTiming(4e-4, 1e-4)
    [old] = c.device_profiles(kquant)
    assert old.decode_s_per_layer == {"onnx": 4e-4} and old.compute_ref_layer_bytes == BENCH_LAYER_BYTES


def test_print_profile(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "exo_tui.cli", "node", "--print-profile", "--name", "probe", "--backend", "onnx"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "EXO_TUI_HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    profile = json.loads(out.stdout)
    assert profile["name"] == "probe" and profile["node_id"].startswith("n-")
    assert profile["layer_timing"]["onnx"]["decode_layer_s"] > 0
    assert profile["memory_bandwidth_bytes_per_s"] > 0
    # how the backend runs here: the operator sees a node on the slower fallback, or on float32 products
    library = kernels.library()
    assert profile["backend"] == "onnx" and profile["engine"]["precision"] == "auto"
    assert profile["kv_value_bytes"] == (2 if library is not None and library.integer else 4)  # float16 caches
    if library is None:
        assert profile["engine"]["matmul"] == "MatMulNBits (ONNX Runtime's)"
    elif library.integer:
        vnni = " (VNNI)" if library.isa == "avx512" else ""
        assert profile["engine"]["matmul"] == f"QLinear {library.isa} int8 products on K-quants, int16 on others{vnni}"
    else:
        assert profile["engine"]["matmul"].startswith(f"QLinear {library.isa} float32 products (no integer products")


def test_node_precision_and_threads_flags(tmp_path: Path) -> None:
    """What bootstrap passes to a node on another host, where no environment of ours reaches; the
    config's node.* keys, and their environment variables over them, where no flag is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXO_TUI_ONNX") and k != "EXO_TUI_THREADS"}
    env["EXO_TUI_HOME"] = str(tmp_path)
    base = [sys.executable, "-m", "exo_tui.cli", "node", "--print-profile", "--no-benchmark", "--name", "probe"]
    out = subprocess.run([*base, "--backend", "onnx", "--precision", "int8", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    engine = json.loads(out.stdout)["engine"]
    assert engine["precision"] == "int8" and engine["threads"] == "1"
    (tmp_path / "config.yaml").write_text("node:\n  threads: 2\n  onnx:\n    precision: float32\n")
    out = subprocess.run([*base, "--backend", "onnx"], capture_output=True, text=True, timeout=120,
                         env=env | {"EXO_TUI_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    engine = json.loads(out.stdout)["engine"]
    assert engine["precision"] == "float32" and engine["threads"] == "1"
    out = subprocess.run([*base, "--backend", "onnx"], capture_output=True, text=True, timeout=120,
                         env=env | {"EXO_TUI_ONNX_PIN": "maybe"})
    assert out.returncode == 2 and "node.onnx.pin is 'maybe'; it must be true or false" in out.stderr
    out = subprocess.run([*base, "--backend", "mlx", "--precision", "int8"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "backend mlx has no setting precision" in out.stderr and not out.stdout


def test_a_profile_from_a_newer_node_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fields a newer node adds are left out, not an error: neighbouring versions share a cluster."""
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    p = device_profile("n2")
    sent = {**p.to_dict(), "a_field_from_the_future": {"x": 1}}
    assert NodeProfile.from_dict(sent) == p


def test_a_timing_taken_under_other_settings_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    monkeypatch.setattr(backends, "_instances", {})
    configure_backend("onnx", spin=True)
    cached = {_cache_key("onnx"): {"decode_layer_s": 5.0, "prefill_layer_token_s": 5.0}, "bandwidth": 1.0}
    (tmp_path / "benchmark-cache.json").write_text(json.dumps(cached))
    p = benchmark(device_profile("n1"), backends=["onnx"])
    assert p.layer_timing["onnx"].decode_layer_s == 5.0  # this machine's figure, from the cache
    configure_backend("onnx", spin=False)  # threads that never spin run slower: not that figure
    p = benchmark(device_profile("n1"), backends=["onnx"])
    assert 0 < p.layer_timing["onnx"].decode_layer_s < 1
    assert len(json.loads((tmp_path / "benchmark-cache.json").read_text())) == 3  # both kept, and bandwidth


def test_a_timing_is_keyed_by_how_the_node_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``exo-tui node --precision``/``--threads`` set the backend up in the process: the cache
    key follows the backend as set up, not the environment it was started from."""
    monkeypatch.setattr(backends, "_instances", {})
    default = _cache_key("onnx")
    configure_backend("onnx", precision="int8")
    assert "precision=int8" in _cache_key("onnx") and "precision=auto" in default
    configure_backend("onnx", threads=1)
    assert "threads=1" in _cache_key("onnx") and _cache_key("onnx") != default


def test_a_timing_says_whether_the_onnx_kernel_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures taken on MatMulNBits (before the kernel, or with it off) are not those of a node
    that runs QLinear: the cache key says which ran."""
    monkeypatch.setattr(kernels, "_enabled", False)
    off = _cache_key("onnx")
    monkeypatch.setattr(kernels, "_enabled", True)
    on = _cache_key("onnx")
    assert off.endswith("|qlinear=none") and on != off and "|qlinear=" in on
    library = kernels.library()
    if library is not None:  # and which build: a changed kernel is timed again
        assert on.endswith(f"|qlinear={library.isa}:{library.build}") and library.build.startswith("exo-kernels-")
    assert "qlinear" not in _cache_key("mlx")


_MEASURE = """
import exo_tui.node.profile as p
calls = []
real = p.time_layers
p.time_layers = lambda backend, *a: calls.append(backend) or real(backend, *a)
p.benchmark(p.device_profile("n"), backends=["onnx"])
print(len(calls))
"""


def test_nodes_starting_together_on_one_machine_measure_once(tmp_path: Path) -> None:
    """Two node processes profiling at once: one measures (alone, so its figure is not slowed by
    the other's) and the other takes it from the cache."""
    env = {**os.environ, "EXO_TUI_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _MEASURE], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        counts = [int(proc.communicate(timeout=300)[0].strip()) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert sorted(counts) == [0, 1]


def test_nodes_of_one_name_starting_together_get_one_id(tmp_path: Path) -> None:
    """Four processes asking for the id of one node name at once all get the same one (before,
    each could make its own, and one crashed moving a temporary file another had just moved)."""
    env = {**os.environ, "EXO_TUI_HOME": str(tmp_path)}
    # Imported first, then all ask at one moment (Python's start-up time varies more than the
    # window this is about).
    code = ("import sys, time; from exo_tui.node.profile import stable_node_id; "
            "time.sleep(max(0.0, float(sys.argv[1]) - time.time())); print(stable_node_id('twin'))")
    at = str(time.time() + 3.0)
    procs = [subprocess.Popen([sys.executable, "-c", code, at], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        outs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert all(proc.returncode == 0 for proc in procs), [err for _, err in outs]
    ids = {out.strip() for out, _ in outs}
    assert len(ids) == 1 and next(iter(ids)).startswith("n-")
    assert (tmp_path / "node-ids" / "twin.id").read_text().strip() in ids
