"""The wire frame: a length-prefixed msgpack header, then raw tensor or payload bytes.

::

    +-----------------+------------------------------+---------------------------+
    | u32 big-endian  | msgpack map (the header)     | nbytes raw bytes          |
    | header length   | v type id plan dtype shape   | (C-contiguous tensor,     |
    |                 | nbytes body lane re          |  little-endian, or blob)  |
    +-----------------+------------------------------+---------------------------+

Header keys (unknown keys are ignored, so later versions can add some):

========  =====================================================================
``v``     protocol version (int); a frame of another version is refused
``type``  what the frame is (str, at most 64 characters): ``forward``, ``error``...
``id``    request id (int); ``0`` for one-way frames. A response carries the id of its request
``re``    ``true`` on a response (so ids chosen by the two sides never collide)
``plan``  plan version the frame belongs to (int), or absent
``dtype`` tensor dtype name (one of :data:`DTYPES`), absent when the payload is not a tensor
``shape`` tensor shape (list of ints)
``nbytes`` number of raw bytes after the header; must equal ``prod(shape) * itemsize`` for a tensor
``lane``  ordering lane of a one-way frame (str); see :mod:`exo_tui.net.connection`
``body``  free-form map of plain values (str keys; nil, bool, int, float, str, bin, arrays, maps)
========  =====================================================================

No pickle, ever, and no msgpack extension types: headers decode with ``raw=False``,
``strict_map_key=True`` and a hook that refuses every ext type; the decoded header is then walked
to make sure it holds plain values only. Sizes are checked against :class:`Limits` *before*
anything is allocated: a header claiming a 100 GB payload is refused from its 30 bytes.

A tensor received is ``np.frombuffer`` over the received bytes: no copy, and read-only (copy it if
you need to write into it).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 3
"""Version of the wire protocol (frames and handshake). Both ends must speak the same one.
3: ``forward`` and ``token`` bodies carry each hop's timing (:mod:`exo_tui.net.timing`)."""

MIB = 1 << 20

#: dtype names accepted on the wire, mapped to little-endian NumPy dtypes.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "float32", "float16", "float64",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "bool",
    )
}
_DTYPE_NAMES: dict[np.dtype, str] = {np.dtype(name): name for name in DTYPES}

MAX_TYPE_LEN = 64
MAX_NDIM = 16
_PREFIX = struct.Struct(">I")
PREFIX_SIZE = _PREFIX.size
_MAX_ID = (1 << 63) - 1


class FrameError(Exception):
    """A frame broke the protocol. The connection it came on is closed with an ``error`` frame."""

    code = "bad_frame"


