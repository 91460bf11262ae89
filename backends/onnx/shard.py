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
kept for a next turn) leave holes between the live ones, and those cost nothing; a verify step
(a stream's last token and its drafts) is as many rows sharing its slot (:data:`FOLD_ROWS`), so it
shares the other streams' pass over the weights. On
``GroupQueryAttention`` (row b is slot b) a run covers a contiguous range of slots instead, and a
slot inside it whose request is not in the batch rides along as a padding row: it writes one junk
position just past its cache's end, which its next real step overwrites. So a slot always keeps
one free position (``KVPool.capacity_for``), except at the model's full context, where such a slot
splits the range instead. When a request outgrows the pool's capacity (a multiple of 256
positions, up to the context length), the pool grows to at least twice it, every request's
positions copied into its slot of the new arrays; when its slots are full it doubles them. So all
of a shard's requests are in one pool and any set of them decodes in one run (with one pool per
capacity, requests at 150 and at 300 positions took two runs: 10.8 ms for eight of them against
6.4-8.4 ms in one). Every slot has the longest request's capacity, but the arrays are anonymous
memory maps: a page is resident only once a position in it is written. On the kernel a windowed
layer's caches are rings of its window's positions beside those (``backends/rings.py``), which never grow.

The pool (its slots, growth, export and import) is :class:`backends.onnx.kv_pool.KVPool`, which
this shard binds; what precision and kernel a shard runs at is :mod:`backends.onnx.precision`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from backends.base import FOLD_ROWS, BackendError, KVCache, ModelConfig, Shard, validate_forward_input
from backends.onnx import ACCURACY_LEVEL, DEFAULT_PRECISION
from backends.onnx.affinity import CorePlan
from backends.onnx.graph import build_shard_graph, shared_form
from backends.onnx.kernels import runs_on_kernel
from backends.onnx.kernels.tile_rows import TileRows
from backends.onnx.kv_pool import CacheEntry, KVPool, PoolArrays
from backends.onnx.precision import caches_half, integer_codes, kernel_for, resolve_precision
from backends.onnx.weights import EmbeddingRows, compact_embedding, embedding_rows
from backends.rings import RingLayout
from backends.weights import LayerWeights, QuantizedWeight, ShardWeights, Weight

MAX_PADDING = 2  # GroupQueryAttention: padding rows a batch accepts between two requests before it splits
MIN_BATCH = 2
"""Single-token steps of at least this many requests run as one batch (else one by one): every
weight is read once for all of them. SmolLM2, 2 threads (Zen 5), the QLinear kernel: a decode step
of 1 / 4 / 8 / 16 rows takes 2.8 / 4.1 / 5.9 / 10.8 ms batched at the int16 precision, 3.6 / 4.9 /
9.7 / 17.3 in float32 and 2.9 / 3.9 / 5.8 / 9.3 in int8 (``benchmarks/onnx_kernels.py``, one run). (On MatMulNBits, whose multi-row path dequantizes the whole matrix, 2 / 3 / 4 rows took 28 /
30 / 32 ms against 15 ms for one.)"""
PROBE_ID = "\0probe"  # the request id of the load-time probe steps


