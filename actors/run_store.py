"""The run store: measurement runs and their reports, in embedded SQLite or in MongoDB.

A run is named ``experiment/benchmark/settings/repetition`` (its id), the way researchers lay
out their measurement directories. Its reports are stored one row (or document) each, keyed by
run and time, and read back in time order in pages, so an export of an hour-long run never
holds the hour in memory. EventReports are stored with the reports and make up the run's
events.

Reports are stored by kind, so that each exporter reads only what its format needs
(:class:`~wattflow.formats.runs.RunData`). PowerReports, nearly all of a run, are rows of
typed fields: time, series (a small number standing for sensor, target, scope, socket and
device, named once per run), power, metadata and processing time; exports that fold power read
the first three and nothing else. Every other kind (GPU and meter readings, events, counters)
is kept as its JSON document. One sequence numbers both, so reports of one millisecond keep the
order they were stored in across kinds. A store of the first layout (every report a JSON
document) is migrated the first time this code opens it: its PowerReports move to rows, once.

``sqlite:///path/to/runs.db`` (or a bare path) selects SQLite; ``mongodb://host/db`` selects
MongoDB. With neither, the store is ``runs.db`` in the user's data directory
(``$XDG_DATA_HOME/wattflow``, by default ``~/.local/share/wattflow``). Both stores
implement :class:`RunStore`: what writes or reads a run, the service's recorder, ``wattflow
runs`` and the exporters, never asks which one it holds.
"""

from __future__ import annotations

import heapq
import operator
import os
import platform
import re
import sqlite3
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any, SupportsIndex, cast

import orjson

from wattflow.formats import powerapi
from wattflow.formats.errors import WattflowError
from wattflow.formats.reports import (
    EventName,
    EventReport,
    PowerReport,
    Report,
    from_micros,
    report_kind,
    to_micros,
    to_millis,
    to_utc,
)
from wattflow.formats.runs import (
    NOT_POWER,
    PAGE,
    PowerPage,
    Run,
    RunData,
    Series,
    SeriesIds,
    TimelinePage,
    TimelineRow,
    series_of,
)

LAYOUT = 3
"""The store layout this code writes. 1 (or none said): every report one JSON document;
2: PowerReports as rows of their own, the others as before; 3: runs note how their exports
went. Older stores migrate when opened."""

POWER = "PowerReport"

END_OF_TIME_MS = 2**62
"""A time in Unix ms after every report's: the open end of a range of times."""


class StoreError(WattflowError):
    """A store that cannot be opened, or a run that is not there."""


def run_id(experiment: str, benchmark: str, settings: str, repetition: int) -> str:
    """``experiment/benchmark/settings/repetition``; names may not hold ``/``."""
    for what, name in (
        ("experiment", experiment),
        ("benchmark", benchmark),
        ("settings", settings),
    ):
        if not name or "/" in name:
            raise StoreError(f"{what} {name!r}: give a non-empty name without '/'")
    return f"{experiment}/{benchmark}/{settings}/{repetition}"


def parse_run_id(text: str) -> tuple[str, str, str, int]:
    """The parts of ``E/B/S/N``."""
    parts = text.split("/")
    if len(parts) != 4 or not parts[3].isdigit():
        raise StoreError(f"run {text!r}: write it experiment/benchmark/settings/repetition")
    return parts[0], parts[1], parts[2], int(parts[3])


