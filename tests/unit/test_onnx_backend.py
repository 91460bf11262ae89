"""The ONNX Runtime backend against the NumPy reference, split against whole, KV moves, errors.

Tolerance: the reference dequantizes the same codes the backend keeps quantized, so the only
differences are float32 rounding (summation order, float32 vs float64 softmax/norm). Logits must
agree within ``RTOL = 1e-4`` of the largest logit's magnitude (observed: ~1e-6 on tiny models,
~1e-5 on SmolLM2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from backends import available_backends, get_backend
from backends.base import BackendError, KVCache
from backends.onnx import SPIN_US, ONNXBackend, kernels, physical_cores
from backends.onnx.affinity import CorePlan, core_plan
from backends.weights import QuantizedWeight, dense
from exo_tui.config import ConfigError, load_config
from exo_tui.models.gguf_file import GGUFModel
from tests.conftest import WEIGHT_TYPES
from tests.factory import write_tiny_llama
from tests.reference import ReferenceShard

RTOL = 1e-4
PROMPT = np.array([5, 17, 30, 100, 7, 9, 11, 260, 42])


def close(a: np.ndarray, b: np.ndarray, rtol: float = RTOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.abs(a - b).max())
    scale = float(np.abs(b).max())
    assert err <= rtol * scale, f"max abs difference {err:.3g} > {rtol} x {scale:.3g}"


def load(path: Path, start: int = 0, end: int | None = None, **kw):
    """A shard of ``path``; float32 unless ``precision`` says otherwise: these tests hold the
    backend's math to the reference's float32 (the integer precisions are tested on their own)."""
    model = GGUFModel(path)
    cfg = model.config
    weights = model.shard_weights(start, cfg.n_layers if end is None else end)
    kw.setdefault("precision", "float32")
    return cfg, weights, ONNXBackend(threads=kw.pop("threads", 2), **kw).load_shard(cfg, weights)


def decode_tokens(n: int, start: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array([(31 * i + 3) % 250]), np.array([start + i])) for i in range(n)]


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["qlinear", "matmulnbits"])
@pytest.mark.parametrize("weight_type", [*WEIGHT_TYPES, "F32-untied"])
def test_logits_match_reference(tiny_models, weight_type, kernel, monkeypatch):
    """Both ways of running 4-bit matrices: exo-tui's kernel (the default where it builds) and
    MatMulNBits with a correction (``node.onnx.kernel`` off, and where it does not)."""
    monkeypatch.setattr(kernels, "_enabled", kernel == "1")
    cfg, weights, shard = load(tiny_models[weight_type])
    if weight_type.startswith(("Q4", "Q5")):
        assert bool(shard.kernel) == (kernel == "1")
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    last = shard.forward("r2", PROMPT, pos)
    assert last.shape == (1, cfg.vocab_size) and last.dtype == np.float32
    close(last, ref.forward("r2", PROMPT, pos))
    for tok, p in decode_tokens(6, len(PROMPT)):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))
    assert shard.kv_length("r") == len(PROMPT) + 6


def test_chunked_prefill_equals_one_prefill(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    whole = ref.forward("a", PROMPT, np.arange(len(PROMPT)), all_logits=True)
    first = shard.forward("b", PROMPT[:4], np.arange(4), all_logits=True)
    rest = shard.forward("b", PROMPT[4:], np.arange(4, len(PROMPT)), all_logits=True)
    close(np.concatenate([first, rest]), whole)
    one_by_one = [shard.forward("c", PROMPT[i : i + 1], np.array([i])) for i in range(len(PROMPT))]
    close(np.concatenate(one_by_one), whole)


def test_kv_buffers_grow_past_capacity(tmp_path):
    path = write_tiny_llama(tmp_path / "long.gguf", weight_type="Q4_0", context_length=700, seed=4)
    cfg, weights, shard = load(path)
    ref = ReferenceShard(cfg, weights)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, 250)
    close(shard.forward("r", ids, np.arange(250)), ref.forward("r", ids, np.arange(250)))
    more = rng.integers(0, cfg.vocab_size, 20)  # crosses the first 256-position buffer
    close(shard.forward("r", more, np.arange(250, 270)), ref.forward("r", more, np.arange(250, 270)))
    for tok, p in decode_tokens(3, 270):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))
    ids = rng.integers(0, cfg.vocab_size, 700 - 273)
    shard.forward("r", ids, np.arange(273, 700))
    with pytest.raises(BackendError, match="context full"):
        shard.forward("r", np.array([1]), np.array([700]))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_split_equals_whole(tiny_models, k):
    path = tiny_models["Q4_1"]
    cfg, _, whole = load(path)
    _, _, head = load(path, 0, k)
    _, tail_w, tail = load(path, k)
    assert head.is_first and not head.is_last and tail.is_last and not tail.is_first
    pos = np.arange(len(PROMPT))
    hidden = head.forward("r", PROMPT, pos)
    assert hidden.shape == (len(PROMPT), cfg.hidden_size) and hidden.dtype == np.float32
    close(tail.forward("r", hidden, pos, all_logits=True), whole.forward("r", PROMPT, pos, all_logits=True), 1e-5)
    for tok, p in decode_tokens(4, len(PROMPT)):
        close(tail.forward("r", head.forward("r", tok, p), p), whole.forward("r", tok, p), 1e-5)
    # mixed: ONNX layers [0, k) then the NumPy reference for [k, L)
    ref_tail = ReferenceShard(cfg, tail_w)
    ref_whole = ReferenceShard(cfg, GGUFModel(path).shard_weights(0, cfg.n_layers))
    close(ref_tail.forward("m", head.forward("m", PROMPT, pos), pos), ref_whole.forward("m", PROMPT, pos))


def test_export_import_moves_a_request(tiny_models):
    path = tiny_models["Q8_0"]
    cfg, weights, a = load(path)
    _, _, b = load(path)
    pos = np.arange(len(PROMPT))
    a.forward("r", PROMPT, pos)
    steps = decode_tokens(5, len(PROMPT))
    for tok, p in steps[:2]:
        a.forward("r", tok, p)
    cache = a.export_kv("r")
    assert (cache.start, cache.end, cache.length) == (0, cfg.n_layers, len(PROMPT) + 2)
    assert all(k.shape == (cfg.n_kv_heads, cache.length, cfg.head_dim) and k.dtype == np.float32 for k in cache.keys)
    b.import_kv("moved", cache)
    assert b.kv_length("moved") == cache.length and b.requests() == ["moved"]
    for tok, p in steps[2:]:
        np.testing.assert_array_equal(b.forward("moved", tok, p), a.forward("r", tok, p))


def test_kv_layout_is_the_reference_layout(tiny_models):
    """Exported keys are rotated, (n_kv_heads, length, head_dim): a cache written by another
    backend (here the NumPy reference) continues on ONNX."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    shard.forward("r", PROMPT, pos)
    ref.forward("r", PROMPT, pos)
    exported = shard.export_kv("r")
    for (rk, rv), k, v in zip(ref.cache["r"], exported.keys, exported.values, strict=True):
        close(k, rk)
        close(v, rv)
    foreign = KVCache(0, cfg.n_layers, len(PROMPT), [k for k, _ in ref.cache["r"]], [v for _, v in ref.cache["r"]])
    _, _, fresh = load(tiny_models["Q4_1"])
    fresh.import_kv("r", foreign)
    for tok, p in decode_tokens(3, len(PROMPT)):
        close(fresh.forward("r", tok, p), ref.forward("r", tok, p))


