"""Hostile input: garbage mixed into good reports, on every input, changes nothing else.

hypothesis draws the garbage (JSON cut short, text that is not JSON, bytes that are not UTF-8,
fields of the wrong type, fields missing, lines longer than the input takes, CSV rows with cells
that are not numbers or too few of them, BSON documents that are not reports) and where it goes
between the lines, documents, messages or rows of a small hwpc-sensor recording (or of a
wattmeter log). Each input then runs as a user runs it, and must:

- exit as a clean run does (the service does not crash on what it is given);
- write the same PowerReports and FormulaReports as the clean JSON Lines run (the meter: as the
  clean meter run), within the tolerance :mod:`tests.test_inputs_agree` allows between inputs;
- account for every bad item: one dead letter from the input each, with a reason, and as many
  ``rejected_input`` in the ledger.

Good lines also come with fields nobody knows: those must not change anything. Each input runs
a few examples only (the service starts for each one); each example carries up to 20 bad items.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import urllib3
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pymongo import MongoClient

from wattflow.formats import powerapi
from wattflow.formats.reports import HWPCReport

from ..conftest import Service, drained_ledger, wait_until, wattflow
from ..servers import ServerProcess, free_port, mongodb_uri
from ..test_inputs_agree import (
    Document,
    Outcome,
    by_model,
    differences,
    outputs,
    read_jsonl,
)
from ..test_mongodb import hwpc_sensor_document
from ..test_node import gpu, meter_csv, rapl, write_jsonl

# The benchmarks' stream generator, imported as tests/test_inputs_agree.py imports it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from generate_hwpc import record

EXAMPLES = int(os.environ.get("DRILL_EXAMPLES", "2"))
"""Runs per input: each starts the service, so two keep the drills quick in CI; set the
variable higher to search longer."""
DRILL = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    # No shrinking: each try is a run of the service, and the example that failed is printed.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAX_LINE_BYTES = 8192
"""The line bound given to the inputs that have one: a good line of the recording is below
3,000 bytes, so an oversized line of garbage costs little to send."""
WAIT_S = 60.0
SENSOR = "node-1"

# --- garbage -----------------------------------------------------------------------------------

READABLE = st.characters(
    blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Zs"), blacklist_characters="\n\r"
)
"""Characters a line of text can hold and that no reader takes for a line end or for blank."""


def not_a_report(text: str) -> bool:
    """Whether text is no JSON object (those are drawn on purpose, field by field)."""
    try:
        return not isinstance(json.loads(text), dict)
    except ValueError:
        return True


WRONG_VALUES: dict[str, list[Any]] = {
    "timestamp": [[1], {"at": 1}, None, "not a date", "", 1e30],
    "sensor": [7, [SENSOR], None, ""],
    "target": [3.5, {"name": "x"}, None, ""],
    "groups": ["rapl", [1, 2], 42],
}
"""For each field of hwpc-sensor's report, values no report can have."""
BAD_COUNTERS: list[Any] = ["lots", None, [1], {"v": 1}]


def wrong_field(document: Document, field: str, value: Any) -> Document:
    return {**document, field: value}


def bad_counter(document: Document, value: Any) -> Document:
    """The document with its first counter replaced by ``value``."""
    changed = json.loads(json.dumps(document, default=str))
    for sockets in changed["groups"].values():
        for cpus in sockets.values():
            for events in cpus.values():
                events[next(iter(events))] = value
                return {**document, "groups": changed["groups"]}
    raise AssertionError("a report without counters")


def missing(document: Document, field: str) -> Document:
    return {key: value for key, value in document.items() if key != field}


def bad_documents(good: list[Document]) -> st.SearchStrategy[Document]:
    """Report-shaped documents that no report can come from."""
    document = st.sampled_from(good)
    wrong = st.tuples(document, st.sampled_from(sorted(WRONG_VALUES))).flatmap(
        lambda pair: st.sampled_from(WRONG_VALUES[pair[1]]).map(
            lambda value: wrong_field(pair[0], pair[1], value)
        )
    )
    return st.one_of(
        wrong,
        st.builds(bad_counter, document, st.sampled_from(BAD_COUNTERS)),
        st.builds(missing, document, st.sampled_from(["timestamp", "sensor", "target"])),
        st.fixed_dictionaries({"hello": st.text(READABLE, max_size=10)}),
    )


