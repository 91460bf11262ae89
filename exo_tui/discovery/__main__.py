"""``python -m exo_tui.discovery``: list the nodes and hosts discovery finds, for a few seconds.

A troubleshooting aid: it runs the same :class:`~exo_tui.discovery.Discovery` the coordinator
runs (config file, ``EXO_TUI_KNOWN_PEERS``, ``~/.ssh/config``, tailscale, mDNS) and prints each
event as a line of JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from exo_tui.discovery.service import MODES, Discovery
from exo_tui.events import EventBus


async def _main(args: argparse.Namespace) -> int:
    bus = EventBus()
    sub = bus.subscribe()
    kw: dict[str, Any] = {"interfaces": args.interface or None, "cli_peers": args.peer or ()}
    if args.mode:
        kw["mode"] = args.mode
    try:
        from exo_tui.config import load_config

        disc = Discovery.from_config(bus, load_config(), **kw)
    except Exception as exc:  # a broken config still lets us browse with the defaults
        print(f"(config not used: {exc})", file=sys.stderr)
        disc = Discovery(bus, **kw)
    async with disc:
        loop = asyncio.get_running_loop()
        end = loop.time() + args.seconds
        while (left := end - loop.time()) > 0:
            try:
                async with asyncio.timeout(left):
                    ev = await sub.get()
            except TimeoutError:
                break
            print(json.dumps(ev.to_dict(), default=list), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exo_tui.discovery", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--interface", action="append", metavar="IP", help="mDNS only on this address (repeatable)")
    p.add_argument("--peer", action="append", metavar="HOST[:PORT]")
    p.add_argument("--mode", choices=MODES)
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
