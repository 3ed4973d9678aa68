"""PowerAPI's CSV output: ``<directory>/<sensor>-<target>/<Kind>.csv``, appended to; and
wattflow's own file of ended workloads' energy, ``<directory>/<sensor>/TargetEnergyReport.csv``."""

from __future__ import annotations

import asyncio
import csv
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

import numpy as np
from pydantic import BeforeValidator, Field, PositiveInt, field_validator

from wattflow.actors.backend import split_commas
from wattflow.actors.handoff import raise_open_files_limit
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.appending import (
    WRONG_PATH,
    append,
    check_output_path,
    file_error,
    start_on_a_new_line,
    take_back,
)
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Column, IntArray
from wattflow.formats.report_table import (
    ReportTable,
    as_column,
    coded,
    csv_extra_columns,
    csv_texts,
)
from wattflow.formats.reports import Report, TargetEnergyReport

TagList = Annotated[list[str], BeforeValidator(split_commas)]


CSV_MODELS = ("PowerReport", "FormulaReport", "TargetEnergyReport")
"""The kinds the CSV output has a layout for: PowerAPI's two, and wattflow's own record of a
workload's energy (:data:`~wattflow.formats.powerapi.CSV_TARGET_ENERGY`)."""


class CsvPusherConfig(PusherConfig):
    """Settings of the CSV output (``--output csv --directory D``)."""

    type: Literal["csv"] = "csv"
    directory: Path = Field(
        default=Path("."),
        description="Directory that receives one folder per sensor and target (the current "
        "directory by default, as PowerAPI's).",
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
        """A CSV layout exists for power, formula and workload energy reports only: any other
        kind would be refused report by report at run time, each one a dead letter."""
        if value not in CSV_MODELS:
            raise ValueError(
                f"the CSV output writes {', '.join(CSV_MODELS)} (there is no CSV layout with "
                f"columns for {value}); record {value} with --output jsonl --model {value}"
            )
        return value

    @classmethod
    def example(cls) -> CsvPusherConfig:
        """PowerReports under ./power."""
        return cls(type="csv", directory=Path("power"))

    max_open_files: PositiveInt = Field(
        default=4096,
        description="Files kept open at once (one per sensor, target and kind); the least "
        "recently used is closed. The service raises its open-files limit to fit them, and "
        "keeps fewer open where the system's hard limit is lower.",
    )


OTHER_DESCRIPTORS = 1024
"""File descriptors left to the rest of the service when the CSV output's files are counted
against the open-files limit."""

HEADER_MAX_BYTES = 1 << 20
"""The longest first line read as an existing file's header: a file whose first line is longer
(a file that is not CSV) is not read into memory whole."""

FileKey = tuple[str, str, str]
"""A file's sensor, target and name (:func:`~wattflow.formats.powerapi.csv_output_name`)."""


@dataclass(slots=True)
class _Rows:
    """The rows of a batch that go to one file, their kind, and the header of a file they
    start."""

    key: FileKey
    kind: str
    rows: IntArray
    new_header: list[str]
    header: list[str] | None = None


@pushers.register("csv")
class CsvPusher(Pusher[CsvPusherConfig]):
    """Appends to one file per sensor, target and kind, as PowerAPI does.

    Every batch, a frame or reports, becomes one :class:`~wattflow.formats.report_table.
    ReportTable`; its rows are sorted by file, and the rows of all files that share a header
    are formatted a column at a time and cut into each file's text. A file that already
    exists keeps its header; a row whose metadata does not fit that header is refused
    (dead-lettered with the reason) rather than written under the wrong columns.
    """

    config_model = CsvPusherConfig
    takes_frames = True

    def __init__(self, config: CsvPusherConfig) -> None:
        super().__init__(config)
        self._files: OrderedDict[FileKey, tuple[BinaryIO, list[str]]] = OrderedDict()
        """Each open file and its header, the most recently used last."""
        self._open_at_most = 0
        """``--max-open-files``, or fewer where the open-files limit is lower (set at the
        first file)."""

    async def check(self) -> None:
        """A directory that cannot be made or written stops the command at start (exit 2),
        instead of each batch being retried for ``--retry-for-s`` (:func:`check_output_path`)."""
        directory = self.config.directory
        where = f"output '{self.config.name}': --directory {directory}"
        await asyncio.to_thread(check_output_path, where, directory)

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        return await self.write_batch(batch)

    async def write_batch(self, batch: Batch) -> list[tuple[Report, str]]:
        """Files are opened and written on a thread (file systems block: a full disk, a hung
        NFS mount); the text is formatted on the event loop, where it is pure computation (on
        a thread it would trade the interpreter lock with the loop every few milliseconds).

        A batch is written whole or not at all: when a write fails, every file it wrote to is
        cut back to its size before the batch (:mod:`~wattflow.actors.pushers.appending`)."""
        table = ReportTable.of(batch)
        refused: dict[int, str] = {}
        files = self._files_of(table, refused)
        sizes: dict[Path, int] = {}
        """The size of each file the batch writes to, before it did."""
        try:
            await asyncio.to_thread(self._open_all, files, sizes, refused)
            layouts: dict[tuple[str, tuple[str, ...]], list[_Rows]] = {}
            for file in files:
                if file.header is None:  # refused whole: the file cannot be written
                    continue
                self._refuse_misfits(table, file, refused)
                if len(file.rows):
                    layouts.setdefault((file.kind, tuple(file.header)), []).append(file)
            for (kind, header), alike in layouts.items():
                chosen = np.concatenate([file.rows for file in alike])
                cuts = [len(file.rows) for file in alike]
                texts = csv_texts(table.take(chosen), kind, header, cuts)
                await asyncio.to_thread(self._append, alike, texts, sizes)
        except OSError as error:
            await asyncio.to_thread(self._take_back, sizes)
            raise file_error(self.config.name, error) from error
        rows = sorted(refused)
        return list(zip(table.reports_at(rows), [refused[row] for row in rows], strict=True))

    def _files_of(self, table: ReportTable, refused: dict[int, str]) -> list[_Rows]:
        """The rows of each file, in the table's order, and the header it would start with;
        rows without one of ``--tags`` go to ``refused`` instead, with the reason."""
        names = self._names(table)
        sensors, kinds = table.sensors, table.kinds
        targets = _folder_targets(table.targets, names)
        code = (sensors.codes * len(targets.values) + targets.codes) * len(names.values)
        code += names.codes
        kept = self._with_tags(table, names, refused)
        order = kept[np.argsort(code[kept], kind="stable")]
        bounds = np.flatnonzero(np.diff(code[order])) + 1
        files = []
        for rows in np.split(order, bounds) if len(order) else []:
            first = int(rows[0])
            key = (
                sensors.values[sensors.codes[first]],
                targets.values[targets.codes[first]],
                names.values[names.codes[first]],
            )
            kind = kinds.values[kinds.codes[first]]
            metadata = table.metadata
            keys = metadata if isinstance(metadata, dict) else metadata[first]
            files.append(_Rows(key, kind, rows, powerapi.csv_output_header(kind, keys)))
        return files

    @staticmethod
    def _names(table: ReportTable) -> Column:
        """Each row's file name (:func:`~wattflow.formats.powerapi.csv_output_name`), coded."""
        scopes = as_column(table.metadata_values("scope"), len(table))
        kinds = table.kinds
        pairs = kinds.codes * len(scopes.values) + scopes.codes
        present = np.unique(pairs)
        names = coded(
            [
                powerapi.csv_output_name(kinds.values[kind], scopes.values[scope])
                for kind, scope in zip(*np.divmod(present, len(scopes.values)), strict=True)
            ]
        )
        return Column(names.codes[np.searchsorted(present, pairs)], names.values)

    def _with_tags(self, table: ReportTable, names: Column, refused: dict[int, str]) -> IntArray:
        """The rows that carry every one of ``--tags``; the others to ``refused``."""
        tags = self.config.tags
        everything: IntArray = np.arange(len(table), dtype=np.int64)
        if not tags:
            return everything
        missing = _missing_tags(table, tags)
        sensors, targets = table.sensors, table.targets
        for row, tag in missing.items():
            sensor = sensors.values[sensors.codes[row]]
            target = targets.values[targets.codes[row]]
            name = names.values[names.codes[row]]
            path = powerapi.csv_output_path(self.config.directory, sensor, target, name)
            refused[row] = f"{path}: no tag {tag!r} in the report"
        return np.setdiff1d(everything, np.array(list(missing), dtype=np.int64))

    def _refuse_misfits(self, table: ReportTable, file: _Rows, refused: dict[int, str]) -> None:
        """Take out of a file's rows those its header has no column for, into ``refused``."""
        assert file.header is not None
        misfits = csv_extra_columns(table, file.kind, file.header, file.rows)
        if not misfits:
            return
        path = powerapi.csv_output_path(self.config.directory, *file.key)
        for row, extra in misfits.items():
            refused[row] = f"{path}: metadata {extra} has no column in the file's header"
        file.rows = file.rows[~np.isin(file.rows, list(misfits))]

    def _open_all(
        self, files: list[_Rows], sizes: dict[Path, int], refused: dict[int, str]
    ) -> None:
        """Open each file, and learn its header. A file whose path cannot hold it (a file
        where its directory should be) or whose existing header is not PowerAPI's has its rows
        refused; any other error is raised, for the batch to be retried."""
        for file in files:
            try:
                _, file.header = self._file(file.key, file.new_header, sizes)
            except (OSError, DecodeError) as error:
                if isinstance(error, OSError) and error.errno not in WRONG_PATH:
                    raise
                reason = str(error)
                if isinstance(error, OSError):
                    reason = str(file_error(self.config.name, error))
                for row in file.rows:
                    refused[int(row)] = reason
                file.header = None

    def _file(
        self, key: FileKey, new_header: list[str], sizes: dict[Path, int]
    ) -> tuple[BinaryIO, list[str]]:
        """The open file of ``key``, opened (the least recently used closed if too many are
        open), its header read or, for a new file, written; its size before the batch goes to
        ``sizes``."""
        path = powerapi.csv_output_path(self.config.directory, *key)
        found = self._files.get(key)
        if found is not None:
            self._files.move_to_end(key)
            sizes.setdefault(path, os.fstat(found[0].fileno()).st_size)
            return found
        path.parent.mkdir(parents=True, exist_ok=True)
        # Read and append, unbuffered: what a write did not take stays in no buffer.
        handle = path.open("a+b", buffering=0)
        try:
            fd = handle.fileno()
            size = sizes.setdefault(path, os.fstat(fd).st_size)
            header = _read_header(path, fd) if size else None
            if header is None:
                header = new_header
                append(fd, powerapi.csv_line(header).encode())
            else:
                start_on_a_new_line(fd, path)
        except BaseException:
            handle.close()
            raise
        opened = self._files[key] = (handle, header)
        while len(self._files) > self._open_limit():
            _, (oldest, _) = self._files.popitem(last=False)
            oldest.close()
        return opened

    def _open_limit(self) -> int:
        """How many files stay open: ``--max-open-files``, the process's open-files limit
        raised to fit them with room for everything else (sockets, the other outputs), or
        fewer if the hard limit is lower. A thousand targets written to a file each, more
        than are kept open, would close and open again most files on every batch."""
        if not self._open_at_most:
            wanted = self.config.max_open_files
            limit = raise_open_files_limit(wanted + OTHER_DESCRIPTORS)
            self._open_at_most = max(16, min(wanted, limit - OTHER_DESCRIPTORS))
        return self._open_at_most

    def _append(self, files: list[_Rows], texts: list[str], sizes: dict[Path, int]) -> None:
        """Append each file's text; a file closed meanwhile (more files in a batch than
        ``--max-open-files`` keeps open) is opened again."""
        for file, text in zip(files, texts, strict=True):
            assert file.header is not None
            handle, _ = self._file(file.key, file.header, sizes)
            try:
                append(handle.fileno(), text.encode())
            except OSError as error:
                error.filename = str(self._path(file.key))  # a write's error names no file
                raise

    def _take_back(self, sizes: dict[Path, int]) -> None:
        """Cut the files of a failed batch back, and close them: the next batch opens them
        again and reads, or writes, their header."""
        take_back(sizes)
        for key in [key for key in self._files if self._path(key) in sizes]:
            handle, _ = self._files.pop(key)
            handle.close()

    def _path(self, key: FileKey) -> Path:
        return powerapi.csv_output_path(self.config.directory, *key)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


def _folder_targets(targets: Column, names: Column) -> Column:
    """The target that picks each row's file: its own, but none (``""``) for a workload's
    record, whose file is one per sensor (:func:`~wattflow.formats.powerapi.csv_output_path`),
    so the records of every workload of a sensor go to the same file."""
    if TargetEnergyReport.kind not in names.values:
        return targets
    energy = names.values.index(TargetEnergyReport.kind)
    codes = np.where(names.codes == energy, len(targets.values), targets.codes)
    return Column(codes, [*targets.values, ""])


def _missing_tags(table: ReportTable, tags: list[str]) -> dict[int, str]:
    """The rows that lack one of ``tags``, each with the first it lacks."""
    metadata = table.metadata
    if isinstance(metadata, dict):
        tag = next((tag for tag in tags if tag not in metadata), None)
        return {} if tag is None else dict.fromkeys(range(len(table)), tag)
    missing: dict[int, str] = {}
    for row, values in enumerate(metadata):
        tag = next((tag for tag in tags if tag not in values), None)
        if tag is not None:
            missing[row] = tag
    return missing


def _read_header(path: Path, fd: int) -> list[str]:
    """The header of an existing file: its first line, read from ``fd`` and bounded by
    :data:`HEADER_MAX_BYTES`.

    Raises:
        DecodeError: naming the file, when the first line is no header of PowerAPI's CSV
            output (no ``timestamp``, ``sensor`` or ``target`` column, too long, not UTF-8).
    """
    first = os.pread(fd, HEADER_MAX_BYTES + 1, 0).split(b"\n", 1)[0]
    if len(first) > HEADER_MAX_BYTES:
        problem = f"the first line is longer than {HEADER_MAX_BYTES} bytes: not a CSV header"
        raise DecodeError(str(path), 1, problem)
    text = first.decode("utf-8", powerapi.CSV_ERRORS)
    reader = csv.reader([text])
    return powerapi.read_csv_header(path, reader, powerapi.CSV_COMMON)
