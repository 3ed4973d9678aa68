"""``extrap-*`` and ``extrap``: runs as Extra-P inputs (see :mod:`wattflow.formats.extrap`).

Every format holds the same table (points from the runs' parameters, callpaths per target and
phase, energy/power/duration metrics), so one base class reads the runs and each subclass only
picks the writer. ``--out`` is one file. Selections Extra-P could not load (no runs, differing
parameter names, too many parameters for the text format, a missing ``extrap`` package for
``.extra-p``) fail before any report is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter, Progress
from wattflow.formats import extrap
from wattflow.formats.runs import Run, RunData


class _ExtrapExporter(Exporter):
    """Shared reading; subclasses write."""

    name: ClassVar[str]
    description: ClassVar[str]
    supports_model: ClassVar[bool] = False

    def __init__(self, *, model: bool = False) -> None:
        if model and not self.supports_model:
            # Silently dropping the flag would leave the user looking for models that are not there.
            raise extrap.ExtrapError(
                f"--model adds fitted models to .extra-p experiments only, not to {self.name}: "
                "export the `extrap` format, or let Extra-P model this file when it opens it"
            )
        super().__init__(model=model)

    def check(self, runs: Sequence[Run]) -> None:
        """Refuse what the format cannot hold, before the long pass over the reports."""
        extrap.parameter_names(runs)

    writer: ClassVar[Callable[[extrap.Measurements, Path], None]]
    """The format's writer, from :mod:`wattflow.formats.extrap`."""

    def write(self, measurements: extrap.Measurements, out: Path) -> None:
        type(self).writer(measurements, out)

    def export(self, runs: Sequence[Run], data: RunData, out: Path, advance: Progress) -> None:
        self.check(runs)
        measurements = extrap.collect(runs, data, advance)
        self.write(measurements, out)


@exporters.register("extrap-text")
class ExtrapTextExporter(_ExtrapExporter):
    name: ClassVar[str] = "extrap-text"
    description: ClassVar[str] = "Extra-P text input (at most 4 parameters; extrap --text)"
    suffix: ClassVar[str] = ".txt"
    writer = extrap.write_text

    def check(self, runs: Sequence[Run]) -> None:
        extrap.check_text_parameters(extrap.parameter_names(runs))


@exporters.register("extrap-json")
class ExtrapJsonExporter(_ExtrapExporter):
    name: ClassVar[str] = "extrap-json"
    description: ClassVar[str] = "Extra-P JSON input, the newer format (extrap --json)"
    suffix: ClassVar[str] = ".json"
    writer = extrap.write_json


@exporters.register("extrap-jsonl")
class ExtrapJsonLinesExporter(_ExtrapExporter):
    name: ClassVar[str] = "extrap-jsonl"
    description: ClassVar[str] = "Extra-P JSON Lines input (extrap --json)"
    suffix: ClassVar[str] = ".jsonl"
    writer = extrap.write_jsonl


@exporters.register("extrap-talpas")
class ExtrapTalpasExporter(_ExtrapExporter):
    name: ClassVar[str] = "extrap-talpas"
    description: ClassVar[str] = "Extra-P TaLPas input (extrap --talpas)"
    suffix: ClassVar[str] = ".talpas"
    writer = extrap.write_talpas


@exporters.register("extrap")
class ExtrapExperimentExporter(_ExtrapExporter):
    """Needs the optional ``extrap`` package, which owns the experiment format."""

    name: ClassVar[str] = "extrap"
    description: ClassVar[str] = "Extra-P experiment (.extra-p); --model adds fitted models"
    suffix: ClassVar[str] = ".extra-p"
    supports_model: ClassVar[bool] = True

    def check(self, runs: Sequence[Run]) -> None:
        extrap.parameter_names(runs)
        extrap.require_extrap()

    def write(self, measurements: extrap.Measurements, out: Path) -> None:
        extrap.write_experiment(measurements, out, model=self.model)
