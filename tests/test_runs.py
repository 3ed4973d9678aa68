"""Runs: import, browse, mark, record live and from programs, and export as a GPU directory."""

from __future__ import annotations

import asyncio
import json
import platform
import re
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pandas as pd  # type: ignore[import-untyped]
import pytest

from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.runs import RunRecorder, RunRecorderConfig
from wattflow.actors.run_store import StoreError, mark, new_run, open_store
from wattflow.formats import powerapi
from wattflow.formats.reports import (
    EventReport,
    GPUDevice,
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    Report,
    TargetEnergyReport,
    to_millis,
)
from wattflow.formats.runs import PAGE, Run, summarise
from wattflow.service.cli import load_run_config
from wattflow.service.recording import TrainingCallback, record
from wattflow.service.runs_cli import ENERGY_HEADER, energy_row, import_lines, run_row, show_lines

from .conftest import FIXTURES, wattflow
from .servers import ServerProcess, mongodb_uri

START = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


def recording(seconds: int = 10) -> list[Report]:
    """A benchmark: GPU readings at 10 Hz, a meter at 1 Hz, power per target, epochs."""
    reports: list[Report] = [
        EventReport(timestamp=at(0), sensor="n", target="all", event="experiment_begin")
    ]
    for tenth in range(10 * seconds):
        t = tenth / 10
        device = GPUDevice(
            power=200_000.0 + tenth,
            total_energy=200.0 * 1000 * t,
            util_gpu=80.0,
            clock_gpu=1410.0,
            temperature=60.0,
            samples={
                "TOTAL_POWER": [(int(at(t).timestamp() * 1e6) + i, 200_000.0) for i in range(2)]
            },
        )
        reports.append(GPUReport(timestamp=at(t), sensor="n", target="all", devices={"0": device}))
        if tenth % 10 == 0:
            reports.append(
                MeterReport(
                    timestamp=at(t),
                    sensor="n",
                    target="all",
                    channels={"d0c0": 150_000.0, "d0c1": 160_000.0},
                )
            )
            reports.append(
                PowerReport(
                    timestamp=at(t),
                    sensor="n",
                    target="train",
                    power=100.0,
                    metadata={"scope": "gpu", "device": "0"},
                )
            )
    for epoch in range(2):
        # The spec's integer index; the first epoch as text, as earlier recordings stored it.
        data: int | str = str(epoch) if epoch == 0 else epoch
        reports.append(
            EventReport(
                timestamp=at(1 + 4 * epoch),
                sensor="n",
                target="all",
                event="epoch_begin",
                data=data,
            )
        )
        reports.append(
            EventReport(
                timestamp=at(4 + 4 * epoch),
                sensor="n",
                target="all",
                event="epoch_end",
                data=data,
            )
        )
    reports.append(
        EventReport(timestamp=at(seconds), sensor="n", target="all", event="experiment_end")
    )
    return sorted(reports, key=lambda r: r.timestamp)


def write_jsonl(path: Path, reports: list[Report]) -> Path:
    path.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    return path


def import_run(store: str, source: Path, repetition: int = 0, p: float = 4) -> None:
    done = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "clock-limit",
        "--benchmark", "bert", "--settings", "877MHz,1065MHz", "--repetition", str(repetition),
        "--param", f"p={p}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "imported" in done.stdout


def check_gpu_directory(root: Path, reports: list[Report]) -> None:
    """Load the directory the way its analysis code does, and compare the numbers."""
    repetition = root / "clock-limit" / "bert" / "877MHz,1065MHz" / "0"
    gpu = pd.read_csv(repetition / "gpu-power.csv", index_col=0)
    assert list(gpu.columns) == [
        "timestamp",
        "clock-gpu",
        "total-energy",
        "power",
        "tmp",
        "util-gpu",
    ]
    gpu_reports = [r for r in reports if isinstance(r, GPUReport)]
    assert list(gpu.index) == list(range(len(gpu_reports)))
    assert list(gpu["power"]) == [r.devices["0"].power for r in gpu_reports]
    first = datetime.fromisoformat(gpu["timestamp"][0])
    assert first.tzinfo is None
    assert first == at(0).astimezone().replace(tzinfo=None)
    events = pd.read_csv(repetition / "timestamps.csv")
    assert list(events.columns) == ["timestamp", "event", "data"]
    assert next(iter(events["event"])) == "experiment_begin"
    assert list(events["event"])[-1] == "experiment_end"
    assert list(events["data"][events["event"] == "epoch_begin"]) == [0, 1]
    external = pd.read_csv(repetition / "power-external.csv", index_col=0)
    channels = [c for c in external.columns if re.match(r"d\dc\d", c)]
    assert channels == ["d0c0", "d0c1"]
    assert (external[channels].sum(axis=1) == 310_000).all()
    samples = pd.read_csv(repetition / "total_power_samples.csv", index_col=0)
    assert list(samples.columns) == ["timestamp", "value"]
    assert len(samples) == 2 * len(gpu_reports)
    assert samples["timestamp"].is_monotonic_increasing
    assert samples["timestamp"].dtype.kind == "i"
    info = json.loads((repetition / "system_info.json").read_text())
    assert {"device_name", "driver_version", "platform", "python_version"} <= set(info)


