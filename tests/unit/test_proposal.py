"""Commands are closed types, checked once; a target names a node by one rule everywhere."""

from __future__ import annotations

import pytest

from exo_tui.cluster.proposal import ClusterState, NodeNotFound, propose, resolve_node
from exo_tui.cluster.view import Action, Command, PlanPreview
from exo_tui.scheduler.plan import Pin

NODES = [("n1", "mini"), ("n2", "pi"), ("n3", "pi")]


def test_a_target_is_an_id_or_a_name_only_one_node_has() -> None:
    assert resolve_node("n2", NODES) == "n2"
    assert resolve_node("mini", NODES) == "n1"
    with pytest.raises(NodeNotFound, match=r"no node 'pi': 2 nodes have that name: use its id \(n2, n3\)"):
        resolve_node("pi", NODES)
    with pytest.raises(NodeNotFound, match="no node 'mac': known nodes are mini, pi, pi"):
        resolve_node("mac", NODES)
    assert resolve_node("gone", NODES, pinned={"gone"}) == "gone"  # an unpin of a node that left


def test_actions_and_previews_are_closed() -> None:
    assert Command("drain", ("n1",)).action is Action.DRAIN
    with pytest.raises(ValueError, match="unknown action 'drian': use drain, undrain, pin, unpin, rebalance, remove, model"):
        Command("drian", ("n1",))
    with pytest.raises(ValueError, match="unknown action 'pinn'"):
        PlanPreview("pinn", ("n1",))
    with pytest.raises(ValueError, match="a pin with layers names exactly one node"):
        Command(Action.PIN, ("n1", "n2"), (0, 2))
    preview = PlanPreview("pin", ["n1"], layers=(0, 2))
    assert preview.action is Action.PIN and preview.command == Command(Action.PIN, ("n1",), (0, 2))
    assert PlanPreview(Action.MODEL, ("m.gguf",)).command == Command(Action.MODEL, model="m.gguf")


def test_a_proposal_leaves_the_drains_and_pins_the_command_asks_for() -> None:
    state = ClusterState(names=dict(NODES), drained=frozenset({"n3"}), pins={"n1": Pin("n1", 0, 2)},
                         held={"n1": (0, 2), "n2": (2, 8)}, n_layers=8)
    assert propose(Command(Action.UNDRAIN, ("n3",)), ("n3",), state) == (set(), {"n1": Pin("n1", 0, 2)})
    assert propose(Command(Action.PIN, ("n2",)), ("n2",), state)[1]["n2"] == Pin("n2", 2, 8)
    assert propose(Command(Action.PIN, ("n2",), (2, 4)), ("n2",), state)[1]["n2"] == Pin("n2", 2, 4)
    assert propose(Command(Action.UNPIN, ("n1",)), ("n1",), state)[1] == {}
    assert state.pins == {"n1": Pin("n1", 0, 2)} and state.drained == {"n3"}  # the state is left as it was
    with pytest.raises(ValueError, match="node pi is not drained"):
        propose(Command(Action.UNDRAIN, ("n2",)), ("n2",), state)
    with pytest.raises(ValueError, match="not within the model's 0-7"):
        propose(Command(Action.PIN, ("n2",), (4, 9)), ("n2",), state)
    with pytest.raises(ValueError, match=r"overlap the pin of mini \(0-1\)"):
        propose(Command(Action.PIN, ("n2",), (1, 3)), ("n2",), state)
    with pytest.raises(ValueError, match="node pi is drained"):
        propose(Command(Action.PIN, ("n3",), (4, 6)), ("n3",), state)
    with pytest.raises(ValueError, match="holds no layers to pin"):
        propose(Command(Action.PIN, ("n3",)), ("n3",), state)
