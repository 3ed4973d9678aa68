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
from wattflow.formats.errors import DecodeError
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
        peer = "socket:{}:{}".format(*writer.get_extra_info("peername")[:2])
        line_number = 0
        batch: list[Report] = []
        try:
            while True:
                try:
                    if emitter.stopping.is_set():
                        # Draining: read what the peer already sent, stop once it goes quiet.
                        line = await asyncio.wait_for(reader.readuntil(b"\n"), 0.1)
                    else:
                        line = await reader.readuntil(b"\n")
                except TimeoutError:
                    break
                except asyncio.IncompleteReadError as end:
                    line = end.partial
                    if not line.strip():
                        break
                    if emitter.stopping.is_set():
                        emitter.reject(
                            line.decode("utf-8", "replace"),
                            f"{peer}:{line_number + 1}: connection cut at shutdown mid-line",
                        )
                        break
                except asyncio.LimitOverrunError as overrun:
                    line_number += 1
                    emitter.reject(
                        None,
                        f"{peer}:{line_number}: line longer than "
                        f"{self.config.max_line_bytes} bytes, skipped",
                    )
                    await self._skip_line(reader, overrun.consumed)
                    continue
                line_number += 1
                if line.strip():
                    try:
                        batch.append(powerapi.decode_json(self.kind, line, peer, line_number))
                    except DecodeError as error:
                        emitter.reject(line.decode("utf-8", "replace"), str(error))
                if len(batch) >= self.config.max_batch or not getattr(reader, "_buffer", b""):
                    await emitter.emit(batch)
                    batch = []
        except ConnectionError as error:
            logger.info("%s closed: %s", peer, error)
        await emitter.emit(batch)

    @staticmethod
    async def _skip_line(reader: asyncio.StreamReader, consumed: int) -> None:
        await reader.readexactly(consumed)
        while True:
            try:
                await reader.readuntil(b"\n")
                return
            except asyncio.LimitOverrunError as overrun:
                await reader.readexactly(overrun.consumed)
