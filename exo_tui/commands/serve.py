"""``exo-tui serve``: the coordinator and its API, headless (no console).

It listens on the API address first (so a busy port fails fast), starts the local node agents
(one by default when no ``--peer`` is given), joins the peers, plans, and prints one ready line
with the URL on stdout. Logs go to stderr. SIGTERM or Ctrl-C stops the API, the coordinator and
every node process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from exo_tui.commands import _serve_set as serve_set
from exo_tui.commands._args import whole_number

if TYPE_CHECKING:
    from exo_tui.config import Config

READY_PREFIX = "exo-tui serve: ready at "


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the coordinator and the OpenAI-compatible API without the console",
        description="Run the coordinator and the API headless: local node agents, peers, the plan, and "
                    "http://127.0.0.1:52415/v1 for OpenAI clients and `exo-tui status/drain/...`.",
    )
    p.add_argument("--config", default=None, metavar="F", help="config file (default ~/.config/exo-tui/config.yaml)")
    p.add_argument("--model", default=None, metavar="M", help="a name `exo-tui models` lists (smollm2-135m, llama3.2:1b...) or a path to a .gguf (default smollm2-135m)")
    p.add_argument("--peer", action="append", default=[], metavar="HOST[:PORT]", help="a node agent to join (repeatable)")
    p.add_argument("--local-nodes", type=int, default=None, metavar="N",
                   help="node agents to start on this machine (default 1 without --peer, 0 with)")
    add_local_memory_limit(p)
    add_context(p)
    p.add_argument("--backends", default=None, metavar="B,B",
                   help="comma list of backends for the local nodes, used in turn (e.g. onnx,mlx)")
    p.add_argument("--api-host", default=None, metavar="HOST", help="address to listen on (default network.api.host, 127.0.0.1)")
    p.add_argument("--api-port", type=int, default=None, metavar="PORT", help="port (default network.api.port, 52415)")
    p.add_argument("--strategy", default=None, choices=["latency", "throughput", "memory", "exo-ring", "even"],
                   help="partition strategy (default: the config's)")
    p.add_argument("--discover", action="store_true", help="browse mDNS for node agents and hosts of this cluster")
    p.add_argument("--speculative", default="auto", type=speculative_mode, metavar="off|auto|K",
                   help="speculative decoding for requests that do not say: auto (default: prompt lookup and "
                        "predictions, drafting where a stream measures a gain), off, or K drafted tokens a step")
    add_draft(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve_set.add_arguments(p)
    p.set_defaults(func=run)


def add_draft(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="a draft model for speculative decoding: a name `exo-tui models` lists or a path to a .gguf "
                        "of the served model's vocabulary (a smaller one of its family); one node runs it whole (with "
                        "--coordinators: give each coordinator of the set the same --draft)")


def with_draft(coordinator: Any, args: argparse.Namespace, config: Any) -> None:
    """``--draft``: the coordinator's draft model; ValueError (one sentence) before anything starts
    when its vocabulary is not the served model's."""
    if not args.draft:
        return
    from exo_tui.cluster.drafting import load_draft
    from exo_tui.models.model import Model

    coordinator.draft = load_draft(args.draft, coordinator, Model(args.model, paths=config.models.paths),
                                   paths=config.models.paths)


def speculative_mode(text: str) -> str | int:
    """``--speculative``: off, auto or a number of drafted tokens."""
    from exo_tui.inference.speculation import parse_mode

    try:
        return parse_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_gb(text: str) -> float:
    """``--local-memory-limit``: a positive number of GB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB (e.g. 0.6)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a memory limit must be above 0 GB, got {text}")
    return value


def add_local_memory_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-memory-limit", type=memory_gb, default=None, metavar="GB",
                   help="memory each local node gives to models (its --memory-limit: shards' weights, KV caches), "
                        "above its runtime's own ~0.2 GB; requests beyond what it holds wait their turn")


def add_context(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=whole_number(0, "tokens", "a context is 0 or more tokens, got {value}"), default=None, metavar="TOKENS",
                   help="the longest a request may grow, prompt and answer: the plan keeps room for the KV caches of "
                        "that many tokens (default models.context_length, 8192; at most the model's own; 0: the "
                        "model's own, 131072 for a Llama 3.1)")


def with_context(config: Config, args: argparse.Namespace) -> Config:
    """``config`` with ``--context`` in ``models.context_length`` where it was given."""
    if args.context is not None:
        config.models.context_length = args.context
    return config


def run(args: argparse.Namespace) -> int:
    from backends.base import BackendError
    from exo_tui.api.listen import ApiServerError
    from exo_tui.commands._runtime import run_main
    from exo_tui.config import ConfigError
    from exo_tui.models.gguf_file import ModelFileError
    from exo_tui.net.errors import RemoteError

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.local_nodes is not None and args.local_nodes < 0:
        print("exo-tui serve: --local-nodes must be 0 or more", file=sys.stderr)
        return 2
    try:
        return run_main(lambda: _serve(args))
    except (ApiServerError, ConfigError, ModelFileError, BackendError, RemoteError, ValueError, OSError, RuntimeError) as exc:
        print(f"exo-tui serve: {exc}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace) -> int:
    from exo_tui.api.listen import bind_api_socket
    from exo_tui.config import load_config

    config = with_context(load_config(args.config), args)
    host = args.api_host or config.network.api.host
    port = args.api_port if args.api_port is not None else config.network.api.port
    # Listen before the heavy imports: a client's first request is queued by the kernel, then served.
    sock = bind_api_socket(host, port)
    if serve_set.wanted(args, config):
        return await serve_set.serve_set(args, config, sock, host, port)
    from exo_tui.api.server import ApiServer, exposure_warning
    from exo_tui.cluster.coordinator import Coordinator

    key = config.network.api.key
    warning = exposure_warning(host, key)
    if warning:
        print(f"exo-tui serve: {warning}", file=sys.stderr, flush=True)
    local = args.local_nodes if args.local_nodes is not None else (0 if args.peer else 1)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    coordinator = Coordinator(model=args.model, config=config, peers=list(args.peer), local_nodes=local,
                              local_backends=backends, strategy=args.strategy, discover=args.discover,
                              local_memory_limits_gb=[args.local_memory_limit] * local if args.local_memory_limit else None,
                              join=True)
    coordinator.speculative = args.speculative
    with_draft(coordinator, args, config)
    server = ApiServer(coordinator, host=host, port=port, api_key=key, max_body_bytes=config.network.api.max_body_bytes,
                       log_level="warning" if args.log_level != "debug" else "info", sock=sock)
    log = logging.getLogger("exo_tui.serve")
    await server.start()
    try:
        await coordinator.start()
        snap = coordinator.snapshot()
        if coordinator.plan is None:
            state = "no plan yet (no node could serve the model: see the errors above)"
        else:
            state = f"{snap.model} on {snap.ready_count} node(s)"
            if coordinator.draft is not None:
                state += f", {coordinator.draft.describe()}"
        print(f"{READY_PREFIX}{server.url}/v1 — {state}", flush=True)
        log.info("API at %s/v1 (OpenAPI at %s/docs)%s", server.url, server.url, ", API key required" if key else "")
        if coordinator.joining is not None:
            log.info("join endpoint on %s:%d: `exo-tui join-token` here, then `exo-tui node --join TOKEN` on the "
                     "new host", config.network.join.host, coordinator.joining.port)
        await asyncio.Event().wait()
    finally:
        log.info("stopping")
        await server.stop()
        await coordinator.stop()
    return 0
