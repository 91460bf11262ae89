"""The RPC layer on loopback: calls, one-way lanes, closing, security refusals and bad input.

Every server and connection a test opens is closed in a ``finally`` (the ``running`` helper), so a
failing test leaves nothing listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_tui.net import (
    AuthError,
    Cluster,
    ConnectError,
    ConnectionClosed,
    Dispatcher,
    Frame,
    HandshakeError,
    Limits,
    ProtocolMismatch,
    RemoteError,
    Security,
    UnknownFrameType,
    auth,
    connect,
    ensure_cluster,
    serve,
    write_node_bundle,
)
from exo_tui.net.client import open_authenticated
from exo_tui.net.frame import DTYPES, PROTOCOL_VERSION, FrameError, IncompleteFrame, decode_frame, frame_bytes
from exo_tui.net.gate import HandshakeGate
from exo_tui.net.transport import peer_identity
from tests.helpers.wire import raw_frame, read_to_eof

NET = "exo_tui.net"
V = PROTOCOL_VERSION
HOST = "127.0.0.1"


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path / "home"))
    return ensure_cluster()


@pytest.fixture
def coord(cluster: Cluster) -> Security:
    return cluster.security()


@pytest.fixture
def node(cluster: Cluster) -> Security:
    return Security.from_bundle(cluster.node_bundle("node-a"))


class App:
    """The server side of the tests: a few routes with real behaviour."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.d = Dispatcher()
        self.d.add("echo", self.echo)
        self.d.add("sleep", self.sleep)
        self.d.add("fail", self.fail)
        self.d.add("boom", self.boom)
        self.d.add("record", self.record)
        self.d.add("slow", self.record)
        self.d.add("callback", self.callback)

    async def echo(self, conn, f: Frame) -> Frame:
        return Frame("echo", body=f.body, tensor=f.tensor, payload=f.payload, plan=f.plan)

    async def sleep(self, conn, f: Frame) -> Frame:
        await asyncio.sleep(f.body["s"])
        return Frame("slept", {"s": f.body["s"]})

    async def fail(self, conn, f: Frame) -> Frame:
        raise RemoteError("no shard for layers 3-5 on this node", code="no_shard")

    async def boom(self, conn, f: Frame) -> Frame:
        raise ValueError("kaboom")

    async def record(self, conn, f: Frame) -> None:
        if f.body.get("s"):
            await asyncio.sleep(f.body["s"])
        self.seen.append((f.type, f.body["i"]))

    async def callback(self, conn, f: Frame) -> Frame:
        r = await conn.call("hello", {"from": "server"})
        return Frame("done", {"client_said": r.body})


@contextlib.asynccontextmanager
async def running(security: Security, handler=None, **kw):
    server = await serve(handler if handler is not None else App().d, HOST, 0, security=security, **kw)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


async def until(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def frames_in(data: bytes) -> list[Frame]:
    out, pos = [], 0
    while pos < len(data):
        f, n = decode_frame(data[pos:])
        out.append(f)
        pos += n
    return out


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NET and "refused connection from 127.0.0.1:" in r.getMessage()]


# ------------------------------------------------------------------ event loops


class HeldServer:
    """A server on its own thread and event loop (as in a node process), whose loop the test can
    hold busy: bytes clients send meanwhile are in the socket before the server's accept runs."""

    def __init__(self, security: Security) -> None:
        self.security = security
        self.port = 0
        self.loop_name = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from exo_tui.net import loop as event_loop

        async def main() -> None:
            async with running(self.security) as server:
                self.port, self._loop = server.port, asyncio.get_running_loop()
                self.loop_name = event_loop.loop_name()
                self._ready.set()
                while not self._stop.is_set():
                    await asyncio.sleep(0.01)

        event_loop.run(main())

    def hold(self, seconds: float) -> None:
        """Block the server's loop for ``seconds``, from the moment this returns."""
        busy = threading.Event()

        def block() -> None:
            busy.set()
            time.sleep(seconds)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(block)
        assert busy.wait(5)

    def __enter__(self) -> HeldServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_first_bytes_sent_before_the_server_looks_are_not_lost(
    coord: Security, node: Security, tls: bool, loop: str, monkeypatch: pytest.MonkeyPatch
):
    """A node serves on uvloop (exo_tui.net.loop). Its loop is held busy while clients connect
    and send their first bytes (the ClientHello, or the plain handshake), so those bytes are in
    the socket before the server's accept runs: every connection must still complete, and calls
    go through. Before the fix, about half the TLS connections to a uvloop server hung."""
    from exo_tui.net import loop as event_loop

    monkeypatch.setenv(event_loop.ENV, loop)
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    with HeldServer(node) as server:
        assert server.loop_name == loop
        for _ in range(3):
            server.hold(0.3)
            conns = await asyncio.gather(*[connect(HOST, server.port, security=coord, timeout=5.0) for _ in range(4)])
            try:
                replies = await asyncio.gather(*[c.call("echo", {"i": i}) for i, c in enumerate(conns)])
                assert [r.body for r in replies] == [{"i": i} for i in range(4)]
            finally:
                for c in conns:
                    c.close()


