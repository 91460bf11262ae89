"""The cluster's view objects to JSON and back (the server writes them, ``--attach`` reads them).

``to_jsonable`` turns dataclasses, tuples and non-finite floats (JSON has no ``Infinity``) into
plain JSON values. The ``*_from_dict`` functions rebuild the frozen dataclasses of
:mod:`exo_tui.cluster.view` and the events of :mod:`exo_tui.events`, ignoring keys a newer
server may add.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from exo_tui import events as ev
from exo_tui.cluster.figures import ClusterFigures
from exo_tui.cluster.view import (
    ClusterSnapshot,
    PlanPreview,
    PlanView,
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


@functools.cache
def _adapter(cls: type[_T]) -> TypeAdapter[_T]:
    return TypeAdapter(cls)


def _takes_none(hint: Any) -> bool:
    return hint is Any or hint is type(None) or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint))


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds, itself or as the items of a tuple (None: neither)."""
    for tp in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return tp
    return None


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, bool, type | None], ...]:
    """Each init field of the dataclass ``cls``: its name, whether a null in it is stray (it takes
    none and has a default to fall back on), and the dataclass it holds (None: none)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.init:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            out.append((f.name, has_default and not _takes_none(hints[f.name]), _dataclass_in(hints[f.name])))
    return tuple(out)


def _stray_nulls_dropped(cls: type, data: Any) -> Any:
    """``data`` for the dataclass ``cls`` without the nulls its fields do not take (a non-finite
    float is written as null): such a field takes its default. Nested dataclasses alike."""
    if not isinstance(data, dict):
        return data
    out = {}
    for name, stray_null, inner in _fields(cls):
        if name not in data or (data[name] is None and stray_null):
            continue
        value = data[name]
        if inner is not None and isinstance(value, list):
            value = [_stray_nulls_dropped(inner, v) for v in value]
        elif inner is not None:
            value = _stray_nulls_dropped(inner, value)
        out[name] = value
    return out


def _build(cls: type[_T], data: dict[str, Any]) -> _T:
    """A dataclass from its JSON form, by pydantic's TypeAdapter: lists become the tuples its
    fields declare, nested dataclasses are built, unknown keys are ignored and missing keys take
    the field's default (a null its field does not take too)."""
    adapter: TypeAdapter[_T] = _adapter(cls)
    return adapter.validate_python(_stray_nulls_dropped(cls, data))


def plan_from_dict(d: dict[str, Any] | None) -> PlanView | None:
    return _build(PlanView, d) if d else None


def snapshot_from_dict(d: dict[str, Any]) -> ClusterSnapshot:
    snapshot = _build(ClusterSnapshot, {k: v for k, v in d.items() if k != "metrics"})
    return dataclasses.replace(snapshot, metrics=ClusterFigures.from_dict(d.get("metrics")))


def preview_from_dict(d: dict[str, Any]) -> PlanPreview:
    return _build(PlanPreview, d)


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
    except ValidationError:
        return None
