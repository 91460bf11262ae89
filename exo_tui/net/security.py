"""Cluster secrets: the cluster CA, node certificates, the cluster key, node bundles, TLS contexts.

Everything lives under the exo-tui home directory (:func:`home_dir`): ``$EXO_TUI_HOME`` if set,
else ``platformdirs.user_config_dir("exo-tui")`` (``~/.config/exo-tui`` on Linux). Directories are
mode 0700 and every secret file 0600. Loading a secret file that others can read is refused, as
ssh does.

The coordinator's side, made on first use by :func:`ensure_cluster`::

    <home>/cluster/ca.crt            the cluster CA certificate (EC P-256, self-signed)
    <home>/cluster/ca.key            its private key
    <home>/cluster/cluster.key       32 random bytes, hex: the key of the HMAC handshake
    <home>/cluster/coordinator.crt   the coordinator's own certificate, signed by the CA
    <home>/cluster/coordinator.key

A node gets one file, a *node bundle* (:func:`node_bundle` / :func:`write_node_bundle`, JSON):
the cluster key, the CA certificate and the node's certificate and key. Bootstrap copies it over
SSH; ``exo-tui node --key-file F`` reads it with :meth:`Security.from_bundle_file`.

Identity on the wire is the CA signature (mutual TLS 1.3, both sides verify against the cluster CA;
host names are not checked: nodes are found by address) plus the HMAC handshake of
:mod:`exo_tui.net.auth`, which is bound to both certificates.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import shutil
import ssl
import stat
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import platformdirs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLUSTER_KEY_BYTES = 32
BUNDLE_FORMAT = "exo-tui-node-bundle"
BUNDLE_VERSION = 1
CA_VALID_DAYS = 20 * 365
CERT_VALID_DAYS = 10 * 365
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


class SecurityError(Exception):
    """Missing, unreadable, badly protected or inconsistent key material."""


# ------------------------------------------------------------------ files and directories


def home_dir(create: bool = True) -> Path:
    """The exo-tui home: ``$EXO_TUI_HOME`` or the platform's user config dir for ``exo-tui``."""
    env = os.environ.get("EXO_TUI_HOME")
    home = Path(env).expanduser() if env else Path(platformdirs.user_config_dir("exo-tui"))
    if create and not home.exists():
        home.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(home, 0o700)
    return home


def cluster_dir(home: Path | None = None) -> Path:
    return (home or home_dir()) / "cluster"


def default_bundle_path(home: Path | None = None) -> Path:
    """Where a node keeps its bundle when ``--key-file`` is not given."""
    return (home or home_dir()) / "node.bundle"


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (the parent must exist)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_secret(path: Path) -> bytes:
    """Read a secret file, refusing one that group or others can access."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SecurityError(f"{path} does not exist") from None
    if st.st_mode & 0o077:
        raise SecurityError(
            f"{path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"run `chmod 600 {path}` (and make sure nobody else copied it)"
        )
    return path.read_bytes()


# ------------------------------------------------------------------ keys and certificates


def generate_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _make_ca(name: str = "exo-tui cluster CA") -> tuple[bytes, bytes]:
    key = generate_private_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    name: str,
    *,
    public_key_pem: bytes | None = None,
    valid_days: int = CERT_VALID_DAYS,
) -> tuple[bytes, bytes | None]:
    """Issue a certificate for ``name`` signed by the CA; returns ``(cert_pem, key_pem)``.

    A new P-256 key is made unless ``public_key_pem`` is given (a node that keeps its own private
    key sends only the public one); then ``key_pem`` is ``None``. The certificate is good for both
    TLS server and client use, since nodes are both.
    """
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise SecurityError(f"the cluster CA key is a {type(ca_key).__name__}, not an EC key: make the cluster again")
    public_key: CertificatePublicKeyTypes
    key_pem: bytes | None
    if public_key_pem is None:
        key = generate_private_key()
        public_key, key_pem = key.public_key(), _key_pem(key)
    else:
        loaded = serialization.load_pem_public_key(public_key_pem)
        if not isinstance(loaded, ec.EllipticCurvePublicKey):
            raise SecurityError(f"a node's public key must be an EC key, not a {type(loaded).__name__}")
        public_key, key_pem = loaded, None
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64] or "node")]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def cert_fingerprint(cert: bytes) -> bytes:
    """SHA-256 of a certificate's DER encoding (PEM is accepted and converted)."""
    if cert.lstrip().startswith(b"-----BEGIN"):
        cert = x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(cert).digest()


