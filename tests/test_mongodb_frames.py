"""hwpc-sensor's MongoDB documents into frames, the way the JSON inputs read their lines.

A batch of documents becomes frames only when they stand for exactly the reports the documents
decode to one by one, and for the reports the same sensor's JSON lines give; anything else is
decoded document by document, as before. The documents are what pymongo gives: each report is
stored as hwpc-sensor's MongoDB output stores it (a BSON date, double counters) and decoded back
from its BSON bytes, and the input itself is checked against a real MongoDB-wire server.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import bson
import pytest
from bson import Binary, Decimal128, Int64, MaxKey, ObjectId, Regex, Timestamp, json_util
from bson.codec_options import CodecOptions
from pymongo import MongoClient

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.actors.pullers.mongodb import MongoDBPuller, MongoDBPullerConfig, printable
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, expand
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.json_frames import (
    Layout,
    decode_document_reports,
    decode_hwpc_document_frames,
    decode_hwpc_frames,
)
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import REPORT_KINDS, HWPCReport, PowerReport, Report

from .conftest import run_async
from .servers import ServerProcess, mongodb_uri
from .test_mongodb import hwpc_sensor_document

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

Document = dict[str, Any]
CODEC: CodecOptions[Document] = CodecOptions(tz_aware=True)
"""How the MongoDB input's client decodes documents."""


def stream(tmp_path: Path, **shape: Any) -> list[bytes]:
    """A generated hwpc-sensor stream, as the lines of its JSON Lines file."""
    path = tmp_path / "hwpc.jsonl"
    record(jsonl=path, **{"ticks": 12, "containers": 5, **shape})
    return path.read_bytes().splitlines()


def as_stored(document: Document) -> Document:
    """A document as the input gets it back from the server: through BSON, with an ``_id``."""
    return bson.decode(bson.encode({"_id": ObjectId(), **document}), CODEC)


def documents_of(lines: list[bytes]) -> list[Document]:
    """The lines' reports as hwpc-sensor's MongoDB output stores them."""
    return [
        as_stored(hwpc_sensor_document(powerapi.decode_json(HWPCReport, line, "t", None)))  # type: ignore[arg-type]
        for line in lines
    ]


def one_by_one(documents: Sequence[Document]) -> list[Report]:
    reports, errors = decode_document_reports(HWPCReport, documents, "test")
    assert errors == []
    return reports


def by_sensor(reports: list[Report]) -> list[Report]:
    """Reports in each sensor's order, sensor after sensor in the order they first come."""
    first = {report.sensor: at for at, report in reversed(list(enumerate(reports)))}
    return sorted(reports, key=lambda report: first[report.sensor])


@pytest.mark.parametrize(
    "shape",
    [{}, {"sensors": ("node-1", "node-2", "node-3")}, {"multiplex": 0.3, "containers": 20}],
)
@pytest.mark.parametrize("batch_documents", [1, 7, 10_000])
def test_frames_stand_for_the_reports_the_documents_decode_to(
    tmp_path: Path, shape: dict[str, Any], batch_documents: int
) -> None:
    """Cut anywhere, batch after batch with what the input remembers of its sensors: the same
    reports, byte for byte, as document by document, and as the sensor's JSON lines."""
    lines = stream(tmp_path, **shape)
    documents = documents_of(lines)
    layouts: dict[str, Layout] = {}
    framed: list[Report] = []
    expected: list[Report] = []
    for start in range(0, len(documents), batch_documents):
        batch = documents[start : start + batch_documents]
        frames = decode_hwpc_document_frames(batch, layouts)
        assert frames is not None, f"a plain batch at document {start}"
        assert all(len(frame) == len(frame.reports()) for frame in frames)
        framed += [report for frame in frames for report in frame.reports()]
        expected += by_sensor(one_by_one(batch))
    assert encode_json_lines(framed) == encode_json_lines(expected)
    from_json = [r for f in decode_hwpc_frames(lines) or [] for r in f.reports()]
    everything = [r for f in decode_hwpc_document_frames(documents) or [] for r in f.reports()]
    assert encode_json_lines(everything) == encode_json_lines(from_json)


def test_double_counters_are_read_as_the_integers_the_sensor_counted(tmp_path: Path) -> None:
    """hwpc-sensor stores integer counters as doubles: both ways give them back as integers,
    and a counter with a fraction, which no frame holds, as it is."""
    [document] = documents_of(stream(tmp_path)[:1])
    counters = document["groups"]["rapl"]["0"]["0"]
    assert all(type(value) is float for value in counters.values())
    [report] = one_by_one([document])
    assert isinstance(report, HWPCReport)
    assert all(type(value) is int for value in report.groups["rapl"]["0"]["0"].values())
    frames = decode_hwpc_document_frames([document])
    assert frames is not None
    assert frames[0].reports() == [report]

    counters["time_enabled"] = 1.5
    counters["time_running"] = Int64(7)
    [report] = one_by_one([document])
    assert isinstance(report, HWPCReport)
    assert report.groups["rapl"]["0"]["0"]["time_enabled"] == 1.5
    assert type(report.groups["rapl"]["0"]["0"]["time_running"]) is int
    assert decode_hwpc_document_frames([document]) is None


