"""hwpc-sensor's socket output: a TCP server that reads newline-delimited JSON reports.

hwpc-sensor connects as a client and writes one JSON report per line. A connection is read only
when its handler asks for more (its transport stays paused in between), and the whole input
holds at most ``max_buffered_bytes`` of lines read and not yet handed on, whatever the number of
connections: when the pipeline is full, the handlers wait to hand on, the budget runs out, every
connection stops being read, and TCP flow control slows the sensors instead of memory filling.
Lines are bounded: one longer than ``max_line_bytes`` is dead-lettered and skipped, so a broken
peer cannot make the service buffer without limit. Under ``--workers``, a worker's input listens
on no port: it adopts the connections the acceptor hands it (:mod:`wattflow.actors.handoff`) and
reads them through the same on-demand, byte-budgeted path.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, Protocol

from pydantic import Field, PositiveInt

from wattflow.actors.errors import PullUnavailable
from wattflow.actors.handoff import receive_connections
from wattflow.actors.partition import Partition
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, LineOutbox, Puller, PullerConfig
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import Report, report_kind

logger = logging.getLogger(__name__)


class SocketPullerConfig(PullerConfig):
    """Settings of the hwpc-sensor socket input."""

    type: Literal["socket"] = "socket"
    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on.",
        json_schema_extra={"flags": ["-h", "--host"]},
    )
    port: int = Field(
        default=9080,
        ge=0,
        le=65535,
        description="TCP port to listen on.",
        json_schema_extra={"flags": ["-p", "--port"]},
    )
    max_line_bytes: PositiveInt = Field(
        default=1 << 20, description="Longest report line accepted, in bytes."
    )
    max_batch: PositiveInt = Field(
        default=500, description="Reports decoded from one connection before they are handed on."
    )
    max_buffered_bytes: PositiveInt = Field(
        default=64 << 20,
        description="Bytes of report lines the input holds, over all its connections, read and "
        "not yet handed on (each read reserves 256 KiB of it first): when the pipeline is full, "
        "the input stops reading at this bound and TCP flow control slows the sensors.",
    )
    gather_ms: float = Field(
        default=20.0,
        ge=0,
        description="How long a connection's lines wait for more before they are decoded and "
        "handed on: a busy sensor's reads become one batch, a quiet sensor's reports wait at "
        "most this long.",
    )
    drain_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="At shutdown, how long connected sensors are still read for what they "
        "already sent.",
    )


READ_BYTES = 256 * 1024
"""The most one read of asyncio's socket transport returns: what a read reserves of the
input's ``max_buffered_bytes`` before it is made."""


