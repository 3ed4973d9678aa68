"""``hpctoolkit``: runs as HPCToolkit databases (see :mod:`wattflow.formats.hpctoolkit`).

hpcviewer opens one database directory at a time, so each run gets its own: with one run
``--out`` is that directory; with several, ``--out`` is a root holding
``<experiment>/<benchmark>/<settings>/<repetition>/``, each part sanitised (anything but
letters, digits and ``._,=+@-`` becomes ``_``) so that a setting such as ``250W/a`` cannot
escape the root. Two runs whose sanitised paths collide get ``~2``, ``~3``… appended.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter, Progress, count_the_rest, path_part
from wattflow.formats.hpctoolkit import write_run
from wattflow.formats.runs import Run, RunData


def database_directories(runs: Sequence[Run], out: Path) -> list[Path]:
    """Where each run's database goes: ``out`` itself for one run, else a tree below it."""
    if len(runs) == 1:
        return [out]
    taken: set[Path] = set()
    found: list[Path] = []
    for run in runs:
        parts = (run.experiment, run.benchmark, run.settings, str(run.repetition))
        base = out.joinpath(*(path_part(part) for part in parts))
        directory, copy = base, 1
        while directory in taken:
            copy += 1
            directory = base.with_name(f"{base.name}~{copy}")
        taken.add(directory)
        found.append(directory)
    return found


@exporters.register("hpctoolkit")
class HpctoolkitExporter(Exporter):
    """One HPCToolkit database (experiment.xml, profile.db, cct.db, trace.db) per run."""

    name: ClassVar[str] = "hpctoolkit"
    description: ClassVar[str] = "HPCToolkit database per run (experiment.xml 4.0, *.db)"
    writes_directory: ClassVar[bool] = True

    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        for run, directory in zip(runs, database_directories(runs, out), strict=True):
            read = 0

            def counted(rows: int) -> None:
                nonlocal read
                read += rows
                advance(rows)

            write_run(run, data.power(run), directory, counted)
            count_the_rest(data, run, read, advance)
