"""``exo-tui`` / ``exo-tui tui``: the terminal console, with an embedded coordinator.

By default it starts a coordinator in this process and one node agent for this machine (plus
``--local-nodes N`` more on loopback, for a cluster on one machine), joins the ``--peer`` nodes,
loads the model and opens the console.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exo_tui.api.client import ClusterClient
    from exo_tui.cluster.coordinator import Coordinator


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tui",
        help="open the terminal console (the default command)",
        description="Open the terminal console with an embedded coordinator and a node agent for this machine.",
    )
    p.add_argument("--config", default=None, metavar="F", help="config file (default ~/.config/exo-tui/config.yaml)")
    p.add_argument(
        "--peer", action="append", default=[], metavar="HOST[:PORT]", help="a node agent to join (repeatable)"
    )
    p.add_argument(
        "--local-nodes", type=int, default=0, metavar="N", help="start N extra node agents on this machine (loopback)"
    )
    from exo_tui.commands.serve import add_context, add_local_memory_limit

    add_local_memory_limit(p)
    add_context(p)
    p.add_argument("--readonly", action="store_true", help="watch only: no drain, rebalance, pin, bootstrap or model change")
    p.add_argument("--model", default=None, metavar="M", help="a name `exo-tui models` lists (smollm2-135m, llama3.2:1b...) or a path to a .gguf (default smollm2-135m)")
    p.add_argument("--attach", default=None, metavar="URL", help="attach to a running `exo-tui serve` instead of embedding one")
    from exo_tui.commands.serve import add_draft

    add_draft(p)
    p.add_argument("--theme", default=None, help="theme for this run (default: ui.theme of the config)")
    p.add_argument(
        "--no-discover", action="store_true",
        help="do not browse for nodes and hosts (network.discovery.mode picks mdns, manual or tailscale)",
    )
    from exo_tui.commands import _serve_set as serve_set

    serve_set.add_arguments(p)  # the console as one of a set of coordinators, as `exo-tui serve` is
    p.add_argument("--api-host", default=None, metavar="HOST",
                   help="with a set of coordinators: where this one's API listens (default network.api.host)")
    p.add_argument("--api-port", type=int, default=None, metavar="PORT",
                   help="with a set of coordinators: its API's port (default network.api.port, 52415)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from exo_tui.config import ConfigError, load_config

    if args.local_nodes < 0:
        print("exo-tui: --local-nodes must be 0 or more", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"exo-tui: {exc}", file=sys.stderr)
        return 2
    if args.attach and args.draft:
        print("exo-tui: --draft is the draft model of the console's own coordinator; the one at --attach has its own "
              "(its `exo-tui serve --draft`)", file=sys.stderr)
        return 2
    if args.attach and args.context is not None:
        print("exo-tui: --context is the context of the console's own coordinator; the one at --attach serves "
              "at its own (its `exo-tui serve --context`)", file=sys.stderr)
        return 2
    from exo_tui.commands.serve import with_context

    config = with_context(config, args)

    from exo_tui.commands import _serve_set as serve_set

    control: ClusterClient | Coordinator
    if serve_set.wanted(args, config):
        try:
            control, on_start, on_stop = _set_member(args, config)
        except (ValueError, OSError) as exc:  # ApiServerError is an OSError: the port is taken
            print(f"exo-tui: {exc}", file=sys.stderr)
            return 2
    elif args.attach:
        from exo_tui.api.client import ClusterClient

        control = ClusterClient(args.attach)
        on_start, on_stop = control.start, control.stop
    else:
        from exo_tui.cluster.coordinator import Coordinator

        try:
            control = Coordinator(
                model=args.model,
                config=config,
                peers=list(args.peer),
                local_nodes=1 + args.local_nodes,
                local_memory_limits_gb=[args.local_memory_limit] * (1 + args.local_nodes) if args.local_memory_limit else None,
                readonly=args.readonly,
                discover=not args.no_discover,
                join=True,  # exo-tui node --join TOKEN reaches this console's coordinator (network.join)
            )
        except RuntimeError as exc:  # its state file cannot be opened (corrupt, a full disk)
            print(f"exo-tui: {exc}", file=sys.stderr)
            return 2
        from exo_tui.commands.serve import with_draft
        from exo_tui.models.gguf_file import ModelFileError

        try:
            with_draft(control, args, config)
        except (ValueError, ModelFileError) as exc:
            print(f"exo-tui: {exc}", file=sys.stderr)
            return 2
        on_start, on_stop = control.start, control.stop

    from exo_tui.tui.app import ExoApp

    app = ExoApp(
        control,
        readonly=args.readonly,
        theme=args.theme or config.ui.theme,
        on_theme_change=theme_saver(config, args.config),
        on_start=on_start,
        on_stop=on_stop,
    )
    app.run()
    return int(app.return_code or 0)


def _set_member(args: argparse.Namespace, config):  # noqa: ANN001, ANN202
    """The console as one coordinator of a set (``--coordinators``, ``coordinators.peers`` or
    ``--join``): this process runs the set's member (its API, Raft, and the coordinator while it
    leads), and the console attaches to its API, so it shows the cluster whoever leads."""
    from exo_tui.api.client import ClusterClient
    from exo_tui.api.listen import bind_api_socket
    from exo_tui.commands._serve_set import NO_LOCAL_NODES, SetMember, wanted

    wanted(args, config)  # the flags into config.coordinators
    for given, flag in ((args.attach, "--attach"), (args.local_nodes, "--local-nodes")):
        if given:
            raise ValueError(f"{flag} does not go with a set of coordinators" + (
                f": {NO_LOCAL_NODES}" if flag == "--local-nodes" else " (leave it out, or run the console alone)"))
    host = args.api_host or config.network.api.host
    port = args.api_port if args.api_port is not None else config.network.api.port
    member = SetMember(config, bind_api_socket(host, port), host, port, model=args.model, peers=list(args.peer),
                       discover=not args.no_discover, join=args.join, draft=args.draft)
    client = ClusterClient(member.local_url)

    async def start() -> None:
        await member.start()
        await member.attach(client)

    async def stop() -> None:
        await client.stop()
        await member.stop()

    return client, start, stop


def theme_saver(config, path: str | None):  # noqa: ANN001, ANN201
    """A callback that writes the chosen theme to ``ui.theme`` of the config file (once per change)."""
    from exo_tui.config import save_config

    def save(name: str) -> None:
        if name != config.ui.theme:
            save_config({"ui.theme": name}, path)
            config.ui.theme = name

    return save
