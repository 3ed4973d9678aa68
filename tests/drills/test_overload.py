"""Overload: many hwpc-sensors flood the socket input far faster than the service estimates.

A hundred connections (one per sensor, 50 containers each, as hwpc-sensor writes to its socket
output) send for ``OVERLOAD_DRILL_S`` seconds (60, in CI too) as fast as TCP takes their
bytes: the senders never wait on their own, so they offer whatever the service can be made to
take. The service must:

- hold bounded memory: its peak RSS (``VmHWM`` in ``/proc/PID/status``, the kernel's own high
  water mark) stays under :data:`PEAK_RSS_BOUND_MB`, however long the flood lasts;
- slow the senders down rather than buffer for them: every connection's kernel send buffer
  fills (the sender has bytes to send and the kernel has no room for them), because the input
  stops reading when the pipeline is full;
- lose nothing: once the senders stop, the backlog drains, the ledger counts every report sent
  as entered and balanced, and the PowerReports are those of a clean run of the same reports
  sent one sensor after the other.

The senders' share of time spent waiting for room in their sockets is printed: a share ``w``
means they could have sent ``1 / (1 - w)`` times what the service took.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..conftest import Service, drained_ledger, wait_until
from ..test_inputs_agree import differences, read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from generate_hwpc import Machine, containers_named, iso_millis, simulate, tick_views
from live_socket import FLAGS  # SmartWatts' flags, as the live path's benchmark gives them

DURATION_S = float(os.environ.get("OVERLOAD_DRILL_S", "60"))
"""How long the senders flood: a minute, as the reliability drills ask (less for a quick look)."""
SENSORS = 100
CONTAINERS = 50
PATTERN_TICKS = 12
"""Ticks simulated per sensor; the flood repeats them with later timestamps, so that the
senders hold a few MB, not the whole flood."""
PEAK_RSS_BOUND_MB = 300.0
"""The service's memory bound under overload with the default settings, start-up (about 90 MB)
included: measured 271 MB (the socket input's 64 MiB budget of lines, the mailboxes, the
formulas' state). A 32 MiB budget (``--max-buffered-bytes``) held 240 MB."""
LISTENING = re.compile(r"listening for hwpc-sensor on \S+:(\d+)")
VM_HWM = re.compile(r"^VmHWM:\s+(\d+) kB", re.MULTILINE)


class Sensor:
    """One sensor's stream: its simulated ticks, repeated with later timestamps."""

    def __init__(self, number: int) -> None:
        machine = Machine(sensor=f"node-{number + 1}", sockets=2, cpus_per_socket=4)
        views = [
            view
            for block in simulate(machine, containers_named(CONTAINERS), PATTERN_TICKS, seed=number)
            for view in tick_views(block)
        ]
        self.first_ms = views[0].millis
        self.pattern = [
            (view.timestamp.encode(), "".join(view.json_lines()).encode()) for view in views
        ]
        self.reports_per_tick = len(views[0].json_lines())

    def tick(self, index: int) -> bytes:
        """The stream's tick ``index``: a pattern tick, its timestamp moved on."""
        stamp, data = self.pattern[index % len(self.pattern)]
        return data.replace(stamp, iso_millis(self.first_ms + 1000 * index).encode())


@dataclass
class Flow:
    """One connection's progress."""

    sensor: Sensor
    connection: socket.socket
    ticks: int = 0
    pending: memoryview = field(default_factory=lambda: memoryview(b""))
    filled: int = 0
    """Rounds in which the flow had more to send and the kernel had no room for it (its send
    buffer full: the service was not reading)."""
    sending: bool = True
    """Until its stream ends: the sender always has more to send until then."""
    closed: bool = False


@dataclass
class Flood:
    """Every sensor sending as fast as TCP takes it, from one thread, until ``duration_s``."""

    port: int
    sensors: list[Sensor]
    duration_s: float
    flows: list[Flow] = field(default_factory=list)
    waited_s: float = 0.0
    sending_s: float = 0.0
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as error:  # handed to the test thread
            self.error = error

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for sensor in self.sensors:
            connection = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            connection.setblocking(False)
            flow = Flow(sensor, connection)
            self.flows.append(flow)
            selector.register(connection, selectors.EVENT_WRITE, flow)
        start = time.monotonic()
        deadline = start + self.duration_s
        open_flows = len(self.flows)
        while open_flows:
            before = time.monotonic()
            events = selector.select(timeout=60)
            self.waited_s += time.monotonic() - before
            assert events, "no connection could send or was closed for 60 s"
            ready = {id(key.data) for key, _ in events}
            for waiting in self.flows:
                if waiting.sending and id(waiting) not in ready:
                    waiting.filled += 1
            for key, mask in events:
                flow = key.data
                if mask & selectors.EVENT_READ:
                    if not flow.connection.recv(1 << 16):  # the service closed it: all read
                        selector.unregister(flow.connection)
                        flow.closed = True
                        open_flows -= 1
                    continue
                if self._send(flow, time.monotonic() < deadline):
                    selector.modify(flow.connection, selectors.EVENT_READ, flow)
        self.sending_s = time.monotonic() - start

    def _send(self, flow: Flow, going_on: bool) -> bool:
        """Send what the kernel takes of the flow's stream; True once it is over (half-closed)."""
        if not flow.pending:
            if not going_on:
                flow.connection.shutdown(socket.SHUT_WR)
                flow.sending = False
                return True
            flow.pending = memoryview(flow.sensor.tick(flow.ticks))
            flow.ticks += 1
        try:
            sent = flow.connection.send(flow.pending)
        except BlockingIOError:
            sent = 0
        if sent < len(flow.pending):
            flow.filled += 1
        flow.pending = flow.pending[sent:]
        return False

    @property
    def reports(self) -> int:
        return sum(flow.ticks * flow.sensor.reports_per_tick for flow in self.flows)


def peak_rss_mb(pid: int) -> float:
    """The process's peak RSS so far, in MB; 0 once it is gone."""
    try:
        found = VM_HWM.search(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0.0
    return int(found.group(1)) / 1024 if found else 0.0


class PeakWatch:
    """Reads the service's ``VmHWM`` every 50 ms until it exits: the last reading is its peak."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.peak_mb = 0.0
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while self.service.process.poll() is None:
            self.peak_mb = max(self.peak_mb, peak_rss_mb(self.service.process.pid))
            time.sleep(0.05)


def start_service(directory: Path) -> tuple[Service, int]:
    directory.mkdir()
    service = Service(
        directory / "service.log",
        "run", "--input", "socket", "--port", "0",
        "--output", "jsonl", "--file", str(directory / "power.jsonl"),
        "--dead-letters", str(directory / "dead.jsonl"),
        *FLAGS,
    )  # fmt: skip
    port: list[int] = []

    def listening() -> bool:
        found = LISTENING.search(service.text()) if service.alive() else None
        if found:
            port.append(int(found.group(1)))
        return bool(found)

    wait_until(listening, 60, "the socket input listening")
    return service, port[0]


def send_whole(port: int, sensor: Sensor, ticks: int) -> None:
    """Send a sensor's first ``ticks`` ticks on one connection, then wait for it to be read."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
        for index in range(ticks):
            connection.sendall(sensor.tick(index))
        connection.shutdown(socket.SHUT_WR)
        assert connection.recv(1) == b""  # closed once every line is read


def clean_run(directory: Path, sensors: list[Sensor], ticks: list[int]) -> Path:
    """The same reports, each sensor's sent whole on its connection: the reference."""
    service, port = start_service(directory)
    with service:
        senders = [
            threading.Thread(target=send_whole, args=(port, sensor, count), daemon=True)
            for sensor, count in zip(sensors, ticks, strict=True)
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(600)
        assert not any(sender.is_alive() for sender in senders)
        log = service.stop(timeout_s=120)
    ledger = drained_ledger(log)
    pairs = zip(sensors, ticks, strict=True)
    assert ledger["entered"] == sum(count * sensor.reports_per_tick for sensor, count in pairs)
    return directory / "power.jsonl"


@pytest.fixture
def drill_path(tmp_path: Path) -> Iterator[Path]:
    """The drill's directory. Its two outputs, several GB each at the rate the service takes a
    flood, are removed afterwards (the logs stay): pytest keeps the temporary directories of
    its last sessions, and a few drills' outputs would fill the disk."""
    yield tmp_path
    for run in ("flood", "clean"):
        (tmp_path / run / "power.jsonl").unlink(missing_ok=True)


@pytest.mark.timeout(900)  # a minute of flood, its drain and a clean run of the same reports
def test_a_flood_of_sensors_is_slowed_down_in_bounded_memory_and_nothing_is_lost(
    drill_path: Path,
) -> None:
    tmp_path = drill_path
    sensors = [Sensor(number) for number in range(SENSORS)]
    service, port = start_service(tmp_path / "flood")
    with service:
        watch = PeakWatch(service)
        flood = Flood(port, sensors, DURATION_S)
        sender = threading.Thread(target=flood.run, daemon=True)
        sender.start()
        sender.join(DURATION_S + 600)
        assert not sender.is_alive(), "the senders were still sending 600 s after the flood"
        assert flood.error is None, repr(flood.error)
        assert all(flow.closed for flow in flood.flows)
        log = service.stop(timeout_s=120)
        watch.thread.join(10)
    ledger = drained_ledger(log)
    waiting = flood.waited_s / flood.sending_s
    print(
        f"\noverload: {SENSORS} connections for {DURATION_S:.0f} s, then drained: "
        f"{flood.reports:,} reports sent in {flood.sending_s:.1f} s "
        f"({flood.reports / flood.sending_s:,.0f}/s taken), "
        f"waits on a full send buffer {sum(f.filled for f in flood.flows):,}, "
        f"senders waiting {waiting:.0%} of the time (could offer {1 / max(1 - waiting, 1e-9):.0f}× "
        f"what was taken), peak RSS {watch.peak_mb:.0f} MB"
    )

    assert 0 < watch.peak_mb <= PEAK_RSS_BOUND_MB, f"peak RSS {watch.peak_mb:.0f} MB"
    slowed = [flow for flow in flood.flows if flow.filled]
    assert len(slowed) == len(flood.flows), (
        f"only {len(slowed)} of {len(flood.flows)} connections found their send buffer full"
    )
    assert ledger["entered"] == flood.reports, ledger
    assert ledger["rejected_input"] == 0, ledger
    assert ledger["dead_out"] == 0, ledger
    assert not (tmp_path / "flood" / "dead.jsonl").exists() or not read_jsonl(
        tmp_path / "flood" / "dead.jsonl"
    )
    flooded = tmp_path / "flood" / "power.jsonl"
    found = LinesDigest.of(flooded)
    assert ledger["delivered"] == found.lines, ledger
    clean = clean_run(tmp_path / "clean", sensors, [flow.ticks for flow in flood.flows])
    expected = LinesDigest.of(clean)
    assert expected.lines
    if expected != found:  # the same lines, in another order: the same reports
        # Tens of millions of lines do not fit in memory as documents: one sensor's tell why.
        problems = differences("PowerReport", sensor_lines(clean), sensor_lines(flooded))
        assert problems == [], "\n".join(problems[:10])
        pytest.fail(f"the flood's PowerReports differ from the clean run's: {found} != {expected}")


@dataclass(frozen=True)
class LinesDigest:
    """A file's lines as a multiset, in bounded memory: how many, and two sums of their hashes
    (one process hashes both files, so equal lines hash equal; the order does not count)."""

    lines: int
    first: int
    second: int

    @classmethod
    def of(cls, path: Path) -> LinesDigest:
        lines = first = second = 0
        with path.open("rb") as stream:
            for line in stream:
                lines += 1
                first += hash(line)
                second += hash((line, 1))
        return cls(lines, first, second)


def sensor_lines(path: Path, sensor: str = "node-1") -> list[dict[str, object]]:
    """The PowerReports of one sensor, read one line at a time."""
    marker = f'"{sensor}"'.encode()
    with path.open("rb") as stream:
        documents = (json.loads(line) for line in stream if marker in line)
        return [document for document in documents if document.get("sensor") == sensor]