def test_import_takes_the_shards_layers_from_a_wider_cache(tiny_models):
    path = tiny_models["F16"]
    cfg, _, whole = load(path)
    _, _, tail = load(path, 2)
    pos = np.arange(len(PROMPT))
    whole.forward("r", PROMPT, pos)
    tail.import_kv("r", whole.export_kv("r"))
    assert tail.export_kv("r").start == 2 and len(tail.export_kv("r").keys) == cfg.n_layers - 2
    head_cache = whole.export_kv("r").slice_layers(0, 2)
    with pytest.raises(BackendError, match="does not cover"):
        tail.import_kv("x", head_cache)


def test_drop_and_truncate(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_0"])
    pos = np.arange(len(PROMPT))
    full = shard.forward("r", PROMPT, pos, all_logits=True)
    shard.forward("other", PROMPT[:3], np.arange(3))
    assert sorted(shard.requests()) == ["other", "r"]
    shard.truncate_kv("r", 4)
    assert shard.kv_length("r") == 4 and shard.export_kv("r").length == 4
    again = shard.forward("r", PROMPT[4:], pos[4:], all_logits=True)
    close(again, full[4:], 1e-6)
    shard.drop("r")
    shard.drop("never-seen")
    assert shard.requests() == ["other"] and shard.kv_length("r") == 0
    assert shard.export_kv("r").length == 0
    close(shard.forward("r", PROMPT, pos, all_logits=True), full, 1e-6)
    shard.close()
    with pytest.raises(BackendError, match="closed"):
        shard.forward("r", PROMPT[:1], np.array([0]))


def test_bad_input_raises_clear_errors(tiny_models):
    path = tiny_models["Q4_1"]
    cfg, _, first = load(path, 0, 2)
    _, _, last = load(path, 2)
    with pytest.raises(BackendError, match="integer token ids"):
        first.forward("r", np.zeros(3, np.float32), np.arange(3))
    for ids in ([cfg.vocab_size], [-1], [3, cfg.vocab_size, 4], [3, -2]):  # one id (a decode step) or several
        with pytest.raises(BackendError, match="token id out of range"):
            first.forward("r", np.array(ids), np.arange(len(ids)))
    with pytest.raises(BackendError, match="expects hidden"):
        last.forward("r", np.zeros((2, cfg.hidden_size + 1), np.float32), np.arange(2))
    with pytest.raises(BackendError, match="non-empty"):
        first.forward("r", np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    with pytest.raises(BackendError, match="positions start at 3"):
        first.forward("r", np.array([1]), np.array([3]))
    with pytest.raises(BackendError, match="consecutive"):
        first.forward("r", np.array([1, 2]), np.array([0, 2]))
    assert first.kv_length("r") == 0  # nothing was appended by the failed calls
    first.forward("r", np.array([1, 2]), np.arange(2))
    bad = KVCache(0, 2, 2, [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim + 1), np.float32)] * 2,
                  [np.zeros((cfg.n_kv_heads, 2, cfg.head_dim), np.float32)] * 2)
    with pytest.raises(BackendError, match="expected"):
        first.import_kv("r", bad)
    assert first.kv_length("r") == 2  # a rejected import leaves the cache alone


def test_bad_weights_and_options(tiny_models, monkeypatch):
    model = GGUFModel(tiny_models["Q4_0"])
    cfg = model.config
    weights = model.shard_weights(0, 2)
    weights.embed = None
    with pytest.raises(BackendError, match="token embedding"):
        ONNXBackend().load_shard(cfg, weights)
    weights = model.shard_weights(0, 2)
    weights.layers[1].wk = weights.layers[1].wq
    with pytest.raises(BackendError, match="layer 1 wk has shape"):
        ONNXBackend().load_shard(cfg, weights)
    with pytest.raises(BackendError, match="unknown ONNX precision"):
        ONNXBackend(precision="fp4")
    with pytest.raises(BackendError, match="threads"):
        ONNXBackend(threads=0)


def test_options_defaults_and_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("EXO_TUI_THREADS", "1")  # read by the config, never by the backend
    monkeypatch.setenv("EXO_TUI_ONNX_PRECISION", "int8")
    backend = ONNXBackend()
    assert backend.threads == physical_cores() and backend.precision == "auto"
    assert backend.spin_us == SPIN_US  # a bounded spin between the ops of a step
    assert backend.session_config["session.intra_op.spin_duration_us"] == str(SPIN_US)
    assert backend.available()
    # The shared instance is made once per process: made under the settings below it would hand
    # int8 math to every later test that asks for it.
    assert get_backend("onnx").name == "onnx"
    env = {"EXO_TUI_HOME": str(tmp_path), "EXO_TUI_THREADS": "1", "EXO_TUI_ONNX_PRECISION": "int8", "EXO_TUI_ONNX_SPIN": "1"}
    settings = load_config(env=env).node.backend_settings("onnx")
    assert settings == {"threads": 1, "precision": "int8", "spin": True, "pin": False, "kernel": True}
    backend = ONNXBackend(**{k: v for k, v in settings.items() if k != "kernel"})
    assert backend.threads == 1 and backend.precision == "int8" and backend.spin_us is None
    assert backend.session_config["session.intra_op.allow_spinning"] == "1"
    assert "session.intra_op.spin_duration_us" not in backend.session_config  # until the step ends
    assert ONNXBackend(threads=3, precision="float32").threads == 3


