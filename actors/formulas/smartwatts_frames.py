"""SmartWatts' tick assembly: a frame of hwpc-sensor reports into arrays over its ticks.

The formula steps one (socket, scope) model after another through the ticks, but everything
around the models is the same arithmetic for every tick: each target's counters summed over its
cpus (multiplexing undone), the sum over targets, RAPL energy, the package frequency. So does
deciding which reports cannot be used, and why: counters that cannot be real, a target without
a ``core`` group, a global report without RAPL or msr counters, a tick without its global report
or too soon after the previous one. :func:`assemble` does all of it for every tick of a frame at
once; whatever a frame holds (reports made into a frame by
:meth:`~wattflow.formats.frames.HWPCFrame.from_reports` included), this is the only way in.

Sums are added one row after another, in the order the reports give their cpus and targets: the
watts do not depend on how many ticks a frame holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from wattflow.actors.formulas.rapl import GLOBAL_TARGETS, RAPL_EVENT_PREFIX, tick_intervals
from wattflow.formats.frames import (
    EventsTable,
    FloatArray,
    HWPCFrame,
    IntArray,
    canonical_rows,
    run_starts,
)
from wattflow.formats.powerapi import datetime_of

WRAPPED_COUNTER = 2**48
"""No counter delta over one interval comes near this (78 hours of cycles at 1 GHz): a delta this
large is a counter that wrapped around and was subtracted without care."""

TIME_EVENTS = ("time_enabled", "time_running")

Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Timing:
    """How a sensor's ticks are timed and what the features are: the formula's mode."""

    previous_ms: int | None
    """The last tick already processed (default mode); ``None`` for the sensor's first."""
    period_ms: int
    """``--sensor-reports-frequency``."""
    compat: bool
    """SmartWatts 2.4.1's way: the period is every tick's interval, features are raw counts,
    multiplexed counters are taken as reported, and there is no first or too-soon tick."""
    lateness_ms: int
    """``--tick-lateness-ms``, named by a tick left without its global report."""
    base_frequency: int
    """The MHz MPERF counts at."""


@dataclass(slots=True, eq=False)
class FrameTicks:
    """The ticks of a frame that have something to estimate, as SmartWatts needs them.

    Sockets come in the order the global reports' RAPL rows first give them. Target blocks:
    ``block_start[t, s]:block_stop[t, s]`` are the rows of ``counts`` holding tick ``t``'s
    targets on socket ``s``, in the order the targets' reports come in the tick.
    """

    millis: IntArray  # (ticks,)
    interval_s: FloatArray  # (ticks,): the time since the previous tick, or the period
    global_codes: IntArray  # (ticks,): the global report's target, a code into the names
    sockets: list[str]
    events: tuple[str, ...]  # the features, sorted
    energy: dict[str, FloatArray]  # RAPL event → (ticks, sockets); NaN where it is not given
    frequency: IntArray  # (ticks, sockets): the package frequency in MHz
    targets: IntArray  # (ticks,): target reports in each tick
    counts: FloatArray  # (rows, events): one target's counters on one socket, summed over cpus
    target_codes: IntArray  # (rows,): the target of each row, a code into the frame's names
    block_start: IntArray  # (ticks, sockets)
    block_stop: IntArray  # (ticks, sockets)
    global_counts: FloatArray  # (ticks, sockets, events): the sum of each block's rows


@dataclass(slots=True, eq=False)
class Assembly:
    """What :func:`assemble` made of a frame."""

    ticks: FrameTicks | None
    """The ticks to estimate, ``None`` when there is none."""
    rejected: list[tuple[int, int, str]]
    """(tick ms, target code, reason) of each report that cannot be used, tick after tick."""
    absorbed: int
    """Reports that go into the formula's state without an estimate: a sensor's first tick,
    the global report of a tick without targets."""
    last_ms: int | None
    """The last tick with a report left: the next frame's ticks are timed from it."""


class Roles(NamedTuple):
    """Which of a frame's tables holds what, by name or else by the events it holds."""

    rapl: EventsTable | None
    msr: EventsTable | None
    core: EventsTable | None
    is_global: Bools
    """Per name code: whether it names the whole-machine report ('all', 'system')."""


