"""Make the recordings `wattflow demo` replays beside hwpc-sensor's: GPUs, power meter, events.

    python scripts/make_demo_recordings.py           # rewrite service/data/demo-*
    python scripts/make_demo_recordings.py --check   # exit 1 if the files differ from its output

It needs wattflow importable (``pip install -e .``): GPU readings and events are built as
wattflow's own report models and written with its JSON encoder, so they are byte for byte what
``wattflow sensor nvml --output jsonl`` (and ``wattflow runs mark``) write. The output is
deterministic: a fixed seed, and every value rounded the way the instruments round it.

The node
--------

``service/data/demo-hwpc.jsonl`` (kept as it is, an input here) is hwpc-sensor on node
``demo-node``: 2 sockets, 30 ticks at 1 Hz from 2026-01-05 09:00:00 UTC, four containers. Its
story, which the new recordings follow:

- up to 09:00:20, ``ml-training`` trains a model with data-parallel PyTorch, one process per
  GPU (3 cores busy feeding them); it ends at 09:00:20 and its processes exit;
- from 09:00:09 to 09:00:20, a traffic spike triples ``web-frontend``'s CPU; web-frontend runs
  an inference server that shares GPU 1 with the training.

GPUs (``demo-gpu.jsonl``: NVML sampler, ``--interval-ms 1000``, 2 GPUs)
-----------------------------------------------------------------------

The sampler starts 3 s before hwpc-sensor's first report, while both GPUs still rest, so the GPU
formula learns their idle power; it ticks on whole seconds (as its pacer schedules) from
08:59:57 to 09:00:30 UTC, 34 ticks. The GPUs are A100-SXM4-like (400 W limit; SM clock 1410 MHz
busy, 210 MHz idle; memory 1215 MHz; application clocks 1095/1215 MHz). Time runs in 100 ms
slots; in each slot:

- processes' SM use (%): pid 4242 (ml-training, rank 0, GPU 0) and pid 4243 (rank 1, GPU 1):
  model loading 12 (08:59:58-59), warm-up 65 (the first second of epoch 0), then 93 (rank 0)
  and 90 (rank 1) until the spike, 81 and 72 during it (rank 1 shares its GPU, and rank 0 waits
  for it at every all-reduce), 20 while a checkpoint is written between the epochs and 15 for
  the final one. pid 5117 (web-frontend, inference, GPU 1): 6 from 08:59:58, 24 during the
  spike. Memory use is about half the SM use. Each slot adds Gaussian noise (σ 2 %).
- device utilisation = min(100, 1.05 × Σ SM use); memory utilisation = min(100, Σ memory use).
- power (W) = static + dynamic: static = 50 + 0.22 × (T − 30) (leakage grows with temperature
  T in °C), dynamic = 2.85 × utilisation × clock / 1410 + 0.55 × memory utilisation, + noise
  (σ 1.5 W), at most the 400 W limit.
- temperature: first order, T → 28 + 0.105 × power with a 12 s time constant.

What the sampler reports per tick and device: ``power`` (the last slot, mW, instantaneous),
``total_energy`` (mJ since the driver loaded: the integral of the slots' power, so the GPU
formula's device power over a tick is the mean of that tick's power samples), utilisations
(means over the tick), clocks, power limit, power state, temperature (the last slot, integral
°C), PCIe throughput, the driver's sample buffers (``TOTAL_POWER`` one sample per slot,
utilisation every 1/6 s: each sample once, in the tick whose interval holds it) and
``processes``: per pid the mean of the driver's process samples (every 1/6 s) in the tick,
with the cgroup from ``/proc/<pid>/cgroup`` (``/ml-training``, ``/web-frontend``).

Power meter (``demo-meter.csv``: a PDU logger at 5 Hz, the ``meter`` input's CSV layout)
------------------------------------------------------------------------------------------

The node has two power supplies sharing the load (50.5 % / 49.5 %) on PDU outlets ``d0c0`` and
``d0c1``. Wall power (AC) = DC load + supply losses, with DC load = CPU + DRAM (hwpc-sensor's
RAPL energy over each of its intervals, both sockets) + both GPUs (the slots above) + the rest of
the board: 62 W (board, BMC, NVMe drives, NIC), 6 W more while training reads its data, and fans
at 14 W + 36 W × clamp((hottest GPU − 35) / 40, 0, 1); losses = 18 W + 4.5 % of DC. So what no
sensor sees, the node formula's ``rest``, is about 140-160 W while the GPUs train (fans spinning
up as they warm) and about 120 W after. Each reading, every 200 ms from
08:59:57 to 09:00:30, is the mean wall power over the 200 ms before it, with meter noise
(σ 0.4 W per outlet), in mW rounded to 100 mW.

Events (``demo-events.jsonl``: what the training script marks)
-----------------------------------------------------------------

experiment_begin 08:59:57, train_begin 08:59:58, epoch 0 from 08:59:59 to 09:00:09.4, epoch 1
from 09:00:09.8 to 09:00:19.6, train_end 09:00:20, experiment_end 09:00:30.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from wattflow.formats.powerapi import encode_json, format_timestamp
from wattflow.formats.reports import (
    EventName,
    EventReport,
    GPUDevice,
    GPUProcess,
    GPUReport,
    GPUSampleKind,
    to_utc,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "service" / "data"
HWPC = DATA / "demo-hwpc.jsonl"
GPU_FILE = DATA / "demo-gpu.jsonl"
METER_FILE = DATA / "demo-meter.csv"
EVENTS_FILE = DATA / "demo-events.jsonl"

SENSOR = "demo-node"
ZERO = datetime(2026, 1, 5, 9, 0, 0, tzinfo=UTC)
"""hwpc-sensor's first report; times below are seconds from it."""
START_S, END_S = -3.0, 30.0
"""The GPU sampler's and the meter's first and last readings."""
SLOT_S = 0.1
SLOTS = round((END_S - START_S) / SLOT_S)
UTIL_SAMPLE_S = 1 / 6
METER_PERIOD_S = 0.2
SEED = 20260105
RAPL_UNIT_J = 2.0**-32

