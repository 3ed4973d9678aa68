"""PowerAPI's CSV output: ``<directory>/<sensor>-<target>/<Kind>.csv``, appended to."""

from __future__ import annotations

import asyncio
import csv
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import cache
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO

import numpy as np
import numpy.typing as npt
from pydantic import BeforeValidator, Field, PositiveInt, field_validator

from wattflow.actors.backend import split_commas
from wattflow.actors.errors import PushError
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats import powerapi
from wattflow.formats.frames import Column, Frame, PowerFrame
from wattflow.formats.reports import PowerReport, Report, to_millis

TagList = Annotated[list[str], BeforeValidator(split_commas)]


CSV_MODELS = ("PowerReport", "FormulaReport")
"""The kinds PowerAPI's CSV output has a layout for."""


class CsvPusherConfig(PusherConfig):
    """Settings of the CSV output (``--output csv --directory D``)."""

    type: Literal["csv"] = "csv"
    directory: Path = Field(
        description="Directory that receives one folder per sensor and target.",
        json_schema_extra={"flags": ["-d", "--directory"]},
    )
    tags: TagList = Field(
        default_factory=list,
        description="Metadata keys every report must carry, comma-separated; a report "
        "without one is refused.",
        json_schema_extra={"flags": ["-t", "--tags"]},
    )

    @field_validator("model")
    @classmethod
    def _has_a_layout(cls, value: str) -> str:
        """PowerAPI's CSV layout exists for power and formula reports only: any other kind would
        be refused report by report at run time, each one a dead letter."""
        if value not in CSV_MODELS:
            raise ValueError(
                f"the CSV output writes {' and '.join(CSV_MODELS)} (PowerAPI's layout has no "
                f"columns for {value}); record {value} with --output jsonl --model {value}"
            )
        return value

    @classmethod
    def example(cls) -> CsvPusherConfig:
        """PowerReports under ./power."""
        return cls(type="csv", directory=Path("power"))

    max_open_files: PositiveInt = Field(
        default=256, description="Files kept open at once; the least recently used is closed."
    )


class _OpenFile:
    __slots__ = ("handle", "header", "metadata_keys", "metadata_values", "writer")

    def __init__(self, handle: TextIO, header: list[str]) -> None:
        self.handle = handle
        self.header = header
        self.writer = csv.writer(handle, lineterminator="\r\n")
        fixed = len(powerapi.CSV_POWER_FIXED) - 1  # socket is metadata too
        columns = header[fixed:] if header[:fixed] == _POWER_START else None
        self.metadata_keys = set(columns or ())
        # The metadata values in column order, in one C call (a tuple, whatever the count).
        self.metadata_values: Callable[[dict[str, Any]], Iterable[Any]] | None = None
        if columns is not None:
            getter = itemgetter(*columns) if columns else (lambda _: ())
            self.metadata_values = (
                getter if len(columns) != 1 else (lambda metadata: (getter(metadata),))
            )


def _texts(files: list[list[list[Any]]]) -> list[str]:
    """The CSV text of each file's rows, as PowerAPI writes them: ``str`` of each value, empty
    for ``None``, quoted where needed, ``\\r\\n`` after each row.

    This is the output's inner loop, so it works on a whole batch a column at a time: a column
    of floats is formatted in one call (:func:`~wattflow.formats.powerapi.float_texts`), the
    rows are joined by one ``%`` on a template and split back into the files' lines. The way
    row by row is kept for text that needs quoting. Files with other metadata columns, so rows
    of another width, are formatted apart.
    """
    texts = [""] * len(files)
    by_width: dict[int, list[int]] = {}
    for at, rows in enumerate(files):
        by_width.setdefault(len(rows[0]), []).append(at)
    for width, members in by_width.items():
        alike = [files[at] for at in members]
        for at, text in zip(members, _texts_of_width(width, alike), strict=True):
            texts[at] = text
    return texts


def _texts_of_width(width: int, files: list[list[list[Any]]]) -> list[str]:
    """:func:`_texts` for files whose first rows have ``width`` cells."""
    rows = list(chain.from_iterable(files))
    cells = list(chain.from_iterable(rows))
    if len(cells) != width * len(rows):
        return ["".join(_quoted_lines(file)) for file in files]
    _format_columns(cells, width)
    text: str = (_template(width) * len(rows)) % tuple(cells)
    if not _is_plain(text, width, len(rows)):
        return ["".join(_quoted_lines(file)) for file in files]
    return _split_files(text, files)