class ReportIndex(NamedTuple):
    """One entry per report of a frame, ordered by tick then target code, and each table row's
    report."""

    millis: IntArray
    targets: IntArray
    row_report: dict[str, IntArray]
    """Group → the report of each of its table's rows."""


class Sockets(NamedTuple):
    """The RAPL sockets of some ticks' global reports, and what they say of each tick's."""

    sockets: IntArray
    """The socket ids, in the order the RAPL rows first give them."""
    energy: dict[str, FloatArray]
    """RAPL event → (ticks, sockets) energy in RAPL units; NaN where the tick has none."""
    frequency: IntArray
    """(ticks, sockets) package frequency in MHz."""
    reasons: list[str | None]
    """Per tick: why its global report cannot be used, or ``None``."""


def roles(frame: HWPCFrame) -> Roles:
    """The frame's ``rapl``, ``msr`` and ``core`` tables: by name, or else the first that holds
    RAPL energy, the first that holds APERF and MPERF, and the only one holding targets' rows
    (PowerAPI's CSV input names each group after its file)."""
    tables = {table.group: table for table in frame.tables}
    is_global = np.array([name in GLOBAL_TARGETS for name in frame.names], dtype=np.bool_)
    rapl = tables.get("rapl") or _first(
        frame, lambda t: any(e.startswith(RAPL_EVENT_PREFIX) for e in t.events)
    )
    msr = tables.get("msr") or _first(frame, lambda t: {"APERF", "MPERF"} <= set(t.events))
    core = tables.get("core")
    if core is None:
        holding = [t for t in frame.tables if not bool(is_global[t.targets].all())]
        core = holding[0] if len(holding) == 1 else None
    return Roles(rapl, msr, core, is_global)


def _first(frame: HWPCFrame, holds: Callable[[EventsTable], bool]) -> EventsTable | None:
    return next((table for table in frame.tables if holds(table)), None)


def index_reports(frame: HWPCFrame) -> ReportIndex:
    """Every report of a frame (a frame of one sensor: a report is a tick and a target)."""
    width = len(frame.names)
    first = min((int(t.millis[0]) for t in frame.tables if len(t)), default=0)
    last = max((int(t.millis[-1]) for t in frame.tables if len(t)), default=0)
    starts = [run_starts(t.millis, t.targets) for t in frame.tables]
    ticks = None
    if (last - first + 1) * width >= 2**63:
        # Ticks centuries apart with many names: each tick by its place among the frame's
        # ticks (fewer than its rows) instead of its milliseconds, so that no key wraps.
        ticks = np.unique(np.concatenate([t.millis for t in frame.tables]))
    keys = [
        _tick_numbers(t.millis[at], first, ticks) * width + t.targets[at]
        for t, at in zip(frame.tables, starts, strict=True)
    ]
    every_key = np.concatenate([np.empty(0, np.int64), *keys])
    unique = distinct_sorted(np.sort(every_key))
    inverse = np.searchsorted(unique, every_key)
    row_report = {}
    done = 0
    for table, at, part in zip(frame.tables, starts, keys, strict=True):
        runs = run_lengths(at, len(table))
        row_report[table.group] = np.repeat(inverse[done : done + len(part)], runs)
        done += len(part)
    tick_of = unique // width
    millis = tick_of + first if ticks is None else ticks[tick_of]
    return ReportIndex(millis, unique % width, row_report)


def _tick_numbers(millis: IntArray, first: int, ticks: IntArray | None) -> IntArray:
    """Ticks as small numbers: milliseconds after ``first``, or places in ``ticks``."""
    numbers: IntArray = millis - first if ticks is None else np.searchsorted(ticks, millis)
    return numbers


def is_canonical(frame: HWPCFrame) -> bool:
    """Whether :func:`assemble` can take a frame as it is: its rows canonical
    (:func:`~wattflow.formats.frames.canonical_rows`, unless its maker promised them so) and
    one name for the global report. :meth:`~wattflow.formats.frames.HWPCFrame.from_reports` of
    the frame's reports makes a frame canonical."""
    codes = [at for at, name in enumerate(frame.names) if name in GLOBAL_TARGETS]
    if len(codes) > 1:  # a tick's global report might then come under two names
        used = np.concatenate([np.empty(0, np.int64), *(t.targets for t in frame.tables)])
        if len(np.intersect1d(used, codes)) > 1:
            return False
    return frame.canonical or canonical_rows(frame.tables)


