"""Prometheus output: power as gauges and energy as counters on an HTTP endpoint Prometheus scrapes.

PowerAPI's pusher type name (``--output prometheus``) and flags (``-u/--addr``, 2.10's
``--uri``, ``-p/--port``, ``-M/--metric-name``, ``-d/--metric-description``, ``-t/--tags``), with
two metrics per series instead of PowerAPI's one:

- ``wattflow_power_watts`` (gauge; ``--metric-name`` renames it): the power of the newest report;
- ``wattflow_energy_joules_total`` (counter): the power integrated over time, each report's power
  times the time since the series' previous report. The first report of a series only starts
  it; a report older than the series' newest changes nothing (the newer report's interval
  already covers its time); a gap longer than ``--series-expiry-s`` is not integrated over.

Labels are bounded on purpose. PowerAPI 2.10 makes every metadata key a label, ``ratio`` (a
float) included, so each report opens a new series that is never removed, and Prometheus'
memory grows without end. Here a series is labelled only by ``sensor``, ``target``, the
metadata keys ``scope``, ``socket`` and ``device``, the target's names that
``--target-names`` adds (``target_kind``, ``target_name``, ``container_runtime``,
``container_id``, ``pod_uid``, ``vm``, ``slurm_job``, ``service``) and those the k8s
pre-processor adds (``k8s_pod_namespace``, ``k8s_pod_name``, ``k8s_container_name``,
``k8s_container_image``); ``--tags`` picks among those. A key a report lacks is no label of its
series (a target that names no workload has none of the names), so series of one metric may
differ in their labels. A
series that has had no report for ``--series-expiry-s`` is removed from the endpoint, so
containers that come and go do not pile up. ``--max-series`` bounds the rest: a report that would
open a series beyond it is refused (a dead letter) rather than dropped unseen.

When ``--tags`` leaves out a key, reports that differ only by it land in one series: their powers
add up (two sockets of one target give its total), and a report sent twice for the same time
replaces itself instead of counting twice.

**Ended workloads.** With ``--target-energy``, the energy formula's
record of each workload that has ended (a Slurm job, a pod's container…) is exposed too, on the
same endpoint (or on its own with ``--model TargetEnergyReport``):

- ``wattflow_target_energy_joules_total`` (counter): the workload's energy per ``scope`` (cpu,
  dram, gpu), labelled by ``sensor``, ``target`` (the workload's name, ``slurm/1234``) and the
  names among ``--tags`` (``target_kind``, ``slurm_job``, ``pod_uid``…); a second record of the
  same workload (one evicted, then seen again) adds to it;
- ``wattflow_target_start_timestamp_seconds`` and ``wattflow_target_end_timestamp_seconds``
  (gauges): its span, as Unix seconds.

A workload's series are kept for ``--series-expiry-s`` after its record, as a silent power
series is, long enough for every scrape to see them, then removed: one record per workload
that ends, so they stay bounded as the power series do. Within that time,
``sum by (slurm_job) (wattflow_target_energy_joules_total)`` is each ended job's energy; over
longer spans Prometheus' own storage keeps it (``last_over_time``).

Samples carry no timestamp: Prometheus stamps them at scrape time, which keeps its staleness
handling (a removed series ends at once in queries). The endpoint is ``prometheus_client``'s
HTTP server in its own thread, over a registry of this output's own (no process metrics); the
reports are folded in on the event loop under a lock the scrape takes too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Self
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from pydantic import AliasChoices, Field, PositiveInt, field_validator, model_validator

from wattflow.actors.errors import PushError
from wattflow.actors.preprocessors.k8s import FLAT_KEYS as K8S_KEYS
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.csv import TagList
from wattflow.formats.reports import PowerReport, Report, TargetEnergyReport
from wattflow.formats.targets import LABEL_KEYS

logger = logging.getLogger(__name__)

BOUNDED_LABELS = ("scope", "socket", "device", *LABEL_KEYS, *K8S_KEYS)
"""The metadata keys that may become labels: ``scope``, ``socket`` and ``device`` have a
handful of values per node; the target's names (:mod:`wattflow.actors.naming`:
``target_kind``, ``slurm_job``, ``pod_uid``…, and the k8s pre-processor's ``k8s_pod_name``…)
one value per target, so they add no series."""

POWER_METRIC = "wattflow_power_watts"
ENERGY_METRIC = "wattflow_energy_joules"
"""Exposed as ``wattflow_energy_joules_total`` (a counter's ``_total`` is added on exposure)."""

TARGET_ENERGY_METRIC = "wattflow_target_energy_joules"
"""Exposed as ``wattflow_target_energy_joules_total``: ended workloads' energy per scope."""
TARGET_START_METRIC = "wattflow_target_start_timestamp_seconds"
TARGET_END_METRIC = "wattflow_target_end_timestamp_seconds"
MODELS = (PowerReport.kind, TargetEnergyReport.kind)
"""The kinds the output writes: PowerReports (and the records, on the same endpoint), or the
records alone."""

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
SWEEP_EVERY_S = 1.0
"""Expired series are looked for at most this often while reports arrive (and at each scrape)."""


class PrometheusPusherConfig(PusherConfig):
    """Settings of the Prometheus output, PowerAPI's ``--output prometheus`` group."""

    type: Literal["prometheus"] = "prometheus"
    addr: str = Field(
        default="127.0.0.1",
        validation_alias=AliasChoices("addr", "uri"),
        description="Address the metrics endpoint listens on; 0.0.0.0 for every interface "
        "(needed in a container). PowerAPI 2.10 named it --uri.",
        json_schema_extra={"flags": ["-u", "--addr"]},
    )
    port: int = Field(
        default=8000,
        ge=0,
        le=65535,
        description="Port of the metrics endpoint (0: any free port, logged).",
        json_schema_extra={"flags": ["-p", "--port"]},
    )
    metric_name: str = Field(
        default=POWER_METRIC,
        description="Name of the power gauge.",
        json_schema_extra={"flags": ["-M", "--metric-name"]},
    )
    metric_description: str = Field(
        default="Power of the target, as the formula estimated it, in watts.",
        min_length=1,
        description="Help text of the power gauge.",
        json_schema_extra={"flags": ["-d", "--metric-description"]},
    )
    tags: TagList = Field(
        default_factory=lambda: list(BOUNDED_LABELS),
        description="Metadata keys that label a series besides sensor and target, "
        f"comma-separated; only {', '.join(BOUNDED_LABELS)}.",
        json_schema_extra={"flags": ["-t", "--tags"]},
    )
    series_expiry_s: float = Field(
        default=300.0,
        gt=0,
        description="A series with no report for this long is removed from the endpoint.",
    )
    max_series: PositiveInt = Field(
        default=100_000,
        description="Most series exposed at once; a report that would open another is refused.",
    )

    @field_validator("model")
    @classmethod
    def _power_only(cls, value: str) -> str:
        if value not in MODELS:
            raise ValueError(
                "the prometheus output writes PowerReports only (and, with --target-energy, "
                f"TargetEnergyReports), not {value}"
            )
        return value

    @field_validator("tags")
    @classmethod
    def _bounded(cls, value: list[str]) -> list[str]:
        """Only bounded keys; none given means all of them, as PowerAPI's empty ``--tags``
        means every key."""
        if not value:
            return list(BOUNDED_LABELS)
        unbounded = [tag for tag in value if tag not in BOUNDED_LABELS]
        if unbounded:
            raise ValueError(
                f"{', '.join(unbounded)}: not a label of the prometheus output, which labels "
                f"series only by sensor, target and {', '.join(BOUNDED_LABELS)}: a key such as "
                "ratio or formula takes a new value with every report or model, and each value "
                "would be a new series kept for ever"
            )
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _valid_name(self) -> Self:
        if not _METRIC_NAME.match(self.metric_name) or self.metric_name.startswith("__"):
            raise ValueError(f"--metric-name {self.metric_name!r} is not a Prometheus metric name")
        taken = (ENERGY_METRIC, TARGET_ENERGY_METRIC, TARGET_START_METRIC, TARGET_END_METRIC)
        if self.metric_name.removesuffix("_total") in taken:
            raise ValueError(f"--metric-name {self.metric_name!r} is another metric's name")
        return self

    @classmethod
    def example(cls) -> PrometheusPusherConfig:
        """Power and energy on http://127.0.0.1:8000/metrics."""
        return cls(type="prometheus")


@dataclass(slots=True)
class _Series:
    """One exposed series: its latest power, its energy, and the reports of its latest time."""

    power_w: float = 0.0
    energy_j: float = 0.0
    millis: int = -1
    interval_s: float = 0.0
    parts: dict[tuple[object, ...], float] = field(default_factory=dict)
    """Power per report of the latest time, by the metadata the labels leave out."""
    seen_at: float = 0.0
    """``time.monotonic()`` of its latest report."""


@dataclass(slots=True)
class _Ended:
    """One ended workload's exposed figures: its energy per scope and its span."""

    energy_j: dict[str, float]
    start_s: float
    end_s: float
    seen_at: float
    """``time.monotonic()`` of its latest record."""


class PowerSeries(Collector):
    """The output's series: folded from reports on the event loop, read by scrapes."""

    def __init__(self, config: PrometheusPusherConfig) -> None:
        self.config = config
        self.labels = ("sensor", "target", *config.tags)
        self._left_out = tuple(key for key in BOUNDED_LABELS if key not in config.tags)
        self._series: dict[tuple[str, ...], _Series] = {}
        self.record_labels = ("sensor", "target", *(k for k in config.tags if k in LABEL_KEYS))
        """An ended workload's labels: its names, none of the per-report keys."""
        self._ended: dict[tuple[str, ...], _Ended] = {}
        self._lock = threading.Lock()
        self._swept_at = time.monotonic()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._series) + len(self._ended)

    def add(self, reports: list[Report]) -> list[tuple[Report, str]]:
        """Fold a batch in; return the reports refused and why."""
        refused: list[tuple[Report, str]] = []
        now = time.monotonic()
        with self._lock:
            for report in reports:
                if isinstance(report, TargetEnergyReport):
                    problem = self._add_ended(report, now)
                else:
                    problem = self._add(report, now)
                if problem is not None:
                    refused.append((report, problem))
            if now - self._swept_at >= SWEEP_EVERY_S:
                self._sweep(now)
        return refused

    def _add(self, report: Report, now: float) -> str | None:
        power = getattr(report, "power", None)
        if not isinstance(power, int | float) or not math.isfinite(power):
            return f"power {power!r} is not a finite number of watts"
        metadata = report.metadata
        key = (report.sensor, report.target, *(_text(metadata.get(k)) for k in self.config.tags))
        series = self._series.get(key)
        if series is None:
            if len(self) >= self.config.max_series:
                return f"--max-series {self.config.max_series} series are exposed already"
            series = self._series[key] = _Series()
        series.seen_at = now
        millis = int(report.timestamp.timestamp() * 1000)
        part = tuple(metadata.get(k) for k in self._left_out)
        if millis == series.millis:  # another part of the same time, or the same one again
            before = series.parts.get(part, 0.0)
            series.parts[part] = power
            series.power_w += power - before
            series.energy_j += (power - before) * series.interval_s
        elif millis > series.millis:
            interval_s = (millis - series.millis) / 1000 if series.millis >= 0 else 0.0
            if interval_s > self.config.series_expiry_s:
                interval_s = 0.0
            series.millis, series.interval_s, series.parts = millis, interval_s, {part: power}
            series.power_w = power
            series.energy_j += power * interval_s
        return None

    def _add_ended(self, report: TargetEnergyReport, now: float) -> str | None:
        """Fold a workload's record in: its energy adds to what earlier records of the same
        workload brought (a counter never goes down), its span widens to theirs."""
        metadata = report.metadata
        key = (
            report.sensor,
            report.target,
            *(_text(metadata.get(k)) for k in self.record_labels[2:]),
        )
        start, end = report.start.timestamp(), report.end.timestamp()
        ended = self._ended.get(key)
        if ended is None:
            if len(self) >= self.config.max_series:
                return f"--max-series {self.config.max_series} series are exposed already"
            ended = self._ended[key] = _Ended({}, start, end, now)
        for scope, joules in report.energy.items():
            ended.energy_j[scope] = ended.energy_j.get(scope, 0.0) + joules
        ended.start_s, ended.end_s = min(ended.start_s, start), max(ended.end_s, end)
        ended.seen_at = now
        return None

    def _sweep(self, now: float) -> None:
        """Remove the series, and the ended workloads, that have had no report for
        ``series_expiry_s``."""
        self._swept_at = now
        oldest = now - self.config.series_expiry_s
        expired = [key for key, series in self._series.items() if series.seen_at < oldest]
        for key in expired:
            del self._series[key]
        ended = [key for key, workload in self._ended.items() if workload.seen_at < oldest]
        for key in ended:
            del self._ended[key]
        expired += ended
        if expired:
            self.expired += len(expired)
            logger.debug("output '%s': %d series expired", self.config.name, len(expired))

    def collect(self) -> Iterator[Metric]:
        """The gauge and the counter, as a scrape reads them (called in the server's thread);
        each series with its non-empty labels only (:func:`_present`)."""
        power = GaugeMetricFamily(self.config.metric_name, self.config.metric_description)
        energy = CounterMetricFamily(
            ENERGY_METRIC,
            "Energy of the target since this output first saw it, in joules: each report's "
            "power times the time since the previous one.",
        )
        labels, power_name, energy_name = self.labels, power.name, f"{energy.name}_total"
        with self._lock:
            self._sweep(time.monotonic())
            for key, series in self._series.items():
                present = _present(labels, key)
                power.samples.append(Sample(power_name, present, series.power_w))
                energy.samples.append(Sample(energy_name, present, series.energy_j))
            ended = self._ended_families() if self._ended else []
        if self.config.model == PowerReport.kind:
            yield power
            yield energy
        yield from ended

    def _ended_families(self) -> list[Metric]:
        """The ended workloads' energy counter and span gauges (under the lock)."""
        labels = self.record_labels
        energy = CounterMetricFamily(
            TARGET_ENERGY_METRIC,
            "Energy of a workload that has ended (a Slurm job, a pod's container, a VM…), per "
            "scope, in joules, from the energy formula's record.",
        )
        start = GaugeMetricFamily(
            TARGET_START_METRIC, "Start of an ended workload, in Unix seconds."
        )
        end = GaugeMetricFamily(TARGET_END_METRIC, "End of an ended workload, in Unix seconds.")
        for key, workload in self._ended.items():
            present = _present(labels, key)
            for scope, joules in workload.energy_j.items():
                energy.samples.append(
                    Sample(f"{energy.name}_total", {**present, "scope": scope}, joules)
                )
            start.samples.append(Sample(start.name, present, workload.start_s))
            end.samples.append(Sample(end.name, present, workload.end_s))
        return [energy, start, end]


