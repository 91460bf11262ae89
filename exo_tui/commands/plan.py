"""``exo-tui plan``: simulate the scheduler on a described cluster, without running anything."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import JustifyMethod

STRATEGY_CHOICES = ("latency", "throughput", "memory", "exo-ring")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="simulate the scheduler: the plan for a model on a described cluster",
        description=(
            "Plan a model on a cluster described in YAML (see examples/clusters/) and print the "
            "plan, its predictions and the comparison with exo's ring split."
        ),
    )
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster description (YAML)")
    p.add_argument("--model", default="smollm2-135m", metavar="MODEL",
                   help="smollm2-135m, a name `exo-tui models` lists, a path to a .gguf, or synthetic:135m|1b|3b|8b|13b|70b|405b")
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default=None, help="default: the config's (latency)")
    p.add_argument("--pin", action="append", default=[], metavar="NODE:START-END",
                   help="fix layers START..END-1 to NODE (repeatable)")
    p.add_argument("--drain", action="append", default=[], metavar="NODE", help="give NODE nothing (repeatable)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for time to first token")
    p.add_argument("--context", type=int, default=None,
                   help="tokens the KV caches are sized for (default: the model's own, at most models.context_length)")
    p.add_argument("--min-layers", type=int, default=None, help="min_layers_per_shard (default: config)")
    p.add_argument("--config", default=None, metavar="FILE", help="config file (default: the user's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _fail(args: argparse.Namespace, message: str, code: int, **extra: Any) -> int:
    if args.json:
        print(json.dumps({"error": message, **extra}))
    else:
        print(f"exo-tui plan: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from ruamel.yaml import YAMLError

    from exo_tui.config import ConfigError, load_config, load_yaml
    from exo_tui.models.gguf_file import ModelFileError
    from exo_tui.models.spec import resolve_spec
    from exo_tui.scheduler import Constraints, InfeasiblePlan, Pin, make_plan, score_nodes
    from exo_tui.scheduler.cluster_spec import ClusterSpecError, profiles_from_cluster

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _fail(args, str(exc), 2)
    path = Path(args.cluster)
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return _fail(args, f"cannot read cluster file {path}: {exc.strerror or exc}; see examples/clusters/", 2)
    except YAMLError as exc:
        return _fail(args, f"cluster file {path} is not valid YAML: {exc}", 2)
    try:
        profiles = profiles_from_cluster(data, now=0.0)
    except ClusterSpecError as exc:
        return _fail(args, f"{path}: {exc}", 2)
    known = {p.node_id for p in profiles}
    for n in args.drain:
        if n not in known:
            return _fail(args, f"--drain {n}: no such node in {path} (nodes: {', '.join(sorted(known))})", 2)
    try:
        pins = tuple(Pin.parse(t) for t in args.pin)
    except ValueError as exc:
        return _fail(args, str(exc), 2)
    try:
        spec = resolve_spec(args.model, args.context, context_limit=config.models.context_length)
    except (ModelFileError, ValueError) as exc:
        return _fail(args, str(exc), 2)
    constraints = Constraints(
        pins=pins, drained=frozenset(args.drain), min_layers_per_shard=args.min_layers, prompt_tokens=args.prompt_tokens
    )
    sched = config.scheduler
    strategy = args.strategy or sched.partition.strategy
    scores = score_nodes(profiles, spec, sched, now=0.0)
    try:
        plan = make_plan(profiles, spec, strategy, constraints, sched, now=0.0, scores=scores)
    except InfeasiblePlan as exc:
        return _fail(args, f"no {strategy} plan: {exc}", 1, constraint=exc.constraint, shortfall_bytes=exc.shortfall_bytes)

    comparison: dict[str, dict[str, Any]] = {}
    for s in STRATEGY_CHOICES:
        c = constraints if s != "exo-ring" else Constraints(drained=constraints.drained, prompt_tokens=args.prompt_tokens)
        try:
            other = plan if s == strategy else make_plan(profiles, spec, s, c, sched, now=0.0, scores=scores, check_memory=False)
        except InfeasiblePlan as exc:
            comparison[s] = {"error": str(exc)}
            continue
        pr = other.predictions
        assert pr is not None
        comparison[s] = {
            "layout": other.layout,
            "ring": " · ".join(f"{x.node_id} {x.start}-{x.end - 1}" for x in other.shards),
            "tok_per_s_single": pr.tok_per_s_single,
            "tok_per_s_saturated": pr.tok_per_s_saturated,
            "ttft_s": pr.ttft_s,
            "load_balance_coefficient": pr.load_balance_coefficient,
            "fits_memory": pr.fits_memory,
        }
    base = comparison.get("exo-ring", {})
    for row in comparison.values():
        if "error" not in row and "error" not in base and base.get("tok_per_s_single"):
            row["single_vs_exo_ring"] = row["tok_per_s_single"] / base["tok_per_s_single"]
            row["saturated_vs_exo_ring"] = row["tok_per_s_saturated"] / base["tok_per_s_saturated"]

    if args.json:
        print(json.dumps({
            "cluster": data.get("name", path.stem),
            "model": spec.to_dict(),
            "strategy": strategy,
            "plan": plan.to_dict(),
            "scores": {n: s.to_dict() for n, s in scores.items()},
            "comparison": comparison,
        }))
        return 0
    _print(data.get("name", path.stem), spec, plan, profiles, scores, comparison, strategy, set(args.drain))
    return 0


def _print(cluster: str, spec: Any, plan: Any, profiles: list[Any], scores: dict[str, Any],
           comparison: dict[str, dict[str, Any]], strategy: str, drained: set[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    pr = plan.predictions
    names = {p.node_id: p.label for p in profiles}
    t = Table(title=f"{cluster}: {spec.name}, {spec.n_layers} layers, strategy {strategy} (plan v{plan.version})")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("#", "right"), ("node", "left"), ("device", "left"), ("layers", "left"), ("n", "right"),
                   ("memory / free", "right"), ("compute", "right"), ("hop", "right"), ("stage", "right"),
                   ("score", "right"))
    for col, j in columns:
        t.add_column(col, justify=j)
    for i, s in enumerate(plan.shards):
        n = pr.node(s.node_id)
        pin = " (pinned)" if s.pinned else ""
        t.add_row(str(i + 1), s.node_id, names[s.node_id], f"{s.start}-{s.end - 1}{pin}", str(s.n_layers),
                  f"{n.memory_bytes / 1e9:.1f} / {n.usable_bytes / 1e9:.1f} GB", f"{n.compute_s * 1e3:.2f} ms",
                  f"{n.hop_s * 1e3:.2f} ms", f"{n.stage_s * 1e3:.2f} ms", f"{scores[s.node_id].score:.0f}")
    used = set(plan.node_ids)
    for p in profiles:
        if p.node_id not in used:
            sc = scores[p.node_id]
            status = "drained" if p.node_id in drained or p.drained else ("not eligible" if not sc.eligible else "unused")
            t.add_row("-", p.node_id, names[p.node_id], status, "0", "-", "-", "-", "-",
                      f"{sc.score:.0f}" + ("" if sc.eligible else " ✗"), style="dim")
    console.print(t)
    console.print(
        f"one stream: [bold]{pr.tok_per_s_single:.2f} tok/s[/] ({pr.decode_s_per_token * 1e3:.1f} ms/token) · "
        f"saturated: [bold]{pr.tok_per_s_saturated:.2f} tok/s[/] · time to first token ({pr.prompt_tokens} tokens): "
        f"{pr.ttft_s:.2f} s · load balance std/mean: {pr.load_balance_coefficient:.2f}"
    )
    for r in plan.reasons:
        console.print(f"  · {r}")
    c = Table(title="strategies compared (ratios against exo-ring)")
    for col in ("strategy", "tok/s one stream", "tok/s saturated", "TTFT", "fits", "ring (layers)"):
        c.add_column(col)
    for s, row in comparison.items():
        if "error" in row:
            c.add_row(s, "-", "-", "-", "-", row["error"][:90])
            continue
        ratio = f" (x{row['single_vs_exo_ring']:.2f})" if "single_vs_exo_ring" in row else ""
        ratio_s = f" (x{row['saturated_vs_exo_ring']:.2f})" if "saturated_vs_exo_ring" in row else ""
        c.add_row(s + (" *" if s == strategy else ""), f"{row['tok_per_s_single']:.2f}{ratio}",
                  f"{row['tok_per_s_saturated']:.2f}{ratio_s}", f"{row['ttft_s']:.2f} s",
                  "yes" if row["fits_memory"] else "[red]no[/]", row["ring"])
    console.print(c)
