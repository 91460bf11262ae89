"""The cluster's draft model (``--draft MODEL``): where it runs, and the draft source of each stream.

The draft model runs whole on one node (:mod:`exo_tui.node.drafting`). The plan places it and
counts its bytes there (:meth:`ClusterDraft.need`, :mod:`exo_tui.scheduler.draft`: its weights
and one stream's KV cache at the served context, on the node where it costs the ring least), so
no shard is given that memory; the plan's :class:`~exo_tui.scheduler.plan.PlanDraft` names the
node, for the partition view and ``exo-tui status``. A node that reads the coordinator's files
loads it from its path on the first ask; to another its weights are streamed first, as a
shard's are (:meth:`ClusterDraft.source_on`). Once loaded, its bytes are in that node's
measured memory, and its heartbeat lists them (:meth:`ClusterDraft.held_on` counts them back
for the next plan, as a shard's are).

Each stream asks one node (:class:`ModelDrafts`, a :class:`~exo_tui.inference.drafts.DraftSource`
drafted before prompt lookup): the tokens accepted since its last ask, ``k`` and the request's
sampling. When that node fails (gone, refusing, no answer within :data:`DRAFT_TIMEOUT_S`), the
stream drafts from the model no more: its other sources go on, and its steps are plain ones where
it has none. Nothing else changes; a new stream asks the node that the plan in force places the
draft model on then. A node whose KV budget has no room for a stream's draft cache (it counts
every stream's, up to 16, :mod:`exo_tui.node.drafting`) drafts nothing for that step and says why;
the stream asks again at its next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from exo_tui.cluster.weights import WeightTransferError, stream_shard
from exo_tui.inference.draft_model import vocabulary_mismatch
from exo_tui.inference.drafts import DraftSource, PromptLookup
from exo_tui.inference.sampling import SamplingParams
from exo_tui.inference.speculation import Speculation
from exo_tui.inference.speculative import Draft, DraftProbs
from exo_tui.models.model import Model
from exo_tui.models.spec import spec_from_gguf
from exo_tui.net.codec import call
from exo_tui.net.connection import Connection
from exo_tui.net.errors import BadBody, ConnectionClosed, RemoteError
from exo_tui.net.messages import Drafted, DraftStep
from exo_tui.net.protocol import DRAFT_TAG, RingPlan
from exo_tui.scheduler.plan import DraftNeed, Plan, PlanDraft
from exo_tui.scheduler.spec import ModelSpec

log = logging.getLogger("exo_tui.cluster")

DRAFT_TIMEOUT_S = 120.0  # a first ask loads the model on its node
STREAM_KV_POSITIONS = 4096  # positions of a stream's draft cache counted against a node's budget when placing it


class DraftHost(Protocol):
    """What the draft model needs from the coordinator."""

    ring: RingPlan | None
    plan: Plan | None
    model: Model | None
    nodes: dict[str, Any]

    @property
    def context_length(self) -> int:
        ...

    def connection(self, node_id: str) -> Connection:
        ...

    def reads_model_files(self, node_id: str) -> bool:
        ...


class ClusterDraft:
    """The served model's draft model and where it runs."""

    def __init__(self, model: Model, host: DraftHost, target: Model, backend: str | None = None) -> None:
        self.model = model
        self.target = str(target.path)  # the model it drafts for (another one served: no drafts)
        self.host = host
        self.backend = backend
        self.path = str(model.path)
        cfg = model.config
        self.nbytes = model.path.stat().st_size  # its file's bytes: about what its weights take
        self.kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * STREAM_KV_POSITIONS
        self.turned_off = 0  # streams that stopped drafting from it because its node failed
        self.failed: dict[str, str] = {}  # node id -> why it stopped drafting there (until the node joins again)
        self._failed_as: dict[str, Any] = {}  # node id -> its handle when it failed
        self._warned = False  # that another model is served now, and it drafts for none
        self._specs: dict[int, ModelSpec] = {}  # its spec at a served context
        self.tag = DRAFT_TAG + self.name  # what a node it was streamed to knows it by
        self._streaming: dict[str, asyncio.Lock] = {}  # one stream of its weights to a node at a time
        self._streamed_to: dict[str, Any] = {}  # node id -> its handle when the weights were streamed to it

    @property
    def name(self) -> str:
        return self.model.name

    def need(self) -> DraftNeed | None:
        """What the scheduler places and counts: the draft's spec at the served context (None: the
        model served is not the one it drafts for)."""
        served = self.host.model
        if served is None or str(served.path) != self.target:
            return None
        context = self.host.context_length
        if context not in self._specs:
            self._specs[context] = spec_from_gguf(self.model.gguf, context)
        return DraftNeed(self.name, self._specs[context])

    def held_on(self, handle: Any) -> int:
        """Its weights' bytes loaded on the node of ``handle`` (its heartbeat's), else 0."""
        draft = (getattr(handle, "metrics", None) or {}).get("draft") or {}
        return int(draft.get("nbytes", 0) or 0) if draft.get("path") in (self.path, self.tag) else 0

    async def source_on(self, node_id: str) -> str:
        """What a draft step names on ``node_id``: the file's path where the node reads the
        coordinator's files, else its tag, once its weights are streamed there (as a shard's are:
        checksummed chunks, :func:`~exo_tui.cluster.weights.stream_shard`)."""
        if self.host.reads_model_files(node_id):
            return self.path
        lock = self._streaming.setdefault(node_id, asyncio.Lock())
        async with lock:
            if node_id not in self.streamed:  # never, or the node joined again since (a new process)
                log.info("streaming the draft model %s to node %s", self.name, node_id)
                gguf = self.model.gguf
                await stream_shard(self.host.connection(node_id), gguf, 0, gguf.config.n_layers, self.backend,
                                   tag=self.tag)
                self._streamed_to[node_id] = self.host.nodes.get(node_id)
        return self.tag

    @property
    def streamed(self) -> set[str]:
        """The nodes that hold its weights streamed to them (the same node process since)."""
        return {n for n, h in self._streamed_to.items() if h is not None and self.host.nodes.get(n) is h}

    def failed_on(self, node_id: str) -> bool:
        """Whether it failed on the node as it is now (a node that joined again is another chance)."""
        return node_id in self.failed and self.host.nodes.get(node_id) is self._failed_as.get(node_id)

    def placed(self) -> PlanDraft | None:
        """Where the plan in force runs it (None: a plan made without it, or no plan)."""
        plan = self.host.plan
        placed = plan.draft if plan is not None else None
        return placed if placed is not None and placed.model == self.name else None

    def node_id(self) -> str | None:
        """The node the draft model runs on for new streams (None: none, or no plan)."""
        placed = self.placed()
        if placed is not None and not placed.node_id:
            return None  # no node has room for it
        if placed is not None and placed.node_id in self.host.nodes and not self.failed_on(placed.node_id):
            return placed.node_id
        # A plan made before the draft model was given, or it failed on the plan's node (until the
        # next plan): beside the ring's shards
        plan = self.host.ring
        if plan is None or not plan.ring:
            return None
        need = self.nbytes + self.kv_bytes
        ids = [e.node_id for e in plan.ring if not self.failed_on(e.node_id)]
        if not ids:
            return None

        def room(node_id: str) -> int:
            handle = self.host.nodes.get(node_id)
            kv = (getattr(handle, "metrics", None) or {}).get("kv") or {}
            here = ((getattr(handle, "metrics", None) or {}).get("draft") or {}).get("path") == self.path
            budget = int(kv.get("budget_bytes", 0) or 0) - int(kv.get("used_bytes", 0) or 0)
            return budget + (need if here else 0)  # where it is loaded already, its bytes are in the budget

        first = ids[0]
        if room(first) >= 2 * need:
            return first
        return max(ids, key=room)

    def attach(self, speculation: Speculation, rid: str, sampling: SamplingParams | None = None) -> ModelDrafts | None:
        """Give a stream's speculation the draft model as a source (before prompt lookup);
        ``sampling``: the request's (its drafts are drawn with them; None: greedy drafts)."""
        node = self.node_id()
        served = self.host.model
        if served is not None and str(served.path) != self.target:
            if not self._warned:
                log.warning("the draft model %s drafts for %s, not for %s served now: no drafts from it (serve again "
                            "with a --draft of this model's family)", self.name, self.target, served.path)
                self._warned = True
            return None
        if node is None or served is None:
            return None
        source = ModelDrafts(self, node, rid, sampling)
        sources = speculation.drafter.sources
        at = next((i for i, s in enumerate(sources) if isinstance(s, PromptLookup)), len(sources))
        sources.insert(at, source)
        return source

    def stream_failed(self, node_id: str, why: str) -> None:
        self.turned_off += 1
        if not self.failed_on(node_id):
            self.failed[node_id] = why
            self._failed_as[node_id] = self.host.nodes.get(node_id)
        self._streamed_to.pop(node_id, None)

    def describe(self) -> str:
        """A line for the partition view and ``exo-tui status``."""
        node = self.node_id()
        where = self.host.nodes[node].name if node is not None and node in self.host.nodes else "no node"
        placed = self.placed()
        if placed is not None and placed.nbytes:
            size = f"{placed.nbytes / 1e6:.0f} MB counted: weights and one stream's KV at {self.host.context_length} tokens"
        else:
            size = f"{self.nbytes / 1e6:.0f} MB"
        off = f", {self.turned_off} stream(s) turned off by a node failure" if self.turned_off else ""
        nowhere = ": no node has room for it" if placed is not None and not placed.node_id else ""
        return f"draft model {self.name} ({size}) on {where}{nowhere}{off}"


