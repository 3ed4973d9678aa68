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

One engine, whatever the input: a batch of reports becomes a frame
(:meth:`~wattflow.formats.frames.HWPCFrame.from_reports`), and every frame goes through the same
three steps: tick assembly (:func:`~wattflow.actors.formulas.smartwatts_frames.assemble`: the
arrays of every tick at once, and the reports that cannot be used, with the reason), one model
step per tick, socket and scope (:class:`Estimates`), and report building (a PowerFrame and a
FormulaFrame). A tick whose model step raises is a dead letter with all its reports, naming the
error; the formula goes on with the next tick, from the models as the failed one left them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, ClassVar, Literal, NamedTuple, Self

import numpy as np
from pydantic import (
    AliasChoices,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from wattflow.actors.checkpoints import FormulaState, Saved, decode_state, encode_state
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.power_model import (
    FloatArray,
    FrequencyLayers,
    FrequencyModel,
    ModelState,
    PowerModel,
    Relearning,
    dynamic_power,
    frequency_features,
    load_regression,
)
from wattflow.actors.formulas.rapl import GLOBAL_TARGETS, RAPL_UNIT_J
from wattflow.actors.formulas.smartwatts_frames import (
    MSR_MISSING,
    FrameTicks,
    Timing,
    assemble,
    is_canonical,
)
from wattflow.actors.formulas.window import StreamTime
from wattflow.formats.batch import Batch, hwpc_frame
from wattflow.formats.frames import (
    Column,
    FormulaFrame,
    FormulaRow,
    Frame,
    HWPCFrame,
    IntArray,
    PowerFrame,
)
from wattflow.formats.powerapi import decode_json, encode_json
from wattflow.formats.reports import HWPCReport, Report, to_millis

COMPAT_SMARTWATTS_24 = "smartwatts-2.4"

HWPC = "hwpc"
"""The one source of a sensor's SmartWatts instance: its hwpc-sensor stream."""

SMARTWATTS_BUFFERED_TICKS = 5
"""SmartWatts 2.4.1 processes its oldest tick once more than this many are buffered."""


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


class SmartWattsState(FormulaState, frozen=True, tag=1):
    """What a SmartWatts instance keeps across a restart."""

    formula = "SmartWatts formula"
    also_reads = frozenset({None})  # before states were versioned: the same fields

    compat: bool
    """Whether it was saved in compat mode: the other mode's models and ticks do not fit."""
    last_ms: int | None
    latest_ms: int | None
    arrival: list[int]
    pending: list[str] | None
    """The ticks still pending, as hwpc-sensor's JSON of each of their reports."""
    scopes: dict[str, dict[str, list[ModelState]]]
    """Each scope's models, by socket, one per frequency layer."""


Produced = list[tuple[PowerFrame, FormulaFrame]]
"""What the estimates of some ticks make: a PowerFrame and a FormulaFrame per run of them, in
tick order."""


@formulas.register("smartwatts")
class SmartWattsFormula(Formula[SmartWattsConfig]):
    """One instance per sensor, holding every socket's and scope's models.

    Ticks wait in :attr:`pending` (one frame, in tick order) until they are ripe: once the
    sensor's stream is ``--tick-lateness-ms`` past them, or in compat mode once more than
    :data:`SMARTWATTS_BUFFERED_TICKS` newer ones came.
    """

    name: ClassVar[str] = "smartwatts"
    inputs: ClassVar[frozenset[str]] = frozenset({HWPCReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = SmartWattsConfig
    replayable: ClassVar[bool] = False  # a tick is the unit of failure (Estimates.fail)

    def __init__(self, config: SmartWattsConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.sensor = str(key)
        self.compat = config.compat == COMPAT_SMARTWATTS_24
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
        self._queued: list[HWPCFrame] = []
        """The ticks received and not yet processed (:attr:`pending`), as frames in the order
        of their ticks, each after the ones before it, joined only when needed: a live
        sensor's ticks come one frame each, and each goes on to be estimated as it came, once
        ripe, rather than being joined to the ticks still waiting and cut from them again."""
        self.arrival: list[int] = []
        """Compat mode: the pending ticks (ms) in the order they first came, SmartWatts'
        order of processing them."""
        self.stream = StreamTime(lateness=config.tick_lateness_ms)
        """Where the sensor's stream is, its newest tick (default mode): the ticks
        ``--tick-lateness-ms`` behind it are ripe."""
        self.last_ms: int | None = None
        """The last tick processed (default mode): the next one's interval starts there."""

    @property
    def pending(self) -> HWPCFrame | None:
        """The ticks received and not yet processed, as one frame."""
        queued = self._queued
        if len(queued) > 1:
            self._queued = queued = [_joined(queued)]
        return queued[0] if queued else None

    @pending.setter
    def pending(self, frame: HWPCFrame | None) -> None:
        self._queued = [] if frame is None else [frame]

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
    def frame_parts(cls, frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
        return [(sensor, frame.of_sensor(sensor)) for sensor in frame.sensors()]

    def process(self, reports: Batch, out: Output) -> None:
        arrival: list[int] | None = None  # the ticks' order, where reports made the frame

        def of_reports(batch: list[Report]) -> HWPCFrame | None:
            nonlocal arrival
            made, arrival = self._frame_of(batch, out)
            return made

        frame = hwpc_frame(reports, of_reports, as_it_is=is_canonical)
        if frame is not None:
            self._take(frame, arrival, out)
        self._emit(self._ripe(out, final=False), out)

    def flush(self, out: Output) -> None:
        """Process every pending tick: at shutdown nothing waits for later reports any more."""
        self._emit(self._ripe(out, final=True), out)

    # --- checkpoints -------------------------------------------------------------------------

    def state(self) -> Saved:
        """Every scope's and socket's models with their windows, where the sensor's stream
        stands, and the ticks still pending (as hwpc-sensor's JSON: at most the lateness
        window, or SmartWatts' buffered ticks in compat mode)."""
        pending = None if self.pending is None else self.pending.reports()
        return encode_state(
            SmartWattsState(
                compat=self.compat,
                last_ms=self.last_ms,
                latest_ms=self.stream.newest_ms(HWPC),
                arrival=self.arrival,
                pending=None if pending is None else [encode_json(r) for r in pending],
                scopes={
                    scope.name: {socket: layers.state() for socket, layers in scope.layers.items()}
                    for scope in self.scopes
                },
            )
        )

    def restore(self, state: Saved) -> None:
        """Take back what :meth:`state` gave: all of it, or (a ``ValueError``) none of it."""
        saved = decode_state(state, SmartWattsState)
        if saved.compat != self.compat:
            raise ValueError("SmartWatts formula state saved in the other mode (--compat)")
        pending = None
        if saved.pending:
            reports = [decode_json(HWPCReport, text, "saved state", None) for text in saved.pending]
            frame, _ = HWPCFrame.from_reports([r for r in reports if isinstance(r, HWPCReport)])
            pending = frame if frame.count else None
        layers = {
            scope.name: {
                socket: self._new_layers(scope, models)
                for socket, models in saved.scopes.get(scope.name, {}).items()
            }
            for scope in self.scopes
        }
        self.last_ms = saved.last_ms
        if saved.latest_ms is not None:
            self.stream.observe(HWPC, saved.latest_ms, 0.0)
        self.arrival = saved.arrival
        self.pending = pending
        for scope in self.scopes:
            scope.layers = layers[scope.name]

    # --- the way in: reports into frames, frames into the pending ticks ---------------------

    def _frame_of(
        self, reports: Sequence[Report], out: Output
    ) -> tuple[HWPCFrame | None, list[int]]:
        """A frame of reports, in tick order, and the ticks (ms) in the order they first came.

        A second report of a target (or a second global report) in a tick replaces the first,
        which becomes a dead letter; so does a report the frame cannot hold.
        """
        kept: dict[tuple[int, str], HWPCReport] = {}
        for report in reports:
            assert isinstance(report, HWPCReport)
            is_global = report.target in GLOBAL_TARGETS
            key = (to_millis(report.timestamp), "" if is_global else report.target)
            earlier = kept.get(key)
            if earlier is not None:
                what = "global report of its tick" if is_global else "report of its target and tick"
                out.reject(earlier, f"replaced by a later {what}")
            kept[key] = report
        ordered = sorted(kept.items(), key=lambda item: item[0][0])
        frame, refused = HWPCFrame.from_reports([report for _, report in ordered])
        for report in refused:
            out.reject(report, _refusal(report))
        arrival = list(dict.fromkeys(millis for millis, _ in kept))
        return (frame if frame.count else None), arrival

    def _take(self, frame: HWPCFrame, arrival: list[int] | None, out: Output) -> None:
        """Add a frame's ticks to the pending ones; in the default mode, a report of a tick
        already processed is a dead letter."""
        if not self.compat:
            later = self._not_late(frame, out)
            if later is None:
                return
            frame = later
        else:
            known = set(self.arrival)
            ticks = arrival if arrival is not None else _ticks(frame).tolist()
            self.arrival.extend(tick for tick in ticks if tick not in known)
        if not self.compat and self._queued and _follows(self._queued, frame):
            self._queued.append(frame)  # joined as pending would be, once that is needed
            return
        self.pending = frame if self.pending is None else self._merged(self.pending, frame, out)

    def _not_late(self, frame: HWPCFrame, out: Output) -> HWPCFrame | None:
        """Default mode: the frame's ticks after the last one processed (``None`` if none),
        the others dead letters; where the sensor's stream is moves to its newest tick."""
        if self.last_ms is not None:
            late, later = frame.after(self.last_ms)
            if late is not None:
                self._late(late, out)
            if later is None:
                return None
            frame = later
        newest = _last_ms(frame)
        self.stream.observe(HWPC, newest, 0.0)
        return frame

    def _late(self, frame: HWPCFrame, out: Output) -> None:
        lateness = self.config.tick_lateness_ms
        assert self.last_ms is not None
        for report in frame.reports():
            late_ms = self.last_ms - to_millis(report.timestamp)
            out.reject(
                report,
                f"arrived after its tick was processed (the sensor's stream had moved "
                f"{late_ms + lateness:.0f} ms past it; raise --tick-lateness-ms above "
                f"{lateness} ms to wait longer)",
            )

    def _merged(self, pending: HWPCFrame, frame: HWPCFrame, out: Output) -> HWPCFrame:
        """The pending ticks and a frame's: joined when the frame starts after them (or in
        their last tick, with other targets), else made again from both frames' reports."""
        last = _last_ms(pending)
        first = min(int(t.millis[0]) for t in frame.tables if len(t))
        if first > last or (first == last and not _reports_in_both(pending, frame, last)):
            try:
                return pending.joined(frame)
            except ValueError:  # a group with other events: the reports make one frame
                pass
        merged, _ = self._frame_of([*pending.reports(), *frame.reports()], out)
        assert merged is not None
        return merged

    # --- ripe ticks: assembled, stepped through, reported --------------------------------

    def _ripe(self, out: Output, *, final: bool) -> Produced:
        """Process the ticks that are ripe (all of them when ``final``)."""
        if not self._queued:
            return []
        if not self.compat:
            ripe = self._ripe_queued(None if final else self.stream.horizon())
            return self._estimate(ripe, out) if ripe is not None else []
        produced: Produced = []
        keep = 0 if final else SMARTWATTS_BUFFERED_TICKS
        while len(self.arrival) > keep and self.pending is not None:
            produced += self._estimate(self._next_compat(len(self.arrival) - keep), out)
        return produced

    def _ripe_queued(self, horizon: int | None) -> HWPCFrame | None:
        """The pending ticks up to ``horizon`` (all of them for ``None``), taken off the
        pending ones: the frames that end by it whole, as they came; a frame with ticks on
        both sides of it makes the pending ticks one frame, cut at the horizon."""
        queued = self._queued
        if horizon is None:
            ripe, self.pending = self.pending, None
            return ripe
        whole = 0
        while whole < len(queued) and _last_ms(queued[whole]) <= horizon:
            whole += 1
        if whole < len(queued) and _first_ms(queued[whole]) <= horizon:
            pending = self.pending
            assert pending is not None
            ripe, self.pending = pending.after(horizon)
            return ripe
        self._queued = queued[whole:]
        return _joined(queued[:whole]) if whole else None

    def _next_compat(self, count: int) -> HWPCFrame:
        """The next ``count`` ticks in the order they came, taken from the pending ones: at
        once when that is also their order in time, else the first one alone."""
        pending = self.pending
        assert pending is not None
        ticks, rest = self.arrival[:count], self.arrival[count:]
        if ticks == sorted(ticks) and (not rest or ticks[-1] < min(rest)):
            ripe, self.pending = pending.after(ticks[-1])
            del self.arrival[:count]
        else:
            first = np.array(self.arrival[:1], dtype=np.int64)
            ripe, self.pending = pending.of_ticks(first), pending.of_ticks(first, invert=True)
            del self.arrival[0]
        assert ripe is not None
        return ripe

    def _estimate(self, frame: HWPCFrame, out: Output) -> Produced:
        """Assemble a frame's ticks, step the models through them and build their reports.

        A tick whose model step raises is a dead letter with its reports (:class:`Estimates`);
        an error outside the model steps makes the whole frame one.
        """
        mark = out.mark()
        try:
            timing = Timing(
                previous_ms=self.last_ms,
                period_ms=self.config.sensor_reports_frequency,
                compat=self.compat,
                lateness_ms=self.config.tick_lateness_ms,
                base_frequency=self.base_frequency,
            )
            assembly = assemble(frame, timing)
            if not self.compat:
                self.last_ms = assembly.last_ms
            _reject(frame, assembly.rejected, out)
            out.absorb(assembly.absorbed)
            if assembly.ticks is None:
                return []
            rejected = {(tick, frame.names[code]) for tick, code, _ in assembly.rejected}
            return Estimates(self, assembly.ticks).run(frame, out, rejected)
        except Exception as error:  # outside any tick's model step: the frame is the unit
            out.fail(frame.reports(), error, unit="frame", since=mark)
            return []

    def _emit(self, produced: Produced, out: Output) -> None:
        """Hand the frames on; PowerFrames that carry their input reports' metadata as their
        reports (the outputs write frames a column at a time), and then all of them, to keep
        the order of ticks."""
        as_reports = any(power.report_metadata is not None for power, _ in produced)
        for power, formula in produced:
            if as_reports:
                out.emit_all(power.reports())
            else:
                out.emit_frame(power)
            out.emit_frame(formula)

    def layers(self, scope: Scope, socket: str) -> FrequencyLayers:
        """The models of one scope and socket, created on first use."""
        layers = scope.layers.get(socket)
        if layers is None:
            layers = scope.layers[socket] = self._new_layers(scope)
        return layers

    def _new_layers(self, scope: Scope, saved: Sequence[ModelState] = ()) -> FrequencyLayers:
        """A scope's models of one socket: none yet, or those a checkpoint ``saved``."""
        config = self.config
        layers = FrequencyLayers(
            base_clock=config.cpu_base_clock,
            min_samples=config.learn_min_samples_required,
            history_window=config.learn_history_window_size,
            error_window=config.learn_error_window_size,
            compat=self.compat,
            base_mhz=self.base_frequency,
            frequency_terms=scope.frequency_terms,
        )
        layers.restore(saved)
        return layers


def _refusal(report: HWPCReport) -> str:
    """Why a frame cannot hold a report (see :meth:`HWPCFrame.from_reports`)."""
    if report.target in GLOBAL_TARGETS and not report.groups:
        return MSR_MISSING
    if not report.groups:
        return f"target report without a 'core' group (it has {sorted(report.groups)})"
    if any(cpus for sockets in report.groups.values() for cpus in sockets.values()):
        return "socket or cpu ids that are not plain numbers (such as '0')"
    return "no counters: its sockets have no cpus"


def _ticks(frame: HWPCFrame) -> IntArray:
    ticks: IntArray = np.unique(np.concatenate([t.millis for t in frame.tables]))
    return ticks


def _last_ms(frame: HWPCFrame) -> int:
    return max(int(t.millis[-1]) for t in frame.tables if len(t))


def _first_ms(frame: HWPCFrame) -> int:
    return min(int(t.millis[0]) for t in frame.tables if len(t))


def _follows(queued: list[HWPCFrame], frame: HWPCFrame) -> bool:
    """Whether a frame's ticks all come after the queued frames' (as a live sensor's next
    tick does) and its groups have the events the queued frames give them: joining it to
    them then is what :meth:`SmartWattsFormula._merged` would do, and cannot fail."""
    if _first_ms(frame) <= _last_ms(queued[-1]):
        return False
    events = {t.group: t.events for queued_frame in queued for t in queued_frame.tables}
    return all(events.get(t.group, t.events) == t.events for t in frame.tables)


def _joined(frames: list[HWPCFrame]) -> HWPCFrame:
    """Frames one after another (see :func:`_follows`) as one."""
    joined = frames[0]
    for frame in frames[1:]:
        joined = joined.joined(frame)
    return joined


def _reports_in_both(first: HWPCFrame, later: HWPCFrame, millis: int) -> bool:
    """Whether both frames hold a report of the same target (or a global report) at ``millis``."""

    def targets(frame: HWPCFrame) -> set[str]:
        seen = np.zeros(len(frame.names), dtype=np.bool_)
        for table in frame.tables:
            seen[table.targets[table.millis == millis]] = True
        names = frame.names
        codes = seen.nonzero()[0].tolist()
        return {"" if (n := names[c]) in GLOBAL_TARGETS else n for c in codes}

    return bool(targets(first) & targets(later))


def _reject(frame: HWPCFrame, rejected: list[tuple[int, int, str]], out: Output) -> None:
    """Dead-letter the reports assembly found unusable, with their reasons, in its order."""
    if not rejected:
        return
    millis = np.array([r[0] for r in rejected], dtype=np.int64)
    targets = np.array([r[1] for r in rejected], dtype=np.int64)
    found = {
        (to_millis(report.timestamp), report.target): report
        for report in frame.of_reports(millis, targets).reports()
    }
    for tick, target, reason in rejected:
        out.reject(found[(tick, frame.names[target])], reason)


# --- one model step per tick, socket and scope; then the reports -------------------------


class Estimate(NamedTuple):
    """One model step: what its reports are built from."""

    tick: int
    """The tick's place in the :class:`FrameTicks`."""
    socket_at: int
    """The socket's place in :attr:`FrameTicks.sockets`."""
    scope_at: int
    """The scope's place in the formula's scopes."""
    coef_code: int
    """The predicting model's coefficients: their place in their scope's
    :attr:`Estimates.coefs`."""
    rapl_power_w: float
    hash_code: int
    """The predicting model's hash: its place in :attr:`Estimates.hashes`."""
    intercept_w: float
    """The predicting model's intercept (compat mode adds each target's share of it)."""
    global_dynamic_w: float
    """The prediction of the global features without the intercept."""
    global_power_w: float
    """The same with the intercept: the ``global`` report's power."""


PREDICTED_AHEAD = 64
"""Ticks of a frame whose global power a model predicts at once."""

RUN_AT_LEAST = 8
"""Ticks a run of model steps takes at least (:meth:`Estimates._run`): fewer, as a live
sensor's one tick per frame, go one by one, which costs less for so few."""


class CoefPower(NamedTuple):
    """What one model's coefficients predict for a socket's global features, tick by tick."""

    coef_code: int
    first: int
    """The tick the predictions start at."""
    dynamic_w: list[float]
    """Without the intercept, one per tick from ``first`` on."""


class RunOfSteps(NamedTuple):
    """Ticks that one model steps through at once (:meth:`Estimates._run`), and their global
    power: measured, predicted without the intercept, and with it."""

    ticks: list[int]
    rapl_power_w: list[float]
    dynamic_w: list[float]
    global_power_w: list[float]


@dataclass(slots=True, eq=False)
class ScopeSteps:
    """What the model steps of one socket and scope read, over a frame's ticks."""

    socket_at: int
    scope_at: int
    scope: Scope
    layers: FrequencyLayers
    rapl_power_w: list[float]
    """The measured power of each tick (NaN where the global report has none)."""
    features: FloatArray
    """(ticks, events): the global features (rates per second, raw counts in compat mode)."""
    feature_rows: list[list[float]]
    """The same rows as lists, as the models store them."""
    package_frequency_mhz: list[int]
    layer_mhz: list[int]
    """The frequency layer of each tick."""
    coef_power: dict[int, CoefPower] = field(default_factory=dict)
    """By ``id`` of the coefficients (kept alive in :attr:`Estimates.coefs`)."""


class EstimateLists(NamedTuple):
    """A frame's estimates (:class:`Estimate`) as they are made, a list per field: a run of
    steps extends each at C speed (:meth:`Estimates._keep_run`)."""

    tick: list[int]
    socket_at: list[int]
    scope_at: list[int]
    coef_code: list[int]
    rapl_power_w: list[float]
    hash_code: list[int]
    intercept_w: list[float]
    global_dynamic_w: list[float]
    global_power_w: list[float]

    def every(self) -> tuple[list[Any], ...]:
        """The lists, in :class:`Estimate`'s order of fields."""
        return tuple(self)


class DescribedLists(NamedTuple):
    """Each estimate's FormulaReport, a list per value, entry for entry with
    :class:`EstimateLists`: its rows are made only if an output or the status asks for them
    (:class:`FormulaFrame`), which most deployments never do."""

    millis: list[int]
    target: list[str]
    """The model's hash."""
    scope: list[str]
    socket: list[str]
    layer_frequency: list[int]
    pkg_frequency: list[int]
    samples: list[int]
    id: list[int]
    error: list[float]
    intercept: list[float]
    coef: list[Any]

    def every(self) -> tuple[list[Any], ...]:
        """The lists, in order: timestamp, target, then :data:`FORMULA_KEYS`' values."""
        return tuple(self)

    def rows_later(self, order: list[int]) -> tuple[int, Callable[[], list[FormulaRow]]]:
        """How many rows, and what makes them in ``order`` (a :class:`FormulaFrame`'s
        ``later``)."""

        def rows() -> list[FormulaRow]:
            millis, target, *values = (list(map(column.__getitem__, order)) for column in self)
            return list(zip(millis, target, zip(*values, strict=True), strict=True))

        return len(order), rows


class EstimateColumns(NamedTuple):
    """A frame's estimates (:class:`Estimate`) in report order, as columns."""

    tick: IntArray
    socket_at: IntArray
    scope_at: IntArray
    coef_code: IntArray
    rapl_power_w: FloatArray
    hash_code: IntArray
    intercept_w: FloatArray
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


class Estimates:
    """The model steps of assembled ticks, then their reports as frames.

    Each socket and scope has its own models, so their ticks are stepped through one (socket,
    scope) at a time; the estimates are then put back in the order of ticks, sockets and scopes.
    """

    def __init__(self, formula: SmartWattsFormula, ticks: FrameTicks) -> None:
        self.formula = formula
        self.ticks = ticks
        self.compat = formula.compat
        # The global features: rates per second, or SmartWatts' raw counts in compat mode.
        self.rates = ticks.global_counts
        if not self.compat:
            self.rates = ticks.global_counts / ticks.interval_s[:, None, None]
        base_clock = formula.config.cpu_base_clock
        self.layers = (np.clip(ticks.frequency // base_clock, 1, 100) * base_clock).tolist()
        self.frequency = ticks.frequency.tolist()
        self.filled = (ticks.block_stop > ticks.block_start).T.tolist()
        self.millis = ticks.millis.tolist()
        self.done = EstimateLists([], [], [], [], [], [], [], [], [])
        self.coefs: list[list[FloatArray]] = [[] for _ in formula.scopes]
        """The coefficients the estimates of each scope used, each model's once."""
        self.hashes: list[str] = []
        self.hash_codes: dict[str, int] = {}
        self.described = DescribedLists([], [], [], [], [], [], [], [], [], [], [])
        """Each estimate's FormulaReport, entry for entry with ``done``."""
        self.failed: dict[int, BaseException] = {}
        """The ticks whose model step raised, and the error: each is a dead letter whole."""

    def run(self, frame: HWPCFrame, out: Output, rejected: set[tuple[int, str]]) -> Produced:
        """Step every socket and scope through the ticks; absorb the reports of the ticks that
        got no estimate, dead-letter those whose step raised; the estimates' frames."""
        ticks = self.ticks
        for socket_at in range(len(ticks.sockets)):
            for scope_at, scope in enumerate(self.formula.scopes):
                energy = ticks.energy.get(scope.rapl_event)
                if energy is not None:
                    self.steps(socket_at, scope_at, scope, energy[:, socket_at] * RAPL_UNIT_J)
        failed = self.drop_failed()
        estimated = np.zeros(len(self.millis), dtype=np.bool_)
        estimated[self.done.tick] = True
        estimated[failed] = True
        out.absorb(int((1 + ticks.targets)[~estimated].sum()))
        produced = self.frames(frame)
        if failed:
            self.reject_failed(frame, out, rejected)
        return produced

    def steps(self, socket_at: int, scope_at: int, scope: Scope, energy_j: FloatArray) -> None:
        """One socket and scope's model steps, tick after tick; the targets' shares are left
        for :meth:`frames`."""
        layers = self.formula.layers(scope, self.ticks.sockets[socket_at])
        features = layers.features(self.rates[:, socket_at, :], self.ticks.frequency[:, socket_at])
        steps = ScopeSteps(
            socket_at=socket_at,
            scope_at=scope_at,
            scope=scope,
            layers=layers,
            rapl_power_w=(energy_j / self.ticks.interval_s).tolist(),
            features=features,
            feature_rows=features.tolist(),
            package_frequency_mhz=[row[socket_at] for row in self.frequency],
            layer_mhz=[row[socket_at] for row in self.layers],
        )
        filled = self.filled[socket_at]
        tick = 0
        ticks = len(steps.rapl_power_w)
        while tick < ticks:
            rapl_power_w = steps.rapl_power_w[tick]
            if filled[tick] and rapl_power_w == rapl_power_w:  # targets, and energy
                try:
                    after = self._run(steps, tick)
                    if after > tick:
                        tick = after
                        continue
                    self._step(steps, tick)
                except Exception as failure:
                    self.fail(tick, failure)
            tick += 1

    def _run(self, steps: ScopeSteps, tick: int) -> int:
        """The model steps from ``tick`` on that leave the model as it is, all at once
        (:meth:`FrequencyModel.track_run`), when at least :data:`RUN_AT_LEAST` ticks can go;
        the tick after the last one done (``tick`` when none was: :meth:`_step` takes it)."""
        if self.compat or len(steps.rapl_power_w) - tick < RUN_AT_LEAST:  # a live tick
            return tick
        model = steps.layers.model(steps.layer_mhz[tick])
        model.use_events(self.ticks.events)
        if not isinstance(model, FrequencyModel) or not model.fitted:
            return tick
        coef_power = self._coef_power(steps, model, tick)
        first = coef_power.first
        rapl_power_w = steps.rapl_power_w
        chosen = self._steppable(steps, tick, first + len(coef_power.dynamic_w))
        if len(chosen) < RUN_AT_LEAST:
            return tick
        intercept_w = model.intercept
        dynamic_w = [coef_power.dynamic_w[at - first] for at in chosen]
        run = RunOfSteps(
            chosen,
            [rapl_power_w[at] for at in chosen],
            dynamic_w,
            [dynamic + intercept_w for dynamic in dynamic_w],
        )
        samples = len(model.samples)
        errors_w = model.track_run(
            run.rapl_power_w, [steps.feature_rows[at] for at in chosen], run.global_power_w,
            steps.scope.relearning,
        )  # fmt: skip
        if not errors_w:
            return tick
        self._keep_run(steps, model, (coef_power.coef_code, samples), run, errors_w)
        return chosen[len(errors_w) - 1] + 1

    def _steppable(self, steps: ScopeSteps, start: int, stop: int) -> list[int]:
        """The ticks from ``start`` to ``stop`` that get a model step: those with targets and
        energy (the others are skipped, as :meth:`steps` does)."""
        filled = self.filled[steps.socket_at]
        rapl_power_w = steps.rapl_power_w
        return [
            at for at in range(start, stop) if filled[at] and rapl_power_w[at] == rapl_power_w[at]
        ]

    def _keep_run(
        self,
        steps: ScopeSteps,
        model: PowerModel,
        codes: tuple[int, int],
        run: RunOfSteps,
        errors_w: list[float],
    ) -> None:
        """The estimates and FormulaReports of the first ``len(errors_w)`` steps of a run, as
        :meth:`_step` keeps each (built by ``map`` and ``zip``, at C speed); ``codes``: the
        coefficients' code and how many samples the model held before the run."""
        coef_code, samples = codes
        taken = len(errors_w)
        ticks = run.ticks[:taken]
        socket_at, scope_at = steps.socket_at, steps.scope_at
        intercept_w = model.intercept
        columns: tuple[Iterable[Any], ...] = (
            ticks, repeat(socket_at, taken), repeat(scope_at, taken), repeat(coef_code, taken),
            run.rapl_power_w[:taken], repeat(self._hash_code(model.hash), taken),
            repeat(intercept_w, taken), run.dynamic_w[:taken], run.global_power_w[:taken],
        )  # fmt: skip
        for kept, values in zip(self.done.every(), columns, strict=True):
            kept.extend(values)
        window = model.samples.maxlen or 0
        held = list(range(samples + 1, min(samples + taken, window) + 1))
        held += [window] * (taken - len(held))  # the window full
        described: tuple[Iterable[Any], ...] = (
            map(self.millis.__getitem__, ticks), repeat(model.hash, taken),
            repeat(steps.scope.name, taken), repeat(self.ticks.sockets[socket_at], taken),
            map(steps.layer_mhz.__getitem__, ticks),
            map(steps.package_frequency_mhz.__getitem__, ticks),
            held, repeat(model.id, taken), errors_w, repeat(intercept_w, taken),
            repeat(model.coef, taken),
        )  # fmt: skip
        for kept, made in zip(self.described.every(), described, strict=True):
            kept.extend(made)

    def _step(self, steps: ScopeSteps, tick: int) -> None:
        """One tick's model step: learn, predict, relearn, and keep the estimate. In compat
        mode the tick that learns the model gets no estimate, as in SmartWatts."""
        layer = steps.layer_mhz[tick]
        model = steps.layers.model(layer)
        model.use_events(self.ticks.events)
        rapl_power_w = steps.rapl_power_w[tick]
        features = steps.feature_rows[tick]
        relearning = steps.scope.relearning
        stored = not model.fitted
        if stored and (
            not model.first_fit(rapl_power_w, features, relearning.max_intercept_w) or self.compat
        ):
            return
        coef_power = self._coef_power(steps, model, tick)
        global_dynamic_w = coef_power.dynamic_w[tick - coef_power.first]
        intercept_w = model.intercept
        global_power_w = global_dynamic_w + intercept_w
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
        estimate = Estimate(
            tick,
            steps.socket_at,
            steps.scope_at,
            coef_power.coef_code,
            rapl_power_w,
            hash_code,
            intercept_w,
            global_dynamic_w,
            global_power_w,
        )
        # Both at once, once nothing can raise: they stay entry for entry.
        for kept, value in zip(self.done.every(), estimate, strict=True):
            kept.append(value)
        for kept, value in zip(
            self.described.every(), (self.millis[tick], model.hash, *description), strict=True
        ):
            kept.append(value)

    def _coef_power(self, steps: ScopeSteps, model: PowerModel, tick: int) -> CoefPower:
        """What the model's coefficients predict for ``tick`` and the ticks after it, up to
        :data:`PREDICTED_AHEAD` of them, computed once per model and stretch of ticks (the
        default mode's model is refined every few ticks)."""
        coef = model.coef
        assert coef is not None
        known = steps.coef_power.get(id(coef))
        if known is None or tick - known.first >= len(known.dynamic_w):
            coefs = self.coefs[steps.scope_at]
            code = len(coefs) if known is None else known.coef_code
            stop = tick + PREDICTED_AHEAD
            dynamic_w = dynamic_power(steps.features[tick:stop], coef).tolist()
            known = steps.coef_power[id(coef)] = CoefPower(code, tick, dynamic_w)
            if code == len(coefs):
                coefs.append(coef)
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
        those after it skip the tick; the estimates it got are dropped (:meth:`drop_failed`).
        """
        self.failed[tick] = error
        for filled in self.filled:
            filled[tick] = False

    def drop_failed(self) -> list[int]:
        """Forget the estimates of the ticks that failed; return those ticks."""
        failed = self.failed
        if failed:
            kept = [at for at, tick in enumerate(self.done.tick) if tick not in failed]
            self.done = EstimateLists._make([column[at] for at in kept] for column in self.done)
            self.described = DescribedLists._make(
                [column[at] for at in kept] for column in self.described
            )
        return sorted(failed)

    def reject_failed(self, frame: HWPCFrame, out: Output, rejected: set[tuple[int, str]]) -> None:
        """Dead-letter the reports of each tick that failed, naming its error; a report
        assembly already rejected (``rejected``: tick ms and target) stays that dead letter."""
        errors = {self.millis[tick]: error for tick, error in sorted(self.failed.items())}
        reports: dict[int, list[Report]] = {millis: [] for millis in errors}
        for report in frame.of_ticks(np.array(list(errors), dtype=np.int64)).reports():
            key = (to_millis(report.timestamp), report.target)
            if key not in rejected:
                reports[key[0]].append(report)
        for millis, error in errors.items():
            out.fail(reports[millis], error, unit="tick")

    def frames(self, frame: HWPCFrame) -> Produced:
        """Every estimate's global and target PowerReports, in the order of ticks, sockets and
        scopes (the global report, then the targets), and its FormulaReport."""
        done = self.done
        if not done.tick:
            return []
        made = EstimateColumns(*map(np.array, done))
        order = np.lexsort((made.scope_at, made.socket_at, made.tick))  # tick, socket, scope
        columns = EstimateColumns(*(column[order] for column in made))
        described = self.described.rows_later(order.tolist())
        return [
            (
                self._power_frame(frame, columns, self._shares(columns)),
                FormulaFrame(self.formula.sensor, FORMULA_KEYS, later=described),
            )
        ]

    def _shares(self, columns: EstimateColumns) -> TargetShares:
        """Each estimate's targets: their rows and their shares of the estimate's power (the
        measured power; in compat mode, SmartWatts' predicted one)."""
        ticks = self.ticks
        start = ticks.block_start[columns.tick, columns.socket_at]
        sizes = ticks.block_stop[columns.tick, columns.socket_at] - start
        estimate = np.repeat(np.arange(len(columns.tick)), sizes)
        first_row = np.cumsum(sizes) - sizes
        rows = start[estimate] + (np.arange(len(estimate)) - first_row[estimate])
        rates = ticks.counts[rows]
        if not self.compat:
            rates = rates / ticks.interval_s[columns.tick[estimate]][:, None]
        dynamic = np.empty(len(rows))
        scope_of = columns.scope_at[estimate]
        for scope_at, scope in enumerate(self.formula.scopes):
            mine = scope_of == scope_at
            if not mine.any():
                continue
            features = rates[mine]
            if scope.frequency_terms and not self.compat:
                frequency = ticks.frequency[
                    columns.tick[estimate][mine], columns.socket_at[estimate][mine]
                ]
                features = frequency_features(features, frequency, self.formula.base_frequency)
            coef = np.array(self.coefs[scope_at])[columns.coef_code[estimate][mine]]
            dynamic[mine] = dynamic_power(features, coef)
        dynamic_global = columns.global_dynamic_w[estimate]
        shared = (dynamic_global > 0.0) & (dynamic > 0.0)
        ratio = np.zeros(len(rows))
        np.divide(dynamic, dynamic_global, out=ratio, where=shared)
        power_w = np.zeros(len(rows))
        if self.compat:  # SmartWatts shares its predicted global power
            power_w[shared] = (
                dynamic[shared] + ratio[shared] * columns.intercept_w[estimate][shared]
            )
        else:
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
        millis = ticks.millis[columns.tick][estimate]
        formula = self.formula
        inputs = column_target.copy()
        inputs[global_at] = ticks.global_codes[columns.tick]
        return PowerFrame(
            sensor=formula.sensor,
            millis=millis,
            targets=column_target,
            target_names=names,
            power=column_power,
            metadata={
                "scope": Column(columns.scope_at[estimate], [s.name for s in formula.scopes]),
                "socket": Column(columns.socket_at[estimate], list(ticks.sockets)),
                "formula": Column(columns.hash_code[estimate], self.hashes),
                "ratio": column_ratio,
            },
            report_metadata=frame.report_metadata(formula.sensor, millis, inputs),
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
    step left it, and that step's frequency layer, package frequency and error. The
    coefficients stay an array, which the report writes as SmartWatts does (numpy's text of
    it), formatted only if a FormulaReport is built (:class:`FormulaFrame`)."""
    return (
        scope,
        socket,
        layer_mhz,
        package_frequency_mhz,
        len(model.samples),
        model.id,
        error_w,
        model.intercept,
        model.coef,
    )
