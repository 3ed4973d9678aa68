"""The ZeroMQ input and output over real sockets on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from wattflow.actors.errors import PushUnavailable
from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.zeromq import ZeroMQPuller, ZeroMQPullerConfig
from wattflow.actors.pushers.jsonl import JsonlPusher, JsonlPusherConfig
from wattflow.actors.pushers.zeromq import ZeroMQPusher, ZeroMQPusherConfig
from wattflow.actors.runtime import DeadLetters
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, expand
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import PowerReport, Report

from .conftest import Service, complete_lines, run_async, wattflow
from .servers import free_port

START = datetime(2026, 4, 1, tzinfo=UTC)


def power_reports(count: int, sensor: str = "node-1", target: str = "") -> list[PowerReport]:
    return [
        PowerReport(
            timestamp=START + timedelta(milliseconds=250 * index),
            sensor=sensor,
            target=target or f"c{index % 3}",
            power=float(index) + 0.125,
            metadata={"scope": "cpu", "socket": "0", "formula": "f1", "ratio": 0.5},
        )
        for index in range(count)
    ]


class Collector:
    """The pipeline as a puller sees it, keeping what it is given; optionally slow to take it."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.stopping = asyncio.Event()
        self.reports: list[Report] = []
        self.rejected: list[tuple[Any, str]] = []
        self.skipped = 0
        self.slow_s = slow_s

    async def emit(self, batch: Batch) -> None:
        if self.slow_s:
            await asyncio.sleep(self.slow_s)
        self.reports.extend(expand(batch))

    def reject(self, payload: Any, reason: str) -> None:
        self.rejected.append((payload, reason))

    def skip(self, count: int) -> None:
        self.skipped += count

    def received(self, skip_target: str = "warm-up") -> list[Report]:
        return [r for r in self.reports if r.target != skip_target]


async def eventually(ready: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not after {timeout_s} s")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def pulling(puller: ZeroMQPuller, collector: Collector) -> AsyncIterator[None]:
    """Run the puller while the block runs; then stop it and wait for it to drain."""
    task = asyncio.create_task(puller.pull(collector))
    await eventually(lambda: puller.ready or task.done(), "the puller's socket")
    try:
        yield
    finally:
        collector.stopping.set()
        await task


async def until_subscribed(publish: Callable[[], Awaitable[object]], collector: Collector) -> None:
    """Publish warm-up messages until one arrives: a subscription takes a while to reach a PUB."""
    deadline = time.monotonic() + 10
    while not any(r.target == "warm-up" for r in collector.reports):
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        await publish()
        await asyncio.sleep(0.05)


def test_power_reports_go_from_pub_to_sub_unchanged() -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(ZeroMQPusherConfig(uri=[uri], max_reports_per_message=7))
    puller = ZeroMQPuller(ZeroMQPullerConfig(model="PowerReport", uri=[uri]))
    collector = Collector()
    reports: list[Report] = [*power_reports(40, "node-1"), *power_reports(30, "node-2")]
    warm_up: list[Report] = list(power_reports(1, "node-1", target="warm-up"))

    async def go() -> None:
        await pusher.check()
        await pusher.open()
        async with pulling(puller, collector):
            await until_subscribed(lambda: pusher.write(warm_up), collector)
            await pusher.write(reports)
            await eventually(lambda: len(collector.received()) >= len(reports), "70 reports")
        await pusher.close()

    run_async(go())
    assert collector.received() == reports
    assert all(r.timestamp.tzinfo is not None for r in collector.received())
    assert collector.rejected == []


def test_published_reports_carry_their_kind_and_sensor_as_topic() -> None:
    port = free_port()
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"PowerReport:node-2")
    reports: list[Report] = [*power_reports(4, "node-1"), *power_reports(3, "node-2")]
    pusher = ZeroMQPusher(ZeroMQPusherConfig(uri=[f"tcp://127.0.0.1:{port}"]))

    async def go() -> list[bytes]:
        await pusher.open()
        while not await subscriber.poll(50):  # until the subscription reaches the publisher
            await pusher.write(reports)
        message: list[bytes] = await subscriber.recv_multipart()
        await pusher.close()
        return message

    try:
        topic, payload = run_async(go())
    finally:
        subscriber.close(linger=0)
        context.term()
    assert topic == b"PowerReport:node-2"
    decoded = [
        powerapi.decode_json(PowerReport, line, "zmq", None) for line in payload.splitlines()
    ]
    assert decoded == reports[4:]