def test_auto_runs_k_quant_files_at_int8_and_the_others_at_int16(tmp_path, monkeypatch):
    """The default precision goes by the file's blocks, the same on each shard of it (the head's
    and the embedding's types count too), read from the file's header without making a layer, or
    from the weights in memory; a precision asked for is kept. Builds without int8 products run
    every file at int16."""
    from backends.onnx.precision import resolve_precision
    from exo_tui.node.host import Transfer

    library = kernels.library()
    int8 = "int8" if library is not None and library.integer else "int16"
    shape = dict(hidden=256, intermediate=256, n_heads=4, n_kv_heads=2, n_layers=2, tied=False)
    for weight_type, embed_type, want in (("Q4_K", "Q6_K", int8), ("Q5_K", "Q6_K", int8), ("Q6_K", "Q6_K", int8),
                                          ("Q4_1", "Q8_0", "int16"), ("Q8_0", "Q8_0", "int16"),
                                          ("F32", "F32", "int16")):
        model = GGUFModel(write_tiny_llama(tmp_path / f"{weight_type}.gguf", weight_type=weight_type,
                                           embed_type=embed_type, **shape))
        for start, end in ((0, 2), (0, 1), (1, 2)):
            weights = model.shard_weights(start, end)
            assert resolve_precision("auto", weights) == want, (weight_type, start, end)
            sent = [model.raw_tensor(n) for n in model.shard_tensor_names(start, end)]  # streamed to a node
            transfer = Transfer("t", model.config, start, end, "onnx", [info for info, _ in sent],
                                sum(info.nbytes for info, _ in sent))
            for _, raw in sent:
                transfer.add_chunk(transfer.received, bytes(raw), hashlib.sha256(bytes(raw)).hexdigest())
            assert transfer.shard_weights().stored_types == weights.stored_types  # read without making a layer
            assert resolve_precision("auto", transfer.shard_weights()) == want, (weight_type, start, end, "sent")
            assert resolve_precision("float32", weights) == "float32"
            layers = [weights.layers[i] for i in range(end - start)]  # in memory, no file header
            in_memory = dataclasses.replace(weights, layers=layers, stored_types={})
            assert resolve_precision("auto", in_memory) == want, (weight_type, start, end, "in memory")
        if weight_type == "Q4_K" and int8 == "int8":  # what the shard then runs
            shard = ONNXBackend().load_shard(model.config, model.shard_weights(0, 2))
            assert shard.precision == "int8" and shard.xbits == 8
            shard.close()
            shard = ONNXBackend(precision="int16").load_shard(model.config, model.shard_weights(0, 2))
            assert shard.precision == "int16" and shard.xbits == 16
            shard.close()
    assert "int8 products on K-quants, int16 on others" in ONNXBackend().describe()["matmul"] or int8 == "int16"
    with pytest.raises(BackendError, match="choose one of auto, float32, int16, int8"):
        ONNXBackend(precision="int4")


@pytest.mark.parametrize(
    ("env", "spin_us", "allow"), [("0", 0, "0"), ("off", 0, "0"), ("40us", 40, "1"), ("0us", 0, "0"), ("on", None, "1")]
)
def test_spin_policy_from_the_config_and_env(tmp_path, env, spin_us, allow):
    settings = load_config(env={"EXO_TUI_HOME": str(tmp_path), "EXO_TUI_ONNX_SPIN": env}).node.backend_settings("onnx")
    backend = ONNXBackend(**{k: v for k, v in settings.items() if k != "kernel"})
    assert backend.spin_us == spin_us
    assert backend.session_config["session.intra_op.allow_spinning"] == allow
    if spin_us:
        assert backend.session_config["session.intra_op.spin_duration_us"] == str(spin_us)
    if allow == "1":  # never between steps
        assert backend.session_config["session.force_spinning_stop"] == "1"


@pytest.mark.parametrize("env", ["5", "fast", "-3us"])
def test_a_bad_spin_setting_says_what_to_write(tmp_path, env):
    with pytest.raises(ConfigError, match=r"node.onnx.spin is .*; it must be 0 \(never spin\), 1 .* or microseconds such as 15us"
                                          r".*EXO_TUI_\* environment variable"):
        load_config(env={"EXO_TUI_HOME": str(tmp_path), "EXO_TUI_ONNX_SPIN": env})
    with pytest.raises(BackendError, match="at least 0 microseconds"):
        ONNXBackend(spin=-1)


def test_an_idle_shard_does_not_spin(tiny_models, monkeypatch):
    """Spinning is between the ops of a step only: the session a shard runs is told to stop its
    pool's spinning once a step returns. (What an idle shard's threads cost in CPU time is
    measured in benchmarks/onnx_spin.py, not bounded here.)"""
    _, _, shard = load(tiny_models["Q4_1"], spin=True)  # the longest spin there is
    shard.forward("r0", PROMPT, np.arange(len(PROMPT)))
    options = shard._session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    shard.close()


def test_core_plans(tmp_path):
    nothing = tmp_path / "no-sysfs"  # no topology known: every CPU a core of its own
    assert core_plan(2, {0, 1}, nothing) == CorePlan(0, (1,))
    assert core_plan(2, {0, 1}, nothing).ort_affinities == "2"  # ONNX Runtime counts processors from 1
    assert core_plan(3, {7, 4, 5, 9}, nothing) == CorePlan(4, (5, 7))
    assert core_plan(3, {7, 4, 5, 9}, nothing).ort_affinities == "6;8"
    assert core_plan(1, {0, 1}, nothing) is None  # one thread: nothing to keep apart
    assert core_plan(3, {0, 1}, nothing) is None  # more threads than cores: the scheduler shares them


def _sysfs(root: Path, cpus: dict[int, tuple[str, int | None]]) -> Path:
    """A /sys/devices/system/cpu tree: cpu -> (its thread_siblings_list, its cpu_capacity)."""
    for cpu, (siblings, capacity) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
        if capacity is not None:
            (root / f"cpu{cpu}" / "cpu_capacity").write_text(f"{capacity}\n")
    return root