class ByteBudget:
    """Bytes an input holds, shared by its connections: a read waits for room first.

    A read is let through when its bytes fit, or when nothing at all is held (so a budget
    smaller than one read cannot stop the input). Bytes are given back as lines are handed on.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.high_water_bytes = 0
        self.waits = 0
        """Reads that had to wait for room: how often the input stopped reading."""
        self._room = asyncio.Event()
        self._room.set()

    def has_room(self, size_bytes: int) -> bool:
        return not self.held_bytes or self.held_bytes + size_bytes <= self.limit_bytes

    async def take(self, size_bytes: int, wait_s: float | None = None) -> bool:
        """Hold ``size_bytes`` more, waiting until they fit, or ``wait_s`` at most: whether
        they are held."""
        if not self.has_room(size_bytes):
            self.waits += 1
            try:
                async with asyncio.timeout(wait_s):
                    while not self.has_room(size_bytes):
                        self._room.clear()
                        await self._room.wait()
            except TimeoutError:
                return False
        self.held_bytes += size_bytes
        self.high_water_bytes = max(self.high_water_bytes, self.held_bytes)
        return True

    def give(self, size_bytes: int) -> None:
        """Hold ``size_bytes`` fewer (more, when negative: lines kept from a read)."""
        self.held_bytes += -size_bytes
        if size_bytes > 0:
            self._room.set()


class Peer(Protocol):
    """One connection as the line reader sees it."""

    name: str

    async def read(self, wait_s: float | None) -> bytes | None:
        """The peer's next data: ``b""`` once it closed, ``None`` if nothing came in
        ``wait_s``."""


class _Connection(asyncio.Protocol):
    """One sensor's connection, read only when its handler asks.

    The transport is paused except while a read waits, so what the sensor sends stays in the
    kernel's buffers (and then in the sensor, through TCP flow control) until the input takes
    it, instead of piling up in this process as a stream reader's eager buffer would.
    """

    def __init__(self, handle: Callable[[_Connection], Coroutine[Any, Any, None]]) -> None:
        self._handle = handle
        self.name = "socket:?"
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self._data: deque[bytes] = deque()
        self._waiter: asyncio.Future[bytes | None] | None = None
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()
        self.name = "socket:{}:{}".format(*transport.get_extra_info("peername")[:2])
        self.task = asyncio.get_running_loop().create_task(self._handle(self))

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        self._data.append(data)
        self._wake()

    def eof_received(self) -> bool:
        self._closed = True
        self._wake()
        return False  # nothing is ever written back: close

    def connection_lost(self, error: Exception | None) -> None:
        if error is not None:
            logger.info("%s closed: %s", self.name, error)
        self._closed = True
        self._wake()

    def _wake(self, *_: object) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self, wait_s: float | None) -> bytes | None:
        if not self._data and not self._closed:
            assert self.transport is not None
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            self.transport.resume_reading()
            timer = loop.call_later(wait_s, self._wake) if wait_s is not None else None
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
                self.transport.pause_reading()
        if self._data:
            return self._data.popleft()
        return b"" if self._closed else None

    def cut(self) -> None:
        """Close the connection at once: a read in progress, and every later one, gets ``b""``."""
        if self.transport is not None:
            self.transport.abort()
        self._closed = True
        self._wake()


@pullers.register("socket")
class SocketPuller(Puller[SocketPullerConfig]):
    """Listens until the pipeline stops; every connected sensor is read concurrently."""

    config_model = SocketPullerConfig

    def __init__(self, config: SocketPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.kind = report_kind(config.model)
        self.bound_port: int | None = None
        self.listening = asyncio.Event()
        self.budget = ByteBudget(config.max_buffered_bytes)
        self._connections: set[_Connection] = set()
        self.handoff: socket.socket | None = None
        """``--workers``: the channel on which the acceptor hands this worker its connections
        (:mod:`wattflow.actors.handoff`); None: this input listens itself."""
        self.instance: Partition | None = None
        """``--workers``: the partition the workers share (``--partition``, or None: every
        sensor), to tell another worker's sensor from another instance's."""

    def not_ready(self) -> str | None:
        if self.handoff is not None:
            return None
        return None if self.bound_port is not None else "not listening yet"

    async def pull(self, emitter: Emitter) -> None:
        if self.handoff is not None and self.partition is not None:
            emitter = _OwnSensors(emitter, self.partition, self.instance)

        async def serve(connection: _Connection) -> None:
            self._connections.add(connection)
            try:
                await self._read(connection, emitter)
            finally:
                self._connections.discard(connection)
                if connection.transport is not None:
                    connection.transport.close()

        if self.handoff is not None:
            await self._take_handed(self.handoff, serve, emitter)
            await self._close_connections()
            return
        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(
                lambda: _Connection(serve), self.config.host, self.config.port
            )
        except OSError as error:
            raise PullUnavailable(
                f"cannot listen on {self.config.host}:{self.config.port}: {error.strerror}"
            ) from error
        self.bound_port = server.sockets[0].getsockname()[1]
        logger.info("listening for hwpc-sensor on %s:%s", self.config.host, self.bound_port)
        self.listening.set()
        async with server:
            await emitter.stopping.wait()
            server.close()
            await self._close_connections()

    async def _take_handed(
        self,
        channel: socket.socket,
        serve: Callable[[_Connection], Coroutine[Any, Any, None]],
        emitter: Emitter,
    ) -> None:
        """Read the connections the acceptor hands over until the pipeline stops.

        A handed connection becomes a :class:`_Connection` on an accepted socket, exactly as
        one this input accepts itself: read on demand, within the same byte budget.
        """
        loop = asyncio.get_running_loop()
        channel.setblocking(False)
        starting: set[asyncio.Task[Any]] = set()
        logger.info("reading the hwpc-sensor connections handed to this worker")

        async def adopt(connection: socket.socket) -> None:
            try:
                await loop.connect_accepted_socket(lambda: _Connection(serve), sock=connection)
            except OSError as error:  # the sensor hung up while the connection was handed
                logger.info("a handed connection could not be read: %s", error)
                connection.close()

        def on_readable() -> None:
            received = receive_connections(channel)
            if received is None:  # the acceptor closed the channel: no more connections
                loop.remove_reader(channel.fileno())
                return
            for connection in received:
                task = loop.create_task(adopt(connection))
                starting.add(task)
                task.add_done_callback(starting.discard)

        loop.add_reader(channel.fileno(), on_readable)
        try:
            await emitter.stopping.wait()
        finally:
            loop.remove_reader(channel.fileno())
            if starting:  # connections received just now: read them like the others
                await asyncio.wait(set(starting))

    async def _close_connections(self) -> None:
        """Read what connected sensors already sent for ``drain_grace_s``, then cut them off."""
        if self._connections:
            await asyncio.wait(self._tasks(), timeout=self.config.drain_grace_s)
        # Peers still connected after the grace period are cut off; what they sent before
        # is already handed on, and a line cut in half is dead-lettered.
        for connection in list(self._connections):
            connection.cut()
        if self._connections:
            await asyncio.wait(self._tasks())

    def _tasks(self) -> set[asyncio.Task[None]]:
        return {c.task for c in self._connections if c.task is not None}

    async def _read(self, peer: Peer, emitter: Emitter) -> None:
        """Read one connection a chunk at a time, decoding each batch's complete lines together.

        A chunk is what one read of the transport returns (256 KiB at most), so a busy sensor's
        reports are decoded and handed on hundreds at a time, while a quiet one's are handed on
        as soon as they arrive. Each chunk is reserved in the input's byte budget first; the
        lines held are counted until they are handed on.
        """
        limit = self.config.max_line_bytes
        line_number = 0
        partial = b""
        skipping = False  # inside a line longer than the limit, until its end
        batch = _CountedOutbox(self.kind, peer.name, self.budget)
        try:
            while True:
                chunk = await self._next_chunk(peer, batch, emitter)
                if not chunk:
                    self._last_line(partial, skipping, peer.name, line_number, batch, emitter)
                    break
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                start = 0
                for position, line in enumerate(lines):
                    if skipping:
                        # The end of an overlong line, already dead-lettered.
                        skipping = False
                        start = position + 1
                    elif len(line) > limit:
                        line_number = self._decode(
                            lines[start:position], peer.name, line_number, batch, emitter
                        )
                        line_number += 1
                        await batch.emit(emitter)  # dead letters in the order of lines
                        self._too_long(emitter, peer.name, line_number)
                        start = position + 1
                line_number = self._decode(lines[start:], peer.name, line_number, batch, emitter)
                if len(partial) > limit and not skipping:
                    line_number += 1
                    await batch.emit(emitter)
                    self._too_long(emitter, peer.name, line_number)
                    skipping = True
                if skipping:
                    partial = b""
                batch.settle()
                if batch.size >= self.config.max_batch:
                    await batch.emit(emitter)
            await batch.emit(emitter)
        finally:
            batch.release()

    async def _next_chunk(
        self, peer: Peer, batch: _CountedOutbox, emitter: Emitter
    ) -> bytes | None:
        """The peer's next data; ``None`` or empty once it closed, or went quiet while draining.

        While lines are held, the read waits ``gather_ms`` at most: a busy sensor's reads then
        gather into one batch, and a quiet sensor's lines are handed on once it pauses. Before
        reading, room for the read is taken in the budget; a connection that holds lines waits
        for it ``gather_ms`` at most, then hands its lines on (giving their room back), so that
        connections waiting for each other's room cannot stall: batches stay large while the
        budget is only briefly full.
        """
        while True:
            if emitter.stopping.is_set():  # draining: what the peer already sent, then stop
                wait_s: float | None = 0.1
            elif batch.size:
                wait_s = self.config.gather_ms / 1000
            else:
                wait_s = None
            if not await self.budget.take(READ_BYTES, wait_s if batch.size else None):
                await batch.emit(emitter)
                continue
            chunk = await peer.read(wait_s)
            self.budget.give(READ_BYTES - len(chunk or b""))
            batch.read_bytes += len(chunk or b"")
            if chunk is not None:
                return chunk
            if emitter.stopping.is_set():
                return None
            await batch.emit(emitter)

    def _decode(
        self,
        lines: list[bytes],
        peer: str,
        line_number: int,
        batch: _CountedOutbox,
        emitter: Emitter,
    ) -> int:
        """Hold complete lines that follow line ``line_number``, to be decoded when handed on;
        return the last one's number."""
        batch.add(lines, line_number + 1)
        return line_number + len(lines)

    def _last_line(
        self,
        partial: bytes,
        skipping: bool,
        peer: str,
        line_number: int,
        batch: _CountedOutbox,
        emitter: Emitter,
    ) -> None:
        """What the peer sent after its last newline, once it closed or went quiet."""
        if skipping or not partial.strip():
            return
        if emitter.stopping.is_set():
            emitter.reject(
                partial.decode("utf-8", "replace"),
                f"{peer}:{line_number + 1}: connection cut at shutdown mid-line",
            )
            return
        self._decode([partial], peer, line_number, batch, emitter)

    def _too_long(self, emitter: Emitter, peer: str, line_number: int) -> None:
        emitter.reject(
            None,
            f"{peer}:{line_number}: line longer than {self.config.max_line_bytes} bytes, skipped",
        )


