"""PowerAPI's per-group CSV input read into frames: a chunk of rows parsed in a few array calls.

hwpc-sensor's CSV files hold one row per cpu, group and tick, so a recording of ten containers
on eight cpus is about 80 rows a second. Parsing them one Python object at a time is the largest
cost of a replay. Here each file is read in chunks of whole lines, and a chunk of plain rows (the
layout hwpc-sensor writes: integer timestamps, sockets, cpus and counters, no quoting) becomes
arrays in a few calls: numpy's C parser reads every number, and the sensor and target names are
found once per run of rows that repeat them.

The files are merged by timestamp as :func:`~wattflow.formats.powerapi.read_hwpc_csv` merges
them: a frame holds every row of every file up to the latest timestamp all files have reached.
Anything the fast way cannot vouch for (a quoted or empty cell, a counter that is not an integer,
a timestamp going back, a text socket, a socket or cpu number out of bounds) hands the rest of
every file, from the first row not yet framed, to :func:`~wattflow.formats.powerapi.read_hwpc_csv`,
which yields reports and dead letters exactly as it always does.
"""

from __future__ import annotations

import csv
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np
import numpy.typing as npt

from wattflow.formats import powerapi
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import EventsTable, HWPCFrame, IntArray, run_starts
from wattflow.formats.reports import CPU_LIMIT, SOCKET_LIMIT, HWPCReport

Records = npt.NDArray[Any]
"""Rows parsed by numpy into records (a structured array), or byte views of them."""

CHUNK_BYTES = 1 << 21
"""Bytes read from a file at once, at first: thousands of rows, so per-chunk costs are shared."""

FRAME_TICKS = 64
"""Ticks a chunk should span: a file whose chunks span fewer (a tick of a thousand containers
is 8,000 rows) reads larger ones, so that per-frame and per-sensor costs stay shared."""

LARGEST_CHUNK = 1 << 26
"""The most bytes read from one file at once, whatever its ticks."""

LONGEST_NAMES = 1024
"""Longest ``sensor,target`` text the fast way reads; longer names go the row-by-row way."""

_FIRST_MILLIS = -62_135_596_800_000  # 0001-01-01, the earliest datetime
_LAST_MILLIS = 253_402_300_799_999  # 9999-12-31T23:59:59.999


@dataclass(slots=True, eq=False)
class _File:
    path: Path
    handle: BinaryIO
    header: list[str]
    group: str
    events: tuple[str, ...]
    lines: int  # lines before the first unframed row (the header is line 1)
    read_to: int  # byte offset where the next chunk starts
    pending: EventsTable | None = None
    """Rows parsed but not yet framed."""
    eof: bool = False
    last_millis: int | None = None
    name_bytes: int = 32
    """Width of the sensor and target records: grows when a file's names are longer."""
    chunk_bytes: int = 0
    """Bytes to read next: grows while chunks span fewer than :data:`FRAME_TICKS` ticks."""

    def pending_rows(self) -> int:
        return 0 if self.pending is None else len(self.pending)


class _NotPlain(Exception):
    """A chunk the fast way cannot read exactly; the row-by-row way takes over."""


class _Names:
    """Sensor and target names and their codes, shared by every frame of one input."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.codes: dict[str, int] = {}

    def code(self, name: str) -> int:
        found = self.codes.get(name)
        if found is None:
            found = self.codes[name] = len(self.names)
            self.names.append(name)
        return found


def read_hwpc_csv_frames(
    paths: list[Path], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[HWPCFrame | HWPCReport | DecodeError]:
    """Merge PowerAPI's per-group CSV files into frames of whole ticks, in timestamp order.

    Yields frames while the files are plain, then (if a file stops being plain) the reports and
    dead letters of :func:`~wattflow.formats.powerapi.read_hwpc_csv` for the rest.

    Raises:
        DecodeError: when a file's header lacks a required column (nothing could be read).
    """
    files: list[_File] = []
    try:
        for path in paths:
            handle = path.open("rb")
            first = handle.readline()
            header = next(csv.reader([first.decode("utf-8")]), None)
            powerapi.check_csv_header(path, header, powerapi.CSV_HWPC)
            assert header is not None
            group = powerapi.csv_group_name(path)
            files.append(_File(path, handle, header, group, (), 1, len(first)))
        plain = all(_prepare(f) for f in files)
        names = _Names()
        while plain:
            try:
                frame = _next_frame(files, names, chunk_bytes)
            except _NotPlain:
                break
            if frame is None:
                return
            yield frame
        yield from _row_by_row(paths, files)
    finally:
        for f in files:
            f.handle.close()


def _prepare(f: _File) -> bool:
    """Whether the header is PowerAPI's own layout, which the fast way reads."""
    layout = powerapi._EventsLayout(f.header)
    if not layout.plain or not layout.names:
        return False
    f.events = tuple(layout.names)
    return True


