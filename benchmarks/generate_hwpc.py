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


PHENOMENA = ("dvfs", "phases", "heterogeneous", "jitter", "multiplex")
"""What real nodes do that :func:`simulate` leaves out, each of which :func:`simulate_node` can
switch on alone or with the others (see its docstring for the physics of each)."""


@dataclass(frozen=True)
class Phenomena:
    """Which of :data:`PHENOMENA` a simulated node shows."""

    dvfs: bool = False
    phases: bool = False
    heterogeneous: bool = False
    jitter: bool = False
    multiplex: bool = False

    @classmethod
    def parse(cls, text: str) -> Phenomena:
        """``all``, ``none``, or names from :data:`PHENOMENA` separated by commas."""
        names = {name.strip() for name in text.split(",") if name.strip()}
        if names == {"all"}:
            names = set(PHENOMENA)
        names.discard("none")
        unknown = names - set(PHENOMENA)
        if unknown:
            raise ValueError(f"unknown phenomena {sorted(unknown)}: choose from {PHENOMENA}")
        return cls(**{name: True for name in names})

    @property
    def label(self) -> str:
        """The names switched on, as :meth:`parse` reads them."""
        on = [name for name in PHENOMENA if getattr(self, name)]
        return "all" if len(on) == len(PHENOMENA) else ",".join(on) or "none"


@dataclass(frozen=True)
class Silicon:
    """The energy physics of :func:`simulate_node`'s cpus; the default is a small server part."""

    p_states_mhz: tuple[float, ...] = (1200.0, 1500.0, 1800.0, 2100.0, 2400.0, 2700.0, 3000.0)
    volts_at_min: float = 0.75
    """Core voltage at the lowest P-state; it rises linearly to ``volts_at_max``."""
    volts_at_max: float = 1.20
    nj_per_cycle: float = 0.9
    """Switching energy of an unhalted cycle (clock tree, pipeline even when stalled), in nJ at
    the base frequency's voltage; it scales with V²."""
    nj_per_instruction: float = 0.7
    """Switching energy of a retired instruction beyond its cycle, in nJ at base voltage (V²)."""
    nj_per_llc_miss: float = 12.0
    """Package energy of an LLC miss (uncore, memory controller), independent of core V/f."""
    dram_nj_per_llc_miss: float = 60.0
    """DRAM energy of an LLC miss (a line read or written back)."""
    leakage_share: float = 0.5
    """The share of idle package power that is leakage, proportional to V; the rest is fixed."""
    switch_noise: float = 0.03
    """Relative spread of the instructions a workload retires per cycle from tick to tick."""
    ambient_celsius: float = 30.0
    kelvin_per_watt: float = 0.8
    """How far above ambient the package settles per W it draws."""
    thermal_ticks: float = 30.0
    """How many ticks the package takes to get 63 % of the way to its new temperature."""
    leakage_doubling_kelvin: float = 25.0
    """Leakage doubles for every this many kelvin; it is ``leakage_share`` of idle at 50 °C."""
    background_w: float = 0.8
    """Mean power, per socket, of what no core counter of a watched target sees (I/O and uncore
    traffic, interrupts, the voltage regulators' losses): RAPL measures it, no report counts it.
    It wanders by about ``background_step_w`` a tick."""
    background_step_w: float = 0.1

    def volts(self, mhz: Floats | float, lowest: float, highest: float) -> Floats:
        """The core voltage at ``mhz``: linear between the lowest and highest P-state."""
        span = max(highest - lowest, 1.0)
        share = (np.asarray(mhz, dtype=np.float64) - lowest) / span
        return np.asarray(self.volts_at_min + (self.volts_at_max - self.volts_at_min) * share)


@dataclass(frozen=True)
class Workload:
    """A kind of code a container runs: how it uses a cycle, and how much of the node it wants."""

    kind: str
    ipc: float
    """Instructions per cycle at the base frequency."""
    misses_per_kilo_instruction: float
    memory_bound: float
    """How much of its time is memory stalls, whose length in ns does not shrink with the clock:
    its IPC at frequency f is ``ipc / (1 + memory_bound · (f / base − 1))``."""
    demand: float
    """Busy cpus it wants at the nominal load (scaled so that the node is about 60 % busy)."""


