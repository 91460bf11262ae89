"""A proof of the cluster key in a connection's first bytes, so that a node can give the coordinator
and its peers a handshake slot before any handshake: :func:`slot_cookie` and :class:`SlotCookies`.

A node's handshake slots are few (:mod:`exo_tui.net.gate`); strangers on the coordinator's own
address (loopback, a shared NAT) must not be able to take them all from it. So every client of the
cluster names, as its TLS ClientHello's server name (SNI, sent in clear in the first flight), a
*slot cookie*::

    "x" + nonce (8 random bytes, hex) + HMAC-SHA256(cluster_key, "exo-tui/slot " minute nonce)[:16] (hex)

where ``minute`` is the Unix time // 60 as 8 bytes. The node reads it from the ClientHello
(:func:`client_hello_server_name`) before it gives the connection a slot: a valid cookie from
this minute or the one before or after (clocks a minute apart still work) whose nonce it has not
seen yet is *proved*; each nonce counts once, so a cookie copied off the wire by an eavesdropper
gets them at most the one connection it was made for, if they are first. The cookie proves only
that its maker holds the cluster key; the TLS and HMAC handshakes still decide who gets in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time

PERIOD_S = 60
NONCE_BYTES = 8
MAC_BYTES = 16
PREFIX = "x"
SEEN_MAX = 8192  # nonces remembered (only valid cookies are, and only key holders can make them)


def _mac(key: bytes, period: int, nonce: bytes) -> bytes:
    return hmac.new(key, b"exo-tui/slot " + struct.pack(">q", period) + nonce, hashlib.sha256).digest()[:MAC_BYTES]


def slot_cookie(key: bytes, now: float | None = None) -> str:
    """A fresh cookie for one connection (a valid DNS label: 49 hex characters after ``x``)."""
    nonce = os.urandom(NONCE_BYTES)
    period = int((time.time() if now is None else now) // PERIOD_S)
    return PREFIX + nonce.hex() + _mac(key, period, nonce).hex()


class SlotCookies:
    """A server's check of the cookies it is shown, each nonce once."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._seen: dict[bytes, int] = {}  # nonce -> its period

    def proved(self, name: str | None, now: float | None = None) -> bool:
        """Whether ``name`` (a ClientHello's server name) is a valid cookie not seen before."""
        if not name or len(name) != 1 + 2 * (NONCE_BYTES + MAC_BYTES) or not name.startswith(PREFIX):
            return False
        try:
            raw = bytes.fromhex(name[1:])
        except ValueError:
            return False
        nonce, tag = raw[:NONCE_BYTES], raw[NONCE_BYTES:]
        period = int((time.time() if now is None else now) // PERIOD_S)
        if not any(hmac.compare_digest(tag, _mac(self.key, p, nonce)) for p in (period, period - 1, period + 1)):
            return False
        if nonce in self._seen:
            return False
        if len(self._seen) >= SEEN_MAX:
            self._seen = {n: p for n, p in self._seen.items() if p >= period - 2}
            if len(self._seen) >= SEEN_MAX:  # more valid cookies in 3 minutes than this: forget the oldest
                for old in list(self._seen)[: SEEN_MAX // 2]:
                    del self._seen[old]
        self._seen[nonce] = period
        return True


def client_hello_server_name(record: bytes) -> str | None:
    """The server name (SNI) of a TLS record holding a ClientHello, or ``None`` (no name, or
    not a ClientHello this parser reads: it is only ever a hint, the handshake decides)."""
    try:
        if len(record) < 5 or record[0] != 0x16:
            return None
        body = record[5:5 + int.from_bytes(record[3:5], "big")]
        if not body or body[0] != 0x01:  # handshake type: ClientHello
            return None
        at = 4 + 2 + 32  # handshake header, legacy version, random
        at += 1 + body[at]  # session id
        at += 2 + int.from_bytes(body[at:at + 2], "big")  # cipher suites
        at += 1 + body[at]  # compression methods
        end = min(len(body), at + 2 + int.from_bytes(body[at:at + 2], "big"))
        at += 2
        while at + 4 <= end:
            kind, size = int.from_bytes(body[at:at + 2], "big"), int.from_bytes(body[at + 2:at + 4], "big")
            at += 4
            if kind == 0:  # server_name: list length, then (type 0, length, name)
                ext = body[at:at + size]
                if len(ext) >= 5 and ext[2] == 0:
                    n = int.from_bytes(ext[3:5], "big")
                    return ext[5:5 + n].decode("ascii", "replace")
                return None
            at += size
    except IndexError:
        return None
    return None
