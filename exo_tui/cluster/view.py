"""What the console, the API and the operator CLI see of the cluster, and what they can ask of it.

:class:`ClusterSnapshot` is a plain, immutable picture of the cluster at one moment.
:class:`ClusterControl` is the whole surface a front end uses: a snapshot, the event bus, previews
of plan changes, the operator actions, chat, and bootstrap. The embedded coordinator implements it;
so does the HTTP client used by ``exo-tui --attach URL``. Front ends never reach past it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from exo_tui.bootstrap.errors import HostKeyUnknown as HostKeyUnknown  # the front ends catch it from here
from exo_tui.cluster.figures import ClusterFigures
from exo_tui.events import EventBus
from exo_tui.inference.sampling import SamplingParams, with_defaults
from exo_tui.inference.speculation import parse_mode

if TYPE_CHECKING:
    from exo_tui.config import Config
    from exo_tui.inference.generate import Chunk
    from exo_tui.inference.request import Request
    from exo_tui.models.model import Model

# Node states, in the order the console sorts them.
NODE_STATES = ("ready", "loading", "suspect", "draining", "drained", "failed", "foreign", "discovered")


@dataclass(frozen=True)
class NodeView:
    node_id: str
    name: str
    address: str
    port: int
    state: str  # one of NODE_STATES
    backend: str = ""  # the backend its shard runs on
    backends: tuple[str, ...] = ()
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    cpu_percent: float = 0.0
    score: float | None = None
    eligible: bool = True
    ineligible_reason: str = ""
    score_breakdown: dict[str, float] = field(default_factory=dict)  # part -> points
    weights: dict[str, float] = field(default_factory=dict)  # group -> weight in force
    layers: tuple[int, int] | None = None  # [start, end) it holds in the current plan
    pinned: tuple[int, int] | None = None
    drained: bool = False
    tok_per_s: float = 0.0
    heartbeat_age_s: float | None = None
    profile: dict[str, Any] = field(default_factory=dict)  # the node's full profile (JSON-able)
    history: dict[str, tuple[float, ...]] = field(default_factory=dict)  # metric -> recent values
    kv: dict[str, int] = field(default_factory=dict)  # its KV budget: budget_bytes, used_bytes, requests, ...
    # seconds a decode token takes in one (mean) layer of the served model: from the start-up
    # benchmark, and as the ring measures it now (None before it held layers: cluster/calibrate.py)
    layer_s_startup: float | None = None
    layer_s_measured: float | None = None


@dataclass(frozen=True)
class LinkView:
    src: str  # node ids, in ring order
    dst: str
    latency_ms: float | None
    ok: bool = True


@dataclass(frozen=True)
class ShardView:
    node_id: str
    start: int
    end: int
    pinned: bool = False
    weight_bytes: int = 0  # its layers' bytes as the file has them (quantized), embedding / head included
    memory_bytes: int = 0  # what the plan counts it needs there: weights and KV caches at the context
    usable_bytes: int = 0  # what its node offers after reserves (0: unknown)
    experts: tuple[int, int] = (0, 0)  # a mixture of experts: (experts per layer, chosen per token); (0, 0) dense
    precision: str = ""  # the math its node runs it at, as the node reports (ONNX: int8, int16, float32); "" unknown


@dataclass(frozen=True)
class PlanView:
    version: int
    n_layers: int
    shards: tuple[ShardView, ...]
    strategy: str = "latency"
    predicted_tok_per_s: float = 0.0
    predicted_ttft_s: float = 0.0
    predicted_ttft_prompt_tokens: int = 0  # the prompt length predicted_ttft_s is for
    reasons: tuple[str, ...] = ()
    context_length: int = 0  # the tokens a request may reach: its shards' KV caches are counted at it
    draft: str = ""  # the draft model and the node it runs on (``--draft``, exo_tui.cluster.drafting); "" when none


@dataclass(frozen=True)
class HostView:
    host: str
    port: int = 22
    source: str = ""  # mdns | ssh_config | config | tailscale | peer | manual
    state: str = "new"  # new | bootstrapping | node | failed
    detail: str = ""  # last bootstrap step or error
    user: str = ""


@dataclass(frozen=True)
class ClusterSnapshot:
    name: str
    model: str
    nodes: tuple[NodeView, ...] = ()
    links: tuple[LinkView, ...] = ()
    plan: PlanView | None = None
    hosts: tuple[HostView, ...] = ()
    tok_per_s: float = 0.0
    updated_at: float = 0.0
    readonly: bool = False
    sampling: Mapping[str, Any] = field(default_factory=dict)  # the model's recommended sampling
    metrics: ClusterFigures | None = None  # measured figures (exo_tui/cluster/metrics.py)
    queue: QueueView | None = None  # admission: requests running and waiting for the ring's memory
    coordinators: tuple[CoordinatorView, ...] = ()  # a set's coordinators; empty for a single one

    @property
    def ready_count(self) -> int:
        return sum(1 for n in self.nodes if n.state == "ready")


@dataclass(frozen=True)
class CoordinatorView:
    """One coordinator of a set (exo_tui.cluster.consensus), as the leader sees it."""

    address: str  # its Raft address
    name: str
    api: str
    role: str  # leader | standby | unreachable
    term: int
    lag: int  # log entries it has not applied (-1: unknown)
    applied: int = -1


@dataclass(frozen=True)
class QueueView:
    """Admission (exo_tui.cluster.admission): what runs, what waits, and the counts so far."""

    running: int = 0
    queued: int = 0
    admitted: int = 0
    preempted: int = 0
    rejected: int = 0
    reserved_positions: int = 0
    capacity_positions: int | None = None  # KV positions the ring holds (None: not reported yet)
    queue_bound: int = 0


@dataclass(frozen=True)
class LayerMove:
    start: int
    end: int
    src: str | None  # node id (None: loaded fresh, e.g. after a failure)
    dst: str
    nbytes: int


class Action(StrEnum):
    """What an operator can ask of the cluster. Every action but ``model`` changes the plan and is
    previewed as a plan diff; ``model`` switches the model served."""

    DRAIN = "drain"
    UNDRAIN = "undrain"
    PIN = "pin"
    UNPIN = "unpin"
    REBALANCE = "rebalance"
    REMOVE = "remove"
    MODEL = "model"

    @classmethod
    def of(cls, value: str) -> Action:
        """The action ``value`` names; ``ValueError`` lists the actions."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown action {value!r}: use {', '.join(cls)}") from None


