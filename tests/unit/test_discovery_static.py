"""Static discovery sources: peers, ~/.ssh/config, tailscale status, bootstrap targets, TXT records."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from exo_tui.bootstrap.install import RemoteHost, _parse_detect, choose_python
from exo_tui.bootstrap.ssh import BootstrapError, Target, parse_target
from exo_tui.discovery import (
    NodeAdvertisement,
    Peer,
    parse_peer,
    parse_ssh_config,
    parse_tailscale_status,
    ssh_config_hosts,
    static_peers,
    tailscale_hosts,
)
from exo_tui.net.address import bracketed, host_port, split_host_port


def test_peer_forms() -> None:
    assert parse_peer("10.0.0.5") == Peer("10.0.0.5", 52416, "peer")
    assert parse_peer("mini.local:6000", source="config") == Peer("mini.local", 6000, "config")
    assert parse_peer("[fe80::1]:7000") == Peer("fe80::1", 7000, "peer")
    assert parse_peer("fe80::1") == Peer("fe80::1", 52416, "peer")
    for bad in ("", "host:0", "host:99999", "host:abc", "[::1", "[::1]x"):
        with pytest.raises(ValueError):
            parse_peer(bad)


def test_an_address_is_written_as_it_is_read() -> None:
    """host:port, [v6]:port: what host_port writes, split_host_port reads back, and a peer's key is it."""
    for host, port in (("10.0.0.5", 52416), ("mini.local", 6000), ("fe80::1", 7000), ("::1", 1)):
        assert split_host_port(host_port(host, port), 0) == (host, port)
    assert host_port("fe80::1", 7000) == "[fe80::1]:7000" and bracketed("::1") == "[::1]" and bracketed("pi") == "pi"
    assert parse_peer("[fe80::1]:7000").key == "[fe80::1]:7000"


def test_static_peers_merge_cli_env_config_without_duplicates() -> None:
    peers = static_peers(
        known_peers=["a:1", "b:2"],
        cli_peers=["c", "a:1"],
        environ={"EXO_TUI_KNOWN_PEERS": "b:2, d:4"},
    )
    assert [(p.key, p.source) for p in peers] == [
        ("c:52416", "peer"),
        ("a:1", "peer"),
        ("b:2", "env"),
        ("d:4", "env"),
    ]


SSH_CONFIG = """
# comment
Host *
    User defaultuser
    ServerAliveInterval 30

Host mini studio
    HostName %h.lan
    Port 2222

Host pi
    HostName=192.168.1.50
    User = pi

Host *.example.com !bad.example.com
    User web

Host gpu-? bastion*
    User nobody

Match host mini exec "true"
    User matched

Host "quoted host"
    HostName 10.1.2.3
"""


def test_ssh_config_hosts_skip_patterns_and_resolve_like_ssh() -> None:
    hosts = {h.alias: h for h in parse_ssh_config(SSH_CONFIG)}
    assert set(hosts) == {"mini", "studio", "pi", "quoted host"}
    assert (hosts["mini"].hostname, hosts["mini"].port, hosts["mini"].user) == ("mini.lan", 2222, "defaultuser")
    assert (hosts["studio"].hostname, hosts["studio"].port) == ("studio.lan", 2222)
    # "Host *" came first, so its User wins, as in ssh (first value obtained is used).
    assert (hosts["pi"].hostname, hosts["pi"].port, hosts["pi"].user) == ("192.168.1.50", 22, "defaultuser")
    assert hosts["quoted host"].hostname == "10.1.2.3"
    assert all(h.source == "ssh_config" for h in hosts.values())


def test_ssh_config_include_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "lab.conf").write_text("Host lab1\n  HostName 10.9.9.9\n  User lab\n")
    (tmp_path / "config").write_text("Include conf.d/*.conf\nHost top\n  Port 2200\n")
    hosts = {h.alias: h for h in ssh_config_hosts(tmp_path / "config")}
    assert hosts["lab1"].hostname == "10.9.9.9" and hosts["lab1"].user == "lab"
    assert hosts["top"].port == 2200
    assert ssh_config_hosts(tmp_path / "missing") == []


TAILSCALE = {
    "BackendState": "Running",
    "Self": {"HostName": "me", "TailscaleIPs": ["100.64.0.1"], "Online": True},
    "Peer": {
        "nodekey:a": {"HostName": "mac-mini", "DNSName": "mac-mini.tail1234.ts.net.", "TailscaleIPs": ["fd7a::5", "100.64.0.5"], "Online": True},
        "nodekey:b": {"HostName": "old-laptop", "DNSName": "old-laptop.tail1234.ts.net.", "TailscaleIPs": ["100.64.0.6"], "Online": False},
        "nodekey:c": {"HostName": "noip", "TailscaleIPs": [], "Online": True},
    },
}


def test_tailscale_status_lists_online_peers_only_when_logged_in() -> None:
    hosts = parse_tailscale_status(TAILSCALE)
    assert [(h.alias, h.hostname, h.name, h.source) for h in hosts] == [
        ("mac-mini.tail1234.ts.net", "100.64.0.5", "mac-mini", "tailscale")
    ]
    assert parse_tailscale_status({**TAILSCALE, "BackendState": "NeedsLogin"}) == []


async def test_tailscale_command_is_run_when_installed(tmp_path: Path) -> None:
    fake = tmp_path / "tailscale"
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'status --json' ] || exit 3\ncat <<'EOF'\n{json.dumps(TAILSCALE)}\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    hosts = await tailscale_hosts(command=str(fake))
    assert [h.hostname for h in hosts] == ["100.64.0.5"]
    assert await tailscale_hosts(command=str(tmp_path / "not-installed")) == []
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'not logged in' >&2\nexit 1\n")
    failing.chmod(0o755)
    assert await tailscale_hosts(command=str(failing)) == []


