"""A shard on ONNX Runtime: one session per shard, one ``run`` per step, KV caches in place.

KV caches live in one pool: arrays ``(layers, slots, n_kv_heads, capacity, head_dim)`` for keys
and for values, one slot per request: float16 where exo-tui's kernels run integer products (the int16 and int8 precisions,
on ``AttentionF16``: half the bytes a decode step reads, which at long contexts is most of
them), float32 with float32 products and on ``GroupQueryAttention``; exported as float32. The
per-layer arrays are bound (IOBinding, as ``OrtValue``s sharing the NumPy memory) both as the
graph's ``past_*`` inputs and as its ``present_*`` outputs, so attention writes only each step's
new positions: nothing is copied.

That layout is what lets several requests decode in one run (``forward_batch``): each is a row of
one batch, at its own position (``seqlens_k`` per row), and every weight matrix is read once for
all of them. On exo-tui's ``Attention`` the whole pool is bound and a ``slots`` input names each
row's slot, so a batch is any set of a pool's requests: requests that ended (or whose caches are
kept for a next turn) leave holes between the live ones, and those cost nothing. On
``GroupQueryAttention`` (row b is slot b) a run covers a contiguous range of slots instead, and a
slot inside it whose request is not in the batch rides along as a padding row: it writes one junk
position just past its cache's end, which its next real step overwrites. So a slot always keeps
one free position (``_capacity_for``), except at the model's full context, where such a slot
splits the range instead. When a request outgrows the pool's capacity (a multiple of 256
positions, up to the context length), the pool grows to at least twice it, every request's
positions copied into its slot of the new arrays; when its slots are full it doubles them. So all
of a shard's requests are in one pool and any set of them decodes in one run (with one pool per
capacity, requests at 150 and at 300 positions took two runs: 10.8 ms for eight of them against
6.4-8.4 ms in one). Every slot has the longest request's capacity, but the arrays are anonymous
memory maps: a page is resident only once a position in it is written. On the kernel a windowed
layer's caches are rings of its window's positions beside those (``backends/rings.py``), which never grow.

Over ~600 lines on purpose, for now: the pool's slots and the session's bindings are one concern
(a run binds the pool's arrays in place; a pool that grows drops the bindings). The next step is the
pool (its slots, growth, export and import) as a class of its own that the shard binds.
"""

from __future__ import annotations

import functools
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import onnxruntime as ort

from backends.base import (
    BackendError,
    KVCache,
    LayerWeights,
    LazyLayers,
    ModelConfig,
    QuantizedWeight,
    Shard,
    ShardWeights,
    validate_forward_input,
)
from backends.kquants import mostly_kquant
from backends.onnx import ACCURACY_LEVEL, AUTO, DEFAULT_PRECISION, PRECISIONS, kernels
from backends.onnx.affinity import CorePlan
from backends.onnx.graph import build_shard_graph
from backends.onnx.kernels import runs_on_kernel
from backends.onnx.kernels.tile_rows import TileRows
from backends.onnx.weights import compact_embedding, embedding_rows
from backends.rings import RingLayout

CAPACITY_STEP = 256  # pools hold multiples of this many positions
FIRST_SLOTS = 4  # slots of a new pool; it doubles when full
MAX_PADDING = 2  # GroupQueryAttention: padding rows a batch accepts between two requests before it splits
MIN_BATCH = 2
"""Single-token steps of at least this many requests run as one batch (else one by one): every
weight is read once for all of them. SmolLM2, 2 threads (Zen 5), the QLinear kernel: a decode step
of 1 / 4 / 8 / 16 rows takes 2.8 / 4.1 / 5.9 / 10.8 ms batched at the int16 precision, 3.6 / 4.9 /
9.7 / 17.3 in float32 and 2.9 / 3.9 / 5.8 / 9.3 in int8 (``benchmarks/onnx_kernels.py``, one run). (On MatMulNBits, whose multi-row path dequantizes the whole matrix, 2 / 3 / 4 rows took 28 /
30 / 32 ms against 15 ms for one.)"""
PROBE_ID = "\0probe"  # the request id of the load-time probe steps


