"""The run store: measurement runs and their reports, in embedded SQLite or in MongoDB.

A run is named ``experiment/benchmark/settings/repetition`` (its id), the way researchers lay
out their measurement directories. Its reports are stored one row (or document) each, keyed by
run and time, and read back in time order in pages, so an export of an hour-long run never
holds the hour in memory. EventReports are stored with the reports and make up the run's
events.

``sqlite:///path/to/runs.db`` (or a bare path) selects SQLite; ``mongodb://host/db`` selects
MongoDB. With neither, the store is ``runs.db`` in the user's data directory
(``$XDG_DATA_HOME/wattflow``, by default ``~/.local/share/wattflow``).
"""

from __future__ import annotations

import os
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from wattflow.formats import powerapi
from wattflow.formats.errors import WattflowError
from wattflow.formats.reports import (
    EventReport,
    PowerReport,
    Report,
    report_kind,
    to_millis,
    to_utc,
    trusted_report,
)
from wattflow.formats.runs import Run

PAGE = 5000
"""Reports read from the store at once."""


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
    if uri.startswith(("mongodb://", "mongodb+srv://")):
        return MongoRunStore(uri)
    scheme, separator, _ = uri.partition("://")
    if separator and scheme != "sqlite":
        raise StoreError(
            f"store {uri!r}: give sqlite:///PATH, a path, or mongodb://HOST/DB, not {scheme}://"
        )
    path = Path(uri.removeprefix("sqlite:///").removeprefix("sqlite://"))
    if not create and not path.exists():
        raise StoreError(f"no run store at {path}: check --store (runs import creates one)")
    return SqliteRunStore(path)


def _micros(moment: datetime) -> int:
    """Unix microseconds: processing times are finer than report timestamps' milliseconds."""
    return round(to_utc(moment).timestamp() * 1e6)


_last_time: list[Any] = [None, None]


def _decode(kind: str, body: bytes | str | dict[str, Any]) -> Report:
    document = body if isinstance(body, dict) else orjson.loads(body)
    if kind == "PowerReport":
        # The store holds what wattflow wrote itself: PowerReports, by far the most numerous,
        # skip validation. A tick's reports share a timestamp, so its parse is kept.
        text = document["timestamp"]
        if text != _last_time[0]:
            _last_time[0], _last_time[1] = text, to_utc(text)
        return trusted_report(
            PowerReport,
            {
                "timestamp": _last_time[1],
                "sensor": document["sensor"],
                "target": document["target"],
                "metadata": document.get("metadata") or {},
                "power": float(document["power"]),
            },
        )
    return powerapi.decode_document(report_kind(kind), document, "run store", None)


