"""PowerAPI's per-group CSV input read into frames: a chunk of rows parsed in one C call.

hwpc-sensor's CSV files hold one row per cpu, group and tick, so a recording of ten containers
on eight cpus is about 80 rows a second. Parsing them one Python object at a time is the largest
cost of a replay. Here each file is read in chunks of whole lines, and a chunk of plain rows (the
layout hwpc-sensor writes: integer timestamps, sockets, cpus and counters, no quoting) becomes
int64 columns in one call of wattflow's C parser (``parse_csv`` in ``formats/_hwpc_lines.c``),
each distinct sensor and target name decoded once. Where wattflow was built without that parser,
every file goes the row-by-row way.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
import numpy.typing as npt

from wattflow.formats import powerapi
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import EventsTable, HWPCFrame
from wattflow.formats.reports import HWPCReport

try:
    from wattflow.formats import _hwpc_lines
except ImportError:  # built without its C parser: every file goes the row-by-row way
    _hwpc_lines = None  # type: ignore[assignment]

CHUNK_BYTES = 1 << 21
"""Bytes read from a file at once, at first: thousands of rows, so per-chunk costs are shared."""

FRAME_TICKS = 64
"""Ticks a chunk should span: a file whose chunks span fewer (a tick of a thousand containers
is 8,000 rows) reads larger ones, so that per-frame and per-sensor costs stay shared."""

LARGEST_CHUNK = 1 << 26
"""The most bytes read from one file at once, whatever its ticks."""


@dataclass(slots=True, eq=False)
class _File:
    path: Path
    handle: io.BufferedReader
    header: list[str]
    group: str
    events: tuple[str, ...]
    lines: int  # lines before the first unframed row (the header is line 1)
    read_to: int  # byte offset where the next chunk starts
    pending: EventsTable | None = None
    """Rows parsed but not yet framed."""
    eof: bool = False
    last_millis: int | None = None
    whole_to: int = -1
    """The rows up to this timestamp are all read (see :func:`_read_chunk`)."""
    chunk_bytes: int = 0
    """Bytes to read next: grows while chunks span fewer than :data:`FRAME_TICKS` ticks."""
    buffer: bytearray = field(default_factory=bytearray)
    """Where each chunk is read (:func:`_read_chunk`), one byte longer than it."""

    def needs_chunk(self) -> bool:
        """Whether the file has more to read and no rows pending."""
        return not self.eof and self.pending is None

    def done(self) -> bool:
        """Whether every row of the file is read and framed."""
        return self.eof and self.pending is None


class _NotPlain(Exception):
    """A chunk the fast way cannot read exactly; the row-by-row way takes over."""


class _Names:
    """Sensor and target names and their codes, shared by every frame of one input.

    A list a frame holds is never changed: a name coded after it was handed to a frame goes
    into a new list, the old names first (as ``json_frames.Layout`` does). The files may be
    parsed on another thread than the one that reads the frames (the CSV input parses in a
    thread of its own), so a frame's names must not grow while a formula reads them."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.codes: dict[str, int] = {}
        self.held = False
        """Whether a frame holds ``names``."""

    def code(self, name: str) -> int:
        found = self.codes.get(name)
        if found is None:
            if self.held:
                self.names, self.held = list(self.names), False
            found = self.codes[name] = len(self.names)
            self.names.append(name)
        return found

    def for_frame(self) -> list[str]:
        """The names, for a frame to hold."""
        self.held = True
        return self.names


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
            if not _plain_header(first):
                handle.close()
                yield from powerapi.read_hwpc_csv(paths)
                return
            text = first.decode("utf-8", powerapi.CSV_ERRORS)
            header = powerapi.read_csv_header(path, csv.reader([text]), powerapi.CSV_HWPC)
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


def _plain_header(first: bytes) -> bool:
    """Whether the file's first line is all of its header, as the row-by-row reader's csv module
    reads it: no quote (a quoted cell may hold a line break) and no carriage return but the one
    before the line break (the csv module ends a row at a lone one too). Any other header makes
    every file go the row-by-row way, which reads it, or refuses it, in its own words."""
    line = first.removesuffix(b"\n").removesuffix(b"\r")
    return b'"' not in line and b"\r" not in line


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
        text = io.TextIOWrapper(f.handle, encoding="utf-8", errors=powerapi.CSV_ERRORS, newline="")
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
    """Rows of every file up to the latest timestamp all of them have read whole, as a frame."""
    while True:
        for f in files:
            if f.needs_chunk():
                _read_chunk(f, names, chunk_bytes)
        if all(f.done() for f in files):
            return None
        horizon = min((f.whole_to for f in files if not f.eof), default=powerapi.LAST_MILLIS)
        cuts = [_cut(f, horizon) for f in files]
        if any(cuts):
            tables = [_take(f, cut) for f, cut in zip(files, cuts, strict=True)]
            return HWPCFrame(names.for_frame(), tables)
        _read_on(files, horizon, names, chunk_bytes)


def _read_on(files: list[_File], horizon: int, names: _Names, chunk_bytes: int) -> None:
    """No tick is whole in every file: read on in those that stop the horizon (a chunk of
    less than a tick)."""
    for f in files:
        if not f.eof and f.whole_to == horizon:
            _read_chunk(f, names, chunk_bytes)


