"""PowerAPI 2.10 encodings: hwpc-sensor JSON, MongoDB documents and the CSV layouts.

Facts this module keeps (from PowerAPI 2.10's report and database code):

- JSON: a report is ``{timestamp, sensor, target, metadata, <payload>}``; ``timestamp`` is
  ``%Y-%m-%dT%H:%M:%S.%f`` (hwpc-sensor writes milliseconds) or Unix milliseconds, naive UTC.
  Socket input is one JSON document per line.
- MongoDB: the same document with ``timestamp`` as a BSON date (a naive UTC datetime in pymongo).
- CSV input: one file per events group, the group named after the file (``rapl.csv`` → ``rapl``);
  header ``timestamp,sensor,target,socket,cpu,<events>``; rows with the same timestamp and
  target, across files, sockets and cpus, make one report; counters are integers.
- CSV output: ``<dir>/<sensor>-<target>/<Kind>.csv``. PowerReport's header is
  ``timestamp,sensor,target,power,socket`` and then the other metadata keys, sorted;
  FormulaReport's is ``timestamp,sensor,target,metadata`` with the metadata as JSON. Timestamps
  are Unix milliseconds.
- Beyond PowerAPI, wattflow's ``TargetEnergyReport`` (a workload's energy once it has ended) has
  a CSV layout of its own: one file per sensor, ``<dir>/<sensor>/TargetEnergyReport.csv``, header
  :data:`CSV_TARGET_ENERGY` and then any other metadata keys, sorted.
"""

from __future__ import annotations

import csv
import heapq
import io
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TextIO

import msgspec
import orjson
from pydantic import ValidationError

from wattflow.formats.errors import DecodeError, describe_validation_error
from wattflow.formats.reports import (
    CPU_LIMIT,
    SOCKET_LIMIT,
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    TargetEnergyReport,
    bad_number_key,
    check_metadata,
    number_below,
    to_millis,
    to_utc,
)
from wattflow.formats.targets import LABEL_KEYS

CSV_COMMON = ("timestamp", "sensor", "target")
CSV_HWPC = (*CSV_COMMON, "socket", "cpu")
CSV_POWER_FIXED = (*CSV_COMMON, "power", "socket")
CSV_FORMULA = (*CSV_COMMON, "metadata")
CSV_TARGET_ENERGY = (
    *CSV_COMMON,
    *("start", "end", "cpu_j", "dram_j", "gpu_j", "reason"),
    *LABEL_KEYS,
)
"""wattflow's own layout of a workload's record (PowerAPI has none): its span in Unix ms, its
energy per scope in J, why it was reported, then its names. The names are in the header
whatever the first record holds, so a system cgroup's record (no names) cannot start a file
that a Slurm job's record would not fit."""

_PAYLOAD_EXCLUDE = {"timestamp", "sensor", "target", "metadata"}


# --- JSON -------------------------------------------------------------------------------------


def format_timestamp(timestamp: datetime) -> str:
    """hwpc-sensor's timestamp form: naive UTC, milliseconds unless finer precision is needed."""
    utc = timestamp.astimezone(UTC) if timestamp.tzinfo else timestamp
    text = utc.strftime("%Y-%m-%dT%H:%M:%S.%f")
    return text[:-3] if utc.microsecond % 1000 == 0 else text


def to_json_dict(report: Report) -> dict[str, Any]:
    """A report as PowerAPI's JSON document (timestamp as a string)."""
    return _document(report, format_timestamp(report.timestamp))


def _document(report: Report, timestamp: Any) -> dict[str, Any]:
    """A report's PowerAPI document, with ``timestamp`` as the encoding writes it."""
    document: dict[str, Any] = {
        "timestamp": timestamp,
        "sensor": report.sensor,
        "target": report.target,
        "metadata": report.metadata,
    }
    document.update(payload_of(report))
    return document


def payload_of(report: Report) -> dict[str, Any]:
    """A report's own fields, after the common base in its document."""
    # The kinds formulas write by the thousand skip pydantic's serializer.
    if type(report) is PowerReport:
        return {"power": report.power}
    if type(report) is HWPCReport:
        return {"groups": report.groups}
    if type(report) is FormulaReport:
        return {}
    return report.model_dump(mode="json", exclude=_PAYLOAD_EXCLUDE, exclude_none=True)


