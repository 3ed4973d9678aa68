"""SmartWatts: per-target CPU and DRAM power from hardware counters, learned against RAPL.

For every tick of a sensor, hwpc-sensor sends one global report (target ``all``: RAPL energy and
the APERF/MPERF counters of each socket) and one report per running target (its per-cpu core
counters). For each socket and scope (``cpu`` against the package's RAPL energy, ``dram`` against
the DRAM's), the formula picks the frequency layer from APERF/MPERF, predicts the power of the sum
of the targets' counters with that layer's model, and splits it among the targets by their own
predictions. The model is (re)learned from a window of (counters, RAPL) samples whenever the
window of recent errors exceeds the threshold.

It writes SmartWatts' reports: a ``global`` PowerReport (the model's raw prediction), one
PowerReport per target with ``scope``, ``socket``, ``formula`` (the model's hash) and ``ratio``
(the target's share), and a FormulaReport describing the model used. The ``rapl`` PowerReports
come from the RAPL formula, which reads the same global reports.

Two modes:

``--compat smartwatts-2.4``
    SmartWatts 2.4.1's numbers: a tick is processed once more than five newer ones are buffered,
    RAPL energy is divided by the configured period, raw counters are the features, scikit-learn's
    ElasticNet is the regression, and targets share the model's predicted global power. Its one
    difference: the ticks still buffered at shutdown are processed instead of lost.

default
    Fixes what SmartWatts' users hit: the interval between ticks comes from their timestamps;
    counters that perf multiplexed are scaled by time_enabled/time_running and turned into rates;
    a tick is processed once the sensor's stream is ``--tick-lateness-ms`` past it, and a tick
    whose global report never came is dead-lettered rather than dropped in silence; the targets'
    powers add up to the measured RAPL power, not to the model's guess of it; and the tick on
    which the model is first learned already gets estimates.

Counters that cannot be real (negative deltas, deltas beyond any count a cpu can make in an
interval: a counter that wrapped around) make their report a dead letter with that reason; a bad
global report takes its tick's target reports with it. A tick whose processing raises all the same
is a dead letter with all its reports, naming the error, on either way (reports or frames); the
formula goes on with the next tick, from the models as the failed one left them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain
from operator import itemgetter
from typing import Any, ClassVar, Literal, NamedTuple, Self

import numpy as np
import numpy.typing as npt
from pydantic import (
    AliasChoices,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.power_model import (
    FloatArray,
    FrequencyLayers,
    PowerModel,
    Relearning,
    dynamic_power,
    frequency_features,
    load_regression,
)
from wattflow.actors.formulas.rapl import (
    GLOBAL_TARGETS,
    RAPL_UNIT_J,
    rapl_groups,
    tick_intervals,
)
from wattflow.actors.formulas.smartwatts_frames import FrameTicks, frame_ticks
from wattflow.formats.frames import (
    Column,
    FormulaFrame,
    Frame,
    HWPCFrame,
    IntArray,
    PowerFrame,
)
from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import (
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    to_millis,
    trusted_report,
)

COMPAT_SMARTWATTS_24 = "smartwatts-2.4"

SMARTWATTS_BUFFERED_TICKS = 5
"""SmartWatts 2.4.1 processes its oldest tick once more than this many are buffered."""

WRAPPED_COUNTER = 2**48
"""No counter delta over one interval comes near this (78 hours of cycles at 1 GHz): a delta this
large is a counter that wrapped around and was subtracted without care."""

TIME_EVENTS = frozenset({"time_enabled", "time_running"})


class SmartWattsConfig(FormulaConfig):
    """SmartWatts' settings, with its flags and defaults, plus wattflow's mode and lateness."""

    disable_cpu_formula: bool = Field(
        default=False, description="Do not estimate the cpu (package) scope."
    )
    disable_dram_formula: bool = Field(default=False, description="Do not estimate the dram scope.")
    cpu_rapl_ref_event: str = Field(
        default="RAPL_ENERGY_PKG", description="RAPL event the cpu scope learns against."
    )
    dram_rapl_ref_event: str = Field(
        default="RAPL_ENERGY_DRAM", description="RAPL event the dram scope learns against."
    )
    # PowerAPI's names, kept exactly (its flags, config keys and variables): the unit is given
    # as "unit" instead of in the name.
    cpu_tdp: PositiveInt = Field(
        default=400,
        description="TDP in W; a model whose intercept is not under it is discarded.",
        json_schema_extra={"unit": "W"},
    )
    cpu_base_clock: PositiveInt = Field(
        default=100,
        description="Base clock in MHz: the width of a frequency layer.",
        json_schema_extra={"unit": "MHz"},
    )
    cpu_base_freq: PositiveInt = Field(
        default=2100,
        description="Base (nominal) frequency in MHz, which MPERF counts at.",
        json_schema_extra={"unit": "MHz"},
    )
    cpu_error_threshold: PositiveFloat = Field(
        default=2.0,
        description="Error in W over which the cpu models are relearned.",
        json_schema_extra={"unit": "W"},
    )
    dram_error_threshold: PositiveFloat = Field(
        default=2.0,
        description="Error in W over which the dram models are relearned.",
        json_schema_extra={"unit": "W"},
    )
    sensor_reports_frequency: PositiveInt = Field(
        default=1000,
        description="Period of hwpc-sensor's reports in ms.",
        json_schema_extra={"flags": ["--sensor-reports-frequency"], "unit": "ms"},
    )
    learn_min_samples_required: PositiveInt = Field(
        default=10, description="Samples a layer needs before its first model is learned."
    )
    learn_history_window_size: PositiveInt = Field(
        default=60, description="Samples a layer keeps to learn from."
    )
    learn_error_window_size: PositiveInt = Field(
        default=60, description="Errors a layer keeps to decide when to relearn."
    )
    learn_error_window_method: Literal["median", "mean"] = Field(
        default="median", description="How the error window is summed up: median or mean."
    )
    compat: Literal["smartwatts-2.4"] | None = Field(
        default=None,
        description="Reproduce another formula's numbers: smartwatts-2.4 for SmartWatts 2.4.1.",
    )
    tick_lateness_ms: NonNegativeInt = Field(
        default=2000,
        validation_alias=AliasChoices("tick_lateness_ms", "tick_lateness"),
        description="How long, in ms of the sensor's own timestamps, a tick waits for late "
        "reports before it is processed (not in compat mode).",
    )

    @model_validator(mode="after")
    def _some_scope(self) -> Self:
        if self.disable_cpu_formula and self.disable_dram_formula:
            raise ValueError(
                "--disable-cpu-formula with --disable-dram-formula leaves SmartWatts nothing to "
                "estimate; use --disable-smartwatts-formula to run without it"
            )
        return self


class BadCounters(ValueError):
    """A report whose counters cannot be real."""


# --- What travels between the steps --------------------------------------------------------
#
# Tick assembly gathers a tick's reports (Tick, Reading) and makes each socket's features
# (SocketFeatures, from the global report's SocketReference); one model step per socket and scope
# (SmartWattsFormula._step) turns them into a ModelStep; report building turns that into the
# PowerReports and the FormulaReport. The frame way (_FrameEstimates) makes the same steps on
# arrays: FrameTicks in, FrameEstimates out.


@dataclass(slots=True)
class Scope:
    """One estimated scope: its RAPL reference, when to relearn, and its models per socket."""

    name: str
    rapl_event: str
    relearning: Relearning
    frequency_terms: bool = False
    """Whether the default mode's model has terms in the package frequency: the package's
    power does (its cores' switching energy follows their voltage), the DRAM's does not."""
    layers: dict[str, FrequencyLayers] = field(default_factory=dict)


Counts = tuple[tuple[str, ...], list[float] | list[int]]
"""Event names, sorted, and the matching counts summed over a socket's cpus (made for every
report and socket, so a plain pair)."""


class CpuLayout(NamedTuple):
    """How to read the counters of a cpu whose events come in one known order."""

    counters: tuple[str, ...]
    """The counters, sorted; empty when there are none (the slow way then says so)."""
    values_of: Callable[[Any], Any]
    """A cpu's values in one C call: the counters', then (when ``timed``) the time columns."""
    timed: bool
    """Whether ``values_of`` ends with ``time_enabled`` and ``time_running``."""


@dataclass(slots=True)
class Reading:
    """A target's report with its counters summed per socket (multiplexing already undone)."""

    report: HWPCReport
    features: dict[str, Counts]