def test_a_subscriber_gets_only_the_kinds_and_sensors_of_its_topics() -> None:
    port = free_port()
    puller = ZeroMQPuller(
        ZeroMQPullerConfig(
            model="PowerReport", uri=[f"tcp://127.0.0.1:{port}"], topics="PowerReport:node-2"
        )
    )
    collector = Collector()
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    wanted = power_reports(5, "node-2")
    end = power_reports(1, "node-2", "end")[0]

    async def send(topic: str, report: Report) -> None:
        await publisher.send_multipart([topic.encode(), powerapi.encode_json(report).encode()])

    async def go() -> None:
        async with pulling(puller, collector):
            await until_subscribed(
                lambda: send("PowerReport:node-2", power_reports(1, "node-2", "warm-up")[0]),
                collector,
            )
            for index, report in enumerate(wanted):
                await send("PowerReport:node-1", power_reports(index + 1, "node-1")[index])
                # An HWPCReport would be a dead letter for a PowerReport input, if it came in.
                await publisher.send_multipart([b"HWPCReport:node-2", b'{"groups": {}}'])
                await send("PowerReport:node-2", report)
            await send("PowerReport:node-2", end)
            await eventually(lambda: end in collector.reports, "the last report")

    try:
        run_async(go())
    finally:
        publisher.close(linger=0)
        context.term()
    assert collector.received() == [*wanted, end]
    assert collector.rejected == []


def test_push_to_pull_loses_nothing_to_a_slow_consumer() -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    # One message queued on each side, and the consumer takes 5 ms a message: the sender waits.
    puller = ZeroMQPuller(
        ZeroMQPullerConfig(
            model="PowerReport", uri=[uri], socket_type="PULL", rcvhwm=1, max_batch=1
        )
    )
    pusher = ZeroMQPusher(
        ZeroMQPusherConfig(uri=[uri], socket_type="PUSH", sndhwm=1, max_reports_per_message=1)
    )
    collector = Collector(slow_s=0.005)
    reports: list[Report] = list(power_reports(200))

    async def go() -> None:
        async with pulling(puller, collector):
            await pusher.open()
            await pusher.write(reports)
            await eventually(lambda: len(collector.reports) >= 200, "200 reports", 30)
        await pusher.close()

    run_async(go(), timeout_s=60)
    assert collector.reports == reports
    assert pusher.sent == 200
    assert puller.messages == 200


def test_a_push_output_waits_for_its_peer_instead_of_dropping() -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(
        ZeroMQPusherConfig(uri=[uri], socket_type="PUSH", sndhwm=2, max_reports_per_message=1)
    )
    reports: list[Report] = list(power_reports(50))

    async def go() -> tuple[bool, list[bytes]]:
        await pusher.open()
        writing = asyncio.create_task(pusher.write(reports))
        await asyncio.sleep(0.5)
        blocked = not writing.done()  # no peer: sending waits, nothing is dropped
        context = zmq.asyncio.Context()
        peer = context.socket(zmq.PULL)
        peer.bind(uri)
        received = [await asyncio.wait_for(peer.recv(), 5) for _ in range(50)]
        await writing
        await pusher.close()
        peer.close(linger=0)
        context.term()
        return blocked, received

    blocked, received = run_async(go())
    assert blocked
    assert [powerapi.decode_json(PowerReport, m, "zmq", None) for m in received] == reports


