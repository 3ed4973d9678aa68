"""What every exporter is: a name, and a function from selected runs to files.

Exporters read runs through :class:`~wattflow.formats.runs.RunData`, each only the kinds and
fields its format needs (the power rows, the timeline, or whole reports of a few kinds), a page
at a time, so memory does not grow with a run's length. They report progress through
``advance``, called with the number of reports just read; the reports of a run an exporter does
not need are counted once that run is done, so the count reaches every report of the runs.
"""

from __future__ import annotations

import re
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
    holds_runs: ClassVar[bool] = False
    """Whether ``out`` is a root that keeps each run apart inside it (a GPU measurement
    directory's tree, ROSS's files named after the run), so one root can take run after run."""
    suffix: ClassVar[str] = ""
    """The usual ending of the file a file format writes (``.txt``)."""

    def __init__(self, *, model: bool = False) -> None:
        self.model = model

    @abstractmethod
    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        """Write ``runs`` to ``out``."""


def count_the_rest(data: RunData, run: Run, read: int, advance: Progress) -> None:
    """Advance by the run's reports that were not read (a store may have taken more since)."""
    advance(max(data.count(run) - read, 0))


_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@-]")


def path_part(text: str) -> str:
    """One directory name from free text, never empty, ``.`` or ``..``: anything but letters,
    digits and ``._,=+@-`` becomes ``_``, so that a setting such as ``250W/a`` cannot escape the
    directory it is put in."""
    cleaned = _UNSAFE.sub("_", text)
    return cleaned if cleaned.strip(".") else cleaned.replace(".", "_") or "_"


def run_output(exporter: type[Exporter], run: tuple[str, str, str, int], directory: Path) -> Path:
    """Where one run (experiment, benchmark, settings, repetition) goes when runs are exported
    one by one into ``directory`` (``wattflow run --export``): ``<directory>/<format>`` for a
    format whose output holds runs apart, else
    ``<directory>/<format>/<experiment>/<benchmark>/<settings>/<repetition>`` (a file with the
    format's suffix, or a directory)."""
    root = directory / exporter.name
    if exporter.holds_runs:
        return root
    experiment, benchmark, settings, repetition = run
    parts = [path_part(part) for part in (experiment, benchmark, settings)]
    return root.joinpath(*parts, f"{repetition}{exporter.suffix}")