def assemble(frame: HWPCFrame, timing: Timing) -> Assembly:
    """A canonical frame's (:func:`is_canonical`) ticks: the reports that cannot be used, with
    the reason; those absorbed; and the arrays of the ticks left to estimate."""
    role = roles(frame)
    index = index_reports(frame)
    is_global = role.is_global[index.targets]
    reasons = _target_reasons(frame, role, index, is_global)
    alive = np.ones(len(index.millis), dtype=np.bool_)
    alive[list(reasons)] = False
    ticks = distinct_sorted(index.millis[alive])  # the reports come in tick order
    tick_of = np.searchsorted(ticks, index.millis)
    targets = np.bincount(tick_of[alive & ~is_global], minlength=len(ticks))
    global_of = np.full(len(ticks), -1, dtype=np.int64)
    alive_globals = (alive & is_global).nonzero()[0]
    global_of[tick_of[alive_globals]] = alive_globals
    interval_s, first, too_soon = _timing(ticks, timing)
    waiting = np.arange(len(ticks)) < first
    waiting_reports = alive & waiting[np.minimum(tick_of, max(len(ticks) - 1, 0))]
    rejects = _Rejects(index, timing)
    rejects.too_soon(too_soon.nonzero()[0], interval_s, alive, tick_of)
    timed = ~waiting & ~too_soon
    rejects.incomplete((timed & (global_of < 0)).nonzero()[0], alive, tick_of)
    candidates = (timed & (global_of >= 0) & (targets > 0)).nonzero()[0]
    found = global_sockets(frame, role, index, global_of[candidates], timing.base_frequency)
    bad = np.array([reason is not None for reason in found.reasons], dtype=np.bool_)
    for at, reason in enumerate(found.reasons):
        if reason is not None:
            tick = int(candidates[at])
            rejects.global_rejected(tick, int(global_of[tick]), reason, alive, tick_of)
    rejects.add_targets(reasons, is_global)
    absorbed = int(waiting_reports.sum()) + int((timed & (global_of >= 0) & (targets == 0)).sum())
    estimable = candidates[~bad]
    frame_ticks = None
    if len(estimable):
        target_tick = np.where(alive & ~is_global, tick_of, -1)
        frame_ticks = _frame_ticks(
            frame, role, index, ticks, estimable, found, ~bad, target_tick, timing
        )
        frame_ticks.interval_s = interval_s[estimable]
        frame_ticks.global_codes = index.targets[global_of[estimable]]
        frame_ticks.targets = targets[estimable]
    last_ms = int(ticks[-1]) if len(ticks) else timing.previous_ms
    return Assembly(frame_ticks, rejects.ordered(), absorbed, last_ms)


def _timing(ticks: IntArray, timing: Timing) -> tuple[FloatArray, int, Bools]:
    """Each tick's interval, the first tick that has one (a sensor's first tick only starts
    the first interval), and which ticks come too soon after the previous one."""
    period_s = timing.period_ms / 1000.0
    if timing.compat or not len(ticks):
        return np.full(len(ticks), period_s), 0, np.zeros(len(ticks), dtype=np.bool_)
    interval_s, first = tick_intervals(ticks, timing.previous_ms, timing.period_ms)
    too_soon = interval_s < period_s / 4
    too_soon[:first] = False
    return interval_s, first, too_soon