def test_core_plans_take_one_cpu_per_physical_core(tmp_path):
    # Hyperthread pairs numbered side by side (0-1 one core, 2-3 the next, ...).
    smt = _sysfs(tmp_path / "smt", {c: (f"{c - c % 2}-{c - c % 2 + 1}", None) for c in range(8)})
    assert core_plan(2, set(range(8)), smt) == CorePlan(0, (2,))
    assert core_plan(4, set(range(8)), smt) == CorePlan(0, (2, 4, 6))
    assert core_plan(5, set(range(8)), smt) is None  # four physical cores
    assert core_plan(2, {1, 2, 3}, smt) == CorePlan(1, (2,))  # the first allowed CPU of each core


def test_core_plans_prefer_the_fast_cores(tmp_path):
    # big.LITTLE as on an RK3588: four little cores first, then four big ones.
    bl = _sysfs(tmp_path / "bl", {c: (str(c), 1024 if c >= 4 else 414) for c in range(8)})
    assert core_plan(4, set(range(8)), bl) == CorePlan(4, (5, 6, 7))
    assert core_plan(2, set(range(8)), bl) == CorePlan(4, (5,))
    assert core_plan(6, set(range(8)), bl) == CorePlan(0, (1, 4, 5, 6, 7))  # all four big, then little
    assert core_plan(2, {0, 1, 2, 5}, bl) == CorePlan(0, (5,))


def _thread_cores() -> dict[str, set[int]]:
    """Each thread of this process and the cores it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores: set[int] = set()
                for part in line.split(":", 1)[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    cores.update(range(int(lo), int(hi or lo) + 1))
                out[tid] = cores
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and at least two cores")
@pytest.mark.parametrize("pin", [True, False])
def test_a_step_runs_on_its_own_cores_and_gives_them_back(tiny_models, monkeypatch, pin):
    mine = os.sched_getaffinity(0)
    before = _thread_cores()
    cfg, weights, shard = load(tiny_models["Q4_1"], pin=pin)
    plan = core_plan(2, mine)
    assert plan is not None
    pool = {tid: cores for tid, cores in _thread_cores().items() if tid not in before}
    assert sorted(pool.values(), key=sorted) == ([{plan.pool_cpus[0]}] if pin else [mine])
    during = []
    session = shard._session

    class Watch:  # records which cores the calling thread may use while the session runs
        def __getattr__(self, name):
            return getattr(session, name)

        def run_with_iobinding(self, io):
            during.append(os.sched_getaffinity(0))
            return session.run_with_iobinding(io)

    shard._session = Watch()
    ref = ReferenceShard(cfg, weights)
    close(shard.forward("r", PROMPT, np.arange(len(PROMPT))), ref.forward("r", PROMPT, np.arange(len(PROMPT))))
    assert during == [{plan.run_cpu}] if pin else [mine]
    assert os.sched_getaffinity(0) == mine  # given back: threads started later keep every core


@pytest.mark.parametrize(("precision", "near"), [("int16", (1e-7, 1e-3)), ("int8", (1e-4, 0.05))])
def test_integer_precisions_are_opt_in_and_close(tiny_models, precision, near):
    cfg, weights, fast = load(tiny_models["Q4_1"], precision=precision)
    _, _, exact = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    want = ref.forward("r", PROMPT, pos)
    close(exact.forward("r", PROMPT, pos), want)
    got = fast.forward("r", PROMPT, pos)
    err = np.abs(got - want).max() / np.abs(want).max()
    library = kernels.library()
    if library is not None and library.integer:
        assert near[0] < err < near[1]  # activation quantization: near, not equal
        assert fast.xbits == int(precision[3:]) and fast.kernel == library.isa
    elif precision == "int16":  # float32 products instead: as exact
        close(got, want)
        assert fast.xbits == 0 and fast.kernel == (library.isa if library is not None else "")
    else:  # MatMulNBits' int8 products
        assert 1e-4 < err < 0.05 and fast.kernel == ""


def test_integer_precisions_keep_float16_caches_and_hand_them_over_as_float32(tiny_models):
    """The int16 precision's KV caches are float16 (half the bytes a step reads at a long
    context), exported as float32 and imported by a float32 shard; the float32 precision keeps
    float32 caches. A cache handed from one to the other decodes on as the reference does."""
    library = kernels.library()
    if library is None or not library.integer:
        pytest.skip("float16 caches come with the kernel's integer products (no integer products here)")
    cfg, weights, fast = load(tiny_models["Q4_1"], precision="int16")
    _, _, exact = load(tiny_models["Q4_1"])
    assert fast.kv_dtype == np.float16 and exact.kv_dtype == np.float32
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    fast.forward("r", PROMPT, pos)
    ref.forward("r", PROMPT, pos)
    cache = fast.export_kv("r")
    assert cache.length == len(PROMPT) and all(k.dtype == v.dtype == np.float32 for k, v in zip(cache.keys, cache.values, strict=True))
    assert all(np.array_equal(k, k.astype(np.float16)) for k in cache.keys)  # float16 values, exactly
    pool = fast.kv.caches["r"].pool
    assert pool.keys.dtype == pool.values.dtype == np.float16
    exact.import_kv("r", cache)
    for tok, p in decode_tokens(4, len(PROMPT)):
        close(exact.forward("r", tok, p), ref.forward("r", tok, p), rtol=2e-2)  # int16's caches, then float32 math
    fast.import_kv("r2", exact.export_kv("r"))  # and back: rounded to float16 on the way in
    assert fast.kv_length("r2") == len(PROMPT) + 4


def test_int16_precision_on_float32_products_where_the_kernel_has_no_integer_products(tiny_models, monkeypatch):
    """Builds without integer products (plain C): the int16 precision runs QLinear's float32
    products, as exact as float32, and says so."""
    library = kernels.library()
    if library is None:
        pytest.skip("no kernel here (tested above)")
    monkeypatch.setattr(kernels, "library", lambda: dataclasses.replace(library, integer=False))
    cfg, weights, shard = load(tiny_models["Q4_1"], precision="int16")
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos), ReferenceShard(cfg, weights).forward("r", PROMPT, pos))
    assert shard.xbits == 0 and shard.kernel == library.isa
    assert "float32 products (no integer products" in ONNXBackend(precision="int16").describe()["matmul"]


def test_int8_precision_on_matmulnbits_where_the_kernel_has_no_int8(tiny_models, monkeypatch):
    """Builds without int8 products (plain C): the int8 precision runs on MatMulNBits' int8 products."""
    library = kernels.library()
    if library is None:
        pytest.skip("no kernel here: the int8 precision is on MatMulNBits anyway (tested above)")
    monkeypatch.setattr(kernels, "library", lambda: dataclasses.replace(library, integer=False))
    cfg, weights, fast = load(tiny_models["Q4_1"], precision="int8")
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    want = ref.forward("r", PROMPT, pos)
    err = np.abs(fast.forward("r", PROMPT, pos) - want).max() / np.abs(want).max()
    assert 1e-4 < err < 0.05 and fast.kernel == ""


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "rtol"), [("float32", RTOL), ("int16", 2e-3)])
def test_default_model_matches_reference(default_model_path, precision, rtol):
    """float32 is the reference's math; int16 (the default) rounds activations to 15 bits, its
    logits near the reference's and its greedy tokens the same."""
    model = GGUFModel(default_model_path)
    cfg = model.config
    weights = model.shard_weights(0, cfg.n_layers)
    shard = ONNXBackend(threads=2, precision=precision).load_shard(cfg, weights)
    ref = ReferenceShard(cfg, weights)
    prompt = np.array([1, 9690, 314, 253, 5356, 30, 2, 198])  # any ids; the check is numerical
    pos = np.arange(len(prompt))
    got, want = shard.forward("r", prompt, pos), ref.forward("r", prompt, pos)
    close(got, want, rtol)
    token = int(got.argmax())
    assert token == int(want.argmax())
    for i in range(10):
        p = np.array([len(prompt) + i])
        got, want = shard.forward("r", np.array([token]), p), ref.forward("r", np.array([token]), p)
        close(got, want, rtol)
        assert int(got.argmax()) == int(want.argmax()), f"greedy token differs at step {i}"
        token = int(got.argmax())
    # and split in two shards of the real model
    head = ONNXBackend(threads=2, precision=precision).load_shard(cfg, model.shard_weights(0, 13))
    tail = ONNXBackend(threads=2, precision=precision).load_shard(cfg, model.shard_weights(13, cfg.n_layers))
    # (float32 near bit for bit; int16's codes may round the other way on a last-bit difference)
    close(tail.forward("s", head.forward("s", prompt, pos), pos), shard.forward("s", prompt, pos),
          1e-5 if precision == "float32" else rtol)


