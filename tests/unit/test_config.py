"""The YAML config: defaults, validation, locations, environment overrides, saving."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from exo_tui.config import (
    Config,
    ConfigError,
    config_home,
    config_path,
    default_config_yaml,
    env_overrides,
    load_config,
    load_yaml,
    save_config,
)

# The config block of SCHEDULER.md, as written there.
SPEC_DEFAULTS = """
scheduler:
  scoring:
    resource_weight: 40
    performance_weight: 35
    load_balance_weight: 15
    network_weight: 10
    min_score_threshold: 60
  partition:
    strategy: latency
    min_layers_per_shard: 1
  load_balancing:
    rebalance_threshold: 0.3
    rebalance_interval: 300
    max_task_migration: 5
    auto_rebalance: false
  fault_tolerance:
    heartbeat_interval: 1
    heartbeat_timeout: 3
    task_retry_limit: 3
  resource_reservation:
    system_reserved_vram: 1.0
    system_reserved_ram: 2.0
    emergency_reserve: 0.1
network:
  discovery:
    mode: mdns
    known_peers: []
    browse_interval: 5
    connect_timeout: 3
  node_port: 52416
  api: {host: 127.0.0.1, port: 52415, key: null, max_body_bytes: 4194304}
  join: {enabled: true, host: 0.0.0.0, port: 52417}
  security:
    enable_tls: true
resources:
  memory: {alert_percent: 80}
  cpu: {cores_reserved: 1, alert_percent: 90}
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"EXO_TUI_HOME": str(tmp_path)}


def test_defaults_are_those_of_the_spec(env: dict[str, str]) -> None:
    cfg = load_config(env=env)
    d = cfg.to_dict()
    spec = load_yaml(SPEC_DEFAULTS)
    for section in ("scheduler", "network", "resources"):
        assert d[section] == spec[section]
    assert cfg.ui.theme == "exo-dark"
    assert cfg.cluster.name == socket.gethostname().split(".")[0]
    assert Config.from_dict(spec).to_dict()["scheduler"] == d["scheduler"]
    assert load_yaml(default_config_yaml())["scheduler"] == spec["scheduler"]


def test_locations(tmp_path: Path) -> None:
    assert config_home({"EXO_TUI_HOME": str(tmp_path)}) == tmp_path
    assert config_path(env={"EXO_TUI_HOME": str(tmp_path)}) == tmp_path / "config.yaml"
    other = tmp_path / "x.yaml"
    assert config_path(env={"EXO_TUI_HOME": str(tmp_path), "EXO_TUI_CONFIG": str(other)}) == other
    assert config_path(tmp_path / "y.yaml", env={"EXO_TUI_CONFIG": str(other)}) == tmp_path / "y.yaml"
    assert config_path(env={}).name == "config.yaml" and "exo-tui" in str(config_path(env={}))