class _Rejects:
    """The reports a frame's ticks cannot use, with the reason, as they are found."""

    def __init__(self, index: ReportIndex, timing: Timing) -> None:
        self.index = index
        self.timing = timing
        self.found: list[tuple[int, int, int, str]] = []
        """(tick, 0 for a global report, report, reason)."""

    def ordered(self) -> list[tuple[int, int, str]]:
        """Tick after tick, the global report first, then the targets."""
        index = self.index
        return [
            (int(index.millis[report]), int(index.targets[report]), reason)
            for _, _, report, reason in sorted(self.found)
        ]

    def _add(self, reports: IntArray, reason: str, globals_: bool = False) -> None:
        millis = self.index.millis
        self.found.extend((int(millis[r]), int(not globals_), int(r), reason) for r in reports)

    def add_targets(self, reasons: dict[int, str], is_global: Bools) -> None:
        for report, reason in reasons.items():
            self._add(np.array([report]), reason, bool(is_global[report]))

    def too_soon(
        self, ticks: IntArray, interval_s: FloatArray, alive: Bools, tick_of: IntArray
    ) -> None:
        for tick in ticks.tolist():
            reason = (
                f"tick {interval_s[tick] * 1000:.0f} ms after the previous one, under a "
                f"quarter of the sensor period ({self.timing.period_ms} ms)"
            )
            self._add((alive & (tick_of == tick)).nonzero()[0], reason)

    def incomplete(self, ticks: IntArray, alive: Bools, tick_of: IntArray) -> None:
        lateness = self.timing.lateness_ms
        wait = "" if self.timing.compat else f" within --tick-lateness-ms {lateness} ms"
        for tick in ticks.tolist():
            reports = (alive & (tick_of == tick)).nonzero()[0]
            when = datetime_of(int(self.index.millis[reports[0]])).isoformat()
            reason = f"tick {when} is incomplete: no global report ('all'){wait}"
            self._add(reports, reason)

    def global_rejected(
        self, tick: int, report: int, reason: str, alive: Bools, tick_of: IntArray
    ) -> None:
        self._add(np.array([report]), reason, True)
        targets = (alive & (tick_of == tick)).nonzero()[0]
        self._add(
            targets[targets != report], f"the global report of its tick was rejected: {reason}"
        )


def _target_reasons(
    frame: HWPCFrame, role: Roles, index: ReportIndex, is_global: Bools
) -> dict[int, str]:
    """Why each target report that cannot be used cannot: no ``core`` group, a counter that
    cannot be real, a socket whose cpus report no counters."""
    reasons: dict[int, str] = {}
    has_core = np.zeros(len(index.millis), dtype=np.bool_)
    core = role.core
    if core is not None:
        has_core[index.row_report[core.group]] = True
    for report in (~is_global & ~has_core).nonzero()[0].tolist():
        groups = sorted(
            t.group for t in frame.tables if (index.row_report[t.group] == report).any()
        )
        reasons[report] = f"target report without a 'core' group (it has {groups})"
    if core is None:
        return reasons
    row_report = index.row_report[core.group]
    targets = ~is_global[row_report]
    columns = [at for at, event in enumerate(core.events) if event not in TIME_EVENTS]
    values = core.values[:, columns]
    bad = (values < 0) | (values >= WRAPPED_COUNTER)
    for row in (targets & bad.any(axis=1)).nonzero()[0].tolist():
        column = columns[int(np.argmax(bad[row]))]
        value = frame.value(core, row, column)
        reasons.setdefault(int(row_report[row]), _bad_counter(core, row, column, value))
    absent = (
        np.isnan(values).all(axis=1)
        if values.dtype.kind == "f"
        else np.full(len(core), not columns)
    )
    if bool(absent.any()):
        starts = run_starts(core.millis, core.targets, core.sockets)
        for start in starts[np.logical_and.reduceat(absent, starts) & targets[starts]].tolist():
            reasons.setdefault(
                int(row_report[start]),
                f"no counters on socket {core.sockets[start]}: its cpus report no events",
            )
    return reasons


def _bad_counter(table: EventsTable, row: int, column: int | str, value: float) -> str:
    event = column if isinstance(column, str) else table.events[column]
    where = f"{event} on socket {table.sockets[row]} cpu {table.cpus[row]}"
    if value < 0:
        return f"negative counter delta {value} for {where}"
    return f"counter delta {value} for {where} is beyond any real count: the counter wrapped around"


MSR_MISSING = (
    "global report without an 'msr' group (APERF, MPERF): the package frequency, and so the "
    "model to use, is unknown"
)
RAPL_MISSING = "global report without RAPL energy counters"


