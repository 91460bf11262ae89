"""Plans: immutable, versioned values with their predictions. JSON-able via ``to_dict``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from exo_tui.scheduler.spec import ModelSpec


@dataclass(frozen=True)
class PlanShard:
    """Layers ``[start, end)`` of the model on ``node_id``, run on ``backend``."""

    node_id: str
    start: int
    end: int
    backend: str = ""
    pinned: bool = False

    @property
    def n_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class NodePrediction:
    node_id: str
    memory_bytes: int  # weights + KV cache (+ embedding / head at the ends)
    usable_bytes: int  # what the node may use after reserves
    compute_s: float  # one decode token through this shard (head included on the last)
    hop_s: float  # the outgoing hop of one token (the last: token id back to the first)
    stage_s: float  # compute + outgoing hop: the stage time the throughput bound uses

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


@dataclass(frozen=True)
class Predictions:
    """What a plan is predicted to do."""

    decode_s_per_token: float  # one stream: every stage and every hop in turn
    tok_per_s_single: float
    tok_per_s_saturated: float  # many streams: 1 / slowest stage
    ttft_s: float  # prefill of ``prompt_tokens`` plus the first token
    prompt_tokens: int
    load_balance_coefficient: float  # std / mean of the stage times
    nodes: tuple[NodePrediction, ...] = ()
    fits_memory: bool = True

    def node(self, node_id: str) -> NodePrediction | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)


@dataclass(frozen=True)
class PlanDraft:
    """Where the plan runs a draft model (``--draft``; :mod:`exo_tui.scheduler.draft`): ``node_id``
    ("" where no node has room for it), the bytes counted there (its weights and one stream's KV
    cache at the served context) and one draft token's predicted seconds there."""

    model: str
    node_id: str
    nbytes: int
    token_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """The ordered ring of shards that covers every layer exactly once, and where a draft model
    runs beside it."""

    model: str
    n_layers: int
    shards: tuple[PlanShard, ...]
    strategy: str
    version: int = 1
    predictions: Predictions | None = None
    reasons: tuple[str, ...] = ()
    draft: PlanDraft | None = None

    def __post_init__(self) -> None:
        pos = 0
        for s in self.shards:
            if s.start != pos or s.end <= s.start:
                raise ValueError(f"plan shards must be contiguous and non-empty in ring order; got {self.layout}")
            pos = s.end
        if pos != self.n_layers:
            raise ValueError(f"plan covers layers [0, {pos}) of {self.n_layers}: every layer needs a node")

    @property
    def layout(self) -> str:
        return ", ".join(f"{s.node_id}[{s.start},{s.end})" for s in self.shards)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.shards)

    def shard_of(self, node_id: str) -> PlanShard | None:
        return next((s for s in self.shards if s.node_id == node_id), None)

    def owner(self, layer: int) -> str:
        for s in self.shards:
            if s.start <= layer < s.end:
                return s.node_id
        raise IndexError(f"layer {layer} is not in [0, {self.n_layers})")

    @property
    def tok_per_s(self) -> float:
        return self.predictions.tok_per_s_single if self.predictions else 0.0

    def with_version(self, version: int) -> Plan:
        return replace(self, version=version)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        d["reasons"] = list(self.reasons)
        if self.predictions is not None:
            d["predictions"]["nodes"] = [asdict(n) for n in self.predictions.nodes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        pred = d.get("predictions")
        predictions = None
        if pred is not None:
            pred = dict(pred)
            pred["nodes"] = tuple(NodePrediction(**n) for n in pred.get("nodes", ()))
            predictions = Predictions(**pred)
        return cls(
            model=d["model"],
            n_layers=int(d["n_layers"]),
            shards=tuple(PlanShard(**s) for s in d["shards"]),
            strategy=d["strategy"],
            version=int(d.get("version", 1)),
            predictions=predictions,
            reasons=tuple(d.get("reasons", ())),
            draft=PlanDraft(**d["draft"]) if d.get("draft") else None,
        )


@dataclass(frozen=True)
class Pin:
    """Layers ``[start, end)`` fixed to ``node_id``: that node holds exactly this range."""

    node_id: str
    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> Pin:
        """``NODE:START-END`` (END exclusive), e.g. ``studio:0-40``."""
        try:
            node, rng = text.rsplit(":", 1)
            a, b = rng.split("-", 1)
            return cls(node, int(a), int(b))
        except ValueError as exc:
            raise ValueError(f"pin {text!r} is not NODE:START-END (layers START..END-1), e.g. studio:0-40") from exc


LEASE_TOKENS = 16  # a hand-off lease's steps: the one the coordinator sends and those the ring runs on its own


@dataclass(frozen=True)
class Constraints:
    """What the operator imposes on a plan."""

    pins: tuple[Pin, ...] = ()
    drained: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    min_layers_per_shard: int | None = None  # None: the config's value
    prompt_tokens: int = 512  # for the time-to-first-token prediction
    # The coordinator's measured share of a decode token (its own time; with ``coordinator_links``
    # its links to the first and from the last stage: scheduler/calibration.py), counted in place
    # of the token's way back from the last stage to the first; None: that hop as the links predict it.
    coordinator_s: float | None = None
    draft: DraftNeed | None = None  # a draft model to place beside the plan (scheduler/draft.py)
    reserved: tuple[tuple[str, int], ...] = ()  # (node, bytes) kept out of a node's memory for other work
    # The coordinator's measured links, (from, to, seconds) with "coordinator" at one end: its hop
    # to the first stage and the last stage's back are added to ``coordinator_s`` (a node not
    # measured that way: its other way's, else the median of those measured).
    coordinator_links: tuple[tuple[str, str, float], ...] = ()
    # The share of decode tokens the last stage hands straight to the first (the hand-off: the
    # coordinator, told in parallel, is not on their way), measured; the rest go by the coordinator
    # (a lease's first step, a stream that drafts). None: a lease's share (1 - 1/LEASE_TOKENS),
    # none where the plan has a draft (a stream that drafts takes no lease).
    handed_share: float | None = None


@dataclass(frozen=True)
class DraftNeed:
    """A draft model to run whole on one node: its name and its spec at the served context (its
    bytes and time counted as a one-shard plan's)."""

    model: str
    spec: ModelSpec