def test_importing_other_parameters_into_an_existing_run_is_refused(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    source = write_jsonl(tmp_path / "run.jsonl", recording())
    import_run(store, source, p=4)
    before = wattflow("runs", "--store", store, "list").stdout
    again = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "clock-limit",
        "--benchmark", "bert", "--settings", "877MHz,1065MHz", "--repetition", "0",
        "--param", "p=8",
    )  # fmt: skip
    assert again.returncode == 2
    message = " ".join(again.stderr.split())
    assert "run clock-limit/bert/877MHz,1065MHz/0 already exists with p=4" in message
    assert "give --settings 877MHz,1065MHz,p=8 (without --settings, the run is named p=8)" in (
        message
    )
    assert "to add these files to the existing run, give --param p=4" in message
    assert wattflow("runs", "--store", store, "list").stdout == before  # nothing was added
    # Doing what it says: the run at p=8 gets its own settings.
    own = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "clock-limit",
        "--benchmark", "bert", "--settings", "877MHz,1065MHz,p=8", "--repetition", "0",
        "--param", "p=8",
    )  # fmt: skip
    assert own.returncode == 0, own.stderr
    with open_store(store) as opened:
        assert opened.get("clock-limit/bert/877MHz,1065MHz,p=8/0").parameters == {"p": 8.0}
    added = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "clock-limit",
        "--benchmark", "bert", "--settings", "877MHz,1065MHz", "--repetition", "0",
        "--param", "p=4",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert "already held reports; it now holds" in " ".join(added.stdout.split())


