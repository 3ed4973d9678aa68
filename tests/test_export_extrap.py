"""The Extra-P exporters, read back with Extra-P's own readers and modeled with its own modeler.

Runs are built in memory with powers chosen so that every expected energy, power and duration
follows from the generating formulas by hand (constant power over whole seconds), not from the
exporter's code; each file is then loaded by the reader Extra-P itself uses for that format
and every value at every point and repetition is compared.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from extrap.entities.experiment import Experiment
from extrap.fileio.experiment_io import read_experiment
from extrap.fileio.file_reader.json_file_reader import (
    JsonFileReader,
)
from extrap.fileio.file_reader.talpas_file_reader import (
    TalpasFileReader,
)
from extrap.fileio.file_reader.text_file_reader import (
    TextFileReader,
)
from extrap.modelers.model_generator import ModelGenerator

from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import Exporter
from wattflow.formats import extrap
from wattflow.formats.reports import EventName, EventReport, PowerReport, Report
from wattflow.formats.runs import ReportLists, Run

START = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)
METRICS = (
    "energy", "power", "duration", "energy_cpu", "energy_dram", "energy_gpu", "energy_node",
)  # fmt: skip
FORMATS = {
    "extrap-text": "run.txt",
    "extrap-json": "run.json",
    "extrap-jsonl": "run.jsonl",
    "extrap-talpas": "run.talpas",
    "extrap": "run.extra-p",
}
Values = dict[tuple[str, str, tuple[float, ...]], list[float]]


def power(start: datetime, t: float, target: str, scope: str, watts: float) -> PowerReport:
    return PowerReport(
        timestamp=start + timedelta(seconds=t),
        sensor="node1",
        target=target,
        power=watts,
        metadata={"scope": scope, "socket": 0},
    )


def event(start: datetime, t: float, name: EventName) -> EventReport:
    return EventReport(
        timestamp=start + timedelta(seconds=t), sensor="node1", target="all", event=name
    )


class Recorded:
    """Runs with their reports, and a stream of each run's reports that counts what it
    hands out."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.reports: dict[str, list[Report]] = {}
        self.read = 0

    def add(self, run: Run, reports: list[Report]) -> None:
        self.runs.append(run)
        self.reports[run.id] = sorted(reports, key=lambda report: report.timestamp)

    def stream(self) -> Callable[[Run], Iterator[Report]]:
        def reports(run: Run) -> Iterator[Report]:
            for report in self.reports[run.id]:
                self.read += 1
                yield report

        return reports

    def total(self) -> int:
        return sum(map(len, self.reports.values()))


def make_run(
    number: int, parameters: dict[str, float], repetition: int, seconds: float, events: list[Any]
) -> Run:
    start = START + timedelta(hours=number)
    return Run(
        id=f"run-{number}",
        experiment="scaling",
        benchmark="solver",
        settings="250W",
        repetition=repetition,
        parameters=parameters,
        start=start,
        end=start + timedelta(seconds=seconds),
        events=[event(start, t, name) for t, name in events],
    )


# The main data set: two parameters (p, n), three points, two repetitions each. Target "app"
# has cpu and dram power in every run; "gpu0" has gpu power only in repetition 0, so it must be
# filled with zeros in repetition 1. An epoch runs from 2.5 s to 6.5 s of each 10 s run, so
# the reports at 3, 4, 5 and 6 s (each worth one second) fall inside it: 4 s of energy.
POINTS = [(1.0, 10.0), (2.0, 10.0), (4.0, 20.0)]
SECONDS = 10.0
EPOCH_SECONDS = 4.0


def cpu_w(p: float, n: float, repetition: int) -> float:
    return 10 * p + n + 0.25 * repetition


def dram_w(repetition: int) -> float:
    return 1.5 + 0.1 * repetition


def gpu_w(p: float) -> float:
    return 50.0 + p


