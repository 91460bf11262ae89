"""A wheelhouse of this project's dependencies, for bootstrap tests (``--wheelhouse``).

Built once with ``pip download`` (from the package indexes pip is configured with here) and kept
under the user cache dir, keyed by a hash of pyproject.toml, so later runs reuse it. Installing
from it on the throwaway host is the offline-LAN path of bootstrap.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import platformdirs

from exo_tui.paths import file_lock

ROOT = Path(__file__).resolve().parents[2]


def wheelhouse_dir() -> Path:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    return Path(platformdirs.user_cache_dir("exo-tui")) / f"test-wheelhouse-{digest}-py{sys.version_info[0]}{sys.version_info[1]}"


def ensure_wheelhouse() -> tuple[Path | None, str]:
    """(directory, "") when ready, else (None, why). Built by one process at a time (the suite's
    workers may all ask at once): the others wait, then take what it built."""
    dest = wheelhouse_dir()
    if (dest / ".complete").exists():
        return dest, ""
    with file_lock(dest.with_name(dest.name + ".lock")):
        if (dest / ".complete").exists():
            return dest, ""
        return _build(dest)


def _build(dest: Path) -> tuple[Path | None, str]:
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(tmp), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        return None, "pip download of the dependencies failed: " + (res.stderr or res.stdout).strip()[-500:]
    for stale in tmp.glob("exo_tui-*"):
        stale.unlink()
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest, ""
