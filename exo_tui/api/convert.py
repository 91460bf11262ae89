"""The cluster's view objects to JSON and back (the server writes them, ``--attach`` reads them).

``to_jsonable`` turns dataclasses, tuples and non-finite floats (JSON has no ``Infinity``) into
plain JSON values. The ``*_from_dict`` functions rebuild the frozen dataclasses of
:mod:`exo_tui.cluster.view` and the events of :mod:`exo_tui.events`, ignoring keys a newer
server may add.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from exo_tui import events as ev
from exo_tui.cluster.figures import ClusterFigures
from exo_tui.cluster.view import (
    ClusterSnapshot,
    HostView,
    LayerMove,
    LinkView,
    NodeView,
    PlanPreview,
    PlanView,
    QueueView,
    ShardView,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")

def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return to_jsonable(value.item())
    return str(value)


def snapshot_to_dict(snapshot: ClusterSnapshot) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(snapshot)
    out["ready_count"] = snapshot.ready_count
    return out


def event_to_dict(event: ev.Event) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(event.to_dict())
    return out


def _build(cls: type[_T], data: dict[str, Any]) -> _T:
    """A dataclass from its JSON form: lists become tuples where the field is a tuple, unknown keys
    are ignored, and missing keys take the field's default."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data or not f.init:
            continue
        value = data[f.name]
        hint = str(hints.get(f.name, ""))
        if isinstance(value, list) and "tuple" in hint:
            value = tuple(value)
        elif isinstance(value, dict) and "tuple[float" in hint:  # history: metric -> values
            value = {k: tuple(v) for k, v in value.items()}
        kwargs[f.name] = value
    return cls(**kwargs)


def _node_from_dict(d: dict[str, Any]) -> NodeView:
    node = _build(NodeView, d)
    return dataclasses.replace(
        node,
        layers=tuple(d["layers"]) if d.get("layers") else None,
        pinned=tuple(d["pinned"]) if d.get("pinned") else None,
        history={k: tuple(v) for k, v in (d.get("history") or {}).items()},
    )


def plan_from_dict(d: dict[str, Any] | None) -> PlanView | None:
    if not d:
        return None
    plan = _build(PlanView, d)
    return dataclasses.replace(plan, shards=tuple(_build(ShardView, s) for s in d.get("shards", ())))


def snapshot_from_dict(d: dict[str, Any]) -> ClusterSnapshot:
    return ClusterSnapshot(
        name=d.get("name", ""),
        model=d.get("model", ""),
        nodes=tuple(_node_from_dict(n) for n in d.get("nodes", ())),
        links=tuple(_build(LinkView, x) for x in d.get("links", ())),
        plan=plan_from_dict(d.get("plan")),
        hosts=tuple(_build(HostView, h) for h in d.get("hosts", ())),
        tok_per_s=float(d.get("tok_per_s") or 0.0),
        updated_at=float(d.get("updated_at") or 0.0),
        readonly=bool(d.get("readonly", False)),
        sampling=dict(d.get("sampling") or {}),
        metrics=ClusterFigures.from_dict(d.get("metrics")),
        queue=_build(QueueView, d["queue"]) if d.get("queue") is not None else None,
    )


def preview_from_dict(d: dict[str, Any]) -> PlanPreview:
    return PlanPreview(
        action=d.get("action", ""),
        targets=tuple(d.get("targets", ())),
        moves=tuple(_build(LayerMove, m) for m in d.get("moves", ())),
        bytes_moved=int(d.get("bytes_moved") or 0),
        tok_per_s_before=float(d.get("tok_per_s_before") or 0.0),
        tok_per_s_after=float(d.get("tok_per_s_after") or 0.0),
        new_plan=plan_from_dict(d.get("new_plan")),
        error=d.get("error") or "",
        note=d.get("note") or "",
        layers=(int(d["layers"][0]), int(d["layers"][1])) if d.get("layers") else None,
    )


def _event_classes() -> dict[str, type[ev.Event]]:
    out: dict[str, type[ev.Event]] = {}
    stack = list(ev.Event.__subclasses__())
    while stack:
        cls = stack.pop()
        out[cls.kind] = cls
        stack.extend(cls.__subclasses__())
    return out


_EVENTS = _event_classes()
EVENT_KINDS = frozenset(_EVENTS)


def event_from_dict(d: dict[str, Any]) -> ev.Event | None:
    """The event a ``/v1/cluster/events`` message carries (None for a type this client does not know)."""
    cls = _EVENTS.get(str(d.get("type", "")))
    if cls is None:
        return None
    try:
        return _build(cls, d)
    except TypeError:
        return None
