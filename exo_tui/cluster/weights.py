"""Putting a shard's weights on a node: from a path it can read, or streamed in chunks.

Streaming sends the tensors' stored bytes (quantized blocks stay blocks) in chunks of
``CHUNK_BYTES``, each with its SHA-256; the node checks every chunk and refuses a bad one, which
is then sent again (up to ``CHUNK_RETRIES`` times) before the load fails with a clear error.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator

import numpy as np

from exo_tui.models.gguf_file import GGUFModel
from exo_tui.net.codec import call
from exo_tui.net.connection import Connection
from exo_tui.net.errors import RemoteError
from exo_tui.net.messages import (
    ChunkReceived,
    Done,
    Load,
    LoadBegin,
    LoadChunk,
    LoadCommit,
    Loaded,
    TensorSpec,
)
from exo_tui.net.protocol import ChunkChecksumError

CHUNK_BYTES = 4 << 20
CHUNK_RETRIES = 3
LOAD_TIMEOUT_S = 300.0

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


class WeightTransferError(RuntimeError):
    pass


async def load_from_path(conn: Connection, path: str, start: int, end: int, backend: str | None, model: str = "",
                         context: int = 0) -> Loaded:
    """``model``: the tag the node keeps the shard under (a node may hold two models' shards);
    ``context``: the context the model is served at, where less than its own
    (:meth:`~backends.base.ModelConfig.at_context`)."""
    return await call(conn, Load(path, start, end, backend, model, context), Loaded, timeout=LOAD_TIMEOUT_S)


async def stream_shard(
    conn: Connection,
    model: GGUFModel,
    start: int,
    end: int,
    backend: str | None,
    *,
    progress: Progress | None = None,
    corrupt: Callable[[int, bytes], bytes] | None = None,
    tag: str = "",
    context: int = 0,
) -> Loaded:
    """Stream layers ``[start, end)`` of ``model`` to the node on ``conn`` and load them there.

    ``corrupt`` (tests only) may alter a chunk's bytes in transit, given its index. ``tag``: the
    model tag the node keeps the shard under; ``context``: the context the model is served at
    (:meth:`~backends.base.ModelConfig.at_context`).
    """
    names = model.shard_tensor_names(start, end)
    infos = [model.tensor_info(n) for n in names]
    total = sum(i.nbytes for i in infos)
    transfer_id = f"t-{os.urandom(6).hex()}"
    tensors = [TensorSpec(i.name, i.type_name, list(i.shape), i.nbytes) for i in infos]
    begin = LoadBegin(transfer_id, model.config.at_context(context).to_wire(), start, end, tensors, backend, tag)
    await call(conn, begin, Done, timeout=30)
    sent = 0
    index = 0
    for chunk in _chunks(model, names):
        sha = hashlib.sha256(chunk).hexdigest()
        for attempt in range(CHUNK_RETRIES + 1):
            data = corrupt(index, chunk) if corrupt is not None else chunk
            try:
                await call(conn, LoadChunk(transfer_id, sent, sha), ChunkReceived, payload=data, timeout=60)
                break
            except RemoteError as exc:
                if exc.code != ChunkChecksumError.code or attempt == CHUNK_RETRIES:
                    raise WeightTransferError(
                        f"streaming layers [{start}, {end}) failed at byte {sent} of {total}: {exc}"
                        + (f" (after {attempt + 1} tries: check the network path to this node)" if attempt else "")
                    ) from exc
        sent += len(chunk)
        index += 1
        if progress is not None:
            progress(sent, total)
    return await call(conn, LoadCommit(transfer_id), Loaded, timeout=LOAD_TIMEOUT_S)


def _chunks(model: GGUFModel, names: list[str]) -> Iterator[bytes]:
    """The tensors' stored bytes, back to back, cut into chunks of CHUNK_BYTES."""
    pending = bytearray()
    for name in names:
        _, raw = model.raw_tensor(name)
        view = np.ascontiguousarray(raw).data.cast("B")
        offset = 0
        while offset < len(view):
            take = min(CHUNK_BYTES - len(pending), len(view) - offset)
            pending += view[offset : offset + take]
            offset += take
            if len(pending) == CHUNK_BYTES:
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)
