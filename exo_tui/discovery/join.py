"""Join tokens: how a node gets the cluster key without SSH.

The operator runs ``exo-tui join-token`` on the coordinator's machine; it prints a token, and on
the new host the operator types ``exo-tui node --join TOKEN``. The node connects to the
coordinator's *join endpoint* (:func:`serve_join`, TLS with the coordinator's certificate, port
52417 by default), checks that certificate against the fingerprint in the token, sends the token's
secret and gets its node bundle (cluster key, CA, a certificate issued for its name) back, which
it stores 0600. The secret works once and expires (one hour by default); the coordinator keeps
only its SHA-256, in ``<exo home>/join-tokens.json`` (0600), so ``join-token`` and the coordinator
can be different processes.

A token: ``exo-join1.`` + base64url(JSON ``{"a": [HOST:PORT...], "i": id, "s": secret, "e":
expiry (unix s), "f": SHA-256 of the coordinator certificate, hex}``). It is a secret until used.

Wire protocol of the join endpoint: the client sends one JSON line ``{"join": 1, "id", "secret",
"name", "port"}`` (``port``: where its node agent will listen); the server answers one JSON line,
``{"ok": true, "bundle": "<bundle text>"}`` or ``{"ok": false, "error": "..."}``, and closes.
Lines are at most 64 KiB; the TLS handshake must finish within 5 s and the request within
``REQUEST_S`` after it. At most ``MAX_JOINING`` connections are served at once, at most
``JOIN_PER_ADDRESS`` of them past their first request byte from one address (loopback included),
shared out by a :class:`~exo_tui.net.gate.HandshakeGate`: a connection that has sent no byte of its
request yet is idle, and a newcomer takes the oldest idle one's place, so strangers holding silent
TLS connections cannot lock out a node that joins (issue 43: 16 such connections refused every
join). ``on_join`` then gets a :class:`Joined` (name, the address the request
came from, the agent's port): the coordinator connects to the new node there
(:meth:`exo_tui.cluster.coordinator.Coordinator` with ``join=True``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import ssl
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exo_tui.net.gate import HandshakeGate, Refused
from exo_tui.paths import file_lock

PREFIX = "exo-join1."
DEFAULT_JOIN_PORT = 52417
DEFAULT_TTL_S = 3600.0
MAX_LINE = 64 * 1024
MAX_JOINING = 16
JOIN_PER_ADDRESS = 4
TLS_HANDSHAKE_S = 5.0
REQUEST_S = 5.0
STORE_NAME = "join-tokens.json"


class JoinError(Exception):
    """A token that cannot be used or a failed join: one subclass per cause, each with its
    ``code`` (the join endpoint sends it with a refusal, so the node raises the same type)."""

    code = "refused"


class TokenInvalid(JoinError):
    """Not a join token, or one copied in part."""

    code = "invalid"


class TokenUnknown(JoinError):
    """A token this coordinator did not make, or revoked."""

    code = "unknown"


class TokenUsed(JoinError):
    """A token used once already (tokens work once)."""

    code = "used"


class TokenExpired(JoinError):
    """A token past its time."""

    code = "expired"


class TokenWrongRole(JoinError):
    """A node's token used to join a coordinator, or the reverse."""

    code = "wrong_role"


class TokenStoreDamaged(JoinError):
    """The coordinator's token file cannot be read."""

    code = "store_damaged"


class NoJoinAddress(JoinError):
    """A token asked for with no address to put in it."""

    code = "no_address"


class NotLeader(JoinError):
    """A coordinator's token used where the coordinator that made it no longer leads its set."""

    code = "not_leader"


class SetRefused(JoinError):
    """The set of coordinators did not take the new one (its Raft refused the change)."""

    code = "set_refused"


class AnswerIncomplete(JoinError):
    """The leader's answer to a coordinator's join lacks what a join needs (another version?)."""

    code = "answer_incomplete"


class JoinRefused(JoinError):
    """The join endpoint refused the request for a reason without a type of its own."""


class EndpointUnreachable(JoinError):
    """No address of the token answered."""

    code = "unreachable"


class WrongCoordinator(JoinError):
    """An address answered with a certificate other than the one the token names (another
    cluster's endpoint, or someone in between): the secret was not sent."""

    code = "wrong_coordinator"


REFUSALS: dict[str, type[JoinError]] = {
    cls.code: cls for cls in (TokenInvalid, TokenUnknown, TokenUsed, TokenExpired, TokenWrongRole, TokenStoreDamaged,
                              NotLeader, SetRefused)
}


@dataclass(frozen=True)
class Joined:
    """A node that got its bundle: its name, the address its request came from, its agent's port
    (``None`` when it did not say)."""

    name: str
    host: str
    port: int | None


