"""The Extra-P export through the run store and the `wattflow export` command."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from extrap.fileio.file_reader.json_file_reader import JsonFileReader
from extrap.fileio.file_reader.talpas_file_reader import (
    TalpasFileReader,
)
from extrap.fileio.file_reader.text_file_reader import TextFileReader

from wattflow.actors.exporters import exporters
from wattflow.formats import powerapi
from wattflow.formats.reports import EventReport, PowerReport, Report
from wattflow.formats.runs import ReportLists, Run

from .conftest import wattflow

START = datetime(2026, 8, 1, tzinfo=UTC)
PROCESSES = (1, 2, 4, 8, 16)
REPETITIONS = 3


def law(p: float) -> float:
    """The scaling law the runs follow: energy = 3 + 0.5·p·log2(p) J."""
    return 3 + 0.5 * p * math.log2(p)


def scaling_runs() -> tuple[list[Run], dict[str, list[Report]]]:
    """Runs over p with 3 repetitions each; target "solver" uses law(p) J in 10 s, of which
    the ``epoch`` phase (seconds 2 to 6) holds 40 %."""
    runs, reports = [], {}
    for p in PROCESSES:
        for repetition in range(REPETITIONS):
            identifier = f"scaling/solver/p{p}/{repetition}"
            start = START + timedelta(hours=p, minutes=repetition)
            energy = law(p) * (1 + 0.001 * (repetition - 1))  # a little run-to-run noise
            stream: list[Report] = [
                PowerReport(
                    timestamp=start + timedelta(seconds=second),
                    sensor="node",
                    target="solver",
                    power=0.0 if second == 0 else energy / 20,
                    metadata={"scope": scope},
                )
                for second in range(0, 11)
                for scope in ("cpu", "dram")
            ]
            events = [
                EventReport(timestamp=start + timedelta(seconds=2, milliseconds=1),
                            sensor="node", target="all", event="epoch_begin"),
                EventReport(timestamp=start + timedelta(seconds=6, milliseconds=1),
                            sensor="node", target="all", event="epoch_end"),
            ]  # fmt: skip
            reports[identifier] = sorted([*stream, *events], key=lambda r: r.timestamp)
            runs.append(
                Run(
                    id=identifier,
                    experiment="scaling",
                    benchmark="solver",
                    settings=f"p{p}",
                    repetition=repetition,
                    parameters={"p": float(p)},
                    start=start,
                    end=start + timedelta(seconds=10),
                    events=events,
                )
            )
    return runs, reports


def export(name: str, path: Path, *, model: bool = False) -> Path:
    runs, reports = scaling_runs()
    advanced: list[int] = []
    exporter = exporters.get(name)(model=model)
    exporter.export(runs, ReportLists(lambda run: reports[run.id]), path, advanced.append)
    assert sum(advanced) == sum(len(r) for r in reports.values()), "every report was counted"
    return path


def measured(experiment: Any, callpath: str, metric: str) -> dict[float, list[float]]:
    """{p: values of the repetitions} for one callpath and metric of an extrap experiment."""
    key = next(
        (c, m) for c, m in experiment.measurements if c.name == callpath and m.name == metric
    )
    return {
        measurement.coordinate[0]: sorted(measurement.values)
        if measurement.values is not None
        else [measurement.mean]
        for measurement in experiment.measurements[key]
    }


def expected_energy(share: float = 1.0) -> dict[float, list[float]]:
    return {
        float(p): sorted(law(p) * (1 + 0.001 * (r - 1)) * share for r in range(REPETITIONS))
        for p in PROCESSES
    }


def same_values(got: list[float], repetitions: list[float]) -> None:
    """The repetitions' values, or their mean where a reader keeps only that."""
    if len(got) == len(repetitions):
        assert got == pytest.approx(repetitions, rel=1e-9)
    else:
        assert got == pytest.approx([sum(repetitions) / len(repetitions)], rel=1e-9)


def reader(name: str) -> Any:
    chosen = {"text": TextFileReader, "json": JsonFileReader, "jsonl": JsonFileReader,
              "talpas": TalpasFileReader}[name]()  # fmt: skip
    chosen.keep_values = True
    return chosen


def test_the_export_command_writes_extrap_text_from_the_store(tmp_path: Path) -> None:
    runs, reports = scaling_runs()
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    for run in runs[:6]:
        source = tmp_path / f"{run.id.replace('/', '_')}.jsonl"
        source.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports[run.id]))
        done = wattflow(
            "runs", "import", str(source), "--store", store, "--experiment", run.experiment,
            "--benchmark", run.benchmark, "--settings", run.settings,
            "--repetition", str(run.repetition), "--param", f"p={run.parameters['p']:g}",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    out = tmp_path / "scaling.txt"
    done = wattflow("export", "extrap-text", "--store", store, "--experiment", "scaling",
                    "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    experiment = reader("text").read_experiment(out)
    values = measured(experiment, "solver", "energy")
    assert values[1.0] == pytest.approx(expected_energy()[1.0], rel=1e-9)
    assert values[2.0] == pytest.approx(expected_energy()[2.0], rel=1e-9)
