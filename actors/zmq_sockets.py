"""What the ZeroMQ input and output share: socket set-up, CURVE keys, and the wire format.

Wire format: a message is one frame of reports, or two frames ``[topic, reports]``. The reports
frame is UTF-8 JSON Lines: one report per line in PowerAPI's JSON layout (``timestamp``,
``sensor``, ``target``, ``metadata`` and the kind's payload). The publisher's topic is
``<kind>:<sensor>`` (``PowerReport:node-1``), so a subscriber filters by kind, or by kind and
sensor, with ZeroMQ's prefix subscriptions.
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from wattflow.formats.errors import WattflowError


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


def configure_curve(
    socket: zmq.asyncio.Socket,
    *,
    bind: bool,
    secret_key: Path | None,
    server_key: Path | None,
    authorized_keys: Path | None,
    context: zmq.asyncio.Context,
) -> AsyncioAuthenticator | None:
    """Encrypt and authenticate the socket with CURVE when keys are given.

    The binding side is the CURVE server: it needs its own key pair, and with
    ``authorized_keys`` it accepts only clients whose public keys are in that directory. The
    connecting side needs its own key pair and the server's public key.
    """
    if secret_key is None:
        if server_key is not None or authorized_keys is not None:
            raise ZmqSetupError("CURVE needs our own key pair: give --curve-secret-key")
        return None
    public, secret = load_key_pair(secret_key, "--curve-secret-key")
    if secret is None:
        raise ZmqSetupError(f"--curve-secret-key {secret_key} holds no secret key")
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    if bind:
        socket.curve_server = True
        if authorized_keys is None:
            return None
        if not authorized_keys.is_dir():
            raise ZmqSetupError(f"--curve-authorized-keys {authorized_keys} is not a directory")
        authenticator = AsyncioAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(authorized_keys))
        return authenticator
    if server_key is None:
        raise ZmqSetupError("a connecting CURVE socket needs the server's --curve-server-key")
    socket.curve_serverkey = load_key_pair(server_key, "--curve-server-key")[0]
    return None


def attach(socket: zmq.asyncio.Socket, uris: list[str], bind: bool) -> None:
    """Bind or connect to every address."""
    for uri in uris:
        try:
            socket.bind(uri) if bind else socket.connect(uri)
        except zmq.ZMQError as error:
            verb = "bind" if bind else "connect"
            raise ZmqSetupError(f"cannot {verb} {uri}: {error}") from None
