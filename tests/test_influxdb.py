"""The InfluxDB outputs against Debian's influxd 1.6.7 and VictoriaMetrics, read back.

Points are compared with PowerAPI 2.10's: its tag algorithm is transcribed below and its
client library (``influxdb-client``) encodes the point, so a line that differs is a layout that
differs. Then every output writes to a real server and the test reads back what it stored.
"""

from __future__ import annotations

import json
import math
import signal
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast
from zlib import crc32

import orjson
import pytest
import urllib3
from influxdb_client.client.write.point import Point
from influxdb_client.domain.write_precision import WritePrecision

from wattflow.actors.errors import PushUnavailable
from wattflow.actors.pushers.influxdb import InfluxDBPusher, InfluxDBPusherConfig, query
from wattflow.actors.pushers.influxdb2 import InfluxDB2Pusher, InfluxDB2PusherConfig
from wattflow.formats import lineprotocol, powerapi
from wattflow.formats.reports import (
    EventReport,
    FormulaReport,
    GPUDevice,
    GPUReport,
    MeterReport,
    PowerReport,
    Report,
    to_millis,
)

from .conftest import Service, run_async, wait_until, wattflow
from .servers import ServerProcess, free_port
from .servers_influx import (
    create_admin,
    influx_uri,
    influxd_server,
    start_influxd,
    start_victoria_metrics,
    victoria_metrics,
)

START = datetime(2026, 2, 1, tzinfo=UTC)
MILLIS = int(START.timestamp() * 1000)


def power_reports(ticks: int, targets: int = 3) -> list[PowerReport]:
    return [
        PowerReport(
            timestamp=START + timedelta(seconds=tick),
            sensor="node-1",
            target=f"c{index}",
            power=10.0 * index + tick / 10,
            metadata={"scope": "cpu", "socket": "0", "formula": "abc", "ratio": 0.5},
        )
        for tick in range(ticks)
        for index in range(targets)
    ]


def write_jsonl(path: Path, reports: list[Report]) -> Path:
    path.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    return path


def powerapi_line(report: PowerReport, selected: list[str]) -> str:
    """PowerAPI 2.10's ``PowerReport.to_influxdb``, transcribed, encoded by its client library.

    PowerAPI gives the time as ``str(timestamp)`` of a naive local datetime, which the client
    turns into the same instant; milliseconds are given here so the test does not depend on
    the machine's time zone.
    """
    metadata = report.metadata
    flat = {
        f"{parent}_{child}" if isinstance(value, dict) else parent: inner
        for parent, value in metadata.items()
        for child, inner in (value.items() if isinstance(value, dict) else {parent: value}.items())
    }
    sanitized = {name: name.translate(str.maketrans(".-/", "___")) for name in flat}
    counts = Counter(sanitized.values())
    names = {
        name: new if counts[new] == 1 else f"{new}_{crc32(name.encode()):x}"
        for name, new in sanitized.items()
    }
    tags = {names[name]: value for name, value in flat.items()}
    if selected:
        tags = {name: value for name, value in tags.items() if name in selected}
    record = {
        "measurement": "power_consumption",
        "tags": {"sensor": report.sensor, "target": report.target} | tags,
        "fields": {"power": report.power},
        "time": to_millis(report.timestamp),
    }
    line: str = Point.from_dict(
        record, write_precision=cast(WritePrecision, WritePrecision.MS)
    ).to_line_protocol()
    return line


METADATA_SHAPES: list[dict[str, Any]] = [
    {"scope": "cpu", "socket": "0", "formula": "abc", "ratio": 0.5},
    {"scope": "cpu", "socket": 0, "flag": True, "nothing": None, "empty": "", "list": [1, "a b"]},
    {
        "scope": "dram",
        "k8s": {"pod-name": "web 1", "app.kubernetes.io/name": "shop,eu=1"},
        "pod.name": "x",
        "pod-name": "y",
        "pod/name": "z",
        "deep": {"a": {"b": 1}},
    },
    {"sensor": "replaced", "tab\tkey": "new\nline", "end": "back\\"},
    {},
]


