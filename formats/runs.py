"""Measurement runs, and what every exporter computes from one: energy per target, phase and domain.

A run is one measured execution of a benchmark: its experiment, benchmark, settings (clock or
power limits, as text), repetition, free parameters (numbers, for Extra-P's models), system
info, time window and event markers. Its reports are the ones whose timestamps fall in the
window; the store hands them out in time order, a page at a time, so an exporter's memory does
not grow with the run's length.

:func:`summarise` folds a run's PowerReports into energy per (target, phase, domain): a report's
power holds from the previous report of the same series (target, scope, socket or device) to
its own timestamp. Phases come from the run's events: ``train_begin``/``train_end`` open and
close phase ``train``, ``epoch_begin``/``epoch_end`` phase ``epoch``, and so on; a report
belongs to the innermost phase open at its timestamp, or to no phase (``""``). A phase's time
is counted the same way, so its mean power is its own energy over its own time.

Exporters read a run through :class:`RunData`, each only the kinds and fields it needs: the
power series as compact rows (:meth:`RunData.power`: time, series, watts), the order of every
report with its processing time (:meth:`RunData.timeline`, for ROSS), or whole reports of some
kinds (:meth:`RunData.reports`, for the GPU directory). The run store answers each from its own
table; :class:`ReportLists` answers them from reports held in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice, pairwise
from typing import Any, Generic, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from wattflow.formats.reports import EventReport, GPUReport, PowerReport, Report, to_micros

DOMAINS = ("cpu", "dram", "gpu", "node")
"""Energy domains exporters report, from PowerReports' ``scope``."""


class Run(BaseModel):
    """One measured execution: what it was, when, and under which settings."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Unique in its store.")
    experiment: str
    benchmark: str
    settings: str = Field(description="E.g. '877MHz,1065MHz', '250W' or 'p=4'.")
    repetition: int = Field(ge=0)
    parameters: dict[str, float] = Field(
        default_factory=dict, description="Free parameters (name → number), for Extra-P."
    )
    system: dict[str, Any] = Field(default_factory=dict, description="System info.")
    start: datetime
    end: datetime
    events: list[EventReport] = Field(default_factory=list)
    exports: dict[str, str] = Field(
        default_factory=dict,
        description="Per export format, how the latest export of this run went: 'written', or "
        "'failed: …' with the reason (set by `wattflow export` and `wattflow run --export`).",
    )

    @property
    def duration_s(self) -> float:
        """Length of the window in seconds."""
        return (self.end - self.start).total_seconds()


def number_text(value: float) -> str:
    """A parameter's value as a name holds it: ``4`` for 4.0, ``0.5``, ``1e-06``; exact, so
    that two values never share a name."""
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def parameter_settings(parameters: Mapping[str, float]) -> str:
    """Settings named after a run's parameters: ``p=4``, or ``batch=32,p=4`` for several.

    The spec names a benchmark-run directory by its settings, several joined with commas
    (``877MHz,1065MHz``); the parameters come sorted by name, so the same parameters always
    name the same run, whatever order they were given in.
    """
    return ",".join(f"{name}={number_text(value)}" for name, value in sorted(parameters.items()))


GPU_SYSTEM_KEYS = ("device_name", "cuda_capability", "driver_version", "cuda_version",
                   "nvml_version")  # fmt: skip
"""The GPU measurement directory's system-info keys that describe the GPU and its driver."""


class RecordedSystem:
    """What a recording itself says about the machine it was made on, gathered report by report.

    The node's name is the reports' sensor name, when they all have one (or else when the GPU
    reports all have one); the GPU's model and driver come from GPU reports whose metadata carry
    them under the GPU measurement directory's keys (``device_name``, ``driver_version``, …).
    Everything else about the machine is unknown: the machine that imports a recording is not
    the one it was made on.
    """

    def __init__(self) -> None:
        self.sensors: set[str] = set()
        self.gpu_sensors: set[str] = set()
        self.gpu: dict[str, Any] = {}

    def add(self, report: Report) -> None:
        self.sensors.add(report.sensor)
        if isinstance(report, GPUReport):
            self.gpu_sensors.add(report.sensor)
            if report.metadata and len(self.gpu) < len(GPU_SYSTEM_KEYS):
                for key in GPU_SYSTEM_KEYS:
                    value = report.metadata.get(key)
                    if value is not None and key not in self.gpu:
                        self.gpu[key] = value

    def info(self) -> dict[str, Any]:
        """The keys the recording gave a value for."""
        found: dict[str, Any] = dict(self.gpu)
        for sensors in (self.sensors, self.gpu_sensors):
            if len(sensors) == 1:
                found["node"] = next(iter(sensors))
                break
        return found