class _Slots(NamedTuple):
    """Rows of one table belonging to the chosen global reports, by (tick, socket) slot."""

    rows: IntArray
    tick: IntArray
    slot: IntArray
    """tick × sockets + the socket's place; -1 for a socket RAPL does not give."""


Fault = tuple[int, int, int, str]
"""(kind: 0 energy, 1 no msr rows, 2 negative APERF/MPERF, 3 MPERF zero; slot; row; reason)."""


def global_sockets(
    frame: HWPCFrame, role: Roles, index: ReportIndex, globals_: IntArray, base_frequency: int
) -> Sockets:
    """What the global reports ``globals_`` (one per tick) say of each RAPL socket: energy and
    package frequency; and why a report cannot be used, as SmartWatts finds it: no msr group,
    no RAPL energy, then socket after socket its energy, then its msr counters."""
    ticks = len(globals_)
    place = np.full(len(index.millis), -1, dtype=np.int64)
    place[globals_] = np.arange(ticks)
    none = np.empty(0, dtype=np.int64)
    msr_tick = place[index.row_report[role.msr.group]] if role.msr is not None else none
    rapl_tick = place[index.row_report[role.rapl.group]] if role.rapl is not None else none
    reasons: list[str | None] = [None] * ticks
    for tick in _without(ticks, rapl_tick):
        reasons[tick] = RAPL_MISSING
    for tick in _without(ticks, msr_tick):
        reasons[tick] = MSR_MISSING
    if role.rapl is None or role.msr is None:
        return Sockets(none, {}, np.zeros((ticks, 0), dtype=np.int64), reasons)
    rapl = role.rapl
    mine = (rapl_tick >= 0).nonzero()[0]
    sockets = np.array(list(dict.fromkeys(rapl.sockets[mine].tolist())), dtype=np.int64)
    position = {int(socket): at for at, socket in enumerate(sockets.tolist())}
    size = ticks * len(sockets)
    slots = _slots(rapl, mine, rapl_tick[mine], position)
    given = np.zeros(size, dtype=np.bool_)
    given[slots.slot] = True
    energy, faults = _energy(frame, rapl, slots, size)
    mine = (msr_tick >= 0).nonzero()[0]
    msr_slots = _slots(role.msr, mine, msr_tick[mine], position)
    frequency = _frequency(frame, role.msr, msr_slots, given, sockets, base_frequency, faults)
    if faults:
        _first_faults(reasons, faults, slots, size, len(rapl))
    return Sockets(
        sockets,
        {event: found.reshape(ticks, len(sockets)) for event, found in energy.items()},
        frequency.reshape(ticks, len(sockets)),
        reasons,
    )


def _first_faults(
    reasons: list[str | None], faults: list[Fault], slots: _Slots, size: int, rows: int
) -> None:
    """Each tick's first fault as its reason, unless it has one: socket after socket in the
    order of their RAPL rows (of ``rows``), then by kind."""
    first_row = np.full(size, rows, dtype=np.int64)
    np.minimum.at(first_row, slots.slot, slots.rows)
    sockets = size // len(reasons)
    for _, _, slot, _, reason in sorted((first_row[f[1]], *f) for f in faults):
        tick = slot // sockets
        if reasons[tick] is None:
            reasons[tick] = reason


def _firsts(keys: IntArray) -> tuple[IntArray, IntArray]:
    """``np.unique(keys, return_index=True)``, at once for keys already rising, as a canonical
    frame's slots are."""
    if bool((keys[1:] > keys[:-1]).all()):
        return keys, np.arange(len(keys))
    found: tuple[IntArray, IntArray] = np.unique(keys, return_index=True)
    return found


def _without(ticks: int, places: IntArray) -> list[int]:
    """The places from 0 to ``ticks`` that ``places`` (-1: none) does not hold."""
    held = np.zeros(ticks + 1, dtype=np.bool_)
    held[places] = True  # -1 marks the spare last entry
    missing: list[int] = (~held[:ticks]).nonzero()[0].tolist()
    return missing


