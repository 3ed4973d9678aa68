"""Frames: many reports of one kind held as columns of numbers, for the pipeline's hot path.

PowerAPI's CSV input holds hwpc-sensor's counters one row per cpu and group, and SmartWatts'
output is four or five rows per input report. Handled one Python object per row, reading,
estimating and writing cost tens of microseconds per report. A frame carries the same reports as
numpy arrays from the input to the output: the CSV input parses a chunk of rows into an
:class:`HWPCFrame`, the formulas that know frames compute every tick of it with array operations
and emit a :class:`PowerFrame`, and the CSV and JSON Lines outputs format a :class:`PowerFrame`
a column at a time (:mod:`wattflow.formats.report_table`).

A frame stands for an exact list of reports, those the row-by-row way makes from the same input:
:meth:`Frame.reports` builds them, and every actor that does not know frames (another output, a
formula, a dead letter) gets those. ``len(frame)`` is that number of reports, which is what
mailboxes bound and the ledger counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from itertools import chain
from typing import Any, ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import (
    CPU_LIMIT,
    SOCKET_LIMIT,
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    number_below,
    to_millis,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Values = npt.NDArray[np.number[Any]]
"""Counter values: integers as sensors write them, or floats (NaN: an event a cpu lacks) in a
frame made from reports that hold floats or cpus with other events."""
ReportKey = tuple[int, str, str]
"""(timestamp ms, sensor, target): the report a frame's rows belong to."""


class Frame(ABC):
    """Many reports of one kind, as columns."""

    kind: ClassVar[str]

    @abstractmethod
    def __len__(self) -> int:
        """The number of reports the frame stands for."""

    @abstractmethod
    def reports(self) -> list[Report]:
        """The reports the frame stands for, in order."""


def run_starts(*columns: IntArray) -> IntArray:
    """Where each run of rows equal in every column starts (the first row always does)."""
    change = np.empty(len(columns[0]), dtype=np.bool_)
    if len(change):
        change[0] = True
        np.not_equal(columns[0][1:], columns[0][:-1], out=change[1:])
        for column in columns[1:]:
            change[1:] |= column[1:] != column[:-1]
    found: IntArray = change.nonzero()[0]
    return found


@dataclass(frozen=True, slots=True, eq=False)
class EventsTable:
    """One events group's rows, as one of PowerAPI's per-group CSV files holds them.

    Rows keep the file's order. Sensors and targets are codes into the frame's ``names``;
    sockets and cpus are the numbers the file writes (their text is ``str`` of them).
    """

    group: str
    events: tuple[str, ...]
    millis: IntArray
    sensors: IntArray
    targets: IntArray
    sockets: IntArray
    cpus: IntArray
    values: Values  # rows × events

    def __len__(self) -> int:
        return len(self.millis)

    def _each(self, pick: Callable[[str], Any]) -> EventsTable:
        """A table of the same group whose every column is ``pick`` of its name: the same
        rows of each (:data:`ROW_COLUMNS`)."""
        return EventsTable(self.group, self.events, *map(pick, ROW_COLUMNS))

    def rows(self, start: int, stop: int) -> EventsTable:
        """Rows ``start`` to ``stop`` (views, no copy)."""
        return self._each(lambda name: getattr(self, name)[start:stop])

    def own_rows(self, start: int) -> EventsTable:
        """Rows ``start`` to the end, as arrays of their own: a part that is kept while the
        rest is let go (a view would keep every row of the table alive with it)."""
        if not start:
            return self
        return self._each(lambda name: getattr(self, name)[start:].copy())

    def then(self, later: EventsTable) -> EventsTable:
        """These rows followed by ``later``'s (same group and events, same name codes)."""
        return self._each(lambda name: np.concatenate((getattr(self, name), getattr(later, name))))

    def where(self, mask: npt.NDArray[np.bool_]) -> EventsTable:
        """The rows ``mask`` selects, in order: views (as :meth:`rows`) where they are one run
        of rows, as a report's rows mostly are, which spares copying every column."""
        count = int(np.count_nonzero(mask))
        if count == len(mask):
            return self
        chosen = np.flatnonzero(mask)
        if count and int(chosen[-1]) - int(chosen[0]) == count - 1:
            return self.rows(int(chosen[0]), int(chosen[-1]) + 1)
        return self._each(lambda name: getattr(self, name)[chosen])