@pytest.mark.parametrize("selected", [[], ["scope", "k8s_pod_name", "socket", "missing"]])
@pytest.mark.parametrize("metadata", METADATA_SHAPES)
def test_power_points_are_the_lines_powerapi_writes(
    metadata: dict[str, Any], selected: list[str]
) -> None:
    for power in (12.5, 12.0, 1e-7):
        report = PowerReport(
            timestamp=START + timedelta(microseconds=1500),
            sensor="node 1",
            target="/docker/a,b=c",
            power=power,
            metadata=metadata,
        )
        expected = powerapi_line(report, selected)
        # Twice: the first line works the layout out, the second reuses it.
        assert lineprotocol.lines(report, selected, powerapi_layout=True) == [expected]
        assert lineprotocol.lines(report, tuple(selected), powerapi_layout=True) == [expected]
        assert expected.endswith(f" {MILLIS + 1}")


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_ratio_and_the_model_hash_are_fields_unless_tags_name_them(nested: bool) -> None:
    """The fast path (flat metadata) and the general one (a nested table) write the same."""
    extra: dict[str, Any] = {"k8s": {"pod": "web"}} if nested else {}
    report = PowerReport(
        timestamp=START,
        sensor="node-1",
        target="c1",
        power=12.5,
        metadata={"scope": "cpu", "socket": "0", "formula": "f00d", "ratio": 0.25, **extra},
    )
    pod = ",k8s_pod=web" if nested else ""
    tags = f"power_consumption{pod},scope=cpu,sensor=node-1,socket=0,target=c1"
    assert lineprotocol.lines(report) == [f'{tags} formula="f00d",power=12.5,ratio=0.25 {MILLIS}']
    # --tags picks the tags; ratio and formula stay fields unless named
    assert lineprotocol.lines(report, ["scope"]) == [
        f'power_consumption,scope=cpu,sensor=node-1,target=c1 formula="f00d",power=12.5,'
        f"ratio=0.25 {MILLIS}"
    ]
    assert lineprotocol.lines(report, ["scope", "ratio"]) == [
        f'power_consumption,ratio=0.25,scope=cpu,sensor=node-1,target=c1 formula="f00d",'
        f"power=12.5 {MILLIS}"
    ]
    # the node formula's watts per part are fields too; a missing value is left out
    node = report.model_copy(
        update={"metadata": {"scope": "node", "ratio": None, "cpu": 40.0, "gpu": 300.5}}
    )
    assert lineprotocol.lines(node) == [
        f"power_consumption,scope=node,sensor=node-1,target=c1 cpu=40,gpu=300.5,power=12.5 {MILLIS}"
    ]


def test_tag_names_are_flattened_and_sanitised_as_powerapi_names_them() -> None:
    report = PowerReport(
        timestamp=START,
        sensor="node 1",
        target="/docker/abc",
        power=12.5,
        metadata={
            "scope": "cpu",
            "k8s": {"pod-name": "web", "app.kubernetes.io/name": "shop"},
            "pod.name": "x",
            "pod-name": "y",
        },
    )
    [line] = lineprotocol.lines(report)
    assert line.startswith("power_consumption,")
    assert line.endswith(f" power=12.5 {MILLIS}")
    tags = dict(
        part.split("=", 1) for part in line.split(" power=")[0].replace("\\ ", "␣").split(",")[1:]
    )
    assert tags["sensor"] == "node␣1"
    assert tags["target"] == "/docker/abc"
    assert tags["k8s_pod_name"] == "web"
    assert tags["k8s_app_kubernetes_io_name"] == "shop"
    # Two names that sanitise alike get PowerAPI's CRC32 suffix, so both survive.
    assert tags[f"pod_name_{crc32(b'pod.name'):x}"] == "x"
    assert tags[f"pod_name_{crc32(b'pod-name'):x}"] == "y"
    [only_scope] = lineprotocol.lines(report, ["scope"])
    assert (
        only_scope
        == f"power_consumption,scope=cpu,sensor=node\\ 1,target=/docker/abc power=12.5 {MILLIS}"
    )


