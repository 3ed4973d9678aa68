"""Export speed and peak memory per format, on a GPU node's run as ``wattflow run --run`` stores it.

The run is what a GPU node leaves in the store: GPUReports at 10 Hz (one device, five power
samples and four processes each), a meter at 1 Hz, the formulas' PowerReports at 1 Hz for every
target (cpu and dram, two sockets), an epoch every five minutes, and the experiment's begin and
end. hwpc-sensor's raw counters are not there: the live recorder does not store them. Ten
minutes with 100 targets is about 250,000 reports.

Each format is exported by ``wattflow export`` in a process of its own, for runs of each
duration given (``--minutes 10,60``); the script prints reports/s (the run's reports over the
export's wall time, start-up included) and the process's peak resident set. Exports stream, so
the peak should not follow the run's length: the last column is the longest run's peak over the
shortest's, the growth an hour's run costs over ten minutes'.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path

from wattflow.actors.run_store import open_store
from wattflow.formats.reports import (
    EventReport,
    GPUDevice,
    GPUProcess,
    GPUReport,
    MeterReport,
    PowerReport,
    Report,
)
from wattflow.formats.runs import Run

START = datetime(2026, 7, 1, 9, 0, tzinfo=UTC)
FORMATS = "gpu-dir,extrap-text,extrap-json,extrap-jsonl,extrap-talpas,extrap,ross,hpctoolkit"
TARGET_RATE = 150_000
"""Reports/s every format should reach: an Extra-P study of 50 one-hour runs × 8 formats in
well under an hour."""


def node_reports(seconds: int, targets: int) -> Iterator[Report]:
    """The run's reports in time order."""
    yield EventReport(timestamp=START, sensor="node", target="all", event="experiment_begin")
    for tenth in range(10 * seconds):
        moment = START + timedelta(seconds=tenth / 10)
        micros = int(moment.timestamp() * 1e6)
        device = GPUDevice(
            power=250_000.0,
            total_energy=250.0 * tenth * 100,
            util_gpu=90.0,
            clock_gpu=1410.0,
            temperature=65.0,
            samples={"TOTAL_POWER": [(micros + 20_000 * i, 250_000.0) for i in range(5)]},
            processes=[GPUProcess(pid=100 + p, sm_util=20.0, cgroup=f"/c{p}") for p in range(4)],
        )
        yield GPUReport(timestamp=moment, sensor="node", target="all", devices={"0": device})
        if tenth % 10:
            continue
        second = tenth // 10
        if second % 300 == 0 and 0 < second < seconds:
            yield EventReport(
                timestamp=moment, sensor="node", target="all", event="epoch_end",
                data=second // 300 - 1,
            )  # fmt: skip
        if second % 300 == 0 and second < seconds:
            yield EventReport(
                timestamp=moment, sensor="node", target="all", event="epoch_begin",
                data=second // 300,
            )  # fmt: skip
        yield MeterReport(timestamp=moment, sensor="node", target="all", channels={"d0c0": 6e5})
        for target in range(targets):
            for scope in ("cpu", "dram"):
                for socket in ("0", "1"):
                    yield PowerReport(
                        timestamp=moment,
                        sensor="node",
                        target=f"/kubepods/pod{target}",
                        power=1.0 + target % 7,
                        metadata={"scope": scope, "socket": socket, "formula": "f", "ratio": 0.01},
                    )
    yield EventReport(
        timestamp=START + timedelta(seconds=seconds), sensor="node", target="all",
        event="experiment_end",
    )  # fmt: skip


def fill(store_uri: str, seconds: int, targets: int) -> int:
    """Store the run (once per store file); return its report count."""
    count = 0
    with open_store(store_uri) as store:
        reports = node_reports(seconds, targets)
        # In batches, as the live recorder stores them: the benchmark's own memory stays small,
        # and so does what each export process starts with.
        while batch := list(islice(reports, 10_000)):
            count += store.add_reports("bench/node/300W/0", batch)
        store.save_run(
            Run(
                id="bench/node/300W/0", experiment="bench", benchmark="node", settings="300W",
                repetition=0, parameters={"p": 1.0}, start=START,
                end=START + timedelta(seconds=seconds),
            )
        )  # fmt: skip
    return count


WRAPPER = """
import os, sys, time
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
cpu = usage.ru_utime + usage.ru_stime
sys.stderr.write(f"\\n{time.perf_counter() - started} {cpu} {usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""Runs the export from a small process: a child's peak RSS counts the pages of the process it
was forked from, and this one's are few (the benchmark's own would be counted otherwise)."""


def measured(command: list[str]) -> tuple[float, float, float, str]:
    """Wall time, CPU time, largest RSS in MB, and the error output of a finished command."""
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, *command], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, check=False,
    )  # fmt: skip
    *errors, last = done.stderr.decode(errors="replace").strip().splitlines() or ["failed"]
    if done.returncode != 0:
        return math.nan, math.nan, math.nan, errors[-1] if errors else last
    wall, cpu, rss_kb = last.split()
    return float(wall), float(cpu), int(rss_kb) / 1024, ""


def export(store: str, name: str, out: Path) -> tuple[float, float, float, str]:
    shutil.rmtree(out, ignore_errors=True)
    return measured(
        [sys.executable, "-m", "wattflow.service", "export", name, "--store", store,
         "--out", str(out)]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes", default="10,60", help="run durations, comma-separated (default 10,60)"
    )
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument("--formats", default=FORMATS)
    parser.add_argument(
        "--repeat", type=int, default=3, help="exports per format and run; the fastest counts"
    )
    args = parser.parse_args()
    durations = [round(float(text) * 60) for text in args.minutes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="wattflow-export-bench-"))
    stores: list[tuple[int, str, int]] = []
    for seconds in durations:
        path = work / f"runs-{seconds}s.db"
        started = time.perf_counter()
        reports = fill(f"sqlite:///{path}", seconds, args.targets)
        print(
            f"run: {seconds / 60:g} min, {args.targets} targets, {reports:,} reports "
            f"({path.stat().st_size / 1e6:.0f} MB of SQLite, stored in "
            f"{time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        stores.append((seconds, f"sqlite:///{path}", reports))
    print(
        f"each export run {args.repeat} times, the fastest kept; reports/s is the run's reports "
        "over the export's wall time, start-up included"
    )
    heads = [f"{seconds / 60:g} min" for seconds, _, _ in stores]
    print(f"{'':<14}" + "".join(f" {head:-^35}" for head in heads))
    print(
        f"{'format':<14}"
        + f" {'wall s':>7} {'CPU s':>7} {'reports/s':>10} {'peak MB':>8}" * len(stores)
        + f" {'RSS growth':>10} {'slowest/150k':>12}"
    )
    for name in args.formats.split(","):
        line = f"{name:<14}"
        peaks: list[float] = []
        rates: list[float] = []
        for seconds, store, reports in stores:
            tries = [
                export(store, name, work / f"out-{name}-{seconds}s") for _ in range(args.repeat)
            ]
            wall, cpu, _, error = min(tries)
            if error:
                line += f" failed: {error}"
                break
            peaks.append(max(t[2] for t in tries))
            rates.append(reports / wall)
            line += f" {wall:>7.2f} {cpu:>7.2f} {reports / wall:>10,.0f} {peaks[-1]:>8.0f}"
        else:
            line += f" {peaks[-1] - peaks[0]:>+8.0f}MB {min(rates) / TARGET_RATE:>12.2f}"
        print(line, flush=True)
    print(f"files in {work}")


if __name__ == "__main__":
    main()