# A flood that is not TLS from its first byte, and one that starts as a TLS record (so the server
# waits for the handshake) and goes on sending: either is cut off, whichever way it first fails.
FLOODS = {
    "not-tls": (b"\x00" + os.urandom((1 << 20) - 1), ("its first bytes are not TLS",)),
    "tls-record-then-more": (
        b"\x16\x03\x01\x02\x00" + os.urandom((1 << 20) - 5),
        ("bytes before the TLS handshake", "TLS handshake failed"),
    ),
}


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("flood", FLOODS)
async def test_a_flood_before_the_tls_handshake_is_refused(
    coord: Security, node: Security, loop: str, flood: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    """The bytes held for TLS before the handshake are bounded: a peer that sends 1 MiB at once
    (no TLS client does) is cut off and logged, and the server goes on serving."""
    from exo_tui.net import loop as event_loop

    data, reasons = FLOODS[flood]
    monkeypatch.setenv(event_loop.ENV, loop)
    caplog.set_level(logging.WARNING, logger=NET)
    with HeldServer(node) as server:
        server.hold(0.3)
        reader, writer = await asyncio.open_connection(HOST, server.port)
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        assert await read_to_eof(reader) == b""
        writer.close()
        async with await connect(HOST, server.port, security=coord) as conn:
            assert (await conn.call("echo", {"ok": 1})).body == {"ok": 1}
    assert any(r in m for m in refusals(caplog) for r in reasons), refusals(caplog)


def _client_hello() -> bytes:
    """A real TLS ClientHello, for a stranger that starts a handshake and then stalls."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def _stalled_stranger(port: int, source: str) -> asyncio.StreamWriter:
    _reader, writer = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    writer.write(_client_hello())  # then never answers the server's hello
    await writer.drain()
    return writer


@pytest.mark.skipif(sys.platform != "linux", reason="sources 127.0.0.2-3 need Linux's whole 127/8 on loopback")
async def test_strangers_in_handshake_leave_the_reserved_slots_to_proved_peers(coord: Security, node: Security, tmp_path,
                                                                              caplog):
    """Strangers that stall inside TLS fill their share of the slots and their address's cap (the
    coordinator's own address, 127.0.0.1, too); the coordinator, whose ClientHello proves the
    cluster key, still gets in; a client without that proof is told the real cause."""
    caplog.set_level(logging.WARNING, logger=NET)
    gate = HandshakeGate(total=4, reserved=2, per_address=1)
    async with running(node, gate=gate) as server:
        strangers = [await _stalled_stranger(server.port, source) for source in ("127.0.0.1", "127.0.0.2")]
        try:
            await until(lambda: len(gate) == 2 and all(t.hello and not t.proved for t in gate._tickets))
            for refused, source in enumerate(("127.0.0.1", "127.0.0.3"), 1):  # its address's cap; the share
                late = await _stalled_stranger(server.port, source)
                await until(lambda n=refused: server.refused >= n)
                late.transport.abort()
            for n in range(3):  # the coordinator, from 127.0.0.1: proved, every time
                async with await connect(HOST, server.port, security=coord, timeout=3) as conn:
                    assert (await conn.call("echo", {"n": n})).body == {"n": n}
            other = ensure_cluster(tmp_path / "other").security()  # its proof is of another key
            with pytest.raises(HandshakeError, match="busy refusing handshakes"):
                await connect(HOST, server.port, security=other, timeout=3)
        finally:
            for w in strangers:
                w.transport.abort()
    messages = [r.getMessage() for r in caplog.records]
    assert any("1 handshakes from 127.0.0.1 are already in progress" in m for m in messages), messages
    assert any("without a proof of the cluster key are in progress" in m for m in messages), messages


async def test_only_a_whole_client_hello_on_a_live_connection_keeps_its_slot_from_being_dropped():
    """The gate may not drop a connection whose ClientHello is in (TLSFirst.client_hello_in), but
    junk, a part of a hello, or a connection gone since stay droppable: a flood of them must not
    hold slots a legitimate link needs."""
    from exo_tui.net.transport import TLSFirst

    class Plain(asyncio.Transport):
        def pause_reading(self) -> None:
            pass

    def fed(*chunks: bytes, lost: bool = False) -> TLSFirst:
        p = TLSFirst(asyncio.StreamReader())
        p.connection_made(Plain())
        for c in chunks:
            p.data_received(c)
        if lost:
            p.connection_lost(None)
        return p

    hello = _client_hello()
    assert fed(hello).client_hello_in
    assert not fed(hello[:20]).client_hello_in  # a part of it
    assert not fed(b"GET / HTTP/1.1\r\n\r\n").client_hello_in  # not TLS
    assert not fed(hello, lost=True).client_hello_in  # gone before its task read it


async def test_a_client_dropped_before_its_client_hello_was_read_connects_again(coord: Security, node: Security):
    """A node under a flood drops the oldest connection whose ClientHello has not arrived, and a
    legitimate client whose loop was slow to send its own can be that one (test_hostile's flood
    lost 1 of 10 links so under a second test worker). The client connects again, a few times:
    here a front that drops its first two connections unanswered, then one that always does."""
    accepted = 0

    async def serve_front(dropping: int, port: int) -> asyncio.Server:
        async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            if accepted <= dropping:
                writer.transport.abort()  # as the gate's drop does
                return
            up_reader, up_writer = await asyncio.open_connection(HOST, port)

            async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                with contextlib.suppress(ConnectionError):
                    while data := await r.read(1 << 16):
                        w.write(data)
                        await w.drain()
                w.close()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        return await asyncio.start_server(front, HOST, 0)

    async with running(node) as server:
        front = await serve_front(2, server.port)
        try:
            async with await connect(HOST, front.sockets[0].getsockname()[1], security=coord, timeout=5) as conn:
                assert (await conn.call("echo", {"n": 1})).body == {"n": 1}
            assert accepted == 3
        finally:
            front.close()
        accepted = 0
        front = await serve_front(1000, server.port)
        try:
            with pytest.raises(HandshakeError, match="busy refusing handshakes"):
                await connect(HOST, front.sockets[0].getsockname()[1], security=coord, timeout=5)
            assert accepted == 4  # the first try and three more, then the node's refusal is said
        finally:
            front.close()


async def test_large_frames_on_many_connections_share_the_receive_budget(coord, node, monkeypatch):
    """With a 4 MiB budget for the whole loop (server and clients alike), 3 MiB tensors sent on
    four connections at once are read a few at a time, in pieces, and all come back whole."""
    from exo_tui.net import budget as budget_module

    monkeypatch.setattr(budget_module, "RECEIVE_BUDGET_BYTES", 4 << 20)
    b = budget_module.receive_budget()
    assert b.capacity == 4 << 20
    peak = 0
    acquire = b.acquire

    async def counted(n: int) -> int:
        nonlocal peak
        got = await acquire(n)
        peak = max(peak, b.used)
        return got

    monkeypatch.setattr(b, "acquire", counted)
    async with running(node) as server:
        conns = [await connect(HOST, server.port, security=coord) for _ in range(4)]
        try:
            tensors = [np.full((3 << 20) // 4, i, np.float32) for i in range(4)]
            replies = await asyncio.gather(*(c.call("echo", tensor=t) for c, t in zip(conns, tensors, strict=True)))
            for i, r in enumerate(replies):
                assert r.tensor.shape == tensors[i].shape and float(r.tensor[-1]) == i
                assert not r.tensor.flags.writeable
        finally:
            for c in conns:
                await c.aclose()
    assert b.used == 0 and 0 < peak <= b.capacity


# ------------------------------------------------------------------ calls and one-way frames


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_call_round_trips_tensors_payloads_and_bodies(coord: Security, node: Security, tls: bool):
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    async with running(node) as server:
        async with await connect(HOST, server.port, security=coord) as conn:
            assert conn.peer_name == ("node-a" if tls else "")
            x = np.random.default_rng(0).standard_normal((1, 576), dtype=np.float32)
            r = await conn.call("echo", {"req": "r1", "pos": [3, 4]}, tensor=x, plan=7)
            assert (r.type, r.body, r.plan) == ("echo", {"req": "r1", "pos": [3, 4]}, 7)
            np.testing.assert_array_equal(r.tensor, x)
            for name in ("float16", "int32", "int64", "uint8"):
                t = np.arange(24).reshape(2, 3, 4).astype(DTYPES[name])
                np.testing.assert_array_equal((await conn.call("echo", tensor=t)).tensor, t)
            chunk = os.urandom(3 << 20)  # a weight-streaming chunk
            assert (await conn.call("echo", {"seq": 1}, payload=chunk)).payload == chunk
            assert next(iter(server.connections)).peer_name == ("coordinator" if tls else "")


async def test_calls_run_concurrently_and_errors_keep_the_connection(coord: Security, node: Security):
    async with running(node) as server, await connect(HOST, server.port, security=coord) as conn:
        slow = asyncio.create_task(conn.call("sleep", {"s": 1.0}))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(0.5):  # not stuck behind the long handler
            assert (await conn.call("echo", {"n": 1})).body == {"n": 1}
        with pytest.raises(RemoteError, match="no shard for layers 3-5") as e:
            await conn.call("fail")
        assert e.value.code == "no_shard"
        with pytest.raises(RemoteError, match="ValueError: kaboom") as e:
            await conn.call("boom")
        assert e.value.code == "handler_error"
        with pytest.raises(UnknownFrameType, match="unknown frame type 'launch_missiles'"):
            await conn.call("launch_missiles")
        with pytest.raises(TimeoutError):
            await conn.call("sleep", {"s": 5}, timeout=0.1)
        assert (await slow).body == {"s": 1.0}
        assert (await conn.call("echo", {"still": "open"})).body == {"still": "open"}


async def test_one_way_frames_keep_their_order_per_lane(coord: Security, node: Security):
    app = App()
    async with running(node, app.d) as server, await connect(HOST, server.port, security=coord) as conn:
        rng = np.random.default_rng(1)
        for i in range(50):
            await conn.send("record", {"i": i, "s": float(rng.uniform(0, 0.003))})
        await conn.send("slow", {"i": 0, "s": 5.0})  # its own lane: does not hold up "record"
        await conn.send("record", {"i": 50})
        await until(lambda: ("record", 50) in app.seen, timeout=4.0)
        assert [i for t, i in app.seen if t == "record"] == list(range(51))
        assert ("slow", 0) not in app.seen
        # one lane shared by two types keeps their relative order
        app.seen.clear()
        await conn.send("slow", {"i": 1, "s": 0.2}, lane="L")
        await conn.send("record", {"i": 2}, lane="L")
        await until(lambda: len([s for s in app.seen if s[1] in (1, 2)]) == 2)
        assert [s for s in app.seen if s[1] in (1, 2)] == [("slow", 1), ("record", 2)]


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_inline_types_run_in_the_read_loop_in_order(coord: Security, node: Security, tls: bool):
    """A one-way frame of an inline type is handled in the read loop itself (no hand-off to a
    lane task) when its lane is idle; behind a busy lane it waits its turn like any other."""
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    app = App()
    where: list[str] = []
    pending: list[bool] = []

    async def fast(conn, f: Frame) -> None:
        task = asyncio.current_task()
        where.append(task.get_name() if task else "")
        pending.append(conn.input_pending())
        app.seen.append(("fast", f.body["i"]))

    app.d.add("fast", fast)
    async with running(node, app.d, inline_types=("fast",)) as server, \
            await connect(HOST, server.port, security=coord) as conn:
        await conn.send("fast", {"i": 0})
        await until(lambda: len(where) == 1)
        assert where[0].startswith("exo-tui read"), where
        assert pending == [False]  # nothing else was sent
        # two frames written at once: handling the first, the second is already there
        await conn.send("fast", {"i": 1})
        await conn.send("fast", {"i": 2})
        await until(lambda: len(where) == 3)
        assert pending[1:] == [True, False]
        # behind a busy lane, an inline type keeps its place in the lane's order
        app.seen.clear()
        await conn.send("slow", {"i": 3, "s": 0.2}, lane="L")
        await conn.send("fast", {"i": 4}, lane="L")
        await until(lambda: len(app.seen) == 2)
        assert app.seen == [("slow", 3), ("fast", 4)]
        assert not where[-1].startswith("exo-tui read")  # it ran in the lane's task


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_frames_sent_in_one_loop_turn_leave_in_one_write(coord: Security, node: Security, tls: bool):
    """A node that ran eight requests' steps together sends their eight results in one write (one
    TLS record, one wake-up of the peer); order holds around a large frame; frames sent with
    ``hold_s`` wait for the next frame, or the shortest of their holds; and a close still sends what
    was held."""
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    app = App()
    # inline: the last frame is handled before the close that comes right behind it
    async with running(node, app.d, inline_types=("record",)) as server:
        conn = await connect(HOST, server.port, security=coord)
        writes: list[int] = []
        write = conn._writer.write

        def counted(data: bytes) -> None:
            writes.append(len(data))
            write(data)

        conn._writer.write = counted  # type: ignore[method-assign]
        try:
            await asyncio.gather(*(conn.send("record", {"i": i}) for i in range(8)))
            await until(lambda: len(app.seen) == 8)
            assert app.seen == [("record", i) for i in range(8)]
            assert len(writes) == 1, writes
            await conn.send("record", {"i": 8})  # a lone frame leaves at the end of its turn
            await until(lambda: len(app.seen) == 9)
            assert len(writes) == 2
            big = np.arange(40_000, dtype=np.float32)  # 160 kB: written on its own, not copied
            await asyncio.gather(conn.send("record", {"i": 9}), conn.send("record", {"i": 10}, tensor=big),
                                 conn.send("record", {"i": 11}))
            await until(lambda: len(app.seen) == 12)
            assert [i for _, i in app.seen[9:]] == [9, 10, 11]
            # frames sent with hold_s wait across turns for the next one sent without, and leave with it
            n = len(writes)
            await conn.send("record", {"i": 12}, hold_s=60.0)
            for _ in range(3):
                await asyncio.sleep(0)  # turns of the loop pass
            await conn.send("record", {"i": 13}, hold_s=60.0)
            for _ in range(3):
                await asyncio.sleep(0)
            assert len(writes) == n and conn.held_s > 0
            await conn.send("record", {"i": 14})
            await until(lambda: len(app.seen) == 15)
            assert len(writes) == n + 1 and conn.held_s == 0
            await conn.send("record", {"i": 15}, hold_s=0.05)  # alone, it goes when its hold ends
            await until(lambda: len(app.seen) == 16)
            assert len(writes) == n + 2
            await conn.send("record", {"i": 16}, hold_s=60.0)
            await conn.send("record", {"i": 17}, hold_s=0.05)  # it may not wait out the first one's hold
            await until(lambda: len(app.seen) == 18)
            assert len(writes) == n + 3
            await conn.send("record", {"i": 18})
        finally:
            await conn.aclose()  # the held frame goes before the close
        await until(lambda: len(app.seen) == 19)
        assert app.seen[-1] == ("record", 18)


async def test_both_sides_can_call(coord: Security, node: Security):
    client = Dispatcher()

    @client.route("hello")
    async def hello(conn, f):
        return Frame("hi", {"got": f.body["from"]})

    async with running(node) as server, await connect(HOST, server.port, security=coord, handler=client) as conn:
        r = await conn.call("callback")
        assert r.body == {"client_said": {"got": "server"}}


async def test_close_fails_pending_calls_and_reports_to_callbacks(coord: Security, node: Security):
    async with running(node) as server:
        conn = await connect(HOST, server.port, security=coord)
        seen: list = []
        conn.on_close(lambda c, reason: seen.append(reason))
        await until(lambda: len(server.connections) == 1)
        server_side = next(iter(server.connections))
        server_seen: list = []
        server_side.on_close(lambda c, reason: server_seen.append(reason))
        pending = asyncio.create_task(conn.call("sleep", {"s": 30}))
        await asyncio.sleep(0.05)
        server_side.close()  # e.g. the node dies
        with pytest.raises(ConnectionClosed, match="closed by 127.0.0.1"):
            await pending
        reason = await asyncio.wait_for(conn.closed, 2)
        assert isinstance(reason, ConnectionClosed) and seen == [reason]
        assert conn.is_closed and server_seen == [None]
        with pytest.raises(ConnectionClosed):
            await conn.call("echo")
        late: list = []
        conn.on_close(lambda c, r: late.append(r))  # registered after the close: still called
        await asyncio.sleep(0.01)
        assert late == [reason]
        await conn.wait_closed()
        await until(lambda: not server.connections)


async def test_server_close_closes_its_connections(coord: Security, node: Security):
    async with running(node) as server:
        conn = await connect(HOST, server.port, security=coord)
        server.close()
        await server.wait_closed()
        assert isinstance(await asyncio.wait_for(conn.closed, 2), ConnectionClosed)
        with pytest.raises(ConnectError, match="cannot connect to 127.0.0.1"):
            await connect(HOST, server.port, security=coord, timeout=2)


async def test_a_payload_over_the_limit_fails_the_call_with_the_servers_reason(coord: Security, node: Security):
    async with running(node, limits=Limits(payload_bytes=1024)) as server:
        async with await connect(HOST, server.port, security=coord) as conn:
            assert (await conn.call("echo", payload=b"x" * 1024)).payload == b"x" * 1024
            with pytest.raises(ConnectionClosed, match="2048 bytes exceeds the limit of 1024"):
                await conn.call("echo", payload=b"x" * 2048)


async def test_connect_to_nothing_says_what_to_check(coord: Security):
    with pytest.raises(ConnectError, match="is the node agent running there"):
        await connect(HOST, 1, security=coord, timeout=2)


async def test_connect_to_a_silent_server_times_out(coord: Security):
    writers: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: writers.append(w), HOST, 0)  # accepts, never speaks
    try:
        port = silent.sockets[0].getsockname()[1]
        with pytest.raises(ConnectError, match=r"no complete connection to 127.0.0.1:\d+ within 0.3 s"):
            await connect(HOST, port, security=coord, timeout=0.3)
        with pytest.raises(ConnectError, match="within 0.3 s"):
            await connect(HOST, port, security=coord.replace(enable_tls=False), timeout=0.3)
    finally:
        for w in writers:
            w.transport.abort()
        silent.close()
        await silent.wait_closed()


# ------------------------------------------------------------------ security


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_wrong_key_is_refused_and_logged(coord, node, tls, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    async with running(node) as server:
        with pytest.raises(AuthError, match="could not prove the cluster key"):
            await connect(HOST, server.port, security=coord.replace(cluster_key=os.urandom(32)))
        await until(lambda: refusals(caplog))
        assert "cluster key" in refusals(caplog)[0]
        assert not server.connections
        async with await connect(HOST, server.port, security=coord) as conn:  # the right key still works
            assert (await conn.call("echo", {"a": 1})).body == {"a": 1}


async def test_no_certificate_is_refused_and_logged(cluster, node, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    async with running(node) as server:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(cadata=cluster.ca_cert_pem.decode())  # trusts the CA, has no cert/key
        reader, writer = await asyncio.open_connection(HOST, server.port, ssl=ctx)
        try:
            writer.write(auth.hello(os.urandom(32)))
            assert len(await read_to_eof(reader)) < auth.CHALLENGE_SIZE  # never challenged
        finally:
            writer.transport.abort()
        await until(lambda: refusals(caplog))
        assert "TLS handshake failed" in refusals(caplog)[0]


async def test_certificate_of_another_cluster_is_refused(coord, node, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    other = ensure_cluster(tmp_path / "other")
    # even with the right cluster key, a certificate not signed by our CA is refused by TLS
    stranger = other.security().replace(cluster_key=coord.cluster_key)
    async with running(node) as server:
        with pytest.raises(HandshakeError):
            await connect(HOST, server.port, security=stranger)
        await until(lambda: refusals(caplog))
        assert "TLS handshake failed" in refusals(caplog)[0]
    # and a client of our cluster refuses a server with a foreign certificate
    async with running(stranger) as server:
        with pytest.raises(HandshakeError, match="TLS handshake with 127.0.0.1:.* failed"):
            await connect(HOST, server.port, security=coord)


class Recorder:
    """A writer that records what the handshake sends."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer, self.sent = writer, bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_replayed_handshake_is_refused_and_logged(coord, node, tls, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    coord, node = coord.replace(enable_tls=tls), node.replace(enable_tls=tls)
    ssl_ctx = coord.client_context() if tls else None

    async def open_raw():
        reader, writer = await asyncio.open_connection(HOST, server.port, ssl=ssl_ctx, server_hostname="" if tls else None)
        return reader, writer

    async with running(node) as server:
        reader, writer = await open_raw()
        rec = Recorder(writer)
        fp_server = peer_identity(writer)[0] if tls else b""
        await auth.client_handshake(
            reader, rec, coord.cluster_key, fp_server=fp_server,  # type: ignore[arg-type]
            fp_client=coord.fingerprint if tls else b"", peer="node",
        )  # a genuine, accepted handshake, recorded
        writer.close()
        assert len(rec.sent) == auth.HELLO_SIZE + auth.MAC_BYTES
        await until(lambda: not server.connections)

        reader, writer = await open_raw()
        try:
            writer.write(bytes(rec.sent))  # replay it byte for byte
            answer = await read_to_eof(reader)
        finally:
            writer.transport.abort()
        assert answer[auth.CHALLENGE_SIZE :] == auth.REFUSED
        await until(lambda: refusals(caplog))
        assert "the peer failed to prove the cluster key (wrong key, or a replayed handshake)" in refusals(caplog)[0]
        assert not server.connections


