"""``exo-tui node``: run the node agent on this machine."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from exo_tui.commands._args import read_secret, secret_help, whole_number

# --threads: said at once, not by a node started later
threads_arg = whole_number(1, "threads", "a step needs at least 1 thread, got {value}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node",
        help="run the node agent (serves shards to a coordinator)",
        description="Run the node agent: profile this device, then serve shards to the coordinator.",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    p.add_argument("--port", type=int, default=52416, help="port to listen on (default 52416; 0: any free port, "
                                                            "which --join tells the coordinator)")
    p.add_argument("--name", default=None, help="node name (default: the host name)")
    p.add_argument("--backend", choices=["auto", "mlx", "onnx"], default="auto")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB", help="memory this node gives to models (weights, KV caches), above its runtime's own ~0.2 GB")
    p.add_argument("--precision", choices=["auto", "float32", "int16", "int8"], default=None,
                   help="ONNX: auto (the default: int8 on K-quant files, which llama.cpp itself rounds to 8 bits, "
                        "else int16), int16 activations (fast, answers as float32's but for near ties), "
                        "float32 (exact) or int8 (fastest, answers near float32's)")
    p.add_argument("--threads", type=threads_arg, default=None, metavar="N",
                   help="threads a step runs on (default: the physical cores)")
    p.add_argument("--key-file", default=None, help="node bundle (cluster key and certificates) from the coordinator")
    p.add_argument("--join", default=None, nargs="?", const="", metavar="TOKEN",
                   help="fetch the cluster key with a join token first (from `exo-tui join-token`)"
                        + secret_help("EXO_TUI_JOIN_TOKEN"))
    p.add_argument("--no-advertise", action="store_true", help="do not advertise over mDNS")
    p.add_argument("--no-tls", action="store_true", help="plain TCP (only to measure what TLS costs)")
    p.add_argument("--no-benchmark", action="store_true", help="skip the start-up layer benchmark")
    p.add_argument("--print-profile", action="store_true", help="print this device's profile as JSON and exit")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from backends import default_backend_name
    from backends.base import BackendError

    name = args.name or socket.gethostname()
    backend = default_backend_name() if args.backend == "auto" else args.backend
    limit = int(args.memory_limit * 1e9) if args.memory_limit else None
    from backends import configure_backend
    from exo_tui.config import ConfigError, load_config

    try:  # the config's node.* keys (their environment variables override them), then the flags
        settings = load_config().node.backend_settings(backend)
        settings |= {k: v for k, v in (("precision", args.precision), ("threads", args.threads)) if v is not None}
        configure_backend(backend, **settings)
    except (ConfigError, BackendError) as exc:
        print(f"exo-tui node: {exc}", file=sys.stderr)
        return 2
    if args.print_profile:
        from exo_tui.node.profile import benchmark, device_profile, runs_on

        profile = device_profile(name, limit)
        if backend in profile.backends:
            runs_on(profile, backend)
        if not args.no_benchmark:
            profile = benchmark(profile)
        print(json.dumps(profile.to_dict(), indent=2))
        return 0

    from exo_tui.net import loop as event_loop
    from exo_tui.net.loop import LoopChoiceError
    from exo_tui.net.security import Security, SecurityError
    from exo_tui.node.agent import NodeAgent

    listener = None
    try:
        token = read_secret(args.join, "EXO_TUI_JOIN_TOKEN", "join token")
        port = args.port
        if token:
            from exo_tui.discovery.join import join_cluster
            from exo_tui.net.server import listening_socket

            if port == 0:  # bound now, so the coordinator is told the port this node will serve on
                listener = listening_socket(args.host, 0)
                port = listener.getsockname()[1]
            key_file = join_cluster(token, name=name, port=port)
        else:
            key_file = args.key_file
        security = Security.from_bundle_file(key_file, enable_tls=not args.no_tls)
        agent = NodeAgent(
            name=name,
            host=args.host,
            port=port,
            sock=listener,
            backend=backend,
            memory_limit_bytes=limit,
            security=security,
            advertise=not args.no_advertise,
            run_benchmark=not args.no_benchmark,
            parent_pid=args.exit_with_parent,
        )
        event_loop.run(agent.run_until_signalled())
    except (SecurityError, BackendError, LoopChoiceError, OSError, ValueError) as exc:
        print(f"exo-tui node: {exc}", file=sys.stderr)
        return 2
    finally:
        if listener is not None:
            listener.close()
    return 0
