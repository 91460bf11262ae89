"""Slot cookies: a proof of the cluster key in a ClientHello's server name (exo_tui/net/slot.py)."""

from __future__ import annotations

import os
import ssl

from exo_tui.net.slot import PERIOD_S, SlotCookies, client_hello_server_name, slot_cookie


def _client_hello(server_name: str | None) -> bytes:
    """The first bytes Python's own TLS client sends (as exo-tui's client does)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def test_a_cookie_is_read_from_a_real_client_hello_and_counts_once() -> None:
    key = os.urandom(32)
    cookie = slot_cookie(key)
    hello = _client_hello(cookie)
    assert client_hello_server_name(hello) == cookie
    cookies = SlotCookies(key)
    assert cookies.proved(client_hello_server_name(hello))
    assert not cookies.proved(cookie)  # a copy replayed: once only


def test_forged_stale_and_malformed_cookies_prove_nothing() -> None:
    key = os.urandom(32)
    cookies = SlotCookies(key)
    assert not cookies.proved(slot_cookie(os.urandom(32)))  # another key
    now = 1_000_000.0
    assert not cookies.proved(slot_cookie(key, now - 2 * PERIOD_S), now)  # two minutes old
    assert cookies.proved(slot_cookie(key, now - PERIOD_S), now)  # a clock a minute behind
    cookie = slot_cookie(key)
    for bad in (None, "", "node.local", cookie[:-1], "y" + cookie[1:], "x" + "g" * 48, cookie[:-2] + "00"):
        assert not cookies.proved(bad), bad
    assert client_hello_server_name(_client_hello(None)) is None
    for junk in (b"", b"\x16\x03\x01\x00\x05\x01\x00", b"\x17" + hello_bytes()[1:], hello_bytes()[:40]):
        assert client_hello_server_name(junk) is None


def hello_bytes() -> bytes:
    return _client_hello("x" + "0" * 48)
