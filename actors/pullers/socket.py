"""hwpc-sensor's socket output: a TCP server that reads newline-delimited JSON reports.

hwpc-sensor connects as a client and writes one JSON report per line. A connection is read only
when its handler asks for more (nothing is read in between), and the whole input holds at most
``max_buffered_bytes`` of lines read and not yet handed on, whatever the number of connections:
when the pipeline is full, the handlers wait to hand on, the budget runs out, every connection
stops being read, and TCP flow control slows the sensors instead of memory filling. A sensor
that sends faster than the pipeline takes waits its turn for the room of a whole batch, then has
its batch read at once and handed on whole.
Lines are bounded: one longer than ``max_line_bytes`` is dead-lettered and skipped, so a broken
peer cannot make the service buffer without limit. Under ``--workers``, a worker's input listens
on no port: it adopts the connections the acceptor hands it (:mod:`wattflow.actors.handoff`) and
reads them through the same on-demand, byte-budgeted path.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pydantic import Field, PositiveInt

from wattflow.actors.errors import PullError, PullUnavailable
from wattflow.actors.handoff import LISTEN_BACKLOG, receive_connections
from wattflow.actors.partition import Partition
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, LineOutbox, Puller, PullerConfig
from wattflow.formats.batch import Batch, reports_left, sensors_share
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
        default=2000, description="Reports decoded from one connection before they are handed on."
    )
    max_buffered_bytes: PositiveInt = Field(
        default=64 << 20,
        description="Bytes of report lines the input holds, over all its connections, read and "
        "not yet handed on (each read reserves 256 KiB of it first, a busy sensor's connection "
        "the room of a whole batch): when the pipeline is full, the input stops reading at this "
        "bound and TCP flow control slows the sensors.",
    )
    gather_ms: float = Field(
        default=100.0,
        ge=0,
        description="How long a connection's lines wait for more before they are decoded and "
        "handed on: a busy sensor's reads become one batch, a quiet sensor's reports wait at "
        "most this long. Keep it under the sensors' period: a sensor that sends again within "
        "it never pauses, and its lines wait for --max-batch of them.",
    )
    drain_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="At shutdown, how long connected sensors are still read for what they "
        "already sent.",
    )


READ_BYTES = 256 * 1024
"""The most one read of a connection takes: what a read reserves of the input's
``max_buffered_bytes`` before it is made."""
ACCEPT_PAUSE_S = 0.5
"""Pause before accepting again after an accept failed (no descriptor left, say)."""
DRAIN_QUIET_S = 0.1
"""At shutdown, how long a connection may stay quiet before it is closed, within
``drain_grace_s``: what a sensor already sent arrives well within it."""
QUIET_SHARE = 0.25
"""A connection whose lines have waited this share of ``gather_ms`` with nothing more coming is
handed on with the next connection whose gathering ends (see :meth:`SocketPuller._hurry`)."""


class ByteBudget:
    """Bytes an input holds, shared by its connections: a read waits for room first.

    Room goes to requests in the order they came: a request waits while an earlier one waits,
    so a connection that asks for the room of the rest of its batch is not passed over, again
    and again, by connections asking for one read's room. A request is let through when it
    fits, or when nothing at all is held (so a budget smaller than one request cannot stop the
    input). Bytes are given back as lines are handed on.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.high_water_bytes = 0
        self.waits = 0
        """Requests that had to wait for room: how often the input stopped reading."""
        self._waiting: deque[tuple[int, asyncio.Future[bool]]] = deque()

    def has_room(self, size_bytes: int) -> bool:
        return not self.held_bytes or self.held_bytes + size_bytes <= self.limit_bytes

    async def take(self, size_bytes: int, wait_s: float | None = None) -> bool:
        """Hold ``size_bytes`` more, waiting until they fit and every earlier request is
        served, or ``wait_s`` at most: whether they are held."""
        if not self._waiting and self.has_room(size_bytes):
            self._hold(size_bytes)
            return True
        self.waits += 1
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[bool] = loop.create_future()
        request = (size_bytes, granted)
        self._waiting.append(request)
        timer = None if wait_s is None else loop.call_later(wait_s, _settle, granted, False)
        try:
            return await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.result():
                self.give(size_bytes)  # granted just as the wait was cancelled
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if request in self._waiting:  # gave up waiting: the next request may fit
                self._waiting.remove(request)
                self._serve()

    def give(self, size_bytes: int) -> None:
        """Hold ``size_bytes`` fewer (more, when negative: lines kept from a read)."""
        self.held_bytes += -size_bytes
        if size_bytes > 0:
            self._serve()

    def _hold(self, size_bytes: int) -> None:
        self.held_bytes += size_bytes
        self.high_water_bytes = max(self.high_water_bytes, self.held_bytes)

    def _serve(self) -> None:
        """Grant the waiting requests that fit, in order, up to the first that does not."""
        waiting = self._waiting
        while waiting:
            size_bytes, granted = waiting[0]
            if not granted.done():
                if not self.has_room(size_bytes):
                    return
                self._hold(size_bytes)
                granted.set_result(True)
            waiting.popleft()


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class Peer(Protocol):
    """One connection as the line reader sees it."""

    name: str

    async def read(self, wait_s: float | None) -> bytes | None:
        """The peer's next data: ``b""`` once it closed, ``None`` if nothing came in
        ``wait_s``."""

    async def readable(self, wait_s: float | None) -> bool:
        """Whether the peer has data to read, or closed, within ``wait_s``; nothing is read."""


