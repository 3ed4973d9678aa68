"""ZeroMQ output: reports to PUB (topic ``<kind>:<sensor>``) or PUSH sockets.

PUSH is lossless: when no peer takes messages, or the peers are ``--sndhwm`` messages behind,
sending waits, the output's mailbox fills, and the inputs slow down. PUB never waits: ZeroMQ
drops a subscriber's messages once it is ``--sndhwm`` behind, so a slow subscriber can never
make the service grow, and it loses messages instead (ZeroMQ's publish-subscribe cannot tell
the publisher). The wire format is in :mod:`wattflow.actors.zmq_sockets`.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import groupby
from pathlib import Path
from typing import Annotated, Literal

import zmq
import zmq.asyncio
from pydantic import BeforeValidator, Field, PositiveInt
from zmq.auth.asyncio import AsyncioAuthenticator

from wattflow.actors.pullers.files import split_commas
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.zmq_sockets import ZmqSetupError, attach, check_curve, configure_curve
from wattflow.formats import powerapi
from wattflow.formats.reports import Report, report_kind

logger = logging.getLogger(__name__)

CommaList = Annotated[list[str], BeforeValidator(split_commas)]


def topic(report: Report) -> str:
    """``<kind>:<sensor>``: subscribers filter on a kind, or on a kind and a sensor."""
    return f"{report.kind}:{report.sensor}"


class ZeroMQPusherConfig(PusherConfig):
    """Settings of the ZeroMQ output (``--output zeromq --uri tcp://…``)."""

    type: Literal["zeromq"] = "zeromq"
    uri: CommaList = Field(
        min_length=1,
        description="Addresses, comma-separated, e.g. tcp://*:5556.",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    socket_type: Literal["PUB", "PUSH"] = Field(
        default="PUB", description="PUB (topics; drops for slow subscribers) or PUSH (waits)."
    )
    bind: bool | None = Field(
        default=None,
        description="Bind the addresses instead of connecting (default: PUB binds, PUSH connects).",
    )
    sndhwm: PositiveInt = Field(
        default=1000, description="Messages queued per peer before PUSH waits or PUB drops."
    )
    linger_ms: int = Field(
        default=5000, ge=0, description="At exit, how long queued messages may still go out."
    )
    max_reports_per_message: PositiveInt = Field(
        default=500, description="Reports sent together in one message (as JSON Lines)."
    )
    curve_secret_key: Path | None = Field(
        default=None, description="Our CURVE key pair (zmq.auth certificate file)."
    )
    curve_server_key: Path | None = Field(
        default=None, description="The binding peer's public CURVE key, when we connect."
    )
    curve_authorized_keys: Path | None = Field(
        default=None, description="Directory of client public keys accepted when we bind."
    )

    @classmethod
    def example(cls) -> ZeroMQPusherConfig:
        """PowerReports published on port 5556."""
        return cls(type="zeromq", uri=["tcp://127.0.0.1:5556"])


@pushers.register("zeromq")
class ZeroMQPusher(Pusher[ZeroMQPusherConfig]):
    """Sends each batch as messages grouped by topic, in the batch's order."""

    config_model = ZeroMQPusherConfig

    def __init__(self, config: ZeroMQPusherConfig) -> None:
        super().__init__(config)
        self.context = zmq.asyncio.Context()
        self.socket: zmq.asyncio.Socket | None = None
        self._authenticator: AsyncioAuthenticator | None = None

    @property
    def binds(self) -> bool:
        if self.config.bind is not None:
            return self.config.bind
        return self.config.socket_type == "PUB"

    async def check(self) -> None:
        try:
            report_kind(self.config.model)
        except ValueError as error:
            raise ZmqSetupError(f"output '{self.config.name}': {error}") from None
        check_curve(
            bind=self.binds,
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
        )

    async def open(self) -> None:
        kind = zmq.PUB if self.config.socket_type == "PUB" else zmq.PUSH
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.SNDHWM, self.config.sndhwm)
        socket.setsockopt(zmq.LINGER, self.config.linger_ms)
        self._authenticator = configure_curve(
            socket,
            bind=self.binds,
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
            context=self.context,
        )
        attach(socket, self.config.uri, self.binds)
        self.socket = socket

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        socket = self.socket
        assert socket is not None, "open() first"
        publishing = self.config.socket_type == "PUB"
        size = self.config.max_reports_per_message
        for name, group in groupby(batch, key=topic):
            reports = list(group)
            for start in range(0, len(reports), size):
                payload = powerapi.encode_json_lines(reports[start : start + size])
                if publishing:
                    await socket.send_multipart([name.encode(), payload])
                else:
                    await socket.send(payload)
        return []

    async def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=self.config.linger_ms)
            self.socket = None
        # Terminating waits up to the linger for queued messages to go out: in a thread, so
        # the event loop (and a CURVE authenticator running on it) goes on meanwhile.
        await asyncio.to_thread(self.context.term)
        if self._authenticator is not None:
            self._authenticator.stop()
