"""Per-process GPU energy on a real GPU: wattflow's shares against the work each load did.

For a node with an NVIDIA driver (it imports and prints ``--help`` anywhere). Two protocols.

**equal** (the default): two loads of the same spin kernel.

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

**mixed** (``--protocol mixed``): a heavy load and a light load that draw very different power
for the same engine time, which a split by time share cannot tell apart. The heavy load is an
FMA loop on every SM (or, with ``--heavy-load torch``, bf16 matmuls, where PyTorch is
installed); the light one is a single block spinning on one SM. The SAME two processes live
through every phase, so that the estimator can learn from their solo stretches what it then
applies when they share: heavy alone, an idle stretch, both (the heavy one in jittered bursts of
seconds when ``--heavy-duty`` < 1), an idle stretch, light alone. Each phase lasts ``--seconds``,
each idle stretch ``--gap-seconds``; the parent hands both processes the schedule (absolute
times) through a pipe once both have started, and each records the start and end of every
kernel it runs. The truth is energy per unit of work: each load's active energy (above idle,
from the energy counter) over its solo phase divided by the kernels it completed there; a
load's true energy in any other window is the kernels it completed there times that figure.
For the shared phase and for the whole run it prints each load's wattflow energy and share
against its true share, the difference in points, the closure (sum of the true energies over
the measured active energy: how far the solo figures explain the shared phase), the share of the
active energy that reached the processes, which split the GPU formula used for the load's
reports (metadata ``split``: ``power`` or ``time``, with the last ``active_power_w`` ±
``active_power_stderr_w``; reports without it count as unknown, as today's formula writes
them), and the share a split by time alone would give (the processes' SM utilisation in the
GPUReports) and ``nvidia-smi pmon``'s. ``--summary PATH`` writes these figures as JSON, with
the GPU's model and driver version, for the docs.

Run from the repository root (the GPU index is NVML's, as ``nvidia-smi`` numbers them). The
equal protocol's three phases of 60 s take about 3.5 minutes; the mixed protocol's three phases
of 60 s and two idle stretches of 10 s about 4 minutes:

    python benchmarks/nvml_real_gpu.py --gpu 0 --seconds 60
    python benchmarks/nvml_real_gpu.py --gpu 0 --protocol mixed --seconds 60 \\
        --summary mixed.json

Then ``python benchmarks/nvml_overhead.py --fake-gpus 1`` measures the sampler's CPU cost on
the real driver (it uses the driver whenever one is installed).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import importlib
import itertools
import json
import math
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
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

HEAVY_PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry heavy(.param .u64 out, .param .u32 rounds)
{
    .reg .pred %p;
    .reg .f32 %f<8>;
    .reg .u32 %r<3>;
    .reg .u64 %rd<3>;

    ld.param.u64 %rd0, [out];
    ld.param.u32 %r0, [rounds];
    mov.f32 %f0, 0f3F800000;
    mov.f32 %f1, 0f3F7FFFFE;
    mov.f32 %f2, 0f3F000000;
    mov.f32 %f3, 0f3E800000;
    mov.f32 %f4, 0f3E000000;
    mov.u32 %r1, 0;
LOOP:
    fma.rn.f32 %f0, %f0, %f1, %f1;
    fma.rn.f32 %f2, %f2, %f1, %f1;
    fma.rn.f32 %f3, %f3, %f1, %f1;
    fma.rn.f32 %f4, %f4, %f1, %f1;
    fma.rn.f32 %f0, %f0, %f1, %f1;
    fma.rn.f32 %f2, %f2, %f1, %f1;
    fma.rn.f32 %f3, %f3, %f1, %f1;
    fma.rn.f32 %f4, %f4, %f1, %f1;
    add.u32 %r1, %r1, 1;
    setp.lt.u32 %p, %r1, %r0;
    @%p bra LOOP;
    add.f32 %f5, %f0, %f2;
    add.f32 %f6, %f3, %f4;
    add.f32 %f7, %f5, %f6;
    cvta.to.global.u64 %rd1, %rd0;
    st.global.f32 [%rd1], %f7;
    ret;
}
"""
"""The mixed protocol's heavy kernel: four independent chains of multiply-adds per thread, so
that the FMA pipes stay full rather than waiting on one chain's latency, as in ``spin``; it
draws far more power than one block of ``spin`` for the same engine time."""