WORKLOADS = {
    "compute": Workload("compute", 2.4, 0.3, 0.05, 1.0),
    "memory": Workload("memory", 0.5, 25.0, 0.8, 0.8),
    "mixed": Workload("mixed", 1.3, 5.0, 0.4, 0.6),
    "idle": Workload("idle", 0.8, 2.0, 0.3, 0.03),
}
KINDS_IN_TURN = ("compute", "memory", "mixed", "memory", "compute", "mixed", "idle", "mixed")
"""The kinds the containers of :func:`node_containers` run, in turn."""


def node_containers(count: int, *, heterogeneous: bool) -> tuple[tuple[str, Workload], ...]:
    """``count`` containers named after their kind; without ``heterogeneous`` every one runs
    the ``mixed`` code (each still wants its kind's share of the node)."""
    found = []
    for number in range(count):
        kind = KINDS_IN_TURN[number % len(KINDS_IN_TURN)]
        workload = WORKLOADS[kind]
        if not heterogeneous:
            mixed = WORKLOADS["mixed"]
            workload = Workload(
                kind, mixed.ipc, mixed.misses_per_kilo_instruction, mixed.memory_bound,
                workload.demand,
            )  # fmt: skip
        found.append((f"{kind}-{number}", workload))
    return tuple(found)


@dataclass
class NodeTicks:
    """The per-tick state of a simulated node, drawn tick after tick before any counter."""

    interval_s: Floats  # (t,) the real length of each tick's interval
    millis: Ints  # (t,) when the sensor read it
    busy: Floats  # (t, k, c) share of the interval the container kept the cpu unhalted
    before_mhz: Floats  # (t, s) the P-state at the start of the interval
    after_mhz: Floats  # (t, s) the P-state at its end
    switch_at: Floats  # (t, s) share of the interval spent at ``before_mhz``


def _levels(ticks: int, k: int, phases: bool, rng: np.random.Generator) -> Floats:
    """Each container's load level per tick (1 = its nominal demand).

    Without phases, every container's load wanders on its own (a persistent random walk, about
    ±15 % from tick to tick). With phases, the node moves from phase to phase every 20–60 ticks:
    a phase sets a common level for everyone (from 25 % to 100 %) and each container's own factor
    (0.7–1.3), and within it loads move by only about 3 %, so that the counters of a phase are
    nearly proportional to one another.
    """
    if not phases:
        walk = np.zeros((ticks, k))
        steps = rng.normal(0.0, 0.15, (ticks, k))
        for t in range(1, ticks):
            walk[t] = 0.8 * walk[t - 1] + steps[t]
        return np.asarray(np.exp(walk))
    levels = np.empty((ticks, k))
    t = 0
    while t < ticks:
        length = int(rng.integers(20, 61))
        common = rng.uniform(0.25, 1.0)
        own = rng.uniform(0.7, 1.3, k)
        stop = min(ticks, t + length)
        levels[t:stop] = common * own * np.exp(rng.normal(0.0, 0.03, (stop - t, k)))
        t = stop
    return levels


def _governor(
    utilisation: Floats, silicon: Silicon, rng: np.random.Generator
) -> tuple[Floats, Floats, Floats]:
    """P-states per tick and socket, chosen by an ondemand-like governor from utilisation.

    It aims for the lowest P-state whose capacity keeps the socket under 85 % busy, goes up at
    once and down only when the load has fallen 10 % under the threshold (hysteresis). A change
    happens at a random moment of the interval, so that tick's APERF/MPERF reads a frequency
    between two P-states, and its energy is spent partly at each.
    """
    states = np.asarray(silicon.p_states_mhz)
    top = len(states) - 1
    ticks, sockets = utilisation.shape
    wanted = np.clip(np.ceil(utilisation / 0.85 * top), 0, top).astype(np.int64)
    lower = np.clip(np.ceil(utilisation * 1.1 / 0.85 * top), 0, top).astype(np.int64)
    state = np.empty((ticks, sockets), dtype=np.int64)
    current = wanted[0].copy()
    for t in range(ticks):
        up = wanted[t] > current
        down = lower[t] < current
        current = np.where(up, wanted[t], np.where(down, lower[t], current))
        state[t] = current
    after = states[state]
    before = np.concatenate([after[:1], after[:-1]])
    switch_at = np.where(before != after, rng.uniform(0.0, 1.0, (ticks, sockets)), 1.0)
    return before, after, switch_at


