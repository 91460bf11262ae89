"""Switching the cluster to another model while the current one serves.

1. The new model's plan is made on the nodes as they are (a model the cluster cannot hold is
   refused, and the current one serves on).
2. Its shards load under the new model's tag (``model_key``: nodes keep two models' shards apart)
   while the current plan goes on answering.
3. At a token boundary the new plan comes into force: no new step starts, the steps running end,
   the coordinator's model, spec and plan are swapped; an answer that was streaming ends with an
   error that says so (its tokens are the old model's).
4. The old model's shards are unloaded.

Where the nodes cannot hold both models (a load fails: too little memory, say), the new model's
loaded shards are dropped and the old way is taken: unload the current model, then load the new
one (nothing answers meanwhile). The same file under another name only renames the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from pathlib import Path

from exo_tui import events as ev
from exo_tui.cluster.model_choices import change_for
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.weights import WeightTransferError
from exo_tui.inference.generate import GenerationError
from exo_tui.models.model import Model
from exo_tui.models.spec import spec_from_gguf
from exo_tui.net.codec import call
from exo_tui.net.errors import RemoteError
from exo_tui.net.messages import Loaded, PlanOp, Plans
from exo_tui.net.protocol import PlanEntry
from exo_tui.scheduler.plan import Plan
from exo_tui.scheduler.spec import ModelSpec

log = logging.getLogger("exo_tui.cluster")

LOAD_ERRORS = (RemoteError, ConnectionError, TimeoutError, WeightTransferError, KeyError)


def model_key(path: str | os.PathLike[str]) -> str:
    """The tag of a model file's shards on the nodes: its real path, size and mtime, hashed."""
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


async def switch(c: CoordinatorParts, model: Model, name: str) -> None:
    """Make ``model`` (opened as ``name``) the one coordinator ``c`` serves."""
    spec = await asyncio.to_thread(lambda: spec_from_gguf(model.gguf, context_limit=c.config.models.context_length))
    key = await asyncio.to_thread(model_key, model.path)
    if c.model is not None and key == c._model_key:  # the same file: only its name changes
        c.model, c.model_name = model, name
        c._touch()
        return
    if c.plan is None or not c.nodes:  # nothing serves: nothing to keep serving
        await c._replace_model(model, name, spec, key)
        return
    serving = c.model.name if c.model is not None else "the current model"
    change = await asyncio.to_thread(change_for, c, spec)
    if change.error or change.new_plan is None:
        raise GenerationError(f"the cluster cannot hold {model.name}: {change.error or 'no plan'}; "
                              f"{serving} serves on")
    plan = change.new_plan
    ring = c._ring_for(plan, key)
    loaded: list[tuple[PlanEntry, Loaded]] = []
    try:
        limit = max(1, c.config.scheduler.load_balancing.max_task_migration)
        for i in range(0, len(ring.ring), limit):
            batch = ring.ring[i : i + limit]
            bodies = await asyncio.gather(*(c._load_shard(e, model, key) for e in batch), return_exceptions=True)
            loaded += [(e, b) for e, b in zip(batch, bodies, strict=True) if not isinstance(b, BaseException)]
            failed = next((b for b in bodies if isinstance(b, BaseException)), None)
            if failed is not None:  # what did load in this batch is in ``loaded``: unloaded below
                raise failed
    except LOAD_ERRORS as exc:
        log.info("the nodes cannot hold %s beside %s (%s): unloading %s first", model.name, serving, exc, serving)
        c._notice("info", f"the nodes cannot hold {model.name} beside {serving} ({exc}): "
                          f"{serving} is unloaded first")
        await _unload(c, [(e.node_id, e.start, e.end) for e, _ in loaded], key)
        await c._replace_model(model, name, spec, key)
        return
    await _swap(c, model, name, spec, key, plan, loaded)


async def _swap(c: CoordinatorParts, model: Model, name: str, spec: ModelSpec, key: str, plan: Plan,
                loaded: list[tuple[PlanEntry, Loaded]]) -> None:
    from exo_tui.cluster.switching import _moves, _shard_record

    async with c._plan_lock:
        c._version = max(c._version, c.plan.version if c.plan else 0) + 1
        plan = plan.with_version(c._version)
        ring = c._ring_for(plan, key)
        try:
            await asyncio.gather(*(call(c.connection(e.node_id), PlanOp(ring), Plans, timeout=30) for e in ring.ring))
        except LOAD_ERRORS as exc:  # a node went away meanwhile: the current model serves on
            await _unload(c, [(e.node_id, e.start, e.end) for e, _ in loaded], key)
            serving = c.model.name if c.model is not None else "the current model"
            raise GenerationError(f"{model.name} could not come into force ({exc}): {serving} serves on; "
                                  "try again") from exc
        c._plan_ready.clear()
        await c._idle.wait()  # a token boundary: no step of the old plan runs now
        old_key = c._model_key
        old = [(h.node_id, start, end) for h in c.nodes.values() for start, end in h.held]
        c.model, c.model_name, c.spec, c._model_key = model, name, spec, key
        c.plan, c.ring = plan, ring
        c.pins.clear()
        c._serve_error = ""
        for h in c.nodes.values():
            h.held, h.shards = set(), []
        for e, body in loaded:
            h = c.nodes[e.node_id]
            h.held.add((e.start, e.end))
            h.shards.append(_shard_record(e, body, key))
        c._plan_ready.set()
        await _unload(c, old, old_key)
        c._refresh_states()
        if c.store is not None:
            c.store.save_plan(plan.version, str(model.path), plan.to_dict())
        moves = _moves(None, plan, spec)
        diff = {"moves": [m.__dict__ for m in moves], "bytes_moved": sum(m.nbytes for m in moves)}
        c.events.publish(ev.PlanChanged(version=plan.version, plan=plan.to_dict(), diff=diff, reason=f"model {model.name}"))
        c._touch()
        log.info("plan %d in force (model %s): %s", plan.version, model.name, plan.layout)


async def _unload(c: CoordinatorParts, shards: list[tuple[str, int, int]], key: str) -> None:
    """Unload those (node, start, end) shards of the model tagged ``key``, where the node is up."""
    async def one(node_id: str, start: int, end: int) -> None:
        h = c.nodes.get(node_id)
        if h is not None and h.live_conn is not None:
            with contextlib.suppress(RemoteError, ConnectionError, TimeoutError):
                await h.unload(start, end, key)

    await asyncio.gather(*(one(*s) for s in shards))
