"""The live path, end to end: hwpc-sensors' socket output → SmartWatts → JSON Lines.

Generates ``--sensors`` × ``--containers`` hwpc-sensor streams with ``generate_hwpc.py`` (2
sockets × 4 cpus each, one tick a second), encoded before any timing as the newline-delimited
JSON that hwpc-sensor writes to its socket output. Then, per round (``--repeat``, medians
printed):

1. **Decode limit.** ``orjson.loads`` on every line, the same bytes: the rate at which a process
   merely parses the input, which no formula service fed JSON can beat.
2. **wattflow.** ``wattflow run --input socket --port 0 --output jsonl --file OUT`` with
   SmartWatts (and RAPL) as by default, pinned to core 0. This process, kept off that core,
   opens one connection per sensor, as hwpc-sensors connect, and sends each sensor's whole
   stream from its own thread as fast as TCP accepts. Each sender then half-closes its
   connection and waits for wattflow to close it, which it does once it has read that sensor's
   last report. After the last connection closes, SIGTERM drains the pipeline (the last ticks
   are flushed) and wattflow exits. The time runs from just before the first byte is sent to the
   last write of OUT (its modification time, in the kernel's clock ticks of a few ms).

Checks, per run: exit code 0; the ledger line wattflow logs at exit (``pipeline drained:
entered=… delivered=…``) says every report sent entered, none was rejected or dead-lettered, and
it delivered as many PowerReports as OUT holds lines. A failed check fails the script (exit 1).

``--workers 1,2`` runs each round once per worker count (``wattflow run --workers N``, each
worker writing its own ``OUT.workerJ.jsonl``), prints the rate of each and its ratio to the
first count's, and the CPU time per report of each (every process: parent and workers). With
workers, wattflow is not pinned: its processes and the senders share the machine's cores, so on
a machine with few cores the senders take a share of what the workers could use.

Prints the decode rate, wattflow's end-to-end rate and their ratio (per round, and the median
of the rounds), wattflow's CPU time (all of it, start-up included; and from the first byte sent
to its exit, with the share of its core that is) and its peak RSS (``VmHWM``). Run from the
repository root, on a machine with two cores or more:

    python benchmarks/live_socket.py --sensors 100 --containers 100 --ticks 40

``--paced`` measures what a running service costs at the pace sensors really send: one tick (the
global report and one report per container, one write) per sensor per second. One connection per
sensor; each sensor first sends :data:`WARM_UP_TICKS` ticks at once (SmartWatts learns its models on
them) and, once wattflow is idle again, ``--seconds`` ticks, one a second, sensor ``j`` of ``N`` at
``j/N`` into each second, as sensors started at random moments do. The CPU time of every process of
the service (user and system, all threads) is read over that span (plus :data:`SETTLE_S` for the
last ticks, and the socket input's ``--gather-ms`` where ``--input-args`` gives it) and printed per
sensor-tick and per report, as a share of a core, and by thread (the event loop, the other threads),
for each ``--paced-containers`` count. So is each tick's latency, what the CPU is traded against:
from its send to the last of its PowerReports in OUT (SmartWatts' estimates, which wait
``--tick-lateness-ms`` of the sensor's own time for late reports; the RAPL formula's come first),
median, 99th percentile and longest, over the ticks whose estimates came out before the CPU was read
(the last ones are flushed at the drain, which would read short). The ledger is checked after a
drain, as in the flood mode. CPU time, not wall time: the machine may be shared. A run in which
wattflow used more than :data:`BUSY_WARNING` of its core could not keep up, and says so. With
``--workers N`` (one count), wattflow runs N workers, not pinned, and the share is of N cores (the
threads of the workers are not read apart). ``--profile N`` runs wattflow under cProfile (with the
Python running this script) and prints the N modules (or C functions) where its event loop spent
most of its own time over the whole run, start-up and warm-up included; profiling slows it, so its
CPU figures are then not comparable.

    python benchmarks/live_socket.py --paced --sensors 100 --seconds 15 --paced-containers 10,100
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_hwpc import Machine, containers_named, simulate, tick_views

WATTFLOW_CORE = 0
FLAGS = (
    "--sensor-reports-frequency", "1000",
    "--learn-min-samples-required", "10",
    "--cpu-base-freq", "2100",
    "--cpu-tdp", "400",
)  # fmt: skip
"""SmartWatts' flags, as the other benchmarks give them; the generator ticks once a second."""
LISTENING = re.compile(rb"listening for hwpc-sensor on \S+:(\d+)")
DRAINED = re.compile(rb"pipeline drained: (.*)")
WORKER_READY = b"reading the hwpc-sensor connections handed to this worker"
START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BUSY_WARNING = 0.85
"""Below this share of its core during the stream, a round's rate says more about the machine."""


