"""Generate realistic hwpc-sensor streams with known per-target ground truth.

The model behind the numbers: each container runs workload phases that set how busy it keeps
each cpu and how memory-bound it is; each socket's frequency follows the load (turbo under light
load, base clock under heavy load). Per-target power is a linear function of the target's counters
at the socket's frequency, plus an idle power that stays with the machine, and RAPL reports the
sum. So a formula that learns the linear model can recover each target's power, and the file of
ground truth says what it should find.

Writes hwpc-sensor's JSON (one report per line) and, with ``--csv``, PowerAPI's CSV layout (one
file per events group).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

RAPL_UNIT = 2.0**32
CORE_EVENTS = (
    "CPU_CLK_THREAD_UNHALTED:REF_P",
    "CPU_CLK_THREAD_UNHALTED:THREAD_P",
    "INSTRUCTIONS_RETIRED",
    "LLC_MISSES",
)


@dataclass(frozen=True)
class Machine:
    """The simulated node."""

    sensor: str = "node-1"
    sockets: int = 2
    cpus_per_socket: int = 4
    base_freq_mhz: float = 2100.0
    max_freq_mhz: float = 3000.0
    idle_pkg_w: float = 12.0
    idle_dram_w: float = 2.5
    joules_per_ginstr: float = 2.2
    joules_per_mllc: float = 0.9
    dram_joules_per_mllc: float = 0.5


@dataclass(frozen=True)
class Container:
    """A target and its workload phases: (busy share of a cpu, memory intensity) per phase."""

    name: str
    phases: tuple[tuple[float, float], ...]


DEFAULT_CONTAINERS = (
    Container("web-frontend", ((0.15, 0.2), (0.45, 0.3), (0.2, 0.2))),
    Container("postgres", ((0.35, 0.8), (0.6, 0.9), (0.3, 0.7))),
    Container("ml-training", ((0.9, 0.4), (0.95, 0.5), (0.1, 0.1))),
    Container("redis", ((0.05, 0.6), (0.1, 0.7), (0.08, 0.6))),
)


def containers_named(count: int) -> tuple[Container, ...]:
    """``count`` containers, cycling through the default workloads with distinct names."""
    if count <= len(DEFAULT_CONTAINERS):
        return DEFAULT_CONTAINERS[:count]
    return tuple(
        Container(f"{base.name}-{i}", tuple((b / 4, m) for b, m in base.phases))
        for i in range(count)
        for base in (DEFAULT_CONTAINERS[i % len(DEFAULT_CONTAINERS)],)
    )


def iso(ts: datetime) -> str:
    """hwpc-sensor's timestamp form: naive UTC, millisecond precision."""
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}"


