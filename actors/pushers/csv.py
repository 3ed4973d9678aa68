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

from pydantic import BeforeValidator, Field, PositiveInt

from wattflow.actors.errors import PushError
from wattflow.actors.pullers.files import split_commas
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report, to_millis

TagList = Annotated[list[str], BeforeValidator(split_commas)]


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
    for column in range(width):
        values = cells[column::width]
        kinds = set(map(type, values))
        if kinds == _TEXT:
            continue
        if kinds == _FLOAT:
            cells[column::width] = powerapi.float_texts(values)
        else:
            cells[column::width] = [_cell_text(value) for value in values]
    text: str = (_template(width) * len(rows)) % tuple(cells)
    if (
        text.count(",") != (width - 1) * len(rows)
        or text.count("\n") != len(rows)
        or text.count("\r") != len(rows)
        or '"' in text
    ):
        return ["".join(_quoted_lines(file)) for file in files]
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


@pushers.register("csv")
class CsvPusher(Pusher[CsvPusherConfig]):
    """Appends to one file per sensor and target, as PowerAPI does.

    A file that already exists keeps its header; a report whose metadata does not fit that header
    is refused (dead-lettered with the reason) rather than written under the wrong columns.
    """

    config_model = CsvPusherConfig

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
        return await asyncio.to_thread(self._write, batch)

    def _write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        """Gather every file's rows, then format and write each file's rows at once.

        A formula writes several rows per input report, so this loop is the output's hot path:
        files are found by (sensor, target, kind) without building paths, the timestamp's text
        is reused across a tick, and a PowerReport whose metadata matches its file's columns
        skips the general row builder. Cells stay values until :func:`_texts` formats the whole
        batch a column at a time.
        """
        refused: list[tuple[Report, str]] = []
        # Rows per file, with a report to reopen it by: a batch may touch more files than are
        # kept open, so files are looked up again when the lines are written.
        touched: dict[tuple[str, str, str], tuple[_OpenFile, Report, list[list[Any]]]] = {}
        tags = self.config.tags
        last_timestamp: object = None
        millis = ""
        power_kind = PowerReport
        try:
            for report in batch:
                metadata = report.metadata
                if tags:
                    missing = [t for t in tags if t not in metadata]
                    if missing:
                        path = powerapi.csv_output_path(self.config.directory, report)
                        refused.append((report, f"{path}: no tag {missing[0]!r} in the report"))
                        continue
                key = (report.sensor, report.target, report.kind)
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
                    row: list[Any] = [millis, report.sensor, report.target, report.power]
                    row.extend(metadata_values(metadata))
                else:
                    try:
                        row = powerapi.csv_output_row(report, opened.header)
                    except ValueError as error:
                        path = powerapi.csv_output_path(self.config.directory, report)
                        refused.append((report, f"{path}: {error}"))
                        continue
                rows.append(row)
            files = [(key, first, rows) for key, (_, first, rows) in touched.items() if rows]
            texts = _texts([rows for _, _, rows in files])
            for (key, first, _), text in zip(files, texts, strict=True):
                opened = self._file(key, first)
                opened.handle.write(text)
                opened.handle.flush()
        except OSError as error:
            raise PushError(f"output '{self.config.name}': {error}") from error
        return refused

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        for opened in self._files.values():
            opened.handle.close()
        self._files.clear()
