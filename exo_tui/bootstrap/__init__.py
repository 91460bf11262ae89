"""Bootstrap: install and start node agents over SSH (asyncssh), and stop them.

- :func:`bootstrap` / :func:`bootstrap_host` — connect, detect, venv, upload, install, key, start, handshake.
- :func:`stop_node` — stop what bootstrap started.
- :class:`BootstrapError` (``.step``), :class:`HostKeyUnknown`, :class:`HostKeyChanged`.
"""

from exo_tui.bootstrap.install import (
    BootstrapOptions,
    BootstrapResult,
    RemoteHost,
    bootstrap,
    bootstrap_host,
    stop_node,
)
from exo_tui.bootstrap.ssh import (
    BootstrapError,
    HostKeyChanged,
    HostKeyUnknown,
    Target,
    connect,
    parse_target,
)

__all__ = [
    "BootstrapError",
    "BootstrapOptions",
    "BootstrapResult",
    "HostKeyChanged",
    "HostKeyUnknown",
    "RemoteHost",
    "Target",
    "bootstrap",
    "bootstrap_host",
    "connect",
    "parse_target",
    "stop_node",
]
