"""The ``energy`` formula: each workload's energy, reported once when it ends.

It reads what the other formulas make (SmartWatts' cpu and dram reports, the GPU formula's gpu
reports), named by the naming step (:mod:`wattflow.actors.naming`), and sums each workload's
energy per scope: a Slurm job's every step, task and GPU process together, a pod's container
with its GPU processes. When the workload has ended it emits one
:class:`~wattflow.formats.reports.TargetEnergyReport`: its energy per scope (cpu, dram, gpu),
its start and its end.

**Energy.** A report's power holds over its tick, the interval since the sensor's previous
tick of that scope (SmartWatts' and the GPU formula's power is a tick's energy over the tick's
length), so its energy is power × that interval. The first tick of each scope only starts the
clock: its interval is not known (as for the Prometheus output's energy counter); nor is a gap
longer than ``--target-end-silence-s`` integrated over. Every
target is counted, ``rapl`` and ``global`` excepted (the measured and the modelled total of a
socket, not targets): the GPUs' own targets (``gpu0``, idle and unattributed power), the
system's cgroups, the containers. So on a node the records' sum is the CPU, DRAM and GPU
energy the formulas measured, and with the node formula's ``rest`` it is the meter's.

**Ended.** A workload has ended when, in its sensor's own time (the reports' timestamps, so a
replay ends workloads as the live run did; the slowest scope's, so that the CPU reports
SmartWatts hands on after the GPU's still count), it has had no report for
``--target-end-silence-s`` (at the stream's start, the time waits for the scopes the inputs
give, cpu and dram with hwpc-sensor's reports and gpu with GPU samples, for as long as the
silence in real time: SmartWatts reports nothing while it learns its first models, and a job
whose GPU reports came first would otherwise end by them and start again); or, with
``--target-cgroup-root``, once none of its cgroups exists there any more (checked, for the
workloads absent from the newest tick, once per tick). When the
whole stream pauses for ``--target-end-silence-s`` of real time, every workload it held has
ended. At a stop, the workloads still running are reported with their energy so far
(``reason: running``), and the state is checkpointed like every formula's, so a restart loses
nothing. At most ``--target-max`` workloads per sensor are held: beyond, the one silent longest
is reported (``evicted``) to make room.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import msgspec
from pydantic import Field, PositiveInt, PrivateAttr

from wattflow.actors.checkpoints import FormulaState, Saved, decode_state, encode_state
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.window import StreamTime
from wattflow.formats.batch import Batch, expand
from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import (
    GPUReport,
    HWPCReport,
    PowerReport,
    Report,
    TargetEnergyReport,
    to_millis,
)

logger = logging.getLogger(__name__)

FORMULA_NAME = "energy"
SCOPES = ("cpu", "dram", "gpu")
NOT_A_TARGET = frozenset({"rapl", "global"})
"""SmartWatts' per-socket totals (measured and modelled): counting them would count twice."""
MAX_CGROUPS = 64
"""cgroups kept per workload for the check that they are gone (a job's steps and tasks)."""
RECENT_TICKS = 64
"""Ticks of each scope whose interval is kept, for reports that come after a newer tick."""


class EnergyConfig(FormulaConfig):
    """Settings of the energy formula (each workload's energy when it ends)."""

    target_energy: bool = Field(
        default=False,
        description="Report each workload's energy (a Slurm job, a pod's container, a VM, a "
        "container, a service; cpu, dram and gpu) once it has ended, as a TargetEnergyReport: "
        "give an output --model TargetEnergyReport.",
    )
    target_end_silence_s: float = Field(
        default=60.0,
        gt=0,
        description="A workload with no report for this long (in its sensor's time) has ended.",
    )
    target_cgroup_root: Path | None = Field(
        default=None,
        description="Where the targets' cgroups are (/sys/fs/cgroup, or its perf_event "
        "hierarchy on cgroup v1): a workload none of whose cgroups is there any more has "
        "ended at the next tick. Unset: only silence ends a workload.",
    )
    target_max: PositiveInt = Field(
        default=100_000,
        description="Most workloads held per sensor; beyond, the one silent longest is "
        "reported (reason evicted) to make room.",
    )
    _scopes_expected: frozenset[str] = PrivateAttr(default=frozenset())
    """The scopes the pipeline's inputs will give (:meth:`EnergyFormula.configured`)."""


Scalar = str | int | float | bool | None
LabelValue = Scalar | dict[str, Scalar]
"""A workload's name as the naming step or a Kubernetes lookup gives it: a value, or PowerAPI
2.10's nested ``k8s`` table of values."""


class _Workload(msgspec.Struct):
    """What is known of one workload: its names, its span, its energy and its cgroups; saved
    as it is in the formula's state."""

    labels: dict[str, LabelValue]
    start_ms: int
    end_ms: int
    energy: dict[str, float] = msgspec.field(default_factory=lambda: dict.fromkeys(SCOPES, 0.0))
    cgroups: list[str] = msgspec.field(default_factory=list)