def _format_columns(cells: list[Any], width: int) -> None:
    """Replace the cells (rows of ``width`` laid end to end) by their texts, in place, a column
    at a time: a column of floats in one call, a column of text left as it is."""
    for column in range(width):
        values = cells[column::width]
        kinds = set(map(type, values))
        if kinds == _TEXT:
            continue
        if kinds == _FLOAT:
            cells[column::width] = powerapi.float_texts(values)
        else:
            cells[column::width] = [_cell_text(value) for value in values]


def _is_plain(text: str, width: int, rows: int) -> bool:
    """Whether ``rows`` rows of ``width`` cells joined without quoting read back as those cells:
    no cell held a comma, a quote or a line break (else the rows must be quoted)."""
    return (
        text.count(",") == (width - 1) * rows
        and text.count("\n") == rows
        and text.count("\r") == rows
        and '"' not in text
    )


def _split_files(text: str, files: list[list[list[Any]]]) -> list[str]:
    """The text of all files' rows cut back into each file's text, its rows in order."""
    lines = text.split("\r\n")
    texts = []
    start = 0
    for file in files:
        end = start + len(file)
        texts.append("\r\n".join(lines[start:end]) + "\r\n")
        start = end
    return texts


_TEXT = {str}
_FLOAT = {float}


@cache
def _template(width: int) -> str:
    return ",".join(["%s"] * width) + "\r\n"


def _cell_text(value: Any) -> str:
    if type(value) is str:
        return value
    return "" if value is None else str(value)


def _quoted_lines(rows: list[list[Any]]) -> list[str]:
    """Row by row, quoting the cells that hold commas, quotes or line breaks."""
    lines = []
    for row in rows:
        texts = list(map(_cell_text, row))
        line = ",".join(texts)
        if line.count(",") != len(texts) - 1 or '"' in line or "\n" in line or "\r" in line:
            line = powerapi.csv_line(texts)
        else:
            line += "\r\n"
        lines.append(line)
    return lines


_POWER_START = list(powerapi.CSV_POWER_FIXED[:-1])


def _rows_of(frame: PowerFrame, rows: npt.NDArray[np.int64]) -> list[Report]:
    """Some rows of a frame as reports."""
    part = PowerFrame(
        sensor=frame.sensor,
        millis=frame.millis[rows],
        targets=frame.targets[rows],
        target_names=frame.target_names,
        power=frame.power[rows],
        metadata={
            key: Column(column.codes[rows], column.values)
            if isinstance(column, Column)
            else column[rows]
            for key, column in frame.metadata.items()
        },
    )
    return part.reports()


def _frame_lines(
    frame: PowerFrame,
    order: npt.NDArray[np.int64],
    header: list[str],
    plain: list[tuple[str, int, int]],
) -> list[tuple[str, str]]:
    """Each file's text for its rows (``order[start:stop]``), as the csv module writes them.

    The files share one ``header``, so one pass formats them all. Columns of
    few distinct values (timestamp, sensor, target, socket, formula, scope) that stand next to
    each other are written as one piece, with their commas, per distinct combination; floats
    are formatted a column at a time (:func:`~wattflow.formats.powerapi.float_texts`). A row is
    then five pieces joined, not sixteen.
    """
    chosen = np.concatenate([order[start:stop] for _, start, stop in plain])
    if _needs_quoting(frame):
        return _quoted_frame_lines(frame, header, chosen, plain)
    pieces = _row_pieces(frame, header, chosen)
    width = len(pieces)
    cells: list[str] = [""] * (width * len(chosen))
    for at, column in enumerate(pieces):
        cells[at::width] = column
    return [(target, "".join(cells[width * a : width * b])) for target, a, b in _spans(plain)]


def _needs_quoting(frame: PowerFrame) -> bool:
    """Whether a text the frame can write holds a comma, a quote or a line break: then cells
    cannot be joined as they are, and the frame's rows are written the quoting way."""
    return any('"' in t or "," in t or "\n" in t or "\r" in t for t in _distinct_texts(frame))


def _quoted_frame_lines(
    frame: PowerFrame,
    header: list[str],
    chosen: npt.NDArray[np.int64],
    plain: list[tuple[str, int, int]],
) -> list[tuple[str, str]]:
    """:func:`_frame_lines` row by row, quoting the cells that need it: the rare frame whose
    sensor, target or metadata texts hold CSV's special characters."""
    columns = [_column_texts(frame, name, chosen) for name in header]
    return [
        (
            target,
            "".join(
                _quoted_lines([list(row) for row in zip(*[c[a:b] for c in columns], strict=False)])
            ),
        )
        for target, a, b in _spans(plain)
    ]


