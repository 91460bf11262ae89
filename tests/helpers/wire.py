"""Raw-bytes helpers for tests that speak to a server below the RPC layer."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct

import msgpack


async def read_to_eof(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes (a reset counts as the end)."""
    buf = bytearray()
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while chunk := await reader.read(65536):
                buf += chunk
    return bytes(buf)


def raw_frame(header: dict, payload: bytes = b"") -> bytes:
    """A frame with any header at all (the encoder would refuse the bad ones)."""
    h = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(h)) + h + payload
