"""Where exo-tui keeps its files: ``$EXO_TUI_HOME`` if set, else the platform's config dir."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
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


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made, mode 0600, with its folder, mode 0700): one
    process of this machine at a time in the block. Without ``fcntl`` (Windows) no lock is taken."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


_STORAGE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                   errno.EROFS: "the file system is read-only"}


def storage_error(exc: OSError) -> str | None:
    """One line for an error writing files (a full disk, a read-only file system), else None."""
    what = _STORAGE_ERRNOS.get(exc.errno or 0)
    if what is None:
        return None
    where = f" {exc.filename}" if exc.filename else ""
    return (f"cannot write{where}: {what}. exo-tui keeps its keys and state in {exo_home()}: "
            "free some space there, or point EXO_TUI_HOME at another folder")


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit, once at start (the usual
    soft limit, 1,024, is what a flood of connections to the API or a node exhausts first);
    returns the soft limit now (-1: unlimited, or a platform without the limit)."""
    try:
        import resource
    except ImportError:  # Windows
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # macOS refuses RLIM_INFINITY: its soft limit stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return -1 if soft == resource.RLIM_INFINITY else soft

