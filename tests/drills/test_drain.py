"""The drain after SIGTERM is bounded by ``--drain-timeout-s``: an output that cannot write does
not hold the service past an orchestrator's grace period, and what it could not write is kept
as dead letters, never lost.

Each run waits for the exit with a bound far below what the outputs' retries alone would take
(``--retry-for-s 300``), so a drain that ignored its deadline fails the test rather than pass
slowly.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import urllib3

from wattflow.actors import pipeline as pipeline_module
from wattflow.actors.pipeline import DRAIN_SETTLE_S, Pipeline, PipelineResult
from wattflow.actors.pullers.base import Emitter
from wattflow.actors.pushers.influxdb import query
from wattflow.actors.runtime import QueueConfig, RestartPolicy
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report

from ..conftest import Service, drained_ledger, run_async, wait_until
from ..servers import ServerProcess, free_port
from ..servers_influx import influx_uri, influxd_server, start_influxd
from ..test_runtime import EchoConfig, EchoFormula, ListPuller, MemoryPusher, hwpc

DRAIN_TIMEOUT_S = 1.0
"""The deadline these runs give: short, so that the suite stays quick."""

EXIT_BOUND_S = DRAIN_TIMEOUT_S + DRAIN_SETTLE_S + 30.0
"""How long a run may take to exit after SIGTERM: the deadline, the settling time after it, and
room for a loaded machine; ten times less than one batch's retries (``--retry-for-s 300``)."""

START = datetime(2026, 1, 1, tzinfo=UTC)


def power_reports(count: int, first: int = 0) -> list[PowerReport]:
    return [
        PowerReport(
            timestamp=START + timedelta(seconds=index),
            sensor="node-1",
            target="c0",
            power=float(index),
            metadata={"scope": "cpu", "socket": "0", "formula": "abc", "ratio": 1.0},
        )
        for index in range(first, first + count)
    ]


def append(path: Path, reports: list[PowerReport]) -> None:
    with path.open("a") as growing:
        growing.write("".join(powerapi.encode_json(r) + "\n" for r in reports))


def following_into_influxdb(tmp_path: Path, source: Path, uri: str) -> Service:
    """A service that follows a JSON Lines file of PowerReports into InfluxDB, with retries
    far longer than its drain deadline."""
    source.touch()
    return Service(
        tmp_path / "service.log", "run", "-s",
        "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
        "--dead-letters", str(tmp_path / "dead.jsonl"),
        "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--poll-interval-s", "0.05",
        "--output", "influxdb", "--uri", uri, "--db", "power",
        "--server-timeout-s", "0.5", "--retry-for-s", "300", "--batch-size", "10",
    )  # fmt: skip


def dead_letters(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "dead.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_with_no_server_dead_letters_everything_within_the_deadline(
    tmp_path: Path,
) -> None:
    source = tmp_path / "power.jsonl"
    reports = power_reports(50)
    service = following_into_influxdb(tmp_path, source, f"http://127.0.0.1:{free_port()}")
    with service:
        append(source, reports)
        service.wait_for_log("retrying")  # the output has the reports and cannot write them
        log = service.stop(code=1, timeout_s=EXIT_BOUND_S)
    ledger = drained_ledger(log)
    assert (ledger["entered"], ledger["delivered"], ledger["dead_out"]) == (50, 0, 50)
    kept = dead_letters(tmp_path)
    assert {letter["reason"] for letter in kept} == {
        "not written within the drain deadline (--drain-timeout-s 1)"
    }
    assert sorted(letter["payload"]["power"] for letter in kept) == [r.power for r in reports]
    assert (
        "wattflow: error: 50 reports could not be written: 50 × pusher:pusher_influxdb: "
        "not written within the drain deadline (--drain-timeout-s 1)"
    ) in log
    assert "reports unaccounted for" not in log
    assert "Traceback" not in log


def stored_powers(server: ServerProcess) -> list[float]:
    try:
        rows = query(influx_uri(server), "power", "SELECT * FROM power_consumption")
    except (KeyError, urllib3.exceptions.HTTPError):  # no database yet
        return []
    # A query that runs while a point is being written may see some of its fields and not yet
    # its power (InfluxDB 1.x stores each field apart): such a row is not stored yet.
    return [float(row["power"]) for row in rows if row.get("power") is not None]  # type: ignore[arg-type]