def _row_pieces(
    frame: PowerFrame, header: list[str], chosen: npt.NDArray[np.int64]
) -> list[list[str]]:
    """The texts of each piece of the ``chosen`` rows, pieces in header order, commas and the
    line end included: a column of many values (floats, timestamps) is a piece of its own,
    each run of neighbouring columns of few values one piece."""
    pieces: list[list[str]] = []
    run: list[str] = []
    for name in header:
        if _is_float_column(frame, name) or name == "timestamp":
            # A column of many values: a piece of its own (timestamps, one text per tick).
            if run:
                pieces.append(_coded_run(frame, run, chosen, before=bool(pieces), after=True))
                run = []
            pieces.append(_column_texts(frame, name, chosen))
        else:
            run.append(name)
    if run:
        pieces.append(_coded_run(frame, run, chosen, before=bool(pieces), after=False))
    else:
        pieces.append(["\r\n"] * len(chosen))
    return pieces


def _is_float_column(frame: PowerFrame, name: str) -> bool:
    return name == "power" or (
        name in frame.metadata and not isinstance(frame.metadata[name], Column)
    )


def _codes_of(
    frame: PowerFrame, name: str, rows: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], list[str]]:
    """A column of few distinct values as codes for ``rows`` and the text of each code."""
    if name == "timestamp":
        millis = frame.millis
        if len(millis) and bool((np.diff(millis) >= 0).all()):
            change = np.empty(len(millis), dtype=np.bool_)
            change[0] = True
            np.not_equal(millis[1:], millis[:-1], out=change[1:])
            code = np.cumsum(change) - 1
            return code[rows], [str(m) for m in millis[change].tolist()]
        stamps, which = np.unique(millis[rows], return_inverse=True)
        return which.reshape(-1), [str(m) for m in stamps.tolist()]
    if name == "sensor":
        return np.zeros(len(rows), dtype=np.int64), [frame.sensor]
    if name == "target":
        return frame.targets[rows], list(frame.target_names)
    column = frame.metadata[name]
    assert isinstance(column, Column)
    return column.codes[rows], [_cell_text(value) for value in column.values]


def _coded_run(
    frame: PowerFrame, names: list[str], rows: npt.NDArray[np.int64], *, before: bool, after: bool
) -> list[str]:
    """Texts of consecutive columns of few values as one piece per row, commas included: each
    combination of their values that occurs is written once."""
    combined = np.zeros(len(rows), dtype=np.int64)
    parts: list[list[str]] = []
    for name in names:
        codes, texts = _codes_of(frame, name, rows)
        combined = combined * len(texts) + codes
        parts.append(texts)
    present = np.flatnonzero(np.bincount(combined)) if len(rows) else combined
    lookup = np.zeros(int(present.max(initial=0)) + 1, dtype=np.int64)
    lookup[present] = np.arange(len(present))
    texts = []
    for value in present.tolist():
        cells = []
        for names_texts in reversed(parts):
            value, code = divmod(value, len(names_texts))
            cells.append(names_texts[code])
        text = ",".join(reversed(cells))
        texts.append(("," if before else "") + text + ("," if after else "\r\n"))
    return _pick(texts, lookup[combined])