POWER_LIMIT_W = 400.0
SM_CLOCK_MHZ, IDLE_CLOCK_MHZ, MEM_CLOCK_MHZ = 1410.0, 210.0, 1215.0
APP_CLOCK_GPU_MHZ, APP_CLOCK_MEM_MHZ = 1095.0, 1215.0
AMBIENT_C, THERMAL_C_PER_W, THERMAL_TAU_S = 28.0, 0.105, 12.0


@dataclass(frozen=True)
class Process:
    pid: int
    device: int
    cgroup: str
    sm: Callable[[float], float]
    """SM use (%) at a time (s from ZERO); 0 where the process is not running."""


def training(busy: float, spike: float) -> Callable[[float], float]:
    """SM use of one data-parallel training rank."""

    def sm(t: float) -> float:
        if t < -2.0 or t >= 20.0:
            return 0.0  # not started yet, then exited
        if t < -1.0:
            return 12.0  # loading the model and the first batches
        if t < 0.0:
            return 65.0  # warm-up: first iterations, kernels being compiled
        if 9.4 <= t < 9.8:
            return 20.0  # checkpoint between epochs
        if t >= 19.6:
            return 15.0  # final checkpoint
        return spike if t >= 9.0 else busy

    return sm


def inference(t: float) -> float:
    """SM use of web-frontend's inference server."""
    if t < -2.0:
        return 0.0
    return 24.0 if 9.0 <= t < 20.0 else 6.0


PROCESSES = (
    Process(4242, 0, "/ml-training", training(93.0, 81.0)),
    Process(4243, 1, "/ml-training", training(90.0, 72.0)),
    Process(5117, 1, "/web-frontend", inference),
)
ENERGY_AT_START_MJ = (8_514_320_117.0, 8_307_954_402.0)
"""The GPUs' energy counters when the sampler starts: a few days since the driver loaded."""
START_TEMPERATURE_C = (33.0, 31.0)


def at(seconds: float) -> datetime:
    return ZERO + timedelta(microseconds=round(seconds * 1e6))


def micros(seconds: float) -> int:
    return round(at(seconds).timestamp() * 1e6)


@dataclass
class Slot:
    """One GPU over one 100 ms slot."""

    power_w: float
    util: float
    util_mem: float
    clock: float
    temperature: float
    processes: dict[int, tuple[float, float]] = field(default_factory=dict)
    """pid → (SM use, memory use) in %."""


