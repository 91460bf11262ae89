"""Scheduler benchmark: decision time, and predicted speed against exo's ring split.

    .venv/bin/python benchmarks/scheduler.py [--quick] [--trials N] [--clusters N]

1. Decision time (``make_plan``: scores, eligibility, ring order, partition, predictions) for
   8 / 64 / 256 nodes x 32 / 80 / 128 layers, with two pins, p50 and p99 over random
   heterogeneous clusters (target: p99 < 10 ms at 64 nodes x 128 layers, latency strategy).
2. On random heterogeneous clusters (2-8 devices of the kinds in
   ``exo_tui/scheduler/cluster_spec.py``, random links, a synthetic model that fits), the
   distribution of predicted tokens/s of ``latency`` (one stream) and ``throughput`` (saturated)
   over ``exo-ring`` on the same cluster, measured side by side.
3. The example clusters of ``examples/clusters/``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quick import parse  # noqa: E402
from exo_tui.config import load_yaml  # noqa: E402
from exo_tui.scheduler import (  # noqa: E402
    Constraints,
    InfeasiblePlan,
    ModelSpec,
    Pin,
    make_plan,
    score_nodes,
    synthetic_spec,
)
from exo_tui.scheduler.cluster_spec import DEVICE_KINDS, profiles_from_cluster  # noqa: E402

GB = 1024**3


def random_cluster(rng: random.Random, n: int, dense_links: bool = True) -> dict:
    kinds = list(DEVICE_KINDS)
    nodes = []
    for i in range(n):
        kind = rng.choice(kinds)
        k = DEVICE_KINDS[kind]
        nodes.append({"id": f"n{i:03d}", "kind": kind, "available_gb": round(k.ram_gb * rng.uniform(0.4, 0.9), 1),
                      "load": rng.choice([0.0, 0.0, 0.0, 0.1, 0.3])})
    links = []
    if dense_links:
        # two to four sites; fast links inside a site, a slower one between sites
        sites = [rng.randrange(rng.randint(1, 4)) for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                kind = rng.choice(["ethernet-10g", "ethernet-1g", "thunderbolt"]) if sites[i] == sites[j] else rng.choice(["wifi", "ethernet-1g"])
                links.append({"between": [nodes[i]["id"], nodes[j]["id"]], "kind": kind})
    return {"name": f"random-{n}", "default_link": "wifi", "nodes": nodes, "links": links}


def layered_spec(n_layers: int, total_gb: float) -> ModelSpec:
    """Llama-like proportions: embedding and head each about 1.2 layers."""
    per = int(total_gb * 1e9 / (n_layers + 2.4))
    return ModelSpec(f"bench-{n_layers}", n_layers, per, int(1.2 * per), int(1.2 * per), 8192, 8192, 2048)


def decision_times(trials: int, sizes: list[int], layer_counts: list[int], strategies: list[str]) -> list[dict]:
    rows = []
    rng = random.Random(1)
    for n in sizes:
        for L in layer_counts:
            for strategy in strategies:
                times, cpu, cpu_scored, ok = [], [], [], 0
                for _ in range(trials):
                    data = random_cluster(rng, n)
                    profiles = profiles_from_cluster(data)
                    # a model needing about a third of the cluster's memory
                    usable = sorted(p.usable_bytes(2 * GB, 1 * GB, 0.1) for p in profiles)  # after the default reserves
                    # a model needing about 30 % of the cluster, with layers a median node can hold a few of
                    total = min(0.3 * sum(usable), 0.25 * L * usable[len(usable) // 2])
                    spec = layered_spec(L, total / 1e9)
                    # two pins of a few layers in the middle, on the two roomiest nodes
                    big = sorted(profiles, key=lambda p: -(p.vram_available_bytes if p.uses_vram else p.ram_available_bytes))
                    pins = (Pin(big[0].node_id, L // 4, L // 4 + 2), Pin(big[1].node_id, L // 2, L // 2 + 3)) if n > 1 else ()
                    c = Constraints(pins=pins)
                    t0, c0 = time.perf_counter(), time.process_time()
                    try:
                        make_plan(profiles, spec, strategy, c, now=0.0)
                        ok += 1
                    except InfeasiblePlan:
                        pass
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    # the coordinator scores nodes on every heartbeat for the console anyway
                    scores = score_nodes(profiles, spec, now=0.0)
                    c1 = time.process_time()
                    try:
                        make_plan(profiles, spec, strategy, c, now=0.0, scores=scores)
                    except InfeasiblePlan:
                        pass
                    cpu_scored.append(time.process_time() - c1)
                a = np.array(times) * 1000
                b = np.array(cpu) * 1000
                sc = np.array(cpu_scored) * 1000
                rows.append({"nodes": n, "layers": L, "strategy": strategy, "p50_ms": float(np.percentile(a, 50)),
                             "p99_ms": float(np.percentile(a, 99)), "cpu_p50_ms": float(np.percentile(b, 50)),
                             "cpu_p99_ms": float(np.percentile(b, 99)), "scored_p50_ms": float(np.percentile(sc, 50)),
                             "scored_p99_ms": float(np.percentile(sc, 99)), "trials": trials, "feasible": ok})
                print(f"  {n:4d} nodes x {L:4d} layers {strategy:10s}: wall p50 {rows[-1]['p50_ms']:7.2f} ms "
                      f"p99 {rows[-1]['p99_ms']:7.2f} ms | cpu p50 {rows[-1]['cpu_p50_ms']:7.2f} ms "
                      f"p99 {rows[-1]['cpu_p99_ms']:7.2f} ms | scores given: cpu p50 {rows[-1]['scored_p50_ms']:6.2f} "
                      f"p99 {rows[-1]['scored_p99_ms']:6.2f} ms | {ok}/{trials} feasible", flush=True)
    return rows


def quantiles(xs: list[float]) -> str:
    a = np.array(xs)
    return " ".join(f"{q}:{np.percentile(a, q):6.2f}" for q in (0, 10, 50, 90, 100)) + f"  mean:{a.mean():6.2f}"


def versus_exo(n_clusters: int) -> dict:
    rng = random.Random(7)
    models = ["1b", "3b", "8b", "13b", "70b"]
    lat, thr, lat_fit, thr_fit, sat_lat = [], [], [], [], []
    exo_over = 0
    done = 0
    skipped = 0
    while done < n_clusters:
        data = random_cluster(rng, rng.randint(2, 8))
        profiles = profiles_from_cluster(data)
        spec = synthetic_spec(rng.choice(models), context_length=rng.choice([2048, 8192]))
        try:
            la = make_plan(profiles, spec, "latency", now=0.0)
            th = make_plan(profiles, spec, "throughput", now=0.0)
        except InfeasiblePlan:
            skipped += 1
            continue
        exo = make_plan(profiles, spec, "exo-ring", now=0.0, check_memory=False)
        r1 = la.predictions.tok_per_s_single / exo.predictions.tok_per_s_single
        r2 = th.predictions.tok_per_s_saturated / exo.predictions.tok_per_s_saturated
        lat.append(r1)
        thr.append(r2)
        sat_lat.append(la.predictions.tok_per_s_saturated / exo.predictions.tok_per_s_saturated)
        if exo.predictions.fits_memory:
            lat_fit.append(r1)
            thr_fit.append(r2)
        else:
            exo_over += 1
        done += 1
    return {"latency_single": lat, "throughput_saturated": thr, "latency_single_fit": lat_fit,
            "throughput_saturated_fit": thr_fit, "latency_saturated": sat_lat, "exo_over_memory": exo_over,
            "infeasible_skipped": skipped}


def versus_optimum(n_cases: int) -> list[float]:
    """Latency's predicted time per token over the brute-force optimum (every subset, order and
    split) on small random clusters: 2-4 nodes, 4-12 layers, random asymmetric links."""
    import itertools

    from exo_tui.config import SchedulerConfig
    from exo_tui.scheduler import DeviceProfile, Link, predict

    rng = random.Random(3)
    rr = SchedulerConfig().resource_reservation
    ratios = []
    while len(ratios) < n_cases:
        n, k = rng.randint(4, 12), rng.randint(2, 4)
        ids = [f"n{i}" for i in range(k)]
        lay = int(rng.uniform(50, 800) * 1e6)
        spec = ModelSpec("x", n, lay, int(lay * 1.2), int(lay * 1.2), 0, 4096, 1)
        ps = [DeviceProfile(nid, ram_total_bytes=100 * GB, ram_available_bytes=int(12 * GB + rng.randint(1, n) * lay * 1.3),
                            memory_bandwidth_bytes_per_s=rng.choice([5e9, 20e9, 100e9, 400e9]),
                            links={o: Link(rng.choice([0.0001, 0.001, 0.005, 0.02]), rng.choice([1e8, 1e9]))
                                   for o in ids if o != nid}) for nid in ids]
        by = {p.node_id: p for p in ps}
        room = {p.node_id: p.usable_bytes(rr.system_reserved_ram * GB, rr.system_reserved_vram * GB, rr.emergency_reserve) for p in ps}
        best = None
        for m in range(1, k + 1):
            for nodes in itertools.permutations(ids, m):
                for cuts in itertools.combinations(range(1, n), m - 1):
                    b = [0, *cuts, n]
                    sh = [(nodes[i], b[i], b[i + 1]) for i in range(m)]
                    if all(spec.range_bytes(s, e) <= room[x] for x, s, e in sh):
                        t = predict(sh, by, spec).decode_s_per_token
                        best = t if best is None else min(best, t)
        if best is None:
            continue
        plan = make_plan(ps, spec, "latency", now=0.0)
        ratios.append(plan.predictions.decode_s_per_token / best)
    return ratios


def examples() -> list[tuple[str, str, float, float, float, float, bool]]:
    out = []
    for path in sorted((ROOT / "examples" / "clusters").glob("*.yaml")):
        data = load_yaml(path.read_text())
        profiles = profiles_from_cluster(data)
        for model in ("synthetic:1b", "synthetic:8b", "synthetic:70b"):
            spec = synthetic_spec(model)
            try:
                la = make_plan(profiles, spec, "latency", now=0.0)
                th = make_plan(profiles, spec, "throughput", now=0.0)
            except InfeasiblePlan:
                out.append((path.stem, model, 0, 0, 0, 0, False))
                continue
            exo = make_plan(profiles, spec, "exo-ring", now=0.0, check_memory=False)
            out.append((path.stem, model, la.predictions.tok_per_s_single, exo.predictions.tok_per_s_single,
                        th.predictions.tok_per_s_saturated, exo.predictions.tok_per_s_saturated, exo.predictions.fits_memory))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--optimum", type=int, default=300, help="small clusters checked against the brute-force optimum")
    ap.add_argument("--nodes", default="8,64,256", help="cluster sizes the decision time is measured at")
    ap.add_argument("--layers", default="32,80,128", help="model depths the decision time is measured at")
    args = parse(ap, trials=3, clusters=20, optimum=10, nodes="8,64", layers="32,128")
    trials, n_clusters = args.trials, args.clusters
    sizes, depths = [int(x) for x in args.nodes.split(",")], [int(x) for x in args.layers.split(",")]

    print("## Decision time (make_plan, two pins, random heterogeneous clusters)\n")
    rows = decision_times(trials, sizes, depths, ["latency", "throughput"])
    print("\nCPU time of make_plan (wall time on this shared machine is noisier; scores given = the")
    print("coordinator's per-heartbeat scores passed in):\n")
    print("| nodes | layers | latency p50 / p99 | throughput p50 / p99 | latency, scores given p50 / p99 | wall latency p50 / p99 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for L in depths:
            la = next(r for r in rows if r["nodes"] == n and r["layers"] == L and r["strategy"] == "latency")
            th = next(r for r in rows if r["nodes"] == n and r["layers"] == L and r["strategy"] == "throughput")
            print(f"| {n} | {L} | {la['cpu_p50_ms']:.1f} / {la['cpu_p99_ms']:.1f} ms | {th['cpu_p50_ms']:.1f} / {th['cpu_p99_ms']:.1f} ms "
                  f"| {la['scored_p50_ms']:.1f} / {la['scored_p99_ms']:.1f} ms | {la['p50_ms']:.1f} / {la['p99_ms']:.1f} ms |")
    target = next((r for r in rows if r["nodes"] == 64 and r["layers"] == 128 and r["strategy"] == "latency"), None)
    if target is not None:
        print(f"\ntarget p99 < 10 ms at 64 x 128 (latency): CPU p99 {target['cpu_p99_ms']:.2f} ms "
              f"({'met' if target['cpu_p99_ms'] < 10 else 'NOT met'}), with scores given {target['scored_p99_ms']:.2f} ms, "
              f"wall p99 {target['p99_ms']:.2f} ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    print(f"\n## Predicted tokens/s over exo-ring on {n_clusters} random clusters (ratios, quantiles)\n")
    t0 = time.perf_counter()
    r = versus_exo(n_clusters)
    print(f"latency, one stream       {quantiles(r['latency_single'])}")
    print(f"throughput, saturated     {quantiles(r['throughput_saturated'])}")
    print(f"latency, saturated        {quantiles(r['latency_saturated'])}")
    if r["latency_single_fit"]:
        print(f"-- only where exo-ring fits memory ({len(r['latency_single_fit'])} clusters):")
        print(f"latency, one stream       {quantiles(r['latency_single_fit'])}")
        print(f"throughput, saturated     {quantiles(r['throughput_saturated_fit'])}")
    print(f"exo-ring over memory on {r['exo_over_memory']} of {n_clusters} clusters; "
          f"{r['infeasible_skipped']} drawn clusters could not hold the model and were redrawn "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"latency >= exo-ring on one stream in {sum(x >= 1 - 1e-9 for x in r['latency_single'])} of {n_clusters}; "
          f"throughput >= exo-ring saturated in {sum(x >= 1 - 1e-9 for x in r['throughput_saturated'])} of {n_clusters}; "
          f"median {statistics.median(r['latency_single']):.2f}x / {statistics.median(r['throughput_saturated']):.2f}x")

    n_opt = args.optimum
    print(f"\n## latency against the brute-force optimum ({n_opt} small clusters, time per token ratio)\n")
    opt = versus_optimum(n_opt)
    print(f"optimal in {sum(r < 1 + 1e-9 for r in opt)} of {n_opt}; {quantiles(opt)}")

    print("\n## Example clusters (tok/s predicted)\n")
    print("| cluster | model | latency 1 stream | exo-ring 1 stream | gain | throughput saturated | exo-ring saturated | gain | exo-ring fits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for c, m, la, ex, th, exs, fits in examples():
        if la == 0:
            print(f"| {c} | {m} | does not fit | | | | | | |")
            continue
        print(f"| {c} | {m} | {la:.1f} | {ex:.1f} | x{la / ex:.2f} | {th:.1f} | {exs:.1f} | x{th / exs:.2f} | {'yes' if fits else 'no'} |")


if __name__ == "__main__":
    main()
