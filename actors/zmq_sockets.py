"""What the ZeroMQ input and output share: socket set-up, CURVE keys, and the wire format.

Wire format: a message is one frame of reports, or two frames ``[topic, reports]``. The reports
frame is UTF-8 JSON Lines: one report per line in PowerAPI's JSON layout (``timestamp``,
``sensor``, ``target``, ``metadata`` and the kind's payload). The publisher's topic is
``<kind>:<sensor>`` (``PowerReport:node-1``), so a subscriber filters by kind, or by kind and
sensor, with ZeroMQ's prefix subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from wattflow.formats.errors import WattflowError

logger = logging.getLogger(__name__)


class ZmqSetupError(WattflowError):
    """A ZeroMQ socket that cannot be set up as configured (a bad address or key file)."""


def load_key_pair(path: Path, what: str) -> tuple[bytes, bytes | None]:
    """A certificate file as ``zmq.auth.create_certificates`` writes it: (public, secret)."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise ZmqSetupError(f"{what} {path}: {error}") from None
    return public, secret


def check_curve(
    *, bind: bool, secret_key: Path | None, server_key: Path | None, authorized_keys: Path | None
) -> None:
    """Raise a one-line error for CURVE settings that cannot work, before anything starts."""
    if secret_key is None:
        if server_key is not None or authorized_keys is not None:
            raise ZmqSetupError("CURVE needs our own key pair: give --curve-secret-key")
        return
    if load_key_pair(secret_key, "--curve-secret-key")[1] is None:
        raise ZmqSetupError(f"--curve-secret-key {secret_key} holds no secret key")
    if bind and authorized_keys is not None and not authorized_keys.is_dir():
        raise ZmqSetupError(f"--curve-authorized-keys {authorized_keys} is not a directory")
    if not bind:
        if server_key is None:
            raise ZmqSetupError("a connecting CURVE socket needs the server's --curve-server-key")
        load_key_pair(server_key, "--curve-server-key")


class RefusalLog:
    """Warnings about peers that failed their handshake: the first of each kind at once, a
    repeat at most every ``every_s`` with how many were not logged, so a stranger that keeps
    reconnecting cannot flood the log."""

    def __init__(self, where: str, every_s: float = 60.0) -> None:
        self.where = where
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warn(self, text: str) -> None:
        now = time.monotonic()
        last = self._last.get(text)
        if last is not None and now - last[0] < self.every_s:
            self._last[text] = (last[0], last[1] + 1)
            return
        repeated = f" ({last[1]} more times since the last warning)" if last and last[1] else ""
        self._last[text] = (now, 0)
        logger.warning("%s: %s%s", self.where, text, repeated)


class CurveAuthenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler for the allow-list, which also says whom it refused and why.

    pyzmq logs a refusal at debug level only; here it is a warning naming the client's address
    and public key, the one place that knows both. The handler answers ZAP requests from a task
    of the event loop it was started on, so it must be started on the loop the socket is used
    on, and live as long as the socket: with no one answering, every handshake hangs.
    """

    def __init__(self, context: zmq.asyncio.Context, authorized_keys: Path, log: RefusalLog):
        super().__init__(context)
        self.authorized_keys = authorized_keys
        self.refusals = log
        self._asking = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # Requests are handled one at a time: the reply below belongs to this one.
        address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        key = z85.encode(msg[6]).decode() if len(msg) > 6 and len(msg[6]) == 32 else "?"
        self._asking = f"{address} (public key {key})"
        await super().handle_zap_message(msg)

    def _send_zap_reply(
        self,
        request_id: bytes,
        status_code: bytes,
        status_text: bytes,
        user_id: str = "anonymous",
    ) -> None:
        super()._send_zap_reply(request_id, status_code, status_text, user_id)
        if status_code != b"200":
            reason = status_text.decode("utf-8", "replace")
            self.refusals.warn(
                f"refused CURVE client {self._asking}: {reason} (the keys accepted are those "
                f"in --curve-authorized-keys {self.authorized_keys})"
            )


HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def handshake_failure(event: int, value: int, endpoint: str, bind: bool) -> str | None:
    """What a failed handshake means to an operator, or None when it was said already.

    ZeroMQ names only the address of the socket's side for a binding socket, the server's for a
    connecting one. A refusal by our own allow-list (an authentication failure of a binding
    socket) was logged by :class:`CurveAuthenticator`, with the client's address and key.
    """
    peer = f"a peer on {endpoint}" if bind else endpoint
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if bind:
            return None
        return (
            f"the CURVE handshake with {endpoint} failed: the server refused our CURVE key "
            f"(status {value}); add our public key to its --curve-authorized-keys"
        )
    hint = (
        "is the peer a CURVE client with this server's public key as --curve-server-key?"
        if bind
        else "is the server a CURVE server, its public key our --curve-server-key?"
    )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        try:
            name = zmq.Event(value).name or str(value)
        except ValueError:
            name = str(value)
        return f"the handshake with {peer} failed: {name.removeprefix('PROTOCOL_ERROR_')} ({hint})"
    return f"the handshake with {peer} failed: {zmq.strerror(value)} ({hint})"


async def watch_handshakes(monitor: zmq.asyncio.Socket, bind: bool, log: RefusalLog) -> None:
    """Log each failed handshake the socket's monitor reports, until cancelled."""
    while True:
        message = await recv_monitor_message(monitor)
        endpoint = message["endpoint"]
        text = handshake_failure(
            int(message["event"]),
            int(message["value"]),
            endpoint.decode("utf-8", "replace") if isinstance(endpoint, bytes) else str(endpoint),
            bind,
        )
        if text is not None:
            log.warn(text)


