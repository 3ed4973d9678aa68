"""A Kubernetes API server that replays recorded pod responses: list and watch, in the API's
own wire format, for the official client and ``kubectl`` alike.

It serves the discovery documents, ``GET /api/v1/pods`` (and ``/api/v1/namespaces/NS/pods``)
as a ``PodList`` at the current ``resourceVersion``, and ``?watch=true`` as the API server
streams a watch: HTTP/1.1 chunked JSON, one event a line, every event after the version asked
for that the field selector takes, then the events the test releases while the watch is open,
until ``timeoutSeconds`` or the test drops the connection. A watch from a version older than
the server keeps (:meth:`KubeApiReplay.compact`) gets what the API server sends: HTTP 200, then
an ``ERROR`` event holding a ``Status`` of code 410 (``Expired``). Field selectors on
``spec.nodeName`` and ``metadata.namespace`` (``=``, ``==``, ``!=``) are applied; any other is
refused with the API's 400 ``Status``. Every request is kept (:attr:`KubeApiReplay.requests`)
so that a test can see what the client asked for.

The test decides when the recorded watch events happen (:meth:`KubeApiReplay.release`): the
watcher's behaviour is then checked against a known order of events, with no sleeping.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

RECORDING = Path(__file__).parent / "data" / "kubernetes"


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, str]
    authorization: str | None = None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _selector(text: str) -> list[tuple[str, bool, str]]:
    """``spec.nodeName=a,metadata.namespace!=b`` → [(field, equal, value)].

    Raises:
        ValueError: a field the pods' selector does not support, as the API refuses it.
    """
    terms = []
    for term in filter(None, text.split(",")):
        equal = "!=" not in term
        name, _, value = term.replace("!=", "=").replace("==", "=").partition("=")
        if name not in ("spec.nodeName", "metadata.namespace", "metadata.name"):
            raise ValueError(f'field label not supported: "{name}"')
        terms.append((name, equal, value))
    return terms


def _field(pod: dict[str, Any], name: str) -> str:
    section, _, key = name.partition(".")
    return str((pod.get(section) or {}).get(key, ""))


def _matches(pod: dict[str, Any], terms: list[tuple[str, bool, str]], namespace: str) -> bool:
    if namespace and _field(pod, "metadata.namespace") != namespace:
        return False
    return all((_field(pod, name) == value) == equal for name, equal, value in terms)


class KubeApiReplay:
    """The recorded cluster: pods listed, then watch events released by the test."""

    def __init__(self, recording: Path = RECORDING) -> None:
        listed = json.loads((recording / "api-v1-pods.list.json").read_text())
        self._documents = {
            "/api": (recording / "api.json").read_bytes(),
            "/apis": (recording / "apis.json").read_bytes(),
            "/api/v1": (recording / "api-v1.json").read_bytes(),
        }
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        for item in listed["items"]:
            self._apply("ADDED", item)
        self.version = int(listed["metadata"]["resourceVersion"])
        self.history: list[tuple[int, dict[str, Any]]] = []
        """Released events, with the version each stands at."""
        self.oldest = self.version
        """Watches from an older version get 410 Gone."""
        with (recording / "api-v1-pods.watch.jsonl").open() as lines:
            self.recorded = [json.loads(line) for line in lines if line.strip()]
        self.requests: list[Request] = []
        self._changed = threading.Condition()
        self._generation = 0
        """Raised by :meth:`drop_watches`: open watches with an older one end."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        key = (_field(pod, "metadata.namespace"), _field(pod, "metadata.name"))
        if kind == "DELETED":
            self.pods.pop(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.pods[key] = {k: v for k, v in pod.items() if k not in ("kind", "apiVersion")}

    def release(self, count: int | None = None) -> int:
        """Let the next ``count`` recorded events (all by default) happen; how many did."""
        with self._changed:
            taken = self.recorded[: len(self.recorded) if count is None else count]
            del self.recorded[: len(taken)]
            for event in taken:
                version = int(event["object"]["metadata"]["resourceVersion"])
                self._apply(event["type"], event["object"])
                self.version = max(self.version, version)
                self.history.append((version, event))
            self._changed.notify_all()
            return len(taken)

    def compact(self) -> None:
        """Forget the history, as etcd's compaction does: a watch from before now gets 410."""
        with self._changed:
            self.oldest = self.version

    def drop_watches(self) -> None:
        """End every open watch at once, as a network fault or an API server restart does."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def watches(self) -> list[Request]:
        return [r for r in self.requests if r.query.get("watch") in ("true", "1")]

    # The HTTP side.

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                replay._serve(self)

        return Handler

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.requests.append(Request(parts.path, query, handler.headers.get("Authorization")))
        path = parts.path.rstrip("/") or "/"
        if path in self._documents:
            self._send(handler, 200, self._documents[path])
            return
        namespace = ""
        segments = path.split("/")
        if len(segments) == 6 and segments[:4] == ["", "api", "v1", "namespaces"]:
            namespace, path = segments[4], f"/api/v1/{segments[5]}"
        if path != "/api/v1/pods":
            body = _status(404, "NotFound", "the server could not find the requested resource")
            self._send(handler, 404, json.dumps(body).encode())
            return
        try:
            terms = _selector(query.get("fieldSelector", ""))
        except ValueError as error:
            message = f'field selector "{query["fieldSelector"]}": {error}'
            self._send(handler, 400, json.dumps(_status(400, "BadRequest", message)).encode())
            return
        if query.get("watch") in ("true", "1"):
            self._watch(handler, terms, namespace, query)
        else:
            self._list(handler, terms, namespace)

    def _list(self, handler: BaseHTTPRequestHandler, terms: Any, namespace: str) -> None:
        with self._changed:
            items = [p for p in self.pods.values() if _matches(p, terms, namespace)]
            version = self.version
        items.sort(key=lambda p: (_field(p, "metadata.namespace"), _field(p, "metadata.name")))
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(version)},
            "items": items,
        }
        self._send(handler, 200, json.dumps(body).encode())

    def _send(self, handler: BaseHTTPRequestHandler, code: int, body: bytes) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _watch(
        self, handler: BaseHTTPRequestHandler, terms: Any, namespace: str, query: dict[str, str]
    ) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for event in self._events(query, terms, namespace):
                line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            pass
        handler.close_connection = True

    def _events(
        self, query: dict[str, str], terms: Any, namespace: str
    ) -> Iterator[dict[str, Any]]:
        """The events a watch sends, waiting for released ones until it ends; the lock is
        never held while the client is written to."""
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        with self._changed:
            generation, oldest = self._generation, self.oldest
        if since and since < oldest:
            message = f"too old resource version: {since} ({oldest})"
            yield {"type": "ERROR", "object": _status(410, "Expired", message)}
            return
        sent = 0
        while True:
            with self._changed:
                released = self.history[sent:]
                sent += len(released)
                if not released:  # what was released before a drop is still sent
                    remaining = deadline - time.monotonic()
                    if generation != self._generation or remaining <= 0:
                        return
                    self._changed.wait(remaining)
                    continue
            for version, event in released:
                if version > since and self._visible(event, terms, namespace, query):
                    yield event

    @staticmethod
    def _visible(event: dict[str, Any], terms: Any, namespace: str, query: dict[str, str]) -> bool:
        if event["type"] == "BOOKMARK":
            return query.get("allowWatchBookmarks") == "true"
        return _matches(event["object"], terms, namespace)


@contextmanager
def kube_api_replay(recording: Path = RECORDING) -> Iterator[KubeApiReplay]:
    server = KubeApiReplay(recording)
    server.start()
    try:
        yield server
    finally:
        server.close()


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig that points ``kubectl`` (and the client's ``local`` mode) at ``server``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "replay", "cluster": {"server": server}}],
        "users": [{"name": "reader", "user": {"token": "replay-token"}}],
        "contexts": [{"name": "replay", "context": {"cluster": "replay", "user": "reader"}}],
        "current-context": "replay",
    }
    path.write_text(json.dumps(config))
    return path