def sensor_ticks(sensors: int, containers: int, ticks: int, seed: int) -> list[list[list[bytes]]]:
    """Each sensor's ticks, each as the JSON lines hwpc-sensor writes to its socket for it:
    the global report, then one per container."""
    streams = []
    for number in range(sensors):
        machine = Machine(sensor=f"node-{number + 1}", sockets=2, cpus_per_socket=4)
        views = simulate(machine, containers_named(containers), ticks, seed=seed + number)
        streams.append(
            [
                [line.encode() for line in view.json_lines()]
                for block in views
                for view in tick_views(block)
            ]
        )
    return streams


def sensor_streams(sensors: int, containers: int, ticks: int, seed: int) -> list[list[bytes]]:
    """Each sensor's reports as hwpc-sensor writes them to its socket: one JSON line each."""
    return [
        [line for tick in stream for line in tick]
        for stream in sensor_ticks(sensors, containers, ticks, seed)
    ]


def decode_rate(streams: Sequence[Sequence[bytes]]) -> float:
    """Reports/s at which ``orjson.loads`` parses every line, one call per line."""
    loads = orjson.loads
    count = 0
    start = time.perf_counter()
    for lines in streams:
        for line in lines:
            loads(line)
        count += len(lines)
    return count / (time.perf_counter() - start)


@dataclass
class Sender:
    """One sensor's connection: sends its stream, then waits for wattflow to close it."""

    connection: socket.socket
    data: bytes
    go: threading.Event
    closed_at: float = 0.0
    error: str | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.go.wait()
            self.connection.sendall(self.data)
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(EXIT_TIMEOUT_S)
            while self.connection.recv(1 << 16):
                pass
            self.closed_at = time.time()
        except OSError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.connection.close()


class Log:
    """wattflow's stderr, read as it comes: the port it listens on and its ledger line."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[bytes] = []
        self.port: int | None = None
        self.ledger: dict[str, int] | None = None
        self.listening = threading.Event()
        self.workers_ready = 0
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            self.lines.append(line)
            self.workers_ready += WORKER_READY in line
            if self.port is None and (found := LISTENING.search(line)):
                self.port = int(found.group(1))
                self.listening.set()
            elif found := DRAINED.search(line):
                pairs = re.findall(rb"(\w+)=(\d+)", found.group(1))
                self.ledger = {name.decode(): int(value) for name, value in pairs}
        self.listening.set()  # stderr closed: wattflow is gone, stop waiting for the port

    def tail(self, lines: int = 15) -> str:
        return b"".join(self.lines[-lines:]).decode("utf-8", "replace")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process, all threads, and of its child processes
    (the workers of ``--workers``, running or waited for), from ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    own = sum(int(fields[index]) for index in (11, 12, 13, 14)) / CLOCK_TICKS
    return own + sum(cpu_seconds(int(child)) for child in children)


def outputs(output: Path) -> list[Path]:
    """The files wattflow wrote: OUT, or with workers, one per worker (OUT.workerJ.jsonl)."""
    found = sorted(output.parent.glob(f"{output.stem}.worker*{output.suffix}"))
    return [output] if output.exists() else found


def peak_rss_mb(pid: int) -> float:
    """The process's peak RSS so far (``VmHWM``), in MB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else 0.0


def wait4(
    process: subprocess.Popen[bytes], timeout: float
) -> tuple[resource.struct_rusage, float] | None:
    """Reap the process within ``timeout``: its own resource usage and peak RSS, or ``None``.

    The peak is read from ``/proc`` every 10 ms until the process is gone, not taken from the
    rusage: ``ru_maxrss`` keeps, across exec, the RSS of the fork of this process that became
    wattflow, which holds the whole input.
    """
    deadline = time.monotonic() + timeout
    peak = 0.0
    while time.monotonic() < deadline:
        peak = max(peak, peak_rss_mb(process.pid))
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage, peak
        time.sleep(0.01)
    return None


