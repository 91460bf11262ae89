"""``exo-tui models``: the GGUF models on this machine (the catalog), as ``--model`` takes their names."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

COLUMNS = ("NAME", "FAMILY", "PARAMS", "QUANT", "SIZE", "CONTEXT", "WHERE")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models", help="list the GGUF models on this machine (Ollama, LM Studio, Hugging Face, models.paths)",
        description="The models of Ollama's store, LM Studio's, the Hugging Face cache and the config's "
                    "models.paths, with each file's family, parameters, quant type, size and place. Any NAME "
                    "here works as --model NAME. Models this runtime cannot run are listed with the reason.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list (every field of each model)")
    p.add_argument("--usable", action="store_true", help="only the models this runtime can run")
    p.add_argument("--config", default=None, metavar="F", help="config file (default ~/.config/exo-tui/config.yaml)")
    p.add_argument("--path", action="append", default=None, metavar="DIR",
                   help="search this folder (or file) instead of models.paths (repeatable)")
    p.set_defaults(func=run)


def fmt_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def rows(entries: list[Any]) -> list[tuple[str, ...]]:
    return [(e.name, e.family or "?", e.size_label or "?", e.quant or "?", fmt_size(e.size_bytes),
             str(e.context_length or "?"), e.where) for e in entries]


def run(args: argparse.Namespace) -> int:
    from exo_tui.config import ConfigError, load_config
    from exo_tui.models import catalog

    try:
        paths = args.path if args.path is not None else list(load_config(args.config).models.paths)
    except ConfigError as exc:
        print(f"exo-tui models: {exc}", file=sys.stderr)
        return 2
    entries = catalog.scan(paths)
    if args.usable:
        entries = [e for e in entries if e.usable]
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print("no models found: put GGUF files in a folder and add it to models.paths of the config, "
              "or pull one with Ollama or LM Studio")
        return 0
    table = [(("" if e.usable else "✗ ") + r[0], *r[1:]) for e, r in zip(entries, rows(entries), strict=True)]
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(COLUMNS[:-1])]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS[:-1], widths, strict=True)) + "  " + COLUMNS[-1])
    for e, r in zip(entries, table, strict=True):
        print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
        if not e.usable:
            print(f"    cannot run: {e.reason}")
    unusable = sum(1 for e in entries if not e.usable)
    print(f"\n{len(entries) - unusable} usable, {unusable} not (✗, with the reason)" if unusable else
          f"\n{len(entries)} usable")
    return 0
