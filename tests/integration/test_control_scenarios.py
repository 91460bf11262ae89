"""One suite of operator scenarios, run against the console's test fake and a real coordinator
(three node agent processes on loopback, a tiny model): what one refuses the other refuses, in
the same words, and a preview changes nothing on either.

Each scenario speaks only the ClusterControl protocol (snapshot, preview, apply), so what it
asserts is what the console sees of the cluster, whichever implements it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from exo_tui.cluster.view import Action, ClusterControl, ClusterSnapshot, Command, run_command
from tests.tui.fake_cluster import FakeCluster

N_NODES = 3
N_LAYERS = 4  # the tiny model's


@pytest.fixture(scope="module")
def node_set(tmp_path_factory: pytest.TempPathFactory):  # -> NodeSet, started on first use
    from tests.integration.cluster_helpers import node_processes

    home = tmp_path_factory.mktemp("exo-home")
    os.environ["EXO_TUI_HOME"] = str(home)
    with node_processes(home, ["onnx"] * N_NODES) as nodes:
        yield nodes


Opener = Callable[[], contextlib.AbstractAsyncContextManager[ClusterControl]]


@pytest.fixture(params=["fake", pytest.param("coordinator", marks=pytest.mark.slow)])
def open_control(request: pytest.FixtureRequest, tiny_model: Path) -> Opener:
    """Opens the cluster a scenario runs on: the fake, or a coordinator over the module's nodes."""
    if request.param == "fake":
        @contextlib.asynccontextmanager
        async def fake() -> AsyncIterator[ClusterControl]:
            yield FakeCluster(n_nodes=N_NODES, n_layers=N_LAYERS)

        return fake
    from tests.integration.cluster_helpers import coordinator

    nodes = request.getfixturevalue("node_set")
    return lambda: coordinator(nodes, model=tiny_model, strategy="even")


def scenario(body: Callable[[ClusterControl, list[str]], Awaitable[None]]) -> Callable[[Opener], None]:
    """A test that runs ``body(control, node ids)`` on each implementation, its plan on every node."""

    def test(open_control: Opener) -> None:
        async def run() -> None:
            async with open_control() as control:
                snap = control.snapshot()
                assert snap.plan is not None and snap.plan.n_layers == N_LAYERS
                ids = sorted(n.node_id for n in snap.nodes)
                assert len(ids) == N_NODES and {s.node_id for s in snap.plan.shards} == set(ids)
                await body(control, ids)

        asyncio.run(run())

    test.__name__ = body.__name__
    test.__doc__ = body.__doc__
    return test


def state(snap: ClusterSnapshot) -> tuple[object, ...]:
    """What a change would change: the plan (version, shards, pins) and each node's standing."""
    assert snap.plan is not None
    return (snap.plan.version, tuple((s.node_id, s.start, s.end, s.pinned) for s in snap.plan.shards),
            tuple(sorted((n.node_id, n.state, n.drained, n.pinned, n.layers) for n in snap.nodes)))


async def refused(control: ClusterControl, command: Command, *words: str) -> None:
    """``command`` is refused, saying ``words``, both previewed and applied; nothing changes."""
    before = state(control.snapshot())
    preview = await control.preview(command)
    assert preview.error, f"{command}: no error"
    assert all(w in preview.error for w in words), preview.error
    result = await control.apply(preview)
    assert result.error and all(w in result.error for w in words), result.error
    assert state(control.snapshot()) == before


async def applied(control: ClusterControl, command: Command) -> None:
    done = await run_command(control, command)
    assert not done.error, f"{command}: {done.error}"


@scenario
async def test_an_undrain_of_a_node_not_drained_is_refused(control: ClusterControl, ids: list[str]) -> None:
    await refused(control, Command(Action.UNDRAIN, (ids[0],)), "is not drained", "nothing to undrain")


@scenario
async def test_a_pin_beyond_the_model_is_refused(control: ClusterControl, ids: list[str]) -> None:
    await refused(control, Command(Action.PIN, (ids[0],), (2, N_LAYERS + 1)), "not within the model's 0-3")


@scenario
async def test_a_pin_overlapping_another_is_refused(control: ClusterControl, ids: list[str]) -> None:
    await applied(control, Command(Action.PIN, (ids[0],), (0, 2)))
    assert {(s.node_id, s.start, s.end) for s in control.snapshot().plan.shards if s.pinned} == {(ids[0], 0, 2)}  # type: ignore[union-attr]
    await refused(control, Command(Action.PIN, (ids[1],), (1, 3)), "overlap the pin of", "unpin it first")


@scenario
async def test_a_pin_on_a_drained_node_is_refused(control: ClusterControl, ids: list[str]) -> None:
    await applied(control, Command(Action.DRAIN, (ids[2],)))
    node = next(n for n in control.snapshot().nodes if n.node_id == ids[2])
    assert node.drained and node.layers is None
    await refused(control, Command(Action.PIN, (ids[2],), (0, 1)), "is drained", "undrain it before pinning")
    await refused(control, Command(Action.PIN, (ids[2],)), "holds no layers to pin")


@scenario
async def test_an_unknown_node_is_refused(control: ClusterControl, ids: list[str]) -> None:
    await refused(control, Command(Action.DRAIN, ("no-such-node",)), "no node 'no-such-node'", "known nodes are")


@scenario
async def test_a_change_that_leaves_layers_unheld_is_refused(control: ClusterControl, ids: list[str]) -> None:
    """Pinned nodes hold their pins only: draining the last unpinned node would leave layers to nobody."""
    await applied(control, Command(Action.PIN, (ids[0],), (0, 1)))
    await applied(control, Command(Action.DRAIN, (ids[2],)))
    await refused(control, Command(Action.DRAIN, (ids[1],)), "the pins leave 1 ranges of layers unheld")
    await refused(control, Command(Action.REMOVE, (ids[1],)), "the pins leave 1 ranges of layers unheld")


async def unchanged_by_previews(control: ClusterControl, *commands: Command) -> None:
    before = state(control.snapshot())
    for command in commands:
        preview = await control.preview(command)
        assert not preview.error, f"{command}: {preview.error}"
        assert preview.new_plan is not None and preview.targets == command.targets
        assert state(control.snapshot()) == before, command


@scenario
async def test_previews_change_nothing(control: ClusterControl, ids: list[str]) -> None:
    """Every plan change previewed, on a fresh cluster, then with a drained and a pinned node:
    nothing moves until one is applied."""
    await unchanged_by_previews(control, Command(Action.DRAIN, (ids[1],)), Command(Action.PIN, (ids[1],), (2, 4)),
                                Command(Action.PIN, (ids[1],)), Command(Action.UNPIN, (ids[0],)),
                                Command(Action.REBALANCE), Command(Action.REMOVE, (ids[1],)))
    await applied(control, Command(Action.DRAIN, (ids[2],)))
    await applied(control, Command(Action.PIN, (ids[0],), (0, 1)))
    await unchanged_by_previews(control, Command(Action.UNDRAIN, (ids[2],)), Command(Action.PIN, (ids[1],), (1, 4)),
                                Command(Action.PIN, (ids[1],)), Command(Action.UNPIN, (ids[0],)), Command(Action.REBALANCE))
    undrain = await control.preview(Command(Action.UNDRAIN, (ids[2],)))
    assert ids[2] in {s.node_id for s in undrain.new_plan.shards}  # type: ignore[union-attr]
    await control.apply(undrain)
    assert ids[2] in {s.node_id for s in control.snapshot().plan.shards}  # type: ignore[union-attr]
