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
            stand_ins = _missing_edges(run, data)
            if stand_ins and stand_ins[0].event == "experiment_begin":
                writer.add(stand_ins.pop(0))  # before every other event, as its time is
            read = 0
            for report in data.reports(run, KINDS):
                read += 1
                if read % PAGE == 0:
                    advance(PAGE)
                writer.add(report)
            advance(read % PAGE)
            count_the_rest(data, run, read, advance)
            for report in stand_ins:  # the end, after every other event
                writer.add(report)
            writer.close(run.system)


def _missing_edges(run: Run, data: RunData) -> list[EventReport]:
    """The loader needs the experiment's begin and end: where the run lacks one (a live run
    marked only at its end, say), the run's window stands in for it, and the machine it ran on
    names it. ``timestamps.csv`` keeps time order: the begin goes first, the end last."""
    present = {r.event for r in data.reports(run, ("EventReport",)) if isinstance(r, EventReport)}
    sensor = str(run.system.get("node") or "wattflow")
    edges: tuple[tuple[EventName, datetime], ...] = (
        ("experiment_begin", run.start),
        ("experiment_end", run.end),
    )
    return [
        EventReport(timestamp=moment, sensor=sensor, target="all", event=name)
        for name, moment in edges
        if name not in present
    ]
