"""The OpenTSDB output against a real VictoriaMetrics taking OpenTSDB's HTTP ``/api/put``.

PowerAPI 2.10 writes through ``opentsdb-py`` 0.6 (HTTP, gzip, ``/api/put?details=true``); its
``save`` is transcribed below over that client's own ``send``, which builds the point, so a
point that differs from PowerAPI's is a layout that differs. Then the service writes to
VictoriaMetrics and the test reads back what it stored through VictoriaMetrics' export API.
"""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
import urllib3
from opentsdb import TSDBClient  # type: ignore[import-untyped]
from opentsdb.protocols import TSDBConnectProtocols  # type: ignore[import-untyped]

from wattflow.actors.errors import PushError, PushUnavailable
from wattflow.actors.pushers.opentsdb import OpenTSDBPusher, OpenTSDBPusherConfig, point
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report

from .conftest import run_async, wattflow
from .servers import ServerProcess, free_port
from .servers_influx import influx_uri, start_victoria_metrics, victoria_metrics

START = datetime(2026, 2, 1, tzinfo=UTC)
MILLIS = int(START.timestamp() * 1000)


def estimates(ticks: int) -> list[PowerReport]:
    """SmartWatts' shape: per tick (half a second apart), cpu and dram of two sockets for two
    containers."""
    return [
        PowerReport(
            timestamp=START + timedelta(milliseconds=500 * tick),
            sensor="node-1",
            target=f"c{container}",
            power=10.0 * container + socket + (5.0 if scope == "dram" else 0.0) + tick / 10,
            metadata={"scope": scope, "socket": str(socket), "formula": "f0", "ratio": 0.5},
        )
        for tick in range(ticks)
        for container in (1, 2)
        for scope in ("cpu", "dram")
        for socket in (0, 1)
    ]


def powerapi_point(report: PowerReport, metric_name: str) -> dict[str, Any]:
    """PowerAPI 2.10's ``OpenTSDB.save``, transcribed, its point built by opentsdb-py's send.

    PowerAPI's timestamps are naive (local time read as UTC by ``replace``); the aware UTC
    time is given here, so the test does not depend on the machine's time zone.
    """
    client = TSDBClient(run_at_once=False, protocol=TSDBConnectProtocols.HTTP)
    sent: dict[str, Any] = client.send(
        metric_name,
        report.power,
        timestamp=int(report.timestamp.replace(tzinfo=UTC).timestamp()),
        host=report.target,
    )
    return sent


def test_points_are_powerapis_under_compat_and_keep_every_estimate_by_default() -> None:
    reports = estimates(2)
    compat = OpenTSDBPusherConfig(
        uri="127.0.0.1", metric_name="power", points_compat="powerapi-2.10"
    )
    for report in reports:
        assert point(report, compat) == powerapi_point(report, "power")
    default = OpenTSDBPusherConfig(uri="127.0.0.1", metric_name="power")
    points = [point(report, default) for report in reports]
    assert points[1] == {
        "metric": "power",
        "timestamp": MILLIS,
        "value": 11.0,
        "tags": {"host": "c1", "sensor": "node-1", "scope": "cpu", "socket": "1"},
    }
    keys = {(p["timestamp"], tuple(sorted(p["tags"].items()))) for p in points}
    assert len(keys) == len(reports)  # no two estimates share a series and a time
    compat_keys = {(p["timestamp"], p["tags"]["host"]) for p in map(powerapi_point_of, reports)}
    assert len(compat_keys) == 2  # PowerAPI's: 16 estimates on 2 series and one second