def _slots(table: EventsTable, rows: IntArray, tick: IntArray, position: dict[int, int]) -> _Slots:
    place = _positions(table.sockets[rows], position)
    return _Slots(rows, tick, np.where(place >= 0, tick * len(position) + place, -1))


def _energy(
    frame: HWPCFrame, rapl: EventsTable, slots: _Slots, size: int
) -> tuple[dict[str, FloatArray], list[Fault]]:
    """Each RAPL event's energy per slot: its first cpu's value, as SmartWatts reads it; the
    values that cannot be real, as faults."""
    energy: dict[str, FloatArray] = {}
    faults: list[Fault] = []
    for column, event in enumerate(rapl.events):
        if event in TIME_EVENTS:
            continue
        values = rapl.values[slots.rows, column]
        given = ~np.isnan(values) if values.dtype.kind == "f" else np.ones(len(values), np.bool_)
        slot, first = _firsts(slots.slot[given])
        rows = slots.rows[given][first]
        found = np.full(size, np.nan)
        found[slot] = values[given][first]
        energy[event] = found
        bad = (found[slot] < 0) | (found[slot] >= WRAPPED_COUNTER)
        for at in bad.nonzero()[0].tolist():
            row = int(rows[at])
            reason = _bad_counter(rapl, row, column, frame.value(rapl, row, column))
            faults.append((0, int(slot[at]), row * len(rapl.events) + column, reason))
    return energy, faults


def _frequency(
    frame: HWPCFrame,
    msr: EventsTable,
    slots: _Slots,
    given: Bools,
    sockets: IntArray,
    base_frequency: int,
    faults: list[Fault],
) -> IntArray:
    """The package frequency per slot: base × ΣAPERF / ΣMPERF over its cpus (an event a cpu
    lacks counting 0); the msr counters missing, negative or zero of a RAPL socket, as
    faults."""
    known = slots.slot >= 0
    rows, slot = slots.rows[known], slots.slot[known]
    pair = np.zeros((len(rows), 2))
    events = [event for event in ("APERF", "MPERF") if event in msr.events]
    for event in events:
        pair[:, int(event == "MPERF")] = msr.values[rows, msr.events.index(event)]
    pair[np.isnan(pair)] = 0.0
    negative = (pair < 0).any(axis=1)
    for at in negative.nonzero()[0].tolist():
        row = int(rows[at])
        value = min(frame.value(msr, row, msr.events.index(e)) for e in events)
        faults.append((2, int(slot[at]), row, _bad_counter(msr, row, "APERF/MPERF", value)))
    sums = np.zeros((len(given), 2))
    if len(rows):
        starts = run_starts(slot)
        sums[slot[starts]] = ordered_sums(pair, starts, exact=_exact(pair))
    present = np.zeros(len(given), dtype=np.bool_)
    present[slot] = True
    for at in (given & ~present).nonzero()[0].tolist():
        socket = sockets[at % len(sockets)]
        faults.append((1, at, 0, f"global report without msr counters for socket {socket}"))
    for at in (given & present & (sums[:, 1] <= 0)).nonzero()[0].tolist():
        socket = sockets[at % len(sockets)]
        reason = f"MPERF is zero on socket {socket}: the package frequency is unknown"
        faults.append((3, at, 0, reason))
    frequency = np.zeros(len(given), dtype=np.int64)
    ok = sums[:, 1] > 0
    frequency[ok] = ((base_frequency * sums[ok, 0]) / sums[ok, 1]).astype(np.int64)
    return frequency


