"""``--pre-processor k8s``: containers' cgroup paths named as Kubernetes knows them.

PowerAPI 2.10's group, flags, JSON keys and variables are taken unchanged
(``--pre-processor k8s -a cluster -p puller``); its layout of the reports is kept under
``--layout powerapi-2.10`` (the default when the SmartWatts formula runs with
``--compat smartwatts-2.4``): a target under ``/kubepods`` becomes its container's name, with
``metadata["k8s"] = {container_id, container_name, namespace, pod_name, pod_labels}``, and the
report of a container the API does not name (a pod's pause container, a pod not yet listed) is
let go. Every other target passes unchanged.

wattflow's own layout (``--layout wattflow``) leaves the input as it is and names the
formulas' output instead (:class:`~wattflow.actors.naming.TargetNaming` asks
:meth:`K8sPreProcessor.output_labels`): the target is kept, so that two pods' containers of the
same name stay two series and a dashboard built on cgroup paths keeps working; flat keys
(``k8s_pod_namespace``, ``k8s_pod_name``, ``k8s_container_name``, ``k8s_container_image``,
those PowerAPI's next release adds) go on the CPU, DRAM and GPU power alike, for every output
to carry as tags or labels; nothing is let go (a pause container's or an unknown pod's energy
is still part of the node's, under its path); and hwpc-sensor's frames keep their fast path
(naming the input would turn each into reports: 25 µs a report, three times the live path's
whole cost).

The container ID is read from the cgroup path by the one resolver every target goes through
(:func:`wattflow.formats.targets.resolve_cgroup`); the pods come from the API through the
official client, this node's only (:mod:`wattflow.actors.preprocessors.pods`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from wattflow.actors.preprocessors import preprocessors
from wattflow.actors.preprocessors.base import PreProcessor, PreProcessorConfig
from wattflow.actors.preprocessors.pods import PodCache, PodContainer, PodWatcher, containers_of
from wattflow.formats.batch import Batch, any_target, expand
from wattflow.formats.errors import WattflowError
from wattflow.formats.reports import Report
from wattflow.formats.targets import resolve_cgroup

logger = logging.getLogger(__name__)

LAYOUT_POWERAPI = "powerapi-2.10"
LAYOUT_WATTFLOW = "wattflow"
UNKNOWN_CONTAINER = "k8s: container unknown to the API (a pause container, or a pod not listed)"
"""The reason the PowerAPI 2.10 layout gives for the reports it lets go."""
NAME_TAKEN = "k8s: container name already a target of this tick (another pod's container)"
"""The PowerAPI 2.10 layout makes a container's name the target, and names are not unique
across pods: the second report of one name in a tick is let go, counted, where SmartWatts
2.4.1 keeps one of the two without a word."""
FLAT_KEYS = ("k8s_pod_namespace", "k8s_pod_name", "k8s_container_name", "k8s_container_image")
"""The metadata keys of wattflow's layout: each fixed for the life of its container, so outputs
may make them tags or labels without adding series beyond the targets themselves."""
PROBE_TIMEOUT_S = 10.0
"""Longest wait for ``wattflow check``'s list of pods."""
LOGGED_TARGETS = 1024
"""Targets of unknown containers logged, at most."""


class K8sConfig(PreProcessorConfig):
    """Names the containers of this node's pods from the Kubernetes API."""

    type: str = Field(default="k8s", description="`k8s`.")
    api_mode: Literal["local", "manual", "cluster"] = Field(
        default="cluster",
        description="How to reach the API: `cluster` (the pod's service account, in a "
        "DaemonSet), `local` (the kubeconfig: KUBECONFIG or ~/.kube/config), `manual` "
        "(--api-host and --api-key).",
        json_schema_extra={"flags": ["-a", "--api-mode"]},
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token for --api-mode manual (`Bearer ` before it is optional).",
        json_schema_extra={"flags": ["-k", "--api-key"]},
    )
    api_host: str | None = Field(
        default=None,
        description="API server URL for --api-mode manual, e.g. https://10.0.0.1:6443.",
        json_schema_extra={"flags": ["-h", "--api-host"]},
    )
    node_name: str | None = Field(
        default=None,
        description="This node's name: only its pods are watched. Default: the NODE_NAME "
        "variable, which the DaemonSet sets from the downward API (spec.nodeName).",
    )
    layout: Literal["wattflow", "powerapi-2.10"] | None = Field(
        default=None,
        description="`powerapi-2.10`: target := container name, metadata under `k8s`, "
        "reports of unknown containers let go (counted); `wattflow`: target kept, flat "
        "`k8s_*` metadata, nothing let go. Default: powerapi-2.10 under --compat "
        "smartwatts-2.4, else wattflow.",
    )
    max_containers: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="Containers kept in memory; the least recently seen go first.",
    )
    watch_timeout_s: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="Each watch asks the API server to end it after this long; the watcher "
        "then resumes from the last version it saw.",
    )
    startup_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="Longest wait for the first list of pods before the inputs start; past "
        "it the service starts anyway and names pods once the list is in.",
    )

    @model_validator(mode="after")
    def _manual_needs_a_host(self) -> K8sConfig:
        if self.api_mode == "manual" and not self.api_host:
            raise ValueError("--api-mode manual needs --api-host (the API server's URL)")
        return self

    def node(self, environ: dict[str, str] | None = None) -> str | None:
        """The node whose pods are watched: --node-name, else NODE_NAME."""
        environ = dict(os.environ) if environ is None else environ
        return self.node_name or environ.get("NODE_NAME") or None