def node_ticks(
    machine: Machine,
    workloads: Sequence[Workload],
    ticks: int,
    phenomena: Phenomena,
    *,
    seed: int,
    start_ms: int,
    period_s: float,
    silicon: Silicon,
) -> NodeTicks:
    """Draw loads, placements, P-states and intervals for every tick."""
    streams = [np.random.default_rng([seed, n]) for n in range(4)]
    cpus, k = machine.cpus, len(workloads)
    demand = np.array([w.demand for w in workloads])
    if k:
        demand *= 0.6 * cpus / demand.sum()
    homes = (np.arange(k) * 3) % cpus
    offset = np.abs(np.arange(cpus)[None, :] - homes[:, None])
    distance = np.minimum(offset, cpus - offset)
    weight = np.maximum(0.0, 1.0 - 0.35 * distance)
    weight /= weight.sum(axis=1, keepdims=True)  # (k, c): the container's spread over cpus
    levels = _levels(ticks, k, phenomena.phases, streams[0])
    busy = demand[None, :, None] * weight[None] * levels[:, :, None]
    busy *= np.exp(streams[1].normal(0.0, 0.02, busy.shape))
    total = busy.sum(axis=1, keepdims=True)  # a cpu is busy at most 98 % of the time
    busy *= np.minimum(1.0, 0.98 / np.maximum(total, 1e-12))
    utilisation = busy.sum(axis=1).reshape(ticks, machine.sockets, -1).mean(axis=2)
    if phenomena.dvfs:
        before, after, switch_at = _governor(utilisation, silicon, streams[2])
    else:
        before = after = np.full((ticks, machine.sockets), machine.base_freq_mhz)
        switch_at = np.ones((ticks, machine.sockets))
    if phenomena.jitter:
        interval_s = period_s * np.clip(1.0 + streams[3].normal(0.0, 0.03, ticks), 0.85, 1.15)
    else:
        interval_s = np.full(ticks, period_s)
    millis = start_ms + np.round(np.cumsum(interval_s) * 1000).astype(np.int64)
    return NodeTicks(interval_s, millis, busy, before, after, switch_at)


class Unexplained:
    """The package power no counter explains, tick after tick: fixed idle power, leakage that
    heats up with the package, and the background of what no watched target runs."""

    def __init__(self, machine: Machine, silicon: Silicon, rng: np.random.Generator) -> None:
        self.fixed_w = machine.idle_pkg_w * (1.0 - silicon.leakage_share)
        self.silicon = silicon
        self.rng = rng
        self.celsius = np.full(machine.sockets, 50.0)
        self.background_w = np.full(machine.sockets, silicon.background_w)

    def add(self, dynamic_w: Floats, leakage_w: Floats) -> Floats:
        """Per (t, s): the package power RAPL measures, given the targets' power and the
        leakage at 50 °C over each tick."""
        silicon = self.silicon
        total = np.empty_like(dynamic_w)
        for t in range(len(dynamic_w)):
            heat = 2.0 ** ((self.celsius - 50.0) / silicon.leakage_doubling_kelvin)
            drift = self.rng.normal(0.0, silicon.background_step_w, len(self.background_w))
            self.background_w = np.maximum(
                0.0, self.background_w + 0.2 * (silicon.background_w - self.background_w) + drift
            )
            total[t] = self.fixed_w + leakage_w[t] * heat + self.background_w + dynamic_w[t]
            settled = silicon.ambient_celsius + silicon.kelvin_per_watt * total[t]
            self.celsius += (settled - self.celsius) / silicon.thermal_ticks
        return total