def _spans(plain: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Each file's rows as a span of the chosen rows."""
    spans = []
    at = 0
    for target, start, stop in plain:
        spans.append((target, at, at + stop - start))
        at += stop - start
    return spans


def _distinct_texts(frame: PowerFrame) -> list[str]:
    """Every text a frame's coded columns and names can write."""
    texts = [frame.sensor, *frame.target_names]
    for column in frame.metadata.values():
        if isinstance(column, Column):
            texts.extend(_cell_text(value) for value in column.values)
    return texts


def _column_texts(frame: PowerFrame, name: str, rows: npt.NDArray[np.int64]) -> list[str]:
    """One column's cell texts for ``rows`` of a frame."""
    if name == "power":
        return powerapi.float_array_texts(frame.power[rows])
    column = frame.metadata.get(name)
    if column is not None and not isinstance(column, Column):
        return powerapi.float_array_texts(column[rows])
    codes, texts = _codes_of(frame, name, rows)
    return _pick(texts, codes)


def _pick(texts: list[str], codes: npt.NDArray[np.int64]) -> list[str]:
    """``texts[code]`` for each code, in one C call."""
    if not len(codes):
        return []
    picked: list[str] = np.array(texts, dtype=object)[codes].tolist()
    return picked


_Touched = tuple[_OpenFile, Report, list[list[Any]]]
"""A file a batch writes to: the open file, the report it was opened by, its rows so far."""


@pushers.register("csv")
class CsvPusher(Pusher[CsvPusherConfig]):
    """Appends to one file per sensor and target, as PowerAPI does.

    A file that already exists keeps its header; a report whose metadata does not fit that header
    is refused (dead-lettered with the reason) rather than written under the wrong columns.
    """

    config_model = CsvPusherConfig
    takes_frames = True

    def __init__(self, config: CsvPusherConfig) -> None:
        super().__init__(config)
        self._files: OrderedDict[tuple[str, str, str], _OpenFile] = OrderedDict()

    async def check(self) -> None:
        directory = self.config.directory
        if directory.exists() and not directory.is_dir():
            raise PushError(f"output '{self.config.name}': {directory} is not a directory")

    def _file(self, key: tuple[str, str, str], first: Report) -> _OpenFile:
        found = self._files.get(key)
        if found is not None:
            self._files.move_to_end(key)
            return found
        path = powerapi.csv_output_path(self.config.directory, first)
        path.parent.mkdir(parents=True, exist_ok=True)
        header: list[str] | None = None
        if path.exists() and path.stat().st_size > 0:
            with path.open(newline="", encoding="utf-8") as existing:
                header = next(csv.reader(existing), None)
        handle = path.open("a", newline="", encoding="utf-8")
        opened = _OpenFile(handle, header or powerapi.csv_output_header(first))
        if header is None:
            opened.writer.writerow(opened.header)
        self._files[key] = opened
        while len(self._files) > self.config.max_open_files:
            _, oldest = self._files.popitem(last=False)
            oldest.handle.close()
        return opened

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        # File systems block (a full disk, a hung NFS mount): never on the event loop.
        if len(batch) == 1 and isinstance(batch[0], Frame):
            frame: Frame = batch[0]
            if isinstance(frame, PowerFrame) and not self.config.tags:
                return await self._write_frame(frame)
            batch = frame.reports()
        return await asyncio.to_thread(self._write, batch)

    async def _write_frame(self, frame: PowerFrame) -> list[tuple[Report, str]]:
        """A frame's rows, a file at a time, each column formatted for all rows at once.

        Files are opened and written on a thread; the text is formatted on the event loop,
        where it is pure computation (on a thread it would trade the interpreter lock with the
        loop every few milliseconds).
        """
        order, spans, refused = await asyncio.to_thread(self._frame_files, frame)
        layouts: dict[tuple[str, ...], list[tuple[str, int, int, int]]] = {}
        for span in spans:  # files that hold the same columns in another order apart
            layouts.setdefault(span[4], []).append(span[:4])
        for header, alike in layouts.items():
            plain = [(target, start, stop) for target, start, stop, _ in alike]
            texts = _frame_lines(frame, order, list(header), plain)
            await asyncio.to_thread(self._write_texts, frame, alike, texts)
        return refused

    def _frame_files(
        self, frame: PowerFrame
    ) -> tuple[
        npt.NDArray[np.int64],
        list[tuple[str, int, int, int, tuple[str, ...]]],
        list[tuple[Report, str]],
    ]:
        """Open each file a frame's rows go to; the rows by file (``order``), each file's span
        of them (target, start, stop, first row, header), and the rows refused.

        Rows go to their files in the frame's order. A file whose header has other metadata
        columns than the frame gets its rows the report-by-report way (which refuses the
        reports that do not fit it).
        """
        # Rows by file, in frame order within each: a radix sort on narrow codes.
        narrow = frame.targets
        if len(frame.target_names) < 2**16:
            narrow = narrow.astype(np.uint16)
        order = np.argsort(narrow, kind="stable")
        targets = frame.targets[order]
        bounds = np.flatnonzero(np.diff(targets)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        stops = np.concatenate((bounds, [len(targets)])).tolist()
        keys = frame.metadata.keys()
        refused: list[tuple[Report, str]] = []
        spans: list[tuple[str, int, int, int, tuple[str, ...]]] = []
        for start, stop in zip(starts, stops, strict=True):
            target = frame.target_names[int(targets[start])]
            # Frames come from SmartWatts and RAPL, whose scopes are PowerAPI's: PowerReport.csv.
            key = (frame.sensor, target, PowerReport.kind)
            try:
                opened = self._file_for(key, frame, int(order[start]))
            except OSError as error:
                raise PushError(f"output '{self.config.name}': {error}") from error
            if opened.metadata_values is None or opened.metadata_keys != set(keys):
                refused.extend(self._write(_rows_of(frame, order[start:stop])))
                continue
            spans.append((target, start, stop, int(order[start]), tuple(opened.header)))
        return order, spans, refused

    def _write_texts(
        self,
        frame: PowerFrame,
        spans: list[tuple[str, int, int, int]],
        texts: list[tuple[str, str]],
    ) -> None:
        """Append each file's text; a file closed meanwhile (more files in a frame than
        ``--max-open-files`` keeps open) is opened again."""
        try:
            for (target, _, _, first), (_, text) in zip(spans, texts, strict=True):
                key = (frame.sensor, target, PowerReport.kind)
                opened = self._file_for(key, frame, first)
                opened.handle.write(text)
                opened.handle.flush()
        except OSError as error:
            raise PushError(f"output '{self.config.name}': {error}") from error

    def _file_for(self, key: tuple[str, str, str], frame: PowerFrame, row: int) -> _OpenFile:
        """The open file of ``key``, opened from the frame's ``row`` when it is not yet."""
        found = self._files.get(key)
        if found is not None:
            self._files.move_to_end(key)
            return found
        return self._file(key, _rows_of(frame, np.array([row]))[0])

    def _write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        """Gather every file's rows, then format and write each file's rows at once.

        Cells stay values until :func:`_texts` formats the whole batch a column at a time.
        """
        refused: list[tuple[Report, str]] = []
        # Rows per file, with a report to reopen it by: a batch may touch more files than are
        # kept open, so files are looked up again when the lines are written.
        touched: dict[tuple[str, str, str], _Touched] = {}
        try:
            self._gather_rows(batch, touched, refused)
            self._write_touched(touched)
        except OSError as error:
            raise PushError(f"output '{self.config.name}': {error}") from error
        return refused

    def _gather_rows(
        self,
        batch: list[Report],
        touched: dict[tuple[str, str, str], _Touched],
        refused: list[tuple[Report, str]],
    ) -> None:
        """Each report's row, added to its file's rows in ``touched`` (the files opened at their
        first row); the reports refused, with the reason, to ``refused``, in batch order.

        A formula writes several rows per input report, so this loop is the output's hot path:
        files are found by (sensor, target, kind) without building paths, the timestamp's text
        is reused across a tick, and a PowerReport whose metadata matches its file's columns
        skips the general row builder (:meth:`_general_row`).
        """
        tags = self.config.tags
        last_timestamp: object = None
        millis = ""
        power_kind = PowerReport
        for report in batch:
            metadata = report.metadata
            if tags and (missing := self._missing_tag(report)) is not None:
                refused.append((report, missing))
                continue
            key = (report.sensor, report.target, powerapi.csv_output_name(report))
            entry = touched.get(key)
            if entry is None:
                entry = touched[key] = (self._file(key, report), report, [])
            opened, _, rows = entry
            metadata_values = opened.metadata_values
            if (
                metadata_values is not None
                and type(report) is power_kind
                and metadata.keys() == opened.metadata_keys
            ):
                if report.timestamp is not last_timestamp:
                    last_timestamp = report.timestamp
                    millis = str(to_millis(report.timestamp))
                row = [millis, report.sensor, report.target, report.power]
                row.extend(metadata_values(metadata))
                rows.append(row)
            elif (general := self._general_row(report, opened, refused)) is not None:
                rows.append(general)

    def _missing_tag(self, report: Report) -> str | None:
        """Why a report lacks one of ``--tags``, or ``None`` when it carries them all."""
        missing = [t for t in self.config.tags if t not in report.metadata]
        if missing:
            path = powerapi.csv_output_path(self.config.directory, report)
            return f"{path}: no tag {missing[0]!r} in the report"
        return None

    def _general_row(
        self, report: Report, opened: _OpenFile, refused: list[tuple[Report, str]]
    ) -> list[Any] | None:
        """A report's row under its file's header, any report kind; ``None``, the report added
        to ``refused`` with the reason, when its metadata does not fit that header."""
        try:
            return powerapi.csv_output_row(report, opened.header)
        except ValueError as error:
            path = powerapi.csv_output_path(self.config.directory, report)
            refused.append((report, f"{path}: {error}"))
            return None

    def _write_touched(self, touched: dict[tuple[str, str, str], _Touched]) -> None:
        """Format the rows of every file a batch touched at once, then append each file's text
        (reopened from its first report if it was closed meanwhile)."""
        files = [(key, first, rows) for key, (_, first, rows) in touched.items() if rows]
        texts = _texts([rows for _, _, rows in files])
        for (key, first, _), text in zip(files, texts, strict=True):
            opened = self._file(key, first)
            opened.handle.write(text)
            opened.handle.flush()

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        for opened in self._files.values():
            opened.handle.close()
        self._files.clear()