ROW_COLUMNS = ("millis", "sensors", "targets", "sockets", "cpus", "values")
"""An :class:`EventsTable`'s columns with one entry per row, in the order it takes them."""


def canonical_rows(tables: Sequence[EventsTable]) -> bool:
    """Whether each table's rows come in tick order, and a report's rows of one socket
    together, each cpu once among them: the rows array code can take as they are (SmartWatts'
    tick assembly does). PowerAPI's CSV input may give others (its row-by-row reading merges
    them); :meth:`HWPCFrame.from_reports` of the frame's reports makes them so."""
    for table in tables:
        if not len(table):
            continue
        if bool((table.millis[1:] < table.millis[:-1]).any()):
            return False
        starts = run_starts(table.millis, table.targets, table.sockets)
        if not _segments_unique(table, starts):
            return False
        if not _cpus_unique(table.cpus, starts):
            return False
    return True


def _segments_unique(table: EventsTable, starts: IntArray) -> bool:
    """Whether no (tick, target, socket) starts two segments (rows in tick order).

    One int64 key per segment: its tick's place among the table's ticks, target code and
    socket, in mixed radix. The tick's place (not its milliseconds, which span 3·10¹⁴) is below
    the number of segments, the target below the frame's names and the socket below
    :data:`~wattflow.formats.reports.SOCKET_LIMIT` (every input refuses larger ones): the
    product fits 63 bits unless a table holds billions of rows, and then the segments are
    compared as rows of three columns instead."""
    millis = table.millis[starts]
    tick = np.zeros(len(starts), dtype=np.int64)
    np.cumsum(millis[1:] != millis[:-1], out=tick[1:])
    targets, sockets = table.targets[starts], table.sockets[starts]
    width = int(targets.max()) + 1
    span = int(sockets.max()) + 1
    if (int(tick[-1]) + 1) * width * span < 2**63:
        keys = (tick * width + targets) * span + sockets
        return len(np.unique(keys)) == len(keys)
    rows = np.unique(np.stack((tick, targets, sockets), axis=1), axis=0)
    return len(rows) == len(starts)


def _cpus_unique(cpus: IntArray, starts: IntArray) -> bool:
    """Whether no cpu comes twice in one segment."""
    segment_start = np.zeros(len(cpus), dtype=np.bool_)
    segment_start[starts] = True
    rising = np.empty(len(cpus), dtype=np.bool_)
    rising[0] = True
    rising[1:] = cpus[1:] > cpus[:-1]
    if bool((rising | segment_start).all()):
        return True
    segment = np.cumsum(segment_start)
    # Segments are at most the rows and cpus below CPU_LIMIT (2**20, which every input keeps):
    # the key stays below 2**63 for any table that fits in memory (2**43 rows).
    keys = segment * (int(cpus.max()) + 1) + cpus
    return len(np.unique(keys)) == len(keys)