class EnergyState(FormulaState, frozen=True, tag=1):
    """What the energy formula keeps across a restart: its workloads and its scopes' ticks."""

    formula = "energy formula"
    also_reads = frozenset({None})  # before states were versioned: the same fields

    workloads: dict[str, _Workload]
    clocks: dict[str, tuple[int | None, list[tuple[int, int]]]]
    """Each scope's newest tick and the intervals of its recent ticks (tick, length in ms)."""
    newest_ms: int | None


@dataclass
class _Clock:
    """One scope's ticks: the newest and the interval that ends at each recent one."""

    newest_ms: int | None = None
    intervals: dict[int, int] = field(default_factory=dict)

    def interval_ms(self, millis: int) -> int:
        """The length of the tick that ends at ``millis`` (0 for the first tick: unknown)."""
        known = self.intervals.get(millis)
        if known is not None:
            return known
        if self.newest_ms is None or millis < self.newest_ms:
            interval = 0  # the first tick, or one older than every tick kept
        else:
            interval = millis - self.newest_ms
            self.newest_ms = millis
        if self.newest_ms is None:
            self.newest_ms = millis
        self.intervals[millis] = interval
        while len(self.intervals) > RECENT_TICKS:
            del self.intervals[next(iter(self.intervals))]
        return interval


def workload_name(report: Report) -> str:
    """The workload a report counts towards: the naming step's ``target_name``, else the
    target itself (a target that names no workload is its own)."""
    name = report.metadata.get("target_name")
    return name if isinstance(name, str) and name else report.target


