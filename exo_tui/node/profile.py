"""What a node is: its device (memory, CPU, chip, backends) and how fast it runs a layer.

The performance figure the scheduler uses is measured, not looked up: at start the node times a
few decode steps and a short prefill of layers shaped like the default model's on each backend it
has, and of the same in Q4_K super-blocks (which a backend may run at another precision: ONNX's
``auto`` runs them at int8; a K-quant model is planned on those figures), and its memory bandwidth. Results are cached per machine (keyed by backend, how it is set
up to run, versions and shape) so restarts are quick.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from backends import available_backends, get_backend, is_apple_silicon
from backends.base import BackendError, ModelConfig
from backends.kquants import KQuantWeight, random_blocks
from backends.weights import LayerWeights, QuantizedWeight, ShardWeights
from exo_tui import __version__
from exo_tui.paths import exo_home, file_lock

# SmolLM2-135M's layer shape: the default model, so figures compare across nodes.
BENCH_CONFIG = ModelConfig(
    n_layers=4, hidden_size=576, intermediate_size=1536, n_heads=9, n_kv_heads=3, head_dim=64,
    vocab_size=256, rms_eps=1e-5, rope_theta=100000.0, context_length=512,
)
# The same layers in Q4_K super-blocks (whose rows are multiples of 256 weights, so 512 wide): a
# backend may run a K-quant file's layers at another precision (ONNX's auto: int8, against int16
# on the other blocks), so they are timed too, for the plans of such models.
KQUANT_BENCH_CONFIG = ModelConfig(
    n_layers=4, hidden_size=512, intermediate_size=1536, n_heads=8, n_kv_heads=4, head_dim=64,
    vocab_size=256, rms_eps=1e-5, rope_theta=100000.0, context_length=512,
)


def layer_params(cfg: ModelConfig) -> int:
    """The weights of one of ``cfg``'s layers' matrices."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.hidden_size * q + 2 * cfg.hidden_size * kv + 3 * cfg.hidden_size * cfg.intermediate_size


BENCH_LAYER_BYTES = layer_params(BENCH_CONFIG) * 20 // 32  # Q4_0-style blocks: 20 bytes a 32 weights
KQUANT_BENCH_LAYER_BYTES = layer_params(KQUANT_BENCH_CONFIG) * 144 // 256  # Q4_K: 144 bytes a 256
BENCH_LAYERS = 4
BENCH_DECODE_STEPS = 8
BENCH_PREFILL_TOKENS = 128  # per-token prefill time at 32 tokens was ~1.3x that at 512 (the predicted prompt)
BENCH_PREFILL_RUNS = 3  # best of these, while they fit in BENCH_PREFILL_BUDGET_S
BENCH_PREFILL_BUDGET_S = 0.5
TIMING_METHOD = "v4"  # in the cache key: figures taken the old way are measured again (v3: float16 scales; v4: K-quant layers too)


@dataclass
class LayerTiming:
    decode_layer_s: float  # one token through one layer, at small context
    prefill_layer_token_s: float  # one prompt token through one layer, in a batch
    # the same of a K-quant layer (KQUANT_BENCH_CONFIG's, Q4_K); 0: not measured
    kquant_decode_layer_s: float = 0.0
    kquant_prefill_layer_token_s: float = 0.0

    def for_model(self, kquant: bool) -> tuple[float, float, int]:
        """Decode and prefill seconds a layer, and the bytes of the layer they were measured on,
        for a model whose layers are (``kquant``) or are not mostly K-quant super-blocks."""
        if kquant and self.kquant_decode_layer_s > 0 and self.kquant_prefill_layer_token_s > 0:
            return self.kquant_decode_layer_s, self.kquant_prefill_layer_token_s, KQUANT_BENCH_LAYER_BYTES
        return self.decode_layer_s, self.prefill_layer_token_s, BENCH_LAYER_BYTES