SM_COUNT_ATTRIBUTE = 16
"""``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``."""
KERNEL_S = 0.02
"""Each load's kernels last about this long alone: short enough that a phase's end cuts off
little work, long enough that a launch's overhead is small."""
SETTLE_S = 2.0
"""Left out at the start of each measured window: CUDA start-up in the equal protocol, the
energy counter's and the estimator's lag in both."""
MARGIN_S = 1.0
"""Left out at the end of each measured window."""
BURST_S = 1.5
"""Mean length of the heavy load's bursts in the shared phase when ``--heavy-duty`` < 1."""


def cuda_environment(gpu: int) -> dict[str, str]:
    """The environment of a load process: CUDA sees only NVML's GPU ``gpu``, as device 0.

    CUDA numbers devices fastest first unless told to follow the PCI bus, as NVML and
    ``nvidia-smi`` do; without ``CUDA_DEVICE_ORDER`` a node with mixed GPUs would load another
    GPU than the one measured, and a load asking for device ``gpu`` under
    ``CUDA_VISIBLE_DEVICES=gpu`` would find none for any ``gpu`` but 0."""
    return {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu)}


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
        self._functions: dict[bytes, ctypes.c_void_p] = {}
        self.out = ctypes.c_uint64()
        size = ctypes.c_size_t(4)  # size_t: a bare int would pass 32 bits
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(self.out), size), "cuMemAlloc")
        sms = ctypes.c_int()
        self._check(
            self.lib.cuDeviceGetAttribute(ctypes.byref(sms), SM_COUNT_ATTRIBUTE, device),
            "cuDeviceGetAttribute",
        )
        self.sm_count = sms.value
        self.blocks = sms.value * 8

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise SystemExit(f"CUDA: {call} failed with error {code}")

    def _function(self, name: bytes, ptx: bytes) -> ctypes.c_void_p:
        """The kernel ``name`` of ``ptx``, compiled by the driver the first time it is asked
        for (so that the equal protocol never compiles the heavy kernel)."""
        if name not in self._functions:
            module = ctypes.c_void_p()
            self._check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData")
            function = ctypes.c_void_p()
            self._check(
                self.lib.cuModuleGetFunction(ctypes.byref(function), module, name),
                "cuModuleGetFunction",
            )
            self._functions[name] = function
        return self._functions[name]

    def launch(self, name: bytes, ptx: bytes, rounds: int, blocks: int, threads: int) -> None:
        """One kernel of ``blocks`` × ``threads``, waited for."""
        out = ctypes.c_uint64(self.out.value)
        count = ctypes.c_uint32(rounds)
        params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(out), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(count), ctypes.c_void_p),
        )
        self._check(
            self.lib.cuLaunchKernel(
                self._function(name, ptx), blocks, 1, 1, threads, 1, 1, 0, None, params, None
            ),
            "cuLaunchKernel",
        )
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def spin(self, rounds: int) -> None:
        """One kernel over every SM, waited for."""
        self.launch(b"spin", SPIN_PTX, rounds, self.blocks, 256)


def calibrated(
    run: Callable[[int], None], seconds: float = KERNEL_S, first: int = 1 << 10
) -> tuple[int, float]:
    """The size (rounds, or matmuls) at which one ``run`` takes about ``seconds``, and how long
    it took then: once untimed (the driver compiles a kernel, a library sets up, at the first
    call), then doubled from ``first`` until it takes half of that, then scaled, then timed
    once more."""
    run(first)
    size = first
    while True:
        started = time.perf_counter()
        run(size)
        took = time.perf_counter() - started
        if took >= seconds / 2 or size >= 1 << 30:
            break
        size *= 2
    size = max(1, min(int(size * seconds / took), (1 << 32) - 1))
    started = time.perf_counter()
    run(size)
    return size, time.perf_counter() - started


def load(duty: float, seconds: float, report: Path) -> None:
    """Keep the GPU busy ``duty`` of the time for ``seconds`` in ~20 ms kernels, sleeping a
    jittered time after each; write the kernels run and their GPU time to ``report``."""
    cuda = Cuda(0)  # the only device in CUDA_VISIBLE_DEVICES
    rounds, _ = calibrated(cuda.spin)
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


# ---------------------------------------------------------------- the mixed protocol's loads

ROLES = ("heavy", "light")


