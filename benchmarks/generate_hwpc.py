"""Generate realistic hwpc-sensor streams with known per-target ground truth.

The model behind the numbers: each container runs workload phases that set how busy it keeps
each cpu and how memory-bound it is; each socket's frequency follows the load (turbo under light
load, base clock under heavy load). Per-target power is a linear function of the target's counters
at the socket's frequency, plus an idle power that stays with the machine, and RAPL reports the
sum. So a formula that learns the linear model can recover each target's power, and the file of
ground truth says what it should find.

Writes hwpc-sensor's JSON (one report per line) and, with ``--csv``, PowerAPI's CSV layout (one
file per events group). Several sensors (``--sensors``) are separate machines whose reports are
interleaved by timestamp, as a formula service fed by a fleet receives them.

The simulation runs on arrays (ticks × containers × cpus) and the writers format text straight
from them, because throughput benchmarks need recordings of a few hundred thousand reports and
should not wait minutes for them.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

RAPL_UNIT = 2.0**32
CORE_EVENTS = (
    "CPU_CLK_THREAD_UNHALTED:REF_P",
    "CPU_CLK_THREAD_UNHALTED:THREAD_P",
    "INSTRUCTIONS_RETIRED",
    "LLC_MISSES",
)
CSV_EVENTS = {
    "rapl": ("RAPL_ENERGY_DRAM", "RAPL_ENERGY_PKG", "time_enabled", "time_running"),
    "msr": ("APERF", "MPERF", "TSC", "time_enabled", "time_running"),
    "core": (*CORE_EVENTS, "time_enabled", "time_running"),
}
"""Columns after ``timestamp,sensor,target,socket,cpu`` of each group's file: the events sorted
by name, then perf's times, as PowerAPI's CSV layout has them."""
GROUP_FILES = ("rapl.csv", "msr.csv", "core.csv")
"""The order to give PowerAPI's CSV input: it keeps a tick's per-target rows only when the file
holding them (``core.csv``) comes last."""
ROWS_PER_BLOCK = 200_000
"""Per-cpu readings simulated at once: large enough for numpy to pay off, small enough that the
Python lists the writers format from stay far under a gigabyte."""

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


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

    @property
    def cpus(self) -> int:
        """Logical cpus, numbered socket by socket as hwpc-sensor reports them."""
        return self.sockets * self.cpus_per_socket


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


def iso_millis(millis: int) -> str:
    """:func:`iso` of a Unix time in milliseconds."""
    return iso(datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=millis))


@dataclass
class Block:
    """Consecutive ticks of one sensor as arrays: counters as reported, and the true power.

    Axes: t tick, k container, c cpu (socket-major), s socket. Counter arrays end in an axis of
    the group's events in :data:`CSV_EVENTS` order.
    """

    machine: Machine
    targets: tuple[str, ...]
    millis: Ints  # (t,) Unix ms
    core: Ints  # (t, k, c, 6) what the target's perf counters reported
    present: Bools  # (t, k, c) the target ran on the cpu: hwpc-sensor writes a row for it
    system_core: Ints  # (t, c, 6) the machine-wide counters of the `all` target
    system_present: Bools  # (t, c)
    msr: Ints  # (t, c, 5)
    rapl: Ints  # (t, s, 4), RAPL energy in 2^-32 J per tick
    dynamic_cpu: Floats  # (t, k, s) W each target really drew above idle
    dynamic_dram: Floats  # (t, k, s)
    socket_cpu: Floats  # (t, s) W the package drew, idle included: what RAPL measured
    socket_dram: Floats  # (t, s)

    def __len__(self) -> int:
        return len(self.millis)

    def attributed(self) -> tuple[Floats, Floats]:
        """Per (t, k, s): dynamic power plus idle power shared in proportion to dynamic power.

        SmartWatts-style formulas hand the intercept (idle power) to the targets in proportion
        to their activity, so this, not the dynamic power alone, is what their per-target
        estimates should approach; the targets of a socket add up to its RAPL power.
        """
        found = []
        pairs = ((self.dynamic_cpu, self.socket_cpu), (self.dynamic_dram, self.socket_dram))
        for dynamic, socket in pairs:
            total = dynamic.sum(axis=1, keepdims=True)
            share = np.divide(dynamic, total, out=np.zeros_like(dynamic), where=total > 0)
            found.append(share * socket[:, None, :])
        return found[0], found[1]


def simulate(
    machine: Machine,
    containers: Sequence[Container],
    ticks: int,
    *,
    seed: int = 42,
    start: datetime = datetime(2026, 1, 5, 9, 0, 0, tzinfo=UTC),
    period_s: float = 1.0,
    multiplex: float = 0.0,
) -> Iterator[Block]:
    """Simulate ``ticks`` ticks of one machine, a block of ticks at a time.

    ``multiplex`` is the share of per-cpu core readings that perf multiplexed: their counters
    ran for only part of the interval (``time_running`` < ``time_enabled``) and count that much
    less, as perf reports them. The ground truth is what the target really did.
    """
    rng = np.random.default_rng(seed)
    cpus, k = machine.cpus, len(containers)
    ns = int(period_s * 1e9)
    start_ms = round(start.timestamp() * 1000)
    socket_of = np.arange(cpus) // machine.cpus_per_socket
    homes = (np.arange(k) * 3) % cpus
    offset = np.abs(np.arange(cpus)[None, :] - homes[:, None])
    distance = np.minimum(offset, cpus - offset)
    reach = np.maximum(0.0, 1.0 - 0.3 * distance)  # (k, c): load spreads to nearby cpus
    phases = max(len(c.phases) for c in containers) if containers else 1
    table = [[c.phases[min(p, len(c.phases) - 1)] for p in range(phases)] for c in containers]
    levels = np.array(table, dtype=np.float64).reshape(k, phases, 2)
    shares, memory_of = levels[..., 0], levels[..., 1]  # (k, phase)
    span = machine.max_freq_mhz - machine.base_freq_mhz
    base = machine.base_freq_mhz
    step = max(1, ROWS_PER_BLOCK // max(1, k * cpus))
    for first in range(0, ticks, step):
        n = min(step, ticks - first)
        index = np.arange(first, first + n)
        jitter = rng.normal(0.0, 2.0, n)
        millis = start_ms + np.floor(index * period_s * 1000 + jitter).astype(np.int64)
        phase = np.minimum((index * 3) // max(ticks, 1), phases - 1)
        share = shares[:, phase].T  # (t, k)
        memory = memory_of[:, phase].T
        busy = share[:, :, None] * reach[None] * rng.uniform(0.85, 1.15, (n, k, cpus))
        busy = np.clip(busy, 0.0, 1.0)
        load = busy.sum(axis=1).clip(0.0, 1.0)  # (t, c)
        by_socket = load.reshape(n, machine.sockets, machine.cpus_per_socket)
        freq = machine.max_freq_mhz - span * by_socket.mean(axis=2)  # (t, s)
        freq_cpu = freq[:, socket_of][:, None, :]  # (t, 1, c)
        cycles = busy * freq_cpu * 1e6 * period_s
        present = cycles >= 1
        instructions = cycles * (1.6 - 1.1 * memory)[:, :, None]
        instructions *= rng.uniform(0.95, 1.05, (n, k, cpus))
        llc = instructions * 0.004 * memory[:, :, None] * rng.uniform(0.9, 1.1, (n, k, cpus))
        ref = cycles * base / freq_cpu
        watts = (
            instructions / 1e9 * machine.joules_per_ginstr * (freq_cpu / base) ** 2
            + llc / 1e6 * machine.joules_per_mllc
        ) / period_s
        dram_watts = llc / 1e6 * machine.dram_joules_per_mllc / period_s
        watts[~present] = 0.0
        dram_watts[~present] = 0.0
        per_socket = (n, k, machine.sockets, machine.cpus_per_socket)
        dynamic_cpu = watts.reshape(per_socket).sum(axis=3)
        dynamic_dram = dram_watts.reshape(per_socket).sum(axis=3)
        socket_cpu = machine.idle_pkg_w + dynamic_cpu.sum(axis=1)
        socket_dram = machine.idle_dram_w + dynamic_dram.sum(axis=1)

        running = np.full((n, k, cpus), ns, dtype=np.int64)
        if multiplex:
            chosen = rng.random((n, k, cpus)) < multiplex
            partial = (ns * rng.uniform(0.5, 0.9, (n, k, cpus))).astype(np.int64)
            running = np.where(chosen, partial, running)
        seen = running / ns
        true_counts = np.stack([ref, cycles, instructions, llc], axis=-1)
        true_counts[~present] = 0.0
        core = np.empty((n, k, cpus, 6), dtype=np.int64)
        core[..., :4] = (true_counts * seen[..., None]).astype(np.int64)
        core[..., 4] = ns
        core[..., 5] = running
        system_core = np.empty((n, cpus, 6), dtype=np.int64)
        system_core[..., :4] = true_counts.astype(np.int64).sum(axis=1)
        system_core[..., 4:] = ns

        mperf = np.maximum(1, (load * base * 1e6 * period_s).astype(np.int64))
        msr = np.empty((n, cpus, 5), dtype=np.int64)
        msr[..., 0] = (mperf * freq[:, socket_of] / base).astype(np.int64)
        msr[..., 1] = mperf
        msr[..., 2] = int(base * 1e6 * period_s)
        msr[..., 3:] = ns
        rapl = np.empty((n, machine.sockets, 4), dtype=np.int64)
        rapl[..., 0] = (socket_dram * period_s * RAPL_UNIT).astype(np.int64)
        rapl[..., 1] = (socket_cpu * period_s * RAPL_UNIT).astype(np.int64)
        rapl[..., 2:] = ns
        yield Block(
            machine=machine,
            targets=tuple(c.name for c in containers),
            millis=millis,
            core=core,
            present=present,
            system_core=system_core,
            system_present=present.any(axis=1),
            msr=msr,
            rapl=rapl,
            dynamic_cpu=dynamic_cpu,
            dynamic_dram=dynamic_dram,
            socket_cpu=socket_cpu,
            socket_dram=socket_dram,
        )


def _template(names: Sequence[str]) -> str:
    """A %-format for one cpu's events as a JSON object: the hot path of writing JSON."""
    return "{" + ",".join(f'"{name}":%d' for name in names) + "}"