@pytest.mark.slow
def test_default_model_batched_greedy_equals_solo(default_model_path):
    """Batched rows take MatMulNBits' multi-row kernel (a different summation order than one
    row's): on the real model, eight requests decoded together give each one's solo greedy tokens."""
    from exo_tui.models.model import Model

    model = Model(default_model_path)
    cfg = model.config
    shard = ONNXBackend(threads=2).load_shard(cfg, model.gguf.shard_weights(0, cfg.n_layers))
    topics = ["the sea", "Paris", "a red fox", "bread", "the moon", "trains", "rain", "bees"]
    prompts = {f"r{i}": np.array(model.chat_prompt_ids([{"role": "user", "content": f"Tell me about {t}."}]))
               for i, t in enumerate(topics)}
    steps = 16

    def greedy(rid: str, prompt: np.ndarray) -> list[int]:
        tokens = [int(shard.forward(rid, prompt, np.arange(len(prompt)))[-1].argmax())]
        for i in range(steps):
            logits = shard.forward(rid, np.array(tokens[-1:]), np.array([len(prompt) + i]))
            tokens.append(int(logits[-1].argmax()))
        shard.drop(rid)
        return tokens

    solo = {rid: greedy(rid, p) for rid, p in prompts.items()}
    together = {rid: [int(shard.forward(rid, p, np.arange(len(p)))[-1].argmax())] for rid, p in prompts.items()}
    for i in range(steps):
        items = [(rid, np.array(together[rid][-1:]), np.array([len(prompts[rid]) + i])) for rid in prompts]
        for (rid, _, _), logits in zip(items, shard.forward_batch(items), strict=True):
            together[rid].append(int(logits[-1].argmax()))
    assert together == solo


def test_weight_copies_are_released_after_load(tiny_models):
    """The session keeps its own copies of the weights; ours are freed once a probe proves that
    (zeroing them changes nothing), and the shard still computes the right logits."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    assert shard.weight_arrays_nbytes == 0
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    for tok, p in decode_tokens(3, len(PROMPT)):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))


def test_long_prompts_run_in_chunks(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_1"])
    shard.prefill_chunk = 4
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("a", PROMPT, pos, all_logits=True), ref.forward("a", PROMPT, pos, all_logits=True))
    last = shard.forward("b", PROMPT, pos)
    assert last.shape == (1, cfg.vocab_size)
    close(last, ref.forward("b", PROMPT, pos))
    _, _, head = load(tiny_models["Q4_1"], 0, 2)
    head.prefill_chunk = 4
    _, _, whole_head = load(tiny_models["Q4_1"], 0, 2)
    close(head.forward("c", PROMPT, pos), whole_head.forward("c", PROMPT, pos), 1e-5)


def affine(w: np.ndarray, bits: int, group: int) -> QuantizedWeight:
    """Min-max affine quantization of ``w`` (any bits and group), the general QuantizedWeight."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // group, group)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    scale = np.maximum(hi - lo, 1e-6) / (2**bits - 1)
    q = np.clip(np.round((blocks - lo[:, :, None]) / scale[:, :, None]), 0, 2**bits - 1).astype(np.uint8)
    return QuantizedWeight(q.reshape(rows, cols), scale.astype(np.float32), lo.astype(np.float32), bits, group)