def _zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in an anonymous memory map: its pages come on first write, 4 KB at a time. (NumPy
    asks for huge pages for arrays this large, and a request's first positions in a new pool then
    fault in a 2 MB page per layer and head, zeroed, after the kernel compacts memory for it:
    moving a request to a larger pool stalled its stream 0.2-0.6 s, where this takes ~6 ms.)"""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, int(np.prod(shape))).reshape(shape)


def _release_layer(array: np.ndarray, layer: int) -> None:
    """Give the pages of ``array[layer]`` (an array of :func:`_zeroed`, copied elsewhere) back to
    the system; they read as zeros after. (The map is shared memory: MADV_REMOVE frees its pages,
    where MADV_DONTNEED would only unmap them from this process.)"""
    buf = array.base
    while buf is not None and not isinstance(buf, mmap.mmap):
        buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
    if buf is None or not hasattr(mmap, "MADV_REMOVE"):
        return
    size = array[layer].nbytes
    start = -(-layer * size // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the layer only
    end = (layer + 1) * size // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        buf.madvise(mmap.MADV_REMOVE, start, end - start)


@dataclass
class _Pool:
    """Slots of one capacity; ``owners[s]`` is the request in slot ``s`` or None."""

    capacity: int
    keys: np.ndarray  # (full-length layers, slots, n_kv_heads, capacity, head_dim)
    values: np.ndarray
    owners: list[str | None]
    bindings: dict[tuple[int, int], tuple[ort.IOBinding, list[ort.OrtValue]]] = field(default_factory=dict)
    ring_keys: np.ndarray | None = None  # (windowed layers, slots, n_kv_heads, ring rows, head_dim): backends/rings.py
    ring_values: np.ndarray | None = None

    def layer(self, rings: RingLayout, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard layer ``i``'s keys and values, ``(slots, n_kv_heads, positions, head_dim)``."""
        if rings.ring_of[i] >= 0:
            return self.ring_keys[rings.ring_of[i]], self.ring_values[rings.ring_of[i]]  # type: ignore[index]
        return self.keys[rings.full_of[i]], self.values[rings.full_of[i]]

    @property
    def slots(self) -> int:
        return len(self.owners)


@dataclass
class _Step:
    """One request's single-token step inside ``forward_batch``: ``index`` is its place in the batch."""

    index: int
    rid: str
    entry: _Entry
    hidden: np.ndarray  # (1, hidden)


@dataclass
class _StepInputs:
    """A decode step's small inputs and its output, bound once to an IOBinding and refilled in
    place at each step of the same shape (binding them anew, an OrtValue made and looked up per
    input and the output's buffer bound, was most of the Python between two steps' runs)."""

    shape: tuple[int, int]  # (rows of the batch, logits rows)
    slots: np.ndarray  # (B,) int32
    hidden: np.ndarray  # (B, 1, hidden) float32
    seqlens: np.ndarray  # (B,) int32
    total: np.ndarray  # () int32
    out: np.ndarray  # (B, rows, vocab) or (B, 1, hidden) float32


@dataclass
class _Entry:
    """Where a request's cache lives and how many positions it holds."""

    pool: _Pool
    slot: int
    length: int
    floor: int = 0  # the rings hold no position before it (backends/rings.py: first_held)

    @property
    def capacity(self) -> int:
        return self.pool.capacity


