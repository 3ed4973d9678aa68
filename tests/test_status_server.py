"""``wattflow run --http-port``: /health, /ready and /metrics, from a running service and from
pipelines whose actors fail, restart or stall."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.base import Emitter
from wattflow.actors.runtime import QueueConfig, RestartPolicy
from wattflow.actors.status import METRICS, PipelineStatus
from wattflow.formats import powerapi
from wattflow.formats.reports import Report
from wattflow.service.status_server import StatusServer

from .conftest import Service, run_async, wait_until, wattflow
from .servers import free_port
from .servers_influx import influx_uri, influxd_server, start_influxd
from .servers_prometheus import promtool_check_metrics
from .test_influxdb import power_reports
from .test_runtime import EchoConfig, EchoFormula, ListPuller, MemoryPusher, hwpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> tuple[int, str]:
    response = urllib3.request("GET", url, timeout=10, retries=False)
    return response.status, response.data.decode()


def samples(text: str) -> Samples:
    """Every sample of an exposition by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def test_a_live_service_reports_its_flow_model_error_and_lag(tmp_path: Path) -> None:
    hwpc_file = tmp_path / "hwpc.jsonl"
    record(ticks=30, containers=3, sensors=("node-1", "node-2"), jsonl=hwpc_file)
    power, formula = tmp_path / "power.jsonl", tmp_path / "formula.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with Service(
        tmp_path / "service.log", "run", "-s", "--http-port", str(port),
        "--input", "jsonl", "--files", str(hwpc_file), "--poll-interval-s", "0.05",
        "--learn-min-samples-required", "10",
        "--output", "jsonl", "--file", str(power),
        "--output", "jsonl", "--model", "FormulaReport", "--file", str(formula),
    ) as service:  # fmt: skip
        service.wait_for_log("health, readiness and metrics on")

        def flow_agrees() -> bool:
            service.alive()
            found = samples(get(base + "/metrics")[1])
            written = value(found, "wattflow_actor_reports_out_total", actor="pusher:pusher_jsonl")
            errors = {
                (r["sensor"], r["metadata"]["scope"], str(r["metadata"]["socket"])): r["metadata"][
                    "error"
                ]
                for r in lines(formula)
            }
            exposed = {
                (labels["sensor"], labels["scope"], labels["socket"]): v
                for (name, pairs), v in found.items()
                if name == "wattflow_model_error_watts"
                for labels in [dict(pairs)]
            }
            return bool(power.exists()) and written == len(lines(power)) > 0 and exposed == errors

        wait_until(flow_agrees, 60, "the metrics to agree with what was written")
        text = get(base + "/metrics")[1]
        health, ready = get(base + "/health"), get(base + "/ready")
        service.stop()
    assert health == (200, "ok\n")
    assert ready == (200, "ok\n")
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""
    found = samples(text)
    reports = len(hwpc_file.read_text().splitlines())
    assert value(found, "wattflow_actor_reports_in_total", actor="puller:puller_jsonl") == reports
    assert value(found, "wattflow_actor_reports_in_total", actor="router") == reports
    assert value(found, "wattflow_actor_reports_dead_total", actor="formula:smartwatts") == 0
    assert value(found, "wattflow_healthy") == 1
    assert value(found, "wattflow_actor_running", actor="pusher:pusher_jsonl") == 1
    # the recording is from the past: its newest tick is older than now
    lag = value(found, "wattflow_tick_lag_seconds", actor="formula:smartwatts")
    assert lag is not None
    assert lag > 0
    names = {name for name, _ in found}
    assert {"wattflow_mailbox_capacity_reports", "wattflow_output_retries_total"} <= names
    # every pipeline metric is one the docs list (METRICS), beside the process' own
    assert all(name in METRICS or name.startswith("process_") for name in names)
    assert {name for name in METRICS if name.endswith("_total")} <= names


