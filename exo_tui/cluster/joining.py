"""The coordinator's join endpoint: ``exo-tui node --join TOKEN`` against a running coordinator.

:class:`JoinEndpoint` serves :mod:`exo_tui.discovery.join` on ``network.join.host:port`` (both
``exo-tui serve`` and the console start it, with ``Coordinator(join=True)``). A node that presents
a valid one-time token gets its bundle; the coordinator then connects to the node agent at the
address the request came from and the port it named, retrying while the agent starts (it
profiles the device first), and adds it to the cluster as any node: it appears in the console and
takes layers after a rebalance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.config import Config
from exo_tui.discovery.join import Joined, JoinServer, serve_join
from exo_tui.net.address import is_loopback
from exo_tui.net.errors import ConnectError, RemoteError

log = logging.getLogger("exo_tui.cluster")

WAIT_FOR_AGENT_S = 300.0  # a node's start-up benchmark on a slow machine takes a while
RETRY_S = 1.0


def reaches_beyond_loopback(config: Config) -> bool:
    """Whether nodes on other hosts can join (then local nodes must listen beyond loopback too)."""
    join = config.network.join
    return bool(join.enabled) and not is_loopback(join.host)


class JoinEndpoint:
    def __init__(self, coordinator: CoordinatorParts) -> None:
        self.coordinator = coordinator
        self.server: JoinServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    async def start(self, host: str, port: int) -> None:
        cset = getattr(self.coordinator, "coordinator_set", None)  # one of a set: coordinators join too
        self.server = await serve_join(host, port, home=self.coordinator.home, on_join=self._joined,
                                       on_coordinator=None if cset is None else cset.admit)
        log.info("join endpoint on %s:%d (exo-tui join-token makes its one-time tokens)", host, self.server.port)

    def _joined(self, joined: Joined) -> None:
        port = joined.port or self.coordinator.config.network.node_port
        self.coordinator._notice("info", f"node {joined.name} used a join token from {joined.host}: "
                                         f"connecting to its agent at {joined.host}:{port}")
        task = asyncio.create_task(self._adopt(joined.name, joined.host, port), name=f"join {joined.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self, name: str, host: str, port: int) -> None:
        c = self.coordinator
        deadline = time.monotonic() + WAIT_FOR_AGENT_S
        while True:
            try:
                await c.add_node(host, port)
                break
            except (ConnectError, OSError, RemoteError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    c._notice("error", f"node {name} joined but its agent at {host}:{port} never answered ({exc}): "
                                       f"is `exo-tui node` running there and port {port} open to this machine?")
                    return
            await asyncio.sleep(RETRY_S)
        await c._after_membership_change(f"node {name} joined")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.server is not None:
            await self.server.close()
            self.server = None
