"""The wire frame: round trips, limits checked before allocating, and refusal of bad headers."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exo_tui.net.frame import (
    DTYPES,
    PROTOCOL_VERSION,
    Frame,
    FrameError,
    IncompleteFrame,
    Limits,
    ProtocolVersionError,
    decode_frame,
    encode_frame,
    frame_bytes,
    parse_header,
)

V = PROTOCOL_VERSION


def raw_frame(header: dict, payload: bytes = b"") -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(h)) + h + payload


# ------------------------------------------------------------------ round trips

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
bodies = st.dictionaries(st.text(max_size=12), plain, max_size=6)
types = st.text(min_size=1, max_size=20).filter(lambda s: len(s) <= 64)
tensors = st.sampled_from(["float32", "float16", "float64", "int8", "int32", "int64", "uint8", "uint16", "bool"]).flatmap(
    lambda d: hnp.arrays(np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
)


@settings(max_examples=200)
@given(
    ftype=types,
    body=bodies,
    fid=st.integers(0, 2**63 - 1),
    plan=st.none() | st.integers(0, 2**32),
    response=st.booleans(),
    lane=st.none() | st.text(min_size=1, max_size=10),
    content=st.one_of(st.none(), tensors, st.binary(max_size=300)),
)
def test_round_trip(ftype, body, fid, plan, response, lane, content):
    tensor = content if isinstance(content, np.ndarray) else None
    payload = content if isinstance(content, bytes) else None
    f = Frame(ftype, body, tensor, payload, plan, fid, response, lane)
    data = frame_bytes(f)
    g, used = decode_frame(data + b"tail")
    assert used == len(data)
    assert (g.type, g.body, g.plan, g.id, g.response, g.lane) == (ftype, body, plan, fid, response, lane)
    if tensor is not None:
        assert g.payload is None
        assert g.tensor.dtype == tensor.dtype and g.tensor.shape == tensor.shape
        np.testing.assert_array_equal(g.tensor, tensor)
    else:
        assert g.tensor is None
        assert g.payload == (payload or None)


def test_hidden_state_is_a_zero_copy_read_only_view():
    x = np.random.default_rng(0).standard_normal((1, 576), dtype=np.float32)
    g, _ = decode_frame(frame_bytes(Frame("forward", {"req": "r1"}, tensor=x, plan=3)))
    np.testing.assert_array_equal(g.tensor, x)
    root = g.tensor
    while isinstance(root, np.ndarray):
        root = root.base
    assert isinstance(root, bytes)  # np.frombuffer over the received bytes
    assert not g.tensor.flags.writeable


def test_non_contiguous_and_big_endian_tensors_are_sent_in_wire_order():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    g, _ = decode_frame(frame_bytes(Frame("t", tensor=x.T)))
    np.testing.assert_array_equal(g.tensor, x.T)
    be = np.arange(5, dtype=">i4")
    g, _ = decode_frame(frame_bytes(Frame("t", tensor=be)))
    assert g.tensor.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(g.tensor, [0, 1, 2, 3, 4])


def test_encode_refuses_what_the_wire_cannot_carry():
    with pytest.raises(TypeError, match="cannot be sent"):
        encode_frame(Frame("t", tensor=np.zeros(3, np.complex64)))
    with pytest.raises(TypeError, match="numpy"):
        encode_frame(Frame("t", tensor=[1.0, 2.0]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        encode_frame(Frame("t", tensor=np.zeros(3, np.float32), payload=b"x"))
    with pytest.raises(TypeError, match="msgpack cannot encode"):
        encode_frame(Frame("t", {"obj": object()}))


def test_unknown_header_fields_are_ignored():
    data = raw_frame({"v": V, "type": "ping", "id": 7, "future_field": [1, 2], "body": {"a": 1}})
    f, _ = decode_frame(data)
    assert (f.type, f.id, f.body) == ("ping", 7, {"a": 1})


def test_every_declared_dtype_decodes():
    for name, dt in DTYPES.items():
        x = np.ones((2, 3), dtype=dt)
        g, _ = decode_frame(frame_bytes(Frame("t", tensor=x)))
        assert g.tensor.dtype == dt and g.tensor.shape == (2, 3), name


# ------------------------------------------------------------------ limits, before allocation


def test_header_limit_is_checked_from_the_prefix():
    limits = Limits(header_bytes=128)
    with pytest.raises(FrameError, match="exceeds the limit of 128"):
        decode_frame(struct.pack(">I", 129), limits)
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_frame(b"\xff\xff\xff\xff")


def test_a_header_claiming_100_gb_is_refused_from_the_header_alone():
    header = {"v": V, "type": "forward", "dtype": "float32", "shape": [25_000_000_000], "nbytes": 100_000_000_000}
    data = raw_frame(header)  # no payload follows: nothing may wait for or allocate it
    with pytest.raises(FrameError, match="100000000000 bytes exceeds the limit of 268435456"):
        decode_frame(data)
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_frame(raw_frame({"v": V, "type": "chunk", "nbytes": 100_000_000_000}))


def test_payload_limit_is_configurable():
    data = frame_bytes(Frame("chunk", payload=b"x" * 2048))
    assert decode_frame(data, Limits(payload_bytes=2048))[0].payload == b"x" * 2048
    with pytest.raises(FrameError, match="2048 bytes exceeds the limit of 2047"):
        decode_frame(data, Limits(payload_bytes=2047))


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [([10], 39), ([10], 41), ([2, 3], 0), ([], 8), ([0], 4)],
)
def test_tensor_bytes_must_match_dtype_and_shape(shape, nbytes):
    data = raw_frame({"v": V, "type": "forward", "dtype": "float32", "shape": shape, "nbytes": nbytes}, b"\0" * nbytes)
    with pytest.raises(FrameError, match="needs .* bytes but the frame carries"):
        decode_frame(data)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"v": V + 1, "type": "ping"}, f"protocol {V + 1}, this process speaks {V}: upgrade"),
        ({"type": "ping"}, "protocol None"),
        ({"v": "1", "type": "ping"}, "protocol '1'"),
        ({"v": V}, "'type' must be a string"),
        ({"v": V, "type": ""}, "'type' must be a string"),
        ({"v": V, "type": "x" * 65}, "'type' must be a string"),
        ({"v": V, "type": "t", "id": -1}, "'id' must be an integer"),
        ({"v": V, "type": "t", "id": 2**63}, "'id' must be an integer"),
        ({"v": V, "type": "t", "id": 1.5}, "'id' must be an integer"),
        ({"v": V, "type": "t", "re": 1}, "'re' must be a boolean"),
        ({"v": V, "type": "t", "plan": "p"}, "'plan' must be an integer"),
        ({"v": V, "type": "t", "body": [1]}, "'body' must be a map"),
        ({"v": V, "type": "t", "lane": 3}, "'lane' must be a string"),
        ({"v": V, "type": "t", "dtype": "object", "shape": [1], "nbytes": 8}, "dtype 'object' is not supported"),
        ({"v": V, "type": "t", "dtype": "float32", "shape": [-1], "nbytes": 4}, "shape must be a list"),
        ({"v": V, "type": "t", "dtype": "float32", "shape": "4", "nbytes": 4}, "shape must be a list"),
        ({"v": V, "type": "t", "dtype": "float32", "shape": [1] * 17, "nbytes": 4}, "shape must be a list"),
        ({"v": V, "type": "t", "shape": [1], "nbytes": 4}, "shape but no dtype"),
        ({"v": V, "type": "t", "nbytes": -5}, "'nbytes' must be an integer"),
    ],
)
def test_bad_headers_are_refused(header, match):
    with pytest.raises(FrameError, match=match):
        parse_header(msgpack.packb(header, use_bin_type=True))


def test_protocol_version_error_says_what_to_do():
    with pytest.raises(ProtocolVersionError) as e:
        parse_header(msgpack.packb({"v": V + 1, "type": "ping"}))
    assert e.value.peer_version == V + 1 and e.value.code == "protocol_version"


def test_header_must_be_a_string_keyed_map_of_plain_values():
    with pytest.raises(FrameError, match="must be a map"):
        parse_header(msgpack.packb([1, "ping"]))
    with pytest.raises(FrameError, match="not valid msgpack"):
        parse_header(msgpack.packb({1: "x", "v": V, "type": "t"}))  # strict_map_key
    with pytest.raises(FrameError, match="map keys must be strings"):
        parse_header(msgpack.packb({"v": V, "type": "t", "body": {b"k": 1}}, use_bin_type=True))
    with pytest.raises(FrameError, match="not valid msgpack"):
        parse_header(b"\xc1garbage")
    with pytest.raises(FrameError, match="not valid msgpack"):
        parse_header(msgpack.packb({"v": V, "type": "t"}) + b"\x00")  # trailing bytes


def test_no_extension_types_and_no_pickle():
    import pickle

    ext = msgpack.packb({"v": V, "type": "t", "body": {"x": msgpack.ExtType(42, b"\x80\x04N.")}})
    with pytest.raises(FrameError, match="extension type 42"):
        parse_header(ext)
    ts = msgpack.packb({"v": V, "type": "t", "body": {"x": msgpack.Timestamp(1, 0)}})
    with pytest.raises(FrameError, match="Timestamp"):
        parse_header(ts)
    with pytest.raises(FrameError):
        parse_header(pickle.dumps({"v": V, "type": "t"}))


def test_truncated_frames_are_incomplete():
    data = frame_bytes(Frame("forward", {"a": 1}, tensor=np.ones(8, np.float32)))
    for cut in (0, 2, 4, 6, len(data) - 1):
        with pytest.raises(IncompleteFrame):
            decode_frame(data[:cut])


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(header_bytes=1)
    with pytest.raises(ValueError):
        Limits(payload_bytes=-1)
    with pytest.raises(ValueError):
        Limits(frame_timeout_s=0)


def test_payload_memoryview_counts_bytes():
    mv = memoryview(np.arange(6, dtype=np.float32).reshape(2, 3))
    g, _ = decode_frame(frame_bytes(Frame("chunk", payload=mv)))
    assert g.payload == mv.tobytes() and len(g.payload) == 24
