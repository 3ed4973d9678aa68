"""The run store's layout: PowerReports as rows, read by kind, the same from SQLite and MongoDB,
and stores of the first layout (every report a JSON document) migrated when opened."""

from __future__ import annotations

import io
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from rich.console import Console

from wattflow.actors.exporters import exporters
from wattflow.actors.run_store import LAYOUT, RunStore, open_store
from wattflow.formats import powerapi
from wattflow.formats.report_table import encode_json_documents
from wattflow.formats.reports import (
    EventReport,
    GPUDevice,
    GPUReport,
    MeterReport,
    PowerReport,
    Report,
    to_micros,
    to_millis,
)
from wattflow.formats.runs import NOT_POWER, ReportLists, Run, RunData, Series, series_of
from wattflow.service.runs_cli import export_command

from .servers import ServerProcess, mongodb_uri

START = datetime(2026, 5, 4, 10, 0, tzinfo=UTC)
RUN = Run(
    id="layout/mixed/250W/0", experiment="layout", benchmark="mixed", settings="250W",
    repetition=0, parameters={"p": 2.0}, start=START, end=START + timedelta(seconds=3),
)  # fmt: skip
FORMATS = {"gpu-dir": "gpu", "extrap-json": "x.json", "ross": "ross", "hpctoolkit": "toolkit"}


def at(micros: int) -> datetime:
    return START + timedelta(microseconds=micros)


def batches() -> list[tuple[list[Report], datetime | None]]:
    """Three seconds of a node, as batches the way a recorder stores them: times finer than
    the millisecond, a batch stored out of time order, two sensors with the same target, and
    processing times for the live batches only (the first is imported)."""
    found: list[tuple[list[Report], datetime | None]] = []
    for tick in range(12):
        micros = tick * 250_000 + (tick % 3) * 17  # every third tick off the millisecond
        reports: list[Report] = [
            GPUReport(timestamp=at(micros), sensor="n1", target="all",
                      devices={"0": GPUDevice(power=90_000.0 + tick, util_gpu=40.0)}),
        ]  # fmt: skip
        for sensor, target, scope, socket in (
            ("n1", "/a", "cpu", 0), ("n1", "/a", "cpu", 1), ("n1", "/a", "dram", 0),
            ("n2", "/a", "cpu", 0), ("n1", "pid:7", "gpu", None), ("n1", "rapl", "cpu", 0),
        ):  # fmt: skip
            metadata: dict[str, Any] = {"scope": scope, "formula": f"f{tick // 4}", "ratio": 0.25}
            if socket is not None:
                metadata["socket"] = socket
            else:
                metadata["device"] = "0"
            power = 2.0 + tick * 0.5 + (socket or 0)
            reports.append(PowerReport(timestamp=at(micros + 3), sensor=sensor, target=target,
                                       power=power, metadata=metadata))  # fmt: skip
        if tick % 4 == 0:
            reports.append(MeterReport(timestamp=at(micros), sensor="n1", target="all",
                                       channels={"d0c0": 120_000.0}))  # fmt: skip
        if tick in (2, 9):
            name = "epoch_begin" if tick == 2 else "epoch_end"
            reports.append(EventReport(timestamp=at(micros), sensor="n1", target="all",
                                       event=name, data=0))  # fmt: skip
        if tick == 5:
            reports.reverse()  # one millisecond, stored in reverse: the store keeps that order
        found.append((reports, None if tick == 0 else START + timedelta(seconds=tick + 0.5)))
    return found


def stored_order() -> list[tuple[Report, float | None]]:
    """What a store hands back: time order by millisecond, then the order stored."""
    numbered = [
        (to_millis(report.timestamp), number, report, processed)
        for number, (report, processed) in enumerate(
            (report, None if processed is None else processed.timestamp())
            for reports, processed in batches()
            for report in reports
        )
    ]
    return [
        (report, processed) for _, _, report, processed in sorted(numbered, key=lambda r: r[:2])
    ]


def fill(store: RunStore) -> None:
    for reports, processed in batches():
        store.add_reports(RUN.id, reports, processed=processed)
    store.save_run(RUN)


