"""Measurement runs, and what every exporter computes from one: energy per target, phase and domain.

A run is one measured execution of a benchmark: its experiment, benchmark, settings (clock or
power limits, as text), repetition, free parameters (numbers, for Extra-P's models), system
info, time window and event markers. Its reports are the ones whose timestamps fall in the
window; the store hands them out in time order, one at a time, so an exporter's memory does not
grow with the run's length.

:func:`summarise` folds a run's PowerReports into energy per (target, phase, domain): a report's
power holds from the previous report of the same series (target, scope, socket or device) to
its own timestamp. Phases come from the run's events: ``train_begin``/``train_end`` open and
close phase ``train``, ``epoch_begin``/``epoch_end`` phase ``epoch``, and so on; a report
belongs to the innermost phase open at its timestamp, or to no phase (``""``). A phase's time
is counted the same way, so its mean power is its own energy over its own time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from wattflow.formats.reports import EventReport, GPUReport, PowerReport, Report

DOMAINS = ("cpu", "dram", "gpu", "node")
"""Energy domains exporters report, from PowerReports' ``scope``."""


class Run(BaseModel):
    """One measured execution: what it was, when, and under which settings."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Unique in its store.")
    experiment: str
    benchmark: str
    settings: str = Field(description="E.g. '877MHz,1065MHz', '250W' or 'p=4'.")
    repetition: int = Field(ge=0)
    parameters: dict[str, float] = Field(
        default_factory=dict, description="Free parameters (name → number), for Extra-P."
    )
    system: dict[str, Any] = Field(default_factory=dict, description="System info.")
    start: datetime
    end: datetime
    events: list[EventReport] = Field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Length of the window in seconds."""
        return (self.end - self.start).total_seconds()


def number_text(value: float) -> str:
    """A parameter's value as a name holds it: ``4`` for 4.0, ``0.5``, ``1e-06``; exact, so
    that two values never share a name."""
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def parameter_settings(parameters: Mapping[str, float]) -> str:
    """Settings named after a run's parameters: ``p=4``, or ``batch=32,p=4`` for several.

    The spec names a benchmark-run directory by its settings, several joined with commas
    (``877MHz,1065MHz``); the parameters come sorted by name, so the same parameters always
    name the same run, whatever order they were given in.
    """
    return ",".join(f"{name}={number_text(value)}" for name, value in sorted(parameters.items()))


GPU_SYSTEM_KEYS = ("device_name", "cuda_capability", "driver_version", "cuda_version",
                   "nvml_version")  # fmt: skip
"""The GPU measurement directory's system-info keys that describe the GPU and its driver."""


class RecordedSystem:
    """What a recording itself says about the machine it was made on, gathered report by report.

    The node's name is the reports' sensor name, when they all have one (or else when the GPU
    reports all have one); the GPU's model and driver come from GPU reports whose metadata carry
    them under the GPU measurement directory's keys (``device_name``, ``driver_version``, …).
    Everything else about the machine is unknown: the machine that imports a recording is not
    the one it was made on.
    """

    def __init__(self) -> None:
        self.sensors: set[str] = set()
        self.gpu_sensors: set[str] = set()
        self.gpu: dict[str, Any] = {}

    def add(self, report: Report) -> None:
        self.sensors.add(report.sensor)
        if isinstance(report, GPUReport):
            self.gpu_sensors.add(report.sensor)
            if report.metadata and len(self.gpu) < len(GPU_SYSTEM_KEYS):
                for key in GPU_SYSTEM_KEYS:
                    value = report.metadata.get(key)
                    if value is not None and key not in self.gpu:
                        self.gpu[key] = value

    def info(self) -> dict[str, Any]:
        """The keys the recording gave a value for."""
        found: dict[str, Any] = dict(self.gpu)
        for sensors in (self.sensors, self.gpu_sensors):
            if len(sensors) == 1:
                found["node"] = next(iter(sensors))
                break
        return found