def test_ready_waits_for_an_unreachable_output_and_metrics_count_the_outage(
    tmp_path: Path,
) -> None:
    server = influxd_server(tmp_path / "influxd")
    source = tmp_path / "power.jsonl"
    source.write_text("")
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def metric(name: str) -> float | None:
        return value(samples(get(base + "/metrics")[1]), name, output="pusher_influxdb")

    try:
        with Service(
            tmp_path / "service.log", "run", "-s", "--http-port", str(port),
            "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
            "--poll-interval-s", "0.05",
            "--output", "influxdb", "--uri", influx_uri(server), "--db", "power",
            "--server-timeout-s", "0.5", "--retry-for-s", "120",
        ) as service:  # fmt: skip
            service.wait_for_log("health, readiness and metrics on")
            wait_until(lambda: service.alive() and get(base + "/ready")[0] == 200, 30, "ready")
            source.write_text("".join(powerapi.encode_json(r) + "\n" for r in power_reports(5)))
            wait_until(lambda: service.alive() and get(base + "/ready")[0] == 503, 30, "not ready")
            status, reason = get(base + "/ready")
            health = get(base + "/health")
            assert metric("wattflow_output_unreachable") == 1
            # down from the start, never written: one outage, as /ready saw it become unready
            assert metric("wattflow_output_outages_total") == 1
            start_influxd(server)
            wait_until(lambda: service.alive() and get(base + "/ready")[0] == 200, 60, "ready")
            retries = metric("wattflow_output_retries_total")
            outages = metric("wattflow_output_outages_total")
            unreachable = metric("wattflow_output_unreachable")
            service.stop()
    finally:
        server.stop(kill=True)
    assert status == 503
    assert "output 'pusher_influxdb': unreachable:" in reason
    assert health == (200, "ok\n")  # every actor runs: the output is waiting, not broken
    assert retries is not None
    assert retries >= 1
    assert (outages, unreachable) == (1, 0)