def _cut(f: _File, horizon: int) -> int:
    """The pending rows at or before ``horizon``."""
    if f.pending is None:
        return 0
    return int(np.searchsorted(f.pending.millis, horizon, side="right"))


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
    data = _whole_lines(f)
    if data is None:
        return
    size = len(data)
    if data[-1] != LINE_BREAK:  # the file's last line, without its line break
        f.buffer[size] = LINE_BREAK
        data = memoryview(f.buffer)[: size + 1]
    table = _parse(data, f, names)
    ticks = _ticks_in_order(f, table.millis)
    if ticks < FRAME_TICKS and f.chunk_bytes < LARGEST_CHUNK:
        f.chunk_bytes = min(LARGEST_CHUNK, f.chunk_bytes * -(-FRAME_TICKS // ticks))
    if not f.eof and ticks > 1:
        table, size = _whole_ticks(f, table, size)
    f.read_to += size
    f.last_millis = int(table.millis[-1])
    # Rows up to this timestamp are all read: the last one's if the chunk ended at a tick.
    f.whole_to = powerapi.LAST_MILLIS if f.eof else f.last_millis - (ticks == 1)
    f.pending = table if f.pending is None else f.pending.then(table)


LINE_BREAK = ord("\n")


def _ticks_in_order(f: _File, millis: npt.NDArray[np.int64]) -> int:
    """The ticks of a chunk's rows.

    Raises:
        _NotPlain: at timestamps going back, which the row-by-row merge decides.
    """
    previous = f.last_millis
    if (previous is not None and millis[0] < previous) or bool((np.diff(millis) < 0).any()):
        raise _NotPlain
    return 1 + int(np.count_nonzero(millis[1:] != millis[:-1]))


def _whole_ticks(f: _File, table: EventsTable, size: int) -> tuple[EventsTable, int]:
    """The rows of a chunk (``size`` bytes) but its last tick's, and their bytes.

    The last tick may go on in the next chunk: it is left to be read again with it, so that
    every pending row is of a whole tick, framed as it is, never joined to a chunk read after
    it (a copy of the whole chunk, a third of the CSV input's time with a thousand
    containers).
    """
    millis = table.millis
    whole_rows = int(np.searchsorted(millis, millis[-1], side="left"))
    size = _line_start_in(f.buffer, size, len(millis), len(millis) - whole_rows)
    return table.rows(0, whole_rows), size


def _line_start_in(buffer: bytearray, size: int, lines: int, last_lines: int) -> int:
    """Where the last ``last_lines`` of the ``lines`` whole lines of ``buffer[:size]`` start:
    found by numpy in the part of the buffer they take on average, or twice that, and so on."""
    data = np.frombuffer(buffer, dtype=np.uint8, count=size)
    window = min(size, 2 * size * (last_lines + 1) // lines + 4096)
    while True:
        breaks = np.flatnonzero(data[size - window :] == LINE_BREAK)
        if len(breaks) > last_lines:
            return size - window + int(breaks[-last_lines - 1]) + 1
        window = min(size, 2 * window)


def _whole_lines(f: _File) -> memoryview | None:
    """The next chunk's whole lines, read into the file's one buffer (``_File.buffer``), or
    None at the end of the file. The chunk ends at its last line break, the next one starts
    after it; at the end of the file, the last line may lack its line break.

    The buffer is reused from chunk to chunk. A new bytes object per chunk, and its copy
    that completed the last line, were each faulted in page by page: half the page faults of
    a one-socket replay (97,000 against 48,000 now).
    """
    while True:
        if len(f.buffer) <= f.chunk_bytes:  # room for the chunk and a line break after it
            f.buffer = bytearray(f.chunk_bytes + 1)
        f.handle.seek(f.read_to)
        read = f.handle.readinto(memoryview(f.buffer)[: f.chunk_bytes])
        if read < f.chunk_bytes:  # the end of the file
            f.eof = True
            return memoryview(f.buffer)[:read] if read else None
        size = f.buffer.rfind(b"\n", 0, read) + 1
        if size:
            return memoryview(f.buffer)[:size]
        f.chunk_bytes *= 2  # a line longer than the chunk: read it whole


def _parse(data: memoryview, f: _File, names: _Names) -> EventsTable:
    """Whole lines of a plain file as a table, read by the C parser (``parse_csv`` in
    ``formats/_hwpc_lines.c``) straight into int64 columns.

    The parser reads only what the row-by-row way would read the same: no quoting, no empty or
    padded cells, numbers written as integers without leading zeros (sockets and cpus exactly as
    ``str`` writes them, within their bounds), names shorter than 1,024 bytes.

    Raises:
        _NotPlain: at anything that is not plain, or where wattflow was built without its C
            parser.
    """
    parsed = None if _hwpc_lines is None else _hwpc_lines.parse_csv(data, len(f.header))
    if parsed is None:
        raise _NotPlain
    texts, millis, sensors, targets, sockets, cpus, counters = parsed
    codes = np.array([names.code(text) for text in texts], dtype=np.int64)
    millis_column = np.frombuffer(millis, dtype=np.int64)
    if int(millis_column.max()) > powerapi.LAST_MILLIS:
        raise _NotPlain
    return EventsTable(
        f.group,
        f.events,
        millis_column,
        codes[np.frombuffer(sensors, dtype=np.int64)],
        codes[np.frombuffer(targets, dtype=np.int64)],
        np.frombuffer(sockets, dtype=np.int64),
        np.frombuffer(cpus, dtype=np.int64),
        np.frombuffer(counters, dtype=np.int64).reshape(-1, len(f.events)),
    )