def merge_system(stored: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """System info ``given`` over ``stored``: a value given replaces the stored one, a ``None``
    given does not."""
    return {**stored, **{key: value for key, value in given.items() if value is not None}}


ReportStream = Callable[[Run], Iterator[Report]]
"""A run's reports inside its window, in time order, streamed from the store."""

TimedReportStream = Callable[[Run], Iterator[tuple[Report, float | None]]]
"""The same, each with the Unix time in seconds at which the service finished processing it:
when the run's recorder took it from the pipeline. ``None`` where the store does not know, as
for imported files, whose processing happened elsewhere.
"""


def phases_of(events: Iterable[EventReport]) -> list[tuple[datetime, datetime, str]]:
    """(start, end, name) of each phase the events mark, innermost last when they nest."""
    open_phases: dict[str, list[datetime]] = {}
    found: list[tuple[datetime, datetime, str]] = []
    for event in sorted(events, key=lambda e: e.timestamp):
        name, _, edge = event.event.rpartition("_")
        if name == "experiment":
            continue
        if edge == "begin":
            open_phases.setdefault(name, []).append(event.timestamp)
        elif edge == "end" and open_phases.get(name):
            found.append((open_phases[name].pop(), event.timestamp, name))
    found.sort(key=lambda phase: (phase[0], -(phase[1] - phase[0]).total_seconds()))
    return found


def phase_at(phases: list[tuple[datetime, datetime, str]], moment: datetime) -> str:
    """The innermost phase open at ``moment`` (the latest-starting one), or ``""``."""
    current = ""
    for start, end, name in phases:
        if start > moment:
            break
        if start <= moment <= end:
            current = name
    return current


@dataclass
class RunSummary:
    """What a run's reports add up to."""

    run: Run
    energy_j: dict[tuple[str, str, str], float] = field(default_factory=dict)
    """(target, phase, domain) → energy in J; phase "" is outside every phase."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Phase → seconds spent in it and in no phase nested in it."""
    covered_s: float = 0.0
    """Time inside at least one phase (nested phases counted once)."""
    reports: int = 0

    def targets(self) -> list[str]:
        """Targets with energy, sorted."""
        return sorted({target for target, _, _ in self.energy_j})

    def phases(self) -> list[str]:
        """Phases with energy, sorted ("" first when some energy is outside every phase)."""
        return sorted({phase for _, phase, _ in self.energy_j})

    def energy(self, target: str, domain: str | None = None, phase: str | None = None) -> float:
        """Energy in J of a target, in one domain or in all, in one phase or the whole run.

        With no domain: the target's ``node`` energy where it has some, since the node
        formula's figure for a target already adds up its cpu, dram and gpu power (and for the
        ``node`` target it is the meter); otherwise the sum of its domains. Adding ``node`` to
        the others would count them twice.
        """
        if domain is None and any(name == target and d == "node" for name, _, d in self.energy_j):
            domain = "node"
        return sum(
            joules
            for (name, p, d), joules in self.energy_j.items()
            if name == target and (domain is None or d == domain) and (phase is None or p == phase)
        )

    def duration_s(self, phase: str | None = None) -> float:
        """The run's length, or the time spent in ``phase`` and no phase nested in it (outside
        every phase for "")."""
        if phase is None:
            return self.run.duration_s
        if phase == "":
            return max(self.run.duration_s - self.covered_s, 0.0)
        return self.phase_seconds.get(phase, 0.0)

    def mean_power_w(
        self, target: str, domain: str | None = None, phase: str | None = None
    ) -> float:
        """Energy over duration: the target's mean power in the run or the phase."""
        seconds = self.duration_s(phase)
        return self.energy(target, domain, phase) / seconds if seconds > 0 else 0.0


def summarise(
    run: Run, reports: Iterable[Report], on_report: Callable[[], None] | None = None
) -> RunSummary:
    """Fold a run's reports (time order) into energy per target, phase and domain."""
    summary = RunSummary(run)
    phases = phases_of(run.events)
    # A phase's time, like its energy, is what its nested phases leave it: each stretch between
    # two phase edges belongs to the innermost phase open over it.
    edges = sorted({moment for start, end, _ in phases for moment in (start, end)})
    for earlier, later in pairwise(edges):
        name = phase_at(phases, earlier + (later - earlier) / 2)
        if name:
            summary.phase_seconds[name] = (
                summary.phase_seconds.get(name, 0.0) + (later - earlier).total_seconds()
            )
    reach: datetime | None = None
    for start, end, _ in phases:  # sorted by start: the union's length
        if reach is None or start > reach:
            summary.covered_s += (end - start).total_seconds()
            reach = end
        elif end > reach:
            summary.covered_s += (end - reach).total_seconds()
            reach = end
    previous: dict[tuple[str, str, str, str], datetime] = {}
    for report in reports:
        summary.reports += 1
        if on_report is not None:
            on_report()
        if not isinstance(report, PowerReport):
            continue
        domain = str(report.metadata.get("scope", ""))
        if domain not in DOMAINS or report.target in ("rapl", "global"):
            continue
        series = (
            report.target,
            domain,
            str(report.metadata.get("socket", "")),
            str(report.metadata.get("device", "")),
        )
        last = previous.get(series)
        previous[series] = report.timestamp
        if last is None:
            continue
        seconds = (report.timestamp - last).total_seconds()
        if seconds <= 0:
            continue
        key = (report.target, phase_at(phases, report.timestamp), domain)
        summary.energy_j[key] = summary.energy_j.get(key, 0.0) + report.power * seconds
    return summary
