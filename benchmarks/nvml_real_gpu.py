"""Per-process GPU energy on a real GPU: wattflow's shares against the work each load did.

For a node with an NVIDIA driver (it imports and prints ``--help`` anywhere). It:

1. measures the GPU's idle power from its energy counter before any load starts (or takes
   ``--gpu-idle-power-w``), and starts ``wattflow run --input nvml`` with the GPU formula per
   process and that idle, recording GPUReports and PowerReports as JSON Lines, with
   ``nvidia-smi --query-gpu`` (10 Hz) and ``nvidia-smi pmon`` (1 Hz) beside it;
2. runs three phases of ``--seconds`` each: load A alone (busy all the time), load B alone
   (busy ``--duty`` of the time, with jittered sleeps so it cannot lock to the driver's
   sampling), then both together. A load is a spin kernel in PTX through the CUDA driver
   (``libcuda.so.1``; no toolkit, PyTorch or CuPy needed); each load counts its own kernels
   and the GPU time they took (launch to completion);
3. prints, per phase: idle W, the device's energy and its active part (above idle), the energy
   wattflow gave each load (Σ W·Δt over its reports) and its share, against each load's share
   of the work (kernel time) and of SM time in ``nvidia-smi pmon``, and what stayed on the
   device target above idle; then wattflow's device readings against ``nvidia-smi``'s.

Run from the repository root (the GPU index is NVML's, as ``nvidia-smi`` numbers them); three
phases of 60 s take about 3.5 minutes:

    python benchmarks/nvml_real_gpu.py --gpu 0 --seconds 60

Then ``python benchmarks/nvml_overhead.py --fake-gpus 1`` measures the sampler's CPU cost on
the real driver (it uses the driver whenever one is installed).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

SPIN_PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin(.param .u64 out, .param .u32 rounds)
{
    .reg .pred %p;
    .reg .f32 %f<3>;
    .reg .u32 %r<3>;
    .reg .u64 %rd<3>;

    ld.param.u64 %rd0, [out];
    ld.param.u32 %r0, [rounds];
    mov.f32 %f0, 0f3F800000;
    mov.f32 %f1, 0f3F7FFFFE;
    mov.u32 %r1, 0;
LOOP:
    fma.rn.f32 %f0, %f0, %f1, %f1;
    add.u32 %r1, %r1, 1;
    setp.lt.u32 %p, %r1, %r0;
    @%p bra LOOP;
    cvta.to.global.u64 %rd1, %rd0;
    st.global.f32 [%rd1], %f0;
    ret;
}
"""
"""A kernel that keeps every SM it runs on busy for ``rounds`` dependent multiply-adds and
writes the result, so the driver's compiler cannot drop the loop."""


class Cuda:
    """The few CUDA driver calls a spin load needs, through ctypes."""

    def __init__(self, gpu: int) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise SystemExit(f"CUDA driver not loadable: {error}") from None
        self._check(self.lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), gpu), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(self.lib.cuCtxCreate_v2(ctypes.byref(self.context), 0, device), "cuCtxCreate")
        module = ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(module), SPIN_PTX), "cuModuleLoadData")
        self.function = ctypes.c_void_p()
        self._check(
            self.lib.cuModuleGetFunction(ctypes.byref(self.function), module, b"spin"),
            "cuModuleGetFunction",
        )
        self.out = ctypes.c_uint64()
        size = ctypes.c_size_t(4)  # size_t: a bare int would pass 32 bits
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(self.out), size), "cuMemAlloc")
        sms = ctypes.c_int()
        self._check(
            self.lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, device),  # MULTIPROCESSOR_COUNT
            "cuDeviceGetAttribute",
        )
        self.blocks = sms.value * 8

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise SystemExit(f"CUDA: {call} failed with error {code}")

    def spin(self, rounds: int) -> None:
        """One kernel over every SM, waited for."""
        out = ctypes.c_uint64(self.out.value)
        count = ctypes.c_uint32(rounds)
        params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(out), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(count), ctypes.c_void_p),
        )
        self._check(
            self.lib.cuLaunchKernel(
                self.function, self.blocks, 1, 1, 256, 1, 1, 0, None, params, None
            ),
            "cuLaunchKernel",
        )
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


