"""The type checker passes on the tree (configured in pyproject.toml's [tool.mypy]: a base level
everywhere, strict on net, scheduler, cluster and api). ``make lint`` runs it too; here it runs in
the suite, so CI's ``make test`` fails on a type error. mypy's cache (.mypy_cache) makes a rerun
check only what changed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed (pip install -e '.[dev]')")
def test_mypy_passes() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