def simulate_gpu(device: int, rng: random.Random) -> list[Slot]:
    """The device's slots: slot ``s`` covers (START + s·SLOT, START + (s+1)·SLOT]."""
    temperature = START_TEMPERATURE_C[device]
    slots = []
    for s in range(SLOTS):
        middle = START_S + (s + 0.5) * SLOT_S
        processes: dict[int, tuple[float, float]] = {}
        for process in PROCESSES:
            level = process.sm(middle) if process.device == device else 0.0
            if level > 0:
                sm = min(100.0, max(1.0, level + rng.gauss(0.0, 2.0)))
                processes[process.pid] = (sm, sm * 0.48)
        util = min(100.0, 1.05 * sum(sm for sm, _ in processes.values()))
        util_mem = min(100.0, sum(mem for _, mem in processes.values()))
        clock = SM_CLOCK_MHZ if processes else IDLE_CLOCK_MHZ
        static = 50.0 + 0.22 * (temperature - 30.0)
        dynamic = 2.85 * util * clock / SM_CLOCK_MHZ + 0.55 * util_mem
        power = min(POWER_LIMIT_W, static + dynamic + rng.gauss(0.0, 1.5))
        target = AMBIENT_C + THERMAL_C_PER_W * power
        temperature += (target - temperature) * (1.0 - math.exp(-SLOT_S / THERMAL_TAU_S))
        slots.append(Slot(power, util, util_mem, clock, temperature, processes))
    return slots


def tick_seconds() -> list[float]:
    return [START_S + k for k in range(round(END_S - START_S) + 1)]


def gpu_reports(gpus: list[list[Slot]], rng: random.Random) -> list[GPUReport]:
    """One report per tick, as the NVML sampler makes them."""
    per_tick = round(1.0 / SLOT_S)
    util_times = [
        START_S + k * UTIL_SAMPLE_S for k in range(1, round((END_S - START_S) / UTIL_SAMPLE_S) + 1)
    ]
    energy_j = [value / 1000.0 for value in ENERGY_AT_START_MJ]
    reports = []
    for k, tick in enumerate(tick_seconds()):
        devices: dict[str, GPUDevice] = {}
        for index, slots in enumerate(gpus):
            # The slots of the interval the tick closes; the first tick only starts the sampler.
            mine = slots[(k - 1) * per_tick : k * per_tick] if k else []
            energy_j[index] += sum(slot.power_w * SLOT_S for slot in mine)
            last = slots[max(k * per_tick - 1, 0)]
            fields: dict[str, Any] = {
                "power": float(round(last.power_w * 1000)),
                "power_averaged": False,
                "total_energy": float(round(energy_j[index] * 1000)),
            }
            if mine:
                fields["util_gpu"] = float(round(sum(s.util for s in mine) / len(mine)))
                fields["util_mem"] = float(round(sum(s.util_mem for s in mine) / len(mine)))
            else:
                fields["util_gpu"] = fields["util_mem"] = 0.0
            busy = any(slot.processes for slot in mine)
            reading = rng.gauss(0.0, 1.0)
            fields.update(
                clock_gpu=last.clock,
                clock_mem=MEM_CLOCK_MHZ,
                app_clock_gpu=APP_CLOCK_GPU_MHZ,
                app_clock_mem=APP_CLOCK_MEM_MHZ,
                enforced_power_limit=POWER_LIMIT_W * 1000,
                power_state=0,
                temperature=float(round(last.temperature)),
                pci_tx=float(round(28_000 + 2_000 * reading)) if busy else 120.0,
                pci_rx=float(round(352_000 + 15_000 * reading)) if busy else 310.0,
            )
            if mine:
                fields["samples"] = samples(slots, tick - 1.0, tick, util_times)
                fields["processes"] = processes(slots, tick - 1.0, tick, util_times)
            else:
                fields["processes"] = []
            devices[str(index)] = GPUDevice(**fields)
        reports.append(GPUReport(timestamp=at(tick), sensor=SENSOR, target="all", devices=devices))
    return reports


def slot_at(slots: list[Slot], seconds: float) -> Slot:
    """The slot whose interval holds ``seconds``."""
    return slots[min(max(math.ceil((seconds - START_S) / SLOT_S - 1e-9) - 1, 0), SLOTS - 1)]


def samples(
    slots: list[Slot], begin: float, end: float, util_times: list[float]
) -> dict[GPUSampleKind, list[tuple[int, float]]]:
    """The driver's buffers in (begin, end]: a power sample 40 ms before each slot ends,
    utilisation every 1/6 s."""
    first = round((begin - START_S) / SLOT_S)
    power = [
        (micros(START_S + (s + 1) * SLOT_S - 0.04), float(round(slots[s].power_w * 1000)))
        for s in range(first, first + round((end - begin) / SLOT_S))
    ]
    inside = [t for t in util_times if begin < t <= end]
    return {
        "TOTAL_POWER": power,
        "GPU_UTILIZATION": [(micros(t), float(round(slot_at(slots, t).util))) for t in inside],
        "MEMORY_UTILIZATION": [
            (micros(t), float(round(slot_at(slots, t).util_mem))) for t in inside
        ],
    }


