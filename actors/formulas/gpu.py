"""GPU formula: NVML readings → power per process or container on each GPU, and the GPU's idle.

For each device and sampling tick (τ0, τ1]:

1. **Device power** comes from the energy counter (Volta and newer): the NVML input reads it
   every ``--energy-ms`` (2 s) and power every tick, so the ticks between two
   counter readings take the counter's increase over that span, shared in proportion to their
   power readings (the mean of the driver's power samples stamped in the tick, whichever tick
   brought them, else the power reading); a tick waits for the counter reading that ends its
   span, within ``--gpu-hold-ms``. Without a counter, a tick's power is its reading. The first
   tick of a device with only an energy counter starts its interval.
2. **Idle power** is ``--gpu-idle-power-w`` watts when given. Otherwise it is learned from
   the whole counter spans (the ticks between two counter readings) in which every tick
   rested: no process used the SMs (per the process windows below) and device utilisation
   was at most ``--gpu-idle-util``. A span's power is its energy over its length, the
   counter's own figure: a resting tick in a span that also held a burst gets a share of the
   span's energy by interpolation, and the counter's lag can put part of the burst in it.
   Idle is the lowest mean power over :data:`IDLE_MEAN_S` of consecutive such spans, among
   those holding the last ``--gpu-idle-window`` resting ticks (their mean while they last
   less): a mean over three spans, not one, because the counter steps every ~100 ms, so a
   2 s span can read up to 5 % low (the next one as much high). Without a counter each tick
   is a span of its own. Until the first such span, idle is the median of the resting ticks'
   own power readings so far (the driver's power samples in each tick: a resting tick's share
   of a span that also held a burst depends on the counter's steps and lag, and on how late
   a loaded machine read the tick); until the device has rested once, 0 W: all of its power
   is active.
3. **Active energy** = (device power − idle) × the tick's length, never below zero.
4. **Per process.** The driver records every ~200 ms which ONE process holds the engine, and
   NVML averages those samples per process over the window since the previous call (a sample
   naming another process counts as 0). The NVML input reports each answer as a window,
   ``process_window`` (start and end in µs), with each process's mean in it. A tick's active
   energy is split among the windows that overlap it, pro rata by the overlap, and inside each
   window among its processes by their share of its SM utilisation. Processes are grouped into
   their cgroup (a container) unless ``--gpu-targets process`` asks for ``pid:<pid>`` targets;
   a process with no known cgroup is always its own target.
   **Per GPU instance (MIG).** Under MIG the driver gives no per-process utilisation; on a GPU
   with GPM counters (Hopper and newer) the NVML input reports instead each GPU instance's
   graphics activity between two GPM samples, ``instance_window``. Those windows are split the
   same way, each instance a target ``gpu<index>/gi<id>`` with its activity as its share. The
   processes on an instance are named in the input's report but get no power of their own.
5. **Waiting for the window.** A window arrives after the ticks it covers (it ends at the
   driver's newest sample), so a tick is held until a window covers its end, for at most
   ``--gpu-hold-ms`` of report time. What no window covers by then goes to the device's target,
   and the tick is counted (``uncovered_ticks``, logged as a warning).
6. **The device's own target** (``gpu<index>``) keeps the idle power, plus the active energy of
   windows without SM use (a context that only holds memory) and of uncovered time, so the
   targets of a device add up to its measured power on every tick.

**State** (:meth:`GpuFormula.state`, kept by checkpoints): per device, the last tick's time,
the counter's last reading and what released ticks took of it, the resting spans idle is
learned from (at most ``--gpu-idle-window`` ticks' worth), the span being released, the
resting ticks' power before the first such span, the process windows still needed and the
ticks still held (at most :data:`MAX_WINDOWS` and :data:`MAX_HELD_TICKS`). A restart at a
checkpoint then splits the held ticks as one uninterrupted run would: none is lost, none is
reported twice. A state saved before spans taught idle restores its resting ticks.

Recordings made before ``process_window`` existed give each tick's processes for that tick
alone: the tick is then its own window.

Limits: SM utilisation is a time share, not an energy share, so a memory-bound process and a
compute-bound one at the same utilisation get the same power. Under MIG the driver reports no
per-process utilisation: with GPM, power above idle goes to the GPU instances by their activity
(a time share: a small instance and a large one equally busy get the same power); without GPM
(before Hopper) everything above idle stays with the device target. Each driver
sample is one draw of who holds the engine, so a process's share is exact only over many
samples (tens of seconds), not per tick.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np
from pydantic import AliasChoices, Field, PositiveInt

from wattflow.actors.checkpoints import FormulaState, Packed, Saved, decode_state, encode_state
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.gpu_readings import (
    NoReading,
    power_samples,
    samples_mean_mw,
    tick_power_w,
)
from wattflow.actors.formulas.gpu_sharing import (
    PowersState,
    ProcessEnergy,
    ProcessPowers,
    ProcessWindow,
)
from wattflow.actors.formulas.window import StreamTime
from wattflow.formats.batch import Batch
from wattflow.formats.reports import (
    GPUDevice,
    GPUProcess,
    GPUReport,
    PowerReport,
    Report,
    ReportMetadata,
    check_metadata,
)

logger = logging.getLogger(__name__)

FORMULA_NAME = "gpu"

STATE_VERSION = 2
"""The layout of :meth:`GpuFormula.state` (:class:`GpuState`); a state of another version is
refused (the instance starts afresh and the log says so), but for version 1 (before processes'
active power was learned), which is read with nothing learned yet."""

ROUNDING = 1e-12
"""What the device keeps, as a part of the tick's power, below which it is the split's
rounding, not power: 0 W."""

DRIVER_SAMPLE_US = 200_000
"""Period of the driver's utilisation samples until the device's own buffer shows it: about
200 ms on H100 and H200 (NVML says between 1/6 s and 1 s, by product)."""

MAX_HELD_TICKS = 10_000
"""Ticks a device holds at most while waiting for process windows; past that the oldest is
released (its uncovered part to the device's target, counted) whatever ``--gpu-hold-ms`` says."""

MAX_WINDOWS = 10_000
"""Process windows a device keeps at most; those no held tick overlaps are dropped first."""

IDLE_MEAN_S = 6.0
"""Learned idle is the lowest mean power over this much resting time: three of the NVML
input's 2 s energy-counter spans, across which the counter's 100 ms steps cancel out to ±2 %."""

_SECONDS_SLACK = 1e-3
"""Spans that last :data:`IDLE_MEAN_S` less this (three spans of 2 s, summed in floats) last
it."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class GpuConfig(FormulaConfig):
    """Settings of the GPU formula."""

    gpu_idle_power_w: float | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("gpu_idle_power_w", "gpu_idle_power"),
        description="Idle power of every GPU in W; learned from the readings when unset.",
    )
    gpu_idle_util: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="SM utilisation (%) up to which a tick counts as idle, to learn idle power.",
        json_schema_extra={"unit": "%"},
    )
    gpu_idle_window: PositiveInt = Field(
        default=600,
        description="Resting ticks among which idle is learned, in whole energy-counter spans "
        "in which every tick rested (their lowest 6 s mean power).",
    )
    gpu_hold_ms: PositiveInt = Field(
        default=3000,
        description="How long a tick waits, in report time, for the per-process utilisation "
        "(under MIG, the per-instance activity) that covers it; what none covers by then stays "
        "with the device's target.",
        json_schema_extra={"unit": "ms"},
    )
    gpu_targets: Literal["cgroup", "process"] = Field(
        default="cgroup",
        description="Attribute GPU power to containers (cgroups) or to single processes.",
    )


@dataclass(slots=True)
class _Window:
    """One answer of the driver's per-process utilisation over (start, end] (under MIG, of the
    GPU instances' activity): each process's (instance's) share of the window."""

    start_us: int
    end_us: int
    shares: dict[str, float]
    """Per process (its identity, see :func:`_process_key`) or GPU instance: the share of the
    window's time it held the engine, 0-1."""
    targets: dict[str, str]
    """The target each process's power goes to."""
    busy: bool
    """Whether a process used the SMs above ``--gpu-idle-util`` in the window."""
    process: ProcessWindow | None = None
    """What the processes' active power is learned from and split by; ``None`` under MIG."""
    active_j: float = 0.0
    """Active energy of the released ticks, over the part of them the window covers."""
    released_s: float = 0.0
    """Seconds of the window the released ticks covered: once all of it, the window teaches
    the processes' active power."""


@dataclass(slots=True)
class _Tick:
    """A device's tick, waiting for the windows that cover it and the counter reading that
    settles its power."""

    report: GPUReport
    start_us: int
    end_us: int
    reading_w: float | None
    """The tick's own power reading; ``None`` where the device gave only its counter."""
    util_gpu: float | None
    waits: bool
    """False where the device gives neither per-process utilisation nor per-instance activity
    (MIG without GPM): nothing to wait for."""
    power_w: float = 0.0
    """The tick's power, once settled."""
    settled: bool = False
    """Whether ``power_w`` is final: scaled to the energy counter, or the device has none."""
    span_us: int | None = None
    """End of the counter span that settled the tick (its own end on a device without a
    counter); ``None`` where the tick was not settled with every other tick of its span (the
    counter's first reading, one that went backwards, a span some of whose ticks were released
    on their own readings): such a tick teaches no idle."""
    span_ticks: int = 0
    """How many ticks that span holds."""
    span_read_s: float | None = None
    """The span's length by the counter's own reading times, where the driver gave them: its
    energy is the counter's increase between those, whatever the ticks' timestamps say."""

    @property
    def seconds(self) -> float:
        return (self.end_us - self.start_us) / 1e6


class _Span(msgspec.Struct, array_like=True):
    """The ticks of one counter span released so far: idle is learned from a span once its
    last tick is released, if every one of its ticks rested. A checkpoint keeps it as it is,
    a list of its fields in their order (``read_s`` came last, later)."""

    end_us: int
    ticks: int
    seen: int = 0
    energy_j: float = 0.0
    seconds: float = 0.0
    rested: bool = True
    read_s: float | None = None
    """Its length between the counter's reading times (see :attr:`_Tick.span_read_s`)."""


@dataclass
class _DeviceState:
    """What a device's previous ticks left behind."""

    timestamp: datetime | None = None
    counter_mj: float | None = None
    """The energy counter's last reading, and when (the tick's end, µs)."""
    counter_us: int | None = None
    counter_read_us: int | None = None
    """When the driver read the counter's last reading (its field value's time), if it said."""
    spent_mj: float = 0.0
    """Energy of the ticks released since the last counter reading before it settled them."""
    counter_w: float | None = None
    """Mean power between the last two counter readings: what a tick with no reading of its
    own gets when released before the counter settles it."""
    idle_spans: deque[tuple[float, float, int]] = field(default_factory=deque)
    """The last whole counter spans in which every tick rested: energy (J), seconds, ticks
    (together at most ``--gpu-idle-window`` ticks, and at least the newest span)."""
    span: _Span | None = None
    """The span whose ticks are being released."""
    idle_readings: deque[float] = field(default_factory=deque)
    """The power of each resting tick, until the first span in :attr:`idle_spans`."""
    idle_w: float | None = None
    """Learned idle power; ``None`` until computed again."""
    windows: deque[_Window] = field(default_factory=deque)
    covered_us: int | None = None
    """End of the newest process window: the ticks up to here can be split."""
    held: deque[_Tick] = field(default_factory=deque)
    powers: ProcessPowers = field(default_factory=ProcessPowers)
    """What the windows taught about each process's active power."""
    sample_us: int = DRIVER_SAMPLE_US
    """Period of the driver's utilisation samples (from its buffer, once read)."""
    released_us: int | None = None
    """End of the last tick released: windows ending before it are no longer needed."""
    uncovered_ticks: int = 0


class TickSpan(msgspec.Struct, array_like=True, frozen=True):
    """The counter span that settled a held tick: its end, its ticks, its read length."""

    us: int
    ticks: int
    read_s: float | None = None


class SavedReport(msgspec.Struct, frozen=True):
    """What a held tick's reports take from its GPU report."""

    timestamp: datetime
    sensor: str
    target: str
    metadata: ReportMetadata
    """The report's own metadata, carried on to the tick's reports as it came."""

    def __post_init__(self) -> None:
        """Refuse, as it is decoded, metadata an input would have refused (a state written
        by hand or damaged): an output could not write it."""
        check_metadata(self.metadata)


class SavedTick(msgspec.Struct, kw_only=True, frozen=True):
    """A held :class:`_Tick` as a checkpoint keeps it."""

    report: SavedReport
    us: tuple[int, int]
    reading_w: float | None
    util_gpu: float | None
    waits: bool
    power_w: float
    settled: bool
    span: TickSpan | None = None


class SavedWindow(msgspec.Struct, kw_only=True, frozen=True):
    """A :class:`_Window` as a checkpoint keeps it."""

    us: tuple[int, int]
    shares: dict[str, float]
    targets: dict[str, str]
    busy: bool
    process: tuple[float, float, dict[str, float]] | None
    """The :class:`ProcessWindow`'s seconds, samples and noise shares (``None`` under MIG)."""
    learning: tuple[float, float]
    """:attr:`_Window.active_j` and :attr:`_Window.released_s`."""


WindowV1 = tuple[int, int, dict[str, float], bool]
"""A window as version 1 kept it: start and end (µs), each target's SM utilisation (%), busy;
nothing learned."""


class SavedDevice(msgspec.Struct, kw_only=True, frozen=True):
    """A :class:`_DeviceState` as a checkpoint keeps it; the fields with defaults came after
    version 1 (or, for ``idle_spans`` and ``span``, within it)."""

    timestamp: datetime | None
    counter_mj: float | None
    counter_us: int | None
    counter_read_us: int | None = None
    spent_mj: float
    counter_w: float | None
    idle_w: Packed
    """The resting ticks' power readings (:attr:`_DeviceState.idle_readings`)."""
    idle_spans: Packed | None = None
    """The resting spans, as rows of (energy J, seconds, ticks)."""
    span: _Span | None = None
    windows: list[SavedWindow | WindowV1]
    powers: PowersState | None = None
    sample_us: int = DRIVER_SAMPLE_US
    covered_us: int | None
    held: list[SavedTick]
    released_us: int | None
    uncovered_ticks: int


class GpuState(FormulaState, frozen=True, tag=STATE_VERSION):
    """What the GPU formula keeps across a restart: each device's state, by index."""

    formula = "GPU formula"
    also_reads = frozenset({1})  # before processes' active power was learned

    devices: dict[str, SavedDevice]


@formulas.register(FORMULA_NAME)
class GpuFormula(Formula[GpuConfig]):
    """One instance per sensor (node); it keeps the state of each of the node's devices."""

    name: ClassVar[str] = FORMULA_NAME
    inputs: ClassVar[frozenset[str]] = frozenset({GPUReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = GpuConfig
    replayable: ClassVar[bool] = False  # a report (a sampling tick) is the unit of failure

    def __init__(self, config: GpuConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.devices: dict[str, _DeviceState] = {}
        self.streams: dict[str, StreamTime] = {}
        """Each device's stream time, its newest tick (µs): rebuilt by the first tick after a
        restart, before any held tick is judged by it."""

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        return report.sensor if isinstance(report, GPUReport) else None

    @property
    def uncovered_ticks(self) -> int:
        """Ticks, over all devices, part of whose active energy stayed with the device's
        target because no process window covered them in time."""
        return sum(state.uncovered_ticks for state in self.devices.values())

    # --- checkpoints -------------------------------------------------------------------------

    def state(self) -> Saved:
        """Each device's counter, learned idle readings, process windows and held ticks."""
        devices = {index: _save_device(device) for index, device in self.devices.items()}
        return encode_state(GpuState(devices=devices))

    def restore(self, state: Saved) -> None:
        saved = decode_state(state, GpuState)
        window = self.config.gpu_idle_window
        self.devices = {
            index: _restore_device(device, window) for index, device in saved.devices.items()
        }

    def process(self, reports: Batch, out: Output) -> None:
        for report in reports:
            assert isinstance(report, GPUReport)
            mark = out.mark()
            try:
                self._tick(report, out)
            except Exception as error:  # the devices' state keeps what the tick did to it
                out.fail([report], error, unit="tick", since=mark)

    def flush(self, out: Output) -> None:
        """At shutdown, split every held tick with the windows there are."""
        for index, state in self.devices.items():
            while state.held:
                self._release(state.held.popleft(), state, index, out)

    def _tick(self, report: GPUReport, out: Output) -> None:
        """One sampling tick of the node's devices: the unit of failure."""
        produced = 0
        problems = []
        for index, device in report.devices.items():
            try:
                produced += self._device(report, index, device, out)
            except NoReading as error:
                problems.append(f"gpu {index}: {error}")
        if problems and not produced:
            out.reject(report, "; ".join(problems))
        elif not produced:
            out.absorb()

    def _device(self, report: GPUReport, index: str, device: GPUDevice, out: Output) -> int:
        """Take the device's tick; emit the reports of the ticks that can now be split."""
        state = self.devices.setdefault(index, _DeviceState())
        end_us = _micros(report.timestamp)
        first = state.timestamp is None
        _interval_s(state.timestamp, report.timestamp)  # rejects a tick not after the last
        start_us = end_us - 1 if state.timestamp is None else _micros(state.timestamp)
        state.timestamp = report.timestamp
        reading_w = _reading_power_w(state, device, 0 if first else start_us, end_us)
        state.sample_us = _sample_period_us(device, state.sample_us)
        waits = device.processes is not None or device.instances is not None
        if device.processes is not None:
            self._add_window(device, state, start_us, end_us)
        elif device.instances is not None:
            self._add_instance_window(device, state, index, start_us, end_us)
        _hold(state, _Tick(report, start_us, end_us, reading_w, device.util_gpu, waits),
              device.total_energy, first, device.total_energy_us)  # fmt: skip
        held_until = self._held_until(index, end_us)
        emitted = 0
        while state.held and (
            (state.held[0].settled and _covered(state.held[0], state))
            or state.held[0].end_us <= held_until
            or len(state.held) > MAX_HELD_TICKS
        ):
            emitted += self._release(state.held.popleft(), state, index, out)
        _forget_windows(state)
        return emitted

    def _held_until(self, index: str, end_us: int) -> int:
        """The newest tick end (µs) the device's stream has gone ``--gpu-hold-ms`` past: the
        ticks up to it are released whether or not a window covers them."""
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = StreamTime(lateness=self.config.gpu_hold_ms * 1000)
        stream.observe(index, end_us, 0.0)
        horizon = stream.horizon()
        assert horizon is not None
        return horizon

    def _add_window(
        self, device: GPUDevice, state: _DeviceState, start_us: int, end_us: int
    ) -> None:
        """The tick's process window: the NVML input's, or the tick itself in older
        recordings. A window of no length (no new answer from the driver) adds nothing."""
        if device.process_window is not None:
            start_us, end_us = device.process_window
        idle_util = self.config.gpu_idle_util
        busy = any(p.sm_util > idle_util for p in device.processes or ())
        shares, targets = self._shares(device)
        seconds = (end_us - start_us) / 1e6
        samples = (end_us - start_us) / state.sample_us
        noise = state.powers.noise_shares(shares, samples, end_us, device.running_pids)
        process = ProcessWindow(seconds, shares, samples, noise)
        _append_window(state, _Window(start_us, end_us, shares, targets, busy, process))

    def _add_instance_window(
        self, device: GPUDevice, state: _DeviceState, index: str, start_us: int, end_us: int
    ) -> None:
        """Under MIG: the GPU instances' GPM window (the tick itself where a report gives
        none), each instance a target ``gpu<index>/gi<id>`` with its graphics activity as its
        share, as a process's SM utilisation is."""
        if device.instance_window is not None:
            start_us, end_us = device.instance_window
        idle_util = self.config.gpu_idle_util
        shares = {
            f"gpu{index}/gi{instance.id}": instance.graphics_util / 100.0
            for instance in device.instances or ()
            if instance.graphics_util > 0
        }
        busy = any(util * 100.0 > idle_util for util in shares.values())
        targets = {target: target for target in shares}
        _append_window(state, _Window(start_us, end_us, shares, targets, busy))

    def _release(self, tick: _Tick, state: _DeviceState, index: str, out: Output) -> int:
        """Split one tick's active energy among its windows' targets; emit one report for each
        and one for the device, which keeps the rest. Returns how many reports."""
        if not tick.settled:  # the counter did not answer in time: the tick's own reading
            tick.power_w = _unsettled_w(tick, state)
            state.spent_mj += tick.power_w * tick.seconds * 1000.0
        overlaps, covered, resting = _overlaps(tick, state.windows)
        idle_w = min(self._idle(tick, resting, state), tick.power_w)
        active_w = tick.power_w - idle_w
        state.released_us = tick.end_us
        if tick.waits and covered < 1.0:
            self._count_uncovered(state, index)
        shares = _target_shares(overlaps, active_w, state.powers)
        _learn(overlaps, active_w, state)
        attributed_w = 0.0
        for target, share in sorted(shares.items()):
            power_w = share.energy_j / tick.seconds
            attributed_w += power_w
            out.emit(self._report(tick.report, target, index, power_w, share.ratio, share))
        device_w = tick.power_w - attributed_w
        if device_w < ROUNDING * tick.power_w:  # what the split's sums leave in rounding
            device_w = 0.0
        device_ratio = device_w / tick.power_w if tick.power_w > 0 else 1.0
        out.emit(self._report(tick.report, f"gpu{index}", index, device_w, device_ratio))
        return len(shares) + 1

    def _count_uncovered(self, state: _DeviceState, index: str) -> None:
        state.uncovered_ticks += 1
        count = state.uncovered_ticks
        if count & (count - 1) == 0:  # 1, 2, 4, 8...: a steady problem does not flood the log
            logger.warning(
                "GPU %s: no per-process or per-instance activity covered a tick within %d ms; "
                "its active power stays with gpu%s (%d ticks so far)",
                index,
                self.config.gpu_hold_ms,
                index,
                count,
            )

    def _idle(self, tick: _Tick, resting: bool, state: _DeviceState) -> float:
        """Idle power in W: configured, else learned from the whole counter spans in which
        every tick rested, else from the resting ticks so far, else 0 W (until the device has
        rested once, all of its power counts as active)."""
        if self.config.gpu_idle_power_w is not None:
            return self.config.gpu_idle_power_w
        quiet = tick.util_gpu is None or tick.util_gpu <= self.config.gpu_idle_util
        window = self.config.gpu_idle_window
        if _close_span(state, tick, resting and quiet, window):
            state.idle_readings.clear()  # no longer needed: spans teach idle from now on
            state.idle_w = None
        elif resting and quiet and not state.idle_spans:
            # The tick's own reading: its share of a counter span that also held a burst
            # depends on the counter's steps and lag, and on when a late tick was read.
            state.idle_readings.append(tick.power_w if tick.reading_w is None else tick.reading_w)
            while len(state.idle_readings) > window:
                state.idle_readings.popleft()
            state.idle_w = None
        if state.idle_w is None:
            state.idle_w = _learned_idle_w(state)
        return state.idle_w

    def _shares(self, device: GPUDevice) -> tuple[dict[str, float], dict[str, str]]:
        """Each process's share of the window (its SM utilisation, 0-1), by its identity, and
        the target it goes to: its cgroup (a container) or itself, as configured."""
        shares: dict[str, float] = {}
        targets: dict[str, str] = {}
        for process in device.processes or ():
            if process.sm_util <= 0:
                continue
            key = _process_key(process)
            if self.config.gpu_targets == "cgroup" and process.cgroup:
                targets[key] = process.cgroup
            else:
                targets[key] = f"pid:{process.pid}"
            shares[key] = shares.get(key, 0.0) + process.sm_util / 100.0
        return shares, targets

    def _report(
        self,
        report: GPUReport,
        target: str,
        index: str,
        power_w: float,
        ratio: float,
        share: _TargetShare | None = None,
    ) -> PowerReport:
        """A target's report: its power and ``ratio`` (a process's, container's or GPU
        instance's part of the tick's active energy; the device's part of its power), and for
        all but the device how it was split (see :class:`_TargetShare`)."""
        metadata: dict[str, Any] = {
            **report.metadata,
            "scope": "gpu",
            "device": index,
            "formula": FORMULA_NAME,
            "ratio": ratio,
        }
        if share is not None:
            metadata["split"] = share.split
            metadata["active_power_w"] = share.active_power_w
            metadata["active_power_stderr_w"] = share.active_power_stderr_w
        return PowerReport(
            timestamp=report.timestamp,
            sensor=report.sensor,
            target=target,
            power=power_w,
            metadata=metadata,
        )


def _save_device(state: _DeviceState) -> SavedDevice:
    return SavedDevice(
        timestamp=state.timestamp,
        counter_mj=state.counter_mj,
        counter_us=state.counter_us,
        counter_read_us=state.counter_read_us,
        spent_mj=state.spent_mj,
        counter_w=state.counter_w,
        idle_w=Packed.of(state.idle_readings),
        idle_spans=Packed.of([list(span) for span in state.idle_spans]),
        span=state.span,
        windows=[_save_window(window) for window in state.windows],
        powers=state.powers.state(),
        sample_us=state.sample_us,
        covered_us=state.covered_us,
        held=[_save_tick(tick) for tick in state.held],
        released_us=state.released_us,
        uncovered_ticks=state.uncovered_ticks,
    )


def _save_window(window: _Window) -> SavedWindow:
    process = window.process
    return SavedWindow(
        us=(window.start_us, window.end_us),
        shares=window.shares,
        targets=window.targets,
        busy=window.busy,
        process=None if process is None else (process.seconds, process.samples, process.noise),
        learning=(window.active_j, window.released_s),
    )


def _restore_window(saved: SavedWindow | WindowV1) -> _Window:
    """A window from :func:`_save_window`, or from version 1's (split by time share: nothing
    was learned then)."""
    if isinstance(saved, tuple):
        start_us, end_us, sm_percent, busy = saved
        fractions = {target: value / 100.0 for target, value in sm_percent.items()}
        return _Window(start_us, end_us, fractions, {t: t for t in fractions}, busy)
    process = None
    if saved.process is not None:
        seconds, samples, noise = saved.process
        process = ProcessWindow(seconds, saved.shares, samples, noise)
    (start_us, end_us), (active_j, released_s) = saved.us, saved.learning
    return _Window(
        start_us, end_us, saved.shares, saved.targets, saved.busy, process, active_j, released_s
    )


def _save_tick(tick: _Tick) -> SavedTick:
    report = tick.report  # only what the tick's reports take from it
    return SavedTick(
        report=SavedReport(report.timestamp, report.sensor, report.target, report.metadata),
        us=(tick.start_us, tick.end_us),
        reading_w=tick.reading_w,
        util_gpu=tick.util_gpu,
        waits=tick.waits,
        power_w=tick.power_w,
        settled=tick.settled,
        span=None
        if tick.span_us is None
        else TickSpan(tick.span_us, tick.span_ticks, tick.span_read_s),
    )


def _restore_device(saved: SavedDevice, idle_window: int) -> _DeviceState:
    """A device's state from :func:`_save_device`, bounded as the running formula bounds it.
    A state saved before spans taught idle has only resting ticks: they teach idle until the
    first whole resting span, as for a device that has not rested a whole span yet."""
    idle_spans: deque[tuple[float, float, int]] = deque()
    spans = [] if saved.idle_spans is None else saved.idle_spans.array().reshape(-1, 3).tolist()
    for energy_j, seconds, ticks in spans:
        idle_spans.append((energy_j, seconds, int(ticks)))
    _bound_spans(idle_spans, idle_window)
    return _DeviceState(
        timestamp=saved.timestamp,
        counter_mj=saved.counter_mj,
        counter_us=saved.counter_us,
        counter_read_us=saved.counter_read_us,
        spent_mj=saved.spent_mj,
        counter_w=saved.counter_w,
        idle_spans=idle_spans,
        span=saved.span,
        idle_readings=deque(saved.idle_w.values()[-idle_window:]),
        windows=deque(_restore_window(window) for window in saved.windows[-MAX_WINDOWS:]),
        covered_us=saved.covered_us,
        held=deque(_restore_tick(tick) for tick in saved.held[-MAX_HELD_TICKS:]),
        powers=ProcessPowers() if saved.powers is None else ProcessPowers.restore(saved.powers),
        sample_us=saved.sample_us,
        released_us=saved.released_us,
        uncovered_ticks=saved.uncovered_ticks,
    )


def _restore_tick(saved: SavedTick) -> _Tick:
    report = GPUReport.trusted(**msgspec.structs.asdict(saved.report))
    tick = _Tick(report, *saved.us, saved.reading_w, saved.util_gpu, saved.waits, saved.power_w)
    tick.settled = saved.settled
    if saved.span is not None:
        tick.span_us, tick.span_ticks, tick.span_read_s = msgspec.structs.astuple(saved.span)
    return tick


def _micros(timestamp: datetime) -> int:
    """A timestamp in Unix µs, exactly, as the driver stamps its samples."""
    return (timestamp - _EPOCH) // _MICROSECOND


def _append_window(state: _DeviceState, window: _Window) -> None:
    """Keep a window for the ticks it overlaps; one of no length (nothing new) adds nothing."""
    if window.end_us <= window.start_us:
        return
    state.windows.append(window)
    if state.covered_us is None or window.end_us > state.covered_us:
        state.covered_us = window.end_us
    while len(state.windows) > MAX_WINDOWS:
        state.windows.popleft()


def _covered(tick: _Tick, state: _DeviceState) -> bool:
    """Whether the tick can be split now: windows reach its end, or it has none to wait for."""
    return not tick.waits or (state.covered_us is not None and state.covered_us >= tick.end_us)


def _forget_windows(state: _DeviceState) -> None:
    """Drop the windows that end before every tick still to be split."""
    keep_from = state.held[0].start_us if state.held else state.released_us
    while state.windows and keep_from is not None and state.windows[0].end_us <= keep_from:
        state.windows.popleft()


def _overlaps(
    tick: _Tick, windows: deque[_Window]
) -> tuple[list[tuple[float, _Window]], float, bool]:
    """The windows overlapping the tick with the seconds of it each covers, the fraction of
    the tick that they cover, and whether the tick rested: no window overlapping it saw SM
    use, and windows cover it whole (or the device gives no per-process readings at all)."""
    duration = tick.end_us - tick.start_us
    found: list[tuple[float, _Window]] = []
    covered = 0
    busy = False
    for window in windows:
        overlap = min(window.end_us, tick.end_us) - max(window.start_us, tick.start_us)
        if overlap <= 0:
            continue
        covered += overlap
        busy = busy or window.busy
        found.append((overlap / 1e6, window))
    fraction_covered = min(covered / duration, 1.0)
    resting = not busy and (fraction_covered >= 1.0 or not tick.waits)
    return found, fraction_covered, resting


@dataclass(slots=True)
class _TargetShare:
    """A target's part of a tick's active energy, and how it was split: by the learned
    active power of each of its processes (``power``), or by their time shares (``time``: not
    learned yet, or processes the data cannot tell apart; GPU instances). Its active power and
    standard error (means over its processes weighted by energy) are the learned ones where
    ``power``, else the fit's figures so far (0 for GPU instances): every report of a process
    carries the same keys, as outputs with a fixed layout (PowerAPI's CSV header) need."""

    energy_j: float = 0.0
    ratio: float = 0.0
    split: Literal["power", "time"] = "power"
    active_power_w: float = 0.0
    active_power_stderr_w: float = 0.0


def _target_shares(
    overlaps: list[tuple[float, _Window]], active_w: float, powers: ProcessPowers
) -> dict[str, _TargetShare]:
    """Each target's part of the tick's active energy: the processes' windows by learned
    active power (:meth:`ProcessPowers.split`), GPU instances' by their activity; what no
    window with SM use covers stays with the device."""
    shares: dict[str, _TargetShare] = {}
    energy_of_tick = 0.0
    processes: list[tuple[float, ProcessWindow]] = []
    targets: dict[str, str] = {}
    processes_j = 0.0
    for seconds, window in overlaps:
        total = sum(window.shares.values())
        energy_of_tick += active_w * seconds
        if total <= 0:
            continue
        if window.process is not None:
            processes.append((seconds, window.process))
            targets.update(window.targets)
            processes_j += active_w * seconds
            continue
        for key, share in window.shares.items():
            entry = shares.setdefault(window.targets[key], _TargetShare(split="time"))
            entry.energy_j += active_w * seconds * share / total
    if processes:
        for part in powers.split(processes, processes_j, targets):
            _add(shares.setdefault(part.target, _TargetShare()), part)
    for entry in shares.values():
        entry.ratio = entry.energy_j / energy_of_tick if energy_of_tick > 0 else 0.0
        if entry.energy_j > 0:
            entry.active_power_w /= entry.energy_j
            entry.active_power_stderr_w /= entry.energy_j
    return shares


def _add(entry: _TargetShare, part: ProcessEnergy) -> None:
    """Add a process's energy to its target's; the target is split by power only if every
    one of its processes is (its means are weighted by energy, divided at the end)."""
    entry.energy_j += part.energy_j
    if part.split == "time":
        entry.split = "time"
    entry.active_power_w += part.power_w * part.energy_j
    entry.active_power_stderr_w += part.stderr_w * part.energy_j


def _learn(overlaps: list[tuple[float, _Window]], active_w: float, state: _DeviceState) -> None:
    """Credit each process window with the released tick's active energy over the part of it
    the window covers; a window covered whole teaches the processes' active power."""
    for seconds, window in overlaps:
        if window.process is None:
            continue
        window.active_j += active_w * seconds
        window.released_s += seconds
        if window.released_s >= window.process.seconds * (1 - 1e-9) > 0:
            state.powers.learn(window.process, window.active_j, window.end_us, window.targets)
            window.released_s = -math.inf  # learned once


def _process_key(process: GPUProcess) -> str:
    """A process's identity: its pid and start time (from /proc), so a reused pid is another
    process; where the start time is unknown, its pid and cgroup."""
    if process.started is not None:
        return f"{process.pid}@{process.started}"
    return f"{process.pid}@{process.cgroup or ''}"


def _sample_period_us(device: GPUDevice, known_us: int) -> int:
    """The driver's utilisation sample period, from the spacing of its samples in the buffer
    when the tick brought some, else what was known."""
    samples = (device.samples or {}).get("GPU_UTILIZATION", [])
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(samples)]
    gaps = [gap for gap in gaps if gap > 0]
    return min(gaps) if gaps else known_us


def _interval_s(previous: datetime | None, timestamp: datetime) -> float | None:
    """Seconds since the device's previous tick; ``None`` at its first tick."""
    if previous is None:
        return None
    interval_s = (timestamp - previous).total_seconds()
    if interval_s <= 0:
        raise NoReading(f"tick at {timestamp.isoformat()} is not after the previous one")
    return interval_s


def _hold(
    state: _DeviceState,
    tick: _Tick,
    energy_mj: float | None,
    first: bool,
    read_us: int | None = None,
) -> None:
    """Hold a tick until it can be split; a counter reading settles the ticks before it."""
    if energy_mj is not None:
        if not (first and tick.reading_w is None):  # else the first reading only starts it
            state.held.append(tick)
        _settle(state, energy_mj, tick.end_us, read_us)
    elif tick.reading_w is not None:
        if state.counter_us is None:  # a device without counter: the reading is its power
            tick.power_w, tick.settled = tick.reading_w, True
            tick.span_us, tick.span_ticks = tick.end_us, 1  # and the tick its own span
        state.held.append(tick)


def _settle(state: _DeviceState, energy_mj: float, end_us: int, read_us: int | None = None) -> None:
    """A counter reading at ``end_us``: the held ticks since the previous one share its
    increase, in proportion to their power readings (by length where a tick has none). The
    ticks released before it came used their own readings (``spent_mj``): the rest is shared.

    The first reading, or one lower than the last (a driver reload), has no increase to share:
    the ticks keep their own readings.
    """
    pending = [tick for tick in state.held if not tick.settled]
    previous_mj, previous_us = state.counter_mj, state.counter_us
    previous_read_us = state.counter_read_us
    state.counter_mj, state.counter_us, state.counter_read_us = energy_mj, end_us, read_us
    spent_mj, state.spent_mj = state.spent_mj, 0.0
    if previous_mj is None or previous_us is None or energy_mj < previous_mj:
        for tick in pending:
            tick.power_w, tick.settled = _unsettled_w(tick, state), True
        return
    span_s = (end_us - previous_us) / 1e6
    state.counter_w = (energy_mj - previous_mj) / 1000.0 / span_s if span_s > 0 else None
    if pending:
        _share(pending, max(energy_mj - previous_mj - spent_mj, 0.0) / 1000.0)
        if pending[0].start_us == previous_us:  # no tick of the span went on its own reading
            read_s = _between_s(previous_read_us, read_us)
            for tick in pending:
                tick.span_us, tick.span_ticks, tick.span_read_s = end_us, len(pending), read_s


def _between_s(earlier_us: int | None, later_us: int | None) -> float | None:
    """Seconds between two readings' own times, where both are known and in order."""
    if earlier_us is None or later_us is None or later_us <= earlier_us:
        return None
    return (later_us - earlier_us) / 1e6


def _share(pending: list[_Tick], left_j: float) -> None:
    """Share ``left_j`` joules among ticks by their readings × length (by length alone where
    a tick has no reading)."""
    weights = [(tick.reading_w or 0.0) * tick.seconds for tick in pending]
    if any(tick.reading_w is None for tick in pending) or sum(weights) <= 0:
        weights = [tick.seconds for tick in pending]
    total = sum(weights)
    for tick, weight in zip(pending, weights, strict=True):
        tick.power_w = left_j * weight / total / tick.seconds if total > 0 else 0.0
        tick.settled = True


def _close_span(state: _DeviceState, tick: _Tick, rested: bool, idle_window: int) -> bool:
    """Add a released tick to its counter span; when that is the span's last tick and every
    one of them rested, keep the span to learn idle from. Returns whether it was kept."""
    if tick.span_us is None:
        state.span = None
        return False
    span = state.span
    if span is None or span.end_us != tick.span_us:
        span = state.span = _Span(tick.span_us, tick.span_ticks, read_s=tick.span_read_s)
    span.seen += 1
    span.energy_j += tick.power_w * tick.seconds
    span.seconds += tick.seconds
    span.rested = span.rested and rested
    if span.seen < span.ticks:
        return False
    state.span = None
    if not span.rested or span.seconds <= 0:
        return False
    # By the counter's own reading times where known: a reading taken late (a stalled
    # sampler) holds more energy than the ticks' timestamps say the span lasted.
    state.idle_spans.append((span.energy_j, span.read_s or span.seconds, span.ticks))
    _bound_spans(state.idle_spans, idle_window)
    return True


def _bound_spans(spans: deque[tuple[float, float, int]], idle_window: int) -> None:
    """Keep the newest spans that hold at most ``idle_window`` ticks, and at least one."""
    ticks = sum(span[2] for span in spans)
    while len(spans) > 1 and ticks > idle_window:
        ticks -= spans.popleft()[2]


def _learned_idle_w(state: _DeviceState) -> float:
    """Idle from the whole resting spans: the lowest mean power over :data:`IDLE_MEAN_S` of
    consecutive ones, their mean while they hold less. Before the first one, the median of
    the resting ticks' readings so far (the median leaves out the few read while a burst's
    edge was in the driver's samples); 0 W without any."""
    if state.idle_spans:
        return _lowest_mean_w(state.idle_spans)
    if state.idle_readings:
        return float(np.median(np.fromiter(state.idle_readings, dtype=np.float64)))
    return 0.0


def _lowest_mean_w(spans: deque[tuple[float, float, int]]) -> float:
    """The lowest mean power of consecutive spans that last :data:`IDLE_MEAN_S` or more
    together (the shortest such run ending at each span); the mean of them all while they
    last less."""
    energy_j = np.concatenate(([0.0], np.cumsum([span[0] for span in spans])))
    seconds = np.concatenate(([0.0], np.cumsum([span[1] for span in spans])))
    if seconds[-1] < IDLE_MEAN_S - _SECONDS_SLACK:
        return float(energy_j[-1] / seconds[-1])
    ends = np.arange(1, len(seconds))
    starts = np.searchsorted(seconds, seconds[1:] - IDLE_MEAN_S + _SECONDS_SLACK, "right") - 1
    ends, starts = ends[starts >= 0], starts[starts >= 0]
    means = (energy_j[ends] - energy_j[starts]) / (seconds[ends] - seconds[starts])
    return float(means.min())


def _unsettled_w(tick: _Tick, state: _DeviceState) -> float:
    """A tick's power without a counter reading to scale it: its own reading, else the
    counter's mean over its last span, else 0 W."""
    if tick.reading_w is not None:
        return tick.reading_w
    return state.counter_w if state.counter_w is not None else 0.0


def _reading_power_w(
    state: _DeviceState, device: GPUDevice, start_us: int, end_us: int
) -> float | None:
    """The tick's own power (:func:`tick_power_w`, the definition the node formula shares);
    ``None`` for a device with only an energy counter, whose first reading starts the interval.

    The NVML input reads the driver's samples once a window (a second), so most of those a
    tick brings are the earlier ticks': they go to the held ticks they were stamped in
    (:func:`_refine_held_readings`), and their mean is not this tick's power."""
    samples = power_samples(device)
    if samples:
        _refine_held_readings(state, samples)
    return tick_power_w(device, start_us, end_us)


def _refine_held_readings(state: _DeviceState, samples: list[tuple[int, float]]) -> None:
    """Give each held tick that the counter has not settled yet the mean of the samples
    stamped in it: the counter's increase is shared by these readings, and the driver's
    samples (every ~20 ms) tell a tick's power better than the one reading taken at its end."""
    for tick in state.held:
        if not tick.settled and tick.reading_w is not None:
            own = samples_mean_mw(samples, tick.start_us, tick.end_us)
            if own is not None:
                tick.reading_w = own / 1000.0