@dataclass
class NodeProfile:
    node_id: str
    name: str
    hostname: str
    os: str
    arch: str
    python: str
    version: str
    cpu_model: str
    cpu_cores: int  # physical
    cpu_threads: int  # logical
    ram_total_bytes: int
    ram_available_bytes: int
    memory_limit_bytes: int | None  # --memory-limit: the memory it gives to models, above its runtime's own
    device_type: str  # apple | cuda | cpu
    chip: str  # Apple chip or GPU name, when detectable
    unified_memory: bool
    backends: list[str]
    layer_timing: dict[str, LayerTiming] = field(default_factory=dict)
    memory_bandwidth_bytes_per_s: float = 0.0
    backend: str = ""  # the backend this node agent runs its shards on (one of ``backends``)
    engine: dict[str, str] = field(default_factory=dict)  # how that backend runs here (Backend.describe)
    kv_value_bytes: int = 4  # bytes a cached K or V value takes on that backend (ONNX's int16/int8: 2)
    runtime_baseline_bytes: int = 0  # the node process's resident memory at start, before any shard

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeProfile:
        """A profile as a node sent it; fields this version does not know (a newer node's) are
        left out, so nodes and coordinators of neighbouring versions still join one cluster."""
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        timed = {f.name for f in fields(LayerTiming)}
        d["layer_timing"] = {k: LayerTiming(**{f: x for f, x in v.items() if f in timed})
                             for k, v in d.get("layer_timing", {}).items()}
        return cls(**d)

    def offered_memory_bytes(self) -> int:
        """Memory this node offers for shards: available RAM, capped by ``--memory-limit`` (the
        memory it gives to models, above its runtime's own)."""
        avail = self.ram_available_bytes
        return min(avail, self.memory_limit_bytes) if self.memory_limit_bytes else avail


def runs_on(profile: NodeProfile, backend: str) -> None:
    """Record in ``profile`` that the node runs its shards on ``backend``: how that backend runs
    here (precision, threads, kernels), the precision of the KV caches it keeps, and the process's
    resident memory with the backend imported and checked (its runtime's baseline)."""
    engine = get_backend(backend)
    profile.backend = backend
    profile.engine = engine.describe()
    profile.kv_value_bytes = engine.kv_value_bytes()
    profile.runtime_baseline_bytes = process_rss_bytes()


def process_rss_bytes() -> int:
    """This process's resident memory now."""
    return int(psutil.Process().memory_info().rss)


def stable_node_id(name: str) -> str:
    """The node id for ``name`` on this host, created once and kept across restarts."""
    directory = exo_home() / "node-ids"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in name)}.id"
    # Nodes of one name starting together (two processes) must agree on one id: one makes it,
    # the other reads it.
    with file_lock(directory / ".lock"):
        if path.exists():
            value = path.read_text().strip()
            if value:
                return value
        value = f"n-{uuid.uuid4().hex[:12]}"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, path)
    return value


def _cpu_model() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2
            ).stdout.strip()
        except OSError:
            return platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=3
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def device_profile(name: str, memory_limit_bytes: int | None = None, backends: list[str] | None = None) -> NodeProfile:
    """The static part of the profile (no benchmark)."""
    vm = psutil.virtual_memory()
    apple = is_apple_silicon()
    gpu = "" if apple else _gpu_name()
    return NodeProfile(
        node_id=stable_node_id(name),
        name=name,
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        arch=platform.machine(),
        python=platform.python_version(),
        version=__version__,
        cpu_model=_cpu_model(),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        cpu_threads=psutil.cpu_count(logical=True) or 1,
        ram_total_bytes=int(vm.total),
        ram_available_bytes=int(vm.available),
        memory_limit_bytes=memory_limit_bytes,
        device_type="apple" if apple else ("cuda" if gpu else "cpu"),
        chip=_cpu_model() if apple else gpu,
        unified_memory=apple,
        backends=list(backends) if backends is not None else available_backends(),
    )