def test_file_values_are_read(tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "config.yaml").write_text(
        "scheduler:\n  partition:\n    strategy: throughput\n  scoring:\n    min_score_threshold: 50\n"
        "network:\n  api: {host: 0.0.0.0, port: 8000, key: abc}\nui:\n  theme: exo-light\n"
    )
    cfg = load_config(env=env)
    assert cfg.scheduler.partition.strategy == "throughput"
    assert cfg.scheduler.scoring.min_score_threshold == 50.0
    assert isinstance(cfg.scheduler.scoring.min_score_threshold, float)
    assert (cfg.network.api.host, cfg.network.api.port, cfg.network.api.key) == ("0.0.0.0", 8000, "abc")
    assert cfg.ui.theme == "exo-light"
    assert cfg.get("scheduler.partition.strategy") == "throughput"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("scheduler:\n  scoring:\n    resorce_weight: 3\n", ["scheduler.scoring.resorce_weight", "resource_weight"]),
        ("schedule: {}\n", ["unknown config key schedule", "scheduler, network, resources, ui, cluster"]),
        ("scheduler:\n  partition:\n    strategy: fastest\n", ["scheduler.partition.strategy", "'latency'", "'exo-ring'"]),
        ("scheduler:\n  load_balancing:\n    max_task_migration: 2.5\n", ["scheduler.load_balancing.max_task_migration", "an integer"]),
        ("scheduler:\n  load_balancing:\n    auto_rebalance: yes please\n", ["auto_rebalance", "true or false"]),
        ("network:\n  node_port: 70000\n", ["network.node_port", "1 to 65535"]),
        ("scheduler:\n  resource_reservation:\n    emergency_reserve: 2\n", ["emergency_reserve", "0 to 0.9"]),
        ("network:\n  discovery:\n    known_peers: [nohost]\n", ["known_peers", "host:port"]),
        ("network:\n  discovery:\n    mode: bluetooth\n", ["network.discovery.mode", "'mdns'"]),
        ("scheduler: 3\n", ["scheduler must be a mapping"]),
        ("scheduler:\n  fault_tolerance:\n    heartbeat_interval: 5\n    heartbeat_timeout: 3\n", ["heartbeat_timeout"]),
        ("a: [unclosed\n", ["not valid YAML"]),
        ("- 1\n- 2\n", ["must hold a mapping"]),
    ],
)
def test_bad_files_name_the_key_and_what_is_allowed(tmp_path: Path, env: dict[str, str], text: str, fragments: list[str]) -> None:
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    for f in fragments:
        assert f in str(e.value)


def test_env_overrides(env: dict[str, str]) -> None:
    env = env | {
        "EXO_TUI_KNOWN_PEERS": "10.0.0.5:52416, pi.local:52416",
        "EXO_TUI_API_KEY": "s3cret",
        "EXO_TUI__SCHEDULER__PARTITION__STRATEGY": "memory",
        "EXO_TUI__SCHEDULER__LOAD_BALANCING__AUTO_REBALANCE": "true",
        "EXO_TUI__NETWORK__NODE_PORT": "6000",
    }
    cfg = load_config(env=env)
    assert cfg.network.discovery.known_peers == ["10.0.0.5:52416", "pi.local:52416"]
    assert cfg.network.api.key == "s3cret"
    assert cfg.scheduler.partition.strategy == "memory"
    assert cfg.scheduler.load_balancing.auto_rebalance is True
    assert cfg.network.node_port == 6000
    assert env_overrides({"EXO_TUI_KNOWN_PEERS": ""}) == {"network.discovery.known_peers": []}


def test_bad_env_values_are_errors_naming_the_key(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="network.discovery.known_peers.*EXO_TUI_"):
        load_config(env=env | {"EXO_TUI_KNOWN_PEERS": "nohost"})
    with pytest.raises(ConfigError, match="unknown config key scheduler.nope"):
        load_config(env=env | {"EXO_TUI__SCHEDULER__NOPE": "1"})


def test_env_values_are_yaml_and_unknown_sections_are_named(env: dict[str, str]) -> None:
    got = env_overrides(env | {"exo_tui__network__discovery__known_peers": "[a:1, b:2]", "EXO_TUI__UI__THEME": "",
                               "EXO_TUI__SCHEDULER__SCORING__RESOURCE_WEIGHT": "0.5", "EXO_TUI__BOGUS__X": "1"})
    assert got == {"network.discovery.known_peers": ["a:1", "b:2"], "ui.theme": None,
                   "scheduler.scoring.resource_weight": 0.5, "bogus.x": 1}
    with pytest.raises(ConfigError, match="unknown config key bogus in the top level"):
        load_config(env=env | {"EXO_TUI__BOGUS__X": "1"})


def test_the_file_is_yaml_1_2_and_a_key_given_twice_is_an_error(tmp_path: Path, env: dict[str, str]) -> None:
    p = tmp_path / "config.yaml"
    p.write_text("scheduler:\n  load_balancing:\n    auto_rebalance: yes\n")
    with pytest.raises(ConfigError, match="auto_rebalance is 'yes'; it must be true or false"):
        load_config(p, env=env)
    p.write_text("ui:\n  theme: nord\nui:\n  theme: exo-light\n")
    with pytest.raises(ConfigError, match=rf"(?s)config file {re.escape(str(p))} is not valid YAML .*duplicate key"):
        load_config(p, env=env)


