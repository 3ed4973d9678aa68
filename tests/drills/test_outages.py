"""A database output's server goes away mid-run and comes back: nothing is lost or doubled.

The service follows a JSON Lines file of PowerReports into InfluxDB, or into MongoDB
(SecantusDB), with the default ``--retry-for-s`` (300 s). Reports come before the outage, during
it and after it; the server is killed (SIGKILL, as a crash) and started again on the same
storage once the output has retried a few times. Every report must then be in the database
once, none dead-lettered, and the service must drain and exit 0 on SIGTERM.

Each drill prints how long the output took to write its backlog once the server answered
again (its next retry comes within the 5 s the backoff grows to): figures for
docs/operations.md, not asserted, since a loaded machine makes them longer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import urllib3
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from wattflow.actors.pushers.influxdb import query

from ..conftest import Service, drained_ledger, wait_until
from ..servers import ServerProcess, free_port, mongodb_command, mongodb_uri
from ..servers_influx import influx_uri, influxd_server, start_influxd
from .test_drain import append, dead_letters, power_reports

RETRIES = 5
"""Retries the output makes against the dead server before it comes back."""
WAIT_S = 60.0


def metric(http_port: int, name: str, output: str) -> float:
    """One of the service's per-output metrics (0 while the page does not answer)."""
    try:
        page = urllib3.request("GET", f"http://127.0.0.1:{http_port}/metrics", timeout=2)
    except urllib3.exceptions.HTTPError:
        return 0.0
    found = re.search(rf'^{name}{{output="{output}"}} (\S+)$', page.data.decode(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def following(tmp_path: Path, source: Path, http_port: int, *output: str) -> Service:
    source.touch()
    return Service(
        tmp_path / "service.log", "run", "-s", "--http-port", str(http_port),
        "--dead-letters", str(tmp_path / "dead.jsonl"),
        "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--poll-interval-s", "0.05",
        *output,
    )  # fmt: skip


def outage(
    tmp_path: Path,
    server: ServerProcess,
    restart: Callable[[], None],
    stored: Callable[[], list[float]],
    output: list[str],
    name: str,
) -> None:
    """30 reports before the outage, 30 during, 30 after; the checks of the module docstring."""
    source = tmp_path / "power.jsonl"
    before, during, after = (power_reports(30, first=start) for start in (0, 30, 60))
    http_port = free_port()
    with following(tmp_path, source, http_port, *output) as service:
        append(source, before)
        wait_until(lambda: service.alive() and len(stored()) == 30, WAIT_S, "30 before")
        server.stop(kill=True)
        down = time.monotonic()
        append(source, during)
        wait_until(
            lambda: (
                service.alive()
                and metric(http_port, "wattflow_output_retries_total", name) >= RETRIES
            ),
            WAIT_S,
            f"{RETRIES} retries against the dead server",
        )
        assert metric(http_port, "wattflow_output_unreachable", name) == 1.0
        restart()
        back = time.monotonic()
        outage_s = back - down
        wait_until(lambda: service.alive() and len(stored()) == 60, WAIT_S, "the backlog")
        recovered_s = time.monotonic() - back
        append(source, after)
        wait_until(lambda: service.alive() and len(stored()) == 90, WAIT_S, "30 after")
        retries = metric(http_port, "wattflow_output_retries_total", name)
        outages = metric(http_port, "wattflow_output_outages_total", name)
        log = service.stop(timeout_s=WAIT_S)
    print(
        f"\n{name}: down {outage_s:.1f} s; backlog of 30 written {recovered_s:.2f} s after the"
        " server answered again;"
        f" {retries:.0f} retries, {outages:.0f} outage(s) counted"
    )
    ledger = drained_ledger(log)
    assert (ledger["entered"], ledger["delivered"], ledger["dead_out"]) == (90, 90, 0)
    assert dead_letters(tmp_path) == []
    assert sorted(stored()) == [r.power for r in (*before, *during, *after)]
    assert outages >= 1
    assert "Traceback" not in log


def test_influxdb_down_and_back(tmp_path: Path) -> None:
    server = influxd_server(tmp_path / "influxd")
    start_influxd(server)

    def stored() -> list[float]:
        try:
            rows = query(influx_uri(server), "power", "SELECT * FROM power_consumption")
        except (KeyError, urllib3.exceptions.HTTPError):  # no database yet, or down
            return []
        return [float(row["power"]) for row in rows]  # type: ignore[arg-type]

    try:
        outage(
            tmp_path, server, lambda: start_influxd(server), stored,
            ["--output", "influxdb", "--uri", influx_uri(server), "--db", "power",
             "--server-timeout-s", "0.5", "--batch-size", "10"],
            "pusher_influxdb",
        )  # fmt: skip
    finally:
        server.stop(kill=True)


def test_mongodb_killed_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(
        mongodb_command(port, tmp_path / "mongodb"), port, tmp_path / "mongodb.log", "mongodb"
    )
    server.start()
    uri = mongodb_uri(server)

    def stored() -> list[float]:
        client: MongoClient[dict[str, object]] = MongoClient(uri, serverSelectionTimeoutMS=500)
        try:
            documents = list(client["powerapi"]["power"].find({}, {"power": 1}))
        except PyMongoError:  # down, or not answering yet
            return []
        finally:
            client.close()
        assert len({d["_id"] for d in documents}) == len(documents)
        return [float(d["power"]) for d in documents]  # type: ignore[arg-type]

    try:
        outage(
            tmp_path, server, server.start, stored,
            ["--output", "mongodb", "-u", uri, "-d", "powerapi", "-c", "power",
             "--server-timeout-s", "0.5", "--batch-size", "10"],
            "pusher_mongodb",
        )  # fmt: skip
    finally:
        server.stop(kill=True)