def test_a_server_killed_mid_run_leaves_every_report_written_or_dead_lettered(
    tmp_path: Path,
) -> None:
    server = influxd_server(tmp_path / "influxd")
    start_influxd(server)
    source = tmp_path / "power.jsonl"
    before, during = power_reports(30), power_reports(30, first=30)
    try:
        with following_into_influxdb(tmp_path, source, influx_uri(server)) as service:
            append(source, before)
            wait_until(
                lambda: service.alive() and len(stored_powers(server)) == 30, 60, "30 points"
            )
            server.stop(kill=True)
            append(source, during)
            service.wait_for_log("retrying")
            log = service.stop(code=1, timeout_s=EXIT_BOUND_S)
        start_influxd(server)  # the same storage: what was written before the kill
        stored = stored_powers(server)
    finally:
        server.stop(kill=True)
    ledger = drained_ledger(log)
    kept = [letter["payload"]["power"] for letter in dead_letters(tmp_path)]
    assert (ledger["entered"], ledger["delivered"], ledger["dead_out"]) == (60, 30, 30)
    assert sorted(stored) == [r.power for r in before]
    assert sorted(kept) == [r.power for r in during]


def test_an_output_stuck_opening_does_not_hold_the_service(tmp_path: Path) -> None:
    """The JSON Lines output opening a FIFO nobody reads (on its first batch) blocks in a
    thread forever: the deadline gives up on it, and the service exits without waiting for
    that thread."""
    fifo = tmp_path / "never-read.jsonl"
    os.mkfifo(fifo)
    source = tmp_path / "power.jsonl"
    source.touch()
    port = free_port()
    service = Service(
        tmp_path / "service.log", "run", "-s", "--http-port", str(port),
        "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--dead-letters", str(tmp_path / "dead.jsonl"),
        "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--poll-interval-s", "0.05",
        "--output", "jsonl", "--file", str(fifo),
    )  # fmt: skip
    queued = 'wattflow_actor_reports_in_total{actor="pusher:pusher_jsonl"} 10.0'
    with service:
        append(source, power_reports(10))
        wait_until(lambda: service.alive() and queued in metrics(port), 30, "10 reports queued")
        log = service.stop(code=1, timeout_s=EXIT_BOUND_S)
    ledger = drained_ledger(log)
    assert (ledger["entered"], ledger["delivered"], ledger["dead_out"]) == (10, 0, 10)
    assert len(dead_letters(tmp_path)) == 10


def metrics(port: int) -> str:
    """The service's ``/metrics`` page, or nothing while it does not answer yet."""
    try:
        response = urllib3.request("GET", f"http://127.0.0.1:{port}/metrics", timeout=2)
    except urllib3.exceptions.HTTPError:
        return ""
    return response.data.decode()


class EndlessPuller(ListPuller):
    """An input that emits all its reports, whatever ``stopping`` says, and then never ends: the
    kind of actor the settling time after the deadline exists for."""

    async def pull(self, emitter: Emitter) -> None:
        for start in range(0, len(self.reports), self.batch):
            chunk = self.reports[start : start + self.batch]
            await emitter.emit(chunk)
            self.emitted += len(chunk)
        await asyncio.Event().wait()


class StuckPusher(MemoryPusher):
    """An output whose writes never return."""

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        await asyncio.Event().wait()
        return []


def test_actors_still_running_after_the_deadline_are_cancelled_and_accounted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stuck output fills every mailbox up to the input; past the deadline the output gives
    up, everything flows to dead letters, and the input that never ends is cancelled."""
    monkeypatch.setattr(pipeline_module, "DRAIN_SETTLE_S", 0.2)
    puller = EndlessPuller([hwpc(i) for i in range(400)])
    built = Pipeline(
        [puller],
        [(EchoFormula, EchoConfig())],
        [StuckPusher()],
        queue=QueueConfig(max_reports=50, max_batch=10),
        restart_policy=RestartPolicy(initial_backoff_s=0.001),
        drain_timeout_s=0.2,
    )

    async def scenario() -> PipelineResult:
        running = asyncio.ensure_future(built.run())
        while len(built.router.mailbox) < 50:  # backpressure has reached the input
            await asyncio.sleep(0.01)
        built.stop()
        return await running

    result = run_async(scenario(), timeout_s=30)
    ledger = built.ledger
    assert result.deadline_passed
    assert ledger.balanced(), ledger
    assert ledger.entered == puller.emitted == 400
    assert (ledger.delivered, ledger.dead_out, ledger.dispatched) == (0, 400, 400)
    assert result.past_deadline == 400