class _Connection:
    """One sensor's connection, read only when its handler asks.

    A read takes what the kernel already holds at once, with no trip through the event loop;
    only a read that finds nothing waits for the socket to become readable. Between reads
    nothing is read: what the sensor sends stays in the kernel's buffers (and then in the
    sensor, through TCP flow control) until the input takes it. A busy sensor's lines are
    therefore read in one go up to the batch's size, and its batch is handed on whole, instead
    of every connection's batch growing one read at a time, turn by turn, until the byte budget
    runs out with all of them half full.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        try:
            self.name = "socket:{}:{}".format(*sock.getpeername()[:2])
        except OSError:  # the peer is already gone: its reads say so
            self.name = "socket:?"
        self.task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._endless = False
        """Whether the wait under way has no deadline (an idle connection's)."""
        self._closed = False

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def hurry(self) -> None:
        """End a wait for more data now: a read waiting with lines held returns what came
        (nothing), and the lines are handed on."""
        self._wake()

    def stop_idling(self) -> None:
        """End a wait with no deadline (a connection holding no lines, waiting for its sensor)
        now: its reader looks again, and at a stop waits ``DRAIN_QUIET_S`` at most. A wait with
        a deadline (lines held, ``gather_ms``) is left to end by itself."""
        if self._endless:
            self._wake()

    def _recv(self) -> bytes | None:
        """What the kernel holds (``READ_BYTES`` at most), ``b""`` once the peer closed, or
        ``None`` when nothing is there yet."""
        if self._closed:
            return b""
        try:
            data = self.sock.recv(READ_BYTES)
        except BlockingIOError:
            return None
        except OSError as error:
            logger.info("%s closed: %s", self.name, error)
            data = b""
        if not data:
            self._closed = True
        return data

    def _ready(self) -> bool:
        """Whether a read would return at once (data, or the peer closed), without reading."""
        if self._closed:
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            pass  # the read says what happened
        return True

    async def _wait(self, wait_s: float | None) -> None:
        """Wait until the socket is readable (or closed, or cut), ``wait_s`` at most."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, self._wake)
        timer = loop.call_later(wait_s, self._wake) if wait_s is not None else None
        self._endless = wait_s is None
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._endless = False
            loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()

    async def read(self, wait_s: float | None) -> bytes | None:
        data = self._recv()
        if data is not None or wait_s == 0:
            return data
        await self._wait(wait_s)
        return self._recv()

    async def readable(self, wait_s: float | None) -> bool:
        if self._ready():
            return True
        await self._wait(wait_s)
        return self._ready()

    def cut(self) -> None:
        """Close the connection at once: a read in progress, and every later one, gets ``b""``."""
        self._closed = True
        if self._waiter is None:
            self.close()
        self._wake()

    def close(self) -> None:
        """Close the socket (a read in progress stops watching it first: see :meth:`cut`)."""
        self._closed = True
        if self._waiter is None:
            self.sock.close()


def _listeners(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, as asyncio's servers bind.

    Raises:
        OSError: an address cannot be listened on.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(infos):
            listener = socket.socket(family, kind, protocol)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def check_listening(name: str, host: str, port: int) -> str:
    """Listen on ``host`` and ``port`` as the input will, and close again: a port in use (or
    not allowed), or an address that is not this machine's, stops the command at start with
    one line naming the flag at fault, rather than being retried for ``--retry-for-s`` and
    ending the run with exit 1. Nothing is kept open, so that ``wattflow check`` may call it,
    and the acceptor of ``--workers`` listen on the port after it. Returns what was found.

    Raises:
        PullError: naming the input, the flag and why.
    """
    try:
        for listener in _listeners(host, port):
            listener.close()
    except socket.gaierror as error:
        raise PullError(f"input '{name}': --host {host}: {error.strerror or error}") from None
    except OSError as error:
        flag = f"--host {host}" if error.errno == errno.EADDRNOTAVAIL else f"--port {port}"
        raise PullError(
            f"input '{name}': {flag}: cannot listen on {host}:{port}: {error.strerror or error}"
        ) from None
    return f"can listen on {host}:{port}"


@pullers.register("socket")
class SocketPuller(Puller[SocketPullerConfig]):
    """Listens until the pipeline stops; every connected sensor is read concurrently."""

    config_model = SocketPullerConfig

    def __init__(self, config: SocketPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.kind = report_kind(config.model)
        self.bound_port: int | None = None
        self.listening = asyncio.Event()
        self.budget = ByteBudget(config.max_buffered_bytes)
        self._connections: set[_Connection] = set()
        self._gathering: dict[_Connection, float] = {}
        """Connections of sensors that are not busy, holding lines and waiting ``gather_ms`` for
        more, with the time (monotonic) their last data came."""
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

    async def check(self) -> None:
        """A port that cannot be listened on stops the command at start (exit 2)
        (:func:`check_listening`); a worker of ``--workers`` listens on none."""
        if self.handoff is None:
            check_listening(self.config.name, self.config.host, self.config.port)

    async def probe(self) -> str:
        """``wattflow check``: whether the port can be listened on."""
        return check_listening(self.config.name, self.config.host, self.config.port)

    async def pull(self, emitter: Emitter) -> None:
        if self.handoff is not None and self.partition is not None:
            emitter = _OwnSensors(emitter, self.partition, self.instance)
        loop = asyncio.get_running_loop()

        def serve(sock: socket.socket) -> None:
            """Read a connection, accepted here or handed over, in a task of its own."""
            connection = _Connection(sock)
            self._connections.add(connection)
            connection.task = loop.create_task(self._serve(connection, emitter))

        try:
            if self.handoff is not None:
                await self._take_handed(self.handoff, serve, emitter)
            else:
                await self._accept(serve, emitter)
            await self._close_connections()
        finally:  # cut short (the drain deadline, a second signal): no connection outlives it
            await self._cancel_connections()

    async def _serve(self, connection: _Connection, emitter: Emitter) -> None:
        try:
            await self._read(connection, emitter)
        finally:
            self._connections.discard(connection)
            connection.close()

    async def _accept(self, serve: Callable[[socket.socket], None], emitter: Emitter) -> None:
        """Listen and accept connections until the pipeline stops."""
        try:
            listeners = _listeners(self.config.host, self.config.port)
        except OSError as error:
            raise PullUnavailable(
                f"cannot listen on {self.config.host}:{self.config.port}: {error.strerror or error}"
            ) from error
        self.bound_port = listeners[0].getsockname()[1]
        logger.info("listening for hwpc-sensor on %s:%s", self.config.host, self.bound_port)
        self.listening.set()
        loop = asyncio.get_running_loop()

        async def accept(listener: socket.socket) -> None:
            while True:
                try:
                    sock, _ = await loop.sock_accept(listener)
                except OSError as error:  # out of descriptors, say: wait, then accept again
                    logger.warning("accepting a connection failed: %s", error)
                    await asyncio.sleep(ACCEPT_PAUSE_S)
                    continue
                serve(sock)

        accepting = [loop.create_task(accept(listener)) for listener in listeners]
        try:
            await emitter.stopping.wait()
        finally:
            for task in accepting:
                task.cancel()
            await asyncio.gather(*accepting, return_exceptions=True)
            for listener in listeners:
                listener.close()

    async def _take_handed(
        self,
        channel: socket.socket,
        serve: Callable[[socket.socket], None],
        emitter: Emitter,
    ) -> None:
        """Read the connections the acceptor hands over until the pipeline stops.

        A handed connection is read exactly as one this input accepts itself: on demand,
        within the same byte budget.
        """
        loop = asyncio.get_running_loop()
        channel.setblocking(False)
        logger.info("reading the hwpc-sensor connections handed to this worker")

        def on_readable() -> None:
            received = receive_connections(channel)
            if received is None:  # the acceptor closed the channel: no more connections
                loop.remove_reader(channel.fileno())
                return
            for connection in received:
                serve(connection)

        loop.add_reader(channel.fileno(), on_readable)
        try:
            await emitter.stopping.wait()
        finally:
            loop.remove_reader(channel.fileno())

    async def _close_connections(self) -> None:
        """Read what connected sensors already sent for ``drain_grace_s``, then cut them off.

        A connection that holds no lines waits for its sensor with no deadline: it is woken
        first, so that it waits ``DRAIN_QUIET_S`` more at most, and an idle sensor's
        connection is closed then rather than at the end of the grace period.
        """
        for connection in self._connections:
            connection.stop_idling()
        if self._connections:
            await asyncio.wait(self._tasks(), timeout=self.config.drain_grace_s)
        # Peers still connected after the grace period are cut off; what they sent before
        # is already handed on, and a line cut in half is dead-lettered.
        for connection in list(self._connections):
            connection.cut()
        if self._connections:
            await asyncio.wait(self._tasks())

    async def _cancel_connections(self) -> None:
        """Cancel the connections' tasks still running, and wait until they have ended; none
        is left once :meth:`_close_connections` has run."""
        running = self._tasks()
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    def _tasks(self) -> set[asyncio.Task[None]]:
        return {c.task for c in self._connections if c.task is not None}

    async def _read(self, peer: Peer, emitter: Emitter) -> None:
        """Read one connection a chunk at a time, decoding each batch's complete lines together.

        A chunk is what one read returns (256 KiB at most); a busy sensor's chunks follow one
        another until its batch is full, and are decoded and handed on together, while a quiet
        one's lines are handed on as soon as it pauses. Each chunk is reserved in the input's
        byte budget first; the lines held are counted until they are handed on.
        """
        cursor = _Cursor()
        batch = _CountedOutbox(self.kind, peer.name, self.budget)
        try:
            while chunk := await self._next_chunk(peer, batch, emitter):
                await self._split(chunk, cursor, peer.name, batch, emitter)
                del chunk  # its lines are in the batch: hold nothing else while waiting
                batch.settle()
                if batch.size >= self.config.max_batch:
                    batch.busy = True
                    await batch.emit(emitter)
                    # A read that finds data does not yield: let the other connections and
                    # the stages run before this one reads its next batch.
                    await asyncio.sleep(0)
                self._gathered(peer, batch)
            self._last_line(cursor, peer.name, batch, emitter)
            await batch.emit(emitter)
        finally:
            self._gather_no_more(peer)
            batch.release()

    def _gathered(self, peer: Peer, batch: _CountedOutbox) -> None:
        """Note when a quiet sensor's connection last brought lines it holds (see
        :meth:`_hurry`); a busy sensor's batches are left to fill."""
        if not isinstance(peer, _Connection):
            return
        if batch.size and not batch.busy:
            self._gathering[peer] = time.monotonic()
        else:
            self._gathering.pop(peer, None)

    def _gather_no_more(self, peer: Peer) -> None:
        if isinstance(peer, _Connection):  # only the socket's own connections gather
            self._gathering.pop(peer, None)

    def _hurry(self, peer: Peer) -> None:
        """A connection's gathering ended: the other quiet connections whose lines have waited
        ``QUIET_SHARE`` of ``gather_ms`` with nothing more coming are handed on now too.

        Live sensors each send a tick a second, at moments spread over the second: every tick
        would be decoded and go through the stages on its own, ``gather_ms`` after it came,
        with the process idle (and its caches taken by other processes) in between. Handed on
        together, ticks that came close together go through the stages back to back, sooner
        than they would have, none later: a lone tick is not delayed, and a tick still coming
        in (data in the last ``QUIET_SHARE`` of the wait) is left to gather.
        """
        self._gather_no_more(peer)
        if not self._gathering:
            return
        quiet_since = time.monotonic() - self.config.gather_ms / 1000 * QUIET_SHARE
        ready = [c for c, last in self._gathering.items() if last <= quiet_since]
        for connection in ready:
            del self._gathering[connection]
            connection.hurry()

    async def _split(
        self, chunk: bytes, cursor: _Cursor, peer: str, batch: _CountedOutbox, emitter: Emitter
    ) -> None:
        """Add a chunk's complete lines to the batch; a line longer than ``max_line_bytes`` is
        dead-lettered in its place (what came before it is handed on first)."""
        limit = self.config.max_line_bytes
        lines = chunk.split(b"\n")
        if cursor.partial:  # the end of a line begun in the last chunk
            lines[0] = cursor.partial + lines[0]
        cursor.partial = lines.pop()
        start = 0
        for position, line in enumerate(lines):
            if cursor.skipping:
                # The end of an overlong line, already dead-lettered.
                cursor.skipping = False
                start = position + 1
            elif len(line) > limit:
                self._decode(lines[start:position], cursor, batch)
                cursor.number += 1
                await batch.emit(emitter)  # dead letters in the order of lines
                self._too_long(emitter, peer, cursor.number)
                start = position + 1
        self._decode(lines[start:], cursor, batch)
        if len(cursor.partial) > limit and not cursor.skipping:
            cursor.number += 1
            await batch.emit(emitter)
            self._too_long(emitter, peer, cursor.number)
            cursor.skipping = True
        if cursor.skipping:
            cursor.partial = b""

    async def _next_chunk(
        self, peer: Peer, batch: _CountedOutbox, emitter: Emitter
    ) -> bytes | None:
        """The peer's next data; ``None`` or empty once it closed, or went quiet while draining.

        While lines are held, the read waits ``gather_ms`` at most: a busy sensor's reads then
        gather into one batch, and a quiet sensor's lines are handed on once it pauses. A
        connection that holds no lines waits for data before it takes any room, so that quiet
        sensors hold none of the budget. Before reading, room for the read is taken in the
        budget (:meth:`_make_room`); a connection that holds lines waits for it ``gather_ms`` at
        most, then hands its lines on (giving their room back), so that connections waiting for
        each other's room cannot stall.
        """
        while True:
            wait_s = self._wait_s(batch, emitter)
            if not batch.size and not await peer.readable(wait_s):
                if wait_s == DRAIN_QUIET_S:
                    return None  # quiet while draining
                continue  # woken at the stop: wait DRAIN_QUIET_S now
            if batch.room_bytes < READ_BYTES and not await self._make_room(batch, wait_s):
                batch.busy = True
                self._gather_no_more(peer)
                await batch.emit(emitter)
                continue
            chunk = await peer.read(wait_s if batch.size else 0)
            batch.room_bytes -= len(chunk or b"")
            batch.read_bytes += len(chunk or b"")
            if chunk is not None:
                return chunk
            if await self._nothing_came(peer, batch, emitter):
                return None

    async def _nothing_came(self, peer: Peer, batch: _CountedOutbox, emitter: Emitter) -> bool:
        """A read found nothing: whether the connection is done (quiet while draining).
        Holding no lines, it gives its room back while it waits; holding lines, its sensor
        has paused: they are handed on."""
        if not batch.size:
            batch.give_room(batch.room_bytes)
            return False
        if emitter.stopping.is_set():
            return True
        batch.busy = False
        self._hurry(peer)
        await batch.emit(emitter)
        return False

    def _wait_s(self, batch: _CountedOutbox, emitter: Emitter) -> float | None:
        """How long a read may wait for data: while draining, 0.1 s (what the peer already
        sent, then stop); holding lines, ``gather_ms``; else as long as it takes."""
        if emitter.stopping.is_set():
            return DRAIN_QUIET_S
        return self.config.gather_ms / 1000 if batch.size else None

    async def _make_room(self, batch: _CountedOutbox, wait_s: float | None) -> bool:
        """Take room in the budget for the next read: whether it was taken.

        A connection whose last batch was full (its sensor sends faster than the pipeline
        takes) asks, before it reads again, for the room of a whole batch of lines as long as
        the last ones, waiting its turn behind the earlier requests while it holds no lines.
        Its next batch is then read whole, at once, and handed on full, instead of every
        connection's batch growing by a read at a time until the budget is spread over all of
        them and each is handed on small. Otherwise it asks for one read's room; holding
        lines, it waits ``wait_s`` at most.
        """
        wanted = READ_BYTES - batch.room_bytes
        if not batch.size and batch.busy and batch.line_bytes:
            # the last read of a batch may bring up to a read's bytes past max_batch
            whole = self.config.max_batch * batch.line_bytes + READ_BYTES
            whole = min(whole, self.budget.limit_bytes)
            wanted = max(wanted, whole - batch.room_bytes)
        if not await self.budget.take(wanted, wait_s if batch.size else None):
            return False
        batch.room_bytes += wanted
        return True

    def _decode(self, lines: list[bytes], cursor: _Cursor, batch: _CountedOutbox) -> None:
        """Hold complete lines that follow line ``cursor.number``, to be decoded when handed
        on."""
        batch.add(lines, cursor.number + 1)
        cursor.number += len(lines)

    def _last_line(
        self, cursor: _Cursor, peer: str, batch: _CountedOutbox, emitter: Emitter
    ) -> None:
        """What the peer sent after its last newline, once it closed or went quiet."""
        if cursor.skipping or not cursor.partial.strip():
            return
        if emitter.stopping.is_set():
            emitter.reject(
                cursor.partial.decode("utf-8", "replace"),
                f"{peer}:{cursor.number + 1}: connection cut at shutdown mid-line",
            )
            return
        self._decode([cursor.partial], cursor, batch)

    def _too_long(self, emitter: Emitter, peer: str, line_number: int) -> None:
        emitter.reject(
            None,
            f"{peer}:{line_number}: line longer than {self.config.max_line_bytes} bytes, skipped",
        )


