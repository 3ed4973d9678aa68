"""RAPL formula: energy deltas from hwpc-sensor's ``rapl`` group → watts per socket and domain.

Its reports have SmartWatts' ``rapl`` layout: target ``rapl``, the global report's metadata plus
``scope``, ``socket``, ``formula`` (the RAPL event, as SmartWatts names it) and ``ratio`` 1.0.

hwpc-sensor reports, for each socket, the energy each RAPL domain used since its previous tick,
in units of 2^-32 J. Power is that energy over the real interval between the two ticks' timestamps
(SmartWatts divides by the configured sensor frequency instead, which is wrong whenever a tick is
late). The first tick of a sensor only sets the start of the first interval.
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import datetime
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field, PositiveInt

from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.formats.frames import (
    Column,
    EventsTable,
    FloatArray,
    Frame,
    HWPCFrame,
    IntArray,
    PowerFrame,
)
from wattflow.formats.powerapi import datetime_of
from wattflow.formats.reports import HWPCReport, PowerReport, Report, to_millis

RAPL_UNIT_J = 2.0**-32
"""Energy of one unit of hwpc-sensor's RAPL counters, in J."""

GLOBAL_TARGETS = frozenset({"all", "system"})
"""Names of the whole-machine report: hwpc-sensor says ``all``, older recordings ``system``."""

RAPL_EVENT_PREFIX = "RAPL_ENERGY_"

SCOPE_OF_DOMAIN = {"PKG": "cpu", "DRAM": "dram", "PSYS": "psys", "CORES": "cores", "GPU": "uncore"}
"""SmartWatts' scope name for each RAPL domain (PP1, the 'GPU' domain, is the uncore)."""


class RaplConfig(FormulaConfig):
    """Settings of the RAPL formula."""

    sensor_reports_frequency: PositiveInt = Field(
        default=1000,
        description="Period of hwpc-sensor's reports in ms; ticks closer than a quarter of it "
        "are rejected as duplicates.",
        json_schema_extra={"flags": ["--sensor-reports-frequency"], "unit": "ms"},
    )
    compat: Literal["smartwatts-2.4"] | None = Field(
        default=None,
        description="Reproduce another formula's numbers: smartwatts-2.4 for SmartWatts 2.4.1.",
    )


def rapl_groups(report: HWPCReport) -> list[str]:
    """Groups that hold RAPL events.

    hwpc-sensor calls the group ``rapl``, but PowerAPI's CSV input names each group after its
    file (``rapl2.csv`` holds group ``rapl2``), so the events, not the group name, decide.
    """
    if "rapl" in report.groups:
        return ["rapl"]
    found = []
    for group, sockets in report.groups.items():
        for cpus in sockets.values():
            for events in cpus.values():
                if any(event.startswith(RAPL_EVENT_PREFIX) for event in events):
                    found.append(group)
                break
            break
    return found


def global_parts(frame: Frame) -> list[tuple[Hashable, Frame]] | None:
    """Each sensor's global reports in a frame, as ``dispatch_key`` of a formula reading RAPL
    energy picks them; ``None`` unless every global report has a ``rapl`` group."""
    if not isinstance(frame, HWPCFrame):
        return None
    if "global parts" not in frame.memo:
        frame.memo["global parts"] = _global_parts(frame)
    parts: list[tuple[Hashable, Frame]] | None = frame.memo["global parts"]
    return parts


