"""Typed frame bodies (exo_tui.net.messages over exo_tui.net.codec): every message goes through a
real frame's encoding and comes back equal, and a body with any field of the wrong type, a
required field missing or a field the message does not have is refused with the op and the field
named."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any

import pytest

from exo_tui.net import messages as m
from exo_tui.net.codec import Message
from exo_tui.net.errors import BadBody
from exo_tui.net.frame import Frame, decode_frame, frame_bytes
from exo_tui.net.protocol import PlanEntry, RingPlan

PLAN = RingPlan(3, 4, (PlanEntry("n1", "10.0.0.1", 52416, 0, 2, "onnx"), PlanEntry("n2", "::1", 52417, 2, 4)), "m")

# One of each message, its optional fields set where it has them (so that they travel too).
SAMPLES: list[Message] = [
    m.ScoreAsk(top=2, targets=[5, 6]),
    m.DraftQ(counts=[2], ids=b"\x07\0\0\0\x08\0\0\0", probs=b"\0\0\0?\0\0\0?"),
    m.Forward(rid="r", hop=1, pos=12, step=-3, n_tokens=13, sampling={"temperature": 0.7, "seed": 4}, fill=True,
              history=[1, 2, 3], adopt="old", logprobs=2, score=m.ScoreAsk(1, [2]), more=3,
              timing=[["n1", 0.0, 0.01, 1.5, 1.6]], draft=[7, 8],
              draft_q=m.DraftQ(counts=[1, 1], ids=b"\x07\0\0\0\x08\0\0\0", probs=b"\0\0\x80?\0\0\x80?")),
    m.Token(rid="r", step=4, token=17, timing=[["n1", 0.0, 0.01, 1.5, 1.6]], logprobs=[17, -0.5, [[17, -0.5]]],
            scored=True, tokens=[7, 17], accepted=1, listed=[[7, -0.1, []], [17, -0.5, []]]),
    m.DraftStep(rid="r", path="/d.gguf", pos=12, k=4, backend="onnx", sampling={"temperature": 0.7, "seed": 4}),
    m.Drafted(tokens=[7, 8, 9], lost=True, nbytes=100, q=m.DraftQ([3], b"\0" * 12, b"\0" * 12)),
    m.Drafted(tokens=[], refused="no room for the draft model's cache"),
    m.StepFailed(rid="r", error="boom", step=None, node_id="n2", failed_node="n3", kv_budget=True),
    m.Heartbeat(metrics={"cpu_percent": 3.5, "kv": {"budget_bytes": 10}}, t=1.25),
    m.HeldShard(start=0, end=2, backend="onnx", nbytes=100, model="m", held_bytes=90, precision="int8"),
    m.Attach(term=3),
    m.Attached(profile={"node_id": "n1"}, shards=[m.HeldShard(0, 2, "onnx", 100)], plans=[1, 3], port=52416,
               kv={"budget_bytes": 10}),
    m.ProfileAsk(),
    m.Profile(profile={"node_id": "n1"}),
    m.Load(path="/m.gguf", start=0, end=2, backend="mlx", model="m", context=4096),
    m.TensorSpec(name="blk.0.attn_q.weight", type="Q4_0", shape=[64, 64], nbytes=2304),
    m.LoadBegin(transfer_id="t-1", config={"n_layers": 4}, start=0, end=2,
                tensors=[m.TensorSpec("a", "F32", [2], 8)], backend="onnx", model="m"),
    m.LoadChunk(transfer_id="t-1", offset=8, sha256="ab" * 32),
    m.ChunkReceived(received=16),
    m.LoadCommit(transfer_id="t-1"),
    m.Loaded(start=0, end=2, backend="onnx", nbytes=100, held_bytes=90, kv={"budget_bytes": 10}),
    m.Unload(start=0, end=2, model="m"),
    m.Unloaded(unloaded=True, kv={"budget_bytes": 10}),
    PLAN.ring[0],
    PLAN,
    m.PlanOp(plan=PLAN),
    m.Plans(plans=[2, 3]),
    m.KVExport(rid="r", start=0, end=2, model="m", length=18),
    m.KV(length=20, held=[8, 20]),
    m.KVImport(rid="r", start=0, end=2, length=20, held=[8, 20], model="m"),
    m.Drop(rid="r", final=True),
    m.Ping(t=1.5),
    m.Pong(t=1.5, node_id="n1"),
    m.LinkProbe(host="10.0.0.2", port=52416, pings=3, bandwidth_bytes=1 << 20),
    m.Link(latency_s=0.001, rtt_s=0.002, bandwidth_bytes_per_s=1e9),
    m.Done(),
]


def _all_messages(cls: type = Message) -> set[type]:
    """Every message class (the ones their modules name: ``dataclass(slots=True)`` leaves the class
    it replaced among the subclasses)."""
    out = set()
    for sub in cls.__subclasses__():
        if getattr(sys.modules[sub.__module__], sub.__name__, None) is sub:
            out.add(sub)
        out |= _all_messages(sub)
    return out


def test_every_message_has_a_sample() -> None:
    assert _all_messages() == {type(s) for s in SAMPLES}


def _on_the_wire(msg: Message) -> dict[str, Any]:
    """The body as the peer decodes it from a real frame's bytes."""
    frame, _ = decode_frame(frame_bytes(Frame(msg.TYPE or "x", body=msg.to_body())))
    return frame.body


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_message_comes_back_equal_through_a_frame(msg: Message) -> None:
    assert type(msg).decode(_on_the_wire(msg)) == msg


