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
from typing import Any, ClassVar, Literal, Self

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
    ErrorMethod,
    FloatArray,
    FrequencyLayers,
    dynamic_power,
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


@dataclass(slots=True)
class Scope:
    """One estimated scope: its RAPL reference, relearning threshold and models per socket."""

    name: str
    rapl_event: str
    error_threshold: float
    layers: dict[str, FrequencyLayers] = field(default_factory=dict)


Counts = tuple[tuple[str, ...], list[float] | list[int]]
"""Event names, sorted, and the matching counts summed over a socket's cpus."""


Layout = tuple[tuple[str, ...], Callable[[Any], Any], bool]
"""Counter names, a getter of a cpu's counters (then its time columns), and whether it has them."""


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
    """What the global report says of one socket: RAPL energy per event, package frequency."""

    energy: dict[str, float]
    package_frequency: int


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
        if not config.disable_cpu_formula:
            self.scopes.append(Scope("cpu", config.cpu_rapl_ref_event, config.cpu_error_threshold))
        if not config.disable_dram_formula:
            self.scopes.append(
                Scope("dram", config.dram_rapl_ref_event, config.dram_error_threshold)
            )
        self.error_method: ErrorMethod = config.learn_error_window_method
        self.ticks: dict[datetime, Tick] = {}
        self.held: HWPCFrame | None = None
        """The last ticks of a frame, waiting ``--tick-lateness-ms`` for the next frame."""
        self.latest: datetime | None = None
        self.last_tick: datetime | None = None
        self._layouts: dict[tuple[str, ...], Layout] = {}

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
        """Sum a target's counters per socket, undoing perf's multiplexing outside compat.

        This runs once per input report, so the common case (every cpu reporting the same
        events) stays in C: one ``itemgetter`` call per cpu and ``zip``/``sum`` per event.
        """
        group = core_group(report)
        if group is None:
            raise BadCounters(
                f"target report without a 'core' group (it has {sorted(report.groups)})"
            )
        features: dict[str, Counts] = {}
        for socket, cpus in group.items():
            rows = list(cpus.values())
            if not rows:
                continue
            layout = self._layouts.get(tuple(rows[0]))
            if layout is None:
                layout = self._layout(rows[0])
            if not layout[0]:
                features[socket] = self._features_slowly(socket, cpus)
                continue
            names, values_of, timed = layout
            try:
                values = list(map(values_of, rows))
                columns = list(zip(*values, strict=True))
                if timed:  # the time columns come last
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
                unusual = True
            if unusual:
                features[socket] = self._features_slowly(socket, cpus)
                continue
            features[socket] = (names, sums)
        return features

    def _layout(self, events: dict[str, int | float]) -> Layout:
        """How to read a cpu's events in one C call: sorted counters, then the time columns.

        ``timed`` says whether the getter ends with the two time columns.
        """
        names = tuple(sorted(e for e in events if e not in TIME_EVENTS))
        timed = events.keys() >= TIME_EVENTS
        keys = (*names, "time_enabled", "time_running") if timed else names
        if not keys:  # no counters at all: the slow way says so
            return ((), tuple, False)
        layout: Layout = (names, itemgetter(*keys), timed)
        if len(keys) == 1:
            only = itemgetter(keys[0])
            layout = (names, lambda row: (only(row),), False)
        if len(self._layouts) < 64:
            self._layouts[tuple(events)] = layout
        return layout

    def _features_slowly(self, socket: str, cpus: dict[str, dict[str, int | float]]) -> Counts:
        """Every case the fast path leaves: cpus with other events, multiplexing, bad values."""
        sums: dict[str, float] = {}
        for cpu, events in cpus.items():
            if not isinstance(events, dict):
                raise BadCounters(f"cpu {cpu} of socket {socket} holds no events")
            scale = 1.0
            enabled = events.get("time_enabled")
            running = events.get("time_running")
            if (
                not self.compat
                and isinstance(enabled, int | float)
                and isinstance(running, int | float)
                and running < enabled
            ):
                scale = enabled / running if running > 0 else 0.0
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
                energy: dict[str, float] = {}
                for cpu, events in cpus.items():
                    for event, value in events.items():
                        if event in TIME_EVENTS or event in energy:
                            continue
                        if not 0 <= value < WRAPPED_COUNTER:
                            raise BadCounters(_bad_counter(event, value, socket, cpu))
                        energy[event] = value
                msr_cpus = msr.get(socket)
                if not msr_cpus:
                    raise BadCounters(f"global report without msr counters for socket {socket}")
                aperf = mperf = 0.0
                for cpu, events in msr_cpus.items():
                    a, m = events.get("APERF", 0), events.get("MPERF", 0)
                    if a < 0 or m < 0:
                        raise BadCounters(_bad_counter("APERF/MPERF", min(a, m), socket, cpu))
                    aperf += a
                    mperf += m
                if mperf <= 0:
                    raise BadCounters(
                        f"MPERF is zero on socket {socket}: the package frequency is unknown"
                    )
                frequency = int(self.base_frequency * aperf / mperf)
                references[socket] = SocketReference(energy, frequency)
        if not references:
            raise BadCounters("global report without RAPL energy counters")
        return references

    def _process_tick(self, tick: Tick, out: Output) -> None:
        interval_s = self.period_s
        if not self.compat:
            previous, self.last_tick = self.last_tick, tick.timestamp
            if previous is None:
                # Like the RAPL formula: a sensor's first tick only starts the first interval.
                out.absorb(len(tick.targets) + (tick.global_report is not None))
                return
            interval_s = (tick.timestamp - previous).total_seconds()
            if interval_s < self.period_s / 4:
                reason = (
                    f"tick {interval_s * 1000:.0f} ms after the previous one, under a quarter of "
                    f"the sensor period ({self.config.sensor_reports_frequency} ms)"
                )
                for report in tick.reports():
                    out.reject(report, reason)
                return
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
            return
        if not tick.targets:
            out.absorb()
            return
        try:
            references = self._reference(global_report)
        except BadCounters as error:
            out.reject(global_report, str(error))
            for reading in tick.targets.values():
                out.reject(reading.report, f"the global report of its tick was rejected: {error}")
            return
        estimated = False
        for socket, reference in references.items():
            names = [name for name, r in tick.targets.items() if socket in r.features]
            if not names:
                continue
            counts = [tick.targets[name].features[socket] for name in names]
            events = counts[0][0]
            if all(c[0] == events for c in counts):
                matrix = np.array([[0.0] * len(events)] + [c[1] for c in counts])
            else:  # targets reporting different events: align them on the union, 0 if absent
                events = tuple(sorted({e for c in counts for e in c[0]}))
                matrix = np.zeros((len(names) + 1, len(events)))
                for row, (own, values) in enumerate(counts, start=1):
                    matrix[row, [events.index(e) for e in own]] = values
            matrix[0] = matrix[1:].sum(axis=0)
            if not self.compat:
                matrix /= interval_s
            for scope in self.scopes:
                energy = reference.energy.get(scope.rapl_event)
                if energy is None:
                    continue
                estimated |= self._estimate(
                    scope,
                    socket,
                    tick,
                    names,
                    events,
                    matrix,
                    energy * RAPL_UNIT_J / interval_s,
                    reference.package_frequency,
                    out,
                )
        if not estimated:
            out.absorb(1 + len(tick.targets))

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
            )
        return layers

    def _estimate(
        self,
        scope: Scope,
        socket: str,
        tick: Tick,
        names: list[str],
        events: tuple[str, ...],
        matrix: FloatArray,
        rapl_w: float,
        package_frequency: int,
        out: Output,
    ) -> bool:
        """One socket and scope of a tick; whether it produced estimates."""
        config = self.config
        layers = self._layers(scope, socket)
        model = layers.model(package_frequency)
        model.use_events(events)
        global_features = matrix[0].tolist()
        stored = False
        if not model.fitted:
            model.store(rapl_w, global_features)
            stored = True
            learned = model.learn(config.cpu_tdp)
            model.clear_errors()
            if self.compat or not learned:
                return False
        assert model.coef is not None
        # The intercept cancels out of every share.
        dynamic = dynamic_power(matrix, model.coef).tolist()
        intercept = model.intercept
        dynamic_global = dynamic[0]
        raw_global = dynamic_global + intercept
        timestamp = tick.timestamp
        sensor = self.sensor
        labels: dict[str, Any] = {"scope": scope.name, "socket": socket, "formula": model.hash}
        global_report = tick.global_report
        assert global_report is not None
        # One PowerReport per target per socket and scope: the formula's hot loop, so the
        # reports are built from complete field dicts and handed on in one call.
        emitted = [
            trusted_report(
                PowerReport,
                {
                    "timestamp": timestamp,
                    "sensor": sensor,
                    "target": "global",
                    "power": raw_global,
                    "metadata": {**global_report.metadata, **labels, "ratio": 1.0},
                },
            )
        ]
        targets = tick.targets
        share_measured = not self.compat
        for name, target_dynamic in zip(names, dynamic[1:], strict=True):
            if dynamic_global > 0.0 and target_dynamic > 0.0:
                ratio = target_dynamic / dynamic_global
                # SmartWatts shares its predicted global power; wattflow the measured one.
                power = ratio * rapl_w if share_measured else target_dynamic + ratio * intercept
            else:
                ratio = power = 0.0
            emitted.append(
                trusted_report(
                    PowerReport,
                    {
                        "timestamp": timestamp,
                        "sensor": sensor,
                        "target": name,
                        "power": power,
                        "metadata": {**targets[name].report.metadata, **labels, "ratio": ratio},
                    },
                )
            )
        out.emit_all(emitted)
        error = abs(rapl_w - raw_global)
        if not stored:
            model.store(rapl_w, global_features)
        model.store_error(error)
        if model.window_error(self.error_method) > scope.error_threshold:
            model.relearn(config.cpu_tdp)
        out.emit(
            FormulaReport.trusted(
                timestamp=timestamp,
                sensor=self.sensor,
                target=model.hash,
                metadata={
                    "scope": scope.name,
                    "socket": socket,
                    "layer_frequency": model.frequency,
                    "pkg_frequency": package_frequency,
                    "samples": len(model.samples),
                    "id": model.id,
                    "error": error,
                    "intercept": model.intercept,
                    "coef": model.coef_text,
                },
            )
        )
        return True

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
        if self.compat or self.ticks:
            self._by_reports(frame, out)
            return
        ripe: HWPCFrame | None = frame
        last = int(max(t.millis.max() for t in frame.tables if len(t)))
        if not final:
            if self.latest is not None:
                last = max(last, to_millis(self.latest))
            ripe, self.held = frame.after(last - self.config.tick_lateness_ms)
        self.latest = datetime_of(last)
        if ripe is not None and not self._estimate_frame(ripe, out):
            self._by_reports(ripe, out)

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
        for at, socket in enumerate(ticks.sockets):
            for number, scope in enumerate(self.scopes):
                energy = ticks.energy.get(scope.rapl_event)
                if energy is not None:
                    estimates.run(at, socket, number, scope, energy[:, at] * RAPL_UNIT_J)
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
        self.done: list[tuple[int, int, int, int, float, int, float, float]] = []
        """(tick, socket, scope, coef code, RAPL W, hash code, dynamic W, global W) of each
        estimate, the dynamic power being the model's without its intercept."""
        self.coefs: list[FloatArray] = []
        """The coefficients the estimates used, each model's once."""
        self.hashes: list[str] = []
        self.hash_codes: dict[str, int] = {}
        self.described: list[tuple[int, str, tuple[Any, ...]]] = []
        self.failed: dict[int, BaseException] = {}
        """The ticks whose model step raised, and the error: each is a dead letter whole."""

    def run(self, at: int, socket: str, number: int, scope: Scope, energy_w_s: FloatArray) -> None:
        """What ``_estimate`` does, for one socket and scope, tick after tick; the targets'
        shares are left for :meth:`emit`."""
        formula = self.formula
        config = formula.config
        layers = formula._layers(scope, socket)
        models = layers.models
        events = self.ticks.events
        tdp = config.cpu_tdp
        threshold = scope.error_threshold
        method = formula.error_method
        rapl_w = (energy_w_s / self.interval_s).tolist()
        rates = self.rates[:, at, :]
        features = rates.tolist()
        frequencies = [row[at] for row in self.frequency]
        layer_of = [row[at] for row in self.layers]
        filled = self.filled[at]
        millis = self.millis
        dynamic_of: dict[int, tuple[int, list[float]]] = {}
        coefs = self.coefs
        hash_codes = self.hash_codes
        done = self.done
        described = self.described
        name = scope.name
        for tick in range(self.first, len(millis)):
            if not filled[tick]:
                continue
            try:
                layer = layer_of[tick]
                model = models.get(layer)
                if model is None:
                    model = layers.model(layer)
                if model.events != events:
                    model.use_events(events)
                power = rapl_w[tick]
                stored = False
                if model.coef is None:
                    model.store(power, features[tick])
                    stored = True
                    learned = model.learn(tdp)
                    model.clear_errors()
                    if not learned:
                        continue
                coef = model.coef
                assert coef is not None
                known = dynamic_of.get(id(coef))
                if known is None:  # once per model, for every tick: the global features' power
                    known = dynamic_of[id(coef)] = (
                        len(coefs),
                        dynamic_power(rates, coef).tolist(),
                    )
                    coefs.append(coef)
                coef_code, dynamic = known
                dynamic_global = dynamic[tick]
                raw_global = dynamic_global + model.intercept
                code = hash_codes.get(model.hash)
                if code is None:
                    code = hash_codes[model.hash] = len(self.hashes)
                    self.hashes.append(model.hash)
                error = abs(power - raw_global)
                if not stored:
                    model.store(power, features[tick])
                model.store_error(error)
                if model.window_error(method) > threshold:
                    model.relearn(tdp)
                summary = (
                    millis[tick],
                    model.hash,
                    (
                        name,
                        socket,
                        model.frequency,
                        frequencies[tick],
                        len(model.samples),
                        model.id,
                        error,
                        model.intercept,
                        model.coef_text,
                    ),
                )
                # Both at once, once nothing can raise: they stay entry for entry.
                done.append((tick, at, number, coef_code, power, code, dynamic_global, raw_global))
                described.append(summary)
            except Exception as failure:
                self.fail(tick, failure)

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
            kept = [at for at, entry in enumerate(self.done) if entry[0] not in failed]
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
            estimated[[entry[0] for entry in self.done]] = True
        return estimated

    def emit(self, frame: HWPCFrame, out: Output) -> None:
        """Every estimate's global and target PowerReports, in the order ``_estimate`` makes
        them (tick, socket, scope; the global report, then the targets), and FormulaReports."""
        formula = self.formula
        if not self.done:
            return
        ticks = self.ticks
        order = np.lexsort(
            (
                np.array([entry[2] for entry in self.done]),
                np.array([entry[1] for entry in self.done]),
                np.array([entry[0] for entry in self.done]),
            )
        ).tolist()
        done = [self.done[at] for at in order]
        described = [self.described[at] for at in order]
        tick, at, scope, coefs, rapl_w, code, dynamic_w, raw_global = zip(*done, strict=True)
        tick_of = np.array(tick, dtype=np.int64)
        at_of = np.array(at, dtype=np.int64)
        start = ticks.block_start[tick_of, at_of]
        size = ticks.block_stop[tick_of, at_of] - start
        # Target rows: each estimate's block of targets.
        estimate_of_row = np.repeat(np.arange(len(tick_of)), size)
        first_row = np.cumsum(size) - size
        rows = start[estimate_of_row] + (
            np.arange(len(estimate_of_row)) - first_row[estimate_of_row]
        )
        features = ticks.counts[rows] / self.interval_s[tick_of[estimate_of_row]][:, None]
        coef = np.array(self.coefs)[np.array(coefs, dtype=np.int64)[estimate_of_row]]
        dynamic = dynamic_power(features, coef)
        global_w = np.array(raw_global)
        rapl = np.array(rapl_w)
        dynamic_global = np.array(dynamic_w)[estimate_of_row]
        shared = (dynamic_global > 0.0) & (dynamic > 0.0)
        ratio = np.zeros(len(rows))
        np.divide(dynamic, dynamic_global, out=ratio, where=shared)
        power = np.zeros(len(rows))
        np.multiply(ratio, rapl[estimate_of_row], out=power, where=shared)
        # Interleave: each estimate's global row, then its targets.
        count = len(tick_of) + len(rows)
        global_at = first_row + np.arange(len(tick_of))
        target_at = np.ones(count, dtype=np.bool_)
        target_at[global_at] = False
        names = [*frame.names, "global"]
        column_target = np.empty(count, dtype=np.int64)
        column_target[global_at] = len(names) - 1
        column_target[target_at] = ticks.target_codes[rows]
        column_power = np.empty(count)
        column_power[global_at] = global_w
        column_power[target_at] = power
        column_ratio = np.empty(count)
        column_ratio[global_at] = 1.0
        column_ratio[target_at] = ratio
        estimate = np.repeat(np.arange(len(tick_of)), size + 1)
        out.emit_frame(
            PowerFrame(
                sensor=formula.sensor,
                millis=ticks.millis[tick_of][estimate],
                targets=column_target,
                target_names=names,
                power=column_power,
                metadata={
                    "scope": Column(
                        np.array(scope, dtype=np.int64)[estimate],
                        [s.name for s in formula.scopes],
                    ),
                    "socket": Column(at_of[estimate], list(ticks.sockets)),
                    "formula": Column(np.array(code, dtype=np.int64)[estimate], self.hashes),
                    "ratio": column_ratio,
                },
            )
        )
        out.emit_frame(FormulaFrame(formula.sensor, FORMULA_KEYS, described))


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


def _bad_counter(event: str, value: float, socket: str, cpu: str) -> str:
    if value < 0:
        return f"negative counter delta {value} for {event} on socket {socket} cpu {cpu}"
    return (
        f"counter delta {value} for {event} on socket {socket} cpu {cpu} is beyond any real "
        f"count: the counter wrapped around"
    )
