"""The coordinator's persisted state: SQLite in WAL mode, in the exo-tui home.

Known nodes and hosts, pins, drains, the plan in force, and an audit log of operator actions
(time, action, target, result). A restarted coordinator reads it back: it reconnects to the
nodes it knew, restores pins and drains, and adopts the plan (the nodes still hold its shards).
Writes are small and synchronous; they happen on operator actions and plan changes, never on the
token path.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, name TEXT NOT NULL, host TEXT NOT NULL, port INTEGER NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS hosts (
    host TEXT PRIMARY KEY, port INTEGER NOT NULL, source TEXT NOT NULL, user TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS pins (node_id TEXT PRIMARY KEY, start INTEGER NOT NULL, end_ INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS drains (node_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS plan (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL,
    model TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL,
    result TEXT NOT NULL, detail TEXT NOT NULL DEFAULT ''
);
"""


@dataclass(frozen=True)
class KnownNode:
    node_id: str
    name: str
    host: str
    port: int
    last_seen: float


@dataclass(frozen=True)
class AuditEntry:
    ts: float
    action: str
    target: str
    result: str
    detail: str


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise RuntimeError(
                f"the coordinator's state file {self.path} cannot be used ({exc}): move it away to start "
                "with a fresh state (nodes, pins and drains are then forgotten)"
            ) from exc
        self.path.chmod(0o600)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        with self._lock:
            self._db.execute(sql, args)

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args))

    # ---------------------------------------------------------------- nodes and hosts

    def remember_node(self, node_id: str, name: str, host: str, port: int) -> None:
        self._write(
            "INSERT INTO nodes VALUES (?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET "
            "name=excluded.name, host=excluded.host, port=excluded.port, last_seen=excluded.last_seen",
            (node_id, name, host, port, time.time()),
        )

    def forget_node(self, node_id: str) -> None:
        for table in ("nodes", "pins", "drains"):
            self._write(f"DELETE FROM {table} WHERE node_id = ?", (node_id,))

    def known_nodes(self) -> list[KnownNode]:
        return [KnownNode(*row) for row in self._read("SELECT node_id, name, host, port, last_seen FROM nodes")]

    def remember_host(self, host: str, port: int, source: str, user: str = "") -> None:
        self._write("INSERT OR REPLACE INTO hosts VALUES (?, ?, ?, ?)", (host, port, source, user))

    def known_hosts(self) -> list[tuple[str, int, str, str]]:
        return [tuple(r) for r in self._read("SELECT host, port, source, user FROM hosts")]  # type: ignore[misc]

    # ---------------------------------------------------------------- pins, drains, plan

    def save_pins(self, pins: dict[str, tuple[int, int]]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM pins")
            self._db.executemany("INSERT INTO pins VALUES (?, ?, ?)", [(n, a, b) for n, (a, b) in pins.items()])
            self._db.execute("COMMIT")

    def pins(self) -> dict[str, tuple[int, int]]:
        return {n: (a, b) for n, a, b in self._read("SELECT node_id, start, end_ FROM pins")}

    def save_drains(self, drained: set[str]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM drains")
            self._db.executemany("INSERT INTO drains VALUES (?)", [(n,) for n in sorted(drained)])
            self._db.execute("COMMIT")

    def drains(self) -> set[str]:
        return {r[0] for r in self._read("SELECT node_id FROM drains")}

    def save_plan(self, version: int, model: str, body: dict[str, Any]) -> None:
        self._write("INSERT OR REPLACE INTO plan VALUES (1, ?, ?, ?)", (version, model, json.dumps(body)))

    def plan(self) -> tuple[int, str, dict[str, Any]] | None:
        rows = self._read("SELECT version, model, body FROM plan WHERE id = 1")
        if not rows:
            return None
        version, model, body = rows[0]
        return int(version), str(model), json.loads(body)

    # ---------------------------------------------------------------- audit

    def audit(self, action: str, target: str, result: str, detail: str = "") -> None:
        self._write("INSERT INTO audit (ts, action, target, result, detail) VALUES (?, ?, ?, ?, ?)",
                    (time.time(), action, target, result, detail))

    def audit_log(self, limit: int = 200) -> list[AuditEntry]:
        rows = self._read("SELECT ts, action, target, result, detail FROM audit ORDER BY id DESC LIMIT ?", (limit,))
        return [AuditEntry(*r) for r in reversed(rows)]