_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def encode_json(report: Report) -> str:
    """One report as one line of JSON, without the newline."""
    return orjson.dumps(to_json_dict(report), option=_JSON_OPTIONS).decode()


_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""A counter as :data:`~wattflow.formats.reports.Counter` takes an integer: one beyond 64 bits
is left to pydantic, which reads it as a double."""


class HwpcDocument(msgspec.Struct, gc=False):
    """hwpc-sensor's JSON report, as far as it must be checked before it is trusted.

    msgspec checks the whole layout, down to every counter being an integer or a float, in C
    while it parses. The same checks in Python cost as much again as parsing, and pydantic's
    validation of the nested groups several times that.
    """

    timestamp: int | float | str
    sensor: Annotated[str, msgspec.Meta(min_length=1)]
    target: Annotated[str, msgspec.Meta(min_length=1)]
    groups: dict[str, dict[str, dict[str, dict[str, _Int64 | float]]]] = {}
    metadata: dict[str, Any] = {}


decode_hwpc_document = msgspec.json.Decoder(HwpcDocument).decode
"""Parse and check one hwpc-sensor JSON report (raises ``msgspec.DecodeError``)."""


def decode_json(kind: type[Report], data: str | bytes, source: str, line: int | None) -> Report:
    """Decode one JSON document into a report of ``kind``.

    Raises:
        DecodeError: naming ``source``, ``line`` and the missing or invalid field.
    """
    if kind is HWPCReport:
        fast = _decode_hwpc(data, {})
        if fast is not None:
            return fast
    return _validated(kind, data, source, line)


def _validated(kind: type[Report], data: str | bytes, source: str, line: int | None) -> Report:
    """pydantic's validation of one JSON document: the report, or the error naming the field."""
    try:
        return kind.model_validate_json(data)
    except ValidationError as error:
        if any(e["type"] == "json_invalid" for e in error.errors()):
            message = error.errors()[0]["msg"]
            raise DecodeError(source, line, f"not valid JSON: {message}") from None
        if any(e["type"] == "model_type" for e in error.errors()):
            raise DecodeError(source, line, "a report must be a JSON object") from None
        raise DecodeError(
            source, line, f"{kind.kind}: {describe_validation_error(error)}"
        ) from None


def decode_json_lines(
    kind: type[Report], lines: Iterable[str | bytes], source: str, first_line: int
) -> tuple[list[Report], list[tuple[DecodeError, str | bytes]]]:
    """Decode consecutive JSON lines, numbered from ``first_line``; blank lines are skipped.

    Returns the reports, and each line that could not become one with its error, in order.
    Each line is decoded as :func:`decode_json` decodes it alone (an HWPCReport by msgspec,
    else by pydantic, whose report or error and the reason it gives are the line's), except
    that each timestamp is converted once per call: the reports of a tick share one datetime,
    which encoders then format once. A line msgspec refused goes straight to pydantic.
    """
    reports: list[Report] = []
    errors: list[tuple[DecodeError, str | bytes]] = []
    stamps: dict[int | float | str, datetime] = {}
    hwpc = kind is HWPCReport
    for number, line in enumerate(lines, first_line):
        report = _decode_hwpc(line, stamps) if hwpc else None
        if report is not None:
            reports.append(report)
        elif line.strip():
            try:
                reports.append(_validated(kind, line, source, number))
            except DecodeError as error:
                errors.append((error, line))
    return reports, errors