PLAN_ACTIONS = tuple(a for a in Action if a is not Action.MODEL)  # changes previewed as a plan diff
COMMAND_ACTIONS = tuple(Action)


@dataclass(frozen=True)
class Command:
    """One operator action, as the console, the API, the CLI and the coordinator all say it.

    ``targets``: node ids or names (none for a rebalance); ``layers``: a pin's range
    ``[start, end)`` of exactly one node, None to pin what the node holds now; ``model``: the
    name or path the ``model`` action loads. ``ValueError`` says what is wrong with one that
    cannot be: this is the one place a command's shape is checked (what the cluster holds, such
    as the model's layer count, is checked by :func:`~exo_tui.cluster.proposal.propose`)."""

    action: Action
    targets: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None
    model: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action.of(self.action))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.layers is not None:
            if self.action is not Action.PIN:
                raise ValueError(f"only a pin takes layers, not {self.action}")
            start, end = self.layers
            if not 0 <= start < end:
                raise ValueError(f"layers [{start}, {end}): start must be >= 0 and below end (end is one past the last)")
            if len(self.targets) != 1:
                raise ValueError("a pin with layers names exactly one node")
            object.__setattr__(self, "layers", (int(start), int(end)))
        if (self.action is Action.MODEL) != bool(self.model):
            raise ValueError("the model action takes a model name or path" if self.action is Action.MODEL
                             else f"{self.action} takes no model")

    def __str__(self) -> str:
        what = self.model if self.action is Action.MODEL else " ".join(self.targets)
        layers = f" layers {self.layers[0]}-{self.layers[1] - 1}" if self.layers else ""
        return f"{self.action} {what}".strip() + layers


