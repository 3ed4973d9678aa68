"""The InfluxDB outputs against Debian's influxd 1.6.7 and VictoriaMetrics, read back."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zlib import crc32

import orjson
import pytest
import urllib3

from wattflow.actors.pushers.influxdb import InfluxDBPusher, InfluxDBPusherConfig, query
from wattflow.formats import lineprotocol, powerapi
from wattflow.formats.reports import FormulaReport, PowerReport, Report

from .conftest import run_async, wattflow
from .servers import ServerProcess, free_port
from .servers_influx import influx_uri, influxd_server, start_influxd

START = datetime(2026, 2, 1, tzinfo=UTC)


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


def test_points_are_laid_out_as_powerapi_writes_them() -> None:
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
    millis = int(START.timestamp() * 1000)
    assert line.startswith("power_consumption,")
    assert line.endswith(f" power=12.5 {millis}")
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
    assert "k8s" not in only_scope
    assert ",scope=cpu," in only_scope


def test_the_v1_output_creates_the_database_and_reads_back_with_influxql(
    influxdb_server: ServerProcess, tmp_path: Path
) -> None:
    reports: list[Report] = list(power_reports(10))
    reports.append(
        FormulaReport(
            timestamp=START,
            sensor="node-1",
            target="model-1",
            metadata={"scope": "cpu", "layer_frequency": 2100, "error": 0.5, "coef": "[1, 2]"},
        )
    )
    source = write_jsonl(tmp_path / "power.jsonl", reports[:-1])
    formula_source = write_jsonl(tmp_path / "formula.jsonl", reports[-1:])
    uri = influx_uri(influxdb_server)
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--input", "jsonl", "--model", "FormulaReport", "--files", str(formula_source),
        "--output", "influxdb", "--uri", uri, "--db", "power", "--batch-size", "7",
        "--output", "influxdb", "--model", "FormulaReport", "--uri", uri, "--db", "power",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = query(uri, "power", "SELECT * FROM power_consumption")
    assert len(rows) == 30
    first = min(rows, key=lambda row: (str(row["time"]), str(row["target"])))
    assert first["time"] == int(START.timestamp() * 1000)
    assert (first["sensor"], first["target"], first["power"]) == ("node-1", "c0", 0.0)
    assert (first["scope"], first["socket"], first["ratio"]) == ("cpu", "0", "0.5")
    [model] = query(uri, "power", "SELECT * FROM formula_report")
    assert (model["target"], model["layer_frequency"], model["coef"]) == (
        "model-1",
        2100.0,
        "[1, 2]",
    )


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
    log = tmp_path / "service.log"
    with log.open("wb") as output:
        service = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wattflow.service",
                "run",
                "-s",
                "--input",
                "jsonl",
                "--model",
                "PowerReport",
                "--files",
                str(source),
                "--poll-interval-s",
                "0.05",
                "--output",
                "influxdb",
                "--uri",
                influx_uri(server),
                "--db",
                "power",
                "--server-timeout-s",
                "0.5",
                "--retry-for-s",
                "120",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    reports = power_reports(60)
    try:
        with source.open("a") as growing:
            for part in range(3):
                for report in reports[part * 60 : (part + 1) * 60]:
                    growing.write(powerapi.encode_json(report) + "\n")
                growing.flush()
                if part == 0:
                    time.sleep(1.0)  # written while the server is not there yet
                    start_influxd(server)
                    time.sleep(1.0)
                if part == 1:
                    server.stop(kill=True)
                    time.sleep(1.0)
                    start_influxd(server)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (
                    len(query(influx_uri(server), "power", "SELECT * FROM power_consumption"))
                    >= 180
                ):
                    break
            except (KeyError, urllib3.exceptions.HTTPError):
                pass
            time.sleep(0.2)
        service.send_signal(2)
        service.wait(timeout=60)
        rows = query(influx_uri(server), "power", "SELECT * FROM power_consumption")
    finally:
        service.kill()
        server.stop(kill=True)
    text = log.read_text()
    assert service.returncode == 0, text
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


def test_the_v2_output_writes_to_victoria_metrics(
    victoria_metrics_server: ServerProcess, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "power.jsonl", list(power_reports(5)))
    uri = influx_uri(victoria_metrics_server)
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb2", "--uri", uri, "--org", "org", "--db", "power",
        "--token", "t0ken", "--tags", "scope,socket", "--batch-size", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
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
    assert by_target["c1"]["timestamps"][0] == int(START.timestamp() * 1000)
    missing_port = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "influxdb2", "--uri", "http://127.0.0.1", "--org", "o", "--db", "b",
    )  # fmt: skip
    assert missing_port.returncode == 2
    assert "no port" in missing_port.stderr
