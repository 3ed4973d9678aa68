"""Extra-P inputs from measurement runs: energy, power and duration as functions of parameters.

Extra-P fits performance models ``f(p, q, …)`` to values measured at several points of a
parameter space, each point measured several times. wattflow maps its runs onto that:

- a **point** is one distinct tuple of the runs' free parameters (:attr:`Run.parameters`, set by
  ``wattflow runs import --param NAME=VALUE``); every run must name the same parameters;
- the **repetitions** at a point are the runs with that tuple, one value per run (ordered by
  the run's repetition number, then its id);
- a **callpath** is a target (the whole run) or ``target->phase`` for each phase its run's
  events mark (``epoch``, ``train``…: only the energy measured inside that phase, and the time
  spent in it, neither counting a phase nested in it). Energy outside every phase counts only
  towards the plain target;
- the **metrics** are ``energy`` (J: the target's ``node`` energy where the node formula gave
  it one, which already holds its cpu, dram and gpu; else summed over its domains), ``power`` (W,
  that energy over the duration), ``duration`` (s, the run's or the phase's), and the energy of
  each domain: ``energy_cpu``, ``energy_dram``, ``energy_gpu``, ``energy_node`` (J).

Extra-P refuses a file where some (callpath, metric) lacks a value at some point, so a target
(or phase) missing from a run gets 0 J and 0 W in that run; its duration stays the run's (or
the phase's, 0 s where the run never entered it), because the time is the run's, not the
target's.

Extra-P splits callpaths at ``->`` and its text reader folds runs of whitespace, so names are
made safe once, the same way for every format: whitespace runs become one space, ``->`` inside
a target or phase name becomes ``=>``, and an empty name becomes ``_``.

Memory: :func:`collect` folds each run's power rows with :func:`summarise_power` as they arrive
(no other report is read) and keeps only the summaries (one value per target, phase and
domain), so it grows with runs times keys, never with reports. The writers then hold nothing
but that table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import orjson

from wattflow.formats.errors import WattflowError
from wattflow.formats.runs import DOMAINS, Run, RunData, RunSummary, summarise_power

METRICS: tuple[str, ...] = (
    "energy",
    "power",
    "duration",
    *(f"energy_{domain}" for domain in DOMAINS),
)
"""Every metric written, in the order written."""

UNITS: dict[str, str] = {"energy": "J", "power": "W", "duration": "s"} | {
    f"energy_{domain}": "J" for domain in DOMAINS
}

MAX_TEXT_PARAMETERS = 4
"""Extra-P's text reader refuses files with more parameters."""

Point = tuple[float, ...]


class ExtrapError(WattflowError, ValueError):
    """Runs that cannot become an Extra-P input, or a missing optional dependency.

    A ``ValueError`` so that the command reports it as bad usage, in one line.
    """


@dataclass
class Measurements:
    """The runs as Extra-P sees them: values per (callpath, metric, point), one per run."""

    parameters: tuple[str, ...]
    points: list[Point]
    """Sorted, each with one coordinate per parameter."""
    callpaths: list[str]
    """Each target, followed by its ``target->phase`` callpaths."""
    values: dict[tuple[str, str, Point], list[float]] = field(default_factory=dict)
    """(callpath, metric, point) → one value per run at that point; complete."""

    def at(self, callpath: str, metric: str, point: Point) -> list[float]:
        """The repetitions of ``metric`` for ``callpath`` at ``point``."""
        return self.values[(callpath, metric, point)]

    def series(self) -> Iterator[tuple[str, str]]:
        """Every (callpath, metric), callpath-major, in the order the files list them."""
        for callpath in self.callpaths:
            for metric in METRICS:
                yield callpath, metric


def safe_name(name: str) -> str:
    """A target or phase name Extra-P reads back unchanged as one callpath element."""
    return " ".join(name.split()).replace("->", "=>") or "_"


def parameter_names(runs: Sequence[Run]) -> tuple[str, ...]:
    """The runs' common parameter names, in the first run's order.

    Checked before any report is read, so a bad selection fails at once rather than after a
    long pass over the store.

    Raises:
        ExtrapError: no runs, no parameters, a run whose names differ, or a value that is not
            a finite number.
    """
    if not runs:
        raise ExtrapError("no runs to export")
    names = tuple(runs[0].parameters)
    if not names:
        raise ExtrapError(
            f"run {runs[0].id!r} has no parameters; Extra-P models values as functions of "
            "parameters: give them with `wattflow runs import … --param NAME=VALUE`"
        )
    for run in runs:
        if set(run.parameters) != set(names):
            raise ExtrapError(
                f"run {run.id!r} has parameters {sorted(run.parameters)}, but run "
                f"{runs[0].id!r} has {sorted(names)}; every exported run needs the same names"
            )
        for name, value in run.parameters.items():
            if not math.isfinite(value):
                raise ExtrapError(f"run {run.id!r}: parameter {name!r} is {value!r}")
    return names