def test_import_list_show_mark_and_export_a_gpu_directory(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    reports = recording()
    import_run(store, write_jsonl(tmp_path / "run.jsonl", reports))
    listed = wattflow("runs", "--store", store, "list")
    assert listed.returncode == 0, listed.stderr
    assert "clock-limit/bert/877MHz,1065MHz/0" in listed.stdout
    assert "p=4" in listed.stdout
    shown = wattflow("runs", "show", "clock-limit/bert/877MHz,1065MHz/0", "--store", store)
    assert shown.returncode == 0, shown.stderr
    assert "100 GPUReport" in shown.stdout
    assert "epoch_begin" in shown.stdout
    out = tmp_path / "export"
    exported = wattflow("export", "gpu-dir", "--store", store, "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    inside = len([r for r in reports if r.timestamp <= at(10)])
    assert f"wrote {out} from 1 run, {inside} reports" in exported.stderr
    check_gpu_directory(out, reports)
    # The recording is months old: marking it now is refused, unless asked for.
    marked = wattflow("runs", "mark", "train_begin", "--store", store, "--at", "now")
    assert marked.returncode == 0, marked.stderr
    assert "warning: the event is outside run clock-limit/bert/877MHz,1065MHz/0's window" in (
        marked.stderr
    )
    with open_store(store) as opened:
        [run] = opened.runs()
        assert run.events[-1].event == "train_begin"
        assert run.end > at(10), "marking widens the window"


def test_marking_an_imported_run_now_is_refused_and_at_places_the_event(tmp_path: Path) -> None:
    """A recording from months ago marked now would get a window of months, which an export
    would then span: ``runs mark`` refuses, and ``--at`` places the event in the recording."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    import_run(store, write_jsonl(tmp_path / "run.jsonl", recording()))
    identifier = "clock-limit/bert/877MHz,1065MHz/0"
    refused = wattflow("runs", "mark", "epoch_begin", "3", "--store", store)
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert f"run {identifier} spans 2026-06-01T08:00:00+00:00 – 2026-06-01T08:00:10+00:00" in (
        message
    )
    assert "Give --at TIME to place the event in the run" in message
    for at_time, expected in (("+2.5", at(2.5)), ("2026-06-01T08:00:07.25", at(7.25))):
        placed = wattflow("runs", "mark", "epoch_begin", "3", "--at", at_time, "--store", store)
        assert placed.returncode == 0, placed.stderr
        assert f"marked epoch_begin in {identifier} at {expected.isoformat()}" in placed.stdout
        assert placed.stderr == "", "inside the window: no warning"
    late = wattflow("runs", "mark", "train_end", "--at", "2026-06-01T08:10:00Z", "--store", store)
    assert late.returncode == 0, late.stderr
    assert "widened by 9.8 min: it now spans" in " ".join(late.stderr.split())
    bad = wattflow("runs", "mark", "train_end", "--at", "yesterday", "--store", store)
    assert bad.returncode == 2
    assert "--at 'yesterday': give an ISO 8601 time" in bad.stderr
    with open_store(store) as opened:
        run = opened.get(identifier)
    assert (run.start, run.end) == (at(0), at(600))
    assert [(e.event, e.timestamp) for e in run.events if e.data == 3] == [
        ("epoch_begin", at(2.5)),
        ("epoch_begin", at(7.25)),
    ]
    exported = wattflow("export", "ross", "--store", store, "--out", str(tmp_path / "ross"))
    assert exported.returncode == 0, exported.stderr


def test_the_mongodb_store_holds_the_same_run(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    store = mongodb_uri(mongodb_server) + "measurements"
    reports = recording(4)
    import_run(store, write_jsonl(tmp_path / "run.jsonl", reports))
    with open_store(store) as opened:
        [run] = opened.runs(experiment="clock-limit")
        assert run.parameters == {"p": 4.0}
        inside = [r for r in reports if r.timestamp <= at(4)]  # the epochs after the end
        assert len(inside) < len(reports)
        assert list(opened.reports(run)) == inside
        assert opened.count(run) == len(inside)
        assert {moment for _, moment in opened.timed_reports(run)} == {None}, "imported"
        processed = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
        mark(opened, run, "train_begin")
        opened.add_reports(run.id, [reports[0]], processed=processed)
        timed = [moment for _, moment in opened.timed_reports(opened.get(run.id))]
        assert timed.count(processed.timestamp()) == 1
        assert sum(moment is not None for moment in timed) == 2, "the mark is timed too"


def test_reports_come_back_in_pages_in_time_order(tmp_path: Path) -> None:
    reports = [
        PowerReport(
            timestamp=at(i / 100),
            sensor="n",
            target=f"t{i % 7}",
            power=float(i),
            metadata={"scope": "cpu"},
        )
        for i in range(2 * PAGE + 123)
    ]
    source = write_jsonl(tmp_path / "big.jsonl", list(reversed(reports)))
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    import_run(store, source)
    with open_store(store) as opened:
        [run] = opened.runs()
        back = list(opened.reports(run))
    assert [r.power for r in back if isinstance(r, PowerReport)] == [r.power for r in reports]
    assert len(back) == len(reports)


def test_the_service_records_a_live_run(tmp_path: Path) -> None:
    reports = recording(3)
    gpu = write_jsonl(tmp_path / "gpu.jsonl", [r for r in reports if isinstance(r, GPUReport)])
    meter = write_jsonl(
        tmp_path / "meter.jsonl", [r for r in reports if isinstance(r, MeterReport)]
    )
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    before = time.time()
    done = wattflow(
        "run", "--input", "jsonl", "--model", "GPUReport", "--files", str(gpu),
        "--input", "jsonl", "--model", "MeterReport", "--files", str(meter),
        "--gpu-idle-power", "50", "--run", "live/bert/250W/2", "--store", store,
    )  # fmt: skip
    after = time.time()
    assert done.returncode == 0, done.stderr
    with open_store(store) as opened:
        run = opened.get("live/bert/250W/2")
        kinds = {r.kind for r in opened.reports(run)}
        processed = [moment for _, moment in opened.timed_reports(run)]
        stored = list(opened.reports(run))
    assert {"GPUReport", "MeterReport", "PowerReport"} <= kinds
    # A recording replayed through the service keeps the window it was measured in.
    assert run.start == at(0)
    assert run.end == max(report.timestamp for report in stored)
    assert run.end <= at(4)
    # Every report carries the moment the service finished with it, for ROSS's real time.
    assert processed
    assert all(moment is not None and before <= moment <= after for moment in processed)


def test_programs_mark_phases_with_the_python_api(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    with record("train", "resnet", settings="300W", repetition=1, parameters={"batch": 64},
                store=store) as run:  # fmt: skip
        callback = TrainingCallback(run, batches=True)
        callback.on_train_begin()
        for epoch in range(2):
            callback.on_epoch_begin(epoch)
            callback.on_train_batch_begin(0)
            callback.on_train_batch_end(0)
            callback.on_epoch_end(epoch)
        callback.on_train_end()
    with open_store(store) as opened:
        [stored] = opened.runs()
        names = [event.event for event in stored.events]
        summary = summarise(stored, opened.reports(stored))
    assert names[0] == "experiment_begin"
    assert names[-1] == "experiment_end"
    assert names.count("epoch_begin") == 2
    assert names.count("batch_end") == 2
    assert stored.parameters == {"batch": 64.0}
    assert summary.reports == len(names)


def test_runs_that_differ_only_by_parameters_are_named_after_them(tmp_path: Path) -> None:
    """Without --settings, the benchmark-run directory is named by the parameters, joined
    with commas as the spec joins settings, in name order whatever order they were given."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    source = write_jsonl(tmp_path / "run.jsonl", recording(2))
    for params in (["p=4"], ["p=8", "batch=32"], ["batch=32", "p=8"], ["p=0.5"]):
        done = wattflow(
            "runs", "import", str(source), "--store", store, "--experiment", "scaling",
            "--benchmark", "solver", "--repetition", "0",
            *(argument for param in params for argument in ("--param", param)),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    with open_store(store) as opened:
        runs = {run.settings: run.parameters for run in opened.runs()}
    assert runs == {
        "p=4": {"p": 4.0},
        "batch=32,p=8": {"batch": 32.0, "p": 8.0},  # imported twice into the same run
        "p=0.5": {"p": 0.5},
    }
    out = tmp_path / "out"
    assert wattflow("export", "gpu-dir", "--store", store, "--out", str(out)).returncode == 0
    assert sorted(p.name for p in (out / "scaling" / "solver").iterdir()) == [
        "batch=32,p=8",
        "p=0.5",
        "p=4",
    ]
    nothing = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "scaling",
        "--benchmark", "solver", "--repetition", "0",
    )  # fmt: skip
    assert nothing.returncode == 2
    assert "give --settings" in nothing.stderr
    assert "or --param NAME=VALUE to name the run after its parameters" in nothing.stderr


def test_event_data_is_the_specs_integer_index_everywhere(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """JSON Lines, both stores, `runs mark` and the Python API keep an integer index; text, as
    older recordings hold it, is still read."""
    lines: list[dict[str, object]] = [
        {"timestamp": "2026-06-01T08:00:00.000", "sensor": "n", "target": "all",
         "event": "experiment_begin"},
        {"timestamp": "2026-06-01T08:00:01.000", "sensor": "n", "target": "all",
         "event": "epoch_begin", "data": 3},
        {"timestamp": "2026-06-01T08:00:02.000", "sensor": "n", "target": "all",
         "event": "epoch_end", "data": "3"},
        {"timestamp": "2026-06-01T08:00:03.000", "sensor": "n", "target": "all",
         "event": "experiment_end", "data": "done"},
    ]  # fmt: skip
    source = tmp_path / "events.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for store in (f"sqlite:///{tmp_path / 'runs.db'}", mongodb_uri(mongodb_server) + "events"):
        done = wattflow(
            "runs", "import", str(source), "--store", store, "--experiment", "e",
            "--benchmark", "b", "--settings", "s", "--repetition", "0",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        with open_store(store) as opened:
            [run] = opened.runs()
            assert [event.data for event in run.events] == [None, 3, "3", "done"]
            mark(opened, opened.get(run.id), "batch_begin", "7")  # as `runs mark` gives it
            mark(opened, opened.get(run.id), "batch_end", 7)
            assert [event.data for event in opened.get(run.id).events][-2:] == [7, 7]
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    marked = wattflow("runs", "mark", "train_begin", "5", "--store", store, "--run", "e/b/s/0")
    assert marked.returncode == 0, marked.stderr
    with record("e", "b", settings="s", repetition=1, store=store) as program:
        TrainingCallback(program).on_epoch_begin(2)
        program.mark("epoch_end", "2")
        program.mark("batch_begin", "warm-up")
    with open_store(store) as opened:
        assert opened.get("e/b/s/0").events[-1].data == 5
        events = opened.get("e/b/s/1").events
    assert [(event.event, event.data) for event in events] == [
        ("experiment_begin", None),
        ("epoch_begin", 2),
        ("epoch_end", 2),
        ("batch_begin", "warm-up"),
        ("experiment_end", None),
    ]
    shown = wattflow("runs", "show", "e/b/s/0", "--store", store)
    assert re.search(r"epoch_begin\s+3\n", shown.stdout), shown.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**lines[1], "data": True}) + "\n")
    refused = wattflow(
        "runs", "import", str(bad), "--store", store, "--experiment", "e", "--benchmark", "b",
        "--settings", "s", "--repetition", "2",
    )  # fmt: skip
    assert refused.returncode == 2
    assert "an index (an integer) or text, not a boolean" in refused.stderr


def test_a_store_with_text_event_data_reads_and_exports_integers(tmp_path: Path) -> None:
    """Stores written before the index was an integer hold text: it is read as it is, and
    timestamps.csv gets the integers."""
    path = tmp_path / "old.db"
    events = [("experiment_begin", None), ("epoch_begin", "0"), ("epoch_end", "0"),
              ("experiment_end", None)]  # fmt: skip
    with sqlite3.connect(path) as old:
        old.executescript(
            """
            CREATE TABLE runs (
                id TEXT PRIMARY KEY, experiment TEXT, benchmark TEXT, settings TEXT,
                repetition INTEGER, parameters TEXT, system TEXT, start INTEGER, end INTEGER);
            CREATE TABLE reports (seq INTEGER PRIMARY KEY, run TEXT, ts INTEGER, kind TEXT,
                body BLOB);
            INSERT INTO runs VALUES ('e/b/s/0', 'e', 'b', 's', 0, '{}', '{}', 0, 10000);
            """
        )
        for second, (name, data) in enumerate(events):
            body = {"timestamp": second * 1000, "sensor": "n", "target": "all", "event": name}
            if data is not None:
                body["data"] = data
            old.execute(
                "INSERT INTO reports (run, ts, kind, body) VALUES ('e/b/s/0', ?, 'EventReport', ?)",
                (second * 1000, json.dumps(body)),
            )
    old.close()
    with open_store(f"sqlite:///{path}") as store:
        assert [event.data for event in store.get("e/b/s/0").events] == [None, "0", "0", None]
    out = tmp_path / "out"
    done = wattflow("export", "gpu-dir", "--store", f"sqlite:///{path}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(out / "e" / "b" / "s" / "0" / "timestamps.csv")
    assert list(table["data"]) == [0, 0, 0, 0]
    assert table["data"].dtype.kind == "i"


def test_the_service_and_a_program_recording_one_run_keep_its_parameters(
    tmp_path: Path,
) -> None:
    """Whichever starts second, neither's copy of the run drops the other's parameters or
    narrows the window the other widened."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"

    def report(seconds: float = 0.0, moment: datetime | None = None) -> PowerReport:
        moment = (moment or datetime.now(UTC)) + timedelta(seconds=seconds)
        return PowerReport(timestamp=moment, sensor="n", target="t", power=1.0)

    async def service_first() -> None:
        recorder = RunRecorder(RunRecorderConfig(name="run_store", run="e/b/s/0", store=store))
        await recorder.open()
        with record("e", "b", settings="s", repetition=0, parameters={"p": 4}, store=store):
            await recorder.write([report()])
            await recorder.write([report(0.001)])
            await asyncio.sleep(0.05)
        with open_store(store) as opened:
            ended = opened.get("e/b/s/0").end  # experiment_end's moment
        # The pipeline's last reports from just before the block's end reach the recorder
        # after it: they widen the recorder's window, which must not shrink the stored one.
        await recorder.write([report(-0.01, ended)])
        await recorder.close()

    async def program_first() -> None:
        with record("e", "b", settings="s", repetition=1, parameters={"p": 8}, store=store):
            recorder = RunRecorder(RunRecorderConfig(name="run_store", run="e/b/s/1", store=store))
            await recorder.open()
            await recorder.write([report()])
            with record("e", "b", settings="s", repetition=1, store=store) as again:
                again.mark("epoch_begin", 0)  # a second block, with no parameters
            await recorder.write([report(0.001)])
            await recorder.close()

    asyncio.run(service_first())
    asyncio.run(program_first())
    with open_store(store) as opened:
        first, second = opened.get("e/b/s/0"), opened.get("e/b/s/1")
    assert first.parameters == {"p": 4.0}
    assert second.parameters == {"p": 8.0}
    for run in (first, second):
        assert run.system["node"] == platform.node()  # recorded live, on this machine
        names = [event.event for event in run.events]
        assert names[0] == "experiment_begin"
        assert names[-1] == "experiment_end", "the window still holds the block's end"


def test_the_mongodb_store_merges_what_its_writers_give(
    mongodb_server: ServerProcess,
) -> None:
    store = mongodb_uri(mongodb_server) + "merging"
    run = Run(id="e/b/s/0", experiment="e", benchmark="b", settings="s", repetition=0,
              parameters={"p": 4.0}, system={"node": "n", "platform": "$HOME"},
              start=at(1), end=at(2))  # fmt: skip
    with open_store(store) as opened:
        opened.save_run(run)
        update = {"parameters": {"q": 1.0}, "system": {"node": None, "machine": "x"},
                  "start": at(1.5), "end": at(3)}  # fmt: skip
        stale = run.model_copy(update=update)
        opened.save_run(stale, widen=True)
        merged = opened.get(run.id)
        assert merged.parameters == {"p": 4.0, "q": 1.0}
        assert merged.system == {"node": "n", "platform": "$HOME", "machine": "x"}
        assert (merged.start, merged.end) == (at(1), at(3))
        opened.save_run(stale)  # not widening: the window given
        assert (opened.get(run.id).start, opened.get(run.id).end) == (at(1.5), at(3))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["runs", "show", "no-such-run"], "experiment/benchmark/settings/repetition"),
        (
            [
                "runs",
                "import",
                "/nowhere.jsonl",
                "--experiment",
                "e",
                "--benchmark",
                "b",
                "--settings",
                "s",
                "--repetition",
                "0",
            ],
            "no such file",
        ),
        (
            [
                "runs",
                "import",
                "x.jsonl",
                "--experiment",
                "e/x",
                "--benchmark",
                "b",
                "--settings",
                "s",
                "--repetition",
                "0",
            ],
            "without '/'",
        ),
        (["export", "gpu-dir", "--out", "x"], "no run matches"),
    ],
)
def test_bad_runs_and_stores_are_one_line_and_exit_2(
    tmp_path: Path, arguments: list[str], message: str
) -> None:
    (tmp_path / "x.jsonl").write_text("")
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    open_store(store).close()  # an empty store: the messages are about the runs asked for
    done = wattflow(*arguments, "--store", store, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_store_from_before_processing_times_opens_and_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.executescript(
            """
            CREATE TABLE runs (
                id TEXT PRIMARY KEY, experiment TEXT, benchmark TEXT, settings TEXT,
                repetition INTEGER, parameters TEXT, system TEXT, start INTEGER, end INTEGER);
            CREATE TABLE reports (seq INTEGER PRIMARY KEY, run TEXT, ts INTEGER, kind TEXT,
                body BLOB);
            INSERT INTO runs VALUES ('e/b/s/0', 'e', 'b', 's', 0, '{}', '{}', 0, 10000);
            INSERT INTO reports (run, ts, kind, body) VALUES ('e/b/s/0', 5000, 'PowerReport',
                '{"timestamp": 5000, "sensor": "n", "target": "a", "power": 7.5}');
            """
        )
    old.close()
    with open_store(f"sqlite:///{path}") as store:
        run = store.get("e/b/s/0")
        [(report, processed)] = list(store.timed_reports(run))
        store.add_reports(run.id, [report], processed=at(1))
        timed = [moment for _, moment in store.timed_reports(run)]
    assert isinstance(report, PowerReport)
    assert report.power == 7.5
    assert processed is None
    assert timed == [None, at(1).timestamp()]


def test_a_run_without_events_exports_its_window_as_the_experiment(tmp_path: Path) -> None:
    """The directory's loader needs the experiment's begin and end: a run recorded without
    them (a replayed file, say) gets its window's edges, in its own timestamp form."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    reports = [r for r in recording(3) if not isinstance(r, EventReport)]
    import_run(store, write_jsonl(tmp_path / "run.jsonl", reports))
    done = wattflow("export", "gpu-dir", "--store", store, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    repetition = tmp_path / "out" / "clock-limit" / "bert" / "877MHz,1065MHz" / "0"
    events = pd.read_csv(repetition / "timestamps.csv")
    assert list(events["event"]) == ["experiment_begin", "experiment_end"]
    stamps = [datetime.fromisoformat(stamp) for stamp in events["timestamp"]]
    window = (min(r.timestamp for r in reports), max(r.timestamp for r in reports))
    assert stamps == [moment.astimezone().replace(tzinfo=None) for moment in window]


def test_powerapi_recording_documents_import_as_the_jsonl_input_reads_them(
    tmp_path: Path,
) -> None:
    """PowerAPI's file-input recordings are one {"reports": [...]} document, not JSON Lines."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    done = wattflow(
        "runs", "import", str(FIXTURES / "hwpc.json"), "--store", store, "--experiment", "e",
        "--benchmark", "b", "--settings", "s", "--repetition", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = orjson.loads((FIXTURES / "hwpc.json").read_bytes())["reports"]
    with open_store(store) as opened:
        [run] = opened.runs()
        stored = list(opened.reports(run))
    assert len(stored) == len(expected) == 10
    assert all(isinstance(report, HWPCReport) for report in stored)
    assert [r.timestamp for r in stored] == sorted(
        datetime.fromisoformat(e["timestamp"]).replace(tzinfo=UTC) for e in expected
    )
    assert {r.target for r in stored} == {e["target"] for e in expected}


def test_a_mistyped_store_is_an_error_not_a_new_empty_store(tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    for command in (("runs", "list"), ("export", "extrap-text", "--out", str(tmp_path / "o"))):
        done = wattflow(*command, "--store", f"sqlite:///{missing}")
        assert done.returncode == 2
        assert f"no run store at {missing}" in done.stderr
    assert not missing.exists()
    other = wattflow("runs", "list", "--store", "foo:///x", cwd=tmp_path)
    assert other.returncode == 2
    assert "give sqlite:///PATH, a path, or mongodb://HOST/DB, not foo://" in other.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_export_option_says_what_it_does() -> None:
    helped = wattflow("export", "--help")
    assert helped.returncode == 0, helped.stderr
    text = " ".join(helped.stdout.split())
    for option in ("--store STORE sqlite:///path", "--experiment EXPERIMENT only",
                   "--benchmark BENCHMARK only", "--run E/B/S/N only",
                   "--out OUT where to write: a directory for gpu-dir"):  # fmt: skip
        assert option in text, option


def test_a_failed_import_leaves_no_store_behind(tmp_path: Path) -> None:
    """``runs import`` creates the store, so it is the typo guard's weak spot: arguments and
    files are checked before the store is opened, and a store it created but could not fill is
    removed, so ``runs list`` then says there is no store rather than list none."""
    source = write_jsonl(tmp_path / "power.jsonl", recording(1))
    (tmp_path / "bad.jsonl").write_text("not json\n")
    typo = tmp_path / "typo.db"
    run = ["--store", f"sqlite:///{typo}", "--experiment", "e", "--benchmark", "b",
           "--repetition", "0"]  # fmt: skip
    for arguments, message in (
        ([str(source)], "give --settings"),
        ([str(tmp_path / "missing.jsonl"), "--settings", "s"], "missing.jsonl: no such file"),
        ([str(source), "--settings", "s", "--model", "Nope"], "unknown report model 'Nope'"),
        ([str(tmp_path / "bad.jsonl"), "--settings", "s"], "bad.jsonl:1: not valid JSON"),
    ):
        done = wattflow("runs", "import", *arguments, *run)
        assert done.returncode == 2, done.stdout
        assert message in done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "power.jsonl"]
    listed = wattflow("runs", "list", "--store", f"sqlite:///{typo}")
    assert listed.returncode == 2
    assert f"no run store at {typo}" in listed.stderr
    # A store that holds runs stays when an import into it fails.
    assert wattflow("runs", "import", str(source), "--settings", "s", *run).returncode == 0
    bad = wattflow("runs", "import", str(tmp_path / "bad.jsonl"), "--settings", "t", *run)
    assert bad.returncode == 2
    with open_store(f"sqlite:///{typo}", create=False) as opened:
        assert [r.id for r in opened.runs()] == ["e/b/s/0"]


def test_what_the_runs_commands_print_is_built_from_data_alone() -> None:
    """The rows and lines of ``runs list``, ``energy``, ``show`` and ``import``, from a run
    and its counts: no store, no terminal."""
    run = Run(id="e/b/250W/0", experiment="e", benchmark="b", settings="250W", repetition=0,
              parameters={"p": 4.0, "batch": 0.5}, system={"node": "n"}, start=at(0), end=at(12),
              events=[EventReport(timestamp=at(1), sensor="n", target="all", event="epoch_begin",
                                  data=3)],
              exports={"ross": "written", "gpu-dir": "failed: disk full"})  # fmt: skip
    assert run_row(run, 42) == (
        "e/b/250W/0", "p=4, batch=0.5", "2026-06-01 08:00:00", "12.0", "42",
        "gpu-dir (failed: disk full), ross",
    )  # fmt: skip
    ended = TargetEnergyReport(timestamp=at(5), sensor="n", target="slurm/7", start=at(1),
                               end=at(3.5), energy={"cpu": 10.0, "gpu": 2.25}, reason="gone",
                               metadata={"target_kind": "slurm"})  # fmt: skip
    assert energy_row(ended) == (
        "n", "slurm/7", "slurm", "2026-06-01 08:00:01.000", "2026-06-01 08:00:03.500", "2.500",
        "10.000", "0.000", "2.250", "12.250", "gone",
    )  # fmt: skip
    assert len(ENERGY_HEADER) == len(energy_row(ended))
    assert show_lines(run, {"PowerReport": 5, "EventReport": 1}) == [
        "[bold]e/b/250W/0[/bold]",
        "window: 2026-06-01T08:00:00+00:00 – 2026-06-01T08:00:12+00:00 (12.0 s)",
        "parameters: {'p': 4.0, 'batch': 0.5}",
        "reports: 1 EventReport, 5 PowerReport",
        "  2026-06-01T08:00:01+00:00  epoch_begin  3",
        'system: {"node":"n"}',
        "export gpu-dir: failed: disk full",
        "export ross: written",
    ]
    assert show_lines(run.model_copy(update={"events": [], "exports": {}}), {})[3] == (
        "reports: none"
    )
    assert import_lines(run, 10, 10) == [
        "imported 10 reports into e/b/250W/0 "
        "(2026-06-01 08:00:00+00:00 – 2026-06-01 08:00:12+00:00)"
    ]
    assert import_lines(run, 10, 30)[1].startswith(
        "e/b/250W/0 already held reports; it now holds 30"
    )


def test_run_is_the_runs_output_by_another_name(tmp_path: Path) -> None:
    """``--run`` and its flags stand for the registered ``runs`` output: the same settings, so
    the same recorder, whichever way it is given."""
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    given = ["--run", "e/b/s/0", "--store", store, "--export", "ross", "--export-dir", "x"]
    by_flag = load_run_config(["--input", "jsonl", "--files", "a.jsonl", *given], environ={})
    by_output = load_run_config(
        ["--input", "jsonl", "--files", "a.jsonl", "--output", "runs", "--name", "run_store",
         *given],
        environ={},
    )  # fmt: skip
    assert list(by_flag.outputs) == ["run_store"]
    assert by_flag.outputs == by_output.outputs
    assert isinstance(pushers.get("runs")(by_flag.outputs["run_store"]), RunRecorder)


@pytest.mark.parametrize("kind", ["sqlite", "mongodb"])
def test_a_run_made_and_marked_through_the_store_reads_back_whichever_the_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """What the recorder, ``record()`` and ``runs mark`` share (``find``, ``new_run``,
    ``mark``) behaves the same on both stores behind the interface."""
    if kind == "sqlite":
        uri = f"sqlite:///{tmp_path / 'runs.db'}"
    else:
        uri = mongodb_uri(request.getfixturevalue("mongodb_server")) + "marking"
    with open_store(uri) as store:
        assert store.find("e/b/s/0") is None
        run = new_run("e/b/s/0", {"p": 4.0})
        store.save_run(run)
        run = mark(store, run, "epoch_begin", "3")
        run = mark(store, run, "epoch_end", 3.0)
        found = store.find("e/b/s/0")
        assert found is not None
        assert found.parameters == {"p": 4.0}
        assert found.system["node"] == platform.node()
        assert [(e.event, e.data) for e in found.events] == [("epoch_begin", 3), ("epoch_end", 3)]
        assert to_millis(found.end) == to_millis(run.end) >= to_millis(found.events[-1].timestamp)
        # What the recorder polls for an end marked by another process: events since a time.
        since = found.events[-1].timestamp
        stamped = [e for e in found.events if to_millis(e.timestamp) >= to_millis(since)]
        assert store.events_since(run.id, since) == stamped
        assert stamped[-1].event == "epoch_end"
        assert store.events_since(run.id, since + timedelta(milliseconds=1)) == []
    with pytest.raises(StoreError, match="give a non-empty name"):
        new_run("e//s/0")