def merge_system(stored: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """System info ``given`` over ``stored``: a value given replaces the stored one, a ``None``
    given does not."""
    return {**stored, **{key: value for key, value in given.items() if value is not None}}


PAGE = 5000
"""Rows handed over at once."""


class Series(NamedTuple):
    """What a PowerReport's power is the power of: its sensor and target, and its metadata's
    ``scope``, ``socket`` and ``device`` as text (``""`` where absent)."""

    sensor: str
    target: str
    scope: str
    socket: str
    device: str


class SeriesIds:
    """Small numbers standing for series, given in the order the series first appear, and
    what each stands for: how pages name their rows' series once rather than on every row."""

    def __init__(self) -> None:
        self._ids: dict[Series, int] = {}
        self.series: dict[int, Series] = {}

    def number(self, key: Series) -> int:
        """The id of ``key``, new if it has none yet."""
        number = self._ids.get(key)
        if number is None:
            number = self._ids[key] = len(self._ids)
            self.series[number] = key
        return number


def series_of(report: PowerReport) -> Series:
    metadata = report.metadata
    return Series(
        report.sensor,
        report.target,
        str(metadata.get("scope", "")),
        str(metadata.get("socket", "")),
        str(metadata.get("device", "")),
    )


@dataclass(frozen=True, slots=True)
class PowerPage:
    """Some of a run's PowerReports, in time order, as the exporters fold them."""

    rows: Sequence[tuple[int, int, float]]
    """(time in Unix µs, series id, power in W)."""
    series: Mapping[int, Series]
    """What each series id the rows hold stands for (it may hold more)."""


NOT_POWER = -1
"""The series id of a timeline row that is not a PowerReport."""

TimelineRow = tuple[int, int, float, float | None, int, int]
"""(time in Unix µs, series id or :data:`NOT_POWER`, power in W or 0.0, the Unix time in
seconds at which the service finished processing the report or ``None`` where the store does
not know (imported files were processed elsewhere), then the two keys the rows are ordered by:
the time in Unix ms and the place the report was stored in.

Readers use the first four. The last two come along because a store that sorts by them hands
them out anyway, and dropping them would cost a copy of every row."""


@dataclass(frozen=True, slots=True)
class TimelinePage:
    """Some of a run's reports of every kind, in time order: PowerReports as in
    :class:`PowerPage`, the others only as a moment."""

    rows: Sequence[TimelineRow]
    series: Mapping[int, Series]


class RunData(ABC):
    """A run's reports, read by kind: what the exporters read runs through.

    Every method hands out the reports inside the run's window, in time order (the order they
    were stored in within one timestamp), a page at a time, so that memory does not grow with
    a run's length.
    """

    @abstractmethod
    def power(self, run: Run) -> Iterator[PowerPage]:
        """The run's PowerReports as rows."""

    @abstractmethod
    def timeline(self, run: Run) -> Iterator[TimelinePage]:
        """Every report of the run, each a row: PowerReports with their series and power."""

    @abstractmethod
    def reports(self, run: Run, kinds: Sequence[str] | None = None) -> Iterator[Report]:
        """The run's reports of ``kinds`` (every kind by default) as reports."""

    @abstractmethod
    def count(self, run: Run) -> int:
        """The number of reports in the run's window, of every kind."""


def power_pages(reports: Iterable[Report]) -> Iterator[PowerPage]:
    """PowerPages of the PowerReports among ``reports`` (time order)."""
    ids = SeriesIds()
    stream = (report for report in reports if isinstance(report, PowerReport))
    while page := list(islice(stream, PAGE)):
        rows = [(to_micros(r.timestamp), ids.number(series_of(r)), r.power) for r in page]
        yield PowerPage(rows, ids.series)


class ReportLists(RunData):
    """Runs' reports handed over by a function, each run's reports read once and held.

    For reports that are not in a store (tests, a program's own list). ``reports(run)`` gives
    the run's reports in time order, each a report or a (report, processing time in Unix
    seconds or ``None``) pair; it is called once per run, when that run is first read.
    """

    def __init__(
        self, reports: Callable[[Run], Iterable[Report | tuple[Report, float | None]]]
    ) -> None:
        self._source = reports
        self._held: dict[str, list[tuple[Report, float | None]]] = {}

    def _of(self, run: Run) -> list[tuple[Report, float | None]]:
        held = self._held.get(run.id)
        if held is None:
            held = self._held[run.id] = [
                item if isinstance(item, tuple) else (item, None) for item in self._source(run)
            ]
        return held

    def power(self, run: Run) -> Iterator[PowerPage]:
        return power_pages(report for report, _ in self._of(run))

    def timeline(self, run: Run) -> Iterator[TimelinePage]:
        held = self._of(run)
        ids = SeriesIds()
        for first in range(0, len(held), PAGE):
            rows: list[TimelineRow] = []
            for place, (report, processed) in enumerate(held[first : first + PAGE], first):
                micros = to_micros(report.timestamp)
                if isinstance(report, PowerReport):
                    number, power = ids.number(series_of(report)), report.power
                else:
                    number, power = NOT_POWER, 0.0
                rows.append((micros, number, power, processed, micros // 1000, place))
            yield TimelinePage(rows, ids.series)

    def reports(self, run: Run, kinds: Sequence[str] | None = None) -> Iterator[Report]:
        return (r for r, _ in self._of(run) if kinds is None or r.kind in kinds)

    def count(self, run: Run) -> int:
        return len(self._of(run))


def phases_of(events: Iterable[EventReport]) -> list[tuple[datetime, datetime, str]]:
    """(start, end, name) of each phase the events mark, innermost last when they nest."""
    open_phases: dict[str, list[datetime]] = {}
    found: list[tuple[datetime, datetime, str]] = []
    for event in sorted(events, key=lambda e: e.timestamp):
        name, _, edge = event.event.rpartition("_")
        if name == "experiment":
            continue
        if edge == "begin":
            open_phases.setdefault(name, []).append(event.timestamp)
        elif edge == "end" and open_phases.get(name):
            found.append((open_phases[name].pop(), event.timestamp, name))
    found.sort(key=lambda phase: (phase[0], -(phase[1] - phase[0]).total_seconds()))
    return found


def phase_at(phases: list[tuple[datetime, datetime, str]], moment: datetime) -> str:
    """The innermost phase open at ``moment`` (the latest-starting one), or ``""``."""
    current = ""
    for start, end, name in phases:
        if start > moment:
            break
        if start <= moment <= end:
            current = name
    return current


Moment = TypeVar("Moment", datetime, int)


class PhaseClock(Generic[Moment]):
    """The chain of phases open at a moment, for moments that mostly come in time order.

    Reports arrive in time order, so a sweep keeps the work per moment proportional to the
    phases open, not to all the run's phases (a run may mark thousands of batches). Moments
    are datetimes, or Unix µs with phases given in :func:`micro_phases`.
    """

    def __init__(self, phases: list[tuple[Moment, Moment, str]]) -> None:
        self._phases: list[tuple[Moment, Moment, str]] = phases
        self._next = 0
        self._open: list[tuple[Moment, Moment, str]] = []
        self._last: Moment | None = None

    def chain(self, moment: Moment) -> tuple[str, ...]:
        """Names of the phases open at ``moment`` (start ≤ moment ≤ end), outermost first,
        in :func:`phases_of`'s order: the last is :func:`phase_at`'s innermost phase."""
        if self._last is not None and moment < self._last:
            self._next, self._open = 0, []
        self._last = moment
        while self._next < len(self._phases) and self._phases[self._next][0] <= moment:
            self._open.append(self._phases[self._next])
            self._next += 1
        self._open = [phase for phase in self._open if phase[1] >= moment]
        return tuple(name for _, _, name in self._open)


def micro_phases(run: Run) -> list[tuple[int, int, str]]:
    """:func:`phases_of` the run's events, in Unix µs."""
    return [(to_micros(start), to_micros(end), name) for start, end, name in phases_of(run.events)]


@dataclass
class RunSummary:
    """What a run's reports add up to."""

    run: Run
    energy_j: dict[tuple[str, str, str], float] = field(default_factory=dict)
    """(target, phase, domain) → energy in J; phase "" is outside every phase."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Phase → seconds spent in it and in no phase nested in it."""
    covered_s: float = 0.0
    """Time inside at least one phase (nested phases counted once)."""
    reports: int = 0
    """Reports read: every report :func:`summarise` was given, the power rows
    :func:`summarise_power` was."""
    _index: dict[str, list[tuple[str, str, str]]] | None = field(default=None, repr=False)
    _indexed: int = field(default=0, repr=False)

    def targets(self) -> list[str]:
        """Targets with energy, sorted."""
        return sorted({target for target, _, _ in self.energy_j})

    def phases(self) -> list[str]:
        """Phases with energy, sorted ("" first when some energy is outside every phase)."""
        return sorted({phase for _, phase, _ in self.energy_j})

    def energy(self, target: str, domain: str | None = None, phase: str | None = None) -> float:
        """Energy in J of a target, in one domain or in all, in one phase or the whole run.

        With no domain: the target's ``node`` energy where it has some, since the node
        formula's figure for a target already adds up its cpu, dram and gpu power (and for the
        ``node`` target it is the meter); otherwise the sum of its domains. Adding ``node`` to
        the others would count them twice.
        """
        keys = self._by_target().get(target, ())
        if domain is None and any(d == "node" for _, _, d in keys):
            domain = "node"
        return sum(
            self.energy_j[key]
            for key in keys
            if (domain is None or key[2] == domain) and (phase is None or key[1] == phase)
        )

    def _by_target(self) -> dict[str, list[tuple[str, str, str]]]:
        """The keys of :attr:`energy_j` by target, in its order (sums add in that order), so
        that a summary of many targets is not scanned whole for each."""
        if self._index is None or self._indexed != len(self.energy_j):
            self._index = {}
            for key in self.energy_j:
                self._index.setdefault(key[0], []).append(key)
            self._indexed = len(self.energy_j)
        return self._index

    def duration_s(self, phase: str | None = None) -> float:
        """The run's length, or the time spent in ``phase`` and no phase nested in it (outside
        every phase for "")."""
        if phase is None:
            return self.run.duration_s
        if phase == "":
            return max(self.run.duration_s - self.covered_s, 0.0)
        return self.phase_seconds.get(phase, 0.0)

    def mean_power_w(
        self, target: str, domain: str | None = None, phase: str | None = None
    ) -> float:
        """Energy over duration: the target's mean power in the run or the phase."""
        seconds = self.duration_s(phase)
        return self.energy(target, domain, phase) / seconds if seconds > 0 else 0.0


def summarise(run: Run, reports: Iterable[Report]) -> RunSummary:
    """Fold a run's reports (time order) into energy per target, phase and domain."""
    held = list(reports)
    summary = summarise_power(run, power_pages(held))
    summary.reports = len(held)
    return summary


def summarise_power(
    run: Run, pages: Iterable[PowerPage], advance: Callable[[int], None] | None = None
) -> RunSummary:
    """:func:`summarise` from the run's power rows (:meth:`RunData.power`); ``advance`` is
    called with the number of rows of each page as it is read."""
    summary = RunSummary(run)
    phases = phases_of(run.events)
    summary.phase_seconds = _phase_seconds(phases)
    summary.covered_s = _covered_seconds(phases)
    clock = PhaseClock(micro_phases(run))
    energy = summary.energy_j
    # Per series id: [previous report's time, target, domain], shared by the ids of one
    # (target, domain, socket, device) whatever their sensor; None for a series left out.
    slots: dict[int, list[Any] | None] = {}
    shared: dict[tuple[str, str, str, str], list[Any]] = {}
    moment, phase = -1, ""
    for page in pages:
        if advance is not None:
            advance(len(page.rows))
        summary.reports += len(page.rows)
        for micros, number, power in page.rows:
            slot = slots.get(number, _UNSEEN)
            if slot is _UNSEEN:
                slot = slots[number] = _energy_slot(page.series[number], shared)
            if slot is None:
                continue
            last = slot[0]
            slot[0] = micros
            if last is None or micros <= last:
                continue
            if micros != moment:
                chain = clock.chain(micros)
                moment, phase = micros, chain[-1] if chain else ""
            key = (slot[1], phase, slot[2])
            energy[key] = energy.get(key, 0.0) + power * ((micros - last) / 1_000_000)
    return summary


def _phase_seconds(phases: list[tuple[datetime, datetime, str]]) -> dict[str, float]:
    """Each phase's own time: what its nested phases leave it, as with its energy. Each
    stretch between two phase edges belongs to the innermost phase open over it."""
    seconds: dict[str, float] = {}
    edges = sorted({moment for start, end, _ in phases for moment in (start, end)})
    for earlier, later in pairwise(edges):
        name = phase_at(phases, earlier + (later - earlier) / 2)
        if name:
            seconds[name] = seconds.get(name, 0.0) + (later - earlier).total_seconds()
    return seconds


def _covered_seconds(phases: list[tuple[datetime, datetime, str]]) -> float:
    """The length of the union of the phases (sorted by start): nested and overlapping
    phases counted once."""
    covered = 0.0
    reach: datetime | None = None
    for start, end, _ in phases:
        if reach is None or start > reach:
            covered += (end - start).total_seconds()
            reach = end
        elif end > reach:
            covered += (end - reach).total_seconds()
            reach = end
    return covered


_UNSEEN: Any = object()


def _energy_slot(
    series: Series, shared: dict[tuple[str, str, str, str], list[Any]]
) -> list[Any] | None:
    """A series' state in :func:`summarise_power`: only cpu, dram, gpu and node count, and
    neither the ``rapl`` nor the ``global`` target (whole-socket figures)."""
    if series.scope not in DOMAINS or series.target in ("rapl", "global"):
        return None
    key = (series.target, series.scope, series.socket, series.device)
    slot = shared.get(key)
    if slot is None:
        slot = shared[key] = [None, series.target, series.scope]
    return slot
