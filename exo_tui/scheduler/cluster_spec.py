"""Simulated clusters: device kinds, link kinds, and profiles from a ``cluster.yaml`` mapping.

Pure: takes the parsed mapping (the ``plan`` command reads the file). Format::

    name: home-lab
    default_link: wifi                 # a link kind, or {latency_ms: 3, bandwidth_mbps: 300}
    nodes:
      - id: studio
        kind: mac-studio-m2-ultra      # a device kind below: memory, bandwidth, type
        name: Mac Studio               # optional
        memory_gb: 192                 # optional: overrides the kind's memory
        available_gb: 180              # optional: free memory (default: memory - 10 %)
        vram_gb: 24                    # optional, CUDA devices
        decode_ms_per_layer: 4.5       # optional: measured for THIS model's layers
        prefill_ms_per_layer_token: 0.2
        bandwidth_gbps: 800            # optional: memory bandwidth, GB/s
        load: 0.1                      # optional: load factor 0..1
        power: active                  # optional
        drained: false
    links:
      - {between: [studio, rtx], kind: ethernet-10g}
      - {between: [studio, phone], latency_ms: 8, bandwidth_mbps: 200}

A node with neither ``kind`` nor ``decode_ms_per_layer`` is an error naming it. Device kinds
estimate a layer's decode time from its bytes and the kind's memory bandwidth (decode reads every
weight once per token), so the estimate scales with the model's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exo_tui.scheduler.profile import DeviceProfile, Link

GiB = 1024**3


@dataclass(frozen=True)
class DeviceKind:
    label: str
    device_type: str  # cpu | cuda | apple
    ram_gb: float
    vram_gb: float  # discrete GPU memory (0: none)
    bandwidth_gb_s: float  # memory bandwidth of the memory the shard runs from
    cores: int
    backends: tuple[str, ...]
    benchmark: float  # relative speed, for the score's performance part


DEVICE_KINDS: dict[str, DeviceKind] = {
    "mac-studio-m2-ultra": DeviceKind("Mac Studio M2 Ultra", "apple", 192, 0, 800, 24, ("mlx", "onnx"), 8.0),
    "mac-studio-m4-max": DeviceKind("Mac Studio M4 Max", "apple", 128, 0, 546, 16, ("mlx", "onnx"), 6.0),
    "macbook-pro-m3-max": DeviceKind("MacBook Pro M3 Max", "apple", 64, 0, 400, 16, ("mlx", "onnx"), 4.5),
    "macbook-air-m2": DeviceKind("MacBook Air M2", "apple", 16, 0, 100, 8, ("mlx", "onnx"), 1.2),
    "mac-mini-m4": DeviceKind("Mac mini M4", "apple", 16, 0, 120, 10, ("mlx", "onnx"), 1.5),
    "rtx-4090-desktop": DeviceKind("RTX 4090 desktop", "cuda", 64, 24, 1008, 16, ("onnx",), 10.0),
    "rtx-3090-desktop": DeviceKind("RTX 3090 desktop", "cuda", 32, 24, 936, 12, ("onnx",), 8.0),
    "rtx-3060-desktop": DeviceKind("RTX 3060 desktop", "cuda", 32, 12, 360, 8, ("onnx",), 3.5),
    "linux-laptop": DeviceKind("x86 laptop (DDR5)", "cpu", 32, 0, 60, 8, ("onnx",), 0.6),
    "linux-desktop": DeviceKind("x86 desktop (DDR5)", "cpu", 64, 0, 80, 16, ("onnx",), 0.8),
    "iphone-15-pro": DeviceKind("iPhone 15 Pro", "apple", 8, 0, 51, 6, ("mlx",), 0.5),
    "android-phone": DeviceKind("Android flagship", "cpu", 12, 0, 60, 8, ("onnx",), 0.5),
    "raspberry-pi-5": DeviceKind("Raspberry Pi 5 (8 GB)", "cpu", 8, 0, 17, 4, ("onnx",), 0.15),
    "raspberry-pi-4": DeviceKind("Raspberry Pi 4 (4 GB)", "cpu", 4, 0, 6, 4, ("onnx",), 0.05),
}

# latency_ms, bandwidth in MB/s (bytes, not bits) of a link kind
LINK_KINDS: dict[str, tuple[float, float]] = {
    "thunderbolt": (0.08, 2500.0),
    "ethernet-10g": (0.15, 1100.0),
    "ethernet-1g": (0.35, 115.0),
    "wifi": (4.0, 40.0),
    "wifi-phone": (8.0, 20.0),
    "loopback": (0.02, 5000.0),
}


class ClusterSpecError(ValueError):
    """The cluster description is invalid; the message names the node or key."""


def _link(d: Any, where: str) -> Link:
    if isinstance(d, str):
        if d not in LINK_KINDS:
            raise ClusterSpecError(f"{where}: unknown link kind {d!r}; use one of {', '.join(LINK_KINDS)}")
        lat, mbs = LINK_KINDS[d]
        return Link(lat / 1000, mbs * 1e6)
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{where}: a link is a kind name or {{latency_ms, bandwidth_mbps}}")
    if "kind" in d:
        base = _link(d["kind"], where)
    else:
        base = Link(0.002, 50e6)
    lat = float(d.get("latency_ms", base.latency_s * 1000)) / 1000
    bw = float(d["bandwidth_mbps"]) * 1e6 / 8 if "bandwidth_mbps" in d else base.bandwidth_bytes_per_s
    if lat < 0 or bw <= 0:
        raise ClusterSpecError(f"{where}: latency must be >= 0 and bandwidth > 0")
    return Link(lat, bw, float(d.get("loss", 0.0)))


NODE_KEYS = {
    "id", "name", "kind", "memory_gb", "available_gb", "vram_gb", "vram_available_gb", "decode_ms_per_layer",
    "prefill_ms_per_layer_token", "bandwidth_gbps", "load", "power", "drained", "failed", "device_type", "cores",
    "benchmark", "backend",
}


def profiles_from_cluster(data: Mapping[str, Any], now: float = 0.0) -> list[DeviceProfile]:
    """Device profiles for a simulated cluster (heartbeats at ``now``)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ClusterSpecError("a cluster file needs a non-empty `nodes:` list (see examples/clusters/)")
    unknown = set(data) - {"name", "nodes", "links", "default_link", "description"}
    if unknown:
        raise ClusterSpecError(f"unknown cluster key {sorted(unknown)[0]!r}: allowed are name, description, nodes, links, default_link")
    default = _link(data.get("default_link", "ethernet-1g"), "default_link")
    nodes: list[dict[str, Any]] = []
    ids: list[str] = []
    for i, n in enumerate(data["nodes"]):
        if not isinstance(n, Mapping) or "id" not in n:
            raise ClusterSpecError(f"node #{i + 1} needs an `id:`")
        nid = str(n["id"])
        bad = set(n) - NODE_KEYS
        if bad:
            raise ClusterSpecError(f"node {nid}: unknown key {sorted(bad)[0]!r}; allowed are {', '.join(sorted(NODE_KEYS))}")
        if nid in ids:
            raise ClusterSpecError(f"node id {nid} appears twice")
        if "kind" not in n and "decode_ms_per_layer" not in n:
            raise ClusterSpecError(f"node {nid}: give a `kind:` ({', '.join(DEVICE_KINDS)}) or `decode_ms_per_layer:`")
        if "kind" in n and n["kind"] not in DEVICE_KINDS:
            raise ClusterSpecError(f"node {nid}: unknown kind {n['kind']!r}; use one of {', '.join(DEVICE_KINDS)}")
        ids.append(nid)
        nodes.append(dict(n))
    links: dict[tuple[str, str], Link] = {}
    for j, ln in enumerate(data.get("links") or []):
        where = f"links[{j}]"
        pair = ln.get("between") if isinstance(ln, Mapping) else None
        if not isinstance(pair, list) or len(pair) != 2:
            raise ClusterSpecError(f"{where}: needs `between: [node, node]`")
        a, b = (str(x) for x in pair)
        for x in (a, b):
            if x not in ids:
                raise ClusterSpecError(f"{where}: unknown node {x!r} (nodes: {', '.join(ids)})")
        link = _link({k: v for k, v in ln.items() if k != "between"}, where)
        links[(a, b)] = links[(b, a)] = link
    out = []
    for n in nodes:
        nid = str(n["id"])
        kind = DEVICE_KINDS.get(n.get("kind", ""))
        dtype = n.get("device_type", kind.device_type if kind else "cpu")
        ram = float(n.get("memory_gb", kind.ram_gb if kind else 16)) * GiB
        vram = float(n.get("vram_gb", kind.vram_gb if kind else 0)) * GiB
        avail = float(n["available_gb"]) * GiB if "available_gb" in n else ram * 0.9
        vavail = float(n["vram_available_gb"]) * GiB if "vram_available_gb" in n else vram * 0.95
        bw = float(n.get("bandwidth_gbps", kind.bandwidth_gb_s if kind else 50)) * 1e9
        backends = (n["backend"],) if "backend" in n else (kind.backends if kind else ("onnx",))
        decode = {backends[0]: float(n["decode_ms_per_layer"]) / 1000} if "decode_ms_per_layer" in n else {}
        prefill = {backends[0]: float(n["prefill_ms_per_layer_token"]) / 1000} if "prefill_ms_per_layer_token" in n else {}
        out.append(DeviceProfile(
            node_id=nid,
            name=str(n.get("name", kind.label if kind else nid)),
            device_type=dtype,
            ram_total_bytes=int(ram),
            ram_available_bytes=int(avail),
            vram_total_bytes=int(vram),
            vram_available_bytes=int(vavail),
            unified_memory=dtype == "apple",
            cpu_cores=int(n.get("cores", kind.cores if kind else 4)),
            cpu_utilization=0.0,
            backends=tuple(backends),
            decode_s_per_layer=decode,
            prefill_s_per_layer_token=prefill,
            compute_ref_layer_bytes=0,
            memory_bandwidth_bytes_per_s=bw,
            load_factor=float(n.get("load", 0.0)),
            benchmark_score=float(n.get("benchmark", kind.benchmark if kind else 1.0)),
            power_state=str(n.get("power", "active")),
            links={o: links.get((nid, o), default) for o in ids if o != nid},
            last_heartbeat=now,
            drained=bool(n.get("drained", False)),
            failed=bool(n.get("failed", False)),
        ))
    return out