class ONNXShard(Shard):
    """Layers ``[weights.start, weights.end)`` on ONNX Runtime's CPU execution provider."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ShardWeights,
        *,
        threads: int,
        precision: str = DEFAULT_PRECISION,
        session_config: dict[str, str] | None = None,
        cores: CorePlan | None = None,
    ) -> None:
        super().__init__(config, weights.start, weights.end)
        self.threads = threads
        self._cores = cores  # the calling thread's core during a run (the pool's are in session_config)
        self.precision = precision = resolve_precision(precision, weights)
        library = kernel_for(precision)
        # A tied embedding on the shard that also has the head is looked up in the head's tiles
        # (TileRows, once the graph has them): one form of the matrix, not two.
        tied_head = (self.is_first and self.is_last and weights.output is weights.embed and library is not None
                     and runs_on_kernel(weights.embed))
        self._embed = compact_embedding(weights.embed) if self.is_first and not tied_head else None
        self.kernel = library.isa if library is not None else ""  # which QLinear build runs, if any
        self.xbits = integer_codes(precision, library)  # QLinear's activation codes (0: float32 products)
        half_kv = caches_half(library, self.xbits)
        self._slot_map = library is not None  # Attention takes each row's slot; GroupQueryAttention row b = slot b
        self.kv_dtype = np.dtype(np.float16 if half_kv else np.float32)
        self.rings = RingLayout.of(config, self.start, self.end, rings=library is not None)
        accuracy_level = ACCURACY_LEVEL[precision]
        graph = build_shard_graph(config, weights, accuracy_level, batch_head_rows=MIN_BATCH, kernel=bool(library),
                                  xbits=self.xbits, half_kv=half_kv)
        self._kv_inputs, self._kv_outputs, self._output = graph.kv_inputs, graph.kv_outputs, graph.output
        if tied_head:
            e = weights.embed
            self._embed = TileRows(graph.initializers[graph.head_tiles], e.source_type, e.bits, self.xbits, e.shape[1])
        model_bytes = graph.model.SerializeToString()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # Memory patterns plan a shape's allocations on its second run, as one block beside what the
        # first run left in the arena: a 512-row chunk of a 2048-wide shard grew it by 81 MB, then
        # 64 MB more (benchmarks/step_memory.py), at no measured gain in speed.
        options.enable_mem_pattern = False
        for key, value in (session_config or {}).items():
            options.add_session_config_entry(key, value)
        if library is not None:
            options.register_custom_ops_library(library.path)
        # Weights reach the session as OrtValues over our NumPy arrays: QLinear's tiles to be read
        # where they are (kept for the session's life), the rest copied by ONNX Runtime (see
        # ShardGraph.in_place and _release_weight_copies).
        self._in_place = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in graph.initializers.items()
                          if n in graph.in_place}
        for name, value in self._in_place.items():
            options.add_initializer(name, value)
        self._weight_arrays = {n: a for n, a in graph.initializers.items() if n not in graph.in_place}
        self._weight_values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._weight_arrays.items()}
        options.add_external_initializers(list(self._weight_values), list(self._weight_values.values()))
        del graph
        try:
            self._session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BackendError(
                f"ONNX Runtime cannot build layers [{self.start}, {self.end}) ({exc}); "
                "check that onnxruntime >= 1.20 is installed"
            ) from exc
        self._kv_pool: _Pool | None = None
        self._step_inputs: weakref.WeakKeyDictionary[ort.IOBinding, _StepInputs] = weakref.WeakKeyDictionary()
        self._caches: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        if not weights.disposable:
            self._release_weight_copies(
                lambda: build_shard_graph(
                    config, weights, accuracy_level, batch_head_rows=MIN_BATCH, kernel=bool(library), xbits=self.xbits,
                    half_kv=half_kv,
                ).initializers
            )
        elif session_keeps_own_weights(threads, precision, session_config or {}):
            # The layers we were given are gone (nothing to make the values again from), so the
            # check ran on a small shard of the same graph instead, once for this process.
            self._weight_arrays = {}
            self._weight_values = {}

    @property
    def weight_arrays_nbytes(self) -> int:
        """Bytes of weight arrays this shard holds besides ONNX Runtime's own buffers (and besides
        the ``QLinear`` tiles it reads in place: those are its only copy)."""
        return sum(a.nbytes for a in self._weight_arrays.values())

    def _release_weight_copies(self, rebuild: Callable[[], dict[str, np.ndarray]]) -> None:
        """Free our weight arrays when the session no longer reads them.

        ONNX Runtime (1.2x, CPU) copies external initializers into its own buffers and repacks
        the matrices, so after loading our arrays are dead weight, as large as the model. That is
        checked, not assumed: all arrays are zeroed and probe steps (prompt and decode) must give
        exactly the outputs they gave before; only then are the arrays released, else their values
        are made again (``rebuild``) and written back. No copy is kept meanwhile: at load, memory
        peaks here, and a copy would add the shard's whole size to that peak.
        """
        before = self._probe()
        for a in self._weight_arrays.values():
            a[...] = 0
        after = self._probe()
        if np.array_equal(before, after):
            self._weight_arrays = {}
            self._weight_values = {}
        else:
            for n, fresh in rebuild().items():
                if n in self._weight_arrays:  # (not QLinear's tiles: never zeroed)
                    self._weight_arrays[n][...] = fresh

    def _probe(self) -> np.ndarray:
        """Outputs of a fixed random prompt and one decode step (no cache kept): the prompt's
        ``MIN_BATCH`` rows take the graph's batched paths, the step its single-row ones."""
        rid = PROBE_ID
        n = MIN_BATCH
        hidden = np.random.default_rng(0).standard_normal((n + 1, self.config.hidden_size)).astype(np.float32)
        with self._lock:
            try:
                prompt = self._run(rid, hidden[:n], 0, all_logits=True)
                step = self._run(rid, hidden[n:], n, all_logits=True)
                return np.concatenate([prompt, step])
            finally:
                self._release(rid)

    # ------------------------------------------------------------------ caches

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def _capacity_for(self, needed: int) -> int:
        """The pool for a cache of ``needed`` positions: one spare position (see the module's
        docstring), rounded up to ``CAPACITY_STEP``, never past the model's context."""
        cap = -(-(needed + 1) // CAPACITY_STEP) * CAPACITY_STEP
        return max(1, min(cap, self.config.context_length))

    def _pool(self, capacity: int) -> _Pool:
        """The pool, with at least ``capacity`` positions a slot: made, or grown (to at least
        twice its capacity) with every request in its slot."""
        pool = self._kv_pool
        if pool is None:
            keys, values, ring_keys, ring_values = self._kv_arrays(FIRST_SLOTS, capacity)
            pool = self._kv_pool = _Pool(capacity, keys, values, [None] * FIRST_SLOTS,
                                         ring_keys=ring_keys, ring_values=ring_values)
        elif pool.capacity < capacity:
            self._remake(pool, pool.slots, max(capacity, self._capacity_for(2 * pool.capacity)))
        return pool

    def _kv_arrays(self, slots: int, capacity: int) -> tuple[np.ndarray, ...]:
        """Keys and values of the full-length layers, then the windowed layers' rings."""
        c = self.config
        shape = (self.rings.n_full, slots, c.n_kv_heads, capacity, c.head_dim)
        ring = (self.rings.n_ring, slots, c.n_kv_heads, self.rings.size, c.head_dim)
        return (_zeroed(shape, self.kv_dtype), _zeroed(shape, self.kv_dtype),
                _zeroed(ring, self.kv_dtype), _zeroed(ring, self.kv_dtype))

    def _remake(self, pool: _Pool, slots: int, capacity: int) -> None:
        """New arrays for ``pool``, of ``slots`` slots of ``capacity`` positions; each request's
        positions in use are copied (the rest of the new pages stay untouched)."""
        keys, values, ring_keys, ring_values = self._kv_arrays(slots, capacity)
        entries = list(self._caches.values())  # every cache is in the one pool
        for new, old, ring in ((keys, pool.keys, False), (values, pool.values, False),
                               (ring_keys, pool.ring_keys, True), (ring_values, pool.ring_values, True)):
            for layer in range(old.shape[0]):
                for e in entries:
                    n = min(e.length, self.rings.size) if ring else e.length
                    new[layer, e.slot, :, :n] = old[layer, e.slot, :, :n]
                _release_layer(old, layer)  # so a growth holds one layer's caches twice, not every layer's
        pool.keys, pool.values, pool.capacity = keys, values, capacity
        pool.ring_keys, pool.ring_values = ring_keys, ring_values
        pool.owners += [None] * (slots - pool.slots)
        pool.bindings.clear()  # they point at the old arrays

    def _take_slot(self, pool: _Pool, request_id: str) -> int:
        """The lowest free slot of ``pool`` (so live requests stay packed), doubling it when full."""
        for slot, owner in enumerate(pool.owners):
            if owner is None:
                pool.owners[slot] = request_id
                return slot
        slot = pool.slots
        self._remake(pool, 2 * slot, pool.capacity)
        pool.owners[slot] = request_id
        return slot

    def _release(self, request_id: str) -> None:
        entry = self._caches.pop(request_id, None)
        if entry is None:
            return
        pool = entry.pool
        pool.owners[entry.slot] = None
        if not any(pool.owners):
            self._kv_pool = None  # its memory goes back; the next request makes a new one

    def _cache_with_room(self, request_id: str, needed: int) -> _Entry:
        """The request's entry, in a pool with room for ``needed`` positions."""
        pool = self._pool(self._capacity_for(needed))
        entry = self._caches.get(request_id)
        if entry is None:
            entry = self._caches[request_id] = _Entry(pool, self._take_slot(pool, request_id), 0)
        return entry

    def _binding(self, pool: _Pool, a: int, b: int) -> ort.IOBinding:
        """An IOBinding with slots ``[a, b)`` of ``pool`` as every layer's past and present K/V."""
        cached = pool.bindings.get((a, b))
        if cached is not None:
            return cached[0]
        binding = self._session.io_binding()
        ortvalues = []
        for i, ((pk, pv), (ok, ov)) in enumerate(zip(self._kv_inputs, self._kv_outputs, strict=True)):
            layer_keys, layer_values = pool.layer(self.rings, i)
            k_val = ort.OrtValue.ortvalue_from_numpy(layer_keys[a:b])
            v_val = ort.OrtValue.ortvalue_from_numpy(layer_values[a:b])
            binding.bind_ortvalue_input(pk, k_val)
            binding.bind_ortvalue_output(ok, k_val)
            binding.bind_ortvalue_input(pv, v_val)
            binding.bind_ortvalue_output(ov, v_val)
            ortvalues += [k_val, v_val]
        pool.bindings[(a, b)] = (binding, ortvalues)
        return binding

    # ------------------------------------------------------------------ Shard

    def _hidden(self, x: np.ndarray) -> np.ndarray:
        """Float32 rows ``(T, hidden)`` for this shard's input: embedded ids on the first shard."""
        if self.is_first:
            if self._embed is None:
                raise BackendError("the first shard was loaded without the token embedding")
            rows = embedding_rows(self._embed, x.astype(np.int64))
            if self.config.embed_scale != 1.0:
                rows *= np.float32(self.config.embed_scale)
            return rows
        return np.ascontiguousarray(x, dtype=np.float32)

    def _check_open(self) -> None:
        if self._session is None:
            raise BackendError(f"shard [{self.start}, {self.end}) is closed: load it again")

    def _validate(self, request_id: str, x: np.ndarray, positions: np.ndarray) -> int:
        """Checks one step's input against the request's cache; returns the cached length."""
        cached = self.kv_length(request_id)
        validate_forward_input(self, x, positions, cached)
        t = positions.shape[0]
        if t > 1 and not np.array_equal(positions, np.arange(cached, cached + t)):
            raise BackendError(f"positions must be consecutive from {cached}, got {positions[:8].tolist()}...")
        return cached

    def forward(
        self, request_id: str, x: np.ndarray, positions: np.ndarray, *, all_logits: bool = False
    ) -> np.ndarray:
        x, positions = np.asarray(x), np.asarray(positions)
        with self._lock:
            self._check_open()
            cached = self._validate(request_id, x, positions)
            hidden = self._hidden(x)
            t, rows = positions.shape[0], self.prefill_chunk  # read once: a node may set it as a step runs
            if t <= rows:
                return self._run(request_id, hidden, cached, all_logits)
            outs = []
            try:
                for a in range(0, t, rows):
                    chunk = hidden[a : a + rows]
                    out = self._run(request_id, chunk, cached + a, all_logits)
                    if all_logits or not self.is_last or a + len(chunk) == t:
                        outs.append(out)
            except BackendError:  # all or nothing: forget the chunks that did run
                if cached == 0 or self.rings.n_ring:  # (a ring's rows are overwritten by them: it goes)
                    self._release(request_id)
                elif request_id in self._caches:
                    self._caches[request_id].length = cached
                raise
            return np.concatenate(outs)

    def forward_batch(self, items: list[tuple[str, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """``forward`` for several requests: their single-token steps run as batched runs (rows of
        one ``session.run`` per range of neighbouring slots), longer ones alone. All items are
        checked before any cache changes."""
        with self._lock:
            self._check_open()
            seen: set[str] = set()
            prepared = []
            for rid, x, positions in items:
                if rid in seen:
                    raise BackendError(f"request {rid} appears twice in one batch")
                seen.add(rid)
                x, positions = np.asarray(x), np.asarray(positions)
                prepared.append((rid, x, positions, self._validate(rid, x, positions)))
            results: list[np.ndarray | None] = [None] * len(items)
            steps: list[_Step] = []
            for i, (rid, x, positions, cached) in enumerate(prepared):
                if positions.shape[0] != 1:
                    results[i] = self.forward(rid, x, positions)
                    continue
                new = rid not in self._caches
                try:
                    entry = self._cache_with_room(rid, cached + 1)
                except Exception:
                    if new:
                        self._release(rid)
                    raise
                steps.append(_Step(i, rid, entry, self._hidden(x)))
            steps.sort(key=lambda step: step.entry.slot)  # all in the one pool
            runs = [steps] if self._slot_map else self._runs(steps)
            for run in filter(None, runs):
                for i, out in self._run_rows(run) if len(run) >= MIN_BATCH else self._run_each(run):
                    results[i] = out
            return results  # type: ignore[return-value]

    def _runs(self, group: list[_Step]) -> list[list[_Step]]:
        """Splits one pool's steps (sorted by slot) into ranges worth running as one batch: a gap
        of more than ``MAX_PADDING`` slots, or a slot in between whose cache is full (it has no
        spare position to pad with), starts a new run."""
        pool = group[0].entry.pool
        runs = [[group[0]]]
        for step in group[1:]:
            between = range(runs[-1][-1].entry.slot + 1, step.entry.slot)
            full = any(
                (owner := pool.owners[s]) is not None and self._caches[owner].length >= pool.capacity
                for s in between
            )
            if len(between) > MAX_PADDING or full:
                runs.append([step])
            else:
                runs[-1].append(step)
        return runs

    def _run_each(self, run: list[_Step]) -> list[tuple[int, np.ndarray]]:
        return [(step.index, self._run(step.rid, step.hidden, step.entry.length, False)) for step in run]

    def _run_rows(self, run: list[_Step]) -> list[tuple[int, np.ndarray]]:
        """One ``session.run`` of single-token steps of one pool: any of its requests on
        ``Attention``; on ``GroupQueryAttention`` neighbouring slots, where slots of the range not
        in ``run`` are padding rows (their one junk position is overwritten later)."""
        c = self.config
        pool = run[0].entry.pool
        if self._slot_map:
            slots = np.array([step.entry.slot for step in run], np.int32)
        else:
            slots = np.arange(run[0].entry.slot, run[-1].entry.slot + 1, dtype=np.int32)
        row = {int(s): i for i, s in enumerate(slots)}
        seqlens = np.array([self._caches[o].length if (o := pool.owners[s]) is not None else 0 for s in slots], np.int32)
        hidden = np.zeros((len(slots), 1, c.hidden_size), np.float32)
        for step in run:
            hidden[row[step.entry.slot], 0] = step.hidden[0]
        try:
            out = self._session_run(pool, slots, hidden, seqlens, rows=1)
        except Exception as exc:
            for step in run:
                if step.entry.length == 0:
                    self._release(step.rid)
            raise BackendError(
                f"ONNX Runtime failed on layers [{self.start}, {self.end}) for a batch of {len(run)} requests ({exc})"
            ) from exc
        for step in run:
            step.entry.length += 1
        return [(step.index, out[row[step.entry.slot]]) for step in run]

    def _session_run(
        self, pool: _Pool, slots: np.ndarray, hidden: np.ndarray, seqlens: np.ndarray, rows: int
    ) -> np.ndarray:
        """Runs ``hidden`` ``(B, T, hidden)``, row i in slot ``slots[i]`` of the pool, whose cache
        holds ``seqlens[i]`` positions: on ``Attention`` the pool is bound whole and ``slots`` given
        to it; on ``GroupQueryAttention`` the slots must be neighbours and their range is bound.
        Returns ``(B, T, hidden)``, or on the last shard the logits of each row's last ``rows``
        tokens ``(B, rows, vocab)``."""
        c = self.config
        n, t = hidden.shape[0], hidden.shape[1]
        if self._slot_map:
            io = self._binding(pool, 0, pool.slots)
        else:
            io = self._binding(pool, int(slots[0]), int(slots[-1]) + 1)
        if t == 1:
            return self._decode_run(io, slots, hidden, seqlens, rows)
        self._step_inputs.pop(io, None)  # rebound below: the next decode step binds its inputs again
        if self._slot_map:
            io.bind_cpu_input("slots", slots)
        io.bind_cpu_input("hidden_in", hidden)
        io.bind_cpu_input("seqlens_k", (seqlens + (t - 1)).astype(np.int32))
        io.bind_cpu_input("total_seq_len", np.array(int(seqlens.max()) + t, dtype=np.int32))
        if self.is_last:
            io.bind_cpu_input("logits_start", np.array([t - rows], dtype=np.int64))
            out = np.empty((n, rows, c.vocab_size), dtype=np.float32)
        else:
            out = np.empty((n, t, c.hidden_size), dtype=np.float32)
        io.bind_output(self._output, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self._run_bound(io)
        return out

    def _decode_run(
        self, io: ort.IOBinding, slots: np.ndarray, hidden: np.ndarray, seqlens: np.ndarray, rows: int
    ) -> np.ndarray:
        """:meth:`_session_run` of one token a row, into the inputs bound to ``io`` for this shape
        (:class:`_StepInputs`, bound at its first such step); returns a copy of the output."""
        n = hidden.shape[0]
        step = self._step_inputs.get(io)
        if step is None or step.shape != (n, rows):
            width = self.config.vocab_size if self.is_last else self.config.hidden_size
            step = _StepInputs(
                (n, rows), np.zeros(n, np.int32), np.zeros((n, 1, self.config.hidden_size), np.float32),
                np.zeros(n, np.int32), np.zeros((), np.int32), np.empty((n, rows, width), np.float32),
            )
            if self._slot_map:
                io.bind_cpu_input("slots", step.slots)
            io.bind_cpu_input("hidden_in", step.hidden)
            io.bind_cpu_input("seqlens_k", step.seqlens)
            io.bind_cpu_input("total_seq_len", step.total)
            if self.is_last:
                io.bind_cpu_input("logits_start", np.array([1 - rows], dtype=np.int64))
            io.bind_output(self._output, "cpu", 0, np.float32, list(step.out.shape), step.out.ctypes.data)
            self._step_inputs[io] = step
        step.slots[:] = slots
        step.hidden[...] = hidden
        step.seqlens[:] = seqlens
        step.total[...] = int(seqlens.max()) + 1
        self._run_bound(io)
        return step.out.copy()

    def _run_bound(self, io: ort.IOBinding) -> None:
        if self._cores is None:
            self._session.run_with_iobinding(io)
            return
        before = self._cores.enter()
        try:
            self._session.run_with_iobinding(io)
        finally:
            self._cores.leave(before)

    def _run(self, request_id: str, hidden: np.ndarray, cached: int, all_logits: bool) -> np.ndarray:
        """One ``session.run`` of ``hidden`` ``(T, hidden)`` after ``cached`` positions."""
        t = hidden.shape[0]
        new_request = request_id not in self._caches
        entry = self._cache_with_room(request_id, cached + t)
        try:
            out = self._session_run(
                entry.pool, np.array([entry.slot], np.int32), hidden.reshape(1, t, -1),
                np.array([cached], np.int32), rows=t if all_logits else 1,
            )
        except Exception as exc:
            if new_request:
                self._release(request_id)
            raise BackendError(
                f"ONNX Runtime failed on layers [{self.start}, {self.end}) for request {request_id} "
                f"at position {cached} ({exc})"
            ) from exc
        entry.length = cached + t
        return out[0]

    @property
    def ring_layers(self) -> int:
        return self.rings.n_ring

    def kv_length(self, request_id: str) -> int:
        entry = self._caches.get(request_id)
        return entry.length if entry is not None else 0

    def export_kv(self, request_id: str) -> KVCache:
        c = self.config
        with self._lock:
            entry = self._caches.get(request_id)
            if entry is None:
                empty = np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32)
                return KVCache(self.start, self.end, 0, [empty.copy() for _ in range(self.n_layers)],
                               [empty.copy() for _ in range(self.n_layers)])
            n, s, pool = entry.length, entry.slot, entry.pool
            keys, values = [], []
            for i in range(self.n_layers):  # a ring: its last positions, oldest first
                rows = self.rings.rows(n) if self.rings.ring_of[i] >= 0 else slice(0, n)
                layer_keys, layer_values = pool.layer(self.rings, i)
                keys.append(layer_keys[s][:, rows].astype(np.float32))
                values.append(layer_values[s][:, rows].astype(np.float32))
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
        if len(part.keys) != self.n_layers or len(part.values) != self.n_layers:
            raise BackendError(f"cache has {len(part.keys)} key / {len(part.values)} value layers, expected {self.n_layers}")
        kept = [self.rings.check_import(i, n, k, v, c.n_kv_heads, c.head_dim, self.start)
                for i, (k, v) in enumerate(zip(part.keys, part.values, strict=True))]
        with self._lock:
            self._check_open()
            self._release(request_id)
            entry = self._cache_with_room(request_id, n)
            for i, (first, k, v) in enumerate(kept):
                layer_keys, layer_values = entry.pool.layer(self.rings, i)
                rows = self.rings.rows(n) if self.rings.ring_of[i] >= 0 else slice(first, n)
                layer_keys[entry.slot][:, rows] = k
                layer_values[entry.slot][:, rows] = v
            entry.length, entry.floor = n, max(0, n - self.rings.window)

    def truncate_kv(self, request_id: str, length: int) -> None:
        with self._lock:
            entry = self._caches.get(request_id)
            if entry is not None:
                if length < 0:
                    raise BackendError(f"cannot truncate a KV cache to {length} positions")
                if not self.rings.can_truncate(entry.length, int(length), entry.floor):
                    raise self.rings.truncate_error(request_id, entry.length, int(length), entry.floor)
                entry.floor = self.rings.first_held(entry.length, entry.floor)
                entry.length = min(int(length), entry.length)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._release(request_id)

    def rename_kv(self, old: str, new: str) -> None:
        with self._lock:  # the slot changes owner: nothing is copied
            if new in self._caches:
                raise BackendError(f"request {new} already has a cache here")
            entry = self._caches.pop(old, None)
            if entry is None:
                raise BackendError(f"request {old} has no cache here to hand over")
            entry.pool.owners[entry.slot] = new
            self._caches[new] = entry

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
            self._kv_pool = None
            self._session = None  # type: ignore[assignment]
            self._weight_values.clear()
            self._weight_arrays = {}
            self._in_place = {}
            self._embed = None


def kernel_for(precision: str) -> kernels.Library | None:
    """The QLinear build a shard of this precision runs on, if any: float32 and int16 on any build
    (int16 on float32 products where the build has no integer products: as exact, not as fast),
    int8 on one with integer products (else it stays on MatMulNBits' int8 products)."""
    library = kernels.library()
    if library is None or precision != "int8":
        return library
    return library if library.integer else None


def resolve_precision(precision: str, weights: ShardWeights) -> str:
    """The precision a shard runs at: ``precision``, or for ``auto`` (:data:`~backends.onnx.AUTO`)
    int8 where most of the shard's quantized bytes (the file's, by type: ``stored_types``; else
    those of the weights in memory, without making a lazy layer) are K-quant super-blocks and the
    build has int8 products, int16 otherwise."""
    if precision != AUTO:
        return precision
    if kernel_for("int8") is None:
        return "int16"
    return "int8" if mostly_kquant(weights.stored_types or _quantized_bytes_in_memory(weights)) else "int16"


def _quantized_bytes_in_memory(weights: ShardWeights) -> dict[str, int]:
    made = [] if isinstance(weights.layers, LazyLayers) else [lw for lw in weights.layers if lw is not None]
    matrices = [getattr(lw, f.name) for lw in made for f in fields(lw)] + [weights.embed, weights.output]
    out: dict[str, int] = {}
    for w in (m for v in matrices for m in (v if isinstance(v, list) else [v])):
        if isinstance(w, QuantizedWeight):
            kind = w.source_type or ("Q8_0" if w.bits == 8 else "Q4_0")
            out[kind] = out.get(kind, 0) + w.nbytes
    return out


def caches_half(library: object, xbits: int) -> bool:
    """Whether a shard keeps float16 KV caches: with the kernels' integer products it does (they
    read them as float16); float32 math (products) keeps float32 caches."""
    return library is not None and xbits != 0


def integer_codes(precision: str, library: kernels.Library | None) -> int:
    """The bits of the integer codes QLinear rounds a shard's activations to (0: float32 products)."""
    return PRECISIONS[precision] if library is not None and library.integer else 0


@functools.cache
def _session_keeps_own_weights(
    threads: int, precision: str, session_config: tuple[tuple[str, str], ...], kernel: str
) -> bool:
    rng = np.random.default_rng(0)
    c = ModelConfig(n_layers=1, hidden_size=64, intermediate_size=128, n_heads=2, n_kv_heads=1, head_dim=32,
                    vocab_size=64, rms_eps=1e-5, rope_theta=10000.0, context_length=64)

    # 4-bit in GGUF's blocks (QLinear where it runs) and with float32 scales (MatMulNBits with a
    # correction), a dense float32 matrix, an 8-bit tied head (two 4-bit passes and its dense copy
    # for batches), norms and rotary tables: every kind of initializer a graph has.
    h, i, qd, kvd = c.hidden_size, c.intermediate_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    dense_v = rng.standard_normal((kvd, h)).astype(np.float32)
    quantized = functools.partial(QuantizedWeight.random, rng)
    layer = LayerWeights(np.ones(h, np.float32), quantized(qd, h), quantized(kvd, h, half=False), dense_v,
                         quantized(h, qd), np.ones(h, np.float32), quantized(i, h), quantized(i, h), quantized(h, i))
    embed = quantized(c.vocab_size, h, bits=8)
    weights = ShardWeights(0, 1, [layer], embed=embed, norm=np.ones(h, np.float32), output=embed)
    shard = ONNXShard(c, weights, threads=threads, precision=precision, session_config=dict(session_config))
    try:
        return shard.weight_arrays_nbytes == 0
    finally:
        shard.close()


def session_keeps_own_weights(threads: int, precision: str, session_config: dict[str, str]) -> bool:
    """Whether ONNX Runtime, with these settings, keeps its own copies of a shard's weights (so
    ours can go once the session is made): checked as ``_release_weight_copies`` does, on a
    one-layer shard with every kind of weight the graph has, once per process and settings."""
    library = kernel_for(precision)
    return _session_keeps_own_weights(
        threads, precision, tuple(sorted(session_config.items())), library.path if library else ""
    )