@dataclass(frozen=True)
class JoinToken:
    addresses: tuple[str, ...]  # "host:port" of the join endpoint, tried in order
    token_id: str
    secret: str
    expires: float  # unix time
    fingerprint: str  # SHA-256 (hex) of the coordinator's certificate

    def encode(self) -> str:
        doc = {"a": list(self.addresses), "i": self.token_id, "s": self.secret, "e": int(self.expires),
               "f": self.fingerprint}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> JoinToken:
        text = "".join(text.split())  # a token pasted with line breaks still works
        if not text.startswith(PREFIX):
            raise TokenInvalid(f"not an exo-tui join token (it should start with {PREFIX!r}): run `exo-tui join-token` "
                            "on the coordinator and copy the whole token")
        body = text[len(PREFIX):]
        try:
            doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            token = cls(
                addresses=tuple(str(a) for a in doc["a"]),
                token_id=str(doc["i"]),
                secret=str(doc["s"]),
                expires=float(doc["e"]),
                fingerprint=str(doc["f"]).lower(),
            )
        except (ValueError, KeyError, TypeError):
            raise TokenInvalid("the join token is damaged (copied only in part?): copy the whole token again") from None
        if not token.addresses or not token.token_id or len(token.secret) < 32 or len(token.fingerprint) != 64:
            raise TokenInvalid("the join token is incomplete: copy the whole token again")
        return token

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    """The coordinator's one-time secrets (hashes only), in a 0600 JSON file with a lock."""

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from exo_tui.net.security import home_dir

            path = home_dir() / STORE_NAME
        self.path = Path(path)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.path.with_name(self.path.name + ".lock"))

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError:
            raise TokenStoreDamaged(f"{self.path} is damaged: delete it (outstanding join tokens stop working)") from None
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, dict]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    def add(self, token: JoinToken, *, now: float | None = None, role: str = "node") -> None:
        """``role``: what the token joins, a ``node`` or a ``coordinator`` (of a set: it gets the
        cluster's secrets, the CA's key included)."""
        now = time.time() if now is None else now
        with self._locked():
            data = {k: v for k, v in self._read().items() if v.get("expires", 0) > now - 86400}  # prune old
            data[token.token_id] = {"hash": _hash(token.secret), "created": now, "expires": token.expires,
                                    "used": None, "used_by": "", "role": role}
            self._write(data)

    def _check(self, rec: dict | None, secret: str, now: float) -> None:
        if rec is None or not hmac.compare_digest(rec.get("hash", ""), _hash(secret)):
            raise TokenUnknown("unknown join token (made for another coordinator, or revoked): make a new one "
                            "with `exo-tui join-token`")
        if rec.get("used"):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["used"]))
            raise TokenUsed(f"this join token was already used (at {when} by {rec.get('used_by') or 'a node'}): "
                            "tokens work once; make a new one with `exo-tui join-token`")
        if now >= rec.get("expires", 0):
            raise TokenExpired("this join token has expired: make a new one with `exo-tui join-token`")

    def validate(self, token_id: str, secret: str, *, now: float | None = None) -> None:
        """Raise :class:`JoinError` unless the token is known, unused and unexpired."""
        with self._locked():
            self._check(self._read().get(token_id), secret, time.time() if now is None else now)

    def consume(self, token_id: str, secret: str, *, name: str = "", now: float | None = None,
                role: str = "node") -> None:
        """Validate and mark used, atomically: a second use is refused; so is a token made for
        another role (a node's token cannot join a coordinator, nor the reverse)."""
        now = time.time() if now is None else now
        with self._locked():
            data = self._read()
            self._check(data.get(token_id), secret, now)
            made_for = data[token_id].get("role", "node")
            if made_for != role:
                raise TokenWrongRole(f"this join token is for a {made_for}, not a {role}: make one with "
                                f"`exo-tui join-token{' --coordinator' if role == 'coordinator' else ''}`")
            data[token_id]["used"] = now
            data[token_id]["used_by"] = name
            self._write(data)

    def records(self) -> dict[str, dict]:
        """Every token's record (hashes, never secrets): what a set of coordinators replicates."""
        with self._locked():
            return self._read()

    def merge(self, records: dict[str, dict]) -> None:
        """Take in another coordinator's records (a set's new leader): tokens it made work here,
        and a token used anywhere stays used."""
        with self._locked():
            data = self._read()
            for token_id, rec in records.items():
                mine = data.get(token_id)
                if mine is None or (rec.get("used") and not mine.get("used")):
                    data[token_id] = dict(rec)
            self._write(data)

    def revoke_all(self, *, now: float | None = None) -> int:
        """Forget every token; returns how many were still usable (unused and unexpired)."""
        now = time.time() if now is None else now
        with self._locked():
            data = self._read()
            n = sum(1 for v in data.values() if not v.get("used") and v.get("expires", 0) > now)
            self._write({})
            return n

    def outstanding(self, *, now: float | None = None) -> int:
        now = time.time() if now is None else now
        return sum(1 for v in self._read().values() if not v.get("used") and v.get("expires", 0) > now)