def _frame_ticks(
    frame: HWPCFrame,
    role: Roles,
    index: ReportIndex,
    ticks: IntArray,
    estimable: IntArray,
    found: Sockets,
    kept: Bools,
    target_tick: IntArray,
    timing: Timing,
) -> FrameTicks:
    """The arrays of the ticks to estimate (``estimable``, places in ``ticks``; ``kept``, which
    of the ticks ``found`` describes they are); ``target_tick``: each report's tick, -1 for a
    report that is not a usable target."""
    place = np.full(len(ticks), -1, dtype=np.int64)
    place[estimable] = np.arange(len(estimable))
    report_tick = np.where(target_tick >= 0, place[np.maximum(target_tick, 0)], -1)
    core = role.core
    assert core is not None  # the ticks have targets
    row_tick = report_tick[index.row_report[core.group]]
    position = {int(socket): at for at, socket in enumerate(found.sockets.tolist())}
    rows = _features(core, row_tick, position, not timing.compat)
    blocks = _blocks(rows, len(estimable), len(position))
    return FrameTicks(
        millis=ticks[estimable],
        interval_s=np.empty(0),
        global_codes=np.empty(0, dtype=np.int64),
        sockets=[str(socket) for socket in found.sockets.tolist()],
        events=rows.events,
        energy={event: energy[kept] for event, energy in found.energy.items()},
        frequency=found.frequency[kept],
        targets=np.empty(0, dtype=np.int64),
        counts=rows.counts,
        target_codes=rows.target_codes,
        block_start=blocks.start,
        block_stop=blocks.stop,
        global_counts=blocks.global_counts,
    )


class TargetRows(NamedTuple):
    """Every target's counters per socket, summed over its cpus, in the order SmartWatts reads
    them: by tick, socket (only sockets with RAPL rows), then the target's place in its tick."""

    events: tuple[str, ...]
    """The features' names, sorted."""
    counts: FloatArray
    """(rows, events): one target's counters on one socket, summed over its cpus."""
    exact: bool
    """Whether sums of the counts are exact in floats whatever their order (see
    :func:`ordered_sums`)."""
    target_codes: IntArray
    """Each row's target, a code into the frame's names."""
    tick_of_row: IntArray
    socket_of_row: IntArray
    """Each row's socket, as its place in the RAPL order."""


class TargetBlocks(NamedTuple):
    """The rows of each tick and socket, and their sum (see :class:`FrameTicks`)."""

    start: IntArray
    stop: IntArray
    global_counts: FloatArray


def _features(
    core: EventsTable, row_tick: IntArray, position: dict[int, int], scale_multiplexed: bool
) -> TargetRows:
    """Every target's counters per socket, summed over its cpus (an event a cpu lacks counts
    0), a multiplexed cpu's scaled by time_enabled/time_running first; of the reports to
    estimate, those whose rows have a tick (``row_tick`` ≥ 0). Every report is summed (a
    report's sums do not depend on the others'), and those left out dropped after."""
    events = tuple(sorted(e for e in core.events if e not in TIME_EVENTS))
    values = core.values[:, [core.events.index(e) for e in events]].astype(np.float64)
    whole = core.values.dtype.kind != "f"
    if not whole:
        values[np.isnan(values)] = 0.0
    scaled = (
        scale_multiplexed and set(TIME_EVENTS) <= set(core.events) and _unmultiplex(core, values)
    )
    exact = not scaled and _exact(values, whole=whole)
    if not len(core):
        empty = np.empty(0, dtype=np.int64)
        return TargetRows(events, np.empty((0, len(events))), exact, empty, empty, empty)
    starts = run_starts(core.millis, core.targets, core.sockets)
    sums = ordered_sums(values, starts, exact=exact)
    segment_tick = row_tick[starts]
    segment_target = core.targets[starts]
    socket_of = _positions(core.sockets[starts], position)
    order = _read_order(segment_tick, segment_target, socket_of)
    return TargetRows(
        events,
        np.ascontiguousarray(sums[order]),
        exact,
        segment_target[order],
        segment_tick[order],
        socket_of[order],
    )


def _exact(values: FloatArray, *, whole: bool = False) -> bool:
    """Whether sums of any of the rows are exact in floats whatever the order: integers (as
    ``whole`` says they are, or as found) whose sum stays under 2**52 whatever the rows."""
    if not len(values):
        return True
    integers = whole or bool((values == np.floor(values)).all())
    return integers and float(np.abs(values).max()) * (len(values) + 1) < 2**52


