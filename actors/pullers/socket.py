"""hwpc-sensor's socket output: a TCP server that reads newline-delimited JSON reports.

hwpc-sensor connects as a client and writes one JSON report per line. Each connection is read
no faster than the pipeline accepts its reports, so a slow pipeline slows the sensor through TCP
flow control instead of filling memory. Lines are bounded: one longer than ``max_line_bytes`` is
dead-lettered and skipped, so a broken peer cannot make the service buffer without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import Any, Literal

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


@pullers.register("socket")
class SocketPuller(Puller[SocketPullerConfig]):
    """Listens until the pipeline stops; every connected sensor is read concurrently."""

    config_model = SocketPullerConfig

    def __init__(self, config: SocketPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.kind = report_kind(config.model)
        self.bound_port: int | None = None
        self.listening = asyncio.Event()
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
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

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._connections[task] = writer
            try:
                await self._read(reader, writer, emitter)
            finally:
                self._connections.pop(task, None)
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

        if self.handoff is not None:
            await self._take_handed(self.handoff, serve, emitter)
            await self._close_connections()
            return
        try:
            server = await asyncio.start_server(
                serve, self.config.host, self.config.port, limit=self.config.max_line_bytes
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

    async def _take_handed(self, channel: socket.socket, serve: Any, emitter: Emitter) -> None:
        """Read the connections the acceptor hands over until the pipeline stops."""
        loop = asyncio.get_running_loop()
        channel.setblocking(False)
        tasks: set[asyncio.Task[None]] = set()
        limit = self.config.max_line_bytes
        logger.info("reading the hwpc-sensor connections handed to this worker")

        async def start(connection: socket.socket) -> None:
            reader, writer = await asyncio.open_connection(sock=connection, limit=limit)
            await serve(reader, writer)

        def on_readable() -> None:
            received = receive_connections(channel)
            if received is None:  # the acceptor closed the channel: no more connections
                loop.remove_reader(channel.fileno())
                return
            for connection in received:
                task = asyncio.ensure_future(start(connection))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        loop.add_reader(channel.fileno(), on_readable)
        try:
            await emitter.stopping.wait()
        finally:
            loop.remove_reader(channel.fileno())

    async def _close_connections(self) -> None:
        """Read what connected sensors already sent for ``drain_grace_s``, then cut them off."""
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=self.config.drain_grace_s)
        # Peers still connected after the grace period are cut off; what they sent before
        # is already handed on, and a line cut in half is dead-lettered.
        for open_writer in list(self._connections.values()):
            open_writer.transport.abort()
        if self._connections:
            await asyncio.wait(set(self._connections))

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, emitter: Emitter
    ) -> None:
        """Read one connection a chunk at a time, decoding each chunk's complete lines together.

        A chunk is whatever the peer's data already buffered holds (up to ``max_line_bytes``),
        so a busy sensor's reports are decoded and handed on hundreds at a time, while a quiet
        one's are handed on as soon as they arrive.
        """
        peer = "socket:{}:{}".format(*writer.get_extra_info("peername")[:2])
        limit = self.config.max_line_bytes
        line_number = 0
        partial = b""
        skipping = False  # inside a line longer than the limit, until its end
        batch = LineOutbox(self.kind, peer)
        try:
            while True:
                chunk = await self._next_chunk(reader, batch, emitter)
                if not chunk:
                    self._last_line(partial, skipping, peer, line_number, batch, emitter)
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
                            lines[start:position], peer, line_number, batch, emitter
                        )
                        line_number += 1
                        await batch.emit(emitter)  # dead letters in the order of lines
                        self._too_long(emitter, peer, line_number)
                        start = position + 1
                line_number = self._decode(lines[start:], peer, line_number, batch, emitter)
                if len(partial) > limit and not skipping:
                    line_number += 1
                    await batch.emit(emitter)
                    self._too_long(emitter, peer, line_number)
                    skipping = True
                if skipping:
                    partial = b""
                if batch.size >= self.config.max_batch:
                    await batch.emit(emitter)
        except ConnectionError as error:
            logger.info("%s closed: %s", peer, error)
        await batch.emit(emitter)

    async def _next_chunk(
        self, reader: asyncio.StreamReader, batch: LineOutbox, emitter: Emitter
    ) -> bytes | None:
        """The peer's next data; ``None`` or empty once it closed, or went quiet while draining.

        While lines are held, the read waits ``gather_ms`` at most: a busy sensor's reads then
        gather into one batch, and a quiet sensor's lines are handed on once it pauses.
        """
        limit = self.config.max_line_bytes
        while True:
            if emitter.stopping.is_set():  # draining: what the peer already sent, then stop
                wait_s: float | None = 0.1
            elif batch.size:
                wait_s = self.config.gather_ms / 1000
            else:
                return await reader.read(limit)
            try:
                return await asyncio.wait_for(reader.read(limit), wait_s)
            except TimeoutError:
                if emitter.stopping.is_set():
                    return None
                await batch.emit(emitter)

    def _decode(
        self,
        lines: list[bytes],
        peer: str,
        line_number: int,
        batch: LineOutbox,
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
        batch: LineOutbox,
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
