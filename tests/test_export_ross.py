"""The ``ross`` exporter, read back with a reader written from ROSS's "Data Sample Format" page.

The reader below builds its struct strings from the spec's field lists (C ``int`` → ``i``,
``unsigned int`` → ``I``, ``float`` → ``f``, ``double`` → ``d``), not from the writer's module,
so a field written in the wrong place or with the wrong width shows up as a wrong value here.
Expected values are computed from the generated reports by brute force, not by the writer's
streaming code.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.ross import RossExporter
from wattflow.actors.run_store import open_store
from wattflow.formats import ross
from wattflow.formats.reports import (
    EventName,
    EventReport,
    MeterReport,
    PowerReport,
    Report,
    to_micros,
)
from wattflow.formats.runs import ReportLists, Run, summarise
from wattflow.service.runs_cli import export_command

START = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)

# The spec's structs, field by field: (name, C type).
C_TYPES = {"int": "i", "unsigned int": "I", "float": "f", "double": "d"}
METADATA_FIELDS = [
    ("sample_type", "int"),
    ("sample_size", "int"),
    ("virtual_time", "double"),
    ("real_time", "double"),
]
MODEL_METADATA_FIELDS = [
    ("pe_id", "unsigned int"),
    ("kp_id", "unsigned int"),
    ("lp_id", "unsigned int"),
    ("gvt", "float"),
    ("stats_type", "int"),
    ("model_size", "int"),
]
EVENT_FIELDS = [
    ("source_lp", "unsigned int"),
    ("destination_lp", "unsigned int"),
    ("virtual_send_time", "float"),
    ("virtual_recv_time", "float"),
    ("real_time", "float"),
    ("model_data_size", "unsigned int"),
]
PE_COUNTERS = [
    "pe_id", "events_processed", "events_aborted", "events_rolled_back", "total_rollbacks",
    "secondary_rollbacks", "fossil_collect_attempts", "priority_queue_size", "network_sends",
    "network_receives", "num_GVTs", "pe_event_ties", "all_reduce_count",
]  # fmt: skip
PE_TIMES = [
    "efficiency", "network_read_time", "network_other_time", "GVT_time", "fossil_collect_time",
    "events_aborted_time", "events_processed_time", "priority_queue_time", "rollback_time",
    "cancel_q_time", "avl_tree_time", "buddy_time", "lz4_time",
]  # fmt: skip
PE_FIELDS = [(n, "unsigned int") for n in PE_COUNTERS] + [(n, "float") for n in PE_TIMES]
KP_COUNTERS = [
    "pe_id", "kp_id", "events_processed", "events_aborted", "events_rolled_back",
    "total_rollbacks", "secondary_rollbacks", "network_sends", "network_receives",
]  # fmt: skip
KP_FIELDS = [(n, "unsigned int") for n in KP_COUNTERS] + [
    ("time_ahead_gvt", "float"),
    ("efficiency", "float"),
]
LP_COUNTERS = [
    "pe_id", "kp_id", "lp_id", "events_processed", "events_aborted", "events_rolled_back",
    "network_sends", "network_receives",
]  # fmt: skip
LP_FIELDS = [(n, "unsigned int") for n in LP_COUNTERS] + [("efficiency", "float")]
# wattflow's model data, from the layout table in formats/ross.py's docstring.
MODEL_DATA_FIELDS = [
    ("power_w", "double"),
    ("energy_j", "double"),
    ("scope", "unsigned int"),
    ("reports", "unsigned int"),
]
EVENT_DATA_FIELDS = [("power_w", "double")]


def layout(fields: list[tuple[str, str]]) -> struct.Struct:
    """Little-endian, no padding: what x86-64's natural alignment gives for these structs."""
    return struct.Struct("<" + "".join(C_TYPES[c] for _, c in fields))


SAMPLES = {0: ("pe", PE_FIELDS), 1: ("kp", KP_FIELDS), 2: ("lp", LP_FIELDS)}


