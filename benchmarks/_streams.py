"""``benchmarks/speculative.py``'s 8 streams (issue 42: "throughput at 8 streams must not drop"):
4 copy prompts and 4 free chat at once, greedy, a mode against ``off``.

Each round runs every mode once, one after the other (every other round in the reverse order),
and a round's ratio compares runs a few seconds apart, so a shared machine's drift over minutes
stays out of it; many rounds' ratios are the statement: their median, a 95 % interval of it
(bootstrap), their quartiles and the sign test of the rounds a mode lost. Per mode also: the
coordinator's CPU time per token (this process's, the nodes being processes of their own: its
Python competes with them for the cores), the share of tokens the ring handed on by itself
(hand-off leases), the verify steps run and the drafts proposed and not run. ``profile``: the
coordinator's busiest functions per mode (cProfile; it slows every mode alike).
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import math
import os
import pstats
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

STREAMS = 8
# mode name -> (speculation, the copies carry their prediction); "fixed": the copies at --stream-k
MODES = ("off", "auto", "predicted", "fixed")

Decode = Callable[..., Awaitable[dict[str, Any]]]


def modes(names: str, k: int) -> list[tuple[str, str | int, bool]]:
    """The modes asked for (``off`` always first): (name, speculation, with the prediction)."""
    asked = [m for m in names.split(",") if m]
    bad = set(asked) - set(MODES)
    if bad:
        raise ValueError(f"--stream-modes takes some of {','.join(MODES)}, not {','.join(sorted(bad))}")
    table = {"off": ("off", "off", False), "auto": ("auto", "auto", False),
             "predicted": ("auto predicted", "auto", True), "fixed": (f"k={k} predicted", k, True)}
    return [table[m] for m in ("off", *[m for m in asked if m != "off"])]


async def streams_round(decode: Decode, c: Any, copy: list[dict[str, str]], chat: list[dict[str, str]], tokens: int,
                        mode: str | int, answer: str | None, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """The 8 streams once (the copies with ``answer`` as their prediction where given; the chats
    under auto where the mode is a fixed k): aggregate tok/s, first token to last, and the rest."""
    handed = c.pipeline.handed_steps
    cpu, t0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        answers = await asyncio.gather(*(
            decode(c, chat, tokens, mode if isinstance(mode, str) else "auto") if i % 2 else
            decode(c, copy, tokens, mode, answer) for i in range(STREAMS)))
    finally:
        if profile is not None:
            profile.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    n = sum(len(a["tokens"]) for a in answers)
    return {"tok_s": n / wall, "cpu_ms": 1e3 * cpu / n, "handed": (c.pipeline.handed_steps - handed) / n,
            "steps": sum(len(a["k"]) for a in answers), "drafted": sum(a["drafted"] for a in answers),
            "accepted": sum(a["accepted"] for a in answers), "shadowed": sum(a["shadowed"] for a in answers),
            "k": [k for a in answers for k in a["k"]], "tokens": [a["tokens"] for a in answers]}


def sign_p(below: int, n: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven were either mode as likely
    to win a round."""
    tail = sum(math.comb(n, i) for i in range(min(below, n - below) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def median_interval(xs: list[float], resamples: int = 4000) -> tuple[float, float]:
    """A 95 % interval of the median of ``xs`` (bootstrap, a fixed seed)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def print_streams(runs: dict[tuple[str, int], list[dict[str, Any]]], sizes: tuple[int, ...], names: list[str],
                  rounds: int, tokens: int) -> None:
    """The 8 streams' table: each mode's rounds against the same rounds' ``off``."""
    print(f"\n{STREAMS} streams at once (4 copy and 4 chat prompts, greedy, {tokens} tokens each; 'predicted': the "
          f"copies with their prediction), aggregate tok/s first token to last, {rounds} rounds; ratios per round "
          f"against that round's off; load average {os.getloadavg()[0]:.1f} at the end (a shared machine)\n")
    print("| nodes | case | tok/s (median) | ÷ off: median | 95 % interval | quartiles | min-max | rounds below 1 "
          "(sign test p) | coordinator CPU ms/token | handed | verify steps | drafted / accepted | not run | "
          "k chosen (median) | same text as off |")
    print("|---:|---|---:|---:|---|---|---|---|---:|---:|---:|---|---:|---:|---|")
    for n in sizes:
        off = runs[("off", n)]
        for name in names:
            rs = runs[(name, n)]
            ratios = [r["tok_s"] / o["tok_s"] for r, o in zip(rs, off, strict=True)]
            same = all(r["tokens"] == o["tokens"] for r, o in zip(rs, off, strict=True))
            below = sum(x < 1 for x in ratios)
            lo, hi = median_interval(ratios)
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            sign = f"{below} of {len(ratios)} (p {sign_p(below, len(ratios)):.2g})" if name != "off" else "–"
            ks = [k for r in rs for k in r["k"]]
            print(f"| {n} | {name} | {statistics.median(r['tok_s'] for r in rs):.1f} | "
                  f"{statistics.median(ratios):.3f} | {lo:.2f}-{hi:.2f} | {q[0]:.2f}-{q[2]:.2f} | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} | {sign} | {statistics.median(r['cpu_ms'] for r in rs):.3f} | "
                  f"{statistics.mean(r['handed'] for r in rs):.1%} | {sum(r['steps'] for r in rs)} | "
                  f"{sum(r['drafted'] for r in rs)} / {sum(r['accepted'] for r in rs)} | "
                  f"{sum(r['shadowed'] for r in rs)} | {statistics.median(ks) if ks else 0:g} | {same} |")


def print_profiles(profiles: dict[tuple[str, int], cProfile.Profile]) -> None:
    for (name, n), profile in profiles.items():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(f"\n--- {n} node(s), 8 streams {name}: the coordinator's busiest functions (own time)\n{out.getvalue()}")
