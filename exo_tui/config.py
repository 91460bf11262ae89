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
  dotted key, case-insensitive), e.g. ``EXO_TUI__SCHEDULER__PARTITION__STRATEGY=throughput``,
  gathered by pydantic-settings; the value is read as YAML (``true``, ``3``, ``0.5``, ``[a, b]``).

YAML is read and written with ruamel.yaml alone (YAML 1.2: ``yes`` and ``on`` are strings, a key
given twice is an error): :func:`load_yaml` and :func:`dump_yaml` for every reader of the project.
:func:`save_config` writes changed values back with ruamel.yaml's round trip, so the rest of the
file (other keys, their order, comments) stays as the operator wrote it.
"""

from __future__ import annotations

import io
import os
import re
import socket
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, EnvSettingsSource
from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.comments import CommentedMap

ENV_CONFIG = "EXO_TUI_CONFIG"
ENV_HOME = "EXO_TUI_HOME"
ENV_PREFIX = "EXO_TUI__"

GB = 1024**3


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what is allowed."""


def _safe_yaml() -> YAML:
    y = YAML(typ="safe", pure=True)
    y.default_flow_style = False
    y.representer.sort_base_mapping_type_on_output = False  # keys in the order they were given
    return y


def load_yaml(text: str) -> Any:
    """The data of a YAML document (plain dicts, lists, scalars); :class:`YAMLError` if it is not YAML."""
    return _safe_yaml().load(text)


def dump_yaml(data: Any) -> str:
    """``data`` as a YAML document, block style, keys in their order."""
    out = io.StringIO()
    _safe_yaml().dump(data, out)
    return out.getvalue()


# ------------------------------------------------------------------------------- schema
# Each pydantic model is a section: unknown keys are refused (``extra="forbid"``) and values are
# taken as they are typed (``strict``: no "3" for 3, no 1 for true; an integer is a number). A
# value with a range or a shape carries a check with the text of what is allowed; the messages
# are composed by :func:`_config_error` from the path of the key.


