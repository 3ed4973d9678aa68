"""``--workers N`` on the socket input: one acceptor, N readers, one sensor per connection.

hwpc-sensor opens one connection and writes its reports to it, one JSON line each. With several
worker processes the connection must be read by the worker that owns the sensor (its formula
state lives there), and by that worker alone, so that each line is decoded once. The acceptor
(in the parent process) accepts the connection, *peeks* at its first line without consuming it
(``MSG_PEEK``), finds the sensor, and passes the connection's file descriptor to the owning
worker over a Unix socket (``SCM_RIGHTS``). The worker then reads the connection from its first
byte, exactly as if it had accepted it: no byte is read twice, nothing is copied between
processes, and TCP flow control still slows a sensor down to its worker's pace.

A thousand sensors may connect at the same moment (a cluster's sensors started together, or
reconnecting after the service restarted), and each may take its time to send its first line
(hwpc-sensor writes its first report after its first tick). So the acceptor never polls: every
connection waiting for its first line is one entry in the event loop's selector, peeked at
only when the kernel says it is readable. A peek that finds part of a line sets the socket's
receive low-water mark (``SO_RCVLOWAT``) one byte past what it found, so the kernel wakes the
acceptor again only once more has come (or the peer closed). A connection whose first line is
late just waits: it is never given to a worker by default, since the wrong worker would
dead-letter every report of it. One that sends no complete first line within
:data:`FIRST_LINE_TIMEOUT_S` is closed, logged and counted. The connections the acceptor holds
are bounded (:data:`MAX_PENDING`): past the bound it stops accepting, and the next connections
wait in the kernel's listen backlog.

Handing over never blocks the acceptor either: each worker's channel has a queue, sent in
order as the channel takes them (a ``SOCK_SEQPACKET`` pair holds what its send buffer holds: a
few hundred connections with the default ``net.core.wmem_default``); a channel that takes
nothing for :data:`HAND_TIMEOUT_S` (a stuck worker) has its queue closed, logged, counted, and
the run exits 1.

A connection belongs to the worker of its first line's sensor. A connection whose complete
first line names no sensor (garbage) goes to worker 0, whose socket input dead-letters what
does not decode, as it would without workers.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import re
import resource
import socket
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

import msgspec

from wattflow.actors.errors import PullUnavailable
from wattflow.actors.partition import Partition

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096
"""Connections the kernel may queue before they are accepted: a thousand sensors connecting
at once fit. The kernel caps it at ``net.core.somaxconn`` (4096 since Linux 5.4, 128 before)."""
FIRST_LINE_TIMEOUT_S = 60.0
"""Longest wait for a connection's first line (or its ``"sensor"`` field), from its accept:
after it, the connection is closed, handed to no worker. hwpc-sensor writes its first report
one tick (1 s by default) after it connects."""
MAX_PENDING = 4096
"""Connections the acceptor holds at most (waiting for their first line or for their worker's
channel); past it, new connections wait in the listen backlog."""
HAND_TIMEOUT_S = 60.0
"""Longest time a worker's channel may take no connection while some wait for it (a worker
whose loop is stuck; a restarting worker takes a few seconds)."""
ACCEPT_PAUSE_S = 0.5
"""Pause before accepting again after an accept failed (no descriptor left, say)."""
WANTED_OPEN_FILES = 65536
"""The soft open-files limit the service raises itself to (the hard limit allowing): one
descriptor per connected sensor, in the parent while it waits for the first line and in
the worker after."""
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


def settle(future: asyncio.Future[None]) -> None:
    """Mark a readiness wait done (the selector may report it again before it is removed)."""
    if not future.done():
        future.set_result(None)


def send_connection(channel: socket.socket, connection: socket.socket) -> None:
    """Pass ``connection``'s descriptor over ``channel`` (a Unix ``SOCK_SEQPACKET`` socket)."""
    channel.sendmsg(
        [b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [connection.fileno()]))]
    )


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


