"""Every key of the console, in one place.

The same table feeds the widgets' ``BINDINGS`` (each with an id, so a user keymap can remap it),
the help screen (``?`` shows the focused pane's keys and the global ones), the ``:`` command mode
and the ``ctrl+p`` palette. Dangerous actions (drain, rebalance, remove...) are flagged so
``--readonly`` can hide them everywhere at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding, BindingType

# Scopes: where a key works. "global" keys work on the main screen whatever pane has focus
# (unless a text input takes the key).
SCOPES = ("global", "nodes", "chat", "events", "hosts", "models", "detail", "confirm")
SCOPE_TITLES = {
    "global": "Everywhere",
    "nodes": "Nodes table",
    "chat": "Chat",
    "events": "Events log",
    "hosts": "Hosts view",
    "models": "Model picker",
    "detail": "Node detail",
    "confirm": "Confirmation",
}


@dataclass(frozen=True)
class KeySpec:
    id: str  # binding id, e.g. "exo.nodes.drain" (remappable)
    key: str  # Textual key string ("D", "space", "ctrl+p")
    action: str  # Textual action name on the widget/screen of the scope
    description: str  # short, for the footer and palette
    scope: str
    help: str = ""  # one sentence for the help screen and tooltips
    dangerous: bool = False  # hidden and refused in --readonly
    show: bool = True  # shown in the footer
    key_display: str | None = None
    priority: bool = False  # opens a text box: runs before keys typed right after it are delivered

    def binding(self) -> Binding:
        return Binding(
            self.key,
            self.action,
            self.description,
            show=self.show,
            key_display=self.key_display,
            priority=self.priority,
            tooltip=self.help,
            id=self.id,
        )


KEYS: tuple[KeySpec, ...] = (
    # ------------------------------------------------------------------ everywhere
    KeySpec("exo.help", "question_mark", "help", "Help", "global", "Keys of the focused pane", key_display="?"),
    KeySpec("exo.chat", "c", "focus_chat", "Chat", "global", "Move to the chat box to ask the model (esc comes back)", show=False, priority=True),
    KeySpec("exo.command", "colon", "command_mode", "Command", "global", "Type a command: :nodes :hosts :chat :events :model :theme", key_display=":", priority=True),
    KeySpec("exo.palette", "ctrl+p", "command_palette", "Palette", "global", "Search every action", show=False),
    KeySpec("exo.rebalance", "R", "rebalance", "Rebalance", "global", "Preview a rebalance of the whole plan, then apply it", dangerous=True),
    KeySpec("exo.bootstrap", "b", "bootstrap", "Bootstrap", "global", "Install and start a node agent on a host (opens the hosts view)", dangerous=True, show=False),
    KeySpec("exo.add_host", "a", "add_host", "Add host", "global", "Add a host by name or address", dangerous=True, show=False),
    KeySpec("exo.model", "m", "choose_model", "Model", "global", "Choose the model the cluster serves", dangerous=True, show=False),
    KeySpec("exo.theme", "t", "toggle_theme", "Theme", "global", "Switch between exo-dark and exo-light (:theme NAME for any)", show=False),
    KeySpec("exo.strip", "M", "toggle_strip", "Metrics", "global", "Show or hide the cluster strip: measured requests, latencies, the ring's split of a token, sparklines", show=False),
    KeySpec("exo.pause", "Z", "toggle_pause", "Pause", "global", "Pause or resume the live refresh"),
    KeySpec("exo.maximize", "f", "maximize_pane", "Full pane", "global", "Show the focused pane alone; f or esc again to restore", show=False),
    KeySpec("exo.focus_next", "tab", "app.focus_next", "Next pane", "global", "Move focus to the next pane", show=False),
    KeySpec("exo.quit", "q", "back", "Back/Quit", "global", "Close this view; on the main screen, quit"),
    # ------------------------------------------------------------------ nodes table
    KeySpec("exo.nodes.details", "enter", "details", "Details", "nodes", "Profile, score breakdown, sparklines and shards of the node"),
    KeySpec("exo.nodes.mark", "space", "mark", "Mark", "nodes", "Mark or unmark the node; D/U act on the marked set"),
    KeySpec("exo.nodes.filter", "slash", "filter", "Filter", "nodes", "Show only nodes whose name, address or state contains the text", key_display="/", priority=True),
    KeySpec("exo.nodes.drain", "D", "drain", "Drain", "nodes", "Move all layers off the marked (or selected) nodes", dangerous=True),
    KeySpec("exo.nodes.undrain", "U", "undrain", "Undrain", "nodes", "Let the marked (or selected) nodes take layers again", dangerous=True),
    KeySpec("exo.nodes.pin", "p", "pin", "Pin", "nodes", "Pin or unpin the selected node's current layers", dangerous=True),
    KeySpec("exo.nodes.pin_layers", "P", "pin_layers", "Pin layers", "nodes", "Pin a range of layers to the selected node, moving them there", dangerous=True, show=False),
    KeySpec("exo.nodes.remove", "X", "remove", "Remove", "nodes", "Drain and forget the marked (or selected) nodes", dangerous=True, show=False),
    # ------------------------------------------------------------------ chat
    KeySpec("exo.chat.stop", "escape", "stop", "Stop", "chat", "Stop the answer; the partial text stays"),
    KeySpec("exo.chat.history_prev", "up", "history(-1)", "Previous prompt", "chat", "Recall the previous prompt", show=False),
    KeySpec("exo.chat.history_next", "down", "history(1)", "Next prompt", "chat", "Recall the next prompt", show=False),
    KeySpec("exo.chat.page_up", "pageup", "scroll_log(-1)", "Scroll up", "chat", "Scroll the answers up a page (the view stays put while new text arrives)", show=False),
    KeySpec("exo.chat.page_down", "pagedown", "scroll_log(1)", "Scroll down", "chat", "Scroll the answers down; at the bottom it follows the answer again", show=False),
    KeySpec("exo.chat.clear", "ctrl+l", "clear", "Clear chat", "chat", "Start a new conversation", show=False),
    # ------------------------------------------------------------------ events
    KeySpec("exo.events.follow", "G", "follow", "Follow", "events", "Jump to the newest event and follow"),
    # ------------------------------------------------------------------ hosts view
    KeySpec("exo.hosts.bootstrap", "b", "bootstrap", "Bootstrap", "hosts", "Install and start a node agent on the selected host", dangerous=True),
    KeySpec("exo.hosts.add", "a", "add_host", "Add host", "hosts", "Add a host by name or address", dangerous=True),
    KeySpec("exo.hosts.filter", "slash", "filter", "Filter", "hosts", "Show only matching hosts", key_display="/", priority=True),
    KeySpec("exo.hosts.back", "q,escape", "back", "Back", "hosts", "Back to the nodes"),
    # ------------------------------------------------------------------ model picker
    KeySpec("exo.models.choose", "enter", "choose", "Load", "models", "Show what loading the selected model changes, then load it across the cluster", dangerous=True),
    KeySpec("exo.models.filter", "slash", "filter", "Filter", "models", "Show only models whose name, family, quant or place contains the text", key_display="/", priority=True),
    KeySpec("exo.models.reload", "r", "reload", "Rescan", "models", "Look for models again and plan each on the cluster as it is now"),
    KeySpec("exo.models.back", "q,escape", "back", "Back", "models", "Back to the nodes (a load goes on)"),
    # ------------------------------------------------------------------ node detail
    KeySpec("exo.detail.back", "q,escape", "back", "Back", "detail", "Back to the nodes"),
    # ------------------------------------------------------------------ confirmation
    KeySpec("exo.confirm.cancel", "escape,n", "cancel", "Cancel", "confirm", "Change nothing"),
    KeySpec("exo.confirm.apply", "y", "apply", "Apply", "confirm", "Carry out the change shown"),
)

# ``:`` commands: name -> (description, takes an argument)
COMMANDS: dict[str, tuple[str, bool]] = {
    "nodes": ("Focus the nodes table", False),
    "hosts": ("Open the hosts view (discovered and configured hosts, bootstrap)", False),
    "chat": ("Focus the chat", False),
    "events": ("Focus the events log", False),
    "model": ("Choose the model (:model NAME to set it)", True),
    "theme": ("Choose a theme (:theme NAME to set it)", True),
    "set": ("Chat sampling: :set temperature 0, :set top_p default (the model's); :set alone shows them", True),
    "rebalance": ("Preview a rebalance", False),
    "unpin": ("Take a pin off: :unpin NODE (a name, or the id of a node not in the cluster)", True),
    "metrics": ("Show or hide the cluster strip of measured figures (M)", False),
    "pause": ("Pause or resume the live refresh", False),
    "help": ("Show the keys", False),
    "quit": ("Quit exo-tui", False),
}
DANGEROUS_COMMANDS = frozenset({"model", "rebalance", "unpin"})


def specs(scope: str) -> tuple[KeySpec, ...]:
    return tuple(k for k in KEYS if k.scope == scope)


def bindings(scope: str) -> list[BindingType]:
    """The ``BINDINGS`` of the widget or screen that serves ``scope``."""
    return [k.binding() for k in specs(scope)]


def dangerous_actions(scope: str) -> frozenset[str]:
    return frozenset(k.action for k in specs(scope) if k.dangerous)


def display_key(spec: KeySpec) -> str:
    if spec.key_display:
        return spec.key_display
    names = {"escape": "esc", "space": "space", "enter": "enter", "up": "↑", "down": "↓"}
    return "/".join(names.get(k, k) for k in spec.key.split(","))


def scope_rows(scope: str, *, readonly: bool = False) -> list[tuple[str, str, str]]:
    """(key, description, help) of one scope's keys."""
    return [(display_key(k), k.description, k.help) for k in specs(scope) if not (readonly and k.dangerous)]


def help_rows(scope: str, *, readonly: bool = False) -> list[tuple[str, str, str]]:
    """Rows for the help screen: the scope's keys, then the global ones."""
    scopes = [scope] if scope == "global" else [scope, "global"]
    return [row for s in scopes for row in scope_rows(s, readonly=readonly)]


def command_names(*, readonly: bool = False) -> list[str]:
    return [c for c in COMMANDS if not (readonly and c in DANGEROUS_COMMANDS)]


def parse_command(text: str) -> tuple[str, str]:
    """``":theme exo-light"`` -> ``("theme", "exo-light")``; unknown names come back as they are."""
    text = text.strip().lstrip(":").strip()
    name, _, arg = text.partition(" ")
    return name.lower(), arg.strip()
