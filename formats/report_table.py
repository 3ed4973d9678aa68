"""Reports as a table of columns, written as PowerAPI's JSON lines or CSV rows in one pass.

The JSON Lines and CSV outputs have one way to write, whatever they are given: a frame of
PowerReports from SmartWatts or RAPL, reports from the GPU and node formulas, an input recorded
as it is. :meth:`ReportTable.of` makes any of them one table, and the encoders format it a column
at a time: each distinct value of a column of few values (a timestamp, a target, a scope) once,
a column of floats in one call to orjson, the rows' metadata documents in one call too. The rows
are then laid out by :func:`join_rows` in one pass, with no Python code run per row.

The encodings are PowerAPI's, byte for byte: a JSON line is what ``orjson`` writes for the
report's document (:func:`~wattflow.formats.powerapi.to_json_dict`), a CSV row what the ``csv``
module writes for the row PowerAPI's CSV output lays out (``str`` of each value, empty for
``None``, quoted where needed, ``\\r\\n`` after it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, AnyStr, TypeAlias, cast

import numpy as np
import orjson

from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, expand, power_frame
from wattflow.formats.frames import Column, FloatArray, IntArray, PowerFrame
from wattflow.formats.reports import (
    FormulaReport,
    PowerReport,
    Report,
    TargetEnergyReport,
    to_millis,
)

Values: TypeAlias = Column | FloatArray | list[Any]
"""A column: few distinct values, coded; floats; or each row's value."""

Piece: TypeAlias = AnyStr | Column | list[AnyStr]
"""Part of every row: the same text on each, a column of few texts (codes into them), or each
row's text."""

_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


@dataclass(slots=True, eq=False)
class ReportTable:
    """Reports, one row each, as columns: what the CSV and JSON Lines outputs write.

    ``metadata`` is a column per key when every row has those keys in that order (a frame's),
    else each row's dict.
    """

    kinds: Column
    """Each row's kind (``PowerReport``…)."""
    timestamps: Column
    """Each row's code into the distinct timestamps: datetimes, or Unix ms where
    ``timestamps_in_millis`` (a frame's ticks, which the CSV output writes as they are)."""
    sensors: Column
    targets: Column
    metadata: dict[str, Values] | list[dict[str, Any]]
    power: FloatArray | list[Any] | None
    """Each row's power (``None`` on a row of another kind); ``None`` without PowerReports."""
    payloads: list[dict[str, Any]] | None
    """Each row's own fields, as its document holds them; ``None`` when every row is a
    PowerReport (its own field is its power)."""
    source: Batch
    """What the table was made of, to give back the reports of rows an output refuses."""
    timestamps_in_millis: bool = False

    def __len__(self) -> int:
        return len(self.timestamps.codes)

    @classmethod
    def of(cls, batch: Batch) -> ReportTable:
        """The table of a batch: of reports, or of a frame, which travels alone (a PowerFrame
        read straight from its columns, any other frame from its reports)."""
        frame = power_frame(batch)
        if frame is not None:
            return cls._of_power_frame(frame)
        return cls._of_reports(expand(batch))

    @classmethod
    def _of_power_frame(cls, frame: PowerFrame) -> ReportTable:
        ticks, tick_codes = _ticks(frame.millis)
        rows = len(frame)
        # A row with metadata of its own (its input report's) goes as its dict.
        metadata: dict[str, Values] | list[dict[str, Any]] = (
            dict(frame.metadata) if frame.report_metadata is None else frame.metadata_rows()
        )
        first = np.zeros(rows, dtype=np.int64)  # every row's code into one value (never changed)
        return cls(
            kinds=Column(first, [PowerReport.kind]),
            timestamps=Column(tick_codes, ticks.tolist()),
            sensors=Column(first, [frame.sensor]),
            targets=Column(frame.targets, frame.target_names),
            metadata=metadata,
            power=frame.power,
            payloads=None,
            source=[frame],
            timestamps_in_millis=True,
        )

    @classmethod
    def _of_reports(cls, reports: list[Report]) -> ReportTable:
        kinds = set(map(type, reports))
        types = Column(np.zeros(len(reports), dtype=np.int64), list(kinds))
        if len(kinds) > 1:
            types = coded(list(map(type, reports)))
        powers = kinds == {PowerReport}
        power = None
        if PowerReport in kinds:
            power = [getattr(report, "power", None) for report in reports]
        return cls(
            kinds=Column(types.codes, [kind.kind for kind in types.values]),
            timestamps=coded([report.timestamp for report in reports]),
            sensors=coded([report.sensor for report in reports]),
            targets=coded([report.target for report in reports]),
            metadata=[report.metadata for report in reports],
            power=power,
            payloads=None if powers else list(map(powerapi.payload_of, reports)),
            source=reports,
        )

    def take(self, rows: IntArray) -> ReportTable:
        """The table of some of its rows, in the order given."""
        columns = ("kinds", "timestamps", "sensors", "targets", "metadata", "power", "payloads")
        taken = {name: _taken(getattr(self, name), rows) for name in columns}
        return ReportTable(
            **taken, source=self.source, timestamps_in_millis=self.timestamps_in_millis
        )

    def reports_at(self, rows: Sequence[int]) -> list[Report]:
        """The reports of some rows of the table as it was made (not of a :meth:`take`)."""
        source = self.source
        if not rows:
            return []
        reports = expand(source)
        return [reports[row] for row in rows]

    def metadata_values(self, key: str) -> Values | None:
        """The column of one metadata key (``None`` where a row lacks it); ``None`` when the
        table's columns do not hold the key."""
        metadata = self.metadata
        if isinstance(metadata, dict):
            return metadata.get(key)
        return [row.get(key) for row in metadata]


