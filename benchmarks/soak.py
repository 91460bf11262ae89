"""A soak: many requests of mixed lengths through the HTTP API on 2 local nodes (default model),
a few at a time, some cancelled midway and some whose client vanishes, with a drain and a
``kill -9`` of a node during the run. It prints what was lost (should be 0), how many completed
greedy answers differ from their solo run (should be 0), each process's resident memory growth
between the 200th request (``--steady-from``) and the last, and the time to first token (p50/p99).

    python benchmarks/soak.py [--requests 1000] [--concurrency 8] [--drain-at 40] [--kill-at 120]
                             [--steady-from 200] [--prompts 8] [--lengths 8,24,64]

Cancelled: the client stops reading after half its tokens and closes the response. Disconnected:
a raw socket sends the request, reads a little of the stream and is closed with a reset.
The drain (undone 30 requests later, ``--undrain-after``) and the kill happen before the 200th request, so that the
growth measured afterwards is that of a steady cluster (the kill leaves one node holding every
layer, which adds the other half of the weights to its memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a haiku about rain.", "List three uses of copper.",
    "Explain what a prime number is.", "Tell me a short story about a fox.", "How do plants make food?",
    "What is 17 times 3?", "Describe the colour blue to someone who cannot see.",
]
LENGTHS = (8, 24, 64)


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}


async def stream(http, url: str, prompt: str, max_tokens: int, stop_after: int | None = None) -> tuple[str, float, str]:  # noqa: ANN001
    """(text, time to first token, finish reason or 'cancelled')."""
    t0 = time.perf_counter()
    ttft, pieces, finish, n = 0.0, [], "", 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body(prompt, max_tokens), timeout=600) as r:
        if r.status_code != 200:
            return "", 0.0, f"http {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return "".join(pieces), ttft, f"error: {d['error']['message']}"
            choice = d["choices"][0]
            if content := choice["delta"].get("content"):
                if not ttft:
                    ttft = time.perf_counter() - t0
                pieces.append(content)
                n += 1
                if stop_after is not None and n >= stop_after:
                    return "".join(pieces), ttft, "cancelled"
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return "".join(pieces), ttft, finish


async def vanish(port: int, prompt: str, max_tokens: int) -> None:
    """A client that sends a streaming request, reads a little and is gone (a TCP reset)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body(prompt, max_tokens)).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    seen = b""
    while seen.count(b"data: ") < 3:
        chunk = await asyncio.wait_for(reader.read(4096), 600)
        if not chunk:
            break
        seen += chunk
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def run(args: argparse.Namespace) -> None:
    import httpx
    import psutil

    from exo_tui.api.server import ApiServer
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.local_nodes import free_port
    from exo_tui.cluster.view import Command
    from exo_tui.config import Config

    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 10.0
    home = Path(tempfile.mkdtemp(prefix="exo-soak-"))
    c = Coordinator(local_nodes=2, config=config, home=home, persist=False, strategy="even")
    port = free_port()
    server = ApiServer(c, port=port)
    await server.start()
    await c.start()
    changes: list[str] = []  # what happened to the cluster, from its events

    async def watch() -> None:
        from exo_tui import events as ev

        with c.events.subscribe() as sub:
            async for e in sub:
                if isinstance(e, ev.OperatorAction):
                    changes.append(f"{e.action} {e.target}: {e.result}")
                elif isinstance(e, ev.NodeFailed):
                    changes.append(f"node {c.node_name(e.node_id)} failed: {e.reason}")
                elif isinstance(e, ev.PlanChanged):
                    changes.append(f"plan v{e.version} ({e.reason})")

    watcher = asyncio.create_task(watch())
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    kinds = ["complete"] * args.requests
    for i in rng.sample(range(args.requests), args.requests // 5):
        kinds[i] = "cancel" if i % 2 else "vanish"
    prompts, lengths = PROMPTS[: args.prompts], tuple(int(n) for n in args.lengths.split(","))
    plan = [(rng.choice(prompts), rng.choice(lengths), k) for k in kinds]
    procs = {"coordinator": psutil.Process()} | {n.name: psutil.Process(n.process.pid) for n in c._local}
    lost: list[str] = []
    differ: list[int] = []
    ttfts: list[float] = []
    rss_at: dict[str, dict[str, int]] = {}
    done = 0
    counts = {"complete": 0, "cancel": 0, "vanish": 0}
    t_start = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            solo = {}
            for p in prompts:
                for n in lengths:
                    text, _, finish = await stream(http, url, p, n)
                    assert finish in ("stop", "length"), finish
                    solo[(p, n)] = text
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                nonlocal done
                prompt, n, kind = plan[i]
                async with sem:
                    try:
                        if kind == "vanish":
                            await vanish(port, prompt, n)
                        else:
                            text, ttft, finish = await stream(http, url, prompt, n, n // 2 if kind == "cancel" else None)
                            if kind == "complete":
                                if finish not in ("stop", "length"):
                                    lost.append(f"request {i}: {finish}")
                                elif text != solo[(prompt, n)]:
                                    differ.append(i)
                                ttfts.append(ttft)
                            elif finish.startswith(("error", "http")):
                                lost.append(f"request {i} ({kind}): {finish}")
                    except Exception as exc:  # noqa: BLE001 - counted as lost, with the reason
                        lost.append(f"request {i} ({kind}): {type(exc).__name__}: {exc}")
                    counts[kind] += 1
                    done += 1
                    if done == args.steady_from:
                        rss_at["steady"] = {k: p.memory_info().rss for k, p in procs.items() if p.is_running()}
                    if done == args.drain_at:
                        name = c._local[0].name
                        asyncio.create_task(c.apply(await c.preview(Command("drain", (name,)))))
                    if done == args.drain_at + args.undrain_after:
                        asyncio.create_task(c.apply(await c.preview(Command("undrain", (c._local[0].name,)))))
                    if done == args.kill_at:
                        victim = c._local[1]
                        os.kill(victim.process.pid, signal.SIGKILL)
                        procs.pop(victim.name, None)

            await asyncio.gather(*(one(i) for i in range(args.requests)))
            await asyncio.sleep(2.5)  # a heartbeat or two after the last
            rss_at["end"] = {k: p.memory_info().rss for k, p in procs.items() if p.is_running()}
            kv = {h.name: dict(h.metrics.get("kv") or {}) for h in c.nodes.values() if h.state != "failed"}
    finally:
        watcher.cancel()
        await server.stop()
        await c.stop()
    wall = time.perf_counter() - t_start
    print(f"{args.requests} requests at {args.concurrency} concurrent in {wall:.0f} s: "
          f"{counts['complete']} completed, {counts['cancel']} cancelled midway, {counts['vanish']} disconnected")
    print("cluster changes during the run:" + "".join(f"\n  {x}" for x in changes))
    print(f"lost: {len(lost)}" + "".join(f"\n  {x}" for x in lost[:10]))
    print(f"completed greedy answers unlike their solo run: {len(differ)} {differ[:10]}")
    print(f"resident memory, request {args.steady_from} -> last:")
    for k in rss_at.get("end", {}):
        a, b = rss_at.get("steady", {}).get(k), rss_at["end"][k]
        if a:
            print(f"  {k:24s} {a / 1e6:7.1f} MB -> {b / 1e6:7.1f} MB  ({(b - a) / a * 100:+.1f} %)")
    print("nodes' KV after: " + ", ".join(f"{n}: {d.get('requests', '?')} requests, {d.get('used_bytes', 0) / 1e6:.1f} MB"
                                           for n, d in kv.items()))
    if ttfts:
        q = statistics.quantiles(ttfts, n=100)
        print(f"time to first token: p50 {statistics.median(ttfts) * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms "
              f"({len(ttfts)} completed requests)")
    print(f"admission: {c.admission.stats().to_dict()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--drain-at", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=120)
    ap.add_argument("--undrain-after", type=int, default=30, help="requests after the drain, the undrain")
    ap.add_argument("--steady-from", type=int, default=200, help="the request from which memory growth is measured")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the answers' max_tokens, drawn from")
    args = parse(ap, requests=24, concurrency=4, drain_at=3, undrain_after=5, kill_at=18, steady_from=20, prompts=2,
                 lengths="4,8")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