def bad_lines(good: list[bytes], *, oversized: bool = False) -> st.SearchStrategy[bytes]:
    """Lines (without their newline) that no report can come from."""
    documents = [json.loads(line) for line in good]
    kinds = [
        # a good line cut short: never valid JSON
        st.tuples(st.sampled_from(good), st.floats(0.0, 0.99)).map(
            lambda pair: pair[0].rstrip()[: max(1, int(len(pair[0].rstrip()) * pair[1]))]
        ),
        st.text(READABLE, min_size=1, max_size=60).filter(not_a_report).map(str.encode),
        # not UTF-8
        st.binary(max_size=40).map(
            lambda raw: b"\xff" + raw.replace(b"\n", b"").replace(b"\r", b"")
        ),
        bad_documents(documents).map(orjson.dumps),
    ]
    if oversized:
        kinds.append(
            st.integers(MAX_LINE_BYTES + 1, 2 * MAX_LINE_BYTES).map(lambda size: b"x" * size)
        )
    return st.one_of(kinds)


def with_unknown_fields(line: bytes) -> bytes:
    """A good line with fields no reader knows: it must give the same report."""
    return orjson.dumps({**json.loads(line), "firmware": "1.2", "extra": {"nested": [1, 2]}})


Placed = list[tuple[int, Any]]
"""Bad items and the index of the good item each goes before (the number of good items: after
the last)."""


def placed(good_count: int, bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Placed]:
    return st.lists(st.tuples(st.integers(0, good_count), bad), min_size=1, max_size=20)


def mix(good: list[Any], bad: Placed) -> list[Any]:
    """The good items in order, with each bad item before the good one it names."""
    before: dict[int, list[Any]] = {}
    for index, item in bad:
        before.setdefault(index, []).append(item)
    mixed: list[Any] = []
    for index, item in enumerate([*good, None]):
        mixed += before.get(index, [])
        if index < len(good):
            mixed.append(item)
    return mixed


# --- the recording and the clean runs -----------------------------------------------------------


class Recording:
    """A small hwpc-sensor recording: one node, two containers, 40 ticks, as JSON lines, as
    CSV files and as MongoDB documents."""

    def __init__(self, directory: Path) -> None:
        self.jsonl = directory / "hwpc.jsonl"
        record(
            ticks=40, containers=2, sensors=(SENSOR,), multiplex=0.2,
            jsonl=self.jsonl, csv_dir=directory,
        )  # fmt: skip
        self.lines = [line.rstrip(b"\n") for line in self.jsonl.read_bytes().splitlines()]
        self.csv = {
            name: (directory / f"{name}.csv").read_text().splitlines()
            for name in ("rapl", "msr", "core")
        }
        self.documents = [
            hwpc_sensor_document(powerapi.decode_json(HWPCReport, line, "recording", None))  # type: ignore[arg-type]
            for line in self.lines
        ]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    return Recording(tmp_path_factory.mktemp("recording"))