def coded(values: list[Any]) -> Column:
    """Values as a coded column, each distinct value once, in order of appearance."""
    index: dict[Any, int] = {}
    codes = [index.setdefault(value, len(index)) for value in values]
    return Column(np.array(codes, dtype=np.int64), list(index))


def _ticks(millis: IntArray) -> tuple[IntArray, IntArray]:
    """A frame's distinct timestamps and each row's code into them: without a sort when they
    go forward, as formulas write them (a live sensor's frame is one tick: a few numpy calls,
    each costing more than its rows)."""
    if not len(millis) or np.count_nonzero(millis[1:] < millis[:-1]):
        ticks, inverse = np.unique(millis, return_inverse=True)
        return ticks, inverse.reshape(-1)
    new = np.empty(len(millis), dtype=np.bool_)
    new[0] = True
    np.not_equal(millis[1:], millis[:-1], out=new[1:])
    codes: IntArray = new.cumsum() - 1
    return millis[new], codes


def _taken(values: Any, rows: IntArray) -> Any:
    if values is None:
        return None
    if isinstance(values, dict):
        return {key: _taken(column, rows) for key, column in values.items()}
    if isinstance(values, Column):
        return Column(values.codes[rows], values.values)
    if isinstance(values, np.ndarray):
        return values[rows]
    return [values[row] for row in rows.tolist()]


# --- Rows of text -----------------------------------------------------------------------------


FEW_ROWS = 256
"""Up to this many rows, texts are picked in Python and columns are not merged with one another
(each is joined with its constants only): numpy's fixed cost per call (tens of them to merge
columns) is then more than the rows' own work. A live sensor's tick is a table of a few dozen
rows, a few ticks of it a few hundred."""