def test_the_other_kinds_have_their_own_measurements() -> None:
    model = FormulaReport(
        timestamp=START,
        sensor="s",
        target="model",
        metadata={"samples": 3, "error": 0, "ok": True, "name": 'a "b"\\', "coef": [1.5, 2]},
    )
    assert lineprotocol.lines(model) == [
        f'formula_report,sensor=s,target=model coef="[1.5,2]",error=0,name="a \\"b\\"\\\\",'
        f"ok=true,samples=3 {MILLIS}"
    ]
    gpu = GPUReport(
        timestamp=START,
        sensor="s",
        target="all",
        devices={"0": GPUDevice(power=70000.0, util_gpu=50.0), "1": GPUDevice(temperature=40)},
    )
    assert lineprotocol.lines(gpu) == [
        f"gpu,device=0,sensor=s,target=all power=70000,util_gpu=50 {MILLIS}",
        f"gpu,device=1,sensor=s,target=all temperature=40 {MILLIS}",
    ]
    meter = MeterReport(timestamp=START, sensor="m", target="all", channels={"d0c1": 1500.5})
    assert lineprotocol.lines(meter) == [
        f"meter,channel=d0c1,sensor=m,target=all power_mw=1500.5 {MILLIS}"
    ]
    event = EventReport(timestamp=START, sensor="app", target="all", event="epoch_begin")
    assert lineprotocol.lines(event) == [
        f'event,sensor=app,target=all event="epoch_begin" {MILLIS}'
    ]
    with pytest.raises(ValueError, match="power is nan"):
        # A report a formula built (unvalidated: inputs refuse a power that is not finite).
        lineprotocol.lines(
            PowerReport.model_construct(timestamp=START, sensor="s", target="t", power=math.nan)
        )


def test_a_request_never_holds_more_points_than_the_batch_size() -> None:
    def gpus(count: int) -> GPUReport:
        devices = {str(i): GPUDevice(power=1.0) for i in range(count)}
        return GPUReport(timestamp=START, sensor="s", target="all", devices=devices)

    batch: list[Report] = [gpus(3), gpus(3), gpus(2), gpus(9), gpus(1)]
    found, refused = lineprotocol.requests(batch, (), 5)
    assert refused == []
    assert [len(points) for _, points in found] == [3, 5, 9, 1]
    assert [reports for reports, _ in found] == [batch[:1], batch[1:3], batch[3:4], batch[4:]]


def show(uri: str, statement: str, database: str = "power") -> list[list[Any]]:
    """The values of an InfluxQL ``SHOW`` statement (its first series)."""
    response = urllib3.request("GET", f"{uri}/query", fields={"db": database, "q": statement})
    series = orjson.loads(response.data)["results"][0].get("series", [])
    return [values for found in series for values in found.get("values", [])]


def test_the_v1_output_creates_the_database_and_reads_back_with_influxql(
    influxdb_server: ServerProcess, tmp_path: Path
) -> None:
    """Through the real command line: PowerAPI's tags, --tags, FormulaReports, a new database."""
    reports: list[Report] = list(power_reports(10))
    reports.append(
        PowerReport(
            timestamp=START,
            sensor="node-1",
            target="pod-1",
            power=3.5,
            metadata={"scope": "cpu", "k8s": {"pod.name": "web"}, "a-b": "1", "a.b": "2"},
        )
    )
    model = FormulaReport(
        timestamp=START,
        sensor="node-1",
        target="model-1",
        metadata={"scope": "cpu", "layer_frequency": 2100, "error": 0.5, "coef": [1, 2.5]},
    )
    source = write_jsonl(tmp_path / "power.jsonl", reports)
    formula_source = write_jsonl(tmp_path / "formula.jsonl", [model])
    uri = influx_uri(influxdb_server)
    assert ["power"] not in show(uri, "SHOW DATABASES")
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--input", "jsonl", "--model", "FormulaReport", "--files", str(formula_source),
        "--output", "influxdb", "--uri", uri, "--db", "power", "--batch-size", "7",
        "--output", "influxdb", "--name", "selected", "--uri", uri, "--db", "selected",
        "--tags", "scope,k8s_pod_name",
        "--output", "influxdb", "--model", "FormulaReport", "--uri", uri, "--db", "power",
        "--output", "influxdb", "--name", "compat", "--uri", uri, "--db", "powerapi",
        "--points-compat", "powerapi-2.10",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ["power"] in show(uri, "SHOW DATABASES")
    rows = query(uri, "power", "SELECT * FROM power_consumption")
    assert len(rows) == 31
    first = min(rows, key=lambda row: (str(row["time"]), str(row["target"])))
    assert first["time"] == MILLIS
    assert (first["sensor"], first["target"], first["power"]) == ("node-1", "c0", 0.0)
    assert (first["scope"], first["socket"], first["ratio"]) == ("cpu", "0", 0.5)
    assert first["formula"] == "abc"
    tag_keys = {key for [key] in show(uri, "SHOW TAG KEYS FROM power_consumption")}
    assert tag_keys == {
        "sensor", "target", "scope", "socket", "k8s_pod_name",
        f"a_b_{crc32(b'a-b'):x}", f"a_b_{crc32(b'a.b'):x}",
    }  # fmt: skip
    fields = show(uri, "SHOW FIELD KEYS FROM power_consumption")
    assert sorted(fields) == [["formula", "string"], ["power", "float"], ["ratio", "float"]]
    # PowerAPI 2.10's layout, kept on request: every metadata key a tag, ratio as text
    compat_tags = {key for [key] in show(uri, "SHOW TAG KEYS FROM power_consumption", "powerapi")}
    assert compat_tags == tag_keys | {"formula", "ratio"}
    [compat_first] = query(
        uri,
        "powerapi",
        f"SELECT * FROM power_consumption WHERE target = 'c0' AND time = {MILLIS}ms",
    )
    assert (compat_first["ratio"], compat_first["power"]) == ("0.5", 0.0)
    [pod] = query(uri, "power", "SELECT * FROM power_consumption WHERE target = 'pod-1'")
    assert (pod["k8s_pod_name"], pod["power"]) == ("web", 3.5)
    selected = query(uri, "selected", "SELECT * FROM power_consumption")
    assert len(selected) == 31
    assert {key for [key] in show(uri, "SHOW TAG KEYS FROM power_consumption", "selected")} == {
        "sensor", "target", "scope", "k8s_pod_name",
    }  # fmt: skip
    [written] = query(uri, "power", "SELECT * FROM formula_report")
    assert written["time"] == MILLIS
    assert (written["target"], written["layer_frequency"], written["error"]) == (
        "model-1",
        2100.0,
        0.5,
    )
    assert json.loads(str(written["coef"])) == [1, 2.5]
    assert written["scope"] == "cpu"