def _row_by_row(paths: list[Path], files: list[_File]) -> Iterator[HWPCReport | DecodeError]:
    """Hand every file, from its first unframed row, to the row-by-row reader."""
    resume: list[tuple[TextIO, list[str], int]] = []
    for f in files:
        f.handle.seek(_line_start(f.handle, f.lines))
        text = io.TextIOWrapper(f.handle, encoding="utf-8", newline="")
        resume.append((text, f.header, f.lines))
    yield from powerapi.read_hwpc_csv(paths, resume)


def _line_start(handle: BinaryIO, lines: int) -> int:
    """Where the line after the first ``lines`` lines starts: every framed row is one line."""
    handle.seek(0)
    position = 0
    while lines:
        block = handle.read(1 << 20)
        if not block:
            break
        found = block.count(b"\n")
        if found < lines:
            lines -= found
            position += len(block)
            continue
        at = -1
        for _ in range(lines):
            at = block.index(b"\n", at + 1)
        return position + at + 1
    return position


def _next_frame(files: list[_File], names: _Names, chunk_bytes: int) -> HWPCFrame | None:
    """Rows of every file up to the latest timestamp all of them have passed, as a frame."""
    while True:
        for f in files:
            if not f.eof and f.pending_rows() == 0:
                _read_chunk(f, names, chunk_bytes)
        open_files = [f for f in files if not f.eof or f.pending_rows()]
        if not open_files:
            return None
        # Rows before the smallest last timestamp among files that may hold more of it.
        reading = [f for f in files if not f.eof]
        if reading:
            horizon = min(int(f.pending.millis[-1]) for f in reading if f.pending)
            cuts = [_cut(f, horizon) for f in files]
            if not any(cuts):
                # Every pending row is at the horizon: read on in the files that stop there.
                for f in reading:
                    if f.pending is not None and int(f.pending.millis[-1]) == horizon:
                        _read_chunk(f, names, chunk_bytes)
                continue
        else:
            cuts = [f.pending_rows() for f in files]
        tables = [_take(f, cut) for f, cut in zip(files, cuts, strict=True)]
        return HWPCFrame(names.names, tables)


def _cut(f: _File, horizon: int) -> int:
    if f.pending is None:
        return 0
    return int(np.searchsorted(f.pending.millis, horizon, side="left"))


def _take(f: _File, rows: int) -> EventsTable:
    """The first ``rows`` pending rows of a file, which then count as framed."""
    pending = f.pending
    if pending is None:
        empty = np.empty(0, dtype=np.int64)
        values = np.empty((0, len(f.events)), dtype=np.int64)
        return EventsTable(f.group, f.events, empty, empty, empty, empty, empty, values)
    f.lines += rows
    f.pending = None if rows == len(pending) else pending.rows(rows, len(pending))
    return pending.rows(0, rows)