def scaling_runs() -> Recorded:
    recorded = Recorded()
    number = 0
    for p, n in POINTS:
        for repetition in (1, 0):  # stored out of repetition order: the export sorts
            number += 1
            run = make_run(
                number, {"p": p, "n": n}, repetition, SECONDS,
                [(2.5, "epoch_begin"), (6.5, "epoch_end")],
            )  # fmt: skip
            reports: list[Report] = list(run.events)
            for t in range(int(SECONDS) + 1):
                reports.append(power(run.start, t, "app", "cpu", cpu_w(p, n, repetition)))
                reports.append(power(run.start, t, "app", "dram", dram_w(repetition)))
                if repetition == 0:
                    reports.append(power(run.start, t, "gpu0", "gpu", gpu_w(p)))
            recorded.add(run, reports)
    return recorded


def expected_scaling() -> Values:
    """By hand: constant power times the seconds it covers, zero where a target is absent."""
    values: Values = {}
    for p, n in POINTS:
        for repetition in (0, 1):
            watts = {
                "app": {"cpu": cpu_w(p, n, repetition), "dram": dram_w(repetition)},
                "gpu0": {"gpu": gpu_w(p)} if repetition == 0 else {},
            }
            for target, domains in watts.items():
                for callpath, seconds in ((target, SECONDS), (f"{target}->epoch", EPOCH_SECONDS)):
                    metrics = {
                        "energy": sum(domains.values()) * seconds,
                        "power": sum(domains.values()),
                        "duration": seconds,
                    }
                    for domain in ("cpu", "dram", "gpu", "node"):
                        metrics[f"energy_{domain}"] = domains.get(domain, 0.0) * seconds
                    for metric, value in metrics.items():
                        values.setdefault((callpath, metric, (p, n)), []).append(value)
    return values


def load(format_name: str, path: Path) -> Experiment:
    """The experiment as Extra-P's reader for that format loads it, repetitions kept."""
    if format_name == "extrap":
        return read_experiment(str(path))
    reader_class = {
        "extrap-text": TextFileReader,
        "extrap-json": JsonFileReader,
        "extrap-jsonl": JsonFileReader,
        "extrap-talpas": TalpasFileReader,
    }[format_name]
    reader = reader_class()
    reader.keep_values = True
    return reader.read_experiment(str(path))


def values_of(experiment: Experiment) -> Values:
    """Each (callpath, metric, point)'s repetitions, as Extra-P holds them.

    Extra-P 4.2's JSON Lines reader drops the repetitions even when asked to keep them (it does
    not pass ``keep_values`` on), so for it the values are rebuilt from the count, minimum and
    maximum it does keep; the data sets below have at most two distinct values per point, so
    that rebuild is exact.
    """
    values: Values = {}
    for measurements in experiment.measurements.values():
        for measurement in measurements:
            key = (
                str(measurement.callpath.name),
                str(measurement.metric.name),
                tuple(float(c) for c in measurement.coordinate),
            )
            if measurement.values is not None:
                values[key] = [float(v) for v in measurement.values]
            else:
                count = int(measurement.repetitions)
                assert count <= 2 or measurement.minimum == measurement.maximum
                low, high = float(measurement.minimum), float(measurement.maximum)
                values[key] = [low] * (count - 1) + [high] if count > 1 else [low]
    return values


def in_order(values: Values) -> Values:
    """Repetitions sorted, for readers that do not keep their order (JSON Lines)."""
    return {key: sorted(found) for key, found in values.items()}


def assert_values(found: Values, expected: Values) -> None:
    assert sorted(found) == sorted(expected)
    for key, wanted in expected.items():
        assert found[key] == pytest.approx(wanted, rel=1e-12, abs=1e-9), key