def write_requests(uri: str) -> int:
    """How many ``/write`` requests influxd has answered, from its own statistics."""
    stats = orjson.loads(urllib3.request("GET", f"{uri}/debug/vars").data)
    return sum(
        value["values"]["writeReq"] for key, value in stats.items() if key.startswith("httpd")
    )


def test_batches_are_cut_into_requests_of_batch_size_points(
    influxdb_server: ServerProcess,
) -> None:
    uri = influx_uri(influxdb_server)
    urllib3.request("POST", f"{uri}/query", fields={"q": "CREATE DATABASE power"})
    before = write_requests(uri)
    config = InfluxDBPusherConfig(uri=uri, db="power", batch_size=7)
    assert write_in_process(config, [list(power_reports(10))]) == []
    assert write_requests(uri) - before == 5  # 30 points, 7 a request
    assert len(query(uri, "power", "SELECT * FROM power_consumption")) == 30


def write_in_process(config: InfluxDBPusherConfig, batches: list[list[Report]]) -> list[Any]:
    pusher = InfluxDBPusher(config)

    async def go() -> list[Any]:
        await pusher.check()
        await pusher.open()
        refused: list[Any] = []
        for batch in batches:
            refused += await pusher.write(batch)
        await pusher.close()
        return refused

    return run_async(go())


def test_a_refused_write_is_a_dead_letter_and_the_rest_is_written(
    influxdb_server: ServerProcess,
) -> None:
    def model(second: int, error: float | str) -> FormulaReport:
        return FormulaReport(
            timestamp=START + timedelta(seconds=second),
            sensor="node-1",
            target="model-1",
            metadata={"error": error},
        )

    uri = influx_uri(influxdb_server)
    # A text where the earlier points have a number: InfluxDB refuses that request (400).
    batch: list[Report] = [model(0, 0.5), model(1, "high"), model(2, 0.7)]
    config = InfluxDBPusherConfig(uri=uri, db="power", model="FormulaReport", batch_size=1)
    refused = write_in_process(config, [batch])
    assert [report for report, _ in refused] == [batch[1]]
    assert "server refused the write (400)" in refused[0][1]
    assert "field type conflict" in refused[0][1]
    rows = query(uri, "power", "SELECT * FROM formula_report")
    assert [row["error"] for row in rows] == [0.5, 0.7]


