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
"""

from __future__ import annotations

import csv
import heapq
import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import orjson
from pydantic import ValidationError

from wattflow.formats.errors import DecodeError, describe_validation_error
from wattflow.formats.reports import (
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    to_millis,
    to_utc,
)

CSV_COMMON = ("timestamp", "sensor", "target")
CSV_HWPC = (*CSV_COMMON, "socket", "cpu")
CSV_POWER_FIXED = (*CSV_COMMON, "power", "socket")
CSV_FORMULA = (*CSV_COMMON, "metadata")

_PAYLOAD_EXCLUDE = {"timestamp", "sensor", "target", "metadata"}


# --- JSON -------------------------------------------------------------------------------------


def format_timestamp(timestamp: datetime) -> str:
    """hwpc-sensor's timestamp form: naive UTC, milliseconds unless finer precision is needed."""
    utc = timestamp.astimezone(UTC) if timestamp.tzinfo else timestamp
    text = utc.strftime("%Y-%m-%dT%H:%M:%S.%f")
    return text[:-3] if utc.microsecond % 1000 == 0 else text


def to_json_dict(report: Report) -> dict[str, Any]:
    """A report as PowerAPI's JSON document (timestamp as a string)."""
    document: dict[str, Any] = {
        "timestamp": _formatted_timestamp(report.timestamp),
        "sensor": report.sensor,
        "target": report.target,
        "metadata": report.metadata,
    }
    # The kinds formulas write by the thousand skip pydantic's serializer.
    if type(report) is PowerReport:
        document["power"] = report.power
    elif type(report) is HWPCReport:
        document["groups"] = report.groups
    elif type(report) is not FormulaReport:
        document.update(report.model_dump(mode="json", exclude=_PAYLOAD_EXCLUDE, exclude_none=True))
    return document


_last_formatted: list[Any] = [None, ""]


def _formatted_timestamp(timestamp: datetime) -> str:
    """``format_timestamp`` remembering its last answer: a tick's reports share a timestamp."""
    if timestamp is not _last_formatted[0]:
        _last_formatted[0], _last_formatted[1] = timestamp, format_timestamp(timestamp)
    text: str = _last_formatted[1]
    return text


def encode_json(report: Report) -> str:
    """One report as one line of JSON, without the newline."""
    return orjson.dumps(to_json_dict(report), option=orjson.OPT_NON_STR_KEYS).decode()


def decode_json(kind: type[Report], data: str | bytes, source: str, line: int | None) -> Report:
    """Decode one JSON document into a report of ``kind``.

    Raises:
        DecodeError: naming ``source``, ``line`` and the missing or invalid field.
    """
    if kind is HWPCReport:
        fast = _decode_hwpc(data)
        if fast is not None:
            return fast
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


def _decode_hwpc(data: str | bytes) -> HWPCReport | None:
    """hwpc-sensor's JSON the fast way, or ``None`` to leave it to the full validation.

    Every report of a sensor goes through here, and pydantic's validation of the nested groups
    costs twice what parsing them does. This path checks the structure down to the sockets and
    leaves each cpu's events as JSON gave them (formulas check those as they sum them);
    anything unusual (a missing field, a wrong type, a timestamp it cannot read) falls back to
    pydantic, whose error names the field.
    """
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(document) is not dict:
        return None
    sensor = document.get("sensor")
    target = document.get("target")
    groups = document.get("groups", _NO_GROUPS)
    metadata = document.get("metadata", _NO_GROUPS)
    if (
        type(sensor) is not str
        or type(target) is not str
        or not sensor
        or not target
        or type(groups) is not dict
        or type(metadata) is not dict
    ):
        return None
    for sockets in groups.values():
        if type(sockets) is not dict:
            return None
        for cpus in sockets.values():
            if type(cpus) is not dict:
                return None
    timestamp = _cached_timestamp(document.get("timestamp"))
    if timestamp is None:
        return None
    return HWPCReport.trusted(
        timestamp=timestamp,
        sensor=sensor,
        target=target,
        metadata=dict(metadata) if metadata is _NO_GROUPS else metadata,
        groups=dict(groups) if groups is _NO_GROUPS else groups,
    )


_NO_GROUPS: dict[str, Any] = {}
_last_timestamp: list[Any] = [None, None]


def _cached_timestamp(value: Any) -> datetime | None:
    """``to_utc`` remembering its last answer: every report of a tick has the same timestamp."""
    if value == _last_timestamp[0] and type(value) is type(_last_timestamp[0]):
        cached: datetime = _last_timestamp[1]
        return cached
    if type(value) not in (int, str):
        return None
    try:
        converted = to_utc(value)
    except (ValueError, OverflowError):
        return None
    _last_timestamp[0], _last_timestamp[1] = value, converted
    return converted


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
    document = to_json_dict(report)
    document["timestamp"] = report.timestamp.astimezone(UTC).replace(tzinfo=None)
    return document


