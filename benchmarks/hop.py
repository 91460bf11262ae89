"""One hop of the wire on loopback: TLS on vs off, against a bare stream echo as the floor, on uvloop
and on asyncio's own event loop (both ends).

A server process echoes what it gets; this process calls it. One round trip is two hops (the hidden
state goes there and comes back), so "hop" = round trip / 2. Rows, measured side by side in one run:

* ``floor``: a bare stream echo of the same bytes (no framing, no TLS, no RPC);
* ``rpc, TLS off``: exo-tui frames + RPC over TCP (``network.security.enable_tls: false``);
* ``rpc, TLS on``: the default, mutual TLS 1.3.

Columns: the decode hidden state (1×576 float32, 2.3 KB) as a call round trip, median and p99;
the same as two one-way ``forward`` frames (there, and passed back by the server's handler: the
path the pipeline uses); a 128-token prefill hidden state (128×576 float32, 295 KB) round trip; and
the throughput of 4 MiB weight chunks (one way, acknowledged).

    .venv/bin/python benchmarks/hop.py [--n 3000] [--rounds 2] [--loops uvloop,asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402
from exo_tui.net import Dispatcher, Frame, Security, connect, ensure_cluster, serve  # noqa: E402
from exo_tui.net import loop as event_loop  # noqa: E402

HIDDEN = 576
CHUNK = 4 << 20


# ------------------------------------------------------------------ server process


async def _serve(mode: str, home: str) -> None:
    if mode == "floor":

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    n = int.from_bytes(await reader.readexactly(4), "big")
                    data = await reader.readexactly(n)
                    writer.write(n.to_bytes(4, "big") + data)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0, limit=1 << 20)
        port = server.sockets[0].getsockname()[1]
    else:
        sec = Security.from_bundle((Path(home) / "node.bundle").read_bytes(), enable_tls=mode == "tls")
        d = Dispatcher()

        @d.route("echo")
        async def echo_frame(conn, f: Frame) -> Frame:
            return Frame("echo", tensor=f.tensor)

        @d.route("forward")
        async def forward(conn, f: Frame) -> None:  # one-way, as in the pipeline: pass it on
            await conn.send("forward", tensor=f.tensor)

        @d.route("chunk")
        async def chunk(conn, f: Frame) -> Frame:
            return Frame("ack", {"n": len(f.payload or b"")})

        srv = await serve(d, "127.0.0.1", 0, security=sec)
        port = srv.port
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


# ------------------------------------------------------------------ client


def _stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


async def _measure(mode: str, port: int, coord: Security, n: int) -> dict[str, float]:
    hidden = np.random.default_rng(0).standard_normal((1, HIDDEN), dtype=np.float32)
    prefill = np.random.default_rng(1).standard_normal((128, HIDDEN), dtype=np.float32)
    chunk = os.urandom(CHUNK)
    out: dict[str, float] = {}
    pc = time.perf_counter
    if mode == "floor":
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)

        async def rt(data: bytes) -> None:
            writer.write(len(data).to_bytes(4, "big") + data)
            await writer.drain()
            m = int.from_bytes(await reader.readexactly(4), "big")
            np.frombuffer(await reader.readexactly(m), np.float32)

        hb, pb = hidden.tobytes(), prefill.tobytes()
        for _ in range(200):
            await rt(hb)
        ts = []
        for _ in range(n):
            t = pc()
            await rt(hb)
            ts.append(pc() - t)
        out["rtt_med"], out["rtt_p99"] = _stats(ts)
        out["oneway_med"] = out["rtt_med"]  # the floor has no one-way path: same echo
        ts = []
        for _ in range(max(20, n // 20)):
            t = pc()
            await rt(pb)
            ts.append(pc() - t)
        out["prefill_med"] = statistics.median(ts)
        t = pc()
        for _ in range(20):
            await rt(chunk[: CHUNK // 2])  # echo both ways: same bytes on the wire as a one-way chunk
        out["chunk_mb_s"] = 20 * CHUNK / (pc() - t) / 1e6
        writer.close()
        return out

    arrived: asyncio.Queue[Frame] = asyncio.Queue()
    client = Dispatcher()

    @client.route("forward")
    async def back(conn, f: Frame) -> None:
        arrived.put_nowait(f)

    conn = await connect("127.0.0.1", port, security=coord.replace(enable_tls=mode == "tls"), handler=client)
    try:
        for _ in range(200):
            await conn.send("forward", tensor=hidden)
            await arrived.get()
        ts = []
        for _ in range(n):
            t = pc()
            await conn.send("forward", tensor=hidden)
            await arrived.get()
            ts.append(pc() - t)
        out["oneway_med"] = statistics.median(ts)
        for _ in range(200):
            await conn.call("echo", tensor=hidden)
        ts = []
        for _ in range(n):
            t = pc()
            await conn.call("echo", tensor=hidden)
            ts.append(pc() - t)
        out["rtt_med"], out["rtt_p99"] = _stats(ts)
        ts = []
        for _ in range(max(20, n // 20)):
            t = pc()
            await conn.call("echo", tensor=prefill)
            ts.append(pc() - t)
        out["prefill_med"] = statistics.median(ts)
        t = pc()
        for _ in range(20):
            await conn.call("chunk", payload=chunk)
        out["chunk_mb_s"] = 20 * CHUNK / (pc() - t) / 1e6
    finally:
        await conn.aclose()
    return out


def _serve_and_measure(mode: str, home: str, coord: Security, n: int) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", mode, "--home", home],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        port = int(proc.stdout.readline())
        return event_loop.run(_measure(mode, port, coord, n))
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="round trips per row (default 3000)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds alternating the loops; medians are printed")
    ap.add_argument("--loops", default="uvloop,asyncio", help="event loops to compare (both ends run on it)")
    ap.add_argument("--serve", choices=["floor", "plain", "tls"], help=argparse.SUPPRESS)
    ap.add_argument("--home", help=argparse.SUPPRESS)
    args = parse(ap, n=50, rounds=1)
    if args.serve:
        event_loop.run(_serve(args.serve, args.home))
        return 0

    loops = args.loops.split(",")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="exo-hop-") as home:
        cluster = ensure_cluster(Path(home))
        (Path(home) / "node.bundle").write_bytes(cluster.node_bundle("bench-node"))
        os.chmod(Path(home) / "node.bundle", 0o600)
        coord = cluster.security()
        for _ in range(args.rounds):
            for loop in loops:
                os.environ[event_loop.ENV] = loop  # this process and the server it starts
                for mode in ("floor", "plain", "tls"):
                    runs.setdefault((loop, mode), []).append(_serve_and_measure(mode, home, coord, args.n))
    rows = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}

    names = {"floor": "floor: bare stream echo", "plain": "rpc, TLS off", "tls": "rpc, TLS on (default)"}
    print(f"\nOne hop on loopback, server in another process, {args.n} round trips per row, median of "
          f"{args.rounds} rounds (Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f})\n")
    print(f"| loop | {'':24} | decode call RTT | p99 | hop = RTT/2 | one-way there+back | 128-token prefill RTT | 4 MiB chunks |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (loop, mode), r in rows.items():
        print(
            f"| {loop} | {names[mode]:24} | {r['rtt_med'] * 1e3:.3f} ms | {r['rtt_p99'] * 1e3:.3f} ms | "
            f"{r['rtt_med'] * 1e3 / 2:.3f} ms | {r['oneway_med'] * 1e3:.3f} ms | "
            f"{r['prefill_med'] * 1e3:.3f} ms | {r['chunk_mb_s']:.0f} MB/s |"
        )
    print()
    for loop in loops:
        tls, plain, floor = rows[(loop, "tls")], rows[(loop, "plain")], rows[(loop, "floor")]
        print(f"{loop}: TLS on / off: decode RTT ×{tls['rtt_med'] / plain['rtt_med']:.2f}, "
              f"prefill ×{tls['prefill_med'] / plain['prefill_med']:.2f}, "
              f"chunk throughput ×{tls['chunk_mb_s'] / plain['chunk_mb_s']:.2f}; "
              f"rpc (TLS off) / floor: decode RTT ×{plain['rtt_med'] / floor['rtt_med']:.2f}; "
              f"a hop with TLS {tls['rtt_med'] / 2 * 1e3:.3f} ms (target < 0.3 ms: "
              f"{'met' if tls['rtt_med'] / 2 < 3e-4 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