@formulas.register(FORMULA_NAME)
class EnergyFormula(Formula[EnergyConfig]):
    """One instance per sensor, holding the energy of each of its workloads."""

    name: ClassVar[str] = FORMULA_NAME
    inputs: ClassVar[frozenset[str]] = frozenset({PowerReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = EnergyConfig
    needs: ClassVar[frozenset[str] | None] = frozenset(
        {HWPCReport.kind, GPUReport.kind, PowerReport.kind}
    )
    replayable: ClassVar[bool] = False

    def __init__(self, config: EnergyConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.workloads: dict[str, _Workload] = {}
        self.clocks: dict[str, _Clock] = {}
        self.newest_ms: int | None = None
        self.checked_ms: int | None = None
        self.last_input = time.monotonic()
        self.stream = StreamTime(
            config.target_end_silence_s, config._scopes_expected, started=self.last_input
        )
        """How far the stream has come in its own time: its slowest scope's newest tick."""
        self.evicted: list[tuple[str, _Workload]] = []
        """Workloads let go to make room, reported at the next end check."""

    @classmethod
    def enabled(cls, config: FormulaConfig) -> bool:
        return isinstance(config, EnergyConfig) and config.target_energy

    @classmethod
    def takes_formula_output(cls, config: FormulaConfig) -> bool:
        return cls.enabled(config)

    @classmethod
    def configured(cls, config: FormulaConfig, given: frozenset[str]) -> FormulaConfig:
        """The scopes to wait for at the stream's start: cpu and dram where an input gives
        hwpc-sensor's reports (SmartWatts), gpu where one gives GPU samples."""
        assert isinstance(config, EnergyConfig)
        expected = config.model_copy()
        scopes = {"cpu", "dram"} if HWPCReport.kind in given else set()
        if GPUReport.kind in given:
            scopes.add("gpu")
        expected._scopes_expected = frozenset(scopes)
        return expected

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if not isinstance(report, PowerReport) or report.target in NOT_A_TARGET:
            return None
        return report.sensor if report.metadata.get("scope") in SCOPES else None

    def process(self, reports: Batch, out: Output) -> None:
        self.last_input = time.monotonic()
        for report in expand(reports):  # its readers' hand-off gives reports
            mark = out.mark()
            try:
                self._add(report)
            except Exception as error:  # a report it cannot count: dead-lettered, said why
                out.fail([report], error, unit="report", since=mark)
        self._end_silent(out)
        self._end_gone(out)

    def _add(self, report: Report) -> None:
        assert isinstance(report, PowerReport)
        scope = str(report.metadata["scope"])
        millis = to_millis(report.timestamp)
        clock = self.clocks.setdefault(scope, _Clock())
        self.stream.observe(scope, millis, self.last_input)
        interval = clock.interval_ms(millis)
        if interval > self.config.target_end_silence_s * 1000:
            interval = 0  # a gap in the stream is not integrated over (the tick only restarts)
        name = workload_name(report)
        workload = self.workloads.get(name)
        if workload is None:
            self._make_room()
            labels = {k: v for k, v in report.metadata.items() if k.startswith(_LABEL_PREFIXES)}
            workload = self.workloads[name] = _Workload(labels, millis - interval, millis)
        workload.energy[scope] += report.power * interval / 1000
        workload.start_ms = min(workload.start_ms, millis - interval)
        workload.end_ms = max(workload.end_ms, millis)
        if report.target not in workload.cgroups and len(workload.cgroups) < MAX_CGROUPS:
            workload.cgroups.append(report.target)
        if self.newest_ms is None or millis > self.newest_ms:
            self.newest_ms = millis

    def _make_room(self) -> None:
        """Keep at most ``target_max`` workloads: the one silent longest goes first, to the
        output (nothing is lost), at the next end check."""
        if len(self.workloads) < self.config.target_max:
            return
        oldest = min(self.workloads, key=lambda name: self.workloads[name].end_ms)
        self.evicted.append((oldest, self.workloads.pop(oldest)))

    def _end_silent(self, out: Output) -> None:
        """Report the evicted workloads and those silent for ``target_end_silence_s``."""
        for name, workload in self.evicted:
            out.emit(self._record(name, workload, "evicted"))
        self.evicted.clear()
        now_ms = self._stream_time()
        if now_ms is None:
            return
        oldest = now_ms - self.config.target_end_silence_s * 1000
        for name in sorted(n for n, w in self.workloads.items() if w.end_ms < oldest):
            out.emit(self._record(name, self.workloads.pop(name), "silent"))

    def _stream_time(self) -> int | None:
        """How far the stream has come: the newest tick of its slowest scope among those that
        reported within ``target_end_silence_s`` of real time before the latest input
        (:class:`~wattflow.actors.formulas.window.StreamTime`).

        The scopes come from other formulas at their own pace: SmartWatts holds its ticks a
        while, the GPU formula its own, and a replay of separate files reads each at full
        speed. Judged by the newest tick of any scope, a job whose GPU process stopped would
        end by the GPU's time while its CPU reports of those seconds were still on their way,
        and those would start a second record of the same job. A scope that has stopped
        reporting (its input gone), or one yet to come at the start, does not hold the others
        back for longer than the silence.
        """
        return self.stream.time_ms(self.last_input)

    def _end_gone(self, out: Output) -> None:
        """Report the workloads absent from the newest tick none of whose cgroups exists
        under ``target_cgroup_root`` any more; looked at once per tick."""
        root = self.config.target_cgroup_root
        if root is None or self.newest_ms is None or self.checked_ms == self.newest_ms:
            return
        self.checked_ms = self.newest_ms
        absent = sorted(n for n, w in self.workloads.items() if w.end_ms < self.newest_ms)
        for name in absent:
            if not any(_exists(root, path) for path in self.workloads[name].cgroups):
                out.emit(self._record(name, self.workloads.pop(name), "gone"))

    def deadline(self) -> float | None:
        if not self.workloads:
            return None
        return self.last_input + self.config.target_end_silence_s

    def wake(self, out: Output) -> None:
        """The stream paused for ``target_end_silence_s``: every workload it held has ended,
        and the ticks after the pause start their clocks afresh."""
        self.clocks.clear()
        self.stream.sources.clear()
        for name in sorted(self.workloads):
            out.emit(self._record(name, self.workloads.pop(name), "silent"))

    def flush(self, out: Output) -> None:
        """At a stop, the workloads still running, with their energy so far."""
        self._end_silent(out)
        for name in sorted(self.workloads):  # by name: the order they came in varies
            out.emit(self._record(name, self.workloads.pop(name), "running"))

    def _record(self, name: str, workload: _Workload, reason: str) -> TargetEnergyReport:
        end = datetime_of(workload.end_ms)
        return TargetEnergyReport.trusted(
            timestamp=end,
            sensor=str(self.key),
            target=name,
            metadata=dict(workload.labels),
            start=datetime_of(workload.start_ms),
            end=end,
            energy=dict(workload.energy),
            reason=reason,
        )

    def state(self) -> Saved:
        clocks = {
            scope: (clock.newest_ms, list(clock.intervals.items()))
            for scope, clock in self.clocks.items()
        }
        return encode_state(EnergyState(self.workloads, clocks, self.newest_ms))

    def restore(self, state: Saved) -> None:
        saved = decode_state(state, EnergyState)
        for workload in saved.workloads.values():
            for scope in SCOPES:
                workload.energy.setdefault(scope, 0.0)
            del workload.cgroups[MAX_CGROUPS:]
        self.workloads = saved.workloads
        for scope, (newest, intervals) in saved.clocks.items():
            self.clocks[scope] = _Clock(newest, dict(intervals))
        restored = {scope: clock.newest_ms for scope, clock in self.clocks.items()}
        self.stream.restore({scope: ms for scope, ms in restored.items() if ms is not None})
        self.newest_ms = saved.newest_ms


_LABEL_PREFIXES = ("target_", "container_", "pod_", "vm", "slurm_", "service", "k8s")
"""The metadata a workload's record carries: its names (the naming step's labels, and what a
Kubernetes lookup adds: PowerAPI 2.10's nested ``k8s`` table or flat ``k8s_*`` keys), none of
the per-report figures (ratio, formula, socket)."""


def _exists(root: Path, cgroup: str) -> bool:
    """Whether the cgroup's directory is still there (a GPU process's cgroup, or
    hwpc-sensor's target, relative to the cgroup mount)."""
    return os.path.isdir(os.path.join(root, cgroup.lstrip("/")))