JSON_TEMPLATES = {
    "rapl": _template(("RAPL_ENERGY_PKG", "RAPL_ENERGY_DRAM", "time_enabled", "time_running")),
    "msr": _template(CSV_EVENTS["msr"]),
    "core": _template(CSV_EVENTS["core"]),
}
"""hwpc-sensor's JSON puts the RAPL package energy first; the CSV columns are sorted instead."""
CSV_TEMPLATES = {
    group: "%d,%s,%s,%d,%d," + ",".join(["%d"] * len(events)) + "\n"
    for group, events in CSV_EVENTS.items()
}


class TickView:
    """One tick of a block as Python values, formatted to hwpc-sensor JSON, CSV and truth."""

    def __init__(self, block: Block, lists: dict[str, Any], t: int) -> None:
        self.block = block
        self.machine = block.machine
        self.millis: int = lists["millis"][t]
        self.timestamp = iso_millis(self.millis)
        self.lists = lists
        self.t = t

    def _json_group(self, values: list[list[int]], ran: list[bool] | None, group: str) -> str:
        """A group's ``{socket: {cpu: {event: value}}}`` over the cpus that have a reading."""
        per = self.machine.cpus_per_socket
        template = '"%d":' + JSON_TEMPLATES[group]
        parts = []
        for s in range(self.machine.sockets):
            cpus = range(s * per, (s + 1) * per)
            inner = ",".join([template % (c, *values[c]) for c in cpus if ran is None or ran[c]])
            if inner:
                parts.append(f'"{s}":{{{inner}}}')
        return "{" + ",".join(parts) + "}"

    def json_lines(self) -> list[str]:
        """The tick's reports in hwpc-sensor's JSON: the `all` report first, then each target."""
        t, lists, per = self.t, self.lists, self.machine.cpus_per_socket
        head = f'{{"timestamp":"{self.timestamp}","sensor":"{self.machine.sensor}","target":'
        template = '"%d":{"%d":' + JSON_TEMPLATES["rapl"] + "}"
        rapl = ",".join(template % (s, s * per, *v) for s, v in enumerate(lists["rapl_json"][t]))
        msr = self._json_group(lists["msr"][t], None, "msr")
        core = self._json_group(lists["system_core"][t], lists["system_present"][t], "core")
        lines = [f'{head}"all","groups":{{"rapl":{{{rapl}}},"msr":{msr},"core":{core}}}}}\n']
        for target, values, ran in zip(
            self.block.targets, lists["core"][t], lists["present"][t], strict=True
        ):
            groups = self._json_group(values, ran, "core")
            lines.append(f'{head}"{target}","groups":{{"core":{groups}}}}}\n')
        return lines

    def reports(self) -> list[dict[str, Any]]:
        """The tick's reports as PowerAPI's JSON documents."""
        return [json.loads(line) for line in self.json_lines()]

    def _csv_rows(
        self, group: str, target: str, values: list[list[int]], ran: list[bool] | None
    ) -> list[str]:
        template, ms, sensor = CSV_TEMPLATES[group], self.millis, self.machine.sensor
        per = self.machine.cpus_per_socket
        return [
            template % (ms, sensor, target, c // per, c, *v)
            for c, v in enumerate(values)
            if ran is None or ran[c]
        ]

    def csv_rows(self) -> dict[str, list[str]]:
        """The tick's rows per events group, in PowerAPI's CSV layout (`all` rows first)."""
        t, lists, per = self.t, self.lists, self.machine.cpus_per_socket
        template, ms, sensor = CSV_TEMPLATES["rapl"], self.millis, self.machine.sensor
        rapl = [
            template % (ms, sensor, "all", s, s * per, *v) for s, v in enumerate(lists["rapl"][t])
        ]
        core = self._csv_rows("core", "all", lists["system_core"][t], lists["system_present"][t])
        for target, values, ran in zip(
            self.block.targets, lists["core"][t], lists["present"][t], strict=True
        ):
            core += self._csv_rows("core", target, values, ran)
        return {
            "rapl": rapl,
            "msr": self._csv_rows("msr", "all", lists["msr"][t], None),
            "core": core,
        }

    def truth(self) -> list[list[Any]]:
        """Ground truth of the tick (rows under :func:`truth_header`): targets, then sockets."""
        common = [self.timestamp, self.machine.sensor]
        rows: list[list[Any]] = [
            [*common, target, *values]
            for target, values in zip(self.block.targets, self.lists["truth"][self.t], strict=True)
        ]
        sockets = self.machine.sockets
        for s, (cpu_w, dram_w) in enumerate(self.lists["socket_truth"][self.t]):
            own = [0.0] * (4 * sockets)
            own[4 * s : 4 * s + 4] = [cpu_w, cpu_w, dram_w, dram_w]
            rows.append([*common, f"rapl-socket-{s}", cpu_w, dram_w, cpu_w, dram_w, *own])
        return rows


def truth_header(sockets: int) -> list[str]:
    """Columns of the ground truth: per target, watts summed over sockets, then per socket.

    ``*_w`` is the power the target's own activity drew; ``*_attributed_w`` adds its share of
    idle power, in proportion to its dynamic power on each socket, which is what SmartWatts-style
    formulas attribute. The ``rapl-socket-N`` rows carry each socket's measured total.
    """
    per_socket = [
        f"{name}_socket_{s}"
        for s in range(sockets)
        for name in ("cpu_w", "cpu_attributed_w", "dram_w", "dram_attributed_w")
    ]
    return [
        "timestamp", "sensor", "target",
        "cpu_w", "dram_w", "cpu_attributed_w", "dram_attributed_w", *per_socket,
    ]  # fmt: skip


class BlockLists(dict[str, Any]):
    """A block's arrays as nested Python lists, each converted on first use.

    Formatting text from Python lists is much faster than indexing numpy arrays element by
    element, and converting only what a writer reads keeps, say, a truth-only run cheap.
    """

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def __missing__(self, name: str) -> Any:
        block = self.block
        if name == "rapl_json":
            array: npt.NDArray[Any] = block.rapl[..., [1, 0, 2, 3]]
        elif name == "truth":
            array = np.round(self._truth(), 6)
        elif name == "socket_truth":
            array = np.round(np.stack([block.socket_cpu, block.socket_dram], axis=-1), 6)
        else:
            array = getattr(block, name)
        self[name] = found = array.tolist()
        return found

    def _truth(self) -> Floats:
        """Per (t, k): the values of :func:`truth_header` after timestamp, sensor and target."""
        block = self.block
        attributed_cpu, attributed_dram = block.attributed()
        values = (block.dynamic_cpu, attributed_cpu, block.dynamic_dram, attributed_dram)
        per_socket = np.stack(values, axis=-1)  # (t, k, s, 4)
        t, k = per_socket.shape[:2]
        totals = [v.sum(axis=2, keepdims=True) for v in values]
        return np.concatenate(
            [totals[0], totals[2], totals[1], totals[3], per_socket.reshape(t, k, -1)], axis=2
        )


def tick_views(block: Block) -> list[TickView]:
    """The block's ticks, sharing one conversion of the block to Python values."""
    lists = BlockLists(block)
    return [TickView(block, lists, t) for t in range(len(block))]


def interleave(streams: Sequence[Iterator[Block]]) -> Iterator[TickView]:
    """Ticks of several machines in timestamp order, as a formula fed by all of them sees them.

    The machines tick in step (same period and tick count) and each tick's timestamp jitters by
    a few ms, so ordering each round of ticks by timestamp orders the whole stream.
    """
    for blocks in zip(*streams, strict=True):
        views = [tick_views(block) for block in blocks]
        for t in range(len(blocks[0])):
            yield from sorted((v[t] for v in views), key=lambda view: view.millis)


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
    """Yield, per tick, the hwpc-sensor reports (as JSON documents) and the ground-truth rows.

    Convenient for small recordings built in code; :class:`Recording` writes large ones.
    """
    blocks = simulate(
        machine, containers, ticks, seed=seed, start=start, period_s=period_s, multiplex=multiplex
    )
    header = truth_header(machine.sockets)
    for block in blocks:
        for view in tick_views(block):
            yield view.reports(), [dict(zip(header, row, strict=True)) for row in view.truth()]


class Recording:
    """Files being written: hwpc-sensor JSON Lines, PowerAPI CSV per group, ground truth CSV."""

    def __init__(
        self, jsonl: Path | None = None, csv_dir: Path | None = None, truth: Path | None = None
    ) -> None:
        self.reports = 0
        self.handles: list[IO[str]] = []
        self.jsonl = self._open(jsonl) if jsonl else None
        self.groups: dict[str, IO[str]] = {}
        if csv_dir:
            csv_dir.mkdir(parents=True, exist_ok=True)
            for group, events in CSV_EVENTS.items():
                handle = self._open(csv_dir / f"{group}.csv")
                handle.write(",".join(("timestamp", "sensor", "target", "socket", "cpu", *events)))
                handle.write("\n")
                self.groups[group] = handle
        self.truth_path = truth
        self.truth: Any = None  # a csv writer, once the number of sockets is known

    def _open(self, path: Path) -> IO[str]:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("w", newline="", buffering=1 << 20)
        self.handles.append(handle)
        return handle

    def write(self, views: Iterable[TickView]) -> None:
        """Append ticks to every file being written, so a recording never sits in memory."""
        for view in views:
            self.reports += 1 + len(view.block.targets)
            if self.jsonl:
                self.jsonl.writelines(view.json_lines())
            for group, rows in view.csv_rows().items() if self.groups else ():
                self.groups[group].writelines(rows)
            if self.truth_path:
                if self.truth is None:
                    self.truth = csv.writer(self._open(self.truth_path))
                    self.truth.writerow(truth_header(view.machine.sockets))
                self.truth.writerows(view.truth())

    def close(self) -> None:
        for handle in self.handles:
            handle.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def record(
    *,
    ticks: int,
    containers: int,
    sockets: int = 2,
    cpus_per_socket: int = 4,
    sensors: Sequence[str] = ("node-1",),
    multiplex: float = 0.0,
    seed: int = 42,
    jsonl: Path | None = None,
    csv_dir: Path | None = None,
    truth: Path | None = None,
) -> int:
    """Simulate and write a recording; return how many reports it holds."""
    streams = [
        simulate(
            Machine(sensor=name, sockets=sockets, cpus_per_socket=cpus_per_socket),
            containers_named(containers),
            ticks,
            seed=seed + number,
            multiplex=multiplex,
        )
        for number, name in enumerate(sensors)
    ]
    with Recording(jsonl, csv_dir, truth) as recording:
        recording.write(interleave(streams))
    return recording.reports


def write_csv_groups(reports: Iterable[dict[str, Any]], directory: Path) -> list[Path]:
    """Write reports given as JSON documents in PowerAPI's CSV input layout: a file per group."""
    directory.mkdir(parents=True, exist_ok=True)
    writers: dict[str, tuple[IO[str], Any, list[str]]] = {}
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
    for opened, _, _ in writers.values():
        opened.close()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    parser.add_argument("--out", type=Path, help="hwpc-sensor JSON Lines file to write")
    parser.add_argument("--truth", type=Path, help="ground-truth CSV to write")
    parser.add_argument("--csv", type=Path, help="PowerAPI CSV files to write in this directory")
    args = parser.parse_args()
    if not (args.out or args.csv or args.truth):
        parser.error("nothing to write: give --out, --csv or --truth")
    names = [args.sensor] if args.sensors == 1 else [f"node-{n + 1}" for n in range(args.sensors)]
    record(
        ticks=args.ticks,
        containers=args.containers,
        sockets=args.sockets,
        cpus_per_socket=args.cpus_per_socket,
        sensors=names,
        multiplex=args.multiplex,
        seed=args.seed,
        jsonl=args.out,
        csv_dir=args.csv,
        truth=args.truth,
    )


if __name__ == "__main__":
    main()
