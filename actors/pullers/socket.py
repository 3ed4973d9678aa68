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
from typing import Literal

from pydantic import Field, PositiveInt

from wattflow.actors.errors import PullUnavailable
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, LineOutbox, Puller, PullerConfig
from wattflow.formats.reports import report_kind

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

    def not_ready(self) -> str | None:
        return None if self.bound_port is not None else "not listening yet"

    async def pull(self, emitter: Emitter) -> None:
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
