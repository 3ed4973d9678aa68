"""Extra-P's input formats: text, JSON, JSON Lines and TaLPas, from the runs' summaries.

Extra-P models how a metric grows with parameters, from measurements at several points. Here:

- a **point** is a distinct tuple of the runs' parameters (every run must name the same
  parameters); the runs at a point are its **repetitions**, one value each;
- a **callpath** is a target, or ``target->phase`` for the phases the run's events mark;
- the **metrics** are ``energy`` (J, every domain), ``power`` (mean W over the run or the
  phase), ``duration`` (s) and ``energy_cpu``, ``energy_dram``, ``energy_gpu``,
  ``energy_node`` (J per domain).

Extra-P refuses a file where a (callpath, metric) lacks a value at some point, so a target
that a run did not see counts 0 in that run. Numbers are written without exponents, as the
text format's grammar asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import orjson

from wattflow.formats.runs import DOMAINS, RunSummary

METRICS = ("energy", "power", "duration", *(f"energy_{domain}" for domain in DOMAINS))
TEXT_MAX_PARAMETERS = 4

Point = tuple[float, ...]


@dataclass
class Table:
    """Values per (callpath, metric) and point, one per repetition, in run order."""

    parameters: list[str]
    points: list[Point] = field(default_factory=list)
    values: dict[tuple[str, str], dict[Point, list[float]]] = field(default_factory=dict)

    def callpaths(self) -> list[str]:
        return sorted({callpath for callpath, _ in self.values})


def _value(summary: RunSummary, target: str, phase: str | None, metric: str) -> float:
    if metric == "energy":
        return summary.energy(target, None, phase)
    if metric == "power":
        return summary.mean_power_w(target, None, phase)
    if metric == "duration":
        return summary.duration_s(phase)
    return summary.energy(target, metric.removeprefix("energy_"), phase)


def table(summaries: Sequence[RunSummary]) -> Table:
    """Lay the runs out as Extra-P's measurements.

    Raises:
        ValueError: runs that do not all name the same parameters, or no parameter at all.
    """
    if not summaries:
        raise ValueError("no runs to export")
    names = sorted(summaries[0].run.parameters)
    if not names:
        raise ValueError(
            f"run {summaries[0].run.id} has no parameters: Extra-P models values over "
            "parameters (give them with `wattflow runs import --param NAME=VALUE`)"
        )
    for summary in summaries:
        if sorted(summary.run.parameters) != names:
            raise ValueError(
                f"run {summary.run.id} has parameters {sorted(summary.run.parameters)}, "
                f"the others {names}: Extra-P needs the same ones in every run"
            )
    result = Table(parameters=names)
    callpaths: set[tuple[str, str | None]] = set()
    for summary in summaries:
        for target in summary.targets():
            callpaths.add((target, None))
            callpaths.update((target, phase) for phase in summary.phases() if phase)
    for summary in summaries:
        point = tuple(summary.run.parameters[name] for name in names)
        if point not in result.points:
            result.points.append(point)
        for target, phase in sorted(callpaths, key=lambda c: (c[0], c[1] or "")):
            callpath = target if phase is None else f"{target}->{phase}"
            for metric in METRICS:
                cell = result.values.setdefault((callpath, metric), {})
                cell.setdefault(point, []).append(_value(summary, target, phase, metric))
    result.points.sort()
    return result


def number(value: float) -> str:
    """A number as the text format's grammar takes it: digits and a point, no exponent."""
    return str(np.format_float_positional(value, trim="-"))


def write_text(data: Table, path: Path) -> None:
    """The text format: PARAMETER, POINTS, then METRIC / REGION / DATA sections.

    Raises:
        ValueError: more parameters than the format takes.
    """
    if len(data.parameters) > TEXT_MAX_PARAMETERS:
        raise ValueError(
            f"{len(data.parameters)} parameters: Extra-P's text format takes at most "
            f"{TEXT_MAX_PARAMETERS}; export extrap-json or extrap instead"
        )
    with path.open("w", encoding="utf-8") as out:
        out.write("# written by wattflow\n")
        out.write(f"PARAMETER {' '.join(data.parameters)}\n")
        points = " ".join(f"({' '.join(number(c) for c in point)})" for point in data.points)
        out.write(f"POINTS {points}\n")
        for metric in METRICS:
            out.write(f"METRIC {metric}\n")
            for callpath in data.callpaths():
                out.write(f"REGION {callpath}\n")
                cell = data.values[(callpath, metric)]
                for point in data.points:
                    out.write(f"DATA {' '.join(number(v) for v in cell[point])}\n")


def write_json(data: Table, path: Path) -> None:
    """The (newer) JSON format: parameters, then measurements by callpath and metric."""
    measurements: dict[str, dict[str, list[dict[str, list[float]]]]] = {}
    for (callpath, metric), cell in sorted(data.values.items()):
        measurements.setdefault(callpath, {})[metric] = [
            {"point": list(point), "values": cell[point]} for point in data.points
        ]
    document = {"parameters": data.parameters, "measurements": measurements}
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def _lines(data: Table, out: IO[bytes], talpas: bool) -> None:
    for (callpath, metric), cell in sorted(data.values.items()):
        for point in data.points:
            parameters = dict(zip(data.parameters, point, strict=True))
            if talpas:
                # One line per value, fields separated by ';' as the TaLPas format has them.
                for value in cell[point]:
                    out.write(
                        b'{"parameters":' + orjson.dumps(parameters)
                        + b';"metric":' + orjson.dumps(metric)
                        + b';"callpath":' + orjson.dumps(callpath)
                        + b';"value":' + orjson.dumps(value) + b"}\n"
                    )  # fmt: skip
            else:
                record = {"params": parameters, "callpath": callpath, "metric": metric,
                          "value": cell[point]}  # fmt: skip
                out.write(orjson.dumps(record) + b"\n")


def write_jsonl(data: Table, path: Path) -> None:
    """JSON Lines: one line per (callpath, metric, point) with its repetitions' values."""
    with path.open("wb") as out:
        _lines(data, out, talpas=False)


def write_talpas(data: Table, path: Path) -> None:
    """TaLPas: one line per value."""
    with path.open("wb") as out:
        _lines(data, out, talpas=True)