def _decode_hwpc(data: str | bytes, stamps: dict[int | float | str, datetime]) -> HWPCReport | None:
    """hwpc-sensor's JSON the fast way, or ``None`` to leave it to the full validation.

    Every report of a sensor goes through here. Anything msgspec's checks refuse, a timestamp
    :func:`to_utc` cannot read, a socket or cpu key out of bounds, or metadata no output writes
    falls back to pydantic, whose error names the field (and which also accepts the rare forms
    msgspec does not, such as counters written as strings). ``stamps`` holds the timestamps
    already converted, each once (one that cannot be read is never remembered).
    """
    try:
        document = decode_hwpc_document(data)
    except (msgspec.DecodeError, UnicodeDecodeError):  # bytes not UTF-8 in a string
        return None
    raw = document.timestamp
    timestamp = stamps.get(raw)
    if timestamp is None:
        timestamp = utc_or_none(raw)
        if timestamp is None:
            return None
        stamps[raw] = timestamp
    if bad_number_key(document.groups) is not None or not plain_metadata(document):
        return None
    return HWPCReport.trusted(
        timestamp=timestamp,
        sensor=document.sensor,
        target=document.target,
        metadata=document.metadata,
        groups=document.groups,
    )


def plain_metadata(document: HwpcDocument) -> bool:
    """Whether a document's metadata is as every output writes it (:func:`check_metadata`); a
    report whose metadata is not goes to pydantic's validation, which refuses it, naming the
    value. hwpc-sensor writes none: the check costs nothing on its reports."""
    if not document.metadata:
        return True
    try:
        check_metadata(document.metadata)
    except ValueError:
        return False
    return True


def utc_or_none(value: int | float | str) -> datetime | None:
    """``to_utc``, or ``None`` when it cannot read the value."""
    if type(value) is bool:
        return None
    try:
        return to_utc(value)
    except (ValueError, OverflowError):
        return None


FIRST_MILLIS = -62_135_596_800_000
"""Unix milliseconds of 0001-01-01T00:00:00Z, the earliest datetime Python holds."""
LAST_MILLIS = 253_402_300_799_999
"""Unix milliseconds of 9999-12-31T23:59:59.999Z, the latest whole millisecond it holds."""


def datetime_of(millis: int) -> datetime:
    """The UTC datetime of Unix milliseconds.

    Each call makes a new object: a caller that converts a tick's timestamp for many reports
    converts it once and hands the same object to each, which encoders then format once.

    Raises:
        ValueError: for milliseconds outside the datetimes Python holds.
    """
    if not FIRST_MILLIS <= millis <= LAST_MILLIS:
        raise ValueError(f"timestamp {millis} ms is out of range")
    return to_utc(millis)


def decode_document(kind: type[Report], document: Any, source: str, line: int | None) -> Report:
    """Decode an already parsed document (a JSON object or a MongoDB document).

    Raises:
        DecodeError: naming ``source``, ``line`` and the missing or invalid field.
    """
    if not isinstance(document, dict):
        raise DecodeError(source, line, "a report must be a JSON object")
    try:
        return kind.model_validate(document)
    except ValidationError as error:
        raise DecodeError(
            source, line, f"{kind.kind}: {describe_validation_error(error)}"
        ) from None


# --- MongoDB ----------------------------------------------------------------------------------


def to_mongodb(report: Report) -> dict[str, Any]:
    """A report as PowerAPI stores it in MongoDB: the JSON layout with a BSON date."""
    return _document(report, report.timestamp.astimezone(UTC).replace(tzinfo=None))


def from_mongodb(kind: type[Report], document: dict[str, Any], source: str = "mongodb") -> Report:
    """A report from a MongoDB document (its ``_id`` is ignored).

    Raises:
        DecodeError: naming the document's ``_id`` and the missing or invalid field.
    """
    where = f"{source} _id={document['_id']}" if "_id" in document else source
    return decode_document(kind, document, where, None)


# --- CSV input --------------------------------------------------------------------------------


def csv_group_name(path: Path) -> str:
    """PowerAPI names an events group after its file: ``rapl.csv`` holds group ``rapl``."""
    return path.name[:-4] if path.name.endswith(".csv") else path.name


CSV_ERRORS = "surrogateescape"
"""How CSV files are decoded: a byte that is not UTF-8 is kept as a lone surrogate (see
:data:`_NOT_UTF8`), so the row holding it is a dead letter and the rest of the file is read."""

_NOT_UTF8 = re.compile("[\udc80-\udcff]")
"""What :data:`CSV_ERRORS` makes of a byte that is not UTF-8."""

NOT_UTF8 = "not valid UTF-8"


