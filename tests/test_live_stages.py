"""``benchmarks/live_stages.py`` runs every stage of the live path on generated lines and
prints figures that add up: the benchmark itself is checked, not the machine's speed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "live_stages.py"
STAGES = (
    "orjson.loads (the limit)",
    "msgspec parse",
    "decode (C parser)",
    "route",
    "SmartWatts",
    "RAPL",
    "encode (JSON Lines)",
)


def test_every_stage_is_measured_and_the_sum_is_the_path() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sensors", "2", "--containers", "5",
         "--ticks", "30", "--repeat", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    micros = {
        name: float(found.group(1))
        for name in STAGES
        if (found := re.search(re.escape(name) + r"\s+([\d.]+) µs", done.stdout))
    }
    assert micros.keys() == set(STAGES), done.stdout
    assert all(value > 0 for value in micros.values()), done.stdout
    reports = re.search(r"([\d,]+) reports .*?([\d,]+) PowerReports", done.stdout)
    assert reports is not None, done.stdout
    assert int(reports.group(1).replace(",", "")) == 2 * (5 + 1) * 30  # containers + global
    assert int(reports.group(2).replace(",", "")) > 0, "the formulas estimated the ticks"
    path = sum(micros[name] for name in STAGES[2:])
    total = re.search(r"decode \+ route \+ formulas \+ encode\s+([\d.]+) µs", done.stdout)
    assert total is not None, done.stdout
    assert abs(float(total.group(1)) - path) <= 0.02, "the sum is of the stages printed"