def api_factory(config: K8sConfig) -> Callable[[], Any]:
    """What makes the ``CoreV1Api`` of ``config``'s mode, without touching the client's global
    configuration (two pre-processors may reach two clusters).

    Raises (when called):
        WattflowError: the client is not installed, or the mode's configuration is missing.
    """

    def make() -> Any:
        try:
            from kubernetes import client
            from kubernetes import config as kube_config
        except ImportError:
            raise WattflowError(
                "--pre-processor k8s needs the Kubernetes client: "
                "pip install 'wattflow[kubernetes]'"
            ) from None
        try:
            if config.api_mode == "local":
                # KUBECONFIG as it is now: the client reads it once, when first imported.
                loaded = kube_config.new_client_from_config(
                    config_file=os.environ.get("KUBECONFIG")
                )
                return client.CoreV1Api(loaded)
            configuration = client.Configuration()
            if config.api_mode == "cluster":
                kube_config.load_incluster_config(client_configuration=configuration)
            else:
                configuration.host = str(config.api_host)  # checked: manual needs it
                if config.api_key:
                    token = config.api_key.get_secret_value().removeprefix("Bearer ").strip()
                    configuration.api_key = {"authorization": token}
                    configuration.api_key_prefix = {"authorization": "Bearer"}
            return client.CoreV1Api(client.ApiClient(configuration))
        except kube_config.ConfigException as error:
            raise WattflowError(f"{config.name}: --api-mode {config.api_mode}: {error}") from None

    return make


