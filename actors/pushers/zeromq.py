"""ZeroMQ output: reports to PUB (topic ``<kind>:<sensor>``) or PUSH sockets.

PUSH is lossless: when no peer takes messages, or the peers are ``--sndhwm`` messages behind,
sending waits, the output's mailbox fills, and the inputs slow down. The wait is bounded by
``--send-timeout-s``: then the batch is retried with backoff for ``--retry-for-s`` and, if the
peer never comes, becomes dead letters, so nothing is dropped without a trace. PUB never waits:
ZeroMQ drops a subscriber's messages once it is ``--sndhwm`` behind, so a slow subscriber can
never make the service grow, and it loses messages instead (ZeroMQ's publish-subscribe cannot
tell the publisher). The wire format is in :mod:`wattflow.actors.zmq_sockets`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import groupby
from pathlib import Path
from typing import Literal

import zmq
import zmq.asyncio
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from wattflow.actors.backend import CommaList
from wattflow.actors.errors import PushUnavailable
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.zmq_sockets import (
    ZmqSetupError,
    ZmqSocket,
    check_curve,
    opening_line,
    probe_addresses,
)
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import Report, report_kind

logger = logging.getLogger(__name__)


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
    bind: bool = Field(
        default=False,
        description="Bind the addresses, also for PUSH (which connects by default).",
    )
    connect: bool = Field(
        default=False,
        description="Connect to the addresses, also for PUB (which binds by default).",
    )
    sndhwm: PositiveInt = Field(
        default=1000, description="Messages queued per peer before PUSH waits or PUB drops."
    )
    send_timeout_s: PositiveFloat = Field(
        default=10.0,
        description="How long PUSH waits for a peer to take a message before the batch is "
        "retried (see --retry-for-s).",
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

    @model_validator(mode="after")
    def _bind_or_connect(self) -> ZeroMQPusherConfig:
        if self.bind and self.connect:
            raise ValueError("give --bind or --connect, not both")
        return self

    @property
    def binds(self) -> bool:
        """PUB binds by default (subscribers come and go), PUSH connects to a collector."""
        if self.bind or self.connect:
            return self.bind
        return self.socket_type == "PUB"

    @classmethod
    def example(cls) -> ZeroMQPusherConfig:
        """PowerReports published on port 5556."""
        return cls(type="zeromq", uri=["tcp://127.0.0.1:5556"])


@pushers.register("zeromq")
class ZeroMQPusher(Pusher[ZeroMQPusherConfig]):
    """Sends each batch as messages of up to ``max_reports_per_message`` reports, in order.

    PUB messages group consecutive reports of one topic; PUSH messages take the batch as it is.
    """

    config_model = ZeroMQPusherConfig

    def __init__(self, config: ZeroMQPusherConfig) -> None:
        super().__init__(config)
        self.zmq: ZmqSocket | None = None
        """The open socket with its context and CURVE handler, from ``open`` to ``close``."""
        self.socket: zmq.asyncio.Socket | None = None
        self.sent = 0
        """Messages handed to ZeroMQ (for PUB, whether or not a subscriber took them)."""

    @property
    def binds(self) -> bool:
        return self.config.binds

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
        # Bind or connect now: an address ZeroMQ refuses (``tcp://host`` without a port, a port
        # in use) stops the service before it starts, rather than failing the output each time
        # the supervisor restarts it. A throw-away socket: this runs before the service's event
        # loop, and the socket that sends must be opened on that loop (see ``open``).
        kind = zmq.PUB if self.config.socket_type == "PUB" else zmq.PUSH
        try:
            probe_addresses(kind, self.config.uri, self.binds)
        except ZmqSetupError as error:
            raise ZmqSetupError(f"output '{self.config.name}': {error}") from None

    async def open(self) -> None:
        """Open the socket on the running event loop, which it is used and closed on: with an
        allow-list, the handler that answers the clients' handshakes is a task of that loop."""
        if self.zmq is not None:
            if self.zmq.loop is not asyncio.get_running_loop():
                raise RuntimeError("the ZeroMQ output was opened on another event loop")
            return
        where = f"output '{self.config.name}'"
        self.zmq = ZmqSocket(
            zmq.PUB if self.config.socket_type == "PUB" else zmq.PUSH,
            uris=self.config.uri,
            bind=self.binds,
            options={
                zmq.SNDHWM: self.config.sndhwm,
                zmq.LINGER: self.config.linger_ms,
                # pyzmq's asyncio sockets honour SNDTIMEO: an awaited send fails with zmq.Again.
                zmq.SNDTIMEO: int(self.config.send_timeout_s * 1000),
            },
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
            where=where,
        )
        self.socket = self.zmq.socket
        logger.info(
            opening_line(
                where, self.config.socket_type, self.config.uri, bind=self.binds,
                secret_key=self.config.curve_secret_key,
                authorized_keys=self.config.curve_authorized_keys,
            )
        )  # fmt: skip

    def _messages(self, batch: list[Report]) -> list[tuple[list[bytes], list[Report]]]:
        """The batch as messages, each with the reports it holds."""
        size = self.config.max_reports_per_message
        if self.config.socket_type == "PUSH":
            groups = [("", batch)]
        else:
            groups = [(name, list(group)) for name, group in groupby(batch, key=topic)]
        messages = []
        for name, reports in groups:
            for start in range(0, len(reports), size):
                part = reports[start : start + size]
                payload = encode_json_lines(part)
                messages.append(([name.encode(), payload] if name else [payload], part))
        return messages

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        """Send the batch, waiting (PUSH) while the peers are ``sndhwm`` messages behind.

        When the first message cannot go within ``send_timeout_s``, nothing of the batch went:
        :class:`PushUnavailable` has it retried with backoff. Once part of it went, a retry
        would send that part twice, so the rest waits here, up to ``retry_for_s``, and what
        still cannot go is refused: dead letters, never a silent loss.
        """
        socket = self.socket
        assert socket is not None, "open() first"
        where = f"output '{self.config.name}' ({','.join(self.config.uri)})"
        give_up_at: float | None = None
        messages = self._messages(batch)
        for number, (frames, _) in enumerate(messages):
            while True:
                try:
                    await socket.send_multipart(frames)
                    break
                except zmq.Again:
                    waited = self.config.send_timeout_s
                    if number == 0:
                        raise PushUnavailable(
                            f"{where}: no ZeroMQ peer took a message for {waited:g} s"
                        ) from None
                    now = time.monotonic()
                    give_up_at = give_up_at or now - waited + self.config.retry_for_s
                    if now >= give_up_at:
                        rest = [r for _, part in messages[number:] for r in part]
                        reason = f"{where}: no ZeroMQ peer took the rest of a batch"
                        return [(report, reason) for report in rest]
            self.sent += 1
        return []

    async def close(self) -> None:
        """Give queued messages ``linger_ms`` to go out, and say so when that was not enough.

        ZeroMQ cannot tell how many messages it discarded. It returns from terminating as soon
        as its queues are empty, so a termination that lasted the whole linger means some of
        what was sent may not have gone out.
        """
        if self.zmq is None:
            return
        opened, self.zmq, self.socket = self.zmq, None, None
        opened.close(linger=self.config.linger_ms)
        started = time.monotonic()
        # Terminating waits up to the linger: in a thread, so the event loop goes on meanwhile.
        await asyncio.to_thread(opened.context.term)
        lingered_s = time.monotonic() - started
        if self.config.linger_ms and lingered_s >= self.config.linger_ms / 1000:
            logger.warning(
                "output '%s': messages still queued after --linger-ms %d were discarded; "
                "ZeroMQ does not say how many (at most --sndhwm %d per peer, of %d sent)",
                self.config.name,
                self.config.linger_ms,
                self.config.sndhwm,
                self.sent,
            )
