"""The wheel of this project that bootstrap uploads, built once and cached.

From a source checkout the wheel is built with ``pip wheel --no-deps`` (hatchling, without build
isolation when hatchling is importable here, so it works offline) and cached under the user cache
dir, keyed by the version and a hash of the sources: editing the code makes a new wheel, running
bootstrap again does not rebuild. An installed exo-tui without its sources looks for its wheel in
the wheelhouse, or fetches it with ``pip download``.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import platformdirs

import exo_tui
from exo_tui.bootstrap.ssh import BootstrapError

PACKAGES = ("exo_tui", "backends", "themes")


def source_root() -> Path | None:
    """The checkout this exo-tui runs from (has pyproject.toml naming exo-tui), or None."""
    root = Path(exo_tui.__file__).resolve().parent.parent
    pp = root / "pyproject.toml"
    if pp.exists() and 'name = "exo-tui"' in pp.read_text():
        return root
    return None


def source_hash(root: Path) -> str:
    h = hashlib.sha256()
    files = [root / "pyproject.toml", root / "README.md"]
    for pkg in PACKAGES:
        files += sorted(p for p in (root / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for f in files:
        if f.exists():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("exo-tui")) / "wheels"


def find_project_wheel(directory: Path) -> Path | None:
    """The newest ``exo_tui-<this version>-*.whl`` in ``directory``."""
    found = sorted(directory.glob(f"exo_tui-{exo_tui.__version__}-*.whl"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


async def _run(*cmd: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


async def project_wheel(wheelhouse: Path | None = None) -> Path:
    """A wheel of this exo-tui (built once per source state and cached)."""
    root = source_root()
    if root is None:
        if wheelhouse is not None and (w := find_project_wheel(wheelhouse)):
            return w
        dest = cache_dir() / f"release-{exo_tui.__version__}"
        if (w := find_project_wheel(dest)) is not None:
            return w
        dest.mkdir(parents=True, exist_ok=True)
        rc, out = await _run(
            sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), f"exo-tui=={exo_tui.__version__}"
        )
        if rc != 0 or (w := find_project_wheel(dest)) is None:
            raise BootstrapError(
                "upload",
                "this exo-tui was installed without its sources and its wheel could not be downloaded:\n"
                + _tail(out)
                + "\nput exo_tui-" + exo_tui.__version__ + "-py3-none-any.whl in a --wheelhouse directory",
            )
        return w
    dest = cache_dir() / f"{exo_tui.__version__}-{source_hash(root)}"
    if (w := find_project_wheel(dest)) is not None:
        return w
    _prune(keep=4)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=_ensure(cache_dir())))
    try:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp), str(root)]
        if importlib.util.find_spec("hatchling") is not None:
            cmd.insert(4, "--no-build-isolation")
        rc, out = await _run(*cmd)
        built = find_project_wheel(tmp)
        if rc != 0 or built is None:
            raise BootstrapError("upload", f"building the exo-tui wheel from {root} failed:\n{_tail(out)}")
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / built.name
        shutil.move(str(built), final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(keep: int) -> None:
    """Drop all but the newest ``keep`` source-state wheels (each edit of the code makes one)."""
    dirs = [d for d in cache_dir().glob("*-*") if d.is_dir() and not d.name.startswith(("release-", "build-"))]
    dirs.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for d in dirs[keep:]:
        shutil.rmtree(d, ignore_errors=True)


def _ensure(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _tail(text: str, n: int = 12) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])
