"""The ZeroMQ input and output over real sockets on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.zeromq import ZeroMQPuller, ZeroMQPullerConfig
from wattflow.actors.pushers.jsonl import JsonlPusher, JsonlPusherConfig
from wattflow.actors.pushers.zeromq import ZeroMQPusher, ZeroMQPusherConfig
from wattflow.actors.runtime import DeadLetters
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report

from .conftest import run_async
from .servers import free_port, wait_until

START = datetime(2026, 4, 1, tzinfo=UTC)


def power_reports(count: int, sensor: str = "node-1") -> list[PowerReport]:
    return [
        PowerReport(
            timestamp=START + timedelta(milliseconds=250 * index),
            sensor=sensor,
            target=f"c{index % 3}",
            power=float(index),
            metadata={"scope": "cpu", "socket": "0"},
        )
        for index in range(count)
    ]


async def publish_and_receive(
    pusher_config: ZeroMQPusherConfig,
    subscriber: zmq.asyncio.Socket,
    batches: list[list[Report]],
    expected_messages: int,
) -> list[list[bytes]]:
    pusher = ZeroMQPusher(pusher_config)
    await pusher.check()
    await pusher.open()
    await asyncio.sleep(0.3)  # a subscription takes a moment to reach the publisher
    for batch in batches:
        await pusher.write(batch)
    received = []
    for _ in range(expected_messages):
        received.append(await asyncio.wait_for(subscriber.recv_multipart(), 5))
    await pusher.close()
    return received


def test_published_reports_carry_their_kind_and_sensor_as_topic() -> None:
    port = free_port()
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"PowerReport:node-2")
    reports: list[Report] = [*power_reports(4, "node-1"), *power_reports(3, "node-2")]
    config = ZeroMQPusherConfig(uri=[f"tcp://127.0.0.1:{port}"])
    try:
        [message] = run_async(publish_and_receive(config, subscriber, [reports], 1))
    finally:
        subscriber.close(linger=0)
        context.term()
    topic, payload = message
    assert topic == b"PowerReport:node-2"
    decoded = [
        powerapi.decode_json(PowerReport, line, "zmq", None) for line in payload.splitlines()
    ]
    assert decoded == reports[4:]


def lines_in(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_pipeline_until(
    puller: ZeroMQPuller, out: Path, count: int, feed: Any, dead: DeadLetters | None = None
) -> list[dict[str, Any]]:
    """Run puller → jsonl file; ``feed`` sends once the puller's socket exists."""

    async def go() -> None:
        pipeline = Pipeline(
            [puller], [], [JsonlPusher(JsonlPusherConfig(file=out))], dead_letters=dead
        )
        running = asyncio.create_task(pipeline.run())
        while not puller.ready:
            await asyncio.sleep(0.01)
        await feed()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and await asyncio.to_thread(lines_in, out) < count:
            await asyncio.sleep(0.05)
        pipeline.stop()
        await running

    run_async(go())
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_push_to_pull_delivers_everything_in_order_and_bad_frames_are_dead_letters(
    tmp_path: Path,
) -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    puller = ZeroMQPuller(
        ZeroMQPullerConfig(model="PowerReport", uri=[uri], socket_type="PULL", max_batch=7)
    )
    reports = power_reports(300)
    dead = DeadLetters()

    async def feed() -> None:
        pusher = ZeroMQPusher(
            ZeroMQPusherConfig(uri=[uri], socket_type="PUSH", max_reports_per_message=10)
        )
        await pusher.open()
        await pusher.write(list(reports[:150]))
        assert pusher.socket is not None
        await pusher.socket.send(b'{"broken"\n')
        await pusher.write(list(reports[150:]))
        await pusher.close()

    written = run_pipeline_until(puller, tmp_path / "out.jsonl", 300, feed, dead)
    assert [w["power"] for w in written] == [r.power for r in reports]
    assert written[0]["timestamp"] == "2026-04-01T00:00:00.000"
    assert dead.total == 1
    [reason] = list(dead.by_reason)
    assert "not valid JSON" in reason