class _CountedOutbox(LineOutbox):
    """A connection's lines, counted in the input's byte budget until they are handed on.

    ``read_bytes`` are the bytes read and not yet settled; :meth:`settle`, after a chunk's
    lines are split, keeps counted only the bytes of the complete lines held (the end of a line
    still to come is not counted: a budget full of half lines could never be read further).
    """

    def __init__(self, kind: type[Report], source: str, budget: ByteBudget) -> None:
        super().__init__(kind, source)
        self.budget = budget
        self.read_bytes = 0
        self.held_bytes = 0

    def add(self, lines: list[bytes], first_line: int) -> None:
        super().add(lines, first_line)
        self.held_bytes += sum(map(len, lines))

    def settle(self) -> None:
        """Give back what was read and is not held as complete lines."""
        self.budget.give(self.read_bytes - self.held_bytes)
        self.read_bytes = self.held_bytes

    async def emit(self, emitter: Emitter) -> None:
        """Hand the lines on, then give their bytes back."""
        try:
            await super().emit(emitter)
        finally:
            self.settle()
            self.budget.give(self.held_bytes)
            self.read_bytes = self.held_bytes = 0

    def release(self) -> None:
        """Give back everything still counted (the connection is done)."""
        self.budget.give(self.read_bytes)
        self.read_bytes = self.held_bytes = 0