def test_a_push_output_that_waits_too_long_accounts_for_every_report() -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(
        ZeroMQPusherConfig(
            uri=[uri],
            socket_type="PUSH",
            sndhwm=1,
            max_reports_per_message=1,
            send_timeout_s=0.1,
            retry_for_s=0.3,
            linger_ms=2000,
        )
    )
    first: list[Report] = list(power_reports(6))
    second: list[Report] = list(power_reports(2, "node-2"))

    async def go() -> tuple[list[tuple[Report, str]], list[bytes]]:
        await pusher.open()
        # No peer: what ZeroMQ queues for the peer to come waits; the rest of the batch is
        # refused (dead letters), and a batch of which nothing can go is to be retried.
        refused = await pusher.write(first)
        with pytest.raises(PushUnavailable, match="no ZeroMQ peer"):
            await pusher.write(second)
        context = zmq.asyncio.Context()
        peer = context.socket(zmq.PULL)
        peer.bind(uri)
        received = []
        while await peer.poll(500):
            received.append(await peer.recv())
        await pusher.close()
        peer.close(linger=0)
        context.term()
        return refused, received

    refused, received = run_async(go())
    delivered = [powerapi.decode_json(PowerReport, m, "zmq", None) for m in received]
    assert refused, "six messages cannot all wait in a queue of one"
    assert all("no ZeroMQ peer" in reason for _, reason in refused)
    assert delivered + [report for report, _ in refused] == first


def test_bad_messages_become_dead_letters_and_good_ones_pass() -> None:
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    puller = ZeroMQPuller(ZeroMQPullerConfig(model="PowerReport", uri=[uri], socket_type="PULL"))
    collector = Collector()
    good = power_reports(5)
    context = zmq.asyncio.Context()
    sender = context.socket(zmq.PUSH)

    def line(report: Report) -> bytes:
        return powerapi.encode_json(report).encode()

    async def go() -> None:
        async with pulling(puller, collector):
            sender.connect(uri)
            await sender.send(line(good[0]))
            await sender.send(b'{"broken"')
            await sender.send_multipart([b"PowerReport:node-1", b"x", line(good[0])])
            await sender.send(b"\xff\xfe not UTF-8")
            await sender.send(b'{"timestamp": 1, "sensor": "s", "target": "t", "metadata": {}}')
            await sender.send_multipart([b"PowerReport:node-1", line(good[1])])
            await sender.send(b"\n".join([line(good[2]), b"[1, 2]", line(good[3])]) + b"\n")
            await sender.send(line(good[4]))
            await eventually(lambda: good[4] in collector.reports, "the last good report")

    try:
        run_async(go())
    finally:
        sender.close(linger=0)
        context.term()
    assert collector.reports == good
    reasons = [reason for _, reason in collector.rejected]
    assert len(reasons) == 5, reasons
    assert all(reason.startswith(f"zeromq {uri} from 127.0.0.1: ") for reason in reasons)
    assert "not valid JSON" in reasons[0]
    assert "3 frames" in reasons[1]
    assert "not valid JSON" in reasons[2]
    assert "missing field 'power'" in reasons[3]
    assert collector.rejected[0][0] == '{"broken"'


def run_pipeline_until(
    puller: ZeroMQPuller,
    out: Path,
    count: int,
    feed: Callable[[], Awaitable[None]],
    dead: DeadLetters | None = None,
) -> list[dict[str, Any]]:
    """Run puller → jsonl file; ``feed`` sends once the puller's socket exists."""

    async def go() -> None:
        pipeline = Pipeline(
            [puller], [], [JsonlPusher(JsonlPusherConfig(file=out))], dead_letters=dead
        )
        running = asyncio.create_task(pipeline.run())
        await eventually(lambda: puller.ready, "the puller's socket")
        await feed()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and await asyncio.to_thread(complete_lines, out) < count:
            await asyncio.sleep(0.05)
        pipeline.stop()
        await running

    run_async(go())
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_a_pipeline_delivers_pushed_reports_in_order_and_counts_bad_frames(
    tmp_path: Path,
) -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
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


