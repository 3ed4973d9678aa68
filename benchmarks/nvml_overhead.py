"""CPU cost of the NVML sampler: % of one core per GPU while it samples at 10 Hz.

Runs ``wattflow run --input nvml --interval-ms 100 --output jsonl --model GPUReport`` for
``--seconds`` after its first report (start-up is not counted), and reads the child's CPU time
(all threads, from the scheduler's nanosecond counters) at both ends. The GPU formula is disabled
unless ``--with-formula`` is given, so the figure is what recording GPUReports costs.

With a real NVIDIA driver on the machine it samples the real GPUs; otherwise it builds the C
stand-in of the tests (gcc needed) and samples ``--fake-gpus`` simulated ones, each C call
spinning the CPU time an idle GPU's driver spends in it: ``--call-costs h200`` (the default:
the energy counter 3.89 ms, field values with it 4.51 ms, process utilisation 2.22 ms and the
GPU utilisation buffer 2.17 ms through pynvml's two C calls, power and utilisation rates under
0.01 ms) or ``h100`` (the energy counter 3.8 ms, field values with instantaneous power
0.082 ms, process utilisation 1.15 ms per C call...); ``--free-calls`` for a stand-in that
answers in microseconds: the sampler's own share; ``--mig-instances N`` for GPUs in MIG mode
with GPM and N GPU instances, read once a window. ``--with-formula`` keeps the GPU formula on,
as a service attributing GPU power runs. It prints the % of one core per GPU against the 1 %
target, and over the stand-in the C calls per second per GPU of each entry point. Run from the
repository root:

    python benchmarks/nvml_overhead.py --fake-gpus 4 --with-formula
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_PERCENT_PER_GPU = 1.0
"""The sampler's budget: 1 % of one core per GPU at 10 Hz."""

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.nvml_fake import (  # noqa: E402 - after the path that makes `tests` importable
    build_fake_nvml,
    nvml_environment,
    read_reports,
    sampler_command,
    write_scenario,
)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, every thread, in seconds.

    The scheduler's per-thread run time (``/proc/<pid>/task/*/schedstat``, in ns) where the
    kernel has it: ``/proc/<pid>/stat`` counts in clock ticks of 10 ms, too coarse for a
    process that runs well under a millisecond per tick. Threads that ended before the
    reading are not in either; the sampler's threads live as long as it does.
    """
    try:
        return (
            sum(
                int((task / "schedstat").read_text().split()[0])
                for task in Path(f"/proc/{pid}/task").iterdir()
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def mig_lines(gpu: int, instances: int, processes: int) -> list[str]:
    """A simulated GPU's processes: sharing it, or one on each of ``instances`` MIG GPU
    instances (busy 10 %, 20 %... of the time) when ``instances`` is not 0."""
    if not instances:
        return [f"d{gpu}.proc={1000 + p}:{10 + p}:5" for p in range(processes)]
    lines = [f"d{gpu}.mig=1", f"d{gpu}.gpm=1"]
    for gi in range(1, instances + 1):
        lines += [f"d{gpu}.gi={gi}:{10 * gi}", f"d{gpu}.gi_proc={gi}:{1000 + gi}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured sampling time")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--fake-gpus", type=int, default=1, help="GPUs the stand-in simulates")
    parser.add_argument("--processes", type=int, default=4, help="processes per simulated GPU")
    parser.add_argument(
        "--mig-instances",
        type=int,
        default=0,
        help="simulated GPUs in MIG mode with GPM and this many GPU instances (at most 7), a "
        "process on each, instead of processes sharing the GPU",
    )
    parser.add_argument("--interval-ms", type=int, default=100)
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds left to start-up before measuring"
    )
    parser.add_argument("--with-formula", action="store_true", help="keep the GPU formula on")
    parser.add_argument(
        "--fake", action="store_true", help="use the stand-in even where a driver is installed"
    )
    parser.add_argument(
        "--call-costs",
        choices=("h100", "h200"),
        default="h200",
        help="which GPU's measured CPU cost per C call the stand-in spins (default: h200)",
    )
    parser.add_argument(
        "--free-calls", action="store_true", help="stand-in calls cost nothing (no preset)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        real = bool(ctypes.util.find_library("nvidia-ml")) and not args.fake
        if real:
            environment = dict(os.environ)
            what = "the real NVIDIA driver"
        else:
            library = build_fake_nvml(directory / "lib")
            lines = [f"devices={args.fake_gpus}"]
            if not args.free_calls:
                lines.append(f"call_costs={args.call_costs}")
            for gpu in range(args.fake_gpus):
                lines.append(f"d{gpu}.power=0:100000,500:250000")
                lines += mig_lines(gpu, args.mig_instances, args.processes)
            scenario = write_scenario(directory / "scenario.txt", lines)
            environment = nvml_environment(library, scenario)
            environment["FAKE_NVML_CALLS"] = str(directory / "calls.txt")
            costs = "free calls" if args.free_calls else f"{args.call_costs.upper()} call costs"
            each = (
                f"MIG with GPM, {args.mig_instances} GPU instances"
                if args.mig_instances
                else f"{args.processes} processes"
            )
            what = f"the C stand-in ({args.fake_gpus} GPUs, {each} each, {costs})"
        output = directory / "gpu.jsonl"
        flags = ["--interval-ms", str(args.interval_ms)]
        if not args.with_formula:
            # The sampler alone, as `wattflow sensor nvml` runs it.
            flags += [f"--disable-{name}-formula" for name in ("gpu", "node", "rapl", "smartwatts")]
        process = subprocess.Popen(
            [*sampler_command(output, *flags)],
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            while not read_reports(output):
                if process.poll() is not None:
                    raise SystemExit(f"the sampler stopped:\n{process.communicate()[1][-3000:]}")
                time.sleep(0.05)
            # Start-up work (imports, a formula's background warm-up) is not sampling: let it end.
            time.sleep(args.settle)
            first_reports = len(read_reports(output))
            wall_0, cpu_0 = time.monotonic(), cpu_seconds(process.pid)
            # A virtual machine's neighbours shift single readings by a few tenths of a percent:
            # windows give the median and the spread as well as the whole.
            windows: list[float] = []
            wall, cpu = wall_0, cpu_0
            while wall - wall_0 < args.seconds - 1e-9:
                time.sleep(min(args.window, args.seconds - (wall - wall_0)))
                wall_next, cpu_next = time.monotonic(), cpu_seconds(process.pid)
                windows.append((cpu_next - cpu) / (wall_next - wall))
                wall, cpu = wall_next, cpu_next
            wall_1, cpu_1 = wall, cpu
            reports = read_reports(output)
        finally:
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=60)
        gpus = len(reports[-1]["devices"])
        ticks = len(reports) - first_reports
        share = (cpu_1 - cpu_0) / (wall_1 - wall_0)
        formula = "with the GPU formula" if args.with_formula else "without formulas"
        print(f"sampled {what}: {gpus} GPUs every {args.interval_ms} ms, {formula}")
        expected = args.seconds * 1000 / args.interval_ms
        print(f"ticks in {wall_1 - wall_0:.1f} s: {ticks} (expected {expected:.0f})")
        per_gpu = share * 100 / gpus
        print(f"CPU: {share * 100:.2f} % of one core; {per_gpu:.2f} % per GPU")
        print(
            f"per GPU against the {TARGET_PERCENT_PER_GPU:g} % target: "
            f"{per_gpu / TARGET_PERCENT_PER_GPU:.2f}x"
        )
        print(
            f"per {args.window:g} s window: median {statistics.median(windows) * 100:.2f} %, "
            f"min {min(windows) * 100:.2f} %, max {max(windows) * 100:.2f} % "
            f"({len(windows)} windows)"
        )
        print(f"per tick: {(cpu_1 - cpu_0) / max(ticks, 1) * 1000:.2f} ms CPU")
        calls = directory / "calls.txt"
        if calls.exists():
            # Counted from start to stop: per second of the whole run, per GPU.
            seconds = len(reports) * args.interval_ms / 1000
            counts = [line.split() for line in calls.read_text().splitlines()]
            rates = ", ".join(
                f"{name} {int(count) / seconds / gpus:.2f}"
                for name, count in counts
                if count != "0"
            )
            print(f"C calls per second per GPU: {rates}")


if __name__ == "__main__":
    main()
