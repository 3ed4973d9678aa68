"""ZeroMQ input: reports from SUB (with topic filters) or PULL sockets.

A batch of messages is decoded and handed on before more are received, so a slow pipeline
leaves messages queued in ZeroMQ, bounded by ``--rcvhwm``. What happens beyond that depends
on the pattern: a PUSH peer blocks (nothing is lost), a PUB peer drops the messages of the
subscriber that cannot keep up (ZeroMQ's publish-subscribe has no back-channel, so the
subscriber cannot even count what it lost). Use PUSH/PULL where every report counts.

Wire format (see :mod:`wattflow.actors.zmq_sockets`): a message is ``[reports]`` or
``[topic, reports]``; ``reports`` is UTF-8 JSON Lines in PowerAPI's JSON layout, one report
per line, several lines per message allowed. Anything else is a dead letter.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio
from pydantic import Field, PositiveInt, model_validator

from wattflow.actors.backend import CommaList
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig, hand_on
from wattflow.actors.zmq_sockets import ZmqSetupError, ZmqSocket, check_curve, opening_line
from wattflow.formats.batch import handed_on
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.json_frames import Layout, LineRun, decode_hwpc_frames, decode_json_runs
from wattflow.formats.reports import HWPCReport, Report, report_kind

logger = logging.getLogger(__name__)


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
    bind: bool = Field(
        default=False,
        description="Bind the addresses, also for SUB (which connects by default).",
    )
    connect: bool = Field(
        default=False,
        description="Connect to the addresses, also for PULL (which binds by default).",
    )
    topics: CommaList = Field(
        default_factory=list,
        description="SUB topic prefixes, comma-separated, e.g. PowerReport:node-1 (all if empty).",
    )
    rcvhwm: PositiveInt = Field(
        default=1000,
        description="Messages ZeroMQ queues for us; beyond, a PUSH peer waits, a PUB peer drops.",
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
    max_batch: PositiveInt = Field(default=1000, description="Messages decoded at once.")
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="Longest wait for a message before checking for a stop."
    )
    drain_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="At shutdown, how long messages already queued are still received.",
    )

    @model_validator(mode="after")
    def _bind_or_connect(self) -> ZeroMQPullerConfig:
        if self.bind and self.connect:
            raise ValueError("give --bind or --connect, not both")
        return self

    @property
    def binds(self) -> bool:
        """PULL binds by default (a collector many senders reach), SUB connects to publishers."""
        if self.bind or self.connect:
            return self.bind
        return self.socket_type == "PULL"

    @classmethod
    def example(cls) -> ZeroMQPullerConfig:
        """PowerReports from a publisher on this host."""
        return cls(type="zeromq", uri=["tcp://127.0.0.1:5555"])


def _peer(frame: zmq.Frame) -> str | None:
    """The sending host's address as ZeroMQ reports it (TCP only), to name it in dead letters."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return None


