"""Node formula: an external power meter's reading of the whole node, against the estimates.

A wattmeter sees everything the node draws: CPUs, memory, GPUs, and what no sensor covers (fans,
disks, NICs, power-supply losses). This formula lines the meter up with the other readings of
the same node (the same ``sensor`` name) and reports, per interval:

- ``node``: the meter's power (the sum of the channels chosen with ``--node-channels``, all by
  default), with the cpu, dram and gpu figures and the rest in its metadata;
- ``rest``: meter − (cpu + dram + gpu), what the other sensors do not see. It can be negative
  when the estimates exceed the meter, which says the estimates are off, so it is not clamped;
- with ``--node-shares``, for every target that has cpu, dram or gpu PowerReports (from the
  service's other formulas, or from an input), its estimated power and its share of node
  power (``ratio``), scope ``node``.

Alignment. The readings come at their own rates and clocks, so each source is held as
piecewise-constant power over its intervals (a meter reading or a RAPL delta stands for the time
since the previous one) and averaged over the node's intervals, which are hwpc-sensor's ticks
when RAPL readings come in, else the GPU sampler's, else the meter's. A source that starts or
stops inside an interval (a stream's edge) counts for the energy it measured in it; what no
source measured is in the rest. A meter whose clock is off is set right with the meter input's
clock offset.

When. An interval is reported once every source has reported past its end, in the sources' own
time (:class:`~wattflow.actors.formulas.window.StreamTime`): the meter, RAPL and the GPUs when
the pipeline's inputs give them, and, with ``--node-shares``, the estimates of each scope (a
later tick's, since a tick's estimates may come in several batches). So a replay, which reads
each file at its own pace, reports the intervals the live run reported, with the same sources
in each. A source that has been quiet for ``--node-lateness-ms`` of real time (a sampler that
stopped, one that never came) holds the intervals back no longer; the actor's timer
(:meth:`NodeFormula.deadline`) releases them when no input follows, and at shutdown every
interval held is reported. What the formula holds (each source's recent power and last reading,
the intervals not yet reported, the targets' estimates waiting for them) is checkpointed with the
other formulas' state, so the intervals held at a crash are reported after the restart.

cpu and dram come from the RAPL counters (all sockets), gpu from the NVML energy counter or
power (all devices): the same measurements the other formulas share among their targets.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar

import msgspec
import numpy as np
from pydantic import Field, PrivateAttr

from wattflow.actors.backend import CommaList
from wattflow.actors.checkpoints import FormulaState, Saved, decode_state, encode_state
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.gpu_readings import NoReading, tick_power_w
from wattflow.actors.formulas.rapl import (
    GLOBAL_TARGETS,
    RAPL_UNIT_J,
    frame_of_global_reports,
    global_parts,
    rapl_groups,
    tick_energy,
)
from wattflow.actors.formulas.window import StreamTime
from wattflow.formats.batch import Batch, hwpc_frame
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import (
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    Report,
)

FORMULA_NAME = "node"
SOURCES = ("meter", "cpu", "dram", "gpu")
_DOMAIN_SCOPE = {"RAPL_ENERGY_PKG": "cpu", "RAPL_ENERGY_DRAM": "dram"}
_SHARED_SCOPES = frozenset({"cpu", "dram", "gpu"})
_NOT_A_TARGET = frozenset({"rapl", "global"})


MAX_HELD_INTERVALS = 10_000
"""Intervals held at most for a source that lags behind the others in its own time (hours of
hwpc-sensor's ticks): beyond, the oldest are reported without it, and a warning says so."""

_LOG = logging.getLogger(__name__)

_RANK = {"rapl": 0, "gpu": 1, "meter": 2}
"""Which source's readings set the node's intervals: the first of these that comes."""

_READINGS = frozenset({"meter", "rapl", "gpu"})
"""The sources whose last reading the formula keeps (:attr:`NodeFormula.previous`)."""

_GPU_COUNTER = "gpu_counter"
"""The GPUs' last energy counter reading, kept apart from their last power reading."""


class NodeConfig(FormulaConfig):
    """Settings of the node formula."""

    _sources_expected: frozenset[str] = PrivateAttr(default=frozenset())
    """The sources the pipeline's inputs will give (:meth:`NodeFormula.configured`)."""

    node_channels: CommaList = Field(
        default_factory=list,
        description="Meter channels (d{device}c{channel}), comma-separated, that make up the node; "
        "all if empty.",
    )
    node_lateness_ms: int = Field(
        default=2000,
        ge=0,
        description="How long (real time) a quiet source holds the node's intervals back.",
    )
    node_shares: bool = Field(
        default=False,
        description="Also report each target's estimated power and share of node power.",
    )


class NodeState(FormulaState, frozen=True, tag=1):
    """What the node formula keeps across a restart: bounded by the intervals it holds."""

    formula = "node formula"
    also_reads = frozenset({None})  # before states were versioned: the same fields

    series: dict[str, tuple[int | None, list[int], list[float]]]
    """Each source's power since the oldest interval held: (first start, ends, watts)."""
    previous: dict[str, tuple[int, dict[str, float]]]
    """Each source's last reading: (its end in ms, its values)."""
    anchor_source: str | None
    anchor_ends: list[int]
    """The ends of the node's intervals not yet reported, after the last one reported."""
    targets: dict[str, dict[str, list[float] | float]]
    """Each held interval's estimates per target (a sum, before they were kept apart)."""
    stream: dict[str, int] = msgspec.field(default_factory=dict)
    """How far each source had come (none before the stream time was kept)."""
    reported_until: int | None = None
    """The end of the last interval reported (none before it was kept)."""


@dataclass
class _Series:
    """Power of one source as (end time in ms, watts over the interval that ends there)."""

    ends: list[int] = field(default_factory=list)
    watts: list[float] = field(default_factory=list)
    first_start: int | None = None

    def add(self, start: int, end: int, watts: float) -> None:
        if self.first_start is None:
            self.first_start = start
        if self.ends and end <= self.ends[-1]:
            return  # late or repeated: the interval is already covered
        self.ends.append(end)
        self.watts.append(watts)

    @property
    def covered_until(self) -> int | None:
        return self.ends[-1] if self.ends else None

    def mean(self, start: int, end: int, *, partial: bool = False) -> float | None:
        """Time-weighted mean power over (start, end], or None where the series has a gap.

        With ``partial``, a series that starts or stops inside the interval (a source's first
        or last reading falls within it: the edges of a stream, which no lateness mends) counts
        for the part it covers: the energy it measured there over the interval's whole length,
        ``None`` only where it covers none of it. The part it did not measure is then in the
        node's rest, as a source with no reading at all is. Leaving the source out instead
        would put the energy it *did* measure in the rest too: a GPU's last tick, ending a
        millisecond before hwpc-sensor's last one, would be counted both in the GPU's targets
        and in the rest.
        """
        if self.first_start is None or not self.ends or end <= start:
            return None
        if not partial and (start < self.first_start or end > self.ends[-1]):
            return None
        position, until = max(start, self.first_start), min(end, self.ends[-1])
        if position >= until:
            return None
        total = 0.0
        index = bisect_right(self.ends, position)
        while position < until and index < len(self.ends):
            segment_end = min(self.ends[index], until)
            total += self.watts[index] * (segment_end - position)
            position = segment_end
            index += 1
        return total / (end - start)

    def forget_before(self, time_ms: int) -> None:
        """Drop intervals that end before ``time_ms``: memory stays bounded on long runs."""
        cut = bisect_right(self.ends, time_ms) - 1
        if cut > 0:
            self.first_start = self.ends[cut - 1]
            del self.ends[:cut]
            del self.watts[:cut]


def _millis(timestamp: datetime) -> int:
    return int(timestamp.timestamp() * 1000)


@formulas.register(FORMULA_NAME)
class NodeFormula(Formula[NodeConfig]):
    """One instance per node (sensor name), holding each source's recent power."""

    name: ClassVar[str] = FORMULA_NAME
    inputs: ClassVar[frozenset[str]] = frozenset(
        {MeterReport.kind, HWPCReport.kind, GPUReport.kind, PowerReport.kind}
    )
    config_model: ClassVar[type[FormulaConfig]] = NodeConfig
    needs: ClassVar[frozenset[str] | None] = frozenset({MeterReport.kind})
    replayable: ClassVar[bool] = False  # a report, and an interval to report, are the units

    def __init__(self, config: NodeConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.series = {source: _Series() for source in SOURCES}
        self.previous: dict[str, tuple[int, dict[str, float]]] = {}
        self.anchor_ends: list[int] = []
        self.anchor_source: str | None = None
        self.reported_until: int | None = None
        """The end of the last interval reported: a better source's intervals go on from it."""
        self.targets: dict[int, dict[str, list[float]]] = defaultdict(dict)
        """Each interval's estimates per target, as they came: summed exactly
        (:func:`math.fsum`) when reported, so the order they came in changes no digit."""
        self.stream = StreamTime(config.node_lateness_ms / 1000.0, config._sources_expected)
        """How far the node's sources have come in their own time."""
        self.warned_held = False

    @classmethod
    def configured(cls, config: FormulaConfig, given: frozenset[str]) -> FormulaConfig:
        """The sources to wait for: the meter, RAPL where an input gives hwpc-sensor's
        reports, the GPUs where one gives GPU samples and, with ``--node-shares``, the
        estimates of the scopes the other formulas make from them."""
        assert isinstance(config, NodeConfig)
        expected = config.model_copy()
        sources = {"meter"}
        if HWPCReport.kind in given:
            sources |= {"rapl", _estimates("cpu"), _estimates("dram")}
        if GPUReport.kind in given:
            sources |= {"gpu", _estimates("gpu")}
        if not config.node_shares:
            sources = {source for source in sources if source in SOURCES or source == "rapl"}
        expected._sources_expected = frozenset(sources)
        return expected

    @classmethod
    def takes_formula_output(cls, config: FormulaConfig) -> bool:
        return isinstance(config, NodeConfig) and config.node_shares

    @classmethod
    def frame_parts(cls, frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
        return global_parts(frame)

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if isinstance(report, MeterReport | GPUReport):
            return report.sensor
        if isinstance(report, HWPCReport) and report.target in GLOBAL_TARGETS:
            return report.sensor if rapl_groups(report) else None
        if isinstance(report, PowerReport):
            scope = report.metadata.get("scope")
            if scope in _SHARED_SCOPES and report.target not in _NOT_A_TARGET:
                return report.sensor
        return None

    def process(self, reports: Batch, out: Output) -> None:
        frame = hwpc_frame(
            reports,
            lambda batch: frame_of_global_reports(batch, out),
            others=lambda report: self._other(report, out),  # each report a unit
        )
        if frame is not None:
            self._rapl(frame, out)
        self._report_ready(out, flushing=False)

    def _other(self, report: Report, out: Output) -> None:
        """A meter reading, a GPU sample or a target's estimate: the report is the unit."""
        try:
            if isinstance(report, MeterReport):
                self._meter(report, out)
            elif isinstance(report, GPUReport):
                self._gpu(report, out)
            elif isinstance(report, PowerReport):
                self._target(report, out)
        except Exception as error:  # each source absorbs or rejects last, after its state
            out.fail([report], error, unit="report")

    def flush(self, out: Output) -> None:
        self._report_ready(out, flushing=True)

    # --- checkpoints ---------------------------------------------------------------------------

    def state(self) -> Saved:
        """Each source's power since the oldest interval held, each source's last reading, the
        node's intervals not yet reported and the targets' estimates waiting for them: bounded
        by the intervals held (:data:`MAX_HELD_INTERVALS` at most)."""
        return encode_state(
            NodeState(
                series={
                    source: (series.first_start, series.ends, series.watts)
                    for source, series in self.series.items()
                },
                previous=self.previous,
                anchor_source=self.anchor_source,
                anchor_ends=self.anchor_ends,
                targets={
                    str(end): dict[str, list[float] | float](powers)
                    for end, powers in self.targets.items()
                },
                stream=self.stream.state(),
                reported_until=self.reported_until,
            )
        )

    def restore(self, state: Saved) -> None:
        """Take back what :meth:`state` gave. The sources restored count as come now: the
        intervals held wait for their late readings for ``--node-lateness-ms`` again, and are
        reported then even if no input comes (a state written before the stream time was kept
        takes each source's last reading for it)."""
        saved = decode_state(state, NodeState)
        unknown = saved.series.keys() - set(SOURCES)
        if unknown:
            raise ValueError(f"no source {sorted(unknown)[0]!r} in the node formula")
        self.series = {
            source: _Series(ends, watts, first_start)
            for source, (first_start, ends, watts) in saved.series.items()
        }
        self.previous = dict(saved.previous)
        self.anchor_source = saved.anchor_source
        self.anchor_ends = saved.anchor_ends
        self.reported_until = saved.reported_until
        newest = saved.stream or {
            name: end for name, (end, _) in saved.previous.items() if name in _READINGS
        }
        self.stream.restore(newest, seen_at=time.monotonic())
        self.targets.update(
            (int(end), {target: _parts(power) for target, power in powers.items()})
            for end, powers in saved.targets.items()
        )

    def deadline(self) -> float | None:
        """When a source that holds the intervals back has been quiet for
        ``--node-lateness-ms``: the actor wakes the instance then, so a stream that pauses
        still has its last intervals reported."""
        if len(self.anchor_ends) < 2:
            return None
        if self._awaiting_better():
            return self.stream.started + self.stream.idle_s
        return self.stream.deadline()

    def wake(self, out: Output) -> None:
        self._report_ready(out, flushing=False)

    # --- sources -------------------------------------------------------------------------------

    def _meter(self, report: MeterReport, out: Output) -> None:
        wanted = self.config.node_channels
        channels = {k: v for k, v in report.channels.items() if not wanted or k in wanted}
        missing = [channel for channel in wanted if channel not in report.channels]
        if missing or not channels:
            reason = f"missing channels {missing}" if missing else "no channels"
            out.reject(report, f"meter reading {reason}")
            return
        self._interval("meter", report, {"meter": sum(channels.values()) / 1000.0}, out)

    def _rapl(self, frame: HWPCFrame, out: Output) -> None:
        """The node's cpu and dram energy of every tick of a frame of global reports, each tick
        (its global report) the unit of failure: a tick not after the previous one is a dead
        letter, as a reading of any source is."""
        mark = out.mark()
        try:
            ticks = self._rapl_ticks(frame)
        except Exception as error:  # reading the arrays: no tick was taken yet
            out.fail(frame.reports(), error, unit="frame", since=mark)
            return
        for end, energy in ticks:
            mark = out.mark()
            try:
                if self._reading("rapl", end, energy, deltas=True):
                    out.absorb()
                    continue
                when = datetime_of(end).isoformat()
                for report in frame.of_ticks(np.array([end])).reports():
                    out.reject(report, f"rapl reading at {when} is not new")
            except Exception as error:
                out.fail(
                    frame.of_ticks(np.array([end])).reports(), error, unit="report", since=mark
                )

    @staticmethod
    def _rapl_ticks(frame: HWPCFrame) -> list[tuple[int, dict[str, float]]]:
        """Each tick's RAPL energy (J) per scope, summed over sockets, in the order the ticks
        came."""
        _, ticks, energy = tick_energy(frame)
        scopes = [_DOMAIN_SCOPE.get(event) for event in energy.events]
        per_tick: list[dict[str, float]] = [defaultdict(float) for _ in range(len(ticks))]
        for tick, event, value in zip(
            energy.tick.tolist(), energy.event.tolist(), energy.value.tolist(), strict=True
        ):
            scope = scopes[event]
            if scope is not None:
                per_tick[tick][scope] += value * RAPL_UNIT_J
        return [(end, dict(energy)) for end, energy in zip(ticks.tolist(), per_tick, strict=True)]

    def _gpu(self, report: GPUReport, out: Output) -> None:
        """The GPUs' power over the tick since the previous one: by their energy counters where
        every device read its counter at this tick and at the previous one (a recording with a
        counter every tick), else by each device's own power over the tick
        (:func:`tick_power_w`, the GPU formula's definition). The NVML input reads the counter
        every ``--energy-ms`` and power every tick: a counter reading is then a span of many
        ticks, whose power readings already cover it."""
        if not report.devices:
            out.absorb()
            return
        end = _millis(report.timestamp)
        previous = self.previous.get("gpu")
        start_us = (previous[0] if previous is not None else end - 1) * 1000
        if self._gpu_counters(report, end, previous, out):
            return
        power_w = 0.0
        for device in report.devices.values():
            try:
                power_w += tick_power_w(device, start_us, end * 1000) or 0.0
            except NoReading:
                continue
        self._interval("gpu", report, {"gpu": power_w}, out)

    def _target(self, report: PowerReport, out: Output) -> None:
        if not self.config.node_shares:
            out.absorb()
            return
        millis = _millis(report.timestamp)
        # a tick's estimates are complete once a later tick's come: this one's may be split
        self.stream.observe(_estimates(report.metadata["scope"]), millis - 1, time.monotonic())
        self.targets[millis].setdefault(report.target, []).append(report.power)
        out.absorb()

    def _interval(
        self,
        name: str,
        report: Report,
        values: dict[str, float],
        out: Output,
    ) -> None:
        """Record a reading of ``values`` (watts) for the interval ending at the report, which
        starts at the previous report of the same source; a reading not after it is a dead
        letter."""
        if self._reading(name, _millis(report.timestamp), values, deltas=False):
            out.absorb()
        else:
            out.reject(report, f"{name} reading at {report.timestamp.isoformat()} is not new")

    def _reading(self, name: str, end: int, values: dict[str, float], *, deltas: bool) -> bool:
        """Record ``values`` (watts, or energy in J when ``deltas``) for the interval from the
        previous reading of the source to ``end`` (ms); ``False`` when ``end`` is not after it
        (the reading then becomes the previous one all the same, as a source that went back in
        time goes on from there)."""
        previous = self.previous.get(name)
        self.previous[name] = (end, values)
        self.stream.observe(name, end, time.monotonic())
        if previous is None:
            return True
        start = previous[0]
        if end <= start:
            return False
        seconds = (end - start) / 1000.0
        for source, value in values.items():
            self.series[source].add(start, end, value / seconds if deltas else value)
        self._anchor(name, start, end)
        return True

    def _gpu_counters(
        self,
        report: GPUReport,
        end: int,
        previous: tuple[int, dict[str, float]] | None,
        out: Output,
    ) -> bool:
        """Keep the GPUs' counters when every device read its own at this tick; take the
        interval from their increase when they were read at the previous tick too (a counter
        that went back, a driver reload, gives none). Whether they did."""
        counters = [device.total_energy for device in report.devices.values()]
        if any(counter is None for counter in counters):
            return False
        counted = self.previous.get(_GPU_COUNTER)
        energy_j = sum(counter or 0.0 for counter in counters) / 1000.0
        self.previous[_GPU_COUNTER] = (end, {_GPU_COUNTER: energy_j})
        if counted is None or previous is None or counted[0] != previous[0]:
            return False
        earlier_j = counted[1][_GPU_COUNTER]
        if energy_j >= earlier_j:
            self._reading("gpu", end, {"gpu": energy_j - earlier_j}, deltas=True)
        else:
            self.previous["gpu"] = (end, {"gpu": 0.0})
            self.stream.observe("gpu", end, time.monotonic())
        out.absorb()
        return True

    def _anchor(self, name: str, start: int, end: int) -> None:
        """Intervals follow hwpc-sensor's ticks if any come, else the GPU's, else the meter's."""
        if self.anchor_source is None or _RANK[name] < _RANK[self.anchor_source]:
            self.anchor_source = name
            self.anchor_ends = self._taken_over(start, end)
            return
        if name == self.anchor_source and (not self.anchor_ends or end > self.anchor_ends[-1]):
            self.anchor_ends.append(end)

    def _taken_over(self, start: int, end: int) -> list[int]:
        """The interval ends once a better source's first interval (``start`` to ``end``)
        takes over: from it, where nothing was reported yet (the intervals follow the better
        source from its first); else from the last one reported, through the lesser source's
        held intervals up to ``start``, so that the node's reports neither leave out nor count
        twice the time around the change (hwpc-sensor started well after the meter)."""
        done = self.reported_until
        if done is None:
            return [start, end]
        ends = [done, *(held for held in self.anchor_ends if done < held < start)]
        ends += [later for later in (start, end) if later > ends[-1]]
        return ends

    def _awaiting_better(self) -> bool:
        """Whether the intervals follow a lesser source while a better one the inputs will give
        has not set any yet, for ``--node-lateness-ms`` after the start at most: they are held
        meanwhile, as the better source's first readings replace them. Which source's readings
        came first must not decide the intervals reported (a replay's GPU file read before
        hwpc-sensor's would give intervals of its own that the live run never had)."""
        stream, anchor = self.stream, self.anchor_source
        if anchor is None or stream.started + stream.idle_s <= time.monotonic():
            return False
        return any(_RANK.get(source, len(_RANK)) < _RANK[anchor] for source in stream.expected)

    # --- output --------------------------------------------------------------------------------

    def _report_ready(self, out: Output, *, flushing: bool) -> None:
        """Report each interval once every source came past its end, or at shutdown.

        Sources arrive at their own pace (a meter's logger may send once a minute, a replay
        reads one file before the next), so an interval waits for the slowest source's
        readings to pass its end, in the sources' own time, unless that source has been quiet
        for ``--node-lateness-ms`` of real time. This runs after each batch and, through
        :meth:`wake`, when :meth:`deadline` passes without input.
        """
        horizon = math.inf if flushing else self._horizon()
        reported = False
        while len(self.anchor_ends) >= 2 and horizon is not None and self.anchor_ends[1] <= horizon:
            start, end = self.anchor_ends[0], self.anchor_ends[1]
            active = [s for s in SOURCES if self.series[s].covered_until is not None]
            targets = self._targets_until(end)  # reported with the interval, or never
            if "meter" in active:
                mark = out.mark()
                try:
                    self._emit(start, end, active, targets, out)
                except Exception as error:  # its inputs were absorbed: no report to dead-letter
                    out.fail((), error, unit="interval", since=mark)
            self.anchor_ends.pop(0)
            self.reported_until = end
            reported = True
        if reported:  # never before: the intervals may yet follow a source that comes later
            for source in SOURCES:
                self.series[source].forget_before(self.anchor_ends[0])

    def _horizon(self) -> float | None:
        """How far the intervals may be reported: as far as the sources have come, or further
        where more than ``MAX_HELD_INTERVALS`` are held (``None``: not at all yet)."""
        horizon = None if self._awaiting_better() else self.stream.time_ms(time.monotonic())
        if len(self.anchor_ends) <= MAX_HELD_INTERVALS:
            return horizon
        self._warn_held()
        overflow = self.anchor_ends[len(self.anchor_ends) - MAX_HELD_INTERVALS]
        return overflow if horizon is None else max(horizon, overflow)

    def _warn_held(self) -> None:
        """Said once per instance: the oldest intervals go without the slowest source."""
        if not self.warned_held:
            self.warned_held = True
            _LOG.warning(
                "node %s: a source lags more than %d intervals behind the others; the oldest "
                "intervals are reported without it",
                self.key,
                MAX_HELD_INTERVALS,
            )

    def _emit(
        self, start: int, end: int, active: list[str], targets: dict[str, float], out: Output
    ) -> None:
        """The node's reports of the interval from ``start`` to ``end`` (ms): the meter's power
        with the sources' means, the rest no source covers, and each target's estimate with
        ``--node-shares``."""
        means = {
            source: self.series[source].mean(start, end, partial=source != "meter")
            for source in active
        }
        meter = means.get("meter")
        if meter is None:
            return  # the meter has a gap here: there is no node figure to report
        parts = {source: means.get(source) for source in ("cpu", "dram", "gpu")}
        known = {k: v for k, v in parts.items() if v is not None}
        rest = meter - sum(known.values())
        timestamp = datetime_of(end)
        rounded = {k: round(v, 6) for k, v in known.items()}
        out.emit(self._node_report(timestamp, "node", meter, {"ratio": 1.0, **rounded}))
        out.emit(self._node_report(timestamp, "rest", rest, {"ratio": _share(rest, meter)}))
        if self.config.node_shares:
            for target, power in sorted(targets.items()):
                ratio = _share(power, meter)
                out.emit(self._node_report(timestamp, target, power, {"ratio": ratio}))

    def _targets_until(self, end: int) -> dict[str, float]:
        """The targets' estimates of the interval ending at ``end`` (ms), forgetting those of
        intervals that end earlier: they will never be reported."""
        targets = self.targets.pop(end, {})
        for stale in [t for t in self.targets if t < end]:
            del self.targets[stale]
        return {target: math.fsum(parts) for target, parts in targets.items()}

    def _node_report(
        self, timestamp: datetime, target: str, power_w: float, metadata: dict[str, float]
    ) -> PowerReport:
        """A report of the node formula; ``metadata`` comes after its scope and formula."""
        return PowerReport(
            timestamp=timestamp,
            sensor=str(self.key),
            target=target,
            power=power_w,
            metadata={"scope": "node", "formula": FORMULA_NAME, **metadata},
        )


def _parts(saved: float | list[float]) -> list[float]:
    """A target's estimates of an interval as saved (a sum, before they were kept apart)."""
    return list(saved) if isinstance(saved, list) else [saved]


def _estimates(scope: object) -> str:
    """The source of the other formulas' estimates of a scope (cpu, dram, gpu)."""
    return f"{scope} estimates"


def _share(power_w: float, meter_w: float) -> float:
    """``power_w`` as a share of the meter's power; 0 when the meter reads 0 W."""
    return power_w / meter_w if meter_w else 0.0