class ZmqSocket:
    """A ZeroMQ socket with what keeps it working: its context, the CURVE allow-list's handler
    and the watch of failed handshakes, all on the event loop that opens it.

    Opening needs a running event loop, and the socket must be used and closed on it: the
    handler and the watch are tasks of that loop. A check before the service's loop starts
    uses :func:`probe_addresses`, which leaves nothing behind.
    """

    def __init__(
        self,
        kind: int,
        *,
        uris: list[str],
        bind: bool,
        options: dict[int, int],
        secret_key: Path | None,
        server_key: Path | None,
        authorized_keys: Path | None,
        where: str,
        subscribe: Sequence[str] = (),
    ) -> None:
        """Create, secure, subscribe and bind or connect; on any error nothing stays open.

        Raises:
            ZmqSetupError: a key file that cannot be read, an address ZeroMQ refuses.
        """
        self.loop = asyncio.get_running_loop()
        self.context = zmq.asyncio.Context()
        self.socket: zmq.asyncio.Socket = self.context.socket(kind)
        self.authenticator: CurveAuthenticator | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watch: asyncio.Task[None] | None = None
        log = RefusalLog(where)
        try:
            for option, value in options.items():
                self.socket.setsockopt(option, value)
            self.authenticator = configure_curve(
                self.socket,
                bind=bind,
                secret_key=secret_key,
                server_key=server_key,
                authorized_keys=authorized_keys,
                context=self.context,
                log=log,
            )
            if secret_key is not None:
                self._monitor = self.socket.get_monitor_socket(HANDSHAKE_FAILURES)
                self._watch = asyncio.create_task(watch_handshakes(self._monitor, bind, log))
            for topic in subscribe:
                self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            attach(self.socket, uris, bind)
        except BaseException:
            self.close(linger=0)
            self.context.term()
            raise

    def close(self, linger: int) -> None:
        """Stop the watch and the handler and close the socket, giving queued messages
        ``linger`` ms; the caller then terminates :attr:`context` (which waits that long)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.socket.close(linger=linger)
        # Connected peers are authenticated already; the handler's own socket must be closed,
        # or terminating the context would wait for it forever.
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


def opening_line(
    where: str,
    socket_type: str,
    uris: list[str],
    *,
    bind: bool,
    secret_key: Path | None,
    authorized_keys: Path | None,
    topics: list[str] | None = None,
) -> str:
    """The line an input or output logs as its socket opens: where it binds or connects, what
    it subscribes to (``topics``, for a SUB socket: empty for every topic), how it is secured."""
    subscribed = ""
    if topics is not None:
        subscribed = f", subscribed to {', '.join(topics) or 'every topic'}"
    return (
        f"{where}: {socket_type} {'bound to' if bind else 'connecting to'} {','.join(uris)}"
        f"{subscribed}{curve_summary(bind, secret_key, authorized_keys)}"
    )


def curve_summary(bind: bool, secret_key: Path | None, authorized_keys: Path | None) -> str:
    """How the socket is secured, for the line that says where it binds or connects."""
    if secret_key is None:
        return " (no CURVE: unencrypted, any peer accepted)"
    if not bind:
        return " (CURVE client)"
    if authorized_keys is None:
        return " (CURVE server, any client with the server's public key accepted)"
    count = sum(1 for path in authorized_keys.glob("*.key") if path.is_file())
    keys = "key" if count == 1 else "keys"
    return f" (CURVE server, accepting the {count} client {keys} in {authorized_keys})"


def probe_addresses(kind: int, uris: list[str], bind: bool) -> None:
    """Bind or connect a throw-away socket, to find an address ZeroMQ refuses before the
    service starts; it is closed, and its addresses freed, before this returns.

    Raises:
        ZmqSetupError: the first address that cannot be bound or connected.
    """
    context = zmq.Context()
    socket = context.socket(kind)
    try:
        attach(socket, uris, bind)
    finally:
        socket.close(linger=0)
        context.term()


def configure_curve(
    socket: zmq.asyncio.Socket,
    *,
    bind: bool,
    secret_key: Path | None,
    server_key: Path | None,
    authorized_keys: Path | None,
    context: zmq.asyncio.Context,
    log: RefusalLog,
) -> CurveAuthenticator | None:
    """Encrypt and authenticate the socket with CURVE when keys are given.

    The binding side is the CURVE server: it needs its own key pair, and with
    ``authorized_keys`` it accepts only clients whose public keys are in that directory (the
    returned handler answers on the running event loop, which must be the socket's). The
    connecting side needs its own key pair and the server's public key.
    """
    check_curve(
        bind=bind, secret_key=secret_key, server_key=server_key, authorized_keys=authorized_keys
    )
    if secret_key is None:
        return None
    public, secret = load_key_pair(secret_key, "--curve-secret-key")
    socket.curve_publickey = public
    socket.curve_secretkey = secret or b""
    if bind:
        socket.curve_server = True
        if authorized_keys is None:
            return None
        authenticator = CurveAuthenticator(context, authorized_keys, log)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(authorized_keys))
        return authenticator
    assert server_key is not None  # check_curve
    socket.curve_serverkey = load_key_pair(server_key, "--curve-server-key")[0]
    return None


def attach(socket: zmq.Socket[Any], uris: list[str], bind: bool) -> None:
    """Bind or connect to every address."""
    for uri in uris:
        try:
            socket.bind(uri) if bind else socket.connect(uri)
        except zmq.ZMQError as error:
            verb = "bind" if bind else "connect"
            raise ZmqSetupError(f"cannot {verb} {uri}: {error}") from None