class HWPCFrame(Frame):
    """hwpc-sensor reports of whole ticks, as the rows of each events group.

    The reports are those PowerAPI's CSV input merges from the same rows: one per timestamp,
    sensor and target, holding every group with rows for it. Ticks come in timestamp order.
    """

    kind: ClassVar[str] = HWPCReport.kind

    __slots__ = ("canonical", "count", "memo", "names", "originals", "sensor", "tables")

    def __init__(
        self,
        names: list[str],
        tables: list[EventsTable],
        count: int | None = None,
        originals: dict[ReportKey, HWPCReport] | None = None,
        *,
        canonical: bool = False,
        sensor: str | None = None,
    ):
        self.names = names
        """The texts the sensor and target codes stand for. Never changed once a frame has it:
        an input hands the same list to a sensor's frames batch after batch (a name may be in
        it that the frame's rows do not use), so that they join without new codes."""
        self.tables = tables
        self.count = count
        """The number of reports, counted when first asked for."""
        self.memo: dict[str, Any] = {}
        """What consumers derived from the frame, kept for the next one: a frame never changes,
        and several formulas may ask for the same part of it."""
        self.originals = originals
        """The reports a frame made by :meth:`from_reports` stands for, by key: :meth:`reports`
        gives those objects back (metadata and the counters' own types included), and a part
        of the frame keeps the whole dict, looked up by key."""
        self.canonical = canonical
        """Whether the frame's maker built its rows canonical (:func:`canonical_rows`), so
        that a consumer may skip that check; ``False`` says nothing either way. The JSON inputs'
        decoder promises it: it places whole lines, each tick after the one before, each
        (tick, target) once, each socket's cpus together and each once."""
        self.sensor = sensor
        """The sensor of every row, where the frame's maker knows there is one (the JSON
        inputs' decoder makes a frame per sensor), so that :meth:`sensors` need not look at
        the rows: the router asks it of every frame. ``None`` says nothing either way."""

    @classmethod
    def from_reports(cls, reports: Sequence[HWPCReport]) -> tuple[HWPCFrame, list[HWPCReport]]:
        """A frame of any reports, one per (timestamp ms, sensor, target), in their order.

        The way into the frame engine for reports that did not come as frames (a batch with
        metadata, float counters, another order...). A group's events are those any of its cpus
        has, in the order they first come; its values are floats, NaN where a cpu lacks an
        event, unless every cpu has every event as an integer. Also returns the reports the
        frame cannot hold: those without a single cpu, and those whose socket or cpu ids are
        not plain numbers (``"0"``, not ``"00"``).
        """
        names: dict[str, int] = {}
        groups: dict[str, _GroupRows] = {}
        originals: dict[ReportKey, HWPCReport] = {}
        refused: list[HWPCReport] = []
        for report in reports:
            millis = to_millis(report.timestamp)
            sensor = names.setdefault(report.sensor, len(names))
            target = names.setdefault(report.target, len(names))
            cells = _cells(report)
            if cells is None:
                refused.append(report)
                continue
            originals[(millis, report.sensor, report.target)] = report
            for group, socket, cpu, events in cells:
                rows = groups.get(group)
                if rows is None:
                    rows = groups[group] = _GroupRows()
                rows.keys.append((millis, sensor, target, socket, cpu))
                rows.events.append(events)
        tables = [rows.table(group) for group, rows in groups.items()]
        return cls(list(names), tables, len(originals), originals), refused

    def __len__(self) -> int:
        if self.count is None:
            self.count = _count_reports(self.tables, len(self.names))
        return self.count

    def sensors(self) -> list[str]:
        """The sensors with rows in this frame, in code order.

        Worked out once per frame (kept in :attr:`memo`): the router asks it of every frame
        for SmartWatts, :meth:`of_sensor` and the RAPL formula's parts again, and on a live
        sensor's one-tick frame numpy's fixed cost per call is most of the work."""
        found: list[str] | None = self.memo.get("sensors")
        if found is None:
            found = self.memo["sensors"] = self._sensors()
        return list(found)

    def _sensors(self) -> list[str]:
        """:meth:`sensors`, worked out: mostly a frame of one sensor (an input's frame is),
        which one comparison per table shows."""
        columns = [t.sensors for t in self.tables if len(t)]
        if not columns:
            return []
        if self.sensor is not None:
            return [self.sensor]
        first = int(columns[0][0])
        if all(not np.count_nonzero(column != first) for column in columns):
            return [self.names[first]]
        codes = np.unique(np.concatenate(columns))
        return [self.names[code] for code in codes.tolist()]

    def of_sensor(self, sensor: str) -> HWPCFrame:
        """The frame's rows of one sensor (the frame itself when it holds no other)."""
        code = self.names.index(sensor)
        if self.sensors() in ([sensor], []):
            return self
        return self._part([t.where(t.sensors == code) for t in self.tables])

    def of_ticks(self, millis: IntArray, *, invert: bool = False) -> HWPCFrame:
        """The frame's rows of the ticks at ``millis`` (or of every other tick)."""
        return self._part([t.where(np.isin(t.millis, millis, invert=invert)) for t in self.tables])

    def of_reports(self, millis: IntArray, targets: IntArray) -> HWPCFrame:
        """The frame's rows of the reports of these ticks and targets (codes), pair by pair."""
        width = len(self.names)
        everything = np.concatenate([millis, *(t.millis for t in self.tables)])
        if not len(everything):
            return self._part(list(self.tables))
        first = int(everything.min())
        ticks = None
        if (int(everything.max()) - first + 1) * width >= 2**63:
            # Ticks centuries apart with many names: ticks by their place among them, so
            # that no key wraps around.
            ticks = np.unique(everything)

        def keys(stamps: IntArray, codes: IntArray) -> IntArray:
            numbers = stamps - first if ticks is None else np.searchsorted(ticks, stamps)
            found: IntArray = numbers * width + codes
            return found

        wanted = keys(millis, targets)
        tables = self.tables
        return self._part([t.where(np.isin(keys(t.millis, t.targets), wanted)) for t in tables])

    def _part(self, tables: list[EventsTable]) -> HWPCFrame:
        return HWPCFrame(self.names, tables, None, self.originals, sensor=self.sensor)

    def value(self, table: EventsTable, row: int, column: int) -> int | float:
        """A counter as its report gave it: an integer stays one in a table of floats."""
        value: int | float = table.values[row, column].item()
        if self.originals:
            names = self.names
            key = (int(table.millis[row]), names[table.sensors[row]], names[table.targets[row]])
            report = self.originals.get(key)
            if report is not None:
                cpus = report.groups[table.group][str(table.sockets[row])]
                value = cpus[str(table.cpus[row])].get(table.events[column], value)
        return value

    def report_metadata(
        self, sensor: str, millis: IntArray, targets: IntArray
    ) -> list[dict[str, Any]] | None:
        """The metadata of the reports of ``sensor`` at these ticks and targets (codes), pair
        by pair, for the PowerReports made from them; ``None`` when no report has any."""
        originals = self.originals
        if not originals or not any(report.metadata for report in originals.values()):
            return None
        names = self.names
        found = []
        for tick, code in zip(millis.tolist(), targets.tolist(), strict=True):
            report = originals.get((tick, sensor, names[code]))
            found.append(report.metadata if report is not None else {})
        return found

    def after(self, millis: int) -> tuple[HWPCFrame | None, HWPCFrame | None]:
        """The ticks up to ``millis`` and those after it, either ``None`` when empty."""
        cuts = [int(np.searchsorted(t.millis, millis, side="right")) for t in self.tables]
        if not any(cuts) and self.originals is None:  # all of it after millis, as it is
            return None, (self if _has_rows(self.tables) else None)
        upto = [t.rows(0, cut) for t, cut in zip(self.tables, cuts, strict=True)]
        # The later part keeps only its own rows and reports: a formula holds it while more
        # ticks come, and holding views would keep the whole frame alive as long.
        later = [t.own_rows(cut) for t, cut in zip(self.tables, cuts, strict=True)]
        first = self._part(upto) if _has_rows(upto) else None
        if not _has_rows(later):
            return first, None
        originals = self._originals_after(millis)
        return first, HWPCFrame(self.names, later, None, originals, sensor=self.sensor)

    def _originals_after(self, millis: int) -> dict[ReportKey, HWPCReport] | None:
        """The reports this frame was made of that come after ``millis``: the later part's
        own, so that it does not keep the earlier ones alive."""
        if not self.originals:
            return None
        return {key: r for key, r in self.originals.items() if key[0] > millis} or None

    def joined(self, later: HWPCFrame) -> HWPCFrame:
        """This frame followed by a later one: each group's rows followed by the later frame's
        rows of that group, the groups only the later frame has after this frame's.

        Raises:
            ValueError: when a group has other events in the later frame.
        """
        names, mine, theirs = self._recoded(later)
        following = {table.group: table for table in theirs}
        together: list[EventsTable] = []
        for table in mine:
            more = following.pop(table.group, None)
            if more is None:
                together.append(table)
            elif more.events != table.events:
                raise ValueError(f"frames with other events in group {table.group!r}")
            else:
                together.append(table.then(more))
        together.extend(following.values())
        originals = self.originals
        if later.originals is not None:
            originals = {**(originals or {}), **later.originals}
        count = None if self.count is None or later.count is None else self.count + later.count
        sensor = self.sensor if self.sensor == later.sensor else None
        return HWPCFrame(names, together, count, originals, sensor=sensor)

    def _recoded(self, later: HWPCFrame) -> tuple[list[str], list[EventsTable], list[EventsTable]]:
        """Names for both frames' rows, and each frame's tables with codes into them.

        A later frame of the same input mostly has this frame's names, or more after them: then
        no code changes. Otherwise the later frame's names are kept, followed by those of this
        frame's rows it lacks, and this frame's codes change: the names of a sensor's pending
        ticks so follow its input's, rather than growing with every container ever seen."""
        names = later.names
        mine = self.names
        if names is mine or (len(names) >= len(mine) and names[: len(mine)] == mine):
            return names, self.tables, later.tables
        index = {name: code for code, name in enumerate(names)}
        used = np.unique(
            np.concatenate(
                [np.empty(0, np.int64)]
                + [t.sensors for t in self.tables]
                + [t.targets for t in self.tables]
            )
        )
        recode = np.zeros(len(mine), dtype=np.int64)
        recode[used] = [index.setdefault(mine[code], len(index)) for code in used.tolist()]
        if len(index) > len(names):
            names = list(index)
        tables = [
            EventsTable(
                t.group,
                t.events,
                t.millis,
                recode[t.sensors],
                recode[t.targets],
                t.sockets,
                t.cpus,
                t.values,
            )
            for t in self.tables
        ]
        return names, tables, later.tables

    def reports(self) -> list[Report]:
        """The reports, merged as PowerAPI's CSV input merges the rows of its files.

        For each tick: the files in order, each (sensor, target) in the order its first row
        comes; in a report, groups in file order, sockets and cpus in row order, events in
        the file's column order; a cpu given twice keeps the later values. A frame made by
        :meth:`from_reports` gives back the reports it was made of.
        """
        names = self.names
        originals = self.originals or {}
        tables = [
            (
                t.group,
                t.events,
                t.millis.tolist(),
                t.sensors.tolist(),
                t.targets.tolist(),
                list(map(str, t.sockets.tolist())),
                list(map(str, t.cpus.tolist())),
                t.values.tolist(),
            )
            for t in self.tables
        ]
        at = [0] * len(tables)
        ticks = np.unique(np.concatenate([t.millis for t in self.tables])).tolist()
        reports: list[Report] = []
        for millis in ticks:
            pending: dict[tuple[int, int], dict[str, dict[str, dict[str, dict[str, int]]]]] = {}
            for number, (
                group,
                events,
                stamps,
                sensors,
                targets,
                sockets,
                cpus,
                values,
            ) in enumerate(tables):
                row = at[number]
                end = len(stamps)
                while row < end and stamps[row] == millis:
                    key = (sensors[row], targets[row])
                    groups = pending.get(key)
                    if groups is None:
                        groups = pending[key] = {}
                    cpu_events = groups.setdefault(group, {}).setdefault(sockets[row], {})
                    counters = dict(zip(events, values[row], strict=True))
                    found = cpu_events.get(cpus[row])
                    if found is None:
                        cpu_events[cpus[row]] = counters
                    else:
                        found.update(counters)
                    row += 1
                at[number] = row
            timestamp = datetime_of(millis)
            for (sensor, target), groups in pending.items():
                original = originals.get((millis, names[sensor], names[target]))
                if original is not None:
                    reports.append(original)
                    continue
                reports.append(
                    HWPCReport.trusted(
                        timestamp=timestamp,
                        sensor=names[sensor],
                        target=names[target],
                        metadata={},
                        groups=groups,
                    )
                )
        return reports