def test_a_subscriber_that_never_reads_cannot_hold_up_a_publisher() -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    idle = context.socket(zmq.SUB)
    idle.setsockopt(zmq.RCVHWM, 5)
    idle.setsockopt(zmq.SUBSCRIBE, b"")
    idle.connect(uri)
    pusher = ZeroMQPusher(ZeroMQPusherConfig(uri=[uri], sndhwm=5, max_reports_per_message=1))
    warm_up: list[Report] = list(power_reports(1, target="warm-up"))
    warm_ups = 0

    async def go() -> int:
        nonlocal warm_ups
        await pusher.open()
        # What is published before the subscription reaches the publisher goes nowhere:
        # publish warm-up reports until one arrives.
        while not idle.poll(50):
            await pusher.write(warm_up)
            warm_ups += 1
        for _ in range(20):
            await pusher.write(list(power_reports(100)))
        assert pusher.socket is not None
        hwm = pusher.socket.getsockopt(zmq.SNDHWM)
        assert isinstance(hwm, int)
        await pusher.close()
        return hwm

    try:
        assert run_async(go(), timeout_s=20) == 5  # 2,000 messages sent past a full subscriber
        queued = 0
        while idle.poll(100):
            *_, payload = idle.recv_multipart(zmq.NOBLOCK)
            queued += b'"warm-up"' not in payload
    finally:
        idle.close(linger=0)
        context.term()
    assert pusher.sent == warm_ups + 2000
    assert 0 < queued < 2000, "the publisher dropped what the subscriber could not take"


def make_keys(tmp_path: Path) -> dict[str, Path]:
    """Server, client and stranger key pairs; only the client's public key is authorised."""
    keys = tmp_path / "keys"
    authorised = tmp_path / "authorised"
    keys.mkdir()
    authorised.mkdir()
    paths: dict[str, Path] = {"authorised": authorised}
    for name in ("server", "client", "stranger"):
        public, secret = zmq.auth.create_certificates(str(keys), name)
        paths[name] = Path(public)
        paths[f"{name}_secret"] = Path(secret)
    (authorised / "client.key").write_bytes(paths["client"].read_bytes())
    return paths


def curve_client(uri: str, keys: dict[str, Path]) -> ZeroMQPuller:
    """A SUB input with the client's CURVE keys, subscribed to every PowerReport."""
    return ZeroMQPuller(
        ZeroMQPullerConfig(
            model="PowerReport",
            uri=[uri],
            curve_secret_key=keys["client_secret"],
            curve_server_key=keys["server"],
        )
    )