@dataclass(frozen=True)
class Phase:
    """One stretch of the mixed protocol's schedule: Unix times, and each load's duty (0 =
    paused, 1 = busy all the time)."""

    name: str
    start: float
    end: float
    heavy_duty: float
    light_duty: float

    def duty(self, role: str) -> float:
        return self.heavy_duty if role == "heavy" else self.light_duty


MEASURED = ("heavy alone", "both", "light alone")
"""The phases the mixed protocol measures; the others are idle stretches between them."""


def mixed_schedule(
    start: float, seconds: float, gap_seconds: float, heavy_duty: float
) -> list[Phase]:
    """Heavy alone, idle, both, idle, light alone, from ``start`` (Unix seconds) on."""
    plan = [
        ("heavy alone", seconds, 1.0, 0.0),
        ("idle after heavy", gap_seconds, 0.0, 0.0),
        ("both", seconds, heavy_duty, 1.0),
        ("idle after both", gap_seconds, 0.0, 0.0),
        ("light alone", seconds, 0.0, 1.0),
    ]
    phases, moment = [], start
    for name, length_s, heavy, light in plan:
        if length_s > 0:
            phases.append(Phase(name, moment, moment + length_s, heavy, light))
        moment += length_s
    return phases


def follow_schedule(
    run_unit: Callable[[], None],
    stints: list[tuple[float, float, float]],
    rng: random.Random,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> list[tuple[float, float]]:
    """Run units of work through ``stints`` of (start, end, duty) in Unix seconds; return each
    unit's (start, end).

    A unit is not begun when the previous one, as long again, would end after the stint, so
    that little work spills into the next phase even while the other load slows this one down.
    Below a duty of 1 the load runs in bursts of ~``BURST_S`` and pauses in proportion, both
    jittered, so that the shares of engine time move from window to window (what lets an
    estimator tell the loads' power apart) and cannot lock to the driver's sampling."""
    units: list[tuple[float, float]] = []
    last_s = 0.0
    for start, end, duty in stints:
        if duty <= 0:
            continue
        now = clock()
        if now < start:
            sleep(start - now)
            now = clock()
        while now + last_s <= end:
            burst_start = now
            burst_end = end if duty >= 1 else min(end, now + BURST_S * rng.uniform(0.5, 1.5))
            while True:  # at least one unit a burst: the stint has room for it
                started = clock()
                run_unit()
                now = clock()
                last_s = now - started
                units.append((started, now))
                if now + last_s > burst_end:
                    break
            if duty < 1:
                pause_s = (now - burst_start) * (1 - duty) / duty * rng.uniform(0.5, 1.5)
                sleep(max(0.0, min(pause_s, end - now)))
                now = clock()
    return units


def heavy_unit(kind: str) -> tuple[Callable[[], None], dict[str, Any]]:
    """The heavy load's unit of work, calibrated to ~``KERNEL_S`` alone, and what it is."""
    if kind == "torch":
        torch: Any = importlib.import_module("torch")  # only on nodes that have it
        n = 8192
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")

        def matmuls(count: int) -> None:
            for _ in range(count):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()

        count, took = calibrated(matmuls, first=1)
        return (lambda: matmuls(count)), {
            "unit": f"{count} bf16 matmuls of {n}×{n} (PyTorch {torch.__version__})",
            "unit_s": took,
        }
    cuda = Cuda(0)
    blocks = cuda.sm_count * 8

    def heavy(rounds: int) -> None:
        cuda.launch(b"heavy", HEAVY_PTX, rounds, blocks, 256)

    rounds, took = calibrated(heavy)
    return (lambda: heavy(rounds)), {
        "unit": f"FMA kernel, {blocks} blocks × 256 threads on {cuda.sm_count} SMs, "
        f"{rounds} rounds of 8 multiply-adds",
        "unit_s": took,
    }


def light_unit() -> tuple[Callable[[], None], dict[str, Any]]:
    """The light load's unit of work: one block of one warp spinning on one SM."""
    cuda = Cuda(0)

    def spin(rounds: int) -> None:
        cuda.launch(b"spin", SPIN_PTX, rounds, 1, 32)

    rounds, took = calibrated(spin)
    return (lambda: spin(rounds)), {
        "unit": f"spin kernel, 1 block × 32 threads, {rounds} dependent multiply-adds",
        "unit_s": took,
    }


def mixed_load(role: str, heavy_kind: str, report: Path) -> None:
    """One load of the mixed protocol: calibrate, say so on stdout, read the schedule from
    stdin, follow it, and write every unit's start and end to ``report``."""
    run_unit, unit = heavy_unit(heavy_kind) if role == "heavy" else light_unit()
    print(json.dumps({"ready": True, "pid": os.getpid(), **unit}), flush=True)
    schedule = [Phase(**phase) for phase in json.loads(sys.stdin.readline())]
    units = follow_schedule(
        run_unit,
        [(phase.start, phase.end, phase.duty(role)) for phase in schedule],
        random.Random(os.getpid()),
    )
    # Alive, context and all, to the schedule's end: the heavy load's last stint is the shared
    # phase, and through the light load's solo phase its process must still be there, idle.
    time.sleep(max(0.0, schedule[-1].end - time.time()))
    report.write_text(json.dumps({"pid": os.getpid(), "role": role, **unit, "units": units}))


# ------------------------------------------------------------------- reading the recordings


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


def describe(gpu: int) -> dict[str, Any]:
    """The GPU's model and the driver's and NVML's versions, printed and returned (for the
    mixed protocol's summary)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        info = {
            "index": gpu,
            "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "nvml": _text(pynvml.nvmlSystemGetNVMLVersion()),
        }
    finally:
        pynvml.nvmlShutdown()
    print(f"GPU {gpu}: {info['name']}")
    print(f"driver {info['driver']}, NVML {info['nvml']}")
    return info


def _text(value: str | bytes) -> str:
    """NVML's strings: older bindings return bytes."""
    return value.decode() if isinstance(value, bytes) else value


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


# ------------------------------------------------------- the mixed protocol's arithmetic


def units_in(units: list[tuple[float, float]], start: float, end: float) -> float:
    """Units of work done in (start, end): a unit that straddles an edge counts for the part
    of its span inside, so that a window's count does not jump by one at its edges."""
    total = 0.0
    for begun, ended in units:
        inside = min(ended, end) - max(begun, start)
        if inside > 0:
            total += inside / (ended - begun)
    return total


def energy_per_unit_j(active_j: float, units: float) -> float:
    """A load's energy per unit of work from its solo window: active energy over units done."""
    return active_j / units if units > 0 else math.nan


def true_energy_j(units: Mapping[str, float], per_unit_j: Mapping[str, float]) -> dict[str, float]:
    """Each load's true energy in a window: units done there × its solo energy per unit (no
    units, no energy, even where the per-unit figure is unknown)."""
    return {role: units[role] * per_unit_j[role] if units[role] > 0 else 0.0 for role in units}


def shares(values: Mapping[str, float]) -> dict[str, float]:
    """Each value's share of their sum (NaN when nothing is there to share)."""
    total = sum(values.values())
    return {key: value / total if total > 0 else math.nan for key, value in values.items()}


def closure(true_j: Mapping[str, float], active_j: float) -> float:
    """The true energies' sum over the measured active energy: 1 when the solo figures explain
    the window; below 1 when the loads together draw more than their solo energy per unit says
    (or do less work for it), above 1 when less."""
    return sum(true_j.values()) / active_j if active_j > 0 else math.nan


def window_figures(
    active_j: float,
    wattflow_j: Mapping[str, float],
    units: Mapping[str, float],
    per_unit_j: Mapping[str, float],
    time_weight: Mapping[str, float],
) -> dict[str, Any]:
    """One window's figures: each load's wattflow energy and share against its true share,
    the difference in points, the share a split by time alone gives (``time_weight``: SM
    utilisation × time), the closure and the active energy that reached the processes."""
    true_j = true_energy_j(units, per_unit_j)
    true_share, given_share, time_share = shares(true_j), shares(wattflow_j), shares(time_weight)
    return {
        "active_j": active_j,
        "true_j": sum(true_j.values()),
        "closure": closure(true_j, active_j),
        "to_processes": sum(wattflow_j.values()) / active_j if active_j > 0 else math.nan,
        "loads": {
            role: {
                "units": units[role],
                "true_j": true_j[role],
                "true_share": true_share[role],
                "wattflow_j": wattflow_j[role],
                "wattflow_share": given_share[role],
                "difference_points": 100 * (given_share[role] - true_share[role]),
                "time_share": time_share[role],
                "time_difference_points": 100 * (time_share[role] - true_share[role]),
            }
            for role in units
        },
    }


def split_source(
    power: list[dict[str, Any]], target: str, start: float, end: float
) -> dict[str, Any]:
    """Which split the GPU formula used for ``target``'s reports in (start, end]: the share of
    its reports with metadata ``split`` = ``power``, = ``time``, or without it (a formula that
    predates the power-aware estimator), and the last learned ``active_power_w`` ±
    ``active_power_stderr_w`` (None where no report carried them)."""
    counts = {"power": 0, "time": 0, "unknown": 0}
    last_w: float | None = None
    last_stderr_w: float | None = None
    for report in power:
        if report["target"] != target or not start < epoch(report["timestamp"]) <= end:
            continue
        metadata = report.get("metadata") or {}
        split = metadata.get("split")
        counts[split if split in ("power", "time") else "unknown"] += 1
        if "active_power_w" in metadata:
            last_w = metadata["active_power_w"]
            last_stderr_w = metadata.get("active_power_stderr_w")
    total = sum(counts.values())
    return {
        "reports": total,
        **{kind: count / total if total else math.nan for kind, count in counts.items()},
        "active_power_w": last_w,
        "active_power_stderr_w": last_stderr_w,
    }


def time_weights(
    reports: list[dict[str, Any]], gpu: int, pids: list[int], start: float, end: float
) -> dict[int, float]:
    """Each pid's SM utilisation × window length (%·s) over the GPUReports in (start, end]:
    what a split by time share alone gives each process. A report's processes average the
    driver's samples over its ``process_window`` (µs); a recording without one weighs each
    report alike."""
    weights = dict.fromkeys(pids, 0.0)
    for report in reports:
        if not start < epoch(report["timestamp"]) <= end:
            continue
        device = report["devices"].get(str(gpu)) or {}
        window = device.get("process_window")
        length_s = (window[1] - window[0]) / 1e6 if window else 1.0
        for process in device.get("processes") or ():
            if process["pid"] in weights:
                weights[process["pid"]] += process["sm_util"] * length_s
    return weights


def measured_windows(phases: list[Phase]) -> dict[str, tuple[float, float]]:
    """The windows the mixed protocol reports: each measured phase less ``SETTLE_S`` at its
    start and ``MARGIN_S`` at its end, and the whole run from the first to the last."""
    windows = {
        phase.name: (phase.start + SETTLE_S, phase.end - MARGIN_S)
        for phase in phases
        if phase.name in MEASURED
    }
    windows["whole run"] = (phases[0].start + SETTLE_S, phases[-1].end - MARGIN_S)
    return windows


def analyse_mixed(
    phases: list[Phase],
    loads: Mapping[str, dict[str, Any]],
    power: list[dict[str, Any]],
    reports: list[dict[str, Any]],
    pmon: Path | None,
    gpu: int,
    idle_w: float,
) -> dict[str, Any]:
    """The mixed protocol's figures from the recordings: energy per unit from each load's solo
    window, then every window's figures (see :func:`window_figures`), the split's source in
    each load's reports and ``nvidia-smi pmon``'s SM shares."""
    pids = {role: int(loads[role]["pid"]) for role in ROLES}
    windows = measured_windows(phases)
    active: dict[str, float] = {}
    units: dict[str, dict[str, float]] = {}
    for name, (start, end) in windows.items():
        active[name] = counter_j(reports, gpu, start, end) - idle_w * (end - start)
        units[name] = {role: units_in(loads[role]["units"], start, end) for role in ROLES}
    per_unit_j = {
        role: energy_per_unit_j(active[f"{role} alone"], units[f"{role} alone"][role])
        for role in ROLES
    }
    figures: dict[str, Any] = {}
    for name, (start, end) in windows.items():
        energy = energy_by_target(power, start, end)
        weights = time_weights(reports, gpu, list(pids.values()), start, end)
        window = window_figures(
            active[name],
            {role: energy.get(f"pid:{pid}", 0.0) for role, pid in pids.items()},
            units[name],
            per_unit_j,
            {role: weights[pid] for role, pid in pids.items()},
        )
        sm = pmon_sm(pmon, list(pids.values()), start, end) if pmon else {}
        pmon_share = shares({role: sm.get(pid, 0.0) for role, pid in pids.items()})
        for role, pid in pids.items():
            window["loads"][role]["pid"] = pid
            window["loads"][role]["pmon_share"] = pmon_share[role]
            window["loads"][role]["split"] = split_source(power, f"pid:{pid}", start, end)
        figures[name] = {"start": start, "end": end, "seconds": end - start, **window}
        figures[name]["device_j"] = active[name] + idle_w * (end - start)
        figures[name]["left_on_device_j"] = energy.get(f"gpu{gpu}", 0.0) - idle_w * (end - start)
    return {"energy_per_unit_j": per_unit_j, "windows": figures}


def print_mixed(analysis: Mapping[str, Any], loads: Mapping[str, dict[str, Any]]) -> None:
    """The mixed protocol's figures as Markdown, one table a window."""
    per_unit = analysis["energy_per_unit_j"]
    print("\n### Energy per unit of work, from each load's solo phase\n")
    for role in ROLES:
        print(f"- {role}: {per_unit[role]:.4f} J per unit; a unit is {loads[role]['unit']}, "
              f"{loads[role]['unit_s'] * 1000:.1f} ms alone")  # fmt: skip
    for name, window in analysis["windows"].items():
        seconds = window["seconds"]
        print(f"\n### {name} ({seconds:.0f} s)\n")
        print(
            f"device {window['device_j']:.0f} J ({window['device_j'] / seconds:.1f} W), active "
            f"{window['active_j']:.0f} J, true {window['true_j']:.0f} J: closure "
            f"{window['closure']:.2f}; to the processes {window['to_processes']:.1%} of active, "
            f"left on the device above idle {window['left_on_device_j']:.0f} J"
        )
        print("\n| load | units | true J | true share | wattflow J | wattflow share "
              "| difference | time split | pmon SM | split power / time / unknown "
              "| active power W |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for role, load in window["loads"].items():
            split = load["split"]
            learned = (
                "—"
                if split["active_power_w"] is None
                else f"{split['active_power_w']:.1f} ± {split['active_power_stderr_w'] or 0:.1f}"
            )
            print(
                f"| {role} (pid {load['pid']}) | {load['units']:.0f} | {load['true_j']:.0f} "
                f"| {load['true_share']:.1%} | {load['wattflow_j']:.0f} "
                f"| {load['wattflow_share']:.1%} | {load['difference_points']:+.1f} pts "
                f"| {load['time_share']:.1%} | {load['pmon_share']:.1%} "
                f"| {split['power']:.0%} / {split['time']:.0%} / {split['unknown']:.0%} "
                f"| {learned} |"
            )


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so that the summary is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def commit() -> str | None:
    """The checkout's commit, so that a summary says which code gave its figures."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


# ------------------------------------------------------------------------------- the runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Protocols: equal (default), two loads of the same spin kernel, A busy all the "
        "time and B busy --duty of it: alone, then together; mixed, a heavy load (every SM) "
        "and a light one (one SM), the same two processes through heavy alone, both, light "
        "alone, with idle stretches between, against the truth from their solo energy per "
        "unit of work. See the module's docstring and docs/benchmarks.md.",
    )
    parser.add_argument("--gpu", type=int, default=0, help="NVML's index, as nvidia-smi's")
    parser.add_argument("--protocol", choices=("equal", "mixed"), default="equal")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--duty", type=float, default=0.3, help="equal: busy share of load B")
    parser.add_argument(
        "--gap-seconds", type=float, default=10.0,
        help="mixed: idle stretch between phases (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "--heavy-duty", type=float, default=1.0,
        help="mixed: busy share of the heavy load while both run, in jittered bursts of "
        f"~{BURST_S:g} s when below 1 (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--heavy-load", choices=("ptx", "torch"), default="ptx",
        help="mixed: the heavy load, an FMA kernel on every SM through libcuda (default) or "
        "bf16 matmuls through PyTorch, where it is installed",
    )  # fmt: skip
    parser.add_argument(
        "--summary", type=Path, help="mixed: write the figures, GPU model and driver as JSON"
    )
    parser.add_argument(
        "--gpu-idle-power-w", type=float, help="idle power (default: measured before the loads)"
    )
    parser.add_argument("--load", nargs=3, help=argparse.SUPPRESS)  # DUTY SECONDS REPORT
    parser.add_argument("--mixed-load", nargs=3, help=argparse.SUPPRESS)  # ROLE KIND REPORT
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.load:
        load(float(args.load[0]), float(args.load[1]), Path(args.load[2]))
        return
    if args.mixed_load:
        mixed_load(args.mixed_load[0], args.mixed_load[1], Path(args.mixed_load[2]))
        return
    if not shutil.which("nvidia-smi"):
        raise SystemExit("nvidia-smi not found: this benchmark needs a node with the driver")
    gpu_info = describe(args.gpu)
    idle_w = args.gpu_idle_power_w
    if idle_w is None:
        idle_w = idle_power_w(args.gpu, 8.0)
        print(f"idle power, measured before the loads: {idle_w:.1f} W")
    if args.protocol == "mixed":
        run_mixed(args, gpu_info, idle_w)
    else:
        run_equal(args, idle_w)


@dataclass(frozen=True)
class Recording:
    """What runs beside the loads, and where it writes."""

    sampler: subprocess.Popen[bytes]
    gpu_file: Path
    power_file: Path
    smi_file: Path
    pmon_file: Path

    def check(self) -> None:
        """Stop the run if the sampler has stopped: its figures would be meaningless."""
        if self.sampler.poll() is not None:
            _, error = self.sampler.communicate()
            raise SystemExit(f"the sampler stopped: {error.decode()[-2000:]}")


def start_recording(stack: ExitStack, gpu: int, idle_w: float, directory: Path) -> Recording:
    """``nvidia-smi`` at 10 Hz, ``nvidia-smi pmon`` and wattflow's sampler with the GPU formula
    per process, for the length of ``stack``; after their start-up."""
    gpu_file, power_file = directory / "gpu.jsonl", directory / "power.jsonl"
    smi_file, pmon_file = directory / "smi.csv", directory / "pmon.txt"
    stack.enter_context(
        running(
            ["nvidia-smi", "-i", str(gpu), "--query-gpu="
             "timestamp,power.draw,utilization.gpu,clocks.sm,temperature.gpu",
             "--format=csv,noheader,nounits", "-lms", "100", "-f", str(smi_file)]
        )
    )  # fmt: skip
    stack.enter_context(
        running(
            ["nvidia-smi", "pmon", "-i", str(gpu), "-s", "u", "-d", "1", "-o", "T"],
            stdout=stack.enter_context(pmon_file.open("w")),
        )
    )
    sampler = stack.enter_context(
        running(
            [sys.executable, "-m", "wattflow.service", "run", "--input", "nvml",
             "--devices", str(gpu), "--gpu-targets", "process",
             "--gpu-idle-power-w", f"{idle_w:.3f}",
             "--disable-rapl-formula", "--disable-smartwatts-formula",
             "--disable-node-formula",
             "--output", "jsonl", "--model", "GPUReport", "--file", str(gpu_file),
             "--output", "jsonl", "--model", "PowerReport", "--file", str(power_file)],
            stderr=subprocess.PIPE,
        )
    )  # fmt: skip
    time.sleep(3)  # the sampler's start-up
    return Recording(sampler, gpu_file, power_file, smi_file, pmon_file)


def print_device_readings(
    recording: Recording, gpu: int, start: float, end: float, what: str
) -> None:
    reports = lines(recording.gpu_file)
    inside = [r for r in reports if start <= epoch(r["timestamp"]) <= end]
    smi = [row for row in smi_rows(recording.smi_file) if start <= row.get("time", 0.0) <= end]
    print(f"\n### Device readings over {what}: {len(inside)} ticks, {len(smi)} nvidia-smi rows\n")
    compare(gpu, inside, smi)


def run_equal(args: argparse.Namespace, idle_w: float) -> None:
    """The equal protocol: A alone, B alone, both, each phase with fresh processes."""
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        directory = Path(scratch)
        recording = start_recording(stack, args.gpu, idle_w, directory)
        environment = cuda_environment(args.gpu)
        phases: list[tuple[str, tuple[float, float], list[dict[str, Any]]]] = []
        for name, duties in (("A alone", {"A": 1.0}), ("B alone", {"B": args.duty}),
                             ("A and B together", {"A": 1.0, "B": args.duty})):  # fmt: skip
            phases.append(run_phase(name, duties, args, directory, environment))
        time.sleep(6)  # the last windows, and ticks held for them (--gpu-hold-ms)
        recording.check()
        stack.close()
        reports, power = lines(recording.gpu_file), lines(recording.power_file)
        for name, window, loads in phases:
            phase_table(name, window, loads, power, reports, recording.pmon_file, args.gpu, idle_w)
        start, end = phases[0][1][0], phases[-1][1][1]
        print_device_readings(recording, args.gpu, start, end, "the three phases")


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
                    [sys.executable, __file__, "--load", str(duty), str(args.seconds + 3),
                     str(files[label])],
                    env=environment,
                )
            )  # fmt: skip
        deadline = time.monotonic() + args.seconds + 60
        while not all(path.exists() for path in files.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"phase {name}: the loads did not finish")
            time.sleep(0.5)
    loads = [{**json.loads(files[label].read_text()), "name": label} for label in duties]
    start = max(load["start"] for load in loads) + SETTLE_S
    end = min(load["end"] for load in loads) - MARGIN_S
    return name, (start, end), loads


def ready(child: subprocess.Popen[bytes], role: str, timeout_s: float) -> dict[str, Any]:
    """The line a mixed load writes once calibrated (its pid and unit of work)."""
    assert child.stdout is not None
    readable, _, _ = select.select([child.stdout], [], [], timeout_s)
    line = child.stdout.readline() if readable else b""
    if not line:
        raise SystemExit(f"the {role} load did not start (exit status {child.poll()})")
    answer: dict[str, Any] = json.loads(line)
    return answer


def run_mixed(args: argparse.Namespace, gpu_info: dict[str, Any], idle_w: float) -> None:
    """The mixed protocol: the same heavy and light processes through every phase."""
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        directory = Path(scratch)
        recording = start_recording(stack, args.gpu, idle_w, directory)
        environment = cuda_environment(args.gpu)
        files = {role: directory / f"mixed-{role}.json" for role in ROLES}
        children: dict[str, subprocess.Popen[bytes]] = {}
        for role in ROLES:  # one after the other, so that each calibrates alone
            children[role] = stack.enter_context(
                running(
                    [sys.executable, __file__, "--mixed-load", role, args.heavy_load,
                     str(files[role])],
                    env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )
            )  # fmt: skip
            started = ready(children[role], role, 120.0)
            print(f"{role} load: pid {started['pid']}, a unit is {started['unit']}, "
                  f"{started['unit_s'] * 1000:.1f} ms alone", flush=True)  # fmt: skip
        phases = mixed_schedule(time.time() + 2.0, args.seconds, args.gap_seconds,
                                args.heavy_duty)  # fmt: skip
        schedule = (json.dumps([asdict(phase) for phase in phases]) + "\n").encode()
        for child in children.values():
            assert child.stdin is not None
            child.stdin.write(schedule)
            child.stdin.flush()
        for phase in phases:
            print(f"phase {phase.name}: {phase.end - phase.start:.0f} s", flush=True)
        for role, child in children.items():
            try:
                child.wait(timeout=max(0.0, phases[-1].end - time.time()) + 60)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the {role} load did not finish") from None
            if child.returncode != 0 or not files[role].exists():
                raise SystemExit(f"the {role} load failed (exit status {child.returncode})")
        time.sleep(6)  # the last windows, and ticks held for them (--gpu-hold-ms)
        recording.check()
        stack.close()
        loads = {role: json.loads(files[role].read_text()) for role in ROLES}
        analysis = analyse_mixed(
            phases, loads, lines(recording.power_file), lines(recording.gpu_file),
            recording.pmon_file, args.gpu, idle_w,
        )  # fmt: skip
        print_mixed(analysis, loads)
        print_device_readings(recording, args.gpu, phases[0].start, phases[-1].end, "the run")
    if args.summary:
        summary = {
            "protocol": "mixed",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "commit": commit(),
            "gpu": gpu_info,
            "idle_w": idle_w,
            "seconds": args.seconds,
            "gap_seconds": args.gap_seconds,
            "heavy_duty": args.heavy_duty,
            "heavy_load": args.heavy_load,
            "loads": {
                role: {key: value for key, value in load.items() if key != "units"}
                for role, load in loads.items()
            },
            "phases": [asdict(phase) for phase in phases],
            **analysis,
        }
        args.summary.write_text(json.dumps(finite(summary), indent=2, ensure_ascii=False) + "\n")
        print(f"\nsummary written to {args.summary}")


if __name__ == "__main__":
    main()