def collect(runs: Sequence[Run], data: RunData, advance: Callable[[int], None]) -> Measurements:
    """Read every run's power once and lay the results out as Extra-P's points and values.

    ``advance`` is called with the number of reports read, and for each run at last with the
    number of its reports of other kinds, which are not read at all.

    Raises:
        ExtrapError: see :func:`parameter_names`; also when the runs hold no power at all,
            or when two targets' names become one after :func:`safe_name`.
    """
    names = parameter_names(runs)
    summaries: list[tuple[Point, RunSummary]] = []
    for run in runs:
        summary = summarise_power(run, data.power(run), advance)
        advance(max(data.count(run) - summary.reports, 0))
        summaries.append((tuple(float(run.parameters[name]) for name in names), summary))

    # callpath → (target, phase); phase None is the whole run
    keys: dict[str, tuple[str, str | None]] = {}
    for _, summary in summaries:
        for target, phase, _ in summary.energy_j:
            _claim(keys, safe_name(target), (target, None))
            if phase:
                _claim(keys, f"{safe_name(target)}->{safe_name(phase)}", (target, phase))
    if not keys:
        raise ExtrapError(
            "the selected runs hold no PowerReport with a cpu, dram, gpu or node scope"
        )
    callpaths = sorted(keys, key=lambda name: (safe_name(keys[name][0]), keys[name][1] or ""))

    points = sorted({point for point, _ in summaries})
    measurements = Measurements(names, points, callpaths)
    ordered = sorted(summaries, key=lambda item: (item[1].run.repetition, item[1].run.id))
    for point, summary in ordered:
        for callpath, (target, within) in keys.items():
            for metric, value in _metrics(summary, target, within):
                measurements.values.setdefault((callpath, metric, point), []).append(value)
    return measurements


def _claim(keys: dict[str, tuple[str, str | None]], name: str, key: tuple[str, str | None]) -> None:
    """Add a callpath, refusing two different targets (or phases) that print as one."""
    held = keys.setdefault(name, key)
    if held != key:
        raise ExtrapError(
            f"targets or phases {held!r} and {key!r} both become callpath {name!r} "
            "(whitespace folded, '->' written '=>'); Extra-P would merge them"
        )


def _metrics(summary: RunSummary, target: str, phase: str | None) -> Iterator[tuple[str, float]]:
    """The metrics of one callpath in one run, 0 where the target has no energy there."""
    yield "energy", summary.energy(target, phase=phase)
    yield "power", summary.mean_power_w(target, phase=phase)
    yield "duration", summary.duration_s(phase)
    for domain in DOMAINS:
        yield f"energy_{domain}", summary.energy(target, domain, phase)


def _finite(value: float, where: str) -> float:
    if not math.isfinite(value):
        raise ExtrapError(f"{where}: {value!r} is not a number Extra-P can read")
    return value


def text_number(value: float) -> str:
    """A number in the text format's grammar: optional sign, digits, optional fraction.

    The grammar has no exponent, so ``1e-05`` is written ``0.00001``; the digits are Python's
    shortest round-tripping ones, so the value read back is the value written.
    """
    _finite(value, "text format")
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return format(Decimal(repr(value)), "f")


def _json(value: Any) -> bytes:
    return orjson.dumps(value)


def write_text(measurements: Measurements, path: Path) -> None:
    """Extra-P's text format: PARAMETER, POINTS, then REGION / METRIC / DATA per point.

    Raises:
        ExtrapError: more than :data:`MAX_TEXT_PARAMETERS` parameters, or a parameter name
            that is empty or holds whitespace (the PARAMETER line is split at spaces).
    """
    check_text_parameters(measurements.parameters)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        units = ", ".join(f"{metric} {unit}" for metric, unit in UNITS.items())
        out.write(f"# wattflow energy measurements; units: {units}\n")
        out.write(f"PARAMETER {' '.join(measurements.parameters)}\n")
        if len(measurements.parameters) == 1:
            coordinates = " ".join(text_number(point[0]) for point in measurements.points)
        else:
            coordinates = " ".join(
                "(" + " ".join(map(text_number, point)) + ")" for point in measurements.points
            )
        out.write(f"POINTS {coordinates}\n")
        for callpath in measurements.callpaths:
            out.write(f"REGION {callpath}\n")
            for metric in METRICS:
                out.write(f"METRIC {metric}\n")
                for point in measurements.points:
                    data = " ".join(map(text_number, measurements.at(callpath, metric, point)))
                    out.write(f"DATA {data}\n")


def check_text_parameters(parameters: Sequence[str]) -> None:
    """Refuse what the text format cannot hold, before any report is read.

    Raises:
        ExtrapError: as :func:`write_text`.
    """
    if len(parameters) > MAX_TEXT_PARAMETERS:
        raise ExtrapError(
            f"Extra-P's text format holds at most {MAX_TEXT_PARAMETERS} parameters; these runs "
            f"have {len(parameters)} ({', '.join(parameters)}): export extrap-json instead"
        )
    for name in parameters:
        if not name or name != "".join(name.split()) or name.startswith("#"):
            raise ExtrapError(
                f"parameter {name!r} cannot be written in Extra-P's text format "
                "(no whitespace, no leading '#'): export extrap-json instead"
            )


