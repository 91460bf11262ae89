"""The one keymap: ids are unique, every action exists where its scope binds it, help and palette agree."""

from __future__ import annotations

import pytest

from exo_tui.tui import keymap
from exo_tui.tui.app import ExoApp
from exo_tui.tui.screens.detail import NodeDetailScreen
from exo_tui.tui.screens.dialogs import ConfirmChange
from exo_tui.tui.screens.hosts import HostsScreen
from exo_tui.tui.screens.models import ModelsScreen
from exo_tui.tui.widgets.chat import ChatInput, ChatPane
from exo_tui.tui.widgets.events import EventsLog
from exo_tui.tui.widgets.nodes import NodesTable

SCOPE_CLASSES = {
    "global": [ExoApp],
    "nodes": [NodesTable],
    "chat": [ChatPane, ChatInput],
    "events": [EventsLog],
    "hosts": [HostsScreen],
    "models": [ModelsScreen],
    "detail": [NodeDetailScreen],
    "confirm": [ConfirmChange],
}


def test_ids_are_unique() -> None:
    ids = [k.id for k in keymap.KEYS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("spec", keymap.KEYS, ids=lambda k: k.id)
def test_every_action_exists(spec: keymap.KeySpec) -> None:
    name = spec.action.split("(")[0]
    if name.startswith("app."):
        assert hasattr(ExoApp, "action_" + name[4:])
        return
    classes = SCOPE_CLASSES[spec.scope]
    assert any(hasattr(cls, "action_" + name) for cls in classes), f"{spec.id}: no action_{name} on {classes}"


def test_bindings_carry_ids() -> None:
    for scope in keymap.SCOPES:
        for binding in keymap.bindings(scope):
            assert binding.id and binding.id.startswith("exo.")


def test_the_classes_bind_from_the_keymap() -> None:
    nodes_ids = {b.id for b in NodesTable.BINDINGS}
    assert {"exo.nodes.drain", "exo.nodes.mark", "exo.nodes.pin"} <= nodes_ids
    assert {b.id for b in ExoApp.BINDINGS} >= {"exo.help", "exo.command", "exo.pause", "exo.quit"}


def test_readonly_help_hides_dangerous_keys() -> None:
    full = {row[1] for row in keymap.help_rows("nodes")}
    ro = {row[1] for row in keymap.help_rows("nodes", readonly=True)}
    assert {"Drain", "Undrain", "Pin", "Rebalance"} <= full
    assert not {"Drain", "Undrain", "Pin", "Rebalance"} & ro
    assert "Help" in ro
    assert "model" not in keymap.command_names(readonly=True)


def test_parse_command() -> None:
    assert keymap.parse_command(":theme exo-light") == ("theme", "exo-light")
    assert keymap.parse_command("  :Nodes ") == ("nodes", "")
    assert keymap.parse_command(":") == ("", "")
