"""Run the console over the in-test FakeCluster (no real nodes): ``python -m tests.tui.dev_app [N]``.

For looking at the app in a terminal (tmux checks) before or without a real cluster.
"""

from __future__ import annotations

import sys

from exo_tui.tui.app import ExoApp
from tests.tui.fake_cluster import T0, FakeCluster


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    readonly = "--readonly" in sys.argv
    cluster = FakeCluster(n_nodes=n, chat_delay_s=0.05)
    ExoApp(cluster, readonly=readonly, clock=lambda: T0 + 2).run()


if __name__ == "__main__":
    main()