def named_power(data: RunData, run: Run) -> list[tuple[int, Series, float]]:
    return [(t, page.series[n], w) for page in data.power(run) for t, n, w in page.rows]


def named_timeline(data: RunData, run: Run) -> list[tuple[int, Series | None, float, Any]]:
    return [
        (t, None if n == NOT_POWER else page.series[n], w, processed)
        for page in data.timeline(run)
        for t, n, w, processed, _, _ in page.rows
    ]


def exported(data: RunData, runs: list[Run], out: Path) -> dict[str, bytes]:
    """Every file each format writes, by path below ``out``."""
    for name, target in FORMATS.items():
        advanced: list[int] = []
        exporters.get(name)().export(runs, data, out / target, advanced.append)
        assert sum(advanced) == sum(data.count(run) for run in runs), name
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def check_store(store: RunStore, tmp_path: Path) -> dict[str, bytes]:
    """The store hands out what was stored, by every road, as held in memory would."""
    expected = stored_order()
    [run] = store.runs()
    assert run == RUN.model_copy(update={"events": run.events})
    assert [e.event for e in run.events] == ["epoch_begin", "epoch_end"]
    assert list(store.timed_reports(run)) == expected
    assert list(store.reports(run)) == [report for report, _ in expected]
    kinds = ["GPUReport", "EventReport"]
    assert list(store.reports(run, kinds)) == [r for r, _ in expected if r.kind in kinds]
    assert store.count(run) == len(expected)
    held = ReportLists(lambda _: expected)
    assert named_power(store, run) == named_power(held, run)
    assert named_timeline(store, run) == named_timeline(held, run)
    powers = [r for r, _ in expected if isinstance(r, PowerReport)]
    assert named_power(store, run) == [
        (to_micros(r.timestamp), series_of(r), r.power) for r in powers
    ]
    files = exported(store, [run], tmp_path / "store")
    assert files == exported(held, [run], tmp_path / "held")
    return files