@pullers.register("zeromq")
class ZeroMQPuller(Puller[ZeroMQPullerConfig]):
    """Receives until the pipeline stops: a socket has no end, so it always runs as a stream."""

    config_model = ZeroMQPullerConfig

    def __init__(self, config: ZeroMQPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.socket: zmq.asyncio.Socket | None = None
        self.ready = False
        self.messages = 0
        """Messages received, good or bad: what a user compares with what was sent."""
        self._layouts: dict[str, Layout] = {}
        """Each sensor's groups, remembered from one batch of messages to the next."""

    def not_ready(self) -> str | None:
        return None if self.ready else "socket not open yet"

    @property
    def binds(self) -> bool:
        return self.config.binds

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

    def _open(self) -> ZmqSocket:
        """The socket, on the running event loop (see :class:`ZmqSocket`); say where it is."""
        where = f"input '{self.config.name}'"
        sub = self.config.socket_type == "SUB"
        opened = ZmqSocket(
            zmq.SUB if sub else zmq.PULL,
            uris=self.config.uri,
            bind=self.binds,
            options={zmq.RCVHWM: self.config.rcvhwm, zmq.LINGER: 0},
            secret_key=self.config.curve_secret_key,
            server_key=self.config.curve_server_key,
            authorized_keys=self.config.curve_authorized_keys,
            where=where,
            subscribe=(self.config.topics or [""]) if sub else [],
        )
        logger.info(
            opening_line(
                where, self.config.socket_type, self.config.uri, bind=self.binds,
                secret_key=self.config.curve_secret_key,
                authorized_keys=self.config.curve_authorized_keys,
                topics=self.config.topics if sub else None,
            )
        )  # fmt: skip
        return opened

    async def pull(self, emitter: Emitter) -> None:
        # The context lives as long as one pull: terminating it is what frees ZeroMQ's threads.
        opened: ZmqSocket | None = None
        try:
            opened = self._open()
            self.socket = opened.socket
            self.ready = True
            await self._receive(opened.socket, emitter)
        finally:
            if opened is not None:
                opened.close(linger=0)
                opened.context.term()
            self.socket = None
            self.ready = False
            # Always, zero included: the number to compare with what was sent, and the sign
            # that nothing came (a refused CURVE key, a wrong topic, a publisher elsewhere).
            logger.info("input '%s': %d ZeroMQ messages received", self.config.name, self.messages)

    async def _receive(self, socket: zmq.asyncio.Socket, emitter: Emitter) -> None:
        """Receive what is queued, up to ``max_batch`` messages, and emit it before more.

        Waiting on ``emit`` is the backpressure: meanwhile ZeroMQ queues up to ``rcvhwm``
        messages, then stops reading the peers. Once stopping, what is already queued is still
        received for ``drain_grace_s`` at most, so a peer that never pauses cannot hold up the
        shutdown.
        """
        kind = report_kind(self.config.model)
        where = f"zeromq {','.join(self.config.uri)}"
        drain_until: float | None = None
        while True:
            if drain_until is None and emitter.stopping.is_set():
                drain_until = time.monotonic() + self.config.drain_grace_s
            if drain_until is not None:
                if time.monotonic() >= drain_until or not await socket.poll(0):
                    return
            elif not await socket.poll(int(self.config.poll_interval_s * 1000)):
                continue
            messages: list[list[zmq.Frame]] = []
            for _ in range(self.config.max_batch):
                try:
                    messages.append(await socket.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            self.messages += len(messages)
            await self._emit(kind, messages, where, emitter)

    async def _emit(
        self, kind: type[Report], messages: list[list[zmq.Frame]], where: str, emitter: Emitter
    ) -> None:
        """Hand on what messages hold: hwpc-sensor's plain reports as frames (one per sensor,
        :func:`~wattflow.formats.json_frames.decode_json_runs`), anything else message by
        message.

        With a partition, a message under a topic that names one of its sensors is taken on
        that word (:meth:`_of_partition`); each of its reports is then checked with the same
        function, and one whose sensor another partition takes is a dead letter: that
        partition let the message go by its topic, so skipping the report here would lose it
        without a trace. The whole batch is decoded at once as long as nothing is misplaced;
        otherwise each topic's messages are decoded apart, to name the topic in the reason.
        """
        if self.partition is None:
            await self._hand_on(kind, messages, where, emitter)
            return
        by_topic = self._of_partition(messages, emitter)
        framed = True
        if any(topic is not None for topic in by_topic):
            every = [message for group in by_topic.values() for message in group]
            frames = self._frames(kind, every)
            if frames is not None and all(
                self.partition.owns(sensor) for frame in frames for sensor in frame.sensors()
            ):
                await hand_on(emitter, frames)
                return
            framed = frames is not None
        for topic, group in by_topic.items():
            await self._hand_on(kind, group, where, emitter, topic, framed=framed)

    def _frames(
        self, kind: type[Report], messages: list[list[zmq.Frame]]
    ) -> list[HWPCFrame] | None:
        """The messages' reports as one frame per sensor, or None when they cannot be."""
        if kind is not HWPCReport or any(len(message) > 2 for message in messages):
            return None
        lines = [line for message in messages for line in message[-1].bytes.split(b"\n")]
        return decode_hwpc_frames(lines, self._layouts)

    async def _hand_on(
        self,
        kind: type[Report],
        messages: list[list[zmq.Frame]],
        where: str,
        emitter: Emitter,
        topic: str | None = None,
        *,
        framed: bool = True,
    ) -> None:
        """Decode messages (as frames when ``framed`` and they can be, else report by report)
        and hand them on. Under ``topic``, a topic of this partition, the reports of sensors
        other partitions take are dead-lettered (:meth:`Partition.divide
        <wattflow.actors.partition.Partition.divide>`, which cuts a frame per sensor as the
        partition filter does)."""
        decoded = self._decode(kind, messages, where, emitter, framed)
        for batch in handed_on(decoded):
            if topic is None or self.partition is None:
                await emitter.emit(batch)
                continue
            parts, misplaced = self.partition.divide(batch)
            for report in misplaced:
                emitter.reject(
                    report,
                    f"{where}: sensor {report.sensor!r} came under topic {topic!r} of partition "
                    f"{self.partition} but belongs to partition {self.partition.of(report.sensor)}",
                )
            for part in parts:
                await emitter.emit(part)

    def _of_partition(
        self, messages: list[list[zmq.Frame]], emitter: Emitter
    ) -> dict[str | None, list[list[zmq.Frame]]]:
        """The messages not known to be another partition's, by the topic that says they are
        this partition's (None: a message whose topic names no sensor).

        A message whose topic names its sensor as wattflow's ZeroMQ output sets it
        (``<kind>:<sensor>``, the kind this input reads) is let go undecoded when the sensor
        is another instance's: its lines are counted as skipped. Other messages are decoded,
        and the emitter lets go the reports of other sensors.
        """
        assert self.partition is not None
        prefix = f"{self.config.model}:".encode()
        kept: dict[str | None, list[list[zmq.Frame]]] = {}
        for message in messages:
            topic = message[0].bytes if len(message) == 2 else b""
            if not topic.startswith(prefix):
                kept.setdefault(None, []).append(message)
                continue
            if self.partition.owns(topic.removeprefix(prefix).decode("utf-8", "replace")):
                kept.setdefault(topic.decode("utf-8", "replace"), []).append(message)
                continue
            lines = message[1].bytes.split(b"\n")
            emitter.skip(sum(1 for line in lines if line.strip()))
        return kept

    def _decode(
        self,
        kind: type[Report],
        messages: list[list[zmq.Frame]],
        where: str,
        emitter: Emitter,
        framed: bool,
    ) -> list[HWPCFrame] | list[Report]:
        """The messages' frames, or their reports (one run of lines per message, for
        :func:`~wattflow.formats.json_frames.decode_json_runs`); each line that is not a report,
        and each message that is not ``[reports]`` or ``[topic, reports]``, a dead letter, in
        the order they came.

        Reasons name the address and the sending host but no message or line number, so a
        stream of bad input adds to a few counters instead of creating a reason per message;
        the host is looked up only for a dead letter. The lines are numbered through the batch
        to find each line's message and put the dead letters in order.
        """
        runs: list[LineRun] = []
        senders: list[zmq.Frame] = []
        dead: list[tuple[int, zmq.Frame, Any, str]] = []
        line = 1
        for frames in messages:
            if len(frames) > 2:
                problem = f"{len(frames)} frames, expected [reports] or [topic, reports]"
                dead.append((line, frames[0], [frame.bytes for frame in frames], problem))
                continue
            lines = frames[-1].bytes.split(b"\n")
            runs.append((where, line, lines))
            senders.append(frames[0])
            line += len(lines)
        decoded, errors = decode_json_runs(kind, runs, self._layouts, framed=framed and not dead)
        for error, raw in errors:
            at = error.line or 0
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            sender = senders[bisect_right(runs, at, key=itemgetter(1)) - 1]
            dead.append((at, sender, text, error.problem))
        for _, sender, payload, problem in sorted(dead, key=itemgetter(0)):  # a message first
            peer = _peer(sender)
            source = f"{where} from {peer}" if peer else where
            emitter.reject(payload, f"{source}: {problem}")
        return decoded
