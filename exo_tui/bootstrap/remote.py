"""What bootstrap learns of a remote host, and the shell it runs there to learn it: the detection
script and its parsing (:class:`RemoteHost`), the choice of a Python, pip's failures explained.

Pure text in and out (nothing here opens a connection); :mod:`exo_tui.bootstrap.install` runs it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from exo_tui.bootstrap.errors import BootstrapError

MIN_PYTHON = (3, 11)


@dataclass
class RemoteHost:
    os: str = ""
    arch: str = ""
    home: str = ""
    data_dir: str = ""
    hostname: str = ""
    python: str = ""
    python_version: str = ""
    apple_silicon: bool = False
    free_bytes: int | None = None
    free_dir: str = ""
    systemd_user: bool = False
    pythons: list[tuple[str, str, bool]] = field(default_factory=list)  # (path, version, has venv)

    @property
    def venv(self) -> str:
        return f"{self.data_dir}/venv"

    @property
    def exe(self) -> str:
        return f"{self.venv}/bin/exo-tui"


# ---------------------------------------------------------------------- remote scripts


def _detect_script(candidates: Sequence[str]) -> str:
    cands = " ".join(shlex.quote(c) for c in candidates)
    # Non-interactive SSH sessions get a short PATH (macOS: no Homebrew): look there too.
    return f"""
PATH="$PATH:/opt/homebrew/bin:/usr/local/bin:$HOME/.local/bin:$HOME/.pyenv/shims"
echo "os=$(uname -s)"
echo "arch=$(uname -m)"
echo "home=$HOME"
echo "data=${{XDG_DATA_HOME:-$HOME/.local/share}}/exo-tui"
echo "hostname=$(hostname 2>/dev/null || uname -n)"
for py in {cands}; do
  p=$(command -v "$py" 2>/dev/null) || continue
  v=$("$p" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || continue
  if "$p" -c 'import venv, ensurepip' >/dev/null 2>&1; then ve=1; else ve=0; fi
  echo "python=$p $v $ve"
done
if [ "$(uname -s)" = Darwin ]; then
  echo "translated=$(sysctl -n sysctl.proc_translated 2>/dev/null)"
  echo "brand=$(sysctl -n machdep.cpu.brand_string 2>/dev/null)"
fi
d="$HOME"; [ -d "${{XDG_DATA_HOME:-$HOME/.local/share}}" ] && d="${{XDG_DATA_HOME:-$HOME/.local/share}}"
echo "free_kb=$(df -Pk "$d" 2>/dev/null | awk 'NR==2 {{print $4}}')"
echo "free_dir=$d"
if command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1; then
  echo "systemd_user=1"
fi
"""


def _parse_detect(out: str) -> RemoteHost:
    h = RemoteHost()
    brand = translated = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        value = value.strip()
        if key == "os":
            h.os = value
        elif key == "arch":
            h.arch = value
        elif key == "home":
            h.home = value
        elif key == "data":
            h.data_dir = value
        elif key == "hostname":
            h.hostname = value
        elif key == "python":
            parts = value.rsplit(" ", 2)
            if len(parts) == 3:
                h.pythons.append((parts[0], parts[1], parts[2] == "1"))
        elif key == "translated":
            translated = value
        elif key == "brand":
            brand = value
        elif key == "free_kb" and value.isdigit():
            h.free_bytes = int(value) * 1024
        elif key == "free_dir":
            h.free_dir = value
        elif key == "systemd_user":
            h.systemd_user = value == "1"
    h.apple_silicon = h.os == "Darwin" and (h.arch == "arm64" or translated == "1" or "Apple" in brand)
    return h


def _version_tuple(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split(".")[:2])
    except ValueError:
        return (0,)


def choose_python(h: RemoteHost, requested: str | None) -> None:
    """Pick the interpreter, or raise a BootstrapError that says how to get one."""
    ok = [(p, v, ve) for p, v, ve in h.pythons if _version_tuple(v) >= MIN_PYTHON]
    if requested:
        match = [x for x in h.pythons if x[0] == requested or x[0].endswith("/" + requested)]
        if not match:
            raise BootstrapError(
                "detect", f"--python {requested} does not run on {h.hostname or 'the host'}: give the path of a Python ≥ 3.11 there"
            )
        ok = [x for x in match if _version_tuple(x[1]) >= MIN_PYTHON]
        if not ok:
            raise BootstrapError("detect", f"--python {requested} is Python {match[0][1]}; exo-tui needs Python ≥ 3.11")
    if not ok:
        found = ", ".join(f"{p} ({v})" for p, v, _ in h.pythons) or "no python3 at all"
        hint = (
            "install it with Homebrew (brew install python@3.12) or from python.org"
            if h.os == "Darwin"
            else "install it (Debian/Ubuntu: sudo apt install python3.11 python3.11-venv; Fedora: sudo dnf install python3.11)"
        )
        raise BootstrapError(
            "detect", f"no Python ≥ 3.11 on {h.hostname or 'the host'} (found {found}): {hint}, or pass --python PATH"
        )
    with_venv = [x for x in ok if x[2]]
    if not with_venv:
        p, v, _ = ok[0]
        minor = ".".join(v.split(".")[:2])
        raise BootstrapError(
            "detect",
            f"{p} ({v}) lacks the venv module: install it (Debian/Ubuntu: sudo apt install python{minor}-venv) "
            "or pass --python with another interpreter",
        )
    h.python, h.python_version, _ = with_venv[0]


def _pip_hint(out: str) -> str:
    low = out.lower()
    if "no space left" in low:
        return "the host ran out of disk space: free some space there and run bootstrap again"
    if "permission denied" in low:
        return "permission denied writing the venv: check the owner of the exo-tui data directory on the host"
    if "could not find a version" in low or "no matching distribution" in low:
        return (
            "the host's package index lacks a dependency (an offline LAN?): run `pip download exo-tui -d DIR` "
            "on a machine with the same OS and Python, then bootstrap with --wheelhouse DIR"
        )
    if "network is unreachable" in low or "connection" in low and "error" in low or "temporary failure" in low:
        return "the host cannot reach its package index: give it network access or use --wheelhouse DIR"
    return "read pip's message above; fix the cause on the host (or use --wheelhouse DIR) and run again"


def _q(path: str) -> str:
    """Quote a remote path, keeping a leading ``~/``."""
    return shlex.quote(path)
