"""``benchmarks/side_by_side.py --shapes``: which shapes it runs, and a tiny run end to end.

The run is real on both sides: SmartWatts 2.4.1 from PyPI, in the Python 3.12 virtual
environment the script creates (once, in the user's cache, shared by every checkout: installing
scikit-learn takes a minute or two), and wattflow from this test's interpreter. Two small shapes
keep it to about half a minute.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import subprocess
import sys
from pathlib import Path

# The benchmarks' modules, imported as the benchmarks import them (a script folder, not a
# package), so that one module has one name for mypy and for Python.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from side_by_side import Shape, parse_args, shape_ticks, shapes_to_run, smartwatts_python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "side_by_side.py"


def test_axes_vary_one_dimension_at_a_time_from_the_base() -> None:
    base = Shape(2, 4, 10)
    axes = shapes_to_run(base, [1, 2], [4, 8, 32], [10, 100, 1000], grid=False)
    assert axes == [
        base,
        Shape(1, 4, 10),
        Shape(2, 8, 10),
        Shape(2, 32, 10),
        Shape(2, 4, 100),
        Shape(2, 4, 1000),
        # then the small nodes: one socket of 4 or 8 cpus, 2, 5 or 10 containers
        Shape(1, 4, 2),
        Shape(1, 4, 5),
        Shape(1, 8, 2),
        Shape(1, 8, 5),
        Shape(1, 8, 10),
    ]
    grid = shapes_to_run(base, [1, 2], [4, 8, 32], [10, 100, 1000], grid=True, small_nodes=False)
    assert len(grid) == len(set(grid)) == 18
    assert {s.sockets for s in grid} == {1, 2}
    assert {s.containers for s in grid} == {10, 100, 1000}


def test_ticks_follow_the_report_budget_above_a_floor() -> None:
    args = parse_args(["--shapes", "--shape-reports", "30000", "--shape-min-ticks", "30"])
    assert shape_ticks(Shape(2, 4, 10), args) == 2727  # 11 reports a tick
    assert shape_ticks(Shape(2, 4, 100), args) == 297
    assert shape_ticks(Shape(2, 4, 1000), args) == 30  # the floor: 30,030 reports
    args = parse_args(["--shapes", "--sensors", "3", "--shape-reports", "3300"])
    assert shape_ticks(Shape(1, 4, 10), args) == 100  # 3 sensors of 11 reports a tick


def smartwatts_venv() -> Path:
    """SmartWatts 2.4.1's environment in the user's cache, created under a lock so that two
    test runs at once do not install it into the same folder together."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wattflow"
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / "smartwatts-2.4.1-venv"
    with (cache / "smartwatts-2.4.1-venv.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        smartwatts_python(venv)
    return venv


def test_a_tiny_shapes_run_measures_both_formulas_on_each_shape(tmp_path: Path) -> None:
    venv = smartwatts_venv()
    done = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--shapes",
            "--sockets", "2", "--cpus-per-socket", "2", "--containers", "3",
            "--shape-sockets", "1", "--shape-cpus-per-socket", "2", "--shape-containers", "3",
            "--shape-reports", "1", "--shape-min-ticks", "45", "--startup-runs", "0",
            "--no-small-nodes", "--wattflow-longer", "2", "--smartwatts-longer", "2",
            "--min-samples", "10", "--history-window", "20", "--seed", "7",
            "--venv", str(venv), "--wattflow-python", sys.executable, "--keep", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        found = re.match(r"(\d×\d cpus, \d+ containers)\s+(.*)", line)
        if found:
            rows[found[1]] = found[2].split()
    assert set(rows) == {"2×2 cpus, 3 containers", "1×2 cpus, 3 containers"}, done.stdout
    for label, cells in rows.items():
        ticks, reports, smartwatts, wattflow, ratio, cpu_ratio, files, _, agree = cells
        assert (int(ticks), int(reports)) == (45, 45 * 4), label
        rates = [float(v.replace(",", "").rstrip("×*")) for v in (smartwatts, wattflow, ratio)]
        assert all(math.isfinite(v) and v > 0 for v in rates), (label, cells)
        assert math.isfinite(float(cpu_ratio.rstrip("×"))), (label, cells)
        # rapl, global and the three containers, the same files from both formulas.
        assert (int(files), agree) == (5, "same"), (label, cells)
    for shape in ("s2-c2-k3", "s1-c2-k3"):
        for name in ("SmartWatts", "wattflow"):
            written = sorted(p.name for p in (tmp_path / shape / f"{name}-out").iterdir())
            assert written == [
                "node-1-global", "node-1-ml-training", "node-1-postgres", "node-1-rapl",
                "node-1-web-frontend",
            ], (shape, name)  # fmt: skip
