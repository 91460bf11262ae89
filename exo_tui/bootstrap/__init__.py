"""Bootstrap: install and start node agents over SSH (asyncssh), and stop them.

- :func:`bootstrap` / :func:`bootstrap_host` — connect, detect, venv, upload, install, key, start, handshake.
- :func:`stop_node` — stop what bootstrap started.
- :class:`BootstrapError` (``.step``), :class:`HostKeyUnknown`, :class:`HostKeyChanged` (in
  :mod:`exo_tui.bootstrap.errors`, which imports nothing heavy).

The names are loaded on first use, so importing the errors does not import asyncssh.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BootstrapOptions": "install",
    "BootstrapResult": "install",
    "RemoteHost": "install",
    "bootstrap": "install",
    "bootstrap_host": "install",
    "stop_node": "install",
    "BootstrapError": "errors",
    "HostKeyChanged": "errors",
    "HostKeyUnknown": "errors",
    "Target": "ssh",
    "connect": "ssh",
    "parse_target": "ssh",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
