"""Typed frame bodies: a frozen dataclass per message, checked once where it arrives.

A message is a frozen, slotted dataclass deriving from :class:`Message`, with the frame ``TYPE``
it travels as; :mod:`exo_tui.net.messages` holds every op's request and reply. Its fields' types
say what the wire may hold, and :meth:`Message.decode` checks a received body against them once,
field by field (a small check each: a forward step is decoded once per token per hop, so this
costs microseconds, not a schema library's milliseconds). A body that does not fit raises
:class:`BadBody` naming the op and the field (``forward: field 'hop' must be an int, got str``),
and the receiving side answers it with one ``error`` frame of code ``bad_body``. A field the
message does not have is refused too: a peer asking for something this side does not know must
not see it silently ignored.

The field types understood: ``int`` (not a bool), ``float`` (an int is taken), ``str``, ``bool``,
``bytes``, ``X | None`` (absent or nil), ``list[X]`` and ``tuple[X, ...]`` of any of these,
``dict[str, Any]`` (a map, its values not checked: nested data owned by a layer above the wire,
which parses it), another :class:`Message` (a nested map, its errors named ``outer.inner``), and
``Any``. A field with a default may be absent; :meth:`Message.to_body` leaves out fields that are
None or (the very object) their default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union

import numpy as np

from exo_tui.net.connection import Connection
from exo_tui.net.errors import BadBody
from exo_tui.net.frame import Frame

M = TypeVar("M", bound="Message")
_MISSING: Any = object()


class _Wrong(Exception):
    """A value of the wrong shape: what was expected, what came, and where under the field."""

    def __init__(self, expected: str, got: str, where: str = "") -> None:
        super().__init__(expected)
        self.expected, self.got, self.where = expected, got, where


def _kind(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


_Check = Callable[[Any], Any]


def _scalar(tp: type, expected: str) -> _Check:
    def check(v: Any) -> Any:
        if type(v) is not tp:
            raise _Wrong(expected, _kind(v))
        return v

    return check


def _number(v: Any) -> float:
    t = type(v)
    if t is float:
        return typing.cast(float, v)
    if t is int:
        return float(v)
    raise _Wrong("a number", _kind(v))


def _optional(inner: _Check | None) -> _Check | None:
    if inner is None:
        return None

    def check(v: Any) -> Any:
        return None if v is None else inner(v)

    return check


def _sequence(inner: _Check | None, expected: str, make: Callable[[list[Any]], Any], item: Any = None) -> _Check:
    """A list's check: each item's (``item``: a scalar type, checked for all items at once, at C
    speed, before the items are looked at one by one to say which is wrong)."""
    def check(v: Any) -> Any:
        if type(v) is not list:
            raise _Wrong(expected, _kind(v))
        if inner is None or (item is not None and set(map(type, v)) <= {item}):
            return make(v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(inner(x))
            except _Wrong as w:
                raise _Wrong(expected, f"{w.got} at index {i}{w.where}") from None
        return make(out)

    return check


def _map(v: Any) -> Any:
    if type(v) is not dict:
        raise _Wrong("a map", _kind(v))
    return v


def _nested(cls: type[Message]) -> _Check:
    def check(v: Any) -> Any:
        if type(v) is not dict:
            raise _Wrong("a map", _kind(v))
        return _spec(cls).decode(v, _raise_nested)

    return check


def _raise_nested(name: str, wrong: _Wrong | None, detail: str) -> None:
    """A nested message's field is wrong: the outer field's check reports it under its own name."""
    if wrong is None:
        raise _Wrong("", detail, f".{name}")
    raise _Wrong(wrong.expected, wrong.got, f".{name}{wrong.where}")


_NAMES = {int: "an int", float: "a number", str: "a string", bool: "a bool", bytes: "bytes"}
_PLURALS = {int: "ints", float: "numbers", str: "strings", bool: "bools", bytes: "bytes"}


def _plural(tp: Any) -> str:
    if tp in _PLURALS:
        return _PLURALS[tp]
    if isinstance(tp, type) and issubclass(tp, Message):
        return "maps"
    return str(tp)


def _check_for(tp: Any) -> _Check | None:
    """The check of a field of type ``tp`` (None: anything goes)."""
    if tp is Any:
        return None
    if tp in (int, str, bool, bytes):
        return _scalar(tp, _NAMES[tp])
    if tp is float:
        return _number
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _optional(_check_for(next(a for a in args if a is not type(None))))
    if origin is list and len(args) == 1:
        scalar = args[0] if args[0] in _SCALARS else None
        return _sequence(_check_for(args[0]), f"a list of {_plural(args[0])}", lambda x: x, scalar)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        scalar = args[0] if args[0] in _SCALARS else None
        return _sequence(_check_for(args[0]), f"a list of {_plural(args[0])}", tuple, scalar)
    if origin is dict and args[:1] == (str,):
        return _map
    if isinstance(tp, type) and issubclass(tp, Message):
        return _nested(tp)
    raise TypeError(f"no wire check for a field of type {tp!r}")


def _encoder_for(tp: Any) -> Callable[[Any], Any] | None:
    """How a field's value goes on the wire (None: as it is)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _encoder_for(inner[0]) if len(inner) == 1 else None
    if isinstance(tp, type) and issubclass(tp, Message):
        return lambda v: v.to_body()
    if origin in (list, tuple) and args:
        item = _encoder_for(args[0])
        if item is not None:
            return lambda v: [item(x) for x in v]
        if origin is tuple:
            return list
    return None