def not_utf8(text: str) -> bool:
    """Whether text decoded with :data:`CSV_ERRORS` held bytes that are not UTF-8."""
    return _NOT_UTF8.search(text) is not None


def read_csv_header(path: Path, reader: Iterator[list[str]], required: Iterable[str]) -> list[str]:
    """The next row of ``reader`` (a ``csv.reader`` at the start of ``path``), checked by
    :func:`check_csv_header`.

    Raises:
        DecodeError: as :func:`check_csv_header` does, and for a header the csv module cannot
            read (a cell beyond its 128 KiB).
    """
    try:
        header = next(reader, None)
    except csv.Error as error:
        raise DecodeError(str(path), 1, f"the CSV header is unreadable: {error}") from None
    check_csv_header(path, header, required)
    assert header is not None
    return header


def check_csv_header(path: Path, header: list[str] | None, required: Iterable[str]) -> None:
    """Raise a :class:`DecodeError` naming the first required column the header lacks."""
    if not header:
        raise DecodeError(str(path), 1, "empty file: expected a CSV header")
    if not_utf8("".join(header)):
        raise DecodeError(str(path), 1, f"the CSV header is {NOT_UTF8}")
    for column in required:
        if column not in header:
            raise DecodeError(str(path), 1, f"missing field '{column}' in the CSV header")


Row = tuple[int, int, str, dict[str, str]]
"""A CSV row in merge order: (timestamp ms, file index, line number, row)."""


def _rows(
    path: Path, handle: TextIO, index: int, required: tuple[str, ...]
) -> Iterator[tuple[int, int, int, dict[str, str]] | DecodeError]:
    reader = csv.DictReader(handle)
    try:
        header = list(reader.fieldnames or [])
    except csv.Error as error:  # a field beyond the csv module's limit (128 KiB)
        problem = f"the CSV header is unreadable: {error}"
        raise DecodeError(str(path), reader.reader.line_num, problem) from None
    check_csv_header(path, header, required)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            # A field beyond the limit: the rest of its line is left unread, and the reader goes
            # on at the next line.
            yield DecodeError(str(path), reader.reader.line_num, f"not a CSV row: {error}")
            continue
        line = reader.line_num
        unreadable = _dict_row_problem(row)
        if unreadable is not None:
            yield DecodeError(str(path), line, unreadable)
            continue
        millis = _row_millis(row["timestamp"])
        if isinstance(millis, str):
            yield DecodeError(str(path), line, millis)
            continue
        yield millis, index, line, row


def _dict_row_problem(row: dict[str | None, Any]) -> str | None:
    """What makes a row of :func:`_rows` unreadable (text not UTF-8, an empty value, more
    values than columns), or ``None``."""
    if not_utf8("".join(v for v in row.values() if isinstance(v, str))):
        return NOT_UTF8
    empty = next((k for k, v in row.items() if v is None or v == ""), None)
    if empty is not None or None in row:
        return f"empty value for '{empty}'" if empty else "more values than header columns"
    return None


def _row_millis(text: str) -> int | str:
    """A CSV row's timestamp in Unix milliseconds (written as such or as a date), or what is
    wrong with it."""
    try:
        return int(text)
    except ValueError:
        try:
            return to_millis(to_utc(text))
        except ValueError as error:
            return f"field 'timestamp': {error}"


Counters = dict[str, int | float]
"""One cpu's events of one group, as a report's ``groups`` hold them."""

Sockets = dict[str, dict[str, Counters]]
"""One group of one report: socket → cpu → events."""

Block = tuple[int, int, int, dict[tuple[str, str], Sockets]]
"""Consecutive rows of one file with the same timestamp, in merge order: (timestamp ms, file
index, block number in the file, each (sensor, target)'s sockets)."""

HwpcRow = tuple[int, int, str, str, str, str, Counters]
"""A counter row read one at a time: (ms, line, sensor, target, socket, cpu, events)."""