def _first_cpu(document: Document) -> dict[str, Any]:
    group = next(iter(document["groups"].values()))
    socket = next(iter(group.values()))
    cpu: dict[str, Any] = next(iter(socket.values()))
    return cpu


def _changed(at: int, change: Callable[[Document], Any]) -> Callable[[list[Document]], None]:
    def apply(documents: list[Document]) -> None:
        change(documents[at])

    return apply


def _set_counter(value: Any) -> Callable[[list[Document]], None]:
    return _changed(3, lambda d: _first_cpu(d).update(time_enabled=value))


def _replace(at: int, by: int) -> Callable[[list[Document]], None]:
    def apply(documents: list[Document]) -> None:
        documents[at] = dict(documents[by])

    return apply


def _renumber(level: str, number: int) -> Callable[[list[Document]], None]:
    """The first group's first socket, or its first cpu, given another number."""

    def change(document: Document) -> None:
        sockets = next(iter(document["groups"].values()))
        keys = sockets if level == "socket" else next(iter(sockets.values()))
        keys[str(number)] = keys.pop(next(iter(keys)))

    return _changed(3, change)


CHANGES: dict[str, Callable[[list[Document]], None]] = {
    "a socket beyond its bound": _renumber("socket", 65_536),
    "a socket of 10**18": _renumber("socket", 10**18),
    "a cpu beyond its bound": _renumber("cpu", 1_048_576),
    "a cpu of 2**63": _renumber("cpu", 2**63),
    "metadata": _changed(3, lambda d: d.update(metadata={"k": 1})),
    "a counter with a fraction": _set_counter(1.5),
    "a double beyond 2**53": _set_counter(2.0**60),
    "a counter that is not a number": _set_counter(float("nan")),
    "a counter as text": _set_counter("12"),
    "a boolean counter": _set_counter(True),
    "a decimal counter": _set_counter(Decimal128("12")),
    "a missing event": _changed(3, lambda d: _first_cpu(d).popitem()),
    "an extra event": _changed(3, lambda d: _first_cpu(d).update(X=1.0)),
    "a timestamp as text": _changed(3, lambda d: d.update(timestamp=d["timestamp"].isoformat())),
    "a timestamp in milliseconds": _changed(
        3, lambda d: d.update(timestamp=int(d["timestamp"].timestamp() * 1000))
    ),
    "a timestamp going back": _changed(
        3, lambda d: d.update(timestamp=d["timestamp"] - timedelta(seconds=5))
    ),
    "a second report of a target in its tick": _replace(3, 2),
    "no groups": _changed(3, lambda d: d.pop("groups")),
    "groups that are not a table": _changed(3, lambda d: d.update(groups="rapl")),
    "an empty sensor name": _changed(3, lambda d: d.update(sensor="")),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_batch_with_a_document_the_frame_cannot_stand_for_is_left_to_the_documents(
    tmp_path: Path, change: Callable[[list[Document]], None]
) -> None:
    documents = documents_of(stream(tmp_path))
    change(documents)
    assert decode_hwpc_document_frames(documents) is None
    assert decode_hwpc_document_frames(documents[10:]) is not None, "the rest is plain"
    # Document by document, each is a report or a named error, as before frames existed.
    reports, errors = decode_document_reports(HWPCReport, documents, "test")
    assert len(reports) + len(errors) == len(documents)
    for error, document in errors:
        assert str(document["_id"]) in str(error)


@pytest.mark.parametrize(
    ("level", "number"),
    [("socket", 65_536), ("socket", 10**18), ("cpu", 1_048_576), ("cpu", 2**63)],
)
def test_a_document_with_a_socket_or_cpu_out_of_bounds_is_refused_alone(
    tmp_path: Path, level: str, number: int
) -> None:
    """Neither way takes it: the batch is decoded document by document, and that document
    alone is an error naming it and the key; the others are the reports they always were."""
    documents = documents_of(stream(tmp_path))
    expected = one_by_one(documents[:3] + documents[4:])
    _renumber(level, number)(documents)
    assert decode_hwpc_document_frames(documents) is None
    reports, errors = decode_document_reports(HWPCReport, documents, "test")
    assert reports == expected
    assert [document for _, document in errors] == [documents[3]]
    assert str(documents[3]["_id"]) in str(errors[0][0])
    assert f"{level} '{number}'" in str(errors[0][0])


def test_documents_of_other_kinds_are_decoded_one_by_one() -> None:
    stamp = datetime(2026, 1, 1, tzinfo=UTC)
    documents = [
        as_stored({"timestamp": stamp, "sensor": "s", "target": f"t{n}", "power": 2.0 * n})
        for n in range(3)
    ]
    documents.append(as_stored({"timestamp": stamp, "sensor": "s", "target": "x"}))
    reports, errors = decode_document_reports(PowerReport, documents, "mongodb test.power")
    assert [r.power for r in reports if isinstance(r, PowerReport)] == [0.0, 2.0, 4.0]
    [(error, document)] = errors
    assert document is documents[3]
    assert "power" in str(error)
    assert str(documents[3]["_id"]) in str(error)


# --- the input, against a real server ----------------------------------------------------------


BSON_VALUES: tuple[Any, ...] = (
    ObjectId("5f57a7649750d76f8a581efe"), Decimal128("1.5"), Decimal128("NaN"), Int64(2**63 - 1),
    Int64(-(2**63)), Regex("x"), Timestamp(1, 2), MaxKey(), Binary(b"\xff"), float("nan"),
    float("inf"), 1e308, 2.0**53 + 1, None, True, "", "x", [], {}, [1, {"a": 2}],
    {"$x": {"a.b": [None]}}, datetime(9999, 12, 31, 23, 59, 59, 999999), datetime(1, 1, 1),
    "9999-12-31T23:59:59.999-01:00", "0001-01-01T00:00:00+01:00", 2**63 - 1, -(2**63),
)  # fmt: skip
"""What BSON holds and a field may be, whatever it expects: BSON's own kinds, numbers at the
ends of their ranges, text, nesting, and dates at both ends of the calendar."""


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _mutated(document: Document, rng: random.Random) -> None:
    """One field of the document, or a value deep in its groups, made something else."""
    where = rng.randrange(4)
    if where == 0:
        key = rng.choice(["timestamp", "sensor", "target", "groups", "metadata", "power", "_id"])
        document[key] = rng.choice([*BSON_VALUES, _nested(rng.choice([10, 90]))])
    elif where == 1:
        document.pop(rng.choice(["timestamp", "sensor", "target", "groups", "power"]), None)
    elif where == 2:
        document["metadata"] = {"k": rng.choice(BSON_VALUES)}
    else:
        level: Any = document.get("groups")
        while isinstance(level, dict) and level:  # a group, a socket, a cpu or a counter
            key = rng.choice(list(level))
            if not isinstance(level[key], dict) or rng.random() < 0.25:
                level[key] = rng.choice(BSON_VALUES)
                break
            level = level[key]


def test_any_mutated_document_becomes_a_report_or_a_dead_letter_never_an_error(
    tmp_path: Path,
) -> None:
    """A sweep of 300 batches of stored documents (hwpc-sensor's and PowerReports), each with
    one to three values made any BSON value, stored and read back through BSON: decoded as
    every kind, as frames or one by one, nothing raises; each document is a report or a dead
    letter naming its ``_id``; and every report can be written as JSON and as BSON (an ObjectId
    or a Decimal128 in metadata passed before, and the JSON outputs failed on it)."""
    rng = random.Random(13)
    hwpc = documents_of(stream(tmp_path, ticks=3, containers=2, sensors=("node-1", "node-2")))
    power = [
        as_stored(powerapi.to_mongodb(PowerReport(timestamp=at, sensor="n", target="t", power=9.5)))
        for at in range(1, 6)
    ]
    refused = 0
    for _ in range(300):
        base = hwpc if rng.random() < 0.7 else power
        start = rng.randrange(len(base))
        batch = [bson.decode(bson.encode(document)) for document in base[start : start + 8]]
        for _ in range(rng.randint(1, 3)):
            _mutated(rng.choice(batch), rng)
        stored = [as_stored(document) for document in batch]
        for kind in REPORT_KINDS.values():
            frames = decode_hwpc_document_frames(stored, {}) if kind is HWPCReport else None
            if frames is not None:
                reports = [report for frame in frames for report in frame.reports()]
                errors: list[Any] = []
            else:
                reports, errors = decode_document_reports(kind, stored, "mongodb")
            assert len(reports) + len(errors) == len(stored)
            for error, document in errors:
                assert str(error).startswith(f"mongodb _id={document['_id']}: "), error
                assert json_util.loads(printable(document)).keys() == document.keys()
            for report in reports:
                assert powerapi.encode_json(report)
                assert bson.encode(powerapi.to_mongodb(report))
            refused += any("is not JSON data" in str(error) for error, _ in errors)
    assert refused >= 20, "the sweep puts BSON's own values in metadata"


class Recorder:
    """What the pipeline receives from an input: each batch as it was handed on."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.batches: list[Batch] = []
        self.rejected: list[tuple[Any, str]] = []

    async def emit(self, batch: Batch) -> None:
        self.batches.append(batch)

    def reject(self, payload: Any, reason: str) -> None:
        self.rejected.append((payload, reason))

    def skip(self, count: int) -> None:
        """Reports of other partitions' sensors: none here, since no partition is set."""
        raise AssertionError(f"{count} reports skipped without a partition")


def test_the_input_hands_on_frames_and_leaves_the_odd_batch_to_reports(
    tmp_path: Path, mongodb_server: ServerProcess
) -> None:
    """Batches of 7 documents: the one holding a document with a text timestamp (as another
    tool might write it) goes document by document; every other batch goes as frames. The
    reports are those of the sensor's JSON lines, in the order they were inserted."""
    lines = stream(tmp_path, sensors=("node-1", "node-2"))
    documents = documents_of(lines)
    odd = 30
    documents[odd]["timestamp"] = documents[odd]["timestamp"].isoformat()
    client: MongoClient[Document] = MongoClient(mongodb_uri(mongodb_server))
    try:
        client["powerapi"]["hwpc"].insert_many(documents)
    finally:
        client.close()
    config = MongoDBPullerConfig(
        uri=mongodb_uri(mongodb_server), db="powerapi", collection="hwpc", max_batch=7
    )
    recorder = Recorder()
    run_async(MongoDBPuller(config).pull(recorder))

    assert recorder.rejected == []
    framed = [batch for batch in recorder.batches if isinstance(batch[0], HWPCFrame)]
    reports = [batch for batch in recorder.batches if not isinstance(batch[0], Frame)]
    assert [len(batch) for batch in reports] == [7], "only the odd batch goes report by report"
    assert len(framed) >= len(documents) // 7
    got: list[Report] = [report for batch in recorder.batches for report in expand(batch)]
    expected = powerapi.decode_json_lines(HWPCReport, lines, "test", 1)[0]
    key: Callable[[Any], Any] = lambda r: (r.timestamp, r.sensor, r.target)  # noqa: E731
    assert encode_json_lines(sorted(got, key=key)) == encode_json_lines(sorted(expected, key=key))


def smartwatts_on(
    batches: Sequence[Batch],
) -> dict[str, list[dict[str, Any]]]:
    """SmartWatts' reports for one sensor's batches, each kind's in order (the order between
    kinds is each output's own)."""
    config = SmartWattsConfig(learn_min_samples_required=5)
    SmartWattsFormula.prepare(config)
    formula = SmartWattsFormula(config, "node-1")
    produced: dict[str, list[dict[str, Any]]] = {}
    for batch in [*batches, None]:
        out = Output()
        if batch is None:
            formula.flush(out)
        else:
            items: list[Any] = list(batch)  # a frame travels alone, as the runtime hands it on
            formula.process(items, out)
        for report in expand(out.items()):
            produced.setdefault(report.kind, []).append(report.model_dump())
    return produced


def test_the_framed_input_gives_the_power_reports_of_the_report_by_report_input(
    tmp_path: Path, mongodb_server: ServerProcess
) -> None:
    """The documents on a real server, read by the input (frames), and read back and decoded
    one by one as the input did before frames (PowerAPI's decoding: double counters kept):
    SmartWatts gives the same PowerReports and FormulaReports, number for number."""
    lines = stream(tmp_path, ticks=40, containers=6, multiplex=0.2)
    client: MongoClient[Document] = MongoClient(mongodb_uri(mongodb_server), tz_aware=True)
    try:
        client["powerapi"]["hwpc"].insert_many(documents_of(lines))
        stored = list(client["powerapi"]["hwpc"].find().sort("_id", 1))
    finally:
        client.close()
    config = MongoDBPullerConfig(
        uri=mongodb_uri(mongodb_server), db="powerapi", collection="hwpc", max_batch=50
    )
    recorder = Recorder()
    run_async(MongoDBPuller(config).pull(recorder))
    assert recorder.rejected == []
    assert all(isinstance(batch[0], HWPCFrame) for batch in recorder.batches)

    one_at_a_time = [powerapi.from_mongodb(HWPCReport, d, "mongodb") for d in stored]
    assert any(
        type(value) is float
        for report in one_at_a_time
        if isinstance(report, HWPCReport)
        for value in report.groups["rapl"]["0"]["0"].values()
    ), "the reference keeps hwpc-sensor's doubles"
    reference = [one_at_a_time[start : start + 50] for start in range(0, len(stored), 50)]
    produced = smartwatts_on(recorder.batches)
    expected = smartwatts_on(reference)
    assert len(produced["PowerReport"]) > 200
    assert len(produced["FormulaReport"]) > 10
    assert produced == expected
