"""Files onto a host over SSH: by SFTP where the host has it, else over the SSH channel itself.

An OpenSSH server without a ``Subsystem sftp`` line (or whose sftp-server is not installed)
refuses SFTP; bootstrap then copies the same files with ``cat`` over plain exec channels (each
file's bytes are the channel's stdin, written to a temporary name and moved into place), which any
POSIX host with a shell can do. Either way the calls are the same: :func:`remote_files`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh

log = logging.getLogger("exo_tui.bootstrap")


def _q(path: str) -> str:
    return shlex.quote(path)


class SftpFiles:
    """The operations bootstrap needs, by SFTP."""

    via = "sftp"

    def __init__(self, sftp: asyncssh.SFTPClient) -> None:
        self.sftp = sftp

    async def makedirs(self, path: str) -> None:
        await self.sftp.makedirs(path, exist_ok=True)

    async def put(self, local: str | Path, remote: str) -> None:
        await self.sftp.put(str(local), remote)

    async def write(self, remote: str, data: bytes, mode: int = 0o644) -> None:
        async with self.sftp.open(remote, "wb", asyncssh.SFTPAttrs(permissions=mode)) as f:
            await f.write(data)
        await self.sftp.chmod(remote, mode)  # whatever the umask did

    async def sizes(self, directory: str) -> dict[str, int]:
        return {os.fsdecode(e.filename): int(e.attrs.size or 0) for e in await self.sftp.readdir(directory)}


def output_text(out: bytes | str | None) -> str:
    """A command's output as text (bytes where the channel was opened without an encoding)."""
    if isinstance(out, bytes):
        return out.decode(errors="replace")
    return out or ""


class ChannelFiles:
    """The same operations over exec channels (``cat``, ``mkdir -p``, ``ls``): no SFTP needed."""

    via = "ssh channel"

    def __init__(self, conn: asyncssh.SSHClientConnection) -> None:
        self.conn = conn

    async def _sh(self, script: str, data: bytes | None = None) -> bytes:
        res = await self.conn.run("sh -c " + _q(script), input=data, encoding=None, check=False)
        if res.exit_status != 0:
            err = output_text(res.stderr).strip()
            raise OSError(f"remote command failed ({res.exit_status}): {script.splitlines()[0][:80]}: {err[-300:]}")
        out = res.stdout or b""
        return out if isinstance(out, bytes) else out.encode()

    async def makedirs(self, path: str) -> None:
        await self._sh(f"mkdir -p {_q(path)}")

    async def put(self, local: str | Path, remote: str) -> None:
        await self.write(remote, Path(local).read_bytes())

    async def write(self, remote: str, data: bytes, mode: int = 0o644) -> None:
        tmp = f"{remote}.part"
        await self._sh(f"umask 077; cat > {_q(tmp)} && chmod {mode:o} {_q(tmp)} && mv -f {_q(tmp)} {_q(remote)}", data)
        size = int((await self._sh(f"wc -c < {_q(remote)}")).decode().strip() or -1)
        if size != len(data):
            raise OSError(f"{remote}: {size} bytes arrived of {len(data)} sent over the SSH channel")

    async def sizes(self, directory: str) -> dict[str, int]:
        out = await self._sh(f"cd {_q(directory)} && for f in *; do [ -f \"$f\" ] && wc -c < \"$f\" | "
                             "tr -d ' \\n' && printf ' %s\\n' \"$f\"; done; true")
        sizes = {}
        for line in out.decode(errors="replace").splitlines():
            n, _, name = line.partition(" ")
            if n.isdigit() and name:
                sizes[name] = int(n)
        return sizes


@contextlib.asynccontextmanager
async def remote_files(conn: asyncssh.SSHClientConnection) -> AsyncIterator[SftpFiles | ChannelFiles]:
    """File operations on the host: SFTP, or, where the host refuses the SFTP subsystem, the SSH
    channel (said in the log)."""
    try:
        sftp = await conn.start_sftp_client()
    except (asyncssh.Error, EOFError) as exc:
        log.info("the host has no SFTP (%s): copying files over the SSH channel", exc)
        yield ChannelFiles(conn)
        return
    try:
        yield SftpFiles(sftp)
    finally:
        sftp.exit()
