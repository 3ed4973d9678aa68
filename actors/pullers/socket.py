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
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.formats import powerapi
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
        batch: list[Report] = []
        try:
            while True:
                try:
                    if emitter.stopping.is_set():
                        # Draining: read what the peer already sent, stop once it goes quiet.
                        chunk = await asyncio.wait_for(reader.read(limit), 0.1)
                    else:
                        chunk = await reader.read(limit)
                except TimeoutError:
                    chunk = None
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
                        self._too_long(emitter, peer, line_number)
                        start = position + 1
                line_number = self._decode(lines[start:], peer, line_number, batch, emitter)
                if len(partial) > limit and not skipping:
                    line_number += 1
                    self._too_long(emitter, peer, line_number)
                    skipping = True
                if skipping:
                    partial = b""
                if len(batch) >= self.config.max_batch or not getattr(reader, "_buffer", b""):
                    await emitter.emit(batch)
                    batch = []
        except ConnectionError as error:
            logger.info("%s closed: %s", peer, error)
        await emitter.emit(batch)

    def _decode(
        self,
        lines: list[bytes],
        peer: str,
        line_number: int,
        batch: list[Report],
        emitter: Emitter,
    ) -> int:
        """Decode complete lines that follow line ``line_number``; return the last one's number."""
        if lines:
            reports, errors = powerapi.decode_json_lines(self.kind, lines, peer, line_number + 1)
            for error, raw in errors:
                text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                emitter.reject(text, str(error))
            batch.extend(reports)
        return line_number + len(lines)

    def _last_line(
        self,
        partial: bytes,
        skipping: bool,
        peer: str,
        line_number: int,
        batch: list[Report],
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
