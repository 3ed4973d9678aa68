"""``wattflow run --http-port P``: ``/health``, ``/ready`` and ``/metrics`` over HTTP.

The server is the standard library's WSGI server (``wsgiref``, a thread per request) in a
thread of its own, and ``/metrics`` is ``prometheus_client``'s WSGI application, which already
does what a scrape needs: the text and OpenMetrics formats chosen by the ``Accept`` header,
gzip, ``name[]`` filters. Both are already here (``prometheus_client`` is a dependency of the
Prometheus output), so the endpoint costs no new dependency; aiohttp would bring one for three
routes. A hand-written asyncio HTTP server would be less code to load but parsing HTTP by hand
is where such servers go wrong.

Running outside the event loop is also what makes ``/health`` honest: the request thread asks
the loop for a :class:`~wattflow.actors.status.Snapshot` and waits at most
:data:`LOOP_ANSWER_S`. A loop stuck in a blocking call cannot answer, and ``/health`` then says
so with 503, which a server running on that loop could never do.

Answers: 200 with ``ok``, or 503 with one reason per line (``text/plain``). A path other than
``/health``, ``/ready`` and ``/metrics`` gets 404.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import ProcessCollector, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from wattflow.actors.status import Snapshot
from wattflow.formats.errors import WattflowError

logger = logging.getLogger(__name__)

LOOP_ANSWER_S = 5.0
"""How long a request waits for the event loop before saying it does not answer."""

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow client cannot hold the next probe."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """Requests go to the debug log, not to stderr: probes come every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http %s " + format, self.address_string(), *args)


class _Fixed(Collector):
    """The metric families of one snapshot, as a collector for ``prometheus_client``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class Snapshots(Protocol):
    """What the server asks for each request: a pipeline's status (:class:`PipelineStatus`),
    or, under ``--workers``, every worker's together (``workers.WorkersStatus``)."""

    async def snapshot(self) -> Snapshot: ...


class StatusServer:
    """Serves a pipeline's health, readiness and metrics from its own thread."""

    def __init__(
        self, status: Snapshots, addr: str, port: int, answer_s: float = LOOP_ANSWER_S
    ) -> None:
        self.status = status
        self.answer_s = answer_s
        self.addr = addr
        self.requested_port = port
        self.port: int | None = None
        """The port listened on once :meth:`listen` returned (``--http-port 0`` picks one)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def listen(self) -> None:
        """Start serving; before :meth:`attach`, every probe answers 503 ("starting").

        Raises:
            WattflowError: when the address and port cannot be listened on.
        """

        class Server(_Server):
            address_family = _family(self.addr, self.requested_port)

        try:
            server = make_server(
                self.addr, self.requested_port, self._app, Server, handler_class=_Quiet
            )
        except OSError as error:
            where = f"{self.addr}:{self.requested_port}"
            raise WattflowError(
                f"--http-port: cannot listen on {where}: {error.strerror}"
            ) from None
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, name="wattflow-http", daemon=True
        )
        self._thread.start()
        logger.info(
            "health, readiness and metrics on http://%s:%d/{health,ready,metrics}",
            self.addr,
            self.port,
        )

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer from the pipeline running on ``loop`` from now on."""
        self._loop = loop

    def close(self) -> None:
        """Stop serving and release the port."""
        server, self._server = self._server, None
        self._loop = None
        if server is not None:
            server.shutdown()
            server.server_close()

    # --- requests (in the server's threads) -----------------------------------------------

    def _snapshot(self) -> Snapshot | str:
        """The pipeline's snapshot, or why there is none."""
        loop = self._loop
        if loop is None:
            return "starting: the pipeline is not running yet"
        try:
            future = asyncio.run_coroutine_threadsafe(self.status.snapshot(), loop)
        except RuntimeError:  # the loop has closed
            return "stopped: the pipeline has ended"
        try:
            return future.result(self.answer_s)
        except TimeoutError:
            future.cancel()
            return f"the event loop has not answered for {self.answer_s:g} s"

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path not in ("/health", "/ready", "/metrics"):
            return _text(
                start_response, "404 Not Found", ["no such page: try /health, /ready or /metrics"]
            )
        snapshot = self._snapshot()
        if isinstance(snapshot, str):
            return _text(start_response, "503 Service Unavailable", [snapshot])
        if path == "/metrics":
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Fixed(snapshot.metrics))
            ProcessCollector(registry=registry)
            answer: Iterable[bytes] = make_wsgi_app(registry)(environ, start_response)
            return answer
        reasons = snapshot.unhealthy if path == "/health" else snapshot.not_ready
        if reasons:
            return _text(start_response, "503 Service Unavailable", reasons)
        return _text(start_response, "200 OK", ["ok"])


def _text(start_response: StartResponse, status: str, lines: list[str]) -> list[bytes]:
    body = "".join(line + "\n" for line in lines).encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    start_response(status, headers)
    return [body]


def _family(addr: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (``::``), else IPv4."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET
    return infos[0][0] if infos else socket.AF_INET
