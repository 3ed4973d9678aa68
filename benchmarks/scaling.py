"""How wattflow's SmartWatts throughput scales with containers per sensor and with sensors.

Each case feeds the same number of input reports (``--reports``, give or take one tick) through
``wattflow run`` pinned to one core, so that the cost per report can be compared across cases:
if cost grows linearly with the work, reports/s stays flat. ``--format csv`` reads and writes
PowerAPI's CSV layout (replays go through frames, many reports as arrays); ``--format jsonl``
reads and writes JSON Lines, report by report, as live inputs are processed. Start-up (the same
command on a one-tick input) is subtracted. Run from the repository root:

    python benchmarks/scaling.py --reports 60000 --format csv
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_hwpc import GROUP_FILES, record

CASES = (
    ("containers per sensor", 10, 1),
    ("containers per sensor", 100, 1),
    ("containers per sensor", 1000, 1),
    ("sensors", 10, 1),
    ("sensors", 10, 10),
    ("sensors", 10, 100),
)
MIN_TICKS = 45
"""Fewest ticks per sensor. The generator runs three workload phases, each at its own frequency
layer, and a layer's model needs ``--learn-min-samples-required`` (10) ticks before it estimates:
with fewer than about 15 ticks per phase a case would only learn, and look cheaper than it is.
With the default ``--reports`` no case needs the floor."""
FLAGS = ("--learn-min-samples-required", "10", "--cpu-base-freq", "2100", "--cpu-tdp", "400")


def wattflow(source: Path, output: Path, extra: list[str], layout: str) -> list[str]:
    """The command, pinned to one core where taskset exists.

    ``source`` is a JSON Lines file, or the directory of a recording's CSV files.
    """
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    if layout == "csv":
        files = ",".join(str(source / name) for name in GROUP_FILES)
        io = [
            "--input", "csv", "--model", "HWPCReport", "--files", files,
            "--output", "csv", "--model", "PowerReport", "--directory", str(output),
        ]  # fmt: skip
    else:
        io = [
            "--input", "jsonl", "--model", "HWPCReport", "--files", str(source),
            "--output", "jsonl", "--model", "PowerReport", "--file", str(output),
        ]  # fmt: skip
    return [*pin, sys.executable, "-m", "wattflow.service", "run", *io, *FLAGS, *extra]


def generate(source: Path, layout: str, ticks: int, containers: int, sensors: int) -> int:
    """Write a recording in the layout asked for (once); return its report count."""
    names = [f"node-{n + 1}" for n in range(sensors)]
    marker = source / "reports" if layout == "csv" else source.with_suffix(".count")
    if marker.exists():
        return int(marker.read_text())
    if layout == "csv":
        reports = record(ticks=ticks, containers=containers, sensors=names, csv_dir=source)
    else:
        reports = record(ticks=ticks, containers=containers, sensors=names, jsonl=source)
    marker.write_text(str(reports))
    return reports


def written(output: Path, layout: str) -> int:
    """PowerReports an output holds."""
    if layout == "csv":
        return sum(sum(1 for _ in path.open()) - 1 for path in output.glob("*/PowerReport.csv"))
    return sum(1 for _ in output.open())


def clear(output: Path) -> None:
    if output.is_dir():
        shutil.rmtree(output)
    else:
        output.unlink(missing_ok=True)


def timed(command: list[str]) -> float:
    """Wall time of a command that must succeed."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reports", type=int, default=60000, help="input reports per case")
    parser.add_argument("--wattflow-args", default="", help="extra wattflow flags")
    parser.add_argument("--keep", type=Path, help="keep the generated inputs here")
    parser.add_argument(
        "--format",
        choices=("csv", "jsonl"),
        default="csv",
        help="PowerAPI's CSV layout in and out (replays, by frames), or JSON Lines (report by "
        "report, as live inputs)",
    )
    args = parser.parse_args()
    extra = args.wattflow_args.split()
    layout = args.format
    work = args.keep or Path(tempfile.mkdtemp(prefix="wattflow-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    suffix = "" if layout == "csv" else ".jsonl"
    tiny = work / f"tiny-{layout}{suffix}"
    generate(tiny, layout, 1, 10, 1)
    output = work / f"out-{layout}{'.jsonl' if layout == 'jsonl' else ''}"
    startups = []
    for _ in range(3):
        clear(output)
        startups.append(timed(wattflow(tiny, output, extra, layout)))
    startup = statistics.median(startups)
    print(f"wattflow on one core, {layout} in and out, flags {' '.join([*FLAGS, *extra])}")
    print(f"start-up: {startup:.2f} s (subtracted below)\n")
    columns = ("ticks", "reports", "outputs", "reports/s", "µs/report")
    print(f"{'case':30} {columns[0]:>6} " + " ".join(f"{c:>{len(c) + 1}}" for c in columns[1:]))
    baseline = math.nan
    for label, containers, sensors in CASES:
        ticks = round(args.reports / ((containers + 1) * sensors))
        if ticks < MIN_TICKS:
            print(f"(raised to {MIN_TICKS} ticks per sensor: fewer would barely estimate)")
            ticks = MIN_TICKS
        source = work / f"c{containers}-s{sensors}-t{ticks}{suffix}"
        reports = generate(source, layout, ticks, containers, sensors)
        clear(output)
        wall = timed(wattflow(source, output, extra, layout))
        outputs = written(output, layout)
        rate = reports / max(wall - startup, 1e-9)
        if math.isnan(baseline):
            baseline = rate
        name = f"{containers} containers × {sensors} sensor{'s' if sensors > 1 else ''}"
        print(
            f"{name:30} {ticks:6d} {reports:8d} {outputs:8d} {rate:10.0f} {1e6 / rate:10.1f}"
            f"   ({label}; {rate / baseline:.2f}× the first case)"
        )


if __name__ == "__main__":
    main()
