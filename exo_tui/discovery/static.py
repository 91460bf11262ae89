"""Hosts and peers we know without mDNS: static peers, ``~/.ssh/config`` and tailscale.

All parsing here is plain functions over text so it can be tested without a network.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from exo_tui.discovery.mdns import DEFAULT_NODE_PORT
from exo_tui.net.address import host_port, split_host_port

ENV_KNOWN_PEERS = "EXO_TUI_KNOWN_PEERS"


@dataclass(frozen=True)
class Peer:
    """A node agent address given by the operator (config, env, ``--peer``) or by tailscale."""

    host: str
    port: int = DEFAULT_NODE_PORT
    source: str = "config"  # config | env | peer | tailscale

    @property
    def key(self) -> str:
        return host_port(self.host, self.port)


@dataclass(frozen=True)
class CandidateHost:
    """A host that could be bootstrapped over SSH."""

    alias: str  # what to pass to ``exo-tui bootstrap`` (an ssh_config alias, a name or an address)
    hostname: str  # where it resolves to
    port: int = 22
    user: str = ""
    source: str = "ssh_config"  # ssh_config | tailscale | mdns | config
    name: str = ""  # a display name

    @property
    def key(self) -> tuple[str, int]:
        return (self.alias, self.port)


def parse_peer(text: str, *, source: str = "peer", default_port: int = DEFAULT_NODE_PORT) -> Peer:
    host, port = split_host_port(text, default_port)
    return Peer(host=host, port=port, source=source)


def parse_peer_list(text: str, *, source: str, default_port: int = DEFAULT_NODE_PORT) -> list[Peer]:
    """Comma- or whitespace-separated peers (the ``EXO_TUI_KNOWN_PEERS`` form)."""
    items = [p for p in text.replace(",", " ").split() if p]
    return [parse_peer(p, source=source, default_port=default_port) for p in items]


def static_peers(
    *,
    known_peers: Iterable[str] = (),
    cli_peers: Iterable[str] = (),
    environ: dict[str, str] | None = None,
    default_port: int = DEFAULT_NODE_PORT,
) -> list[Peer]:
    """Peers from the config file, ``EXO_TUI_KNOWN_PEERS`` and ``--peer``, first source wins."""
    env = os.environ if environ is None else environ
    peers: dict[str, Peer] = {}
    groups = [
        [parse_peer(p, source="peer", default_port=default_port) for p in cli_peers],
        parse_peer_list(env.get(ENV_KNOWN_PEERS, ""), source="env", default_port=default_port),
        [parse_peer(p, source="config", default_port=default_port) for p in known_peers],
    ]
    for group in groups:
        for p in group:
            peers.setdefault(p.key, p)
    return list(peers.values())


# ---------------------------------------------------------------------- ~/.ssh/config


def _ssh_tokens(line: str) -> tuple[str, list[str]] | None:
    """``Keyword args`` or ``Keyword=args`` → (keyword lower-cased, args with quotes honoured)."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = re.match(r"([^\s=]+)\s*=?\s*(.*)$", line)
    if m is None:
        return None
    key, rest = m.group(1), m.group(2)
    values: list[str] = []
    cur, quoted = "", False
    for ch in rest.strip():
        if ch == '"':
            quoted = not quoted
        elif ch.isspace() and not quoted:
            if cur:
                values.append(cur)
                cur = ""
        else:
            cur += ch
    if cur:
        values.append(cur)
    return key.strip().lower(), values


