"""Fixtures for SSH bootstrap, mDNS and network-namespace tests (reusable from other tests).

- ``ssh_client_keys``: an authorized and a wrong client key pair (session).
- ``ssh_host``: a throwaway user with a real ``sshd`` on a loopback port (session).
- ``fresh_ssh_host``: the same, for one test (to break things in).
- ``sftpless_ssh_host``: a fresh one whose sshd has no SFTP subsystem.
- ``wheelhouse``: this project's dependencies as wheels, built once (``--wheelhouse``).
- ``exo_home``: an isolated ``EXO_TUI_HOME`` (the cluster CA and key live there).
- ``bootstrap_options``: BootstrapOptions for ``ssh_host`` (its known_hosts, keys; no agent).
- ``netns_hosts``: three network namespaces on a bridge, each with sshd (see tests/helpers/netns.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from tests.helpers import sshd as sshd_helpers
from tests.helpers.sshd import KeyPair, SshServer, ThrowawayUser


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The RPC tests run on both event loops a node may use (exo_tui.net.loop): asyncio's and
    uvloop. The rest run on asyncio's, as the TUI's coordinator does."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if item.module is not None and item.module.__name__.endswith("test_rpc"):
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


@dataclasses.dataclass
class SshHost:
    server: SshServer
    user: ThrowawayUser
    client: KeyPair
    wrong: KeyPair

    @property
    def target(self) -> str:
        return self.server.target

    def known_hosts(self, path: Path) -> Path:
        """A known_hosts file at ``path`` that holds this host's real key."""
        return self.server.write_known_hosts(path)

    def options(self, known_hosts: Path, **kw):  # noqa: ANN201
        from exo_tui.bootstrap import BootstrapOptions

        base = dict(
            known_hosts=known_hosts,
            client_keys=[self.client.private],
            agent_path=False,
            ssh_config=False,
            connect_timeout_s=5.0,
        )
        base.update(kw)
        return BootstrapOptions(**base)


@pytest.fixture(scope="session")
def ssh_client_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[KeyPair, KeyPair]:
    reason = sshd_helpers.skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("ssh-client")
    return KeyPair.generate(d / "id_ed25519"), KeyPair.generate(d / "wrong_ed25519", comment="wrong")


def _start_host(workdir: Path, keys: tuple[KeyPair, KeyPair], *, sftp: bool = True) -> SshHost:
    user = ThrowawayUser.create()
    try:
        server = SshServer.start(workdir, user, client_pubkeys=[keys[0].public_line], sftp=sftp)
    except BaseException:
        user.remove()
        raise
    return SshHost(server=server, user=user, client=keys[0], wrong=keys[1])


def _stop_host(host: SshHost) -> None:
    try:
        host.user.stop_processes()
    finally:
        host.server.stop()
        host.user.remove()


@pytest.fixture(scope="session")
def ssh_host(tmp_path_factory: pytest.TempPathFactory, ssh_client_keys: tuple[KeyPair, KeyPair]) -> Iterator[SshHost]:
    host = _start_host(tmp_path_factory.mktemp("sshd"), ssh_client_keys)
    yield host
    _stop_host(host)


@pytest.fixture
def fresh_ssh_host(tmp_path: Path, ssh_client_keys: tuple[KeyPair, KeyPair]) -> Iterator[SshHost]:
    host = _start_host(tmp_path / "sshd", ssh_client_keys)
    yield host
    _stop_host(host)


@pytest.fixture
def sftpless_ssh_host(tmp_path: Path, ssh_client_keys: tuple[KeyPair, KeyPair]) -> Iterator[SshHost]:
    """A fresh host whose sshd has no ``Subsystem sftp`` (SFTP refused, as on some minimal hosts)."""
    host = _start_host(tmp_path / "sshd", ssh_client_keys, sftp=False)
    yield host
    _stop_host(host)


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    from tests.helpers.wheelhouse import ensure_wheelhouse

    path, why = ensure_wheelhouse()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture
def exo_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "exo-home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("EXO_TUI_HOME", str(home))
    return home


# ---------------------------------------------------------------------- network namespaces


@dataclasses.dataclass
class NetnsNodes:
    """``netns_lab`` after bootstrap: a node agent in each namespace, all of one cluster."""

    lab: object  # tests.helpers.netns.NetnsLab
    home: Path  # the EXO_TUI_HOME of the cluster the nodes joined (coordinator side)
    results: list  # BootstrapResult per host, in lab.hosts order
    known_hosts: Path
    bootstrap_s: float

    def options(self, **kw):  # noqa: ANN201
        from exo_tui.bootstrap import BootstrapOptions

        base = dict(known_hosts=self.known_hosts, client_keys=[self._client.private], agent_path=False,
                    ssh_config=False, home=self.home, connect_timeout_s=5.0)
        base.update(kw)
        return BootstrapOptions(**base)

    _client: KeyPair = dataclasses.field(default=None, repr=False)  # type: ignore[assignment]


@pytest.fixture(scope="session")
def netns_lab(ssh_client_keys: tuple[KeyPair, KeyPair]) -> Iterator[object]:
    """Three namespaces (a, b, c) on a bridge, each with a throwaway user and sshd on port 22."""
    from tests.helpers import netns

    reason = netns.skip_reason()
    if reason:
        pytest.skip(reason)
    lab = netns.NetnsLab.create(3)
    try:
        lab.start_sshd([ssh_client_keys[0].public_line])
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="session")
def netns_nodes(netns_lab, ssh_client_keys, wheelhouse: Path) -> NetnsNodes:  # noqa: ANN001
    """Bootstrap a node agent (advertising over mDNS, port 52416) into each namespace."""
    import asyncio
    import time

    from exo_tui.bootstrap import BootstrapOptions, bootstrap

    home = netns_lab.workdir / "exo-home"
    home.mkdir(mode=0o700, exist_ok=True)
    kh = netns_lab.known_hosts(netns_lab.workdir / "known_hosts")

    async def all_hosts() -> list:
        return await asyncio.gather(*(
            bootstrap(h.ssh_target, BootstrapOptions(
                known_hosts=kh, client_keys=[ssh_client_keys[0].private], agent_path=False, ssh_config=False,
                home=home, wheelhouse=wheelhouse, node_name=f"lab-{h.label}", node_args=["--no-benchmark"],
                connect_timeout_s=5.0, handshake_timeout_s=120,
            ))
            for h in netns_lab.hosts
        ))

    t0 = time.monotonic()
    results = asyncio.run(all_hosts())
    nodes = NetnsNodes(lab=netns_lab, home=home, results=list(results), known_hosts=kh,
                       bootstrap_s=time.monotonic() - t0)
    nodes._client = ssh_client_keys[0]
    return nodes
