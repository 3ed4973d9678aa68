"""RAPL formula: energy deltas from hwpc-sensor's ``rapl`` group → watts per socket and domain.

Its reports have SmartWatts' ``rapl`` layout: target ``rapl``, the global report's metadata plus
``scope``, ``socket``, ``formula`` (the RAPL event, as SmartWatts names it) and ``ratio`` 1.0.

hwpc-sensor reports, for each socket, the energy each RAPL domain used since its previous tick,
in units of 2^-32 J. Power is that energy over the real interval between the two ticks' timestamps
(SmartWatts divides by the configured sensor frequency instead, which is wrong whenever a tick is
late). The first tick of a sensor only sets the start of the first interval.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import lru_cache
from itertools import accumulate
from typing import ClassVar, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import Field, PositiveInt

from wattflow.actors.checkpoints import FormulaState, Saved, decode_state, encode_state
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.formats.batch import Batch, hwpc_frame
from wattflow.formats.frames import (
    Column,
    EventsTable,
    FloatArray,
    Frame,
    HWPCFrame,
    IntArray,
    PowerFrame,
    run_starts,
)
from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import HWPCReport, Report, to_millis

RAPL_UNIT_J = 2.0**-32
"""Energy of one unit of hwpc-sensor's RAPL counters, in J."""

GLOBAL_TARGETS = frozenset({"all", "system"})
"""Names of the whole-machine report: hwpc-sensor says ``all``, older recordings ``system``."""

RAPL_EVENT_PREFIX = "RAPL_ENERGY_"

SCOPE_OF_DOMAIN = {"PKG": "cpu", "DRAM": "dram", "PSYS": "psys", "CORES": "cores", "GPU": "uncore"}
"""SmartWatts' scope name for each RAPL domain (PP1, the 'GPU' domain, is the uncore)."""


class RaplConfig(FormulaConfig):
    """Settings of the RAPL formula."""

    sensor_reports_frequency: PositiveInt = Field(
        default=1000,
        description="Period of hwpc-sensor's reports in ms; ticks closer than a quarter of it "
        "are rejected as duplicates.",
        json_schema_extra={"flags": ["--sensor-reports-frequency"], "unit": "ms"},
    )
    compat: Literal["smartwatts-2.4"] | None = Field(
        default=None,
        description="Reproduce another formula's numbers: smartwatts-2.4 for SmartWatts 2.4.1.",
    )


class RaplState(FormulaState, frozen=True, tag=1):
    """What the RAPL formula keeps across a restart."""

    formula = "RAPL formula"
    also_reads = frozenset({None})  # before states were versioned: the same fields

    previous_ms: int | None
    """The last tick: after a restart, the next one has its interval at once."""


def rapl_groups(report: HWPCReport) -> list[str]:
    """Groups that hold RAPL events.

    hwpc-sensor calls the group ``rapl``, but PowerAPI's CSV input names each group after its
    file (``rapl2.csv`` holds group ``rapl2``), so the events, not the group name, decide.
    """
    if "rapl" in report.groups:
        return ["rapl"]
    found = []
    for group, sockets in report.groups.items():
        for cpus in sockets.values():
            for events in cpus.values():
                if any(event.startswith(RAPL_EVENT_PREFIX) for event in events):
                    found.append(group)
                break
            break
    return found


