"""External power meters: readings per channel, from files that grow or from a TCP line socket.

Wattmeters and PDUs come with their own loggers, which write CSV or JSON lines, or can send
them to a socket. This input takes both, line by line, and makes MeterReports (target ``all``,
the node named by ``--sensor``, which must be the name hwpc-sensor and the NVML sampler use for
the same node so the node formula can line them up).

A line is one reading, in mW per channel named ``d{device}c{channel}``:

- CSV: a header ``timestamp,d0c0,d0c1,…`` (first line of a file or of a connection), then rows;
- JSON: ``{"timestamp": …, "channels": {"d0c0": 1234.5}}``, or the channels at the top level,
  or a whole MeterReport in PowerAPI's JSON layout (its ``sensor`` then wins).

Followed files resume after a restart (``--state-file``): each file's position
(:class:`~wattflow.actors.pullers.files.FollowedFile`) is reported at batch boundaries with the
file's CSV header, which the rows after that position need.

Timestamps are Unix milliseconds or ISO 8601 (naive means UTC), as in the other reports.
``--clock-offset-ms`` is added to them, for a logger whose clock is off from the node's: the
node formula matches readings by time, so a meter that runs 2 s late would otherwise be
compared with the wrong ticks. Over ZeroMQ, meters send MeterReports to ``--input zeromq
--model MeterReport`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import socket
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal, Self

import orjson
from pydantic import Field, PositiveInt, model_validator

from wattflow.actors.errors import PullError, PullUnavailable
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.actors.pullers.files import (
    INLINE_DECODE_BYTES,
    FileFollower,
    FileList,
    FollowedFile,
    split_lines,
)
from wattflow.actors.pullers.socket import DRAIN_QUIET_S, check_listening
from wattflow.formats.reports import MeterReport, Report, to_utc

logger = logging.getLogger(__name__)

CHANNEL = re.compile(r"^d\d+c\d+$")


class MeterPullerConfig(PullerConfig):
    """Settings of the power-meter input (``--input meter --files F`` or ``--port P``)."""

    type: Literal["meter"] = "meter"
    model: str = Field(
        default="MeterReport",
        description="Report kind the input holds.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    files: FileList = Field(
        default_factory=list,
        description="Meter logs to read (CSV or JSON lines), comma-separated.",
        json_schema_extra={"flags": ["-f", "--files"]},
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on for meter lines.")
    port: int | None = Field(
        default=None, ge=0, le=65535, description="TCP port to listen on for meter lines."
    )
    sensor: str = Field(
        default_factory=socket.gethostname,
        description="Name of the node the meter measures (hwpc-sensor's sensor name).",
        json_schema_extra={"default_doc": "the host name"},
    )
    clock_offset_ms: int = Field(
        default=0, description="Added to the meter's timestamps to match the node's clock."
    )
    follow: bool = Field(
        default=False, description="Keep reading the files as they grow (implied by --stream)."
    )
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="How often a followed file is checked for new lines."
    )
    max_batch: PositiveInt = Field(default=500, description="Readings handed on at once.")

    @model_validator(mode="after")
    def _a_source(self) -> Self:
        if not self.files and self.port is None:
            raise ValueError("give the meter's --files, or a --port to listen on")
        if self.model != MeterReport.kind:
            raise ValueError(f"the meter input makes MeterReports, not {self.model}")
        return self

    @classmethod
    def example(cls) -> MeterPullerConfig:
        """A wattmeter's CSV log."""
        return cls(type="meter", files=[Path("meter.csv")], sensor="node-1")