@dataclass(slots=True)
class Tick:
    """The reports of one sensor tick, gathered until the tick is processed."""

    timestamp: datetime
    global_report: HWPCReport | None = None
    targets: dict[str, Reading] = field(default_factory=dict)

    def reports(self) -> Iterable[HWPCReport]:
        """Every report the tick holds."""
        if self.global_report is not None:
            yield self.global_report
        for reading in self.targets.values():
            yield reading.report


@dataclass(slots=True)
class SocketReference:
    """What the global report says of one socket."""

    rapl_energy: dict[str, float]
    """RAPL event → energy over the interval, in RAPL units (2⁻³² J)."""
    package_frequency_mhz: int


@dataclass(slots=True)
class SocketFeatures:
    """One socket of an assembled tick: what its models step on."""

    socket: str
    targets: list[str]
    """The targets with counters on this socket, in the order their reports came."""
    events: tuple[str, ...]
    """The features' names, sorted."""
    rows: FloatArray
    """The global features (the targets' sum), then one row per target: counter rates per
    second, or in compat mode the raw counts."""
    rapl_power_w: dict[str, float]
    """RAPL event → the socket's measured power over the interval."""
    package_frequency_mhz: int


@dataclass(slots=True)
class ModelStep:
    """What one socket and scope's model predicted on a tick, for its reports."""

    model: PowerModel
    """The layer's model, as the step left it (relearned, maybe): the FormulaReport's."""
    model_hash: str
    """The model that predicted (before any relearning): the PowerReports' ``formula``."""
    rapl_power_w: float
    intercept_w: float
    dynamic_w: list[float]
    """The prediction without the intercept for each of the features' rows."""
    global_power_w: float
    """The prediction of the global features, intercept included."""
    error_w: float
    """|RAPL − global prediction|, stored in the error window."""
    layer_mhz: int
    """The frequency layer of the tick."""


def core_group(report: HWPCReport) -> dict[str, dict[str, dict[str, int | float]]] | None:
    """A target's per-cpu counters.

    hwpc-sensor names the group ``core``; PowerAPI's CSV input names each group after its file,
    so a report with one group is taken whatever its name.
    """
    found = report.groups.get("core")
    if found is None and len(report.groups) == 1:
        found = next(iter(report.groups.values()))
    return found


def msr_group(report: HWPCReport) -> dict[str, dict[str, dict[str, int | float]]] | None:
    """The global report's APERF/MPERF group, by name or by its events."""
    found = report.groups.get("msr")
    if found is not None:
        return found
    for group in report.groups.values():
        for cpus in group.values():
            for events in cpus.values():
                if "APERF" in events and "MPERF" in events:
                    return group
                break
            break
    return None


