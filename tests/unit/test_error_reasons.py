"""Errors keep their reason and are told apart by type, not by the words of their message."""

from __future__ import annotations

import logging
import ssl
import sys
from pathlib import Path

import pytest

from exo_tui.net.security import ensure_cluster
from exo_tui.net.transport import is_tls_alert


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> tuple[ssl.SSLError | None, ssl.SSLError | None]:
    """A TLS handshake between the two contexts over memory buffers (real OpenSSL, no sockets):
    the error each side ended with (None: it finished)."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_side=False)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    errors: dict[str, ssl.SSLError | None] = {"c": None, "s": None}
    done = {"c": False, "s": False}
    for _ in range(20):
        for side, obj in (("c", c), ("s", s)):
            if done[side] or errors[side] is not None:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                errors[side] = exc
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done[k] or errors[k] is not None for k in done):
            break
    return errors["c"], errors["s"]


def test_a_tls_alert_is_told_by_its_reason_code(tmp_path: Path) -> None:
    """A client of another cluster refuses our server's certificate: it fails its own check (not
    an alert), and the server receives the client's alert (an alert)."""
    ours = ensure_cluster(tmp_path / "ours").security()
    theirs = ensure_cluster(tmp_path / "theirs").security()
    client_error, server_error = _handshake(theirs.client_context(), ours.server_context())
    assert isinstance(client_error, ssl.SSLCertVerificationError) and not is_tls_alert(client_error)
    assert server_error is not None and is_tls_alert(server_error), server_error
    assert _handshake(ours.client_context(), ours.server_context()) == (None, None)


def test_why_mlx_is_unavailable_is_kept_and_said(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from backends import _instances, get_backend
    from backends.base import BackendError
    from backends.mlx import MLXBackend

    monkeypatch.setitem(sys.modules, "mlx.core", None)  # import mlx.core raises ModuleNotFoundError
    monkeypatch.setitem(_instances, "mlx", MLXBackend())
    caplog.set_level(logging.INFO, logger="backends.mlx")
    with pytest.raises(BackendError, match=r"backend mlx is not available on this machine: ModuleNotFoundError: .*mlx\.core"):
        get_backend("mlx")
    assert "MLX is not available here: ModuleNotFoundError" in caplog.text


async def test_a_peer_that_fails_its_profile_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A peer of our cluster that does not answer ``profile`` is not listed, and the log says why."""
    from exo_tui.discovery.service import net_probe
    from exo_tui.discovery.static import Peer
    from exo_tui.net.dispatcher import Dispatcher
    from exo_tui.net.server import serve

    security = ensure_cluster(tmp_path / "home").security()
    server = await serve(Dispatcher(), "127.0.0.1", 0, security=security)  # knows no op: refuses "profile"
    try:
        caplog.set_level(logging.INFO, logger="exo_tui.discovery.service")
        assert await net_probe(security)(Peer("127.0.0.1", server.port), 5.0) is None
    finally:
        server.close()
        await server.wait_closed()
    assert f"peer 127.0.0.1:{server.port} is not listed: it did not answer a profile (UnknownFrameType" in caplog.text
