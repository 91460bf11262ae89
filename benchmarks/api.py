"""Aggregate decode tokens/s at 1, 4, 8 and 16 concurrent streams, through a 1-node and a 3-node
cluster of local node agents (``--backend onnx`` or ``mlx``), directly (``coordinator.generate``) and through the HTTP API
(streaming ``/v1/chat/completions``), measured side by side in one run.

Each stream asks a different question and decodes ``--tokens`` tokens greedily (fewer if the model
ends its answer). Columns:

* ``tok/s``: every stream's tokens after its first, over the time from the first stream's first
  token to the last stream's end (the decode rate of the whole cluster);
* ``× 1 stream``: that rate over the same path's rate with one stream (batching's gain);
* ``wall tok/s``: all generated tokens over the whole run, prefill included;
* ``steady tok/s`` (direct path): the tokens all streams produce while every one of them is
  decoding (from the last stream's first token to the first stream's end), over that window: the
  batched decode rate with no prompt being prefilled beside it;
* ``HTTP cost``: how much lower the HTTP path's decode rate is than the direct one.

The HTTP clients run in a process of their own (``--http-clients process``, the default), as an
application's would: the HTTP column pays for the server's end of the connection, and the clients
take their share of the same CPUs. ``--http-clients loop`` runs them in this process's event loop,
beside the server and the coordinator, where every event they parse holds up the cluster's own
work: the HTTP column then pays for both ends.

    .venv/bin/python benchmarks/api.py [--tokens 32] [--model smollm2-135m] [--nodes 1,3] [--rounds 3]
                                       [--http-clients process|loop]

Every stream count runs ``--rounds`` times, the counts alternating within each round, and each
column is the median over the rounds (one 32-token stream is a short measurement: its rate
varied by a third between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.quick import parse  # noqa: E402
from exo_tui.api.server import ApiServer  # noqa: E402
from exo_tui.cluster.coordinator import Coordinator  # noqa: E402
from exo_tui.cluster.view import ChatParams  # noqa: E402
from exo_tui.config import Config  # noqa: E402
from exo_tui.net import loop as event_loop  # noqa: E402

TOPICS = ["the sea", "a red fox", "Paris", "winter", "a robot", "bread", "the moon", "trains", "music", "a garden",
          "mountains", "a library", "coffee", "rain", "a lighthouse", "bees"]


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]


class Stream:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None
        self.end = 0.0
        self.tokens = 0
        self.stamps: list[float] = []


def _rates(streams: list[Stream]) -> tuple[float, float]:
    firsts = [s.first for s in streams if s.first is not None]
    decode_tokens = sum(max(0, s.tokens - 1) for s in streams)
    span = max(s.end for s in streams) - min(firsts) if firsts else 0.0
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    return (decode_tokens / span if span > 0 else 0.0), (sum(s.tokens for s in streams) / wall if wall > 0 else 0.0)


def _steady(streams: list[Stream]) -> float:
    """Tokens per second while every stream decodes (0 when the streams never all overlap)."""
    if any(s.first is None for s in streams):
        return 0.0
    start, end = max(s.first for s in streams), min(s.end for s in streams)  # type: ignore[type-var]
    if end <= start:
        return 0.0
    return sum(start < t <= end for s in streams for t in s.stamps) / (end - start)


async def _direct(c: Coordinator, i: int, tokens: int) -> Stream:
    s = Stream()
    request = c.new_request(_messages(i), ChatParams(max_tokens=tokens, temperature=0.0, seed=1))
    async for chunk in c.generate(request):
        if chunk.token_id is not None:
            s.stamps.append(time.monotonic())
            s.first = s.first or s.stamps[-1]
    s.tokens = len(request.generated)
    s.end = time.monotonic()
    return s


async def _http(http: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> Stream:
    s = Stream()
    body = {"model": model, "messages": _messages(i), "temperature": 0, "seed": 1, "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                s.tokens = data["usage"]["completion_tokens"]
            elif data["choices"] and data["choices"][0]["delta"].get("content"):
                s.first = s.first or time.monotonic()
    s.end = time.monotonic()
    return s


async def _http_in_process(url: str, model: str, n: int, tokens: int) -> list[Stream]:
    """``n`` concurrent ``_http`` streams run by a client process (this file with ``--client``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", url, model, str(n), str(tokens), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the HTTP client process failed (exit {proc.returncode})")
    streams = []
    for d in json.loads(out):
        s = Stream()
        s.start, s.first, s.end, s.tokens = d["start"], d["first"], d["end"], d["tokens"]
        streams.append(s)
    return streams