class LineDecoder:
    """Turns one source's lines into MeterReports, remembering its CSV header."""

    def __init__(self, config: MeterPullerConfig, source: str) -> None:
        self.config = config
        self.source = source
        self.header: list[str] | None = None
        self.offset = timedelta(milliseconds=config.clock_offset_ms)

    def decode(self, line: str) -> MeterReport | None:
        """The line's reading, or None for a header or an empty line.

        Raises:
            ValueError: saying what is wrong with the line.
        """
        text = line.strip()
        if not text:
            return None
        if text.startswith("{"):
            return self._json(text)
        cells = [cell.strip() for cell in text.split(",")]
        if cells[0] == "timestamp":
            bad = [name for name in cells[1:] if not CHANNEL.match(name)]
            if bad:
                raise ValueError(f"CSV header names {bad}, not channels d<device>c<channel>")
            self.header = cells
            return None
        if self.header is None:
            raise ValueError("CSV row before the header 'timestamp,d0c0,…'")
        if len(cells) != len(self.header):
            raise ValueError(f"{len(cells)} cells where the header has {len(self.header)}")
        channels = {
            name: _mw(value) for name, value in zip(self.header[1:], cells[1:], strict=True)
        }
        return self._report(cells[0], channels, self.config.sensor)

    def _json(self, text: str) -> MeterReport:
        try:
            document = orjson.loads(text)
        except orjson.JSONDecodeError as error:
            raise ValueError(f"not valid JSON: {error}") from None
        if not isinstance(document, dict) or "timestamp" not in document:
            raise ValueError("a JSON reading needs a 'timestamp'")
        channels = document.get("channels")
        if channels is None:
            channels = {k: v for k, v in document.items() if CHANNEL.match(k)}
        _check_channels(channels)
        sensor = document.get("sensor") or self.config.sensor
        if not isinstance(sensor, str):
            raise ValueError(f"sensor {sensor!r} is not a name")
        return self._report(document["timestamp"], channels, sensor)

    def _report(self, timestamp: Any, channels: dict[str, Any], sensor: str) -> MeterReport:
        try:
            moment: datetime = to_utc(timestamp) + self.offset
        except OverflowError:
            raise ValueError(
                f"timestamp {timestamp!r} with --clock-offset-ms {self.config.clock_offset_ms}"
                " is out of range"
            ) from None
        return MeterReport(
            timestamp=moment,
            sensor=sensor,
            target="all",
            channels={name: float(value) for name, value in channels.items()},
        )


def _mw(cell: str) -> float:
    """A CSV cell's reading in mW: a finite number (``nan`` and ``inf`` are no readings, as
    JSON, which has no such numbers, cannot give them either)."""
    value = float(cell)
    if not math.isfinite(value):
        raise ValueError(f"{cell!r} is not a reading in mW")
    return value


def _text(line: bytes) -> str:
    return line.decode("utf-8", "replace")


def _decode_lines(
    decoder: LineDecoder, lines: Sequence[str | bytes], first: int
) -> tuple[list[Report], list[tuple[str, str]]]:
    """The readings of lines numbered from ``first``, and each line that is none with the reason
    a dead letter gives (its source and number first)."""
    readings: list[Report] = []
    rejected: list[tuple[str, str]] = []
    for number, line in enumerate(lines, start=first):
        text = _text(line) if isinstance(line, bytes) else line
        try:
            report = decoder.decode(text)
        except (ValueError, TypeError) as error:
            rejected.append((text, f"{decoder.source}:{number}: {error}"))
            continue
        if report is not None:
            readings.append(report)
    return readings, rejected