@pytest.fixture(scope="module")
def reference(recording: Recording, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """What the clean JSON Lines run writes."""
    directory = tmp_path_factory.mktemp("clean")
    done = wattflow("run", "--input", "jsonl", "--files", str(recording.jsonl), *outputs(directory))
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_jsonl(directory / "dead.jsonl") == []
    return Outcome(
        power=read_jsonl(directory / "power.jsonl"),
        formula=read_jsonl(directory / "formula.jsonl"),
        log=done.stderr,
    )


def test_the_clean_run_is_worth_comparing_with(reference: Outcome) -> None:
    """Learned models and every target: a run that garbage disturbed would show."""
    assert len(reference.power) >= 200
    assert len(reference.formula) >= 5
    assert {d["target"] for d in reference.power} >= {"rapl", "global"}


def fresh(factory: pytest.TempPathFactory) -> Path:
    return factory.mktemp("hostile")


def check(reference: Outcome, directory: Path, log: str, puller: str, bad: int) -> None:
    """The run wrote what the clean run wrote, and dead-lettered each bad item, from the
    input, with a reason."""
    dead = read_jsonl(directory / "dead.jsonl")
    assert len(dead) == bad, f"{len(dead)} dead letters for {bad} bad items: {dead[:5]}"
    assert {letter["actor"] for letter in dead} == {f"puller:{puller}"}, dead[:5]
    assert all(letter["reason"] for letter in dead)
    assert drained_ledger(log)["rejected_input"] == bad
    assert "Traceback" not in log, log[-3000:]
    found = Outcome(
        power=read_jsonl(directory / "power.jsonl"),
        formula=read_jsonl(directory / "formula.jsonl"),
        log=log,
    )
    expected_power, expected_formula = by_model(reference)
    found_power, found_formula = by_model(found)
    problems = differences("PowerReport", expected_power, found_power)
    problems += differences("FormulaReport", expected_formula, found_formula)
    assert not problems, "\n".join(problems[:20]) + f"\n--- log:\n{log[-2000:]}"
    assert len(found.power) == len(reference.power)


def reports_read(http_port: int, actor: str) -> int:
    """What the input has read so far, dead letters included (from ``/metrics``)."""
    try:
        page = urllib3.request("GET", f"http://127.0.0.1:{http_port}/metrics", timeout=2)
    except urllib3.exceptions.HTTPError:
        return 0
    pattern = rf'^wattflow_actor_reports_in_total{{actor="{re.escape(actor)}"}} (\S+)$'
    found = re.search(pattern, page.data.decode(), re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def stop_once_read(service: Service, http_port: int, actor: str, count: int) -> str:
    """Stop a live run once its input has read ``count`` items; return its log."""
    wait_until(
        lambda: service.alive() and reports_read(http_port, actor) >= count,
        WAIT_S,
        f"{count} items read by {actor}",
    )
    return service.stop(timeout_s=WAIT_S)


# --- the drills, one per input ------------------------------------------------------------------


@given(data=st.data())
@DRILL
def test_jsonl_file(
    data: st.DataObject,
    recording: Recording,
    reference: Outcome,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    bad = data.draw(placed(len(recording.lines), bad_lines(recording.lines)), "bad")
    decorated = data.draw(st.sets(st.sampled_from(range(len(recording.lines)))), "decorated")
    good = [
        with_unknown_fields(line) if index in decorated else line
        for index, line in enumerate(recording.lines)
    ]
    directory = fresh(tmp_path_factory)
    source = directory / "hostile.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in mix(good, bad)))
    done = wattflow("run", "--input", "jsonl", "--files", str(source), *outputs(directory))
    assert done.returncode == 0, done.stderr[-3000:]
    check(reference, directory, done.stderr, "puller_jsonl", len(bad))


@given(data=st.data())
@DRILL
def test_socket(
    data: st.DataObject,
    recording: Recording,
    reference: Outcome,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    bad = data.draw(placed(len(recording.lines), bad_lines(recording.lines, oversized=True)))
    directory = fresh(tmp_path_factory)
    http_port = free_port()
    with Service(
        directory / "service.log", "run", "--http-port", str(http_port),
        "--input", "socket", "--port", "0", "--max-line-bytes", str(MAX_LINE_BYTES),
        *outputs(directory),
    ) as service:  # fmt: skip
        service.wait_for_log("listening for hwpc-sensor on ")
        found = re.search(r"listening for hwpc-sensor on [^:\s]+:(\d+)", service.text())
        assert found, service.text()
        with socket.create_connection(("127.0.0.1", int(found.group(1))), timeout=WAIT_S) as peer:
            peer.sendall(b"".join(line + b"\n" for line in mix(recording.lines, bad)))
        log = stop_once_read(
            service, http_port, "puller:puller_socket", len(recording.lines) + len(bad)
        )
    check(reference, directory, log, "puller_socket", len(bad))


@given(data=st.data())
@DRILL
def test_zeromq(
    data: st.DataObject,
    recording: Recording,
    reference: Outcome,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each message one report or one bad line, as a sensor that sends report by report."""
    bad = data.draw(placed(len(recording.lines), bad_lines(recording.lines)))
    directory = fresh(tmp_path_factory)
    uri = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    messages = mix(recording.lines, bad)
    with Service(
        directory / "service.log", "run", "--http-port", str(http_port),
        "--input", "zeromq", "--uri", uri, "--socket-type", "PULL", "--bind",
        *outputs(directory),
    ) as service:  # fmt: skip
        context = zmq.Context()
        try:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)  # queue them all until the service takes them
            push.connect(uri)
            for message in messages:
                push.send(message)
            log = stop_once_read(service, http_port, "puller:puller_zeromq", len(messages))
        finally:
            context.destroy(linger=0)
    check(reference, directory, log, "puller_zeromq", len(bad))


@given(data=st.data())
@DRILL
def test_mongodb_documents(
    data: st.DataObject,
    recording: Recording,
    reference: Outcome,
    tmp_path_factory: pytest.TempPathFactory,
    mongodb_server: ServerProcess,
) -> None:
    bad = data.draw(placed(len(recording.documents), bad_documents(recording.documents)))
    directory = fresh(tmp_path_factory)
    collection = f"hwpc_{next(COLLECTIONS)}"
    client: MongoClient[Document] = MongoClient(
        mongodb_uri(mongodb_server), serverSelectionTimeoutMS=5000
    )
    try:
        # insert_many adds an ``_id`` to each document: insert copies, in order.
        documents = [dict(document) for document in mix(recording.documents, bad)]
        client["powerapi"][collection].insert_many(documents)
    finally:
        client.close()
    done = wattflow(
        "run", "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi",
        "-c", collection, *outputs(directory),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    check(reference, directory, done.stderr, "puller_mongodb", len(bad))


COLLECTIONS = itertools.count()


def bad_rows(rows: list[str]) -> st.SearchStrategy[str]:
    """CSV rows that no reading can come from: cells missing or added, a counter or the
    timestamp that is not a number."""
    row = st.sampled_from(rows).map(lambda text: text.split(","))
    return st.one_of(
        st.tuples(row, st.integers(1, 4)).map(lambda pair: ",".join(pair[0][: -pair[1]])),
        row.map(lambda cells: ",".join([*cells, "7"])),
        st.tuples(row, st.sampled_from(["lots", "", "1.2.3", "0x10", "--1"])).map(
            lambda pair: ",".join([*pair[0][:-1], pair[1]])
        ),
        st.tuples(row, st.sampled_from(["yesterday", "", "12:00"])).map(
            lambda pair: ",".join([pair[1], *pair[0][1:]])
        ),
    )


@given(data=st.data())
@DRILL
def test_csv_files(
    data: st.DataObject,
    recording: Recording,
    reference: Outcome,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = fresh(tmp_path_factory)
    files = []
    bad_count = 0
    for name, (header, *rows) in recording.csv.items():
        bad = data.draw(placed(len(rows), bad_rows(rows)), name)
        bad_count += len(bad)
        path = directory / f"{name}.csv"
        path.write_text("\n".join([header, *mix(rows, bad)]) + "\n")
        files.append(str(path))
    done = wattflow("run", "--input", "csv", "--files", ",".join(files), *outputs(directory))
    assert done.returncode == 0, done.stderr[-3000:]
    check(reference, directory, done.stderr, "puller_csv", bad_count)


# --- the meter ----------------------------------------------------------------------------------

METER_SECONDS = 8


def meter_outputs(directory: Path, meter: Path, hwpc: Path, nvml: Path) -> list[str]:
    return [
        "run", "--disable-smartwatts-formula",
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "jsonl", "--model", "GPUReport", "--files", str(nvml),
        "--input", "meter", "--files", str(meter), "--sensor", SENSOR,
        "--output", "jsonl", "--file", str(directory / "power.jsonl"),
        "--dead-letters", str(directory / "dead.jsonl"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def meter_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str], Outcome]:
    """The node's RAPL and GPU reports, the meter's clean log, and the clean run's output."""
    directory = tmp_path_factory.mktemp("meter")
    hwpc = write_jsonl(directory / "hwpc.jsonl", [rapl(s) for s in range(METER_SECONDS + 1)])
    nvml = write_jsonl(directory / "gpu.jsonl", [gpu(h) for h in range(2 * METER_SECONDS + 1)])
    meter = meter_csv(directory / "meter.csv", METER_SECONDS)
    done = wattflow(*meter_outputs(directory, meter, hwpc, nvml))
    assert done.returncode == 0, done.stderr[-3000:]
    power = read_jsonl(directory / "power.jsonl")
    assert sum(d["metadata"].get("scope") == "node" for d in power) >= 2 * METER_SECONDS
    clean = Outcome(power=power, formula=[], log=done.stderr)
    return hwpc, nvml, meter.read_text().splitlines(), clean


def bad_meter_lines(rows: list[str]) -> st.SearchStrategy[str]:
    """Meter lines that no reading can come from, as CSV rows and as JSON."""
    json_junk = st.one_of(
        st.just('{"timestamp": 1767603600000, "channels": {}}'),
        st.just('{"d0c0": 12.5}'),
        st.sampled_from(["x", None, [1], True]).map(
            lambda value: json.dumps({"timestamp": 1767603600000, "d0c0": value})
        ),
        st.sampled_from([[1], None, "never", 1e30]).map(
            lambda stamp: json.dumps({"timestamp": stamp, "d0c0": 1.0})
        ),
        st.text(READABLE, max_size=30).map(lambda text: "{" + text),
    )
    return st.one_of(bad_rows(rows), json_junk).filter(
        lambda line: line.strip() and not line.startswith("timestamp")
    )


@given(data=st.data())
@DRILL
def test_meter_file(
    data: st.DataObject,
    meter_run: tuple[Path, Path, list[str], Outcome],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    hwpc, nvml, (header, *rows), clean = meter_run
    bad = data.draw(placed(len(rows), bad_meter_lines(rows)))
    directory = fresh(tmp_path_factory)
    meter = directory / "meter.csv"
    meter.write_text("\n".join([header, *mix(rows, bad)]) + "\n")
    done = wattflow(*meter_outputs(directory, meter, hwpc, nvml))
    assert done.returncode == 0, done.stderr[-3000:]
    dead = read_jsonl(directory / "dead.jsonl")
    assert len(dead) == len(bad), dead[:5]
    assert {letter["actor"] for letter in dead} == {"puller:puller_meter"}
    assert drained_ledger(done.stderr)["rejected_input"] == len(bad)
    found = read_jsonl(directory / "power.jsonl")
    problems = differences("PowerReport", clean.power, found)
    assert not problems, "\n".join(problems[:20])