def join_rows(
    pieces: Sequence[Piece[AnyStr]], rows: int, cuts: Sequence[int], empty: AnyStr
) -> list[AnyStr]:
    """The rows the pieces make side by side, as one text per cut (``cuts``: rows in each);
    ``empty``, ``""`` or ``b""``, says which texts they are.

    Neighbouring pieces of few texts are made one piece, each combination of their texts that
    occurs written once, as long as the combinations stay few beside the rows; then every
    piece is laid into one list a piece at a time, and each cut joined in one call.
    """
    laid = _merged(pieces, rows, empty)
    width = len(laid)
    cells: list[AnyStr] = [empty] * (width * rows)
    for at, column in enumerate(laid):
        cells[at::width] = column
    if len(cuts) == 1:  # one text of every row (JSON Lines): no slice of the cells to copy
        return [empty.join(cells)]
    texts: list[AnyStr] = []
    start = 0
    for count in cuts:
        texts.append(empty.join(cells[width * start : width * (start + count)]))
        start += count
    return texts


def _merged(pieces: Sequence[Piece[AnyStr]], rows: int, empty: AnyStr) -> list[list[AnyStr]]:
    """Each row's text of each piece left once neighbouring pieces of few texts are merged.

    A column of one text (a frame's one tick, its sensor) is that text on every row: merged
    like any other constant, it costs nothing per row. Constants are gathered as they come
    and joined once, with the column they precede where there is one."""
    limit = 1 if rows <= FEW_ROWS else rows // 4
    laid: list[list[AnyStr]] = []
    run: list[AnyStr | Column] = []
    size = 1
    for piece in pieces:
        if isinstance(piece, Column):
            values = piece.values
            if len(values) == 1:
                run.append(values[0])
                continue
            if size > 1 and size * len(values) > limit:
                laid.append(_run_texts(run, rows, empty))
                run, size = [], 1
            size *= max(len(values), 1)
            run.append(piece)
        elif isinstance(piece, list):
            if run:
                laid.append(_run_texts(run, rows, empty))
                run, size = [], 1
            laid.append(piece)
        else:
            run.append(piece)
    if run:
        laid.append(_run_texts(run, rows, empty))
    return laid


def _run_texts(run: list[AnyStr | Column], rows: int, empty: AnyStr) -> list[AnyStr]:
    """Each row's text of pieces laid side by side: constants, and columns of few texts.

    With one column among constants, each of its texts is joined with them once, then picked
    for every row: work per distinct text, not per row and piece."""
    coded = [at for at, piece in enumerate(run) if isinstance(piece, Column)]
    if not coded:
        return [empty.join(cast("list[AnyStr]", run))] * rows
    if len(coded) == 1:
        at = coded[0]
        column = cast(Column, run[at])
        before = empty.join(cast("list[AnyStr]", run[:at]))
        after = empty.join(cast("list[AnyStr]", run[at + 1 :]))
        return _pick([before + text + after for text in column.values], column.codes)
    return _texts_by_combination(run, [cast(Column, run[at]) for at in coded], empty)


def _texts_by_combination(
    run: list[AnyStr | Column], coded: list[Column], empty: AnyStr
) -> list[AnyStr]:
    """Many rows: each combination of the columns' texts that occurs is joined once, then
    picked for every row that has it (``coded``: the run's columns, in order)."""
    combined = coded[0].codes
    for column in coded[1:]:
        combined = combined * len(column.values) + column.codes
    present = np.flatnonzero(np.bincount(combined))
    lookup = np.zeros(int(present.max(initial=0)) + 1, dtype=np.int64)
    lookup[present] = np.arange(len(present))
    digits = _digits(present, coded)
    parts: list[list[AnyStr]] = [
        _pick(piece.values, digits.pop()) if isinstance(piece, Column) else [piece] * len(present)
        for piece in run
    ]
    made = [empty.join(row) for row in zip(*parts, strict=True)]
    return _pick(made, lookup[combined])


def _digits(combinations: IntArray, coded: list[Column]) -> list[IntArray]:
    """Each column's code in each combination, the last column's first (``pop`` gives them in
    the columns' order): the combination is a number whose digits are the codes."""
    digits: list[IntArray] = []
    rest = combinations
    for column in reversed(coded):
        rest, digit = np.divmod(rest, len(column.values))
        digits.append(digit)
    return digits