class RunStore(ABC):
    """Runs and their reports."""

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
    def _report_page(
        self, run: str, after: tuple[int, int], until: int, kinds: list[str] | None
    ) -> list[tuple[int, int, str, Any, int | None]]:
        """Up to PAGE (time ms, sequence, kind, body, processed µs) after ``after``, up to
        ``until``."""

    @abstractmethod
    def count(self, run: Run) -> int:
        """Reports inside the run's window."""

    @abstractmethod
    def close(self) -> None:
        """Release the database."""

    def runs(self, experiment: str | None = None, benchmark: str | None = None) -> list[Run]:
        """The runs, optionally of one experiment or benchmark, in id order, with events."""
        found = []
        for row in self._run_rows(experiment, benchmark):
            events = [
                r
                for r in self._reports(
                    row["id"], to_millis(row["start"]), to_millis(row["end"]), ["EventReport"]
                )
                if isinstance(r, EventReport)
            ]
            found.append(Run.model_validate({**row, "events": events}))
        return sorted(found, key=lambda run: run.id)

    def get(self, identifier: str) -> Run:
        """One run by its id."""
        experiment, benchmark, _, _ = parse_run_id(identifier)
        for run in self.runs(experiment, benchmark):
            if run.id == identifier:
                return run
        raise StoreError(f"no run {identifier!r} in the store")

    def reports(self, run: Run, kinds: list[str] | None = None) -> Iterator[Report]:
        """The run's reports inside its window, in time order (and insertion order within)."""
        return self._reports(run.id, to_millis(run.start), to_millis(run.end), kinds)

    def timed_reports(self, run: Run) -> Iterator[tuple[Report, float | None]]:
        """The run's reports as :meth:`reports` gives them, each with its processing time
        (Unix seconds), or ``None`` where it was not recorded live."""
        for kind, body, processed in self._rows(
            run.id, to_millis(run.start), to_millis(run.end), None
        ):
            yield _decode(kind, body), None if processed is None else processed / 1e6

    def _reports(self, run: str, start: int, end: int, kinds: list[str] | None) -> Iterator[Report]:
        for kind, body, _ in self._rows(run, start, end, kinds):
            yield _decode(kind, body)

    def _rows(
        self, run: str, start: int, end: int, kinds: list[str] | None
    ) -> Iterator[tuple[str, Any, int | None]]:
        """(kind, body, processed µs) of the run's stored reports in time order, page by page."""
        after = (start - 1, 2**62)
        while True:
            page = self._report_page(run, after, end, kinds)
            for millis, sequence, kind, body, processed in page:
                yield kind, body, processed
                after = (millis, sequence)
            if len(page) < PAGE:
                return

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SqliteRunStore(RunStore):
    """One SQLite file: a table of runs and a table of reports indexed by (run, time)."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Used from worker threads (the service's recorder), one call at a time.
            self.db = sqlite3.connect(path, check_same_thread=False)
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"store {path}: {error}") from None
        self.path = path
        self.db.executescript(
            """
            PRAGMA journal_mode = WAL;
            CREATE TABLE IF NOT EXISTS runs (
                id TEXT PRIMARY KEY, experiment TEXT, benchmark TEXT, settings TEXT,
                repetition INTEGER, parameters TEXT, system TEXT, start INTEGER, end INTEGER);
            CREATE TABLE IF NOT EXISTS reports (
                seq INTEGER PRIMARY KEY, run TEXT, ts INTEGER, kind TEXT, body BLOB,
                processed INTEGER);
            CREATE INDEX IF NOT EXISTS reports_by_time ON reports (run, ts, seq);
            """
        )
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(reports)")}
        if "processed" not in columns:  # a store written before processing times were kept
            with self.db:
                self.db.execute("ALTER TABLE reports ADD COLUMN processed INTEGER")

    def save_run(self, run: Run, *, widen: bool = False) -> None:
        # One upsert: the merge happens inside SQLite, so that another process's write between
        # a read and this write cannot be lost. json_patch merges objects key by key (a null
        # would delete a key: the system info's are left out of the patch).
        system = {key: value for key, value in run.system.items() if value is not None}
        start, end = ("MIN(start, excluded.start)", 'MAX("end", excluded."end")') if widen else (
            "excluded.start", 'excluded."end"')  # fmt: skip
        with self.db:
            self.db.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
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
        micros = None if processed is None else _micros(processed)
        reports = list(reports)
        bodies = powerapi.encode_json_documents(reports)  # a tick's timestamp formatted once
        rows = (
            (run, to_millis(r.timestamp), r.kind, body, micros)
            for r, body in zip(reports, bodies, strict=True)
        )
        with self.db:
            cursor = self.db.executemany(
                "INSERT INTO reports (run, ts, kind, body, processed) VALUES (?, ?, ?, ?, ?)",
                rows,
            )
        return cursor.rowcount

    def _run_rows(self, experiment: str | None, benchmark: str | None) -> list[dict[str, Any]]:
        query = (
            "SELECT * FROM runs WHERE (?1 IS NULL OR experiment = ?1) "
            "AND (?2 IS NULL OR benchmark = ?2)"
        )
        rows = []
        for row in self.db.execute(query, (experiment, benchmark)):
            identifier, e, b, s, n, parameters, system, start, end = row
            rows.append(
                {
                    "id": identifier, "experiment": e, "benchmark": b, "settings": s,
                    "repetition": n, "parameters": orjson.loads(parameters),
                    "system": orjson.loads(system), "start": to_utc(start), "end": to_utc(end),
                }
            )  # fmt: skip
        return rows

    def _report_page(
        self, run: str, after: tuple[int, int], until: int, kinds: list[str] | None
    ) -> list[tuple[int, int, str, Any, int | None]]:
        kind_filter = ""
        arguments: list[Any] = [run, after[0], after[0], after[1], until]
        if kinds:
            kind_filter = f" AND kind IN ({','.join('?' * len(kinds))})"
            arguments += kinds
        return list(
            self.db.execute(
                "SELECT ts, seq, kind, body, processed FROM reports WHERE run = ? AND "
                "(ts > ? OR (ts = ? AND seq > ?)) AND ts <= ?" + kind_filter
                + f" ORDER BY ts, seq LIMIT {PAGE}",
                arguments,
            )
        )  # fmt: skip

    def count(self, run: Run) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM reports WHERE run = ? AND ts BETWEEN ? AND ?",
            (run.id, to_millis(run.start), to_millis(run.end)),
        ).fetchone()
        return int(row[0])

    def close(self) -> None:
        self.db.close()


class MongoRunStore(RunStore):
    """Collections ``runs`` and ``run_reports`` in the database the URI names (``wattflow``)."""

    def __init__(self, uri: str) -> None:
        from pymongo import ASCENDING, MongoClient
        from pymongo.errors import PyMongoError
        from pymongo.uri_parser import parse_uri

        from wattflow.actors.connections import describe_driver_error, redact_uri

        try:
            database = parse_uri(uri).get("database") or "wattflow"
            self.client: Any = MongoClient(uri, tz_aware=True, serverSelectionTimeoutMS=5000)
            self.db = self.client[database]
            self.db.run_reports.create_index(
                [("run", ASCENDING), ("ts", ASCENDING), ("seq", ASCENDING)]
            )
        except (PyMongoError, ValueError) as error:
            raise StoreError(f"store {redact_uri(uri)}: {describe_driver_error(error)}") from None
        self._sequence = int(datetime.now().timestamp() * 1e6)

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
        batch: list[dict[str, Any]] = []
        total = 0
        micros = None if processed is None else _micros(processed)
        for report in reports:
            self._sequence += 1
            document: dict[str, Any] = {
                "run": run, "ts": to_millis(report.timestamp), "seq": self._sequence,
                "kind": report.kind, "report": powerapi.to_json_dict(report),
            }  # fmt: skip
            if micros is not None:
                document["processed"] = micros
            batch.append(document)
            if len(batch) == PAGE:
                self.db.run_reports.insert_many(batch)
                total += len(batch)
                batch = []
        if batch:
            self.db.run_reports.insert_many(batch)
            total += len(batch)
        return total

    def _run_rows(self, experiment: str | None, benchmark: str | None) -> list[dict[str, Any]]:
        query: dict[str, Any] = {}
        if experiment is not None:
            query["experiment"] = experiment
        if benchmark is not None:
            query["benchmark"] = benchmark
        return [{**row, "id": row["_id"]} for row in self.db.runs.find(query)]

    def _report_page(
        self, run: str, after: tuple[int, int], until: int, kinds: list[str] | None
    ) -> list[tuple[int, int, str, Any, int | None]]:
        query: dict[str, Any] = {
            "run": run,
            "ts": {"$lte": until},
            "$or": [{"ts": {"$gt": after[0]}}, {"ts": after[0], "seq": {"$gt": after[1]}}],
        }
        if kinds:
            query["kind"] = {"$in": kinds}
        cursor = self.db.run_reports.find(query).sort([("ts", 1), ("seq", 1)]).limit(PAGE)
        return [(d["ts"], d["seq"], d["kind"], d["report"], d.get("processed")) for d in cursor]

    def count(self, run: Run) -> int:
        # Written as $and: SecantusDB 0.7 miscounts a single range condition on an indexed field.
        query = [{"run": run.id}, {"ts": {"$gte": to_millis(run.start)}},
                 {"ts": {"$lte": to_millis(run.end)}}]  # fmt: skip
        return int(self.db.run_reports.count_documents({"$and": query}))

    def close(self) -> None:
        self.client.close()
