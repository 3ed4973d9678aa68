"""The MongoDB input and output against a real MongoDB-wire server (SecantusDB) on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from bson import ObjectId
from pymongo import MongoClient

from wattflow.actors.pushers import mongodb as mongodb_pusher
from wattflow.actors.pushers.influxdb import query
from wattflow.actors.pushers.mongodb import MongoDBPusher, MongoDBPusherConfig, document_id
from wattflow.formats import jsonl, powerapi
from wattflow.formats.reports import HWPCReport, PowerReport, Report

from .conftest import Service, run_async, wait_until, wattflow
from .servers import ServerProcess, free_port, mongodb_command, mongodb_uri
from .servers_influx import influx_uri
from .test_smartwatts import reports_of, workload


def hwpc_sensor_document(report: HWPCReport) -> dict[str, Any]:
    """A report as hwpc-sensor's MongoDB output stores it: a BSON date and double counters."""
    document = powerapi.to_mongodb(report)
    document["groups"] = {
        group: {
            socket: {
                cpu: {event: float(value) for event, value in events.items()}
                for cpu, events in cpus.items()
            }
            for socket, cpus in sockets.items()
        }
        for group, sockets in report.groups.items()
    }
    return document


def fixture_documents(fixtures: Path) -> list[dict[str, Any]]:
    """PowerAPI's recorded hwpc-sensor reports, as the sensor would have put them in MongoDB."""
    raw = json.loads((fixtures / "hwpc_rapl_2_socket.json").read_text())["reports"]
    documents = []
    for record in raw:
        report = powerapi.decode_document(HWPCReport, record, "fixture", None)
        document = hwpc_sensor_document(report)  # type: ignore[arg-type]
        documents.append(document)
    # In time order, as wattflow reads PowerAPI's recordings (they are slightly out of order),
    # with ids that grow in that order, as the sensor's inserts make them.
    documents.sort(key=lambda document: document["timestamp"])
    return [{"_id": ObjectId(), **document} for document in documents]


def client_of(server: ServerProcess) -> MongoClient[dict[str, Any]]:
    return MongoClient(mongodb_uri(server), tz_aware=True, serverSelectionTimeoutMS=5000)


def identity(document: dict[str, Any]) -> tuple[Any, ...]:
    metadata = document.get("metadata", {})
    stamp = document["timestamp"]
    millis = int(stamp.timestamp() * 1000) if isinstance(stamp, datetime) else stamp
    return (
        millis,
        document["sensor"],
        document["target"],
        metadata.get("scope"),
        metadata.get("socket"),
    )


# --- output -----------------------------------------------------------------------------------


