"""This node's pods, from the Kubernetes API: listed, then watched, kept by container ID.

The k8s pre-processor must name a container from the ID in its cgroup path, at the rate the
sensor reports (every target, every tick), without a request per report. So a thread lists the
pods once and then follows the API's watch from the list's ``resourceVersion``, keeping a map
from container ID to the pod's names that the event loop reads without waiting.

Only this node's pods are asked for (``fieldSelector=spec.nodeName=<node>``): the cgroups a
sensor sees are those of its own node, and a DaemonSet whose every pod watched the whole cluster
(what PowerAPI 2.10 does) would cost the API server a watch of every pod per node, and each
pod's memory the cluster's size. The map is bounded all the same (:class:`PodCache`): a node
whose containers restart for weeks must not grow it without end.

A watch ends: the server closes it after ``timeoutSeconds``, a network fault breaks it, the API
server restarts, or the version it resumes from is too old (HTTP 410 Gone, the ``Expired``
Status). The watcher then resumes from the last version it saw, or lists again after a 410,
waiting between failed attempts with :class:`~wattflow.actors.runtime.Backoff` (bounded steps,
forever: the pods keep changing as long as the service runs). Every failure is counted for the
service's metrics and logged once per kind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from wattflow.actors.runtime import Backoff

logger = logging.getLogger(__name__)

GONE = 410
"""The API's status for a watch whose ``resourceVersion`` is older than it keeps."""


@dataclass(frozen=True, slots=True)
class PodContainer:
    """What the API says of one container of a pod on this node."""

    container_id: str
    """The runtime's ID, without the ``containerd://`` (``cri-o://``, ``docker://``) prefix:
    the form cgroup paths hold it in."""
    container_name: str
    namespace: str
    pod_name: str
    pod_uid: str
    image: str = ""
    pod_labels: Mapping[str, str] = field(default_factory=dict)


def containers_of(pod: Mapping[str, Any]) -> list[PodContainer]:
    """The containers of a pod (a Pod object as the API's JSON) that have an ID.

    Init and ephemeral containers are included (PowerAPI 2.10 reads only the regular ones,
    and drops the reports of the others: an init container's minutes of work vanished). A
    container not yet started has no ``containerID``: it has no cgroup either.
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    found = []
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for container in status.get(key) or ():
            runtime_id = container.get("containerID") or ""
            _, _, container_id = runtime_id.partition("://")
            if container_id:
                found.append(
                    PodContainer(
                        container_id=container_id,
                        container_name=str(container.get("name", "")),
                        namespace=str(metadata.get("namespace", "")),
                        pod_name=str(metadata.get("name", "")),
                        pod_uid=str(metadata.get("uid", "")),
                        image=str(container.get("image", "")),
                        pod_labels=dict(metadata.get("labels") or {}),
                    )
                )
    return found


class PodCache:
    """Container ID → :class:`PodContainer`, at most ``max_containers`` of them.

    A deleted pod's containers are kept (as PowerAPI's later versions do) until newer entries
    push them out, the least recently seen first: the sensor's reports of a container's last
    ticks reach the pre-processor after the API said the pod is gone. Reads and writes come
    from two threads (the watcher's and the event loop's), under one lock held for a dict
    operation only.
    """

    def __init__(self, max_containers: int = 10_000) -> None:
        self.max_containers = max_containers
        self._containers: OrderedDict[str, PodContainer] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0
        """Entries pushed out by the bound."""

    def get(self, container_id: str) -> PodContainer | None:
        with self._lock:
            return self._containers.get(container_id)

    def __len__(self) -> int:
        return len(self._containers)

    def put_pod(self, pod: Mapping[str, Any]) -> None:
        """Add or refresh the pod's containers (an ADDED or MODIFIED event, a listed pod)."""
        containers = containers_of(pod)
        with self._lock:
            for container in containers:
                self._containers[container.container_id] = container
                self._containers.move_to_end(container.container_id)
            while len(self._containers) > self.max_containers:
                self._containers.popitem(last=False)
                self.evicted += 1

    def replace(self, pods: list[Mapping[str, Any]]) -> None:
        """A fresh list: its pods become the most recent entries, the others stay (their
        reports may still be in flight) until the bound pushes them out."""
        for pod in pods:
            self.put_pod(pod)


