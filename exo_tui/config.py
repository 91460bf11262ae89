"""The exo-tui configuration: a YAML file with typed sections, defaults, validation and env overrides.

Where the file is:

* ``EXO_TUI_CONFIG`` (a file path), if set; otherwise
* ``$EXO_TUI_HOME/config.yaml`` if ``EXO_TUI_HOME`` is set (the directory for all exo-tui
  config and state; tests point it at a temporary directory); otherwise
* ``platformdirs.user_config_dir("exo-tui")/config.yaml``.

A missing file means all defaults. Keys and defaults follow ``SCHEDULER.md`` (``scheduler.*``,
``network.*``, ``resources.*``) plus ``ui.theme``, ``cluster.name`` and ``models.paths``. Unknown
keys and values of the wrong type or outside their range raise :class:`ConfigError`, whose message
names the dotted key and what is allowed.

Environment overrides (applied after the file):

* ``EXO_TUI_KNOWN_PEERS=host:port,host:port`` → ``network.discovery.known_peers``
* ``EXO_TUI_API_KEY=...`` → ``network.api.key``
* the general scheme ``EXO_TUI__SECTION__KEY=value`` (double underscores between the parts of the
  dotted key, case-insensitive), e.g. ``EXO_TUI__SCHEDULER__PARTITION__STRATEGY=throughput``; the
  value is read as YAML (``true``, ``3``, ``0.5``, ``[a, b]``).

:func:`save_config` writes changed values back, editing only the lines of those keys so the rest
of the file (other keys, comments) stays as the operator wrote it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

ENV_CONFIG = "EXO_TUI_CONFIG"
ENV_HOME = "EXO_TUI_HOME"
ENV_PREFIX = "EXO_TUI__"

GB = 1024**3


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what is allowed."""


# ------------------------------------------------------------------------------- schema
# Each dataclass is a section; field metadata may carry a check: (predicate, "allowed values").