def global_parts(frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
    """Each sensor's global reports in a frame, as ``dispatch_key`` of a formula reading RAPL
    energy picks them; ``None`` unless every global report has a ``rapl`` group."""
    if "global parts" not in frame.memo:
        frame.memo["global parts"] = _global_parts(frame)
    parts: list[tuple[Hashable, Frame]] | None = frame.memo["global parts"]
    return parts


def _global_parts(frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
    """:func:`global_parts`, worked out: ``[]`` for a frame of targets' reports only, ``None``
    when a target has RAPL rows or a global report has no RAPL energy (the frame then goes
    report by report, where such reports are told apart).

    The router asks this of every frame, and a live sensor's frame is one tick: numpy's fixed
    cost per call is then most of the work. So each step is a call or two on the frame's
    columns end to end (every table's rows one after the other), each table's part of them a
    slice, rather than a few calls per table."""
    tables = {table.group: table for table in frame.tables}
    rapl = tables.get("rapl")
    names = frame.names
    codes = [names.index(name) for name in GLOBAL_TARGETS if name in names]  # names are unique
    targets = np.concatenate([np.empty(0, dtype=np.int64), *(t.targets for t in frame.tables)])
    is_global = _among(targets, codes)
    if rapl is None:
        if np.count_nonzero(is_global):
            return None
        return []  # only targets' reports, none of them the formula's
    if len(tables) != len(frame.tables):
        return None
    stops = list(accumulate(len(table) for table in frame.tables))
    global_rows = [
        is_global[stop - len(table) : stop] for table, stop in zip(frame.tables, stops, strict=True)
    ]
    reports = _global_report_count(frame, rapl, targets, is_global, stops, codes)
    if reports is None:
        return None
    return _sensor_parts(frame, reports, global_rows)


def _among(values: IntArray, codes: list[int]) -> npt.NDArray[np.bool_]:
    """Where ``values`` is one of ``codes`` (the global targets' codes: one or two, for which
    comparisons cost less than ``np.isin``)."""
    if not codes:
        return np.zeros(len(values), dtype=np.bool_)
    found: npt.NDArray[np.bool_] = values == codes[0]
    for code in codes[1:]:
        found |= values == code
    return found


def _global_report_count(
    frame: HWPCFrame,
    rapl: EventsTable,
    targets: IntArray,
    is_global: npt.NDArray[np.bool_],
    stops: list[int],
    codes: list[int],
) -> int | None:
    """How many global reports a frame holds, when every one of them has RAPL energy and no
    target has RAPL rows; else ``None``. ``targets`` and ``is_global`` are the target of every
    row of the frame's tables end to end and whether it is global, ``stops`` where each
    table's rows end among them, ``codes`` the global targets' codes.

    One key per row, its report's: the RAPL rows' keys are among the global rows' keys, so
    the global reports all have RAPL energy exactly when both hold as many distinct keys."""
    stop = stops[frame.tables.index(rapl)]
    start = stop - len(rapl)
    if np.count_nonzero(is_global[start:stop]) != stop - start:
        return None  # a target's RAPL rows
    keys = _report_keys(frame, targets, several_targets=len(codes) > 1)
    in_rapl = _distinct(keys[start:stop])
    if _distinct(keys[is_global]) != in_rapl:
        return None  # a global report without RAPL energy
    return in_rapl


def _report_keys(frame: HWPCFrame, targets: IntArray, *, several_targets: bool) -> IntArray:
    """One number per row of the frame's tables, end to end (``targets``: their targets),
    that tells one global report from another: its tick (ms after the first one, or, for
    ticks spread over centuries with many names, its place among the frame's ticks, so that
    no key wraps around 64 bits), sensor and target (``several_targets``: whether global
    rows may have more than one).

    What does not vary among global rows is left out: the sensor of a frame of one sensor (an
    input's frame is), the target where one name is global. Then a global report is its tick
    and its key the tick's milliseconds, as they are."""
    millis: IntArray = np.concatenate(
        [np.empty(0, dtype=np.int64), *(t.millis for t in frame.tables)]
    )
    several_sensors = len(frame.sensors()) > 1
    if not len(millis) or not (several_sensors or several_targets):
        return millis
    width = len(frame.names)
    first, last = int(np.minimum.reduce(millis)), int(np.maximum.reduce(millis))
    if (last - first + 1) * width * width < 2**63:
        places = millis - first
    else:
        places = np.searchsorted(np.unique(millis), millis)
    if several_sensors:
        places = places * width + np.concatenate([t.sensors for t in frame.tables])
    keys: IntArray = places * width + targets
    return keys


def _distinct(keys: IntArray) -> int:
    """How many distinct keys there are (a sort and a comparison: ``np.unique`` costs more on a
    few keys)."""
    if not len(keys):
        return 0
    ordered = np.sort(keys)
    return 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))


