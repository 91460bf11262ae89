"""``exo-tui join-token``: print a one-time token with which a node fetches the cluster key."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "join-token",
        help="print a one-time token a new node joins with (exo-tui node --join TOKEN)",
        description=(
            "Make a one-time, expiring join token. On the new host run `exo-tui node --join TOKEN`: "
            "it fetches this cluster's key from the coordinator's join endpoint once. The running "
            "coordinator (exo-tui serve, or the console) serves that endpoint on network.join.host:port "
            "(default all interfaces, port 52417); without one running, add --serve."
        ),
    )
    p.add_argument("--ttl", type=float, default=60.0, metavar="MINUTES", help="minutes until it expires (default 60)")
    p.add_argument("--address", action="append", metavar="HOST[:PORT]",
                   help="address the node reaches this machine at (default: this host's addresses)")
    p.add_argument("--port", type=int, default=None, help="join port (default network.join.port, 52417)")
    p.add_argument("--config", default=None, metavar="F", help="config file (default ~/.config/exo-tui/config.yaml)")
    p.add_argument("--serve", action="store_true", help="serve the join endpoint here until the token is used or expires")
    p.add_argument("--coordinator", action="store_true",
                   help="a token for a coordinator of a set (exo-tui serve --join TOKEN), not a node: it hands over "
                        "the cluster's secrets; make it where the set's leader runs")
    p.add_argument("--revoke-all", action="store_true", help="invalidate every token and exit (says how many were still usable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from exo_tui.config import ConfigError, load_config
    from exo_tui.discovery.join import JoinError, TokenStore, create_join_token, serve_join
    from exo_tui.discovery.mdns import host_addresses
    from exo_tui.net.address import host_port, split_host_port
    from exo_tui.net.security import SecurityError, home_dir

    if args.revoke_all:
        n = TokenStore(home_dir() / "join-tokens.json").revoke_all()
        print(f"revoked every join token ({n} still usable)")
        return 0
    try:
        join = load_config(args.config).network.join
    except ConfigError as exc:
        print(f"exo-tui join-token: {exc}", file=sys.stderr)
        return 2
    port = args.port or join.port
    wildcard = join.host in ("0.0.0.0", "::", "")
    try:
        if args.address:
            addresses = [host_port(*split_host_port(a, port)) for a in args.address]
        elif not wildcard:
            addresses = [host_port(join.host, port)]
        else:
            addresses = [host_port(a, port) for a in host_addresses(ipv6=False)] or [host_port("127.0.0.1", port)]
        token = create_join_token(addresses, ttl_s=args.ttl * 60, role="coordinator" if args.coordinator else "node")
    except (JoinError, SecurityError, ValueError) as exc:
        print(f"exo-tui join-token: {exc}", file=sys.stderr)
        return 1
    print(token.encode())
    until = time.strftime("%H:%M", time.localtime(token.expires))
    command = "serve --coordinator-port PORT" if args.coordinator else "node"
    print(f"\nOn the new host: exo-tui {command} --join <the token above>   (works once, until {until}; "
          f"join endpoint {', '.join(addresses)})", file=sys.stderr)
    if not args.serve or args.coordinator:  # a coordinator's token is answered by the set's leader only
        return 0

    async def serve() -> int:
        done = asyncio.Event()
        server = await serve_join(join.host, port, on_join=lambda _joined: done.set())
        print(f"serving the join endpoint on {join.host}:{server.port}; waiting for the node…", file=sys.stderr)
        try:
            async with asyncio.timeout(max(1.0, token.expires - time.time())):
                await done.wait()
        except TimeoutError:
            print("the token expired unused", file=sys.stderr)
            return 1
        finally:
            await server.close()
        print(f"node {server.joined[-1]} joined", file=sys.stderr)
        return 0

    try:
        return asyncio.run(serve())
    except OSError as exc:
        print(f"exo-tui join-token: cannot listen on port {port}: {exc.strerror or exc} "
              "(is the coordinator already serving it? then drop --serve)", file=sys.stderr)
        return 1
