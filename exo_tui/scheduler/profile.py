"""What the scheduler knows of a node: :class:`DeviceProfile`, plain data the node agent measures.

All sizes are bytes, all times seconds, all fractions 0..1. Times are plain floats on whatever
clock the caller uses (the coordinator passes ``now`` on the same clock as ``last_heartbeat``).

Compute is given per backend as the seconds one transformer layer takes:

* ``decode_s_per_layer[backend]``: one token through one layer (decode step);
* ``prefill_s_per_layer_token[backend]``: per prompt token through one layer during prefill.

Both were measured on layers of ``compute_ref_layer_bytes`` bytes; for another model the time
scales with the layer's bytes (decode is memory-bandwidth bound). ``compute_ref_layer_bytes = 0``
means "measured on this model's own layers" (no scaling). A profile without measurements falls
back to ``memory_bandwidth_bytes_per_s``: a layer takes its bytes / (bandwidth x 0.6). On a CPU
that is also the floor under a measured decode time: the node measures a few layers, which fit
in its caches, while a decode step of a whole shard streams every layer's weights from memory
(SmolLM2 on the 2-core VM, int16: 0.063 ms a layer measured, 2.2 MB a layer at 26 GB/s copy
bandwidth; one node predicted 291 tok/s without the floor and ~160 with it, 149-160 served).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from exo_tui.scheduler.spec import ModelSpec

DEVICE_TYPES = ("cpu", "cuda", "apple")
POWER_STATES = ("active", "low_power", "battery", "sleep")
BANDWIDTH_EFFICIENCY = 0.6  # share of peak memory bandwidth a decode step reaches
PREFILL_SPEEDUP = 4.0  # per-token prefill vs decode when prefill was not measured
DEFAULT_LATENCY_S = 0.002  # a link we know nothing about: a busy LAN
DEFAULT_BANDWIDTH = 50e6  # bytes/s


@dataclass(frozen=True)
class Link:
    """A measured link from a node to a peer."""

    latency_s: float
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH
    loss: float = 0.0

    def hop_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / max(self.bandwidth_bytes_per_s, 1.0)


UNKNOWN_LINK = Link(DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH)


@dataclass(frozen=True)
class DeviceProfile:
    """One node as the scheduler sees it. The node agent fills it from its measurements."""

    node_id: str
    name: str = ""
    device_type: str = "cpu"  # cpu | cuda | apple
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    vram_total_bytes: int = 0
    vram_available_bytes: int = 0
    unified_memory: bool = False  # Apple silicon: RAM is the VRAM
    cpu_cores: int = 1
    cpu_utilization: float = 0.0
    backends: tuple[str, ...] = ("onnx",)
    decode_s_per_layer: dict[str, float] = field(default_factory=dict)
    prefill_s_per_layer_token: dict[str, float] = field(default_factory=dict)
    compute_ref_layer_bytes: int = 0
    # Bytes a backend keeps per cached K or V value (float32: 4; ONNX's integer precisions keep
    # float16 caches: 2). A backend not listed counts 4: never less memory than it will take.
    kv_value_bytes: dict[str, int] = field(default_factory=dict)
    memory_bandwidth_bytes_per_s: float = 10e9
    load_factor: float = 0.0  # 0 idle .. 1 saturated by other work
    benchmark_score: float = 1.0  # higher is faster; compared with the work's min_performance
    power_state: str = "active"
    links: dict[str, Link] = field(default_factory=dict)  # peer node id -> link
    last_heartbeat: float = 0.0
    drained: bool = False
    failed: bool = False
    # Under a --memory-limit: its available memory is what the limit leaves, the reserves of
    # resource_reservation already given back (they are for a machine's other programs).
    memory_limited: bool = False
    # Its compute figures were measured on the ring (scheduler/calibration.py): the decode time
    # holds everything, so the memory-bandwidth floor is not put under it.
    calibrated: bool = False
    # The output head's decode time in this node's layers, as the ring measured it (None: its
    # bytes over a layer's).
    head_layers: float | None = None
    # Its measured seconds per layer by the layers its shard held (layers, seconds): a layer's
    # time grows with the shard on a busy machine (a long run loses the core to other work; a
    # short one, woken from sleep, gets it); a plan for another count of layers is predicted
    # between those measured, and beyond them as other nodes of its host measured it grow
    # (context.PlanContext.size).
    layer_s_by_layers: tuple[tuple[float, float], ...] = ()
    # The CPU its process may use under a quota (a container's, a cgroup's), in cores (None: no
    # quota), and the CPU seconds a second of its runs takes (its threads; measured on the ring,
    # 1 until then): a step needing more CPU a second than the quota gives waits for it
    # (scheduler/prediction.py). Nodes with the same ``host_id`` share ``cpu_cores``.
    cpu_quota_cores: float | None = None
    cpu_per_busy_s: float = 1.0
    # Its quota held it back while it ran a shard of this many layers (None: not so measured): its
    # measured step times hold the quota's wait up to that many, and the bound counts beyond it.
    quota_held_layers: int | None = None
    host_id: str = ""
    # A ring of this node alone: a token's way from its last stage back to its first, as the ring
    # measured it (its token written to the coordinator, a turn of its loop; None: not measured).
    # Between two nodes that way is their link's; on one node the ring counted it nowhere else.
    handoff_s: float | None = None

    def __hash__(self) -> int:
        return hash(self.node_id)

    @property
    def label(self) -> str:
        return self.name or self.node_id

    # ------------------------------------------------------------------ memory

    @property
    def uses_vram(self) -> bool:
        """Shards live in discrete GPU memory (a CUDA device with its own VRAM)."""
        return self.device_type == "cuda" and not self.unified_memory and self.vram_total_bytes > 0

    @property
    def compute_memory_total(self) -> int:
        """The memory a shard runs from: VRAM on a discrete GPU, RAM otherwise."""
        return self.vram_total_bytes if self.uses_vram else self.ram_total_bytes

    @property
    def compute_memory_available(self) -> int:
        return self.vram_available_bytes if self.uses_vram else self.ram_available_bytes

    @property
    def effective_vram_available(self) -> int:
        """VRAM for scoring: unified memory and CPU devices run from RAM, so RAM is their VRAM."""
        return self.vram_available_bytes if self.uses_vram else self.ram_available_bytes

    def usable_bytes(self, reserved_ram: float, reserved_vram: float, emergency: float) -> int:
        """Memory a shard may use: available minus the system reserve and the emergency share."""
        if self.uses_vram:
            free = self.vram_available_bytes - reserved_vram - emergency * self.vram_total_bytes
        else:
            free = self.ram_available_bytes - reserved_ram - emergency * self.ram_total_bytes
        return max(0, int(free))

    # ------------------------------------------------------------------ compute

    def kv_bytes_per_layer(self, spec: ModelSpec, backend: str | None = None) -> float:
        """One layer's KV cache for ``spec``'s context on this node (``spec`` counts float32)."""
        value = self.kv_value_bytes.get(backend or self.best_backend(), 4)
        return spec.kv_bytes_per_layer * max(int(value), 1) / 4

    def best_backend(self) -> str:
        if self.decode_s_per_layer:
            return min(sorted(self.decode_s_per_layer), key=lambda b: self.decode_s_per_layer[b])
        return self.backends[0] if self.backends else "onnx"

    def _scale(self, spec: ModelSpec) -> float:
        return spec.mean_active_layer_bytes / self.compute_ref_layer_bytes if self.compute_ref_layer_bytes > 0 else 1.0

    def layer_s(self, spec: ModelSpec, backend: str | None = None) -> float:
        """Seconds one decode token spends in one (average) layer of ``spec``, load included.

        Other work on the node (``load_factor``) slows it: time x (1 + load_factor).
        """
        backend = backend or self.best_backend()
        t = self.decode_s_per_layer.get(backend)
        streamed = spec.mean_active_layer_bytes / (max(self.memory_bandwidth_bytes_per_s, 1.0) * BANDWIDTH_EFFICIENCY)
        if t is not None and t > 0:
            t = t * self._scale(spec)
            if self.device_type == "cpu" and not self.calibrated:  # no faster than its weights stream from memory
                t = max(t, streamed)
        else:
            t = streamed
        return t * (1.0 + min(max(self.load_factor, 0.0), 1.0))

    def prefill_s(self, spec: ModelSpec, backend: str | None = None) -> float:
        """Seconds per prompt token per (average) layer during prefill, load included."""
        backend = backend or self.best_backend()
        t = self.prefill_s_per_layer_token.get(backend)
        if t is not None and t > 0:
            return t * self._scale(spec) * (1.0 + min(max(self.load_factor, 0.0), 1.0))
        return self.layer_s(spec, backend) / PREFILL_SPEEDUP

    def link_to(self, peer: str) -> Link:
        if peer == self.node_id:
            return Link(0.0, float("inf"))
        return self.links.get(peer, UNKNOWN_LINK)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["backends"] = list(self.backends)
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        d = dict(d)
        d["backends"] = tuple(d.get("backends", ("onnx",)))
        d["links"] = {k: (v if isinstance(v, Link) else Link(**v)) for k, v in (d.get("links") or {}).items()}
        d["decode_s_per_layer"] = {k: float(v) for k, v in (d.get("decode_s_per_layer") or {}).items()}
        d["prefill_s_per_layer_token"] = {k: float(v) for k, v in (d.get("prefill_s_per_layer_token") or {}).items()}
        d["kv_value_bytes"] = {k: int(v) for k, v in (d.get("kv_value_bytes") or {}).items()}
        d["layer_s_by_layers"] = tuple((float(a), float(b)) for a, b in d.get("layer_s_by_layers") or ())
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def with_(self, **changes: Any) -> DeviceProfile:
        return replace(self, **changes)