def test_every_point_arrives_once_across_an_outage_and_a_late_start(tmp_path: Path) -> None:
    """influxd is down at start, comes up, is killed mid-stream and comes back."""
    server = influxd_server(tmp_path / "influxd")
    source = tmp_path / "power.jsonl"
    source.write_text("")
    service = Service(
        tmp_path / "service.log", "run", "-s",
        "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--poll-interval-s", "0.05",
        "--output", "influxdb", "--uri", influx_uri(server), "--db", "power",
        "--server-timeout-s", "0.5", "--retry-for-s", "120",
    )  # fmt: skip
    reports = power_reports(60)

    def stored() -> int:
        try:
            return len(query(influx_uri(server), "power", "SELECT * FROM power_consumption"))
        except (KeyError, urllib3.exceptions.HTTPError):  # no database (yet), or no server
            return 0

    def append(part: int) -> None:
        with source.open("a") as growing:
            for report in reports[part * 60 : (part + 1) * 60]:
                growing.write(powerapi.encode_json(report) + "\n")

    try:
        with service:
            append(0)  # written while the server is not there yet: the output retries
            service.wait_for_log("retrying")
            start_influxd(server)
            wait_until(lambda: service.alive() and stored() >= 60, 60, "the first 60 points")
            append(1)
            wait_until(lambda: service.alive() and stored() >= 120, 60, "120 points")
            server.stop(kill=True)
            retries = service.text().count("retrying")
            append(2)  # written while the server is down: the output retries again
            service.wait_for_log("retrying", count=retries + 1)
            start_influxd(server)
            wait_until(lambda: service.alive() and stored() >= 180, 60, "180 points")
            text = service.stop(signal.SIGINT)
        rows = query(influx_uri(server), "power", "SELECT * FROM power_consumption")
    finally:
        server.stop(kill=True)
    assert "retrying" in text
    keys = [(row["time"], row["target"]) for row in rows]
    assert len(keys) == len(set(keys)) == 180
    assert sorted(row["power"] for row in rows) == sorted(r.power for r in reports)  # type: ignore[type-var]


def test_the_password_never_appears_in_logs(influxdb_server: ServerProcess, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "power.jsonl", list(power_reports(2)))
    secret = tmp_path / "password"
    secret.write_text("hunter2-secret\n")
    done = wattflow(
        "run", "-v", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb", "--uri", f"http://127.0.0.1:{free_port()}", "--db", "power",
        "--user", "admin", "--password-file", str(secret), "--retry-for-s", "1",
        "--server-timeout-s", "0.2",
    )  # fmt: skip
    assert done.returncode == 1
    assert "could not be written" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    bad = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb", "--uri", influx_uri(influxdb_server), "--db", "power",
        "--password", "hunter2-secret",
    )  # fmt: skip
    assert bad.returncode == 2
    assert "a password needs --user" in bad.stderr
    assert "hunter2" not in bad.stderr


def vm_write_requests(uri: str) -> int:
    """How many InfluxDB writes VictoriaMetrics has taken, from its own metrics."""
    metrics = urllib3.request("GET", f"{uri}/metrics").data.decode()
    return sum(
        int(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('vm_http_requests_total{path="/influx/write"')
    )


def test_the_v2_output_writes_to_victoria_metrics(
    victoria_metrics_server: ServerProcess, tmp_path: Path
) -> None:
    """PowerAPI's influxdb2 flags, --port appended to a uri without one, --tags, --batch-size."""
    source = write_jsonl(tmp_path / "power.jsonl", list(power_reports(5)))
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    uri = influx_uri(victoria_metrics_server)
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb2", "--uri", "http://127.0.0.1",
        "-p", str(victoria_metrics_server.port), "-g", "org", "-d", "power",
        "--token-file", str(token), "-t", "scope,socket", "--batch-size", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert vm_write_requests(uri) == 4  # 15 points, 4 a request
    urllib3.request("GET", f"{uri}/internal/force_flush")
    response = urllib3.request(
        "GET", f"{uri}/api/v1/export", fields={"match[]": '{__name__="power_consumption_power"}'}
    )
    series = [orjson.loads(line) for line in response.data.splitlines()]
    assert len(series) == 3
    labels = series[0]["metric"]
    assert set(labels) == {"__name__", "sensor", "target", "scope", "socket"}
    by_target = {s["metric"]["target"]: s for s in series}
    assert by_target["c1"]["values"] == pytest.approx([10.0 + t / 10 for t in range(5)])
    assert by_target["c1"]["timestamps"] == [MILLIS + 1000 * t for t in range(5)]
    missing_port = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb2", "--uri", "http://127.0.0.1", "--org", "o", "--db", "b",
    )  # fmt: skip
    assert missing_port.returncode == 2
    assert "no port" in missing_port.stderr
    both = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb2", "--uri", uri, "--org", "o", "--db", "b",
        "--token", "t0ken", "--token-file", str(token),
    )  # fmt: skip
    assert both.returncode == 2
    assert "one of --token, --token-file" in both.stderr