def powerapi_point_of(report: PowerReport) -> dict[str, Any]:
    return powerapi_point(report, "power")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"metric_name": "power consumption"}, "letters, digits"),
        ({"metric_name": "power", "model": "HWPCReport"}, "writes PowerReports"),
        ({"metric_name": "power", "uri": "ftp://h"}, "http:// or https://"),
        ({"metric_name": "power", "uri": "http://h:4242", "port": 4343}, "give one"),
    ],
)
def test_bad_settings_say_why(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OpenTSDBPusherConfig.model_validate({"uri": "127.0.0.1", **settings})


def test_the_address_is_built_as_opentsdb_py_builds_it() -> None:
    def url(**settings: Any) -> str:
        return OpenTSDBPusherConfig(metric_name="m", **settings).base_url()

    assert url(uri="tsdb.example", port=4343) == "http://tsdb.example:4343"
    assert url(uri="tsdb.example") == "http://tsdb.example:4242"
    assert url(uri="https://tsdb.example/", port=443) == "https://tsdb.example:443"
    assert url(uri="http://tsdb.example:80") == "http://tsdb.example:80"


@pytest.fixture
def opentsdb_victoria(tmp_path: Path) -> Iterator[tuple[ServerProcess, int]]:
    """VictoriaMetrics with OpenTSDB's HTTP API on a port of its own."""
    server = victoria_metrics(tmp_path / "victoria-metrics")
    put_port = free_port()
    server.command.append(f"-opentsdbHTTPListenAddr=127.0.0.1:{put_port}")
    start_victoria_metrics(server)
    try:
        yield server, put_port
    finally:
        server.stop(kill=True)


def exported(server: ServerProcess, metric: str) -> list[dict[str, Any]]:
    uri = influx_uri(server)
    urllib3.request("GET", f"{uri}/internal/force_flush")
    response = urllib3.request(
        "GET", f"{uri}/api/v1/export", fields={"match[]": f'{{__name__="{metric}"}}'}
    )
    return [orjson.loads(line) for line in response.data.splitlines()]


def test_the_service_writes_to_victoria_metrics_with_powerapis_flags(
    opentsdb_victoria: tuple[ServerProcess, int], tmp_path: Path
) -> None:
    server, put_port = opentsdb_victoria
    reports = estimates(3)
    source = tmp_path / "power.jsonl"
    source.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "opentsdb", "-u", "127.0.0.1", "-p", str(put_port),
        "--metric-name", "power", "--batch-size", "7",
        "--output", "opentsdb", "--uri", f"http://127.0.0.1:{put_port}",
        "--metric-name", "power_compat", "--points-compat", "powerapi-2.10", "-n", "compat",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    series = exported(server, "power")
    assert len(series) == 8  # 2 containers x 2 scopes x 2 sockets
    by_labels = {tuple(sorted(s["metric"].items())): s for s in series}
    key = (
        ("__name__", "power"),
        ("host", "c2"),
        ("scope", "dram"),
        ("sensor", "node-1"),
        ("socket", "1"),
    )
    assert by_labels[key]["values"] == pytest.approx([26.0, 26.1, 26.2])
    assert by_labels[key]["timestamps"] == [MILLIS, MILLIS + 500, MILLIS + 1000]
    compat = exported(server, "power_compat")
    assert {tuple(sorted(s["metric"])) for s in compat} == {("__name__", "host")}
    assert len(compat) == 2
    for one in compat:  # whole seconds: the ticks half a second apart fall on two of them
        assert set(one["timestamps"]) == {MILLIS, MILLIS + 1000}


class RefusingOpenTSDB(http.server.BaseHTTPRequestHandler):
    """OpenTSDB's answers VictoriaMetrics does not give: a 400 with ``details`` naming the
    points it refused (those of target ``bad``), then a 503, then a 401."""

    answers: ClassVar[list[int]] = []
    bodies: ClassVar[list[list[dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = orjson.loads(gzip.decompress(self.rfile.read(int(self.headers["Content-Length"]))))
        type(self).bodies.append(body)
        status = type(self).answers.pop(0) if type(self).answers else 200
        failed = [p for p in body if p["tags"]["host"] == "bad"]
        details = {
            "success": len(body) - len(failed),
            "failed": len(failed),
            "errors": [{"datapoint": p, "error": "Invalid tag value"} for p in failed],
        }
        data = orjson.dumps(details) if status in (200, 400) else b"busy"
        self.send_response(400 if failed and status == 200 else status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_refused_points_are_dead_letters_and_the_rest_is_written() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RefusingOpenTSDB)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        config = OpenTSDBPusherConfig(
            uri="127.0.0.1", port=httpd.server_address[1], metric_name="power", batch_size=2
        )
        pusher = OpenTSDBPusher(config)
        reports: list[Report] = [
            report.model_copy(update={"target": "bad"}) if index == 1 else report
            for index, report in enumerate(estimates(1)[:3])
        ]

        async def scenario() -> list[tuple[Report, str]]:
            await pusher.open()
            refused = await pusher.write(reports)
            RefusingOpenTSDB.answers[:] = [503]
            with pytest.raises(PushUnavailable, match="503"):
                await pusher.write(reports[:1])
            RefusingOpenTSDB.answers[:] = [401]
            with pytest.raises(PushError, match="not authorised"):
                await pusher.write(reports[:1])
            await pusher.close()
            return refused

        refused = run_async(scenario())
    finally:
        httpd.shutdown()
    assert [(r.target, reason.split(": ")[-1]) for r, reason in refused] == [
        ("bad", "Invalid tag value")
    ]
    assert [len(body) for body in RefusingOpenTSDB.bodies[:2]] == [2, 1]  # --batch-size 2


def test_an_absent_server_is_retried() -> None:
    config = OpenTSDBPusherConfig(uri="127.0.0.1", port=free_port(), metric_name="power")
    pusher = OpenTSDBPusher(config)

    async def scenario() -> None:
        await pusher.open()
        with pytest.raises(PushUnavailable):
            await pusher.write(list(estimates(1)[:1]))

    run_async(scenario())


def test_check_finds_a_server_that_takes_puts(
    opentsdb_victoria: tuple[ServerProcess, int],
) -> None:
    """VictoriaMetrics' listener refuses /api/version (OpenTSDB's), and takes an empty put."""
    _, put_port = opentsdb_victoria
    config = OpenTSDBPusherConfig(uri="127.0.0.1", port=put_port, metric_name="power")
    assert "takes /api/put" in run_async(OpenTSDBPusher(config).probe())
    absent = OpenTSDBPusherConfig(uri="127.0.0.1", port=free_port(), metric_name="power")
    with pytest.raises(PushUnavailable):
        run_async(OpenTSDBPusher(absent).probe())