def from_mongodb(kind: type[Report], document: dict[str, Any], source: str = "mongodb") -> Report:
    """A report from a MongoDB document (its ``_id`` is ignored).

    Raises:
        DecodeError: naming the document's ``_id`` and the missing or invalid field.
    """
    identifier = document.get("_id")
    where = f"{source} _id={identifier}" if identifier is not None else source
    return decode_document(kind, document, where, None)


# --- CSV input --------------------------------------------------------------------------------


def csv_group_name(path: Path) -> str:
    """PowerAPI names an events group after its file: ``rapl.csv`` holds group ``rapl``."""
    return path.name[:-4] if path.name.endswith(".csv") else path.name


def check_csv_header(path: Path, header: list[str] | None, required: Iterable[str]) -> None:
    """Raise a :class:`DecodeError` naming the first required column the header lacks."""
    if not header:
        raise DecodeError(str(path), 1, "empty file: expected a CSV header")
    for column in required:
        if column not in header:
            raise DecodeError(str(path), 1, f"missing field '{column}' in the CSV header")


Row = tuple[int, int, str, dict[str, str]]
"""A CSV row in merge order: (timestamp ms, file index, line number, row)."""


def _rows(
    path: Path, handle: TextIO, index: int, required: tuple[str, ...]
) -> Iterator[tuple[int, int, int, dict[str, str]] | DecodeError]:
    reader = csv.DictReader(handle)
    check_csv_header(path, list(reader.fieldnames or []), required)
    for row in reader:
        line = reader.line_num
        empty = next((k for k, v in row.items() if v is None or v == ""), None)
        if empty is not None or None in row:
            problem = f"empty value for '{empty}'" if empty else "more values than header columns"
            yield DecodeError(str(path), line, problem)
            continue
        try:
            millis = int(row["timestamp"])
        except ValueError:
            try:
                millis = to_millis(to_utc(row["timestamp"]))
            except ValueError as error:
                yield DecodeError(str(path), line, f"field 'timestamp': {error}")
                continue
        yield millis, index, line, row


HwpcRow = tuple[int, int, int, str, str, str, str, dict[str, int | float]]
"""A counter row in merge order: (ms, file index, line, sensor, target, socket, cpu, events)."""


def _hwpc_rows(path: Path, handle: TextIO, index: int) -> Iterator[HwpcRow | DecodeError]:
    """One events file's rows, parsed: the common case (integer counters) stays in C."""
    reader = csv.reader(handle)
    header = next(reader, None)
    check_csv_header(path, header, CSV_HWPC)
    assert header is not None
    position = {name: header.index(name) for name in CSV_HWPC}
    at_ts, at_sensor, at_target = position["timestamp"], position["sensor"], position["target"]
    at_socket, at_cpu = position["socket"], position["cpu"]
    events_at = [i for i, name in enumerate(header) if name not in CSV_HWPC]
    names = [header[i] for i in events_at]
    contiguous = events_at == list(range(len(CSV_HWPC), len(header)))
    width = len(header)
    for cells in reader:
        line = reader.line_num
        if len(cells) != width or "" in cells:
            yield DecodeError(str(path), line, _bad_cells(header, cells))
            continue
        try:
            millis = int(cells[at_ts])
        except ValueError:
            try:
                millis = to_millis(to_utc(cells[at_ts]))
            except ValueError as error:
                yield DecodeError(str(path), line, f"field 'timestamp': {error}")
                continue
        raw = cells[len(CSV_HWPC) :] if contiguous else [cells[i] for i in events_at]
        try:
            values: list[int | float] = list(map(int, raw))
        except ValueError:
            try:
                values = [_number(value) for value in raw]
            except ValueError as error:
                yield DecodeError(str(path), line, f"counter is not a number: {error}")
                continue
        yield (
            millis,
            index,
            line,
            cells[at_sensor],
            cells[at_target],
            cells[at_socket],
            cells[at_cpu],
            dict(zip(names, values, strict=True)),
        )


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _bad_cells(header: list[str], cells: list[str]) -> str:
    if len(cells) > len(header):
        return "more values than header columns"
    for name, value in zip(header, cells, strict=False):
        if value == "":
            return f"empty value for '{name}'"
    return f"empty value for '{header[len(cells)]}'"


