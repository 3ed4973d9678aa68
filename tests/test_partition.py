"""``wattflow run --partition i/N``: N instances share one input by sensor.

The instances of one stream together write exactly what one instance without the option
writes (no report missing, none twice), each takes only its own sensors, reports of the other
sensors are counted as skipped (not dead letters; but on ZeroMQ, a report sent under a topic of
this partition's sensors that is another's is one), and on MongoDB each keeps a checkpoint of
its own.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from wattflow.actors.partition import Partition, partition_of
from wattflow.actors.pullers.zeromq import ZeroMQPuller, ZeroMQPullerConfig
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch
from wattflow.formats.frames import Frame
from wattflow.formats.reports import HWPCReport

from .conftest import Service, run_async, wait_until, wattflow
from .servers import ServerProcess, free_port, mongodb_uri
from .test_influxdb import power_reports
from .test_mongodb import client_of, hwpc_sensor_document
from .test_status_server import get, samples, value
from .test_zeromq import Collector, eventually, pulling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

SENSORS = tuple(f"node-{number}" for number in range(1, 7))
TICKS = 20
SETTINGS = ("--learn-min-samples-required", "5", "--learn-history-window-size", "10")

Document = dict[str, Any]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hwpc-sensor's reports of six machines, three containers each, in one JSON Lines file
    (and PowerAPI's CSV files beside it)."""
    directory = tmp_path_factory.mktemp("recording")
    jsonl = directory / "hwpc.jsonl"
    record(ticks=TICKS, containers=3, sensors=SENSORS, jsonl=jsonl, csv_dir=directory)
    taken = {partition_of(sensor, 2) for sensor in SENSORS}
    assert taken == {0, 1}, "each partition of two takes some of the sensors"
    return jsonl