def test_ready_names_an_input_that_has_not_reached_its_server(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with Service(
        tmp_path / "service.log", "run", "-s", "--http-port", str(port),
        "--input", "mongodb", "--uri", f"mongodb://127.0.0.1:{free_port()}/",
        "-d", "power", "-c", "hwpc", "--server-timeout-s", "0.2",
        "--output", "jsonl", "--file", str(tmp_path / "power.jsonl"),
    ) as service:  # fmt: skip
        service.wait_for_log("health, readiness and metrics on")
        wait_until(lambda: service.alive() and get(base + "/health")[0] == 200, 30, "healthy")
        ready = get(base + "/ready")
        service.stop()
    assert ready[0] == 503
    assert re.search(r"input 'puller_mongodb': server (not reached yet|unavailable)", ready[1])


def test_a_port_in_use_stops_the_command(tmp_path: Path) -> None:
    source = tmp_path / "power.jsonl"
    source.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = wattflow(
            "run", "--http-port", str(taken.getsockname()[1]),
            "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
            "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
        )  # fmt: skip
    assert done.returncode == 2
    assert "--http-port: cannot listen on 127.0.0.1:" in done.stderr


class StreamPuller(ListPuller):
    """Emits its reports, then waits for the pipeline to stop, as a live input does."""

    async def pull(self, emitter: Emitter) -> None:
        await super().pull(emitter)
        await emitter.stopping.wait()


def in_process(pusher: MemoryPusher, policy: RestartPolicy) -> tuple[Pipeline, StatusServer]:
    reports: list[Report] = [hwpc(i) for i in range(30)]
    pipeline = Pipeline(
        [StreamPuller(reports)],
        [(EchoFormula, EchoConfig())],
        [pusher],
        queue=QueueConfig(max_reports=50, max_batch=10),
        restart_policy=policy,
    )
    server = StatusServer(PipelineStatus(pipeline), "127.0.0.1", 0)
    server.listen()
    return pipeline, server


async def wait_async(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not ready after {timeout_s} s")


async def fetch(server: StatusServer, path: str) -> tuple[int, str]:
    """A request from another thread, while this loop stays free to answer it."""
    return await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}{path}")


def test_health_says_which_actor_is_restarting_and_which_failed_for_good() -> None:
    async def restarting() -> tuple[tuple[int, str], tuple[int, str]]:
        """/health before the pipeline runs, and while its output waits to restart."""
        pipeline, server = in_process(
            MemoryPusher(crash_first=1), RestartPolicy(initial_backoff_s=60)
        )
        before = await fetch(server, "/health")  # not attached: the pipeline is not running
        server.attach(asyncio.get_running_loop())
        running = asyncio.create_task(pipeline.run())
        supervisor = pipeline.supervisor
        await wait_async(lambda: "pusher:memory" in supervisor.restarting, 10, "a restart")
        during = await fetch(server, "/health")
        await supervisor.cancel_all()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await asyncio.to_thread(server.close)
        return before, during

    before, during = run_async(restarting())
    assert before[0] == 503
    assert "starting" in before[1]
    assert during[0] == 503
    assert "pusher:memory is restarting after RuntimeError('disk on fire')" in during[1]

    async def failed() -> tuple[tuple[int, str], tuple[int, str], str]:
        pipeline, server = in_process(
            MemoryPusher(crash_first=10_000), RestartPolicy(initial_backoff_s=0, max_restarts=2)
        )
        server.attach(asyncio.get_running_loop())
        result = await pipeline.run()
        assert not result.ok
        answers = await fetch(server, "/health"), await fetch(server, "/ready")
        text = (await fetch(server, "/metrics"))[1]
        await asyncio.to_thread(server.close)
        return answers[0], answers[1], text

    health, ready, text = run_async(failed())
    assert health[0] == ready[0] == 503
    assert "pusher:memory failed 3 times, last: RuntimeError('disk on fire')" in health[1]
    found = samples(text)
    assert value(found, "wattflow_healthy") == 0
    assert value(found, "wattflow_actor_running", actor="pusher:memory") == 0
    assert value(found, "wattflow_actor_restarts_total", actor="pusher:memory") == 2
    assert value(found, "wattflow_actor_reports_dead_total", actor="pusher:memory") == 30


def test_health_fails_while_the_event_loop_is_stuck() -> None:
    status = PipelineStatus(
        Pipeline([ListPuller([])], [(EchoFormula, EchoConfig())], [MemoryPusher()])
    )
    server = StatusServer(status, "127.0.0.1", 0, answer_s=0.2)
    server.listen()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    release = threading.Event()
    try:
        server.attach(loop)
        loop.call_soon_threadsafe(release.wait, 60)  # a blocking call on the loop
        stuck = get(f"http://127.0.0.1:{server.port}/health")
        release.set()
        freed: list[tuple[int, str]] = []

        def answered() -> bool:
            freed.append(get(f"http://127.0.0.1:{server.port}/health"))
            return "has not answered" not in freed[-1][1]

        wait_until(answered, 10, "the loop to answer again")
    finally:
        release.set()
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    assert stuck == (503, "the event loop has not answered for 0.2 s\n")
    # free again, it answers for the pipeline (which was never started)
    assert "has not started yet" in freed[-1][1]


def test_an_unknown_path_is_404() -> None:
    status = PipelineStatus(
        Pipeline([ListPuller([])], [(EchoFormula, EchoConfig())], [MemoryPusher()])
    )
    server = StatusServer(status, "127.0.0.1", 0)
    server.listen()
    try:
        code, text = get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        server.close()
    assert code == 404
    assert "/health" in text


def test_the_operations_page_lists_every_metric_with_its_labels() -> None:
    """Dashboards are written against docs/operations.md's table: it must say what is served."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(r"^\| `(wattflow_\w+)` \| \w+ \|([^|]*)\|", page, re.MULTILINE)
    }
    assert rows.keys() == METRICS.keys()
    for name, (kind, labels, _) in METRICS.items():
        assert re.findall(r"`(\w+)`", rows[name]) == list(labels), name
        assert f"| `{name}` | {kind} |" in page
