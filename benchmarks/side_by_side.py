"""wattflow beside PowerAPI SmartWatts 2.4.1, on the same input, in one process tree.

Creates (once) a Python 3.12 virtual environment with SmartWatts 2.4.1 from PyPI, generates a
realistic hwpc-sensor recording in PowerAPI's CSV layout with known per-target power, runs both
formulas on it with the same settings, each writing PowerAPI's CSV output, and prints for each:
input reports, wall time, start-up time (the same command on a one-tick input), throughput in
input reports per second net of start-up, the largest resident set, and the error of the
per-target cpu power against the ground truth.

wattflow runs pinned to one core (``taskset -c 0``); SmartWatts, whose actors are processes,
gets every core. Run it from the repository root:

    python benchmarks/side_by_side.py --ticks 600 --containers 10
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_hwpc import Machine, containers_named, generate, write_csv_groups

ROOT = Path(__file__).resolve().parent.parent
SMARTWATTS_VENV = ROOT / "benchmarks" / ".smartwatts-venv"
PYTHON_312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"
GROUP_FILES = ("rapl.csv", "msr.csv", "core.csv")
"""PowerAPI's CSV input advances its clock when the LAST file moves to the next timestamp and
drops the rows it has not read by then: the per-target file must come last, or only the global
report of each tick gets through."""


@dataclass
class Outcome:
    """What one formula did with the input."""

    name: str
    reports: int
    wall_s: float
    startup_s: float
    max_rss_mb: float
    output: Path

    @property
    def throughput(self) -> float:
        """Input reports per second, start-up left out."""
        return self.reports / max(self.wall_s - self.startup_s, 1e-9)


def smartwatts_python(venv: Path) -> Path:
    """The venv's interpreter, creating the venv with SmartWatts 2.4.1 on first use."""
    python = venv / "bin" / "python"
    if not python.exists():
        base = shutil.which("python3.12") or PYTHON_312
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "smartwatts==2.4.1"], check=True
        )
    return python


def write_input(directory: Path, args: argparse.Namespace, ticks: int) -> tuple[int, Path]:
    """Generate a recording as PowerAPI CSV; return its report count and truth file."""
    machine = Machine(sockets=args.sockets, cpus_per_socket=args.cpus_per_socket)
    reports = []
    truth_rows = []
    for tick_reports, truth in generate(
        machine, containers_named(args.containers), ticks, multiplex=args.multiplex
    ):
        reports.extend(tick_reports)
        truth_rows.extend(truth)
    write_csv_groups(reports, directory)
    truth_path = directory / "truth.csv"
    with truth_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(truth_rows[0]))
        writer.writeheader()
        writer.writerows(truth_rows)
    return len(reports), truth_path


def run_measured(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run a command; return its wall time and the largest resident set in its tree (MB)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    stderr = process.stderr.read() if process.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss / 1024


def formula_flags(args: argparse.Namespace) -> list[str]:
    """SmartWatts' settings, the same on both sides."""
    return [
        "--cpu-base-freq", "2100",
        "--cpu-tdp", "400",
        "--sensor-reports-frequency", "1000",
        "--learn-min-samples-required", str(args.min_samples),
        "--learn-history-window-size", str(args.history_window),
    ]  # fmt: skip


def commands(
    name: str, python: Path, inputs: Path, output: Path, args: argparse.Namespace
) -> list[str]:
    """The command line of one formula: SmartWatts' own, which wattflow accepts as is."""
    files = ",".join(str(inputs / f) for f in GROUP_FILES)
    io = [
        "--input", "csv", "--model", "HWPCReport", "--name", "puller", "--files", files,
        "--output", "csv", "--model", "PowerReport", "--name", "pusher",
        "--directory", str(output),
    ]  # fmt: skip
    if name == "smartwatts":
        return [str(python), "-m", "smartwatts", *io, *formula_flags(args)]
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    extra = shlex.split(args.wattflow_args)
    return [
        *pin,
        sys.executable,
        "-m",
        "wattflow.service",
        "run",
        *io,
        *formula_flags(args),
        *extra,
    ]


def measure(name: str, python: Path, work: Path, args: argparse.Namespace, reports: int) -> Outcome:
    """Start-up on the one-tick input, then the full run."""
    env = {**os.environ, "TZ": "UTC"}  # PowerAPI writes CSV timestamps through local time
    startups = []
    for attempt in range(3):
        out = work / f"{name}-startup-{attempt}"
        wall, _ = run_measured(commands(name, python, work / "tiny", out, args), env)
        startups.append(wall)
    output = work / f"{name}-out"
    wall, rss = run_measured(commands(name, python, work / "input", output, args), env)
    return Outcome(name, reports, wall, statistics.median(startups), rss, output)


def cpu_power_by_tick(output: Path) -> dict[tuple[int, str], float]:
    """Per (tick in ms, target): cpu power summed over sockets, from PowerAPI CSV output."""
    found: dict[tuple[int, str], float] = defaultdict(float)
    for path in output.glob("*/PowerReport.csv"):
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                if row["target"] in ("rapl", "global") or row.get("scope") != "cpu":
                    continue
                found[(int(row["timestamp"]), row["target"])] += float(row["power"])
    return found


def truth_by_tick(path: Path) -> dict[tuple[int, str], float]:
    """Ground truth per (tick in ms, target), idle power attributed as the formulas do."""
    found = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row["target"].startswith("rapl-socket"):
                continue
            stamp = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=UTC)
            found[(round(stamp.timestamp() * 1000), row["target"])] = float(row["cpu_attributed_w"])
    return found


