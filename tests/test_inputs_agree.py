"""Every input gives the same power for the same recording.

One hwpc-sensor recording (two machines, three containers each, some readings multiplexed by
perf) goes through ``wattflow run`` as a user runs it, once per input: the JSON Lines file, the
CSV files, TCP connections as hwpc-sensor's socket output makes them, a MongoDB collection as
hwpc-sensor's MongoDB output fills it, and ZeroMQ messages. Each run writes its PowerReports
and FormulaReports to JSON Lines, with the same SmartWatts settings. Every run must exit 0,
dead-letter nothing, and write the same reports, with the same numbers, as the JSON Lines
input does.

The JSON Lines input is the reference because it is the plainest way in: one file, no network
and no database. It decodes its lines into frames with the decoder the socket and ZeroMQ
inputs use too (``formats/json_frames.py``'s ``decode_hwpc_frames``); the CSV input makes its
frames its own way (``formats/csv_frames.py``), and the MongoDB input from documents.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq
from pymongo import MongoClient

from wattflow.formats import powerapi
from wattflow.formats.reports import HWPCReport

from .conftest import Service, wait_until, wattflow
from .servers import ServerProcess, free_port, mongodb_uri
from .test_mongodb import hwpc_sensor_document

# The benchmarks' stream generator, imported as the benchmarks import it (a script folder, not
# a package), so that one module has one name for mypy and for Python.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

SENSORS = ("node-1", "node-2")
CONTAINERS = ("web-frontend", "postgres", "ml-training")
TICKS = 60
LATENESS_MS = 2000
SETTINGS = (
    "--learn-min-samples-required", "10", "--learn-history-window-size", "20",
    "--learn-error-window-size", "5", "--cpu-error-threshold", "0.05",
    "--dram-error-threshold", "0.05", "--tick-lateness-ms", str(LATENESS_MS),
)  # fmt: skip
"""The same SmartWatts settings for every run: small windows and thresholds, so that models are
learned, and learned again, within the recording."""
RELATIVE = 1e-9
"""How close two runs' numbers must be: the same arithmetic on the same counters, except that
MongoDB holds the counters as doubles, as hwpc-sensor stores them."""
ABSOLUTE_W = 1e-12
"""...and for figures at or near zero, where a relative tolerance means nothing."""
PRINTED = 1e-7
"""How close a model's coefficients must be: they are written as text, to 9 digits."""
WAIT_S = 60.0

Document = dict[str, Any]
Identity = tuple[str, str, str, str | None, str | None]


@dataclass(frozen=True)
class Recording:
    """The recording, in each form an input reads."""

    jsonl: Path
    csv: list[Path]
    lines: dict[str, list[bytes]]
    """Each sensor's JSON lines (newline included), in the order the sensor sent them."""
    documents: list[Document]
    """The reports as hwpc-sensor's MongoDB output stores them, in the order it inserts them."""
    last_tick: dict[str, datetime]
    """Each sensor's last timestamp (naive UTC, as the reports write it)."""

    @property
    def reports(self) -> int:
        return sum(map(len, self.lines.values()))


@dataclass(frozen=True)
class Outcome:
    """What one run wrote."""

    power: list[Document]
    formula: list[Document]
    log: str


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    directory = tmp_path_factory.mktemp("recording")
    jsonl = directory / "hwpc.jsonl"
    written = record(
        ticks=TICKS,
        containers=len(CONTAINERS),
        sensors=SENSORS,
        multiplex=0.2,
        jsonl=jsonl,
        csv_dir=directory,
    )
    lines: dict[str, list[bytes]] = {sensor: [] for sensor in SENSORS}
    documents = []
    last_tick: dict[str, datetime] = {}
    with jsonl.open("rb") as handle:
        for line in handle:
            report = powerapi.decode_json(HWPCReport, line, "recording", None)
            assert isinstance(report, HWPCReport)
            lines[report.sensor].append(line)
            documents.append(hwpc_sensor_document(report))
            last_tick[report.sensor] = naive(powerapi.format_timestamp(report.timestamp))
    assert sum(map(len, lines.values())) == written == TICKS * len(SENSORS) * 4
    assert {r["target"] for r in documents} == {"all", *CONTAINERS}
    return Recording(
        jsonl=jsonl,
        csv=[directory / name for name in ("rapl.csv", "msr.csv", "core.csv")],
        lines=lines,
        documents=documents,
        last_tick=last_tick,
    )


