"""Operator commands against a running coordinator (``exo-tui serve`` or a console):
``status``, ``drain``, ``undrain``, ``pin``, ``unpin``, ``rebalance``.

They talk to its HTTP API (``--url``, default the config's ``network.api`` address,
http://127.0.0.1:52415) with the API key of the config or ``EXO_TUI_API_KEY``, and change the
cluster exactly as the console's keys do: each action is planned by the coordinator, and
``--dry-run`` shows the plan diff without changing anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exo_tui.cluster.view import Command, parse_layers
from exo_tui.commands._args import read_secret, secret_help
from exo_tui.commands._coordinators import coordinators_of
from exo_tui.net.address import host_port

ACTIONS = ("drain", "undrain", "pin", "unpin", "rebalance")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="the coordinator's API (default http://127.0.0.1:52415, or network.api of the config)")
    p.add_argument("--api-key", default=None, nargs="?", const="", metavar="KEY",
                   help="API key (default network.api.key of the config, or $EXO_TUI_API_KEY)"
                        + secret_help("EXO_TUI_API_KEY"))
    p.add_argument("--config", default=None, metavar="F", help="config file (default ~/.config/exo-tui/config.yaml)")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the cluster of a running coordinator",
                       description="Nodes, their state, scores and layers, the plan of a running coordinator, and the figures it measured.")
    _common(p)
    p.set_defaults(func=run, action="status")

    for action, text in (("drain", "move a node's layers to the others and keep it empty"),
                         ("undrain", "let a drained node hold layers again")):
        p = sub.add_parser(action, help=text, description=f"{text[0].upper()}{text[1:]} (NODE: id or name).")
        p.add_argument("node", metavar="NODE", help="node id or name")
        p.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")
        _common(p)
        p.set_defaults(func=run, action=action)

    p = sub.add_parser("pin", help="fix layers to a node, kept there across rebalances",
                       description="Pin layers START-END (inclusive, e.g. 0-14) to a node (NODE: id or name): the "
                                   "plan changes so that the node holds exactly those layers, the others share the "
                                   "rest. Without START-END, pin the layers the node holds now.")
    p.add_argument("node", metavar="NODE")
    p.add_argument("layers", metavar="START-END", nargs="?", default=None,
                   help="layers for the node, inclusive (default: the layers it holds now)")
    p.add_argument("--dry-run", action="store_true")
    _common(p)
    p.set_defaults(func=run, action="pin")

    p = sub.add_parser("unpin", help="let rebalances move a pinned node's layers again", description="Unpin a node.")
    p.add_argument("node", metavar="NODE")
    p.add_argument("--dry-run", action="store_true")
    _common(p)
    p.set_defaults(func=run, action="unpin")

    p = sub.add_parser("rebalance", help="make the best plan for the cluster as it is now",
                       description="Plan afresh and switch to it; --dry-run shows the diff (moves, bytes, tok/s).")
    p.add_argument("--dry-run", action="store_true")
    _common(p)
    p.set_defaults(func=run, action="rebalance")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from exo_tui.api.client import ApiClientError
    from exo_tui.config import ConfigError

    try:
        url, key = _target(args)
        return asyncio.run(_run(args, url, key))
    except (ApiClientError, ConfigError, ValueError) as exc:
        print(f"exo-tui {args.action}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ApiClientError) and exc.code == "no_coordinator" else 1
    except Exception as exc:  # noqa: BLE001 - one line that says what failed, never a traceback
        print(f"exo-tui {args.action}: {type(exc).__name__}: {exc or 'no reason given'}", file=sys.stderr)
        return 1


def _target(args: argparse.Namespace) -> tuple[str, str | None]:
    from exo_tui.config import load_config

    config = load_config(args.config)
    key = read_secret(args.api_key, "EXO_TUI_API_KEY", "API key") or config.network.api.key
    if args.url:
        return args.url, key
    host = config.network.api.host
    host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    return f"http://{host_port(host, config.network.api.port)}", key


async def _run(args: argparse.Namespace, url: str, key: str | None) -> int:
    from exo_tui.api.client import ClusterClient

    client = ClusterClient(url, api_key=key or "")
    try:
        if args.action == "status":
            data = await client.request("GET", "/v1/cluster")
            health = await client.request("GET", "/health")
            if coordinators_of(health):  # one of a set: who leads, in which term, how far behind
                data["coordinators"] = coordinators_of(health)
            if args.json:
                print(json.dumps(data, indent=2))
            else:
                _print_status(data, url, health)
            return 0
        targets = (args.node,) if getattr(args, "node", None) else ()
        layers = parse_layers(args.layers) if getattr(args, "layers", None) else None
        result = await client.action(Command(args.action, targets, layers), dry_run=args.dry_run)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            names = {n["node_id"]: n["name"] for n in (await client.request("GET", "/v1/cluster"))["nodes"]}
            _print_preview(result, names, args.dry_run)
        return 0
    finally:
        await client._http.aclose()


def _gb(n: float | None) -> str:
    return f"{(n or 0) / 1e9:.1f}"


def queue_line(q: dict[str, Any]) -> str:
    """Admission at a glance: what runs and waits for the ring's memory, and the counts so far."""
    cap = q.get("capacity_positions")
    held = f"{q.get('reserved_positions', 0)}/{cap}" if cap is not None else "?"
    return (f"requests: {q.get('running', 0)} running, {q.get('queued', 0)} queued (bound {q.get('queue_bound', 0)}) · "
            f"admitted {q.get('admitted', 0)}, preempted {q.get('preempted', 0)}, rejected {q.get('rejected', 0)} · "
            f"KV positions {held}")