@dataclass(frozen=True)
class PlanPreview:
    """What a plan change will do, shown before the operator says yes."""

    action: Action
    targets: tuple[str, ...]
    moves: tuple[LayerMove, ...] = ()
    bytes_moved: int = 0
    tok_per_s_before: float = 0.0
    tok_per_s_after: float = 0.0
    new_plan: PlanView | None = None
    error: str = ""  # when the change is impossible, why and what to do
    note: str = ""  # e.g. "a chat is streaming: the drain waits for it to end"
    layers: tuple[int, int] | None = None  # a pin's layers [start, end); None pins what the node holds

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action.of(self.action))
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def command(self) -> Command:
        """The command this previews (targets as the preview names them: node ids)."""
        if self.action is Action.MODEL:
            return Command(self.action, model=self.targets[0])
        return Command(self.action, self.targets, self.layers)


@dataclass(frozen=True)
class ModelChoice:
    """A model of the machine's catalog, as the picker shows it: what it is, whether this runtime
    can run it, and whether the cluster can hold it now (the scheduler's plan for it)."""

    name: str  # what --model, :model and the APIs take
    family: str = ""
    params: str = ""  # "135M"
    quant: str = ""
    size_bytes: int = 0
    context_length: int = 0
    where: str = ""  # the file, ~ for the home folder
    source: str = ""  # registry | config | ollama | lmstudio | huggingface
    usable: bool = True  # the runtime can run it
    reason: str = ""  # why not, and what to do
    fits: bool | None = None  # the cluster can hold it now (None: not asked, it cannot run)
    fit_reason: str = ""  # why it does not fit
    tok_per_s: float = 0.0  # predicted, one stream
    current: bool = False  # the file the cluster serves


_SETTING_RULES: dict[str, tuple[type, Any, str]] = {  # name: (type, check, what is allowed)
    "temperature": (float, lambda x: 0.0 <= x <= 2.0, "0 up to 2"),
    "top_p": (float, lambda x: 0.0 < x <= 1.0, "above 0 up to 1"),
    "top_k": (int, lambda n: n >= 0, "0 (off) or more"),
    "max_tokens": (int, lambda n: n >= 1, "1 or more"),
    "repetition_penalty": (float, lambda x: 0.0 < x <= 10.0, "above 0 up to 10"),
    "seed": (int, lambda n: True, "a whole number or none"),
}


_MODELS_OWN = ("temperature", "top_p", "top_k", "repetition_penalty")  # None: the model's recommendation


@dataclass(frozen=True)
class ChatParams:
    """A chat's settings; a sampling setting left at ``None`` takes the model's recommendation
    (see :meth:`sampling`)."""

    max_tokens: int = 512
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculative: str | int | None = None  # off | auto | k drafted tokens; None: the cluster's (serve --speculative)
    prediction: str = ""  # text the answer is expected to copy (OpenAI's Predicted Outputs): drafted from

    SETTINGS = (*_SETTING_RULES, "speculative")

    def sampling(self, recommended: Mapping[str, Any]) -> SamplingParams:
        """The sampling these settings ask for, where left out the model's ``recommended``."""
        given = {name: getattr(self, name) for name in (*_MODELS_OWN, "seed")}
        return with_defaults(given, recommended)

    def with_setting(self, name: str, value: str) -> ChatParams:
        """A copy with one sampling setting changed from text (the console's ``:set NAME VALUE``);
        ``ValueError`` says what is wrong and what is allowed."""
        key = name.strip().lower().replace("-", "_")
        value = value.strip()
        if key == "speculative":
            return replace(self, speculative=parse_mode(value))
        if key not in _SETTING_RULES:
            raise ValueError(f"no setting {name!r}: choose one of {', '.join(self.SETTINGS)}")
        if key == "seed" and value.lower() in ("none", "off", ""):
            return replace(self, seed=None)

        if key in _MODELS_OWN and value.lower() in ("default", "model", ""):
            unset: dict[str, Any] = {key: None}
            return replace(self, **unset)
        kind, ok, allowed = _SETTING_RULES[key]
        try:
            x = kind(value)
        except ValueError:
            raise ValueError(f"{key} takes {'a whole number' if kind is int else 'a number'}, not {value!r}") from None
        if not ok(x):
            raise ValueError(f"{key} takes {allowed}, not {value}")
        return replace(self, **{key: x})

    def describe(self, recommended: Mapping[str, Any] | None = None) -> str:
        """The settings in force, ``(model's)`` after those the model's recommendation sets."""
        recommended = recommended or {}
        s = self.sampling(recommended)

        def show(name: str) -> str:
            mark = " (model's)" if getattr(self, name) is None and name in recommended else ""
            return f"{name} {getattr(s, name):g}{mark}"

        seed = "none" if self.seed is None else str(self.seed)
        spec = "" if self.speculative is None else f" · speculative {self.speculative}"
        return (f"{show('temperature')} · {show('top_p')} · {show('top_k')} · max_tokens {self.max_tokens} · "
                f"{show('repetition_penalty')} · seed {seed}{spec}")


