"""Discovery: mDNS advertise and browse, static peers, ``~/.ssh/config`` and tailscale hosts.

- :class:`NodeAdvertiser` — the node agent's ``_exo-tui._tcp.local.`` advertisement.
- :class:`Discovery` — the coordinator's view of every source, published as events.
- :mod:`exo_tui.discovery.join` — one-time join tokens.
"""

from exo_tui.discovery.mdns import (
    NODE_SERVICE,
    SSH_SERVICES,
    MdnsBrowser,
    NodeAdvertisement,
    NodeAdvertiser,
    cluster_fingerprint,
    host_addresses,
)
from exo_tui.discovery.service import DiscoveredNode, Discovery, net_probe, tcp_probe
from exo_tui.discovery.static import (
    ENV_KNOWN_PEERS,
    CandidateHost,
    Peer,
    parse_peer,
    parse_ssh_config,
    parse_tailscale_status,
    ssh_config_hosts,
    static_peers,
    tailscale_hosts,
)

__all__ = [
    "ENV_KNOWN_PEERS",
    "NODE_SERVICE",
    "SSH_SERVICES",
    "CandidateHost",
    "DiscoveredNode",
    "Discovery",
    "MdnsBrowser",
    "NodeAdvertisement",
    "NodeAdvertiser",
    "Peer",
    "cluster_fingerprint",
    "host_addresses",
    "net_probe",
    "parse_peer",
    "parse_ssh_config",
    "parse_tailscale_status",
    "ssh_config_hosts",
    "static_peers",
    "tailscale_hosts",
    "tcp_probe",
]