def cert_name(cert_pem: bytes) -> str:
    """The common name of a certificate (the node name it was issued for)."""
    c = x509.load_pem_x509_certificate(cert_pem)
    attrs = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _check_pair(ca_cert_pem: bytes, cert_pem: bytes, key_pem: bytes, where: str) -> None:
    """Check the certificate is signed by the CA and matches the private key."""
    try:
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as e:
        raise SecurityError(f"{where}: unreadable certificate or key ({e})") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as e:  # InvalidSignature has no common base
        raise SecurityError(
            f"{where}: the certificate was not issued by this cluster's CA ({type(e).__name__}): "
            "issue a new one with the coordinator (bootstrap the node again)"
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise SecurityError(f"{where}: the private key does not belong to the certificate")


# ------------------------------------------------------------------ the cluster (coordinator side)


@dataclass(frozen=True)
class Cluster:
    """The coordinator's secrets: CA, cluster key and its own certificate."""

    dir: Path
    cluster_key: bytes = field(repr=False)  # secrets never show in reprs, logs or tracebacks
    ca_cert_pem: bytes = field(repr=False)
    ca_key_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)

    def issue_node_cert(
        self, name: str, *, public_key_pem: bytes | None = None, valid_days: int = CERT_VALID_DAYS
    ) -> tuple[bytes, bytes | None]:
        """A certificate for node ``name`` signed by the cluster CA: ``(cert_pem, key_pem)``."""
        return issue_cert(
            self.ca_cert_pem, self.ca_key_pem, name, public_key_pem=public_key_pem, valid_days=valid_days
        )

    def node_bundle(self, name: str) -> bytes:
        """A new node bundle for ``name`` (fresh key and certificate), as bytes to write 0600."""
        cert_pem, key_pem = self.issue_node_cert(name)
        assert key_pem is not None
        return make_bundle(self.cluster_key, self.ca_cert_pem, cert_pem, key_pem, name=name)

    def security(self, *, enable_tls: bool = True, **kw: Any) -> Security:
        """The coordinator's :class:`Security` for :func:`exo_tui.net.client.connect` / ``serve``."""
        return Security(
            cluster_key=self.cluster_key, ca_cert_pem=self.ca_cert_pem, cert_pem=self.cert_pem,
            key_pem=self.key_pem, enable_tls=enable_tls, name="coordinator", **kw,
        )


_FILES = ("ca.crt", "ca.key", "cluster.key", "coordinator.crt", "coordinator.key")
_create_lock = threading.Lock()


def ensure_cluster(home: Path | None = None) -> Cluster:
    """Load the cluster secrets, creating them on first use (CA, cluster key, coordinator cert).

    Creation is atomic (made in a temporary directory, then renamed), so two processes starting at
    once end up with the same cluster.
    """
    home = Path(home) if home is not None else home_dir()
    home.mkdir(parents=True, mode=0o700, exist_ok=True)
    d = cluster_dir(home)
    with _create_lock:
        if not d.exists():
            tmp = Path(tempfile.mkdtemp(dir=home, prefix=".cluster-"))  # mode 0700
            try:
                ca_cert, ca_key = _make_ca()
                cert, key = issue_cert(ca_cert, ca_key, "coordinator")
                assert key is not None
                write_secret(tmp / "ca.crt", ca_cert)
                write_secret(tmp / "ca.key", ca_key)
                write_secret(tmp / "cluster.key", secrets.token_bytes(CLUSTER_KEY_BYTES).hex().encode() + b"\n")
                write_secret(tmp / "coordinator.crt", cert)
                write_secret(tmp / "coordinator.key", key)
                try:
                    os.rename(tmp, d)
                except OSError:
                    if not d.exists():
                        raise
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return load_cluster(home)