def raise_open_files_limit(wanted: int = WANTED_OPEN_FILES) -> int:
    """Raise the soft open-files limit to ``wanted`` (or the hard limit, if lower), and say so;
    return the soft limit now (``wanted`` when unlimited).

    A thousand sensors connecting at once take a thousand descriptors in the parent, then in
    their workers, which inherit the limit; the common default soft limit of 1024 would make
    ``accept`` fail past it. Only the soft limit is raised, which needs no privilege.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as error:
        logger.warning("cannot raise the open-files limit (RLIMIT_NOFILE) from %d: %s", soft, error)
        return soft
    logger.info(
        "raised the open-files limit (RLIMIT_NOFILE) from %d to %d (hard limit %s): one "
        "descriptor per connected sensor and per file an output keeps open",
        soft,
        target,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
    )
    return target


def kernel_backlog(requested: int) -> int:
    """The listen backlog the kernel grants for ``requested``: capped at
    ``net.core.somaxconn`` (``requested`` where that cannot be read)."""
    try:
        cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return requested
    return min(requested, cap)


class _Pending:
    """A connection accepted and not handed over yet: waiting for its first line."""

    __slots__ = ("address", "lowered", "peeked", "sock", "timer")

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.peeked = 0
        """Bytes of its first line seen so far (a peek reads nothing)."""
        self.lowered = False
        """Whether its receive low-water mark is set past ``peeked``."""
        self.timer: asyncio.TimerHandle | None = None


class _Channel:
    """One worker's channel and the connections waiting for room in it, sent in order."""

    def __init__(self, sock: socket.socket, index: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        """Kept: the pool closes the channels as the acceptor's task ends."""
        self.index = index
        self.queue: deque[tuple[socket.socket, str | None]] = deque()
        self.waiting = False
        """Whether the loop watches the channel for room."""
        self.timer: asyncio.TimerHandle | None = None
        """Fires :data:`HAND_TIMEOUT_S` after the channel last took a connection, while full."""


OUTCOMES = ("handed", "silent", "peer_closed", "stalled", "failed", "stopped")
"""What becomes of an accepted connection: handed to its worker; closed because no complete
first line came in time (``silent``); closed by its peer, or reset, before a byte
(``peer_closed``); closed because its worker's channel took nothing for too long
(``stalled``) or refused it (``failed``); closed because the service stopped before it was
handed (``stopped``)."""


class Acceptor:
    """Listens where the socket input would, and hands each connection to its worker.

    ``channels[j]`` reaches worker ``j``; ``partition`` is the instance's own (``--partition``,
    or every sensor), which the workers split between them. Everything runs in callbacks of
    the event loop: the listener's, each waiting connection's and each full channel's
    readiness, and one timer per waiting connection.
    """

    def __init__(
        self,
        host: str,
        port: int,
        channels: Sequence[socket.socket],
        partition: Partition,
        max_line_bytes: int,
        *,
        first_line_timeout_s: float = FIRST_LINE_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        hand_timeout_s: float = HAND_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.port = port
        self.channels = channels
        self.partition = partition
        self.max_line_bytes = max_line_bytes
        self.first_line_timeout_s = first_line_timeout_s
        self.max_pending = max_pending
        self.hand_timeout_s = hand_timeout_s
        self.bound_port: int | None = None
        self.handed = [0] * len(channels)
        """Connections handed to each worker so far."""
        self.closed: Counter[str] = Counter()
        """Connections closed without being handed, by outcome (see :data:`OUTCOMES`)."""
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._pending: dict[int, _Pending] = {}
        self._queues = [_Channel(channel, index) for index, channel in enumerate(channels)]
        self._peek = bytearray(max_line_bytes)
        """One buffer for every peek: a peek copies what the kernel holds, allocating nothing."""

    @property
    def held(self) -> int:
        """Connections accepted and not handed yet: waiting for a first line or a channel."""
        return len(self._pending) + sum(self.queued)

    @property
    def queued(self) -> list[int]:
        """Connections waiting for room in each worker's channel, their sensor known."""
        return [len(channel.queue) for channel in self._queues]

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
            listener.listen(LISTEN_BACKLOG)
        except OSError as error:
            raise PullUnavailable(
                f"cannot listen on {self.host}:{self.port}: {error.strerror or error}"
            ) from error
        listener.setblocking(False)
        self._listener = listener
        self.bound_port = listener.getsockname()[1]
        logger.info("listening for hwpc-sensor on %s:%s", self.host, self.bound_port)
        backlog = kernel_backlog(LISTEN_BACKLOG)
        if backlog < LISTEN_BACKLOG:
            logger.log(
                logging.WARNING if backlog < 1024 else logging.INFO,
                "the kernel caps the listen backlog at %d (net.core.somaxconn; %d asked): "
                "past that many sensors connecting at once, the others' connections wait for "
                "their client to try again (a second or more)",
                backlog,
                LISTEN_BACKLOG,
            )

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
        assert self._listener is not None, "listen() first"
        self._loop = asyncio.get_running_loop()
        self._watch_listener()
        try:
            await self._loop.create_future()  # the callbacks do the work, until cancelled
        finally:
            self.close()

    # --- accepting ---------------------------------------------------------------------

    def _watch_listener(self) -> None:
        if self._loop is None or self._listener is None or self._accepting:
            return
        self._loop.add_reader(self._listener.fileno(), self._accept_ready)
        self._accepting = True

    def _unwatch_listener(self) -> None:
        if self._loop is not None and self._listener is not None and self._accepting:
            self._loop.remove_reader(self._listener.fileno())
        self._accepting = False

    def _accept_ready(self) -> None:
        """Accept every connection the backlog holds, up to :attr:`max_pending` held."""
        assert self._listener is not None
        assert self._loop is not None
        while self.held < self.max_pending:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # reset while in the backlog
            except OSError as error:  # out of descriptors, say: the backlog keeps the rest
                logger.warning(
                    "accepting a connection failed: %s; accepting again in %g s",
                    error,
                    ACCEPT_PAUSE_S,
                )
                self._unwatch_listener()
                self._loop.call_later(ACCEPT_PAUSE_S, self._watch_listener)
                return
            self._wait_for_first_line(sock, "{}:{}".format(*address[:2]))
        # Full: the next connections wait in the backlog until one held here leaves.
        self._unwatch_listener()

    def _released(self) -> None:
        """A held connection left (handed or closed): accept again if the bound had stopped it."""
        if not self._accepting and self.held < self.max_pending:
            self._watch_listener()

    # --- waiting for the first line ----------------------------------------------------

    def _wait_for_first_line(self, sock: socket.socket, address: str) -> None:
        assert self._loop is not None
        sock.setblocking(False)
        pending = _Pending(sock, address)
        self._pending[sock.fileno()] = pending
        pending.timer = self._loop.call_later(self.first_line_timeout_s, self._expire, pending)
        self._loop.add_reader(sock.fileno(), self._readable, pending)

    def _readable(self, pending: _Pending) -> None:
        """Peek at what the connection holds; hand it over once its sensor is known."""
        limit = self.max_line_bytes
        try:
            size = pending.sock.recv_into(self._peek, limit, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._drop(pending, "peer_closed", f"cut before its first line: {error}")
            return
        if not size:
            self._drop(pending, "peer_closed", "closed before sending a byte")
            return
        end = self._peek.find(b"\n", 0, size)
        # Readable, yet no more than last time although the low-water mark asked for more:
        # the peer closed mid-line, or the kernel holds no more until something is read.
        stuck = pending.lowered and size <= pending.peeked
        complete = end >= 0 or size >= limit or stuck
        sensor = first_sensor(bytes(self._peek[: end if end >= 0 else size]), complete)
        if sensor is None and not complete and self._wait_for_more(pending, size):
            return
        self._route(pending, sensor)

    def _wait_for_more(self, pending: _Pending, size: int) -> bool:
        """Have the kernel report the connection readable again only once more than ``size``
        bytes are there (or the peer closed): whether it will."""
        try:
            pending.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(size + 1, self.max_line_bytes)
            )
        except OSError as error:  # a system without it: decide with what is there
            logger.debug("%s: cannot wait for more of its first line: %s", pending.address, error)
            return False
        pending.peeked, pending.lowered = size, True
        return True

    def _forget(self, pending: _Pending) -> None:
        """Stop watching a connection that waited for its first line."""
        assert self._loop is not None
        self._loop.remove_reader(pending.sock.fileno())
        self._pending.pop(pending.sock.fileno(), None)
        if pending.timer is not None:
            pending.timer.cancel()

    def _expire(self, pending: _Pending) -> None:
        self._drop(
            pending,
            "silent",
            f"sent no complete first line within {self.first_line_timeout_s:g} s "
            f"({pending.peeked} bytes of it)",
            logging.WARNING,
        )

    def _drop(self, pending: _Pending, outcome: str, why: str, level: int = logging.DEBUG) -> None:
        """Close a connection that waited for its first line, handed to no worker."""
        self._forget(pending)
        pending.sock.close()
        self.closed[outcome] += 1
        logger.log(
            level, "connection from %s %s: closed, handed to no worker", pending.address, why
        )
        self._released()

    # --- handing over ------------------------------------------------------------------

    def _route(self, pending: _Pending, sensor: str | None) -> None:
        """Queue the connection for its sensor's worker, its low-water mark back to 1 byte (the
        worker waits for each line as it comes), and send what the channel takes."""
        self._forget(pending)
        if pending.lowered:
            with contextlib.suppress(OSError):
                pending.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        channel = self._queues[self.worker_for(sensor)]
        channel.queue.append((pending.sock, sensor))
        self._flush(channel)

    def _flush(self, channel: _Channel) -> None:
        """Send the channel's queue, in order, until it is empty or the channel is full."""
        while channel.queue:
            sock, sensor = channel.queue[0]
            try:
                send_connection(channel.sock, sock)
            except (BlockingIOError, InterruptedError):
                self._wait_for_room(channel)
                return
            except OSError as error:
                self.closed["failed"] += 1
                logger.error(
                    "connection of sensor %s not handed to worker %d, closed: %s",
                    sensor,
                    channel.index,
                    error,
                )
            else:
                self.handed[channel.index] += 1
                if channel.timer is not None:  # it took one: the stall clock starts again
                    channel.timer.cancel()
                    channel.timer = None
            channel.queue.popleft()
            sock.close()  # the worker holds its own descriptor now
            self._released()
        self._stop_waiting_for_room(channel)

    def _wait_for_room(self, channel: _Channel) -> None:
        assert self._loop is not None
        if not channel.waiting:
            self._loop.add_writer(channel.fd, self._flush, channel)
            channel.waiting = True
        if channel.timer is None:
            channel.timer = self._loop.call_later(self.hand_timeout_s, self._stalled, channel)

    def _stop_waiting_for_room(self, channel: _Channel) -> None:
        if channel.waiting and self._loop is not None:
            self._loop.remove_writer(channel.fd)
        channel.waiting = False
        if channel.timer is not None:
            channel.timer.cancel()
            channel.timer = None

    def _stalled(self, channel: _Channel) -> None:
        """The worker's channel took nothing for :attr:`hand_timeout_s`: close its queue."""
        channel.timer = None
        count = self._close_queue(channel, "stalled")
        logger.error(
            "worker %d took no connection for %g s: %d connections waiting for it closed, "
            "unread (their sensors must connect again)",
            channel.index,
            self.hand_timeout_s,
            count,
        )
        self._stop_waiting_for_room(channel)
        self._released()

    def _close_queue(self, channel: _Channel, outcome: str) -> int:
        count = len(channel.queue)
        while channel.queue:
            channel.queue.popleft()[0].close()
        self.closed[outcome] += count
        return count

    # --- stopping ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting; the connections not handed yet are closed (counted as stopped)."""
        self._unwatch_listener()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        waiting = list(self._pending.values())
        for pending in waiting:
            self._forget(pending)
            pending.sock.close()
        self.closed["stopped"] += len(waiting)
        queued = 0
        for channel in self._queues:
            queued += self._close_queue(channel, "stopped")
            self._stop_waiting_for_room(channel)
        if waiting or queued:
            logger.info(
                "stopped accepting: %d connections that had not sent their first line and %d "
                "waiting for their worker closed",
                len(waiting),
                queued,
            )