@dataclass
class Run:
    """One wattflow run's figures and what its checks found."""

    reports: int
    wall_s: float = 0.0
    read_s: float = 0.0  # until wattflow had read (and closed) every connection
    cpu_s: float = 0.0  # the whole process, start-up and shutdown included
    cpu_stream_s: float = 0.0  # from the first byte sent to exit
    exit_s: float = 0.0  # from the first byte sent to exit
    peak_rss_mb: float = 0.0
    written: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def busy(self) -> float:
        """Share of its core wattflow used from the first byte sent to its exit."""
        return self.cpu_stream_s / self.exit_s if self.exit_s > 0 else 0.0

    @property
    def rate(self) -> float:
        return self.reports / self.wall_s if self.wall_s > 0 else 0.0


ALL_CORES = frozenset(os.sched_getaffinity(0))
"""The cores this script may use, read before it keeps itself off wattflow's core."""


def pin_to(core: int) -> None:
    os.sched_setaffinity(0, {core})


def free_on_all_cores() -> None:
    """Several workers run on every core, not on the cores the script kept for itself."""
    os.sched_setaffinity(0, ALL_CORES)


def run_wattflow(
    command: list[str],
    extra: list[str],
    input_extra: list[str],
    blobs: Sequence[bytes],
    reports: int,
    output: Path,
    timeout: float,
    workers: int = 1,
) -> Run:
    """Start wattflow on the socket input, send every sensor's stream, drain, and measure."""
    run = Run(reports=reports)
    for old in outputs(output):
        old.unlink()
    process = subprocess.Popen(
        [*command, "run", "--input", "socket", "--port", "0", *input_extra, "--workers",
         str(workers), "--output", "jsonl", "--file", str(output), *FLAGS, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=(lambda: pin_to(WATTFLOW_CORE)) if workers == 1 else free_on_all_cores,
    )  # fmt: skip
    assert process.stderr is not None
    log = Log(process.stderr)
    senders: list[Sender] = []
    try:
        if not log.listening.wait(START_TIMEOUT_S) or log.port is None:
            run.problems.append(f"wattflow did not start listening:\n{log.tail()}")
            return run
        started = time.monotonic()
        while workers > 1 and log.workers_ready < workers and process.poll() is None:
            if time.monotonic() - started > START_TIMEOUT_S:
                break
            time.sleep(0.05)  # the workers start (the time is not measured)
        go = threading.Event()
        for blob in blobs:
            connection = socket.create_connection(("127.0.0.1", log.port), timeout=30)
            connection.settimeout(None)
            senders.append(Sender(connection, blob, go))
        cpu_before = cpu_seconds(process.pid)
        start = time.time()
        go.set()
        deadline = time.monotonic() + timeout
        for sender in senders:
            sender.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [s for s in senders if s.thread.is_alive()]
        failed = [s.error for s in senders if s.error]
        if stuck or failed:
            run.problems.append(
                f"{len(stuck)} connections still open after {timeout:.0f} s, "
                f"{len(failed)} failed ({failed[:3]})"
            )
        run.read_s = max(s.closed_at for s in senders) - start if not stuck else 0.0
        process.send_signal(signal.SIGTERM)
        reaped = wait4(process, EXIT_TIMEOUT_S)
        if reaped is None:
            run.problems.append(f"wattflow did not exit within {EXIT_TIMEOUT_S:.0f} s of SIGTERM")
            return run
        run.exit_s = time.time() - start
        usage, run.peak_rss_mb = reaped
        run.cpu_s = usage.ru_utime + usage.ru_stime  # with the workers it waited for
        run.cpu_stream_s = run.cpu_s - cpu_before
        log.thread.join(10)
        written = outputs(output)
        run.wall_s = max((f.stat().st_mtime_ns / 1e9 for f in written), default=start) - start
        check(run, process.returncode, log, output)
        return run
    finally:
        if process.returncode is None:
            process.kill()
            process.wait()
        for sender in senders:
            sender.connection.close()


def check(run: Run, returncode: int | None, log: Log, output: Path) -> None:
    """Exit code 0, and the ledger accounts for every report sent and every line written."""
    if returncode != 0:
        run.problems.append(f"wattflow exited with {returncode}:\n{log.tail()}")
    written = outputs(output)
    if not written:
        run.problems.append(f"wattflow wrote no {output}")
        return
    first: dict[str, object] = {}
    for path in written:
        with path.open("rb") as handle:
            run.written += sum(
                chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 24), b"")
            )
            handle.seek(0)
            first = first or orjson.loads(handle.readline() or b"{}")
    if "power" not in first:
        run.problems.append(f"the first line of {written[0]} is not a PowerReport: {first}")
    ledger = log.ledger
    if ledger is None:
        run.problems.append(
            f"no ledger line ('pipeline drained: …') in wattflow's log:\n{log.tail()}"
        )
        return
    if ledger.get("entered") != run.reports:
        run.problems.append(f"sent {run.reports} reports, the ledger says {ledger}")
    for name in ("rejected_input", "dead_in", "dead_out"):
        if ledger.get(name, 0):
            run.problems.append(f"{name}={ledger[name]} in the ledger: {ledger}")
    if ledger.get("delivered") != run.written:
        run.problems.append(f"{run.written} lines written, the ledger says {ledger}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--sensors", type=int, default=100, help="hwpc-sensors, one connection each"
    )
    parser.add_argument("--containers", type=int, default=100, help="containers per sensor")
    parser.add_argument("--ticks", type=int, default=40, help="ticks (one a second) per sensor")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; medians are printed")
    parser.add_argument(
        "--wattflow",
        default=str(Path(sys.executable).parent / "wattflow"),
        help="command that runs wattflow (default: the one next to this Python)",
    )
    parser.add_argument(
        "--wattflow-args",
        default="",
        help="more flags for `wattflow run`, after the output's (--wattflow-args='…')",
    )
    parser.add_argument(
        "--input-args",
        default="",
        help="more flags for the socket input, e.g. --input-args='--max-batch 500'",
    )
    parser.add_argument(
        "--workers",
        default="1",
        help="worker counts to compare, comma-separated (e.g. 1,2): `wattflow run --workers N`",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="longest wait for wattflow to read the input"
    )
    parser.add_argument(
        "--paced",
        action="store_true",
        help="paced mode: each sensor sends one tick a second; prints CPU per sensor-tick",
    )
    parser.add_argument(
        "--seconds", type=int, default=20, help="--paced: seconds of paced ticks measured"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="--paced: run wattflow under cProfile (with this Python) and print the N modules "
        "that took most of the event loop's time (profiling slows it: its CPU figures go up)",
    )
    parser.add_argument(
        "--paced-containers",
        default="10,100",
        help="--paced: containers per sensor, one shape per count, comma-separated",
    )
    args = parser.parse_args()
    if args.paced:
        args.containers_list = [int(n) for n in args.paced_containers.split(",")]
        if min(args.sensors, args.seconds, args.repeat, *args.containers_list) < 1:
            parser.error("--sensors, --seconds, --repeat and --paced-containers take 1 or more")
        if not args.workers.isdigit() or int(args.workers) < 1:
            parser.error("--paced takes one --workers count, 1 or more")
        args.workers = int(args.workers)
        others = os.sched_getaffinity(0) - {WATTFLOW_CORE}
        if others:
            os.sched_setaffinity(0, others)
        return paced_main(args)
    if min(args.sensors, args.containers, args.ticks, args.repeat) < 1:
        parser.error("--sensors, --containers, --ticks and --repeat take 1 or more")
    try:
        counts = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error("--workers takes counts separated by commas, e.g. 1,2")
    if min(counts) < 1:
        parser.error("--workers takes counts of 1 or more")
    command = shlex.split(args.wattflow)
    extra = shlex.split(args.wattflow_args)
    input_extra = shlex.split(args.input_args)

    others = os.sched_getaffinity(0) - {WATTFLOW_CORE}
    if others:
        os.sched_setaffinity(0, others)  # the senders and the decode loop stay off wattflow's core
    else:
        print("warning: one core only: the senders share wattflow's core", file=sys.stderr)

    started = time.perf_counter()
    streams = sensor_streams(args.sensors, args.containers, args.ticks, args.seed)
    reports = sum(len(lines) for lines in streams)
    blobs = [b"".join(lines) for lines in streams]
    megabytes = sum(len(blob) for blob in blobs) / 1e6
    print(
        f"{args.sensors} sensors × {args.containers} containers × {args.ticks} ticks: "
        f"{reports:,} reports, {megabytes:,.0f} MB of JSON lines "
        f"(generated in {time.perf_counter() - started:.1f} s); wattflow on core {WATTFLOW_CORE}, "
        f"senders on cores {sorted(others) or [WATTFLOW_CORE]}"
    )

    decodes: list[float] = []
    runs: dict[int, list[Run]] = {count: [] for count in counts}
    with tempfile.TemporaryDirectory(prefix="wattflow-live-") as directory:
        output = Path(directory) / "power.jsonl"
        for round_number in range(1, args.repeat + 1):
            decodes.append(decode_rate(streams))
            for count in counts:
                run = run_wattflow(
                    command, extra, input_extra, blobs, reports, output, args.timeout, count
                )
                runs[count].append(run)
                report_round(round_number, count, run, decodes[-1])
    return summary(runs, decodes, counts)


