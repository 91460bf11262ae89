"""Cluster secrets on disk, certificates, node bundles, TLS contexts and the handshake MAC."""

from __future__ import annotations

import os
import ssl
import stat
import threading
from pathlib import Path

import platformdirs
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from exo_tui.net import auth
from exo_tui.net.security import (
    Security,
    SecurityError,
    cert_fingerprint,
    cert_name,
    default_bundle_path,
    ensure_cluster,
    generate_private_key,
    home_dir,
    load_cluster,
    make_bundle,
    parse_bundle,
    read_secret,
    write_node_bundle,
)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "exo-home"
    monkeypatch.setenv("EXO_TUI_HOME", str(h))
    return h


def test_home_dir_is_env_or_platform_config_dir(home: Path, monkeypatch: pytest.MonkeyPatch):
    assert home_dir() == home and mode(home) == 0o700
    monkeypatch.delenv("EXO_TUI_HOME")
    assert home_dir(create=False) == Path(platformdirs.user_config_dir("exo-tui"))


def test_cluster_is_created_on_first_use_with_private_modes(home: Path):
    c = ensure_cluster()
    assert c.dir == home / "cluster"
    assert mode(home) == 0o700 and mode(c.dir) == 0o700
    files = sorted(p.name for p in c.dir.iterdir())
    assert files == ["ca.crt", "ca.key", "cluster.key", "coordinator.crt", "coordinator.key"]
    assert all(mode(c.dir / f) == 0o600 for f in files)
    assert len(c.cluster_key) == 32
    ca = x509.load_pem_x509_certificate(c.ca_cert_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    x509.load_pem_x509_certificate(c.cert_pem).verify_directly_issued_by(ca)
    # second use loads the same cluster
    again = ensure_cluster()
    assert again.cluster_key == c.cluster_key and again.ca_cert_pem == c.ca_cert_pem


def test_concurrent_first_use_makes_one_cluster(home: Path):
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(ensure_cluster().cluster_key)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys) == 4
    assert [p.name for p in home.iterdir()] == ["cluster"]  # no temporary directory left behind


def test_secret_readable_by_others_is_refused(home: Path):
    c = ensure_cluster()
    os.chmod(c.dir / "cluster.key", 0o644)
    with pytest.raises(SecurityError, match=r"accessible by other users \(mode 0644\): run `chmod 600"):
        load_cluster()
    os.chmod(c.dir / "cluster.key", 0o600)
    assert load_cluster().cluster_key == c.cluster_key


def test_missing_or_bad_cluster_files_are_reported(home: Path):
    c = ensure_cluster()
    (c.dir / "ca.key").unlink()
    with pytest.raises(SecurityError, match="lacks ca.key"):
        load_cluster()


def test_node_bundle_round_trip(home: Path, tmp_path: Path):
    c = ensure_cluster()
    path = write_node_bundle(tmp_path / "nodes" / "n1.bundle", c.node_bundle("pi-4"))
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    sec = Security.from_bundle_file(path)
    assert sec.cluster_key == c.cluster_key and sec.ca_cert_pem == c.ca_cert_pem and sec.name == "pi-4"
    assert cert_name(sec.cert_pem) == "pi-4"
    ca = x509.load_pem_x509_certificate(c.ca_cert_pem)
    x509.load_pem_x509_certificate(sec.cert_pem).verify_directly_issued_by(ca)
    assert sec.fingerprint == cert_fingerprint(sec.cert_pem) and len(sec.fingerprint) == 32
    # default location
    write_node_bundle(default_bundle_path(), c.node_bundle("me"))
    assert Security.from_bundle_file().name == "me"