@dataclass
class WatchStats:
    """What the watcher did, for ``/metrics`` and the tests."""

    lists: int = 0
    watches: int = 0
    events: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    resource_version: str | None = None


ApiFactory = Callable[[], Any]
"""Makes a ``kubernetes.client.CoreV1Api`` (the client is made in the watcher's thread)."""


class PodWatcher:
    """Lists and watches this node's pods into a :class:`PodCache`, in a thread of its own.

    The official client (``kubernetes``) is blocking, so it runs in a daemon thread; the
    event loop only reads the cache. ``ready`` is set once the first list is in, so that the
    pre-processor can tell a pod it does not know yet from one that does not exist.
    """

    def __init__(
        self,
        api: ApiFactory,
        node_name: str,
        cache: PodCache,
        *,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        backoff: Backoff | None = None,
    ) -> None:
        self._api_factory = api
        self.node_name = node_name
        self.cache = cache
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.backoff = backoff or Backoff(0.5, 30.0)
        self.stats = WatchStats()
        self.ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    @property
    def field_selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="k8s-pod-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to end and wait for it a bounded time: a read in progress ends at the
        next event or at ``request_timeout_s``; the thread is a daemon, so it never holds up
        the process's exit."""
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.stop()
            # The client keeps the open response here; closing it ends a read that would
            # otherwise wait for the next event.
            response = getattr(watch, "_resp", None)
            if response is not None:
                with contextlib.suppress(Exception):
                    response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        api = self._api_factory()
        version: str | None = None
        while not self._stopping.is_set():
            try:
                if version is None:
                    version = self._list(api)
                version = self._follow(api, version)
                self.backoff.reset()
            except Exception as error:  # any failure of the API or the network: retry
                if self._stopping.is_set():
                    return  # the stop closed the watch
                version = self._failed(error, version)
                self._stopping.wait(self.backoff.next_s())

    def _failed(self, error: Exception, version: str | None) -> str | None:
        """Count and log a failure; the version to resume from (None: list again)."""
        status = getattr(error, "status", None)
        kind = f"http_{status}" if isinstance(status, int) else type(error).__name__
        first = kind not in self.stats.failures
        self.stats.failures[kind] += 1
        log = logger.warning if first else logger.debug
        log("pods of node %s: %s (%s); retrying with backoff", self.node_name, kind, error)
        return None if status == GONE else version

    def _list(self, api: Any) -> str:
        response = api.list_pod_for_all_namespaces(
            field_selector=self.field_selector,
            _preload_content=False,
            _request_timeout=self.request_timeout_s,
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        self.cache.replace(list(body.get("items") or ()))
        self.stats.lists += 1
        version = str(body["metadata"]["resourceVersion"])
        self.stats.resource_version = version
        self.ready.set()
        return version

    def _follow(self, api: Any, version: str) -> str:
        """Watch from ``version`` until the server ends the watch; the last version seen."""
        from kubernetes import watch

        # The client's models are made of each event (its ERROR handling needs them, and pod
        # events are few); the cache reads the event's JSON as the API sent it.
        self._watch = watcher = watch.Watch()
        self.stats.watches += 1
        for event in self._events(watcher, api, version):
            kind = str(event.get("type"))
            self.stats.events[kind] += 1
            pod = event.get("raw_object") or {}
            version = str((pod.get("metadata") or {}).get("resourceVersion") or version)
            self.stats.resource_version = version
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.cache.put_pod(pod)
        return version

    def _events(self, watcher: Any, api: Any, version: str) -> Iterator[dict[str, Any]]:
        read_timeouts = (self.request_timeout_s, self.watch_timeout_s + self.request_timeout_s)
        events: Iterator[dict[str, Any]] = watcher.stream(
            api.list_pod_for_all_namespaces,
            field_selector=self.field_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            # Connecting is bounded by request_timeout_s; a quiet watch sends nothing until
            # the server ends it after timeout_seconds, so reading waits that long and more.
            _request_timeout=read_timeouts,
        )
        for event in events:
            if self._stopping.is_set():
                return
            yield event