def _read_chunk(f: _File, names: _Names, chunk_bytes: int) -> None:
    """Read and parse the next chunk of whole lines, appending it to the pending rows.

    Raises:
        _NotPlain: when the chunk is not plain; nothing of it is kept.
    """
    f.chunk_bytes = f.chunk_bytes or chunk_bytes
    f.handle.seek(f.read_to)
    data = f.handle.read(f.chunk_bytes)
    if len(data) == f.chunk_bytes:
        data += f.handle.readline()
    if not data:
        f.eof = True
        return
    f.eof = not f.handle.read(1)
    size = len(data)
    if not data.endswith(b"\n"):  # the file's last line, without its line break
        data += b"\n"
    table = _parse(data, f, names)
    millis = table.millis
    previous = f.last_millis
    if (previous is not None and millis[0] < previous) or bool((np.diff(millis) < 0).any()):
        raise _NotPlain  # timestamps going back: the row-by-row merge decides
    f.last_millis = int(millis[-1])
    f.read_to += size
    ticks = 1 + int(np.count_nonzero(millis[1:] != millis[:-1]))
    if ticks < FRAME_TICKS and f.chunk_bytes < LARGEST_CHUNK:
        f.chunk_bytes = min(LARGEST_CHUNK, f.chunk_bytes * -(-FRAME_TICKS // ticks))
    f.pending = table if f.pending is None else f.pending.then(table)


def _parse(data: bytes, f: _File, names: _Names) -> EventsTable:
    """Whole lines of a plain file as a table.

    numpy's C parser reads each row into a record: the numbers as integers, the sensor, target,
    socket and cpu as bytes, and it refuses a row with another number of cells. What it would
    read otherwise than the row-by-row way (quoting, empty or padded cells, numbers that are
    not integers, names longer than the widest record) is not plain.

    Raises:
        _NotPlain: at anything that is not plain.
    """
    if b'"' in data or b"\0" in data:
        raise _NotPlain
    if b"\r" in data and data.count(b"\r") != data.count(b"\r\n"):
        raise _NotPlain  # a line broken by a lone carriage return
    if data.startswith((b"\n", b"\r\n")) or b"\n\n" in data or b"\n\r\n" in data:
        raise _NotPlain  # a blank line, which numpy would skip
    while True:
        records = _records(data, f.name_bytes, len(f.header))
        if _fits(records, "sensor") and _fits(records, "target"):
            break
        if f.name_bytes >= LONGEST_NAMES:
            raise _NotPlain
        f.name_bytes *= 4
    millis = np.ascontiguousarray(records["millis"])
    if millis.min() < _FIRST_MILLIS or millis.max() > _LAST_MILLIS:
        raise _NotPlain
    sensors, targets = _codes(records["sensor"], records["target"], names)
    events_at = _field_at(records, "e0")  # the counters fill the end of each record
    counters = _bytes(records, events_at, 8 * len(f.events)).view(np.int64)
    table = EventsTable(
        f.group,
        f.events,
        millis,
        sensors,
        targets,
        _as_written(records, "socket", SOCKET_LIMIT),
        _as_written(records, "cpu", CPU_LIMIT),
        np.ascontiguousarray(counters),
    )
    return table


_NUMBER_BYTES = 8
"""Width of the socket and cpu records: no machine has 10^8 cpus."""

_EVENT_FIELDS = tuple(f"e{number}" for number in range(4096))


def _records(data: bytes, name_bytes: int, cells: int) -> Records:
    """Every row as a record of the header's cells, or :class:`_NotPlain`."""
    fields = [
        ("millis", "<i8"),
        ("sensor", f"S{name_bytes}"),
        ("target", f"S{name_bytes}"),
        ("socket", f"S{_NUMBER_BYTES}"),
        ("cpu", f"S{_NUMBER_BYTES}"),
    ]
    fields.extend((name, "<i8") for name in _EVENT_FIELDS[: cells - len(fields)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy would read "5.0" as 5 with a warning
        try:
            return np.loadtxt(io.BytesIO(data), delimiter=",", dtype=np.dtype(fields), ndmin=1)
        except (ValueError, OverflowError, DeprecationWarning) as error:
            raise _NotPlain from error


def _bytes(records: Records, at: int, width: int) -> Records:
    """Bytes ``at`` to ``at + width`` of every record (rows × width), a view."""
    raw = records.view(np.uint8).reshape(len(records), records.dtype.itemsize)
    return raw[:, at : at + width]


def _field_bytes(records: Records, name: str) -> Records:
    """A bytes field of every record as rows × its width, a view."""
    return _bytes(records, _field_at(records, name), records.dtype[name].itemsize)


def _field_at(records: Records, name: str) -> int:
    """Where a field starts in each record, in bytes."""
    fields = records.dtype.fields
    assert fields is not None
    at: int = fields[name][1]
    return at


def _fits(records: Records, name: str) -> bool:
    """Whether every text of a bytes field is shorter than the field (none was cut short).

    Raises:
        _NotPlain: when a text is empty.
    """
    raw = _field_bytes(records, name)
    if not bool(raw[:, 0].all()):
        raise _NotPlain  # an empty cell
    return not bool(raw[:, -1].any())


def _codes(sensors: Records, targets: Records, names: _Names) -> tuple[IntArray, IntArray]:
    """Each row's sensor and target codes."""
    return _coded(sensors, names), _coded(targets, names)


def _coded(texts: Records, names: _Names) -> IntArray:
    """Each row's code of a text column, the text read once per run of rows that repeat it
    and each distinct text decoded once."""
    runs = run_starts(texts)
    known: dict[bytes, int] = {}
    codes = []
    try:
        for text in texts[runs].tolist():
            code = known.get(text)
            if code is None:
                code = known[text] = names.code(text.decode("utf-8"))
            codes.append(code)
    except UnicodeDecodeError as error:
        raise _NotPlain from error
    return np.repeat(np.array(codes, dtype=np.int64), np.diff(np.append(runs, len(texts))))


def _as_written(records: Records, name: str, limit: int) -> IntArray:
    """Sockets and cpus as numbers, when ``str`` of each gives back its text exactly and each
    is below ``limit``.

    They are text in a report; a number written otherwise ("01", " 1", "+1") is not plain, nor
    is one out of bounds (the row-by-row way refuses its row).

    Raises:
        _NotPlain: when a socket or cpu is written otherwise, or out of bounds.
    """
    raw = _field_bytes(records, name)
    first = raw[:, 0]
    digit_first = (first >= 48) & (first <= 57)
    lone_zero_or_not_zero = (first != 48) | (raw[:, 1] == 0)  # only "0" itself starts with 0
    if not bool((digit_first & lone_zero_or_not_zero).all()):
        raise _NotPlain
    value = (first - 48).astype(np.int64)
    for column in range(1, _NUMBER_BYTES):
        digit = raw[:, column]
        present = digit != 0
        if not bool(present.any()):
            break
        if not bool((((digit >= 48) & (digit <= 57)) | ~present).all()):
            raise _NotPlain
        value = np.where(present, value * 10 + (digit.astype(np.int64) - 48), value)
    if bool((value >= limit).any()):
        raise _NotPlain
    return value