def _pick(texts: list[Any], codes: IntArray) -> list[Any]:
    """``texts[code]`` for each code, in one C call."""
    if len(codes) <= FEW_ROWS:
        return [texts[code] for code in codes.tolist()]
    picked: list[Any] = np.array(texts, dtype=object)[codes].tolist()
    return picked


def as_column(values: Values | None, rows: int) -> Column:
    """Any column as a coded one (``None``: a column of ``None``)."""
    if values is None:
        return Column(np.zeros(rows, dtype=np.int64), [None])
    if isinstance(values, Column):
        return values
    return coded(values.tolist() if isinstance(values, np.ndarray) else values)


# --- JSON Lines -------------------------------------------------------------------------------


def encode_json_lines(batch: Batch) -> bytes:
    """A batch of reports, or one frame, as JSON Lines in UTF-8: each report what
    :func:`~wattflow.formats.powerapi.encode_json` writes, then a newline."""
    if not batch:
        return b""
    table = ReportTable.of(batch)
    pieces: list[Piece[bytes]] = [
        b'{"timestamp":',
        _json_coded(
            table.timestamps,
            _json_millis if table.timestamps_in_millis else _json_timestamp,
        ),
        b',"sensor":',
        _json_coded(table.sensors, _dumps),
        b',"target":',
        _json_coded(table.targets, _dumps),
        b',"metadata":',
        *_json_metadata(table.metadata),
    ]
    if table.payloads is None:
        assert table.power is not None
        pieces += [b',"power":', _json_values(table.power), b"}\n"]
    else:
        own = _json_insides(table.payloads)
        pieces += [[b"," + inside if inside else b"" for inside in own], b"}\n"]
    return join_rows(pieces, len(table), [len(table)], b"")[0]


def encode_json_documents(reports: Sequence[Report]) -> list[bytes]:
    """Each report as :func:`~wattflow.formats.powerapi.encode_json` writes it, in UTF-8."""
    lines = encode_json_lines(reports)
    return lines.split(b"\n")[:-1]  # orjson escapes every newline inside a string


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=_JSON_OPTIONS)


def _json_timestamp(timestamp: datetime) -> bytes:
    return orjson.dumps(powerapi.format_timestamp(timestamp))


@lru_cache(maxsize=1024)
def _json_millis(millis: int) -> bytes:
    """A tick's timestamp as JSON, kept for the next frames of the tick: each formula's frame
    of a live sensor's tick writes the same one, and formatting a datetime costs more than
    the rest of a small frame's columns."""
    return _json_timestamp(powerapi.datetime_of(millis))


def _json_coded(column: Column, encode: Any) -> Column:
    return Column(column.codes, list(map(encode, column.values)))


def _json_metadata(metadata: dict[str, Values] | list[dict[str, Any]]) -> list[Piece[bytes]]:
    """The pieces of the metadata object: a piece per key of a table's columns, or each row's
    object."""
    if isinstance(metadata, list):
        return [b"{", _json_insides(metadata), b"}"]
    if not metadata:
        return [b"{}"]
    pieces: list[Piece[bytes]] = []
    for key, values in metadata.items():
        pieces += [_json_key(key, not pieces), _json_values(values)]
    return [*pieces, b"}"]


@lru_cache(maxsize=256)
def _json_key(key: str, first: bool) -> bytes:
    """A metadata key's text before its values, as a frame's columns write it: the same few
    keys (``scope``, ``socket``…) on every frame, so encoded once."""
    return (b"{" if first else b",") + _dumps(key) + b":"


_SCALARS = {float, int, bool, type(None)}
"""Types whose JSON text holds no comma: a list of them is encoded in one call and split."""