class _Cursor:
    """Where the reading of a connection stands: the last complete line's number, the start
    of the next line, and whether that line is too long and being skipped to its end."""

    __slots__ = ("number", "partial", "skipping")

    def __init__(self) -> None:
        self.number = 0
        self.partial = b""
        self.skipping = False


class _CountedOutbox(LineOutbox):
    """A connection's lines, counted in the input's byte budget until they are handed on.

    ``room_bytes`` are taken in the budget for reads still to come; ``read_bytes`` are the bytes
    read and not yet settled; :meth:`settle`, after a chunk's lines are split, keeps counted
    only the bytes of the complete lines held (the end of a line still to come is not counted:
    a budget full of half lines could never be read further). Handing the lines on gives back
    their bytes and the room left.
    """

    def __init__(self, kind: type[Report], source: str, budget: ByteBudget) -> None:
        super().__init__(kind, source)
        self.budget = budget
        self.room_bytes = 0
        self.read_bytes = 0
        self.held_bytes = 0
        self.busy = False
        """Whether the last batch went on before the sensor paused: it sends faster than
        the lines are handed on."""
        self.line_bytes = 0
        """The length of the lines of the last batch handed on, on average."""

    def add(self, lines: list[bytes], first_line: int) -> None:
        super().add(lines, first_line)
        self.held_bytes += sum(map(len, lines))

    def settle(self) -> None:
        """Give back what was read and is not held as complete lines."""
        self.budget.give(self.read_bytes - self.held_bytes)
        self.read_bytes = self.held_bytes

    async def emit(self, emitter: Emitter) -> None:
        """Hand the lines on, then give their bytes and the room left back."""
        if self.size:
            self.line_bytes = -(-self.held_bytes // self.size)
        try:
            await super().emit(emitter)
        finally:
            self.release()

    def give_room(self, size_bytes: int) -> None:
        """Give back room taken for reads that are not made now."""
        self.budget.give(size_bytes)
        self.room_bytes -= size_bytes

    def release(self) -> None:
        """Give back everything still counted (the batch went on, or the connection is done)."""
        self.budget.give(self.read_bytes + self.room_bytes)
        self.room_bytes = self.read_bytes = self.held_bytes = 0


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

    def _takes(self, sensor: str) -> bool:
        return self._worker.owns(sensor) or (
            self._instance is not None and not self._instance.owns(sensor)
        )

    async def emit(self, batch: Batch) -> None:
        kept, left = sensors_share(batch, self._takes)
        for report in reports_left(batch, self._takes) if left else ():
            self._emitter.reject(
                report,
                f"sensor {report.sensor!r} belongs to another worker (--workers): this "
                "connection went to the worker of its first report's sensor; send each "
                "sensor's reports on a connection of its own",
            )
        for part in kept:
            await self._emitter.emit(part)

    def reject(self, payload: Any, reason: str) -> None:
        self._emitter.reject(payload, reason)

    def skip(self, count: int) -> None:
        self._emitter.skip(count)
