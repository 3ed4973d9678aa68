"""Extra-P exports: ``extrap-text``, ``extrap-json``, ``extrap-jsonl``, ``extrap-talpas`` and
``extrap`` (the ``.extra-p`` experiment, optionally with fitted models).

Every run is summarised as its reports stream by (:func:`wattflow.formats.runs.summarise`),
so memory follows the number of targets and phases, not of reports. The ``.extra-p`` file is
Extra-P's own serialisation of an experiment, so it is written by the ``extrap`` package
itself (an optional dependency: ``pip install 'wattflow[extrap]'``), from the JSON export, and
``--model`` adds the models its default modeler fits.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter, Progress
from wattflow.formats import extrap
from wattflow.formats.runs import ReportStream, Run, summarise


class _ExtrapExporter(Exporter):
    """Summarises the runs, lays them out as points and repetitions, and writes one file."""

    def write(self, data: extrap.Table, out: Path) -> None:
        """Write the laid-out measurements in this exporter's format."""
        raise NotImplementedError

    def export(
        self, runs: Sequence[Run], reports: ReportStream, out: Path, advance: Progress
    ) -> None:
        summaries = [summarise(run, reports(run), on_report=lambda: advance(1)) for run in runs]
        data = extrap.table(summaries)
        out.parent.mkdir(parents=True, exist_ok=True)
        self.write(data, out)


@exporters.register("extrap-text")
class ExtrapText(_ExtrapExporter):
    name: ClassVar[str] = "extrap-text"
    description: ClassVar[str] = "Extra-P text file"

    def write(self, data: extrap.Table, out: Path) -> None:
        extrap.write_text(data, out)


@exporters.register("extrap-json")
class ExtrapJson(_ExtrapExporter):
    name: ClassVar[str] = "extrap-json"
    description: ClassVar[str] = "Extra-P JSON file"

    def write(self, data: extrap.Table, out: Path) -> None:
        extrap.write_json(data, out)


@exporters.register("extrap-jsonl")
class ExtrapJsonLines(_ExtrapExporter):
    name: ClassVar[str] = "extrap-jsonl"
    description: ClassVar[str] = "Extra-P JSON Lines file"

    def write(self, data: extrap.Table, out: Path) -> None:
        extrap.write_jsonl(data, out)


@exporters.register("extrap-talpas")
class ExtrapTalpas(_ExtrapExporter):
    name: ClassVar[str] = "extrap-talpas"
    description: ClassVar[str] = "Extra-P TaLPas file"

    def write(self, data: extrap.Table, out: Path) -> None:
        extrap.write_talpas(data, out)


@exporters.register("extrap")
class ExtrapExperiment(_ExtrapExporter):
    name: ClassVar[str] = "extrap"
    description: ClassVar[str] = "Extra-P experiment (.extra-p), with --model its fitted models"

    def export(
        self, runs: Sequence[Run], reports: ReportStream, out: Path, advance: Progress
    ) -> None:
        try:
            from extrap.fileio.experiment_io import write_experiment  # type: ignore[import-untyped]
            from extrap.fileio.file_reader.json_file_reader import (  # type: ignore[import-untyped]
                JsonFileReader,
            )
            from extrap.modelers.model_generator import ModelGenerator  # type: ignore[import-untyped]
        except ImportError:
            raise ValueError(
                "the .extra-p format is written by Extra-P itself: pip install extrap"
            ) from None
        summaries = [summarise(run, reports(run), on_report=lambda: advance(1)) for run in runs]
        data = extrap.table(summaries)
        with tempfile.TemporaryDirectory() as scratch:
            measurements = Path(scratch) / "measurements.json"
            extrap.write_json(data, measurements)
            reader = JsonFileReader()
            reader.keep_values = True
            experiment = reader.read_experiment(measurements)
        if self.model:
            ModelGenerator(experiment).model_all()
        out.parent.mkdir(parents=True, exist_ok=True)
        write_experiment(experiment, str(out))
