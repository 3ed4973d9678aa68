"""What every exporter is: a name, and a function from selected runs to files.

Exporters read runs through :class:`~wattflow.formats.runs.RunData`, each only the kinds and
fields its format needs (the power rows, the timeline, or whole reports of a few kinds), a page
at a time, so memory does not grow with a run's length. They report progress through
``advance``, called with the number of reports just read; the reports of a run an exporter does
not need are counted once that run is done, so the count reaches every report of the runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from wattflow.formats.runs import Run, RunData

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
    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        """Write ``runs`` to ``out``."""


def count_the_rest(data: RunData, run: Run, read: int, advance: Progress) -> None:
    """Advance by the run's reports that were not read (a store may have taken more since)."""
    advance(max(data.count(run) - read, 0))