def _sensor_parts(
    frame: HWPCFrame, reports: int, global_rows: list[npt.NDArray[np.bool_]]
) -> list[tuple[Hashable, Frame]]:
    """A frame's global reports, one part per sensor; ``reports`` is their count, kept on a
    frame of a single sensor.

    The global rows of a frame of one sensor (an input's frame is) are that sensor's, when
    there are any: the frame's sensors, which the router already asked for, say so."""
    if not reports:
        return []
    tables = [table.where(rows) for table, rows in zip(frame.tables, global_rows, strict=True)]
    only_global = HWPCFrame(frame.names, tables, None, frame.originals, sensor=frame.sensor)
    sensors = frame.sensors()
    if len(sensors) != 1:
        sensors = only_global.sensors()
    if len(sensors) == 1:
        part = HWPCFrame(only_global.names, only_global.tables, reports, sensor=sensors[0])
        return [(sensors[0], part)]
    return [(sensor, only_global.of_sensor(sensor)) for sensor in sensors]


def tick_intervals(ticks: IntArray, previous: int | None, period_ms: int) -> tuple[FloatArray, int]:
    """Seconds from each tick (ms) to the one before it, as ``timedelta.total_seconds()``
    computes them, and the first tick that has one: 1 when ``previous`` (the last tick already
    processed) is ``None``, the first tick then getting the configured period in its place."""
    gaps = np.diff(ticks, prepend=ticks[0] - period_ms if previous is None else previous)
    seconds: FloatArray = (gaps * 1000) / 1e6
    return seconds, 0 if previous is not None else 1


class Energy(NamedTuple):
    """The RAPL energy of a frame's global reports, one entry per tick, table, socket and event,
    in the order of the reports' ticks, groups, sockets and events."""

    tick: IntArray
    """Each entry's place in the frame's ticks (in the order they came)."""
    table: IntArray
    """Each entry's place in the RAPL tables."""
    row: IntArray
    """Each entry's row of its table: its report, socket and the first cpu giving the event."""
    column: IntArray
    """Each entry's column of its table."""
    event: IntArray
    """Each entry's event, a code into ``events``."""
    events: list[str]
    value: FloatArray
    socket: IntArray
    """Each entry's socket, as its row gives it."""
    target: IntArray
    """Each entry's target (a code into the frame's names), as its row gives it."""


def rapl_energy(tables: list[EventsTable], places: IntArray) -> Energy:
    """Each tick's energy per table, socket and RAPL event: from the first cpu giving the event,
    as every cpu of a socket repeats it. ``places``: each row's tick, its place among the
    frame's ticks in the order they came, for every table's rows end to end (:func:`_arrival`).

    A live sensor's tick is a few rows, where numpy's fixed cost per call, not the rows, is
    the work: each table gives its entries as one matrix (:func:`_table_energy`), put in
    order with one sort."""
    events = list(dict.fromkeys(t.events[c] for t in tables for c in rapl_columns(t.events)))
    stops = accumulate(len(table) for table in tables)
    parts = [
        _table_energy(at, table, places[stop - len(table) : stop], events)
        for at, (table, stop) in enumerate(zip(tables, stops, strict=True))
        if len(table)
    ]
    if not parts:
        entries, value = np.empty((len(_ENTRY_FIELDS), 0), dtype=np.int64), np.empty(0)
    elif len(parts) == 1:  # mostly: hwpc-sensor's one rapl group
        entries, value = parts[0]
    else:
        entries = np.concatenate([part[0] for part in parts], axis=1)
        value = np.concatenate([part[1] for part in parts])
    order = np.lexsort((entries[1], entries[4], entries[0], entries[3]))
    ordered = entries[:, order]
    return Energy(
        ordered[3],
        ordered[0],
        ordered[5],
        ordered[1],
        ordered[2],
        events,
        value[order],
        ordered[6],
        ordered[7],
    )