def report_round(round_number: int, workers: int, run: Run, decode: float) -> None:
    print(
        f"round {round_number}, {workers} worker{'s' if workers > 1 else ''}: decode "
        f"{decode:,.0f} reports/s; wattflow "
        f"{run.rate:,.0f} reports/s = {run.rate / decode:.1%} ({run.wall_s:.2f} s, "
        f"input read in {run.read_s:.2f} s), "
        f"{run.written:,} PowerReports, CPU {run.cpu_stream_s:.2f} s to exit "
        f"({run.busy:.0%} of one core; {run.cpu_s:.2f} s in all), "
        f"peak RSS {run.peak_rss_mb:,.0f} MB" + ("" if not run.problems else "; FAILED")
    )
    if not run.problems and workers == 1 and run.busy < BUSY_WARNING:
        print(
            f"  warning: wattflow had {run.busy:.0%} of its core: "
            "another process shared core 0, or the senders did not keep it busy"
        )
    for problem in run.problems:
        print(f"  problem: {problem}", file=sys.stderr)


def summary(runs: dict[int, list[Run]], decodes: list[float], counts: list[int]) -> int:
    """The medians of the rounds, per worker count, and each count's ratio to the first."""
    decode = statistics.median(decodes)
    print()
    print(f"decode limit (orjson.loads per line): {decode:>12,.0f} reports/s")
    anchor = statistics.median(run.rate for run in runs[counts[0]])
    for count in counts:
        done = runs[count]
        rate = statistics.median(run.rate for run in done)
        ratio = statistics.median(run.rate / d for run, d in zip(done, decodes, strict=True))
        cpu_stream = statistics.median(run.cpu_stream_s for run in done)
        per_report_us = cpu_stream / done[0].reports * 1e6
        print(
            f"wattflow --workers {count} (socket → jsonl): {rate:>12,.0f} reports/s "
            f"({statistics.median(run.wall_s for run in done):.2f} s), "
            f"{ratio:.1%} of the decode limit, "
            f"{rate / anchor if anchor else 0:.2f}× --workers {counts[0]}; "
            f"CPU {cpu_stream:.2f} s from the first byte to exit = {per_report_us:.1f} µs per "
            f"report ({statistics.median(run.busy for run in done):.0%} of one core; "
            f"{statistics.median(run.cpu_s for run in done):.2f} s in all, start-up included); "
            f"peak RSS of the parent {max(run.peak_rss_mb for run in done):,.0f} MB"
        )
    every = [run for count in counts for run in runs[count]]
    failed = [run for run in every if run.problems]
    if failed:
        print(f"{len(failed)} of {len(every)} runs FAILED their checks (see above)")
        return 1
    written = {run.written for run in every}
    print(f"checks passed: exit 0, ledger balanced, PowerReports written {sorted(written)}")
    return 0