def default_store_uri() -> str:
    """SQLite in the user's data directory."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{base / 'wattflow' / 'runs.db'}"


def open_store(uri: str | None, *, create: bool = True) -> RunStore:
    """The store a URI names (see the module's docstring).

    Commands that only read (``runs list``, ``export``) pass ``create=False``: a mistyped
    SQLite path then says so, rather than becoming a new empty store that matches no run.

    Raises:
        StoreError: for a URI of another scheme, or a missing SQLite file when not creating.
    """
    uri = uri or default_store_uri()
    path = sqlite_path(uri)
    if path is None:
        return MongoRunStore(uri)
    if not create and not path.exists():
        raise StoreError(f"no run store at {path}: check --store (runs import creates one)")
    return SqliteRunStore(path)


def sqlite_path(uri: str | None) -> Path | None:
    """The SQLite file a store URI names, or None for MongoDB.

    Raises:
        StoreError: for a URI of another scheme.
    """
    uri = uri or default_store_uri()
    if uri.startswith(("mongodb://", "mongodb+srv://")):
        return None
    scheme, separator, _ = uri.partition("://")
    if separator and scheme != "sqlite":
        raise StoreError(
            f"store {uri!r}: give sqlite:///PATH, a path, or mongodb://HOST/DB, not {scheme}://"
        )
    return Path(uri.removeprefix("sqlite:///").removeprefix("sqlite://"))


def discard_if_empty(path: Path) -> None:
    """Remove a SQLite store that holds no run (and its write-ahead log): what a command that
    created it and then failed leaves, which would otherwise read as a store without runs."""
    try:
        with SqliteRunStore(path) as store:
            if store.runs():
                return
    except (StoreError, sqlite3.Error):
        return  # not a store this code can read: not one to remove either
    for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        leftover.unlink(missing_ok=True)


def processing_micros(moment: datetime | None) -> int | None:
    """Unix microseconds: processing times are finer than report timestamps' milliseconds."""
    return None if moment is None else round(to_utc(moment).timestamp() * 1e6)


def processing_seconds(micros: int | None) -> float | None:
    """A stored processing time in Unix seconds, as readers take it."""
    return None if micros is None else micros / 1e6


class Documents:
    """Stored JSON documents made reports again, for one read of the store.

    Every kind but PowerReport is decoded as an input would be; PowerReports (in a store of the
    first layout, being migrated) are what wattflow wrote itself and skip validation. A tick's
    PowerReports share a timestamp, so the last timestamp's parse is kept.
    """

    __slots__ = ("_text", "_time")

    def __init__(self) -> None:
        self._text: Any = None
        self._time: Any = None

    def report(self, kind: str, body: bytes | str | dict[str, Any]) -> Report:
        document = body if isinstance(body, dict) else orjson.loads(body)
        if kind == POWER:
            text = document["timestamp"]
            if text != self._text:
                self._text, self._time = text, to_utc(text)
            return PowerReport.trusted(
                timestamp=self._time,
                sensor=document["sensor"],
                target=document["target"],
                metadata=document.get("metadata") or {},
                power=float(document["power"]),
            )
        return powerapi.decode_document(report_kind(kind), document, "run store", None)

    def power(self, body: bytes | str | dict[str, Any]) -> PowerReport:
        """A PowerReport from its JSON document, as the first layout stored it."""
        report = self.report(POWER, body)
        assert isinstance(report, PowerReport)
        return report


def power_report(micros: int, series: Series, power: float, metadata: Any) -> PowerReport:
    """A stored PowerReport as it was given (its metadata holds scope, socket and device)."""
    return PowerReport.trusted(
        timestamp=from_micros(micros),
        sensor=series.sensor,
        target=series.target,
        metadata=metadata or {},
        power=power,
    )


Row = tuple[int, int, Report, int | None]
"""(time ms, sequence, report, processing time µs or None): what the merged reads sort."""


class RunStore(RunData):
    """Runs and their reports: PowerReports as rows of their series, time and power, every
    other kind as its JSON document, both numbered by one sequence (see the module's
    docstring)."""

    @abstractmethod
    def save_run(self, run: Run, *, widen: bool = False) -> None:
        """Create or update a run's description (not its reports), in one atomic write.

        A run can have several writers at once, each holding its own copy: the service
        recording it (``wattflow run --run``), a program marking it (``record()``), an import.
        So what is stored is never lost to a copy that lacks it: the parameters given are
        merged into the stored ones (a value given replaces the stored one of that name, and
        no parameter is dropped), and so is the system info (a ``None`` given replaces
        nothing). The window is replaced by the one given, or with ``widen`` only widened to
        cover it, as the writers that stretch a run while others stretch it too need.
        """

    @abstractmethod
    def add_reports(
        self, run: str, reports: Iterable[Report], processed: datetime | None = None
    ) -> int:
        """Store reports for a run; return how many.

        ``processed`` is when the service finished processing them, for live recordings; it is
        what ROSS exports show as real time.
        """

    @abstractmethod
    def _run_rows(self, experiment: str | None, benchmark: str | None) -> list[dict[str, Any]]:
        """Stored run descriptions, as saved."""

    @abstractmethod
    def note_export(self, run: str, format_name: str, outcome: str) -> None:
        """Note how the latest export of a run in a format went (:attr:`Run.exports`), leaving
        the rest of the run as it is.

        Raises:
            StoreError: when the store cannot be written.
        """

    @abstractmethod
    def _power_pages(self, run: str, start: int, end: int) -> Iterator[PowerPage]:
        """The run's power rows from ``start`` to ``end`` (Unix ms, both included)."""

    @abstractmethod
    def _timeline_pages(self, run: str, start: int, end: int) -> Iterator[TimelinePage]:
        """Every report of the run from ``start`` to ``end`` as a timeline row."""

    @abstractmethod
    def _power_reports(self, run: str, start: int, end: int) -> Iterator[Row]:
        """The run's PowerReports, whole, in time order."""

    @abstractmethod
    def _other_reports(
        self, run: str, start: int, end: int, kinds: Sequence[str] | None
    ) -> Iterator[Row]:
        """The run's reports of ``kinds`` (every kind but PowerReport when None), in time
        order."""

    @abstractmethod
    def _count(self, run: str, start: int, end: int) -> int:
        """Reports of every kind from ``start`` to ``end``."""

    @abstractmethod
    def close(self) -> None:
        """Release the database."""

    def runs(self, experiment: str | None = None, benchmark: str | None = None) -> list[Run]:
        """The runs, optionally of one experiment or benchmark, in id order, with events."""
        found = []
        for row in self._run_rows(experiment, benchmark):
            rows = self._other_reports(
                row["id"], to_millis(row["start"]), to_millis(row["end"]), ["EventReport"]
            )
            events = [report for _, _, report, _ in rows if isinstance(report, EventReport)]
            found.append(Run.model_validate({**row, "events": events}))
        return sorted(found, key=lambda run: run.id)

    def find(self, identifier: str) -> Run | None:
        """One run by its id, or ``None`` when the store has none of that id."""
        experiment, benchmark, _, _ = parse_run_id(identifier)
        return next((r for r in self.runs(experiment, benchmark) if r.id == identifier), None)

    def get(self, identifier: str) -> Run:
        """One run by its id.

        Raises:
            StoreError: when the store has none of that id.
        """
        found = self.find(identifier)
        if found is None:
            raise StoreError(f"no run {identifier!r} in the store")
        return found

    def events_since(self, run: str, since: datetime) -> list[EventReport]:
        """The run's events stamped at or after ``since``, inside its window or not.

        What the recorder polls to notice an event another process stored (``runs mark``,
        ``record()``): the reports' index is by run and time, so this reads only the rows of
        the run stamped since ``since``, however long the run.
        """
        rows = self._other_reports(run, to_millis(since), END_OF_TIME_MS, ["EventReport"])
        return [report for _, _, report, _ in rows if isinstance(report, EventReport)]

    def power(self, run: Run) -> Iterator[PowerPage]:
        return self._power_pages(run.id, to_millis(run.start), to_millis(run.end))

    def timeline(self, run: Run) -> Iterator[TimelinePage]:
        return self._timeline_pages(run.id, to_millis(run.start), to_millis(run.end))

    def reports(self, run: Run, kinds: Sequence[str] | None = None) -> Iterator[Report]:
        """The run's reports inside its window, in time order (and insertion order within)."""
        return (report for _, _, report, _ in self._merged(run, kinds))

    def timed_reports(self, run: Run) -> Iterator[tuple[Report, float | None]]:
        """The run's reports as :meth:`reports` gives them, each with its processing time
        (Unix seconds), or ``None`` where it was not recorded live."""
        for _, _, report, processed in self._merged(run, None):
            yield report, processing_seconds(processed)

    def count(self, run: Run) -> int:
        """Reports inside the run's window."""
        return self._count(run.id, to_millis(run.start), to_millis(run.end))

    def _merged(self, run: Run, kinds: Sequence[str] | None) -> Iterator[Row]:
        start, end = to_millis(run.start), to_millis(run.end)
        streams: list[Iterator[Row]] = []
        if kinds is None or POWER in kinds:
            streams.append(self._power_reports(run.id, start, end))
        others = None if kinds is None else [kind for kind in kinds if kind != POWER]
        if others is None or others:
            streams.append(self._other_reports(run.id, start, end, others))
        return heapq.merge(*streams, key=lambda row: (row[0], row[1]))

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Encoded:
    """Report times in Unix µs, converted once per tick."""

    def __init__(self) -> None:
        self._moment: datetime | None = None
        self._micros = 0

    def micros(self, report: Report) -> int:
        """The report's time in Unix µs; a tick's reports share their timestamp object."""
        if report.timestamp is not self._moment:
            self._moment, self._micros = report.timestamp, to_micros(report.timestamp)
        return self._micros


class _SqliteSeries(dict[int, Series]):
    """A run's series by id, read again when a page names one added since."""

    def __init__(self, db: sqlite3.Connection, run: str) -> None:
        super().__init__()
        self.db = db
        self.run = run
        self._load()

    def _load(self) -> None:
        rows = self.db.execute(
            "SELECT id, sensor, target, scope, socket, device FROM series WHERE run = ?",
            (self.run,),
        )
        self.update((number, Series(*fields)) for number, *fields in rows)

    def __missing__(self, number: int) -> Series:
        self._load()
        if number not in self:
            raise KeyError(number)
        return self[number]


class SqliteRunStore(RunStore):
    """One SQLite file: tables of runs, series, PowerReports and other reports.

    ``power_reports`` rows are (sequence, run, time in ms and its µs beyond, series, power,
    metadata as JSON, processing time); ``series`` names each series once per run; ``reports``
    holds every other kind as its JSON document. Both report tables are indexed by (run, time,
    sequence). ``PRAGMA user_version`` is the layout: 0 for the first one (every report a JSON
    document), migrated on open.
    """

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Used from worker threads (the service's recorder), one call at a time. Writes
            # take the lock when they begin (BEGIN IMMEDIATE): see _writing.
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode = WAL")
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"store {path}: {error}") from None
        self.path = path
        self._series_ids: dict[tuple[str, Series], int] = {}
        if self._layout() < LAYOUT:
            with self._writing():
                if self._layout() < LAYOUT:  # another process may have migrated meanwhile
                    self._create_or_migrate()

    def _layout(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction, the database locked from its start, so that reading the
        sequence and writing the rows it numbers cannot interleave with another writer."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            self._series_ids.clear()  # ids it created are gone
            raise
        self.db.execute("COMMIT")

    def _create_or_migrate(self) -> None:
        execute = self.db.execute
        execute(
            "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, experiment TEXT, "
            "benchmark TEXT, settings TEXT, repetition INTEGER, parameters TEXT, system TEXT, "
            "start INTEGER, end INTEGER, exports TEXT NOT NULL DEFAULT '{}')"
        )
        if "exports" not in {row[1] for row in execute("PRAGMA table_info(runs)")}:
            execute("ALTER TABLE runs ADD COLUMN exports TEXT NOT NULL DEFAULT '{}'")
        execute(
            "CREATE TABLE IF NOT EXISTS reports (seq INTEGER PRIMARY KEY, run TEXT, ts INTEGER, "
            "kind TEXT, body BLOB, processed INTEGER, us INTEGER NOT NULL DEFAULT 0)"
        )
        columns = {row[1] for row in execute("PRAGMA table_info(reports)")}
        if "processed" not in columns:  # a store written before processing times were kept
            execute("ALTER TABLE reports ADD COLUMN processed INTEGER")
        if "us" not in columns:
            execute("ALTER TABLE reports ADD COLUMN us INTEGER NOT NULL DEFAULT 0")
        execute("CREATE INDEX IF NOT EXISTS reports_by_time ON reports (run, ts, seq)")
        execute(
            "CREATE TABLE IF NOT EXISTS series (id INTEGER PRIMARY KEY, run TEXT, sensor TEXT, "
            "target TEXT, scope TEXT, socket TEXT, device TEXT, "
            "UNIQUE (run, sensor, target, scope, socket, device))"
        )
        execute(
            "CREATE TABLE IF NOT EXISTS power_reports (seq INTEGER PRIMARY KEY, run TEXT, "
            "ts INTEGER, us INTEGER, series INTEGER, power REAL, metadata BLOB, "
            "processed INTEGER)"
        )
        execute("CREATE INDEX IF NOT EXISTS power_by_time ON power_reports (run, ts, seq)")
        execute("CREATE TABLE IF NOT EXISTS sequence (last INTEGER NOT NULL)")
        if execute("SELECT COUNT(*) FROM sequence").fetchone()[0] == 0:
            execute("INSERT INTO sequence SELECT COALESCE(MAX(seq), 0) FROM reports")
        # The first layout's PowerReports, JSON documents among the others, become rows.
        moved = execute(
            "SELECT seq, run, ts, body, processed FROM reports WHERE kind = ? ORDER BY seq",
            (POWER,),
        )
        documents = Documents()
        while page := moved.fetchmany(PAGE):
            self._insert_power(
                (run, seq, documents.power(body), processed)
                for seq, run, _, body, processed in page
            )
        execute("DELETE FROM reports WHERE kind = ?", (POWER,))
        # Times finer than the millisecond: only an ISO text longer than 23 characters has them.
        timestamp = "json_extract(body, '$.timestamp')"
        finer = execute(
            f"SELECT seq, {timestamp} FROM reports WHERE typeof({timestamp}) = 'text' "
            f"AND length({timestamp}) > 23"
        ).fetchall()
        for seq, text in finer:
            execute(
                "UPDATE reports SET us = ? WHERE seq = ?", (to_micros(to_utc(text)) % 1000, seq)
            )
        execute(f"PRAGMA user_version = {LAYOUT}")

    def _series_id(self, run: str, series: Series) -> int:
        """The series' id in the run, created if new (inside a write transaction)."""
        found = self._series_ids.get((run, series))
        if found is None:
            self.db.execute(
                "INSERT OR IGNORE INTO series (run, sensor, target, scope, socket, device) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run, *series),
            )
            (found,) = self.db.execute(
                "SELECT id FROM series WHERE run = ? AND sensor = ? AND target = ? AND "
                "scope = ? AND socket = ? AND device = ?",
                (run, *series),
            ).fetchone()
            self._series_ids[(run, series)] = found
        return int(found)

    def _insert_power(self, reports: Iterable[tuple[str, int, PowerReport, int | None]]) -> None:
        """(run, sequence, report, processing µs) as rows, inside a write transaction."""
        encoded = Encoded()
        dumps = orjson.dumps
        rows = []
        for run, seq, report, processed in reports:
            micros = encoded.micros(report)
            number = self._series_id(run, series_of(report))
            metadata = dumps(report.metadata, option=orjson.OPT_NON_STR_KEYS)
            rows.append((seq, run, micros // 1000, micros % 1000, number, report.power, metadata,
                         processed))  # fmt: skip
        self.db.executemany(
            "INSERT INTO power_reports (seq, run, ts, us, series, power, metadata, processed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )

    def save_run(self, run: Run, *, widen: bool = False) -> None:
        # One upsert: the merge happens inside SQLite, so that another process's write between
        # a read and this write cannot be lost. json_patch merges objects key by key (a null
        # would delete a key: the system info's are left out of the patch).
        system = {key: value for key, value in run.system.items() if value is not None}
        start, end = ("MIN(start, excluded.start)", 'MAX("end", excluded."end")') if widen else (
            "excluded.start", 'excluded."end"')  # fmt: skip
        with self._writing():
            self.db.execute(
                "INSERT INTO runs (id, experiment, benchmark, settings, repetition, parameters, "
                'system, start, "end") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) '
                "ON CONFLICT (id) DO UPDATE "
                "SET experiment = excluded.experiment, benchmark = excluded.benchmark, "
                "settings = excluded.settings, repetition = excluded.repetition, "
                "parameters = json_patch(parameters, excluded.parameters), "
                f'system = json_patch(system, excluded.system), start = {start}, "end" = {end}',
                (
                    run.id, run.experiment, run.benchmark, run.settings, run.repetition,
                    orjson.dumps(run.parameters).decode(), orjson.dumps(system).decode(),
                    to_millis(run.start), to_millis(run.end),
                ),
            )  # fmt: skip

    def add_reports(
        self, run: str, reports: Iterable[Report], processed: datetime | None = None
    ) -> int:
        micros = processing_micros(processed)
        reports = list(reports)
        if not reports:
            return 0
        with self._writing():
            (last,) = self.db.execute(
                "UPDATE sequence SET last = last + ? RETURNING last", (len(reports),)
            ).fetchone()
            numbered = list(enumerate(reports, start=last - len(reports) + 1))
            self._insert_power(
                (run, seq, report, micros)
                for seq, report in numbered
                if isinstance(report, PowerReport)
            )
            others = [
                (seq, report) for seq, report in numbered if not isinstance(report, PowerReport)
            ]
            # Imported here: it needs numpy, which reading a store does not.
            from wattflow.formats.report_table import encode_json_documents

            bodies = encode_json_documents([report for _, report in others])
            encoded = Encoded()
            rows = []
            for (seq, report), body in zip(others, bodies, strict=True):
                moment = encoded.micros(report)
                rows.append((seq, run, moment // 1000, report.kind, body, micros, moment % 1000))
            self.db.executemany(
                "INSERT INTO reports (seq, run, ts, kind, body, processed, us) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        return len(reports)

    def _run_rows(self, experiment: str | None, benchmark: str | None) -> list[dict[str, Any]]:
        query = (
            "SELECT id, experiment, benchmark, settings, repetition, parameters, system, start, "
            '"end", exports FROM runs WHERE (?1 IS NULL OR experiment = ?1) '
            "AND (?2 IS NULL OR benchmark = ?2)"
        )
        rows = []
        for row in self.db.execute(query, (experiment, benchmark)):
            identifier, e, b, s, n, parameters, system, start, end, exports = row
            rows.append(
                {
                    "id": identifier, "experiment": e, "benchmark": b, "settings": s,
                    "repetition": n, "parameters": orjson.loads(parameters),
                    "system": orjson.loads(system), "start": to_utc(start), "end": to_utc(end),
                    "exports": orjson.loads(exports),
                }
            )  # fmt: skip
        return rows

    def note_export(self, run: str, format_name: str, outcome: str) -> None:
        try:
            with self._writing():
                self.db.execute(
                    "UPDATE runs SET exports = json_set(exports, ?, ?) WHERE id = ?",
                    (f'$."{format_name}"', outcome, run),
                )
        except sqlite3.Error as error:
            raise StoreError(f"store {self.path}: {error}") from None

    def _power_pages(self, run: str, start: int, end: int) -> Iterator[PowerPage]:
        series = _SqliteSeries(self.db, run)
        cursor = self.db.execute(
            "SELECT ts * 1000 + us, series, power FROM power_reports "
            "WHERE run = ? AND ts BETWEEN ? AND ? ORDER BY ts, seq",
            (run, start, end),
        )
        while rows := cursor.fetchmany(PAGE):
            yield PowerPage(rows, series)

    def _timeline_pages(self, run: str, start: int, end: int) -> Iterator[TimelinePage]:
        series = _SqliteSeries(self.db, run)
        # One statement: SQLite merges the two tables' index orders. The rows end with the
        # columns they are ordered by (TimelineRow), so they go out as SQLite hands them over.
        cursor = self.db.execute(
            "SELECT ts * 1000 + us, series, power, processed / 1e6, ts, seq FROM power_reports "
            "WHERE run = ?1 AND ts BETWEEN ?2 AND ?3 UNION ALL "
            f"SELECT ts * 1000 + us, {NOT_POWER}, 0.0, processed / 1e6, ts, seq FROM reports "
            "WHERE run = ?1 AND ts BETWEEN ?2 AND ?3 ORDER BY 5, 6",
            (run, start, end),
        )
        while rows := cursor.fetchmany(PAGE):
            yield TimelinePage(rows, series)

    def _power_reports(self, run: str, start: int, end: int) -> Iterator[Row]:
        series = _SqliteSeries(self.db, run)
        cursor = self.db.execute(
            "SELECT ts, seq, ts * 1000 + us, series, power, metadata, processed "
            "FROM power_reports WHERE run = ? AND ts BETWEEN ? AND ? ORDER BY ts, seq",
            (run, start, end),
        )
        while rows := cursor.fetchmany(PAGE):
            for millis, seq, micros, number, power, metadata, processed in rows:
                report = power_report(micros, series[number], power, orjson.loads(metadata))
                yield millis, seq, report, processed

    def _other_reports(
        self, run: str, start: int, end: int, kinds: Sequence[str] | None
    ) -> Iterator[Row]:
        kind_filter = ""
        arguments: list[Any] = [run, start, end]
        if kinds:
            kind_filter = f" AND kind IN ({','.join('?' * len(kinds))})"
            arguments += kinds
        cursor = self.db.execute(
            "SELECT ts, seq, kind, body, processed FROM reports "
            "WHERE run = ? AND ts BETWEEN ? AND ?" + kind_filter + " ORDER BY ts, seq",
            arguments,
        )
        documents = Documents()
        while rows := cursor.fetchmany(PAGE):
            for millis, seq, kind, body, processed in rows:
                yield millis, seq, documents.report(kind, body), processed

    def _count(self, run: str, start: int, end: int) -> int:
        counted = 0
        for table in ("power_reports", "reports"):
            row = self.db.execute(
                f"SELECT COUNT(*) FROM {table} WHERE run = ? AND ts BETWEEN ? AND ?",
                (run, start, end),
            ).fetchone()
            counted += int(row[0])
        return counted

    def close(self) -> None:
        self.db.close()


class MongoRunStore(RunStore):
    """Collections ``runs``, ``run_power`` (PowerReports: run, time in ms and its µs beyond,
    sequence, series fields, power, metadata, processing time) and ``run_reports`` (every other
    kind as its document) in the database the URI names (``wattflow``).

    Document ``layout`` of collection ``store`` holds the layout; a database without it is of
    the first layout (PowerReports among the other documents), migrated on open.
    """

    def __init__(self, uri: str) -> None:
        from pymongo import ASCENDING, MongoClient
        from pymongo.errors import PyMongoError
        from pymongo.uri_parser import parse_uri

        from wattflow.actors.connections import describe_driver_error, redact_uri

        try:
            database = parse_uri(uri).get("database") or "wattflow"
            self.client: Any = MongoClient(uri, tz_aware=True, serverSelectionTimeoutMS=5000)
            self.db = self.client[database]
            by_time = [("run", ASCENDING), ("ts", ASCENDING), ("seq", ASCENDING)]
            self.db.run_reports.create_index(by_time)
            self.db.run_power.create_index(by_time)
            self._migrate()
        except (PyMongoError, ValueError) as error:
            raise StoreError(f"store {redact_uri(uri)}: {describe_driver_error(error)}") from None
        self._sequence = int(datetime.now().timestamp() * 1e6)

    def _migrate(self) -> None:
        """Move the first layout's PowerReports to ``run_power``, a page at a time. Each keeps
        its ``_id``, so two processes migrating at once cannot copy one twice."""
        from pymongo.errors import BulkWriteError

        layout = self.db.store.find_one({"_id": "layout"})
        if layout is not None and layout.get("version", 0) >= LAYOUT:
            return
        stored = Documents()
        while page := list(self.db.run_reports.find({"kind": POWER}).limit(PAGE)):
            documents = []
            for document in page:
                report = stored.power(document["report"])
                documents.append(
                    {"_id": document["_id"], **_power_document(
                        document["run"], document["seq"], report, document.get("processed"))}
                )  # fmt: skip
            try:
                self.db.run_power.insert_many(documents, ordered=False)
            except BulkWriteError as error:
                if any(e.get("code") != 11000 for e in error.details.get("writeErrors", [])):
                    raise
            self.db.run_reports.delete_many({"_id": {"$in": [d["_id"] for d in page]}})
        self.db.store.update_one({"_id": "layout"}, {"$set": {"version": LAYOUT}}, upsert=True)

    def save_run(self, run: Run, *, widen: bool = False) -> None:
        # One update with an aggregation pipeline, so that the merge is atomic on the server.
        # Values go in as $literal: a string starting with '$' would be read as a field path.
        document = run.model_dump(exclude={"events"})
        system = {key: value for key, value in run.system.items() if value is not None}
        fields: dict[str, Any] = {
            name: {"$literal": document[name]}
            for name in ("experiment", "benchmark", "settings", "repetition", "start", "end")
        }
        fields["parameters"] = {"$mergeObjects": ["$parameters", {"$literal": run.parameters}]}
        fields["system"] = {"$mergeObjects": ["$system", {"$literal": system}]}
        if widen:
            fields["start"] = {"$min": ["$start", fields["start"]]}
            fields["end"] = {"$max": ["$end", fields["end"]]}
        self.db.runs.update_one({"_id": run.id}, [{"$set": fields}], upsert=True)

    def add_reports(
        self, run: str, reports: Iterable[Report], processed: datetime | None = None
    ) -> int:
        batches: dict[str, list[dict[str, Any]]] = {"run_power": [], "run_reports": []}
        total = 0
        micros = processing_micros(processed)
        encoded = Encoded()
        for report in reports:
            self._sequence += 1
            if isinstance(report, PowerReport):
                name = "run_power"
                document = _power_document(run, self._sequence, report, micros, encoded)
            else:
                name = "run_reports"
                moment = encoded.micros(report)
                document = {
                    "run": run, "ts": moment // 1000, "us": moment % 1000, "seq": self._sequence,
                    "kind": report.kind, "report": powerapi.to_json_dict(report),
                }  # fmt: skip
                if micros is not None:
                    document["processed"] = micros
            batch = batches[name]
            batch.append(document)
            if len(batch) == PAGE:
                self.db[name].insert_many(batch)
                total += len(batch)
                batch.clear()
        for name, batch in batches.items():
            if batch:
                self.db[name].insert_many(batch)
                total += len(batch)
        return total

    def _run_rows(self, experiment: str | None, benchmark: str | None) -> list[dict[str, Any]]:
        query: dict[str, Any] = {}
        if experiment is not None:
            query["experiment"] = experiment
        if benchmark is not None:
            query["benchmark"] = benchmark
        return [{**row, "id": row["_id"]} for row in self.db.runs.find(query)]

    def note_export(self, run: str, format_name: str, outcome: str) -> None:
        from pymongo.errors import PyMongoError

        from wattflow.actors.connections import describe_driver_error

        try:
            self.db.runs.update_one({"_id": run}, {"$set": {f"exports.{format_name}": outcome}})
        except PyMongoError as error:
            raise StoreError(f"run store: {describe_driver_error(error)}") from None

    def _pages(
        self,
        collection: str,
        run: str,
        window: tuple[int, int],
        kinds: Sequence[str] | None = None,
        fields: Sequence[str] | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        """The collection's documents of the run in time order, PAGE at a time, each page
        asked for after the last one's (time, sequence)."""
        after = (window[0] - 1, 2**62)
        projection = (
            None if fields is None else {"_id": 0, "ts": 1, "seq": 1, **dict.fromkeys(fields, 1)}
        )
        while True:
            query: dict[str, Any] = {
                "run": run,
                "ts": {"$lte": window[1]},
                "$or": [{"ts": {"$gt": after[0]}}, {"ts": after[0], "seq": {"$gt": after[1]}}],
            }
            if kinds:
                query["kind"] = {"$in": list(kinds)}
            cursor = self.db[collection].find(query, projection)
            page = list(cursor.sort([("ts", 1), ("seq", 1)]).limit(PAGE))
            if page:
                yield page
                after = (page[-1]["ts"], page[-1]["seq"])
            if len(page) < PAGE:
                return

    def _power_pages(self, run: str, start: int, end: int) -> Iterator[PowerPage]:
        ids = SeriesIds()
        fields = (*SERIES_FIELDS, "us", "power")
        for page in self._pages("run_power", run, (start, end), fields=fields):
            rows = [(d["ts"] * 1000 + d["us"], ids.number(_series(d)), d["power"]) for d in page]
            yield PowerPage(rows, ids.series)

    def _timeline_pages(self, run: str, start: int, end: int) -> Iterator[TimelinePage]:
        ids = SeriesIds()

        def power() -> Iterator[TimelineRow]:
            fields = (*SERIES_FIELDS, "us", "power", "processed")
            for page in self._pages("run_power", run, (start, end), fields=fields):
                for d in page:
                    yield (
                        d["ts"] * 1000 + d["us"], ids.number(_series(d)), d["power"],
                        processing_seconds(d.get("processed")), d["ts"], d["seq"],
                    )  # fmt: skip

        def others() -> Iterator[TimelineRow]:
            fields = ("us", "processed", "report.timestamp")
            for page in self._pages("run_reports", run, (start, end), fields=fields):
                for d in page:
                    yield (
                        d["ts"] * 1000 + _sub_millisecond(d), NOT_POWER, 0.0,
                        processing_seconds(d.get("processed")), d["ts"], d["seq"],
                    )  # fmt: skip

        merged = heapq.merge(power(), others(), key=lambda row: (row[4], row[5]))
        while rows := list(islice(merged, PAGE)):
            yield TimelinePage(rows, ids.series)

    def _power_reports(self, run: str, start: int, end: int) -> Iterator[Row]:
        for page in self._pages("run_power", run, (start, end)):
            for d in page:
                report = power_report(
                    d["ts"] * 1000 + d["us"], _series(d), d["power"], d["metadata"]
                )
                yield d["ts"], d["seq"], report, d.get("processed")

    def _other_reports(
        self, run: str, start: int, end: int, kinds: Sequence[str] | None
    ) -> Iterator[Row]:
        documents = Documents()
        for page in self._pages("run_reports", run, (start, end), kinds):
            for d in page:
                yield (
                    d["ts"],
                    d["seq"],
                    documents.report(d["kind"], d["report"]),
                    d.get("processed"),
                )

    def _count(self, run: str, start: int, end: int) -> int:
        # Written as $and: SecantusDB 0.7 miscounts a single range condition on an indexed field.
        query = [{"run": run}, {"ts": {"$gte": start}}, {"ts": {"$lte": end}}]
        return sum(
            int(self.db[name].count_documents({"$and": query}))
            for name in ("run_power", "run_reports")
        )

    def close(self) -> None:
        self.client.close()


def _power_document(
    run: str, seq: int, report: PowerReport, processed: int | None, encoded: Encoded | None = None
) -> dict[str, Any]:
    """A PowerReport as a ``run_power`` document."""
    micros = to_micros(report.timestamp) if encoded is None else encoded.micros(report)
    sensor, target, scope, socket, device = series_of(report)
    document: dict[str, Any] = {
        "run": run, "ts": micros // 1000, "us": micros % 1000, "seq": seq, "sensor": sensor,
        "target": target, "scope": scope, "socket": socket, "device": device,
        "power": float(report.power), "metadata": report.metadata,
    }  # fmt: skip
    if processed is not None:
        document["processed"] = processed
    return document


SERIES_FIELDS = Series._fields
"""A ``run_power`` document's fields that name its series."""


def _series(document: dict[str, Any]) -> Series:
    """The series a ``run_power`` document's power is of."""
    return Series(*(document[name] for name in SERIES_FIELDS))


def _sub_millisecond(document: dict[str, Any]) -> int:
    """The µs beyond the millisecond of a ``run_reports`` document; the first layout did not
    store them, its report's timestamp has them."""
    if "us" in document:
        return int(document["us"])
    return to_micros(to_utc(document["report"]["timestamp"])) % 1000


def system_info() -> dict[str, Any]:
    """What is known of this machine, in the keys of the GPU measurement directory spec (and
    ``node``, its host name): for runs recorded on it, never for runs imported into it."""
    return {
        "platform": platform.platform(),
        "os_release": platform.release(),
        "os_version": platform.version(),
        "machine": platform.machine(),
        "python_version": platform.python_version(),
        "node": platform.node(),
    }


def event_data(value: object) -> int | str | None:
    """An event's data as wattflow records it: the spec's integer index where the value is a
    whole number (``3``, ``"3"``, ``3.0``, numpy's integers), other values as text, ``None``
    for none."""
    if value is None:
        return None
    if isinstance(value, str):
        return int(value) if re.fullmatch(r"\s*[+-]?[0-9]+\s*", value) else value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        return operator.index(cast(SupportsIndex, value))
    return str(value)


def new_run(identifier: str, parameters: Mapping[str, float] | None = None) -> Run:
    """A run recorded on this machine from now on: its window is this moment until reports or
    events widen it, its system info this machine's (:func:`system_info`).

    Raises:
        StoreError: for an id that names no run (see :func:`run_id`).
    """
    experiment, benchmark, settings, repetition = parse_run_id(identifier)
    now = datetime.now(UTC)
    return Run(
        id=run_id(experiment, benchmark, settings, repetition),
        experiment=experiment,
        benchmark=benchmark,
        settings=settings,
        repetition=repetition,
        parameters=dict(parameters or {}),
        system=system_info(),
        start=now,
        end=now,
    )


def mark(
    store: RunStore, run: Run, event: EventName, data: object = None, at: datetime | None = None
) -> Run:
    """Record an event in a run, now or ``at`` a given time, and widen its window to hold it:
    ``wattflow runs mark`` and a program's ``record()`` both mark runs this way. Returns the
    run as widened.

    ``data`` is the event's index (an epoch or batch number, as the GPU measurement
    directory's spec has it): see :func:`event_data`. The event's processing time is now,
    when it was marked, whatever ``at`` says.
    """
    now = datetime.now(UTC)
    moment = now if at is None else to_utc(at)
    report = EventReport(
        timestamp=moment, sensor=platform.node(), target="all", event=event, data=event_data(data)
    )
    store.add_reports(run.id, [report], processed=now)
    if run.start <= moment <= run.end:
        return run
    run = run.model_copy(update={"start": min(run.start, moment), "end": max(run.end, moment)})
    store.save_run(run, widen=True)
    return run
