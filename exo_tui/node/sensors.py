"""Readings of the platform's sensors that a heartbeat carries when the platform reports them.

``power_w``: the machine's power draw — the batteries' ``power_now`` on Linux
(``/sys/class/power_supply``), else the CPU package's, from the RAPL energy counter
(``/sys/class/powercap/intel-rapl:0``) between two readings. ``vram_used_bytes`` and
``vram_total_bytes``: the NVIDIA GPUs' memory, from ``nvidia-smi`` (read at most every
``GPU_EVERY_S``: it takes tens of milliseconds). ``cpu_quota_cores``: the CPU a cgroup quota leaves
this process, in cores (v1 ``cpu.cfs_quota_us`` over its period, v2 ``cpu.max``), where one holds
it: a container's limit, or an emulated slow node. A reading the platform does not give is left out,
never reported as zero. (Temperature comes with :func:`exo_tui.node.profile.live_metrics`.)
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

POWER_SUPPLY = Path("/sys/class/power_supply")
CGROUP = Path("/sys/fs/cgroup")
RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
GPU_EVERY_S = 5.0

_rapl_last: tuple[float, int] | None = None
_gpu_cache: tuple[float, dict[str, Any]] | None = None


def power_w() -> float | None:
    global _rapl_last
    try:
        supplies = [p / "power_now" for p in POWER_SUPPLY.iterdir() if (p / "power_now").is_file()]
    except OSError:
        supplies = []
    total = 0.0
    for path in supplies:
        try:
            total += int(path.read_text().strip()) / 1e6
        except (OSError, ValueError):
            continue
    if total > 0:
        return total
    try:
        energy = int(RAPL.read_text().strip())
    except (OSError, ValueError):
        return None
    now, last = time.monotonic(), _rapl_last
    _rapl_last = (now, energy)
    if last is None or energy < last[1] or now <= last[0]:
        return None  # the first reading, or the counter wrapped
    return (energy - last[1]) / 1e6 / (now - last[0])


def gpu_memory() -> dict[str, Any]:
    global _gpu_cache
    now = time.monotonic()
    if _gpu_cache is not None and now - _gpu_cache[0] < GPU_EVERY_S:
        return _gpu_cache[1]
    out: dict[str, Any] = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            text = subprocess.run([smi, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=3, check=True).stdout
            rows = [[int(x) for x in line.split(",")] for line in text.strip().splitlines() if line.strip()]
            if rows:
                out = {"vram_used_bytes": sum(r[0] for r in rows) << 20, "vram_total_bytes": sum(r[1] for r in rows) << 20}
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            out = {}
    _gpu_cache = (now, out)
    return out


def _numbers(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None


def cpu_quota_cores(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP) -> float | None:
    """The cores a cgroup CPU quota leaves this process (None: no quota, or no cgroup to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            quota = _numbers(root / controllers / group.lstrip("/") / "cpu.cfs_quota_us")
            period = _numbers(root / controllers / group.lstrip("/") / "cpu.cfs_period_us")
            if quota and period and int(quota[0]) > 0 and int(period[0]) > 0:
                return int(quota[0]) / int(period[0])
            return None
        if not controllers:  # v2: the unified hierarchy
            for base in (root, root / "unified"):
                got = _numbers(base / group.lstrip("/") / "cpu.max")
                if got and got[0] != "max" and len(got) == 2 and int(got[1]) > 0:
                    return int(got[0]) / int(got[1])
    return None


def read() -> dict[str, Any]:
    """The readings this platform gives now (an empty dict where it gives none)."""
    out = dict(gpu_memory())
    quota = cpu_quota_cores()
    if quota is not None:
        out["cpu_quota_cores"] = round(quota, 3)
    watts = power_w()
    if watts is not None:
        out["power_w"] = round(watts, 2)
    return out
