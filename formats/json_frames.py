"""hwpc-sensor's JSON reports read into frames: the live inputs' way into the frame engine.

hwpc-sensor writes one JSON object per report to its socket (and to files and ZeroMQ), and a
node of a hundred containers writes a hundred of them a second. Made into one Python object per
report, then summed per socket and estimated one target at a time, they cost about ten times what
parsing them costs. Here a batch of lines becomes one :class:`~wattflow.formats.frames.HWPCFrame`
per sensor. Two ways make the same frames: wattflow's C parser of hwpc-sensor's form
(``_hwpc_lines``, :func:`compiled_hwpc_frames`) writes the counters straight into int64 columns
and numpy checks and assembles them; where it declines a batch, or was not built, msgspec checks
and parses each line in C (integer counters only), each cpu's counters are kept as parsed, and
numpy takes each group's values in one pass into its columns. The formulas that know frames
estimate every tick of it with array operations, as they do for PowerAPI's CSV files.

A frame stands for exactly the reports the lines decode to one by one
(:func:`~wattflow.formats.powerapi.decode_json_lines`), so a batch becomes a frame only when
every line is plain: it decodes, carries no metadata, has a timestamp of whole milliseconds not
earlier than the line before, names a (timestamp, sensor, target) no other line of the batch
names, holds only integer counters that fit 64 bits, writes sockets and cpus as plain numbers
(``"0"``, not ``"00"`` or ``"-1"``) within bounds (sockets below 65,536, cpus below
1,048,576: :data:`~wattflow.formats.reports.SOCKET_LIMIT`,
:data:`~wattflow.formats.reports.CPU_LIMIT`), gives every group at least one socket (a
report whose group is empty has no row to stand for it) and every cpu of a group the same
events (one or more), and comes in the order the frame gives its reports back. Anything else
(hostile input included) leaves the batch to the line-by-line way, which decodes, and
dead-letters, exactly as it always did. A frame gives each cpu's events back in its group's
order, which is hwpc-sensor's order; a sensor that wrote them in another order on some cpus
gets the same counters back in the group's order.

So placed, a frame's rows are canonical (:attr:`~wattflow.formats.frames.HWPCFrame.canonical`:
ticks in order, each report's rows of a socket together, each cpu once among them), and the
frames say so: SmartWatts then takes them as they are, without checking.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain
from typing import Annotated, Any

import msgspec
import numpy as np

from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import EventsTable, HWPCFrame, IntArray
from wattflow.formats.powerapi import (
    FIRST_MILLIS,
    LAST_MILLIS,
    HwpcDocument,
    decode_json_lines,
    from_mongodb,
    utc_or_none,
)
from wattflow.formats.reports import (
    CPU_LIMIT,
    SOCKET_LIMIT,
    HWPCReport,
    Report,
    to_millis,
    to_utc,
)

try:
    from wattflow.formats import _hwpc_lines
except ImportError:  # built without a C compiler: the Python way only
    _hwpc_lines = None  # type: ignore[assignment]


class _WholeDocument(msgspec.Struct, gc=False):
    """hwpc-sensor's JSON report as :class:`~wattflow.formats.powerapi.HwpcDocument` checks
    it, with integer counters only, which is all a frame holds: a line with any other counter
    is not plain."""

    timestamp: int | float | str
    sensor: Annotated[str, msgspec.Meta(min_length=1)]
    target: Annotated[str, msgspec.Meta(min_length=1)]
    groups: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    metadata: dict[str, Any] = {}


_decode_whole = msgspec.json.Decoder(_WholeDocument).decode


class _NotPlain(Exception):
    """A line the frame cannot stand for: the batch goes the line-by-line way."""


class _Cut(Exception):
    """A line the frame cannot place after the lines before it (its groups come in another
    order than the frame's tables): it starts the next frame."""


class _GroupRows:
    """One events group's rows while a batch is read: per line, per socket, then per cpu."""

    __slots__ = ("counters", "cpu_texts", "events", "line_millis", "line_rows",
                 "line_sensors", "line_targets", "pick", "rank", "socket_rows", "socket_texts",
                 "width")  # fmt: skip

    def __init__(self, events: tuple[str, ...], rank: int) -> None:
        self.events = events
        self.width = len(events)
        self.pick: Callable[[dict[str, Any]], Any] = operator.itemgetter(*events)
        self.rank = rank
        """The group's place among the batch's groups: the frame gives a tick's reports back in
        the order of their first group's place."""
        self.line_millis: list[int] = []
        self.line_sensors: list[int] = []
        self.line_targets: list[int] = []
        self.line_rows: list[int] = []
        self.socket_texts: list[str] = []
        self.socket_rows: list[int] = []
        self.cpu_texts: list[str] = []
        self.counters: list[dict[str, Any]] = []
        """Each cpu's counters, as decoded: taken in the group's event order by :meth:`table`,
        in one pass over the batch."""

    def add(self, sockets: dict[str, dict[str, dict[str, Any]]]) -> None:
        """One line's rows of this group: each socket's cpus and their counters."""
        if not sockets:
            # No row would stand for it: the frame would count the report and never give it
            # back (nor its empty group, when it has others).
            raise _NotPlain("a group without sockets")
        width = self.width
        rows = 0
        for socket_text, cpus in sockets.items():
            count = len(cpus)
            # Each cpu must have exactly the group's events: one with more would lose them,
            # and with the sum right, any cpu with more means one with fewer, which ``pick``
            # refuses (KeyError) in :meth:`table`.
            if not count or sum(map(len, cpus.values())) != width * count:
                raise _NotPlain("a socket without cpus, or cpus with other events")
            self.socket_texts.append(socket_text)
            self.socket_rows.append(count)
            self.cpu_texts.extend(cpus)
            self.counters.extend(cpus.values())
            rows += count
        self.line_rows.append(rows)

    def table(self, group: str) -> EventsTable:
        counts = np.array(self.line_rows, dtype=np.int64)
        picked = map(self.pick, self.counters)
        # The counters are Python integers (the decoders refuse anything else), which numpy
        # takes one by one in C; one beyond 64 bits overflows.
        try:
            values = np.fromiter(
                chain.from_iterable(picked) if self.width > 1 else picked,
                dtype=np.int64,
                count=self.width * len(self.counters),
            )
        except OverflowError:
            raise _NotPlain("a counter beyond 64 bits") from None
        sockets = np.repeat(_numbers(self.socket_texts, SOCKET_LIMIT), self.socket_rows)
        return EventsTable(
            group,
            self.events,
            np.repeat(np.array(self.line_millis, dtype=np.int64), counts),
            np.repeat(np.array(self.line_sensors, dtype=np.int64), counts),
            np.repeat(np.array(self.line_targets, dtype=np.int64), counts),
            sockets,
            _numbers(self.cpu_texts, CPU_LIMIT),
            values.reshape(-1, self.width),
        )


def _numbers(texts: list[str], limit: int) -> IntArray:
    """Socket or cpu keys as the numbers a frame holds; only keys that are their number's text
    (``"0"``, ``"12"``, not ``"-1"``), since the frame writes them back as ``str`` of the number,
    and below ``limit`` (:data:`~wattflow.formats.reports.SOCKET_LIMIT` or
    :data:`~wattflow.formats.reports.CPU_LIMIT`): a batch with another goes the line-by-line
    way, which refuses the report that carries it."""
    known: dict[str, int] = {}
    for text in set(texts):
        try:
            number = int(text)
        except ValueError:
            raise _NotPlain("a socket or cpu that is not a number") from None
        if str(number) != text or number < 0:
            # A frame's rows are placed by their socket and cpu numbers: "-1" is not one of
            # them (nor for :meth:`~wattflow.formats.frames.HWPCFrame.from_reports`).
            raise _NotPlain("a socket or cpu written another way than its number")
        if number >= limit:
            raise _NotPlain("a socket or cpu number out of bounds")
        known[text] = number
    numbers: IntArray = np.fromiter(map(known.__getitem__, texts), dtype=np.int64, count=len(texts))
    return numbers


def _millis_of(raw: int | float | str) -> int:
    """A line's timestamp in Unix milliseconds, when a frame can hold it."""
    timestamp = utc_or_none(raw)
    if timestamp is None or timestamp.microsecond % 1000:
        raise _NotPlain("a timestamp the frame cannot hold")
    millis = to_millis(timestamp)
    if not FIRST_MILLIS <= millis <= LAST_MILLIS:
        raise _NotPlain("a timestamp out of range")
    return millis


Groups = tuple[tuple[str, tuple[str, ...]], ...]
"""A sensor's groups and each group's events, in the order its frames' tables hold them."""

NAMES_LIMIT = 1024
"""The most names (the sensor and its targets) an input remembers of a sensor: beyond it, the
next batch codes its names afresh. Containers come and go, each under a new name; a table that
kept them all would grow without end, and every frame would carry it."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What an input remembers of a sensor from one batch to the next, so that its frames come
    alike: its groups (:data:`Groups`), and the names its frames' codes stand for.

    A batch that starts with containers' reports, before the global report names the rapl and
    msr groups, still orders its tables as the sensor writes its groups. And a sensor's frames
    share their names, each batch's new ones after the others, so that a formula that holds
    a sensor's ticks (SmartWatts) joins the next frame onto them without coding names again.
    ``names`` is never changed (frames hold it): a batch with new names makes a new list."""

    groups: Groups = ()
    names: list[str] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Each name's code: its place in ``names``."""


_NO_LAYOUT = Layout()


def _remembered(groups: Groups, names: list[str], codes: dict[str, int]) -> Layout:
    """The layout to remember after a batch: its names only up to :data:`NAMES_LIMIT`."""
    if len(names) > NAMES_LIMIT:
        return Layout(groups)
    return Layout(groups, names, codes)


class _Batch:
    """The state of one batch's pass: names, groups, the tick being read."""

    __slots__ = ("codes", "groups", "millis_of", "names", "reports", "tick", "tick_keys",
                 "tick_rank")  # fmt: skip

    def __init__(self, layout: Layout = _NO_LAYOUT) -> None:
        self.codes: dict[str, int] = dict(layout.codes)
        self.names = layout.names
        """The names of the frames made so far (or the remembered ones): the list the next
        frame shares when its lines brought no new name."""
        self.groups: dict[str, _GroupRows] = {
            name: _GroupRows(events, rank) for rank, (name, events) in enumerate(layout.groups)
        }
        self.millis_of: dict[int | float | str, int] = {}
        self.reports = 0
        self.tick: int | None = None
        self.tick_keys: set[tuple[int, int]] = set()
        self.tick_rank = 0

    def add(self, document: HwpcDocument | _WholeDocument) -> None:
        millis = self._millis(document.timestamp)
        codes = self.codes
        sensor = codes.setdefault(document.sensor, len(codes))
        target = codes.setdefault(document.target, len(codes))
        groups = document.groups
        known = self.groups
        first_rank = last_rank = -1
        for name in groups:
            found = known.get(name)
            rank = len(known) if found is None else found.rank
            if rank < last_rank:
                raise _Cut
            if first_rank < 0:
                first_rank = rank
            last_rank = rank
        self._place(millis, (sensor, target), first_rank)
        for name, sockets in groups.items():
            rows = known.get(name)
            if rows is None:
                rows = self._new_group(name, sockets)
            rows.line_millis.append(millis)
            rows.line_sensors.append(sensor)
            rows.line_targets.append(target)
            rows.add(sockets)
        self.reports += 1

    def _millis(self, raw: int | float | str) -> int:
        millis = self.millis_of.get(raw)
        if millis is None:
            millis = self.millis_of[raw] = _millis_of(raw)
        return millis

    def _place(self, millis: int, key: tuple[int, int], rank: int) -> None:
        """Check the line comes where the frame gives its report back: ticks in order, each
        (sensor, target) once per tick, a tick's reports in the order of their first group's
        place (the frame gives them back group by group)."""
        if millis != self.tick:
            if self.tick is not None and millis < self.tick:
                raise _NotPlain("a timestamp earlier than the line before")
            self.tick = millis
            self.tick_keys = set()
        elif key in self.tick_keys:
            raise _NotPlain("a second report of a target in one tick")
        elif rank < self.tick_rank:
            raise _Cut
        self.tick_keys.add(key)
        self.tick_rank = rank

    def _new_group(self, name: str, sockets: dict[str, dict[str, dict[str, Any]]]) -> _GroupRows:
        for cpus in sockets.values():
            for counters in cpus.values():
                if not counters:
                    raise _NotPlain("a cpu without events")
                rows = self.groups[name] = _GroupRows(tuple(counters), len(self.groups))
                return rows
        raise _NotPlain("a group without cpus")

    def layout(self) -> Layout:
        """The groups and their events, in the order of the batch's tables, and the names of
        its frame (:meth:`frame` has made it)."""
        groups = tuple((name, rows.events) for name, rows in self.groups.items())
        return _remembered(groups, self.names, self.codes)

    def next(self) -> _Batch:
        """A batch for the lines after this one's (:meth:`frame` has made its frame), which
        still knows the tick being read (a target's second report in it is not plain) and
        codes names as this one does."""
        following = _Batch()
        following.codes = self.codes
        following.names = self.names
        following.millis_of = self.millis_of
        following.tick = self.tick
        following.tick_keys = self.tick_keys
        following.tick_rank = -1
        return following

    def frame(self, sensor: str) -> HWPCFrame:
        """The frame of the batch's lines, all of ``sensor`` (a batch is one sensor's)."""
        if len(self.codes) != len(self.names):
            self.names = list(self.codes)
        tables = [rows.table(name) for name, rows in self.groups.items() if rows.line_rows]
        return HWPCFrame(self.names, tables, self.reports, canonical=True, sensor=sensor)


def decode_hwpc_frames(
    lines: Sequence[bytes | str], layouts: dict[str, Layout] | None = None
) -> list[HWPCFrame] | None:
    """The frames of a batch of hwpc-sensor JSON lines (blank lines skipped), or ``None`` when a
    line is not plain (see the module's docstring) or there is no line: then decode the batch
    line by line with :func:`~wattflow.formats.powerapi.decode_json_lines`.

    One frame per sensor, each holding that sensor's reports in the order they came (a batch
    of several sensors, as a MongoDB collection or a shared file holds them, is handed on
    sensor by sensor). ``layouts`` is what an input remembers of each sensor's groups from one
    batch to the next: a batch that starts with containers' reports, before the global report
    names the rapl and msr groups, then still orders its tables as the sensor writes its groups.
    A line whose groups come in another order than its frame's tables starts another frame of
    its sensor, so that each frame gives its reports back as they came.

    The C parser (:func:`compiled_hwpc_frames`) makes the frames of a batch in hwpc-sensor's
    own form; a batch it declines is parsed by msgspec and assembled in Python, into the same
    frames.
    """
    frames = compiled_hwpc_frames(lines, layouts)
    if frames is not None:
        return frames
    documents = _plain_lines(lines)
    if documents is None:
        return None
    return _frames_learning_again(documents, layouts)


def _plain_lines(lines: Sequence[bytes | str]) -> list[_WholeDocument] | None:
    """Each line checked and parsed (blank lines skipped), or None at the first line that is
    not plain."""
    documents: list[_WholeDocument] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            document = _decode_whole(line)
        except (msgspec.DecodeError, UnicodeDecodeError):  # bytes not UTF-8 in a string
            return None
        if document.metadata or not document.groups:
            return None
        documents.append(document)
    return documents


def _frames_learning_again(
    documents: Sequence[HwpcDocument | _WholeDocument], layouts: dict[str, Layout] | None
) -> list[HWPCFrame] | None:
    """The frames of plain documents, their tables in the order ``layouts`` remembers of each
    sensor; when that fails and some layout was remembered, the frames of the batch on its
    own, from which ``layouts`` learns again.

    The retry is for a sensor whose groups changed (restarted with other events, a group
    renamed, another sensor under the same name): its reports may no longer fit the layout
    remembered from its earlier batches, and ``layouts`` is only kept from a batch that made
    frames, so without a retry the stale layout would stay and every later batch of that
    sensor would go the line-by-line way. Forgetting the layouts and trying once more makes
    the batch's frames as if it were the first and keeps its layout for the batches that
    follow; a batch that is not plain on its own still gives None."""
    known = {} if layouts is None else layouts
    frames = _document_frames(documents, known)
    if frames is None and known:
        known.clear()
        frames = _document_frames(documents, known)
    return frames


# --- hwpc-sensor's lines parsed in C -------------------------------------------------------------


def compiled_hwpc_frames(
    lines: Sequence[bytes | str], layouts: dict[str, Layout] | None = None
) -> list[HWPCFrame] | None:
    """The frames :func:`decode_hwpc_frames` makes of ``lines``, parsed in C straight into
    columns (``_hwpc_lines``, no Python object per counter), or ``None`` where that parser is
    not sure to make the same frames: then :func:`decode_hwpc_frames` decides.

    The C parser reads only hwpc-sensor's plain form (see ``formats/_hwpc_lines.c``) and
    declines anything else: escapes, floats, signs, unknown or repeated keys, a cpu whose
    events differ from its group's first cpu in the line, in their order too. Here, per
    sensor, numpy checks on its columns what :class:`_Batch` checks line by line: ticks in
    order, one report per (tick, target), each line's groups in the order of the sensor's
    tables, a tick's reports in the order of their first group. A batch that
    :class:`_Batch` would cut into two frames of a sensor (a group order that changes), or
    whose events differ from those ``layouts`` remembers, is declined too. ``layouts`` is
    updated only when frames are made, as :func:`decode_hwpc_frames` does.
    """
    parsed = None if _hwpc_lines is None else _hwpc_lines.parse(lines)
    if parsed is None:
        return None
    (
        strings,
        stamps,
        line_stamps,
        line_sensors,
        line_targets,
        occurrence_lines,
        shapes_of,
        shapes,
    ) = parsed
    try:
        stamp_millis = np.array([_millis_of(raw) for raw in stamps], dtype=np.int64)
    except _NotPlain:
        return None
    columns = _LineColumns(
        strings,
        stamp_millis[_ints(line_stamps)],
        _ints(line_sensors),
        _ints(line_targets),
        _ints(occurrence_lines),
        _ints(shapes_of),
        [_Shape(*shape) for shape in shapes],
    )
    known = {} if layouts is None else layouts
    frames: list[HWPCFrame] = []
    learned: dict[str, Layout] = {}
    sensor_ids, firsts = np.unique(columns.sensors, return_index=True)
    single = len(sensor_ids) == 1
    for sensor_id in sensor_ids[firsts.argsort()].tolist():
        sensor = strings[sensor_id]
        made = columns.frame(sensor_id, known.get(sensor, _NO_LAYOUT), single)
        if made is None:
            return None
        frames.append(made[0])
        learned[sensor] = made[1]
    known.update(learned)
    return frames


def c_parser_built() -> bool:
    """Whether wattflow was built with its C parser of hwpc-sensor's lines (``_hwpc_lines``);
    without it (no C compiler where it was installed) every batch goes the Python way."""
    return _hwpc_lines is not None


def _ints(column: bytearray) -> IntArray:
    ints: IntArray = np.frombuffer(column, dtype=np.int64)
    return ints


class _Shape:
    """One group with one list of events, as the C parser gives its rows."""

    __slots__ = ("cpus", "events", "group", "lines", "sockets", "values")

    def __init__(
        self,
        group: str,
        events: tuple[str, ...],
        lines: bytearray,
        sockets: bytearray,
        cpus: bytearray,
        values: bytearray,
    ) -> None:
        self.group = group
        self.events = events
        self.lines = _ints(lines)
        self.sockets = _ints(sockets)
        self.cpus = _ints(cpus)
        self.values = _ints(values).reshape(-1, len(events))


class _LineColumns:
    """A batch as the C parser gives it, made into frames sensor by sensor."""

    def __init__(
        self,
        strings: list[str],
        millis: IntArray,
        sensors: IntArray,
        targets: IntArray,
        occurrence_lines: IntArray,
        occurrence_shapes: IntArray,
        shapes: list[_Shape],
    ) -> None:
        self.strings = strings
        self.millis = millis
        self.sensors = sensors
        self.targets = targets
        self.occurrence_lines = occurrence_lines
        self.occurrence_shapes = occurrence_shapes
        self.shapes = shapes

    def frame(self, sensor: int, layout: Layout, single: bool) -> tuple[HWPCFrame, Layout] | None:
        """The sensor's frame and its layout, or None where :class:`_Batch` would not make
        exactly one frame of its lines with this layout."""
        if single:
            lines = np.arange(len(self.sensors))
            lines_of_groups = self.occurrence_lines
            shapes_of_groups = self.occurrence_shapes
        else:
            lines = np.flatnonzero(self.sensors == sensor)
            mine = self.sensors[self.occurrence_lines] == sensor
            lines_of_groups = self.occurrence_lines[mine]
            shapes_of_groups = self.occurrence_shapes[mine]
        ranked = self._ranks(shapes_of_groups, layout.groups)
        if ranked is None:
            return None
        shape_ranks, groups = ranked
        if not self._placed(lines, lines_of_groups, shape_ranks[shapes_of_groups]):
            return None
        names, known, codes = self._names(lines, layout)
        tables = []
        for group, (events, shape) in groups.items():
            if shape is not None:
                tables.append(self._table(group, events, self.shapes[shape], sensor, codes, single))
        frame = HWPCFrame(names, tables, len(lines), canonical=True, sensor=self.strings[sensor])
        learned = tuple((group, events) for group, (events, _) in groups.items())
        return frame, _remembered(learned, names, known)

    def _ranks(
        self, shapes_of_groups: IntArray, layout: Groups
    ) -> tuple[IntArray, dict[str, tuple[tuple[str, ...], int | None]]] | None:
        """Each shape's group's place among the sensor's tables (the layout's groups, then
        new ones as they first come), and per group its events and its shape; None when a
        group comes with other events than its table's."""
        groups: dict[str, tuple[tuple[str, ...], int | None]] = {
            group: (events, None) for group, events in layout
        }
        ranks = np.full(len(self.shapes), -1, dtype=np.int64)
        used, firsts = np.unique(shapes_of_groups, return_index=True)
        for shape_index in used[firsts.argsort()].tolist():
            shape = self.shapes[shape_index]
            known = groups.get(shape.group)
            if known is not None and (known[0] != shape.events or known[1] is not None):
                return None
            groups[shape.group] = (shape.events, shape_index)
            ranks[shape_index] = list(groups).index(shape.group)
        return ranks, groups

    def _placed(self, lines: IntArray, lines_of_groups: IntArray, group_ranks: IntArray) -> bool:
        """Whether :class:`_Batch` places every line in one frame: each line's groups in the
        tables' order, ticks in order, one report per (tick, target), a tick's reports in the
        order of their first group.

        A live sensor's batch is a tick or so: each check is a call or two of numpy (counts
        rather than ``any``, a sort rather than ``np.unique``), whose fixed cost is then most
        of the work."""
        same_line = lines_of_groups[1:] == lines_of_groups[:-1]
        if np.count_nonzero(group_ranks[1:][same_line] <= group_ranks[:-1][same_line]):
            return False
        first_ranks = group_ranks[np.concatenate(([True], ~same_line))]
        millis = self.millis[lines]
        steps = millis[1:] - millis[:-1]
        if np.count_nonzero(steps < 0):
            return False
        same_tick = steps == 0
        if np.count_nonzero(first_ranks[1:][same_tick] < first_ranks[:-1][same_tick]):
            return False
        ticks = np.zeros(len(millis), dtype=np.int64)
        np.cumsum(~same_tick, out=ticks[1:])
        keys = np.sort(ticks * len(self.strings) + self.targets[lines])
        return not np.count_nonzero(keys[1:] == keys[:-1])

    def _names(self, lines: IntArray, layout: Layout) -> tuple[list[str], dict[str, int], IntArray]:
        """The frame's names: the layout's, then the sensor's and targets' new ones as they
        first come (as :class:`_Batch` codes them); each name's code, and each string's code
        among the names."""
        known = layout.codes
        if known:  # mostly, every name is the layout's: no order to find
            table = np.array([known.get(text, -1) for text in self.strings], dtype=np.int64)
            if not (
                np.count_nonzero(table[self.sensors[lines]] < 0)
                or np.count_nonzero(table[self.targets[lines]] < 0)
            ):
                return layout.names, known, table
        both = np.column_stack((self.sensors[lines], self.targets[lines])).ravel()
        ids, firsts = np.unique(both, return_index=True)
        ordered = ids[np.argsort(firsts)].tolist()
        names = layout.names
        strings = self.strings
        found = [known.get(strings[at], -1) for at in ordered]
        if -1 in found:  # names the sensor's earlier batches did not have
            known = dict(known)
            found = [known.setdefault(strings[at], len(known)) for at in ordered]
            names = list(known)
        codes = np.zeros(len(strings), dtype=np.int64)
        codes[ordered] = found
        return names, known, codes

    def _table(
        self,
        group: str,
        events: tuple[str, ...],
        shape: _Shape,
        sensor: int,
        codes: IntArray,
        single: bool,
    ) -> EventsTable:
        if single:
            rows, sockets, cpus, values = shape.lines, shape.sockets, shape.cpus, shape.values
        else:
            mine = self.sensors[shape.lines] == sensor
            rows, sockets, cpus = shape.lines[mine], shape.sockets[mine], shape.cpus[mine]
            values = shape.values[mine]
        return EventsTable(
            group,
            events,
            self.millis[rows],
            codes[self.sensors[rows]],
            codes[self.targets[rows]],
            sockets,
            cpus,
            values,
        )


Decoded = tuple[list[HWPCFrame] | list[Report], list[tuple[DecodeError, str | bytes]]]
"""A batch's frames (one per sensor), or its reports and each line that is not one, with why."""

LineRun = tuple[str, int, Sequence[bytes | str]]
"""Consecutive lines: the source their dead letters name, the first one's number, the lines."""


def decode_json_runs(
    kind: type[Report],
    runs: Sequence[LineRun],
    layouts: dict[str, Layout] | None = None,
    *,
    framed: bool = True,
) -> Decoded:
    """Decode a batch of JSON lines the one way every JSON input (socket, JSON Lines, ZeroMQ)
    does: hwpc-sensor's reports into frames when the whole batch is plain (see
    :func:`decode_hwpc_frames`; ``layouts`` is what the input remembers of its sensors, and
    ``framed=False`` leaves frames out), else each run line by line with
    :func:`~wattflow.formats.powerapi.decode_json_lines`, so that a dead letter names its own
    run's source and line. A batch is one batch whatever runs it came in: a socket's reads,
    however the network cut them, or a ZeroMQ batch's messages make one frame per sensor."""
    if kind is HWPCReport and framed and runs:
        every = runs[0][2] if len(runs) == 1 else [line for *_, lines in runs for line in lines]
        frames = decode_hwpc_frames(every, layouts)
        if frames is not None:
            return frames, []
    decoded = [decode_json_lines(kind, lines, source, first) for source, first, lines in runs]
    reports = list(chain.from_iterable(made for made, _ in decoded))
    return reports, list(chain.from_iterable(refused for _, refused in decoded))


def decode_json_batch(
    kind: type[Report],
    lines: Sequence[bytes | str],
    source: str,
    first_line: int,
    layouts: dict[str, Layout] | None = None,
) -> Decoded:
    """:func:`decode_json_runs` of one run of lines, numbered from ``first_line``."""
    return decode_json_runs(kind, [(source, first_line, lines)], layouts)


# --- MongoDB documents ------------------------------------------------------------------------

_NO_TEXT = Annotated[str, msgspec.Meta(pattern="^(?!)")]
"""A text no string matches: beside ``int`` in a lax conversion, it keeps strings from being
read as numbers, so that only doubles are made integers."""

_WholeGroups = dict[str, dict[str, dict[str, dict[str, int | _NO_TEXT]]]]
"""hwpc-sensor's groups with integer counters: converted laxly, a double that holds a whole
number of at most 2⁵³ becomes that integer, and any other double, a string, a boolean or
anything else is refused."""

_LARGEST_WHOLE_DOUBLE = 2.0**53
"""The largest double below which every whole number is one: msgspec's lax conversion reads
whole doubles up to it as integers, and :func:`whole_counters` does the same."""


def decode_hwpc_document_frames(
    documents: Sequence[dict[str, Any]], layouts: dict[str, Layout] | None = None
) -> list[HWPCFrame] | None:
    """The frames of a batch of hwpc-sensor's MongoDB documents, as pymongo decodes them, or
    ``None`` when a document is not plain or there is none: then decode the batch document by
    document with :func:`decode_document_reports`.

    A document is plain when a JSON line of the same report would be (see the module's
    docstring) and its timestamp is a BSON date. hwpc-sensor's MongoDB output stores its
    integer counters as doubles: a double that holds a whole number (of at most 2⁵³, where
    every whole number is a double) is read as that integer, as
    :func:`decode_document_reports` reads it too, so that the frame stands for exactly the
    reports of the batch, and for the reports the sensor's JSON gives. Frames are one per
    sensor, in the order the documents came, and ``layouts`` is what the input remembers of
    each sensor's groups, as for :func:`decode_hwpc_frames`.
    """
    plain = _plain_documents(documents)
    if plain is None:
        return None
    return _frames_learning_again(plain, layouts)


def _plain_documents(documents: Sequence[dict[str, Any]]) -> list[HwpcDocument] | None:
    """Each document as the JSON way holds a line (its timestamp in Unix milliseconds, its
    counters integers), or ``None`` when one is not plain. The groups are checked and
    converted by msgspec in C; the rest is a few look-ups per document."""
    convert = msgspec.convert
    millis_of: dict[datetime, int] = {}
    plain: list[HwpcDocument] = []
    for document in documents:
        timestamp = document.get("timestamp")
        sensor = document.get("sensor")
        target = document.get("target")
        if (
            type(timestamp) is not datetime
            or type(sensor) is not str
            or type(target) is not str
            or not sensor
            or not target
            or document.get("metadata", {}) != {}
        ):
            return None
        try:
            # Integers only: no text ever matches ``_NO_TEXT``.
            groups: dict[str, Any] = convert(document.get("groups"), _WholeGroups, strict=False)
        except msgspec.ValidationError:
            return None
        if not groups:
            return None
        millis = millis_of.get(timestamp)
        if millis is None:
            if timestamp.microsecond % 1000:
                return None
            millis = millis_of[timestamp] = to_millis(to_utc(timestamp))
        plain.append(HwpcDocument(millis, sensor, target, groups))
    return plain


def _document_frames(
    documents: Sequence[HwpcDocument | _WholeDocument], layouts: dict[str, Layout]
) -> list[HWPCFrame] | None:
    """One frame per sensor from documents already checked and parsed (lines of hwpc-sensor's
    JSON, or MongoDB's documents), or None when one of them is not plain."""
    done: dict[str, list[HWPCFrame]] = {}
    sensors: dict[str, _Batch] = {}
    try:
        for document in documents:
            batch = sensors.get(document.sensor)
            if batch is None:
                batch = sensors[document.sensor] = _Batch(layouts.get(document.sensor, _NO_LAYOUT))
            try:
                batch.add(document)
            except _Cut:
                done.setdefault(document.sensor, []).append(batch.frame(document.sensor))
                batch = sensors[document.sensor] = batch.next()
                batch.add(document)
        frames = [
            frame
            for sensor, batch in sensors.items()
            for frame in [*done.get(sensor, ()), batch.frame(sensor)]
        ]
    except (_NotPlain, _Cut, KeyError):  # KeyError: a cpu lacking one of its group's events
        return None
    for sensor, batch in sensors.items():
        layouts[sensor] = batch.layout()
    return frames or None


def decode_documents(
    kind: type[Report],
    documents: Sequence[dict[str, Any]],
    source: str,
    layouts: dict[str, Layout] | None = None,
) -> tuple[list[HWPCFrame] | list[Report], list[tuple[DecodeError, dict[str, Any]]]]:
    """Decode a batch of MongoDB documents the one way the MongoDB input does: frames when the
    batch is plain (:func:`decode_hwpc_document_frames`), else document by document
    (:func:`decode_document_reports`: reports, and each document that is not one, with its
    error)."""
    if kind is HWPCReport:
        frames = decode_hwpc_document_frames(documents, layouts)
        if frames is not None:
            return frames, []
    return decode_document_reports(kind, documents, source)


def decode_document_reports(
    kind: type[Report], documents: Sequence[dict[str, Any]], source: str
) -> tuple[list[Report], list[tuple[DecodeError, dict[str, Any]]]]:
    """Decode MongoDB documents one by one into reports of ``kind``
    (:func:`~wattflow.formats.powerapi.from_mongodb`), and name each document that is not one,
    with its error. HWPCReports' counters are read as :func:`decode_hwpc_document_frames`
    reads them (:func:`whole_counters`), so that a batch gives the same reports either way."""
    reports: list[Report] = []
    errors: list[tuple[DecodeError, dict[str, Any]]] = []
    for document in documents:
        try:
            report = from_mongodb(kind, document, source)
        except DecodeError as error:
            errors.append((error, document))
            continue
        if isinstance(report, HWPCReport):
            report = whole_counters(report)
        reports.append(report)
    return reports, errors


def whole_counters(report: HWPCReport) -> HWPCReport:
    """The report with each double counter that holds a whole number of at most 2⁵³ made that
    integer (hwpc-sensor's MongoDB output stores integer counters as doubles); the report
    itself when it has none."""
    if not any(
        type(value) is float
        for sockets in report.groups.values()
        for cpus in sockets.values()
        for events in cpus.values()
        for value in events.values()
    ):
        return report
    groups = {
        group: {
            socket: {
                cpu: {event: _whole(value) for event, value in events.items()}
                for cpu, events in cpus.items()
            }
            for socket, cpus in sockets.items()
        }
        for group, sockets in report.groups.items()
    }
    return report.model_copy(update={"groups": groups})


def _whole(value: int | float) -> int | float:
    if type(value) is float and value.is_integer() and abs(value) <= _LARGEST_WHOLE_DOUBLE:
        return int(value)
    return value
