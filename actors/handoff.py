"""``--workers N`` on the socket input: one acceptor, N readers, one sensor per connection.

hwpc-sensor opens one connection and writes its reports to it, one JSON line each. With several
worker processes the connection must be read by the worker that owns the sensor (its formula
state lives there), and by that worker alone, so that each line is decoded once. The acceptor
(in the parent process) accepts the connection, *peeks* at its first line without consuming it
(``MSG_PEEK``), finds the sensor, and passes the connection's file descriptor to the owning
worker over a Unix socket (``SCM_RIGHTS``). The worker then reads the connection from its first
byte, exactly as if it had accepted it: no byte is read twice, nothing is copied between
processes, and TCP flow control still slows a sensor down to its worker's pace.

A connection belongs to the worker of its first line's sensor. A connection whose first line
names no sensor (garbage, a closed connection) goes to worker 0, whose socket input
dead-letters what does not decode, as it would without workers.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import Sequence

import msgspec

from wattflow.actors.errors import PullUnavailable
from wattflow.actors.partition import Partition

logger = logging.getLogger(__name__)

PEEK_TIMEOUT_S = 5.0
"""Longest wait for a connection's first line (or its ``"sensor"`` field) before it is handed
to worker 0 as it is."""
PEEK_PAUSE_S = 0.005
"""Pause between two peeks that found no more data: a peek consumes nothing, so the socket
stays readable and waiting for readability would not wait."""
_SENSOR = re.compile(rb'"sensor"\s*:\s*("(?:[^"\\]|\\.)*")')


class _Head(msgspec.Struct):
    """The one field of a report the acceptor reads; every other key is skipped unparsed."""

    sensor: str


_head = msgspec.json.Decoder(_Head)


def first_sensor(data: bytes, complete: bool) -> str | None:
    """The sensor of the first line of ``data``; None if it cannot tell (yet).

    ``complete``: ``data`` holds the whole first line (a newline, or the peer closed). Before
    the line is complete, a ``"sensor": "…"`` pair already in it is enough: hwpc-sensor writes
    the sensor before the counters.
    """
    line = data.split(b"\n", 1)[0]
    if complete:
        try:
            return _head.decode(line).sensor
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    found = _SENSOR.search(line)
    if found is None:
        return None
    try:
        name = json.loads(found.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) else None


async def peek_sensor(
    connection: socket.socket, limit: int, timeout_s: float = PEEK_TIMEOUT_S
) -> str | None:
    """The sensor that a fresh connection's first line names, read without consuming it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen = -1
    while loop.time() < deadline:
        readable = loop.create_future()
        loop.add_reader(connection.fileno(), settle, readable)
        try:
            await asyncio.wait_for(readable, max(0.0, deadline - loop.time()))
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(connection.fileno())
        try:
            data = connection.recv(limit, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            return None
        if not data:  # closed before a byte
            return None
        complete = b"\n" in data or len(data) >= limit
        sensor = first_sensor(data, complete)
        if sensor is not None or complete:
            return sensor
        if len(data) == seen:
            await asyncio.sleep(PEEK_PAUSE_S)
        seen = len(data)
    return None


def settle(future: asyncio.Future[None]) -> None:
    """Mark a readiness wait done (the selector may report it again before it is removed)."""
    if not future.done():
        future.set_result(None)


def send_connection(channel: socket.socket, connection: socket.socket) -> None:
    """Pass ``connection``'s descriptor over ``channel`` (a Unix ``SOCK_SEQPACKET`` socket)."""
    channel.sendmsg(
        [b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [connection.fileno()]))]
    )


HAND_TIMEOUT_S = 30.0
"""Longest wait for room in a worker's channel (a worker whose loop is stuck)."""


async def _send_when_room(channel: socket.socket, connection: socket.socket) -> None:
    """:func:`send_connection` on a non-blocking channel, waiting while it is full."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HAND_TIMEOUT_S
    while True:
        try:
            send_connection(channel, connection)
            return
        except (BlockingIOError, InterruptedError):
            pass
        writable = loop.create_future()
        loop.add_writer(channel.fileno(), settle, writable)
        try:
            await asyncio.wait_for(writable, max(0.0, deadline - loop.time()))
        finally:
            loop.remove_writer(channel.fileno())


def receive_connections(channel: socket.socket) -> list[socket.socket] | None:
    """The connections waiting on ``channel`` (non-blocking); None once the acceptor closed it."""
    received: list[socket.socket] = []
    while True:
        try:
            message, fds, _flags, _address = socket.recv_fds(channel, 16, 4)
        except (BlockingIOError, InterruptedError):
            return received
        for fd in fds:
            received.append(socket.socket(fileno=fd))
        if not message and not fds:
            for connection in received:  # the acceptor is gone: nobody waits for these
                connection.close()
            return None


class Acceptor:
    """Listens where the socket input would, and hands each connection to its worker.

    ``channels[j]`` reaches worker ``j``; ``partition`` is the instance's own (``--partition``,
    or every sensor), which the workers split between them.
    """

    def __init__(
        self,
        host: str,
        port: int,
        channels: Sequence[socket.socket],
        partition: Partition,
        max_line_bytes: int,
    ) -> None:
        self.host = host
        self.port = port
        self.channels = channels
        self.partition = partition
        self.max_line_bytes = max_line_bytes
        self.bound_port: int | None = None
        self.handed = [0] * len(channels)
        """Connections handed to each worker so far."""
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def listen(self) -> None:
        """Bind and listen, before the workers start, so that a busy port fails at once.

        Raises:
            PullUnavailable: the address cannot be listened on.
        """
        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(1024)
        except OSError as error:
            raise PullUnavailable(
                f"cannot listen on {self.host}:{self.port}: {error.strerror or error}"
            ) from error
        listener.setblocking(False)
        self._listener = listener
        self.bound_port = listener.getsockname()[1]
        logger.info("listening for hwpc-sensor on %s:%s", self.host, self.bound_port)

    def worker_for(self, sensor: str | None) -> int:
        """The worker that reads a connection whose first line names ``sensor``."""
        if sensor is None:
            return 0
        owner = self.partition.worker_of(sensor, len(self.channels))
        # A sensor of another instance: any worker lets it go (counted as skipped).
        return 0 if owner is None else owner

    async def serve(self) -> None:
        """Accept until cancelled.

        A connection handed to a worker that is restarting waits in its channel, and the
        restarted worker reads it: the parent keeps the worker's end of the channel open.
        """
        listener = self._listener
        assert listener is not None, "listen() first"
        loop = asyncio.get_running_loop()
        try:
            while True:
                connection, _address = await loop.sock_accept(listener)
                task = asyncio.ensure_future(self._hand(connection))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self.close()

    async def _hand(self, connection: socket.socket) -> None:
        """Peek, hand over, and close this process's copy of the connection."""
        with connection:
            connection.setblocking(False)
            sensor = await peek_sensor(connection, self.max_line_bytes)
            worker = self.worker_for(sensor)
            try:
                await _send_when_room(self.channels[worker], connection)
            except (OSError, TimeoutError) as error:
                logger.warning(
                    "connection of sensor %s not handed to worker %d, closed: %s",
                    sensor,
                    worker,
                    error,
                )
                return
            self.handed[worker] += 1

    def close(self) -> None:
        """Stop accepting; connections being peeked at are closed."""
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
