"""``ross``: runs as ROSS instrumentation binaries (see :mod:`wattflow.formats.ross`).

``--out`` is a directory, even for one run, so that every run's three files keep one naming
scheme. Per run, with ``<stem>`` = ``<experiment>-<benchmark>-<settings>-<repetition>`` (every
character outside ``A-Z a-z 0-9 . _ -`` turned into ``_``; ``-2``, ``-3``… appended where two
runs would otherwise share a stem):

- ``<stem>.bin``: PE, KP, LP and model samples;
- ``<stem>-evtrace.bin``: one event per PowerReport (ROSS's ``evtrace`` suffix);
- ``<stem>.json``: what the KP and LP ids and the model data mean.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import ClassVar

import orjson

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter, Progress, count_the_rest
from wattflow.formats.ross import RossWriter, check_window
from wattflow.formats.runs import Run, RunData

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_stem(run: Run) -> str:
    """A file name from the run's parts that no shell or file system misreads."""
    stem = _UNSAFE.sub("_", f"{run.experiment}-{run.benchmark}-{run.settings}-{run.repetition}")
    return "_" + stem[1:] if stem.startswith(".") else stem


@exporters.register("ross")
class RossExporter(Exporter):
    """One sample stream, one event trace and one description per run."""

    name: ClassVar[str] = "ross"
    description: ClassVar[str] = "ROSS instrumentation binary (PE/KP/LP/model samples, events)"
    writes_directory: ClassVar[bool] = True
    holds_runs: ClassVar[bool] = True

    def __init__(
        self, *, model: bool = False, interval_s: float = 1.0, events: bool = True
    ) -> None:
        super().__init__(model=model)
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, not {interval_s!r}")
        self.interval_s = interval_s
        self.events = events

    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        for run in runs:  # before any file is written
            check_window(run, self.interval_s)
        out.mkdir(parents=True, exist_ok=True)
        taken: set[str] = set()
        for run in runs:
            base = stem = file_stem(run)
            number = 1
            while stem in taken:
                number += 1
                stem = f"{base}-{number}"
            taken.add(stem)
            with ExitStack() as files:
                samples = files.enter_context(open(out / f"{stem}.bin", "wb"))
                events = (
                    files.enter_context(open(out / f"{stem}-evtrace.bin", "wb"))
                    if self.events
                    else None
                )
                writer = RossWriter(run, samples, events, interval_s=self.interval_s)
                for page in data.timeline(run):
                    advance(len(page.rows))
                    writer.add(page)
                writer.close()
            count_the_rest(data, run, writer.processed, advance)
            description = writer.description()
            description["files"] = {
                "samples": f"{stem}.bin",
                "events": f"{stem}-evtrace.bin" if self.events else None,
            }
            (out / f"{stem}.json").write_bytes(
                orjson.dumps(description, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
            )
