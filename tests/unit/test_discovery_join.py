"""Join tokens: format, one-time store, expiry, and the join endpoint over loopback TLS."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from exo_tui.discovery.join import (
    EndpointUnreachable,
    JoinToken,
    TokenExpired,
    TokenInvalid,
    TokenStore,
    TokenUnknown,
    TokenUsed,
    TokenWrongRole,
    WrongCoordinator,
    create_join_token,
    fetch_bundle,
    join_cluster,
    serve_join,
)
from exo_tui.net.security import Security, SecurityError, ensure_cluster, parse_bundle


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "exo-home"
    h.mkdir(mode=0o700)
    monkeypatch.setenv("EXO_TUI_HOME", str(h))
    return h


def test_token_round_trip_and_damage(home: Path) -> None:
    tok = create_join_token(["10.0.0.2:52417", "[fe80::1]:52417"], home=home)
    text = tok.encode()
    assert text.startswith("exo-join1.")
    assert JoinToken.decode(text) == tok
    assert JoinToken.decode(text[:30] + "\n  " + text[30:]) == tok  # pasted with a line break
    with pytest.raises(TokenInvalid, match="copy the whole token"):
        JoinToken.decode(text[:-20])
    with pytest.raises(TokenInvalid, match="not an exo-tui join token"):
        JoinToken.decode("hello")
    # The store keeps only a hash of the secret, 0600.
    store = home / "join-tokens.json"
    assert tok.secret not in store.read_text()
    assert stat.S_IMODE(store.stat().st_mode) == 0o600


def test_a_token_works_once(home: Path) -> None:
    tok = create_join_token(["127.0.0.1:1"], home=home)
    store = TokenStore(home / "join-tokens.json")
    store.validate(tok.token_id, tok.secret)
    store.consume(tok.token_id, tok.secret, name="pi")
    with pytest.raises(TokenUsed, match="already used .* by pi"):
        store.consume(tok.token_id, tok.secret, name="pi")
    with pytest.raises(TokenUsed, match="already used"):
        store.validate(tok.token_id, tok.secret)


def test_expired_wrong_and_unknown_tokens_are_refused(home: Path) -> None:
    now = time.time()
    tok = create_join_token(["127.0.0.1:1"], home=home, ttl_s=60, now=now)
    store = TokenStore(home / "join-tokens.json")
    with pytest.raises(TokenExpired, match="expired"):
        store.consume(tok.token_id, tok.secret, now=now + 61)
    with pytest.raises(TokenUnknown, match="unknown"):
        store.consume(tok.token_id, "0" * 32)
    with pytest.raises(TokenUnknown, match="unknown"):
        store.consume("nosuchid", tok.secret)
    store.consume(tok.token_id, tok.secret, now=now + 59)  # still fine just before expiry
    assert store.outstanding() == 0
    t2 = create_join_token(["127.0.0.1:1"], home=home)
    create_join_token(["127.0.0.1:1"], home=home, ttl_s=60, now=time.time() - 3600)  # expired: not counted
    assert store.outstanding() == 1 and store.revoke_all() == 1
    with pytest.raises(TokenUnknown, match="unknown"):
        store.consume(t2.token_id, t2.secret)


async def test_join_endpoint_hands_out_a_bundle_once(home: Path, tmp_path: Path) -> None:
    joined: list = []
    server = await serve_join("127.0.0.1", 0, home=home, on_join=joined.append)
    try:
        tok = create_join_token([f"127.0.0.1:{server.port}"], home=home)
        bundle = await fetch_bundle(tok.encode(), name="laptop", agent_port=52499)
        b = parse_bundle(bundle)
        cluster = ensure_cluster(home)
        assert b["cluster_key"] == cluster.cluster_key and b["name"] == "laptop"
        assert [(j.name, j.host, j.port) for j in joined] == [("laptop", "127.0.0.1", 52499)]
        Security.from_bundle(bundle)  # usable as a node's security

        with pytest.raises(TokenUsed, match="already used"):
            await fetch_bundle(tok, name="laptop")
    finally:
        await server.close()


async def test_a_refusal_reaches_the_joiner_as_its_own_type(home: Path) -> None:
    """The endpoint sends the cause's code with a refusal; the joining side raises that type."""
    from exo_tui.discovery.join import NotLeader
    from exo_tui.discovery.join_coordinator import join_set

    async def lost_the_lead(*_: object) -> dict:
        raise NotLeader("this coordinator no longer leads the set: make the token where the leader runs")

    server = await serve_join("127.0.0.1", 0, home=home, on_coordinator=lost_the_lead)
    try:
        for_a_coordinator = create_join_token([f"127.0.0.1:{server.port}"], home=home, role="coordinator")
        with pytest.raises(TokenWrongRole, match="refused the token: this join token is for a coordinator, not a node"):
            await fetch_bundle(for_a_coordinator, name="x")
        again = create_join_token([f"127.0.0.1:{server.port}"], home=home, role="coordinator")
        with pytest.raises(NotLeader, match="no longer leads the set"):
            await join_set(again, name="c2", raft_port=52418, api_port=52415)
    finally:
        await server.close()


