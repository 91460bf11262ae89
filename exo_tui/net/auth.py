"""Mutual HMAC-SHA256 challenge-response over the cluster key, before anything else on a connection.

It runs inside TLS (after the TLS 1.3 handshake, which already checked both certificates against
the cluster CA), on fixed-size binary messages, so it can be read before any frame parsing and
always tells a version mismatch apart from garbage::

    client → server  HELLO      "EXOT" u16 version  u16 0        nonce_c[32]               40 bytes
    server → client  CHALLENGE  "EXOT" u16 version  u8 status u8 0  nonce_s[32] mac_s[32]  72 bytes
    client → server  PROOF      mac_c[32]                                                   32 bytes
    server → client  RESULT     u8 (0 accepted, 1 refused)                                   1 byte

    mac_role = HMAC-SHA256(cluster_key, "exo-tui/auth " role  u16 version  nonce_c  nonce_s
                                        server_cert_sha256  client_cert_sha256)

* Both nonces are fresh random 32 bytes, so a recorded handshake replayed later fails (the server's
  nonce differs, so the recorded proof does not match).
* The MACs cover both certificates' fingerprints as each side sees them (channel binding): a
  handshake relayed by a man in the middle with its own certificate fails. Without TLS
  (``enable_tls: false``) the fingerprints are 32 zero bytes.
* The role label differs for the two MACs, so one side's proof cannot be reflected as the other's.
* Comparisons are constant-time (:func:`hmac.compare_digest`).
* A version mismatch is answered with status 1 and the server's version, so the client can say
  "node 10.0.0.7:52416 speaks exo-tui protocol 2, this coordinator speaks 1: upgrade ...".

The callers (:mod:`exo_tui.net.server`, :mod:`exo_tui.net.client`) apply the handshake timeout,
log refusals with the peer's address and close the connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import struct

from exo_tui.net.errors import AuthError, HandshakeError, ProtocolMismatch
from exo_tui.net.frame import PROTOCOL_VERSION

MAGIC = b"EXOT"
NONCE_BYTES = 32
MAC_BYTES = 32
_HELLO = struct.Struct(">4sHH32s")
_CHALLENGE = struct.Struct(">4sHBB32s32s")
HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
STATUS_OK = 0
STATUS_VERSION = 1
ACCEPTED = b"\x00"
REFUSED = b"\x01"
NO_FINGERPRINT = bytes(32)

UPGRADE_HINT = "upgrade exo-tui on the older side (pip install -U exo-tui) so both match"


def mac(key: bytes, role: str, version: int, nonce_c: bytes, nonce_s: bytes, fp_server: bytes, fp_client: bytes) -> bytes:
    """The proof of ``role`` ("client" or "server") for one handshake."""
    msg = b"".join(
        (
            b"exo-tui/auth ", role.encode(), struct.pack(">H", version),
            nonce_c, nonce_s, fp_server or NO_FINGERPRINT, fp_client or NO_FINGERPRINT,
        )
    )
    return hmac.new(key, msg, hashlib.sha256).digest()


def hello(nonce_c: bytes, version: int = PROTOCOL_VERSION) -> bytes:
    return _HELLO.pack(MAGIC, version, 0, nonce_c)


def _describe_garbage(data: bytes) -> str:
    if data[:1] == b"\x16" and data[1:2] == b"\x03":
        return "the peer speaks TLS but TLS is off here (network.security.enable_tls differs between the two sides)"
    if data[:4] in (b"GET ", b"POST", b"HEAD", b"PUT "):
        return "the peer speaks HTTP, not the exo-tui protocol (the API is on another port)"
    return "the peer did not start an exo-tui handshake (garbage or another protocol)"


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: bytes,
    *,
    fp_server: bytes,
    fp_client: bytes,
    peer: str,
    version: int = PROTOCOL_VERSION,
    local: str = "this process",
) -> None:
    """Prove the cluster key to the server and check its proof. Raises :class:`HandshakeError`."""
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    writer.write(hello(nonce_c, version))
    await writer.drain()
    try:
        data = await reader.readexactly(CHALLENGE_SIZE)
    except asyncio.IncompleteReadError as e:
        raise AuthError(
            f"{peer} closed the connection during the handshake ({len(e.partial)} of {CHALLENGE_SIZE} bytes): "
            "it did not accept this side (different cluster? TLS on one side only? see its log)"
        ) from None
    magic, peer_version, status, _, nonce_s, mac_s = _CHALLENGE.unpack(data)
    if magic != MAGIC:
        raise HandshakeError(f"{peer}: {_describe_garbage(data)}")
    if status == STATUS_VERSION or peer_version != version:
        raise ProtocolMismatch(
            f"{peer} speaks exo-tui protocol {peer_version}, {local} speaks {version}: {UPGRADE_HINT}",
            peer_version=peer_version,
        )
    if status != STATUS_OK:
        raise HandshakeError(f"{peer} answered the handshake with unknown status {status}")
    want = mac(key, "server", version, nonce_c, nonce_s, fp_server, fp_client)
    if not hmac.compare_digest(want, mac_s):
        writer.write(bytes(MAC_BYTES))  # a proof that cannot match: the server logs and closes too
        raise AuthError(
            f"{peer} could not prove the cluster key: it belongs to another cluster, or someone relays "
            "the connection. Bootstrap the node again with this coordinator's bundle"
        )
    writer.write(mac(key, "client", version, nonce_c, nonce_s, fp_server, fp_client))
    await writer.drain()
    try:
        result = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        result = REFUSED
    if result != ACCEPTED:
        raise AuthError(f"{peer} refused this side's proof of the cluster key (wrong key?)")


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: bytes,
    *,
    fp_server: bytes,
    fp_client: bytes,
    version: int = PROTOCOL_VERSION,
    local: str = "this process",
) -> None:
    """Check the client's proof of the cluster key and prove ours. Raises :class:`HandshakeError`."""
    try:
        data = await reader.readexactly(HELLO_SIZE)
    except asyncio.IncompleteReadError as e:
        if e.partial[:4] not in (b"", MAGIC[: len(e.partial)]):
            raise HandshakeError(_describe_garbage(e.partial)) from None
        raise AuthError("the peer closed the connection before completing the handshake (no key?)") from None
    magic, peer_version, _, nonce_c = _HELLO.unpack(data)
    if magic != MAGIC:
        raise HandshakeError(_describe_garbage(data))
    if peer_version != version:
        writer.write(_CHALLENGE.pack(MAGIC, version, STATUS_VERSION, 0, bytes(32), bytes(32)))
        await writer.drain()
        raise ProtocolMismatch(
            f"the peer speaks exo-tui protocol {peer_version}, {local} speaks {version}: {UPGRADE_HINT}",
            peer_version=peer_version,
        )
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    mac_s = mac(key, "server", version, nonce_c, nonce_s, fp_server, fp_client)
    writer.write(_CHALLENGE.pack(MAGIC, version, STATUS_OK, 0, nonce_s, mac_s))
    await writer.drain()
    try:
        mac_c = await reader.readexactly(MAC_BYTES)
    except asyncio.IncompleteReadError:
        raise AuthError("the peer closed the connection instead of proving the cluster key (wrong or no key)") from None
    want = mac(key, "client", version, nonce_c, nonce_s, fp_server, fp_client)
    if not hmac.compare_digest(want, mac_c):
        writer.write(REFUSED)
        await writer.drain()
        raise AuthError("the peer failed to prove the cluster key (wrong key, or a replayed handshake)")
    writer.write(ACCEPTED)
    await writer.drain()
