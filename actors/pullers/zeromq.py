"""ZeroMQ input: reports from SUB (with topic filters) or PULL sockets.

A batch of messages is decoded and handed on before more are received, so a slow pipeline
leaves messages queued in ZeroMQ, bounded by ``--rcvhwm``. What happens beyond that depends
on the pattern: a PUSH peer blocks (nothing is lost), a PUB peer drops the messages of the
subscriber that cannot keep up (ZeroMQ's publish-subscribe has no back-channel). Use PUSH/PULL
where every report counts. The wire format is in :mod:`wattflow.actors.zmq_sockets`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal

import zmq
import zmq.asyncio
from pydantic import BeforeValidator, Field, PositiveInt
from zmq.auth.asyncio import AsyncioAuthenticator

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.actors.pullers.files import split_commas
from wattflow.actors.zmq_sockets import ZmqSetupError, attach, check_curve, configure_curve
from wattflow.formats import powerapi
from wattflow.formats.reports import Report, report_kind

logger = logging.getLogger(__name__)

CommaList = Annotated[list[str], BeforeValidator(split_commas)]


class ZeroMQPullerConfig(PullerConfig):
    """Settings of the ZeroMQ input (``--input zeromq --uri tcp://…``)."""

    type: Literal["zeromq"] = "zeromq"
    uri: CommaList = Field(
        min_length=1,
        description="Addresses, comma-separated, e.g. tcp://127.0.0.1:5555.",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    socket_type: Literal["SUB", "PULL"] = Field(
        default="SUB", description="SUB (subscribe to publishers) or PULL (lossless)."
    )
    bind: bool | None = Field(
        default=None,
        description="Bind the addresses instead of connecting (default: PULL binds, SUB connects).",
    )
    topics: CommaList = Field(
        default_factory=list,
        description="SUB topic prefixes, comma-separated, e.g. PowerReport:node-1 (all if empty).",
    )
    rcvhwm: PositiveInt = Field(default=1000, description="Messages queued before ZeroMQ stops.")
    curve_secret_key: Path | None = Field(
        default=None, description="Our CURVE key pair (zmq.auth certificate file)."
    )
    curve_server_key: Path | None = Field(
        default=None, description="The binding peer's public CURVE key, when we connect."
    )
    curve_authorized_keys: Path | None = Field(
        default=None, description="Directory of client public keys accepted when we bind."
    )
    max_batch: PositiveInt = Field(default=1000, description="Messages decoded at once.")
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="Longest wait for a message before checking for a stop."
    )

    @classmethod
    def example(cls) -> ZeroMQPullerConfig:
        """PowerReports from a publisher on this host."""
        return cls(type="zeromq", uri=["tcp://127.0.0.1:5555"])


@pullers.register("zeromq")
class ZeroMQPuller(Puller[ZeroMQPullerConfig]):
    """Receives until stopped (or, outside stream mode too: a socket has no end)."""

    config_model = ZeroMQPullerConfig

    def __init__(self, config: ZeroMQPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.context = zmq.asyncio.Context()
        self.socket: zmq.asyncio.Socket | None = None
        self.ready = False
        self._authenticator: AsyncioAuthenticator | None = None

    @property
    def binds(self) -> bool:
        if self.config.bind is not None:
            return self.config.bind
        return self.config.socket_type == "PULL"

    async def check(self) -> None:
        try:
            report_kind(self.config.model)
        except ValueError as error:
            raise ZmqSetupError(f"input '{self.config.name}': {error}") from None
        check_curve(
            bind=self.binds,
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
        )

    def _open(self) -> zmq.asyncio.Socket:
        kind = zmq.SUB if self.config.socket_type == "SUB" else zmq.PULL
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
        socket.setsockopt(zmq.LINGER, 0)
        self._authenticator = configure_curve(
            socket,
            bind=self.binds,
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
            context=self.context,
        )
        if kind == zmq.SUB:
            for topic in self.config.topics or [""]:
                socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        attach(socket, self.config.uri, self.binds)
        return socket

    async def pull(self, emitter: Emitter) -> None:
        kind = report_kind(self.config.model)
        socket = self.socket = self._open()
        self.ready = True
        source = f"zeromq {','.join(self.config.uri)}"
        line = 0
        try:
            while True:
                stopping = emitter.stopping.is_set()
                timeout = 0 if stopping else int(self.config.poll_interval_s * 1000)
                if not await socket.poll(timeout):
                    if stopping:
                        return  # drained what was already queued
                    continue
                reports: list[Report] = []
                for _ in range(self.config.max_batch):
                    try:
                        frames = await socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    payload = frames[-1]
                    lines = [part for part in payload.split(b"\n") if part.strip()]
                    decoded, errors = powerapi.decode_json_lines(kind, lines, source, line + 1)
                    line += len(lines)
                    reports += decoded
                    for error, raw in errors:
                        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                        emitter.reject(text, str(error))
                await emitter.emit(reports)
        finally:
            socket.close(linger=0)
            if self._authenticator is not None:
                self._authenticator.stop()
            self.context.term()
