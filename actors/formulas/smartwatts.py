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
    a tick is processed once the sensor's stream is ``--tick-lateness`` past it, and a tick whose
    global report never came is dead-lettered rather than dropped in silence; the targets' powers
    add up to the measured RAPL power, not to the model's guess of it; and the tick on which the
    model is first learned already gets estimates.

Counters that cannot be real (negative deltas, deltas beyond any count a cpu can make in an
interval: a counter that wrapped around) make their report a dead letter with that reason; a bad
global report takes its tick's target reports with it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain
from operator import itemgetter
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.power_model import (
    ErrorMethod,
    FloatArray,
    FrequencyLayers,
    warm_up,
)
from wattflow.actors.formulas.rapl import GLOBAL_TARGETS, RAPL_UNIT_J, rapl_groups
from wattflow.formats.reports import (
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
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
    cpu_tdp: PositiveInt = Field(
        default=400, description="TDP in W; a model whose intercept is not under it is discarded."
    )
    cpu_base_clock: PositiveInt = Field(
        default=100, description="Base clock in MHz: the width of a frequency layer."
    )
    cpu_base_freq: PositiveInt = Field(
        default=2100, description="Base (nominal) frequency in MHz, which MPERF counts at."
    )
    cpu_error_threshold: PositiveFloat = Field(
        default=2.0, description="Error in W over which the cpu models are relearned."
    )
    dram_error_threshold: PositiveFloat = Field(
        default=2.0, description="Error in W over which the dram models are relearned."
    )
    sensor_reports_frequency: PositiveInt = Field(
        default=1000,
        description="Period of hwpc-sensor's reports in ms.",
        json_schema_extra={"flags": ["--sensor-reports-frequency"]},
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
    tick_lateness: NonNegativeInt = Field(
        default=2000,
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
        warm_up(self.compat)
        self.ticks: dict[datetime, Tick] = {}
        self.latest: datetime | None = None
        self.last_tick: datetime | None = None
        self._layouts: dict[tuple[str, ...], Layout] = {}

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if isinstance(report, HWPCReport):
            return report.sensor
        return None

    def process(self, reports: list[Report], out: Output) -> None:
        for report in reports:
            assert isinstance(report, HWPCReport)
            self._receive(report, out)
            if self.compat:
                while len(self.ticks) > SMARTWATTS_BUFFERED_TICKS:
                    oldest = next(iter(self.ticks))
                    self._process_tick(self.ticks.pop(oldest), out)
        if not self.compat and self.latest is not None:
            horizon = self.latest.timestamp() - self.config.tick_lateness / 1000.0
            ripe = sorted(t for t in self.ticks if t.timestamp() <= horizon)
            for timestamp in ripe:
                self._process_tick(self.ticks.pop(timestamp), out)

    def flush(self, out: Output) -> None:
        """Process every buffered tick: at shutdown nothing waits for later reports any more."""
        order = list(self.ticks) if self.compat else sorted(self.ticks)
        for timestamp in order:
            self._process_tick(self.ticks.pop(timestamp), out)

    def _receive(self, report: HWPCReport, out: Output) -> None:
        timestamp = report.timestamp
        if not self.compat and self.last_tick is not None and timestamp <= self.last_tick:
            late_ms = (self.last_tick - timestamp).total_seconds() * 1000
            out.reject(
                report,
                f"arrived after its tick was processed (the sensor's stream had moved "
                f"{late_ms + self.config.tick_lateness:.0f} ms past it; raise --tick-lateness "
                f"above {self.config.tick_lateness} ms to wait longer)",
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
            wait = "" if self.compat else f" within --tick-lateness {self.config.tick_lateness} ms"
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
        layers = scope.layers.get(socket)
        if layers is None:
            layers = scope.layers[socket] = FrequencyLayers(
                base_clock=config.cpu_base_clock,
                min_samples=config.learn_min_samples_required,
                history_window=config.learn_history_window_size,
                error_window=config.learn_error_window_size,
                compat=self.compat,
            )
        model = layers.model(package_frequency)
        model.use_events(events)
        global_features = matrix[0].tolist()
        stored = False
        if not model.fitted:
            model.store(rapl_w, global_features)
            stored = True
            learned = model.learn(config.cpu_tdp)
            model.errors.clear()
            if self.compat or not learned:
                return False
        assert model.coef is not None
        dynamic = (matrix @ model.coef).tolist()  # the intercept cancels out of every share
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


def _bad_counter(event: str, value: float, socket: str, cpu: str) -> str:
    if value < 0:
        return f"negative counter delta {value} for {event} on socket {socket} cpu {cpu}"
    return (
        f"counter delta {value} for {event} on socket {socket} cpu {cpu} is beyond any real "
        f"count: the counter wrapped around"
    )
