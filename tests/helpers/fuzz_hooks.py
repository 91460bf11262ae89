"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=tests/helpers/fuzz_hooks.py``) that widen its fuzzing
past what a schema allows, to what a stranger sends: each generated JSON body also comes with one
of its integers made 2**64, 2**70, -2**64 or 10**400, or one of its strings made to hold a lone surrogate
(``"\\ud800x"``, which JSON can spell and Python decodes). The server must answer them 4xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

HUGE = (2**64, 2**70, -(2**64), 10**400)
LONE = "\ud800x"


def _paths(value: Any, at: tuple = ()) -> list[tuple[tuple, Any]]:
    """Every (path, leaf) of a JSON value whose leaf is an int (not a bool) or a str."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _paths(v, (*at, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _paths(v, (*at, i))]
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return [(at, value)]
    return []


def _with(value: Any, path: tuple, leaf: Any) -> Any:
    if not path:
        return leaf
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _with(value[head], rest, leaf)}
    out = list(value)
    out[head] = _with(value[head], rest, leaf)
    return out


def _variants(body: Any) -> list[Any]:
    out = [body]
    for path, leaf in _paths(body):
        if isinstance(leaf, str):
            out.append(_with(body, path, leaf + LONE))
        else:
            out.extend(_with(body, path, huge) for huge in HUGE)
    return out


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> Any:
    return st.sampled_from(_variants(body))
