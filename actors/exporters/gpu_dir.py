"""``gpu-dir``: runs as a GPU measurement directory (see :mod:`wattflow.formats.gpu_dir`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import ClassVar

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter, Progress, count_the_rest
from wattflow.formats.gpu_dir import RepetitionWriter
from wattflow.formats.reports import EventName, EventReport
from wattflow.formats.runs import PAGE, Run, RunData

KINDS = ("GPUReport", "MeterReport", "EventReport")
"""The kinds the directory holds; PowerReports are not read."""


@exporters.register("gpu-dir")
class GpuDirExporter(Exporter):
    """``--out`` is the data root: experiment/benchmark/settings/repetition below it."""

    name: ClassVar[str] = "gpu-dir"
    description: ClassVar[str] = "GPU measurement directory (CSV files per repetition)"
    writes_directory: ClassVar[bool] = True
    holds_runs: ClassVar[bool] = True

    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        for run in runs:
            directory = out / run.experiment / run.benchmark / run.settings / str(run.repetition)
            writer = RepetitionWriter(directory)
            events: dict[EventName, bool] = {"experiment_begin": False, "experiment_end": False}
            read = 0
            for report in data.reports(run, KINDS):
                read += 1
                if read % PAGE == 0:
                    advance(PAGE)
                writer.add(report)
                if isinstance(report, EventReport) and report.event in events:
                    events[report.event] = True
            advance(read % PAGE)
            count_the_rest(data, run, read, advance)
            # The loader needs the experiment's begin and end: the window stands in for them.
            if not events["experiment_begin"] or not events["experiment_end"]:
                edges: tuple[tuple[EventName, datetime], ...] = (
                    ("experiment_begin", run.start),
                    ("experiment_end", run.end),
                )
                # The run's window stands in for a missing edge; the machine it ran on names it.
                sensor = str(run.system.get("node") or "wattflow")
                for name, moment in edges:
                    if not events[name]:
                        writer.add(
                            EventReport(timestamp=moment, sensor=sensor, target="all", event=name)
                        )
            writer.close(run.system)
