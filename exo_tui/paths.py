"""Where exo-tui keeps its files: ``$EXO_TUI_HOME`` if set, else the platform's config dir."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def exo_home() -> Path:
    """The directory (mode 0700) for config, keys, certificates, state and caches."""
    env = os.environ.get("EXO_TUI_HOME")
    path = Path(env).expanduser() if env else Path(platformdirs.user_config_dir("exo-tui"))
    if not path.exists():
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
    return path
