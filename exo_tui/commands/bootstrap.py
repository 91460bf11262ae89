"""``exo-tui bootstrap [USER@]HOST[:PORT]``: install and start a node agent over SSH (or ``--stop`` it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from exo_tui.commands.node import threads_arg

    p = sub.add_parser(
        "bootstrap",
        help="install exo-tui on a host over SSH and start its node agent",
        description=(
            "Install exo-tui on HOST over SSH (a venv under the remote user's data dir), give it this "
            "cluster's key, start `exo-tui node` there and wait until it answers. Running it again "
            "upgrades and restarts the node. Host keys are checked against known_hosts; you log in "
            "with your SSH keys and agent, as ssh does."
        ),
    )
    p.add_argument("target", metavar="[USER@]HOST[:PORT]", help="the SSH host (an ~/.ssh/config alias works)")
    p.add_argument("--accept-new-host-key", action="store_true", help="accept and record a host key not yet in known_hosts")
    p.add_argument("--python", metavar="PATH", help="the remote Python ≥ 3.11 to use (default: the newest found)")
    p.add_argument("--wheelhouse", metavar="DIR", type=Path, help="install dependencies only from these wheels (offline LANs)")
    p.add_argument("--stop", action="store_true", help="stop the node agent on HOST instead")
    p.add_argument("--no-install", action="store_true", help="only restart the node that is installed there")
    p.add_argument("--node-port", type=int, default=None, help="the node's port (default: network.node_port, 52416)")
    p.add_argument("--name", help="node name (default: the host's hostname)")
    p.add_argument("--backend", choices=["auto", "mlx", "onnx"], default=None)
    p.add_argument("--memory-limit", type=float, metavar="GB", help="memory the node gives to models (weights, KV caches), above its runtime's own ~0.2 GB")
    p.add_argument("--precision", choices=["auto", "float32", "int16", "int8"], default=None,
                   help="the node's ONNX precision (exo-tui node --precision; default auto)")
    p.add_argument("--threads", type=threads_arg, default=None, metavar="N", help="threads a step runs on there")
    p.add_argument("--known-hosts", type=Path, metavar="FILE", help="known_hosts file (default ~/.ssh/known_hosts)")
    p.add_argument("-i", "--identity", action="append", metavar="FILE", help="private key to log in with (repeatable)")
    p.add_argument("--no-advertise", action="store_true", help="the node does not advertise over mDNS")
    p.add_argument("--connect-timeout", type=float, default=None, metavar="S", help="SSH connect timeout (default 10)")
    p.set_defaults(func=run)


def _print_progress(ev) -> None:  # noqa: ANN001
    mark = {"running": "…", "ok": "✓", "failed": "✗"}.get(ev.status, " ")
    text = f"{mark} {ev.step:<9} {ev.message}".rstrip()
    if ev.status == "failed" or (ev.status == "running" and not ev.message):
        return  # a failure is printed once, with what to do, by run()
    print(text, flush=True)


def _confirm_on_tty(err) -> bool:  # noqa: ANN001
    """Ask like ssh does, when a person is at the terminal."""
    if not sys.stdin.isatty():
        return False
    print(f"The authenticity of host {err.host} can't be established.")
    print(f"{err.key_type} key fingerprint is {err.fingerprint}.")
    try:
        answer = input("Are you sure you want to continue connecting (yes/no)? ")
    except EOFError:
        return False
    return answer.strip().lower() in ("yes", "y")


def node_settings(args: argparse.Namespace) -> list[str]:
    """The ``exo-tui node`` flags for how the remote node runs (its environment is not ours)."""
    argv = ["--precision", args.precision] if args.precision else []
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    return argv


def run(args: argparse.Namespace) -> int:
    import asyncio

    from exo_tui.bootstrap import BootstrapError, BootstrapOptions, bootstrap, parse_target, stop_node

    try:
        target = parse_target(args.target)
    except ValueError as exc:
        print(f"exo-tui bootstrap: {args.target!r}: {exc}; use [USER@]HOST[:PORT]", file=sys.stderr)
        return 2

    node_port, connect_timeout = args.node_port, args.connect_timeout
    if node_port is None or connect_timeout is None:
        try:
            from exo_tui.config import load_config

            cfg = load_config()
            node_port = node_port or cfg.network.node_port
            connect_timeout = connect_timeout or max(10.0, float(cfg.network.discovery.connect_timeout))
        except Exception as exc:  # a broken config should not block a bootstrap; say so
            print(f"exo-tui bootstrap: ignoring the config ({exc})", file=sys.stderr)
    opts = BootstrapOptions(
        accept_new_host_key=args.accept_new_host_key,
        confirm_host_key=None,
        known_hosts=args.known_hosts,
        client_keys=args.identity or None,
        python=args.python,
        wheelhouse=args.wheelhouse,
        node_port=node_port or 52416,
        node_name=args.name,
        backend=None if args.backend in (None, "auto") else args.backend,
        memory_limit_gb=args.memory_limit,
        advertise=not args.no_advertise,
        connect_timeout_s=connect_timeout or 10.0,
        install=not args.no_install,
        node_args=node_settings(args),
    )
    if not args.accept_new_host_key:

        async def ask(err) -> bool:  # noqa: ANN001
            return await asyncio.to_thread(_confirm_on_tty, err)

        opts.confirm_host_key = ask
    if args.wheelhouse and not args.wheelhouse.is_dir():
        print(f"exo-tui bootstrap: --wheelhouse {args.wheelhouse} is not a directory", file=sys.stderr)
        return 2
    try:
        if args.stop:
            stopped = asyncio.run(stop_node(target, opts, on_progress=_print_progress))
            return 0 if stopped is not None else 1
        result = asyncio.run(bootstrap(target, opts, on_progress=_print_progress))
    except BootstrapError as exc:
        print(f"exo-tui bootstrap: {target}: step {exc.step} failed: {exc.message}", file=sys.stderr)
        return 1
    print(f"node {result.node_name} ({result.node_id}) runs on {result.address}:{result.port} "
          f"[{result.manager}] after {result.total_s:.1f} s")
    return 0