def export(
    name: str, recorded: Recorded, out: Path, *, model: bool = False
) -> tuple[Exporter, list[int]]:
    advanced: list[int] = []
    exporter = exporters.get(name)(model=model)
    exporter.export(recorded.runs, ReportLists(recorded.stream()), out, advanced.append)
    return exporter, advanced


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_every_format_reads_back_with_extrap_own_reader(format_name: str, tmp_path: Path) -> None:
    recorded = scaling_runs()
    out = tmp_path / FORMATS[format_name]
    exporter, advanced = export(format_name, recorded, out)

    assert exporter.name == format_name
    assert sum(advanced) == recorded.total() == recorded.read
    experiment = load(format_name, out)
    assert [p.name for p in experiment.parameters] == ["p", "n"]
    assert sorted(tuple(c) for c in experiment.coordinates) == POINTS
    assert sorted(m.name for m in experiment.metrics) == sorted(METRICS)
    assert sorted(c.name for c in experiment.callpaths) == [
        "app", "app->epoch", "gpu0", "gpu0->epoch",
    ]  # fmt: skip
    # Phases hang under their target in Extra-P's call tree.
    tree = {
        node.name: sorted(child.name for child in node.childs)
        for node in experiment.call_tree.childs
    }
    assert tree == {"app": ["epoch"], "gpu0": ["epoch"]}
    expected = expected_scaling()
    found = values_of(experiment)
    if format_name == "extrap-jsonl":
        found, expected = in_order(found), in_order(expected)
    assert_values(found, expected)
    means = {
        (m.callpath.name, m.metric.name, tuple(m.coordinate)): float(m.mean)
        for measurements in experiment.measurements.values()
        for m in measurements
    }
    assert means == pytest.approx({key: sum(v) / len(v) for key, v in expected.items()})
    if format_name == "extrap":
        assert experiment.modelers == []


def test_phase_energy_is_only_the_phase(tmp_path: Path) -> None:
    """Nested phases: energy and time go to the innermost one; the plain target holds the
    whole run."""
    recorded = Recorded()
    for number, p in enumerate((1.0, 2.0), start=1):
        run = make_run(
            number, {"p": p}, 0, 8.0,
            [(0.5, "train_begin"), (2.5, "epoch_begin"), (4.5, "epoch_end"), (6.5, "train_end")],
        )  # fmt: skip
        reports: list[Report] = [
            power(run.start, t, "job", "node", 100.0 * p + t) for t in range(9)
        ]
        recorded.add(run, reports)
    out = tmp_path / "phases.json"
    export("extrap-json", recorded, out)

    found = values_of(load("extrap-json", out))
    for p in (1.0, 2.0):
        # power at second t is 100p + t and covers (t-1, t]
        assert found[("job", "energy_node", (p,))] == [sum(100 * p + t for t in range(1, 9))]
        assert found[("job->epoch", "energy", (p,))] == [sum(100 * p + t for t in (3, 4))]
        assert found[("job->train", "energy", (p,))] == [sum(100 * p + t for t in (1, 2, 5, 6))]
        assert found[("job->epoch", "duration", (p,))] == [2.0]
        # train ran 6 s, 2 of them inside the epoch: its own time is 4 s, as its energy is
        assert found[("job->train", "duration", (p,))] == [4.0]
        assert found[("job->train", "power", (p,))] == [
            pytest.approx(sum(100 * p + t for t in (1, 2, 5, 6)) / 4)
        ]
        assert found[("job", "duration", (p,))] == [8.0]
        assert found[("job->epoch", "power", (p,))] == [pytest.approx((200 * p + 7) / 2)]


def test_node_energy_is_not_added_to_the_domains_it_holds(tmp_path: Path) -> None:
    """With --node-shares a target's node power is its cpu + dram + gpu: its total energy is
    the node figure, not that plus the domains again. A target without node power sums."""
    recorded = Recorded()
    run = make_run(1, {"p": 1.0}, 0, 4.0, [])
    reports: list[Report] = []
    for t in range(5):
        reports += [
            power(run.start, t, "job", "cpu", 10.0),
            power(run.start, t, "job", "gpu", 20.0),
            power(run.start, t, "job", "node", 30.0),
            power(run.start, t, "other", "cpu", 5.0),
            power(run.start, t, "other", "dram", 1.0),
        ]
    recorded.add(run, reports)
    out = tmp_path / "node.json"
    export("extrap-json", recorded, out)
    found = values_of(load("extrap-json", out))
    assert found[("job", "energy", (1.0,))] == [120.0]
    assert found[("job", "energy_cpu", (1.0,))] == [40.0]
    assert found[("job", "energy_node", (1.0,))] == [120.0]
    assert found[("job", "power", (1.0,))] == [30.0]
    assert found[("other", "energy", (1.0,))] == [24.0]


