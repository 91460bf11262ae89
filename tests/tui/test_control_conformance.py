"""Every ClusterControl says the same thing: the console's test fake, the coordinator and the
HTTP client (``exo-tui --attach``) have each member of the protocol, with its parameters. What
they do is one suite of scenarios run on the fake and a coordinator:
tests/integration/test_control_scenarios.py."""

from __future__ import annotations

import inspect

import pytest

from exo_tui.api.client import ClusterClient
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.view import ClusterControl, Command, ServingCluster, run_command
from exo_tui.config import Config
from tests.tui.fake_cluster import FakeCluster

MEMBERS = sorted(
    name for name, member in vars(ClusterControl).items()
    if not name.startswith("_") and inspect.isfunction(member)
)


def _parameters(fn: object) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def test_the_protocol_has_the_members_the_front_ends_use() -> None:
    assert MEMBERS == ["add_host", "apply", "bootstrap", "chat", "models", "preview", "set_model", "snapshot"]


@pytest.mark.parametrize("implementation", [FakeCluster, Coordinator, ClusterClient], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", MEMBERS)
def test_each_implementation_takes_what_the_protocol_says(implementation: type, name: str) -> None:
    want = getattr(ClusterControl, name)
    got = getattr(implementation, name, None)
    assert got is not None, f"{implementation.__name__} has no {name}"
    assert _parameters(got) == _parameters(want), f"{implementation.__name__}.{name}"
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want) or (
        inspect.isasyncgenfunction(got) and name == "chat"), f"{implementation.__name__}.{name} is not awaited alike"


def test_the_fake_is_a_cluster_control() -> None:
    assert isinstance(FakeCluster(), ClusterControl)


def test_commands_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown action 'drian'"):
        Command("drian", ("n0",))
    with pytest.raises(ValueError, match="only a pin takes layers"):
        Command("drain", ("n0",), (0, 4))
    with pytest.raises(ValueError, match="start must be >= 0 and below end"):
        Command("pin", ("n0",), (5, 5))
    with pytest.raises(ValueError, match="takes a model name"):
        Command("model")
    assert str(Command("pin", ("mini",), (0, 15))) == "pin mini layers 0-14"
    assert str(Command("model", model="smollm2-135m")) == "model smollm2-135m"


async def test_a_model_command_loads_the_model() -> None:
    fake = FakeCluster()
    done = await run_command(fake, Command("model", model="other.gguf"))
    assert fake.model == "other.gguf" and done.action == "model" and not done.error


def test_the_coordinator_serves_the_api_through_the_serving_protocol(tmp_path) -> None:  # noqa: ANN001
    for name in ("serve_error", "generate"):
        assert _parameters(getattr(Coordinator, name)) == _parameters(getattr(ServingCluster, name)), name
    coordinator = Coordinator(config=Config(), home=tmp_path, persist=False)
    assert isinstance(coordinator, ServingCluster)  # every member, the attributes included
    assert "no plan yet" in coordinator.serve_error()  # nothing serves before it starts
    assert not isinstance(FakeCluster(), ServingCluster)  # the console's fake needs none of it
