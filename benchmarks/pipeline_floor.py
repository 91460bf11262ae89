"""The floor under ``benchmarks/pipeline.py``: how close N processes can come to one on this machine.

Real ONNX shards of the default model (layers split evenly) run in N processes that hand the
hidden state to each other over plain blocking TCP sockets on loopback: no event loop, no TLS, no
msgpack, no batching, no checks, a 12-byte header and the raw floats. A driver process plays the
coordinator (token in, token out, greedy). The clusters take turns, as in ``pipeline.py``, and
the table reports the median ms a token of each round's decode steps.

This is not a way to run exo-tui; it is the measurement that says how much of ``pipeline.py``'s
gap to one node belongs to exo-tui's node agent and protocol and how much to the machine: N
processes sharing its cores, N ``session.run`` calls a token instead of one, each starting with
caches the other processes' weights have just swept through.

    python benchmarks/pipeline_floor.py [--nodes 1,2,3] [--tokens 100] [--rounds 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402

HEADER = struct.Struct("<iii")  # payload bytes, first position, request number
PROMPT = np.array([1, 2, 3, 4, 5], np.int64)


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if not r:
            raise EOFError
        got += r
    return buf


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _node(start: int, end: int, listener: socket.socket, next_port: int, ready: mp.synchronize.Event) -> None:
    """One shard: read a step, run it, send the hidden state (or the greedy token) on."""
    from backends import get_backend
    from exo_tui.models.catalog import resolve_model
    from exo_tui.models.gguf_file import GGUFModel

    model = GGUFModel(resolve_model())
    shard = get_backend("onnx").load_shard(model.config, model.shard_weights(start, end))
    ready.set()
    prev, _ = listener.accept()
    prev.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nxt = _connect(next_port)
    hidden = model.config.hidden_size
    while True:
        try:
            n, pos, rid = HEADER.unpack(_recv_exactly(prev, HEADER.size))
            raw = _recv_exactly(prev, n)
        except EOFError:
            return
        x = np.frombuffer(raw, np.int64) if shard.is_first else np.frombuffer(raw, np.float32).reshape(-1, hidden)
        y = shard.forward(f"r{rid}", x, np.arange(pos, pos + len(x)))
        out = np.array([int(y[-1].argmax())], np.int64) if shard.is_last else np.ascontiguousarray(y, np.float32)
        data = out.tobytes()
        nxt.sendall(HEADER.pack(len(data), pos, rid) + data)


class Ring:
    """N node processes in a ring that starts and ends at this process."""

    def __init__(self, n: int, layers: int) -> None:
        ctx = mp.get_context("spawn")
        self.back = socket.create_server(("127.0.0.1", 0))
        listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
        ports = [s.getsockname()[1] for s in listeners] + [self.back.getsockname()[1]]
        cuts = [round(i * layers / n) for i in range(n + 1)]
        self.procs = []
        for i in range(n):
            ready = ctx.Event()
            p = ctx.Process(target=_node, args=(cuts[i], cuts[i + 1], listeners[i], ports[i + 1], ready), daemon=True)
            p.start()
            self.procs.append((p, ready))
        for p, ready in self.procs:
            while not ready.wait(1.0):
                if not p.is_alive():
                    raise RuntimeError(f"a node process ended with code {p.exitcode} before its shard loaded")
        for s in listeners:
            s.close()
        self.out = _connect(ports[0])
        self.inp, _ = self.back.accept()

    def step(self, ids: np.ndarray, pos: int, rid: int) -> np.ndarray:
        data = ids.tobytes()
        self.out.sendall(HEADER.pack(len(data), pos, rid) + data)
        n, _, _ = HEADER.unpack(_recv_exactly(self.inp, HEADER.size))
        return np.frombuffer(_recv_exactly(self.inp, n), np.int64)

    def decode_ms(self, rid: int, tokens: int) -> float:
        """Median ms of ``tokens`` greedy decode steps after a short prompt."""
        token = self.step(PROMPT, 0, rid)
        times = []
        for pos in range(len(PROMPT), len(PROMPT) + tokens):
            t0 = time.perf_counter()
            token = self.step(token, pos, rid)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def close(self) -> None:
        self.out.close()
        self.inp.close()
        self.back.close()
        for p, _ in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    args = parse(ap, nodes="2", tokens=4, rounds=1)
    from exo_tui.models.catalog import resolve_model
    from exo_tui.models.gguf_file import GGUFModel

    layers = GGUFModel(resolve_model()).config.n_layers
    counts = [int(v) for v in args.nodes.split(",")]
    rings: dict[int, Ring] = {}
    try:
        for n in counts:
            rings[n] = Ring(n, layers)
        results: dict[int, list[float]] = {n: [] for n in counts}
        for r in range(args.rounds):
            for n, ring in rings.items():
                results[n].append(ring.decode_ms(r, args.tokens))
    finally:
        for ring in rings.values():
            ring.close()
    print(f"\nDecode of the default model, one stream, onnx shards in N processes over blocking loopback "
          f"sockets, {args.rounds} rounds of {args.tokens} tokens, medians\n")
    print("| nodes | ms/token | ÷ 1 node | per extra node, ms | rounds, ms/token |")
    print("|---:|---:|---:|---:|---|")
    base = statistics.median(results[min(counts)])
    for n in counts:
        ms = statistics.median(results[n])
        extra = f"{(ms - base) / (n - min(counts)):.2f}" if n > min(counts) else "–"
        print(f"| {n} | {ms:.2f} | {base / ms:.2f} | {extra} | {' '.join(f'{v:.2f}' for v in results[n])} |")


if __name__ == "__main__":
    main()