class _GroupRows:
    """One group's rows while :meth:`HWPCFrame.from_reports` reads reports."""

    __slots__ = ("events", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int, int, int]] = []
        """(millis, sensor, target, socket, cpu) of each row."""
        self.events: list[dict[str, int | float]] = []

    def table(self, group: str) -> EventsTable:
        """The rows as columns: integers when every cpu has every event as an integer, else
        floats with NaN for the events a cpu lacks."""
        names = tuple(dict.fromkeys(chain.from_iterable(self.events)))
        if all(tuple(events) == names for events in self.events):
            rows = [list(events.values()) for events in self.events]
        else:
            rows = [[events.get(name, np.nan) for name in names] for events in self.events]
        values: Values = np.array(rows, dtype=np.float64)
        if all(type(value) is int for value in chain.from_iterable(rows)):
            with suppress(OverflowError):  # beyond 64 bits: floats, which say as much of it
                values = np.array(rows, dtype=np.int64)
        millis, sensors, targets, sockets, cpus = np.array(self.keys, dtype=np.int64).T
        return EventsTable(
            group,
            names,
            millis,
            sensors,
            targets,
            sockets,
            cpus,
            values.reshape(len(rows), len(names)),
        )


def _cells(report: HWPCReport) -> list[tuple[str, int, int, dict[str, Any]]] | None:
    """A report's (group, socket, cpu, events), or ``None`` when it has no cpu or an id is not
    a plain number (a frame holds ids as numbers, and writes them back as their text) below its
    bound (:data:`~wattflow.formats.reports.SOCKET_LIMIT`,
    :data:`~wattflow.formats.reports.CPU_LIMIT`: the inputs refuse any other, but a report
    made otherwise may carry one)."""
    cells = []
    for group, sockets in report.groups.items():
        for socket, cpus in sockets.items():
            socket_id = _plain_id(socket, SOCKET_LIMIT)
            for cpu, events in cpus.items():
                cpu_id = _plain_id(cpu, CPU_LIMIT)
                if socket_id is None or cpu_id is None:
                    return None
                cells.append((group, socket_id, cpu_id, events))
    return cells or None