async def test_relayed_handshake_fails_by_channel_binding(cluster, coord, node, caplog):
    """A man in the middle with a valid certificate of the cluster (a stolen node certificate) but
    without the cluster key relays the handshake bytes between coordinator and node: both refuse."""
    caplog.set_level(logging.INFO, logger=NET)
    mitm = Security.from_bundle(cluster.node_bundle("mallory"))
    tasks: set[asyncio.Task] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.transport.abort()

    async def relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(HOST, server.port, ssl=mitm.client_context(), server_hostname="")
        tasks.update({asyncio.create_task(pipe(cr, sw)), asyncio.create_task(pipe(sr, cw))})

    async with running(node) as server:
        proxy = await asyncio.start_server(relay, HOST, 0, ssl=mitm.server_context())
        try:
            port = proxy.sockets[0].getsockname()[1]
            with pytest.raises(AuthError, match="could not prove the cluster key: .* relays"):
                await connect(HOST, port, security=coord)
            await until(lambda: refusals(caplog))
            assert not server.connections
        finally:
            proxy.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await proxy.wait_closed()


async def test_silent_client_times_out_and_is_logged(coord, node, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    async with running(node.replace(handshake_timeout_s=0.3)) as server:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        try:
            assert await read_to_eof(reader, timeout=3) == b""
        finally:
            writer.transport.abort()
        await until(lambda: refusals(caplog))
        assert "within 0.3 s" in refusals(caplog)[0]  # no ClientHello within the (shorter) handshake timeout


async def test_tls_on_one_side_only_is_refused_with_a_hint(coord, node, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    async with running(node.replace(enable_tls=False)) as server:
        with pytest.raises(HandshakeError):
            await connect(HOST, server.port, security=coord, timeout=3)
        await until(lambda: refusals(caplog))
        assert "the peer speaks TLS but TLS is off here" in refusals(caplog)[0]
    caplog.clear()
    async with running(node) as server:
        with pytest.raises(HandshakeError):
            await connect(HOST, server.port, security=coord.replace(enable_tls=False), timeout=3)
        await until(lambda: refusals(caplog))
        assert "TLS handshake failed" in refusals(caplog)[0]


async def test_other_protocol_version_is_refused_with_a_clear_error(coord, node, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    async with running(node) as server:
        reader, writer = await asyncio.open_connection(HOST, server.port, ssl=coord.client_context(), server_hostname="")
        try:
            with pytest.raises(ProtocolMismatch, match=f"node 127.0.0.1 speaks exo-tui protocol {V}, this coordinator speaks {V + 1}: upgrade") as e:
                await auth.client_handshake(
                    reader, writer, coord.cluster_key, fp_server=peer_identity(writer)[0],
                    fp_client=coord.fingerprint, peer="node 127.0.0.1", version=V + 1, local="this coordinator",
                )
            assert e.value.peer_version == V
        finally:
            writer.transport.abort()
        await until(lambda: refusals(caplog))
        assert f"the peer speaks exo-tui protocol {V + 1}, this node (node-a) speaks {V}: upgrade" in refusals(caplog)[0]


# ------------------------------------------------------------------ bad input after authentication

BAD_INPUT = {
    "garbage": (b"\xde\xad\xbe\xef" * 16, "bad_frame", "exceeds the limit"),
    "not msgpack": (struct.pack(">I", 8) + b"\xc1" * 8, "bad_frame", "not valid msgpack"),
    "wrong version": (raw_frame({"v": V + 1, "type": "echo", "id": 1}), "protocol_version", f"protocol {V + 1}"),
    "100 GB payload": (
        raw_frame({"v": V, "type": "forward", "dtype": "float32", "shape": [25_000_000_000], "nbytes": 100_000_000_000}),
        "bad_frame",
        "100000000000 bytes exceeds the limit",
    ),
    "tensor bytes mismatch": (
        raw_frame({"v": V, "type": "echo", "id": 1, "dtype": "float32", "shape": [2, 5], "nbytes": 39}, b"\0" * 39),
        "bad_frame",
        "needs 40 bytes but the frame carries 39",
    ),
    "ext type": (
        raw_frame({"v": V, "type": "echo", "id": 1, "body": {"x": msgpack.ExtType(1, b"x")}}),
        "bad_frame",
        "extension type 1",
    ),
    "stalled truncated frame": (frame_bytes(Frame("echo", {"a": 1}, id=1))[:-3], "truncated_frame", "not completed within"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_bad_input_closes_only_that_connection(coord, node, caplog, case):
    caplog.set_level(logging.INFO, logger=NET)
    data, code, match = BAD_INPUT[case]
    async with running(node, limits=Limits(frame_timeout_s=0.3)) as server:
        canary = await connect(HOST, server.port, security=coord)
        try:
            reader, writer, _ = await open_authenticated(HOST, server.port, security=coord)
            try:
                # the connection works, then a bad frame arrives
                writer.write(frame_bytes(Frame("echo", {"first": True}, id=1)))
                (n,) = struct.unpack(">I", await reader.readexactly(4))
                head = msgpack.unpackb(await reader.readexactly(n))
                assert head["re"] and head["body"] == {"first": True}
                writer.write(data)
                received = frames_in(await read_to_eof(reader))
            finally:
                writer.transport.abort()
            assert len(received) == 1  # the error frame and nothing else
            err = received[0]
            assert err.type == "error"
            assert err.body["code"] == code
            assert match in err.body["message"]
            logged = [r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()]
            assert logged and match in logged[0] and "127.0.0.1:" in logged[0]
            await until(lambda: len(server.connections) == 1)
            assert (await canary.call("echo", {"alive": case})).body == {"alive": case}
        finally:
            await canary.aclose()


async def test_connection_dropped_inside_a_frame_is_logged(coord, node, caplog):
    caplog.set_level(logging.INFO, logger=NET)
    async with running(node) as server, await connect(HOST, server.port, security=coord) as canary:
        reader, writer, _ = await open_authenticated(HOST, server.port, security=coord)
        writer.write(frame_bytes(Frame("echo", tensor=np.ones(64, np.float32), id=1))[:100])
        await writer.drain()
        writer.close()
        await until(lambda: len(server.connections) == 1)
        await until(lambda: any("connection closed inside a frame's payload" in r.getMessage() for r in caplog.records))
        assert (await canary.call("echo", {"ok": 1})).body == {"ok": 1}


# ------------------------------------------------------------------ fuzz: generated bytes and frames at a live server


class LoopThread:
    """An event loop in a thread, so a synchronous hypothesis test can drive a live server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
headers = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 1, 1, 2, 0, "1", None]),
        "type": st.sampled_from(["echo", "echo", "forward", "error", "", "x" * 65]) | st.text(max_size=6),
    },
    optional={
        "id": st.integers(-2, 2**64 - 1),
        "re": st.booleans() | st.integers(0, 2),
        "plan": st.integers(-1, 5) | st.text(max_size=2),
        "dtype": st.sampled_from([*DTYPES, "object", "complex64", 7]),
        "shape": st.lists(st.integers(-1, 6), max_size=4) | st.just([25_000_000_000]) | st.text(max_size=2),
        "nbytes": st.integers(-1, 80) | st.just(100_000_000_000),
        "body": st.dictionaries(st.text(max_size=4), plain_values, max_size=3) | plain_values,
        "lane": st.text(max_size=3) | st.integers(-5, 5),
        "extra": plain_values,
        "ext": st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    },
)


@st.composite
def frame_streams(draw) -> bytes:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        h = msgpack.packb(draw(headers), use_bin_type=True)
        length = draw(st.sampled_from([len(h)] * 6 + [len(h) + 1, max(len(h) - 1, 0), 0, 2**32 - 1]))
        parts.append(struct.pack(">I", length) + h + draw(st.binary(max_size=80)))
    return b"".join(parts)


def expected_fate(data: bytes) -> str | None:
    """What the server must do with ``data``: the error code it closes with, or None (no bad frame
    among the complete frames; a truncated tail is cut off by our own close)."""
    pos = 0
    while pos < len(data):
        try:
            _, n = decode_frame(data[pos:])
        except IncompleteFrame:
            return None
        except FrameError as e:
            return e.code
        pos += n
    return None


@pytest.mark.timeout(240)
def test_fuzz_generated_frames_and_bytes_at_a_live_server(cluster: Cluster, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger=NET)
    coord = cluster.security()
    node = Security.from_bundle(cluster.node_bundle("fuzz-node"))
    lt = LoopThread()
    server = canary = None
    try:
        node = node.replace(handshake_timeout_s=1.0)
        server = lt.run(serve(App().d, HOST, 0, security=node, limits=Limits(frame_timeout_s=2)))
        canary = lt.run(connect(HOST, server.port, security=coord))
        port = server.port

        async def attack(data: bytes, authenticated: bool) -> bytes:
            if authenticated:
                reader, writer, _ = await open_authenticated(HOST, port, security=coord)
            else:  # TLS but no handshake: the bytes land where the HMAC hello is expected
                reader, writer = await asyncio.open_connection(HOST, port, ssl=coord.client_context(), server_hostname="")
            try:
                writer.write(data)
                await writer.drain()
                if not authenticated:  # end it: the server must refuse, whatever the bytes were
                    writer.close()
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(3):
                            await writer.wait_closed()
                    return b""
                if expected_fate(data) is None:
                    return b""  # nothing bad among the complete frames: the server keeps it open
                return await read_to_eof(reader, timeout=5)
            finally:
                writer.transport.abort()

        @settings(max_examples=250, suppress_health_check=list(HealthCheck))
        @given(data=frame_streams() | st.binary(min_size=1, max_size=200), authenticated=st.booleans())
        def throw(data: bytes, authenticated: bool) -> None:
            answer = lt.run(attack(data, authenticated))
            code = expected_fate(data)
            if authenticated and code is not None:
                last = frames_in(answer)[-1]  # the server closed this connection with an error frame
                assert last.type == "error" and last.body["code"] == code
            assert lt.run(canary.call("echo", {"alive": 1}, timeout=5)).body == {"alive": 1}

        throw()

        async def settled() -> None:
            await until(lambda: len(server.connections) == 1, timeout=10)

        lt.run(settled())
        accepted = sum("accepted connection" in r.getMessage() for r in caplog.records)
        refused = server.refused  # the log has 5 lines a kind per 10 s (rate-limited), the count all
        assert refused > 20 and accepted > 20  # both stages were exercised
        assert lt.run(canary.call("echo", tensor=np.ones(576, np.float32))).tensor.shape == (576,)
        bugs = [r for r in caplog.records if r.name == NET and r.levelno >= logging.ERROR]
        assert not bugs, [r.getMessage() for r in bugs]
    finally:
        if canary is not None:
            lt.run(canary.aclose())
        if server is not None:

            async def stop(srv=server) -> None:
                srv.close()
                await srv.wait_closed()

            lt.run(stop())
        lt.stop()


SERVER_PROCESS = """
import asyncio, sys
from exo_tui.net import Dispatcher, Frame, Security, serve

async def main():
    d = Dispatcher()

    @d.route("echo")
    async def echo(conn, f):
        return Frame("echo", body=f.body)

    @d.route("sleep")
    async def sleep(conn, f):
        await asyncio.sleep(60)

    server = await serve(d, "127.0.0.1", 0, security=Security.from_bundle_file(sys.argv[1]))
    print(server.port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_peer_process_breaks_the_connection_at_once(cluster: Cluster, coord: Security, tmp_path: Path):
    bundle = write_node_bundle(tmp_path / "n.bundle", cluster.node_bundle("victim"))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_PROCESS, str(bundle)], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        conn = await connect(HOST, port, security=coord)
        failed: list = []
        conn.on_close(lambda c, reason: failed.append(reason))
        assert (await conn.call("echo", {"x": 1})).body == {"x": 1}
        step = asyncio.create_task(conn.call("sleep"))  # a step in flight on the node
        await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(step, 30)
        await asyncio.wait_for(asyncio.shield(conn.closed), 30)
        # noticed from the socket itself (the kernel closes a killed process's sockets), not from
        # missed heartbeats: the reason names the peer closing or the connection lost
        assert len(failed) == 1 and isinstance(failed[0], ConnectionClosed), failed
        assert "closed by" in str(failed[0]) or "lost" in str(failed[0]), failed
        await conn.wait_closed()
    finally:
        proc.kill()
        proc.wait(10)