def test_mixed_and_general_quantization(tiny_models):
    """Layers whose matrices differ in kind (GGUF mixes types) and affine forms beyond GGUF's:
    8-bit with a min (correction path), group 64, and kinds that fall back to dense float32."""
    model = GGUFModel(tiny_models["Q4_1"])
    cfg = model.config
    weights = model.shard_weights(0, cfg.n_layers)
    other = GGUFModel(tiny_models["Q8_0"]).shard_weights(0, cfg.n_layers)
    l0, l1, l2, l3 = weights.layers
    l0.wv = other.layers[0].wv  # Q4_1, Q4_1, Q8_0 in one fused projection
    l0.w_up = dense(l0.w_up).astype(np.float16)
    l1.wq, l1.wk, l1.wv = (affine(dense(w), 8, 32) for w in (l1.wq, l1.wk, l1.wv))
    l2.w_gate, l2.w_up = affine(dense(l2.w_gate), 4, 64), affine(dense(l2.w_up), 4, 64)
    l3.wo = affine(dense(l3.wo), 3, 32)  # 3-bit: dense
    l3.w_down = affine(dense(l3.w_down), 4, 16)
    ref = ReferenceShard(cfg, weights)
    shard = ONNXBackend(threads=2, precision="float32").load_shard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    for tok, p in decode_tokens(3, len(PROMPT)):
        close(shard.forward("r", tok, p), ref.forward("r", tok, p))


def test_mixed_with_mlx(tiny_models):
    """ONNX and MLX shards in one pipeline, and a KV cache moved from ONNX to MLX and back."""
    if "mlx" not in available_backends():
        pytest.skip("the MLX backend is not available on this machine")
    path = tiny_models["Q4_1"]
    model = GGUFModel(path)
    cfg = model.config
    mlx = get_backend("mlx")
    onnx_head, onnx_whole = load(path, 0, 2)[2], load(path)[2]
    mlx_tail = mlx.load_shard(cfg, model.shard_weights(2, cfg.n_layers))
    pos = np.arange(len(PROMPT))
    close(mlx_tail.forward("r", onnx_head.forward("r", PROMPT, pos), pos), onnx_whole.forward("r", PROMPT, pos))
    mlx_whole = mlx.load_shard(cfg, model.shard_weights(0, cfg.n_layers))
    mlx_whole.import_kv("r", onnx_whole.export_kv("r"))
    steps = decode_tokens(4, len(PROMPT))
    for tok, p in steps[:2]:
        close(mlx_whole.forward("r", tok, p), onnx_whole.forward("r", tok, p))
    _, _, back = load(path)
    back.import_kv("r", mlx_whole.export_kv("r"))
    for tok, p in steps[2:]:
        close(back.forward("r", tok, p), onnx_whole.forward("r", tok, p))