def test_a_refused_write_leaves_the_pipeline_running(
    influxdb_server: ServerProcess, tmp_path: Path
) -> None:
    """Through the service: the refused request's report is a dead letter; the rest is written."""
    models: list[Report] = [
        FormulaReport(
            timestamp=START + timedelta(seconds=second),
            sensor="node-1",
            target="model-1",
            metadata={"error": "high" if second == 3 else second / 10},
        )
        for second in range(8)
    ]
    source = write_jsonl(tmp_path / "formula.jsonl", models)
    letters = tmp_path / "dead.jsonl"
    uri = influx_uri(influxdb_server)
    urllib3.request("POST", f"{uri}/query", fields={"q": "CREATE DATABASE power"})
    # The first point fixes the field's type (float); the text at second 3 conflicts with it.
    assert (
        write_in_process(
            InfluxDBPusherConfig(uri=uri, db="power", model="FormulaReport"), [models[:1]]
        )
        == []
    )
    done = wattflow(
        "run", "--input", "jsonl", "--model", "FormulaReport", "--files", str(source),
        "--output", "influxdb", "--model", "FormulaReport", "--uri", uri, "--db", "power",
        "--batch-size", "1", "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 1
    assert "1 reports could not be written" in done.stderr
    [letter] = [json.loads(line) for line in letters.read_text().splitlines()]
    assert letter["payload"]["metadata"] == {"error": "high"}
    assert "server refused the write (400)" in letter["reason"]
    assert "field type conflict" in letter["reason"]
    rows = query(uri, "power", "SELECT * FROM formula_report")
    assert [row["error"] for row in rows] == [0.0, 0.1, 0.2, 0.4, 0.5, 0.6, 0.7]


def test_credentials_from_the_environment_or_a_file_and_never_shown(
    tmp_path: Path,
) -> None:
    """On an influxd with auth: the right password writes, a wrong one is refused, unseen."""
    server = influxd_server(tmp_path / "influxd", auth=True)
    start_influxd(server)
    try:
        create_admin(server, "admin", "s3cret-right")
        uri = influx_uri(server)
        source = write_jsonl(tmp_path / "power.jsonl", list(power_reports(2)))
        run = (
            "run", "-v", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
            "--output", "influxdb", "--uri", uri, "--db", "power", "--user", "admin",
        )  # fmt: skip
        done = wattflow(*run, env={"POWERAPI_OUTPUT_PUSHER_INFLUXDB_PASSWORD": "s3cret-right"})
        assert done.returncode == 0, done.stderr
        assert "s3cret" not in done.stderr + done.stdout
        wrong = tmp_path / "password"
        wrong.write_text("s3cret-wrong\n")
        refused = wattflow(*run, "--password-file", str(wrong), "--retry-for-s", "1")
        assert refused.returncode == 1
        assert "not authorised (401)" in refused.stderr
        assert "s3cret" not in refused.stderr + refused.stdout
        check = urllib3.request(
            "GET",
            f"{uri}/query",
            fields={"db": "power", "q": "SELECT count(power) FROM power_consumption"},
            headers=urllib3.make_headers(basic_auth="admin:s3cret-right"),
        )
        assert orjson.loads(check.data)["results"][0]["series"][0]["values"][0][1] == 6
    finally:
        server.stop(kill=True)


def write_v2(config: InfluxDB2PusherConfig, batch: list[Report]) -> list[Any]:
    pusher = InfluxDB2Pusher(config)

    async def go() -> list[Any]:
        await pusher.check()
        await pusher.open()
        try:
            return await pusher.write(batch)
        finally:
            await pusher.close()

    return run_async(go())


def test_the_v2_output_waits_for_a_late_server_and_refuses_what_it_rejects(
    tmp_path: Path, influxdb_server: ServerProcess
) -> None:
    server = victoria_metrics(tmp_path / "vm")
    uri = influx_uri(server)
    token = tmp_path / "token"
    token.write_text("t0ken-secret\n")
    config = InfluxDB2PusherConfig(uri=uri, org="o", db="power", token_file=token)
    batch: list[Report] = list(power_reports(2))
    with pytest.raises(PushUnavailable) as unavailable:
        write_v2(config, batch)
    assert "t0ken" not in str(unavailable.value)
    start_victoria_metrics(server)
    try:
        assert write_v2(config, batch) == []
        urllib3.request("GET", f"{uri}/internal/force_flush")
        response = urllib3.request(
            "GET", f"{uri}/api/v1/export", fields={"match[]": "power_consumption_power"}
        )
        assert sum(len(orjson.loads(line)["values"]) for line in response.data.splitlines()) == 6
    finally:
        server.stop(kill=True)
    # influxd 1.6.7 has no /api/v2/write: a 404 that is no missing bucket, so no retry helps.
    old = InfluxDB2PusherConfig(uri=influx_uri(influxdb_server), org="o", db="b", token_file=token)
    refused = write_v2(old, batch)
    assert [report for report, _ in refused] == batch
    assert "server refused the write (404)" in refused[0][1]
    assert "t0ken" not in refused[0][1]


def drifting_ratio(count: int) -> list[Report]:
    """One container's reports as SmartWatts writes them: its ratio changes every tick and its
    model (the hash) every ten."""
    return [
        PowerReport(
            timestamp=START + timedelta(seconds=tick),
            sensor="node-1",
            target="c1",
            power=10.0 + tick,
            metadata={
                "scope": "cpu",
                "socket": "0",
                "formula": f"model-{tick // 10}",
                "ratio": 0.1 + tick / 1000,
            },
        )
        for tick in range(count)
    ]


def test_one_container_is_one_influxdb_series_whatever_its_ratio(
    influxdb_server: ServerProcess, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "power.jsonl", drifting_ratio(40))
    uri = influx_uri(influxdb_server)
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb", "--uri", uri, "--db", "power",
        "--output", "influxdb", "--name", "compat", "--uri", uri, "--db", "powerapi",
        "--points-compat", "powerapi-2.10",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(show(uri, "SHOW SERIES FROM power_consumption")) == 1
    assert len(show(uri, "SHOW SERIES FROM power_consumption", "powerapi")) == 40
    rows = query(uri, "power", "SELECT ratio, formula, power FROM power_consumption")
    assert [row["ratio"] for row in rows] == pytest.approx([0.1 + t / 1000 for t in range(40)])
    assert [row["formula"] for row in rows] == [f"model-{t // 10}" for t in range(40)]


def test_victoria_metrics_keeps_one_series_per_container_too(
    victoria_metrics_server: ServerProcess, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "power.jsonl", drifting_ratio(40))
    uri = influx_uri(victoria_metrics_server)
    common = ("--output", "influxdb2", "--uri", uri, "--org", "org", "--db", "power")
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        *common, *common, "--name", "chosen", "--tags", "scope,formula,ratio",
        *common, "--name", "compat", "--points-compat", "powerapi-2.10",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    urllib3.request("GET", f"{uri}/internal/force_flush")

    def exported(name: str) -> list[dict[str, Any]]:
        response = urllib3.request(
            "GET", f"{uri}/api/v1/export", fields={"match[]": f'{{__name__="{name}"}}'}
        )
        return [orjson.loads(line) for line in response.data.splitlines()]

    power = exported("power_consumption_power")
    # the default output: one series (ratio a field of its own); --tags naming ratio and
    # formula, and PowerAPI 2.10's layout (socket too): 40 each
    by_labels = Counter(("ratio" in s["metric"], "socket" in s["metric"]) for s in power)
    assert by_labels == {(False, True): 1, (True, False): 40, (True, True): 40}
    [plain] = [series for series in power if "ratio" not in series["metric"]]
    assert set(plain["metric"]) == {"__name__", "sensor", "target", "scope", "socket"}
    assert plain["values"] == [10.0 + t for t in range(40)]
    [ratio] = exported("power_consumption_ratio")
    assert ratio["values"] == pytest.approx([0.1 + t / 1000 for t in range(40)])
    # a string field: VictoriaMetrics keeps a 0 in its place, still one series
    [formula] = exported("power_consumption_formula")
    assert formula["values"] == [0] * 40