def naive(timestamp: str) -> datetime:
    """A report's timestamp as written (naive UTC, milliseconds)."""
    return datetime.fromisoformat(timestamp)


def outputs(directory: Path) -> list[str]:
    """The flags after the input's: the settings, both JSON Lines outputs, the dead letters."""
    return [
        *SETTINGS,
        "--output", "jsonl", "--file", str(directory / "power.jsonl"),
        "--output", "jsonl", "--model", "FormulaReport", "--file", str(directory / "formula.jsonl"),
        "--dead-letters", str(directory / "dead.jsonl"),
    ]  # fmt: skip


def read_jsonl(path: Path) -> list[Document]:
    """The complete lines of a JSON Lines file (one being written may end mid-line)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def outcome(directory: Path, log: str) -> Outcome:
    """What a run that exited 0 wrote; it must have dead-lettered nothing."""
    dead = read_jsonl(directory / "dead.jsonl")
    assert dead == [], f"dead letters: {dead[:3]}\n{log[-3000:]}"
    return Outcome(
        power=read_jsonl(directory / "power.jsonl"),
        formula=read_jsonl(directory / "formula.jsonl"),
        log=log,
    )


def finished(done: subprocess.CompletedProcess[str], directory: Path) -> Outcome:
    assert done.returncode == 0, done.stderr[-3000:]
    return outcome(directory, done.stderr)


def identity(document: Document) -> Identity:
    """What tells a report apart from the others of a run."""
    metadata = document.get("metadata") or {}
    return (
        document["timestamp"],
        document["sensor"],
        document["target"],
        metadata.get("scope"),
        metadata.get("socket"),
    )


# --- the runs, one per input -------------------------------------------------------------------


def run_jsonl(recording: Recording, directory: Path) -> Outcome:
    done = wattflow("run", "--input", "jsonl", "--files", str(recording.jsonl), *outputs(directory))
    return finished(done, directory)


def run_csv(recording: Recording, directory: Path) -> Outcome:
    files = ",".join(map(str, recording.csv))
    return finished(
        wattflow("run", "--input", "csv", "--files", files, *outputs(directory)), directory
    )


def run_mongodb(recording: Recording, directory: Path, server: ServerProcess) -> Outcome:
    client: MongoClient[Document] = MongoClient(mongodb_uri(server), serverSelectionTimeoutMS=5000)
    try:
        # insert_many adds an ``_id`` to each document: insert copies, the fixture is shared.
        client["powerapi"]["hwpc"].insert_many([dict(d) for d in recording.documents])
    finally:
        client.close()
    done = wattflow(
        "run", "--input", "mongodb", "-u", mongodb_uri(server), "-d", "powerapi", "-c", "hwpc",
        *outputs(directory),
    )  # fmt: skip
    return finished(done, directory)


def wait_for_all_but_the_held_ticks(
    service: Service, directory: Path, recording: Recording, reference: Outcome
) -> None:
    """Wait until the service has written what it can before it is stopped.

    SmartWatts holds a sensor's ticks until its stream is ``--tick-lateness-ms`` past them, and
    estimates the rest at shutdown; the RAPL formula holds nothing. So once the whole recording
    is in, every reference report is out except SmartWatts' of the last ticks, and these are
    what the wait looks for: the last RAPL reports need each sensor's last global report. (On a
    connection the last targets' lines may still wait behind it: the socket input reads, at
    shutdown, what its connections have already sent.) The shutdown then adds the held ticks,
    which the comparison checks.
    """
    lateness = timedelta(milliseconds=LATENESS_MS)
    expected = {
        identity(document)
        for document in reference.power
        if document["target"] == "rapl"
        or naive(document["timestamp"]) <= recording.last_tick[document["sensor"]] - lateness
    }
    assert len(expected) < len(reference.power), "some ticks wait for the shutdown"

    def written() -> bool:
        service.alive()
        return expected <= {identity(d) for d in read_jsonl(directory / "power.jsonl")}

    wait_until(written, WAIT_S, f"{len(expected)} reports before the shutdown")


def run_socket(recording: Recording, directory: Path, reference: Outcome) -> Outcome:
    with Service(
        directory / "service.log", "run", "--input", "socket", "--port", "0", *outputs(directory)
    ) as service:
        service.wait_for_log("listening for hwpc-sensor on ")
        found = re.search(r"listening for hwpc-sensor on [^:\s]+:(\d+)", service.text())
        assert found, service.text()
        port = int(found.group(1))

        def send(lines: list[bytes]) -> None:
            """One sensor: its own connection, all its reports, then it goes away."""
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as connection:
                connection.sendall(b"".join(lines))

        # Both sensors at once, as a fleet sends: the service reads each connection on its own.
        with ThreadPoolExecutor(len(SENSORS)) as senders:
            list(senders.map(send, recording.lines.values()))
        wait_for_all_but_the_held_ticks(service, directory, recording, reference)
        log = service.stop(timeout_s=WAIT_S)
    return outcome(directory, log)


def ticks(lines: list[bytes]) -> list[bytes]:
    """A sensor's lines as one message per tick: its global report, then its targets'.

    A message may hold one report or many. One tick per message, rather than one report, lets
    the wait before the shutdown see everything come in: the RAPL reports of a sensor's last
    tick come out when its last message has been received, since a message is decoded whole.
    """
    messages: list[bytes] = []
    for line in lines:
        if b'"target":"all"' in line or not messages:
            messages.append(line)
        else:
            messages[-1] += line
    assert len(messages) == TICKS
    return messages


def run_zeromq(recording: Recording, directory: Path, reference: Outcome) -> Outcome:
    uri = f"tcp://127.0.0.1:{free_port()}"
    with Service(
        directory / "service.log",
        "run", "--input", "zeromq", "--uri", uri, "--socket-type", "PULL", "--bind",
        *outputs(directory),
    ) as service:  # fmt: skip
        context = zmq.Context()
        pushes = []  # a socket that is garbage collected is closed, and drops what it holds
        try:
            for lines in recording.lines.values():
                push = context.socket(zmq.PUSH)
                pushes.append(push)
                push.setsockopt(zmq.LINGER, 0)
                # A PUSH socket queues what it sends until the service has bound its address and
                # taken the connection, so nothing waits for the service to start; and far fewer
                # messages than the queue holds (1,000) are sent, so no send waits either.
                push.connect(uri)
                for tick in ticks(lines):
                    push.send(tick)
            # The service reads what is queued for a moment at shutdown, not what is still on
            # its way; the wait makes sure everything has come in before it is stopped.
            wait_for_all_but_the_held_ticks(service, directory, recording, reference)
        finally:
            context.destroy(linger=0)
        log = service.stop(timeout_s=WAIT_S)
    return outcome(directory, log)


@pytest.fixture(scope="module")
def reference(recording: Recording, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """What the JSON Lines input gives."""
    return run_jsonl(recording, tmp_path_factory.mktemp("jsonl"))


# --- the comparison ---------------------------------------------------------------------------


def by_model(outcome: Outcome) -> tuple[list[Document], list[Document]]:
    """The run's PowerReports and FormulaReports with each model named by its place in the
    order models came into use (per sensor, scope and socket) rather than by its hash, and with
    its coefficients as numbers.

    A model's hash digests its coefficients bit for bit, so a last-bit difference, which the
    tolerance allows, would change it. What must be equal is which model each estimate used:
    the same one in the same order, with the same layer and number, the same coefficients
    (within :data:`PRINTED`) and intercept (within :data:`RELATIVE`). A tick's PowerReports
    name the model that made them and its FormulaReport the model after the tick (relearned if
    its errors grew too large), so within a tick the PowerReports' model comes first.
    """
    uses = sorted(
        [
            (d["timestamp"], 0, d["sensor"], d["metadata"]["scope"], d["metadata"]["socket"],
             d["metadata"]["formula"])
            for d in outcome.power
            if d["target"] != "rapl"  # RAPL's ``formula`` is the RAPL event it reads
        ]
        + [
            (d["timestamp"], 1, d["sensor"], d["metadata"]["scope"], d["metadata"]["socket"],
             d["target"])
            for d in outcome.formula
        ]
    )  # fmt: skip
    names: dict[str, str] = {}
    models: Counter[tuple[str, str, str]] = Counter()
    for _, _, sensor, scope, package, digest in uses:
        if digest not in names:
            models[sensor, scope, package] += 1
            names[digest] = f"model {models[sensor, scope, package]} of {sensor} {scope} {package}"
    power = [
        d if d["target"] == "rapl"
        else {**d, "metadata": {**d["metadata"], "formula": names[d["metadata"]["formula"]]}}
        for d in outcome.power
    ]  # fmt: skip
    formula = [
        {
            **d,
            "target": names[d["target"]],
            "metadata": {
                **d["metadata"],
                "coef": [float(value) for value in d["metadata"]["coef"].strip("[]").split()],
            },
        }
        for d in outcome.formula
    ]
    return power, formula


def same(expected: Any, found: Any) -> bool:
    """Equal values, numbers within :data:`RELATIVE` (or :data:`ABSOLUTE_W` of zero).

    Everything that is not a float must be equal: timestamps, sensors, targets, scopes,
    sockets, the model in ``formula``, its layer and number.
    """
    if isinstance(expected, float) or isinstance(found, float):
        return (
            isinstance(expected, int | float)
            and isinstance(found, int | float)
            and math.isclose(expected, found, rel_tol=RELATIVE, abs_tol=ABSOLUTE_W)
        )
    if isinstance(expected, dict) and isinstance(found, dict):
        return expected.keys() == found.keys() and all(
            (same_coefficients if key == "coef" else same)(value, found[key])
            for key, value in expected.items()
        )
    return bool(expected == found)


def same_coefficients(expected: list[float], found: list[float]) -> bool:
    """A model's coefficients, within the precision they are written with."""
    return len(expected) == len(found) and all(
        math.isclose(one, other, rel_tol=PRINTED, abs_tol=ABSOLUTE_W)
        for one, other in zip(expected, found, strict=True)
    )