@formulas.register("smartwatts")
class SmartWattsFormula(Formula[SmartWattsConfig]):
    """One instance per sensor, holding every socket's and scope's models."""

    name: ClassVar[str] = "smartwatts"
    inputs: ClassVar[frozenset[str]] = frozenset({HWPCReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = SmartWattsConfig
    replayable: ClassVar[bool] = False  # a tick is the unit of failure (_handle_tick)

    def __init__(self, config: SmartWattsConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.sensor = str(key)
        self.compat = config.compat == COMPAT_SMARTWATTS_24
        self.period_s = config.sensor_reports_frequency / 1000.0
        self.base_frequency = config.cpu_base_clock * (
            config.cpu_base_freq // config.cpu_base_clock
        )
        self.scopes: list[Scope] = []
        method = config.learn_error_window_method
        if not config.disable_cpu_formula:
            cpu = Relearning(config.cpu_tdp, config.cpu_error_threshold, method)
            self.scopes.append(Scope("cpu", config.cpu_rapl_ref_event, cpu, frequency_terms=True))
        if not config.disable_dram_formula:
            dram = Relearning(config.cpu_tdp, config.dram_error_threshold, method)
            self.scopes.append(Scope("dram", config.dram_rapl_ref_event, dram))
        self.ticks: dict[datetime, Tick] = {}
        self.held: HWPCFrame | None = None
        """The last ticks of a frame, waiting ``--tick-lateness-ms`` for the next frame."""
        self.latest: datetime | None = None
        self.last_tick: datetime | None = None
        self._layouts: dict[tuple[str, ...], CpuLayout] = {}

    @classmethod
    def prepare(cls, config: FormulaConfig) -> None:
        assert isinstance(config, SmartWattsConfig)
        load_regression(config.compat is not None)

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if isinstance(report, HWPCReport):
            return report.sensor
        return None

    @classmethod
    def frame_parts(cls, frame: Frame) -> list[tuple[Hashable, Frame]] | None:
        if not isinstance(frame, HWPCFrame):
            return None
        return [(sensor, frame.of_sensor(sensor)) for sensor in frame.sensors()]

    def process(self, reports: list[Report], out: Output) -> None:
        if len(reports) == 1 and isinstance(reports[0], HWPCFrame):
            self._process_frame(reports[0], out, final=False)
            return
        if self.held is not None:  # a frame's last ticks come before these reports
            held, self.held = self.held, None
            reports = [*held.reports(), *reports]
        self._process_reports(reports, out)

    def _process_reports(self, reports: list[Report], out: Output) -> None:
        for report in reports:
            assert isinstance(report, HWPCReport)
            try:
                self._receive(report, out)
            except Exception as error:  # it raises before the report is in a tick
                out.fail([report], error, unit="report")
            if self.compat:
                while len(self.ticks) > SMARTWATTS_BUFFERED_TICKS:
                    self._handle_tick(next(iter(self.ticks)), out)
        if not self.compat and self.latest is not None:
            horizon = self.latest.timestamp() - self.config.tick_lateness_ms / 1000.0
            ripe = sorted(t for t in self.ticks if t.timestamp() <= horizon)
            for timestamp in ripe:
                self._handle_tick(timestamp, out)

    def flush(self, out: Output) -> None:
        """Process every buffered tick: at shutdown nothing waits for later reports any more."""
        if self.held is not None:
            held, self.held = self.held, None
            self._process_frame(held, out, final=True)
        order = list(self.ticks) if self.compat else sorted(self.ticks)
        for timestamp in order:
            self._handle_tick(timestamp, out)

    def _handle_tick(self, timestamp: datetime, out: Output) -> None:
        """Process a buffered tick, the unit of failure: if that raises, whatever the tick
        emitted is dropped and its reports are dead letters naming the error. The models keep
        what the failed tick did to them, as the ticks after it will see, and the tick leaves
        the buffer only once it has been handled one way or the other."""
        tick = self.ticks[timestamp]
        mark = out.mark()
        try:
            self._process_tick(tick, out)
        except Exception as error:
            out.fail(tick.reports(), error, unit="tick", since=mark)
        del self.ticks[timestamp]

    # --- tick assembly: reports into ticks, counters into features ----------------------------

    def _receive(self, report: HWPCReport, out: Output) -> None:
        timestamp = report.timestamp
        if not self.compat and self.last_tick is not None and timestamp <= self.last_tick:
            late_ms = (self.last_tick - timestamp).total_seconds() * 1000
            out.reject(
                report,
                f"arrived after its tick was processed (the sensor's stream had moved "
                f"{late_ms + self.config.tick_lateness_ms:.0f} ms past it; raise "
                f"--tick-lateness-ms above {self.config.tick_lateness_ms} ms to wait longer)",
            )
            return
        if report.target in GLOBAL_TARGETS:
            tick = self._tick(timestamp)
            if tick.global_report is not None:
                out.reject(tick.global_report, "replaced by a later global report of its tick")
            tick.global_report = report
        else:
            try:
                features = self._features(report)
            except BadCounters as error:
                out.reject(report, str(error))
                return
            tick = self._tick(timestamp)
            previous = tick.targets.get(report.target)
            if previous is not None:
                out.reject(previous.report, "replaced by a later report of its target and tick")
            tick.targets[report.target] = Reading(report, features)
        if self.latest is None or timestamp > self.latest:
            self.latest = timestamp

    def _tick(self, timestamp: datetime) -> Tick:
        tick = self.ticks.get(timestamp)
        if tick is None:
            tick = self.ticks[timestamp] = Tick(timestamp)
        return tick

    def _features(self, report: HWPCReport) -> dict[str, Counts]:
        """Sum a target's counters per socket, undoing perf's multiplexing outside compat."""
        group = core_group(report)
        if group is None:
            raise BadCounters(
                f"target report without a 'core' group (it has {sorted(report.groups)})"
            )
        features: dict[str, Counts] = {}
        for socket, cpus in group.items():
            rows = list(cpus.values())
            if rows:
                features[socket] = self._socket_counts(socket, cpus, rows)
        return features

    def _socket_counts(
        self, socket: str, cpus: dict[str, dict[str, int | float]], rows: list[dict[str, Any]]
    ) -> Counts:
        """One socket's counters summed over its cpus (``rows``: the cpus' events).

        This runs once per input report and socket, so the common case (every cpu reporting the
        same events) stays in C: one ``itemgetter`` call per cpu and ``zip``/``sum`` per event.
        """
        layout = self._layouts.get(tuple(rows[0]))
        if layout is None:
            layout = self._layout(rows[0])
        if layout.counters:
            sums = self._usual_sums(rows, layout)
            if sums is not None:
                return layout.counters, sums
        return self._features_slowly(socket, cpus)

    def _usual_sums(self, rows: list[dict[str, Any]], layout: CpuLayout) -> list[Any] | None:
        """The counters summed over the cpus the fast way, or ``None`` for anything unusual:
        other events per cpu, values that are not numbers or cannot be real, multiplexing
        (outside compat)."""
        try:
            values = list(map(layout.values_of, rows))
            columns = list(zip(*values, strict=True))
            if layout.timed:  # the time columns come last
                counts = columns[:-2]
                multiplexed = columns[-2] != columns[-1] and not self.compat
            else:
                counts = columns
                multiplexed = False
            sums = list(map(sum, counts))
            unusual = (
                multiplexed
                or sum(map(len, rows)) != len(rows[0]) * len(rows)
                or min(chain.from_iterable(counts)) < 0
                or max(sums) >= WRAPPED_COUNTER
            )
        except (KeyError, TypeError, ValueError):  # other events per cpu, or not numbers
            return None
        return None if unusual else sums

    def _layout(self, events: dict[str, int | float]) -> CpuLayout:
        """How to read a cpu's events in one C call: sorted counters, then the time columns."""
        names = tuple(sorted(e for e in events if e not in TIME_EVENTS))
        timed = events.keys() >= TIME_EVENTS
        keys = (*names, "time_enabled", "time_running") if timed else names
        if not keys:  # no counters at all: the slow way says so
            return CpuLayout((), tuple, False)
        layout = CpuLayout(names, itemgetter(*keys), timed)
        if len(keys) == 1:
            only = itemgetter(keys[0])
            layout = CpuLayout(names, lambda row: (only(row),), False)
        if len(self._layouts) < 64:
            self._layouts[tuple(events)] = layout
        return layout

    def _features_slowly(self, socket: str, cpus: dict[str, dict[str, int | float]]) -> Counts:
        """Every case the fast path leaves: cpus with other events, multiplexing, bad values."""
        sums: dict[str, float] = {}
        for cpu, events in cpus.items():
            if not isinstance(events, dict):
                raise BadCounters(f"cpu {cpu} of socket {socket} holds no events")
            scale = 1.0 if self.compat else _multiplexing_scale(events)
            for event, value in events.items():
                if event in TIME_EVENTS:
                    continue
                if type(value) not in (int, float):
                    raise BadCounters(
                        f"counter {event} on socket {socket} cpu {cpu} is not a number: {value!r}"
                    )
                if not 0 <= value < WRAPPED_COUNTER:
                    raise BadCounters(_bad_counter(event, value, socket, cpu))
                sums[event] = sums.get(event, 0.0) + value * scale
        if not sums:
            raise BadCounters(f"no counters on socket {socket}: its cpus report no events")
        names = tuple(sorted(sums))
        return names, [sums[name] for name in names]

    def _reference(self, report: HWPCReport) -> dict[str, SocketReference]:
        """RAPL energy and package frequency of each socket, from the global report."""
        msr = msr_group(report)
        if msr is None:
            raise BadCounters(
                "global report without an 'msr' group (APERF, MPERF): the package frequency, "
                "and so the model to use, is unknown"
            )
        references: dict[str, SocketReference] = {}
        for group in rapl_groups(report):
            for socket, cpus in report.groups[group].items():
                energy = _rapl_energy(socket, cpus)
                frequency_mhz = self._package_frequency_mhz(socket, msr.get(socket))
                references[socket] = SocketReference(energy, frequency_mhz)
        if not references:
            raise BadCounters("global report without RAPL energy counters")
        return references

    def _package_frequency_mhz(
        self, socket: str, cpus: dict[str, dict[str, int | float]] | None
    ) -> int:
        """The base frequency × APERF/MPERF, both summed over the socket's cpus."""
        if not cpus:
            raise BadCounters(f"global report without msr counters for socket {socket}")
        aperf = mperf = 0.0
        for cpu, events in cpus.items():
            a, m = events.get("APERF", 0), events.get("MPERF", 0)
            if a < 0 or m < 0:
                raise BadCounters(_bad_counter("APERF/MPERF", min(a, m), socket, cpu))
            aperf += a
            mperf += m
        if mperf <= 0:
            raise BadCounters(f"MPERF is zero on socket {socket}: the package frequency is unknown")
        return int(self.base_frequency * aperf / mperf)

    def _process_tick(self, tick: Tick, out: Output) -> None:
        """Assemble a tick, step each socket and scope's model on it, and emit the reports."""
        sockets = self._assemble(tick, out)
        if sockets is None:
            return
        estimated = False
        for features in sockets:
            for scope in self.scopes:
                rapl_power_w = features.rapl_power_w.get(scope.rapl_event)
                if rapl_power_w is None:
                    continue
                step = self._step(scope, features, rapl_power_w)
                if step is not None:
                    out.emit_all(self._power_reports(tick, scope, features, step))
                    out.emit(self._formula_report(tick, scope, features, step))
                    estimated = True
        if not estimated:
            out.absorb(1 + len(tick.targets))

    def _assemble(self, tick: Tick, out: Output) -> list[SocketFeatures] | None:
        """The features of each socket of the tick that has targets; ``None`` when the tick
        has nothing to estimate, its reports then absorbed or rejected here."""
        interval_s = self._interval_s(tick, out)
        if interval_s is None:
            return None
        references = self._references(tick, out)
        if references is None:
            return None
        sockets = []
        for socket, reference in references.items():
            features = self._socket_features(tick, socket, reference, interval_s)
            if features is not None:
                sockets.append(features)
        return sockets

    def _interval_s(self, tick: Tick, out: Output) -> float | None:
        """The tick's interval: since the previous tick, or the configured period in compat
        mode; ``None`` for a sensor's first tick (absorbed: it only starts the first interval,
        as in the RAPL formula) or a tick too soon after the previous one (rejected)."""
        if self.compat:
            return self.period_s
        previous, self.last_tick = self.last_tick, tick.timestamp
        if previous is None:
            out.absorb(len(tick.targets) + (tick.global_report is not None))
            return None
        interval_s = (tick.timestamp - previous).total_seconds()
        if interval_s < self.period_s / 4:
            reason = (
                f"tick {interval_s * 1000:.0f} ms after the previous one, under a quarter of "
                f"the sensor period ({self.config.sensor_reports_frequency} ms)"
            )
            for report in tick.reports():
                out.reject(report, reason)
            return None
        return interval_s

    def _references(self, tick: Tick, out: Output) -> dict[str, SocketReference] | None:
        """What the tick's global report says of each socket; ``None``, the reports absorbed
        or rejected, when the tick has no global report, no targets, or a bad global report."""
        global_report = tick.global_report
        if global_report is None:
            lateness = self.config.tick_lateness_ms
            wait = "" if self.compat else f" within --tick-lateness-ms {lateness} ms"
            for reading in tick.targets.values():
                out.reject(
                    reading.report,
                    f"tick {tick.timestamp.isoformat()} is incomplete: no global report "
                    f"('all'){wait}",
                )
            return None
        if not tick.targets:
            out.absorb()
            return None
        try:
            return self._reference(global_report)
        except BadCounters as error:
            out.reject(global_report, str(error))
            for reading in tick.targets.values():
                out.reject(reading.report, f"the global report of its tick was rejected: {error}")
            return None

    def _socket_features(
        self, tick: Tick, socket: str, reference: SocketReference, interval_s: float
    ) -> SocketFeatures | None:
        """One socket's features and RAPL power; ``None`` when no target ran on it."""
        targets = [name for name, r in tick.targets.items() if socket in r.features]
        if not targets:
            return None
        events, rows = _feature_rows([tick.targets[name].features[socket] for name in targets])
        if not self.compat:
            rows /= interval_s
        rapl_power_w = {}
        for scope in self.scopes:
            energy = reference.rapl_energy.get(scope.rapl_event)
            if energy is not None:
                rapl_power_w[scope.rapl_event] = energy * RAPL_UNIT_J / interval_s
        return SocketFeatures(
            socket, targets, events, rows, rapl_power_w, reference.package_frequency_mhz
        )

    # --- one model step per socket, scope and layer ------------------------------------------

    def _layers(self, scope: Scope, socket: str) -> FrequencyLayers:
        """The models of one scope and socket, created on first use."""
        layers = scope.layers.get(socket)
        if layers is None:
            config = self.config
            layers = scope.layers[socket] = FrequencyLayers(
                base_clock=config.cpu_base_clock,
                min_samples=config.learn_min_samples_required,
                history_window=config.learn_history_window_size,
                error_window=config.learn_error_window_size,
                compat=self.compat,
                base_mhz=self.base_frequency,
                frequency_terms=scope.frequency_terms,
            )
        return layers

    def _step(
        self, scope: Scope, features: SocketFeatures, rapl_power_w: float
    ) -> ModelStep | None:
        """Learn, predict and relearn the model of the socket's layer on one tick; ``None``
        while the layer has no model to predict with (or, in compat mode, on the tick that
        learned it, as SmartWatts waits for the next one)."""
        layers = self._layers(scope, features.socket)
        frequency_mhz = features.package_frequency_mhz
        model = layers.model(frequency_mhz)
        model.use_events(features.events)
        rows = layers.features(features.rows, frequency_mhz)
        global_features = rows[0].tolist()
        stored = not model.fitted
        if stored and (
            not model.first_fit(rapl_power_w, global_features, scope.relearning.max_intercept_w)
            or self.compat
        ):
            return None
        assert model.coef is not None
        intercept_w = model.intercept
        model_hash = model.hash
        dynamic_w = dynamic_power(rows, model.coef).tolist()
        global_power_w = dynamic_w[0] + intercept_w
        error_w = model.track(
            rapl_power_w, global_features, global_power_w, scope.relearning, stored=stored
        )
        return ModelStep(
            model,
            model_hash,
            rapl_power_w,
            intercept_w,
            dynamic_w,
            global_power_w,
            error_w,
            layers.layer_frequency(frequency_mhz),
        )

    # --- report building ---------------------------------------------------------------------

    def _power_reports(
        self, tick: Tick, scope: Scope, features: SocketFeatures, step: ModelStep
    ) -> list[PowerReport]:
        """The ``global`` PowerReport (the model's raw prediction), then one per target, with
        its share (``ratio``) of the global prediction less the intercept (which cancels out of
        every share).

        The formula's hot loop: the reports are built from complete field dicts.
        """
        timestamp = tick.timestamp
        sensor = self.sensor
        labels: dict[str, Any] = {
            "scope": scope.name,
            "socket": features.socket,
            "formula": step.model_hash,
        }
        global_report = tick.global_report
        assert global_report is not None
        reports = [
            trusted_report(
                PowerReport,
                {
                    "timestamp": timestamp,
                    "sensor": sensor,
                    "target": "global",
                    "power": step.global_power_w,
                    "metadata": {**global_report.metadata, **labels, "ratio": 1.0},
                },
            )
        ]
        dynamic_global = step.dynamic_w[0]
        rapl_power_w = step.rapl_power_w
        intercept_w = step.intercept_w
        readings = tick.targets
        share_measured = not self.compat
        for name, target_dynamic in zip(features.targets, step.dynamic_w[1:], strict=True):
            if dynamic_global > 0.0 and target_dynamic > 0.0:
                ratio = target_dynamic / dynamic_global
                # SmartWatts shares its predicted global power; wattflow the measured one.
                if share_measured:
                    power = ratio * rapl_power_w
                else:
                    power = target_dynamic + ratio * intercept_w
            else:
                ratio = power = 0.0
            reports.append(
                trusted_report(
                    PowerReport,
                    {
                        "timestamp": timestamp,
                        "sensor": sensor,
                        "target": name,
                        "power": power,
                        "metadata": {**readings[name].report.metadata, **labels, "ratio": ratio},
                    },
                )
            )
        return reports

    def _formula_report(
        self, tick: Tick, scope: Scope, features: SocketFeatures, step: ModelStep
    ) -> FormulaReport:
        """The FormulaReport describing the model as the step left it."""
        model = step.model
        return FormulaReport.trusted(
            timestamp=tick.timestamp,
            sensor=self.sensor,
            target=model.hash,
            metadata=dict(
                zip(
                    FORMULA_KEYS,
                    model_description(
                        scope.name,
                        features.socket,
                        model,
                        step.layer_mhz,
                        features.package_frequency_mhz,
                        step.error_w,
                    ),
                    strict=True,
                )
            ),
        )

    # --- frames: every tick of a frame with array operations --------------------------------

    def _process_frame(self, frame: HWPCFrame, out: Output, *, final: bool) -> None:
        """Estimate a frame's ticks, holding the last ``--tick-lateness-ms`` unless final.

        The ticks go the report-by-report way when anything in them needs it (see
        :func:`~wattflow.actors.formulas.smartwatts_frames.frame_ticks`), with the same result.
        """
        if self.held is not None:
            held, self.held = self.held, None
            try:
                frame = held.joined(frame)
            except Exception:  # other groups or events: each frame goes its own way
                self._by_reports(held, out)
        if self.compat:
            self._by_reports(frame, out)
            return
        if self.ticks:
            rest = self._back_from_reports(frame, out)
            if rest is None:
                return
            frame = rest
        ripe: HWPCFrame | None = frame
        last = int(max(t.millis.max() for t in frame.tables if len(t)))
        if not final:
            if self.latest is not None:
                last = max(last, to_millis(self.latest))
            ripe, self.held = frame.after(last - self.config.tick_lateness_ms)
        self.latest = datetime_of(last)
        if ripe is not None and not self._estimate_frame(ripe, out):
            self._by_reports(ripe, out)

    def _back_from_reports(self, frame: HWPCFrame, out: Output) -> HWPCFrame | None:
        """The part of a frame that can go the frame way while the report-by-report way still
        buffers ticks (after a batch that was not plain, say), or ``None`` when none can yet.

        The frame's ticks up to the newest buffered one join those ticks the slow way; the
        buffered ticks that the frame's newer ticks make ripe are processed; once none is left,
        the newer ticks go the frame way, so one odd batch does not keep a sensor's stream on
        the slow way for good.
        """
        newest = to_millis(max(self.ticks))
        older, newer = frame.after(newest)
        if older is not None:
            self._by_reports(older, out)
        if newer is None:
            return None
        last = int(max(t.millis.max() for t in newer.tables if len(t)))
        horizon = last - self.config.tick_lateness_ms
        for timestamp in sorted(t for t in self.ticks if to_millis(t) <= horizon):
            self._handle_tick(timestamp, out)
        if self.ticks:
            self._by_reports(newer, out)
            return None
        return newer

    def _by_reports(self, frame: HWPCFrame, out: Output) -> None:
        """A frame's ticks the report-by-report way, waiting and buffering as it does."""
        self._process_reports(frame.reports(), out)

    def _estimate_frame(self, frame: HWPCFrame, out: Output) -> bool:
        """Every tick of a frame; ``False``, having changed nothing, if a tick needs the slow way
        (see :func:`~wattflow.actors.formulas.smartwatts_frames.frame_ticks`; or it comes after
        a tick already processed, or too soon after the previous one), or if making the arrays
        raised (logged: the report-by-report way then names what fails, tick by tick).

        A tick is the unit of failure here too: one whose model step raises is a dead letter
        with its reports, as on the report-by-report way (see :meth:`_FrameEstimates.run`).
        """
        mark = out.mark()
        try:
            estimates = self._frame_estimates(frame)
        except Exception as error:
            out.fall_back(mark, error, way="frame")
            return False
        if estimates is None:
            return False
        self.last_tick = datetime_of(estimates.millis[-1])
        try:
            self._step_frame(frame, estimates, out)
        except Exception as error:  # outside any tick's model step: the frame is the unit
            out.fail(frame.reports(), error, unit="frame", since=mark)
        return True

    def _frame_estimates(self, frame: HWPCFrame) -> _FrameEstimates | None:
        """The frame's ticks ready to step through, or ``None`` for the slow way."""
        ticks = frame_ticks(frame, self.base_frequency, scale_multiplexed=True)
        if ticks is None:
            return None
        millis = ticks.millis
        previous = None if self.last_tick is None else to_millis(self.last_tick)
        if previous is not None and int(millis[0]) <= previous:
            return None
        interval_s, first = tick_intervals(millis, previous, self.config.sensor_reports_frequency)
        if bool((interval_s[first:] < self.period_s / 4).any()):
            return None
        return _FrameEstimates(self, ticks, interval_s, first)

    def _step_frame(self, frame: HWPCFrame, estimates: _FrameEstimates, out: Output) -> None:
        """Step the models through the frame's ticks and emit their estimates.

        Each socket and scope has its own models, so their ticks are stepped through one
        (socket, scope) at a time; the estimates are put back in the order of ticks, sockets
        and scopes that the report-by-report way makes them in.
        """
        ticks = estimates.ticks
        targets = ticks.targets
        first = estimates.first
        if first:
            out.absorb(int(targets[0]) + 1)
        for socket_at in range(len(ticks.sockets)):
            for scope_at, scope in enumerate(self.scopes):
                energy = ticks.energy.get(scope.rapl_event)
                if energy is not None:
                    estimates.run(socket_at, scope_at, scope, energy[:, socket_at] * RAPL_UNIT_J)
        failed = estimates.drop_failed()
        estimated = estimates.ticks_estimated()
        with_targets = targets > 0
        with_targets[:first] = False
        with_targets[failed] = False
        absorbed = np.where(estimated, 0, 1 + targets)[with_targets]
        out.absorb(int(absorbed.sum()) + int((targets[first:] == 0).sum()))
        estimates.emit(frame, out)
        if failed:
            estimates.reject_failed(frame, out)


class FrameEstimate(NamedTuple):
    """One model step of the frame way: what its reports are built from."""

    tick: int
    """The tick's place in the frame."""
    socket_at: int
    """The socket's place in :attr:`FrameTicks.sockets`."""
    scope_at: int
    """The scope's place in the formula's scopes."""
    coef_code: int
    """The predicting model's coefficients: their place in :attr:`_FrameEstimates.coefs`."""
    rapl_power_w: float
    hash_code: int
    """The predicting model's hash: its place in :attr:`_FrameEstimates.hashes`."""
    global_dynamic_w: float
    """The prediction of the global features without the intercept."""
    global_power_w: float
    """The same with the intercept: the ``global`` report's power."""


PREDICTED_AHEAD = 64
"""Ticks of a frame whose global power a model predicts at once."""


class CoefPower(NamedTuple):
    """What one model's coefficients predict for a socket's global features, tick by tick."""

    coef_code: int
    first: int
    """The tick of the frame the predictions start at."""
    dynamic_w: list[float]
    """Without the intercept, one per tick from ``first`` on."""


@dataclass(slots=True, eq=False)
class ScopeSteps:
    """What the model steps of one socket and scope read, over a frame's ticks."""

    socket_at: int
    scope_at: int
    scope: Scope
    layers: FrequencyLayers
    rapl_power_w: list[float]
    """The measured power of each tick."""
    features: FloatArray
    """(ticks, events): the global features, per second."""
    feature_rows: list[list[float]]
    """The same rows as lists, as the models store them."""
    package_frequency_mhz: list[int]
    layer_mhz: list[int]
    """The frequency layer of each tick."""
    coef_power: dict[int, CoefPower] = field(default_factory=dict)
    """By ``id`` of the coefficients (kept alive in :attr:`_FrameEstimates.coefs`)."""


class EstimateColumns(NamedTuple):
    """A frame's estimates (:class:`FrameEstimate`) in report order, as columns."""

    tick: IntArray
    socket_at: IntArray
    scope_at: IntArray
    coef_code: IntArray
    rapl_power_w: FloatArray
    hash_code: IntArray
    global_dynamic_w: FloatArray
    global_power_w: FloatArray


class TargetShares(NamedTuple):
    """The target rows of a frame's estimates: each estimate's block of targets, in turn."""

    rows: IntArray
    """Rows of :attr:`FrameTicks.counts`."""
    estimate: IntArray
    """Each row's estimate."""
    first_row: IntArray
    """Each estimate's first place in ``rows``."""
    sizes: IntArray
    """Each estimate's number of targets."""
    ratio: FloatArray
    """Each target's share of its estimate's global dynamic power."""
    power_w: FloatArray


class _FrameEstimates:
    """The model steps of a frame's ticks, then their reports as frames."""

    def __init__(
        self, formula: SmartWattsFormula, ticks: FrameTicks, interval_s: FloatArray, first: int
    ) -> None:
        self.formula = formula
        self.ticks = ticks
        self.interval_s = interval_s
        self.first = first
        self.rates = ticks.global_counts / interval_s[:, None, None]  # the global features
        base_clock = formula.config.cpu_base_clock
        self.layers = (np.clip(ticks.frequency // base_clock, 1, 100) * base_clock).tolist()
        self.frequency = ticks.frequency.tolist()
        self.filled = (ticks.block_stop > ticks.block_start).T.tolist()
        self.millis = ticks.millis.tolist()
        self.done: list[FrameEstimate] = []
        self.coefs: list[FloatArray] = []
        """The coefficients the estimates used, each model's once."""
        self.hashes: list[str] = []
        self.hash_codes: dict[str, int] = {}
        self.described: list[tuple[int, str, tuple[Any, ...]]] = []
        """Each estimate's FormulaReport, entry for entry with ``done``."""
        self.failed: dict[int, BaseException] = {}
        """The ticks whose model step raised, and the error: each is a dead letter whole."""

    def run(self, socket_at: int, scope_at: int, scope: Scope, energy_j: FloatArray) -> None:
        """What ``_step`` does, for one socket and scope, tick after tick; the targets'
        shares are left for :meth:`emit`."""
        layers = self.formula._layers(scope, self.ticks.sockets[socket_at])
        features = layers.features_each(
            self.rates[:, socket_at, :], self.ticks.frequency[:, socket_at]
        )
        steps = ScopeSteps(
            socket_at=socket_at,
            scope_at=scope_at,
            scope=scope,
            layers=layers,
            rapl_power_w=(energy_j / self.interval_s).tolist(),
            features=features,
            feature_rows=features.tolist(),
            package_frequency_mhz=[row[socket_at] for row in self.frequency],
            layer_mhz=[row[socket_at] for row in self.layers],
        )
        filled = self.filled[socket_at]
        for tick in range(self.first, len(self.millis)):
            if not filled[tick]:
                continue
            try:
                self._step(steps, tick)
            except Exception as failure:
                self.fail(tick, failure)

    def _step(self, steps: ScopeSteps, tick: int) -> None:
        """One tick's model step: learn, predict, relearn, and keep the estimate."""
        layer = steps.layer_mhz[tick]
        model = steps.layers.model(layer)
        model.use_events(self.ticks.events)
        rapl_power_w = steps.rapl_power_w[tick]
        features = steps.feature_rows[tick]
        relearning = steps.scope.relearning
        stored = not model.fitted
        if stored and not model.first_fit(rapl_power_w, features, relearning.max_intercept_w):
            return
        coef_power = self._coef_power(steps, model, tick)
        global_dynamic_w = coef_power.dynamic_w[tick - coef_power.first]
        global_power_w = global_dynamic_w + model.intercept
        hash_code = self._hash_code(model.hash)
        error_w = model.track(rapl_power_w, features, global_power_w, relearning, stored=stored)
        description = model_description(
            steps.scope.name,
            self.ticks.sockets[steps.socket_at],
            model,
            layer,
            steps.package_frequency_mhz[tick],
            error_w,
        )
        estimate = FrameEstimate(
            tick,
            steps.socket_at,
            steps.scope_at,
            coef_power.coef_code,
            rapl_power_w,
            hash_code,
            global_dynamic_w,
            global_power_w,
        )
        # Both at once, once nothing can raise: they stay entry for entry.
        self.done.append(estimate)
        self.described.append((self.millis[tick], model.hash, description))

    def _coef_power(self, steps: ScopeSteps, model: PowerModel, tick: int) -> CoefPower:
        """What the model's coefficients predict for ``tick`` and the ticks after it, up to
        :data:`PREDICTED_AHEAD` of them, computed once per model and stretch of ticks (the
        default mode's model is refined every few ticks)."""
        coef = model.coef
        assert coef is not None
        known = steps.coef_power.get(id(coef))
        if known is None or tick - known.first >= len(known.dynamic_w):
            code = len(self.coefs) if known is None else known.coef_code
            stop = tick + PREDICTED_AHEAD
            dynamic_w = dynamic_power(steps.features[tick:stop], coef).tolist()
            known = steps.coef_power[id(coef)] = CoefPower(code, tick, dynamic_w)
            if code == len(self.coefs):
                self.coefs.append(coef)
        return known

    def _hash_code(self, model_hash: str) -> int:
        code = self.hash_codes.get(model_hash)
        if code is None:
            code = self.hash_codes[model_hash] = len(self.hashes)
            self.hashes.append(model_hash)
        return code

    def fail(self, tick: int, error: BaseException) -> None:
        """A tick's model step raised: the tick is done for, on every socket and scope.

        The socket and scope steps made before it keep what they did to their models, and
        those after it skip the tick, as the report-by-report way leaves them; the estimates
        it got are dropped (:meth:`drop_failed`).
        """
        self.failed[tick] = error
        for filled in self.filled:
            filled[tick] = False

    def drop_failed(self) -> list[int]:
        """Forget the estimates of the ticks that failed; return those ticks."""
        failed = self.failed
        if failed:
            kept = [at for at, estimate in enumerate(self.done) if estimate.tick not in failed]
            self.done = [self.done[at] for at in kept]
            self.described = [self.described[at] for at in kept]
        return sorted(failed)

    def reject_failed(self, frame: HWPCFrame, out: Output) -> None:
        """Dead-letter the reports of each tick that failed, naming its error."""
        errors = {self.millis[tick]: error for tick, error in sorted(self.failed.items())}
        reports: dict[int, list[Report]] = {millis: [] for millis in errors}
        for report in frame.reports():
            found = reports.get(to_millis(report.timestamp))
            if found is not None:
                found.append(report)
        for millis, error in errors.items():
            out.fail(reports[millis], error, unit="tick")

    def ticks_estimated(self) -> npt.NDArray[np.bool_]:
        """Which ticks got at least one estimate."""
        estimated = np.zeros(len(self.millis), dtype=np.bool_)
        if self.done:
            estimated[[estimate.tick for estimate in self.done]] = True
        return estimated

    def emit(self, frame: HWPCFrame, out: Output) -> None:
        """Every estimate's global and target PowerReports, in the order ``_step`` makes
        them (tick, socket, scope; the global report, then the targets), and FormulaReports."""
        if not self.done:
            return
        order = np.lexsort(
            (
                np.array([estimate.scope_at for estimate in self.done]),
                np.array([estimate.socket_at for estimate in self.done]),
                np.array([estimate.tick for estimate in self.done]),
            )
        ).tolist()
        columns = _estimate_columns([self.done[at] for at in order])
        described = [self.described[at] for at in order]
        out.emit_frame(self._power_frame(frame, columns, self._shares(columns)))
        out.emit_frame(FormulaFrame(self.formula.sensor, FORMULA_KEYS, described))

    def _shares(self, columns: EstimateColumns) -> TargetShares:
        """Each estimate's targets: their rows and their shares of the estimate's power."""
        ticks = self.ticks
        start = ticks.block_start[columns.tick, columns.socket_at]
        sizes = ticks.block_stop[columns.tick, columns.socket_at] - start
        estimate = np.repeat(np.arange(len(columns.tick)), sizes)
        first_row = np.cumsum(sizes) - sizes
        rows = start[estimate] + (np.arange(len(estimate)) - first_row[estimate])
        rates = ticks.counts[rows] / self.interval_s[columns.tick[estimate]][:, None]
        dynamic = np.empty(len(rows))
        scope_of = columns.scope_at[estimate]
        for scope_at, scope in enumerate(self.formula.scopes):
            mine = scope_of == scope_at
            if not mine.any():
                continue
            features = rates[mine]
            if scope.frequency_terms:
                frequency = ticks.frequency[
                    columns.tick[estimate][mine], columns.socket_at[estimate][mine]
                ]
                features = frequency_features(features, frequency, self.formula.base_frequency)
            used, at = np.unique(columns.coef_code[estimate][mine], return_inverse=True)
            coef = np.array([self.coefs[code] for code in used.tolist()])[at.reshape(-1)]
            dynamic[mine] = dynamic_power(features, coef)
        dynamic_global = columns.global_dynamic_w[estimate]
        shared = (dynamic_global > 0.0) & (dynamic > 0.0)
        ratio = np.zeros(len(rows))
        np.divide(dynamic, dynamic_global, out=ratio, where=shared)
        power_w = np.zeros(len(rows))
        np.multiply(ratio, columns.rapl_power_w[estimate], out=power_w, where=shared)
        return TargetShares(rows, estimate, first_row, sizes, ratio, power_w)

    def _power_frame(
        self, frame: HWPCFrame, columns: EstimateColumns, shares: TargetShares
    ) -> PowerFrame:
        """The PowerReports: each estimate's global row, then its targets' rows."""
        ticks = self.ticks
        estimates = len(columns.tick)
        count = estimates + len(shares.rows)
        global_at = shares.first_row + np.arange(estimates)
        target_at = np.ones(count, dtype=np.bool_)
        target_at[global_at] = False
        names = [*frame.names, "global"]
        column_target = np.empty(count, dtype=np.int64)
        column_target[global_at] = len(names) - 1
        column_target[target_at] = ticks.target_codes[shares.rows]
        column_power = np.empty(count)
        column_power[global_at] = columns.global_power_w
        column_power[target_at] = shares.power_w
        column_ratio = np.empty(count)
        column_ratio[global_at] = 1.0
        column_ratio[target_at] = shares.ratio
        estimate = np.repeat(np.arange(estimates), shares.sizes + 1)
        formula = self.formula
        return PowerFrame(
            sensor=formula.sensor,
            millis=ticks.millis[columns.tick][estimate],
            targets=column_target,
            target_names=names,
            power=column_power,
            metadata={
                "scope": Column(columns.scope_at[estimate], [s.name for s in formula.scopes]),
                "socket": Column(columns.socket_at[estimate], list(ticks.sockets)),
                "formula": Column(columns.hash_code[estimate], self.hashes),
                "ratio": column_ratio,
            },
        )


def _estimate_columns(estimates: list[FrameEstimate]) -> EstimateColumns:
    """The estimates' fields as arrays."""
    tick, socket_at, scope_at, coef_code, rapl_power_w, hash_code, global_dynamic_w, global_w = zip(
        *estimates, strict=True
    )
    return EstimateColumns(
        tick=np.array(tick, dtype=np.int64),
        socket_at=np.array(socket_at, dtype=np.int64),
        scope_at=np.array(scope_at, dtype=np.int64),
        coef_code=np.array(coef_code, dtype=np.int64),
        rapl_power_w=np.array(rapl_power_w),
        hash_code=np.array(hash_code, dtype=np.int64),
        global_dynamic_w=np.array(global_dynamic_w),
        global_power_w=np.array(global_w),
    )


FORMULA_KEYS = (
    "scope",
    "socket",
    "layer_frequency",
    "pkg_frequency",
    "samples",
    "id",
    "error",
    "intercept",
    "coef",
)
"""The metadata of SmartWatts' FormulaReports, in the order it writes them."""


def model_description(
    scope: str,
    socket: str,
    model: PowerModel,
    layer_mhz: int,
    package_frequency_mhz: int,
    error_w: float,
) -> tuple[Any, ...]:
    """A FormulaReport's metadata values, in :data:`FORMULA_KEYS`' order: the model as a
    step left it, and that step's frequency layer, package frequency and error."""
    return (
        scope,
        socket,
        layer_mhz,
        package_frequency_mhz,
        len(model.samples),
        model.id,
        error_w,
        model.intercept,
        model.coef_text,
    )


def _feature_rows(counts: list[Counts]) -> tuple[tuple[str, ...], FloatArray]:
    """The targets' counters of one socket as rows under one set of events, after a first row
    for their sum (the global features); a target without an event counts 0 of it."""
    events = counts[0][0]
    if all(c[0] == events for c in counts):
        rows = np.array([[0.0] * len(events)] + [c[1] for c in counts])
    else:  # targets reporting different events: align them on the union
        events = tuple(sorted({e for c in counts for e in c[0]}))
        rows = np.zeros((len(counts) + 1, len(events)))
        for row, (own, values) in enumerate(counts, start=1):
            rows[row, [events.index(e) for e in own]] = values
    rows[0] = rows[1:].sum(axis=0)
    return events, rows


def _rapl_energy(socket: str, cpus: dict[str, dict[str, int | float]]) -> dict[str, float]:
    """Each RAPL event's energy on a socket: its first cpu's value, as SmartWatts reads."""
    energy: dict[str, float] = {}
    for cpu, events in cpus.items():
        for event, value in events.items():
            if event in TIME_EVENTS or event in energy:
                continue
            if not 0 <= value < WRAPPED_COUNTER:
                raise BadCounters(_bad_counter(event, value, socket, cpu))
            energy[event] = value
    return energy


def _multiplexing_scale(events: dict[str, int | float]) -> float:
    """time_enabled / time_running of a cpu that perf multiplexed (0 if it never ran), else 1."""
    enabled = events.get("time_enabled")
    running = events.get("time_running")
    if isinstance(enabled, int | float) and isinstance(running, int | float) and running < enabled:
        return enabled / running if running > 0 else 0.0
    return 1.0


def _bad_counter(event: str, value: float, socket: str, cpu: str) -> str:
    if value < 0:
        return f"negative counter delta {value} for {event} on socket {socket} cpu {cpu}"
    return (
        f"counter delta {value} for {event} on socket {socket} cpu {cpu} is beyond any real "
        f"count: the counter wrapped around"
    )