@dataclass
class _Step:
    """One request's step inside ``forward_batch``, of one token or (on the kernel) a few run as
    rows of the batch: ``index`` is its place in the batch, ``cached`` its positions before."""

    index: int
    rid: str
    entry: CacheEntry
    hidden: np.ndarray  # (T, hidden)
    cached: int

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]


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
        self._embed: Weight | EmbeddingRows | TileRows | None = (
            shared_form(weights.source, ("embed",), lambda: compact_embedding(weights.embed))
            if self.is_first and not tied_head else None)
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
            if not isinstance(e, QuantizedWeight) or graph.head_tiles is None:
                raise BackendError("a tied head on the kernel needs its quantized embedding and the head's tiles")
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
        self.kv = KVPool(config, self.start, self.end, self.rings, self.kv_dtype)  # the requests' caches
        self._step_inputs: weakref.WeakKeyDictionary[ort.IOBinding, _StepInputs] = weakref.WeakKeyDictionary()
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
                self.kv.release(rid)

    # ------------------------------------------------------------------ caches

    def _binding(self, pool: PoolArrays, a: int, b: int) -> ort.IOBinding:
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
                    self.kv.release(request_id)
                elif request_id in self.kv.caches:
                    self.kv.caches[request_id].length = cached
                raise
            return np.concatenate(outs)

    @property
    def verifies_in_batch(self) -> bool:
        return self._slot_map

    def forward_batch(self, items: list[tuple[str, np.ndarray, np.ndarray]],
                      all_logits: Collection[int] = ()) -> list[np.ndarray]:
        """``forward`` for several requests: their single-token steps run as batched runs (rows of
        one ``session.run`` per range of neighbouring slots); on the kernel a step of up to
        :data:`FOLD_ROWS` tokens joins the batch as that many rows (on the last shard, where it
        asks for ``all_logits``: a verify step), longer ones run alone. All items are checked
        before any cache changes."""
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
            alone = [i for i, (_, _, p, cached) in enumerate(prepared)
                     if p.shape[0] != 1 and not self._joins(cached, p.shape[0], i in all_logits)]
            for i in alone:
                rid, x, positions, _ = prepared[i]
                results[i] = self.forward(rid, x, positions, all_logits=i in all_logits)
            steps: list[_Step] = []
            for i, (rid, x, positions, cached) in enumerate(prepared):
                if results[i] is not None:
                    continue
                new = rid not in self.kv.caches
                try:
                    entry = self.kv.with_room(rid, cached + positions.shape[0])
                except Exception:
                    if new:
                        self.kv.release(rid)
                    raise
                steps.append(_Step(i, rid, entry, self._hidden(x), cached))
            steps.sort(key=lambda step: step.entry.slot)  # all in the one pool
            runs = [steps] if self._slot_map else self._runs(steps)
            for run in filter(None, runs):
                rows = sum(step.rows for step in run)
                for i, out in self._run_rows(run) if rows >= MIN_BATCH else self._run_each(run):
                    results[i] = out
            done = [r for r in results if r is not None]
            if len(done) != len(results):
                raise BackendError("a batch step gave no output for some of its items")
            return done

    def _joins(self, cached: int, t: int, all_logits: bool) -> bool:
        """Whether a step of ``t`` tokens after ``cached`` runs as rows of a batch (else alone): on
        the kernel, up to :data:`FOLD_ROWS` of them (as one-token rows sharing its slot at
        consecutive positions: ``Attention`` writes every row's keys before any row attends, so
        each sees the cache and the rows before it), on the last shard only where every row's
        logits are wanted, and on a ring only where its last key does not overwrite one its first
        query sees (the kernel's rule)."""
        if not self._slot_map or t > FOLD_ROWS or (self.is_last and not all_logits):
            return False
        r = self.rings
        return not r.n_ring or cached + t - 1 - r.size < max(0, cached - r.window + 1)

    def _runs(self, group: list[_Step]) -> list[list[_Step]]:
        """Splits one pool's steps (sorted by slot) into ranges worth running as one batch: a gap
        of more than ``MAX_PADDING`` slots, or a slot in between whose cache is full (it has no
        spare position to pad with), starts a new run."""
        pool = group[0].entry.pool
        runs = [[group[0]]]
        for step in group[1:]:
            between = range(runs[-1][-1].entry.slot + 1, step.entry.slot)
            full = any(
                (owner := pool.owners[s]) is not None and self.kv.caches[owner].length >= pool.capacity
                for s in between
            )
            if len(between) > MAX_PADDING or full:
                runs.append([step])
            else:
                runs[-1].append(step)
        return runs

    def _run_each(self, run: list[_Step]) -> list[tuple[int, np.ndarray]]:
        return [(step.index, self._run(step.rid, step.hidden, step.cached, False)) for step in run]

    def _run_rows(self, run: list[_Step]) -> list[tuple[int, np.ndarray]]:
        """One ``session.run`` of the steps of one pool, a token a row: on ``Attention`` any of its
        requests, a step of several tokens as that many rows of its slot at consecutive positions;
        on ``GroupQueryAttention`` single tokens of neighbouring slots, where slots of the range
        not in ``run`` are padding rows (their one junk position is overwritten later)."""
        pool = run[0].entry.pool
        first: list[int] = []  # each step's first row
        if self._slot_map:
            slots = np.concatenate([np.full(step.rows, step.entry.slot, np.int32) for step in run])
            seqlens = np.concatenate([step.cached + np.arange(step.rows, dtype=np.int32) for step in run])
            hidden = np.concatenate([step.hidden for step in run])[:, None, :]
            first = np.cumsum([0] + [step.rows for step in run[:-1]]).tolist()
        else:
            slots = np.arange(run[0].entry.slot, run[-1].entry.slot + 1, dtype=np.int32)
            row = {int(s): i for i, s in enumerate(slots)}
            seqlens = np.array([self.kv.caches[o].length if (o := pool.owners[s]) is not None else 0 for s in slots],
                               np.int32)
            hidden = np.zeros((len(slots), 1, self.config.hidden_size), np.float32)
            for step in run:
                hidden[row[step.entry.slot], 0] = step.hidden[0]
                first.append(row[step.entry.slot])
        try:
            out = self._session_run(pool, slots, hidden, seqlens, rows=1)
        except Exception as exc:
            for step in run:
                if step.entry.length == 0:
                    self.kv.release(step.rid)
            raise BackendError(
                f"ONNX Runtime failed on layers [{self.start}, {self.end}) for a batch of {len(run)} requests ({exc})"
            ) from exc
        for step in run:
            step.entry.length = step.cached + step.rows
        return [(step.index, out[a : a + step.rows, 0]) for step, a in zip(run, first, strict=True)]

    def _session_run(
        self, pool: PoolArrays, slots: np.ndarray, hidden: np.ndarray, seqlens: np.ndarray, rows: int
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
        new_request = request_id not in self.kv.caches
        entry = self.kv.with_room(request_id, cached + t)
        try:
            out = self._session_run(
                entry.pool, np.array([entry.slot], np.int32), hidden.reshape(1, t, -1),
                np.array([cached], np.int32), rows=t if all_logits else 1,
            )
        except Exception as exc:
            if new_request:
                self.kv.release(request_id)
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
        return self.kv.length(request_id)

    def export_kv(self, request_id: str) -> KVCache:
        with self._lock:
            return self.kv.export(request_id)

    def import_kv(self, request_id: str, cache: KVCache) -> None:
        n, kept = self.kv.checked(cache)
        with self._lock:
            self._check_open()
            self.kv.install(request_id, n, kept)

    def truncate_kv(self, request_id: str, length: int) -> None:
        with self._lock:
            self.kv.truncate(request_id, length)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self.kv.release(request_id)

    def rename_kv(self, old: str, new: str) -> None:
        with self._lock:
            self.kv.rename(old, new)

    def requests(self) -> list[str]:
        # Without the lock: callers such as heartbeats must not wait for a long step to end.
        while True:
            try:
                return [rid for rid in list(self.kv.caches) if rid != PROBE_ID]
            except RuntimeError:  # the dict changed size while being copied; copy again
                continue

    def close(self) -> None:
        with self._lock:
            self.kv.clear()
            self._session = None
            self._weight_values.clear()
            self._weight_arrays = {}
            self._in_place = {}
            self._embed = None


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