def test_curve_lets_authorised_senders_in_and_keeps_others_out(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    uri = f"tcp://127.0.0.1:{free_port()}"
    puller = ZeroMQPuller(
        ZeroMQPullerConfig(
            model="PowerReport",
            uri=[uri],
            socket_type="PULL",
            curve_secret_key=keys["server_secret"],
            curve_authorized_keys=keys["authorised"],
        )
    )
    reports = power_reports(20)

    async def feed() -> None:
        stranger, client = keys["stranger_secret"], keys["client_secret"]
        for secret, part in ((stranger, reports[:10]), (client, reports[10:])):
            pusher = ZeroMQPusher(
                ZeroMQPusherConfig(
                    uri=[uri],
                    socket_type="PUSH",
                    curve_secret_key=secret,
                    curve_server_key=keys["server"],
                    linger_ms=500,
                )
            )
            await pusher.open()
            await pusher.write(list(part))
            await pusher.close()

    written = run_pipeline_until(puller, tmp_path / "out.jsonl", 10, feed)
    assert [w["power"] for w in written] == [r.power for r in reports[10:]]


def test_curve_publisher_serves_authorised_subscribers_only(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(
        ZeroMQPusherConfig(
            uri=[uri],
            curve_secret_key=keys["server_secret"],
            curve_authorized_keys=keys["authorised"],
        )
    )
    client = curve_client(uri, keys)
    collector = Collector()
    context = zmq.asyncio.Context()
    stranger = context.socket(zmq.SUB)
    public, secret = zmq.auth.load_certificate(str(keys["stranger_secret"]))
    stranger.curve_publickey, stranger.curve_secretkey = public, secret
    stranger.curve_serverkey = zmq.auth.load_certificate(str(keys["server"]))[0]
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    reports: list[Report] = list(power_reports(10))
    warm_up: list[Report] = list(power_reports(1, target="warm-up"))

    async def go() -> tuple[int, bool]:
        await pusher.check()
        await pusher.open()
        stranger.connect(uri)
        async with pulling(client, collector):
            await until_subscribed(lambda: pusher.write(warm_up), collector)
            await pusher.write(reports)
            await eventually(lambda: len(collector.received()) >= 10, "10 reports")
        event = await asyncio.wait_for(recv_monitor_message(monitor), 10)
        got_anything = bool(await stranger.poll(200))
        await asyncio.wait_for(pusher.close(), 10)  # the authenticator must not hold it up
        return event["event"], got_anything

    try:
        event, got_anything = run_async(go())
    finally:
        stranger.disable_monitor()
        monitor.close(linger=0)
        stranger.close(linger=0)
        context.term()
    assert collector.received() == reports
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert not got_anything


def test_a_check_on_its_own_loop_leaves_the_allow_list_to_the_loop_that_sends(
    tmp_path: Path,
) -> None:
    """``wattflow run`` checks the outputs under one event loop and runs them under another:
    the check must leave no socket behind, and the allow-list's handler must answer on the
    loop the socket sends from, or every handshake hangs and subscribers get nothing."""
    keys = make_keys(tmp_path)
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(
        ZeroMQPusherConfig(
            uri=[uri],
            curve_secret_key=keys["server_secret"],
            curve_authorized_keys=keys["authorised"],
        )
    )
    asyncio.run(pusher.check())
    assert pusher.socket is None, "the check left a socket open"
    context = zmq.Context()
    again = context.socket(zmq.PUB)
    again.bind(uri)  # the check freed its address
    again.close(linger=0)
    context.term()
    client = curve_client(uri, keys)
    collector = Collector()
    reports: list[Report] = list(power_reports(10))
    warm_up: list[Report] = list(power_reports(1, target="warm-up"))

    async def go() -> None:
        await pusher.open()
        async with pulling(client, collector):
            await until_subscribed(lambda: pusher.write(warm_up), collector)
            await pusher.write(reports)
            await eventually(lambda: len(collector.received()) >= 10, "10 reports")
        await pusher.close()

    run_async(go())
    assert collector.received() == reports


def test_the_service_reads_a_pull_socket_until_sigterm(tmp_path: Path) -> None:
    uri = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "out.jsonl"
    flags = [
        "--input", "zeromq", "--model", "PowerReport", "--uri", uri, "--socket-type", "PULL",
        "--output", "jsonl", "--model", "PowerReport", "--file", str(out),
    ]  # fmt: skip
    context = zmq.Context()
    sender = context.socket(zmq.PUSH)
    sender.connect(uri)  # the service binds; what is sent before it listens waits here
    reports = power_reports(100)
    try:
        with Service(tmp_path / "service.log", "run", *flags) as service:
            for start in range(0, 100, 10):  # one report per message, and JSON Lines of several
                sender.send(powerapi.encode_json(reports[start]).encode())
                sender.send(encode_json_lines(reports[start + 1 : start + 10]))
            service.stop_once_written(out, 100)
    finally:
        sender.close(linger=0)
        context.term()
    written = [powerapi.decode_json(PowerReport, line, "out", None) for line in out.open("rb")]
    assert written == reports


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--curve-server-key", "/nowhere/server.key"], "--curve-secret-key"),
        (["--curve-secret-key", "/nowhere/client.key_secret"], "/nowhere/client.key_secret"),
        (["--bind", "--connect"], "--bind or --connect"),
    ],
)
def test_a_zeromq_setting_that_cannot_work_is_one_line_and_exit_2(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    done = wattflow(
        "run", "--input", "zeromq", "--uri", f"tcp://127.0.0.1:{free_port()}", *flags,
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert named in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--uri", "tcp://127.0.0.1"], "cannot bind tcp://127.0.0.1: Invalid argument"),
        (["--uri", "tcp://nowhere", "--connect"], "cannot connect tcp://nowhere"),
        (["--uri", "ipc:///nonexistent-dir/out"], "cannot bind ipc:///nonexistent-dir/out"),
    ],
)
def test_an_output_address_zeromq_refuses_is_one_line_and_exit_2(
    fixtures: Path, flags: list[str], named: str
) -> None:
    """Found before anything runs, not by restarting the output until the supervisor gives up."""
    done = wattflow(
        "run", "--input", "csv", "--files", str(fixtures / "csv" / "rapl2.csv"),
        "--output", "zeromq", *flags,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"wattflow: error: output 'pusher_zeromq': {named}" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