class _Spec:
    """A message class's fields, compiled once into straight-line functions (a type test per field:
    what a forward step pays per hop): ``decode`` checks a body, ``encode`` makes one, ``copy``
    makes the message again with some fields changed."""

    def __init__(self, cls: type[Message]) -> None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(typing.cast(Any, cls))  # a dataclass: Message's subclasses are
        self.names = frozenset(f.name for f in fields)
        self.fail = _failing(cls.TYPE or cls.__name__)
        env: dict[str, Any] = {"M": _MISSING, "new": object.__new__, "put": object.__setattr__, "cls": cls,
                               "names": self.names, "Wrong": _Wrong, "kind": _kind, "unknown": _unknown}
        dec = ["def decode(body, fail):",
               "    if not names.issuperset(body):",
               "        unknown(cls, names, body, fail)",
               "    self = new(cls)"]
        enc = ["def encode(self):", "    out = {}"]
        cop = ["def copy(self, changes):", "    new_ = new(cls)"]
        for f in fields:
            n, tp = f.name, hints[f.name]
            optional, inner = _unwrap_optional(tp)
            if optional and f.default is not None:  # None is sent as nothing: it must read back as None
                raise TypeError(f"{cls.__name__}.{n} may be None: give it None for a default")
            dec.append(f"    v = body.get({n!r}, M)")
            if f.default is not dataclasses.MISSING:
                env[f"d_{n}"] = f.default
                dec.append(f"    if v is M: v = d_{n}")
            elif f.default_factory is not dataclasses.MISSING:
                env[f"f_{n}"] = f.default_factory
                dec.append(f"    if v is M: v = f_{n}()")
            else:
                dec.append(f"    if v is M: fail({n!r}, None, 'is missing')")
            if inner in _SCALARS:
                env[f"t_{n}"] = inner
                test = f"type(v) is not t_{n}" + (" and v is not None" if optional else "")
                dec.append(f"    elif {test}: fail({n!r}, Wrong({_NAMES[inner]!r}, kind(v)), '')")
            elif (check := _check_for(tp)) is not None:
                env[f"c_{n}"] = check
                dec += ["    else:",
                        "        try:",
                        f"            v = c_{n}(v)",
                        "        except Wrong as w:",
                        f"            fail({n!r}, w, '')"]
            dec.append(f"    put(self, {n!r}, v)")
            value = "v"
            if (encoder := _encoder_for(tp)) is not None:
                env[f"e_{n}"] = encoder
                value = f"e_{n}(v)"
            # left out: None, and a field at its default (the very object)
            skip = [*(["v is None"] if optional else []), *([f"v is d_{n}"] if f.default is not dataclasses.MISSING else [])]
            enc.append(f"    v = self.{n}")
            enc.append(f"    if not ({' or '.join(skip)}): out[{n!r}] = {value}" if skip else f"    out[{n!r}] = {value}")
            cop.append(f"    v = changes.get({n!r}, M)")
            cop.append(f"    put(new_, {n!r}, self.{n} if v is M else v)")
        dec.append("    return self")
        enc.append("    return out")
        cop.append("    return new_")
        exec("\n".join(dec + enc + cop), env)  # noqa: S102 - code made here, from the class's own field names and types
        self.decode: Callable[[dict[str, Any], Callable[[str, _Wrong | None, str], None]], Any] = env["decode"]
        self.encode: Callable[[Any], dict[str, Any]] = env["encode"]
        self.copy: Callable[[Any, dict[str, Any]], Any] = env["copy"]