def read_jsonl(path: Path) -> list[Document]:
    """The complete lines of a JSON Lines file (one being written may end mid-line)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def written(path: Path) -> Counter[tuple[Any, ...]]:
    """Each PowerReport written, with its figure, counted."""
    return Counter(
        (
            d["timestamp"],
            d["sensor"],
            d["target"],
            d["metadata"].get("scope"),
            d["metadata"].get("socket"),
            d["power"],
        )
        for d in read_jsonl(path)
    )


def reports_per_sensor(recording: Path) -> Counter[str]:
    return Counter(json.loads(line)["sensor"] for line in recording.read_text().splitlines())


def skipped_in(log: str) -> int:
    """The ledger's ``skipped`` in the line the service logs once drained."""
    found = re.findall(r"pipeline drained: .*skipped=(\d+)", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


def output_flags(directory: Path, name: str) -> list[str]:
    return [
        *SETTINGS,
        "--output", "jsonl", "--file", str(directory / f"{name}.jsonl"),
        "--dead-letters", str(directory / f"{name}-dead.jsonl"),
    ]  # fmt: skip


def check_partitions_make_the_whole(
    directory: Path, names: list[str], whole: str, per_sensor: Counter[str], logs: list[str]
) -> None:
    """The partitions' outputs, together, are the whole run's, each report once; each took
    only its own sensors and counted the others' reports as skipped; nothing was dead."""
    expected = written(directory / f"{whole}.jsonl")
    assert len({key[1] for key in expected}) == len(SENSORS), "every sensor has power"
    together: Counter[tuple[Any, ...]] = Counter()
    for index, (name, log) in enumerate(zip(names, logs, strict=True)):
        part = written(directory / f"{name}.jsonl")
        partition = Partition(index, len(names))
        assert part, f"partition {partition} wrote nothing"
        assert {key[1] for key in part} == {s for s in SENSORS if partition.owns(s)}
        others = sum(count for sensor, count in per_sensor.items() if not partition.owns(sensor))
        assert skipped_in(log) == others
        assert read_jsonl(directory / f"{name}-dead.jsonl") == []
        together += part
    assert together == expected


@pytest.mark.parametrize("source", ["jsonl", "csv"])
def test_the_partitions_of_a_recording_together_give_the_whole_run(
    source: str, recording: Path, tmp_path: Path
) -> None:
    if source == "jsonl":
        files = str(recording)
    else:
        files = ",".join(str(recording.parent / f"{g}.csv") for g in ("rapl", "msr", "core"))
    whole = wattflow("run", "--input", source, "--files", files, *output_flags(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert skipped_in(whole.stderr) == 0
    logs = []
    for index in range(2):
        part = wattflow(
            "run", "--partition", f"{index}/2", "--input", source, "--files", files,
            *output_flags(tmp_path, f"part{index}"),
        )  # fmt: skip
        assert part.returncode == 0, part.stderr[-3000:]
        logs.append(part.stderr)
    per_sensor = reports_per_sensor(recording)
    check_partitions_make_the_whole(tmp_path, ["part0", "part1"], "whole", per_sensor, logs)


def test_a_partition_takes_its_sensors_from_the_socket_and_counts_the_rest(
    recording: Path, tmp_path: Path
) -> None:
    """Every machine sends to one socket; partition 1 of 2 writes what the whole run writes for
    its sensors and says, in its metrics and its ledger, how many reports it let go."""
    whole = wattflow(
        "run", "--input", "jsonl", "--files", str(recording), "--disable-smartwatts-formula",
        *output_flags(tmp_path, "whole"),
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    partition = Partition(1, 2)
    expected = Counter(
        {key: n for key, n in written(tmp_path / "whole.jsonl").items() if partition.owns(key[1])}
    )
    per_sensor = reports_per_sensor(recording)
    others = sum(count for sensor, count in per_sensor.items() if not partition.owns(sensor))
    port = free_port()
    http = f"http://127.0.0.1:{port}"
    with Service(
        tmp_path / "service.log", "run", "--partition", "1/2", "--http-port", str(port),
        "--input", "socket", "--port", "0", "--disable-smartwatts-formula",
        *output_flags(tmp_path, "part"),
    ) as service:  # fmt: skip
        service.wait_for_log("listening for hwpc-sensor on ")
        found = re.search(r"listening for hwpc-sensor on [^:\s]+:(\d+)", service.text())
        assert found, service.text()
        with socket.create_connection(("127.0.0.1", int(found[1])), timeout=30) as connection:
            connection.sendall(recording.read_bytes())
        # RAPL holds nothing back: once every report was read, all of its power is written.
        service.wait_for_lines(tmp_path / "part.jsonl", sum(expected.values()))

        def metric(name: str) -> float | None:
            service.alive()
            return value(samples(get(http + "/metrics")[1]), name, actor="puller:puller_socket")

        wait_until(
            lambda: metric("wattflow_actor_reports_skipped_total") == others,
            30,
            "the skipped reports in the metrics",
        )
        assert metric("wattflow_actor_reports_out_total") == per_sensor.total() - others
        assert metric("wattflow_actor_reports_dead_total") == 0
        log = service.stop()
    assert written(tmp_path / "part.jsonl") == expected
    assert skipped_in(log) == others
    assert read_jsonl(tmp_path / "part-dead.jsonl") == []


def test_two_partitions_following_one_mongodb_write_what_one_instance_writes(
    recording: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """hwpc-sensor's documents of six machines in one collection, half of them there before
    the instances start and half inserted while they follow it; each instance keeps its own
    checkpoint beside the collection."""
    documents = [
        hwpc_sensor_document(powerapi.decode_json(HWPCReport, line, "recording", None))  # type: ignore[arg-type]
        for line in recording.read_bytes().splitlines()
    ]
    database = client_of(mongodb_server)["powerapi"]
    half = len(documents) // 2
    database["hwpc"].insert_many(documents[:half])
    uri = mongodb_uri(mongodb_server)
    source = ["--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", "hwpc"]
    ports = [free_port(), free_port()]
    services = [
        Service(
            tmp_path / f"part{index}.log",
            *("run", "-s", "--partition", f"{index}/2", "--http-port", str(ports[index])),
            *(*source, "--checkpoint-interval-s", "0.2", *output_flags(tmp_path, f"part{index}")),
        )
        for index in range(2)
    ]
    logs = []
    try:
        for service in services:
            service.wait_for_log("health, readiness and metrics on")
        for start in range(half, len(documents), 40):
            database["hwpc"].insert_many(documents[start : start + 40])

        def read_everything() -> bool:
            """Whether each instance has read every document: taken or skipped."""
            names = ("wattflow_actor_reports_out_total", "wattflow_actor_reports_skipped_total")
            for service, port in zip(services, ports, strict=True):
                service.alive()
                found = samples(get(f"http://127.0.0.1:{port}/metrics")[1])
                read = sum(value(found, n, actor="puller:puller_mongodb") or 0 for n in names)
                if read != len(documents):
                    return False
            return True

        wait_until(read_everything, 60, "both partitions reading every document")
        logs = [service.stop() for service in services]
    finally:
        for service in services:
            service.kill()
    checkpoints = {d["_id"]: d for d in database["wattflow_checkpoints"].find()}
    assert set(checkpoints) == {
        "puller_mongodb:powerapi.hwpc:partition-0/2",
        "puller_mongodb:powerapi.hwpc:partition-1/2",
    }
    assert all(d["backlog_done"] and d["token"] for d in checkpoints.values())
    whole = wattflow("run", *source, *output_flags(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    per_sensor = reports_per_sensor(recording)
    check_partitions_make_the_whole(tmp_path, ["part0", "part1"], "whole", per_sensor, logs)


def test_changing_the_number_of_partitions_reads_again_only_what_was_not_committed(
    recording: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """One instance follows a collection and stops; more documents come; then two partitions
    start. With no checkpoint of their own, they start where the last partitioning (here: none)
    had committed, not at the collection's start: each reads only the documents inserted
    since, and writes power only for their ticks. A stale checkpoint of an older partitioning
    (5 instances, saved long ago, having handed on nothing) is not the one followed."""
    documents = [
        hwpc_sensor_document(powerapi.decode_json(HWPCReport, line, "recording", None))  # type: ignore[arg-type]
        for line in recording.read_bytes().splitlines()
    ]
    first_ticks = sorted({d["timestamp"] for d in documents})[: TICKS * 3 // 5]
    before = [d for d in documents if d["timestamp"] in first_ticks]
    after = [d for d in documents if d["timestamp"] not in first_ticks]
    database = client_of(mongodb_server)["powerapi"]
    database["wattflow_checkpoints"].insert_one(
        {
            "_id": "puller_mongodb:powerapi.hwpc:partition-0/5",
            "collection": "hwpc",
            "last_id": None,
            "saved": datetime(2020, 1, 1, tzinfo=UTC),
        }
    )
    database["hwpc"].insert_many(before)
    uri = mongodb_uri(mongodb_server)
    source = ["--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", "hwpc"]

    def read_by(services: list[Service], ports: list[int]) -> list[float]:
        """How many documents each instance has read: taken or skipped."""
        names = ("wattflow_actor_reports_out_total", "wattflow_actor_reports_skipped_total")
        counts = []
        for service, port in zip(services, ports, strict=True):
            service.alive()
            found = samples(get(f"http://127.0.0.1:{port}/metrics")[1])
            counts.append(sum(value(found, n, actor="puller:puller_mongodb") or 0 for n in names))
        return counts

    def follow(names: list[str], partitions: list[list[str]], count: int) -> list[str]:
        """Run one instance per name until each has read ``count`` documents (and no more)."""
        ports = [free_port() for _ in names]
        services = [
            Service(
                tmp_path / f"{name}.log",
                *("run", "-s", *partition, "--http-port", str(port), *source),
                *("--checkpoint-interval-s", "0.2", *output_flags(tmp_path, name)),
            )
            for name, partition, port in zip(names, partitions, ports, strict=True)
        ]
        try:
            for service in services:
                service.wait_for_log("health, readiness and metrics on")
            wait_until(
                lambda: min(read_by(services, ports)) >= count, 60, f"{count} documents read"
            )
            assert read_by(services, ports) == [count] * len(names)
            return [service.stop() for service in services]
        finally:
            for service in services:
                service.kill()

    follow(["single"], [[]], len(before))
    database["hwpc"].insert_many(after)
    logs = follow(["part0", "part1"], [["--partition", "0/2"], ["--partition", "1/2"]], len(after))

    for index, log in enumerate(logs):
        assert "no checkpoint puller_mongodb:powerapi.hwpc:partition-" in log
        assert "but puller_mongodb:powerapi.hwpc: starting from the earliest document" in log
        written_ticks = {key[0] for key in written(tmp_path / f"part{index}.jsonl")}
        assert written_ticks, f"partition {index} estimated the new ticks"
        assert min(written_ticks) > powerapi.format_timestamp(max(first_ticks))
        assert read_jsonl(tmp_path / f"part{index}-dead.jsonl") == []
    checkpoints = {d["_id"]: d for d in database["wattflow_checkpoints"].find()}
    for index in range(2):
        assert (
            checkpoints[f"puller_mongodb:powerapi.hwpc:partition-{index}/2"]["last_id"]
            == (after[-1]["_id"])
        )


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("2/2", "partition 2 of 2 does not exist: give 0 to 1"),
        ("1/0", "the number of partitions must be 1 or more"),
        ("one/two", "expected i/N"),
        ("-1/2", "expected i/N"),
    ],
)
def test_a_partition_that_does_not_exist_is_a_one_line_error(given: str, error: str) -> None:
    for how in ([f"--partition={given}"], []):
        done = wattflow(
            "run", *how, "--input", "jsonl", "--files", "absent.jsonl", "--output", "table",
            env={} if how else {"WATTFLOW_PARTITION": given},
        )  # fmt: skip
        assert done.returncode == 2
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("wattflow: error: partition: ")
        assert error in line


def test_every_process_puts_a_sensor_in_the_same_partition() -> None:
    """Python salts its own string hash per process; the partition must not depend on it."""
    program = (
        "from wattflow.actors.partition import partition_of;"
        "print([partition_of(f'node-{n}', 7) for n in range(50)])"
    )
    answers = {
        subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(answers) == 1
    spread = Counter(json.loads(answers.pop()))
    assert set(spread) == set(range(7)), "fifty sensors fall into every one of 7 partitions"


def test_a_partition_lets_other_sensors_zeromq_messages_go_by_their_topic(tmp_path: Path) -> None:
    """Messages with wattflow's topic (``<kind>:<sensor>``) of another partition's sensor are
    let go undecoded (a bad line in one is no dead letter); messages without a topic are
    decoded and their reports of other sensors let go. Either way they count as skipped."""
    partition = Partition(0, 2)
    by_sensor = {
        sensor: [report.model_copy(update={"sensor": sensor}) for report in power_reports(ticks=4)]
        for sensor in SENSORS
    }
    lines = {s: [powerapi.encode_json(r).encode() for r in rs] for s, rs in by_sensor.items()}
    others = [sensor for sensor in SENSORS if not partition.owns(sensor)]
    uri = f"tcp://127.0.0.1:{free_port()}"
    output = tmp_path / "power.jsonl"
    letters = tmp_path / "dead.jsonl"
    with Service(
        tmp_path / "service.log", "run", "--partition", str(partition),
        "--input", "zeromq", "--uri", uri, "--socket-type", "PULL", "--bind",
        "--model", "PowerReport",
        "--output", "jsonl", "--model", "PowerReport", "--file", str(output),
        "--dead-letters", str(letters),
    ) as service:  # fmt: skip
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        try:
            push.connect(uri)
            for sensor in SENSORS:  # with a topic, and a bad line for another's sensor
                garbage = [b"{not json"] if sensor == others[0] else []
                payload = b"\n".join(lines[sensor][:2] + garbage)
                push.send_multipart([f"PowerReport:{sensor}".encode(), payload])
            # without a topic, every sensor's reports in one message
            push.send(b"\n".join(line for sensor in SENSORS for line in lines[sensor][2:]))
            taken = sum(len(lines[s]) for s in SENSORS if partition.owns(s))
            service.wait_for_lines(output, taken)
        finally:
            push.close()
            context.term()
        log = service.stop()
    expected = sorted(
        powerapi.encode_json(r) for s in SENSORS if partition.owns(s) for r in by_sensor[s]
    )
    assert sorted(output.read_text().splitlines()) == expected
    assert read_jsonl(letters) == []
    assert skipped_in(log) == sum(len(lines[s]) for s in others) + 1  # the bad line too


def test_hwpc_reports_under_a_topic_of_another_sensor_are_dead_letters(recording: Path) -> None:
    """A sender that publishes a sensor's reports under the topic of a sensor of partition 0/2
    when their own sensor is partition 1/2's: partition 1 lets the message go by its topic, so
    partition 0 dead-letters those reports, naming the topic and the sensor, and hands on its
    own sensors' reports (as frames) whatever topic of its own they came under."""
    partition = Partition(0, 2)
    streams: dict[str, list[bytes]] = {}
    for line in recording.read_bytes().splitlines():
        streams.setdefault(json.loads(line)["sensor"], []).append(line)
    mine = [sensor for sensor in SENSORS if partition.owns(sensor)]
    theirs = [sensor for sensor in SENSORS if not partition.owns(sensor)]
    uri = f"tcp://127.0.0.1:{free_port()}"
    puller = ZeroMQPuller(ZeroMQPullerConfig(uri=[uri], socket_type="PULL"))
    puller.partition = partition
    collector = Batches()
    context = zmq.asyncio.Context()
    sender = context.socket(zmq.PUSH)
    misplaced = len(streams[theirs[0]])

    async def go() -> None:
        async with pulling(puller, collector):
            sender.connect(uri)
            for sensor in mine:
                await sender.send_multipart(
                    [f"HWPCReport:{sensor}".encode(), b"\n".join(streams[sensor])]
                )
            await sender.send_multipart(
                [f"HWPCReport:{mine[0]}".encode(), b"\n".join(streams[theirs[0]])]
            )
            await sender.send_multipart(
                [f"HWPCReport:{theirs[1]}".encode(), b"\n".join(streams[theirs[1]])]
            )
            await eventually(
                lambda: (
                    len(collector.reports) == sum(len(streams[s]) for s in mine)
                    and len(collector.rejected) == misplaced
                    and collector.skipped == len(streams[theirs[1]])
                ),
                "every message handled",
            )

    try:
        run_async(go())
    finally:
        sender.close(linger=0)
        context.term()
    assert Counter(r.sensor for r in collector.reports) == {s: len(streams[s]) for s in mine}
    assert collector.frames > 0, "hwpc-sensor's plain reports still travel as frames"
    assert Counter(payload.sensor for payload, _ in collector.rejected) == {theirs[0]: misplaced}
    assert {reason for _, reason in collector.rejected} == {
        f"zeromq {uri}: sensor {theirs[0]!r} came under topic 'HWPCReport:{mine[0]}' of "
        "partition 0/2 but belongs to partition 1/2"
    }


class Batches(Collector):
    """A collector that also counts the frames it is handed."""

    frames = 0

    async def emit(self, batch: Batch) -> None:
        self.frames += sum(1 for item in batch if isinstance(item, Frame))
        await super().emit(batch)


def test_a_service_dead_letters_and_counts_reports_a_topic_put_in_its_partition(
    tmp_path: Path,
) -> None:
    """The service on ZeroMQ with ``--partition 0/2``: PowerReports of a partition-1 sensor
    sent under a partition-0 sensor's topic are in the dead-letter file with the reason, and
    in the ledger as ``rejected_input``; the topic's own reports are written."""
    partition = Partition(0, 2)
    mine = next(sensor for sensor in SENSORS if partition.owns(sensor))
    theirs = next(sensor for sensor in SENSORS if not partition.owns(sensor))
    good = [r.model_copy(update={"sensor": mine}) for r in power_reports(ticks=3)]
    bad = [r.model_copy(update={"sensor": theirs}) for r in power_reports(ticks=2)]
    uri = f"tcp://127.0.0.1:{free_port()}"
    output, letters = tmp_path / "power.jsonl", tmp_path / "dead.jsonl"
    with Service(
        tmp_path / "service.log", "run", "--partition", str(partition),
        "--input", "zeromq", "--uri", uri, "--socket-type", "PULL", "--bind",
        "--model", "PowerReport",
        "--output", "jsonl", "--model", "PowerReport", "--file", str(output),
        "--dead-letters", str(letters),
    ) as service:  # fmt: skip
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        try:
            push.connect(uri)
            topic = f"PowerReport:{mine}".encode()
            payload = [powerapi.encode_json(r).encode() for r in (*good, *bad)]
            push.send_multipart([topic, b"\n".join(payload)])
            service.wait_for_lines(output, len(good))
            service.wait_for_log("came under topic")  # the file is written at the stop
        finally:
            push.close()
            context.term()
        log = service.stop()
    assert sorted(output.read_text().splitlines()) == sorted(powerapi.encode_json(r) for r in good)
    dead = read_jsonl(letters)
    assert len(dead) == len(bad)
    assert {d["reason"] for d in dead} == {
        f"zeromq {uri}: sensor {theirs!r} came under topic 'PowerReport:{mine}' of partition "
        "0/2 but belongs to partition 1/2"
    }
    ledger = re.search(r"pipeline drained: .*rejected_input=(\d+) skipped=(\d+)", log)
    assert ledger, log[-3000:]
    assert (int(ledger[1]), int(ledger[2])) == (len(bad), 0)


def test_a_partition_moved_to_another_instance_goes_on_without_relearning(
    recording: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """Instance A takes partition 0/2 of a MongoDB stream and is stopped, as an orchestrator
    stops a pod it moves; instance B, a new process in another working directory (nothing
    local carries over), takes partition 0/2. Its formulas' state comes from the partition's
    checkpoint document: its first ticks are estimated for every container at once (a
    relearning SmartWatts estimates none for ``--learn-min-samples-required`` ticks), and A
    and B together write exactly what one instance of partition 0/2 writes, each report once.
    """
    documents = [
        hwpc_sensor_document(powerapi.decode_json(HWPCReport, line, "recording", None))  # type: ignore[arg-type]
        for line in recording.read_bytes().splitlines()
    ]
    database = client_of(mongodb_server)["powerapi"]
    database["everything"].insert_many([dict(d) for d in documents])
    uri = mongodb_uri(mongodb_server)
    partition = ["--partition", "0/2", "--input", "mongodb", "-u", uri, "-d", "powerapi"]
    one = wattflow("run", *partition, "-c", "everything", *output_flags(tmp_path, "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    expected = written(tmp_path / "one.jsonl")

    half = len(documents) // 2
    database["moved"].insert_many(documents[:half])
    key = "puller_mongodb:powerapi.moved:partition-0/2"

    def instance(name: str) -> Service:
        """``wattflow run -s --partition 0/2`` in a working directory of its own."""
        directory = tmp_path / name
        directory.mkdir()
        return Service(
            tmp_path / f"{name}.log",
            command=[
                "sh", "-c", f'cd "{directory}" && exec "$0" -m wattflow.service "$@"',
                sys.executable, "run", "-s", *partition, "-c", "moved",
                "--checkpoint-interval-s", "0.2", *output_flags(directory, "power"),
            ],
        )  # fmt: skip

    def checkpoint() -> Document:
        return database["wattflow_checkpoints"].find_one({"_id": key}) or {}

    with instance("a") as first:
        wait_until(
            lambda: (
                first.alive()
                and checkpoint().get("last_id") == documents[half - 1]["_id"]
                and checkpoint().get("state") is not None
            ),
            60,
            "instance A's checkpoint at the last document",
        )
        first.stop()
    with instance("b") as second:
        second.wait_for_log("restored the state of", timeout_s=60)
        for start in range(half, len(documents), 40):
            database["moved"].insert_many(documents[start : start + 40])
        wait_until(
            lambda: second.alive() and checkpoint().get("last_id") == documents[-1]["_id"],
            60,
            "instance B's checkpoint at the last document",
        )
        second.stop()
    by_a, by_b = (written(tmp_path / name / "power.jsonl") for name in ("a", "b"))
    assert by_a
    assert by_b
    assert by_a + by_b == expected, "a PowerReport missing, doubled or different"
    first_tick = min(entry[0] for entry in by_b)
    containers = {entry[2] for entry in by_b if entry[0] == first_tick} - {"rapl", "all"}
    assert containers, "instance B estimated its first tick's containers"
    assert {entry for entry in by_b if entry[0] == first_tick} == {
        entry for entry in expected if entry[0] == first_tick
    }
