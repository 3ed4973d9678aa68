"""How wattflow's SmartWatts throughput scales with containers per sensor and with sensors.

Each case feeds about the same number of input reports (``--reports``) through
``wattflow run --input jsonl … --output jsonl …`` pinned to one core, so that the cost per
report can be compared across cases: if cost grows linearly with the work, reports/s stays flat.
Start-up (the same command on an empty input) is subtracted.

    python benchmarks/scaling.py --reports 20000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = (
    ("containers per sensor", 10, 1),
    ("containers per sensor", 100, 1),
    ("containers per sensor", 1000, 1),
    ("sensors", 10, 1),
    ("sensors", 10, 10),
    ("sensors", 10, 100),
)


def wattflow(*args: str) -> list[str]:
    """The command, pinned to one core where taskset exists."""
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    return [*pin, sys.executable, "-m", "wattflow.service", "run", *args]


def timed(command: list[str]) -> float:
    """Wall time of a command that must succeed."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=20000, help="input reports per case")
    parser.add_argument("--keep", type=Path, help="keep the generated inputs here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="wattflow-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    empty = work / "empty.jsonl"
    empty.write_text("")
    flags = ["--learn-min-samples-required", "10"]
    startup = statistics.median(
        timed(
            wattflow(
                "--input",
                "jsonl",
                "--files",
                str(empty),
                "--output",
                "jsonl",
                "--file",
                os.devnull,
                *flags,
            )
        )
        for _ in range(3)
    )
    print(f"start-up: {startup:.2f} s (subtracted below)\n")
    print(f"{'case':34} {'reports':>8} {'outputs':>8} {'reports/s':>10} {'µs/report':>10}")
    baseline = None
    for label, containers, sensors in CASES:
        ticks = max(args.reports // ((containers + 1) * sensors), 60)
        source = work / f"c{containers}-s{sensors}.jsonl"
        if not source.exists():
            subprocess.run(
                [sys.executable, str(HERE / "generate_hwpc.py"), "--ticks", str(ticks),
                 "--containers", str(containers), "--sensors", str(sensors),
                 "--out", str(source)],
                check=True,
            )  # fmt: skip
        reports = sum(1 for _ in source.open())
        output = work / "out.jsonl"
        output.unlink(missing_ok=True)
        wall = timed(
            wattflow(
                "--input",
                "jsonl",
                "--files",
                str(source),
                "--output",
                "jsonl",
                "--file",
                str(output),
                *flags,
            )
        )
        outputs = sum(1 for _ in output.open())
        rate = reports / max(wall - startup, 1e-9)
        baseline = baseline or rate
        name = f"{containers} containers × {sensors} sensor{'s' if sensors > 1 else ''}"
        print(
            f"{name:34} {reports:8d} {outputs:8d} {rate:10.0f} {1e6 / rate:10.1f}"
            f"   ({label}; {rate / baseline:.2f}× the first case)"
        )


if __name__ == "__main__":
    main()