def install_cluster(home: Path, files: dict[str, bytes]) -> Cluster:
    """Install a set's cluster secrets (a coordinator joining with a token): written 0600 where
    there are none yet; where there are, they must be the same (else this home belongs to another
    cluster: a SecurityError that says so)."""
    home = Path(home)
    home.mkdir(parents=True, mode=0o700, exist_ok=True)
    d = cluster_dir(home)
    if d.exists():
        if any(not (d / f).exists() or read_secret(d / f) != files.get(f) for f in _FILES):
            raise SecurityError(f"{d} holds another cluster's secrets: move it away to join this one "
                                "(its nodes then need new bundles), or use another EXO_TUI_HOME")
        return load_cluster(home)
    tmp = Path(tempfile.mkdtemp(dir=home, prefix=".cluster-"))
    try:
        for f in _FILES:
            write_secret(tmp / f, files[f])
        os.rename(tmp, d)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return load_cluster(home)


def load_cluster(home: Path | None = None) -> Cluster:
    """Load existing cluster secrets (see :func:`ensure_cluster` to create them)."""
    d = cluster_dir(Path(home) if home is not None else None)
    if d.stat().st_mode & 0o077:
        raise SecurityError(f"{d} is accessible by other users: run `chmod 700 {d}`")
    missing = [f for f in _FILES if not (d / f).exists()]
    if missing:
        raise SecurityError(
            f"{d} lacks {', '.join(missing)}: restore it from a backup, or move the directory away "
            "to make a new cluster (every node then needs a new bundle)"
        )
    data = {f: read_secret(d / f) for f in _FILES}
    key = _parse_cluster_key(data["cluster.key"], d / "cluster.key")
    _check_pair(data["ca.crt"], data["coordinator.crt"], data["coordinator.key"], str(d))
    return Cluster(d, key, data["ca.crt"], data["ca.key"], data["coordinator.crt"], data["coordinator.key"])


def _parse_cluster_key(text: bytes | str, where: object) -> bytes:
    try:
        key = bytes.fromhex(text.decode() if isinstance(text, bytes) else text)
    except (ValueError, UnicodeDecodeError):
        raise SecurityError(f"{where}: the cluster key is not hex") from None
    if len(key) != CLUSTER_KEY_BYTES:
        raise SecurityError(f"{where}: the cluster key has {len(key)} bytes, expected {CLUSTER_KEY_BYTES}")
    return key


# ------------------------------------------------------------------ node bundles


