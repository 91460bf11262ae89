"""Operator actions and their audit: the drains and pins a :class:`~exo_tui.cluster.view.Command`
would leave, its preview and application, bootstrap, hosts, the model, and the audit log.

A part of :class:`~exo_tui.cluster.coordinator.Coordinator`, which holds the state it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from exo_tui import events as ev
from exo_tui.cluster import model_choices, model_switch
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.proposal import ClusterState, propose
from exo_tui.cluster.snapshots import _to_view_preview
from exo_tui.cluster.view import (
    Action,
    Command,
    HostView,
    ModelChoice,
    PlanPreview,
)
from exo_tui.inference.generate import GenerationError
from exo_tui.models.gguf_file import ModelFileError
from exo_tui.models.model import Model
from exo_tui.net.errors import RemoteError
from exo_tui.scheduler.context import InfeasiblePlan
from exo_tui.scheduler.diff import ChangePreview
from exo_tui.scheduler.plan import Pin
from exo_tui.scheduler.spec import ModelSpec

log = logging.getLogger("exo_tui.cluster")


class OperatorActions(CoordinatorParts):
    """Commands of the operator, previewed and applied, and their audit (a part of the Coordinator)."""

    # ================================================================== operator actions

    def _state(self) -> ClusterState:
        """The cluster as a command is checked against (see :mod:`exo_tui.cluster.proposal`)."""
        held: dict[str, tuple[int, int]] = {}
        for shard in self.plan.shards if self.plan is not None else ():
            held.setdefault(shard.node_id, (shard.start, shard.end))
        return ClusterState(
            names={nid: h.name for nid, h in self.nodes.items()}, drained=frozenset(self.drained), pins=self.pins,
            held=held, failed=frozenset(nid for nid, h in self.nodes.items() if h.state == "failed"),
            n_layers=self.spec.n_layers if self.spec is not None else 0)

    async def preview(self, command: Command) -> PlanPreview:
        if command.action is Action.MODEL:  # the plan the model would have, its diff and bytes to load
            return await asyncio.to_thread(model_choices.preview, self, command.model, self._specs,
                                           _to_view_preview)
        return (await self._planned(command))[0]

    async def _planned(
        self, command: Command
    ) -> tuple[PlanPreview, ChangePreview | None, set[str], dict[str, Pin]]:
        """What ``command`` (a plan change) would do now: the operator's view of it (targets
        resolved to node ids, or the error), the scheduler's change, and the drains and pins it
        would leave."""
        action, layers = command.action, command.layers
        try:
            state = self._state()
            ids = state.resolve(command)
            drained, pins = propose(command, ids, state)
        except ValueError as exc:
            return PlanPreview(action, command.targets, error=str(exc), layers=layers), None, set(), {}
        change = await asyncio.to_thread(self._preview, self.constraints(drained=drained, pins=pins), self.device_profiles())
        view = replace(_to_view_preview(action, ids, change, self, self._streaming_note()), layers=layers)
        return view, change, drained, pins

    def _streaming_note(self) -> str:
        if not self._active:
            return ""
        return f"{len(self._active)} answer(s) streaming: the switch happens between two tokens and their caches move with it"

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        """Carry out an action previewed with :meth:`preview`, planned afresh on the cluster as
        it is now (it may have changed since the preview); returns what was done."""
        if self.readonly:
            return replace(preview, error="read-only console: changes are disabled")
        if preview.action is Action.MODEL:
            try:
                await self.set_model(preview.targets[0])
            except (ModelFileError, GenerationError, InfeasiblePlan, RemoteError, ConnectionError, TimeoutError) as exc:
                return replace(preview, error=str(exc))
            return preview
        action, layers = preview.action, preview.layers
        try:
            command = preview.command
        except ValueError as exc:
            return replace(preview, error=str(exc))
        result, change, drained, pins = await self._planned(command)
        ids = result.targets  # resolved to node ids
        if not result.error and change is not None and change.new_plan is not None:
            self.drained, self.pins = drained, pins
            self._save_constraints()
            for nid in ids:
                if action in (Action.DRAIN, Action.REMOVE) and self.nodes[nid].state in ("ready", "loading"):
                    self.nodes[nid].state = "draining"
                    self.events.publish(ev.NodeStateChanged(node_id=nid, state="draining"))
            try:
                await self._switch(change.new_plan, f"{action} {' '.join(self.node_name(i) for i in ids)}".strip())
                if action is Action.REMOVE:
                    for nid in ids:
                        await self._forget(nid)
                self._last_rebalance_s = time.monotonic()
            except (GenerationError, InfeasiblePlan, RemoteError, ConnectionError, TimeoutError, KeyError) as exc:
                result = replace(result, error=str(exc))
        elif not result.error:
            result = replace(result, error="no plan")
        names = " ".join(self.node_name(i) for i in ids)
        if layers is not None:
            names = f"{names} layers {layers[0]}-{layers[1] - 1}"
        self._audit(action, names, "ok" if not result.error else f"error: {result.error}",
                    f"{len(result.moves)} moves, {result.bytes_moved / 1e6:.1f} MB, "
                    f"{result.tok_per_s_before:.1f} → {result.tok_per_s_after:.1f} tok/s")
        return result

    def _audit(self, action: str, target: str, result: str, detail: str = "") -> None:
        """An operator action: on the event stream and in the persisted audit log."""
        if self.store is not None:
            self.store.audit(action, target, result, detail)
        self.events.publish(ev.OperatorAction(action=action, target=target, result=result, detail=detail))

    async def _forget(self, node_id: str) -> None:
        h = self.nodes.pop(node_id, None)
        self.drained.discard(node_id)
        self.pins.pop(node_id, None)
        if h is not None and h.conn is not None:
            await h.conn.aclose()
        if h is not None:
            self.events.publish(ev.NodeGone(node_id=node_id, name=h.name))
        if self.store is not None:
            self.store.forget_node(node_id)
        self._save_constraints()

    async def bootstrap(self, host: str, *, accept_new_host_key: bool = False) -> None:
        from exo_tui.bootstrap import bootstrap_host  # heavy: asyncssh

        def progress(event: ev.Event) -> None:
            self.events.publish(event)

        result = await bootstrap_host(host, accept_new_host_key=accept_new_host_key, on_event=progress, home=self.home)
        await self.add_node(result.host, result.port)
        await self._after_membership_change(f"node {host} joined")

    async def add_host(self, host: str) -> None:
        self.hosts[host] = HostView(host=host, source="manual")
        if self.store is not None:
            self.store.remember_host(host, 22, "manual")
        self._audit("add_host", host, "ok")
        self.events.publish(ev.HostDiscovered(host=host, source="manual"))
        self._touch()

    async def set_model(self, name_or_path: str) -> None:
        """Serve another model: see :mod:`exo_tui.cluster.model_switch` (the current one serves
        while the new one loads, where the nodes can hold both)."""
        model = await asyncio.to_thread(lambda: Model(name_or_path, paths=self.config.models.paths))
        _ = await asyncio.to_thread(lambda: model.tokenizer)
        await model_switch.switch(self, model, name_or_path)
        self._audit("model", model.name, "ok")

    async def models(self) -> list[ModelChoice]:
        """The machine's models, each planned on the cluster as it is (see cluster/model_choices.py)."""
        return await asyncio.to_thread(model_choices.choices, self, self._specs)

    async def _replace_model(self, model: Model, name: str, spec: ModelSpec, key: str) -> None:
        """The switch that unloads the current model first (nothing serves until the new one
        is loaded)."""
        async with self._plan_lock:
            self.model, self.model_name, self.spec, self._model_key = model, name, spec, key
            self.plan, self.ring = None, None
            self.pins.clear()
            for h in self.nodes.values():
                if h.live_conn is not None:
                    for start, end in list(h.held):
                        with contextlib.suppress(Exception):  # a node that cannot unload frees it when its plan goes
                            # its memory as it is now, for the plan made next (its last heartbeat's counts the shard)
                            await h.unload(start, end)
                h.held.clear()
                h.shards = []
        await self.replan(f"model {model.name}")