_ENTRY_FIELDS = ("table", "column", "event", "tick", "slot's first row", "row", "socket", "target")
"""The rows of :func:`_table_energy`'s matrix, each entry's."""


def _table_energy(
    at: int, table: EventsTable, tick: IntArray, events: list[str]
) -> tuple[IntArray, FloatArray]:
    """A table's (``at``: its place; ``tick``: each row's) RAPL energy, every RAPL event at
    once, unordered: a matrix of :data:`_ENTRY_FIELDS` rows, a column per entry, and each
    entry's value.

    The rows are put in order of their slot (tick and socket), the table's order kept within
    one; then each slot's first row giving each event is the least of its rows' positions
    where that event is not NaN."""
    columns = list(rapl_columns(table.events))
    event_columns = _event_columns(table.events, tuple(events))
    order = np.lexsort((table.sockets, tick))  # a stable sort: the table's order within a slot
    starts = run_starts(tick[order], table.sockets[order])
    values = table.values[order[:, None], columns]  # as the table holds them, in slot order
    count = len(order)
    position = np.where(np.isnan(values), count, np.arange(count)[:, None])
    found = np.minimum.reduceat(position, starts, axis=0)  # slots × events
    slot_at, event_at = (found < count).nonzero()
    taken = found[slot_at, event_at]
    entries = np.empty((len(_ENTRY_FIELDS), len(taken)), dtype=np.int64)
    entries[0] = at
    entries[1:3] = event_columns[:, event_at]
    rows = entries[5] = order[taken]
    entries[3] = tick[rows]
    entries[4] = order[starts[slot_at]]
    entries[6] = table.sockets[rows]
    entries[7] = table.targets[rows]
    return entries, values[taken, event_at].astype(np.float64)


@lru_cache(maxsize=1024)
def rapl_columns(events: tuple[str, ...]) -> tuple[int, ...]:
    """The columns of a table with these events that hold RAPL energy: worked out once per
    group's events (a sensor's tables keep theirs, tick after tick), not on every frame."""
    return tuple(c for c, event in enumerate(events) if event.startswith(RAPL_EVENT_PREFIX))


@lru_cache(maxsize=1024)
def _event_columns(events: tuple[str, ...], rapl_events: tuple[str, ...]) -> IntArray:
    """For a table with ``events``, each RAPL column and its event's code among
    ``rapl_events`` (the frame's), as two rows: the same for every tick of a sensor. Never
    changed by its callers, which only index it."""
    columns = rapl_columns(events)
    found: IntArray = np.array(
        [columns, [rapl_events.index(events[c]) for c in columns]], dtype=np.int64
    ).reshape(2, len(columns))
    return found


def _rapl_tables(frame: HWPCFrame) -> list[EventsTable]:
    """The tables of a frame that hold RAPL energy (``rapl``, or named after a CSV file)."""
    return [t for t in frame.tables if rapl_columns(t.events)]


def _arrival(tables: list[EventsTable]) -> tuple[IntArray, IntArray]:
    """The ticks of the tables' rows, in the order they first come, and each row's place among
    them (every table's rows end to end). Rows whose ticks go forward, as every input gives
    them, need no sort: a tick starts where the milliseconds change."""
    millis = (
        tables[0].millis  # mostly: hwpc-sensor's one rapl group, its rows as they are
        if len(tables) == 1
        else np.concatenate([np.empty(0, dtype=np.int64), *(t.millis for t in tables)])
    )
    if not np.count_nonzero(millis[1:] < millis[:-1]):
        new = np.empty(len(millis), dtype=np.bool_)
        new[:1] = True
        np.not_equal(millis[1:], millis[:-1], out=new[1:])
        places: IntArray = new.cumsum()
        places -= 1
        return millis[new], places
    ticks, first, inverse = np.unique(millis, return_index=True, return_inverse=True)
    rank = first.argsort()
    place = np.empty(len(rank), dtype=np.int64)
    place[rank] = np.arange(len(rank))
    return ticks[rank], place[inverse.reshape(-1)]