class _MeterFile(FileFollower):
    """A followed meter log, whose rows need the CSV header it had where a checkpoint left it."""

    def __init__(self, decoder: LineDecoder, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoder = decoder

    def opened(self, handle: IO[bytes], saved: Any) -> None:
        """Seek a file just opened to its saved position, with the CSV header it had there;
        a file replaced or truncated since, or a new file after a rotation, is read from its
        start (where its header is)."""
        super().opened(handle, saved)
        header = saved.get("header") if isinstance(saved, dict) and self.place.offset else None
        if isinstance(header, list) and header:
            try:
                self.decoder.decode(",".join(str(cell) for cell in header))
            except ValueError as error:
                logger.warning("%s: saved CSV header unreadable (%s)", self.place.path, error)


def _check_channels(channels: Any) -> None:
    """Raise unless a JSON reading's channels are a non-empty mapping of channel names
    (``d<device>c<channel>``) to numbers of mW (booleans are not readings)."""
    if not isinstance(channels, dict) or not channels:
        raise ValueError("no channels d<device>c<channel> in the reading")
    for name, value in channels.items():
        if (
            not CHANNEL.match(str(name))
            or isinstance(value, bool)
            or not isinstance(value, int | float)
        ):
            raise ValueError(f"channel {name!r}: {value!r} is not a reading in mW")


STOP_GRACE_S = 1.0
"""At a stop, how long connected loggers are still read for what they already sent (a
connection quiet for ``DRAIN_QUIET_S`` is closed sooner), as the socket input's
``--drain-grace-s`` default."""


async def _next_line(reader: asyncio.StreamReader, stopping: asyncio.Event) -> bytes:
    """The connection's next line, ``b""`` once it closed; once the service stops, ``b""`` as
    well when nothing more comes for ``DRAIN_QUIET_S``: an idle logger's connection is not
    waited for. A read cut short leaves what it had in the reader's buffer."""
    if not stopping.is_set():
        reading = asyncio.ensure_future(reader.readline())
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({reading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if reading.done():
            return reading.result()
    else:
        reading = asyncio.ensure_future(reader.readline())
    try:
        return await asyncio.wait_for(reading, DRAIN_QUIET_S)
    except TimeoutError:
        return b""


@pullers.register("meter")
class MeterPuller(Puller[MeterPullerConfig]):
    """Reads every file and every connection at once, each with its own header."""

    config_model = MeterPullerConfig
    bound_port: int | None = None

    def not_ready(self) -> str | None:
        listens = self.config.port is not None
        return "not listening yet" if listens and self.bound_port is None else None

    async def check(self) -> None:
        """Files that are missing (unless followed) and a port that cannot be listened on
        (:func:`~wattflow.actors.pullers.socket.check_listening`) stop the command at start."""
        for path in self.config.files:
            if not path.is_file() and not (self.stream or self.config.follow):
                raise PullError(f"input '{self.config.name}': {path}: no such file")
        if self.config.port is not None:
            check_listening(self.config.name, self.config.host, self.config.port)

    async def probe(self) -> str:
        """``wattflow check``: whether the port can be listened on, when one is given."""
        if self.config.port is None:
            return await super().probe()
        return check_listening(self.config.name, self.config.host, self.config.port)

    @property
    def resumable(self) -> bool:
        """Following files, the input reports each file's position (device, inode, byte, line
        and CSV header) at its batch boundaries, and goes on from the saved one at a start."""
        return bool(self.config.files) and (self.stream or self.config.follow)

    async def pull(self, emitter: Emitter) -> None:
        saved = self.saved_position if isinstance(self.saved_position, dict) else {}
        names = {str(path) for path in self.config.files}
        self._positions: dict[str, Any] = {k: v for k, v in saved.items() if k in names}
        self._lock = asyncio.Lock()
        if self.resumable:
            await self.boundary(dict(self._positions))
        tasks = [asyncio.create_task(self._read_file(path, emitter)) for path in self.config.files]
        if self.config.port is not None:
            tasks.append(asyncio.create_task(self._listen(emitter)))
        try:
            await asyncio.gather(*tasks)
        finally:  # the first error ends the input: the others are cancelled, and waited for
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle_lines(
        self,
        lines: Sequence[str | bytes],
        decoder: LineDecoder,
        first: int,
        emitter: Emitter,
        size_bytes: int = 0,
    ) -> None:
        """Decode lines numbered from ``first`` and hand their readings on, in batches of
        ``--max-batch``, each line that is no reading dead-lettered with its number. More than
        :data:`INLINE_DECODE_BYTES` of them (a log caught up with) are decoded in a thread."""
        if size_bytes > INLINE_DECODE_BYTES:
            readings, rejected = await asyncio.to_thread(_decode_lines, decoder, lines, first)
        else:
            readings, rejected = _decode_lines(decoder, lines, first)
        for line, reason in rejected:
            emitter.reject(line, reason)
        size = self.config.max_batch
        full = len(readings) - len(readings) % size
        for start in range(0, full, size):
            await emitter.emit(readings[start : start + size])
        await emitter.emit(readings[full:])

    async def _hand_on(
        self, data: bytes, decoder: LineDecoder, emitter: Emitter, place: FollowedFile
    ) -> bytes:
        """Hand on the complete lines of ``data`` and, following, report every file's position
        after them (with the file's CSV header); return the incomplete rest. One file at a
        time, so the positions reported together stand at a boundary of every file."""
        lines, rest = split_lines(data)
        if not lines:
            return rest
        async with self._lock:
            await self._handle_lines(lines, decoder, place.line + 1, emitter, len(data))
            place.handed_on(len(data) - len(rest), len(lines))
            if self.resumable:
                self._positions[str(place.path)] = {**place.position(), "header": decoder.header}
                await self.boundary(dict(self._positions))
        return rest

    async def _read_file(self, path: Path, emitter: Emitter) -> None:
        """Read one file (followed: as it grows, the new file from its start when the logger
        rotates it, whose header comes again in its first line)."""
        decoder = LineDecoder(self.config, str(path))
        place = FollowedFile(path)
        follower = _MeterFile(
            decoder,
            place,
            self._positions.get(str(path)),
            following=self.stream or self.config.follow,
            poll_interval_s=self.config.poll_interval_s,
            stopping=emitter.stopping,
        )
        partial = b""
        async with contextlib.aclosing(follower.chunks()) as chunks:
            async for chunk, fresh in chunks:
                if fresh:
                    partial = b""
                partial = await self._hand_on(partial + chunk, decoder, emitter, place)
        if partial.strip() and not self.checkpointed:
            # A last line without its newline: read as it is at a stop, unless a committed
            # position leaves it for the next run, which reads it whole.
            await self._handle_lines([_text(partial)], decoder, place.line + 1, emitter)

    async def _listen(self, emitter: Emitter) -> None:
        """Listen and read every logger's connection until the stop; then read what the
        connected loggers already sent, closing each connection once quiet for
        ``DRAIN_QUIET_S`` and the rest after ``STOP_GRACE_S``, so that an idle logger neither
        holds the stop nor leaves a reader pending when the service exits."""
        serving: set[asyncio.Task[Any]] = set()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = "meter:{}:{}".format(*writer.get_extra_info("peername")[:2])
            decoder = LineDecoder(self.config, peer)
            number = 0
            task = asyncio.current_task()
            assert task is not None
            serving.add(task)
            try:
                while line := await _next_line(reader, emitter.stopping):
                    number += 1
                    async with self._lock:  # a boundary: socket lines are not read again
                        await self._handle_lines([_text(line)], decoder, number, emitter)
                        if self.resumable:
                            await self.boundary(dict(self._positions))
            except (ConnectionError, ValueError) as error:  # ValueError: a line over the limit
                logger.info("%s closed: %s", peer, error)
            finally:
                serving.discard(task)
                writer.close()

        try:
            server = await asyncio.start_server(serve, self.config.host, self.config.port)
        except OSError as error:
            raise PullUnavailable(
                f"cannot listen on {self.config.host}:{self.config.port}: {error.strerror}"
            ) from error
        self.bound_port = server.sockets[0].getsockname()[1]
        logger.info("listening for meter readings on %s:%s", self.config.host, self.bound_port)
        try:
            async with server:
                await emitter.stopping.wait()
                server.close()  # no new connections; the connected loggers are read to the end
                if serving:
                    await asyncio.wait(set(serving), timeout=STOP_GRACE_S)
        finally:  # past the grace (or cut short): no connection outlives the input
            for task in list(serving):
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)