async def test_join_endpoint_refuses_expired_tokens_even_if_the_client_clock_disagrees(home: Path) -> None:
    server = await serve_join("127.0.0.1", 0, home=home)
    try:
        past = time.time() - 7200
        tok = create_join_token([f"127.0.0.1:{server.port}"], home=home, ttl_s=60, now=past)
        with pytest.raises(TokenExpired, match="expired"):
            await fetch_bundle(tok, name="x")  # refused here, before connecting
        lying = JoinToken(tok.addresses, tok.token_id, tok.secret, time.time() + 600, tok.fingerprint)
        with pytest.raises(TokenExpired, match="refused the token: this join token has expired"):
            await fetch_bundle(lying, name="x")
    finally:
        await server.close()


async def test_an_impostor_endpoint_never_sees_the_secret(home: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    # Another cluster (another home) serving the join endpoint: its certificate does not match.
    other = tmp_path / "other-home"
    other.mkdir(mode=0o700)
    impostor = await serve_join("127.0.0.1", 0, home=other)
    try:
        tok = create_join_token([f"127.0.0.1:{impostor.port}"], home=home)
        with pytest.raises(WrongCoordinator, match="not the coordinator's"):
            await fetch_bundle(tok, name="x")
        TokenStore(home / "join-tokens.json").validate(tok.token_id, tok.secret)  # still unused
        assert impostor.joined == []
    finally:
        await impostor.close()


async def test_unreachable_endpoint_says_what_to_check(home: Path) -> None:
    from tests.helpers.sshd import free_port

    tok = create_join_token([f"127.0.0.1:{free_port()}"], home=home)
    with pytest.raises(EndpointUnreachable, match="could not reach the coordinator's join endpoint"):
        await fetch_bundle(tok, name="x", timeout_s=2)


def test_join_cluster_writes_the_bundle_0600(home: Path, tmp_path: Path) -> None:
    import asyncio
    import threading

    ready = threading.Event()
    box: dict = {}

    def serve() -> None:
        async def main() -> None:
            server = await serve_join("127.0.0.1", 0, home=home)
            box["port"] = server.port
            box["stop"] = asyncio.Event()
            ready.set()
            await box["stop"].wait()
            await server.close()

        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    t = threading.Thread(target=serve)
    t.start()
    try:
        assert ready.wait(10)
        tok = create_join_token([f"127.0.0.1:{box['port']}"], home=home)
        out = join_cluster(tok.encode(), name="mini", key_file=tmp_path / "node" / "bundle")
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert Security.from_bundle_file(out).name == "mini"
        with pytest.raises(SecurityError, match="already used"):
            join_cluster(tok.encode(), name="mini", key_file=tmp_path / "again")
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(10)
