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
    chunk_bytes: int = 0
    """Bytes to read next: grows while chunks span fewer than :data:`FRAME_TICKS` ticks."""
    buffer: bytearray = field(default_factory=bytearray)
    """Where each chunk is read (:func:`_read_chunk`), one byte longer than it."""

    def pending_rows(self) -> int:
        return 0 if self.pending is None else len(self.pending)


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
        return HWPCFrame(names.for_frame(), tables)


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

    The chunk is read into the file's one buffer (``_File.buffer``), reused from chunk to
    chunk. A new bytes object per chunk, and its copy that completed the last line, were each
    faulted in page by page: half the page faults of a one-socket replay (97,000 against
    48,000 now). A chunk ends at its last line break; the next one starts after it.

    Raises:
        _NotPlain: when the chunk is not plain; nothing of it is kept.
    """
    f.chunk_bytes = f.chunk_bytes or chunk_bytes
    while True:
        if len(f.buffer) <= f.chunk_bytes:  # room for the chunk and a line break after it
            f.buffer = bytearray(f.chunk_bytes + 1)
        f.handle.seek(f.read_to)
        read = f.handle.readinto(memoryview(f.buffer)[: f.chunk_bytes])
        if read < f.chunk_bytes:  # the end of the file
            f.eof = True
            size = read
            break
        size = f.buffer.rfind(b"\n", 0, read) + 1
        if size:
            break
        f.chunk_bytes *= 2  # a line longer than the chunk: read it whole
    if not size:
        return
    if f.buffer[size - 1] == LINE_BREAK:
        data = memoryview(f.buffer)[:size]
    else:  # the file's last line, without its line break
        f.buffer[size] = LINE_BREAK
        data = memoryview(f.buffer)[: size + 1]
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


LINE_BREAK = ord("\n")


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