def parse_ssh_config(text: str, *, base: Path | None = None, _depth: int = 0) -> list[CandidateHost]:
    """Concrete ``Host`` entries of an OpenSSH client config, resolved the way ``ssh`` would.

    Patterns (``*``, ``?``, ``!``) are not hosts and are skipped, but their settings apply to the
    concrete hosts they match (first value wins, as in ``ssh``). ``Match`` blocks are skipped.
    ``Include`` is followed (relative to ``~/.ssh``).
    """
    import fnmatch

    # Each block: (patterns or None for global/Match-skip, settings list in order)
    blocks: list[tuple[list[str] | None, list[tuple[str, list[str]]]]] = [(["*"], [])]
    base = base or Path.home() / ".ssh"

    def feed(text: str, depth: int) -> None:
        for raw in text.splitlines():
            tok = _ssh_tokens(raw)
            if tok is None:
                continue
            key, values = tok
            if key == "host":
                blocks.append((values, []))
            elif key == "match":
                blocks.append((None, []))
            elif key == "include" and depth < 8:
                for pattern in values:
                    p = Path(os.path.expanduser(pattern))
                    if not p.is_absolute():
                        p = base / p
                    for f in sorted(p.parent.glob(p.name)) if any(c in p.name for c in "*?[") else [p]:
                        try:
                            feed(f.read_text(), depth + 1)
                        except OSError:
                            continue
            else:
                blocks[-1][1].append((key, values))

    feed(text, _depth)

    concrete: list[str] = []
    for patterns, _ in blocks[1:]:
        for p in patterns or ():
            if not any(c in p for c in "*?!") and p not in concrete:
                concrete.append(p)

    def matches(alias: str, patterns: list[str]) -> bool:
        ok = False
        for p in patterns:
            if p.startswith("!"):
                if fnmatch.fnmatchcase(alias, p[1:]):
                    return False
            elif fnmatch.fnmatchcase(alias, p):
                ok = True
        return ok

    hosts: list[CandidateHost] = []
    for alias in concrete:
        settings: dict[str, str] = {}
        for patterns, items in blocks:
            if patterns is None or not matches(alias, patterns):
                continue
            for key, values in items:
                if values and key not in settings:
                    settings[key] = values[0]
        hostname = settings.get("hostname", alias).replace("%h", alias)
        try:
            port = int(settings.get("port", "22"))
        except ValueError:
            port = 22
        hosts.append(
            CandidateHost(
                alias=alias,
                hostname=hostname,
                port=port,
                user=settings.get("user", ""),
                source="ssh_config",
                name=alias,
            )
        )
    return hosts


def ssh_config_hosts(path: Path | None = None) -> list[CandidateHost]:
    """Hosts of ``~/.ssh/config`` (or ``path``); empty when the file is missing or unreadable."""
    path = path or Path.home() / ".ssh" / "config"
    try:
        text = path.read_text()
    except OSError:
        return []
    return parse_ssh_config(text, base=path.parent)


# ---------------------------------------------------------------------- tailscale


def parse_tailscale_status(data: dict, *, online_only: bool = True) -> list[CandidateHost]:
    """Peers of ``tailscale status --json``; empty unless the backend is ``Running`` (logged in)."""
    if data.get("BackendState") != "Running":
        return []
    out: list[CandidateHost] = []
    for peer in (data.get("Peer") or {}).values():
        if online_only and not peer.get("Online"):
            continue
        ips = [ip for ip in peer.get("TailscaleIPs") or [] if ip]
        ips.sort(key=lambda ip: ":" in ip)  # IPv4 first
        if not ips:
            continue
        name = peer.get("HostName") or (peer.get("DNSName") or "").split(".")[0] or ips[0]
        dns = (peer.get("DNSName") or "").rstrip(".")
        out.append(CandidateHost(alias=dns or ips[0], hostname=ips[0], port=22, source="tailscale", name=name))
    return out


async def tailscale_hosts(*, command: str = "tailscale", timeout_s: float = 5.0) -> list[CandidateHost]:
    """Online tailnet peers, or ``[]`` when tailscale is not installed, not logged in or fails."""
    exe = shutil.which(command)
    if exe is None:
        return []
    try:
        proc = await asyncio.create_subprocess_exec(
            exe, "status", "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError:
        return []
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return []
    if proc.returncode != 0:
        return []
    try:
        return parse_tailscale_status(json.loads(out))
    except (ValueError, AttributeError):
        return []


def unique(items: Sequence[CandidateHost]) -> list[CandidateHost]:
    seen: dict[tuple[str, int], CandidateHost] = {}
    for h in items:
        seen.setdefault(h.key, h)
    return list(seen.values())