def generate(
    machine: Machine,
    containers: tuple[Container, ...],
    ticks: int,
    *,
    seed: int = 42,
    start: datetime = datetime(2026, 1, 5, 9, 0, 0, tzinfo=UTC),
    period_s: float = 1.0,
    multiplex: float = 0.0,
) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Yield, per tick, the hwpc-sensor reports and the ground-truth rows of that tick.

    ``multiplex`` is the share of per-cpu core readings that perf multiplexed: their counters
    ran for only part of the interval (``time_running`` < ``time_enabled``) and count that much
    less, as perf reports them. The ground truth is what the target really did.
    """
    rng = np.random.default_rng(seed)
    cpus = machine.sockets * machine.cpus_per_socket
    ns = int(period_s * 1e9)
    timestamp = start
    for tick in range(ticks):
        timestamp = start + timedelta(seconds=tick * period_s, milliseconds=float(rng.normal(0, 2)))
        phase = (tick * 3) // max(ticks, 1)
        busy = np.zeros((len(containers), cpus))
        memory = np.zeros(len(containers))
        for i, container in enumerate(containers):
            share, intensity = container.phases[min(phase, len(container.phases) - 1)]
            home = (i * 3) % cpus
            for cpu in range(cpus):
                distance = min((cpu - home) % cpus, (home - cpu) % cpus)
                busy[i, cpu] = share * max(0.0, 1.0 - 0.3 * distance) * rng.uniform(0.85, 1.15)
            memory[i] = intensity
        busy = np.clip(busy, 0.0, 1.0)
        load = busy.sum(axis=0).clip(0, 1)
        reports: list[dict[str, Any]] = []
        truth: list[dict[str, Any]] = []
        dynamic_cpu = np.zeros((len(containers), machine.sockets))
        dynamic_dram = np.zeros((len(containers), machine.sockets))
        socket_power = np.full(machine.sockets, machine.idle_pkg_w)
        socket_dram = np.full(machine.sockets, machine.idle_dram_w)
        core: dict[str, dict[str, dict[str, int]]] = {}
        freq = np.zeros(machine.sockets)
        for s in range(machine.sockets):
            socket_load = load[s * machine.cpus_per_socket : (s + 1) * machine.cpus_per_socket]
            span = machine.max_freq_mhz - machine.base_freq_mhz
            freq[s] = machine.max_freq_mhz - span * float(socket_load.mean())
        for i, container in enumerate(containers):
            groups: dict[str, dict[str, dict[str, int]]] = {}
            cpu_w = 0.0
            dram_w = 0.0
            for s in range(machine.sockets):
                socket_events: dict[str, dict[str, int]] = {}
                socket_w = 0.0
                socket_dram_w = 0.0
                for c in range(machine.cpus_per_socket):
                    cpu = s * machine.cpus_per_socket + c
                    cycles = busy[i, cpu] * freq[s] * 1e6 * period_s
                    if cycles < 1:
                        continue
                    ipc = 1.6 - 1.1 * memory[i]
                    instructions = cycles * ipc * rng.uniform(0.95, 1.05)
                    llc = instructions * 0.004 * memory[i] * rng.uniform(0.9, 1.1)
                    ref = cycles * machine.base_freq_mhz / freq[s]
                    freq_factor = (freq[s] / machine.base_freq_mhz) ** 2
                    socket_w += (
                        instructions / 1e9 * machine.joules_per_ginstr * freq_factor
                        + llc / 1e6 * machine.joules_per_mllc
                    ) / period_s
                    socket_dram_w += llc / 1e6 * machine.dram_joules_per_mllc / period_s
                    running = ns
                    if multiplex and rng.random() < multiplex:
                        running = int(ns * rng.uniform(0.5, 0.9))
                    seen = running / ns
                    socket_events[str(cpu)] = {
                        CORE_EVENTS[0]: int(ref * seen),
                        CORE_EVENTS[1]: int(cycles * seen),
                        CORE_EVENTS[2]: int(instructions * seen),
                        CORE_EVENTS[3]: int(llc * seen),
                        "time_enabled": ns,
                        "time_running": running,
                    }
                    totals = core.setdefault(str(s), {}).setdefault(
                        str(cpu), dict.fromkeys((*CORE_EVENTS, "time_enabled", "time_running"), 0)
                    )
                    totals[CORE_EVENTS[0]] += int(ref)
                    totals[CORE_EVENTS[1]] += int(cycles)
                    totals[CORE_EVENTS[2]] += int(instructions)
                    totals[CORE_EVENTS[3]] += int(llc)
                    totals["time_enabled"] = totals["time_running"] = ns
                if socket_events:
                    groups[str(s)] = socket_events
                socket_power[s] += socket_w
                socket_dram[s] += socket_dram_w
                dynamic_cpu[i, s] = socket_w
                dynamic_dram[i, s] = socket_dram_w
                cpu_w += socket_w
                dram_w += socket_dram_w
            reports.append(
                {
                    "timestamp": iso(timestamp),
                    "sensor": machine.sensor,
                    "target": container.name,
                    "groups": {"core": groups},
                }
            )
            truth.append(
                {
                    "timestamp": iso(timestamp),
                    "sensor": machine.sensor,
                    "target": container.name,
                    "cpu_w": round(cpu_w, 6),
                    "dram_w": round(dram_w, 6),
                }
            )
        # Idle power shared in proportion to each target's dynamic power on each socket, the
        # way SmartWatts shares its intercept: what a formula whose targets add up to RAPL
        # should find.
        cpu_share = dynamic_cpu / np.where(dynamic_cpu.sum(axis=0) > 0, dynamic_cpu.sum(axis=0), 1)
        dram_share = dynamic_dram / np.where(
            dynamic_dram.sum(axis=0) > 0, dynamic_dram.sum(axis=0), 1
        )
        for i, row in enumerate(truth):
            row["cpu_attributed_w"] = round(float((cpu_share[i] * socket_power).sum()), 6)
            row["dram_attributed_w"] = round(float((dram_share[i] * socket_dram).sum()), 6)
        rapl: dict[str, dict[str, dict[str, int]]] = {}
        msr: dict[str, dict[str, dict[str, int]]] = {}
        for s in range(machine.sockets):
            first_cpu = s * machine.cpus_per_socket
            rapl[str(s)] = {
                str(first_cpu): {
                    "RAPL_ENERGY_PKG": int(socket_power[s] * period_s * RAPL_UNIT),
                    "RAPL_ENERGY_DRAM": int(socket_dram[s] * period_s * RAPL_UNIT),
                    "time_enabled": ns,
                    "time_running": ns,
                }
            }
            msr[str(s)] = {}
            for c in range(machine.cpus_per_socket):
                cpu = first_cpu + c
                mperf = max(1, int(load[cpu] * machine.base_freq_mhz * 1e6 * period_s))
                msr[str(s)][str(cpu)] = {
                    "APERF": int(mperf * freq[s] / machine.base_freq_mhz),
                    "MPERF": mperf,
                    "TSC": int(machine.base_freq_mhz * 1e6 * period_s),
                    "time_enabled": ns,
                    "time_running": ns,
                }
            truth.append(
                {
                    "timestamp": iso(timestamp),
                    "sensor": machine.sensor,
                    "target": f"rapl-socket-{s}",
                    "cpu_w": round(float(socket_power[s]), 6),
                    "dram_w": round(float(socket_dram[s]), 6),
                    "cpu_attributed_w": round(float(socket_power[s]), 6),
                    "dram_attributed_w": round(float(socket_dram[s]), 6),
                }
            )
        reports.insert(
            0,
            {
                "timestamp": iso(timestamp),
                "sensor": machine.sensor,
                "target": "all",
                "groups": {"rapl": rapl, "msr": msr, "core": core},
            },
        )
        yield reports, truth


def write_csv_groups(reports: list[dict[str, Any]], directory: Path) -> list[Path]:
    """Write reports in PowerAPI's CSV input layout: one file per events group."""
    directory.mkdir(parents=True, exist_ok=True)
    writers: dict[str, tuple[Any, csv.writer, list[str]]] = {}  # type: ignore[valid-type]
    paths: list[Path] = []
    for report in reports:
        millis = int(
            datetime.fromisoformat(report["timestamp"]).replace(tzinfo=UTC).timestamp() * 1000
        )
        for group, sockets in report["groups"].items():
            for socket, cpus in sockets.items():
                for cpu, events in cpus.items():
                    if group not in writers:
                        names = sorted(e for e in events if not e.startswith("time_"))
                        names += ["time_enabled", "time_running"]
                        path = directory / f"{group}.csv"
                        handle = path.open("w", newline="")
                        writer = csv.writer(handle)
                        writer.writerow(["timestamp", "sensor", "target", "socket", "cpu", *names])
                        writers[group] = (handle, writer, names)
                        paths.append(path)
                    _, writer, names = writers[group]
                    row = [millis, report["sensor"], report["target"], socket, cpu]
                    writer.writerow(row + [events.get(name, 0) for name in names])
    for handle, _, _ in writers.values():
        handle.close()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--containers", type=int, default=4)
    parser.add_argument("--sockets", type=int, default=2)
    parser.add_argument("--cpus-per-socket", type=int, default=4)
    parser.add_argument("--sensor", default="node-1", help="sensor name (with --sensors 1)")
    parser.add_argument(
        "--sensors", type=int, default=1, help="machines, named node-1 … node-N, interleaved"
    )
    parser.add_argument(
        "--multiplex", type=float, default=0.0, help="share of per-cpu readings perf multiplexed"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, required=True, help="JSON Lines file to write")
    parser.add_argument("--truth", type=Path, help="ground-truth CSV to write")
    parser.add_argument("--csv", type=Path, help="also write PowerAPI CSV files here")
    args = parser.parse_args()
    names = [args.sensor] if args.sensors == 1 else [f"node-{n + 1}" for n in range(args.sensors)]
    streams = [
        generate(
            Machine(sensor=name, sockets=args.sockets, cpus_per_socket=args.cpus_per_socket),
            containers_named(args.containers),
            args.ticks,
            seed=args.seed + number,
            multiplex=args.multiplex,
        )
        for number, name in enumerate(names)
    ]
    everything: list[dict[str, Any]] = []
    truth_rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for ticks in zip(*streams, strict=True):
            reports = sorted(
                (report for tick_reports, _ in ticks for report in tick_reports),
                key=lambda report: str(report["timestamp"]),
            )
            out.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in reports)
            if args.csv:
                everything.extend(reports)
            for _, truth in ticks:
                truth_rows.extend(truth)
    if args.truth:
        with args.truth.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(truth_rows[0]))
            writer.writeheader()
            writer.writerows(truth_rows)
    if args.csv:
        write_csv_groups(everything, args.csv)


if __name__ == "__main__":
    main()
