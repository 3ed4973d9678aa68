"""``wattflow run --workers N``: N processes, each with its share of the sensors.

Against real sockets, real files and a real MongoDB: two workers write the PowerReports one
process writes, each sensor in one worker; a worker killed mid-stream is restarted and goes on
taking its sensors' connections; SIGTERM drains every worker and the exit line adds up their
ledgers; ``/health`` and ``/metrics`` answer for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import urllib3

from wattflow.actors.checkpoints import decode_checkpoint
from wattflow.actors.handoff import (
    FIRST_LINE_TIMEOUT_S,
    Acceptor,
    first_sensor,
    receive_connections,
)
from wattflow.actors.partition import Partition
from wattflow.service.workers import per_worker_path

from .conftest import Service, drained_ledger, run_async, wait_until, wattflow
from .servers import free_port
from .test_partition import SENSORS, SETTINGS, read_jsonl, recording, written
from .test_status_server import get, samples

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

__all__ = ["recording"]  # the fixture, shared with the partition tests

WORKERS = 2


def flags(directory: Path, name: str) -> list[str]:
    return [
        *SETTINGS,
        "--output", "jsonl", "--file", str(directory / f"{name}.jsonl"),
        "--dead-letters", str(directory / f"{name}-dead.jsonl"),
    ]  # fmt: skip


def workers_written(directory: Path, name: str, count: int = WORKERS) -> list[Counter[Any]]:
    """Each worker's PowerReports, from its own file."""
    return [written(per_worker_path(directory / f"{name}.jsonl", j)) for j in range(count)]


def sensors_of(reports: Counter[Any]) -> set[str]:
    return {key[1] for key in reports}


def lines_per_sensor(recording: Path) -> dict[str, bytes]:
    """Each machine's hwpc-sensor stream, as it sends it on its own connection."""
    streams: dict[str, list[bytes]] = {}
    for line in recording.read_bytes().splitlines(keepends=True):
        sensor = first_sensor(line, complete=True)
        assert sensor is not None
        streams.setdefault(sensor, []).append(line)
    return {sensor: b"".join(lines) for sensor, lines in streams.items()}


def listening_port(service: Service) -> int:
    service.wait_for_log("listening for hwpc-sensor on ")
    found = re.search(r"listening for hwpc-sensor on [^:\s]+:(\d+)", service.text())
    assert found, service.text()
    return int(found[1])


def send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(data)


def read_from_socket(http_port: int) -> float:
    """The reports the socket input of every worker has handed on, from the parent's
    ``/metrics``; it fails unless both workers' metrics are there, labelled."""
    found = samples(get(f"http://127.0.0.1:{http_port}/metrics")[1])
    counts = {
        dict(labels).get("worker"): count
        for (name, labels), count in found.items()
        if name == "wattflow_actor_reports_out_total"
        and dict(labels).get("actor") == "puller:puller_socket"
    }
    assert set(counts) == {str(j) for j in range(WORKERS)}, counts
    return sum(counts.values())