def _json_values(values: Values) -> Piece[bytes]:
    """A column's JSON texts: each distinct value, each float from the array, or each row's
    value, encoded as orjson encodes it inside a document."""
    if isinstance(values, Column):
        return _json_coded(values, _dumps)
    if isinstance(values, np.ndarray):
        contiguous = np.ascontiguousarray(values, dtype=np.float64)
        return orjson.dumps(contiguous, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    if set(map(type, values)) <= _SCALARS:
        return orjson.dumps(values)[1:-1].split(b",")
    return list(map(_dumps, values))


def _json_insides(objects: list[dict[str, Any]]) -> list[bytes]:
    """Each object's JSON text inside its braces, from one call to orjson: the list's text cut
    where one object ends and the next begins (``},{``), unless that occurs inside them too (in
    a text, or between the objects of a list).

    Cutting one text makes small objects; a call per object costs a buffer of a kilobyte
    each, which, kept for a whole batch, grows the heap a page every few rows.
    """
    text = _dumps(objects)
    if text.count(b"},{") == len(objects) - 1:
        return text[2:-2].split(b"},{")
    return [_dumps(item)[1:-1] for item in objects]


# --- CSV --------------------------------------------------------------------------------------


def csv_texts(
    table: ReportTable, kind: str, header: Sequence[str], cuts: Sequence[int]
) -> list[str]:
    """The table's rows, all of ``kind``, as PowerAPI's CSV output writes them under
    ``header``, one text per cut (``cuts``: the rows of each file, in the table's order).

    A PowerReport's cells are its values under the header's names (``socket`` and the others
    from its metadata, empty where it has none); a FormulaReport's row is always its
    timestamp, sensor, target and metadata as JSON, whatever the header; a
    TargetEnergyReport's (wattflow's own layout, :data:`~wattflow.formats.powerapi.
    CSV_TARGET_ENERGY`) its own fields, then its metadata as a PowerReport's.
    """
    formulas = kind == FormulaReport.kind
    energy = kind == TargetEnergyReport.kind
    pieces: list[Piece[str]] = []
    for name in powerapi.CSV_FORMULA if formulas else header:
        own = _energy_column(table, name) if energy else None
        column = own if own is not None else _csv_column(table, name, formulas=formulas)
        pieces += [",", column]
    pieces[0] = ""
    return join_rows([*pieces, "\r\n"], len(table), cuts, "")


def _csv_column(table: ReportTable, name: str, *, formulas: bool) -> Piece[str]:
    if name == "timestamp":
        ticks = table.timestamps
        if table.timestamps_in_millis:
            return Column(ticks.codes, list(map(str, ticks.values)))
        return Column(ticks.codes, [str(to_millis(t)) for t in ticks.values])
    if name == "sensor":
        return _csv_values(table.sensors)
    if name == "target":
        return _csv_values(table.targets)
    if formulas:
        rows = table.metadata
        assert isinstance(rows, list), "FormulaReports come as reports"
        return _csv_quoted([json.dumps(row) for row in rows])
    if name == "power" and table.power is not None:
        return _csv_values(table.power)
    values = table.metadata_values(name)
    return "" if values is None else _csv_values(values)


_ENERGY_CELLS = {"cpu_j": "cpu", "dram_j": "dram", "gpu_j": "gpu"}
"""A TargetEnergyReport's energy columns and the scope each holds."""


def _energy_column(table: ReportTable, name: str) -> Piece[str] | None:
    """A TargetEnergyReport's own cells under ``name`` (its span as Unix ms, as every CSV
    timestamp is written; its energy per scope in J; its reason), ``None`` for a name that is
    no field of its own (the common columns and the metadata)."""
    payloads = table.payloads
    assert payloads is not None, "TargetEnergyReports come as reports"
    if name in ("start", "end"):
        return [str(to_millis(datetime.fromisoformat(p[name]))) for p in payloads]
    scope = _ENERGY_CELLS.get(name)
    if scope is not None:
        return _csv_values([p["energy"].get(scope) for p in payloads])
    if name == "reason":
        return _csv_values([p["reason"] for p in payloads])
    return None


def _csv_values(values: Values) -> Piece[str]:
    """A column's CSV cells: ``str`` of each value, empty for ``None``, quoted where needed."""
    if isinstance(values, Column):
        return Column(values.codes, _csv_quoted(list(map(_cell_text, values.values))))
    if isinstance(values, np.ndarray):
        return float_texts(values)
    if set(map(type, values)) == {float}:
        return float_texts(np.array(values, dtype=np.float64))
    return _csv_quoted(list(map(_cell_text, values)))


_PROBE_FLOATS = [0.1, 1 / 3, 2.5e-4, 123456.789, 1e15, 9999999999999998.0, -7.25, 1.0]
_ORJSON_WRITES_REPR = (
    orjson.dumps(_PROBE_FLOATS).decode() == "[" + ",".join(map(repr, _PROBE_FLOATS)) + "]"
)
"""Whether this orjson writes floats from 1e-4 to 1e16 as ``repr`` does (shortest digits that
read back exactly, fixed notation); checked once at import, since its formatter is a C library
that could change."""


def float_texts(values: FloatArray) -> list[str]:
    """``str(v)`` of every float, as PowerAPI's CSV output writes them, in one C call where
    that is exact.

    Formatting a float costs about a microsecond in Python, and a CSV row holds two. orjson
    formats a whole array at once and writes what ``repr`` writes over the range powers and
    ratios take; only values outside it (zeros included: ``-0.0``; NaN and infinity, which JSON
    cannot hold; scientific notation) are formatted one by one.
    """
    if not _ORJSON_WRITES_REPR or len(values) < 4:
        return list(map(repr, values.tolist()))
    contiguous = np.ascontiguousarray(values, dtype=np.float64)
    texts = orjson.dumps(contiguous, option=orjson.OPT_SERIALIZE_NUMPY).decode()[1:-1].split(",")
    magnitudes = np.abs(contiguous)
    outside = np.flatnonzero(~((magnitudes >= 1e-4) & (magnitudes < 1e16)))
    for at, value in zip(outside.tolist(), contiguous[outside].tolist(), strict=True):
        texts[at] = repr(value)
    return texts


def _cell_text(value: Any) -> str:
    if type(value) is str:
        return value
    return "" if value is None else str(value)


def _csv_quoted(texts: list[str]) -> list[str]:
    """The texts as cells, those that hold a comma, a quote or a line break quoted as the csv
    module quotes them."""
    joined = "".join(texts)
    if '"' in joined or "," in joined or "\n" in joined or "\r" in joined:
        return [_csv_cell(text) for text in texts]
    return texts


def _csv_cell(text: str) -> str:
    if '"' in text or "," in text or "\n" in text or "\r" in text:
        return powerapi.csv_line([text])[:-2]
    return text


def csv_extra_columns(
    table: ReportTable, kind: str, header: Sequence[str], rows: IntArray
) -> dict[int, list[str]]:
    """The rows (of ``rows``, all of ``kind``) whose values have no column in ``header``, each
    with the names that have none: a PowerReport's metadata keys and ``power``, a
    TargetEnergyReport's metadata keys. A FormulaReport has none: its row is the same under
    any header."""
    if kind == FormulaReport.kind:
        return {}
    allowed = set(header)
    if kind != PowerReport.kind:
        allowed.add("power")  # only a PowerReport has a power to place
    metadata = table.metadata
    if isinstance(metadata, dict):
        extra = sorted({*metadata, "power"} - allowed)
        return dict.fromkeys(rows.tolist(), extra) if extra else {}
    found: dict[int, list[str]] = {}
    for row in rows.tolist():
        keys = metadata[row].keys()
        if not keys <= allowed or "power" not in allowed:
            found[row] = sorted({*keys, "power"} - allowed)
    return found