def _bench_weights(cfg: ModelConfig, kquant: bool = False) -> ShardWeights:
    rng = np.random.default_rng(0)
    h, i, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def matrix(rows: int, cols: int) -> QuantizedWeight:
        if kquant:
            return KQuantWeight(random_blocks(rng, rows, cols, "Q4_K", 0.02), "Q4_K", cols)
        return QuantizedWeight.random(rng, rows, cols)

    layers = [
        LayerWeights(
            attn_norm=np.ones(h, np.float32),
            wq=matrix(qd, h), wk=matrix(kvd, h), wv=matrix(kvd, h), wo=matrix(h, qd),
            ffn_norm=np.ones(h, np.float32),
            w_gate=matrix(i, h), w_up=matrix(i, h), w_down=matrix(h, i),
        )
        for _ in range(cfg.n_layers)
    ]
    # A middle shard: no embedding and no head, so only layer time is measured.
    return ShardWeights(1, 1 + cfg.n_layers, layers)


def time_layers(backend_name: str) -> LayerTiming:
    """Seconds per layer for decode and prefill of the benchmark's layers, and of its K-quant ones."""
    decode, prefill = _time_layers(backend_name, BENCH_CONFIG, kquant=False)
    kquant_decode, kquant_prefill = _time_layers(backend_name, KQUANT_BENCH_CONFIG, kquant=True)
    return LayerTiming(decode, prefill, kquant_decode, kquant_prefill)


def _time_layers(backend_name: str, cfg: ModelConfig, kquant: bool) -> tuple[float, float]:
    """Seconds per layer for decode (median of a few steps) and for prefill (per token)."""
    mid_cfg = ModelConfig(**{**asdict(cfg), "n_layers": cfg.n_layers + 2})
    shard = get_backend(backend_name).load_shard(mid_cfg, _bench_weights(cfg, kquant))
    try:
        rng = np.random.default_rng(1)
        prompt = rng.standard_normal((BENCH_PREFILL_TOKENS, cfg.hidden_size)).astype(np.float32)
        positions = np.arange(BENCH_PREFILL_TOKENS)
        shard.forward("bench-warm", prompt, positions)
        shard.drop("bench-warm")
        # Best of a few runs: other work on the machine only ever adds time, and this figure is
        # cached for good (the predicted time to first token rests on it).
        runs: list[float] = []
        spent = time.perf_counter()
        while len(runs) < BENCH_PREFILL_RUNS and (not runs or time.perf_counter() - spent < BENCH_PREFILL_BUDGET_S):
            if runs:
                shard.drop("bench")
            t0 = time.perf_counter()
            shard.forward("bench", prompt, positions)
            runs.append(time.perf_counter() - t0)
        prefill = min(runs) / (cfg.n_layers * BENCH_PREFILL_TOKENS)
        steps = []
        x = prompt[-1:]
        for j in range(BENCH_DECODE_STEPS):
            t0 = time.perf_counter()
            shard.forward("bench", x, np.array([BENCH_PREFILL_TOKENS + j]))
            steps.append(time.perf_counter() - t0)
        decode = float(np.median(steps)) / cfg.n_layers
    finally:
        shard.close()
    return decode, prefill


