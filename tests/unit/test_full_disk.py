"""A full disk (a real tmpfs filled to the last byte): the coordinator's state file keeps failed
writes and catches up once there is room, and the commands say what to do instead of a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo_tui import events as ev
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.store import StateStore
from exo_tui.config import Config


def _mount_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs (a disk that really fills up)"
    if shutil.which("mount") is None:
        return "needs mount(8)"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m") -> Iterator[Path]:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path) -> Path:
    """Writes a file until the disk is full; returns it (delete it to make room)."""
    filler = disk / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")  # the last partial block too
    return filler


pytestmark = pytest.mark.skipif(_mount_skip_reason() is not None, reason=_mount_skip_reason() or "")


def test_writes_on_a_full_disk_are_kept_and_saved_once_there_is_room(tmp_path: Path) -> None:
    reports: list[str | None] = []
    with small_disk(tmp_path / "disk") as disk:
        store = StateStore(disk / "state.db", on_write_error=reports.append)
        assert store.save_pins({"n-a": (0, 9)}) and store.write_error is None
        filler = fill(disk)
        # Enough writes that the WAL must grow past the free pages it had.
        audit_ok = [store.audit("drain", f"n-{i}", "ok", "x" * 2000) for i in range(200)]
        assert not all(audit_ok)
        assert store.save_drains({"n-b"}) is False
        assert store.save_plan(7, "model.gguf", {"shards": [1, 2, 3]}) is False
        assert store.write_error is not None and "free disk space" in store.write_error
        assert len(reports) == 1 and reports[0] == store.write_error  # reported once, not per write
        assert store.retry() is False  # still full
        # What the file held before is intact and readable meanwhile.
        assert store.pins() == {"n-a": (0, 9)}

        filler.unlink()
        assert store.retry() is True
        assert reports[-1] is None and store.write_error is None
        assert store.drains() == {"n-b"}
        assert store.plan() == (7, "model.gguf", {"shards": [1, 2, 3]})
        assert [e.target for e in store.audit_log(limit=500)] == [f"n-{i}" for i in range(200)]
        store.close()
        # A new process reading the file sees everything.
        again = StateStore(disk / "state.db")
        assert again.drains() == {"n-b"} and again.pins() == {"n-a": (0, 9)} and len(again.audit_log(500)) == 200
        again.close()


def test_the_coordinator_runs_on_and_tells_the_operator(tmp_path: Path) -> None:
    """An operator action on a full disk succeeds, the console gets one error notice that says what
    to do, and the coordinator's periodic retry saves the state once space is freed."""

    async def scenario() -> None:
        with small_disk(tmp_path / "home") as home:
            coordinator = Coordinator(config=Config(), home=home, persist=True)
            sub = coordinator.events.subscribe()
            filler = fill(home)
            for i in range(100):
                await coordinator.add_host(f"host-{i}.lan")  # remembered and audited: writes
            notices = [e for e in iter(sub.get_nowait, None) if isinstance(e, ev.Notice)]
            assert [n.level for n in notices] == ["error"]
            assert "free disk space" in notices[0].message and str(home / "state.db") in notices[0].message
            assert len(coordinator.hosts) == 100  # nothing lost in memory
            filler.unlink()
            assert coordinator.store is not None and coordinator.store.retry()
            notices = [e for e in iter(sub.get_nowait, None) if isinstance(e, ev.Notice)]
            assert [n.level for n in notices] == ["info"] and "saved again" in notices[0].message
            assert {h for h, *_ in coordinator.store.known_hosts()} == {f"host-{i}.lan" for i in range(100)}
            coordinator.store.close()

    asyncio.run(scenario())


def test_commands_on_a_full_disk_say_what_to_do(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        fill(disk)
        env = {**os.environ, "EXO_TUI_HOME": str(disk / "home")}
        for argv, code in ((["join-token"], 1), (["tui", "--no-discover"], 2), (["chat", "--local-nodes", "1", "hi"], 2)):
            out = subprocess.run([sys.executable, "-m", "exo_tui.cli", *argv], capture_output=True, text=True,
                                 timeout=120, env=env, stdin=subprocess.DEVNULL)
            assert out.returncode == code, (argv, out.stderr)
            assert "Traceback" not in out.stderr, (argv, out.stderr)
            assert "disk" in out.stderr and ("free some space" in out.stderr or "free some disk space" in out.stderr), (argv, out.stderr)
            assert str(disk / "home") in out.stderr, (argv, out.stderr)


def test_a_venv_on_a_full_disk_fails_with_its_own_exit_status(tmp_path: Path) -> None:
    """Bootstrap's venv script says "no space" by its exit status (not by its error's words); a
    venv it cannot make for another reason (its directory cannot be made) exits otherwise."""
    from exo_tui.bootstrap.install import NO_SPACE_EXIT, venv_script
    from exo_tui.bootstrap.remote import RemoteHost

    version = ".".join(str(n) for n in sys.version_info[:3])
    with small_disk(tmp_path / "disk", size="8m") as disk:
        host = RemoteHost(data_dir=str(disk / "exo-tui"), python=sys.executable, python_version=version)
        res = subprocess.run(["sh", "-c", venv_script(host)], capture_output=True, text=True, timeout=300)
        assert res.returncode == NO_SPACE_EXIT, res.stderr
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    host = RemoteHost(data_dir=str(not_a_dir / "exo-tui"), python=sys.executable, python_version=version)
    res = subprocess.run(["sh", "-c", venv_script(host)], capture_output=True, text=True, timeout=300)
    assert res.returncode not in (0, NO_SPACE_EXIT) and "Not a directory" in res.stderr, res