class ProtocolVersionError(FrameError):
    """The peer speaks another protocol version."""

    code = "protocol_version"

    def __init__(self, peer_version: Any, message: str | None = None) -> None:
        self.peer_version = peer_version
        super().__init__(
            message
            or f"peer speaks exo-tui protocol {peer_version!r}, this process speaks {PROTOCOL_VERSION}: "
            "upgrade exo-tui on the older side so both match"
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits checked before allocating. ``frame_timeout_s``: once the first bytes of a frame's
    header have arrived, the rest of the frame must arrive within this time (a stalled half frame
    would otherwise hold the connection forever)."""

    header_bytes: int = 1 * MIB
    payload_bytes: int = 256 * MIB
    frame_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 64 <= self.header_bytes <= 0xFFFFFFFF:
            raise ValueError(f"header limit {self.header_bytes} must be between 64 and 2**32-1 bytes")
        if self.payload_bytes < 0:
            raise ValueError("payload limit must be >= 0")
        if self.frame_timeout_s <= 0:
            raise ValueError("frame timeout must be > 0")


DEFAULT_LIMITS = Limits()


@dataclass(slots=True)
class Frame:
    """One message. ``tensor`` and ``payload`` are mutually exclusive (or both ``None``).

    ``id``, ``response`` and ``lane`` are filled in by :mod:`exo_tui.net.connection`; applications
    set ``type``, ``body``, ``tensor`` / ``payload`` and ``plan``.
    """

    type: str
    body: dict[str, Any] = field(default_factory=dict)
    tensor: np.ndarray | None = None
    payload: bytes | bytearray | memoryview | None = None
    plan: int | None = None
    id: int = 0
    response: bool = False
    lane: str | None = None

    def __post_init__(self) -> None:
        if self.body is None:
            self.body = {}


def _ext_refused(code: int, data: bytes) -> Any:
    raise FrameError(f"msgpack extension type {code} is not allowed in a header")


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_KNOWN_KEYS = frozenset({"v", "type", "id", "re", "plan", "dtype", "shape", "nbytes", "body", "lane"})


def _check_plain(value: Any) -> None:
    """Refuse anything but nil/bool/int/float/str/bin/array/map with string keys (a msgpack
    Timestamp, the one extension type msgpack decodes itself, would be refused here)."""
    stack = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        v = pop()
        t = type(v)
        if t in _SCALARS:
            continue
        if t is dict:
            for k in v:
                if type(k) is not str:
                    raise FrameError("header map keys must be strings")
            extend(v.values())
        elif t is list:
            extend(v)
        else:
            raise FrameError(f"header holds a value of type {t.__name__}, only plain values are allowed")


def header_length(prefix: bytes, limits: Limits = DEFAULT_LIMITS) -> int:
    """Decode and check the 4-byte prefix."""
    n: int = _PREFIX.unpack(prefix)[0]
    if n == 0:
        raise FrameError("empty header")
    if n > limits.header_bytes:
        raise FrameError(f"header of {n} bytes exceeds the limit of {limits.header_bytes} bytes")
    return n


@dataclass(slots=True)
class Header:
    """A checked header: everything needed to read and build the frame."""

    type: str
    id: int
    response: bool
    plan: int | None
    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    nbytes: int
    body: dict[str, Any]
    lane: str | None


def _int(h: dict[str, Any], key: str, *, default: Any = None, lo: int = 0, hi: int = _MAX_ID) -> Any:
    v = h.get(key, default)
    if v is default:
        return v
    if type(v) is not int or not lo <= v <= hi:
        raise FrameError(f"header field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def parse_header(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Decode and validate a header. Raises :class:`FrameError` (or :class:`ProtocolVersionError`)."""
    try:
        h = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_refused, use_list=True)
    except FrameError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError...)
        raise FrameError(f"header is not valid msgpack: {type(e).__name__}: {str(e) or 'malformed bytes'}") from None
    if type(h) is not dict:
        raise FrameError(f"header must be a map, got {type(h).__name__}")
    for k, val in h.items():  # known fields are type-checked one by one below; walk the rest
        if type(k) is not str:
            raise FrameError("header map keys must be strings")
        if k not in _KNOWN_KEYS or k == "body":
            _check_plain(val)
    v = h.get("v")
    if v != PROTOCOL_VERSION or type(v) is not int:
        raise ProtocolVersionError(v)
    ftype = h.get("type")
    if type(ftype) is not str or not 0 < len(ftype) <= MAX_TYPE_LEN:
        raise FrameError(f"header field 'type' must be a string of 1..{MAX_TYPE_LEN} characters, got {ftype!r}")
    fid = _int(h, "id", default=0)
    response = h.get("re", False)
    if type(response) is not bool:
        raise FrameError("header field 're' must be a boolean")
    plan = _int(h, "plan")
    nbytes = _int(h, "nbytes", default=0)
    if nbytes > limits.payload_bytes:
        raise FrameError(f"payload of {nbytes} bytes exceeds the limit of {limits.payload_bytes} bytes")
    body = h.get("body", {})
    if type(body) is not dict:
        raise FrameError("header field 'body' must be a map")
    lane = h.get("lane")
    if lane is not None and (type(lane) is not str or not 0 < len(lane) <= MAX_TYPE_LEN):
        raise FrameError(f"header field 'lane' must be a string of 1..{MAX_TYPE_LEN} characters")
    dtype = shape = None
    dname = h.get("dtype")
    if dname is not None:
        dtype = DTYPES.get(dname) if type(dname) is str else None
        if dtype is None:
            raise FrameError(f"tensor dtype {dname!r} is not supported (supported: {', '.join(DTYPES)})")
        s = h.get("shape")
        if not isinstance(s, list) or len(s) > MAX_NDIM or any(type(d) is not int or d < 0 for d in s):
            raise FrameError(f"tensor shape must be a list of at most {MAX_NDIM} non-negative integers, "
                             f"got {_short(s)}")
        shape = tuple(s)
        # Zero dimensions make any product 0: bound the others as if they were 1, so that a shape
        # like [0, 2**62] is refused here rather than by NumPy later.
        spread = math.prod(d for d in shape if d) * dtype.itemsize
        if spread > max(limits.payload_bytes, dtype.itemsize):
            raise FrameError(f"tensor shape {_short(s)} exceeds the payload limit of {limits.payload_bytes} bytes")
        want = math.prod(shape) * dtype.itemsize
        if want != nbytes:
            raise FrameError(
                f"tensor {dname}{list(shape)} needs {want} bytes but the frame carries {nbytes}"
            )
    elif "shape" in h:
        raise FrameError("header has a tensor shape but no dtype")
    return Header(ftype, fid, response, plan, dtype, shape, nbytes, body, lane)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_frame(header: Header, payload: bytes | bytearray | None) -> Frame:
    """Make the :class:`Frame` from a checked header and exactly ``header.nbytes`` bytes."""
    tensor = None
    if header.dtype is not None:
        try:
            tensor = np.frombuffer(payload or b"", dtype=header.dtype).reshape(header.shape)
        except (ValueError, TypeError) as e:  # parse_header's checks make this unreachable; stay a bad frame
            raise FrameError(f"tensor {header.dtype}{list(header.shape or ())} cannot be built: {e}") from None
        tensor.flags.writeable = False  # read-only, whether the bytes came as bytes or a bytearray
        payload = None
    return Frame(header.type, header.body, tensor, payload, header.plan, header.id, header.response, header.lane)


