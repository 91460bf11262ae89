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
from typing import Any

from exo_tui import events as ev
from exo_tui.cluster import model_choices, model_switch
from exo_tui.cluster.snapshots import _to_view_preview
from exo_tui.cluster.view import (
    PLAN_ACTIONS,
    Command,
    HostView,
    ModelChoice,
    PlanPreview,
)
from exo_tui.inference.generate import GenerationError
from exo_tui.models.gguf_file import ModelFileError
from exo_tui.models.model import Model
from exo_tui.net.errors import RemoteError
from exo_tui.scheduler.diff import ChangePreview
from exo_tui.scheduler.partition import InfeasiblePlan
from exo_tui.scheduler.plan import Pin

log = logging.getLogger("exo_tui.cluster")


class OperatorActions:
    """Commands of the operator, previewed and applied, and their audit (a part of the Coordinator)."""

    # ================================================================== operator actions

    def _resolve(self, target: str, *, pinned: bool = False) -> str:
        """The node id ``target`` (an id or a name) names. ``pinned``: an id of a pinned node not
        in the cluster counts too (its pin can be taken off)."""
        if target in self.nodes or (pinned and target in self.pins):
            return target
        matches = [h.node_id for h in self.nodes.values() if h.name == target]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(sorted(h.name for h in self.nodes.values()))
        raise KeyError(f"no node {target!r}: known nodes are {known or 'none'}")

    def _proposed(
        self, action: str, ids: tuple[str, ...], layers: tuple[int, int] | None = None
    ) -> tuple[set[str], dict[str, Pin]]:
        """The drains and pins ``action`` on ``ids`` would leave (raises ValueError if it can't)."""
        drained, pins = set(self.drained), dict(self.pins)
        if layers is not None and action != "pin":
            raise ValueError(f"only a pin takes layers, not {action}")
        if action in ("drain", "remove"):
            drained |= set(ids)
        elif action == "undrain":
            idle = [self.nodes[n].name for n in ids if n not in drained]
            if idle:  # (not a fresh plan in disguise: on tight memory that moves every shard)
                raise ValueError(f"node {', '.join(idle)} is not drained: nothing to undrain")
            drained -= set(ids)
        elif action == "pin" and layers is not None:
            pins.update(self._ranged_pin(ids, layers, pins))
        elif action == "pin":
            for nid in ids:
                shard = self.plan.shard_of(nid) if self.plan else None
                if shard is None:
                    raise ValueError(f"node {self.nodes[nid].name} holds no layers to pin: pin a node that serves layers")
                pins[nid] = Pin(nid, shard.start, shard.end)
        elif action == "unpin":
            for nid in ids:
                pins.pop(nid, None)
        elif action != "rebalance":
            raise ValueError(f"unknown action {action!r}: use drain, undrain, pin, unpin, rebalance or remove")
        return drained, pins

    def _ranged_pin(self, ids: tuple[str, ...], layers: tuple[int, int], pins: dict[str, Pin]) -> dict[str, Pin]:
        """The pin of one node to ``layers`` (raises ValueError for a range no plan can keep)."""
        if len(ids) != 1:
            raise ValueError("a pin with layers names exactly one node")
        nid, (start, end) = ids[0], (int(layers[0]), int(layers[1]))
        n_layers = self.spec.n_layers if self.spec is not None else 0
        if not 0 <= start < end <= n_layers:
            raise ValueError(f"layers {start}-{end - 1} are not within the model's 0-{n_layers - 1}: "
                             f"give START-END with 0 <= START <= END <= {n_layers - 1}")
        for other, p in pins.items():
            if other != nid and p.start < end and start < p.end:
                raise ValueError(f"layers {start}-{end - 1} overlap the pin of {self.nodes[other].name} "
                                 f"({p.start}-{p.end - 1}): unpin it first")
        if self.nodes[nid].state == "failed":
            raise ValueError(f"node {self.nodes[nid].name} has failed: a pin needs a node that is up")
        if nid in self.drained:
            raise ValueError(f"node {self.nodes[nid].name} is drained: undrain it before pinning layers to it")
        return {nid: Pin(nid, start, end)}

    async def preview(self, command: Command) -> PlanPreview:
        if command.action == "model":  # the plan the model would have, its diff and bytes to load
            return await asyncio.to_thread(model_choices.preview, self, command.model, self._specs,
                                           _to_view_preview)
        if command.action not in PLAN_ACTIONS:
            return PlanPreview(command.action, command.targets, error=f"{command.action} is not a plan change: "
                                                                     "use set_model (or run_command)")
        return (await self._planned(command.action, command.targets, command.layers))[0]

    async def _planned(
        self, action: str, targets: tuple[str, ...], layers: tuple[int, int] | None
    ) -> tuple[PlanPreview, ChangePreview | None, set[str], dict[str, Pin]]:
        """What ``action`` would do now: the operator's view of it (targets resolved to node ids,
        or the error), the scheduler's change, and the drains and pins it would leave."""
        try:
            ids = tuple(self._resolve(t, pinned=action == "unpin") for t in targets)
            drained, pins = self._proposed(action, ids, layers)
        except (KeyError, ValueError) as exc:
            return PlanPreview(action, tuple(targets), error=str(exc.args[0]), layers=layers), None, set(), {}
        change = await asyncio.to_thread(self._preview, self.constraints(drained=drained, pins=pins))
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
        if preview.action == "model":
            try:
                await self.set_model(preview.targets[0])
            except (ModelFileError, GenerationError, InfeasiblePlan, RemoteError, ConnectionError, TimeoutError) as exc:
                return replace(preview, error=str(exc))
            return preview
        action, layers = preview.action, preview.layers
        result, change, drained, pins = await self._planned(action, preview.targets, layers)
        ids = result.targets  # resolved to node ids
        if not result.error and change is not None and change.new_plan is not None:
            self.drained, self.pins = drained, pins
            self._save_constraints()
            for nid in ids:
                if action in ("drain", "remove") and self.nodes[nid].state in ("ready", "loading"):
                    self.nodes[nid].state = "draining"
                    self.events.publish(ev.NodeStateChanged(node_id=nid, state="draining"))
            try:
                await self._switch(change.new_plan, f"{action} {' '.join(self.node_name(i) for i in ids)}".strip())
                if action == "remove":
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

    async def _replace_model(self, model: Model, name: str, spec: Any, key: str) -> None:
        """The switch that unloads the current model first (nothing serves until the new one
        is loaded)."""
        async with self._plan_lock:
            self.model, self.model_name, self.spec, self._model_key = model, name, spec, key
            self.plan, self.ring = None, None
            self.pins.clear()
            for h in self.nodes.values():
                if h.connected:
                    for start, end in list(h.held):
                        with contextlib.suppress(Exception):  # a node that cannot unload frees it when its plan goes
                            # its memory as it is now, for the plan made next (its last heartbeat's counts the shard)
                            h.note_kv((await h.conn.call("unload", {"start": start, "end": end}, timeout=30)).body)
                h.held.clear()
                h.shards = []
        await self.replan(f"model {model.name}")
