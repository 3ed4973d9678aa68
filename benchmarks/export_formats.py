"""Export time and peak memory per format, for a long run (by default one hour).

The run holds an hour of a GPU node's measurement: GPUReports at 10 Hz (one device, with power
samples and four processes), a meter at 1 Hz, hwpc-sensor's reports at 1 Hz (the global one
and one per target, four cpus each), the formulas' PowerReports at 1 Hz for every target (cpu
and dram, two sockets), and epoch events every five minutes. Each format is exported by
``wattflow export`` in a process of its own, whose wall time and largest resident set are
printed: the exporters stream, so memory should not follow the run's length.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from wattflow.formats.reports import (
    EventReport,
    GPUDevice,
    GPUProcess,
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    Report,
)
from wattflow.formats.runs import Run
from wattflow.service.runs import open_store

START = datetime(2026, 7, 1, 9, 0, tzinfo=UTC)


def hour_of_reports(seconds: int, targets: int) -> Iterator[Report]:
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
            yield EventReport(timestamp=moment, sensor="node", target="all", event="epoch_end")
        if second % 300 == 0 and second < seconds:
            yield EventReport(timestamp=moment, sensor="node", target="all", event="epoch_begin")
        yield MeterReport(timestamp=moment, sensor="node", target="all", channels={"d0c0": 6e5})
        yield HWPCReport(
            timestamp=moment, sensor="node", target="all",
            groups={"rapl": {"0": {"0": {"RAPL_ENERGY_PKG": 2**36, "RAPL_ENERGY_DRAM": 2**33}}},
                    "msr": {"0": {str(c): {"APERF": 10**9, "MPERF": 10**9} for c in range(4)}}},
        )  # fmt: skip
        for target in range(targets):
            yield HWPCReport(
                timestamp=moment, sensor="node", target=f"/kubepods/pod{target}",
                groups={"core": {"0": {str(c): {"INSTRUCTIONS_RETIRED": 10**8, "LLC_MISSES": 10**5,
                                                "time_enabled": 10**9, "time_running": 10**9}
                                       for c in range(4)}}},
            )  # fmt: skip
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
    with open_store(store_uri) as store:
        count = store.add_reports("bench/hour/300W/0", hour_of_reports(seconds, targets))
        store.save_run(
            Run(
                id="bench/hour/300W/0", experiment="bench", benchmark="hour", settings="300W",
                repetition=0, parameters={"p": 1.0}, start=START,
                end=START + timedelta(seconds=seconds),
            )
        )  # fmt: skip
    return count


def measured(command: list[str]) -> tuple[float, float, str]:
    """Wall time, largest RSS in MB, and the error output of a finished command."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    _, status, usage = os.wait4(process.pid, 0)
    errors = process.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        return float("nan"), float("nan"), errors.strip().splitlines()[-1] if errors else "failed"
    return time.perf_counter() - started, usage.ru_maxrss / 1024, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=3600)
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument(
        "--formats",
        default="gpu-dir,extrap-text,extrap-json,extrap-jsonl,extrap-talpas,extrap,ross,hpctoolkit",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wattflow-export-bench-"))
    store = f"sqlite:///{work / 'runs.db'}"
    started = time.perf_counter()
    reports = fill(store, args.seconds, args.targets)
    size_mb = (work / "runs.db").stat().st_size / 1e6
    print(
        f"run: {args.seconds} s, {args.targets} targets, {reports:,} reports "
        f"({size_mb:.0f} MB of SQLite, stored in {time.perf_counter() - started:.0f} s)"
    )
    print(f"{'format':<15} {'wall s':>8} {'reports/s':>10} {'peak RSS MB':>12}")
    for name in args.formats.split(","):
        out = work / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", "wattflow.service", "export", name,
                   "--store", store, "--out", str(out)]  # fmt: skip
        wall, rss, error = measured(command)
        if error:
            print(f"{name:<15} failed: {error}")
            continue
        print(f"{name:<15} {wall:>8.1f} {reports / wall:>10,.0f} {rss:>12.0f}", flush=True)
    print(f"files in {work}")


if __name__ == "__main__":
    main()