class _OwnSensors:
    """A worker's emitter for handed connections: reports of a sensor that another worker
    owns (a connection carrying several sensors, handed over by its first line's) are
    dead-lettered, not skipped: no other worker reads this connection, so skipping would lose
    them. Reports of sensors no worker of this instance takes (``--partition``) go on to the
    pipeline, which skips them."""

    def __init__(self, emitter: Emitter, worker: Partition, instance: Partition | None) -> None:
        self._emitter = emitter
        self._worker = worker
        self._instance = instance
        self.stopping = emitter.stopping

    def _foreign(self, sensor: str) -> bool:
        return not self._worker.owns(sensor) and (
            self._instance is None or self._instance.owns(sensor)
        )

    async def emit(self, batch: Sequence[Report] | Sequence[Frame]) -> None:
        if len(batch) == 1 and isinstance(batch[0], HWPCFrame):
            await self._emit_frame(batch[0])
            return
        reports = [r for r in batch if isinstance(r, Report)]
        if len(reports) != len(batch):  # another kind of frame: the pipeline sorts it out
            await self._emitter.emit(batch)
            return
        self._reject_all([r for r in reports if self._foreign(r.sensor)])
        await self._emitter.emit([r for r in reports if not self._foreign(r.sensor)])

    async def _emit_frame(self, frame: HWPCFrame) -> None:
        sensors = frame.sensors()
        if not any(self._foreign(s) for s in sensors):
            await self._emitter.emit([frame])
            return
        for sensor in sensors:
            part = frame.of_sensor(sensor)
            if self._foreign(sensor):
                self._reject_all(part.reports())
            else:
                await self._emitter.emit([part])

    def _reject_all(self, reports: Sequence[Report]) -> None:
        for report in reports:
            self._emitter.reject(
                report,
                f"sensor {report.sensor!r} belongs to another worker (--workers): this "
                "connection went to the worker of its first report's sensor; send each "
                "sensor's reports on a connection of its own",
            )

    def reject(self, payload: Any, reason: str) -> None:
        self._emitter.reject(payload, reason)

    def skip(self, count: int) -> None:
        self._emitter.skip(count)