def read_hwpc_csv(paths: list[Path]) -> Iterator[HWPCReport | DecodeError]:
    """Merge PowerAPI's per-group CSV files into HWPCReports, in timestamp order.

    Each file must be sorted by timestamp, as hwpc-sensor writes it. Rows with the same timestamp,
    sensor and target across all files make one report. A row that cannot be read is yielded as a
    :class:`DecodeError` in its place, so the caller can dead-letter it and go on. (PowerAPI's own
    reader needs its files in a particular order and drops rows otherwise; this one does not.)

    Raises:
        DecodeError: when a file's header lacks a required column (nothing could be read).
    """
    handles = [path.open(newline="", encoding="utf-8") for path in paths]
    groups = [csv_group_name(path) for path in paths]
    try:
        streams = [_hwpc_rows(p, h, i) for i, (p, h) in enumerate(zip(paths, handles, strict=True))]
        errors: list[DecodeError] = []
        # Tuples order by (ms, file index, line): unique, so the rest is never compared.
        merged = heapq.merge(*(_only_rows(stream, errors) for stream in streams))
        pending: dict[tuple[str, str], dict[str, Any]] = {}
        current: int | None = None
        for millis, index, _, sensor, target, socket, cpu, events in merged:
            if errors:
                yield from errors
                errors.clear()
            if millis != current:
                if current is not None:
                    yield from _flush(pending)
                current = millis
            entry = pending.get((sensor, target))
            if entry is None:
                entry = pending[(sensor, target)] = {
                    "timestamp": millis,
                    "sensor": sensor,
                    "target": target,
                    "metadata": {},
                    "groups": {},
                }
            cpus = entry["groups"].setdefault(groups[index], {}).setdefault(socket, {})
            found = cpus.get(cpu)
            if found is None:
                cpus[cpu] = events
            else:
                found.update(events)
        yield from errors
        yield from _flush(pending)
    finally:
        for handle in handles:
            handle.close()


def _only_rows(
    stream: Iterator[HwpcRow | DecodeError], errors: list[DecodeError]
) -> Iterator[HwpcRow]:
    for item in stream:
        if isinstance(item, DecodeError):
            errors.append(item)
        else:
            yield item


def _flush(pending: dict[tuple[str, str], dict[str, Any]]) -> Iterator[HWPCReport]:
    # Every value was parsed and checked row by row: no need to validate the report again.
    for entry in pending.values():
        entry["timestamp"] = _cached_timestamp(entry["timestamp"])
        yield HWPCReport.trusted(**entry)
    pending.clear()


def read_power_csv(path: Path) -> Iterator[PowerReport | DecodeError]:
    """Read a PowerReport.csv back: the columns besides the fixed ones become metadata."""
    with path.open(newline="", encoding="utf-8") as handle:
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


def hwpc_csv_rows(report: HWPCReport) -> Iterator[tuple[str, list[str], list[str]]]:
    """A report in PowerAPI's CSV input layout: ``(group, header, row)`` per socket and cpu."""
    millis = str(to_millis(report.timestamp))
    for group, sockets in report.groups.items():
        for socket, cpus in sockets.items():
            for cpu, events in cpus.items():
                header = [*CSV_HWPC, *events]
                row = [millis, report.sensor, report.target, socket, cpu]
                yield group, header, row + [str(value) for value in events.values()]


# --- CSV output -------------------------------------------------------------------------------


def csv_output_path(directory: Path, report: Report) -> Path:
    """Where PowerAPI's CSV output puts a report: ``<dir>/<sensor>-<target>/<Kind>.csv``."""
    return directory / f"{report.sensor}-{report.target}" / f"{report.kind}.csv"


def csv_output_header(report: Report) -> list[str]:
    """The header PowerAPI writes for the first report of a file."""
    if isinstance(report, PowerReport):
        return [*CSV_POWER_FIXED, *sorted(set(report.metadata) - set(CSV_POWER_FIXED))]
    if isinstance(report, FormulaReport):
        return list(CSV_FORMULA)
    raise ValueError(f"PowerAPI's CSV output has no layout for {report.kind}")


def csv_output_row(report: Report, header: list[str]) -> list[str]:
    """A report's values in ``header``'s order, written as PowerAPI writes them.

    Raises:
        ValueError: when the report has metadata the file's header has no column for.
    """
    millis = str(to_millis(report.timestamp))
    if isinstance(report, FormulaReport):
        return [millis, report.sensor, report.target, json.dumps(report.metadata)]
    assert isinstance(report, PowerReport)
    values: dict[str, Any] = {**report.metadata, "power": report.power}
    extra = set(values) - set(header)
    if extra:
        raise ValueError(f"metadata {sorted(extra)} has no column in the file's header")
    values.update(timestamp=millis, sensor=report.sensor, target=report.target)
    return ["" if values.get(c) is None else str(values[c]) for c in header]