def test_txt_record_round_trip_holds_no_secret() -> None:
    ad = NodeAdvertisement(node_id="n-1", name="mini", port=52416, version="0.1.0", backends=("mlx", "onnx"),
                           memory_bytes=16 << 30, cluster="ab12")
    txt = ad.txt()
    assert set(txt) == {"id", "name", "version", "port", "backends", "memory", "cluster"}
    raw = {k.encode(): v.encode() for k, v in txt.items()}
    back = NodeAdvertisement.from_txt(raw, port=1, addresses=("10.0.0.2",), instance="x")
    assert back is not None
    assert (back.node_id, back.backends, back.memory_bytes, back.port, back.addresses) == (
        "n-1", ("mlx", "onnx"), 16 << 30, 52416, ("10.0.0.2",)
    )
    assert NodeAdvertisement.from_txt({b"name": b"x"}, port=1) is None
    assert NodeAdvertisement.from_txt({b"id": b"n", b"memory": b"lots"}, port=1) is None


def test_bootstrap_targets() -> None:
    assert parse_target("mini") == Target("mini", None, None)
    assert parse_target("pi@10.0.0.5:2222") == Target("10.0.0.5", 2222, "pi")
    assert parse_target("me@[fe80::1]:22") == Target("fe80::1", 22, "me")
    assert str(parse_target("me@[fe80::1]:22")) == "me@[fe80::1]:22"
    for bad in ("@host", "host:0", ""):
        with pytest.raises(ValueError):
            parse_target(bad)


DETECT_MAC = """os=Darwin
arch=arm64
home=/Users/ana
data=/Users/ana/.local/share/exo-tui
hostname=studio
python=/usr/bin/python3 3.9.6 1
python=/opt/homebrew/bin/python3.12 3.12.4 1
free_kb=50000000
"""


def test_detection_picks_a_new_enough_python_and_sees_apple_silicon() -> None:
    h = _parse_detect(DETECT_MAC)
    assert h.apple_silicon and h.free_bytes == 50_000_000 * 1024
    choose_python(h, None)
    assert h.python == "/opt/homebrew/bin/python3.12"
    assert _parse_detect(DETECT_MAC.replace("arm64", "x86_64") + "translated=1\n").apple_silicon
    assert not _parse_detect(DETECT_MAC.replace("arm64", "x86_64").replace("Darwin", "Linux")).apple_silicon


def test_detection_failures_say_what_to_install() -> None:
    old = _parse_detect("os=Linux\nhostname=pi\npython=/usr/bin/python3 3.9.2 1\n")
    with pytest.raises(BootstrapError) as info:
        choose_python(old, None)
    assert info.value.step == "detect" and "apt install python3.11" in str(info.value) and "3.9.2" in str(info.value)
    novenv = _parse_detect("os=Linux\nhostname=pi\npython=/usr/bin/python3.11 3.11.2 0\n")
    with pytest.raises(BootstrapError) as info:
        choose_python(novenv, None)
    assert "python3.11-venv" in str(info.value)
    with pytest.raises(BootstrapError, match="is Python 3.9.2"):
        choose_python(old, "/usr/bin/python3")
    assert isinstance(RemoteHost(), RemoteHost)


def test_source_wheel_is_cached_per_source_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exo_tui.bootstrap import wheel

    root = wheel.source_root()
    if root is None:
        pytest.skip("not running from a source checkout")
    h1 = wheel.source_hash(root)
    assert h1 == wheel.source_hash(root)
    assert len(h1) == 16 and os.path.isdir(root / "exo_tui")


def test_ssh_and_netns_tests_say_why_they_skip_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import netns, sshd

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (sshd.skip_reason() or "")
    assert "root" in (netns.skip_reason() or "")


def test_node_command_and_systemd_unit_quote_their_arguments() -> None:
    import shlex

    from exo_tui.bootstrap.install import BootstrapOptions, _node_argv, _unit_text

    h = _parse_detect("os=Linux\nhome=/home/a b\ndata=/home/a b/.local/share/exo-tui\nhostname=pi\n")
    argv = _node_argv(h, "pi 4", f"{h.data_dir}/node.bundle",
                      BootstrapOptions(node_port=6000, backend="onnx", memory_limit_gb=2.5, advertise=False))
    assert argv[:2] == ["/home/a b/.local/share/exo-tui/venv/bin/exo-tui", "node"]
    assert argv[argv.index("--name") + 1] == "pi 4" and argv[argv.index("--port") + 1] == "6000"
    assert ["--backend", "onnx"] == argv[argv.index("--backend"):argv.index("--backend") + 2]
    assert "--no-advertise" in argv and "--memory-limit" in argv
    unit = _unit_text(argv, h)
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert shlex.split(exec_line[len("ExecStart="):]) == argv
    assert "Restart=on-failure" in unit and "WantedBy=default.target" in unit


def test_bootstrap_passes_precision_and_threads_to_the_node() -> None:
    from exo_tui import cli
    from exo_tui.commands.bootstrap import node_settings

    args = cli.build_parser().parse_args(["bootstrap", "pi@10.0.0.7", "--precision", "int8", "--threads", "3"])
    assert node_settings(args) == ["--precision", "int8", "--threads", "3"]
    assert node_settings(cli.build_parser().parse_args(["bootstrap", "pi@10.0.0.7"])) == []
    with pytest.raises(SystemExit):  # refused here, not by the node started over there
        cli.build_parser().parse_args(["bootstrap", "pi@10.0.0.7", "--threads", "0"])