def relative(expected: Any, found: Any) -> float:
    if isinstance(expected, int | float) and isinstance(found, int | float):
        return abs(found - expected) / max(abs(expected), ABSOLUTE_W)
    return math.inf


def differences(kind: str, expected: Iterable[Document], found: Iterable[Document]) -> list[str]:
    """Each way ``found`` differs from ``expected``, in words: reports missing, extra, doubled,
    or with other figures. Order is not compared: the sensors' formulas run side by side and
    their reports interleave differently from one run to the next."""
    wanted = {identity(d): d for d in expected}
    got = {identity(d): d for d in found}
    problems = [
        f"{kind} {key} written {count} times"
        for key, count in Counter(map(identity, found)).items()
        if count > 1
    ]
    problems += [f"{kind} missing: {key}" for key in sorted(wanted.keys() - got.keys())]
    problems += [f"{kind} not expected: {key}" for key in sorted(got.keys() - wanted.keys())]
    for key in sorted(wanted.keys() & got.keys()):
        one, other = wanted[key], got[key]
        if not same(one, other):
            power = ""
            if "power" in one:
                power = (
                    f": {one.get('power')!r} W, here {other.get('power')!r} W"
                    f" (relative {relative(one.get('power'), other.get('power')):.3g})"
                )
            problems.append(f"{kind} {key} differs{power}: {one} != {other}")
    return problems