def _tensor_view(tensor: np.ndarray) -> tuple[str, np.ndarray]:
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"tensor must be a numpy.ndarray, got {type(tensor).__name__} (convert it first)")
    dt = tensor.dtype
    name = _DTYPE_NAMES.get(dt if dt.byteorder in "=|<" else dt.newbyteorder("<"))
    if name is None:
        raise TypeError(f"tensor dtype {dt} cannot be sent (supported: {', '.join(DTYPES)})")
    if dt.byteorder == ">" or not tensor.flags.c_contiguous:
        tensor = np.ascontiguousarray(tensor, dtype=DTYPES[name])
    return name, tensor


def encode_frame(frame: Frame) -> tuple[bytes, memoryview | bytes | None]:
    """Encode a frame into (prefix + header, raw bytes or ``None``), ready for ``writelines``."""
    h: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": frame.type, "id": frame.id}
    raw: Any = None
    if frame.response:
        h["re"] = True
    if frame.plan is not None:
        h["plan"] = frame.plan
    if frame.lane is not None:
        h["lane"] = frame.lane
    if frame.body:
        h["body"] = frame.body
    if frame.tensor is not None:
        if frame.payload is not None:
            raise ValueError("a frame carries a tensor or a payload, not both")
        name, t = _tensor_view(frame.tensor)
        h["dtype"] = name
        h["shape"] = list(t.shape)
        h["nbytes"] = t.nbytes
        if t.nbytes:
            raw = t.reshape(-1).view(np.uint8).data
    elif frame.payload is not None:
        raw = frame.payload
        if isinstance(raw, memoryview) and (raw.ndim != 1 or raw.itemsize != 1):
            raw = raw.cast("B")  # len() must count bytes
        h["nbytes"] = len(raw)
        if not h["nbytes"]:
            raw = None
    try:
        header = msgpack.packb(h, use_bin_type=True, datetime=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"frame body of {frame.type!r} holds a value msgpack cannot encode: {e}") from None
    return _PREFIX.pack(len(header)) + header, raw


def frame_bytes(frame: Frame) -> bytes:
    """The whole frame as one ``bytes`` (tests, tools; the RPC layer writes the parts without joining)."""
    head, raw = encode_frame(frame)
    return head + bytes(raw) if raw is not None else head


def decode_frame(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> tuple[Frame, int]:
    """Decode one whole frame from the start of ``data``; returns (frame, bytes consumed).

    Raises :class:`FrameError` for a bad frame and :class:`IncompleteFrame` when ``data`` ends early.
    """
    mv = memoryview(data)
    if len(mv) < PREFIX_SIZE:
        raise IncompleteFrame("frame shorter than its length prefix")
    n = header_length(bytes(mv[:PREFIX_SIZE]), limits)
    if len(mv) < PREFIX_SIZE + n:
        raise IncompleteFrame("frame ends inside its header")
    header = parse_header(mv[PREFIX_SIZE : PREFIX_SIZE + n], limits)
    end = PREFIX_SIZE + n + header.nbytes
    if len(mv) < end:
        raise IncompleteFrame("frame ends inside its payload")
    payload = bytes(mv[PREFIX_SIZE + n : end]) if header.nbytes else None
    return build_frame(header, payload), end


class IncompleteFrame(FrameError):
    """The stream ended in the middle of a frame."""

    code = "truncated_frame"