def memory_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of a large array copy (read + write), best of a few."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _cache_key(backend: str) -> str:
    import importlib.metadata as md

    versions = []
    for dist in ("mlx", "onnxruntime", "numpy"):
        try:
            versions.append(f"{dist}={md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    shape = f"{BENCH_CONFIG.hidden_size}x{BENCH_CONFIG.intermediate_size}x{BENCH_CONFIG.n_heads}"
    try:  # how the backend runs here (precision, threads, kernels, spin): other settings, other figures
        engine = get_backend(backend).describe()
    except BackendError:
        engine = {}
    settings = ",".join(f"{name}={value}" for name, value in sorted(engine.items()))
    kernel = ""
    if backend == "onnx":  # whether its QLinear kernel runs here (built and trusted), and which build
        from backends.onnx import kernels

        library = kernels.library()
        kernel = f"|qlinear={library.isa + ':' + library.build if library else 'none'}"
    return f"{backend}|{TIMING_METHOD}|{shape}|{_cpu_model()}|{settings}|{','.join(versions)}{kernel}"


def benchmark(profile: NodeProfile, *, use_cache: bool = True, backends: list[str] | None = None) -> NodeProfile:
    """Fill in layer timings for ``backends`` (default: every backend the node has) and the
    memory bandwidth: from this machine's cache, else measured (one process at a time) and cached."""
    cache_path = exo_home() / "benchmark-cache.json"
    # One process of this machine at a time: nodes started together would otherwise time their
    # layers at once, each slowed by the others, and cache those slow figures; in turn, the first
    # measures and the others read its results.
    with file_lock(exo_home() / "benchmark.lock"):
        return _benchmark(profile, cache_path, use_cache, backends)


def _benchmark(profile: NodeProfile, cache_path: Path, use_cache: bool, backends: list[str] | None) -> NodeProfile:
    cache: dict[str, Any] = {}
    if use_cache and cache_path.exists():
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, ValueError):
            cache = {}
    for backend in backends if backends is not None else profile.backends:
        key = _cache_key(backend)
        if key in cache:
            profile.layer_timing[backend] = LayerTiming(**cache[key])
            continue
        timing = time_layers(backend)
        profile.layer_timing[backend] = timing
        cache[key] = asdict(timing)
    if "bandwidth" in cache:
        profile.memory_bandwidth_bytes_per_s = float(cache["bandwidth"])
    else:
        profile.memory_bandwidth_bytes_per_s = memory_bandwidth()
        cache["bandwidth"] = profile.memory_bandwidth_bytes_per_s
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return profile


STREAMING_S = 3.0  # a request is streaming while its last token is this recent


@dataclass
class _Drawn:
    tokens: int = 0
    first_s: float = field(default_factory=time.monotonic)
    last_s: float = field(default_factory=time.monotonic)


class RequestRates:
    """The tokens a node's last hop drew for each request, and its rate while it streams (the
    heartbeat's ``requests``)."""

    def __init__(self) -> None:
        self._drawn: dict[str, _Drawn] = {}

    def drew(self, rid: str, tokens: int) -> None:
        d = self._drawn.setdefault(rid, _Drawn())
        d.tokens += tokens
        d.last_s = time.monotonic()

    def forget(self, rid: str) -> None:
        self._drawn.pop(rid, None)

    def report(self, now: float) -> dict[str, dict[str, float]]:
        """Each request's tokens and tok/s. One that has streamed no token for STREAMING_S (ended,
        its cache kept for a next turn) makes no tok/s now: its average would show on a node long
        after (a drained one too)."""
        return {rid: {"tokens": d.tokens, "tok_per_s": (d.tokens - 1) / max(d.last_s - d.first_s, 1e-6)
                      if d.tokens > 1 and now - d.last_s < STREAMING_S else 0.0}
                for rid, d in self._drawn.items()}


def live_metrics(memory_limit_bytes: int | None = None) -> dict[str, Any]:
    """Memory and CPU right now (sent with every heartbeat)."""
    vm = psutil.virtual_memory()
    metrics: dict[str, Any] = {
        "ram_total_bytes": int(vm.total if not memory_limit_bytes else min(vm.total, memory_limit_bytes)),
        "ram_available_bytes": int(vm.available if not memory_limit_bytes else min(vm.available, memory_limit_bytes)),
        "ram_used_percent": float(vm.percent),
        "process_rss_bytes": process_rss_bytes(),
        "cpu_percent": float(psutil.cpu_percent(interval=None)),
        "load_avg_1m": float(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0,
    }
    temps = getattr(psutil, "sensors_temperatures", None)
    if temps:
        try:
            readings = [t.current for group in temps().values() for t in group if t.current]
            if readings:
                metrics["temperature_c"] = max(readings)
        except (OSError, RuntimeError):
            pass
    battery = getattr(psutil, "sensors_battery", None)
    if battery:
        try:
            b = battery()
            if b is not None:
                metrics["on_battery"] = not b.power_plugged
        except (OSError, RuntimeError):
            pass
    return metrics