def _global_parts(frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
    """:func:`global_parts`, worked out: ``[]`` for a frame of targets' reports only, ``None``
    when a target has RAPL rows or a global report has no RAPL energy (the frame then goes
    report by report, where such reports are told apart)."""
    tables = {table.group: table for table in frame.tables}
    rapl = tables.get("rapl")
    codes = [code for code, name in enumerate(frame.names) if name in GLOBAL_TARGETS]
    if rapl is None:
        if not any(bool(np.isin(t.targets, codes).any()) for t in frame.tables):
            return []  # only targets' reports, none of them the formula's
        return None
    if len(tables) != len(frame.tables):
        return None
    reports = _global_report_count(frame, rapl, codes)
    if reports is None:
        return None
    return _sensor_parts(frame, reports)


def _global_report_count(frame: HWPCFrame, rapl: EventsTable, codes: list[int]) -> int | None:
    """How many global reports a frame holds, when every one of them has RAPL energy and no
    target has RAPL rows; else ``None``. ``codes`` are the global targets' codes."""
    if not bool(np.isin(rapl.targets, codes).all()):
        return None  # a target's RAPL rows
    first = min(int(table.millis.min()) for table in frame.tables if len(table))
    width = len(frame.names)
    in_rapl = _report_keys(rapl, np.ones(len(rapl), dtype=np.bool_), first, width)
    for table in frame.tables:
        if table is not rapl and not bool(
            np.isin(_report_keys(table, np.isin(table.targets, codes), first, width), in_rapl).all()
        ):
            return None  # a global report without RAPL energy
    return len(in_rapl)


def _report_keys(
    table: EventsTable, chosen: npt.NDArray[np.bool_], first: int, width: int
) -> npt.NDArray[np.int64]:
    """One number per report among a table's ``chosen`` rows: its tick (ms after ``first``),
    sensor and target, ``width`` being the number of names the codes index."""
    millis = table.millis[chosen] - first
    keys: npt.NDArray[np.int64] = np.unique(
        (millis * width + table.sensors[chosen]) * width + table.targets[chosen]
    )
    return keys


def _sensor_parts(frame: HWPCFrame, reports: int) -> list[tuple[Hashable, Frame]]:
    """A frame's global reports, one part per sensor; ``reports`` is their count, kept on a
    frame of a single sensor."""
    only_global = frame.of_targets(GLOBAL_TARGETS)
    sensors = only_global.sensors()
    if len(sensors) == 1:
        return [(sensors[0], HWPCFrame(only_global.names, only_global.tables, reports))]
    return [(sensor, only_global.of_sensor(sensor)) for sensor in sensors]


def tick_intervals(ticks: IntArray, previous: int | None, period_ms: int) -> tuple[FloatArray, int]:
    """Seconds from each tick (ms) to the one before it, as ``timedelta.total_seconds()``
    computes them, and the first tick that has one: 1 when ``previous`` (the last tick already
    processed) is ``None``, the first tick then getting the configured period in its place."""
    gaps = np.diff(ticks, prepend=ticks[0] - period_ms if previous is None else previous)
    seconds: FloatArray = (gaps * 1000) / 1e6
    return seconds, 0 if previous is not None else 1


def rapl_table(frame: HWPCFrame) -> EventsTable:
    """The ``rapl`` group's rows of a frame that :func:`global_parts` made."""
    return next(table for table in frame.tables if table.group == "rapl")


def first_rows_per_socket(rapl: EventsTable) -> npt.NDArray[np.int64]:
    """Each tick's first row of each socket, in row order: RAPL is per socket, and every cpu
    of a socket repeats it."""
    slot = rapl.millis * (int(rapl.sockets.max()) + 1) + rapl.sockets
    first: npt.NDArray[np.int64] = np.unique(slot, return_index=True)[1]
    first.sort()
    return first


def _energy_columns(rapl: EventsTable) -> list[int] | None:
    """The columns of a ``rapl`` table that hold RAPL energy; ``None`` when there is none, or
    when an energy delta is negative (a dead letter, written report by report)."""
    columns = [at for at, e in enumerate(rapl.events) if e.startswith(RAPL_EVENT_PREFIX)]
    if not columns or bool((rapl.values[:, columns] < 0).any()):
        return None
    return columns


def _rapl_power_frame(
    sensor: str,
    rapl: EventsTable,
    first: npt.NDArray[np.int64],
    columns: list[int],
    power: FloatArray,
) -> PowerFrame:
    """The ``rapl`` PowerReports of a sensor's ``first`` rows, one per row and energy column:
    ``power`` (W, a row per first row, a column per energy column) with SmartWatts' metadata."""
    events = [rapl.events[at] for at in columns]
    domains = [event[len(RAPL_EVENT_PREFIX) :] for event in events]
    scopes = [SCOPE_OF_DOMAIN.get(domain, domain.lower()) for domain in domains]
    socket_texts, socket_codes = np.unique(rapl.sockets[first], return_inverse=True)
    rows = len(first) * len(columns)
    return PowerFrame(
        sensor=sensor,
        millis=np.repeat(rapl.millis[first], len(columns)),
        targets=np.zeros(rows, dtype=np.int64),
        target_names=["rapl"],
        power=power.reshape(-1),
        metadata={
            "scope": Column(np.tile(np.arange(len(columns)), len(first)), scopes),
            "socket": Column(
                np.repeat(socket_codes.reshape(-1), len(columns)),
                [str(s) for s in socket_texts.tolist()],
            ),
            "formula": Column(np.tile(np.arange(len(columns)), len(first)), events),
            "ratio": np.ones(rows),
        },
    )


@formulas.register("rapl")
class RaplFormula(Formula[RaplConfig]):
    """One instance per sensor: every socket of a sensor shares its tick timestamps."""

    name: ClassVar[str] = "rapl"
    inputs: ClassVar[frozenset[str]] = frozenset({HWPCReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = RaplConfig
    replayable: ClassVar[bool] = False  # a tick is the unit of failure (process)

    def __init__(self, config: RaplConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.previous: datetime | None = None
        self.min_interval_s = config.sensor_reports_frequency / 4000.0

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        if (
            isinstance(report, HWPCReport)
            and report.target in GLOBAL_TARGETS
            and rapl_groups(report)
        ):
            return report.sensor
        return None

    @classmethod
    def frame_parts(cls, frame: Frame) -> list[tuple[Hashable, Frame]] | None:
        return global_parts(frame)

    def process(self, reports: list[Report], out: Output) -> None:
        if len(reports) == 1 and isinstance(reports[0], HWPCFrame):
            frame = reports[0]
            if self.config.compat is None and self._try_frame(frame, out):
                return
            reports = frame.reports()
        for report in reports:
            assert isinstance(report, HWPCReport)
            mark = out.mark()
            try:
                self._tick(report, out)
            except Exception as error:  # a global report is a tick, the unit of failure
                out.fail([report], error, unit="tick", since=mark)

    def _try_frame(self, frame: HWPCFrame, out: Output) -> bool:
        """:meth:`_frame`, or ``False`` with nothing changed when it raises: the report-by-report
        way then says which tick fails, and why."""
        mark, previous = out.mark(), self.previous
        try:
            return self._frame(frame, out)
        except Exception as error:
            self.previous = previous
            out.fall_back(mark, error, way="frame")
            return False

    def _frame(self, frame: HWPCFrame, out: Output) -> bool:
        """Every tick of a frame of global reports at once; ``False``, having changed nothing,
        when a tick needs the report-by-report way (a dead letter to write)."""
        rapl = rapl_table(frame)
        columns = _energy_columns(rapl)
        if columns is None:
            return False
        first = first_rows_per_socket(rapl)
        timing = self._intervals(rapl.millis[first])
        if timing is None:
            return False
        interval_s, tick_of, start = timing
        if start:
            out.absorb()
            keep = tick_of >= 1
            first, tick_of = first[keep], tick_of[keep]
        if not len(first):
            return True
        energy = rapl.values[first][:, columns]
        power = np.multiply(energy, RAPL_UNIT_J, dtype=np.float64) / interval_s[tick_of][:, None]
        out.emit_frame(
            _rapl_power_frame(frame.names[int(rapl.sensors[0])], rapl, first, columns, power)
        )
        return True

    def _intervals(self, millis: IntArray) -> tuple[FloatArray, npt.NDArray[np.intp], int] | None:
        """The interval of each tick of these rows (their timestamps in ms), each row's tick,
        and the first tick that has an interval (:func:`tick_intervals`); the last tick becomes
        the previous one. ``None``, with nothing changed, when a tick is not after the previous
        one or comes too soon after it: those ticks need the report-by-report way."""
        ticks, tick_of = np.unique(millis, return_inverse=True)
        previous = None if self.previous is None else to_millis(self.previous)
        if previous is not None and int(ticks[0]) <= previous:
            return None
        interval_s, start = tick_intervals(ticks, previous, self.config.sensor_reports_frequency)
        if bool((interval_s[start:] < self.min_interval_s).any()):
            return None
        self.previous = datetime_of(int(ticks[-1]))
        return interval_s, tick_of.reshape(-1), start

    def _tick(self, report: HWPCReport, out: Output) -> None:
        if self.config.compat is not None:
            # SmartWatts divides every tick's energy by the configured period, the first included.
            self._emit(report, self.config.sensor_reports_frequency / 1000.0, out)
            return
        previous, now = self.previous, report.timestamp
        if previous is None:
            self.previous = now
            out.absorb()
            return
        interval_s = (now - previous).total_seconds()
        if interval_s <= 0:
            out.reject(report, f"tick at {now.isoformat()} is not after the previous one")
            return
        self.previous = now
        if interval_s < self.min_interval_s:
            out.reject(
                report,
                f"tick {interval_s * 1000:.0f} ms after the previous one, under a quarter of "
                f"the sensor period ({self.config.sensor_reports_frequency} ms)",
            )
            return
        self._emit(report, interval_s, out)

    def _emit(self, report: HWPCReport, interval_s: float, out: Output) -> None:
        now = report.timestamp
        powers: list[PowerReport] = []
        for socket, cpus in (
            item for group in rapl_groups(report) for item in report.groups[group].items()
        ):
            seen: set[str] = set()
            for events in cpus.values():
                for event, value in events.items():
                    if not event.startswith(RAPL_EVENT_PREFIX) or event in seen:
                        continue
                    seen.add(event)
                    if value < 0:
                        out.reject(report, f"negative energy delta {value} for {event}")
                        return
                    domain = event[len(RAPL_EVENT_PREFIX) :]
                    powers.append(
                        PowerReport.trusted(
                            timestamp=now,
                            sensor=report.sensor,
                            target="rapl",
                            power=value * RAPL_UNIT_J / interval_s,
                            metadata=report.metadata
                            | {
                                "scope": SCOPE_OF_DOMAIN.get(domain, domain.lower()),
                                "socket": socket,
                                "formula": event,
                                "ratio": 1.0,
                            },
                        )
                    )
        for power in powers:
            out.emit(power)