def test_a_push_output_waits_for_its_peer_instead_of_dropping() -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"

    async def go() -> tuple[bool, int]:
        pusher = ZeroMQPusher(ZeroMQPusherConfig(uri=[uri], socket_type="PUSH", sndhwm=2,
                                                 max_reports_per_message=1))  # fmt: skip
        await pusher.open()
        reports: list[Report] = list(power_reports(50))
        writing = asyncio.create_task(pusher.write(reports))
        await asyncio.sleep(0.5)
        blocked = not writing.done()  # no peer: sending waits, nothing is dropped
        context = zmq.asyncio.Context()
        peer = context.socket(zmq.PULL)
        peer.bind(uri)
        received = 0
        while received < 50:
            await asyncio.wait_for(peer.recv(), 5)
            received += 1
        await writing
        await pusher.close()
        peer.close(linger=0)
        context.term()
        return blocked, received

    blocked, received = run_async(go())
    assert blocked
    assert received == 50


def test_a_subscriber_that_never_reads_cannot_hold_up_a_publisher() -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    context = zmq.Context()
    idle = context.socket(zmq.SUB)
    idle.setsockopt(zmq.RCVHWM, 5)
    idle.setsockopt(zmq.SUBSCRIBE, b"")
    idle.connect(uri)

    async def go() -> int:
        pusher = ZeroMQPusher(ZeroMQPusherConfig(uri=[uri], sndhwm=5, max_reports_per_message=1))
        await pusher.open()
        await asyncio.sleep(0.3)
        for _ in range(20):
            await pusher.write(list(power_reports(100)))
        assert pusher.socket is not None
        hwm = int(pusher.socket.getsockopt(zmq.SNDHWM))
        await pusher.close()
        return hwm

    try:
        assert run_async(go(), timeout_s=20) == 5  # 2,000 messages sent past a full subscriber
        queued = 0
        while idle.poll(100):
            idle.recv_multipart(zmq.NOBLOCK)
            queued += 1
    finally:
        idle.close(linger=0)
        context.term()
    assert 0 < queued < 2000, "the publisher dropped what the subscriber could not take"


def test_curve_lets_authorised_clients_in_and_keeps_others_out(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    authorised = tmp_path / "authorised"
    keys.mkdir()
    authorised.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    Path(client_public).rename(authorised / "client.key")
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    puller = ZeroMQPuller(
        ZeroMQPullerConfig(
            model="PowerReport",
            uri=[uri],
            socket_type="PULL",
            curve_secret_key=Path(server_secret),
            curve_authorized_keys=authorised,
        )
    )
    reports = power_reports(20)

    async def feed() -> None:
        for secret, part in ((stranger_secret, reports[:10]), (client_secret, reports[10:])):
            pusher = ZeroMQPusher(
                ZeroMQPusherConfig(
                    uri=[uri],
                    socket_type="PUSH",
                    curve_secret_key=Path(secret),
                    curve_server_key=Path(server_public),
                    linger_ms=500,
                )
            )
            await pusher.open()
            await pusher.write(list(part))
            await pusher.close()

    written = run_pipeline_until(puller, tmp_path / "out.jsonl", 10, feed)
    assert [w["power"] for w in written] == [r.power for r in reports[10:]]


def test_the_service_reads_a_pull_socket_until_sigterm(tmp_path: Path) -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    out = tmp_path / "out.jsonl"
    service = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wattflow.service",
            "run",
            "--input",
            "zeromq",
            "--model",
            "PowerReport",
            "--uri",
            uri,
            "--socket-type",
            "PULL",
            "--output",
            "jsonl",
            "--file",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    context = zmq.Context()
    sender = context.socket(zmq.PUSH)
    sender.connect(uri)
    reports = power_reports(100)
    try:
        for report in reports:
            sender.send(powerapi.encode_json(report).encode())
        wait_until(
            lambda: out.exists() and len(out.read_text().splitlines()) == 100, 30, "100 reports"
        )
        service.send_signal(signal.SIGTERM)
        _, stderr = service.communicate(timeout=30)
    finally:
        service.kill()
        sender.close(linger=0)
        context.term()
    assert service.returncode == 0, stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["power"] for w in written] == [r.power for r in reports]


@pytest.mark.parametrize("flags", [["--curve-server-key", "/nowhere/server.key"]])
def test_a_curve_setting_that_cannot_work_is_one_line_and_exit_2(
    tmp_path: Path, flags: list[str]
) -> None:
    from .conftest import wattflow

    done = wattflow(
        "run", "--input", "zeromq", "--uri", f"tcp://127.0.0.1:{free_port()}", *flags,
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--curve-secret-key" in done.stderr
