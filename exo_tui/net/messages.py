"""Every frame body nodes and the coordinator send each other, as a type.

Each class is one op's request or reply (or a frame a node sends unasked), decoded and checked
once where it arrives (:meth:`~exo_tui.net.codec.Message.decode`: the node's op dispatch, the
coordinator's calls and its handler of node frames); handlers read its attributes, never a dict.
What a field holds that a layer above the wire owns (a request's sampling parameters, a token's
logprobs, a plan's hops) is that layer's to parse: such fields are plain maps or lists here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from exo_tui.net.codec import Message
from exo_tui.net.protocol import RingPlan

# ---------------------------------------------------------------------- a step through the ring


@dataclass(frozen=True, slots=True)
class ScoreAsk(Message):
    """A prompt to score: each of ``targets`` (the prompt after its first token) given the tokens
    before it, with its ``top`` likeliest alternatives."""

    top: int
    targets: list[int]


@dataclass(frozen=True, slots=True)
class DraftQ(Message):
    """A draft model's distributions for its drafted tokens (``DraftProbs.to_wire``): each row's
    length, then every row's token ids (int32) and probabilities (float32), little-endian."""

    counts: list[int]
    ids: bytes
    probs: bytes


@dataclass(frozen=True, slots=True)
class Forward(Message):
    """One step of one request through a node's layers (the frame's tensor: token ids at the first
    hop, hidden states after). Sent by the coordinator to the first hop, by each hop to the next."""

    TYPE: ClassVar[str] = "forward"

    rid: str
    hop: int  # the index in the plan's ring of the node it is sent to
    pos: int  # the position of the tensor's first row
    step: int  # the coordinator's id of the step (a prompt chunk's is negative)
    n_tokens: int  # the request's tokens once this step has run
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams.to_dict(): the last hop's sampler
    fill: bool = False  # a prompt's chunk: fill the caches, draw nothing (the token is FILLED)
    history: list[int] | None = None  # the request's tokens, where the sampler needs them
    adopt: str | None = None  # a finished request whose caches this one takes over
    logprobs: int | None = None  # the token's logprobs and this many alternatives' come back
    score: ScoreAsk | None = None
    more: int = 0  # hidden states of the previous hop's run that follow this one at once
    timing: list[Any] | None = None  # the hops' records so far (exo_tui.net.timing)
    draft: list[int] | None = None  # a verify step: the drafted tokens its last rows run (inference.speculative)
    draft_q: DraftQ | None = None  # the distributions the drafts were drawn from (a sampled draft model's)
    # The hand-off (cluster.pipeline): after this step the last hop starts up to ``ahead`` more
    # one-token steps itself, each with the token it drew, at the first hop (unless the token is
    # one of ``halt_on``); ``handed``: a step so started. ``lead``: the coordinator's id of the
    # step they follow: a node runs a handed step only while the latest step the coordinator sent
    # for the request is that one.
    ahead: int = 0
    lead: int | None = None
    handed: bool = False
    halt_on: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Token(Message):
    """The last hop's answer to a step, to the coordinator: the token drawn (FILLED for a prompt's
    chunk). ``scored``: the frame's tensor holds the prompt's scores."""

    TYPE: ClassVar[str] = "token"

    rid: str
    step: int
    token: int
    timing: list[Any] | None = None
    logprobs: list[Any] | None = None  # TokenLogprobs.to_wire()
    scored: bool = False
    tokens: list[int] | None = None  # a verify step's: the drafts accepted, then ``token``
    accepted: int | None = None  # of its drafts, how many were kept
    listed: list[Any] | None = None  # each of ``tokens``' TokenLogprobs.to_wire(), where logprobs were asked


@dataclass(frozen=True, slots=True)
class DraftStep(Message):
    """Draft ``k`` tokens for a stream with the draft model at ``path`` (loaded whole on its first
    ask; :mod:`exo_tui.inference.draft_model`): its cache cut back to ``pos`` positions, then the
    frame's tensor (the token ids accepted since) run. Sent by the coordinator to the draft's node."""

    TYPE: ClassVar[str] = "draft_step"

    rid: str
    path: str
    pos: int
    k: int
    backend: str | None = None
    sampling: dict[str, Any] | None = None  # the request's SamplingParams.to_dict() (None: greedy drafts)


@dataclass(frozen=True, slots=True)
class Drafted(Message):
    """A draft step's tokens, and (a sampled request's) the distributions they were drawn from.
    ``lost``: the node held fewer of the stream's positions than ``pos`` (ask again from 0);
    ``nbytes``: the draft model's weights here; ``refused``: why it drafted nothing (no room in
    the node's KV budget for the stream's draft cache)."""

    TYPE: ClassVar[str] = "ok"

    tokens: list[int]
    lost: bool = False
    nbytes: int = 0
    q: DraftQ | None = None
    refused: str = ""


@dataclass(frozen=True, slots=True)
class StepFailed(Message):
    """A step could not run on a node, to the coordinator. ``failed_node``: the node to suspect
    (an unreachable next hop); ``kv_budget``: refused for want of memory, no node at fault."""

    TYPE: ClassVar[str] = "step_failed"

    rid: str
    error: str
    step: int | None = None  # None: every step of the request
    node_id: str = ""
    failed_node: str | None = None
    kv_budget: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """A node's live metrics, every second, to its coordinator (the cluster's metrics parse them)."""

    TYPE: ClassVar[str] = "heartbeat"

    metrics: dict[str, Any]
    t: float


# ---------------------------------------------------------------------- the coordinator's ops