class _EventsLayout:
    """Where an events file's header puts each column."""

    __slots__ = ("at", "events_at", "header", "names", "plain")

    def __init__(self, header: list[str]) -> None:
        self.header = header
        position = {name: header.index(name) for name in CSV_HWPC}
        self.at = tuple(position[name] for name in CSV_HWPC)
        self.events_at = [i for i, name in enumerate(header) if name not in CSV_HWPC]
        self.names = [header[i] for i in self.events_at]
        # PowerAPI's own layout: the five fixed columns first, in order, then only events.
        self.plain = header[: len(CSV_HWPC)] == list(CSV_HWPC) and self.events_at == list(
            range(len(CSV_HWPC), len(header))
        )


def _hwpc_blocks(
    path: Path, handle: TextIO, index: int, resume: tuple[list[str], int] | None = None
) -> Iterator[Block | DecodeError]:
    """One events file as blocks of rows sharing a timestamp, with bad rows as errors in place.

    Rows are read one at a time, as the csv module reads them, which also finds the line and
    the problem of a bad row. This is the reference the fast way into frames
    (:mod:`wattflow.formats.csv_frames`) is held to, the way paced replays read, and where the
    fast way hands over a file it cannot vouch for.

    ``resume`` is (header, lines already read) for a handle positioned at the start of a row,
    where the columnar reader hands a file over.
    """
    reader = csv.reader(handle)
    if resume is None:
        header, offset = read_csv_header(path, reader, CSV_HWPC), 0
    else:
        header, offset = resume
    rows = _hwpc_rows(path, reader, _EventsLayout(header), offset)
    yield from _row_blocks(rows, index, itertools.count())


def _hwpc_rows(
    path: Path, reader: Any, layout: _EventsLayout, offset: int
) -> Iterator[HwpcRow | DecodeError]:
    """Rows one at a time, as the csv module reads them, each bad one an error naming its line.

    ``reader`` is a ``csv.reader``; ``offset`` is the number of lines before its first.
    """
    _, at_sensor, at_target, at_socket, at_cpu = layout.at
    names = layout.names
    for cells in reader:
        line = offset + reader.line_num
        checked = _checked_cells(cells, layout)
        if isinstance(checked, str):
            yield DecodeError(str(path), line, checked)
            continue
        millis, values = checked
        yield (
            millis,
            line,
            cells[at_sensor],
            cells[at_target],
            cells[at_socket],
            cells[at_cpu],
            dict(zip(names, values, strict=True)),
        )


def _checked_cells(cells: list[str], layout: _EventsLayout) -> tuple[int, list[int | float]] | str:
    """A counter row's timestamp (Unix ms) and counters, or what makes the row unreadable."""
    header = layout.header
    if len(cells) != len(header) or "" in cells:
        return _bad_cells(header, cells)
    if not_utf8("".join(cells)):
        return NOT_UTF8
    at_ts, _, _, at_socket, at_cpu = layout.at
    millis = _row_millis(cells[at_ts])
    if isinstance(millis, str):
        return millis
    if not FIRST_MILLIS <= millis <= LAST_MILLIS:
        return f"field 'timestamp': {cells[at_ts]!r} is out of range"
    problem = _bad_row_number(cells[at_socket], cells[at_cpu])
    if problem is not None:
        return problem
    raw = cells[len(CSV_HWPC) :] if layout.plain else [cells[i] for i in layout.events_at]
    try:
        return millis, list(map(int, raw))
    except ValueError:
        try:
            return millis, [_number(value) for value in raw]
        except ValueError as error:
            return f"counter is not a number: {error}"


def _bad_row_number(socket: str, cpu: str) -> str | None:
    """Why a CSV row's socket or cpu cannot be taken (see
    :func:`~wattflow.formats.reports.bad_number_key`), or ``None``."""
    if not number_below(socket, SOCKET_LIMIT):
        return f"field 'socket': {socket!r} is not a socket number (0 to {SOCKET_LIMIT - 1})"
    if not number_below(cpu, CPU_LIMIT):
        return f"field 'cpu': {cpu!r} is not a cpu number (0 to {CPU_LIMIT - 1})"
    return None


