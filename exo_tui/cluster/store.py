"""The coordinator's persisted state: SQLite in WAL mode, in the exo-tui home.

Known nodes and hosts, pins, drains, the plan in force, and an audit log of operator actions
(time, action, target, result). A restarted coordinator reads it back: it reconnects to the
nodes it knew, restores pins and drains, and adopts the plan (the nodes still hold its shards).
Writes are small and synchronous; they happen on operator actions and plan changes, never on the
token path.

A write that fails (a full disk, a read-only file) is rolled back and reported, never raised: the
cluster keeps running on its in-memory state, which is whole. The failed writes are kept, in
order, and go in first with the next write or :meth:`StateStore.retry` (the coordinator retries
every few seconds), so once there is room again the file catches up with nothing lost.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_PENDING_ROWS = 10_000  # unsaved rows kept while writes fail (the oldest audit lines go first)
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
    def __init__(self, path: Path, *, on_write_error: Callable[[str | None], None] | None = None) -> None:
        """``on_write_error(message)`` is called when writes start failing, and with ``None`` when
        one succeeds again."""
        self.path = Path(path)
        self.write_error: str | None = None  # why the last write failed; None once one succeeds
        self._on_write_error = on_write_error
        self._pending: list[tuple[str, list[tuple[Any, ...]]]] = []  # failed writes, in order
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                raise RuntimeError(
                    f"the coordinator's state file {self.path} cannot be written ({exc}): free some disk "
                    "space there, or point EXO_TUI_HOME at another folder"
                ) from exc
            raise RuntimeError(
                f"the coordinator's state file {self.path} cannot be used ({exc}): move it away to start "
                "with a fresh state (nodes, pins and drains are then forgotten)"
            ) from exc
        self.path.chmod(0o600)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> bool:
        return self._transaction([(sql, [args])])

    def retry(self) -> bool:
        """Writes what failed before; True when nothing is left unsaved."""
        return self._transaction([])

    def _transaction(self, statements: list[tuple[str, list[tuple[Any, ...]]]]) -> bool:
        """Runs the pending writes, then ``(sql, rows)`` pairs, as one transaction; on failure rolls
        back, keeps them pending and reports (see the module's docstring). Returns whether saved."""
        with self._lock:
            batch = self._pending + statements
            if not batch:
                return True
            try:
                self._db.execute("BEGIN")
                for sql, rows in batch:
                    self._db.executemany(sql, rows)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)):
                    raise  # a bug in the statement, not the disk: retrying cannot help
                self._pending = _bounded(batch)
                message = (
                    f"the coordinator's state file {self.path} cannot be written ({exc}): the cluster runs on "
                    "and the changes are kept to write later, but a restart now would forget them; "
                    "free disk space there (or fix its permissions)"
                )
                first = self.write_error is None
                self.write_error = message
                if first and self._on_write_error is not None:
                    self._on_write_error(message)
                return False
            self._pending = []
            recovered = self.write_error is not None
            self.write_error = None
        if recovered and self._on_write_error is not None:
            self._on_write_error(None)
        return True

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args))

    # ---------------------------------------------------------------- nodes and hosts

    def remember_node(self, node_id: str, name: str, host: str, port: int) -> bool:
        return self._write(
            "INSERT INTO nodes VALUES (?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET "
            "name=excluded.name, host=excluded.host, port=excluded.port, last_seen=excluded.last_seen",
            (node_id, name, host, port, time.time()),
        )

    def forget_node(self, node_id: str) -> bool:
        return self._transaction([(f"DELETE FROM {table} WHERE node_id = ?", [(node_id,)])
                                  for table in ("nodes", "pins", "drains")])

    def known_nodes(self) -> list[KnownNode]:
        return [KnownNode(*row) for row in self._read("SELECT node_id, name, host, port, last_seen FROM nodes")]

    def remember_host(self, host: str, port: int, source: str, user: str = "") -> bool:
        return self._write("INSERT OR REPLACE INTO hosts VALUES (?, ?, ?, ?)", (host, port, source, user))

    def known_hosts(self) -> list[tuple[str, int, str, str]]:
        return [(str(h), int(p), str(s), str(u)) for h, p, s, u in self._read("SELECT host, port, source, user FROM hosts")]

    # ---------------------------------------------------------------- pins, drains, plan

    def save_pins(self, pins: dict[str, tuple[int, int]]) -> bool:
        return self._transaction([("DELETE FROM pins", [()]),
                                  ("INSERT INTO pins VALUES (?, ?, ?)", [(n, a, b) for n, (a, b) in pins.items()])])

    def pins(self) -> dict[str, tuple[int, int]]:
        return {n: (a, b) for n, a, b in self._read("SELECT node_id, start, end_ FROM pins")}

    def save_drains(self, drained: set[str]) -> bool:
        return self._transaction([("DELETE FROM drains", [()]),
                                  ("INSERT INTO drains VALUES (?)", [(n,) for n in sorted(drained)])])

    def drains(self) -> set[str]:
        return {r[0] for r in self._read("SELECT node_id FROM drains")}

    def save_plan(self, version: int, model: str, body: dict[str, Any]) -> bool:
        return self._write("INSERT OR REPLACE INTO plan VALUES (1, ?, ?, ?)", (version, model, json.dumps(body)))

    def plan(self) -> tuple[int, str, dict[str, Any]] | None:
        rows = self._read("SELECT version, model, body FROM plan WHERE id = 1")
        if not rows:
            return None
        version, model, body = rows[0]
        return int(version), str(model), json.loads(body)

    # ---------------------------------------------------------------- audit

    def audit(self, action: str, target: str, result: str, detail: str = "") -> bool:
        return self._write("INSERT INTO audit (ts, action, target, result, detail) VALUES (?, ?, ?, ?, ?)",
                           (time.time(), action, target, result, detail))

    def audit_log(self, limit: int = 200) -> list[AuditEntry]:
        rows = self._read("SELECT ts, action, target, result, detail FROM audit ORDER BY id DESC LIMIT ?", (limit,))
        return [AuditEntry(*r) for r in reversed(rows)]


def _bounded(batch: list[tuple[str, list[tuple[Any, ...]]]]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """``batch`` with its oldest audit lines dropped while it holds more than MAX_PENDING_ROWS rows
    (nodes, hosts, pins, drains and the plan are small and always kept)."""
    total = sum(len(rows) for _, rows in batch)
    if total <= MAX_PENDING_ROWS:
        return batch
    kept = []
    for sql, rows in batch:
        if total > MAX_PENDING_ROWS and sql.startswith("INSERT INTO audit"):
            total -= len(rows)
            continue
        kept.append((sql, rows))
    return kept
