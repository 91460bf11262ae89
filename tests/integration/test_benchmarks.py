"""Every benchmark in benchmarks/ runs end to end with ``--quick`` (its tiny parameters), so none
rots unseen: a crash, a traceback or a non-zero exit fails here. Their figures are not looked at
(performance targets live in the benchmarks, never in tests). Two run at a time: much of a
benchmark's time is node processes starting, which leaves a core free."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "quick" and not p.stem.startswith("_"))
# The slowest --quick runs (measured on the 2-core VM), started first so that the two workers end
# together: in name order speculative.py, the slowest by far, started last and ran alone at the end.
SLOWEST = ("speculative", "api", "emulated", "big_model", "soak", "resilience")

pytestmark = pytest.mark.slow


def _run(name: str, tmp: Path) -> str:
    """What went wrong with ``benchmarks/NAME.py --quick`` ('' when it ran through)."""
    home = tmp / name
    env = {**os.environ, "EXO_TUI_HOME": str(home / "home"), "PYTHONPATH": str(ROOT)}  # the user's caches: kernels built once
    try:
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick"], cwd=tmp,
                           capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired as exc:
        return f"{name}: still running after {exc.timeout:.0f} s"
    if r.returncode or "Traceback" in r.stderr:
        return f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    if not r.stdout.strip():
        return f"{name}: printed nothing"
    return ""


@pytest.mark.timeout(900)  # only a hung run: each benchmark has its own 600 s
def test_every_benchmark_runs_with_quick(tmp_path: Path) -> None:
    assert len(BENCHMARKS) >= 17 and set(SLOWEST) <= set(BENCHMARKS), BENCHMARKS
    with ThreadPoolExecutor(2) as pool:
        order = sorted(BENCHMARKS, key=lambda name: SLOWEST.index(name) if name in SLOWEST else len(SLOWEST))
        failed = [f for f in pool.map(lambda name: _run(name, tmp_path), order) if f]
    assert not failed, "\n\n".join(failed)