def test_bundle_errors_say_what_to_do(home: Path, tmp_path: Path):
    with pytest.raises(SecurityError, match="no node bundle at .*bootstrap this node"):
        Security.from_bundle_file(tmp_path / "none")
    with pytest.raises(SecurityError, match="not an exo-tui node bundle"):
        parse_bundle(b"hello")
    c = ensure_cluster()
    loose = tmp_path / "loose.bundle"
    loose.write_bytes(c.node_bundle("n"))
    os.chmod(loose, 0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        Security.from_bundle_file(loose)
    # a certificate of another cluster with this cluster's CA: refused
    other = ensure_cluster(tmp_path / "other-home")
    cert, key = other.issue_node_cert("intruder")
    with pytest.raises(SecurityError, match="not issued by this cluster's CA"):
        parse_bundle(make_bundle(c.cluster_key, c.ca_cert_pem, cert, key))
    # a key that does not belong to the certificate
    cert2, _ = c.issue_node_cert("n2")
    _, key3 = c.issue_node_cert("n3")
    with pytest.raises(SecurityError, match="does not belong"):
        parse_bundle(make_bundle(c.cluster_key, c.ca_cert_pem, cert2, key3))


def test_issue_cert_for_a_public_key_kept_by_the_node(home: Path):
    c = ensure_cluster()
    key = generate_private_key()
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    cert, key_pem = c.issue_node_cert("laptop", public_key_pem=pub)
    assert key_pem is None
    assert x509.load_pem_x509_certificate(cert).public_key().public_numbers() == key.public_key().public_numbers()


def test_issue_cert_refuses_a_public_key_that_is_not_ec(home: Path):
    c = ensure_cluster()
    pub = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(SecurityError, match="must be an EC key, not a .*Ed25519"):
        c.issue_node_cert("laptop", public_key_pem=pub)


def test_tls_contexts_are_tls13_mutual_without_hostname_checks(home: Path):
    sec = Security.coordinator()
    for ctx in (sec.server_context(), sec.client_context()):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert not ctx.check_hostname
    assert sec.server_context() is sec.server_context()  # built once
    assert sec.replace(enable_tls=False).enable_tls is False
    with pytest.raises(SecurityError, match="TLS needs"):
        Security(cluster_key=bytes(32))
    assert Security(cluster_key=bytes(32), enable_tls=False).fingerprint == b""
    # the private key went through a temporary file in the home to load_cert_chain; it is gone
    assert sorted(p.name for p in home.iterdir()) == ["cluster"]


def test_read_secret_needs_an_existing_file(tmp_path: Path):
    with pytest.raises(SecurityError, match="does not exist"):
        read_secret(tmp_path / "x")


def test_handshake_macs_bind_role_nonces_version_and_certificates():
    key, nc, ns, fs, fc = bytes(range(32)), b"c" * 32, b"s" * 32, b"S" * 32, b"C" * 32
    base = auth.mac(key, "client", 1, nc, ns, fs, fc)
    assert len(base) == 32 and base == auth.mac(key, "client", 1, nc, ns, fs, fc)
    variants = [
        auth.mac(key, "server", 1, nc, ns, fs, fc),
        auth.mac(key, "client", 2, nc, ns, fs, fc),
        auth.mac(key, "client", 1, b"x" * 32, ns, fs, fc),
        auth.mac(key, "client", 1, nc, b"x" * 32, fs, fc),
        auth.mac(key, "client", 1, nc, ns, b"x" * 32, fc),
        auth.mac(key, "client", 1, nc, ns, fs, b"x" * 32),
        auth.mac(bytes(32), "client", 1, nc, ns, fs, fc),
        auth.mac(key, "client", 1, nc, ns, fc, fs),  # swapped certificates
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_secrets_never_show_in_reprs(home: Path):
    c = ensure_cluster()
    sec = c.security()
    for obj in (c, sec, Security.from_bundle(c.node_bundle("n"))):
        text = repr(obj)
        assert c.cluster_key.hex() not in text and repr(c.cluster_key) not in text
        assert "PRIVATE KEY" not in text
    assert "enable_tls=True" in repr(sec) and "coordinator" in repr(sec)