def _range(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    def ok(v: float) -> bool:
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    if lo is not None and hi is not None:
        text = f"a number from {lo} to {hi}"
    elif lo is not None:
        text = f"a number >= {lo}"
    else:
        text = f"a number <= {hi}"
    return {"check": (ok, text)}


_PEER_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def _peers_ok(peers: list[str]) -> bool:
    return all(_PEER_RE.match(p) and 0 < int(p.rsplit(":", 1)[1]) < 65536 for p in peers)


@dataclass
class ScoringConfig:
    resource_weight: float = field(default=40.0, metadata=_range(0))
    performance_weight: float = field(default=35.0, metadata=_range(0))
    load_balance_weight: float = field(default=15.0, metadata=_range(0))
    network_weight: float = field(default=10.0, metadata=_range(0))
    min_score_threshold: float = field(default=60.0, metadata=_range(0))


@dataclass
class PartitionConfig:
    strategy: Literal["latency", "throughput", "memory", "exo-ring"] = "latency"
    min_layers_per_shard: int = field(default=1, metadata=_range(1))


@dataclass
class LoadBalancingConfig:
    rebalance_threshold: float = field(default=0.3, metadata=_range(0))
    rebalance_interval: float = field(default=300.0, metadata=_range(0))
    max_task_migration: int = field(default=5, metadata=_range(1))
    auto_rebalance: bool = False


@dataclass
class FaultToleranceConfig:
    heartbeat_interval: float = field(default=1.0, metadata=_range(0.01))
    heartbeat_timeout: float = field(default=3.0, metadata=_range(0.01))
    task_retry_limit: int = field(default=3, metadata=_range(0))


@dataclass
class ResourceReservationConfig:
    system_reserved_vram: float = field(default=1.0, metadata=_range(0))  # GB
    system_reserved_ram: float = field(default=2.0, metadata=_range(0))  # GB
    emergency_reserve: float = field(default=0.1, metadata=_range(0, 0.9))  # fraction kept free


@dataclass
class SchedulerConfig:
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    load_balancing: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    resource_reservation: ResourceReservationConfig = field(default_factory=ResourceReservationConfig)


@dataclass
class DiscoveryConfig:
    mode: Literal["mdns", "manual", "tailscale"] = "mdns"
    known_peers: list[str] = field(
        default_factory=list, metadata={"check": (_peers_ok, "a list of host:port strings, e.g. [10.0.0.5:52416]")}
    )
    browse_interval: float = field(default=5.0, metadata=_range(0.1))
    connect_timeout: float = field(default=3.0, metadata=_range(0.1))


@dataclass
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = field(default=52415, metadata=_range(1, 65535))
    key: str | None = None


@dataclass
class SecurityConfig:
    enable_tls: bool = True


@dataclass
class NetworkConfig:
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    node_port: int = field(default=52416, metadata=_range(1, 65535))
    api: ApiConfig = field(default_factory=ApiConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


@dataclass
class MemoryAlertConfig:
    alert_percent: float = field(default=80.0, metadata=_range(0, 100))


@dataclass
class CpuConfig:
    cores_reserved: int = field(default=1, metadata=_range(0))
    alert_percent: float = field(default=90.0, metadata=_range(0, 100))


@dataclass
class ResourcesConfig:
    memory: MemoryAlertConfig = field(default_factory=MemoryAlertConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)


@dataclass
class UIConfig:
    theme: str = "exo-dark"


@dataclass
class ModelsConfig:
    # Folders (searched for *.gguf, subfolders too) or files that the model catalog lists beside
    # Ollama's, LM Studio's and the Hugging Face cache's models (see exo_tui/models/catalog.py).
    paths: list[str] = field(default_factory=list)


def _default_cluster_name() -> str:
    return socket.gethostname().split(".")[0] or "exo-tui"


@dataclass
class ClusterConfig:
    name: str = field(default_factory=_default_cluster_name)


@dataclass
class Config:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ui: UIConfig = field(default_factory=UIConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def get(self, dotted: str) -> Any:
        """The value of a dotted key, e.g. ``config.get("scheduler.partition.strategy")``."""
        node: Any = self
        for part in dotted.split("."):
            if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
                raise ConfigError(f"unknown config key {dotted!r}: {_allowed_keys_text(type(node))}")
            node = getattr(node, part)
        return node

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        return _build(cls, data or {}, "")


# ------------------------------------------------------------------------------- building


def _allowed_keys_text(cls: type) -> str:
    if not dataclasses.is_dataclass(cls):
        return "it is not a section"
    return "allowed keys are " + ", ".join(f.name for f in dataclasses.fields(cls))


def _type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_text(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    """``value`` as type ``tp``, or ConfigError naming ``key``."""
    origin = get_origin(tp)
    bad = ConfigError(f"config key {key} is {value!r}; it must be {_type_text(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_convert(get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is not None:
            raise bad
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise bad


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "the top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"config section {where} must be a mapping of keys; {_allowed_keys_text(cls)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            key = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(f"unknown config key {key} in {where}: {_allowed_keys_text(cls)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        value = data[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key)
            continue
        converted = _convert(tp, value, key)
        check = f.metadata.get("check")
        if check and converted is not None and not check[0](converted):
            raise ConfigError(f"config key {key} is {value!r}; it must be {check[1]}")
        kwargs[name] = converted
    obj = cls(**kwargs)
    if cls is FaultToleranceConfig and obj.heartbeat_timeout < obj.heartbeat_interval:
        raise ConfigError(
            f"config key {prefix}.heartbeat_timeout ({obj.heartbeat_timeout}) is shorter than "
            f"heartbeat_interval ({obj.heartbeat_interval}); it must be at least the interval"
        )
    return obj


# ------------------------------------------------------------------------------- files and env


def config_home(env: Mapping[str, str] | None = None) -> Path:
    """The directory for exo-tui config and state (``EXO_TUI_HOME`` or the platform's config dir)."""
    env = os.environ if env is None else env
    if env.get(ENV_HOME):
        return Path(env[ENV_HOME]).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("exo-tui"))


def config_path(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if path is not None:
        return Path(path).expanduser()
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG]).expanduser()
    return config_home(env) / "config.yaml"


def _read_yaml(p: Path) -> dict[str, Any]:
    if not p.exists():
        return {}
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML ({exc}): fix the file or delete it") from exc
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read ({exc}): check its permissions") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections (scheduler, network, ...)")
    return data


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Dotted key → value from the ``EXO_TUI_*`` environment variables."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for name in sorted(env):
        if name.upper().startswith(ENV_PREFIX):
            dotted = ".".join(p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p)
            try:
                out[dotted] = yaml.safe_load(env[name]) if env[name] != "" else None
            except yaml.YAMLError as exc:
                raise ConfigError(f"environment variable {name} is not a valid value ({exc})") from exc
    peers = env.get("EXO_TUI_KNOWN_PEERS")
    if peers is not None:
        out["network.discovery.known_peers"] = [p.strip() for p in peers.split(",") if p.strip()]
    key = env.get("EXO_TUI_API_KEY")
    if key:
        out["network.api.key"] = key
    return out


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The config from ``path`` (or the default location) with the environment overrides applied."""
    p = config_path(path, env)
    data = _read_yaml(p)
    for dotted, value in env_overrides(env).items():
        _set_dotted(data, dotted, value)
    try:
        return Config.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {p} or an EXO_TUI_* environment variable)") from exc


def save_config(
    changes: Mapping[str, Any], path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """Write ``changes`` (dotted key → value, e.g. ``{"ui.theme": "exo-light"}``) to the config file.

    Only the lines of the changed keys are edited (or added), so the rest of the file stays as
    it was, comments included. The result is validated before it is written: an invalid change
    raises :class:`ConfigError` and leaves the file alone. Returns the path written.
    """
    p = config_path(path, env)
    text = p.read_text(encoding="utf-8") if p.exists() else ""
    data = _read_yaml(p)
    for dotted, value in changes.items():
        Config().get(dotted)  # unknown keys raise
        _set_dotted(data, dotted, value)
    Config.from_dict(data)  # validate the whole result
    for dotted, value in changes.items():
        text = _edit_yaml_text(text, dotted, value)
    try:
        edited_ok = (yaml.safe_load(text) or {}) == data
    except yaml.YAMLError:
        edited_ok = False
    if not edited_ok:  # the line edit could not express it (flow style): rewrite the whole file
        text = yaml.safe_dump(data, sort_keys=False)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
    return p


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


_KEY_RE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_-]+):(?P<rest>.*)$")


def _edit_yaml_text(text: str, dotted: str, value: Any) -> str:
    """Set one dotted key in block-style YAML text by editing lines (best effort)."""
    lines = text.splitlines()
    parts = dotted.split(".")
    lo, hi, indent = 0, len(lines), 0  # the block we search in
    for depth, part in enumerate(parts):
        found = None
        child_indent = None
        for i in range(lo, hi):
            m = _KEY_RE.match(lines[i])
            if not m or lines[i].lstrip().startswith("#"):
                continue
            ind = len(m.group("indent"))
            if child_indent is None:
                if ind < indent:
                    break
                child_indent = ind
            if ind != child_indent:
                continue
            if m.group("key") == part:
                found = (i, m)
                break
        if found is None:
            # Add the remaining parts as a new block at the end of this block.
            ind = child_indent if child_indent is not None else (indent + 1 if depth else 0)
            new = []
            for d, rest_part in enumerate(parts[depth:]):
                pad = " " * (ind + 2 * d)
                if d == len(parts) - depth - 1:
                    new.append(f"{pad}{rest_part}: {_scalar(value)}")
                else:
                    new.append(f"{pad}{rest_part}:")
            lines[hi:hi] = new
            return "\n".join(lines) + "\n"
        i, m = found
        if depth == len(parts) - 1:
            rest = m.group("rest")
            comment = ""
            cm = re.search(r"\s+#.*$", rest)
            if cm and "'" not in rest and '"' not in rest:
                comment = cm.group(0)
            lines[i] = f"{m.group('indent')}{part}: {_scalar(value)}{comment}"
            # A block value below a scalar key would now be orphaned: drop its lines.
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(m.group("indent"))):
                if lines[j].strip():
                    del lines[j]
                else:
                    j += 1
            return "\n".join(lines) + "\n"
        # Descend: the block of this key runs until a line with indentation <= its own.
        key_indent = len(m.group("indent"))
        end = i + 1
        while end < hi:
            s = lines[end]
            if s.strip() and not s.lstrip().startswith("#") and len(s) - len(s.lstrip()) <= key_indent:
                break
            end += 1
        if m.group("rest").strip() and not m.group("rest").strip().startswith("#"):
            return text  # flow style ({...}) or a scalar: let the caller rewrite the file
        lo, hi, indent = i + 1, end, key_indent + 1
    return text


def default_config_yaml() -> str:
    """The defaults as YAML text (for ``exo-tui config --defaults`` or docs)."""
    return yaml.safe_dump(Config().to_dict(), sort_keys=False)
