"""Typed messages the console's workers post back to the UI (results by message, never by blocking)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from exo_tui.cluster.view import PlanPreview
from exo_tui.events import Event


@dataclass
class ClusterEventReceived(Message):
    """An event from the coordinator's bus."""

    event: Event


@dataclass
class PreviewReady(Message):
    """A plan-change preview came back; the confirmation opens on it."""

    preview: PlanPreview


@dataclass
class ActionDone(Message):
    """An operator action finished (``error`` empty when it worked). ``action``: a plan change's
    :class:`~exo_tui.cluster.view.Action` (``targets``: node ids), or ``bootstrap`` / ``add host``
    (``targets``: the host)."""

    action: str
    targets: tuple[str, ...]
    error: str = ""
    detail: str = ""


@dataclass
class HostKeyQuestion(Message):
    """A host presented a key we do not know: ask the operator before trusting it."""

    host: str
    fingerprint: str
    key_type: str = ""
    shown: str = ""  # how the host names itself (host:port)