WARM_UP_TICKS = 12
"""Ticks each sensor sends, at once, before the paced span: SmartWatts learns its models on the
first ``--learn-min-samples-required`` (10) of them, which a running service did long ago."""
SETTLE_S = 1.5
"""After the last paced tick, the time given to wattflow to handle it before CPU is read
(``--gather-ms`` and the stages take a few tens of ms)."""


def settle_s(input_extra: Sequence[str]) -> float:
    """:data:`SETTLE_S`, plus the input's ``--gather-ms`` when it is given: lines wait that long
    before they are decoded, and the CPU they then take belongs to the paced ticks."""
    gather_ms = 0.0
    for at, flag in enumerate(input_extra):
        if flag == "--gather-ms" and at + 1 < len(input_extra):
            gather_ms = float(input_extra[at + 1])
        elif flag.startswith("--gather-ms="):
            gather_ms = float(flag.split("=", 1)[1])
    return SETTLE_S + gather_ms / 1000


QUIET_CPU_S = 0.02
"""wattflow has handled the warm-up once it uses less CPU than this over half a second."""


@dataclass
class Paced:
    """One paced run's figures: CPU over the paced span, all of the service's processes."""

    sensors: int
    containers: int
    seconds: int
    workers: int = 1  # `wattflow run --workers N`: then not pinned, with N cores to use
    reports: int = 0  # sent, warm-up included: what the ledger must say entered
    cpu_s: float = 0.0
    span_s: float = 0.0
    late_s: float = 0.0  # the latest a tick was sent after its time
    latency_s: list[float] = field(default_factory=list)
    """Per paced tick whose estimates came out while it was measured: from its send to the
    last of its PowerReports written (SmartWatts' per-container estimates come last)."""
    threads: dict[str, float] = field(default_factory=dict)
    written: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ticks(self) -> int:
        """Sensor-ticks sent over the paced span."""
        return self.sensors * self.seconds

    @property
    def per_tick_us(self) -> float:
        return self.cpu_s / self.ticks * 1e6

    @property
    def busy(self) -> str:
        """The CPU over the paced span as a share of the cores the service has."""
        share = self.cpu_s / self.span_s / self.workers
        return f"{share:.1%} of {'a core' if self.workers == 1 else f'{self.workers} cores'}"

    @property
    def per_report_us(self) -> float:
        return self.cpu_s / (self.ticks * (self.containers + 1)) * 1e6

    @property
    def latency(self) -> str:
        """The ticks' latency: median, 99th percentile and longest, and how many were seen."""
        if not self.latency_s:
            return "no tick's estimates seen while measured"
        ordered = sorted(self.latency_s)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return (
            f"latency median {statistics.median(ordered):.2f} s, p99 {p99:.2f} s, "
            f"longest {ordered[-1]:.2f} s ({len(ordered):,} of {self.ticks:,} ticks seen)"
        )


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of each thread of a running process, user and system (the kernel: socket
    reads, writes, epoll) apart, summed by thread name (``comm``): the event loop's thread
    apart from the others (executor threads)."""
    found: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        name = "event loop" if task.name == str(pid) else "other threads"
        fields = stat.rsplit(")", 1)[1].split()
        found[f"{name} user"] = found.get(f"{name} user", 0.0) + int(fields[11]) / CLOCK_TICKS
        found[f"{name} system"] = found.get(f"{name} system", 0.0) + int(fields[12]) / CLOCK_TICKS
    return found


def wait_until_quiet(pid: int, timeout: float) -> None:
    """Wait until wattflow has handled what it was sent: its CPU stops moving."""
    deadline = time.monotonic() + timeout
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_seconds(pid)
        if now - before < QUIET_CPU_S:
            return
        before = now


def millis_of(stamp: int | float | str) -> int:
    """A report's timestamp in Unix ms: hwpc-sensor writes ms, the JSON Lines output ISO."""
    if isinstance(stamp, str):
        moment = datetime.fromisoformat(stamp)
        moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        return round(moment.timestamp() * 1000)
    return int(stamp)