def energy_law(p: float) -> float:
    return 3 + 0.5 * p * math.log2(p)


def law_runs() -> Recorded:
    """p = 1…16, 3 repetitions: reports at 0, 1 and 2 s of half the energy each."""
    recorded = Recorded()
    number = 0
    for p in (1.0, 2.0, 4.0, 8.0, 16.0):
        for repetition in range(3):
            number += 1
            run = make_run(number, {"p": p}, repetition, 2.0, [])
            watts = energy_law(p) / 2
            reports: list[Report] = [power(run.start, t, "solver", "cpu", watts) for t in range(3)]
            recorded.add(run, reports)
    return recorded


def assert_p_log_p(experiment: Experiment, function: Any) -> None:
    """``3 + 0.5 * p^(1) * log2(p)^(1)``: Extra-P found the law the energies were made from."""
    assert len(function.compound_terms) == 1
    term = function.compound_terms[0]
    assert sorted((t.term_type, float(t.exponent)) for t in term.simple_terms) == [
        ("logarithm", 1.0),
        ("polynomial", 1.0),
    ]
    assert function.constant_coefficient == pytest.approx(3.0, abs=1e-6)
    assert term.coefficient == pytest.approx(0.5, abs=1e-6)
    text = function.to_string(*experiment.parameters)
    assert "p^(1" in text
    assert "log2(p)^(1" in text


def test_model_flag_saves_extrap_models(tmp_path: Path) -> None:
    recorded = law_runs()
    out = tmp_path / "law.extra-p"
    export("extrap", recorded, out, model=True)

    experiment = read_experiment(str(out))
    found = values_of(experiment)
    for p in (1.0, 2.0, 4.0, 8.0, 16.0):
        assert found[("solver", "energy", (p,))] == pytest.approx([energy_law(p)] * 3)
    assert len(experiment.modelers) == 1
    models = {
        (callpath.name, metric.name): model
        for (callpath, metric), model in experiment.modelers[0].models.items()
    }
    assert len(models) == len(METRICS)
    assert_p_log_p(experiment, models[("solver", "energy")].hypothesis.function)
    # duration is 2 s at every point: a constant model, no terms
    duration = models[("solver", "duration")].hypothesis.function
    assert duration.compound_terms == []
    assert duration.constant_coefficient == pytest.approx(2.0)


def test_extrap_modeler_on_the_text_export(tmp_path: Path) -> None:
    out = tmp_path / "law.txt"
    export("extrap-text", law_runs(), out)

    experiment = TextFileReader().read_experiment(str(out))
    generator = ModelGenerator(experiment)
    generator.model_all()
    models = {(c.name, m.name): model for (c, m), model in generator.models.items()}
    assert_p_log_p(experiment, models[("solver", "energy")].hypothesis.function)


def test_different_parameter_names_are_refused_before_reading(tmp_path: Path) -> None:
    recorded = Recorded()
    recorded.add(make_run(1, {"p": 1.0}, 0, 2.0, []), [power(START, 0, "a", "cpu", 1.0)])
    recorded.add(make_run(2, {"q": 1.0}, 0, 2.0, []), [power(START, 0, "a", "cpu", 1.0)])
    for format_name, file_name in FORMATS.items():
        with pytest.raises(ValueError, match=r"run 'run-2' has parameters \['q'\].*'run-1'"):
            export(format_name, recorded, tmp_path / file_name)
        assert not (tmp_path / file_name).exists()
    assert recorded.read == 0


def test_runs_without_parameters_are_refused(tmp_path: Path) -> None:
    recorded = Recorded()
    recorded.add(make_run(1, {}, 0, 2.0, []), [power(START, 0, "a", "cpu", 1.0)])
    with pytest.raises(ValueError, match=r"run 'run-1' has no parameters.*--param"):
        export("extrap-json", recorded, tmp_path / "x.json")


def five_parameter_runs() -> Recorded:
    recorded = Recorded()
    parameters = {name: 2.0 for name in ("a", "b", "c", "d", "e")}
    run = make_run(1, parameters, 0, 2.0, [])
    recorded.add(run, [power(run.start, t, "job", "cpu", 7.0) for t in range(3)])
    return recorded