def client_main(url: str, model: str, n: int, tokens: int) -> None:
    """The client process: ``n`` streams at once; prints each stream's times (CLOCK_MONOTONIC,
    the same clock in every process) and tokens as JSON."""
    async def run() -> list[Stream]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
            return list(await asyncio.gather(*(_http(http, url, model, i, tokens) for i in range(n))))

    streams = asyncio.run(run())
    print(json.dumps([{"start": s.start, "first": s.first, "end": s.end, "tokens": s.tokens} for s in streams]))


async def bench(n_nodes: int, counts: list[int], tokens: int, model: str | None, backend: str,
                rounds: int = 1, clients: str = "process") -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="exo-bench-api-"))
    os.environ["EXO_TUI_HOME"] = str(home)
    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 20.0
    c = Coordinator(model=model, config=config, local_nodes=n_nodes, local_backends=[backend], strategy="even",
                    home=home, persist=False)
    rows = []
    await c.start()
    try:
        server = ApiServer(c, port=0)
        await server.start()
        try:
            model_id = (await asyncio.to_thread(httpx.get, f"{server.url}/v1/models")).json()["data"][0]["id"]
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
                await _direct(c, 0, 4)  # warm up: sessions, caches, connections
                await _http(http, server.url, model_id, 0, 4)
                runs: dict[int, list[dict]] = {n: [] for n in counts}
                for _ in range(rounds):  # every count once per round: drift lands in all of them alike
                    for n in counts:
                        direct = await asyncio.gather(*(_direct(c, i, tokens) for i in range(n)))
                        if clients == "process":
                            over_http = await _http_in_process(server.url, model_id, n, tokens)
                        else:
                            over_http = await asyncio.gather(*(_http(http, server.url, model_id, i, tokens) for i in range(n)))
                        d_rate, d_wall = _rates(list(direct))
                        h_rate, h_wall = _rates(list(over_http))
                        runs[n].append({"direct": d_rate, "direct_wall": d_wall, "steady": _steady(list(direct)),
                                        "http": h_rate, "http_wall": h_wall})
                        print(f"  {n_nodes} node(s), {n:2d} stream(s): direct {d_rate:7.1f} tok/s, http {h_rate:7.1f} tok/s",
                              file=sys.stderr, flush=True)
                for n in counts:  # the median of each column over the rounds
                    rows.append({"nodes": n_nodes, "streams": n,
                                 **{k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]}})
        finally:
            await server.stop()
    finally:
        await c.stop()
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        url, model, n, tokens = sys.argv[2:6]
        client_main(url, model, int(n), int(tokens))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--nodes", default="1,3")
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--backend", default="onnx", choices=["onnx", "mlx"], help="backend of the node agents")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every stream count, alternated; medians reported")
    ap.add_argument("--http-clients", choices=["process", "loop"], default="process",
                    help="where the HTTP clients run: a process of their own, or this process's event loop")
    args = parse(ap, tokens=4, nodes="1", streams="1,2", rounds=1)
    counts = [int(x) for x in args.streams.split(",")]
    rows = []
    for n_nodes in (int(x) for x in args.nodes.split(",")):
        rows += event_loop.run(bench(n_nodes, counts, args.tokens, args.model, args.backend, args.rounds,
                                     args.http_clients))

    print(f"\nAggregate decode tokens/s, {args.tokens} tokens per stream, {args.backend} node agents on loopback "
          f"({os.cpu_count()} CPUs), medians of {args.rounds} rounds, HTTP clients in "
          f"{'a process of their own' if args.http_clients == 'process' else 'the server process'}\n")
    head = f"{'nodes':>5} {'streams':>7} | {'direct tok/s':>12} {'× 1 stream':>10} {'wall tok/s':>10} " \
           f"{'steady tok/s':>12} {'× 1 stream':>10} | " \
           f"{'HTTP tok/s':>10} {'× 1 stream':>10} {'wall tok/s':>10} | {'HTTP cost':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        base = next(x for x in rows if x["nodes"] == r["nodes"] and x["streams"] == min(counts))
        cost = 1 - r["http"] / r["direct"] if r["direct"] else 0.0
        print(f"{r['nodes']:>5} {r['streams']:>7} | {r['direct']:>12.1f} {r['direct'] / base['direct']:>9.2f}× "
              f"{r['direct_wall']:>10.1f} {r['steady']:>12.1f} {r['steady'] / base['steady'] if base['steady'] else 0.0:>9.2f}× | {r['http']:>10.1f} {r['http'] / base['http']:>9.2f}× {r['http_wall']:>10.1f} | "
              f"{cost * 100:>8.1f}%")


if __name__ == "__main__":
    main()