def tick_key(tick: bytes) -> tuple[str, int]:
    """A tick's sensor and timestamp, from its first line (its global report)."""
    first = orjson.loads(tick[: tick.index(b"\n")] if b"\n" in tick else tick)
    return first["sensor"], millis_of(first["timestamp"])


class OutputWatcher:
    """Follows wattflow's output files and notes when each (sensor, tick)'s PowerReports
    were last written, other than the RAPL formula's (written as the tick comes): when its
    SmartWatts estimates came out."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.offsets: dict[Path, int] = {}
        self.pending: dict[Path, bytes] = {}
        self.seen: dict[tuple[str, int], float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.stop.wait(0.02):
            self.read()

    def read(self) -> None:
        for path in outputs(self.output):
            try:
                with path.open("rb") as file:
                    file.seek(self.offsets.get(path, 0))
                    data = self.pending.get(path, b"") + file.read()
                    self.offsets[path] = file.tell()
            except OSError:
                continue
            lines = data.split(b"\n")
            self.pending[path] = lines.pop()
            now = time.monotonic()
            for line in lines:
                report = orjson.loads(line)
                if report.get("target") != "rapl":
                    self.seen[(report["sensor"], millis_of(report["timestamp"]))] = now

    def close(self) -> dict[tuple[str, int], float]:
        self.stop.set()
        self.thread.join()
        return self.seen


def send_paced(
    connections: Sequence[socket.socket],
    ticks: Sequence[Sequence[bytes]],
    seconds: int,
    sent: dict[tuple[int, int], float] | None = None,
) -> float:
    """Send tick ``WARM_UP_TICKS + k`` of every sensor during second ``k``, sensor ``j`` at
    ``j / sensors`` into it, as sensors started at random moments do; the latest a send came
    after its time."""
    late = 0.0
    start = time.monotonic()
    count = len(connections)
    for second in range(seconds):
        for number, connection in enumerate(connections):
            due = start + second + number / count
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                late = max(late, -wait)
            connection.sendall(ticks[number][WARM_UP_TICKS + second])
            if sent is not None:
                sent[(number, second)] = time.monotonic()
    return late


def close_all(connections: Sequence[socket.socket], timeout: float) -> None:
    """Half-close every connection, then wait for wattflow to close each (all read)."""
    for connection in connections:
        connection.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + timeout
    for connection in connections:
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while connection.recv(1 << 16):
                pass
        except OSError:
            pass
        connection.close()


def run_paced(
    command: list[str],
    extra: list[str],
    input_extra: list[str],
    ticks: Sequence[Sequence[bytes]],
    run: Paced,
    output: Path,
    timeout: float,
) -> Paced:
    """Start wattflow, warm it up, send ``run.seconds`` paced ticks per sensor, measure the CPU
    of its processes over them, then drain and check its ledger as the flood mode does."""
    for old in outputs(output):
        old.unlink()
    process = subprocess.Popen(
        [*command, "run", "--input", "socket", "--port", "0", *input_extra, "--workers",
         str(run.workers), "--output", "jsonl", "--file", str(output), *FLAGS, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=(lambda: pin_to(WATTFLOW_CORE)) if run.workers == 1 else None,
    )  # fmt: skip
    assert process.stderr is not None
    log = Log(process.stderr)
    connections: list[socket.socket] = []
    try:
        if not log.listening.wait(START_TIMEOUT_S) or log.port is None:
            run.problems.append(f"wattflow did not start listening:\n{log.tail()}")
            return run
        for sensor in ticks:
            connection = socket.create_connection(("127.0.0.1", log.port), timeout=30)
            connections.append(connection)
            connection.sendall(b"".join(sensor[:WARM_UP_TICKS]))
        wait_until_quiet(process.pid, timeout)
        watcher = OutputWatcher(output)
        cpu_before, threads_before = cpu_seconds(process.pid), thread_cpu_seconds(process.pid)
        start = time.monotonic()
        sent: dict[tuple[int, int], float] = {}
        run.late_s = send_paced(connections, ticks, run.seconds, sent)
        time.sleep(settle_s(input_extra))
        run.cpu_s = cpu_seconds(process.pid) - cpu_before
        run.span_s = time.monotonic() - start
        seen = watcher.close()
        keys = [[tick_key(tick) for tick in sensor[WARM_UP_TICKS:]] for sensor in ticks]
        run.latency_s = [
            seen[keys[number][second]] - at
            for (number, second), at in sent.items()
            if keys[number][second] in seen
        ]
        threads = thread_cpu_seconds(process.pid)
        run.threads = {k: v - threads_before.get(k, 0.0) for k, v in threads.items()}
        close_all(connections, timeout)
        process.send_signal(signal.SIGTERM)
        if wait4(process, EXIT_TIMEOUT_S) is None:
            run.problems.append(f"wattflow did not exit within {EXIT_TIMEOUT_S:.0f} s of SIGTERM")
            return run
        log.thread.join(10)
        checked = Run(reports=run.reports)
        check(checked, process.returncode, log, output)
        run.written, run.problems = checked.written, run.problems + checked.problems
        return run
    finally:
        if process.returncode is None:
            process.kill()
            process.wait()
        for connection in connections:
            connection.close()


def print_profile(path: Path, top: int) -> None:
    """Where the event loop's CPU went over a whole profiled run (start-up and warm-up
    included), by module: the share of its own time (``tottime``) each took."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    by_module: dict[str, float] = {}
    for (file, _, function), (_, _, own_s, _, _) in stats.items():
        if "epoll" in function:
            continue  # waiting for sockets: idle, not work
        module = re.sub(r".*/(wattflow|site-packages|python3\.\d+)/", "", file)
        if module == "~":  # a C function: numpy's, the interpreter's, a system call
            module = re.sub(r" of '.*' objects| at 0x\w+", "", function)
        by_module[module] = by_module.get(module, 0.0) + own_s
    total = sum(by_module.values())
    print(f"  where the event loop's time went (cProfile, whole run, {total:.2f} s profiled):")
    for module, own_s in sorted(by_module.items(), key=lambda item: -item[1])[:top]:
        print(f"    {own_s / total:6.1%}  {module}")


