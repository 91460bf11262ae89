"""The shards a node holds, the plans it knows, and weights arriving over the wire.

Everything here is synchronous and transport-free; :mod:`exo_tui.node.agent` drives it from the
network. Backend calls happen on one worker thread, so a shard's per-request caches are never
touched by two steps at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends import get_backend
from backends.base import KVCache, ModelConfig, Shard
from backends.weights import ShardWeights
from exo_tui.models.gguf_file import (
    GGUFModel,
    ModelFileError,
    TensorInfo,
    bytes_by_type,
    held_nbytes,
    lazy_shard,
    shard_load_peak,
    tensor_from_raw,
)
from exo_tui.net.messages import HeldShard
from exo_tui.net.protocol import DRAFT_TAG, ChunkChecksumError, HostError, NoRoom, PlanEntry, RingPlan


@dataclass
class Transfer:
    """Weights of one shard arriving in checksummed chunks."""

    transfer_id: str
    config: ModelConfig
    start: int
    end: int
    backend: str
    tensors: list[TensorInfo]
    total_bytes: int
    model: str = ""
    held_bytes: int = 0  # what the backend will hold of them
    buffer: bytearray = field(default_factory=bytearray)
    received: int = 0

    def add_chunk(self, offset: int, data: bytes, sha256: str) -> None:
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ChunkChecksumError(
                f"transfer {self.transfer_id}: chunk at byte {offset} failed its checksum "
                "(corrupted in transit): send it again"
            )
        if offset != self.received:
            raise HostError(f"transfer {self.transfer_id}: chunk at byte {offset}, expected {self.received}")
        if offset + len(data) > self.total_bytes:
            raise HostError(f"transfer {self.transfer_id}: chunk ends past the announced {self.total_bytes} bytes")
        if not self.buffer:
            self.buffer = bytearray(self.total_bytes)
        self.buffer[offset : offset + len(data)] = data
        self.received += len(data)

    def shard_weights(self) -> ShardWeights:
        """The shard, each tensor decoded from the received bytes when the backend reads its layer
        (one decoded layer at a time beside the bytes, not all of them)."""
        if self.received != self.total_bytes:
            raise HostError(f"transfer {self.transfer_id}: got {self.received} of {self.total_bytes} bytes")
        raw = np.frombuffer(self.buffer, dtype=np.uint8)
        spans: dict[str, tuple[TensorInfo, int]] = {}
        offset = 0
        for info in self.tensors:
            spans[info.name] = (info, offset)
            offset += info.nbytes

        def get(name: str) -> Any:
            if name not in spans:
                raise ModelFileError(f"shard [{self.start}, {self.end}) is missing tensor {name}")
            info, at = spans[name]
            return tensor_from_raw(info, raw[at : at + info.nbytes])

        weights = lazy_shard(self.config, self.start, self.end, get, tied="output.weight" not in spans)
        weights.stored_nbytes = self.total_bytes
        weights.stored_types = bytes_by_type(self.tensors)
        # the coordinator's tag names the file these bytes are of (a hash of its path, size and mtime); a
        # draft model's (draft:NAME) names only the model, so its layers are not shared
        weights.source = "" if self.model.startswith(DRAFT_TAG) else self.model
        return weights


@dataclass
class HostedShard:
    shard: Shard
    backend: str
    start: int
    end: int
    nbytes: int  # its tensors' bytes in the file
    model: str = ""  # the tag its load came with: the plans that run it name it
    held_bytes: int = 0  # what its backend holds of them (gguf_file.held_nbytes)
    precision: str = ""  # the math its backend runs it at, where it has a choice (ONNX: int8, int16, float32)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model, self.start, self.end)


class ShardHost:
    """A node's shards (by model tag and layer range), plans (by version) and transfers.

    A load tagged with a model keeps the other models' shards: the coordinator loads the next
    model while the current one serves, then unloads the old one. An untagged load of another
    model's layers replaces every shard (one model at a time)."""

    def __init__(self, node_id: str, default_backend: str, room: Callable[[], int | None] = lambda: None) -> None:
        self.node_id = node_id
        self.room = room  # bytes a load may still take (its --memory-limit less what the process holds); None: no limit
        self.default_backend = default_backend
        self.shards: dict[tuple[str, int, int], HostedShard] = {}
        self.plans: dict[int, RingPlan] = {}
        self.transfers: dict[str, Transfer] = {}
        self.config: ModelConfig | None = None
        self.lock = threading.Lock()
        self._files: dict[str, tuple[int, GGUFModel]] = {}

    # ------------------------------------------------------------------ loading

    def load_from_file(self, path: str, start: int, end: int, backend: str | None, model: str = "",
                       context: int = 0) -> HostedShard:
        """Layers ``[start, end)`` of the file at ``path``, served at ``context`` tokens where less
        than the model's own (:meth:`~backends.base.ModelConfig.at_context`)."""
        gguf = self._open(path)
        name = backend or self.default_backend
        held = gguf.held_nbytes(start, end, name)
        self._check_room(held, gguf.load_peak_nbytes(start, end, name), start, end)
        try:
            return self._install(gguf.config.at_context(context), lambda: self._weights_of(path, gguf, start, end),
                                 backend, model, held)
        finally:
            gguf.release_pages()  # the shard has its own copy: the file's pages need not stay resident

    def _weights_of(self, path: str, gguf: GGUFModel, start: int, end: int) -> ShardWeights:
        """The file's layers ``[start, end)``, their source named by the file as opened (its path,
        size and modification time): a backend shares what it made of a layer between shards."""
        weights = gguf.shard_weights(start, end)
        stamp, _ = self._files.get(path, (0, None))
        weights.source = f"{path}:{os.path.getsize(path)}:{stamp}"
        return weights

    def _check_room(self, nbytes: int, peak: int, start: int, end: int) -> None:
        """Refuse a load of ``nbytes`` that would take the process past its memory limit at its
        peak (``peak`` beside them: :func:`backends.memory.load_peak_bytes`): it is enforced here,
        not only planned around. A shard holds its backend's form of its tensors once loaded
        (:func:`~exo_tui.models.gguf_file.held_nbytes`)."""
        room = self.room()
        need = nbytes + peak
        if room is not None and need > room:
            raise NoRoom(
                f"loading layers [{start}, {end}) needs {need / 1e6:.0f} MB and this node has {max(0, room) / 1e6:.0f} MB "
                f"left under its --memory-limit ({len(self.shards)} shards held): unload a shard first, or give it more memory",
                detail={"need_bytes": int(need), "room_bytes": int(room)},
            )

    def _open(self, path: str) -> GGUFModel:
        """The model file, opened once (parsing a GGUF's vocabulary takes seconds) while it is
        unchanged on disk."""
        try:
            stamp = os.stat(path).st_mtime_ns
            cached = self._files.get(path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            model = GGUFModel(path)
        except (ModelFileError, OSError) as exc:
            raise HostError(str(exc)) from exc
        self._files = {path: (stamp, model)}  # keep one: the newest model loaded
        return model

    def begin_transfer(self, transfer_id: str, config: ModelConfig, start: int, end: int, backend: str | None,
                       tensors: list[TensorInfo], model: str = "") -> Transfer:
        total = sum(t.nbytes for t in tensors)
        if not tensors or any(t.nbytes <= 0 for t in tensors) or not 0 <= start < end <= config.n_layers:
            raise HostError(f"transfer {transfer_id}: an empty or malformed tensor list for layers [{start}, {end})")
        import psutil

        free = psutil.virtual_memory().available
        if total > free:
            raise HostError(
                f"transfer {transfer_id}: {total / 1e9:.2f} GB of weights do not fit in the {free / 1e9:.2f} GB free here: "
                "give this node fewer layers or free memory"
            )
        name = backend or self.default_backend
        held = held_nbytes(name, tensors, first=start == 0, last=end == config.n_layers)
        # the bytes received stay until the shard is built from them
        peak = shard_load_peak(name, tensors, first=start == 0, last=end == config.n_layers)
        self._check_room(total + held, peak, start, end)
        transfer = Transfer(transfer_id, config, start, end, name, tensors, total, model, held)
        self.transfers[transfer_id] = transfer
        return transfer

    def take_transfer(self, transfer_id: str) -> Transfer:
        """A completed transfer's weights, for another holder than the shard table (a draft model)."""
        transfer = self.transfers.pop(transfer_id, None)
        if transfer is None:
            raise HostError(f"no transfer {transfer_id} in progress here: begin it first")
        return transfer

    def commit_transfer(self, transfer_id: str) -> HostedShard:
        transfer = self.transfers.pop(transfer_id, None)
        if transfer is None:
            raise HostError(f"no transfer {transfer_id} in progress here: begin it first")

        try:
            return self._install(transfer.config, transfer.shard_weights, transfer.backend, transfer.model,
                                 transfer.held_bytes)
        finally:
            transfer.buffer = bytearray()  # the shard has its own form of the bytes

    def _install(self, config: ModelConfig, make_weights: Callable[[], ShardWeights], backend: str | None,
                 model: str, held_bytes: int) -> HostedShard:
        """Loads the weights ``make_weights`` makes; this is their only holder, so the backend may
        drop each layer once it has its own form of it (``disposable``) and everything the load
        freed goes back to the system afterwards."""
        name = backend or self.default_backend
        if not model and self.config is not None and self.config != config and self.shards:
            # A different model, untagged: the old shards cannot be part of the same ring.
            self.unload_all()
        weights = make_weights()
        weights.disposable = True
        nbytes = weights.nbytes  # before the load, which drops the layers
        shard = get_backend(name).load_shard(config, weights)
        hosted = HostedShard(shard, name, weights.start, weights.end, nbytes, model, held_bytes,
                             str(getattr(shard, "precision", "")))
        del weights
        with self.lock:
            old = self.shards.pop(hosted.key, None)
            self.shards[hosted.key] = hosted
            self.config = config
        if old is not None:
            old.shard.close()
        return_freed_memory()
        return hosted

    def unload(self, start: int, end: int, model: str | None = None) -> bool:
        """Unload the shard of layers ``[start, end)`` of ``model`` (None: of any model)."""
        with self.lock:
            keys = [k for k in self.shards if k[1:] == (start, end) and (model is None or k[0] == model)]
            gone = [self.shards.pop(k) for k in keys]
        for hosted in gone:
            hosted.shard.close()
        del gone
        if keys:
            return_freed_memory()
        return bool(keys)

    def unload_all(self) -> None:
        for model, start, end in list(self.shards):
            self.unload(start, end, model)

    # ------------------------------------------------------------------ plans

    def add_plan(self, plan: RingPlan, keep: int = 4) -> None:
        self.plans[plan.version] = plan
        for version in sorted(self.plans)[:-keep]:
            del self.plans[version]

    def hop(self, version: int | None, hop: int) -> tuple[RingPlan, PlanEntry, HostedShard]:
        """The plan, this hop's entry and the shard that serves it — or why not."""
        plan = self.plans.get(version) if version is not None else None
        if plan is None:
            raise HostError(f"node {self.node_id} does not hold plan {version} (holds {sorted(self.plans)})")
        if not 0 <= hop < len(plan.ring):
            raise HostError(f"plan {version} has no hop {hop}")
        entry = plan.ring[hop]
        if entry.node_id != self.node_id:
            raise HostError(f"hop {hop} of plan {version} belongs to {entry.node_id}, not {self.node_id}")
        hosted = self.shards.get((plan.model, entry.start, entry.end))
        if hosted is None:
            raise HostError(f"node {self.node_id} has not loaded layers [{entry.start}, {entry.end}) of plan {version}")
        return plan, entry, hosted

    # ------------------------------------------------------------------ KV caches

    def shard_for_layers(self, start: int, end: int, model: str | None = None) -> HostedShard:
        """The shard (of ``model``; None: of any) that covers layers ``[start, end)``."""
        with self.lock:
            hosted_all = list(self.shards.values())
        for hosted in hosted_all:
            if hosted.start <= start and end <= hosted.end and (model is None or hosted.model == model):
                return hosted
        raise HostError(f"node {self.node_id} holds no shard covering layers [{start}, {end})")

    def export_kv(self, request_id: str, start: int, end: int, model: str | None = None,
                  length: int | None = None) -> KVCache:
        """The request's cache of layers ``[start, end)``; with ``length``, cut back to that many
        positions first (what the coordinator knows its tokens fill: a verify step's rejected
        drafts are past it)."""
        shard = self.shard_for_layers(start, end, model).shard
        if length is not None and shard.kv_length(request_id) > length:
            shard.truncate_kv(request_id, length)
        return shard.export_kv(request_id).slice_layers(start, end)

    def drop(self, request_id: str) -> None:
        with self.lock:
            hosted_all = list(self.shards.values())
        for hosted in hosted_all:
            hosted.shard.drop(request_id)

    def describe(self) -> list[HeldShard]:
        """The shards held, from this host's own records: it never calls into a shard, whose
        backend may be busy with a step on the worker thread (heartbeats must not wait)."""
        with self.lock:
            hosted = list(self.shards.values())
        return [HeldShard(h.start, h.end, h.backend, h.nbytes, h.model, h.held_bytes, h.precision or None)
                for h in hosted]


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def return_freed_memory() -> None:
    """Hand memory the process freed back to the system.

    glibc keeps freed heap memory for reuse, and loading a shard frees a lot: the weights as
    received, their unpacked and repacked forms, the backend's own temporaries. Measured on the
    default model (92 MB of weights streamed to a node): resident memory after the load 651 MB,
    368 MB after ``malloc_trim``. A no-op where the C library has none (macOS, musl)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
