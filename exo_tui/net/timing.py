"""Where a step's time goes, carried with the step itself.

Each node a step passes through appends one :class:`HopTiming` to the step's ``timing`` list:
``forward`` frames carry the list on to the next hop, and the last hop's ``token`` frame brings it
back to the coordinator (wire protocol 3). A record is a short list of plain values:
``[node_id, queue_s, compute_s, in_wall, out_wall]``:

* ``queue_s``: from the frame's arrival to the start of the run that computed it (on the node's
  monotonic clock);
* ``compute_s``: that run's time (a batch's whole run: the step waited for all of it);
* ``in_wall`` / ``out_wall``: ``time.time()`` at the frame's arrival and as the result went on.
  The node's residence (``out - in``) is exact; wall times of different hosts differ by their
  clocks' offset, so the coordinator uses them only to split the communication it measures
  (round trip minus the nodes' residences) between the links.

A record that does not parse is ignored (the step's token still counts): timing is for the
operator's figures, never a reason to fail a step.

A link's own latency and bandwidth, as a node measures them for the coordinator's ``link_probe``,
is :func:`measure_link`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from exo_tui.net.codec import call
from exo_tui.net.connection import Connection
from exo_tui.net.messages import Link, Ping, Pong

MAX_HOPS = 64  # a longer list is not a ring we made


@dataclass(frozen=True)
class HopTiming:
    node_id: str
    queue_s: float
    compute_s: float
    in_wall: float
    out_wall: float

    @property
    def residence_s(self) -> float:
        """Arrival to departure at the node."""
        return max(0.0, self.out_wall - self.in_wall)

    def to_wire(self) -> list[Any]:
        return [self.node_id, self.queue_s, self.compute_s, self.in_wall, self.out_wall]

    @classmethod
    def from_wire(cls, value: Any) -> HopTiming:
        if type(value) is not list or len(value) != 5 or type(value[0]) is not str:
            raise ValueError(f"a hop timing is [node_id, queue_s, compute_s, in_wall, out_wall], not {value!r:.80}")
        nums = value[1:]
        if any(type(x) not in (int, float) or not math.isfinite(x) for x in nums) or min(nums[:2]) < 0:
            raise ValueError(f"a hop timing holds finite non-negative seconds, not {value!r:.80}")
        return cls(value[0], float(nums[0]), float(nums[1]), float(nums[2]), float(nums[3]))


def timings_from_wire(value: Any) -> tuple[HopTiming, ...] | None:
    """The records of a frame's ``timing`` (None when absent or malformed)."""
    if type(value) is not list or not value or len(value) > MAX_HOPS:
        return None
    try:
        return tuple(HopTiming.from_wire(v) for v in value)
    except ValueError:
        return None


def hop_timing(node_id: str, received_s: float, started_s: float, compute_s: float) -> HopTiming:
    """This node's record of a step received at ``received_s`` and run from ``started_s`` for
    ``compute_s`` (monotonic seconds), as its result leaves now."""
    now_m, now_w = time.monotonic(), time.time()
    return HopTiming(node_id, max(0.0, started_s - received_s), max(0.0, compute_s),
                     now_w - (now_m - received_s), now_w)


async def measure_link(peer: Connection, pings: int, bandwidth_bytes: int = 0) -> Link:
    """The link to ``peer``: the median of ``pings`` round trips (latency is half of it) and, with
    ``bandwidth_bytes``, the rate of a ping carrying that many bytes beyond its round trip."""
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        await call(peer, Ping(t0), Pong, timeout=5)
        rtts.append(time.perf_counter() - t0)
    rtt_s = float(statistics.median(rtts))
    bandwidth = None
    if bandwidth_bytes:
        t0 = time.perf_counter()
        await call(peer, Ping(t0), Pong, payload=bytes(bandwidth_bytes), timeout=30)
        bandwidth = bandwidth_bytes / max(time.perf_counter() - t0 - rtt_s, 1e-6)
    return Link(rtt_s / 2, rtt_s, bandwidth)