@pytest.mark.parametrize("source", ["csv", "socket", "mongodb", "zeromq"])
def test_every_input_gives_the_same_reports(
    source: str,
    recording: Recording,
    reference: Outcome,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    runs: dict[str, Callable[[], Outcome]] = {
        "csv": lambda: run_csv(recording, tmp_path),
        "socket": lambda: run_socket(recording, tmp_path, reference),
        "mongodb": lambda: run_mongodb(
            recording, tmp_path, request.getfixturevalue("mongodb_server")
        ),
        "zeromq": lambda: run_zeromq(recording, tmp_path, reference),
    }
    found = runs[source]()
    expected_power, expected_formula = by_model(reference)
    found_power, found_formula = by_model(found)
    problems = differences("PowerReport", expected_power, found_power)
    problems += differences("FormulaReport", expected_formula, found_formula)
    assert not problems, (
        f"{len(problems)} differences from the jsonl input (of {len(reference.power)} "
        f"PowerReports, {len(reference.formula)} FormulaReports):\n"
        + "\n".join(problems[:25])
        + f"\n--- log:\n{found.log[-2000:]}"
    )
    assert len(found.power) == len(reference.power)
    assert len(found.formula) == len(reference.formula)


def test_the_reference_run_reports_every_target_socket_and_scope(
    recording: Recording, reference: Outcome
) -> None:
    """What the inputs agree on is worth agreeing on: hundreds of reports, for every sensor,
    container, socket and scope, from learned models."""
    assert len(reference.power) >= 1000
    assert len(set(map(identity, reference.power))) == len(reference.power), "no report twice"
    assert len(set(map(identity, reference.formula))) == len(reference.formula)
    assert len(reference.formula) >= 20
    assert max(d["metadata"]["id"] for d in reference.formula) >= 3, "models are learned again"
    per_target = Counter((d["sensor"], d["target"]) for d in reference.power)
    for sensor in SENSORS:
        for target in (*CONTAINERS, "global", "rapl"):
            # Four per tick (two sockets, two scopes) once the tick's frequency layer has a
            # model: a layer needs 10 samples first, so some ticks get none.
            assert per_target[sensor, target] >= 4 * 20, (sensor, target, per_target)
    assert {(d["metadata"]["scope"], d["metadata"]["socket"]) for d in reference.power} == {
        (scope, package) for scope in ("cpu", "dram") for package in ("0", "1")
    }
    assert all(d["power"] >= 0 for d in reference.power)
    assert f"entered={recording.reports}" in reference.log, reference.log[-2000:]


def _renumbered(line: bytes, *, socket: str | None = None, cpu: str | None = None) -> bytes:
    """The line with every group's first socket, or its first cpu, given another number."""
    document = json.loads(line)
    for sockets in document["groups"].values():
        if cpu is not None:
            cpus = next(iter(sockets.values()))
            cpus[cpu] = cpus.pop(next(iter(cpus)))
        if socket is not None:
            sockets[socket] = sockets.pop(next(iter(sockets)))
    return json.dumps(document).encode() + b"\n"


def test_reports_with_sockets_or_cpus_out_of_bounds_are_dead_letters(
    recording: Recording, tmp_path: Path
) -> None:
    """One report names socket 10¹⁸ (SmartWatts would size an array by it), another cpu 2⁴⁰:
    the run exits normally, both are dead letters naming their line and key, and every other
    report's PowerReports are written: exactly those of the same file without the two lines."""
    lines = recording.jsonl.read_bytes().splitlines(keepends=True)
    containers = [at for at, line in enumerate(lines) if json.loads(line)["target"] != "all"]
    first, second = containers[len(containers) // 3], containers[len(containers) // 2]
    bad = list(lines)
    bad[first] = _renumbered(lines[first], socket=str(10**18))
    bad[second] = _renumbered(lines[second], cpu=str(2**40))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "hwpc.jsonl").write_bytes(b"".join(bad))
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "hwpc.jsonl").write_bytes(
        b"".join(line for at, line in enumerate(lines) if at not in (first, second))
    )
    runs = {}
    for name in ("bad", "clean"):
        directory = tmp_path / name
        runs[name] = wattflow(
            "run", "--input", "jsonl", "--files", str(directory / "hwpc.jsonl"),
            *outputs(directory),
        )  # fmt: skip
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    letters = read_jsonl(tmp_path / "bad" / "dead.jsonl")
    source = tmp_path / "bad" / "hwpc.jsonl"
    assert [(letter["actor"], letter["payload"]) for letter in letters] == [
        ("puller:puller_jsonl", bad[first].decode().rstrip("\n")),
        ("puller:puller_jsonl", bad[second].decode().rstrip("\n")),
    ]
    assert letters[0]["reason"].startswith(f"{source}:{first + 1}: HWPCReport: field 'groups'")
    assert f"socket '{10**18}' of group" in letters[0]["reason"]
    assert "not a socket number (0 to 65535)" in letters[0]["reason"]
    assert letters[1]["reason"].startswith(f"{source}:{second + 1}: HWPCReport: field 'groups'")
    assert f"cpu '{2**40}' of socket" in letters[1]["reason"]
    assert "not a cpu number (0 to 1048575)" in letters[1]["reason"]
    assert read_jsonl(tmp_path / "clean" / "dead.jsonl") == []
    power = (tmp_path / "bad" / "power.jsonl").read_bytes()
    assert power == (tmp_path / "clean" / "power.jsonl").read_bytes()
    assert len(power.splitlines()) >= 1000
    target = json.loads(lines[first])["target"]
    assert any(json.loads(line)["target"] == target for line in power.splitlines())