def test_save_changes_only_the_given_keys_and_keeps_comments(tmp_path: Path, env: dict[str, str]) -> None:
    p = tmp_path / "config.yaml"
    p.write_text(
        "# my cluster\n"
        "scheduler:\n"
        "  partition:\n"
        "    strategy: memory   # I like memory\n"
        "  scoring:\n"
        "    min_score_threshold: 40\n"
        "ui:\n"
        "  theme: exo-dark # the default\n"
    )
    save_config({"ui.theme": "exo-light"}, env=env)
    text = p.read_text()
    assert "# my cluster" in text and "# I like memory" in text and "theme: exo-light # the default" in text
    cfg = load_config(env=env)
    assert cfg.ui.theme == "exo-light"
    assert cfg.scheduler.partition.strategy == "memory" and cfg.scheduler.scoring.min_score_threshold == 40
    # a key in an existing section, and one in a new section
    save_config({"scheduler.partition.min_layers_per_shard": 2, "cluster.name": "lab"}, env=env)
    cfg = load_config(env=env)
    assert cfg.scheduler.partition.min_layers_per_shard == 2 and cfg.cluster.name == "lab"
    assert cfg.scheduler.partition.strategy == "memory"
    assert "# I like memory" in p.read_text()


def test_save_creates_the_file_and_handles_flow_style(tmp_path: Path, env: dict[str, str]) -> None:
    save_config({"ui.theme": "nord"}, env=env)
    assert load_config(env=env).ui.theme == "nord"
    p = tmp_path / "config.yaml"
    p.write_text("network:\n  api: {host: 127.0.0.1, port: 52415}\n")
    save_config({"network.api.port": 9000}, env=env)
    cfg = load_config(env=env)
    assert cfg.network.api.port == 9000 and cfg.network.api.host == "127.0.0.1"


def test_save_refuses_bad_values_and_leaves_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    p = tmp_path / "config.yaml"
    p.write_text("ui:\n  theme: exo-dark\n")
    with pytest.raises(ConfigError, match="scheduler.partition.strategy"):
        save_config({"scheduler.partition.strategy": "nope"}, env=env)
    with pytest.raises(ConfigError, match="unknown config key"):
        save_config({"ui.colour": "red"}, env=env)
    assert p.read_text() == "ui:\n  theme: exo-dark\n"


def test_a_nodes_backend_settings_are_config_keys_with_the_environment_over_them(tmp_path: Path, env: dict[str, str]) -> None:
    from backends.onnx import SETTINGS
    from exo_tui.config import ONNX_PRECISIONS

    assert set(ONNX_PRECISIONS) == set(SETTINGS)  # the config takes what the backend does
    node = load_config(env=env).node
    assert node.backend_settings("onnx") == {"precision": "auto", "spin": 15, "pin": False, "kernel": True}
    assert node.backend_settings("mlx") == {}
    p = tmp_path / "config.yaml"
    p.write_text("node:\n  threads: 4\n  onnx:\n    spin: 0\n    pin: true\n")
    node = load_config(p, env=env | {"EXO_TUI_ONNX_KERNEL": "off", "EXO_TUI_THREADS": "2"}).node
    assert node.backend_settings("onnx") == {"threads": 2, "precision": "auto", "spin": False, "pin": True, "kernel": False}
    assert node.backend_settings("mlx") == {"threads": 2}
    for name, value, says in (("EXO_TUI_THREADS", "many", "node.threads is 'many'; it must be an integer or null"),
                              ("EXO_TUI_THREADS", "0", "node.threads is 0; it must be a number >= 1"),
                              ("EXO_TUI_ONNX_PRECISION", "fp4", "node.onnx.precision is 'fp4'; it must be one of 'auto'"),
                              ("EXO_TUI_ONNX_PIN", "maybe", "node.onnx.pin is 'maybe'; it must be true or false")):
        with pytest.raises(ConfigError, match=re.escape(says) + r".*EXO_TUI_\* environment variable"):
            load_config(env=env | {name: value})