@dataclass(frozen=True, slots=True)
class HeldShard(Message):
    """A shard a node holds (its ``attached`` reply and heartbeats list them)."""

    start: int
    end: int
    backend: str
    nbytes: int
    model: str = ""
    held_bytes: int = 0
    precision: str | None = None


@dataclass(frozen=True, slots=True)
class Attach(Message):
    """The sender becomes this node's coordinator. ``term``: its Raft term, where it is one of a
    set (the node then refuses an older term's commands: exo_tui.node.fencing)."""

    TYPE: ClassVar[str] = "attach"

    term: int | None = None


@dataclass(frozen=True, slots=True)
class Attached(Message):
    """A node's state: its profile (``NodeProfile.to_dict()``), the shards held, the plans known,
    and its KV budget now (``KVBudget.report()``: the first plan counts the room it leaves)."""

    TYPE: ClassVar[str] = "attached"

    profile: dict[str, Any]
    shards: list[HeldShard]
    plans: list[int]
    port: int
    kv: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProfileAsk(Message):
    TYPE: ClassVar[str] = "profile"


@dataclass(frozen=True, slots=True)
class Profile(Message):
    """A node's profile (``NodeProfile.to_dict()``; empty before the node has one)."""

    TYPE: ClassVar[str] = "profile"

    profile: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Load(Message):
    """Load layers ``[start, end)`` from a GGUF file on the node's host. ``model``: the tag the
    shard is kept under; ``context``: the context served at, where less than the model's (0: its own)."""

    TYPE: ClassVar[str] = "load"

    path: str
    start: int
    end: int
    backend: str | None = None
    model: str = ""
    context: int = 0


@dataclass(frozen=True, slots=True)
class TensorSpec(Message):
    """One tensor of a shard's weights streamed in (GGUF's name, type name, shape and bytes)."""

    name: str
    type: str
    shape: list[int]
    nbytes: int


@dataclass(frozen=True, slots=True)
class LoadBegin(Message):
    """A shard's weights will stream in: its model's config (``ModelConfig.to_wire()``), its
    tensors, in the order their bytes come."""

    TYPE: ClassVar[str] = "load_begin"

    transfer_id: str
    config: dict[str, Any]
    start: int
    end: int
    tensors: list[TensorSpec]
    backend: str | None = None
    model: str = ""


@dataclass(frozen=True, slots=True)
class LoadChunk(Message):
    """Bytes ``[offset, offset + len)`` of a transfer (the frame's payload) and their SHA-256."""

    TYPE: ClassVar[str] = "load_chunk"

    transfer_id: str
    offset: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ChunkReceived(Message):
    TYPE: ClassVar[str] = "ok"

    received: int  # the transfer's bytes received so far


@dataclass(frozen=True, slots=True)
class LoadCommit(Message):
    """Build the shard from a transfer's bytes."""

    TYPE: ClassVar[str] = "load_commit"

    transfer_id: str


@dataclass(frozen=True, slots=True)
class Loaded(Message):
    """A shard loaded, and the node's KV budget measured after it (``KVBudget.report()``)."""

    TYPE: ClassVar[str] = "loaded"

    start: int
    end: int
    backend: str
    nbytes: int
    held_bytes: int
    kv: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Unload(Message):
    """Free the shard of layers ``[start, end)`` (of the model tagged ``model``; None: any)."""

    TYPE: ClassVar[str] = "unload"

    start: int
    end: int
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Unloaded(Message):
    TYPE: ClassVar[str] = "ok"

    unloaded: bool  # whether such a shard was held
    kv: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PlanOp(Message):
    """A ring plan the node takes part in (its layers checked by :meth:`RingPlan.check`)."""

    TYPE: ClassVar[str] = "plan"

    plan: RingPlan


@dataclass(frozen=True, slots=True)
class Plans(Message):
    TYPE: ClassVar[str] = "ok"

    plans: list[int]  # the versions the node holds


@dataclass(frozen=True, slots=True)
class KVExport(Message):
    """A request's KV cache for layers ``[start, end)``."""

    TYPE: ClassVar[str] = "kv_export"

    rid: str
    start: int
    end: int
    model: str | None = None
    length: int | None = None  # cut back to this many positions first (a verify step's rejected drafts are past it)


@dataclass(frozen=True, slots=True)
class KV(Message):
    """A KV cache's shape beside its array (the frame's tensor, :func:`~exo_tui.net.protocol.kv_to_array`):
    the positions it holds, and where windowed layers hold fewer, how many each layer holds."""

    TYPE: ClassVar[str] = "kv"

    length: int
    held: list[int] | None = None


@dataclass(frozen=True, slots=True)
class KVImport(Message):
    """Install a request's KV cache for a whole shard (the frame's tensor, shaped as ``KV`` says)."""

    TYPE: ClassVar[str] = "kv_import"

    rid: str
    start: int
    end: int
    length: int
    held: list[int] | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Drop(Message):
    """Forget a request's caches. ``final``: it has ended, so a step of it still on its way is
    discarded."""

    TYPE: ClassVar[str] = "drop"

    rid: str
    final: bool = False


@dataclass(frozen=True, slots=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"

    t: float | None = None


@dataclass(frozen=True, slots=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"

    t: float | None = None  # the ping's
    node_id: str = ""


@dataclass(frozen=True, slots=True)
class LinkProbe(Message):
    """Measure the link to another node: ``pings`` round trips, and bandwidth with that many bytes."""

    TYPE: ClassVar[str] = "link_probe"

    host: str
    port: int
    pings: int = 5
    bandwidth_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Link(Message):
    TYPE: ClassVar[str] = "link"

    latency_s: float
    rtt_s: float
    bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The empty reply of an op that gives nothing back."""

    TYPE: ClassVar[str] = "ok"