@dataclass(frozen=True)
class ChatChunk:
    """A piece of a streaming answer; the last one has ``finish_reason`` and the stats."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # stop | length | cancelled | error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and of them accepted
    accepted_tokens: int = 0
    ttft_s: float = 0.0
    tok_per_s: float = 0.0
    nodes: tuple[str, ...] = ()
    error: str = ""
    queued_ahead: int | None = None  # a note while the request waits its turn: requests ahead of it


def parse_layers(text: str) -> tuple[int, int]:
    """``"0-14"`` (inclusive, as the console shows ranges) -> ``(0, 15)``."""
    try:
        a, b = (int(x) for x in text.strip().replace("–", "-").split("-", 1))
    except ValueError:
        raise ValueError(f"layers {text!r} are not START-END (inclusive, e.g. 0-14)") from None
    if a < 0 or b < a:
        raise ValueError(f"layers {text!r}: START must be >= 0 and END >= START")
    return a, b + 1


@runtime_checkable
class ClusterControl(Protocol):
    """Everything a front end may read or do."""

    events: EventBus

    def snapshot(self) -> ClusterSnapshot: ...

    async def preview(self, command: Command) -> PlanPreview:
        """What ``command`` (one of :data:`PLAN_ACTIONS`) would change; ``error`` says why it cannot."""
        ...

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        """Carry out a previewed change; returns what was done (``error`` set on failure)."""
        ...

    def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncGenerator[ChatChunk, None]:
        """Stream an answer; closing the iterator (or cancelling its task) stops generation."""
        ...

    async def bootstrap(self, host: str, *, accept_new_host_key: bool = False) -> None: ...

    async def add_host(self, host: str) -> None: ...

    async def set_model(self, name_or_path: str) -> None: ...

    async def models(self) -> list[ModelChoice]:
        """The models on the coordinator's machine, each with whether the cluster can hold it now.
        ``preview(Command("model", model=name))`` shows what switching to one does; ``apply`` of
        it switches."""
        ...


@runtime_checkable
class ServingCluster(ClusterControl, Protocol):
    """What the API needs of the cluster beyond :class:`ClusterControl`: the model it serves (its
    description: names, tokenizer, chat template, context length, recommended sampling), whether
    it can serve now, and generation. The embedded coordinator implements it."""

    readonly: bool
    config: Config  # the coordinator's settings (admission's waits, limits)
    model_name: str | None  # the name or path it was asked to serve
    model: Model | None  # None until it is loaded
    context_length: int  # the context it serves the model at: the file's, or models.context_length where shorter
    pins: Mapping[str, Any]  # node id -> pin, nodes not in the cluster included

    def serve_error(self) -> str:
        """Why a request cannot be served now and what to do; empty when it can."""
        ...

    def generate(self, request: Request, on_queued: Callable[[int], None] | None = None) -> AsyncGenerator[Chunk, None]:
        """The request's chunks as they are generated; ``on_queued(n)`` while it waits for
        admission with ``n`` requests ahead."""
        ...

    def node_name(self, node_id: str) -> str:
        """A node's name (its id where it is not a member)."""
        ...


async def run_command(control: ClusterControl, command: Command, *, dry_run: bool = False) -> PlanPreview:
    """Carry out ``command`` on ``control`` as the API and the CLI ask for it: a plan change is
    previewed, then applied unless ``dry_run`` or impossible (``error`` set); ``model`` loads the
    model (exceptions of :meth:`ClusterControl.set_model` pass through)."""
    if command.action is Action.MODEL:
        if not dry_run:
            await control.set_model(command.model)
        return PlanPreview(Action.MODEL, (command.model,))
    preview = await control.preview(command)
    if not preview.error and not dry_run:
        preview = await control.apply(preview)
    return preview
