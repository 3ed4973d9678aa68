"""What every exporter is: a name, and a function from selected runs to files.

Exporters read runs through :data:`~wattflow.formats.runs.ReportStream` (one run's reports in
time order, streamed from the store), so memory does not grow with a run's length, and report
progress through ``advance`` (called once per report read) so the command can draw a bar.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from wattflow.formats.runs import ReportStream, Run, TimedReportStream

Progress = Callable[[int], None]
"""Called with the number of reports just read."""


class Exporter(ABC):
    """Writes a set of runs in one research format."""

    name: ClassVar[str]
    description: ClassVar[str]
    writes_directory: ClassVar[bool] = False
    """Whether ``out`` is a directory (created) rather than a file."""

    def __init__(self, *, model: bool = False) -> None:
        self.model = model

    @abstractmethod
    def export(
        self, runs: Sequence[Run], reports: ReportStream, out: Path, advance: Progress
    ) -> None:
        """Write ``runs`` to ``out``."""

    def export_timed(
        self, runs: Sequence[Run], reports: TimedReportStream, out: Path, advance: Progress
    ) -> None:
        """Write ``runs`` from reports that carry their processing times.

        The command always calls this; only formats with a place for processing time (ROSS's
        real time) override it, the others drop the times.
        """
        self.export(runs, lambda run: (report for report, _ in reports(run)), out, advance)