def test_forward_batch(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    for rid, n in (("a", 3), ("b", 9)):
        shard.forward(rid, PROMPT[:n], np.arange(n))
        ref.forward(rid, PROMPT[:n], np.arange(n))
    items = [("a", np.array([4]), np.array([3])), ("b", np.array([8]), np.array([9])), ("new", PROMPT[:2], np.arange(2))]
    for (rid, x, pos), got in zip(items, shard.forward_batch(items), strict=True):
        close(got, ref.forward(rid, x, pos))
    # a verify step (every row's logits) beside decode steps: on the kernel its rows join the batch
    items = [("a", np.array([6]), np.array([4])), ("b", PROMPT[2:7], np.arange(10, 15)), ("new", PROMPT[4:5], np.array([2]))]
    got = shard.forward_batch(items, all_logits=[1])
    assert got[1].shape == (5, cfg.vocab_size)
    for (rid, x, pos), out in zip(items, got, strict=True):
        close(out, ref.forward(rid, x, pos, all_logits=rid == "b"))
    with pytest.raises(BackendError, match="positions start at 0"):
        shard.forward_batch([("a", np.array([1]), np.array([5])), ("b", np.array([1]), np.array([0]))])
    with pytest.raises(BackendError, match="twice"):
        shard.forward_batch([("a", np.array([1]), np.array([5])), ("a", np.array([1]), np.array([6]))])
    with pytest.raises(BackendError, match="consecutive"):  # a verify step's bad positions: nothing runs
        shard.forward_batch([("a", np.array([1]), np.array([5])), ("b", PROMPT[:3], np.array([15, 16, 18]))], [1])
    assert shard.kv_length("a") == 5 and shard.kv_length("b") == 15  # nothing ran


@pytest.mark.parametrize("layers", [(0, None), (0, 2), (2, None)], ids=["whole", "first", "last"])
def test_decode_steps_outputs_are_their_own_whatever_runs_next(tiny_models, layers):
    """A decode step's inputs stay bound between steps of one shape and are refilled in place: a
    step's output is still its own after later steps, and steps of other shapes (a batch, a
    prefill) in between leave the next ones right."""
    start, end = layers
    cfg, weights, shard = load(tiny_models["Q4_1"], start, end)
    ref = ReferenceShard(cfg, weights)

    def rows(seed: int, n: int) -> np.ndarray:  # token ids for a first shard, else hidden states
        if start == 0:
            return np.random.default_rng(seed).integers(0, 250, n)
        return np.random.default_rng(seed).standard_normal((n, cfg.hidden_size)).astype(np.float32)

    def both(rid: str, seed: int, n: int, first: int) -> np.ndarray:
        x, pos = rows(seed, n), np.arange(first, first + n)
        got = shard.forward(rid, x, pos)
        close(got, ref.forward(rid, x, pos))
        return got

    both("a", 1, 3, 0)
    both("b", 2, 5, 0)
    kept = [(out, out.copy()) for out in (both("a", 10 + i, 1, 3 + i) for i in range(3))]
    both("c", 3, 4, 0)  # a prefill between two steps of one row
    both("a", 20, 1, 6)
    items = [("a", rows(21, 1), np.array([7])), ("b", rows(22, 1), np.array([5]))]  # two rows, then one
    for (rid, x, pos), got in zip(items, shard.forward_batch(items), strict=True):
        close(got, ref.forward(rid, x, pos))
    for rid, first in (("b", 6), ("c", 4), ("a", 8)):
        both(rid, 30 + first, 1, first)
    for out, copy in kept:
        assert np.array_equal(out, copy)


def _prefill_both(shard, ref, lengths: dict[str, int]) -> None:
    rng = np.random.default_rng(7)
    for rid, n in lengths.items():
        ids = rng.integers(0, 250, n)
        close(shard.forward(rid, ids, np.arange(n)), ref.forward(rid, ids, np.arange(n)))


def _decode_batch(shard, ref, rids: list[str], token: int) -> None:
    """One batched decode step of ``rids`` on the shard against one step each on the reference."""
    items = [(rid, np.array([token + i]), np.array([shard.kv_length(rid)])) for i, rid in enumerate(rids)]
    for (rid, x, pos), got in zip(items, shard.forward_batch(items), strict=True):
        close(got, ref.forward(rid, x, pos))


@pytest.mark.parametrize("layers", [(0, None), (0, 2), (2, None)])
def test_batched_decode_matches_reference_at_different_positions(tiny_models, layers):
    from backends.onnx.kv_pool import FIRST_SLOTS
    from backends.onnx.shard import MIN_BATCH

    start, end = layers
    path = tiny_models["Q4_1"]
    cfg, weights, shard = load(path, start, end)
    ref = ReferenceShard(cfg, weights)
    n = FIRST_SLOTS + 2  # more requests than a new pool's slots: it doubles with caches in it
    assert n >= MIN_BATCH
    rids = [f"r{i}" for i in range(n)]
    if shard.is_first:
        _prefill_both(shard, ref, {rid: 3 + 2 * i for i, rid in enumerate(rids)})
    else:
        rng = np.random.default_rng(3)
        for i, rid in enumerate(rids):
            h = rng.standard_normal((3 + 2 * i, cfg.hidden_size)).astype(np.float32)
            close(shard.forward(rid, h, np.arange(len(h))), ref.forward(rid, h, np.arange(len(h))))
    for step in range(4):
        if shard.is_first:
            _decode_batch(shard, ref, rids, 11 * step)
        else:
            rng = np.random.default_rng(step)
            items = [(rid, rng.standard_normal((1, cfg.hidden_size)).astype(np.float32),
                      np.array([shard.kv_length(rid)])) for rid in rids]
            for (rid, x, pos), got in zip(items, shard.forward_batch(items), strict=True):
                close(got, ref.forward(rid, x, pos))
    assert [shard.kv_length(rid) for rid in rids] == [3 + 2 * i + 4 for i in range(n)]


def test_requests_left_out_of_a_batch_keep_their_caches(tiny_models):
    """Slots between batched requests run as padding rows: their caches must come out intact."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    rids = [f"r{i}" for i in range(8)]
    _prefill_both(shard, ref, {rid: 4 + i for i, rid in enumerate(rids)})
    before = {rid: shard.export_kv(rid) for rid in ("r2", "r5")}
    for step in range(3):
        _decode_batch(shard, ref, ["r0", "r1", "r3", "r4", "r6", "r7"], 5 * step)
    for rid, cache in before.items():
        after = shard.export_kv(rid)
        assert after.length == cache.length
        for k0, k1, v0, v1 in zip(cache.keys, after.keys, cache.values, after.values, strict=True):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
    _decode_batch(shard, ref, rids, 40)  # and everyone goes on correctly, together
    shard.drop("r3")
    _prefill_both(shard, ref, {"late": 5})  # takes the freed slot between live ones
    _decode_batch(shard, ref, ["r0", "r1", "r2", "late", "r4", "r5"], 60)


def _rows_per_run(shard, monkeypatch) -> list[int]:
    """The number of rows of each ``session.run`` the shard makes from now on."""
    rows: list[int] = []
    run = shard._session_run

    def counted(pool, slots, hidden, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows.append(hidden.shape[0])
        return run(pool, slots, hidden, *args, **kwargs)

    monkeypatch.setattr(shard, "_session_run", counted)
    return rows


def test_a_batch_of_scattered_slots_runs_its_rows_and_no_others(tiny_models, monkeypatch):
    """On exo-tui's Attention a batch names each row's cache slot: requests with ended ones and
    others left out between them (caches kept for a next turn) decode as one run of exactly their
    rows, where a contiguous range would carry padding rows or split in two."""
    cfg, weights, shard = load(tiny_models["Q4_1"])
    if not shard.kernel:
        pytest.skip(f"exo-tui's kernels are not built here: {kernels.unavailable()}")
    ref = ReferenceShard(cfg, weights)
    rids = [f"r{i}" for i in range(8)]
    _prefill_both(shard, ref, {rid: 4 + i for i, rid in enumerate(rids)})
    for rid in ("r1", "r4", "r5"):
        shard.drop(rid)
    rows = _rows_per_run(shard, monkeypatch)
    for step in range(3):  # r6 is left out: kept, between r3 and r7
        _decode_batch(shard, ref, ["r7", "r0", "r3", "r2"], 7 * step)
    assert rows == [4, 4, 4]
    _prefill_both(shard, ref, {"late": 3})  # takes the lowest free slot, between live ones
    rows.clear()
    _decode_batch(shard, ref, ["r0", "late", "r2", "r3", "r6", "r7"], 50)
    assert rows[-1] == 6


def test_batched_decode_goes_on_in_one_run_as_the_pool_grows(tmp_path, monkeypatch):
    """A request outgrowing the pool's capacity grows the pool for everyone (caches copied, slots
    kept): requests far apart in length still decode as one run, and all of them correctly."""
    from backends.onnx.kv_pool import CAPACITY_STEP

    path = write_tiny_llama(tmp_path / "long.gguf", weight_type="Q4_0", context_length=700, seed=4)
    cfg, weights, shard = load(path)
    ref = ReferenceShard(cfg, weights)
    _prefill_both(shard, ref, {"long": CAPACITY_STEP - 3, "a": 5, "b": 9, "c": 2, "d": 7})
    rows = _rows_per_run(shard, monkeypatch)
    for step in range(5):  # "long" outgrows the first capacity on the way
        _decode_batch(shard, ref, ["a", "long", "b", "c", "d"], 3 * step)
    assert shard.kv_length("long") == CAPACITY_STEP + 2
    assert shard.kv.pool.capacity > CAPACITY_STEP
    if shard.kernel:  # on GroupQueryAttention a contiguous range: the same five rows here
        assert rows == [5] * 5


def test_a_full_cache_between_batched_requests_is_never_padded(tmp_path):
    path = write_tiny_llama(tmp_path / "short.gguf", weight_type="Q4_1", context_length=16, seed=5)
    cfg, weights, shard = load(path)
    ref = ReferenceShard(cfg, weights)
    live = ["a", "b", "c", "d", "e", "f", "g", "h"]
    lengths = {rid: 2 + i for i, rid in enumerate(live)}
    _prefill_both(shard, ref, {**dict(list(lengths.items())[:4]), "full": 16, **dict(list(lengths.items())[4:])})
    before = shard.export_kv("full")
    for step in range(3):  # two batches of four, one each side of the full cache
        _decode_batch(shard, ref, live, 7 * step)
    after = shard.export_kv("full")
    for k0, k1 in zip(before.keys, after.keys, strict=True):
        np.testing.assert_array_equal(k0, k1)
    with pytest.raises(BackendError, match="context full"):
        shard.forward("full", np.array([1]), np.array([16]))


def test_batched_decode_after_kv_import(tiny_models):
    cfg, weights, shard = load(tiny_models["Q4_1"])
    ref = ReferenceShard(cfg, weights)
    _prefill_both(shard, ref, {"a": 4, "b": 6, "c": 3, "d": 8})
    _, _, other = load(tiny_models["Q4_1"])
    other.import_kv("b", shard.export_kv("b"))
    shard.drop("b")
    shard.import_kv("b", other.export_kv("b"))
    _decode_batch(shard, ref, ["a", "b", "c", "d"], 9)
    assert sorted(shard.requests()) == ["a", "b", "c", "d"]
    for rid in ("a", "b", "c", "d"):
        shard.drop(rid)
    assert shard.requests() == [] and shard.kv.pool is None  # an empty pool gives its memory back


def test_requests_and_kv_length_do_not_wait_for_a_running_step(tiny_models):
    import threading

    _, _, shard = load(tiny_models["Q4_0"])
    shard.forward("r", PROMPT, np.arange(len(PROMPT)))
    seen: list = []
    with shard._lock:  # as while a long step runs in another thread
        t = threading.Thread(target=lambda: seen.append((shard.requests(), shard.kv_length("r"))))
        t.start()
        t.join(5)
    assert seen == [(["r"], len(PROMPT))]


def test_weight_arrays_are_made_again_when_the_session_reads_them(tiny_models, monkeypatch):
    """Where an ONNX Runtime build used our arrays in place (zeroing them changes the probe), the
    shard writes their values back (made again, no copy held during the check) and keeps them."""
    from backends.onnx.graph import build_shard_graph
    from backends.onnx.shard import MIN_BATCH, ONNXShard

    real_probe = ONNXShard._probe
    calls = []

    def probe_sees_zeroed_weights(self):
        out = real_probe(self)
        calls.append(1)
        return out + 1.0 if len(calls) == 2 else out  # the second probe runs on zeroed arrays

    monkeypatch.setattr(ONNXShard, "_probe", probe_sees_zeroed_weights)
    cfg, weights, shard = load(tiny_models["Q4_1"])
    assert shard.weight_arrays_nbytes > 0
    graph = build_shard_graph(cfg, weights, 1, batch_head_rows=MIN_BATCH, kernel=bool(shard.kernel))
    fresh = {n: a for n, a in graph.initializers.items() if n not in graph.in_place}  # the tiles are never zeroed
    assert shard._weight_arrays.keys() == fresh.keys()
    assert all(np.array_equal(shard._weight_arrays[n], a) for n, a in fresh.items())
    ref = ReferenceShard(cfg, weights)
    pos = np.arange(len(PROMPT))
    close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["qlinear", "matmulnbits"])
@pytest.mark.parametrize("precision", ["int16", "float32"])
def test_the_backend_tells_the_scheduler_the_cache_precision_its_shards_keep(tiny_models, precision, kernel, monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", kernel == "1")
    _, _, shard = load(tiny_models["Q4_1"], precision=precision)
    assert ONNXBackend(precision=precision).kv_value_bytes() == shard.kv_dtype.itemsize
    library = kernels.library()
    integer = kernel == "1" and library is not None and library.integer  # the kernel's integer products run here
    assert shard.kv_dtype.itemsize == (2 if precision == "int16" and integer else 4)


def test_qlinear_tiles_are_the_sessions_only_copy_of_the_weights(tmp_path):
    """ONNX Runtime reads a K-quant shard's QLinear tiles where the shard made them (no copy at
    session creation, which held the shard's bytes twice while loading): zeroing them changes the
    logits. A shard with both ends of a model that ties them looks its tokens' embeddings up in the
    head's tiles (no second form of the matrix), a first shard alone keeps the embedding as packed
    codes with the file's super-block fields; both give exactly the matrix's rows."""
    from backends.onnx.kernels.tile_rows import TileRows
    from backends.onnx.weights import EmbeddingRows

    if kernels.library() is None:
        pytest.skip("no QLinear kernel here")
    path = write_tiny_llama(tmp_path / "q4k.gguf", hidden=256, intermediate=512, n_layers=2, weight_type="Q4_K",
                            embed_type="Q6_K", tied=True)
    model = GGUFModel(path)
    embed = model.tensor("token_embd.weight")
    ids = np.array([0, 7, 3, 31, 32, model.config.vocab_size - 1])
    first = ONNXBackend(threads=1).load_shard(model.config, model.shard_weights(0, 1))
    try:
        assert isinstance(first._embed, EmbeddingRows) and first._embed.nbytes < 1.2 * embed.nbytes
        assert np.array_equal(first._embed.rows(ids), embed.dequantize()[ids])
    finally:
        first.close()
    cfg, weights, shard = load(path)
    assert shard._in_place and shard.weight_arrays_nbytes == 0
    tiles = sum(v.numpy().nbytes for v in shard._in_place.values())
    assert tiles >= 0.9 * model.nbytes  # nearly all of the shard's bytes, the tied head's among them
    before = shard.forward("a", PROMPT, np.arange(len(PROMPT)))
    assert isinstance(shard._embed, TileRows) and shard._embed.nbytes == 0
    assert np.array_equal(shard._embed.rows(ids), embed.dequantize()[ids])
    for value in shard._in_place.values():
        value.numpy()[...] = 0  # a view of the array the session reads
    assert not np.array_equal(shard.forward("b", PROMPT, np.arange(len(PROMPT))), before)
    assert not shard._embed.rows(ids).any()  # the rows were the head's tiles