def errors(
    estimated: dict[tuple[int, str], float],
    truth: dict[tuple[int, str], float],
    keys: set[tuple[int, str]],
) -> tuple[float, float, int]:
    """MAPE (on targets over 1 W) and mean absolute error over ``keys``."""
    relative = [abs(estimated[k] - truth[k]) / truth[k] for k in keys if truth[k] >= 1.0]
    absolute = [abs(estimated[k] - truth[k]) for k in keys]
    if not absolute:
        return float("nan"), float("nan"), 0
    mape = 100 * statistics.fmean(relative) if relative else float("nan")
    return mape, statistics.fmean(absolute), len(absolute)


def nearest_keys(
    estimated: dict[tuple[int, str], float], truth: dict[tuple[int, str], float]
) -> dict[tuple[int, str], float]:
    """Re-key estimates on the truth's ticks, allowing 1 ms of rounding in PowerAPI's output."""
    matched = {}
    for (millis, target), power in estimated.items():
        for candidate in (millis, millis - 1, millis + 1):
            if (candidate, target) in truth:
                matched[(candidate, target)] = power
                break
    return matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=600)
    parser.add_argument("--containers", type=int, default=10)
    parser.add_argument("--sockets", type=int, default=2)
    parser.add_argument("--cpus-per-socket", type=int, default=4)
    parser.add_argument("--multiplex", type=float, default=0.0)
    parser.add_argument("--min-samples", type=int, default=10)
    parser.add_argument("--history-window", type=int, default=60)
    parser.add_argument("--wattflow-args", default="", help="extra wattflow flags")
    parser.add_argument("--venv", type=Path, default=SMARTWATTS_VENV)
    parser.add_argument("--keep", type=Path, help="keep inputs and outputs in this directory")
    args = parser.parse_args()

    python = smartwatts_python(args.venv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="wattflow-side-by-side-"))
    work.mkdir(parents=True, exist_ok=True)
    reports, truth_path = write_input(work / "input", args, args.ticks)
    write_input(work / "tiny", args, 1)
    truth = truth_by_tick(truth_path)
    outcomes = [measure(name, python, work, args, reports) for name in ("smartwatts", "wattflow")]
    estimates = {o.name: nearest_keys(cpu_power_by_tick(o.output), truth) for o in outcomes}
    common = set.intersection(*(set(e) for e in estimates.values()))

    print(
        f"input: {reports} reports, {args.ticks} ticks, {args.containers} containers, "
        f"{args.sockets}×{args.cpus_per_socket} cpus, multiplexed share {args.multiplex}"
    )
    print("wattflow pinned to one core; SmartWatts on every core of this machine\n")
    header = (
        f"{'':12} {'wall s':>8} {'startup s':>10} {'reports/s':>10} {'max RSS MB':>11} "
        f"{'MAPE %':>8} {'MAE W':>7} {'targets×ticks':>14} {'MAPE % on common':>17}"
    )
    print(header)
    for outcome in outcomes:
        own = estimates[outcome.name]
        mape, mae, count = errors(own, truth, set(own))
        common_mape, _, _ = errors(own, truth, common)
        print(
            f"{outcome.name:12} {outcome.wall_s:8.2f} {outcome.startup_s:10.2f} "
            f"{outcome.throughput:10.0f} {outcome.max_rss_mb:11.0f} {mape:8.2f} {mae:7.3f} "
            f"{count:14d} {common_mape:17.2f}"
        )
    smartwatts, wattflow = outcomes
    ratio = wattflow.throughput / smartwatts.throughput
    print(f"\nthroughput ratio wattflow / SmartWatts: {ratio:.1f}×")
    print(f"inputs and outputs in {work}")


if __name__ == "__main__":
    main()