def _memory(n: dict[str, Any]) -> str:
    """A node's memory GB in use of its total; where it has a limit, its models' (shards, KV caches)
    of the limit, and the runtime's own memory, which the limit lies above."""
    cell = f"{_gb(n.get('memory_used_bytes'))}/{_gb(n.get('memory_total_bytes'))}"
    profile = n.get("profile") or {}
    if profile.get("memory_limit_bytes") and profile.get("runtime_baseline_bytes"):
        cell += f" limit (+{profile['runtime_baseline_bytes'] / 1e9:.2f} runtime)"
    return cell


def _kv(kv: dict[str, Any]) -> str:
    """A node's KV caches: MB used of its budget, and the requests holding them."""
    if not kv.get("budget_bytes"):
        return "—"
    return f"{kv.get('used_bytes', 0) / 1e6:.0f}/{kv['budget_bytes'] / 1e6:.0f} ({kv.get('requests', 0)} req)"


def _print_status(d: dict[str, Any], url: str, health: dict[str, Any] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from exo_tui.commands._coordinators import print_coordinators
    from exo_tui.commands._figures import print_figures

    console = Console(width=None if sys.stdout.isatty() else 150)
    plan = d.get("plan") or {}
    names = {n["node_id"]: n["name"] for n in d.get("nodes", [])}
    nodes = d.get("nodes", [])
    ready = sum(1 for n in nodes if n["state"] == "ready")
    head = (f"[bold]{d.get('name', '')}[/] · {d.get('model', '')} · {ready}/{len(nodes)} nodes ready · "
            f"{d.get('tok_per_s', 0.0):.1f} tok/s now · {url}")
    if d.get("readonly"):
        head += " · read-only"
    console.print(head)
    if q := d.get("queue"):
        console.print(queue_line(q))
    table = Table(title="nodes", title_justify="left")
    right = ("score", "memory GB", "KV MB", "cpu %", "heartbeat")
    for col in ("node", "id", "state", "backend", "layers", "pin", "score", "memory GB", "KV MB", "cpu %", "heartbeat"):
        table.add_column(col, justify="right" if col in right else "left")
    glyph = {"ready": "●", "loading": "◐", "draining": "◐", "drained": "○", "suspect": "▲", "failed": "✖"}
    for n in nodes:
        layers = f"{n['layers'][0]}-{n['layers'][1] - 1}" if n.get("layers") else "—"
        pin = f"{n['pinned'][0]}-{n['pinned'][1] - 1}" if n.get("pinned") else ""
        score = "—" if n.get("score") is None else f"{n['score']:.0f}" + ("" if n.get("eligible", True) else " ✗")
        hb = "—" if n.get("heartbeat_age_s") is None else f"{n['heartbeat_age_s']:.1f}s"
        state = f"{glyph.get(n['state'], '·')} {n['state']}"
        if n.get("ineligible_reason") and n["state"] == "failed":
            state += f" ({n['ineligible_reason'][:40]})"
        table.add_row(n["name"], n["node_id"], state, n.get("backend", ""), layers, pin, score,
                      _memory(n), _kv(n.get("kv") or {}),
                      f"{n.get('cpu_percent', 0.0):.0f}", hb)
    console.print(table)
    if plan:
        # the heading as a line of its own: a table's title wraps to the (narrow) table's width
        context = f" · context {n}" if (n := plan.get("context_length")) else ""
        console.print(f"plan v{plan['version']} · {plan.get('strategy', '')}{context} · predicted "
                      f"{plan.get('predicted_tok_per_s', 0.0):.1f} tok/s, ttft {plan.get('predicted_ttft_s', 0.0) * 1000:.0f} ms"
                      + (f" for a {n}-token prompt" if (n := plan.get("predicted_ttft_prompt_tokens")) else ""),
                      highlight=False, markup=False)
        if plan.get("draft"):
            console.print(plan["draft"], highlight=False, markup=False)
        t = Table()
        for col in ("stage", "node", "layers", "runs at", "pinned"):
            t.add_column(col)
        for i, sh in enumerate(plan.get("shards", [])):
            t.add_row(str(i), names.get(sh["node_id"], sh["node_id"]), f"{sh['start']}-{sh['end'] - 1}",
                      sh.get("precision") or "", "yes" if sh.get("pinned") else "")
        console.print(t)
    else:
        console.print("no plan: no node serves the model")
    print_figures(console, d.get("metrics") or {}, names)
    print_coordinators(console, health or {})


def _print_preview(p: dict[str, Any], names: dict[str, str], dry_run: bool) -> None:
    targets = " ".join(names.get(t, t) for t in p.get("targets", []))
    verb = "would move" if dry_run else "moved"
    moves = p.get("moves", [])
    print(f"{p.get('action', '')} {targets}".strip() + (" (dry run)" if dry_run else ": done"))
    if moves:
        print(f"  {verb} {len(moves)} layer range(s), {p.get('bytes_moved', 0) / 1e6:.1f} MB:")
        for m in moves:
            src = names.get(m["src"], m["src"]) if m.get("src") else "(fresh)"
            print(f"    layers {m['start']}-{m['end'] - 1}: {src} → {names.get(m['dst'], m['dst'])}")
    else:
        print("  no layers move")
    print(f"  predicted {p.get('tok_per_s_before', 0.0):.1f} → {p.get('tok_per_s_after', 0.0):.1f} tok/s")
    plan = p.get("new_plan")
    if plan:
        layout = "  ".join(f"{names.get(s['node_id'], s['node_id'])}[{s['start']}-{s['end'] - 1}]" for s in plan["shards"])
        print(f"  plan: {layout}")
    if p.get("note"):
        print(f"  note: {p['note']}")