def _row_blocks(
    rows: Iterator[HwpcRow | DecodeError], index: int, blocks: Iterator[int]
) -> Iterator[Block | DecodeError]:
    """Rows read one at a time, grouped into the blocks the fast way makes."""
    millis: int | None = None
    entries: dict[tuple[str, str], Sockets] = {}
    for row in rows:
        if isinstance(row, DecodeError):
            yield row
            continue
        stamp, _, sensor, target, socket, cpu, events = row
        if stamp != millis:
            if millis is not None:
                yield millis, index, next(blocks), entries
            millis, entries = stamp, {}
        cpus = entries.setdefault((sensor, target), {}).setdefault(socket, {})
        found = cpus.get(cpu)
        if found is None:
            cpus[cpu] = events
        else:
            found.update(events)
    if millis is not None:
        yield millis, index, next(blocks), entries


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _bad_cells(header: list[str], cells: list[str]) -> str:
    if len(cells) > len(header):
        return "more values than header columns"
    for name, value in zip(header, cells, strict=False):
        if value == "":
            return f"empty value for '{name}'"
    return f"empty value for '{header[len(cells)]}'"


def read_hwpc_csv(
    paths: list[Path], resume: Sequence[tuple[TextIO, list[str], int]] | None = None
) -> Iterator[HWPCReport | DecodeError]:
    """Merge PowerAPI's per-group CSV files into HWPCReports, in timestamp order.

    Each file must be sorted by timestamp, as hwpc-sensor writes it. Rows with the same timestamp,
    sensor and target across all files make one report. A row that cannot be read is yielded as a
    :class:`DecodeError` in its place, so the caller can dead-letter it and go on. (PowerAPI's own
    reader needs its files in a particular order and drops rows otherwise; this one does not.)

    Files are merged a block of rows with one timestamp at a time: picking the earliest block
    among the files gives the rows in the order picking the earliest row would, with one step
    per block instead of one per row.

    ``resume`` goes on reading files another reader started: for each path, a text handle at
    the start of a row, the header and the number of lines before that row.

    Raises:
        DecodeError: when a file's header lacks a required column (nothing could be read).
    """
    handles, positions = _handles(paths, resume)
    groups = [csv_group_name(path) for path in paths]
    try:
        streams = [
            _hwpc_blocks(p, h, i, at)
            for i, (p, h, at) in enumerate(zip(paths, handles, positions, strict=True))
        ]
        errors: list[DecodeError] = []
        # Tuples order by (ms, file index, block number): unique, so the rest is never compared.
        merged = heapq.merge(*(_only_blocks(stream, errors) for stream in streams))
        pending: dict[tuple[str, str], dict[str, Sockets]] = {}
        current: int | None = None
        for millis, index, _, entries in merged:
            if errors:
                yield from errors
                errors.clear()
            if millis != current:
                if current is not None:
                    yield from _flush(current, pending)
                current = millis
            _add_block(pending, groups[index], entries)
        yield from errors
        if current is not None:
            yield from _flush(current, pending)
    finally:
        for handle in handles:
            handle.close()


def _handles(
    paths: list[Path], resume: Sequence[tuple[TextIO, list[str], int]] | None
) -> tuple[list[TextIO], list[tuple[list[str], int] | None]]:
    """Each file's text handle and where it stands (see :func:`read_hwpc_csv`'s ``resume``;
    ``None``: at its start, header unread)."""
    if resume is None:
        handles: list[TextIO] = [
            path.open(newline="", encoding="utf-8", errors=CSV_ERRORS) for path in paths
        ]
        return handles, [None] * len(paths)
    return [handle for handle, _, _ in resume], [(header, line) for _, header, line in resume]


def _add_block(
    pending: dict[tuple[str, str], dict[str, Sockets]],
    group: str,
    entries: dict[tuple[str, str], Sockets],
) -> None:
    """Add a block of one group's rows to the reports of its tick."""
    for key, sockets in entries.items():
        found = pending.get(key)
        if found is None:
            pending[key] = {group: sockets}
        elif group in found:
            _merge_sockets(found[group], sockets)
        else:
            found[group] = sockets


def _only_blocks(
    stream: Iterator[Block | DecodeError], errors: list[DecodeError]
) -> Iterator[Block]:
    for item in stream:
        if isinstance(item, DecodeError):
            errors.append(item)
        else:
            yield item