def test_fields_left_at_their_default_stay_off_the_wire() -> None:
    step = m.Forward(rid="r", hop=0, pos=0, step=0, n_tokens=3)
    assert step.to_body() == {"rid": "r", "hop": 0, "pos": 0, "step": 0, "n_tokens": 3, "sampling": {}}
    assert m.Forward.decode(step.to_body()) == step
    assert m.Token("r", 1, 2).to_body() == {"rid": "r", "step": 1, "token": 2}


def _wrong(tp: Any) -> tuple[Any, str]:
    """A value of another type than ``tp``, and what the refusal says the field must be."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    origin = typing.get_origin(tp)
    if tp is int:
        return "1", "must be an int, got str"
    if tp is float:
        return "1.5", "must be a number, got str"
    if tp is str:
        return 1, "must be a string, got int"
    if tp is bool:
        return 1, "must be a bool, got int"
    if tp is bytes:
        return "ab", "must be bytes, got str"
    if origin in (list, tuple):
        return {"a": 1}, "must be a list of "
    if origin is dict or (isinstance(tp, type) and issubclass(tp, Message)):
        return [1], "must be a map, got list"
    raise AssertionError(f"no wrong value for {tp!r}")


CASES = [(type(s), f.name) for s in SAMPLES for f in dataclasses.fields(s)  # type: ignore[arg-type]
         if typing.get_type_hints(type(s))[f.name] is not Any]


@pytest.mark.parametrize(("cls", "name"), CASES, ids=[f"{c.__name__}.{n}" for c, n in CASES])
def test_a_field_of_the_wrong_type_is_refused_by_name(cls: type[Message], name: str) -> None:
    sample = next(s for s in SAMPLES if type(s) is cls)
    value, says = _wrong(typing.get_type_hints(cls)[name])
    with pytest.raises(BadBody, match=None) as refused:
        cls.decode({**_on_the_wire(sample), name: value})
    assert str(refused.value).startswith(f"{cls.TYPE or cls.__name__}: field '{name}' {says}")
    assert refused.value.code == "bad_body"


REQUIRED = [(type(s), f.name) for s in SAMPLES for f in dataclasses.fields(s)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize(("cls", "name"), REQUIRED, ids=[f"{c.__name__}.{n}" for c, n in REQUIRED])
def test_a_required_field_missing_is_refused_by_name(cls: type[Message], name: str) -> None:
    sample = next(s for s in SAMPLES if type(s) is cls)
    body = {k: v for k, v in _on_the_wire(sample).items() if k != name}
    with pytest.raises(BadBody, match=f"field '{name}' is missing"):
        cls.decode(body)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_a_field_the_message_does_not_have_is_refused(msg: Message) -> None:
    with pytest.raises(BadBody, match="field 'drafts' is not a field of"):
        type(msg).decode({**_on_the_wire(msg), "drafts": [1, 2]})


@pytest.mark.parametrize(("body", "says"), [
    ({"score": {"top": 1}}, "forward: field 'score.targets' is missing"),
    ({"score": {"top": 1, "targets": [1, 2.0]}}, "forward: field 'score.targets' must be a list of ints, got float at index 1"),
    ({"score": {"top": "1", "targets": []}}, "forward: field 'score.top' must be an int, got str"),
    ({"history": [1, None]}, "forward: field 'history' must be a list of ints, got nil at index 1"),
    ({"hop": True}, "forward: field 'hop' must be an int, got bool"),
    ({"rid": None}, "forward: field 'rid' must be a string, got nil"),
])
def test_nested_and_listed_values_are_checked_too(body: dict[str, Any], says: str) -> None:
    sample = next(s for s in SAMPLES if isinstance(s, m.Forward))
    with pytest.raises(BadBody) as refused:
        m.Forward.decode({**sample.to_body(), **body})
    assert str(refused.value) == says


def test_a_plan_in_its_message_is_checked_for_its_layers_once_decoded() -> None:
    got = m.PlanOp.decode(_on_the_wire(m.PlanOp(PLAN))).plan
    assert got.check() is got and got.ring[1].host == "::1"
    gap = RingPlan(4, 4, (PlanEntry("n1", "h", 1, 0, 1), PlanEntry("n2", "h", 2, 2, 4)))
    with pytest.raises(Exception, match="not a contiguous ring"):
        m.PlanOp.decode(_on_the_wire(m.PlanOp(gap))).plan.check()