def _text(value: object) -> str:
    """A label value: absent is empty, and an empty label is not served (:func:`_present`)."""
    return "" if value is None else str(value)


def _present(names: tuple[str, ...], values: tuple[str, ...]) -> dict[str, str]:
    """A series' labels as served: those with a value only.

    Prometheus reads an empty label as no label, so serving it changes no query; leaving it out
    makes a line of a target that names no workload a third of the size (17 labels, most of
    them empty, are 330 bytes). A metric family's series then differ in their label names,
    which the text format and Prometheus take (OpenMetrics only advises against it), and
    which ``prometheus_client``'s ``add_metric`` cannot say: the samples are built here.
    """
    return {name: value for name, value in zip(names, values, strict=True) if value}


@pushers.register("prometheus")
class PrometheusPusher(Pusher[PrometheusPusherConfig]):
    """Serves the series on ``http://ADDR:PORT/metrics`` from the moment it opens."""

    config_model = PrometheusPusherConfig

    def __init__(self, config: PrometheusPusherConfig) -> None:
        super().__init__(config)
        self.series = PowerSeries(config)
        self.where = f"output '{config.name}' (prometheus {config.addr}:{config.port})"
        """How errors name the output: with the port listened on once open (``--port 0``)."""
        self.port: int | None = None
        """The port listened on, once open (``--port 0`` picks one)."""
        self._server: WSGIServer | None = None

    async def probe(self) -> str:
        """Listen, as the service will: a port in use or an address not of this machine fails."""
        await self.open()
        return f"listening on {self.config.addr}:{self.port}"

    async def check(self) -> None:
        """Start listening now, so a port in use stops the service before it starts."""
        await self.open()

    async def open(self) -> None:
        if self._server is not None:
            return
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.series)
        try:
            server, thread = start_http_server(
                self.config.port, self.config.addr, registry=registry
            )
        except OSError as error:
            raise PushError(f"{self.where}: cannot listen: {error.strerror or error}") from None
        self._server = server
        del thread  # a daemon: it ends with shutdown()
        self.port = server.server_address[1]
        self.where = f"output '{self.config.name}' (prometheus {self.config.addr}:{self.port})"
        logger.info(
            "output '%s': metrics on http://%s:%d/metrics",
            self.config.name,
            self.config.addr,
            self.port,
        )

    def accepts(self, kind: str) -> bool:
        """PowerReports and the ended workloads' records on one endpoint (a user scrapes one
        target per node), or with ``--model TargetEnergyReport`` the records alone."""
        if self.config.model == PowerReport.kind:
            return kind in MODELS
        return kind == self.config.model

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        refused = self.series.add(batch)
        return [(report, f"{self.where}: {reason}") for report, reason in refused]

    async def close(self) -> None:
        """Stop serving: the series go with the process, as a scrape target's do."""
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(_shut_down, server)


def _shut_down(server: WSGIServer) -> None:
    server.shutdown()
    server.server_close()