def one_process_output(recording: Path, directory: Path) -> Counter[Any]:
    """The PowerReports one process writes from the recording (``one.jsonl``): what the
    workers must write together."""
    whole = wattflow("run", "--input", "jsonl", "--files", str(recording), *flags(directory, "one"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    return written(directory / "one.jsonl")


@dataclass
class SocketWorkers:
    """``wattflow run --workers 2`` on the socket input, writing to ``two.jsonl``."""

    service: Service
    socket_port: int
    http_port: int

    def ready(self) -> bool:
        """Whether ``/ready`` says so; not yet while the parent, which listens on the sensors'
        port first, has not started its status server."""
        try:
            return get(f"http://127.0.0.1:{self.http_port}/ready")[0] == 200
        except urllib3.exceptions.NewConnectionError:
            return False

    def wait_read(self, count: int, what: str) -> None:
        """Wait until the workers' socket inputs have handed on ``count`` reports in all."""
        wait_until(
            lambda: self.service.alive() and read_from_socket(self.http_port) == count, 60, what
        )


@contextmanager
def socket_workers(directory: Path) -> Iterator[SocketWorkers]:
    """The workers started, once their socket listens and ``/ready`` answers; killed on the
    way out unless the test stopped them."""
    port = free_port()
    with Service(
        directory / "service.log", "run", "--workers", str(WORKERS), "--http-port", str(port),
        "--input", "socket", "--port", "0", *flags(directory, "two"),
    ) as service:  # fmt: skip
        workers = SocketWorkers(service, listening_port(service), port)
        wait_until(workers.ready, 60, "/ready")
        yield workers


def check_split(directory: Path, name: str, expected: Counter[Any]) -> None:
    """The workers' files hold, together, exactly ``expected``; each sensor in its worker's."""
    parts = workers_written(directory, name)
    assert sum(parts, Counter()) == expected
    for index, part in enumerate(parts):
        mine = Partition(0, 1).split(WORKERS)[index]
        assert part, f"worker {index} wrote nothing"
        assert all(mine.owns(sensor) for sensor in sensors_of(part)), (index, sensors_of(part))


def test_the_acceptor_finds_the_sensor_of_a_first_line() -> None:
    line = b'{"timestamp": 1, "sensor": "node-\\u00e9", "target": "all", "groups": {}}\n'
    assert first_sensor(line, complete=True) == "node-é"
    assert first_sensor(line[:40], complete=False) == "node-é", "before the line is whole"
    assert first_sensor(b'{"timestamp": 1, "sen', complete=False) is None
    assert first_sensor(b"not json at all\n", complete=True) is None


def report_line(sensor: str) -> bytes:
    return json.dumps({"timestamp": 1, "sensor": sensor, "target": "all", "groups": {}}).encode()


@contextmanager
def acceptor_of_two(
    first_line_timeout_s: float = FIRST_LINE_TIMEOUT_S,
) -> Iterator[tuple[Acceptor, list[socket.socket]]]:
    """An acceptor listening on a free loopback port, with two workers' channels: the
    acceptor and the workers' ends (which the test reads, as the workers would). The
    channels' send buffers are the smallest the kernel allows: a few connections fill them
    (by default a few hundred do)."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(WORKERS)]
    for parent_end, worker_end in pairs:
        parent_end.setblocking(False)
        parent_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        worker_end.setblocking(False)
    channels = [parent for parent, _ in pairs]
    acceptor = Acceptor(
        "127.0.0.1",
        0,
        channels,
        Partition(0, 1),
        1 << 20,
        first_line_timeout_s=first_line_timeout_s,
    )
    acceptor.listen()
    try:
        yield acceptor, [worker_end for _, worker_end in pairs]
    finally:
        acceptor.close()
        for parent_end, worker_end in pairs:
            parent_end.close()
            worker_end.close()


async def until(ready: Any, timeout_s: float, what: str) -> None:
    """:func:`wait_until` for a test that runs on the event loop with the acceptor."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not ready():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not after {timeout_s} s"
        await asyncio.sleep(0.01)


def taken(worker_end: socket.socket) -> list[socket.socket]:
    """The connections waiting on a worker's end of its channel (as the worker takes them)."""
    received = receive_connections(worker_end)
    assert received is not None, "the acceptor closed the channel"
    return received


def test_a_full_channel_keeps_its_connections_until_its_worker_takes_them() -> None:
    """More connections at once than a worker's channel holds: the acceptor queues them, and
    sends each as its channel makes room; none is closed, each reaches its sensor's worker."""
    count = 100

    async def scenario() -> None:
        with acceptor_of_two() as (acceptor, worker_ends):
            serving = asyncio.ensure_future(acceptor.serve())
            port = acceptor.bound_port
            assert port is not None
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
            for number, client in enumerate(clients):
                client.sendall(report_line(f"node-{number}") + b"\n")
            await until(
                lambda: sum(acceptor.handed) + sum(acceptor.queued) == count, 10, "every peek"
            )
            assert sum(acceptor.queued), "the workers' channels were full, some waited"
            got: list[list[socket.socket]] = [[] for _ in worker_ends]

            def take_all() -> bool:
                for index, worker_end in enumerate(worker_ends):
                    got[index] += taken(worker_end)
                return sum(map(len, got)) == count

            await until(take_all, 10, "every connection in its worker")
            assert acceptor.handed == [len(mine) for mine in got]
            assert not acceptor.closed
            for index, mine in enumerate(got):
                for connection in mine:
                    sensor = first_sensor(connection.recv(1 << 16), complete=True)
                    assert Partition(0, 1).worker_of(str(sensor), WORKERS) == index, sensor
                    connection.close()
            serving.cancel()
            for client in clients:
                client.close()

    run_async(scenario())


def test_a_connection_without_its_first_line_in_time_goes_to_no_worker() -> None:
    """A connection that sends nothing, and one that sends the start of a line without its
    sensor, are closed once the first line's deadline passes (counted as silent), handed to
    no worker. A first line cut by the peer's close, and one that is not JSON, go to worker 0,
    which dead-letters them, as they would be without workers."""
    start = b'{"timestamp": 1, "sen'

    async def scenario() -> None:
        with acceptor_of_two(first_line_timeout_s=0.5) as (acceptor, worker_ends):
            serving = asyncio.ensure_future(acceptor.serve())
            address = ("127.0.0.1", acceptor.bound_port or 0)
            silent = socket.create_connection(address)
            partial = socket.create_connection(address)
            partial.sendall(start)
            cut = socket.create_connection(address)
            cut.sendall(start)
            cut.shutdown(socket.SHUT_WR)
            garbage = socket.create_connection(address)
            garbage.sendall(b"not json at all\n")
            await until(lambda: acceptor.closed["silent"] == 2, 10, "two silent closed")
            assert acceptor.handed == [2, 0]
            for client in (silent, partial):
                client.settimeout(5)
                with contextlib.suppress(ConnectionResetError):
                    assert client.recv(1) == b"", "closed by the acceptor"
            given = taken(worker_ends[0])
            assert sorted(c.recv(100) for c in given) == sorted([start, b"not json at all\n"])
            assert taken(worker_ends[1]) == []
            serving.cancel()
            for connection in [*given, silent, partial, cut, garbage]:
                connection.close()

    run_async(scenario())


def test_each_sensor_goes_to_exactly_one_worker_of_a_partition() -> None:
    instance = Partition(1, 3)
    workers = instance.split(2)
    for number in range(500):
        sensor = f"node-{number}"
        owners = [j for j, part in enumerate(workers) if part.owns(sensor)]
        assert len(owners) == (1 if instance.owns(sensor) else 0), sensor
        assert instance.worker_of(sensor, 2) == (owners[0] if owners else None)


def test_two_workers_on_the_socket_write_what_one_process_writes(
    recording: Path, tmp_path: Path
) -> None:
    """Six machines, one connection each: the two workers' files are the single process's
    output split by sensor, nothing dead-lettered, and the exit line sums both ledgers."""
    streams = lines_per_sensor(recording)
    expected = one_process_output(recording, tmp_path)
    assert expected
    with socket_workers(tmp_path) as workers:
        for data in streams.values():
            send(workers.socket_port, data)
        sent = len(recording.read_bytes().splitlines())
        workers.wait_read(sent, "every report read, as the workers' metrics say")
        log = workers.service.stop()
    check_split(tmp_path, "two", expected)
    ledger = drained_ledger(log)
    assert ledger["entered"] == len(recording.read_bytes().splitlines())
    assert ledger["delivered"] == sum(expected.values())
    assert ledger["rejected_input"] == ledger["dead_out"] == 0
    assert ledger["workers"] == WORKERS
    assert ledger["worker_restarts"] == ledger["worker_deaths"] == 0
    for index in range(WORKERS):
        assert read_jsonl(per_worker_path(tmp_path / "two-dead.jsonl", index)) == []


def test_a_killed_worker_is_restarted_and_takes_its_sensors_again(
    recording: Path, tmp_path: Path
) -> None:
    """SIGKILL one worker: the parent starts it again, and the sensors it owns, connecting
    afterwards, are read by the new one: the output is whole. The death shows: logged when it
    happens, counted in the parent's ``/metrics``, named in the exit lines, and the run exits
    1 although the drain after it was clean (the ledger cannot count what the dead process
    had read)."""
    streams = lines_per_sensor(recording)
    expected = one_process_output(recording, tmp_path)
    with socket_workers(tmp_path) as workers:
        service = workers.service
        found = re.search(r"worker 0/2 started \(pid (\d+)\)", service.text())
        assert found, service.text()
        os.kill(int(found[1]), signal.SIGKILL)
        service.wait_for_log("worker 0/2 was killed by SIGKILL")
        service.wait_for_log("worker 0/2 started", count=2)
        wait_until(workers.ready, 60, "/ready again")
        assert worker_restarts(workers.http_port) == {"0": 1.0, "1": 0.0}
        for data in streams.values():
            send(workers.socket_port, data)
        workers.wait_read(len(recording.read_bytes().splitlines()), "every report read")
        log = service.stop(code=1)
    check_split(tmp_path, "two", expected)
    assert re.search(
        r"worker 0/2 was killed by SIGKILL; the reports it held are lost: restarting it "
        r"\(restart 1 of the run; 1 of 5 within 60 s\)",
        log,
    ), log[-3000:]
    ledger = drained_ledger(log)
    assert ledger["worker_restarts"] == 1
    assert ledger["worker_deaths"] == 1
    assert (
        "wattflow: error: worker 0/2 died (was killed by SIGKILL) and was restarted 1 time: "
        "what it had read before is not in the ledger, and the reports it held were not "
        "written"
    ) in log, log[-3000:]
    assert "worker 1/2 died" not in log


def worker_restarts(http_port: int) -> dict[str, float]:
    """``wattflow_worker_restarts_total`` of each worker slot, from the parent's ``/metrics``."""
    found = samples(get(f"http://127.0.0.1:{http_port}/metrics")[1])
    return {
        dict(labels)["worker"]: count
        for (name, labels), count in found.items()
        if name == "wattflow_worker_restarts_total"
    }


def test_a_connection_of_several_sensors_goes_to_its_first_sensors_worker(
    recording: Path, tmp_path: Path
) -> None:
    """Every machine's reports on one connection: the worker of the first line's sensor reads
    it, and the reports of the other worker's sensors are dead letters, not lost silently."""
    data = recording.read_bytes()
    first = first_sensor(data, complete=True)
    assert first is not None
    owner = Partition(0, 1).worker_of(first, WORKERS)
    assert owner is not None
    theirs = [s for s in SENSORS if Partition(0, 1).worker_of(s, WORKERS) != owner]
    assert theirs, "the recording's sensors fall to both workers"
    expected_dead = sum(1 for line in data.splitlines() if first_sensor(line, True) in theirs)
    with socket_workers(tmp_path) as workers:
        send(workers.socket_port, data)
        workers.wait_read(len(data.splitlines()) - expected_dead, "every report read")
        log = workers.service.stop()
    dead = per_worker_path(tmp_path / "two-dead.jsonl", owner)
    assert len(read_jsonl(dead)) == expected_dead
    assert "belongs to another worker" in read_jsonl(dead)[0]["reason"]
    assert drained_ledger(log)["rejected_input"] == expected_dead


def test_two_workers_share_a_file_input_by_sensor(recording: Path, tmp_path: Path) -> None:
    """Files: each worker reads them and keeps its sensors; both end with the input."""
    expected = one_process_output(recording, tmp_path)
    two = wattflow(
        "run", "--workers", str(WORKERS), "--input", "jsonl", "--files", str(recording),
        *flags(tmp_path, "two"),
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    check_split(tmp_path, "two", expected)
    ledger = drained_ledger(two.stderr)
    lines = len(recording.read_bytes().splitlines())
    assert ledger["entered"] + ledger["skipped"] == WORKERS * lines
    assert ledger["entered"] == lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "zeromq", "--uri", "tcp://127.0.0.1:1", "--socket-type", "PULL"], "PULL"),
        (["--input", "jsonl", "--files", "x.jsonl", "--output", "table"], "table"),
        (["--input", "jsonl", "--files", "x.jsonl", "--run", "e/b/s/1"], "--run"),
    ],
)
def test_what_one_process_must_do_is_refused_with_workers(
    args: list[str], message: str, tmp_path: Path
) -> None:
    result = wattflow(
        "run", "--workers", "2", *args, "--output", "jsonl", "--file", str(tmp_path / "o.jsonl"),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "--workers" in result.stderr, result.stderr


def test_each_worker_keeps_its_own_state_file(recording: Path, tmp_path: Path) -> None:
    """``--state-file`` under ``--workers``: each worker saves its sensors' formula state in a
    file of its own and restores it, so a recording run in two halves by two workers writes
    what one process writes over the whole recording (relearning would leave ticks out)."""
    lines = recording.read_bytes().splitlines(keepends=True)
    stamps = sorted({json.loads(line)["timestamp"] for line in lines})
    middle = stamps[len(stamps) // 2]  # a whole tick of every sensor in one half or the other
    halves = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    halves[0].write_bytes(b"".join(x for x in lines if json.loads(x)["timestamp"] < middle))
    halves[1].write_bytes(b"".join(x for x in lines if json.loads(x)["timestamp"] >= middle))
    one = one_process_output(recording, tmp_path)
    state = tmp_path / "state" / "wattflow.state"
    got: dict[tuple[Any, ...], float] = {}
    for number, half in enumerate(halves):
        done = wattflow(
            "run", "--workers", str(WORKERS), "--input", "jsonl", "--files", str(half),
            "--state-file", str(state), *flags(tmp_path, f"half{number}"),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert not state.exists(), "the workers share no state file"
        for index in range(WORKERS):
            saved = decode_checkpoint(per_worker_path(state, index).read_bytes())
            assert saved is not None, index
            assert saved["formulas"], index
        if number:
            assert done.stderr.count("restored the state of") == WORKERS, done.stderr[-3000:]
        for part in workers_written(tmp_path, f"half{number}"):
            for key in part:
                assert key[:5] not in got, f"{key} written twice"
                got[key[:5]] = float(key[5])
    expected = {key[:5]: float(key[5]) for key in one}
    assert set(got) == set(expected)
    assert all(abs(got[key] - value) <= 1e-6 * max(1.0, value) for key, value in expected.items())


# --- a thousand sensors connecting at once ----------------------------------------------------

THOUSAND = 1000
LATE_S = 1.5
"""How long the late connections keep their first line back: connected, silent."""
LATER_S = 6.0
"""A few wait longer than the acceptor once waited for a first line (5 s) before it gave
the connection to worker 0."""
LOW_OPEN_FILES = 512
"""The soft open-files limit the service is started with: too few for a thousand
connections, so the service must raise it itself."""
START_WITH_LOW_LIMIT = (
    "import resource, sys; from wattflow.service.cli import main; "
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({LOW_OPEN_FILES}, hard)); "
    "sys.exit(main(sys.argv[1:]))"
)


@dataclass
class Sender:
    """One sensor's connection: ``head`` bytes as soon as it is open, the rest ``late_s``
    later (0: at once), then it half-closes and waits for its worker to close."""

    sensor: str
    data: bytes
    head: int = 0
    late_s: float = 0.0


def thousand_senders(stream: bytes, sensor: str) -> list[Sender]:
    """A thousand sensors, each sending ``stream`` under its own name: most at once; one in
    ten late, its first line whole; one in ten late with its first line cut before the
    sensor's name (20 bytes at once); one in a hundred later still."""
    senders = []
    for number in range(1, THOUSAND + 1):
        name = f"machine-{number}"
        data = stream.replace(f'"sensor":"{sensor}"'.encode(), f'"sensor":"{name}"'.encode())
        assert data.count(name.encode()) == stream.count(sensor.encode())
        if number % 100 == 0:
            senders.append(Sender(name, data, late_s=LATER_S))
        elif number % 10 == 0:
            senders.append(Sender(name, data, late_s=LATE_S))
        elif number % 10 == 5:
            senders.append(Sender(name, data, head=20, late_s=LATE_S))
        else:
            senders.append(Sender(name, data))
    assert b'"sensor"' not in senders[4].data[:20], "the head ends before the sensor's name"
    return senders


async def send_all_at_once(port: int, senders: list[Sender]) -> list[str]:
    """Open every connection at once, then send on each: what went wrong (a connection
    reset, refused, or closed before its worker read it all), one line per connection."""
    opened = await asyncio.gather(
        *(asyncio.open_connection("127.0.0.1", port) for _ in senders), return_exceptions=True
    )
    problems: list[str] = []
    streams = []
    for sender, connection in zip(senders, opened, strict=True):
        if isinstance(connection, BaseException):
            problems.append(f"{sender.sensor}: cannot connect: {connection!r}")
        else:
            streams.append(_stream(sender, *connection))
    results = await asyncio.gather(*streams, return_exceptions=True)
    problems += [f"{result!r}" for result in results if result is not None]
    return problems


async def _stream(
    sender: Sender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        writer.write(sender.data[: sender.head])
        await writer.drain()
        if sender.late_s:
            await asyncio.sleep(sender.late_s)  # the deliberate lateness of its first line
        writer.write(sender.data[sender.head :])
        await writer.drain()
        writer.write_eof()
        # Its worker closes the connection once it has read every line of it.
        rest = await asyncio.wait_for(reader.read(), 60)
        assert rest == b"", f"{sender.sensor}: the service wrote {rest[:100]!r}"
    except OSError as error:
        raise AssertionError(f"{sender.sensor}: {error!r}") from error
    finally:
        writer.close()


def acceptor_counts(http_port: int) -> dict[tuple[str, str], float]:
    """The parent's acceptor metrics: connections by (outcome, worker), and ("pending", "")."""
    found = samples(get(f"http://127.0.0.1:{http_port}/metrics")[1])
    counts = {
        (dict(labels)["outcome"], dict(labels)["worker"]): count
        for (name, labels), count in found.items()
        if name == "wattflow_acceptor_connections_total"
    }
    counts["pending", ""] = found["wattflow_acceptor_pending", (("input", "puller_socket"),)]
    return counts


def enough_open_files(wanted: int) -> None:
    """Raise this process's soft open-files limit to ``wanted`` (the hard limit allowing)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"a thousand connections need {wanted} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def test_a_thousand_connections_opening_at_once_each_go_to_their_sensors_worker(
    tmp_path: Path,
) -> None:
    """A thousand sensors connect at the same moment, some of them holding their first
    line back for 1.5 s (whole, or cut before the sensor's name), a few for 6 s: each
    connection is read by the worker that owns its sensor, none is reset, and the two
    workers' files hold every sensor's PowerReports, each in its own worker's file. The
    service starts with a soft limit of 512 open files, and raises it."""
    enough_open_files(2 * THOUSAND + 256)
    one_sensor = tmp_path / "machine.jsonl"
    record(ticks=4, containers=1, sensors=("node-1",), jsonl=one_sensor)
    alone = one_process_output(one_sensor, tmp_path)
    assert {key[1] for key in alone} == {"node-1"}
    senders = thousand_senders(one_sensor.read_bytes(), "node-1")
    lines = len(one_sensor.read_bytes().splitlines()) * THOUSAND
    http_port = free_port()
    args = [
        "run", "--workers", str(WORKERS), "--http-port", str(http_port),
        "--input", "socket", "--port", "0", *flags(tmp_path, "many"),
    ]  # fmt: skip
    command = [sys.executable, "-c", START_WITH_LOW_LIMIT, *args]
    with Service(tmp_path / "service.log", command=command) as service:
        workers = SocketWorkers(service, listening_port(service), http_port)
        wait_until(workers.ready, 60, "/ready")
        problems = run_async(send_all_at_once(workers.socket_port, senders), 90)
        assert problems == [], f"{len(problems)} connections failed: {problems[:5]}"
        workers.wait_read(lines, "every report read, as the workers' metrics say")
        owners = Counter(str(Partition(0, 1).worker_of(s.sensor, WORKERS)) for s in senders)
        assert acceptor_counts(http_port) == {
            ("handed", "0"): owners["0"],
            ("handed", "1"): owners["1"],
            **{(outcome, ""): 0 for outcome in ("silent", "stalled", "failed", "stopped")},
            ("peer_closed", ""): 0,
            ("pending", ""): 0,
        }
        log = service.stop()
    assert f"raised the open-files limit (RLIMIT_NOFILE) from {LOW_OPEN_FILES}" in log, log[:3000]
    parts = workers_written(tmp_path, "many")
    for index, part in enumerate(parts):
        mine = Partition(0, 1).split(WORKERS)[index]
        assert part, f"worker {index} wrote nothing"
        assert all(mine.owns(sensor) for sensor in sensors_of(part)), index
    expected = Counter(
        {(key[0], s.sensor, *key[2:]): count for s in senders for key, count in alone.items()}
    )
    assert sum(parts, Counter()) == expected
    ledger = drained_ledger(log)
    assert ledger["entered"] == lines
    assert ledger["rejected_input"] == ledger["dead_out"] == 0
    assert ledger["delivered"] == sum(expected.values())
    assert ledger["connections_handed"] == THOUSAND
    assert ledger["connections_closed"] == 0
    for index in range(WORKERS):
        assert read_jsonl(per_worker_path(tmp_path / "many-dead.jsonl", index)) == []
    assert "belongs to another worker" not in log
    assert "not handed" not in log