def make_bundle(cluster_key: bytes, ca_cert_pem: bytes, cert_pem: bytes, key_pem: bytes, *, name: str = "") -> bytes:
    """Serialise a node bundle (JSON text; it holds secrets: store it 0600)."""
    doc = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "name": name or cert_name(cert_pem),
        "cluster_key": cluster_key.hex(),
        "ca_cert": ca_cert_pem.decode(),
        "cert": cert_pem.decode(),
        "key": key_pem.decode(),
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def write_node_bundle(path: Path, bundle: bytes) -> Path:
    """Write a bundle 0600 (its directory is created 0700 if missing)."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    write_secret(path, bundle)
    return path


def parse_bundle(data: bytes, where: object = "node bundle") -> dict[str, Any]:
    """Parse and check a bundle; returns its fields with bytes values for keys and certificates."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise SecurityError(f"{where} is not an exo-tui node bundle (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("format") != BUNDLE_FORMAT:
        raise SecurityError(f"{where} is not an exo-tui node bundle")
    if doc.get("version") != BUNDLE_VERSION:
        raise SecurityError(
            f"{where} is a version {doc.get('version')!r} bundle, this exo-tui reads version {BUNDLE_VERSION}: "
            "upgrade exo-tui here or bootstrap the node again"
        )
    try:
        out = {
            "name": str(doc.get("name", "")),
            "cluster_key": _parse_cluster_key(doc["cluster_key"], where),
            "ca_cert_pem": doc["ca_cert"].encode(),
            "cert_pem": doc["cert"].encode(),
            "key_pem": doc["key"].encode(),
        }
    except (KeyError, AttributeError):
        raise SecurityError(f"{where} lacks a field (cluster_key, ca_cert, cert, key)") from None
    _check_pair(out["ca_cert_pem"], out["cert_pem"], out["key_pem"], str(where))
    return out


# ------------------------------------------------------------------ what the RPC layer uses


@dataclass(frozen=True)
class Security:
    """Key material and settings of one endpoint; pass it to ``serve`` and ``connect``.

    ``enable_tls=False`` (``network.security.enable_tls: false``) exists only to measure what TLS
    costs: frames travel in clear, but the HMAC handshake still runs (without channel binding).
    """

    cluster_key: bytes = field(repr=False)  # secrets never show in reprs, logs or tracebacks
    ca_cert_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    enable_tls: bool = True
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    name: str = ""
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.enable_tls and not (self.ca_cert_pem and self.cert_pem and self.key_pem):
            raise SecurityError("TLS needs the cluster CA certificate and this side's certificate and key")

    @classmethod
    def coordinator(cls, home: Path | None = None, *, enable_tls: bool = True, **kw: Any) -> Security:
        """The coordinator's security, creating the cluster on first use."""
        return ensure_cluster(home).security(enable_tls=enable_tls, **kw)

    @classmethod
    def from_bundle(cls, data: bytes, *, enable_tls: bool = True, where: object = "node bundle", **kw: Any) -> Security:
        b = parse_bundle(data, where)
        return cls(
            cluster_key=b["cluster_key"], ca_cert_pem=b["ca_cert_pem"], cert_pem=b["cert_pem"],
            key_pem=b["key_pem"], enable_tls=enable_tls, name=b["name"], **kw,
        )

    @classmethod
    def from_bundle_file(cls, path: Path | None = None, *, enable_tls: bool = True, **kw: Any) -> Security:
        """A node's security from its bundle file (default: :func:`default_bundle_path`)."""
        path = Path(path) if path is not None else default_bundle_path()
        if not path.exists():
            raise SecurityError(
                f"no node bundle at {path}: bootstrap this node from the coordinator "
                "(it copies the bundle over SSH) or pass --key-file"
            )
        return cls.from_bundle(read_secret(path), enable_tls=enable_tls, where=path, **kw)

    def replace(self, **changes: Any) -> Security:
        """A copy with some fields changed (e.g. ``enable_tls=False``)."""
        return replace(self, **changes)

    @property
    def fingerprint(self) -> bytes:
        """SHA-256 of this side's certificate (empty without one)."""
        fp: bytes | None = self._cache.get("fp")
        if fp is None:
            fp = cert_fingerprint(self.cert_pem) if self.cert_pem else b""
            self._cache["fp"] = fp
        return fp

    def server_context(self) -> ssl.SSLContext:
        return self._context(server=True)

    def client_context(self) -> ssl.SSLContext:
        return self._context(server=False)

    def _context(self, *, server: bool) -> ssl.SSLContext:
        key = "server" if server else "client"
        ctx: ssl.SSLContext | None = self._cache.get(key)
        if ctx is not None:
            return ctx
        if not (self.ca_cert_pem and self.cert_pem and self.key_pem):
            raise SecurityError("TLS needs the cluster CA certificate and this side's certificate and key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # identity: the CA signature and the HMAC handshake, not names
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=self.ca_cert_pem.decode())
        load_chain(ctx, self.cert_pem, self.key_pem)
        self._cache[key] = ctx
        return ctx


def load_chain(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes, home: Path | None = None) -> None:
    """``load_cert_chain`` reads files only: write a private temporary file (0600, in the 0700
    exo-tui home, ``home`` or :func:`home_dir`, rather than a shared /tmp), load it, remove it."""
    try:
        where: Path | None = Path(home) if home is not None else home_dir()
    except OSError:
        where = None
    fd, tmp = tempfile.mkstemp(prefix=".exo-tui-tls-", suffix=".pem", dir=where)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem.rstrip() + b"\n" + key_pem)
        ctx.load_cert_chain(tmp)
    finally:
        os.unlink(tmp)