def _plain_id(text: str, limit: int) -> int | None:
    if not number_below(text, limit):
        return None
    return int(text) if str(int(text)) == text else None


def _has_rows(tables: Sequence[EventsTable]) -> bool:
    """Whether a part of a frame holds any tick: an empty part is ``None``, not a frame."""
    return any(len(table) for table in tables)


def _count_reports(tables: list[EventsTable], width: int) -> int:
    """Distinct (timestamp, sensor, target) among the tables' rows."""
    stamps: list[IntArray] = []
    pairs: list[IntArray] = []
    for table in tables:
        if not len(table):
            continue
        pair = table.sensors * width + table.targets
        starts = run_starts(pair, table.millis)
        stamps.append(table.millis[starts])
        pairs.append(pair[starts])
    if not stamps:
        return 0
    millis = np.concatenate(stamps)
    pair = np.concatenate(pairs)
    first = int(millis.min())
    span = int(millis.max()) - first + 1
    if span * width * width < 2**62:  # one integer key per report: a flat sort
        return len(np.unique((millis - first) * (width * width) + pair))
    return len(np.unique(np.stack((millis, pair), axis=1), axis=0))


@dataclass(slots=True, eq=False)
class Column:
    """A metadata column: each row's code into ``values`` (few distinct values, e.g. a scope)."""

    codes: IntArray
    values: list[Any]