def test_sqlite_and_mongodb_hand_out_the_same_rows_and_exports(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        fill(store)
        from_sqlite = check_store(store, tmp_path / "sqlite")
    with open_store(mongodb_uri(mongodb_server) + "layout_both") as store:
        fill(store)
        from_mongodb = check_store(store, tmp_path / "mongodb")
    assert from_sqlite == from_mongodb
    assert {"ross/layout-mixed-250W-0-evtrace.bin", "x.json", "toolkit/trace.db"} <= set(
        from_sqlite
    )


def first_layout_rows() -> list[tuple[int, str, int, str, bytes, int | None]]:
    """(seq, run, time ms, kind, JSON document, processing µs) as the first layout stored them:
    one row per report, every kind a document."""
    rows = []
    seq = 0
    for reports, processed in batches():
        bodies = encode_json_documents(reports)
        micros = None if processed is None else round(processed.timestamp() * 1e6)
        for report, body in zip(reports, bodies, strict=True):
            seq += 1
            rows.append((seq, RUN.id, to_millis(report.timestamp), report.kind, body, micros))
    return rows


def test_a_first_layout_sqlite_store_migrates_on_open(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.executescript(
            """
            CREATE TABLE runs (
                id TEXT PRIMARY KEY, experiment TEXT, benchmark TEXT, settings TEXT,
                repetition INTEGER, parameters TEXT, system TEXT, start INTEGER, end INTEGER);
            CREATE TABLE reports (seq INTEGER PRIMARY KEY, run TEXT, ts INTEGER, kind TEXT,
                body BLOB, processed INTEGER);
            CREATE INDEX reports_by_time ON reports (run, ts, seq);
            """
        )
        old.execute(
            "INSERT INTO runs VALUES (?, 'layout', 'mixed', '250W', 0, '{\"p\": 2.0}', '{}', ?, ?)",
            (RUN.id, to_millis(RUN.start), to_millis(RUN.end)),
        )
        old.executemany("INSERT INTO reports VALUES (?, ?, ?, ?, ?, ?)", first_layout_rows())
    old.close()
    with open_store(f"sqlite:///{path}") as store:
        migrated = check_store(store, tmp_path / "migrated")
        late = PowerReport(timestamp=at(3), sensor="n1", target="/a", power=9.0,
                           metadata={"scope": "cpu", "socket": 0})  # fmt: skip
        store.add_reports(RUN.id, [late])  # in the first reports' millisecond: after them
        [run] = store.runs()
        first = [r for r in store.reports(run) if to_millis(r.timestamp) == to_millis(START)]
        assert first == [r for r, _ in stored_order()[: len(first) - 1]] + [late]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT
        kinds = dict(db.execute("SELECT kind, COUNT(*) FROM reports GROUP BY kind").fetchall())
        assert "PowerReport" not in kinds
        assert db.execute("SELECT COUNT(*) FROM power_reports").fetchone()[0] == 12 * 6 + 1
        finer = sorted(us for (us,) in db.execute("SELECT us FROM reports"))
        others = [r for r, _ in stored_order() if not isinstance(r, PowerReport)]
        assert finer == sorted(to_micros(r.timestamp) % 1000 for r in others)
        assert set(finer) == {0, 17, 34}, "the readings off the millisecond keep their µs"
    db.close()
    with open_store(f"sqlite:///{path}") as store:  # opened again: nothing moves twice
        assert store.count(store.get(RUN.id)) == len(stored_order()) + 1
    with open_store(f"sqlite:///{tmp_path / 'new.db'}") as store:
        fill(store)
        assert migrated == check_store(store, tmp_path / "new")
    out = tmp_path / "command"
    console = Console(file=io.StringIO())
    assert export_command(["ross", "--store", f"sqlite:///{path}", "--out", str(out)], console) == 0


def test_a_first_layout_mongodb_store_migrates_on_open(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    uri = mongodb_uri(mongodb_server) + "layout_first"
    client: Any = MongoClient(uri, tz_aware=True)
    database = client["layout_first"]
    documents = []
    seq = 0
    for reports, processed in batches():  # as the first layout's add_reports wrote them
        for report in reports:
            seq += 1
            document = {"run": RUN.id, "ts": to_millis(report.timestamp), "seq": seq,
                        "kind": report.kind, "report": powerapi.to_json_dict(report)}  # fmt: skip
            if processed is not None:
                document["processed"] = round(processed.timestamp() * 1e6)
            documents.append(document)
    database.run_reports.insert_many(documents)
    database.runs.insert_one({"_id": RUN.id, **RUN.model_dump(exclude={"id", "events"})})
    try:
        with open_store(uri) as store:
            check_store(store, tmp_path / "migrated")
        assert database.run_reports.count_documents({"kind": "PowerReport"}) == 0
        assert database.run_power.count_documents({}) == 12 * 6
        assert database.store.find_one({"_id": "layout"})["version"] == LAYOUT
        with open_store(uri) as store:  # opened again: nothing moves twice
            assert store.count(store.get(RUN.id)) == len(stored_order())
    finally:
        client.close()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_an_export_reads_only_what_its_format_needs(name: str, tmp_path: Path) -> None:
    """Exports that fold power never decode a report; gpu-dir never reads a PowerReport."""
    reads: dict[str, int] = {"reports": 0, "power": 0, "timeline": 0}

    class Counting(ReportLists):
        def reports(self, run: Run, kinds: Any = None) -> Any:
            for report in super().reports(run, kinds):
                reads["reports"] += 1
                assert not isinstance(report, PowerReport), "a PowerReport decoded"
                yield report

        def power(self, run: Run) -> Any:
            reads["power"] += 1
            return super().power(run)

        def timeline(self, run: Run) -> Any:
            reads["timeline"] += 1
            return super().timeline(run)

    data = Counting(lambda _: stored_order())
    exporters.get(name)().export([RUN], data, tmp_path / FORMATS[name], lambda _: None)
    read = {kind for kind, count in reads.items() if count}
    assert read == {"gpu-dir": {"reports"}, "extrap-json": {"power"}, "ross": {"timeline"},
                    "hpctoolkit": {"power"}}[name]  # fmt: skip