_SCALARS = (int, str, bool, bytes)


def _failing(op: str) -> Callable[[str, _Wrong | None, str], None]:
    """How a message of ``op`` refuses a field: :class:`BadBody`, saying which and why."""

    def fail(name: str, wrong: _Wrong | None, detail: str) -> None:
        if wrong is None:
            raise BadBody(f"{op}: field {name!r} {detail}")
        if not wrong.expected:  # a nested message's field missing or unknown
            raise BadBody(f"{op}: field '{name}{wrong.where}' {wrong.got}")
        raise BadBody(f"{op}: field '{name}{wrong.where}' must be {wrong.expected}, got {wrong.got}")

    return fail


def _unwrap_optional(tp: Any) -> tuple[bool, Any]:
    """Whether ``tp`` is ``X | None``, and X."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return True, next(a for a in args if a is not type(None))
    return False, tp


def _unknown(cls: type[Message], names: frozenset[str], body: dict[str, Any],
             fail: Callable[[str, _Wrong | None, str], None]) -> None:
    unknown = sorted(str(k) for k in body if k not in names)
    fail(unknown[0], None, f"is not a field of {cls.__name__} ({', '.join(sorted(names))})")


_SPECS: dict[type[Message], _Spec] = {}


def _spec(cls: type[Message]) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _Spec(cls)
    return spec


class Message:
    """A frame body as a type: subclass it as a ``@dataclass(frozen=True, slots=True)`` with the
    frame ``TYPE`` it travels as."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""

    @classmethod
    def decode(cls: type[M], body: dict[str, Any]) -> M:
        """The message in ``body``, every field checked; :class:`BadBody` names the first that does
        not fit."""
        spec = _SPECS.get(cls) or _spec(cls)
        return typing.cast(M, spec.decode(body, spec.fail))

    def to_body(self) -> dict[str, Any]:
        """The body to send: every field but those that are None or (the very object) their default."""
        return (_SPECS.get(type(self)) or _spec(type(self))).encode(self)

    def copy(self: M, **changes: Any) -> M:
        """The message with ``changes`` (``dataclasses.replace``, without its cost: a hop sends each
        step on this way)."""
        return typing.cast(M, (_SPECS.get(type(self)) or _spec(type(self))).copy(self, changes))


R = TypeVar("R", bound=Message)


def reply(msg: Message, *, tensor: np.ndarray | None = None) -> Frame:
    """A handler's answer: ``msg`` as a frame (with ``tensor`` where it goes with one)."""
    return Frame(msg.TYPE, body=msg.to_body(), tensor=tensor)


async def send(conn: Connection, msg: Message, *, tensor: np.ndarray | None = None, plan: int | None = None,
               hold_s: float = 0.0) -> None:
    """Send ``msg`` one way (see :meth:`Connection.send`)."""
    await conn.send(msg.TYPE, msg.to_body(), tensor=tensor, plan=plan, hold_s=hold_s)


async def call_frame(conn: Connection, msg: Message, expect: type[R], *, tensor: np.ndarray | None = None,
                     payload: bytes | bytearray | memoryview | None = None, plan: int | None = None,
                     timeout: float | None = None) -> tuple[R, Frame]:
    """Call with ``msg`` (see :meth:`Connection.call`): the reply, decoded as ``expect`` (the one
    place a reply's body is read; :class:`BadBody` when it does not fit), and its frame (a tensor
    that came with it)."""
    frame = await conn.call(msg.TYPE, msg.to_body(), tensor=tensor, payload=payload, plan=plan, timeout=timeout)
    if frame.type != expect.TYPE:
        raise BadBody(f"{msg.TYPE}: the reply is a {frame.type!r} frame, not {expect.TYPE!r}")
    return expect.decode(frame.body), frame


async def call(conn: Connection, msg: Message, expect: type[R], *, tensor: np.ndarray | None = None,
               payload: bytes | bytearray | memoryview | None = None, plan: int | None = None,
               timeout: float | None = None) -> R:
    """:func:`call_frame`'s reply alone."""
    got, _ = await call_frame(conn, msg, expect, tensor=tensor, payload=payload, plan=plan, timeout=timeout)
    return got