# ---------------------------------------------------------------------- coordinator side


def create_join_token(
    addresses: Sequence[str],
    *,
    home: Path | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    role: str = "node",
) -> JoinToken:
    """Make and record a one-time token for the join endpoint at ``addresses`` ("host:port")."""
    from exo_tui.net.security import cert_fingerprint, ensure_cluster, home_dir

    if not addresses:
        raise NoJoinAddress("no address for the join endpoint: pass --address HOST[:PORT]")
    cluster = ensure_cluster(home)
    now = time.time() if now is None else now
    token = JoinToken(
        addresses=tuple(addresses),
        token_id=secrets.token_hex(6),
        secret=secrets.token_hex(16),
        expires=float(int(now + ttl_s)),
        fingerprint=cert_fingerprint(cluster.cert_pem).hex(),
    )
    TokenStore((home or home_dir()) / STORE_NAME).add(token, now=now, role=role)
    return token


def _server_context(cert_pem: bytes, key_pem: bytes, home: Path | None = None) -> ssl.SSLContext:
    from exo_tui.net.security import load_chain

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    load_chain(ctx, cert_pem, key_pem, home)  # its temporary PEM lives in the 0700 exo-tui home, not /tmp
    return ctx


class JoinServer:
    """The join endpoint. ``on_join(joined)`` (a :class:`Joined`) is called after a bundle was handed out."""

    def __init__(self, home: Path | None = None, *, on_join=None, on_coordinator=None) -> None:  # noqa: ANN001
        """``on_coordinator(name, host, raft_port, api_port)``: a coordinator of a set joins
        (:mod:`exo_tui.discovery.join_coordinator`); awaited, it returns what the reply adds."""
        from exo_tui.net.security import ensure_cluster, home_dir

        self.home = home
        self.cluster = ensure_cluster(home)
        self.store = TokenStore((home or home_dir()) / STORE_NAME)
        self.on_join = on_join
        self.on_coordinator = on_coordinator
        self.joined: list[str] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self.gate = HandshakeGate(total=MAX_JOINING, reserved=0, per_address=JOIN_PER_ADDRESS)
        self.refused = 0
        self.port = 0

    async def start(self, host: str = "0.0.0.0", port: int = DEFAULT_JOIN_PORT) -> None:
        ctx = _server_context(self.cluster.cert_pem, self.cluster.key_pem, self.home)
        self._server = await asyncio.start_server(self._handle, host, port, ssl=ctx, limit=MAX_LINE,
                                                  ssl_handshake_timeout=TLS_HANDSHAKE_S)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            for task in list(self._handlers):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> JoinServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        try:
            ticket = self.gate.admit(str(peer[0]) if peer else "?", task.cancel)
        except Refused:
            self.refused += 1
            writer.transport.abort()  # busy: a real node retries; strangers get nothing to hold
            return
        self._handlers.add(task)
        try:
            try:
                async with asyncio.timeout(REQUEST_S):
                    first = await reader.readexactly(1)
                    self.gate.hello(ticket, proved=False)  # no longer idle; its address's cap
                    reply = await self._answer(first, reader, writer)
            except Refused:
                self.refused += 1
                writer.transport.abort()
                return
            except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError):
                reply = {"ok": False, "error": "bad join request"}
            with contextlib.suppress(Exception):
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except asyncio.CancelledError:
            writer.transport.abort()
            if self._server is None or self.gate.holds(ticket):  # closing, not an idle one dropped for room
                raise
            task.uncancel()
        finally:
            self._handlers.discard(task)
            self.gate.release(ticket)
            writer.transport.abort() if writer.transport.is_closing() else writer.close()

    async def _answer(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict:
        line = first if first == b"\n" else first + await reader.readuntil(b"\n")
        req = json.loads(line)
        if not isinstance(req, dict) or req.get("join") != 1:
            return {"ok": False, "error": "not a join request"}
        name = str(req.get("name", ""))[:64].strip()
        if not name:
            return {"ok": False, "error": "a join request needs the node's name"}
        if "raft_port" in req:
            from exo_tui.discovery.join_coordinator import answer_coordinator

            return await answer_coordinator(self, req, name, writer)
        try:
            self.store.consume(str(req.get("id", "")), str(req.get("secret", "")), name=name)
        except JoinError as exc:
            return {"ok": False, "error": str(exc), "code": exc.code}
        bundle = self.cluster.node_bundle(name)
        self.joined.append(name)
        if self.on_join is not None:
            peer = writer.get_extra_info("peername")
            port = req.get("port")
            self.on_join(Joined(name, str(peer[0]) if peer else "",
                                port if type(port) is int and 0 < port < 65536 else None))
        return {"ok": True, "bundle": bundle.decode()}


async def serve_join(host: str = "0.0.0.0", port: int = DEFAULT_JOIN_PORT, *, home: Path | None = None,
                     on_join=None, on_coordinator=None) -> JoinServer:  # noqa: ANN001
    """Start the join endpoint (the coordinator mounts this next to its node connections)."""
    server = JoinServer(home, on_join=on_join, on_coordinator=on_coordinator)
    await server.start(host, port)
    return server


# ---------------------------------------------------------------------- node side


def _split(addr: str) -> tuple[str, int]:
    from exo_tui.discovery.static import split_host_port

    return split_host_port(addr, DEFAULT_JOIN_PORT)


async def fetch_bundle(token: JoinToken | str, *, name: str, agent_port: int | None = None,
                       timeout_s: float = 10.0) -> bytes:
    """Use the token once: connect to the join endpoint, check its certificate, get a node bundle."""
    req: dict = {"name": name}
    if agent_port is not None:
        req["port"] = agent_port
    reply = await exchange(token, req, timeout_s=timeout_s)
    bundle = str(reply.get("bundle", "")).encode()
    from exo_tui.net.security import parse_bundle

    parse_bundle(bundle, "the bundle from the coordinator")  # raises SecurityError if bad
    return bundle


async def exchange(token: JoinToken | str, fields: dict, *, timeout_s: float = 10.0) -> dict:
    """Send the token's join request (with ``fields``) to its endpoint, its certificate checked
    against the token's pin; the endpoint's reply (raises :class:`JoinError` when it refuses)."""
    tok = JoinToken.decode(token) if isinstance(token, str) else token
    if tok.expired():
        raise TokenExpired("this join token has expired: make a new one with `exo-tui join-token` on the coordinator")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the pin below is the check: the token names the certificate
    errors: list[str] = []
    impostor = False
    for addr in tok.addresses:
        host, port = _split(addr)
        writer = None
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port, ssl=ctx, limit=MAX_LINE)
                der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if not der or not hmac.compare_digest(hashlib.sha256(der).hexdigest(), tok.fingerprint):
                    errors.append(f"{addr}: its certificate is not the coordinator's named in the token")
                    impostor = True
                    continue
                req = {"join": 1, "id": tok.token_id, "secret": tok.secret, **fields}
                writer.write(json.dumps(req).encode() + b"\n")
                await writer.drain()
                reply = json.loads(await reader.readuntil(b"\n"))
        except (OSError, TimeoutError, ssl.SSLError, ValueError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as exc:
            errors.append(f"{addr}: {getattr(exc, 'strerror', None) or str(exc) or type(exc).__name__}")
            continue
        finally:
            if writer is not None:
                writer.close()
        if not reply.get("ok"):
            refusal = REFUSALS.get(str(reply.get("code")), JoinRefused)
            raise refusal(f"the coordinator refused the token: {reply.get('error', 'no reason given')}")
        return reply
    if impostor:
        raise WrongCoordinator(
            "no address of the token answered as the coordinator that made it (" + "; ".join(errors) + "): the "
            "secret was not sent; check the address (another cluster's coordinator, or someone in between?)")
    raise EndpointUnreachable(
        "could not reach the coordinator's join endpoint (" + "; ".join(errors) + "): is the coordinator "
        "running (exo-tui / exo-tui serve / exo-tui join-token --serve) and its join port open to this host?"
    )


def join_cluster(token: str, *, name: str, port: int | None = None, key_file: Path | None = None,
                 timeout_s: float = 10.0) -> Path:
    """For ``exo-tui node --join TOKEN``: fetch the bundle once, store it 0600, return its path.
    ``port``: where this node's agent listens (the coordinator connects to it there)."""
    from exo_tui.net.security import SecurityError, default_bundle_path, write_node_bundle

    try:
        bundle = asyncio.run(fetch_bundle(token, name=name, agent_port=port, timeout_s=timeout_s))
    except JoinError as exc:
        raise SecurityError(f"join: {exc}") from None
    return write_node_bundle(Path(key_file) if key_file else default_bundle_path(), bundle)