def _merge_sockets(into: Sockets, sockets: Sockets) -> None:
    """Add a later block's rows of one group to a report's: a tick cut by a chunk boundary."""
    for socket, cpus in sockets.items():
        known = into.get(socket)
        if known is None:
            into[socket] = cpus
            continue
        for cpu, events in cpus.items():
            found = known.get(cpu)
            if found is None:
                known[cpu] = events
            else:
                found.update(events)


def _flush(millis: int, pending: dict[tuple[str, str], dict[str, Sockets]]) -> Iterator[HWPCReport]:
    # Every value was parsed and checked row by row: no need to validate the report again.
    # One datetime for the tick's reports, which encoders then format once.
    timestamp = datetime_of(millis)
    for (sensor, target), groups in pending.items():
        yield HWPCReport.trusted(
            timestamp=timestamp,
            sensor=sensor,
            target=target,
            metadata={},
            groups=groups,
        )
    pending.clear()


def read_power_csv(path: Path) -> Iterator[PowerReport | DecodeError]:
    """Read a PowerReport.csv back: the columns besides the fixed ones become metadata."""
    with path.open(newline="", encoding="utf-8", errors=CSV_ERRORS) as handle:
        for item in _rows(path, handle, 0, (*CSV_COMMON, "power")):
            if isinstance(item, DecodeError):
                yield item
                continue
            millis, _, line, row = item
            metadata: dict[str, Any] = {
                k: v for k, v in row.items() if k not in (*CSV_COMMON, "power")
            }
            try:
                yield PowerReport.model_validate(
                    {
                        "timestamp": millis,
                        "sensor": row["sensor"],
                        "target": row["target"],
                        "power": row["power"],
                        "metadata": metadata,
                    }
                )
            except ValidationError as error:
                yield DecodeError(str(path), line, describe_validation_error(error))


# --- CSV output -------------------------------------------------------------------------------


OWN_SCOPES = frozenset({"gpu", "node"})
"""Scopes of the PowerReports of wattflow's own formulas (GPU, node), which PowerAPI has not:
their metadata has other keys than SmartWatts' (the GPU's ``device``), so in CSV they have a
file of their own beside PowerAPI's, each with one header whatever comes first."""


def csv_output_name(kind: str, scope: object) -> str:
    """The name of a CSV file, without ``.csv``: the kind of its reports, as PowerAPI names it,
    and for PowerReports of one of :data:`OWN_SCOPES`, the scope after it (``PowerReport-gpu``)."""
    if kind == PowerReport.kind and scope in OWN_SCOPES:
        return f"{kind}-{scope}"
    return kind


def csv_output_path(directory: Path, sensor: str, target: str, name: str) -> Path:
    """Where the CSV output puts a report: ``<dir>/<sensor>-<target>/<Kind>.csv``, as PowerAPI
    does (``name``: :func:`csv_output_name`); a workload's record, wattflow's own, in one file
    per sensor, ``<dir>/<sensor>/TargetEnergyReport.csv`` (each workload ends once: a folder
    per workload would hold one row)."""
    if name == TargetEnergyReport.kind:
        return directory / sensor / f"{name}.csv"
    return directory / f"{sensor}-{target}" / f"{name}.csv"


def csv_output_header(kind: str, metadata: Iterable[Any]) -> list[str]:
    """The header PowerAPI writes for a file whose first report is of ``kind`` with these
    metadata keys."""
    if kind == PowerReport.kind:
        return [*CSV_POWER_FIXED, *sorted(set(metadata) - set(CSV_POWER_FIXED))]
    if kind == FormulaReport.kind:
        return list(CSV_FORMULA)
    if kind == TargetEnergyReport.kind:
        return [*CSV_TARGET_ENERGY, *sorted(set(metadata) - set(CSV_TARGET_ENERGY))]
    raise ValueError(f"PowerAPI's CSV output has no layout for {kind}")


def csv_line(row: list[str]) -> str:
    """One row as the csv module writes it (quoting where needed), ``\\r\\n`` included."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerow(row)
    return buffer.getvalue()
