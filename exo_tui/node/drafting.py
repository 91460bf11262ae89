"""A node's draft model (``draft_step``, :mod:`exo_tui.inference.draft_model`): loaded whole on the
first ask that names its path, or streamed here by the coordinator beforehand as a load tagged
``draft:NAME`` (:data:`~exo_tui.net.protocol.DRAFT_TAG`: a node that cannot read the file), and
run on a thread of its own beside the worker that runs the ring's steps, so a stream's drafts for
its next step are made while other streams' steps run here.

Its streams' caches count against the node's KV budget (:data:`~exo_tui.node.kv_budget.DRAFT_KEY`):
a step that would take the caches past it first drops other streams' draft caches, the least
recently asked first (they are run again when asked), and where that is not enough it drafts
nothing and says why (``Drafted.refused``: the stream's step runs without the draft model's drafts).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from backends import get_backend
from exo_tui.inference.draft_model import DraftModel, DraftStateLost
from exo_tui.inference.sampling import SamplingParams
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.net.messages import Drafted, DraftQ, DraftStep
from exo_tui.net.protocol import DRAFT_TAG, HostError
from exo_tui.node.host import Transfer
from exo_tui.node.kv_budget import DRAFT_KEY, KVBudget, shard_cost

log = logging.getLogger("exo_tui.node")


class NodeDrafts:
    """The draft model this node runs (one at a time: a new path replaces it)."""

    def __init__(self, default_backend: str, kv: KVBudget | None = None) -> None:
        self.default_backend = default_backend
        self.kv = kv  # the node's KV budget, its streams' caches counted in it (None: not counted)
        self.model: DraftModel | None = None
        self.path = ""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-draft")
        self._lock = asyncio.Lock()

    async def step(self, msg: DraftStep, tokens: np.ndarray) -> Drafted:
        async with self._lock:  # one ask at a time: the model and its caches are the thread's
            loop = asyncio.get_running_loop()
            if self.model is None or self.path != msg.path:
                if msg.path.startswith(DRAFT_TAG):
                    raise HostError(f"the draft model {msg.path.removeprefix(DRAFT_TAG)} is not on this node (it is "
                                    "streamed here before its first draft step): stream it again")
                await loop.run_in_executor(self._thread, self._load, msg.path, msg.backend or self.default_backend)
            model = self.model
            assert model is not None
            sampling = None if msg.sampling is None else SamplingParams.from_dict(msg.sampling)
            ids = np.asarray(tokens).reshape(-1).tolist()
            why = await self._room(model, msg.rid, msg.pos + len(ids) + msg.k - 1)  # what propose leaves held
            if why:
                return Drafted([], nbytes=model.nbytes, refused=why)
            try:
                draft = await loop.run_in_executor(self._thread, model.propose, msg.rid, msg.pos, ids, msg.k, sampling)
            except DraftStateLost:
                return Drafted([], lost=True, nbytes=model.nbytes)
            finally:
                self._count(model)
            q = None if draft.q is None else DraftQ(*draft.q.to_wire())
            return Drafted(list(draft.tokens), nbytes=model.nbytes, q=q)

    async def _room(self, model: DraftModel, rid: str, length: int) -> str:
        """Room in the KV budget for ``rid``'s draft cache to hold ``length`` positions, made by
        dropping other streams' draft caches (least recently asked first); else why there is none."""
        kv = self.kv
        if kv is None:
            return ""
        while True:
            refused = kv.check({(rid, DRAFT_KEY): length})
            if rid not in refused:
                return ""
            others = [r for r in model.by_age() if r != rid]
            if not others:
                return (f"no room for the draft model's cache of request {rid} ({length} positions): "
                        f"{refused[rid]}; its steps run without the draft model's drafts meanwhile")
            await asyncio.get_running_loop().run_in_executor(self._thread, model.drop, others[0])
            self._count(model)

    def _count(self, model: DraftModel) -> None:
        """The budget's counts of the draft caches, as the model holds them now."""
        if self.kv is None:
            return
        held = model.held()
        for rid in self.kv.draft_held().keys() - held.keys():
            self.kv.record(rid, DRAFT_KEY, 0)
        for rid, n in held.items():
            self.kv.record(rid, DRAFT_KEY, n)

    def _counted(self, model: DraftModel | None) -> None:
        """The budget counts ``model``'s caches (None: no draft model here)."""
        if self.kv is None:
            return
        if model is None:
            self.kv.set_draft(None)
            return
        c = model.config
        self.kv.set_draft(shard_cost(c.n_kv_heads, c.head_dim, 0, c.n_layers, get_backend(model.backend).kv_value_bytes(),
                                     model.shard.ring_layers, c.ring_rows))
        self._count(model)

    def _load(self, path: str, backend: str) -> None:
        self._close_model()
        log.info("loading the draft model %s on %s", path, backend)
        self.model = DraftModel.open(GGUFModel(path), backend)
        self.path = path
        self._counted(self.model)

    async def install(self, transfer: Transfer) -> DraftModel:
        """The draft model from a streamed transfer tagged ``draft:NAME`` (it replaces the one here)."""
        async with self._lock:
            def build() -> DraftModel:
                self._close_model()
                log.info("loading the streamed draft model %s on %s", transfer.model, transfer.backend)
                try:
                    self.model = DraftModel(transfer.config, transfer.shard_weights(), transfer.backend)
                finally:
                    transfer.buffer = bytearray()  # the backend has its own form of the bytes
                self.path = transfer.model
                self._counted(self.model)
                return self.model

            return await asyncio.get_running_loop().run_in_executor(self._thread, build)

    def _close_model(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model, self.path = None, ""
            self._counted(None)

    async def drop(self, rid: str) -> None:
        if self.model is not None:
            async with self._lock:
                model = self.model
                if model is not None:
                    await asyncio.get_running_loop().run_in_executor(self._thread, model.drop, rid)
                    self._count(model)

    def metrics(self) -> dict[str, Any]:
        """What a heartbeat says of the draft model here (empty: none loaded)."""
        m = self.model
        if m is None:
            return {}
        return {"path": self.path, "nbytes": m.nbytes, "streams": m.streams(), "steps": m.steps}

    def close(self) -> None:
        if self.model is not None:
            self._thread.submit(self._close_model).result()
        self._thread.shutdown(wait=True)