def paced_main(args: argparse.Namespace) -> int:
    """``--paced``: each shape's CPU per sensor-tick and per report, and where it goes."""
    command = shlex.split(args.wattflow)
    profile = Path(tempfile.gettempdir()) / f"wattflow-paced-{os.getpid()}.prof"
    if args.profile:
        command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "wattflow.service"]
    extra = shlex.split(args.wattflow_args)
    input_extra = shlex.split(args.input_args)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="wattflow-paced-") as directory:
        output = Path(directory) / "power.jsonl"
        for containers in args.containers_list:
            ticks = [
                [b"".join(tick) for tick in sensor]
                for sensor in sensor_ticks(
                    args.sensors, containers, WARM_UP_TICKS + args.seconds, args.seed
                )
            ]
            runs = []
            for round_number in range(1, args.repeat + 1):
                run = Paced(args.sensors, containers, args.seconds, args.workers)
                run.reports = args.sensors * (WARM_UP_TICKS + args.seconds) * (containers + 1)
                run_paced(command, extra, input_extra, ticks, run, output, args.timeout)
                runs.append(run)
                report_paced(round_number, run)
                if args.profile and profile.exists():
                    print_profile(profile, args.profile)
                    profile.unlink()
            failed += sum(1 for run in runs if run.problems)
            best = sorted(runs, key=lambda run: run.cpu_s)[len(runs) // 2]
            print(
                f"median {args.sensors} sensors × {containers} containers: "
                f"{best.per_tick_us:,.0f} µs of CPU per sensor-tick, "
                f"{best.per_report_us:.1f} µs per report, {best.busy}; {best.latency}"
            )
    if failed:
        print(f"{failed} runs FAILED their checks (see above)")
        return 1
    print("checks passed: exit 0, ledger balanced")
    return 0


def report_paced(round_number: int, run: Paced) -> None:
    threads = ", ".join(
        f"{name} {seconds / run.ticks * 1e6:,.0f} µs"
        for name, seconds in sorted(run.threads.items(), key=lambda item: -item[1])
        if seconds > 0 and run.workers == 1  # a worker's threads are not read
    )
    print(
        f"round {round_number}, {run.sensors} sensors × {run.containers} containers, "
        f"{run.seconds} s paced: CPU {run.cpu_s:.2f} s over {run.span_s:.1f} s "
        f"({run.busy}) = {run.per_tick_us:,.0f} µs per sensor-tick, "
        f"{run.per_report_us:.1f} µs per report; "
        + (f"per sensor-tick by thread (the service's process): {threads}; " if threads else "")
        + f"sends up to {run.late_s * 1e3:.0f} ms late; {run.latency}; "
        + f"{run.written:,} PowerReports"
        + ("" if not run.problems else "; FAILED")
    )
    if run.cpu_s / run.span_s > BUSY_WARNING * run.workers:
        print(
            f"  warning: wattflow used {run.busy}: it could not keep up with the ticks, and "
            "the figures are a lower bound"
        )
    for problem in run.problems:
        print(f"  problem: {problem}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