def simulate_node(
    machine: Machine,
    containers: Sequence[tuple[str, Workload]],
    ticks: int,
    phenomena: Phenomena,
    *,
    seed: int = 42,
    start: datetime = datetime(2026, 1, 5, 9, 0, 0, tzinfo=UTC),
    period_s: float = 1.0,
    silicon: Silicon = Silicon(),
) -> Iterator[Block]:
    """Simulate a node with what production nodes do, a block of ticks at a time.

    The physics, per tick, container and cpu:

    - **Cycles.** The container keeps the cpu unhalted a share ``b`` of the interval ``Δt``:
      ``b · Δt · f`` core cycles (``CPU_CLK_THREAD_UNHALTED:THREAD_P``) and ``b · Δt · f_base``
      reference cycles (``…:REF_P``), at the package frequency ``f``.
    - **Instructions and misses.** Its code retires ``ipc(f)`` instructions per cycle, where
      memory stalls (fixed in ns) make IPC fall as ``f`` rises, and misses the LLC
      ``misses_per_kilo_instruction`` times per thousand (see :class:`Workload`; ±3 % and ±5 %
      from tick to tick).
    - **Energy.** Switching energy per cycle and per instruction scales with V², and the voltage
      rises linearly with the P-state, so energy per cycle grows about with f² (power with f³).
      An LLC miss costs a fixed package energy (uncore) and a fixed DRAM energy.
    - **What no counter explains.** Idle package power is part fixed, part leakage, which is
      proportional to V and doubles every 25 K; the package warms towards a temperature that
      follows its power with a 30-tick lag. What no core counter of a watched target sees (I/O,
      uncore traffic, interrupts) draws about 0.8 W per socket, wandering by about 0.1 W from
      tick to tick. RAPL measures all of it
      plus the targets' power, so a regression sees noise and an idle power that drifts with
      the load.

    What each of :class:`Phenomena` adds:

    - ``dvfs``: the package frequency moves between P-states as the load changes
      (:func:`_governor`), with the energy of a switching tick spent at both frequencies;
      without it the node runs at its base frequency.
    - ``phases``: loads move together from phase to phase and barely within one (:func:`_levels`);
      without it each container's load wanders on its own.
    - ``heterogeneous``: compute-bound (high IPC, few misses), memory-bound (low IPC, many
      misses), mixed and idle containers share the sockets, so their power per cycle differs;
      without it they all run the same code.
    - ``jitter``: each interval is the period ±3 % (the sensor's timer is late or early), and the
      counters, the energy and the timestamps follow the real interval.
    - ``multiplex``: on a quarter of the ticks perf multiplexes half the per-cpu readings:
      ``time_running`` is 50–90 % of ``time_enabled`` and the counts cover only that time. The
      activity in that window is not quite the interval's average (±3 %), so scaling the counts
      by enabled/running gives an estimate, not the truth.

    The ground truth is each container's own energy over each interval, per socket.
    """
    workloads = [workload for _, workload in containers]
    start_ms = round(start.timestamp() * 1000)
    state = node_ticks(
        machine, workloads, ticks, phenomena,
        seed=seed, start_ms=start_ms, period_s=period_s, silicon=silicon,
    )  # fmt: skip
    rng = np.random.default_rng([seed, 10])
    cpus, k = machine.cpus, len(workloads)
    base = machine.base_freq_mhz
    socket_of = np.arange(cpus) // machine.cpus_per_socket
    lowest, highest = min(silicon.p_states_mhz), max(silicon.p_states_mhz)
    base_volts = float(silicon.volts(base, lowest, highest))
    ipc0 = np.array([w.ipc for w in workloads])[None, :, None]
    memory_bound = np.array([w.memory_bound for w in workloads])[None, :, None]
    mpki = np.array([w.misses_per_kilo_instruction for w in workloads])[None, :, None]
    unexplained = Unexplained(machine, silicon, np.random.default_rng([seed, 11]))
    step = max(1, ROWS_PER_BLOCK // max(1, k * cpus))
    for first in range(0, ticks, step):
        span = slice(first, min(ticks, first + step))
        n = span.stop - span.start
        interval = state.interval_s[span]
        busy = state.busy[span]
        seconds = busy * interval[:, None, None]  # (t, k, c) unhalted seconds
        share_before = state.switch_at[span][:, socket_of][:, None, :]  # (t, 1, c)
        cycles = np.zeros((n, k, cpus))
        instructions = np.zeros((n, k, cpus))
        core_joules = np.zeros((n, k, cpus))
        leakage_w = np.zeros((n, machine.sockets))
        retire = np.exp(rng.normal(0.0, silicon.switch_noise, (n, k, cpus)))
        for mhz, share in (
            (state.before_mhz[span], share_before),
            (state.after_mhz[span], 1.0 - share_before),
        ):
            at = mhz[:, socket_of][:, None, :]  # (t, 1, c)
            part = seconds * share * at * 1e6
            ipc = ipc0 / (1.0 + memory_bound * (at / base - 1.0)) * retire
            volts_sq = (silicon.volts(at, lowest, highest) / base_volts) ** 2
            cycles += part
            instructions += part * ipc
            nj = part * silicon.nj_per_cycle + part * ipc * silicon.nj_per_instruction
            core_joules += nj * volts_sq * 1e-9
            socket_share = share[:, 0, :: machine.cpus_per_socket]  # (t, s)
            leakage = silicon.volts(mhz, lowest, highest) / base_volts
            leakage_w += socket_share * machine.idle_pkg_w * silicon.leakage_share * leakage
        llc = instructions * mpki / 1000 * np.exp(rng.normal(0.0, 0.05, (n, k, cpus)))
        ref = seconds * base * 1e6
        present = cycles >= 1
        pkg_joules = np.where(present, core_joules + llc * silicon.nj_per_llc_miss * 1e-9, 0.0)
        dram_joules = np.where(present, llc * silicon.dram_nj_per_llc_miss * 1e-9, 0.0)
        per_socket = (n, k, machine.sockets, machine.cpus_per_socket)
        dynamic_cpu = pkg_joules.reshape(per_socket).sum(axis=3) / interval[:, None, None]
        dynamic_dram = dram_joules.reshape(per_socket).sum(axis=3) / interval[:, None, None]
        socket_cpu = unexplained.add(dynamic_cpu.sum(axis=1), leakage_w)
        socket_dram = machine.idle_dram_w + dynamic_dram.sum(axis=1)

        ns = np.round(interval * 1e9).astype(np.int64)[:, None, None]
        true_counts = np.stack([ref, cycles, instructions, llc], axis=-1)
        true_counts[~present] = 0.0
        running = np.broadcast_to(ns, (n, k, cpus)).copy()
        seen = np.ones((n, k, cpus))
        if phenomena.multiplex:
            ticked = rng.random(n) < 0.25
            chosen = ticked[:, None, None] & (rng.random((n, k, cpus)) < 0.5)
            ratio = rng.uniform(0.5, 0.9, (n, k, cpus))
            running = np.where(chosen, (ns * ratio).astype(np.int64), running)
            window = np.exp(rng.normal(0.0, 0.03, (n, k, cpus)))
            seen = np.where(chosen, running / ns * window, 1.0)
        core = np.empty((n, k, cpus, 6), dtype=np.int64)
        core[..., :4] = (true_counts * seen[..., None]).astype(np.int64)
        core[..., 4] = ns
        core[..., 5] = running
        system_core = np.empty((n, cpus, 6), dtype=np.int64)
        system_core[..., :4] = true_counts.astype(np.int64).sum(axis=1)
        system_core[..., 4:] = ns

        load = busy.sum(axis=1).clip(0.0, 1.0)  # (t, c)
        average_mhz = (
            state.before_mhz[span] * state.switch_at[span]
            + state.after_mhz[span] * (1.0 - state.switch_at[span])
        )[:, socket_of]
        mperf = np.maximum(1, (load * base * 1e6 * interval[:, None]).astype(np.int64))
        msr = np.empty((n, cpus, 5), dtype=np.int64)
        msr[..., 0] = (mperf * average_mhz / base).astype(np.int64)
        msr[..., 1] = mperf
        msr[..., 2] = (base * 1e6 * interval[:, None]).astype(np.int64)
        msr[..., 3:] = ns
        rapl = np.empty((n, machine.sockets, 4), dtype=np.int64)
        rapl[..., 0] = (socket_dram * interval[:, None] * RAPL_UNIT).astype(np.int64)
        rapl[..., 1] = (socket_cpu * interval[:, None] * RAPL_UNIT).astype(np.int64)
        rapl[..., 2:] = ns
        yield Block(
            machine=machine,
            targets=tuple(name for name, _ in containers),
            millis=state.millis[span],
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
    phenomena: Phenomena | None = None,
) -> int:
    """Simulate and write a recording; return how many reports it holds.

    With ``phenomena`` (even none of them), the node is :func:`simulate_node`'s, and
    ``multiplex`` is left to the phenomena; without, it is :func:`simulate`'s.
    """
    streams = [
        simulate(
            Machine(sensor=name, sockets=sockets, cpus_per_socket=cpus_per_socket),
            containers_named(containers),
            ticks,
            seed=seed + number,
            multiplex=multiplex,
        )
        if phenomena is None
        else simulate_node(
            Machine(sensor=name, sockets=sockets, cpus_per_socket=cpus_per_socket),
            node_containers(containers, heterogeneous=phenomena.heterogeneous),
            ticks,
            phenomena,
            seed=seed + number,
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
    parser.add_argument(
        "--phenomena",
        type=Phenomena.parse,
        help="simulate a node with these phenomena: 'all', 'none' or some of "
        f"{', '.join(PHENOMENA)} (comma-separated); without the flag, the plain simulation",
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
        phenomena=args.phenomena,
    )


if __name__ == "__main__":
    main()