def processes(
    slots: list[Slot], begin: float, end: float, util_times: list[float]
) -> list[GPUProcess]:
    """Per pid, the mean of its samples in (begin, end] (integers, as the driver gives them)."""
    seen: dict[int, list[tuple[int, int]]] = {}
    for t in (t for t in util_times if begin < t <= end):
        for pid, (sm, mem) in slot_at(slots, t).processes.items():
            seen.setdefault(pid, []).append((round(sm), round(mem)))
    cgroups = {process.pid: process.cgroup for process in PROCESSES}
    return [
        GPUProcess(
            pid=pid,
            sm_util=sum(sm for sm, _ in values) / len(values),
            mem_util=sum(mem for _, mem in values) / len(values),
            cgroup=cgroups[pid],
        )
        for pid, values in sorted(seen.items())
    ]


def rapl_intervals() -> list[tuple[float, float, float]]:
    """(start s, end s, CPU + DRAM watts) of each hwpc-sensor interval, both sockets.

    The first report's deltas cover the second before it."""
    intervals = []
    previous: float | None = None
    for line in HWPC.read_text().splitlines():
        report = json.loads(line)
        if report["target"] != "all":
            continue
        end = (to_utc(report["timestamp"]) - ZERO).total_seconds()
        start = end - 1.0 if previous is None else previous
        joules = sum(
            events.get("RAPL_ENERGY_PKG", 0) + events.get("RAPL_ENERGY_DRAM", 0)
            for cpus in report["groups"]["rapl"].values()
            for events in list(cpus.values())[:1]
        )
        intervals.append((start, end, joules * RAPL_UNIT_J / (end - start)))
        previous = end
    return intervals


def meter_rows(gpus: list[list[Slot]], rng: random.Random) -> list[str]:
    """The PDU logger's CSV: mean wall power over each 200 ms, per outlet, in mW."""
    rapl = rapl_intervals()

    def cpu_dram_w(t: float) -> float:
        for start, end, watts in rapl:
            if start < t <= end:
                return watts
        return rapl[0][2] if t <= rapl[0][0] else rapl[-1][2]

    def wall_w(t: float) -> float:
        gpu_slots = [slot_at(slots, t) for slots in gpus]
        training = any(pid in s.processes for s in gpu_slots for pid in (4242, 4243))
        hottest = max(slot.temperature for slot in gpu_slots)
        fans = 14.0 + 36.0 * min(max((hottest - 35.0) / 40.0, 0.0), 1.0)
        dc = cpu_dram_w(t) + sum(s.power_w for s in gpu_slots) + 62.0 + fans
        dc += 6.0 if training else 0.0
        return dc + 18.0 + 0.045 * dc

    rows = ["timestamp,d0c0,d0c1"]
    for k in range(round((END_S - START_S) / METER_PERIOD_S) + 1):
        end = START_S + k * METER_PERIOD_S
        steps = 200  # 1 ms steps: every edge above falls on a millisecond
        mean = sum(wall_w(end - METER_PERIOD_S + (i + 0.5) / 1000) for i in range(steps)) / steps
        outlets = [mean * 0.505 + rng.gauss(0.0, 0.4), mean * 0.495 + rng.gauss(0.0, 0.4)]
        cells = [str(round(w * 10) * 100) for w in outlets]
        rows.append(",".join([format_timestamp(at(end)), *cells]))
    return rows


EVENTS: tuple[tuple[float, EventName, str | None], ...] = (
    (-3.0, "experiment_begin", None),
    (-2.0, "train_begin", None),
    (-1.0, "epoch_begin", "0"),
    (9.4, "epoch_end", "0"),
    (9.8, "epoch_begin", "1"),
    (19.6, "epoch_end", "1"),
    (20.0, "train_end", None),
    (30.0, "experiment_end", None),
)


def recordings() -> dict[Path, str]:
    """Every file's text."""
    rng = random.Random(SEED)
    gpus = [simulate_gpu(device, rng) for device in range(2)]
    events = [
        EventReport(timestamp=at(t), sensor=SENSOR, target="all", event=name, data=data)
        for t, name, data in EVENTS
    ]
    return {
        GPU_FILE: "".join(encode_json(r) + "\n" for r in gpu_reports(gpus, rng)),
        METER_FILE: "\n".join(meter_rows(gpus, rng)) + "\n",
        EVENTS_FILE: "".join(encode_json(r) + "\n" for r in events),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the files instead of writing them"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, text in recordings().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)} ({len(text.encode())} bytes)")
    for path in stale:
        print(f"{path.relative_to(ROOT)} differs from what this script makes", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
