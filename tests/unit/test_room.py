"""What a memory-limited node's refused load says of its room, and the limit hint (cluster/room.py)."""

from __future__ import annotations

from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.cluster.room import RoomNotes, is_refusal, limit_needed
from exo_tui.net.dispatcher import error_frame, remote_error
from exo_tui.net.errors import RemoteError
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES
from exo_tui.node.profile import NodeProfile

MB = 1_000_000


def _handle(node_id: str, *, limit: int = 120 * MB, runtime_growth: int = 0, shard_bytes: int = 0) -> NodeHandle:
    profile = NodeProfile(node_id, node_id, "h", "linux", "x86_64", "3.11", "0", "cpu", 2, 2, 8 << 30, 4 << 30, limit,
                          "cpu", "", False, ["onnx"], runtime_baseline_bytes=100 * MB)
    h = NodeHandle(node_id, node_id, "127.0.0.1", 1, profile)
    h.shards = [{"start": 0, "end": 3, "held_bytes": shard_bytes}] if shard_bytes else []
    h.metrics["kv"] = {"runtime_bytes": 100 * MB + runtime_growth + shard_bytes, "used_bytes": 0}
    return h


def test_a_refusal_crosses_the_wire_with_its_figures() -> None:
    frame = error_frame("loading layers [0, 7) needs 64 MB", "no_room", {"need_bytes": 64 * MB, "room_bytes": 53 * MB})
    exc = remote_error(frame)
    assert is_refusal(exc) and exc.detail == {"need_bytes": 64 * MB, "room_bytes": 53 * MB}
    assert not is_refusal(remote_error(error_frame("busy", "error")))
    assert remote_error(error_frame("x", "no_room")).detail == {}


def test_a_refusal_sets_what_the_node_and_the_nodes_that_have_not_opened_the_file_grew_by() -> None:
    notes = RoomNotes()
    a, b, c = _handle("a", runtime_growth=5 * MB), _handle("b"), _handle("c", runtime_growth=2 * MB, shard_bytes=30 * MB)
    notes.attached("c", "m", holds=True)  # c holds shards of m: its reports count the file
    assert [notes.growth(h, "m") for h in (a, b, c)] == [5 * MB, 0, 2 * MB]
    # a's room: limit - reserve - growth: 120 - 48 - 24 = 48 MB; it grew 19 MB beyond its report
    room = 120 * MB - RESERVE_MIN_BYTES - 24 * MB
    notes.refused(a, RemoteError("no room", code="no_room", detail={"need_bytes": 60 * MB, "room_bytes": room}), "m")
    assert notes.growth(a, "m") == 24 * MB
    assert notes.growth(b, "m") == 19 * MB  # b will open the file too
    assert notes.growth(c, "m") == 2 * MB
    notes.loaded("b", "m")
    assert notes.growth(b, "m") == 0  # its next report counts what the load grew it by
    notes.attached("b", "m", holds=False)  # restarted: it opens the file again
    assert notes.growth(b, "m") == 19 * MB


def test_a_refusal_without_figures_changes_nothing() -> None:
    notes = RoomNotes()
    a = _handle("a", runtime_growth=5 * MB)
    notes.refused(a, RemoteError("no room", code="no_room"), "m")
    assert notes.growth(a, "m") == 5 * MB and notes.open_bytes == 0


def test_limit_needed_is_the_least_limit_that_fits() -> None:
    asked: list[int] = []

    def fits(limit: int) -> bool:
        asked.append(limit)
        return limit >= 137 * MB

    assert limit_needed(fits, 120 * MB, 1000 * MB) == 140 * MB  # to 0.01 GB, rounded up
    assert len(asked) < 12
    assert limit_needed(lambda _: False, 120 * MB, 1000 * MB) is None
