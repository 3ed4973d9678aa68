"""The NVML sampler on a real GPU, under load, checked against ``nvidia-smi``.

For a node with an NVIDIA driver (nothing here runs without one). It:

1. starts two load processes on one GPU through the CUDA driver (``libcuda.so.1``, which every
   driver installs; a spin kernel in PTX, compiled by the driver, so no CUDA toolkit, PyTorch
   or CuPy is needed): one busy all the time, one busy ``--duty`` of the time;
2. runs ``wattflow run --input nvml`` with the GPU formula for ``--seconds``, writing the
   GPUReports and the formula's PowerReports as JSON Lines;
3. runs ``nvidia-smi --query-gpu`` every 100 ms and ``nvidia-smi pmon`` beside it;
4. prints the GPU model, driver and NVML versions, then for the same window: mean power from
   wattflow's readings, from its energy counter and from ``nvidia-smi``; utilisation, SM clock
   and temperature from both; and each load process's share of the active power against its
   share of SM utilisation in ``nvidia-smi pmon``.

Run from the repository root (the GPU index is NVML's, as ``nvidia-smi`` numbers them):

    python benchmarks/nvml_real_gpu.py --gpu 0 --seconds 60

Then ``python benchmarks/nvml_overhead.py --fake-gpus 1`` measures the sampler's CPU cost on
the real driver (it uses the driver whenever one is installed).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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


def load(gpu: int, duty: float, seconds: float) -> None:
    """Keep the GPU busy ``duty`` of the time for ``seconds``, in 50 ms kernels."""
    cuda = Cuda(gpu)
    rounds = 1 << 16
    while True:  # calibrate: about 50 ms per kernel
        started = time.perf_counter()
        cuda.spin(rounds)
        took = time.perf_counter() - started
        if took >= 0.02 or rounds >= 1 << 30:
            break
        rounds *= 2
    rounds = max(1, int(rounds * 0.05 / took))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        cuda.spin(rounds)
        busy = time.perf_counter() - started
        if duty < 1:
            time.sleep(busy * (1 - duty) / duty)


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


def pmon_shares(path: Path, pids: list[int]) -> dict[int, float]:
    """Mean SM % of each pid in ``nvidia-smi pmon -s u`` output (``-`` counts as 0)."""
    seen: dict[int, list[float]] = {pid: [] for pid in pids}
    for line in path.read_text().splitlines():
        parts = line.split()
        if line.startswith("#") or len(parts) < 4 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid in seen:
            seen[pid].append(float(parts[3]) if parts[3] != "-" else 0.0)
    return {pid: statistics.fmean(values) if values else 0.0 for pid, values in seen.items()}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


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


def attribution(power: list[dict[str, Any]], pmon: Path, loads: list[tuple[int, float]]) -> None:
    """Each load's share of the attributed power against its share of SM time in pmon."""
    by_pid: dict[int, list[float]] = {pid: [] for pid, _ in loads}
    for report in power:
        for pid in by_pid:
            if report["target"] == f"pid:{pid}":  # --gpu-targets process
                by_pid[pid].append(report["power"])
    shares = pmon_shares(pmon, list(by_pid))
    total_sm = sum(shares.values()) or float("nan")
    total_w = sum(mean(values) for values in by_pid.values()) or float("nan")
    print("| load | busy | wattflow W | share of power | SM % (pmon) | share of SM |")
    print("| --- | --- | --- | --- | --- | --- |")
    for pid, duty in loads:
        watts = mean(by_pid[pid])
        print(
            f"| pid {pid} | {duty:.0%} | {watts:.1f} | {watts / total_w:.1%} | "
            f"{shares[pid]:.1f} | {shares[pid] / total_sm:.1%} |"
        )


def describe(gpu: int) -> None:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    print(f"GPU {gpu}: {pynvml.nvmlDeviceGetName(handle)}")
    print(f"driver {pynvml.nvmlSystemGetDriverVersion()}, NVML {pynvml.nvmlSystemGetNVMLVersion()}")
    pynvml.nvmlShutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--duty", type=float, default=0.3, help="busy share of the 2nd load")
    parser.add_argument("--load", nargs=3, help=argparse.SUPPRESS)  # GPU DUTY SECONDS
    args = parser.parse_args()
    if args.load:
        load(int(args.load[0]), float(args.load[1]), float(args.load[2]))
        return
    if not shutil.which("nvidia-smi"):
        raise SystemExit("nvidia-smi not found: this benchmark needs a node with the driver")
    describe(args.gpu)

    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        directory = Path(scratch)
        gpu_file, power_file = directory / "gpu.jsonl", directory / "power.jsonl"
        smi_file, pmon_file = directory / "smi.csv", directory / "pmon.txt"
        environment = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.gpu)}
        margin = 10.0  # load before the window and after it
        duties = (1.0, args.duty)
        load_seconds = str(args.seconds + 2 * margin)
        loads = [
            stack.enter_context(
                running(
                    [sys.executable, __file__, "--load", "0", str(duty), load_seconds],
                    env=environment,
                )
            )
            for duty in duties
        ]
        time.sleep(margin / 2)
        stack.enter_context(
            running(
                ["nvidia-smi", "-i", str(args.gpu), "--query-gpu="
                 "timestamp,power.draw,utilization.gpu,clocks.sm,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", "100", "-f", str(smi_file)]
            )
        )  # fmt: skip
        stack.enter_context(
            running(
                ["nvidia-smi", "pmon", "-i", str(args.gpu), "-s", "u", "-d", "1"],
                stdout=stack.enter_context(pmon_file.open("w")),
            )
        )
        sampler = stack.enter_context(
            running(
                [sys.executable, "-m", "wattflow.service", "run", "--input", "nvml",
                 "--devices", str(args.gpu), "--gpu-targets", "process",
                 "--disable-rapl-formula", "--disable-smartwatts-formula",
                 "--disable-node-formula",
                 "--output", "jsonl", "--model", "GPUReport", "--file", str(gpu_file),
                 "--output", "jsonl", "--model", "PowerReport", "--file", str(power_file)],
                stderr=subprocess.PIPE,
            )
        )  # fmt: skip
        time.sleep(margin / 2)
        start = time.time()
        time.sleep(args.seconds)
        end = time.time()
        time.sleep(2)  # the last batch of ticks
        if sampler.poll() is not None:
            _, error = sampler.communicate()
            raise SystemExit(f"the sampler stopped: {error.decode()[-2000:]}")
        pids = [(process.pid, duty) for process, duty in zip(loads, duties, strict=True)]
        stack.close()

        def inside(moment: float) -> bool:
            return start <= moment <= end

        reports = [r for r in lines(gpu_file) if inside(epoch(r["timestamp"]))]
        smi = [row for row in smi_rows(smi_file) if inside(row.get("time", 0.0))]
        print(f"window: {args.seconds:.0f} s, {len(reports)} ticks, {len(smi)} nvidia-smi rows")
        compare(args.gpu, reports, smi)
        power = [r for r in lines(power_file) if inside(epoch(r["timestamp"]))]
        attribution(power, pmon_file, pids)


if __name__ == "__main__":
    main()
