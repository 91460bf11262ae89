"""A shard on ONNX Runtime: one session per shard, one ``run`` per step, KV caches in place.

Each request owns float32 K and V buffers ``(layers, 1, n_kv_heads, capacity, head_dim)`` held as
NumPy arrays. Their per-layer slices are bound (IOBinding, as ``OrtValue``s sharing the NumPy
memory) both as the graph's ``past_*`` inputs and as its ``present_*`` outputs, which is
``GroupQueryAttention``'s buffer-sharing mode: each step writes only its new positions, nothing is
copied. When a request outgrows its capacity the buffers grow (doubling, up to the context length).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from backends.base import BackendError, KVCache, ModelConfig, Shard, ShardWeights, validate_forward_input
from backends.onnx.graph import build_shard_graph
from backends.onnx.weights import embedding_rows

CAPACITY_STEP = 256  # KV buffers grow in multiples of this many positions
PROBE_ID = "\0probe"  # the request id of the load-time probe steps
PREFILL_CHUNK = 512  # longer prompts run in chunks: attention scores stay (heads, 512, context)


@dataclass
class _RequestCache:
    length: int
    keys: np.ndarray  # (layers, 1, n_kv_heads, capacity, head_dim)
    values: np.ndarray
    binding: ort.IOBinding
    ortvalues: list[ort.OrtValue]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]


class ONNXShard(Shard):
    """Layers ``[weights.start, weights.end)`` on ONNX Runtime's CPU execution provider."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ShardWeights,
        *,
        threads: int,
        accuracy_level: int = 1,
        session_config: dict[str, str] | None = None,
    ) -> None:
        super().__init__(config, weights.start, weights.end)
        self.threads = threads
        self.accuracy_level = accuracy_level
        self._embed = weights.embed if self.is_first else None
        graph = build_shard_graph(config, weights, accuracy_level)
        self._kv_inputs, self._kv_outputs, self._output = graph.kv_inputs, graph.kv_outputs, graph.output
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        for key, value in (session_config or {}).items():
            options.add_session_config_entry(key, value)
        # Weights reach the session as OrtValues over our NumPy arrays (see _release_weight_copies).
        self._weight_values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in graph.initializers.items()}
        self._weight_arrays = graph.initializers
        options.add_external_initializers(list(self._weight_values), list(self._weight_values.values()))
        try:
            self._session = ort.InferenceSession(
                graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BackendError(
                f"ONNX Runtime cannot build layers [{self.start}, {self.end}) ({exc}); "
                "check that onnxruntime >= 1.20 is installed"
            ) from exc
        self._caches: dict[str, _RequestCache] = {}
        self._lock = threading.RLock()
        self.prefill_chunk = PREFILL_CHUNK
        self._release_weight_copies()

    @property
    def weight_arrays_nbytes(self) -> int:
        """Bytes of weight arrays this shard holds besides ONNX Runtime's own buffers."""
        return sum(a.nbytes for a in self._weight_arrays.values())

    def _release_weight_copies(self) -> None:
        """Free our weight arrays when the session no longer reads them.

        ONNX Runtime (1.2x, CPU) copies external initializers into its own buffers and repacks
        the matrices, so after loading our arrays are dead weight, as large as the model. That is
        checked, not assumed: all arrays are zeroed and probe steps (prompt and decode) must give
        exactly the outputs they gave before; only then are the arrays released, else restored.
        """
        before = self._probe()
        saved = {n: a.copy() for n, a in self._weight_arrays.items()}
        for a in self._weight_arrays.values():
            a[...] = 0
        after = self._probe()
        if np.array_equal(before, after):
            self._weight_arrays = {}
            self._weight_values = {}
        else:
            for n, a in self._weight_arrays.items():
                a[...] = saved[n]

    def _probe(self) -> np.ndarray:
        """Outputs of a fixed random prompt of two tokens and one decode step (no cache kept)."""
        rid = PROBE_ID
        hidden = np.random.default_rng(0).standard_normal((3, self.config.hidden_size)).astype(np.float32)
        with self._lock:
            try:
                prompt = self._run(rid, hidden[:2], 0, all_logits=True)
                step = self._run(rid, hidden[2:], 2, all_logits=True)
                return np.concatenate([prompt, step])
            finally:
                self._caches.pop(rid, None)

    # ------------------------------------------------------------------ caches

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def _new_cache(self, capacity: int) -> _RequestCache:
        c = self.config
        shape = (self.n_layers, 1, c.n_kv_heads, capacity, c.head_dim)
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        binding = self._session.io_binding()
        ortvalues = []
        for i, ((pk, pv), (ok, ov)) in enumerate(zip(self._kv_inputs, self._kv_outputs, strict=True)):
            k_val, v_val = ort.OrtValue.ortvalue_from_numpy(keys[i]), ort.OrtValue.ortvalue_from_numpy(values[i])
            binding.bind_ortvalue_input(pk, k_val)
            binding.bind_ortvalue_output(ok, k_val)
            binding.bind_ortvalue_input(pv, v_val)
            binding.bind_ortvalue_output(ov, v_val)
            ortvalues += [k_val, v_val]
        return _RequestCache(0, keys, values, binding, ortvalues)

    def _capacity_for(self, needed: int) -> int:
        cap = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
        return max(1, min(cap, self.config.context_length))

    def _cache_with_room(self, request_id: str, needed: int) -> _RequestCache:
        cache = self._caches.get(request_id)
        if cache is not None and cache.capacity >= needed:
            return cache
        old_cap = cache.capacity if cache is not None else 0
        grown = self._new_cache(self._capacity_for(max(needed, 2 * old_cap)))
        if cache is not None:
            n = cache.length
            grown.keys[:, :, :, :n] = cache.keys[:, :, :, :n]
            grown.values[:, :, :, :n] = cache.values[:, :, :, :n]
            grown.length = n
        self._caches[request_id] = grown
        return grown

    # ------------------------------------------------------------------ Shard

    def forward(
        self, request_id: str, x: np.ndarray, positions: np.ndarray, *, all_logits: bool = False
    ) -> np.ndarray:
        x, positions = np.asarray(x), np.asarray(positions)
        with self._lock:
            if self._session is None:
                raise BackendError(f"shard [{self.start}, {self.end}) is closed: load it again")
            cache = self._caches.get(request_id)
            cached = cache.length if cache is not None else 0
            validate_forward_input(self, x, positions, cached)
            t = positions.shape[0]
            if t > 1 and not np.array_equal(positions, np.arange(cached, cached + t)):
                raise BackendError(
                    f"positions must be consecutive from {cached}, got {positions[:8].tolist()}..."
                )
            if self.is_first:
                if self._embed is None:
                    raise BackendError("the first shard was loaded without the token embedding")
                hidden = embedding_rows(self._embed, x.astype(np.int64))
            else:
                hidden = np.ascontiguousarray(x, dtype=np.float32)
            if t <= self.prefill_chunk:
                return self._run(request_id, hidden, cached, all_logits)
            outs = []
            try:
                for a in range(0, t, self.prefill_chunk):
                    chunk = hidden[a : a + self.prefill_chunk]
                    out = self._run(request_id, chunk, cached + a, all_logits)
                    if all_logits or not self.is_last or a + len(chunk) == t:
                        outs.append(out)
            except BackendError:  # all or nothing: forget the chunks that did run
                if cached == 0:
                    self._caches.pop(request_id, None)
                elif request_id in self._caches:
                    self._caches[request_id].length = cached
                raise
            return np.concatenate(outs)

    def forward_batch(self, items: list[tuple[str, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """``forward`` for several requests, one run each (M=1 ``MatMulNBits`` is the fastest path
        per token up to ~3 requests). All items are checked before any cache changes."""
        with self._lock:
            seen: set[str] = set()
            for rid, x, positions in items:
                if rid in seen:
                    raise BackendError(f"request {rid} appears twice in one batch")
                seen.add(rid)
                x, positions = np.asarray(x), np.asarray(positions)
                validate_forward_input(self, x, positions, self.kv_length(rid))
            return [self.forward(rid, x, positions) for rid, x, positions in items]

    def _run(self, request_id: str, hidden: np.ndarray, cached: int, all_logits: bool) -> np.ndarray:
        """One ``session.run`` of ``hidden`` ``(T, hidden)`` after ``cached`` positions."""
        c = self.config
        t = hidden.shape[0]
        new_request = request_id not in self._caches
        cache = self._cache_with_room(request_id, cached + t)
        io = cache.binding
        io.bind_cpu_input("hidden_in", hidden.reshape(1, t, c.hidden_size))
        io.bind_cpu_input("seqlens_k", np.array([cached + t - 1], dtype=np.int32))
        io.bind_cpu_input("total_seq_len", np.array(cached + t, dtype=np.int32))
        if self.is_last:
            rows = t if all_logits else 1
            io.bind_cpu_input("logits_start", np.array([t - rows], dtype=np.int64))
            out = np.empty((1, rows, c.vocab_size), dtype=np.float32)
        else:
            out = np.empty((1, t, c.hidden_size), dtype=np.float32)
        io.bind_output(self._output, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        try:
            self._session.run_with_iobinding(io)
        except Exception as exc:
            if new_request:
                self._caches.pop(request_id, None)
            raise BackendError(
                f"ONNX Runtime failed on layers [{self.start}, {self.end}) for request {request_id} "
                f"at position {cached} ({exc})"
            ) from exc
        cache.length = cached + t
        return out[0]

    def kv_length(self, request_id: str) -> int:
        cache = self._caches.get(request_id)
        return cache.length if cache is not None else 0

    def export_kv(self, request_id: str) -> KVCache:
        c = self.config
        with self._lock:
            cache = self._caches.get(request_id)
            if cache is None:
                empty = np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32)
                return KVCache(self.start, self.end, 0, [empty.copy() for _ in range(self.n_layers)],
                               [empty.copy() for _ in range(self.n_layers)])
            n = cache.length
            keys = [cache.keys[i, 0, :, :n].copy() for i in range(self.n_layers)]
            values = [cache.values[i, 0, :, :n].copy() for i in range(self.n_layers)]
            return KVCache(self.start, self.end, n, keys, values)

    def import_kv(self, request_id: str, cache: KVCache) -> None:
        c = self.config
        if not (cache.start <= self.start and self.end <= cache.end):
            raise BackendError(
                f"cache of layers [{cache.start}, {cache.end}) does not cover this shard's [{self.start}, {self.end})"
            )
        part = cache.slice_layers(self.start, self.end)
        n = int(part.length)
        if n > c.context_length:
            raise BackendError(f"cache of {n} tokens exceeds the model's context of {c.context_length}")
        expected = (c.n_kv_heads, n, c.head_dim)
        if len(part.keys) != self.n_layers or len(part.values) != self.n_layers:
            raise BackendError(f"cache has {len(part.keys)} key / {len(part.values)} value layers, expected {self.n_layers}")
        for i, (k, v) in enumerate(zip(part.keys, part.values, strict=True)):
            if np.shape(k) != expected or np.shape(v) != expected:
                raise BackendError(
                    f"cache layer {self.start + i} has keys {np.shape(k)} / values {np.shape(v)}, expected {expected} "
                    "(n_kv_heads, length, head_dim)"
                )
        with self._lock:
            if self._session is None:
                raise BackendError(f"shard [{self.start}, {self.end}) is closed: load it again")
            fresh = self._new_cache(self._capacity_for(max(n, 1)))
            for i, (k, v) in enumerate(zip(part.keys, part.values, strict=True)):
                fresh.keys[i, 0, :, :n] = k
                fresh.values[i, 0, :, :n] = v
            fresh.length = n
            self._caches[request_id] = fresh

    def truncate_kv(self, request_id: str, length: int) -> None:
        with self._lock:
            cache = self._caches.get(request_id)
            if cache is not None:
                cache.length = max(0, min(int(length), cache.length))

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._caches.pop(request_id, None)

    def requests(self) -> list[str]:
        # Without the lock: callers such as heartbeats must not wait for a long step to end.
        while True:
            try:
                return [rid for rid in list(self._caches) if rid != PROBE_ID]
            except RuntimeError:  # the dict changed size while being copied; copy again
                continue

    def close(self) -> None:
        with self._lock:
            self._caches.clear()
            self._session = None  # type: ignore[assignment]
            self._weight_values.clear()
            self._weight_arrays = {}
            self._embed = None
