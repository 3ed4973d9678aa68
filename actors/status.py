"""What a running pipeline says about itself: health, readiness and its Prometheus metrics.

:class:`PipelineStatus` reads the runtime's own bookkeeping (the :class:`Ledger`, the
:class:`DeadLetters`, the mailboxes, the supervisor, each output's retries) and turns it into
the answers of ``/health``, ``/ready`` and ``/metrics`` (``wattflow run --http-port``). It runs
on the event loop, like the actors it reads, so what it reports is one consistent moment; the
HTTP server (:mod:`wattflow.service.status_server`) asks it from its own thread.

Every label is bounded: actors and outputs are fixed when the pipeline is built, sensors are the
nodes, scopes and sockets a handful each. Reasons and targets, which are not bounded, are never
labels.

Two things are watched only while the status is on, by an observer of each formula's output
(:attr:`FormulaActor.observers <wattflow.actors.formulas.base.FormulaActor.observers>`, told of
each batch the formula made before it is named and handed on): SmartWatts' FormulaReports (the
model error per sensor, scope and socket) and the newest timestamp each formula emitted (the
tick lag). A pipeline without ``--http-port`` pays for neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from wattflow.actors.formulas.base import FormulaActor
from wattflow.actors.pipeline import Pipeline
from wattflow.formats.batch import formula_metadata, newest_ms
from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report

METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "wattflow_healthy": ("gauge", (), "1 while every actor runs, else 0 (see /health)."),
    "wattflow_ready": ("gauge", (), "1 once inputs are connected and outputs reachable."),
    "wattflow_actor_running": ("gauge", ("actor",), "1 while the actor's loop runs."),
    "wattflow_actor_restarts_total": (
        "counter",
        ("actor",),
        "Times the actor's loop failed and was restarted.",
    ),
    "wattflow_actor_reports_in_total": (
        "counter",
        ("actor",),
        "Reports the actor took in: read by an input (dead letters and skipped included), "
        "queued for "
        "the router, a formula or an output.",
    ),
    "wattflow_actor_reports_out_total": (
        "counter",
        ("actor",),
        "Reports the actor handed on: to the router (input), to formulas (router), emitted "
        "(formula), written (output).",
    ),
    "wattflow_actor_reports_dead_total": (
        "counter",
        ("actor",),
        "Reports the actor could not process or write: dead letters.",
    ),
    "wattflow_actor_reports_unused_total": (
        "counter",
        ("actor",),
        "Reports that no enabled formula and no output takes (counted, not dead letters).",
    ),
    "wattflow_actor_reports_skipped_total": (
        "counter",
        ("actor",),
        "Reports an input read and let go because another instance takes their sensor "
        "(--partition; counted, not dead letters).",
    ),
    "wattflow_actor_reports_dropped_total": (
        "counter",
        ("actor",),
        "Reports an input's pre-processor let go by design (--pre-processor k8s with the "
        "PowerAPI 2.10 layout: a pod's container the API does not name, such as a pause "
        "container; counted, not dead letters).",
    ),
    "wattflow_pre_processor": (
        "gauge",
        ("pre_processor", "figure"),
        "A pre-processor's own figures: for k8s, containers (cached), containers_evicted_total, "
        "lists_total, watches_total, watch_failures_total, and reports_named_total, "
        "reports_unknown_container_total (PowerAPI 2.10 layout) or targets_named, "
        "targets_unknown_container (wattflow's).",
    ),
    "wattflow_reports_unrequested_total": (
        "counter",
        (),
        "Reports formulas emitted that no output takes (FormulaReports without an output).",
    ),
    "wattflow_mailbox_reports": ("gauge", ("actor",), "Reports waiting in the actor's mailbox."),
    "wattflow_mailbox_capacity_reports": (
        "gauge",
        ("actor",),
        "Reports the mailbox holds before its producers wait (--queue-max-reports).",
    ),
    "wattflow_mailbox_high_water_reports": (
        "gauge",
        ("actor",),
        "Most reports the mailbox has held at once.",
    ),
    "wattflow_tick_lag_seconds": (
        "gauge",
        ("actor",),
        "Wall-clock time now minus the newest timestamp the formula emitted: how far behind "
        "the sensors its output is (live inputs; a replay shows the recording's age).",
    ),
    "wattflow_model_error_watts": (
        "gauge",
        ("sensor", "scope", "socket"),
        "SmartWatts' model error in its newest FormulaReport, per sensor, scope and socket.",
    ),
    "wattflow_output_retries_total": (
        "counter",
        ("output",),
        "Writes tried again after an error a retry may mend.",
    ),
    "wattflow_output_outages_total": (
        "counter",
        ("output",),
        "Times the output's sink became unreachable: a failed write while it counted as "
        "reachable (from the start, or since a write worked), as wattflow_output_unreachable "
        "goes from 0 to 1.",
    ),
    "wattflow_output_unreachable": (
        "gauge",
        ("output",),
        "1 from a failed write to the output's sink until a write works again.",
    ),
}
"""Every pipeline metric: name → (type, labels, help). docs/operations.md lists them too; the
Grafana dashboards use these names, so they do not change."""


@dataclass(frozen=True)
class Snapshot:
    """One moment of the pipeline: what is wrong with it, and its metrics."""

    unhealthy: list[str]
    """Why ``/health`` fails; empty when healthy."""
    not_ready: list[str]
    """Why ``/ready`` fails; empty when ready."""
    metrics: list[Metric] = field(default_factory=list)


class _Families:
    """The metric families of one snapshot, built by name from :data:`METRICS`."""

    def __init__(self) -> None:
        self.by_name: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name, (kind, labels, text) in METRICS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            self.by_name[name] = family(name, text, labels=labels)

    def add(self, name: str, labels: Iterable[str], value: float) -> None:
        self.by_name[name].add_metric(list(labels), value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self.by_name.values())


@dataclass
class _FormulaWatch:
    """What one formula emitted, as the status sees it."""

    newest_ms: int | None = None


class PipelineStatus:
    """Health, readiness and metrics of one pipeline; built before it runs, read on its loop."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.model_error_w: dict[tuple[str, str, str], float] = {}
        self._watches: dict[str, _FormulaWatch] = {}
        for actor in pipeline.formulas:
            self._watch(actor)

    # --- watching the formulas' output -------------------------------------------------------

    def _watch(self, actor: FormulaActor) -> None:
        """Observe the formula's output as it made it, to see its newest timestamp and its
        FormulaReports (the actor never shows its observers a barrier or an empty batch)."""
        watch = self._watches[actor.name] = _FormulaWatch()
        actor.observers.append(partial(self._seen, watch))

    def _seen(self, watch: _FormulaWatch, produced: list[Report | Frame]) -> None:
        newest = newest_ms(produced)
        if newest is not None and (watch.newest_ms is None or newest > watch.newest_ms):
            watch.newest_ms = newest
        for sensor, metadata in formula_metadata(produced):
            self._model_error(sensor, metadata)

    def _model_error(self, sensor: str, metadata: Mapping[str, Any]) -> None:
        error = metadata.get("error")
        if isinstance(error, int | float) and math.isfinite(error):
            key = (sensor, str(metadata.get("scope", "")), str(metadata.get("socket", "")))
            self.model_error_w[key] = float(error)

    # --- health and readiness ---------------------------------------------------------------

    def actor_names(self) -> list[str]:
        """Every actor of the pipeline, inputs first, outputs last."""
        pipeline = self.pipeline
        return [
            *(actor.name for actor in pipeline.pullers),
            pipeline.router.name,
            *(actor.name for actor in pipeline.formulas),
            *(actor.name for actor in pipeline.pushers),
        ]

    def unhealthy(self) -> list[str]:
        """Why the service is not healthy: an actor failed, is restarting, or has stopped."""
        supervisor = self.pipeline.supervisor
        reasons = list(supervisor.failures.values())
        reasons += [
            f"{name} is restarting after {why}" for name, why in supervisor.restarting.items()
        ]
        started = supervisor.started()
        finished = supervisor.finished() - set(supervisor.failures)
        if self.pipeline.stopping.is_set():
            reasons.append("draining: the service is stopping")
        for name in self.actor_names():
            if name not in started:
                reasons.append(f"{name} has not started yet")
            elif name in finished:
                reasons.append(f"{name} has stopped")
        return reasons

    def not_ready(self) -> list[str]:
        """Why the service cannot do its work yet: unhealthy, an input not connected, or an
        output not open or unreachable."""
        reasons = self.unhealthy()
        for puller in self.pipeline.pullers:
            why = puller.puller.not_ready()
            if why is not None:
                reasons.append(f"input '{puller.puller.config.name}': {why}")
        for pusher in self.pipeline.pushers:
            why = pusher.not_ready()
            if why is not None:
                reasons.append(f"output '{pusher.pusher.config.name}': {why}")
        return reasons

    # --- metrics ----------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """Everything at once, taken on the event loop so that the numbers agree."""
        unhealthy = self.unhealthy()
        not_ready = self.not_ready()
        families = _Families()
        families.add("wattflow_healthy", (), 0.0 if unhealthy else 1.0)
        families.add("wattflow_ready", (), 0.0 if not_ready else 1.0)
        self._actors(families)
        self._flow(families)
        self._mailboxes(families)
        self._formulas(families)
        self._outputs(families)
        return Snapshot(unhealthy, not_ready, list(families))

    def _actors(self, families: _Families) -> None:
        supervisor = self.pipeline.supervisor
        started, finished = supervisor.started(), supervisor.finished()
        for name in self.actor_names():
            running = name in started and name not in finished and name not in supervisor.restarting
            families.add("wattflow_actor_running", [name], 1.0 if running else 0.0)
            families.add("wattflow_actor_restarts_total", [name], supervisor.restarts[name])

    def _flow(self, families: _Families) -> None:
        """Reports in, out, dead and unused, per actor."""
        pipeline = self.pipeline
        dead = pipeline.dead_letters.by_actor
        flows: list[tuple[str, int, int]] = []
        for puller in pipeline.pullers:
            emitted = puller.emitter.emitted
            emitter = puller.emitter
            taken = emitted + dead[puller.name] + emitter.skipped + emitter.dropped
            flows.append((puller.name, taken, emitted))
        router = pipeline.router
        flows.append((router.name, router.mailbox.received, router.delivered))
        flows += [(f.name, f.mailbox.received, f.produced) for f in pipeline.formulas]
        delivered = pipeline.ledger.delivered_by_pusher
        flows += [
            (p.name, p.mailbox.received, delivered[p.pusher.config.name]) for p in pipeline.pushers
        ]
        for name, taken, handed in flows:
            families.add("wattflow_actor_reports_in_total", [name], taken)
            families.add("wattflow_actor_reports_out_total", [name], handed)
            families.add("wattflow_actor_reports_dead_total", [name], dead[name])
        for puller in pipeline.pullers:
            skipped = puller.emitter.skipped
            families.add("wattflow_actor_reports_skipped_total", [puller.name], skipped)
            dropped = puller.emitter.dropped
            families.add("wattflow_actor_reports_dropped_total", [puller.name], dropped)
        for pre_processor in pipeline.pre_processors.values():
            for figure, value in sorted(pre_processor.metrics().items()):
                families.add("wattflow_pre_processor", [pre_processor.config.name, figure], value)
        unused = sum(pipeline.ledger.unused.values())
        families.add("wattflow_actor_reports_unused_total", [router.name], unused)
        families.add("wattflow_reports_unrequested_total", (), pipeline.ledger.unrequested)

    def _mailboxes(self, families: _Families) -> None:
        pipeline = self.pipeline
        actors: list[Any] = [pipeline.router, *pipeline.formulas, *pipeline.pushers]
        for actor in actors:
            mailbox = actor.mailbox
            families.add("wattflow_mailbox_reports", [actor.name], len(mailbox))
            families.add("wattflow_mailbox_capacity_reports", [actor.name], mailbox.capacity)
            families.add("wattflow_mailbox_high_water_reports", [actor.name], mailbox.high_water)

    def _formulas(self, families: _Families) -> None:
        now_ms = time.time() * 1000
        for name, watch in self._watches.items():
            if watch.newest_ms is not None:
                families.add("wattflow_tick_lag_seconds", [name], (now_ms - watch.newest_ms) / 1000)
        for key, error_w in sorted(self.model_error_w.items()):
            families.add("wattflow_model_error_watts", key, error_w)

    def _outputs(self, families: _Families) -> None:
        for actor in self.pipeline.pushers:
            name = actor.pusher.config.name
            families.add("wattflow_output_retries_total", [name], actor.retries)
            families.add("wattflow_output_outages_total", [name], actor.outages)
            unreachable = 1.0 if actor.unreachable is not None else 0.0
            families.add("wattflow_output_unreachable", [name], unreachable)
