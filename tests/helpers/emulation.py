"""Emulated clusters on one machine: a node's CPU held to a quota, a link given delay and bandwidth.

* :class:`CpuQuota` moves a process into a cgroup of its own with a CPU quota: cgroup v1's
  ``cpu.cfs_quota_us`` (this machine's: ``/sys/fs/cgroup/cpu``), or v2's ``cpu.max`` where the
  unified hierarchy has the cpu controller. Root only; :func:`cpu_quota_unavailable` says why not.
  Without root, :func:`slow_down` lowers a process's priority (nice 19): a slower node only while
  others compete for the cores, not a quota.
* :class:`Relay` is a userspace TCP relay in its own process (``python -m tests.helpers.emulation
  relay``), since this kernel has no netem: each direction holds every chunk for ``delay_ms`` and
  sends at most ``mbit`` megabits a second. A node reached through it (its address given as the
  relay's) has that link to everything that connects to it: the other nodes' activations, the
  coordinator's frames, the link probes. TLS passes through untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup/unified")
PERIOD_US = 100_000


def _v2_root() -> Path | None:
    for root in (CGROUP_V2, Path("/sys/fs/cgroup")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root
    return None


def cpu_quota_unavailable() -> str | None:
    """Why a CPU quota cannot be set here (None: it can)."""
    if os.geteuid() != 0:
        return "a CPU quota needs root (cgroup files are root's)"
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists() or _v2_root() is not None:
        return None
    return "this machine has no cgroup cpu controller (neither v1 cpu.cfs_quota_us nor v2 cpu.max)"


class CpuQuota:
    """A cgroup of its own for process ``pid``, held to ``cores`` CPU cores (0.25: a quarter of
    one); :meth:`release` moves it back and removes the group."""

    def __init__(self, pid: int, cores: float) -> None:
        why = cpu_quota_unavailable()
        if why is not None:
            raise RuntimeError(why)
        self.pid = pid
        self.v2 = not (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists()
        root = _v2_root() if self.v2 else CGROUP_V1_CPU
        assert root is not None
        self.root = root
        self.path = root / f"exo-tui-emulated-{os.getpid()}-{pid}"
        self.path.mkdir(exist_ok=True)
        self.set(cores)
        (self.path / "cgroup.procs").write_text(str(pid))

    def set(self, cores: float) -> None:
        quota = max(1000, int(cores * PERIOD_US))
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def release(self) -> None:
        with contextlib.suppress(OSError):  # the process may be gone: its group empties anyway
            (self.root / "cgroup.procs").write_text(str(self.pid))
        for _ in range(50):  # the kernel refuses to remove a group until its last task has left it
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def slow_down(pid: int) -> None:
    """Without root: the lowest priority for ``pid`` (it runs when nothing else wants the cores)."""
    os.setpriority(os.PRIO_PROCESS, pid, 19)


# ---------------------------------------------------------------------------------------- relay


class Relay:
    """A relay process from a free loopback port to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int], *, delay_ms: float = 0.0, mbit: float = 0.0) -> None:
        self.target, self.delay_ms, self.mbit = target, delay_ms, mbit
        cmd = [sys.executable, "-m", "tests.helpers.emulation", "relay", "--to", f"{target[0]}:{target[1]}",
               "--delay-ms", str(delay_ms), "--mbit", str(mbit), "--exit-with-parent", str(os.getpid())]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line.startswith("relay listening on "):
            self.stop()
            raise RuntimeError(f"the relay did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, bytes_per_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived and no faster than
    ``bytes_per_s`` (0: unlimited)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s, data))
        queue.put_nowait((0.0, b""))

    task = asyncio.create_task(read())
    free_at = 0.0  # when the emulated line is free to send the next byte
    try:
        while True:
            due, data = await queue.get()
            if not data:
                break
            start = max(due, free_at)
            if bytes_per_s > 0:
                free_at = start + len(data) / bytes_per_s
            wait = (free_at if bytes_per_s > 0 else start) - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    finally:
        task.cancel()
        with contextlib.suppress(Exception):
            writer.close()


async def _relay_main(target: tuple[str, int], delay_s: float, bytes_per_s: float, parent: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer, delay_s, bytes_per_s), _pump(up_reader, writer, delay_s, bytes_per_s),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"relay listening on 127.0.0.1:{port}", flush=True)
    while parent <= 0 or _alive(parent):
        await asyncio.sleep(1.0)
    server.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.emulation")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("relay", help="a TCP relay with per-direction delay and bandwidth")
    r.add_argument("--to", required=True, metavar="HOST:PORT")
    r.add_argument("--delay-ms", type=float, default=0.0)
    r.add_argument("--mbit", type=float, default=0.0, help="megabits a second each way (0: unlimited)")
    r.add_argument("--exit-with-parent", type=int, default=0, metavar="PID")
    args = p.parse_args(argv)
    host, port = args.to.rsplit(":", 1)
    asyncio.run(_relay_main((host, int(port)), args.delay_ms / 1000, args.mbit * 1e6 / 8, args.exit_with_parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
