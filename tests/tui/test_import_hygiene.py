"""Nothing outside exo_tui/tui/ imports textual; only the TUI imports themes (Harlequin's rule)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offenders(forbidden: str, allowed_dir: Path) -> list[str]:
    bad = []
    for package in ("exo_tui", "backends"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if allowed_dir in path.parents:
                continue
            for name in _imports(path):
                if name == forbidden or name.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_only_the_tui_imports_textual() -> None:
    assert _offenders("textual", ROOT / "exo_tui" / "tui") == []


def test_only_the_tui_imports_themes() -> None:
    assert _offenders("themes", ROOT / "exo_tui" / "tui") == []


def test_the_scan_finds_a_textual_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("from textual.widgets import Static\nimport os\n")
    assert "textual.widgets" in _imports(sample)


def test_headless_import_of_the_cluster_does_not_load_textual() -> None:
    code = (
        "import sys\n"
        "import exo_tui.cli, exo_tui.cluster.view, exo_tui.events, exo_tui.config\n"
        "exo_tui.cli.build_parser()\n"
        "assert not any(m == 'textual' or m.startswith('textual.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('textual'))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.skipif(shutil.which("lint-imports") is None and not (Path(sys.executable).parent / "lint-imports").exists(),
                    reason="import-linter not installed")
def test_import_linter_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