def power_reports(count: int) -> list[PowerReport]:
    start = datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000
    return [
        PowerReport(
            timestamp=start + 1000 * (index // 4),
            sensor="node-1",
            target=f"c{index % 4}",
            power=1.5 * index,
            metadata={"scope": "cpu", "socket": "0", "formula": "f", "ratio": 0.25},
        )
        for index in range(count)
    ]


def write_with_pusher(pusher: MongoDBPusher, batches: list[list[Report]]) -> list[Any]:
    async def go() -> list[Any]:
        await pusher.check()
        await pusher.open()
        refused: list[Any] = []
        for batch in batches:
            refused += await pusher.write(batch)
        await pusher.close()
        return refused

    return run_async(go())


def test_the_output_writes_powerapis_documents_once_with_an_index(
    mongodb_server: ServerProcess,
) -> None:
    config = MongoDBPusherConfig(
        uri=mongodb_uri(mongodb_server), db="powerapi", collection="power", batch_size=7
    )
    reports: list[Report] = list(power_reports(40))
    # The second write is a retry of the same batch, as after a timeout: nothing is added.
    refused = write_with_pusher(MongoDBPusher(config), [reports, reports[10:30]])
    assert refused == []
    collection = client_of(mongodb_server)["powerapi"]["power"]
    documents = list(collection.find().sort("_id", 1))
    assert len(documents) == 40
    first = documents[0]
    assert list(first) == ["_id", "timestamp", "sensor", "target", "metadata", "power"]
    assert first["timestamp"] == datetime(2026, 1, 1, tzinfo=UTC)
    assert first["metadata"] == {"scope": "cpu", "socket": "0", "formula": "f", "ratio": 0.25}
    assert sorted(d["power"] for d in documents) == sorted(1.5 * i for i in range(40))
    assert first["_id"].generation_time == datetime(2026, 1, 1, tzinfo=UTC)
    indexes = collection.index_information()
    assert [("sensor", 1), ("target", 1), ("timestamp", 1)] in [i["key"] for i in indexes.values()]


def test_report_ids_tell_apart_everything_that_identifies_a_report() -> None:
    base = power_reports(1)[0]
    variants = [
        base.model_copy(update={"target": "other"}),
        base.model_copy(update={"sensor": "node-2"}),
        base.model_copy(update={"metadata": {**base.metadata, "socket": "1"}}),
        base.model_copy(update={"metadata": {**base.metadata, "scope": "dram"}}),
        base.model_copy(update={"timestamp": base.timestamp.replace(microsecond=1000)}),
    ]
    ids = {document_id(report) for report in [base, *variants]}
    assert len(ids) == 6
    # What a formula recomputes after a restart (its model, the ratio) is not identity.
    same = base.model_copy(update={"power": 3.0, "metadata": {**base.metadata, "ratio": 0.5}})
    assert document_id(same) == document_id(base)


def test_report_ids_keep_time_order_within_a_second() -> None:
    """The input reads in ``_id`` order: ticks of one second (a sensor ticking a few ms early,
    or ``--frequency`` under 1,000 ms) must come back in their time order."""
    base = power_reports(1)[0]
    reports = [
        base.model_copy(update={"timestamp": base.timestamp + timedelta(milliseconds=ms)})
        for ms in (999, 0, 250, 1, 998, 500, 1000, 1999)
    ]
    by_id = sorted(reports, key=document_id)
    assert [r.timestamp for r in by_id] == sorted(r.timestamp for r in reports)
    assert all(
        document_id(r).generation_time == r.timestamp.replace(microsecond=0) for r in reports
    )


def test_reports_whose_ids_hash_alike_are_each_written_once(
    mongodb_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one byte of hash, a hundred reports of one millisecond share ids: each is still
    written, once, however often its batch is written again, recomputed or not."""
    monkeypatch.setattr(mongodb_pusher, "ID_HASH_BYTES", 1)
    base = power_reports(1)[0]
    reports: list[Report] = [
        base.model_copy(update={"target": f"container-{n}"}) for n in range(100)
    ]
    assert len({document_id(r) for r in reports}) < 100, "the test needs ids that collide"
    config = MongoDBPusherConfig(
        type="mongodb", uri=mongodb_uri(mongodb_server), db="powerapi", collection="alike"
    )
    pusher = MongoDBPusher(config)
    recomputed: list[Report] = [r.model_copy(update={"power": 1.0}) for r in reversed(reports)]
    assert write_with_pusher(pusher, [reports[:60], reports, recomputed]) == []
    assert pusher.duplicates == 60 + 100
    stored = list(client_of(mongodb_server)["powerapi"]["alike"].find())
    assert sorted(d["target"] for d in stored) == sorted(r.target for r in reports)
    assert {d["power"] for d in stored} == {base.power}, "the first write stands"


def test_the_output_waits_for_a_server_that_is_down_at_start(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(
        mongodb_command(port, tmp_path / "db"), port, tmp_path / "log", "mongodb"
    )
    source = tmp_path / "hwpc.jsonl"
    source.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports_of(workload(6))))
    reference = tmp_path / "reference.jsonl"
    assert run_rapl("--input", "jsonl", "--files", str(source), out=reference).returncode == 0
    expected = len(lines_of(reference))
    service = Service(
        tmp_path / "service.log", "run", "--disable-smartwatts-formula",
        "--input", "jsonl", "--files", str(source),
        "--output", "mongodb", "-u", f"mongodb://127.0.0.1:{port}/", "-d", "powerapi",
        "-c", "power", "--server-timeout-s", "0.5",
    )  # fmt: skip
    try:
        with service:
            service.wait_for_log("retrying")  # the output found no server, and waits for one
            server.start()
            log = service.finish()
        assert "retrying" in log
        assert expected >= 5
        assert client_of(server)["powerapi"]["power"].count_documents({}) == expected
    finally:
        server.stop(kill=True)


# --- input ------------------------------------------------------------------------------------


def run_rapl(*input_flags: str, out: Path) -> subprocess.CompletedProcess[str]:
    return wattflow(
        "run", *input_flags, "--disable-smartwatts-formula",
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip


def test_the_input_reads_hwpc_sensor_documents_and_leaves_them(
    fixtures: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    documents = fixture_documents(fixtures)
    collection = client_of(mongodb_server)["powerapi"]["hwpc"]
    collection.insert_many(documents)
    recorded = tmp_path / "hwpc.jsonl"
    recorded.write_text(
        "".join(
            powerapi.encode_json(report) + "\n"
            for report in jsonl.read_reports_document(
                HWPCReport, fixtures / "hwpc_rapl_2_socket.json"
            )
            if isinstance(report, HWPCReport)
        )
    )
    from_file = run_rapl("--input", "jsonl", "--files", str(recorded), out=tmp_path / "a.jsonl")
    assert from_file.returncode == 0, from_file.stderr
    from_mongodb = run_rapl(
        "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi", "-c", "hwpc",
        out=tmp_path / "b.jsonl",
    )  # fmt: skip
    assert from_mongodb.returncode == 0, from_mongodb.stderr
    expected = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(expected) >= 4
    assert sorted((tmp_path / "b.jsonl").read_text().splitlines()) == sorted(expected)
    assert collection.count_documents({}) == len(documents), "the input is never consumed"


def test_ticks_under_a_second_apart_come_back_in_order(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """hwpc-sensor's reports of four ticks a second, written by the output and read back by
    the input, make what the file makes: before ``_id`` held the millisecond, a second's
    ticks came back in hash order, and the RAPL formula refused the earlier ones as late."""
    reports = reports_of(workload(24))
    first = reports[0].timestamp
    quarter = [
        r.model_copy(update={"timestamp": first + (r.timestamp - first) / 4}) for r in reports
    ]
    recorded = tmp_path / "hwpc.jsonl"
    recorded.write_text("".join(powerapi.encode_json(r) + "\n" for r in quarter))
    uri = mongodb_uri(mongodb_server)
    written = wattflow(
        "run", "--input", "jsonl", "--files", str(recorded),
        "--output", "mongodb", "-u", uri, "-d", "powerapi", "-c", "quarter",
        "--model", "HWPCReport",
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    period = ("--sensor-reports-frequency", "250")
    from_file = run_rapl(*period, "--input", "jsonl", "--files", str(recorded), out=tmp_path / "a")
    from_mongodb = run_rapl(
        *period, "--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", "quarter",
        out=tmp_path / "b",
    )  # fmt: skip
    assert from_file.returncode == 0, from_file.stderr
    assert from_mongodb.returncode == 0, from_mongodb.stderr
    assert "dead letter" not in from_mongodb.stderr
    expected = (tmp_path / "a").read_text().splitlines()
    assert len(expected) == 23  # one per tick after the first, which only starts an interval
    assert sorted((tmp_path / "b").read_text().splitlines()) == sorted(expected)


def test_a_bad_document_is_a_dead_letter_and_the_rest_goes_through(
    fixtures: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    documents = fixture_documents(fixtures)
    documents[1]["groups"] = "not a table of groups"
    client_of(mongodb_server)["powerapi"]["hwpc"].insert_many(documents)
    letters = tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi",
        "-c", "hwpc", "--disable-smartwatts-formula", "--output", "jsonl",
        "--file", str(tmp_path / "out.jsonl"), "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    letters_read = [json.loads(line) for line in letters.read_text().splitlines()]
    [letter] = [one for one in letters_read if "puller" in one["actor"]]
    assert str(documents[1]["_id"]) in letter["reason"]
    assert "groups" in letter["reason"]
    assert json.loads(letter["payload"])["_id"] == {"$oid": str(documents[1]["_id"])}


def test_a_document_with_an_empty_group_is_recorded_as_it_came(
    fixtures: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """A document whose group holds no socket (``"rapl": {}``), among documents that name the
    group: its batch is read document by document and every document is recorded, that one
    with its empty group (the frame of its batch counted it and lost it before: one report
    fewer written than read, and no dead letter)."""
    documents = fixture_documents(fixtures)
    documents[10]["groups"] = {"rapl": {}}
    client_of(mongodb_server)["powerapi"]["hwpc"].insert_many(documents)
    out = tmp_path / "out.jsonl"
    done = wattflow(
        "run", "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi",
        "-c", "hwpc", "--disable-smartwatts-formula", "--disable-rapl-formula",
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == len(documents)
    assert [w["groups"] for w in written if w["groups"] == {"rapl": {}}] == [{"rapl": {}}]


def test_a_document_whose_metadata_no_output_can_write_is_a_dead_letter_alone(
    fixtures: Path, mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    """A document whose metadata holds an ObjectId (JSON has no such thing) is a dead letter
    naming its ``_id`` and the value; the other documents of its batch are recorded and the
    service exits 0. Before, the input passed it on, and the JSON Lines output failed on it with
    its whole batch: every report read was a dead letter, exit 1."""
    documents = fixture_documents(fixtures)
    documents[1]["metadata"] = {"run": ObjectId()}
    client_of(mongodb_server)["powerapi"]["hwpc"].insert_many(documents)
    out, letters = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi",
        "-c", "hwpc", "--disable-smartwatts-formula", "--disable-rapl-formula",
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(out),
        "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == len(documents) - 1
    [letter] = [json.loads(line) for line in letters.read_text().splitlines()]
    assert letter["actor"] == "puller:puller_mongodb"
    assert str(documents[1]["_id"]) in letter["reason"]
    assert letter["reason"].endswith("metadata.run: ObjectId is not JSON data")


def insert_slowly(server: ServerProcess, documents: list[dict[str, Any]], per_batch: int) -> None:
    collection = client_of(server)["powerapi"]["hwpc"]
    for start in range(0, len(documents), per_batch):
        collection.insert_many(documents[start : start + per_batch])
        time.sleep(0.05)


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hwpc_documents(ticks: int) -> list[dict[str, Any]]:
    return [hwpc_sensor_document(report) for report in reports_of(workload(ticks))]


def test_stream_mode_follows_new_documents_and_resumes_after_a_restart(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    documents = hwpc_documents(30)  # 4 documents per tick: the global one and 3 targets
    reference = tmp_path / "reference.jsonl"
    recorded = tmp_path / "hwpc.jsonl"
    recorded.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports_of(workload(30))))
    assert run_rapl("--input", "jsonl", "--files", str(recorded), out=reference).returncode == 0
    expected = Counter(identity_of_line(line) for line in lines_of(reference))
    per_tick = len(expected) // 29  # the first tick only starts the interval
    flags = [
        "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi", "-c", "hwpc",
        "--disable-smartwatts-formula", "--checkpoint-interval-s", "0.2", "--output", "jsonl",
    ]  # fmt: skip
    insert_slowly(mongodb_server, documents[:40], 40)  # a backlog of 10 ticks
    first = Service(
        tmp_path / "first.log", "run", "-s", *flags, "--file", str(tmp_path / "first.jsonl")
    )
    insert_slowly(mongodb_server, documents[40:80], 8)
    with first:
        first.stop_once_written(tmp_path / "first.jsonl", 19 * per_tick)

    insert_slowly(mongodb_server, documents[80:], 8)  # inserted while the service is down
    second = Service(
        tmp_path / "second.log", "run", "-s", *flags, "--file", str(tmp_path / "second.jsonl")
    )
    with second:
        log = second.stop_once_written(tmp_path / "second.jsonl", 9 * per_tick)
    assert "resuming from checkpoint" in log

    written = Counter(
        identity_of_line(line)
        for line in lines_of(tmp_path / "first.jsonl") + lines_of(tmp_path / "second.jsonl")
    )
    assert max(written.values()) == 1, "a report was written twice"
    # The RAPL formula's last tick was checkpointed with the position: the first tick after
    # the restart has its interval at once, so nothing is missing.
    assert set(written) == set(expected)
    assert client_of(mongodb_server)["powerapi"]["hwpc"].count_documents({}) == len(documents)


def identity_of_line(document: dict[str, Any]) -> tuple[Any, ...]:
    metadata = document.get("metadata", {})
    millis = powerapi.decode_json(PowerReport, json.dumps(document), "x", None).timestamp
    return (
        int(millis.timestamp() * 1000),
        document["sensor"],
        document["target"],
        metadata.get("scope"),
        metadata.get("socket"),
    )


def test_every_report_arrives_once_when_mongodb_restarts_mid_stream(
    tmp_path: Path, influxdb_server: ServerProcess
) -> None:
    """hwpc-sensor documents in, RAPL and SmartWatts through, MongoDB and InfluxDB out; the
    MongoDB server dies mid-stream and comes back."""
    port = free_port()
    server = ServerProcess(
        mongodb_command(port, tmp_path / "db"), port, tmp_path / "mongodb.log", "mongodb"
    )
    server.start()
    ticks = 40
    recorded = tmp_path / "hwpc.jsonl"
    recorded.write_text(
        "".join(powerapi.encode_json(r) + "\n" for r in reports_of(workload(ticks)))
    )
    reference = tmp_path / "reference.jsonl"
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(recorded), "--learn-min-samples-required", "5",
        "--output", "jsonl", "--file", str(reference),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = Counter(identity_of_line(line) for line in lines_of(reference))
    assert len(expected) > 4 * ticks, "SmartWatts' per-target reports are part of the test"
    documents = hwpc_documents(ticks)
    uri = mongodb_uri(server)
    try:
        insert_slowly(server, documents[:40], 40)
        service = Service(
            tmp_path / "service.log", "run", "-s",
            "--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", "hwpc",
            "--server-timeout-s", "1", "--learn-min-samples-required", "5",
            "--output", "mongodb", "-u", uri, "-d", "powerapi", "-c", "power",
            "--server-timeout-s", "1", "--retry-for-s", "120",
            "--output", "influxdb", "--uri", influx_uri(influxdb_server), "--db", "power",
        )  # fmt: skip
        with service:
            insert_slowly(server, documents[40:80], 8)
            power = client_of(server)["powerapi"]["power"]
            wait_until(lambda: power.count_documents({}) > 0, 60, "the first power reports")
            outages = service.text().count("server unavailable")
            server.stop(kill=True)
            # The input sees the outage (and says so) before the server comes back: a real one.
            service.wait_for_log("server unavailable", count=outages + 1)
            server.start()
            insert_slowly(server, documents[80:], 8)
            wait_until(
                lambda: power.count_documents({}) >= len(expected) - 30,
                90,
                "the last power reports",
            )
            log = service.stop()
    finally:
        server.stop()
    server.start()
    try:
        written = Counter(identity(d) for d in client_of(server)["powerapi"]["power"].find())
    finally:
        server.stop()
    assert "server unavailable" in log
    assert max(written.values()) == 1
    assert set(written) == set(expected)
    points = query(influx_uri(influxdb_server), "power", "SELECT * FROM power_consumption")
    in_influx = Counter(
        (row["time"], row["sensor"], row["target"], row["scope"], row["socket"]) for row in points
    )
    assert set(in_influx) == set(expected)


def test_a_connection_string_from_the_environment_never_shows_its_password(
    tmp_path: Path,
) -> None:
    port = free_port()  # nothing listens there: the input waits, and says so in the log
    secret_uri = f"mongodb://wattflow:s3cr3t-pw@127.0.0.1:{port}/"
    service = Service(
        tmp_path / "service.log", "run", "-s",
        "--input", "mongodb", "-d", "powerapi", "-c", "hwpc", "--server-timeout-s", "0.3",
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
        env={**os.environ, "POWERAPI_INPUT_PULLER_MONGODB_URI": secret_uri},
    )  # fmt: skip
    with service:
        service.wait_for_log("server unavailable")
        log = service.stop(code=None)
    assert "server unavailable" in log
    assert "s3cr3t-pw" not in log
    assert "wattflow" not in log.split("server unavailable")[1].split("\n")[0]

    uri_file = tmp_path / "uri"
    uri_file.write_text(secret_uri.replace("mongodb://", "mongodb:/") + "\n")  # a typo
    bad = wattflow(
        "run", "--input", "mongodb", "--uri-file", str(uri_file), "-d", "p", "-c", "h",
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert bad.returncode == 2
    assert "not a MongoDB connection string" in bad.stderr
    assert "s3cr3t-pw" not in bad.stderr


def test_an_unreachable_server_is_one_short_line() -> None:
    """pymongo's own message ends with its whole topology description; users get the server
    and the reason, without the password."""
    from pymongo.errors import PyMongoError

    from wattflow.actors.connections import describe_driver_error

    port = free_port()  # nothing listens there
    client: MongoClient[dict[str, Any]] = MongoClient(
        f"mongodb://alice:s3cret@127.0.0.1:{port}/db", serverSelectionTimeoutMS=300
    )
    try:
        client.admin.command("ping")
    except PyMongoError as error:
        raw, described = str(error), describe_driver_error(error)
    else:
        raise AssertionError("a server answered on a free port")
    finally:
        client.close()
    assert "Topology Description" in raw
    assert described == f"127.0.0.1:{port}: [Errno 111] Connection refused"
    done = wattflow("runs", "list", "--store", f"mongodb://alice:s3cret@127.0.0.1:{port}/db")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"wattflow: error: store mongodb://***@127.0.0.1:{port}/db: "
        f"127.0.0.1:{port}: [Errno 111] Connection refused"
    )