def _unmultiplex(core: EventsTable, values: FloatArray) -> bool:
    """Scale the counters (``values``, in place) of each cpu that perf multiplexed by
    time_enabled/time_running (0 if it never ran); whether there was one."""
    enabled = core.values[:, core.events.index("time_enabled")]
    running = core.values[:, core.events.index("time_running")]
    multiplexed = running < enabled
    if not bool(multiplexed.any()):
        return False
    scale = np.ones(len(core))
    divided = multiplexed & (running > 0)
    scale[divided] = enabled[divided] / running[divided]
    scale[multiplexed & (running <= 0)] = 0.0
    values *= scale[:, None]
    return True


def _read_order(segment_tick: IntArray, segment_target: IntArray, socket_of: IntArray) -> IntArray:
    """The segments by tick, socket, then the place of the target's first row in its tick;
    those without a tick or on a socket without RAPL rows (-1) left out."""
    width = int(segment_target.max()) + 1
    pair = segment_tick * width + segment_target
    reports, first_segment = np.unique(pair, return_index=True)
    rank = first_segment[np.searchsorted(reports, pair)]
    known = (socket_of >= 0) & (segment_tick >= 0)
    order: IntArray = np.lexsort((rank, socket_of, segment_tick))
    kept: IntArray = order[known[order]]
    return kept


def _blocks(rows: TargetRows, ticks: int, sockets: int) -> TargetBlocks:
    """Each tick and socket's block of target rows, and the sum of each block's rows."""
    blocks = rows.tick_of_row * sockets + rows.socket_of_row
    edges = np.searchsorted(blocks, np.arange(ticks * sockets + 1))
    block_start = edges[:-1].reshape(ticks, sockets)
    block_stop = edges[1:].reshape(ticks, sockets)
    global_counts = np.zeros((ticks, sockets, len(rows.events)))
    filled = block_stop > block_start
    if len(rows.counts):
        starts = block_start[filled].reshape(-1)
        global_counts[filled] = ordered_sums(rows.counts, starts, exact=rows.exact)
    return TargetBlocks(block_start, block_stop, global_counts)


def ordered_sums(values: FloatArray, starts: IntArray, *, exact: bool) -> FloatArray:
    """The sum of each run of rows (runs start at ``starts``), added one row after another.

    Integers below 2**52 add up to the same float in any order (``exact``), and numpy's
    ``reduceat`` is then fastest; otherwise its pairwise order could change the last bit, so
    the rows are added in order, a run's first rows all at once, then its second rows, and so
    on: the sums do not depend on how many runs a frame holds.
    """
    if exact or not len(values):
        sums: FloatArray = np.add.reduceat(values, starts, axis=0)
        return sums
    lengths = run_lengths(starts, len(values))
    run_of_row = np.repeat(np.arange(len(starts)), lengths)
    place = np.arange(len(values)) - starts[run_of_row]
    padded = np.zeros((len(starts), int(lengths.max()), values.shape[1]))
    padded[run_of_row, place] = values
    total = padded[:, 0].copy()
    for column in range(1, padded.shape[1]):
        total += padded[:, column]  # adding the zeros that pad a short run changes nothing
    return total


def distinct_sorted(values: IntArray) -> IntArray:
    """The distinct values of a sorted array: ``np.unique`` without its sort and its checks,
    which cost a live tick's few values more than the work."""
    keep = np.empty(len(values), dtype=np.bool_)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    found: IntArray = values[keep]
    return found


def run_lengths(starts: IntArray, rows: int) -> IntArray:
    """The length of each run of ``rows`` rows whose runs start at ``starts`` (the first at 0):
    ``np.diff`` with the end appended, without its copies, which a live tick's few runs would
    mostly pay for."""
    lengths = np.empty(len(starts), dtype=np.int64)
    if len(starts):
        np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
        lengths[-1] = rows - starts[-1]
    return lengths


def _positions(sockets: IntArray, position: dict[int, int]) -> IntArray:
    """Each socket's place in the RAPL order, -1 for a socket RAPL does not report. Sockets are
    below :data:`~wattflow.formats.reports.SOCKET_LIMIT` (every input refuses others): the
    table has at most 65,536 entries."""
    table = np.full(max(int(sockets.max(initial=0)), *position, 0) + 1, -1, dtype=np.int64)
    table[list(position)] = list(position.values())
    found: IntArray = table[sockets]
    return found