def load(gpu: int, duty: float, seconds: float, report: Path) -> None:
    """Keep the GPU busy ``duty`` of the time for ``seconds`` in ~20 ms kernels, sleeping a
    jittered time after each; write the kernels run and their GPU time to ``report``."""
    cuda = Cuda(0)  # the only device in CUDA_VISIBLE_DEVICES
    rounds = 1 << 16
    while True:  # calibrate: about 20 ms per kernel
        started = time.perf_counter()
        cuda.spin(rounds)
        took = time.perf_counter() - started
        if took >= 0.01 or rounds >= 1 << 30:
            break
        rounds *= 2
    rounds = max(1, int(rounds * 0.02 / took))
    jitter = random.Random(os.getpid())
    kernels, busy_s = 0, 0.0
    started_at = time.time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        cuda.spin(rounds)
        busy = time.perf_counter() - started
        kernels += 1
        busy_s += busy
        if duty < 1:
            time.sleep(busy * (1 - duty) / duty * jitter.uniform(0.5, 1.5))
    report.write_text(
        json.dumps({"pid": os.getpid(), "kernels": kernels, "busy_s": busy_s,
                    "start": started_at, "end": time.time()})
    )  # fmt: skip


@contextmanager
def running(command: list[str], **options: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A process for the length of a block, stopped with SIGINT (as a user's Ctrl-C)."""
    process = subprocess.Popen(command, **options)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_bytes() if path.exists() else b""
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]


def epoch(text: str) -> float:
    """A report's timestamp (naive UTC, as wattflow writes them) as Unix seconds."""
    moment = datetime.fromisoformat(text)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def smi_rows(path: Path) -> list[dict[str, float]]:
    """``nvidia-smi --query-gpu`` CSV rows, with numbers (``[N/A]`` left out)."""
    rows = []
    names = ("time", "power", "util", "clock", "temperature")
    with path.open() as file:
        for row in csv.reader(file):
            if len(row) != len(names):
                continue
            parsed: dict[str, float] = {}
            for name, cell in zip(names, row, strict=True):
                cell = cell.strip()
                try:
                    parsed[name] = (
                        time.mktime(time.strptime(cell.split(".")[0], "%Y/%m/%d %H:%M:%S"))
                        + float("0." + cell.split(".")[1])
                        if name == "time"
                        else float(cell)
                    )
                except (ValueError, IndexError):
                    continue
            rows.append(parsed)
    return rows


def pmon_sm(path: Path, pids: list[int], start: float, end: float) -> dict[int, float]:
    """Mean SM % of each pid in ``nvidia-smi pmon -s u -o T`` rows between start and end
    (``-`` counts as 0; a second without a row for the pid counts as 0)."""
    seen: dict[int, float] = dict.fromkeys(pids, 0.0)
    seconds: set[str] = set()
    for line in path.read_text().splitlines():
        parts = line.split()
        if line.startswith("#") or len(parts) < 5 or not parts[2].isdigit():
            continue
        moment = time.mktime(
            time.strptime(f"{time.strftime('%Y%m%d')} {parts[0]}", "%Y%m%d %H:%M:%S")
        )
        if not start <= moment <= end:
            continue
        seconds.add(parts[0])
        pid = int(parts[2])
        if pid in seen and parts[4] != "-":
            seen[pid] += float(parts[4])
    return {pid: total / max(len(seconds), 1) for pid, total in seen.items()}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def energy_by_target(power: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """Each target's energy in J over (start, end]: Σ W·Δt, Δt from each tick to the one
    before it."""
    by_tick: dict[float, dict[str, float]] = defaultdict(dict)
    for report in power:
        by_tick[epoch(report["timestamp"])][report["target"]] = report["power"]
    energy: dict[str, float] = defaultdict(float)
    for earlier, later in itertools.pairwise(sorted(by_tick)):
        if start < later <= end:
            for target, watts in by_tick[later].items():
                energy[target] += watts * (later - earlier)
    return dict(energy)


def counter_j(reports: list[dict[str, Any]], gpu: int, start: float, end: float) -> float:
    """The device's energy over the phase from its counter readings inside it, in J, scaled
    to the phase's length."""
    readings = [(epoch(r["timestamp"]), r["devices"][str(gpu)]["total_energy"]) for r in reports
                if start <= epoch(r["timestamp"]) <= end
                and "total_energy" in r["devices"][str(gpu)]]  # fmt: skip
    if len(readings) < 2:
        return float("nan")
    (t0, e0), (t1, e1) = readings[0], readings[-1]
    return float((e1 - e0) / 1000 * (end - start) / (t1 - t0))


def phase_table(
    name: str,
    window: tuple[float, float],
    loads: list[dict[str, Any]],
    power: list[dict[str, Any]],
    reports: list[dict[str, Any]],
    pmon: Path,
    gpu: int,
    idle_w: float,
) -> None:
    """One phase: device, active and attributed energy, and each load's shares."""
    start, end = window
    seconds = end - start
    device_j = counter_j(reports, gpu, start, end)
    active_j = device_j - idle_w * seconds
    energy = energy_by_target(power, start, end)
    pids = [load["pid"] for load in loads]
    given = {pid: energy.get(f"pid:{pid}", 0.0) for pid in pids}
    kept = energy.get(f"gpu{gpu}", 0.0) - idle_w * seconds
    work = {load["pid"]: load["busy_s"] for load in loads}
    sm = pmon_sm(pmon, pids, start, end)
    total_given, total_work, total_sm = sum(given.values()), sum(work.values()), sum(sm.values())
    print(f"\n### {name} ({seconds:.0f} s)\n")
    print(
        f"device {device_j:.0f} J ({device_j / seconds:.1f} W), idle {idle_w:.1f} W, active "
        f"{active_j:.0f} J; to the loads {total_given:.0f} J ({total_given / active_j:.1%} "
        f"of active), left on gpu{gpu} above idle {kept:.0f} J"
    )
    print("\n| load | kernels | GPU busy s | share of work | SM % (pmon) | share of SM "
          "| wattflow J | share of wattflow |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for load in loads:
        pid = load["pid"]
        print(
            f"| {load['name']} (pid {pid}) | {load['kernels']} | {work[pid]:.1f} "
            f"| {work[pid] / total_work:.1%} | {sm[pid]:.1f} | {sm[pid] / (total_sm or 1):.1%} "
            f"| {given[pid]:.0f} | {given[pid] / (total_given or 1):.1%} |"
        )


def compare(gpu: int, reports: list[dict[str, Any]], smi: list[dict[str, float]]) -> None:
    """wattflow's readings against nvidia-smi's over the same window, as a Markdown table."""
    devices = [r["devices"][str(gpu)] for r in reports]
    energy = [d["total_energy"] for d in devices if "total_energy" in d]
    seconds = epoch(reports[-1]["timestamp"]) - epoch(reports[0]["timestamp"]) if reports else 0
    from_energy = (energy[-1] - energy[0]) / 1000 / seconds if len(energy) > 1 else float("nan")

    def ours(field: str, scale: float = 1.0) -> float:
        return mean([d[field] / scale for d in devices if field in d])

    def theirs(field: str) -> float:
        return mean([row[field] for row in smi if field in row])

    rows = [
        ("power, W", ours("power", 1000), theirs("power")),
        ("power from the energy counter, W", from_energy, float("nan")),
        ("GPU utilisation, %", ours("util_gpu"), theirs("util")),
        ("SM clock, MHz", ours("clock_gpu"), theirs("clock")),
        ("temperature, °C", ours("temperature"), theirs("temperature")),
    ]
    print("| reading | wattflow | nvidia-smi |")
    print("| --- | --- | --- |")
    for name, mine, other in rows:
        print(f"| {name} | {mine:.1f} | {other:.1f} |")
    kinds = {d.get("power_averaged") for d in devices}
    named = {True: "averaged", False: "instantaneous", None: "legacy call"}
    print("power readings: " + ", ".join(sorted(named[kind] for kind in kinds)))


def describe(gpu: int) -> None:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    print(f"GPU {gpu}: {pynvml.nvmlDeviceGetName(handle)}")
    print(f"driver {pynvml.nvmlSystemGetDriverVersion()}, NVML {pynvml.nvmlSystemGetNVMLVersion()}")
    pynvml.nvmlShutdown()


def idle_power_w(gpu: int, seconds: float) -> float:
    """Mean power over ``seconds`` from the energy counter, with nothing started."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        first, started = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
        time.sleep(seconds)
        last, ended = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
    finally:
        pynvml.nvmlShutdown()
    return float((last - first) / 1000 / (ended - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--duty", type=float, default=0.3, help="busy share of load B")
    parser.add_argument(
        "--gpu-idle-power-w", type=float, help="idle power (default: measured before the loads)"
    )
    parser.add_argument("--load", nargs=4, help=argparse.SUPPRESS)  # GPU DUTY SECONDS REPORT
    args = parser.parse_args()
    if args.load:
        load(int(args.load[0]), float(args.load[1]), float(args.load[2]), Path(args.load[3]))
        return
    if not shutil.which("nvidia-smi"):
        raise SystemExit("nvidia-smi not found: this benchmark needs a node with the driver")
    describe(args.gpu)
    idle_w = args.gpu_idle_power_w
    if idle_w is None:
        idle_w = idle_power_w(args.gpu, 8.0)
        print(f"idle power, measured before the loads: {idle_w:.1f} W")

    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        directory = Path(scratch)
        gpu_file, power_file = directory / "gpu.jsonl", directory / "power.jsonl"
        smi_file, pmon_file = directory / "smi.csv", directory / "pmon.txt"
        # CUDA sees only NVML's GPU --gpu, as its device 0; it numbers devices fastest first
        # unless told to follow the PCI bus, as NVML and nvidia-smi do.
        environment = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                       "CUDA_VISIBLE_DEVICES": str(args.gpu)}  # fmt: skip
        stack.enter_context(
            running(
                ["nvidia-smi", "-i", str(args.gpu), "--query-gpu="
                 "timestamp,power.draw,utilization.gpu,clocks.sm,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", "100", "-f", str(smi_file)]
            )
        )  # fmt: skip
        stack.enter_context(
            running(
                ["nvidia-smi", "pmon", "-i", str(args.gpu), "-s", "u", "-d", "1", "-o", "T"],
                stdout=stack.enter_context(pmon_file.open("w")),
            )
        )
        sampler = stack.enter_context(
            running(
                [sys.executable, "-m", "wattflow.service", "run", "--input", "nvml",
                 "--devices", str(args.gpu), "--gpu-targets", "process",
                 "--gpu-idle-power-w", f"{idle_w:.3f}",
                 "--disable-rapl-formula", "--disable-smartwatts-formula",
                 "--disable-node-formula",
                 "--output", "jsonl", "--model", "GPUReport", "--file", str(gpu_file),
                 "--output", "jsonl", "--model", "PowerReport", "--file", str(power_file)],
                stderr=subprocess.PIPE,
            )
        )  # fmt: skip
        time.sleep(3)  # the sampler's start-up
        phases: list[tuple[str, tuple[float, float], list[dict[str, Any]]]] = []
        for name, duties in (("A alone", {"A": 1.0}), ("B alone", {"B": args.duty}),
                             ("A and B together", {"A": 1.0, "B": args.duty})):  # fmt: skip
            phases.append(run_phase(name, duties, args, directory, environment))
        time.sleep(6)  # the last windows, and ticks held for them (--gpu-hold-ms)
        if sampler.poll() is not None:
            _, error = sampler.communicate()
            raise SystemExit(f"the sampler stopped: {error.decode()[-2000:]}")
        stack.close()
        reports, power = lines(gpu_file), lines(power_file)
        for name, window, loads in phases:
            phase_table(name, window, loads, power, reports, pmon_file, args.gpu, idle_w)
        start, end = phases[0][1][0], phases[-1][1][1]
        inside = [r for r in reports if start <= epoch(r["timestamp"]) <= end]
        smi = [row for row in smi_rows(smi_file) if start <= row.get("time", 0.0) <= end]
        print(f"\n### Device readings over the three phases: {len(inside)} ticks, {len(smi)} "
              "nvidia-smi rows\n")  # fmt: skip
        compare(args.gpu, inside, smi)


def run_phase(
    name: str,
    duties: dict[str, float],
    args: argparse.Namespace,
    directory: Path,
    environment: dict[str, str],
) -> tuple[str, tuple[float, float], list[dict[str, Any]]]:
    """Run the loads of one phase together; their window is from their start to their end,
    less a second at each end (CUDA start-up and teardown)."""
    print(f"phase {name}: {args.seconds:.0f} s", flush=True)
    files = {label: directory / f"{name.replace(' ', '-')}-{label}.json" for label in duties}
    with ExitStack() as stack:
        for label, duty in duties.items():
            stack.enter_context(
                running(
                    [sys.executable, __file__, "--load", str(args.gpu), str(duty),
                     str(args.seconds + 3), str(files[label])],
                    env=environment,
                )
            )  # fmt: skip
        deadline = time.monotonic() + args.seconds + 60
        while not all(path.exists() for path in files.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"phase {name}: the loads did not finish")
            time.sleep(0.5)
    loads = [{**json.loads(files[label].read_text()), "name": label} for label in duties]
    start = max(load["start"] for load in loads) + 2.0
    end = min(load["end"] for load in loads) - 1.0
    return name, (start, end), loads


if __name__ == "__main__":
    main()