def _check(ok: Callable[[Any], bool], allowed: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if value is not None and not ok(value):
            raise PydanticCustomError("config_value", "{allowed}", {"allowed": allowed})
        return value

    return AfterValidator(check)


def _range(lo: float | None = None, hi: float | None = None) -> AfterValidator:
    def ok(v: float) -> bool:
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    if lo is not None and hi is not None:
        text = f"a number from {lo} to {hi}"
    elif lo is not None:
        text = f"a number >= {lo}"
    else:
        text = f"a number <= {hi}"
    return _check(ok, text)


_PEER_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def _peers_ok(peers: list[str]) -> bool:
    return all(_PEER_RE.match(p) and 0 < int(p.rsplit(":", 1)[1]) < 65536 for p in peers)


class _Section(BaseModel):
    """A section of the config: typed keys, nothing else; ``null`` for a subsection means its defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_sections_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {k: {} if v is None and _section_of(cls, k) is not None else v for k, v in data.items()}
        return data


def _section_of(cls: type[BaseModel], name: Any) -> type[_Section] | None:
    info = cls.model_fields.get(name) if isinstance(name, str) else None
    tp = info.annotation if info is not None else None
    return tp if isinstance(tp, type) and issubclass(tp, _Section) else None


class ScoringConfig(_Section):
    resource_weight: Annotated[float, _range(0)] = 40.0
    performance_weight: Annotated[float, _range(0)] = 35.0
    load_balance_weight: Annotated[float, _range(0)] = 15.0
    network_weight: Annotated[float, _range(0)] = 10.0
    min_score_threshold: Annotated[float, _range(0)] = 60.0


class PartitionConfig(_Section):
    strategy: Literal["latency", "throughput", "memory", "exo-ring"] = "latency"
    min_layers_per_shard: Annotated[int, _range(1)] = 1


class LoadBalancingConfig(_Section):
    rebalance_threshold: Annotated[float, _range(0)] = 0.3
    rebalance_interval: Annotated[float, _range(0)] = 300.0
    max_task_migration: Annotated[int, _range(1)] = 5
    auto_rebalance: bool = False


class FaultToleranceConfig(_Section):
    heartbeat_interval: Annotated[float, _range(0.01)] = 1.0
    heartbeat_timeout: Annotated[float, _range(0.01)] = 3.0
    task_retry_limit: Annotated[int, _range(0)] = 3

    @model_validator(mode="after")
    def _timeout_covers_the_interval(self) -> FaultToleranceConfig:
        if self.heartbeat_timeout < self.heartbeat_interval:
            raise PydanticCustomError(
                "config_rule",
                "{key} ({timeout}) is shorter than heartbeat_interval ({interval}); it must be at least the interval",
                {"key": "heartbeat_timeout", "timeout": self.heartbeat_timeout, "interval": self.heartbeat_interval},
            )
        return self


class ResourceReservationConfig(_Section):
    system_reserved_vram: Annotated[float, _range(0)] = 1.0  # GB
    system_reserved_ram: Annotated[float, _range(0)] = 2.0  # GB
    emergency_reserve: Annotated[float, _range(0, 0.9)] = 0.1  # fraction kept free


class AdmissionConfig(_Section):
    queue_bound: Annotated[int, _range(0)] = 64  # requests that may wait; past it: 429 with Retry-After
    kv_share: Annotated[float, _range(0.01, 1.0)] = 1.0  # of prompt + max_tokens reserved at admission
    plan_wait_s: Annotated[float, _range(0)] = 120.0  # a request waits this long for a plan, then 503


class SchedulerConfig(_Section):
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    load_balancing: LoadBalancingConfig = Field(default_factory=LoadBalancingConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    resource_reservation: ResourceReservationConfig = Field(default_factory=ResourceReservationConfig)


class DiscoveryConfig(_Section):
    mode: Literal["mdns", "manual", "tailscale"] = "mdns"
    known_peers: Annotated[list[str], _check(_peers_ok, "a list of host:port strings, e.g. [10.0.0.5:52416]")] = Field(
        default_factory=list
    )
    browse_interval: Annotated[float, _range(0.1)] = 5.0
    connect_timeout: Annotated[float, _range(0.1)] = 3.0


class ApiConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, _range(1, 65535)] = 52415
    key: str | None = None
    max_body_bytes: Annotated[int, _range(1024)] = 4 << 20  # a bigger request body is a 413


class JoinConfig(_Section):
    """The coordinator's join endpoint (``exo-tui node --join TOKEN``), served by ``serve`` and the console."""

    enabled: bool = True
    host: str = "0.0.0.0"  # nodes on other hosts join here; one-time tokens and TLS guard it
    port: Annotated[int, _range(1, 65535)] = 52417


class SecurityConfig(_Section):
    enable_tls: bool = True


class NetworkConfig(_Section):
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    node_port: Annotated[int, _range(1, 65535)] = 52416
    api: ApiConfig = Field(default_factory=ApiConfig)
    join: JoinConfig = Field(default_factory=JoinConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)


class MemoryAlertConfig(_Section):
    alert_percent: Annotated[float, _range(0, 100)] = 80.0


class CpuConfig(_Section):
    cores_reserved: Annotated[int, _range(0)] = 1
    alert_percent: Annotated[float, _range(0, 100)] = 90.0


class ResourcesConfig(_Section):
    memory: MemoryAlertConfig = Field(default_factory=MemoryAlertConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)


class UIConfig(_Section):
    theme: str = "exo-dark"


DEFAULT_CONTEXT = 8192
"""The context a cluster serves a model at unless told (``models.context_length``): as Ollama's and
llama.cpp's servers do, less than the 128K a recent model's file allows, whose caches no home
cluster holds beside its weights."""


class ModelsConfig(_Section):
    # Folders (searched for *.gguf, subfolders too) or files that the model catalog lists beside
    # Ollama's, LM Studio's and the Hugging Face cache's models (see exo_tui/models/catalog.py).
    paths: list[str] = Field(default_factory=list)
    # The longest a request may grow (its prompt and answer), in tokens: the plan keeps room for
    # every layer's KV caches at it. At most the model's own (a Llama 3.1 file says 131072, whose
    # caches would be 16 GB at the 8B's shape); 0: the model's own. `--context` overrides it.
    context_length: Annotated[int, _range(0)] = DEFAULT_CONTEXT


def _default_cluster_name() -> str:
    return socket.gethostname().split(".")[0] or "exo-tui"


class ClusterConfig(_Section):
    name: str = Field(default_factory=_default_cluster_name)


class CoordinatorsConfig(_Section):
    """A set of coordinators (``exo-tui serve --coordinators``): Raft among them, one leads
    (docs/coordinators.md). Empty ``peers``: one coordinator, as ever."""

    peers: Annotated[list[str], _check(_peers_ok, "a list of host:port strings, e.g. [10.0.0.5:52418]")] = Field(
        default_factory=list
    )  # every coordinator's Raft address, this one's included
    port: Annotated[int, _range(1, 65535)] = 52418  # this coordinator's Raft port (of its address in peers)
    state_dir: str = ""  # its Raft journal; empty: <exo home>/coordinator


ONNX_PRECISIONS = ("auto", "int16", "float32", "int8")  # backends.onnx.SETTINGS (tests/unit/test_config.py)
_SPIN_RE = re.compile(r"^\d+us$")


class OnnxConfig(_Section):
    """The ONNX backend of a node started on this machine (``exo-tui node``, the console's local
    nodes); each key's environment variable overrides it. See backends/onnx/__init__.py."""

    precision: Literal["auto", "int16", "float32", "int8"] = "auto"  # EXO_TUI_ONNX_PRECISION; --precision wins
    spin: Annotated[int | str, _check(lambda v: v in (0, 1) if isinstance(v, int) else bool(_SPIN_RE.match(v)),
                                      "0 (never spin), 1 (spin until each step ends) or microseconds such as 15us")
                    ] = "15us"  # EXO_TUI_ONNX_SPIN
    pin: bool = False  # EXO_TUI_ONNX_PIN: a step's threads on cores of their own
    kernel: bool = True  # EXO_TUI_ONNX_KERNEL: exo-tui's kernels (off: MatMulNBits and ONNX Runtime's attention)


class NodeConfig(_Section):
    """A node agent started on this machine; its backend gets these as plain values."""

    threads: Annotated[int | None, _range(1)] = None  # EXO_TUI_THREADS; --threads wins; null: the physical cores
    onnx: OnnxConfig = Field(default_factory=OnnxConfig)

    def backend_settings(self, backend: str) -> dict[str, Any]:
        """What ``backends.configure_backend(backend, ...)`` takes from these keys."""
        out: dict[str, Any] = {} if self.threads is None else {"threads": self.threads}
        if backend == "onnx":
            spin = self.onnx.spin
            out |= {"precision": self.onnx.precision, "pin": self.onnx.pin, "kernel": self.onnx.kernel,
                    "spin": int(spin[:-2]) if isinstance(spin, str) else bool(spin)}
        return out


class Config(_Section):
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    ui: UIConfig = Field(default_factory=UIConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    coordinators: CoordinatorsConfig = Field(default_factory=CoordinatorsConfig)
    node: NodeConfig = Field(default_factory=NodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def get(self, dotted: str) -> Any:
        """The value of a dotted key, e.g. ``config.get("scheduler.partition.strategy")``."""
        node: Any = self
        for part in dotted.split("."):
            if not isinstance(node, _Section) or part not in type(node).model_fields:
                raise ConfigError(f"unknown config key {dotted!r}: {_allowed_keys_text(type(node))}")
            node = getattr(node, part)
        return node

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"config section the top level must be a mapping of keys; {_allowed_keys_text(cls)}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _config_error(exc, cls) from None


# ------------------------------------------------------------------------------- messages


def _allowed_keys_text(cls: type) -> str:
    if not (isinstance(cls, type) and issubclass(cls, _Section)):
        return "it is not a section"
    return "allowed keys are " + ", ".join(cls.model_fields)


def _type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_text(get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_text(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _config_error(exc: ValidationError, cls: type[_Section]) -> ConfigError:
    """pydantic's first error as a ConfigError that names the dotted key and what is allowed."""
    errors = exc.errors(include_url=False)
    # An unknown key is named before a bad value, as a reader checks a section's keys first.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    section: type[_Section] | None = cls
    annotation: Any = None
    parts: list[str] = []
    unresolved: list[Any] = []
    for item in err["loc"]:
        if unresolved:
            unresolved.append(item)
        elif isinstance(item, int) and parts:  # an item of a list
            parts[-1] += f"[{item}]"
            annotation = get_args(annotation)[0] if get_args(annotation) else None
        elif section is not None and isinstance(item, str) and item in section.model_fields:
            parts.append(item)
            annotation = section.model_fields[item].annotation
            section = _section_of(section, item)
        else:
            unresolved.append(item)
    key = ".".join(parts)
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if err["type"] == "extra_forbidden":
        where = key or "the top level"
        full = f"{key}.{unresolved[0]}" if key else str(unresolved[0])
        return ConfigError(f"unknown config key {full} in {where}: {_allowed_keys_text(section or cls)}")
    if err["type"] in ("model_type", "dict_type", "model_attributes_type") and section is not None:
        return ConfigError(f"config section {key} must be a mapping of keys; {_allowed_keys_text(section)}")
    if err["type"] == "config_rule":
        return ConfigError(f"config key {key}.{err['msg']}")
    if err["type"] == "config_value":
        return ConfigError(f"config key {key} is {value!r}; it must be {ctx['allowed']}")
    return ConfigError(f"config key {key} is {value!r}; it must be {_type_text(annotation)}")


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
        data = load_yaml(p.read_text(encoding="utf-8"))
    except YAMLError as exc:
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


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _env_value(name: str, value: Any) -> Any:
    """A variable's value as YAML text says it (pydantic-settings has read what is JSON already)."""
    if not isinstance(value, str):
        return value
    if value == "":
        return None
    try:
        return load_yaml(value)
    except YAMLError as exc:
        raise ConfigError(f"environment variable {name} is not a valid value ({exc})") from exc


NODE_ENV = {  # the node's backend settings, each an environment variable of its own too
    "EXO_TUI_THREADS": "node.threads",
    "EXO_TUI_ONNX_PRECISION": "node.onnx.precision",
    "EXO_TUI_ONNX_SPIN": "node.onnx.spin",
    "EXO_TUI_ONNX_PIN": "node.onnx.pin",
    "EXO_TUI_ONNX_KERNEL": "node.onnx.kernel",
}
_FLAG_KEYS = ("node.onnx.pin", "node.onnx.kernel")
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Dotted key → value from the ``EXO_TUI_*`` environment variables. pydantic-settings gathers
    the ``EXO_TUI__SECTION__KEY`` ones into sections; a variable for a section the config does not
    have is kept, so that validation names it as an unknown key."""
    env = os.environ if env is None else env
    fields: dict[str, Any] = {name: (dict[str, Any], {}) for name in Config.model_fields}
    sections = create_model("EnvSections", __base__=BaseSettings, **fields)
    source = EnvSettingsSource(sections, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
    source.env_vars = {name.lower(): value for name, value in env.items()}
    nested = dict(source())
    for name in env:
        if name.upper().startswith(ENV_PREFIX):
            section = name[len(ENV_PREFIX):].split("__", 1)[0].lower()
            if section not in Config.model_fields:
                nested[name[len(ENV_PREFIX):].lower().replace("__", ".")] = env[name]
    out = {dotted: _env_value(f"{ENV_PREFIX}{dotted.upper().replace('.', '__')}", value)
           for dotted, value in sorted(_flatten(nested).items())}
    for name, dotted in NODE_ENV.items():
        if env.get(name, "").strip():
            value = _env_value(name, env[name].strip())
            flag = _FLAGS.get(str(value).lower())
            if flag is not None and dotted in _FLAG_KEYS:
                value = flag
            elif flag is not None and dotted == "node.onnx.spin":  # on: until each step ends, off: never
                value = int(flag)
            out[dotted] = value
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

    The file is edited in place with ruamel.yaml's round trip, so the rest of it stays as the
    operator wrote it: other keys, their order, comments, flow-style mappings. The result is
    validated before it is written: an invalid change raises :class:`ConfigError` and leaves the
    file alone. Returns the path written.
    """
    p = config_path(path, env)
    text = p.read_text(encoding="utf-8") if p.exists() else ""
    data = _read_yaml(p)
    for dotted, value in changes.items():
        Config().get(dotted)  # unknown keys raise
        _set_dotted(data, dotted, value)
    Config.from_dict(data)  # validate the whole result
    text = _edit_yaml_text(text, changes)
    try:
        edited_ok = (load_yaml(text) or {}) == data
    except YAMLError:
        edited_ok = False
    if not edited_ok:  # the round trip wrote something that reads otherwise: write the data plainly
        text = dump_yaml(data)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
    return p


def _edit_yaml_text(text: str, changes: Mapping[str, Any]) -> str:
    """``text`` with each dotted key of ``changes`` set, through ruamel.yaml's round trip."""
    rt = YAML(typ="rt")
    rt.preserve_quotes = True
    doc = rt.load(text) if text.strip() else None
    if not isinstance(doc, CommentedMap):
        doc = CommentedMap()
    for dotted, value in changes.items():
        parts = dotted.split(".")
        node = doc
        for part in parts[:-1]:
            if not isinstance(node.get(part), CommentedMap):
                node[part] = CommentedMap()
            node = node[part]
        node[parts[-1]] = value
    out = io.StringIO()
    rt.dump(doc, out)
    return out.getvalue()


def default_config_yaml() -> str:
    """The defaults as YAML text (for ``exo-tui config --defaults`` or docs)."""
    return dump_yaml(Config().to_dict())
