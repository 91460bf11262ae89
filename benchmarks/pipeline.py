"""Decode speed of one stream through 1, 2, 3 and 4 node processes on loopback, TLS on and off,
on uvloop and on asyncio's own event loop (coordinator and nodes alike, ``EXO_TUI_EVENT_LOOP``).

For each loop and TLS setting, one real coordinator per node count runs with ``--local-nodes N``
(the same backend on every node, layers split evenly), all of them up at once, and they take turns:
each round every cluster decodes one greedy stream of ``--tokens`` tokens of the default model.
Each figure is the median over the rounds of a stream's mean time a decode token (its decode time
over its tokens: where the ring hands tokens on by itself they may reach the coordinator in bursts). Taking turns in short blocks matters on a
shared machine, whose speed drifts by 10-15 % over minutes: measured one configuration after the
other, that drift lands in the ratios. The per-hop time is what each extra node adds to a decode
step: ``(step(N) - step(1)) / (N - 1)``.

    python benchmarks/pipeline.py [--backend onnx] [--tokens 48] [--rounds 5] [--nodes 1,2,3,4]
                                  [--loops uvloop,asyncio] [--variants default,nospin,spin,pin,1thread]
                                  [--in-process] [--threads N]

``--in-process`` adds, taking turns with the clusters, the whole model on one shard in this
process (the same generation loop over :class:`~exo_tui.inference.local.LocalPipeline`, the same
speculation mode as the coordinator's): "served ÷ in-process" is a cluster's tok/s over it. A
second table splits each cluster's decode token as the coordinator's ring figures do (the nodes'
compute and queue, the links, the coordinator's own share), counts the hops a token crosses, and
gives the CPU a token of the coordinator's process and of the cluster's node processes (a stream's
CPU time over its tokens, medians) beside the in-process loop's: on a machine other work keeps
busy, CPU a token moves far less than wall time. ``--threads N`` gives every node and the
in-process shard ``N`` intra-op threads (default: the physical cores), so that the two compare at
the same setting.

``--variants`` runs every cluster in each of these ONNX settings, side by side: ``default``
(intra-op threads spin up to ``SPIN_US`` between the ops of a step), ``nospin`` (they never spin,
``EXO_TUI_ONNX_SPIN=0``), ``spin`` (they spin until each step ends, ``EXO_TUI_ONNX_SPIN=1``),
``pin`` (core pinning, ``EXO_TUI_ONNX_PIN=1``, see ``backends/onnx/affinity.py``) and ``1thread``
(one intra-op thread a node, ``EXO_TUI_THREADS=1``: nodes sharing a machine then do not share
cores within a step), and ``no-handoff`` (the coordinator sending every step: the last hop does
not hand its token to the first, ``RemotePipeline.lease_tokens = 1``; beside ``default``, on the
same cluster, the two ways taking turns); on that cluster too, ``lease64`` (leases of 64 steps:
the coordinator sends a step every 64 tokens) and ``coord-batch`` / ``coord-idle`` (the
coordinator's event loop thread, this process's, at ``SCHED_BATCH``: it never preempts a thread
on waking, or ``SCHED_IDLE``: it runs where a core has nothing else, during those streams).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402

VARIANTS = {  # name -> the environment the node processes start with (see backends/onnx/__init__.py)
    "default": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
    "nospin": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "0", "EXO_TUI_THREADS": ""},
    "spin": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "1", "EXO_TUI_THREADS": ""},
    "pin": {"EXO_TUI_ONNX_PIN": "1", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
    "1thread": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": "1"},
    # the default's nodes, the coordinator sending every step (no hand-off: cluster/pipeline.py's lease_tokens 1)
    "no-handoff": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
    # the default's nodes, a lease 4x as long: the coordinator sends a step every 64 tokens
    "lease64": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
    # the default's nodes, the coordinator's thread under another scheduling policy during its streams
    "coord-batch": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
    "coord-idle": {"EXO_TUI_ONNX_PIN": "0", "EXO_TUI_ONNX_SPIN": "", "EXO_TUI_THREADS": ""},
}
SAME_NODES = {"no-handoff", "lease64", "coord-batch", "coord-idle"}  # the default's cluster, used another way
LEASES = {"no-handoff": 1, "lease64": 64}
POLICIES = {"coord-batch": "SCHED_BATCH", "coord-idle": "SCHED_IDLE"}


def _policy(variant: str) -> None:
    """The scheduling policy of this (the coordinator's event loop) thread for ``variant``'s
    streams (Linux: a thread's own); SCHED_OTHER for every other."""
    if hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, getattr(os, POLICIES.get(variant, "SCHED_OTHER")), os.sched_param(0))

if TYPE_CHECKING:
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.inference.local import LocalPipeline


async def _steps(c: Coordinator, tokens: int) -> list[float]:
    """Seconds between tokens of one greedy stream, from its first decode token on (prefill's left
    out). The first decode token is the step the coordinator sends, answered at once; the tokens
    the ring hands on come a few to a write, held up to the node's TOKEN_HOLD_S: counted from a
    held one, the span (and so the mean) came out short by its hold (5-15 % of a 64-token stream
    at 10 ms, a token ~3 ms), which flattered the served path against the in-process loop."""
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    prompt = c.model.chat_prompt_ids([{"role": "user", "content": "Write a long poem about the sea."}])
    request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
    stamps: list[float] = []
    async for chunk in c.generate(request):
        if chunk.token_id is not None:
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


async def _local_steps(pipeline: LocalPipeline, c: Coordinator, tokens: int) -> list[float]:
    """As :func:`_steps`, the model on one shard in this process (speculation as ``c``'s)."""
    from exo_tui.inference.generate import generate
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams
    from exo_tui.inference.speculation import Speculation

    prompt = c.model.chat_prompt_ids([{"role": "user", "content": "Write a long poem about the sea."}])
    request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
    request.speculation = Speculation.for_request(c.speculative)
    stamps: list[float] = []
    async for chunk in generate(pipeline, c.model.tokenizer, request, context_length=c.context_length):
        if chunk.token_id is not None:
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def _cpu(c: Coordinator | None) -> tuple[float, float]:
    """CPU seconds so far of this process and of ``c``'s node processes (none: in process)."""
    import psutil

    nodes = 0.0
    for node in (c._local if c is not None else ()):  # noqa: SLF001 - the benchmark reads its own cluster
        try:
            nodes += sum(psutil.Process(node.process.pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return time.process_time(), nodes


def _per_token(before: tuple[float, float], after: tuple[float, float], tokens: int) -> tuple[float, float]:
    return (after[0] - before[0]) / tokens, (after[1] - before[1]) / tokens


def _split(ring: list[Any]) -> dict[str, float]:
    """The mean decode token of these ring figures' tokens, split (seconds), and the links it crossed."""
    if not ring:
        return {}
    n = len(ring)
    return {"total": sum(t.total_s for t in ring) / n,
            "compute": sum(sum(t.compute.values()) for t in ring) / n,
            "queue": sum(sum(t.queue.values()) for t in ring) / n,
            "links": sum(sum(t.links.values()) for t in ring) / n,
            "coordinator": sum(t.coordinator_s for t in ring) / n,
            "hops": sum(len(t.links) for t in ring) / n}


async def _group(
    counts: list[int], variants: list[str], backend: str, tls: bool, tokens: int, rounds: int, home: Path,
    in_process: bool = False, splits: dict[tuple[str, int], dict[str, float]] | None = None, threads: int = 0,
) -> dict[tuple[str, int], float]:
    """Seconds per decode step for each variant and node count (and ``("in-process", 1)``), the
    median of the streams' means,
    the clusters taking turns; each cluster's token split into ``splits``."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.pipeline import LEASE_TOKENS
    from exo_tui.config import Config
    from exo_tui.inference.local import LocalPipeline, Stage

    config = Config()
    config.network.security.enable_tls = tls
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0
    coordinators: dict[tuple[str, int], Coordinator] = {}
    try:
        for variant in variants:
            os.environ.update(VARIANTS[variant])  # the node processes read it at start
            if threads and not os.environ["EXO_TUI_THREADS"]:
                os.environ["EXO_TUI_THREADS"] = str(threads)
            for n in counts:
                if variant in SAME_NODES and ("default", n) in coordinators:  # the same cluster, the other way
                    coordinators[(variant, n)] = coordinators[("default", n)]
                    continue
                c = Coordinator(local_nodes=n, local_backends=[backend], strategy="even", config=config,
                                home=home / f"{n}-nodes-{variant}", persist=False)
                await c.start()
                coordinators[(variant, n)] = c
        local = None
        if in_process:
            c0 = next(iter(coordinators.values()))
            assert c0.model is not None
            if threads:
                from backends import configure_backend

                configure_backend(backend, threads=threads)
            local = LocalPipeline()
            await local.load(c0.model.gguf, [Stage(backend, 0, c0.model.config.n_layers)])
        gaps: dict[tuple[str, int], list[float]] = {k: [] for k in coordinators}
        if local is not None:
            gaps[("in-process", 1)] = []
        timed: dict[tuple[str, int], list[Any]] = {k: [] for k in coordinators}
        cpu: dict[tuple[str, int], list[tuple[float, float]]] = {k: [] for k in gaps}
        for _ in range(rounds):
            for k, c in coordinators.items():
                c.pipeline.lease_tokens = LEASES.get(k[0], LEASE_TOKENS)
                began = time.monotonic()
                before = _cpu(c)
                _policy(k[0])
                try:
                    gaps[k].append(statistics.mean(await _steps(c, tokens)))
                finally:
                    _policy("default")
                cpu[k].append(_per_token(before, _cpu(c), tokens))
                timed[k] += [t for t in c.metrics.ring if t.ts >= began]
            if local is not None:
                before = _cpu(None)
                gaps[("in-process", 1)].append(statistics.mean(await _local_steps(local, c0, tokens)))
                cpu[("in-process", 1)].append(_per_token(before, _cpu(None), tokens))
        if splits is not None:
            for k, ring in timed.items():
                splits[k] = _split(ring)
            for k, got in cpu.items():
                splits.setdefault(k, {}).update(cpu_self=statistics.median(x for x, _ in got),
                                                cpu_nodes=statistics.median(y for _, y in got))
        return {k: statistics.median(g) for k, g in gaps.items()}
    finally:
        if local is not None:
            await local.close()
        for c in {id(c): c for c in coordinators.values()}.values():
            await c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="turns each cluster takes")
    ap.add_argument("--nodes", default="1,2,3,4")
    ap.add_argument("--loops", default="uvloop,asyncio", help="event loops to compare (uvloop needs uvloop installed)")
    ap.add_argument("--tls", default="on,off", help="TLS settings to measure: on, off or on,off")
    ap.add_argument("--variants", default="default", help=f"ONNX settings to compare, of {', '.join(VARIANTS)}")
    ap.add_argument("--in-process", action="store_true",
                    help="also the whole model in this process, taking turns with the clusters")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads of every node and of the in-process shard (default: the physical cores)")
    args = parse(ap, tokens=4, rounds=1, nodes="2", loops="asyncio", tls="on")
    from exo_tui.net import loop as event_loop

    counts = [int(x) for x in args.nodes.split(",")]
    loops = args.loops.split(",")
    tls_settings = [t == "on" for t in args.tls.split(",")]
    if not set(args.tls.split(",")) <= {"on", "off"}:
        ap.error("--tls takes on, off or on,off")
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants takes some of {', '.join(VARIANTS)}")
    med: dict[tuple[str, bool, str, int], float] = {}
    splits: dict[tuple[str, bool, str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        for loop in loops:
            os.environ[event_loop.ENV] = loop  # node processes inherit it
            for tls in tls_settings:
                home = Path(d) / f"{loop}-{'tls' if tls else 'plain'}"
                split: dict[tuple[str, int], dict[str, float]] = {}
                steps = event_loop.run(_group(counts, variants, args.backend, tls, args.tokens, args.rounds, home,
                                              args.in_process, split, args.threads))
                for (variant, n), step in steps.items():
                    med[(loop, tls, variant, n)] = step
                for (variant, n), parts in split.items():
                    splits[(loop, tls, variant, n)] = parts
    print(f"\nDecode of the default model, one stream, {args.backend} on every node, loopback, "
          f"the clusters taking turns, {args.rounds} streams of {args.tokens} tokens each, medians of the streams' means\n")
    print("| loop | TLS | variant | nodes | ms/token | tok/s | ÷ 1 node | per extra hop, ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for loop in loops:
        for tls in tls_settings:
            for variant in variants:
                one = med.get((loop, tls, variant, 1))
                for n in counts:
                    s = med[(loop, tls, variant, n)]
                    ratio = f"{one / s:.2f}" if one else "–"
                    hop = f"{(s - one) / (n - 1) * 1000:.2f}" if one and n > 1 else "–"
                    print(f"| {loop} | {'on' if tls else 'off'} | {variant} | {n} | {s * 1000:.1f} | {1 / s:.1f} | {ratio} | {hop} |")
            local = med.get((loop, tls, "in-process", 1))
            if local:
                print(f"| {loop} | {'on' if tls else 'off'} | in-process | 1 | {local * 1000:.1f} | {1 / local:.1f} | – | – |")
    if any(k[2] == "in-process" for k in med):
        print("\nEach cluster's decode token as its ring figures split it (means, ms), served ÷ in-process, and the "
              "CPU a token (ms) of the coordinator's process / its nodes' (in process: the one process's)\n")
        print("| loop | TLS | variant | nodes | compute | queue | links | coordinator | hops a token | served ÷ in-process "
              "| CPU a token |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for (loop, tls, variant, n), parts in splits.items():
            local = med.get((loop, tls, "in-process", 1))
            ratio = f"{local / med[(loop, tls, variant, n)]:.2f}" if local else "–"
            ms = {k: f"{v * 1000:.2f}" for k, v in parts.items()}
            if variant == "in-process":
                print(f"| {loop} | {'on' if tls else 'off'} | in-process | 1 | | | | | | 1.00 | {ms['cpu_self']} |")
                continue
            if "compute" not in parts:
                continue
            print(f"| {loop} | {'on' if tls else 'off'} | {variant} | {n} | {ms['compute']} | {ms['queue']} | "
                  f"{ms['links']} | {ms['coordinator']} | {parts['hops']:.1f} | {ratio} | "
                  f"{ms['cpu_self']} / {ms['cpu_nodes']} |")


if __name__ == "__main__":
    main()