class PowerFrame(Frame):
    """PowerReports as columns: one row per report, with metadata columns.

    ``metadata`` maps each key to a :class:`Column` of coded values or a float array (the
    ``ratio``); every row has every key, in ``metadata``'s order, as the formulas that make
    frames write them.
    """

    kind: ClassVar[str] = PowerReport.kind

    __slots__ = (
        "metadata",
        "millis",
        "power",
        "report_metadata",
        "sensor",
        "target_names",
        "targets",
    )

    def __init__(
        self,
        *,
        sensor: str,
        millis: IntArray,
        targets: IntArray,
        target_names: list[str],
        power: FloatArray,
        metadata: dict[str, Column | FloatArray],
        report_metadata: list[dict[str, Any]] | None = None,
    ) -> None:
        self.sensor = sensor
        self.millis = millis
        self.targets = targets
        self.target_names = target_names
        self.power = power
        self.metadata = metadata
        self.report_metadata = report_metadata
        """Each row's metadata from its input report, before the columns (SmartWatts copies
        the target's report's, or the global report's): the file outputs write each row's
        metadata then as its dict (see :mod:`wattflow.formats.report_table`), other outputs
        the frame's reports."""

    def __len__(self) -> int:
        return len(self.millis)

    def metadata_rows(self) -> list[dict[str, Any]]:
        """Each row's metadata dict, keys in the frame's order."""
        columns: list[list[Any]] = []
        for column in self.metadata.values():
            if isinstance(column, Column):
                values = column.values
                columns.append([values[code] for code in column.codes.tolist()])
            else:
                columns.append(column.tolist())
        keys = list(self.metadata)
        rows = [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
        if self.report_metadata is None:
            return rows
        return [{**own, **row} for own, row in zip(self.report_metadata, rows, strict=True)]

    def reports(self) -> list[Report]:
        names = self.target_names
        sensor = self.sensor
        timestamps = _Timestamps()
        return [
            PowerReport.trusted(
                timestamp=timestamps.of(millis),
                sensor=sensor,
                target=names[target],
                power=power,
                metadata=metadata,
            )
            for millis, target, power, metadata in zip(
                self.millis.tolist(),
                self.targets.tolist(),
                self.power.tolist(),
                self.metadata_rows(),
                strict=True,
            )
        ]


FormulaRow: TypeAlias = tuple[int, str, tuple[Any, ...]]
"""A FormulaReport in a :class:`FormulaFrame`: timestamp ms, target, metadata values."""


class FormulaFrame(Frame):
    """FormulaReports kept as the few values they are built from, built only when asked for.

    SmartWatts describes its model on every estimate; most deployments write no FormulaReports,
    so building them for every tick would be work thrown away. So would formatting its
    coefficients: a value that is a numpy array stands for numpy's text of it (``str``), made
    once per array when the reports are built.
    """

    kind: ClassVar[str] = FormulaReport.kind

    __slots__ = ("_count", "_make", "_rows", "keys", "sensor")

    def __init__(
        self,
        sensor: str,
        keys: tuple[str, ...],
        rows: list[FormulaRow] | None = None,
        *,
        later: tuple[int, Callable[[], list[FormulaRow]]] | None = None,
    ) -> None:
        """``rows``, or ``later``: how many rows there are and what makes them, called the
        first time they are read (SmartWatts keeps a replay's descriptions as columns, and
        making a row of each is most of their cost)."""
        self.sensor = sensor
        self.keys = keys
        self._rows = rows
        self._make: Callable[[], list[FormulaRow]] | None = None
        self._count = len(rows or ())
        if later is not None:
            self._count, self._make = later

    @property
    def rows(self) -> list[FormulaRow]:
        """(timestamp ms, target, metadata values in ``keys``' order) of each report."""
        if self._rows is None:
            assert self._make is not None
            self._rows, self._make = self._make(), None
        return self._rows

    def __len__(self) -> int:
        return self._count

    def reports(self) -> list[Report]:
        keys = self.keys
        timestamps = _Timestamps()
        texts: dict[int, str] = {}
        return [
            FormulaReport.trusted(
                timestamp=timestamps.of(millis),
                sensor=self.sensor,
                target=target,
                metadata={
                    key: _text(value, texts) for key, value in zip(keys, values, strict=True)
                },
            )
            for millis, target, values in self.rows
        ]


def _text(value: Any, texts: dict[int, str]) -> Any:
    """A FormulaFrame's value as its report holds it: an array as its text, made once."""
    if not isinstance(value, np.ndarray):
        return value
    found = texts.get(id(value))
    if found is None:
        found = texts[id(value)] = str(value)
    return found


class _Timestamps:
    """The datetimes of one frame's ticks, each converted once: the reports of a tick share
    one object, which encoders then format once."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[int, datetime] = {}

    def of(self, millis: int) -> datetime:
        found = self._known.get(millis)
        if found is None:
            found = self._known[millis] = datetime_of(millis)
        return found