def test_text_refuses_more_than_four_parameters_but_json_holds_them(tmp_path: Path) -> None:
    recorded = five_parameter_runs()
    with pytest.raises(ValueError, match=r"at most 4 parameters.*5 \(a, b, c, d, e\)"):
        export("extrap-text", recorded, tmp_path / "five.txt")
    assert recorded.read == 0
    assert not (tmp_path / "five.txt").exists()

    export("extrap-json", recorded, tmp_path / "five.json")
    experiment = load("extrap-json", tmp_path / "five.json")
    assert len(experiment.parameters) == 5
    assert values_of(experiment)[("job", "energy", (2.0,) * 5)] == [14.0]


def test_names_survive_every_format(tmp_path: Path) -> None:
    """';' (TaLPas separators), '->' (Extra-P's callpath separator) and runs of whitespace."""
    recorded = Recorded()
    for number, p in enumerate((1.0, 2.0), start=1):
        run = make_run(number, {"p": p}, 0, 2.0, [])
        reports: list[Report] = [power(run.start, t, "x->y;z  w", "cpu", p) for t in range(3)]
        recorded.add(run, reports)
    for format_name, file_name in FORMATS.items():
        export(format_name, recorded, tmp_path / file_name)
        found = values_of(load(format_name, tmp_path / file_name))
        assert found[("x=>y;z w", "energy", (2.0,))] == [4.0], format_name


def test_targets_that_print_alike_are_refused(tmp_path: Path) -> None:
    recorded = Recorded()
    run = make_run(1, {"p": 1.0}, 0, 2.0, [])
    recorded.add(
        run, [power(run.start, t, name, "cpu", 1.0) for t in range(3) for name in ("a b", "a  b")]
    )
    with pytest.raises(ValueError, match="both become callpath 'a b'"):
        export("extrap-json", recorded, tmp_path / "x.json")


def test_model_flag_only_for_experiments() -> None:
    for name in ("extrap-text", "extrap-json", "extrap-jsonl", "extrap-talpas"):
        with pytest.raises(ValueError, match=r"--model adds fitted models to \.extra-p"):
            exporters.get(name)(model=True)
    assert exporters.get("extrap")(model=True).model is True


def test_missing_extrap_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``extrap``, ``.extra-p`` export says how to install it; the other formats work."""
    recorded = law_runs()
    monkeypatch.setitem(sys.modules, "extrap", None)  # what Python does for a missing package
    with pytest.raises(ValueError, match="pip install extrap"):
        export("extrap", recorded, tmp_path / "x.extra-p")
    assert recorded.read == 0
    export("extrap-jsonl", recorded, tmp_path / "x.jsonl")
    monkeypatch.undo()
    assert (
        values_of(load("extrap-jsonl", tmp_path / "x.jsonl"))[("solver", "energy", (1.0,))]
        == [3.0] * 3
    )


def test_text_numbers_follow_the_grammar() -> None:
    """The text grammar has no exponents: tiny and huge values are written out in full."""
    assert extrap.text_number(1e-05) == "0.00001"
    assert extrap.text_number(2.5e20) == "250000000000000000000"
    assert extrap.text_number(4.0) == "4"
    assert float(extrap.text_number(0.1 + 0.2)) == 0.1 + 0.2
    with pytest.raises(ValueError, match="not a number"):
        extrap.text_number(math.inf)


def test_no_power_at_all_is_refused(tmp_path: Path) -> None:
    recorded = Recorded()
    run = make_run(1, {"p": 1.0}, 0, 2.0, [(0.5, "epoch_begin"), (1.5, "epoch_end")])
    recorded.add(run, list(run.events))
    with pytest.raises(ValueError, match="no PowerReport"):
        export("extrap-talpas", recorded, tmp_path / "x.talpas")


def test_every_name_is_registered() -> None:
    assert {name: exporters.get(name).name for name in FORMATS} == {name: name for name in FORMATS}
    assert set(FORMATS) <= set(exporters.names())