def draft_model(name_or_path: str, target: Model, paths: Sequence[str] | None = None) -> Model:
    """The draft model ``name_or_path`` (a name ``exo-tui models`` lists or a path) for ``target``;
    ValueError (one sentence) when its vocabulary is not the target's."""
    model = Model(name_or_path, paths=paths)
    why = vocabulary_mismatch(target.tokenizer, model.tokenizer, model.name)
    if why:
        raise ValueError(why)
    return model


def load_draft(name_or_path: str, host: DraftHost, target: Model, backend: str | None = None,
               paths: Sequence[str] | None = None) -> ClusterDraft:
    """The cluster's draft model (:func:`draft_model`) for ``target``, run by ``host``."""
    return ClusterDraft(draft_model(name_or_path, target, paths), host, target, backend)


class ModelDrafts(DraftSource):
    """One stream's drafts from the draft model on one node."""

    name = "model"
    cheap = False  # each proposal is k steps of the draft model on a node

    def __init__(self, drafts: ClusterDraft, node_id: str, rid: str, sampling: SamplingParams | None = None) -> None:
        self.drafts = drafts
        self.node_id = node_id
        self.rid = rid
        self.sampling = None if sampling is None else sampling.to_dict()
        self.off = False
        self._held: list[int] = []  # the positions the node's cache holds for the stream

    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> Draft:
        if self.off or k <= 0:
            return Draft(())
        n = _shared(tokens, self._held)
        for _ in range(2):
            try:
                conn = self.drafts.host.connection(self.node_id)
                source = await self.drafts.source_on(self.node_id)
                ask = DraftStep(self.rid, source, n, k, self.drafts.backend, self.sampling)
                got = await call(conn, ask, Drafted, tensor=np.asarray(tokens[n:], dtype=np.int64),
                                 timeout=DRAFT_TIMEOUT_S)
                if got.refused:  # no room for its draft cache on the node now: this step without
                    log.info("request %s: %s", self.rid, got.refused)
                    return Draft(())
                q = None if got.q is None else DraftProbs.from_wire(got.q.counts, got.q.ids, got.q.probs)
                if not got.lost and (len(got.tokens) != k or (q is not None and len(q) != k)):
                    raise BadBody(f"draft_step: {len(got.tokens)} tokens and {len(q or ())} distributions "
                                  f"drafted, not {k}")
            except (KeyError, ConnectionClosed, ConnectionError, OSError, RemoteError, TimeoutError, BadBody,
                    ValueError, WeightTransferError) as exc:
                why = str(exc) or type(exc).__name__
                log.warning("request %s: the draft model's node %s failed (%s): no more drafts from it for this "
                            "stream", self.rid, self.node_id, why)
                self.off = True
                self.drafts.stream_failed(self.node_id, why)
                return Draft(())
            if not got.lost:
                break
            n, self._held = 0, []  # the node lost the stream's cache: its tokens again, from the start
        else:
            return Draft(())
        drafted = [int(t) for t in got.tokens]
        self._held = [*tokens, *drafted[:-1]]  # the node ran every draft but the last
        return Draft(tuple(drafted), self.name, q)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if len(diff) else n