def write_json(measurements: Measurements, path: Path) -> None:
    """Extra-P's newer JSON format: parameters, then callpath → metric → points and values."""
    document = {
        "parameters": list(measurements.parameters),
        "measurements": {
            callpath: {
                metric: [
                    {
                        "point": list(point),
                        "values": _checked(measurements, callpath, metric, point),
                    }
                    for point in measurements.points
                ]
                for metric in METRICS
            }
            for callpath in measurements.callpaths
        },
    }
    Path(path).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def write_jsonl(measurements: Measurements, path: Path) -> None:
    """JSON Lines: one line per (callpath, metric, point), its repetitions as a list."""
    with open(path, "wb") as out:
        for callpath, metric in measurements.series():
            for point in measurements.points:
                line = {
                    "params": dict(zip(measurements.parameters, point, strict=True)),
                    "callpath": callpath,
                    "metric": metric,
                    "value": _checked(measurements, callpath, metric, point),
                }
                out.write(_json(line) + b"\n")


def _talpas_json(value: Any) -> bytes:
    """JSON with ``;`` escaped: the TaLPas reader turns every ``;`` of a line into ``,``.

    Outside strings orjson writes no ``;``, so only names are touched, and ``\\u003b`` reads
    back as ``;``.
    """
    return _json(value).replace(b";", b"\\u003b")


def write_talpas(measurements: Measurements, path: Path) -> None:
    """TaLPas: one line per value (per run), fields separated by ``;`` as the format has it."""
    with open(path, "wb") as out:
        for callpath, metric in measurements.series():
            callpath_json = _talpas_json(callpath)
            metric_json = _talpas_json(metric)
            for point in measurements.points:
                parameters = _talpas_json(dict(zip(measurements.parameters, point, strict=True)))
                for value in _checked(measurements, callpath, metric, point):
                    _write_talpas_line(out, parameters, metric_json, callpath_json, value)


def _write_talpas_line(
    out: IO[bytes], parameters: bytes, metric: bytes, callpath: bytes, value: float
) -> None:
    out.write(b'{"parameters":' + parameters + b';"metric":' + metric + b';"callpath":' + callpath)
    out.write(b';"value":' + _json(value) + b"}\n")


def _checked(measurements: Measurements, callpath: str, metric: str, point: Point) -> list[float]:
    values = measurements.at(callpath, metric, point)
    for value in values:
        _finite(value, f"{callpath} {metric} at {point}")
    return values


def require_extrap() -> None:
    """Fail early, before reading reports, when the ``.extra-p`` writer cannot work.

    Raises:
        ExtrapError: when the ``extrap`` package is not installed.
    """
    try:
        import extrap  # noqa: F401
    except ImportError:
        raise ExtrapError(
            "writing .extra-p experiments needs Extra-P's own package: pip install extrap "
            "(or pip install 'wattflow[extrap]')"
        ) from None


def write_experiment(measurements: Measurements, path: Path, *, model: bool = False) -> None:
    """Extra-P's experiment ZIP (``.extra-p``), built and saved with Extra-P's own classes.

    The ZIP's ``experiment.json`` is a serialised ``Experiment`` and its repetitions sit in
    Extra-P's private NumPy value files, so the owner's serialiser is the faithful writer. With
    ``model``, Extra-P's default modeler (the one its command line and GUI use) fits a model
    per (callpath, metric) over the mean of the repetitions, and the models are saved with the
    experiment; fewer than 5 points per parameter give constant models and Extra-P's warning.

    Raises:
        ExtrapError: when ``extrap`` is not installed, or a value is not a finite number.
    """
    require_extrap()
    from extrap.entities.callpath import Callpath
    from extrap.entities.coordinate import Coordinate
    from extrap.entities.experiment import Experiment
    from extrap.entities.measurement import Measurement
    from extrap.entities.metric import Metric
    from extrap.entities.parameter import Parameter
    from extrap.fileio import experiment_io, io_helper
    from extrap.modelers.model_generator import ModelGenerator

    experiment = Experiment()
    for name in measurements.parameters:
        experiment.add_parameter(Parameter(name))
    coordinates = {point: Coordinate(point) for point in measurements.points}
    for coordinate in coordinates.values():
        experiment.add_coordinate(coordinate)
    metrics = {metric: Metric(metric) for metric in METRICS}
    for metric in metrics.values():
        experiment.add_metric(metric)
    for callpath_name in measurements.callpaths:
        callpath = Callpath(callpath_name)
        experiment.add_callpath(callpath)
        for metric_name, metric in metrics.items():
            for point, coordinate in coordinates.items():
                values = _checked(measurements, callpath_name, metric_name, point)
                experiment.add_measurement(
                    Measurement(coordinate, callpath, metric, values, keep_values=True)
                )
    experiment.call_tree = io_helper.create_call_tree(experiment.callpaths)
    io_helper.validate_experiment(experiment)
    if model:
        ModelGenerator(experiment, name="wattflow").model_all()
    experiment_io.write_experiment(experiment, str(path))