def tick_energy(frame: HWPCFrame) -> tuple[list[EventsTable], IntArray, Energy]:
    """A frame's tables that hold RAPL energy, its ticks in the order they came, and their
    energy (:func:`rapl_energy`): what the RAPL and node formulas read of a frame."""
    tables = _rapl_tables(frame)
    ticks, places = _arrival(tables)
    return tables, ticks, rapl_energy(tables, places)


def frame_of_global_reports(reports: list[Report], out: Output) -> HWPCFrame | None:
    """Global reports as one frame (:meth:`HWPCFrame.from_reports`), the way into a formula of
    reports that did not come as a frame; a second report of a tick, and a report a frame
    cannot hold, are dead letters. ``None`` when no report is left."""
    kept: dict[int, HWPCReport] = {}
    for report in reports:
        assert isinstance(report, HWPCReport)
        millis = to_millis(report.timestamp)
        if millis in kept:
            out.reject(
                report, f"tick at {report.timestamp.isoformat()} is not after the previous one"
            )
            continue
        kept[millis] = report
    frame, refused = HWPCFrame.from_reports(list(kept.values()))
    for report in refused:
        out.reject(report, "socket or cpu ids that are not plain numbers (such as '0')")
    return frame if len(frame) else None


@formulas.register("rapl")
class RaplFormula(Formula[RaplConfig]):
    """One instance per sensor: every socket of a sensor shares its tick timestamps.

    One way for every batch: reports become a frame (:meth:`HWPCFrame.from_reports`), each
    tick's interval is decided in turn (the unit of failure), and the power of every tick with
    an interval is worked out at once.
    """

    name: ClassVar[str] = "rapl"
    inputs: ClassVar[frozenset[str]] = frozenset({HWPCReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = RaplConfig
    replayable: ClassVar[bool] = False  # a tick is the unit of failure (process)

    def __init__(self, config: RaplConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.previous_ms: int | None = None
        self.period_ms = config.sensor_reports_frequency
        self.min_interval_s = config.sensor_reports_frequency / 4000.0

    def state(self) -> Saved:
        """The last tick: after a restart, the next one has its interval at once."""
        return encode_state(RaplState(previous_ms=self.previous_ms))

    def restore(self, state: Saved) -> None:
        self.previous_ms = decode_state(state, RaplState).previous_ms

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if (
            isinstance(report, HWPCReport)
            and report.target in GLOBAL_TARGETS
            and rapl_groups(report)
        ):
            return report.sensor
        return None

    @classmethod
    def frame_parts(cls, frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
        return global_parts(frame)

    def process(self, reports: Batch, out: Output) -> None:
        frame = hwpc_frame(reports, lambda batch: frame_of_global_reports(batch, out))
        if frame is None:
            return
        mark = out.mark()
        try:
            self._estimate(frame, out)
        except Exception as error:  # outside any tick's step: the frame is the unit
            out.fail(frame.reports(), error, unit="frame", since=mark)

    def _estimate(self, frame: HWPCFrame, out: Output) -> None:
        """Each tick's interval in turn, then the power of every tick that has one."""
        tables, ticks, energy = tick_energy(frame)
        first_negative = _first_negative(energy)
        intervals = np.full(len(ticks), np.nan)
        for at, millis in enumerate(ticks.tolist()):
            mark = out.mark()
            try:
                interval = self._tick(millis)
            except Exception as error:
                out.fail(
                    frame.of_ticks(ticks[at : at + 1]).reports(), error, unit="tick", since=mark
                )
                continue
            if isinstance(interval, str):
                self._reject(frame, ticks[at], interval, out)
            elif interval is None:
                out.absorb()
            elif at in first_negative:
                self._reject(
                    frame, ticks[at], _negative(frame, tables, energy, first_negative[at]), out
                )
            else:
                intervals[at] = interval
        self._emit(frame, tables, ticks, energy, intervals, out)

    def _tick(self, millis: int) -> float | str | None:
        """A tick's interval in s; ``None`` for a sensor's first tick (it only starts the
        first interval); or why the tick has none. The tick becomes the previous one unless
        it is not after it."""
        if self.config.compat is not None:
            # SmartWatts divides every tick's energy by the configured period, the first too.
            return self.period_ms / 1000.0
        previous, self.previous_ms = self.previous_ms, millis
        if previous is None:
            return None
        interval_s = ((millis - previous) * 1000) / 1e6
        if interval_s <= 0:
            self.previous_ms = previous
            return f"tick at {datetime_of(millis).isoformat()} is not after the previous one"
        if interval_s < self.min_interval_s:
            return (
                f"tick {interval_s * 1000:.0f} ms after the previous one, under a quarter of "
                f"the sensor period ({self.period_ms} ms)"
            )
        return interval_s

    @staticmethod
    def _reject(frame: HWPCFrame, millis: IntArray, reason: str, out: Output) -> None:
        """Dead-letter a tick's report."""
        for report in frame.of_ticks(np.array([millis])).reports():
            out.reject(report, reason)

    def _emit(
        self,
        frame: HWPCFrame,
        tables: list[EventsTable],
        ticks: IntArray,
        energy: Energy,
        intervals: FloatArray,
        out: Output,
    ) -> None:
        """The ``rapl`` PowerReports of every tick with an interval: one per socket and
        event, with SmartWatts' metadata."""
        seconds = intervals[energy.tick]
        kept = ~np.isnan(seconds)
        count = int(np.count_nonzero(kept))
        if not count:
            return
        value, tick, sockets, targets, event = (
            energy.value,
            energy.tick,
            energy.socket,
            energy.target,
            energy.event,
        )
        if count < len(kept):
            value, tick, sockets, targets, event, seconds = (
                value[kept],
                tick[kept],
                sockets[kept],
                targets[kept],
                event[kept],
                seconds[kept],
            )
        socket_ids = np.unique(sockets)
        socket_codes = socket_ids.searchsorted(sockets)
        domains = [e[len(RAPL_EVENT_PREFIX) :] for e in energy.events]
        millis = ticks[tick]
        sensor = frame.names[int(tables[0].sensors[0])]
        out.emit_frame(
            PowerFrame(
                sensor=sensor,
                millis=millis,
                targets=np.zeros(count, dtype=np.int64),
                target_names=["rapl"],
                power=value * RAPL_UNIT_J / seconds,
                metadata={
                    "scope": Column(event, [SCOPE_OF_DOMAIN.get(d, d.lower()) for d in domains]),
                    "socket": Column(socket_codes, [str(s) for s in socket_ids.tolist()]),
                    "formula": Column(event, list(energy.events)),
                    "ratio": np.ones(count),
                },
                report_metadata=frame.report_metadata(sensor, millis, targets),
            )
        )


def _first_negative(energy: Energy) -> dict[int, int]:
    """The first entry of negative energy of each tick that has one, by tick: mostly none,
    which one comparison tells."""
    negative = (energy.value < 0).nonzero()[0]
    if not len(negative):
        return {}
    ticks_with, first = np.unique(energy.tick[negative], return_index=True)
    return dict(zip(ticks_with.tolist(), negative[first].tolist(), strict=True))


def _negative(frame: HWPCFrame, tables: list[EventsTable], energy: Energy, entry: int) -> str:
    """Why a tick whose energy ``entry`` is negative is a dead letter."""
    table = tables[int(energy.table[entry])]
    event = energy.events[int(energy.event[entry])]
    value = frame.value(table, int(energy.row[entry]), int(energy.column[entry]))
    return f"negative energy delta {value} for {event}"
