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

from pydantic import Field, PositiveInt

from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.formats.reports import HWPCReport, PowerReport, Report

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
        json_schema_extra={"flags": ["--sensor-reports-frequency"]},
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


@formulas.register("rapl")
class RaplFormula(Formula[RaplConfig]):
    """One instance per sensor: every socket of a sensor shares its tick timestamps."""

    name: ClassVar[str] = "rapl"
    inputs: ClassVar[frozenset[str]] = frozenset({HWPCReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = RaplConfig

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

    def process(self, reports: list[Report], out: Output) -> None:
        for report in reports:
            assert isinstance(report, HWPCReport)
            self._tick(report, out)

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