@preprocessors.register("k8s")
class K8sPreProcessor(PreProcessor[K8sConfig]):
    """Names pods' containers; see the module's docstring for the two layouts."""

    config_model = K8sConfig

    def __init__(self, config: K8sConfig, *, compat: bool = False) -> None:
        super().__init__(config)
        layout = config.layout or (LAYOUT_POWERAPI if compat else LAYOUT_WATTFLOW)
        self.powerapi_layout = layout == LAYOUT_POWERAPI
        self.names_outputs = not self.powerapi_layout
        self.cache = PodCache(config.max_containers)
        self.watcher: PodWatcher | None = None
        self._api: Any = None
        self.named = 0
        """Reports whose container the API named."""
        self._logged: set[str] = set()
        self._named_targets: set[str] = set()
        self._unknown_targets: set[str] = set()
        self.unknown = 0
        """Reports of a pod's container the API did not name (kept, or let go under the
        PowerAPI 2.10 layout)."""

    async def check(self) -> None:
        """The node's name is known and the client can be configured (exit 2 otherwise)."""
        if self.config.node() is None:
            raise WattflowError(
                f"{self.config.name}: the node's name is unknown: give --node-name or set "
                "NODE_NAME (the DaemonSet sets it from spec.nodeName)"
            )
        self._api = api_factory(self.config)()

    async def probe(self) -> str:
        """List this node's pods once, as the watcher will (``wattflow check``)."""
        await self.check()
        api, node = self._api, self.config.node()
        try:
            pods = await asyncio.to_thread(list_pods, api, f"spec.nodeName={node}")
        except Exception as error:  # the API's errors and the network's, said in one line
            status = getattr(error, "status", None)
            reason = f"HTTP {status} {getattr(error, 'reason', '')}" if status else str(error)
            raise WattflowError(f"listing the pods of node {node}: {reason.strip()}") from None
        containers = sum(len(containers_of(pod)) for pod in pods)
        host = api.api_client.configuration.host
        return f"{len(pods)} pods on node {node} ({containers} containers) at {host}"

    async def start(self) -> None:
        """Start watching, and wait up to ``startup_wait_s`` for the first list."""
        node = self.config.node()
        if node is None:
            await self.check()
            node = self.config.node()
        assert node is not None
        if self._api is None:
            self._api = api_factory(self.config)()
        api = self._api
        self.watcher = PodWatcher(
            lambda: api, node, self.cache, watch_timeout_s=self.config.watch_timeout_s
        )
        self.watcher.start()
        wait_s = self.config.startup_wait_s
        if not await asyncio.to_thread(self.watcher.ready.wait, wait_s):
            logger.warning(
                "%s: no list of node %s's pods after %s s; going on, naming pods once it comes",
                self.config.name,
                node,
                wait_s,
            )

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    def _concerns(self, target: str) -> bool:
        """Whether the PowerAPI 2.10 layout renames or lets go this target (its own test)."""
        return target.startswith("/kubepods")

    def output_labels(self, target: str) -> dict[str, str] | None:
        """wattflow's layout: the pod's names for the formulas' reports of a container the
        API names (any container the resolver finds: the cache holds only pods' ones)."""
        container_id = resolve_cgroup(target).container_id
        if container_id is None:
            return None
        container = self.cache.get(container_id)
        if container is None:
            self._count(self._unknown_targets, target)
            self._say_unknown(target, container_id)
            return None
        self._count(self._named_targets, target)
        return flat(container)

    def _count(self, targets: set[str], target: str) -> None:
        """Distinct targets named or not, for ``/metrics``, up to a bound."""
        if len(targets) < self.config.max_containers:
            targets.add(target)

    def process(self, batch: Batch) -> tuple[Batch, Counter[str]]:
        """The PowerAPI 2.10 layout: reports of pods' containers renamed or let go; a frame
        that holds one becomes its reports (they carry metadata now, which frames do not), the
        others pass as they came. wattflow's layout leaves the input as it is (and names the
        formulas' output instead: :meth:`output_labels`), so hwpc-sensor's frames keep their
        fast path."""
        dropped: Counter[str] = Counter()
        if not self.powerapi_layout or not any_target(batch, self._concerns):
            return batch, dropped
        kept: list[Report] = []
        taken: set[tuple[Any, str, str]] = set()
        for report in expand(batch):
            named = self._named(report)
            if named is None:
                dropped[UNKNOWN_CONTAINER] += 1
                continue
            key = (named.timestamp, named.sensor, named.target)
            if named is not report and key in taken:
                dropped[NAME_TAKEN] += 1
                continue
            taken.add(key)
            kept.append(named)
        self.dropped.update(dropped)
        return kept, dropped

    def _named(self, report: Report) -> Report | None:
        if not self._concerns(report.target):
            return report
        container_id = resolve_cgroup(report.target).container_id
        container = None if container_id is None else self.cache.get(container_id)
        if container is None:
            self.unknown += 1
            self._say_unknown(report.target, container_id)
            return None
        self.named += 1
        return report.model_copy(
            update={
                "target": container.container_name,
                "metadata": {**report.metadata, "k8s": powerapi_metadata(container)},
            }
        )

    def _say_unknown(self, target: str, container_id: str | None) -> None:
        """Log each target whose container the API does not name, once (up to
        :data:`LOGGED_TARGETS` of them: containers come and go for as long as the service
        runs)."""
        if target in self._logged or len(self._logged) >= LOGGED_TARGETS:
            return
        self._logged.add(target)
        what = "let go" if self.powerapi_layout else "not named"
        logger.info(
            "%s: container %s is not one of node %s's pods the API named (a pause container, "
            "or a pod not listed yet): reports of %s %s",
            self.config.name,
            container_id,
            self.config.node(),
            target,
            what,
        )

    def metrics(self) -> dict[str, float]:
        watcher = self.watcher
        figures = {
            "containers": float(len(self.cache)),
            "containers_evicted_total": float(self.cache.evicted),
        }
        if self.powerapi_layout:
            figures["reports_named_total"] = float(self.named)
            figures["reports_unknown_container_total"] = float(self.unknown)
        else:
            figures["targets_named"] = float(len(self._named_targets))
            figures["targets_unknown_container"] = float(len(self._unknown_targets))
        if watcher is not None:
            figures["lists_total"] = float(watcher.stats.lists)
            figures["watches_total"] = float(watcher.stats.watches)
            figures["watch_failures_total"] = float(sum(watcher.stats.failures.values()))
        return figures


def list_pods(api: Any, field_selector: str) -> list[dict[str, Any]]:
    """The pods a field selector takes, as the API's JSON (blocking)."""
    response = api.list_pod_for_all_namespaces(
        field_selector=field_selector, _preload_content=False, _request_timeout=PROBE_TIMEOUT_S
    )
    try:
        items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
    finally:
        response.release_conn()
    return items


def powerapi_metadata(container: PodContainer) -> dict[str, Any]:
    """PowerAPI 2.10's ``metadata["k8s"]`` (its ``K8sContainerMetadata`` as a dict)."""
    return {
        "container_id": container.container_id,
        "container_name": container.container_name,
        "namespace": container.namespace,
        "pod_name": container.pod_name,
        "pod_labels": dict(container.pod_labels),
    }


def flat(container: PodContainer) -> dict[str, str]:
    """wattflow's keys: one level, so every output can make them tags or labels; the names
    PowerAPI's release after 2.10 uses. Pod labels stay out (unbounded keys and values)."""
    values = (container.namespace, container.pod_name, container.container_name, container.image)
    return dict(zip(FLAT_KEYS, values, strict=True))