def take(data: bytes, pos: int, fields: list[tuple[str, str]]) -> tuple[dict[str, Any], int]:
    shape = layout(fields)
    if pos + shape.size > len(data):
        raise ValueError(f"record at {pos} runs past the end ({len(data)} bytes)")
    values = shape.unpack_from(data, pos)
    return dict(zip((name for name, _ in fields), values, strict=True)), pos + shape.size


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every record of a sample stream, with ``kind``, metadata and its fields."""
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        head, pos = take(data, pos, METADATA_FIELDS)
        kind = head["sample_type"]
        if kind in SAMPLES:
            name, fields = SAMPLES[kind]
            assert head["sample_size"] == layout(fields).size
            body, pos = take(data, pos, fields)
            records.append({"kind": name, **head, **body})
        elif kind == 3:
            assert head["sample_size"] == layout(MODEL_METADATA_FIELDS).size
            meta, pos = take(data, pos, MODEL_METADATA_FIELDS)
            assert meta["model_size"] == layout(MODEL_DATA_FIELDS).size
            model, pos = take(data, pos, MODEL_DATA_FIELDS)
            records.append({"kind": "model", **head, **meta, **model})
        else:
            raise ValueError(f"unknown sample type {kind} at {pos - 24}")
    assert pos == len(data)
    return records


def read_events(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    events: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        event, pos = take(data, pos, EVENT_FIELDS)
        assert event["model_data_size"] == layout(EVENT_DATA_FIELDS).size
        model, pos = take(data, pos, EVENT_DATA_FIELDS)
        events.append({**event, **model})
    assert pos == len(data)
    return events


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


def power(t: float, target: str, scope: str, **labels: Any) -> PowerReport:
    # Powers are exact in binary so that float32 and double comparisons can be exact too.
    watts = {
        ("a", "cpu", 0): 10.0,
        ("a", "cpu", 1): 5.0 + 4 * t,
        ("a", "dram", 0): 2.0,
        ("b", "cpu", 0): 20.0,
        ("global", "cpu", 0): 40.0,
        ("gpu0", "gpu", None): 100.0 + 8 * t,
        ("x", "fpga", None): 3.0,
        ("y", "", None): 1.5,
    }[(target, scope, labels.get("socket"))]
    metadata = {"scope": scope, "formula": f"hash-{int(t)}", **labels} if scope else labels
    return PowerReport(timestamp=at(t), sensor="n", target=target, power=watts, metadata=metadata)


def event(t: float, name: EventName) -> EventReport:
    return EventReport(timestamp=at(t), sensor="n", target="all", event=name)


def main_reports() -> list[Report]:
    """3.5 s: ticks every 0.25 s, LPs that appear late, unknown and missing scopes."""
    reports: list[Report] = [event(0.0, "experiment_begin"), event(0.0, "train_begin")]
    for tick in range(15):
        t = tick * 0.25
        if tick % 2 == 0:
            reports.append(
                MeterReport(timestamp=at(t), sensor="n", target="all", channels={"d0c0": 1.0})
            )
        reports += [
            power(t, "a", "cpu", socket=0),
            power(t, "a", "cpu", socket=1),
            power(t, "a", "dram", socket=0),
            power(t, "global", "cpu", socket=0),
            power(t, "gpu0", "gpu", device="0"),
        ]
        if tick >= 6:
            reports.append(power(t, "b", "cpu", socket=0))
        if tick >= 2 and tick % 2 == 0:
            reports.append(power(t, "x", "fpga"))
        if tick == 9:
            reports.append(power(t, "y", ""))
    reports += [event(3.0, "train_end"), event(3.5, "experiment_end")]
    return sorted(reports, key=lambda r: r.timestamp)  # the store's order: time, then insertion


def make_run(
    benchmark: str, seconds: float, *, settings: str = "250W", system: dict[str, Any] | None = None
) -> Run:
    return Run(
        id=f"exp/{benchmark}/{settings}/0",
        experiment="exp",
        benchmark=benchmark,
        settings=settings,
        repetition=0,
        system=system or {},
        start=START,
        end=at(seconds),
    )


def export(
    runs: list[Run], by_run: dict[str, list[Report]], out: Path, **options: Any
) -> list[int]:
    advanced: list[int] = []
    RossExporter(**options).export(
        runs, ReportLists(lambda run: by_run[run.id]), out, advanced.append
    )
    return advanced


def vt_of(report: Report) -> float:
    return (report.timestamp - START).total_seconds()


def expected_lp(
    reports: list[Report], scope: str, target: str, t: float
) -> tuple[float, float, int]:
    """(power, energy, reports) of one LP at sample time ``t``, from the definition.

    Energy adds up in the order the reports are read, each report's power over the
    microseconds since its series' previous one, as the module says: the very bytes the
    writer must produce, whatever shortcuts it takes."""
    latest: dict[tuple[str, str], PowerReport] = {}
    joules = 0.0
    count = 0
    for r in reports:
        if (
            isinstance(r, PowerReport)
            and r.target == target
            and str(r.metadata.get("scope", "")) == scope
            and vt_of(r) <= t
        ):
            key = (str(r.metadata.get("socket", "")), str(r.metadata.get("device", "")))
            earlier = latest.get(key)
            if earlier is not None:
                joules += r.power * ((to_micros(r.timestamp) - to_micros(earlier.timestamp)) / 1e6)
            latest[key] = r
            count += 1
    return sum(r.power for r in latest.values()), joules, count


def test_struct_sizes_match_the_spec_and_the_writer() -> None:
    sizes = {
        "metadata": (METADATA_FIELDS, ross.METADATA, 24),
        "pe": (PE_FIELDS, ross.PE_SAMPLE, 104),
        "kp": (KP_FIELDS, ross.KP_SAMPLE, 44),
        "lp": (LP_FIELDS, ross.LP_SAMPLE, 36),
        "model metadata": (MODEL_METADATA_FIELDS, ross.MODEL_METADATA, 24),
        "event": (EVENT_FIELDS, ross.EVENT, 24),
        "model data": (MODEL_DATA_FIELDS, ross.MODEL_DATA, 24),
    }
    for name, (fields, written, size) in sizes.items():
        native = "@" + "".join(C_TYPES[c] for _, c in fields)
        assert layout(fields).size == size, name
        assert written.size == size, name
        # Natural alignment pads none of these structs, so '<' is the native layout.
        assert struct.calcsize(native) == size, name


def test_every_record_of_a_run_reads_back_as_generated(tmp_path: Path) -> None:
    reports = main_reports()
    run = make_run("bench", 3.5)
    advanced = export([run], {run.id: reports}, tmp_path)
    assert sum(advanced) == len(reports)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "exp-bench-250W-0-evtrace.bin",
        "exp-bench-250W-0.bin",
        "exp-bench-250W-0.json",
    ]
    records = read_samples(tmp_path / "exp-bench-250W-0.bin")
    description = orjson.loads((tmp_path / "exp-bench-250W-0.json").read_bytes())
    lps = {(lp["scope"], lp["target"]): lp for lp in description["lps"]}
    # LP ids in order of first PowerReport; KP ids are the fixed scope codes, then new ones.
    assert [(lp["id"], lp["kp"], lp["scope"], lp["target"]) for lp in description["lps"]] == [
        (0, 0, "cpu", "a"),
        (1, 1, "dram", "a"),
        (2, 0, "cpu", "global"),
        (3, 2, "gpu", "gpu0"),
        (4, 4, "fpga", "x"),
        (5, 0, "cpu", "b"),
        (6, 5, "", "y"),
    ]
    assert description["kps"] == [
        {"id": 0, "scope": "cpu"},
        {"id": 1, "scope": "dram"},
        {"id": 2, "scope": "gpu"},
        {"id": 4, "scope": "fpga"},
        {"id": 5, "scope": ""},
    ]
    points = [1.0, 2.0, 3.0, 3.5]
    kinds = [r["kind"] for r in records]
    assert kinds.count("pe") == len(points) == description["samples"]
    by_sample: dict[float, list[dict[str, Any]]] = {}
    for record in records:
        by_sample.setdefault(record["virtual_time"], []).append(record)
    assert list(by_sample) == points
    powers = [r for r in reports if isinstance(r, PowerReport)]
    for number, t in enumerate(points, start=1):
        read = [r for r in reports if vt_of(r) <= t]
        seen = [r for r in powers if vt_of(r) <= t]
        seen_lps = [lp for lp in description["lps"] if any(
            r.target == lp["target"] and str(r.metadata.get("scope", "")) == lp["scope"]
            for r in seen
        )]  # fmt: skip
        seen_kps = sorted({lp["kp"] for lp in seen_lps})
        sample = by_sample[t]
        # One PE, then the KPs and LPs seen so far by id, then one model record per LP.
        assert [r["kind"] for r in sample] == (
            ["pe"] + ["kp"] * len(seen_kps) + ["lp"] * len(seen_lps) + ["model"] * len(seen_lps)
        )
        assert all(r["real_time"] == max(vt_of(x) for x in read) for r in sample)
        pe = sample[0]
        assert pe["pe_id"] == 0
        assert pe["events_processed"] == pe["network_receives"] == len(read)
        assert pe["network_sends"] == len(seen)
        assert pe["num_GVTs"] == number
        assert pe["events_aborted"] == pe["events_rolled_back"] == 0
        assert pe["efficiency"] == 100.0
        assert all(pe[name] == 0.0 for name in PE_TIMES[1:])
        kp_records = [r for r in sample if r["kind"] == "kp"]
        assert [r["kp_id"] for r in kp_records] == seen_kps
        for record in kp_records:
            count = sum(
                1 for r in seen if lps[(str(r.metadata.get("scope", "")), r.target)]["kp"]
                == record["kp_id"]
            )  # fmt: skip
            assert record["pe_id"] == 0
            assert record["events_processed"] == record["network_sends"] == count
            assert record["network_receives"] == count
            assert (record["time_ahead_gvt"], record["efficiency"]) == (0.0, 100.0)
        lp_records = [r for r in sample if r["kind"] == "lp"]
        models = [r for r in sample if r["kind"] == "model"]
        assert [r["lp_id"] for r in lp_records] == [lp["id"] for lp in seen_lps]
        assert [r["lp_id"] for r in models] == [lp["id"] for lp in seen_lps]
        for lp, record, model in zip(seen_lps, lp_records, models, strict=True):
            watts, joules, count = expected_lp(reports, lp["scope"], lp["target"], t)
            assert (record["pe_id"], record["kp_id"]) == (0, lp["kp"])
            assert record["events_processed"] == record["network_sends"] == count
            assert record["efficiency"] == 100.0
            assert (model["pe_id"], model["kp_id"], model["lp_id"]) == (0, lp["kp"], lp["id"])
            assert (model["gvt"], model["stats_type"]) == (t, 3)
            assert model["scope"] == lp["kp"]
            assert model["reports"] == count
            assert model["power_w"] == watts
            assert model["energy_j"] == joules
    final = {(lp["scope"], lp["target"]): m for lp, m in zip(
        description["lps"], by_sample[3.5][-len(description["lps"]):], strict=True
    )}  # fmt: skip
    # Energy is the integral of power: constant 10 W over 3.5 s, a ramp 5 + 4t over the same.
    assert final[("cpu", "a")]["energy_j"] == pytest.approx(
        10.0 * 3.5 + sum((5.0 + 4 * 0.25 * k) * 0.25 for k in range(1, 15))
    )
    assert final[("cpu", "a")]["power_w"] == 10.0 + 5.0 + 4 * 3.5
    assert final[("cpu", "b")]["energy_j"] == pytest.approx(20.0 * (3.5 - 1.5))
    assert final[("", "y")]["energy_j"] == 0.0  # one report: nothing to integrate yet
    # The same energy as every other exporter's, for the targets summarise counts.
    summary = summarise(run, reports)
    for scope, target in (("cpu", "a"), ("dram", "a"), ("cpu", "b"), ("gpu", "gpu0")):
        assert final[(scope, target)]["energy_j"] == pytest.approx(
            summary.energy(target, scope), rel=1e-12
        )

    events = read_events(tmp_path / "exp-bench-250W-0-evtrace.bin")
    assert len(events) == len(powers) == description["power_reports"]
    for report, record in zip(powers, events, strict=True):
        lp = lps[(str(report.metadata.get("scope", "")), report.target)]["id"]
        assert (record["source_lp"], record["destination_lp"]) == (lp, lp)
        assert record["virtual_send_time"] == record["virtual_recv_time"] == vt_of(report)
        assert record["real_time"] == vt_of(report)
        assert record["power_w"] == report.power


def test_samples_cover_the_window_even_without_reports(tmp_path: Path) -> None:
    quiet = make_run("quiet", 2.5)
    late = make_run("late", 0.5)
    by_run: dict[str, list[Report]] = {
        quiet.id: [],
        late.id: [power(0.25, "a", "cpu", socket=0), power(0.5, "a", "cpu", socket=0)],
    }
    export([quiet, late], by_run, tmp_path, interval_s=0.75, events=False)
    assert not list(tmp_path.glob("*evtrace*"))
    records = read_samples(tmp_path / "exp-quiet-250W-0.bin")
    # No KP or LP yet: the PE alone, at 0.75, 1.5, 2.25 and the end.
    assert [(r["kind"], r["virtual_time"]) for r in records] == [
        ("pe", 0.75), ("pe", 1.5), ("pe", 2.25), ("pe", 2.5),
    ]  # fmt: skip
    assert all(r["events_processed"] == 0 and r["real_time"] == 0.0 for r in records)
    records = read_samples(tmp_path / "exp-late-250W-0.bin")
    assert [r["kind"] for r in records] == ["pe", "kp", "lp", "model"]
    assert records[-1]["virtual_time"] == 0.5
    assert (records[-1]["power_w"], records[-1]["energy_j"]) == (10.0, 2.5)
    description = orjson.loads((tmp_path / "exp-late-250W-0.json").read_bytes())
    assert description["files"] == {"samples": "exp-late-250W-0.bin", "events": None}


def test_power_and_energy_are_the_definition_to_the_last_bit(tmp_path: Path) -> None:
    """Times off the millisecond and powers with no exact binary form: the model records hold
    the very doubles the definition gives (summed in the order read), so any shortcut the
    writer takes must give the same bytes."""
    reports: list[Report] = []
    for tick in range(40):
        micros = tick * 83_337 + (tick * 7919) % 1000
        for target, socket in (("a", "0"), ("a", "1"), ("b", "0")):
            watts = 1.0 / 3.0 + tick * 0.1 + int(socket) / 7.0 + (target == "b") * math.pi
            reports.append(PowerReport(
                timestamp=START + timedelta(microseconds=micros), sensor="n", target=target,
                power=watts, metadata={"scope": "cpu", "socket": socket},
            ))  # fmt: skip
    run = make_run("exact", 3.5)
    export([run], {run.id: reports}, tmp_path)
    description = orjson.loads((tmp_path / "exp-exact-250W-0.json").read_bytes())
    targets = {lp["id"]: lp["target"] for lp in description["lps"]}
    models = [r for r in read_samples(tmp_path / "exp-exact-250W-0.bin") if r["kind"] == "model"]
    assert len(models) == 2 * 4  # two LPs at 1, 2, 3 and 3.5 s
    for model in models:
        watts, joules, count = expected_lp(reports, "cpu", targets[model["lp_id"]], model["gvt"])
        assert (model["power_w"], model["energy_j"], model["reports"]) == (watts, joules, count)
    assert any(m["energy_j"] != round(m["energy_j"], 6) for m in models)  # no exact binary


def test_the_ledger_fills_dropped_and_late_in_the_final_sample(tmp_path: Path) -> None:
    ledger = {"rejected_input": 2, "dead_in": 3, "dead_out": 1, "late": 4, "absorbed": 9}
    run = make_run("ledger", 2.0, system={"ledger": ledger})
    reports: list[Report] = [power(t / 4, "a", "dram", socket=0) for t in range(8)]
    export([run], {run.id: reports}, tmp_path)
    pes = [r for r in read_samples(tmp_path / "exp-ledger-250W-0.bin") if r["kind"] == "pe"]
    assert [(r["events_aborted"], r["events_rolled_back"]) for r in pes] == [(0, 0), (6, 4)]
    assert pes[0]["efficiency"] == 100.0
    assert pes[1]["efficiency"] == pytest.approx(100.0 * (1 - 4 / 8))
    description = orjson.loads((tmp_path / "exp-ledger-250W-0.json").read_bytes())
    assert description["ledger"] == ledger


def test_file_names_are_sanitised_and_never_collide(tmp_path: Path) -> None:
    first = make_run("b c", 1.0, settings="877MHz,1065MHz")
    second = make_run("b_c", 1.0, settings="877MHz_1065MHz")
    export([first, second], {first.id: [], second.id: []}, tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["exp-b_c-877MHz_1065MHz-0-2.json", "exp-b_c-877MHz_1065MHz-0.json"]
    runs = [orjson.loads((tmp_path / name).read_bytes())["run"] for name in names]
    assert runs == [second.id, first.id]


def test_a_window_of_years_is_refused_before_any_file(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    run = make_run("stretched", 3.5).model_copy(update={"start": START - timedelta(days=200)})
    with open_store(uri) as store:
        store.save_run(run)
        store.add_reports(run.id, main_reports())
    out = tmp_path / "out"
    with pytest.raises(ross.RossError, match="would take over 10,000,000 samples of 1 s"):
        export_command(["ross", "--store", uri, "--out", str(out)], Console(file=io.StringIO()))
    assert not out.exists()


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RossExporter(interval_s=0.0)
    with pytest.raises(ValueError, match="interval_s"):
        ross.RossWriter(make_run("x", 1.0), io.BytesIO(), interval_s=-1.0)


def test_export_command_writes_a_stored_run(tmp_path: Path) -> None:
    assert exporters.get("ross") is RossExporter
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    run = make_run("stored", 3.5)
    with open_store(uri) as store:
        store.save_run(run)
        store.add_reports(run.id, main_reports())
    out = tmp_path / "out"
    console = Console(file=io.StringIO(), width=120)
    assert export_command(["ross", "--store", uri, "--out", str(out)], console) == 0
    records = read_samples(out / "exp-stored-250W-0.bin")
    final = [r for r in records if r["kind"] == "model" and r["virtual_time"] == 3.5]
    assert len(final) == 7
    assert final[0]["energy_j"] == pytest.approx(
        10.0 * 3.5 + sum((5.0 + 4 * 0.25 * k) * 0.25 for k in range(1, 15))
    )
    events = read_events(out / "exp-stored-250W-0-evtrace.bin")
    assert len(events) == sum(isinstance(r, PowerReport) for r in main_reports())


def test_real_time_is_when_the_service_processed_each_report(tmp_path: Path) -> None:
    """A live recording keeps processing times; ROSS's real time shows the pipeline's lag."""
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    run = make_run("live", 3.5)
    reports = main_reports()
    lag = {t: 0.0625 + 0.125 * (k % 3) for k, t in enumerate(sorted({vt_of(r) for r in reports}))}
    with open_store(uri) as store:
        store.save_run(run)
        for t in lag:  # one batch per tick, as the recorder stores them
            batch = [r for r in reports if vt_of(r) == t]
            store.add_reports(run.id, batch, processed=at(t + lag[t]))
        stored = [moment for _, moment in store.timed_reports(run)]
    assert stored == [START.timestamp() + vt_of(r) + lag[vt_of(r)] for r in reports]
    out = tmp_path / "out"
    console = Console(file=io.StringIO(), width=120)
    assert export_command(["ross", "--store", uri, "--out", str(out)], console) == 0
    description = orjson.loads((out / "exp-live-250W-0.json").read_bytes())
    assert description["real_time"] == "processing"
    records = read_samples(out / "exp-live-250W-0.bin")
    assert records
    for record in records:
        read = [vt_of(r) for r in reports if vt_of(r) <= record["virtual_time"]]
        expected = max((t + lag[t] for t in read), default=0.0)
        assert record["real_time"] == pytest.approx(expected, abs=1e-6)
    events = read_events(out / "exp-live-250W-0-evtrace.bin")
    powers = [r for r in reports if isinstance(r, PowerReport)]
    assert len(events) == len(powers)
    for record, report in zip(events, powers, strict=True):
        t = vt_of(report)
        assert record["real_time"] == pytest.approx(t + lag[t], abs=1e-6)
        assert record["real_time"] > record["virtual_send_time"]


def test_imported_reports_fall_back_to_measurement_time(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    run = make_run("imported", 3.5)
    with open_store(uri) as store:
        store.save_run(run)
        store.add_reports(run.id, main_reports())
        assert {moment for _, moment in store.timed_reports(run)} == {None}
    out = tmp_path / "out"
    assert (
        export_command(["ross", "--store", uri, "--out", str(out)], Console(file=io.StringIO()))
        == 0
    )
    description = orjson.loads((out / "exp-imported-250W-0.json").read_bytes())
    assert description["real_time"] == "measurement"


def stream_once(reports: list[Report], reads: list[int]) -> Iterator[Report]:
    reads.append(1)
    yield from reports


def test_each_run_is_read_once_in_one_pass(tmp_path: Path) -> None:
    run = make_run("once", 3.5)
    reads: list[int] = []
    advanced: list[int] = []
    RossExporter().export(
        [run], ReportLists(lambda _: stream_once(main_reports(), reads)), tmp_path, advanced.append
    )
    assert reads == [1]
    assert sum(advanced) == len(main_reports())
    assert math.isfinite(read_samples(tmp_path / "exp-once-250W-0.bin")[-1]["energy_j"])
