"""Per-target accuracy of SmartWatts in wattflow on simulated nodes whose true power is known.

Runs the formula in this process on the streams of ``generate_hwpc.py`` (the plain one, nodes
with each of the phenomena production nodes show, alone and all together, and one socket crowded
with 20–30 containers on 4–8 cpus), and prints per stream
and scope, against the ground truth after a learning phase: the per-target MAPE with every
container's rows pooled (the figure the benchmark always printed), and beside it the figures per
container (the worst container's MAPE; the share of rows within 5 %, pooled and in the worst
container), the share of rows it covers, and how far the targets' powers are from adding up to
the measured RAPL power.

It takes seconds and needs nothing but wattflow, so that a test can guard the figures;
``side_by_side.py --phenomena …`` measures the same streams beside SmartWatts 2.4.1. Run it from
the repository root:

    python benchmarks/accuracy.py
    python benchmarks/accuracy.py --stream all-16 --compat smartwatts-2.4
    python benchmarks/accuracy.py --stream crowded-4x30 --per-target --min-truth-w 0
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_hwpc import (
    PHENOMENA,
    RAPL_UNIT,
    Block,
    Machine,
    Phenomena,
    containers_named,
    node_containers,
    simulate,
    simulate_node,
    tick_views,
)

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.formats.batch import expand
from wattflow.formats.reports import HWPCReport, PowerReport

LEARNING_TICKS = 80
"""Ticks left out of the figures at the start of a stream: the models' learning phase."""
MIN_TRUTH_W = 1.0
"""Rows whose true power is under this are left out of the MAPE (and of coverage), as a few
milliwatts off a near-idle target would say nothing of the model but swamp the mean. On a
crowded socket that leaves out most rows, and whole containers (``--min-truth-w 0`` takes
every row whose truth is above 0 W): see ``docs/benchmarks.md``."""
SCOPES = ("cpu", "dram")


@dataclass(frozen=True)
class Stream:
    """A simulated sensor's recording: the node, its containers and what it shows."""

    name: str
    phenomena: Phenomena | None
    """``None``: the plain simulation of ``generate_hwpc.py`` (what its recordings always were)."""
    sockets: int = 2
    cpus_per_socket: int = 4
    containers: int = 16
    ticks: int = 400
    seed: int = 42

    def machine(self) -> Machine:
        return Machine(sockets=self.sockets, cpus_per_socket=self.cpus_per_socket)

    def blocks(self) -> Iterator[Block]:
        """The recording, a block of ticks at a time."""
        if self.phenomena is None:
            return simulate(
                self.machine(), containers_named(self.containers), self.ticks, seed=self.seed
            )
        return simulate_node(
            self.machine(),
            node_containers(self.containers, heterogeneous=self.phenomena.heterogeneous),
            self.ticks,
            self.phenomena,
            seed=self.seed,
        )

    def describe(self) -> str:
        shape = f"{self.sockets}×{self.cpus_per_socket} cpus, {self.containers} containers"
        what = "plain" if self.phenomena is None else f"phenomena {self.phenomena.label}"
        return f"{shape}, {self.ticks} ticks, {what}"


def streams() -> list[Stream]:
    """The streams the figures are kept for: today's plain recordings, a node with each
    phenomenon alone, and with all of them, on the two shapes the figures started from."""
    found = [
        Stream("plain-10", None, containers=10, ticks=600),
        Stream("plain-16", None),
        Stream("none-16", Phenomena()),
    ]
    found += [Stream(f"{name}-16", Phenomena.parse(name)) for name in PHENOMENA]
    found += [
        Stream("all-16", Phenomena.parse("all")),
        Stream("all-24", Phenomena.parse("all"), sockets=1, cpus_per_socket=8, containers=24),
    ]
    return found


CROWDED_SHAPES = ((4, 20), (4, 24), (4, 30), (6, 20), (6, 24), (6, 30), (8, 20), (8, 30))
"""(cpus, containers) of the crowded streams: 20–30 containers on 4–8 cpus of one socket (8 cpus
with 24 containers is ``all-24``)."""


def crowded_streams() -> list[Stream]:
    """One socket crowded with 20–30 containers on 4–8 cpus, with every phenomenon (DVFS,
    phases, heterogeneous containers, jitter, multiplexing), seed 42: each container gets a
    fraction of a cpu, and the socket's dynamic power is a few watts against the same
    unexplained power as a larger socket's."""
    return [
        Stream(
            f"crowded-{cpus}x{containers}",
            Phenomena.parse("all"),
            sockets=1,
            cpus_per_socket=cpus,
            containers=containers,
        )
        for cpus, containers in CROWDED_SHAPES
    ]


Key = tuple[int, str]
"""(tick, target)"""


@dataclass
class Recording:
    """A stream's reports, and per scope, tick and target the power that should be found."""

    reports: list[HWPCReport]
    truth: dict[str, dict[Key, float]]
    """Per scope: the target's power summed over sockets, idle shared in proportion to
    activity, as SmartWatts-style formulas attribute it."""
    tick_of: dict[int, int]
    """Unix ms → tick number."""
    rapl_w: dict[tuple[int, str, str], float]
    """(tick, socket, scope) → the power RAPL measured over the interval the timestamps give."""


def record(stream: Stream) -> Recording:
    """Simulate a stream into HWPCReports and its ground truth."""
    reports: list[HWPCReport] = []
    truth: dict[str, dict[Key, float]] = {scope: {} for scope in SCOPES}
    tick_of: dict[int, int] = {}
    rapl_w: dict[tuple[int, str, str], float] = {}
    previous_ms: int | None = None
    tick = 0
    for block in stream.blocks():
        attributed = dict(zip(SCOPES, block.attributed(), strict=True))
        for t, view in enumerate(tick_views(block)):
            tick_of[view.millis] = tick
            for document in view.reports():
                reports.append(_report(document))
            for scope, values in attributed.items():
                for k, target in enumerate(block.targets):
                    truth[scope][(tick, target)] = float(values[t, k].sum())
            if previous_ms is not None:
                interval_s = (view.millis - previous_ms) / 1000
                for s in range(block.machine.sockets):
                    dram, pkg = block.rapl[t, s, 0], block.rapl[t, s, 1]
                    rapl_w[(tick, str(s), "cpu")] = pkg / RAPL_UNIT / interval_s
                    rapl_w[(tick, str(s), "dram")] = dram / RAPL_UNIT / interval_s
            previous_ms = view.millis
            tick += 1
    return Recording(reports, truth, tick_of, rapl_w)


def _report(document: dict[str, Any]) -> HWPCReport:
    stamp = datetime.fromisoformat(document["timestamp"]).replace(tzinfo=UTC)
    return HWPCReport(
        timestamp=stamp,
        sensor=document["sensor"],
        target=document["target"],
        groups=document["groups"],
    )


def estimate(recording: Recording, settings: dict[str, Any]) -> list[PowerReport]:
    """Run SmartWatts over the recording, as ``wattflow run`` does; its PowerReports."""
    config = SmartWattsConfig(**settings)
    SmartWattsFormula.prepare(config)
    formula = SmartWattsFormula(config, recording.reports[0].sensor)
    out = Output()
    formula.process(list(recording.reports), out)
    formula.flush(out)
    assert not out.rejected, out.rejected[:3]
    return [r for r in expand(out.items()) if isinstance(r, PowerReport)]


@dataclass
class Accuracy:
    """One scope's per-target figures on a stream, after the learning phase."""

    scope: str
    rows: int
    """Target-ticks whose true power is at least the floor (:data:`MIN_TRUTH_W`)."""
    covered: int
    """Those that got an estimate."""
    mape_percent: float
    """Over the covered rows of every target pooled: each row counts once, so a target with
    many rows weighs more, and one target far off can hide behind the others' rows."""
    worst_rapl_gap_w: float
    """The largest |Σ targets − RAPL| of a socket on a tick (default mode: 0 but rounding)."""
    per_target: dict[str, float] = field(default_factory=dict)
    """MAPE per target, %, over its covered rows: the issue's "MAPE per container"."""
    within: int = 0
    """Covered rows within :data:`WITHIN_PERCENT` of the truth."""
    per_target_within: dict[str, float] = field(default_factory=dict)
    """Per target, the share (%) of its covered rows within :data:`WITHIN_PERCENT`."""
    targets: int = 0
    """Targets with a row after the learning phase, whatever their power: those of
    :attr:`per_target` are the ones with a row at or above the floor."""

    @property
    def coverage_percent(self) -> float:
        return 100 * self.covered / self.rows if self.rows else math.nan

    @property
    def worst_target_mape_percent(self) -> float:
        """The largest per-target MAPE: what "≤ 5 % MAPE per container" is checked against."""
        return max(self.per_target.values(), default=math.nan)

    @property
    def within_percent(self) -> float:
        """The share of covered rows within :data:`WITHIN_PERCENT` of the truth, pooled."""
        return 100 * self.within / self.covered if self.covered else math.nan

    @property
    def worst_target_within_percent(self) -> float:
        """The smallest per-target share of rows within :data:`WITHIN_PERCENT`."""
        return min(self.per_target_within.values(), default=math.nan)


WITHIN_PERCENT = 5.0
"""The error a row must be within to count in :attr:`Accuracy.within`."""


def _estimates(
    recording: Recording, powers: Sequence[PowerReport], scope: str
) -> tuple[dict[Key, float], dict[tuple[int, str], float]]:
    """The scope's per-target estimates summed over sockets, and each socket's sum per tick."""
    estimated: dict[Key, float] = defaultdict(float)
    sums: dict[tuple[int, str], float] = defaultdict(float)
    for report in powers:
        metadata = report.metadata
        if metadata.get("scope") != scope or report.target == "global":
            continue
        millis = round(report.timestamp.timestamp() * 1000)
        tick = recording.tick_of[millis]
        estimated[(tick, report.target)] += report.power
        sums[(tick, str(metadata["socket"]))] += report.power
    return estimated, sums


def accuracy(
    recording: Recording,
    powers: Sequence[PowerReport],
    learning_ticks: int = LEARNING_TICKS,
    min_truth_w: float = MIN_TRUTH_W,
) -> list[Accuracy]:
    """Per scope: MAPE and coverage of the per-target estimates, and the sums against RAPL,
    over the rows after ``learning_ticks`` whose true power is ``min_truth_w`` or more."""
    found = []
    for scope in SCOPES:
        estimated, sums = _estimates(recording, powers, scope)
        rows = covered = 0
        targets: set[str] = set()
        errors: dict[str, list[float]] = defaultdict(list)
        for (tick, target), truth in recording.truth[scope].items():
            if tick < learning_ticks:
                continue
            targets.add(target)
            if truth < min_truth_w or truth <= 0.0:
                continue
            rows += 1
            if (tick, target) in estimated:
                covered += 1
                errors[target].append(abs(estimated[(tick, target)] - truth) / truth)
        every = [error for target_errors in errors.values() for error in target_errors]
        gaps = [
            abs(total - recording.rapl_w[(tick, socket, scope)])
            for (tick, socket), total in sums.items()
        ]
        found.append(
            Accuracy(
                scope,
                rows,
                covered,
                100 * statistics.fmean(every) if every else math.nan,
                max(gaps, default=math.nan),
                {target: 100 * statistics.fmean(e) for target, e in sorted(errors.items())},
                sum(100 * error <= WITHIN_PERCENT for error in every),
                {target: _within(e) for target, e in sorted(errors.items())},
                len(targets),
            )
        )
    return found


def _within(errors: list[float]) -> float:
    """The share (%) of relative ``errors`` within :data:`WITHIN_PERCENT`."""
    return 100 * sum(100 * error <= WITHIN_PERCENT for error in errors) / len(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    every = streams() + crowded_streams()
    names = [s.name for s in every]
    parser.add_argument("--stream", action="append", choices=names, help="(default: every one)")
    parser.add_argument(
        "--phenomena",
        type=Phenomena.parse,
        action="append",
        help="also a 2×4-cpu, 16-container stream with these phenomena (e.g. 'dvfs,phases')",
    )
    parser.add_argument("--seed", type=int, default=42, help="of the --phenomena streams")
    parser.add_argument("--compat", help="e.g. smartwatts-2.4")
    parser.add_argument("--learning-ticks", type=int, default=LEARNING_TICKS)
    parser.add_argument(
        "--min-truth-w",
        type=float,
        default=MIN_TRUTH_W,
        help="leave out rows whose true power is under this (0: every row above 0 W)",
    )
    parser.add_argument("--per-target", action="store_true", help="print each target's MAPE")
    parser.add_argument(
        "--seeds",
        type=lambda text: [int(seed) for seed in text.split(",")],
        help="run every chosen stream with each of these seeds (e.g. 42,1,2,3,4), then print "
        "the mean of each figure over them",
    )
    args = parser.parse_args()
    settings: dict[str, Any] = {"cpu_base_freq": 2100, "cpu_tdp": 400}
    if args.compat:
        settings["compat"] = args.compat
    print(HEADER)
    chosen = [s for s in every if args.stream and s.name in args.stream]
    chosen += [Stream(p.label, p, seed=args.seed) for p in args.phenomena or ()]
    for stream in chosen or every:
        seeded = [dataclasses.replace(stream, seed=seed) for seed in args.seeds or ()]
        found: list[Accuracy] = []
        for each in seeded or [stream]:
            recording = record(each)
            powers = estimate(recording, settings)
            for figures in accuracy(recording, powers, args.learning_ticks, args.min_truth_w):
                found.append(figures)
                name = f"{stream.name}@{each.seed}" if seeded else stream.name
                print(line(name, figures))
                if args.per_target:
                    print_per_target(figures)
        if len(seeded) > 1:
            for scope in SCOPES:
                print(mean_line(stream.name, [f for f in found if f.scope == scope]))


def print_per_target(figures: Accuracy) -> None:
    """Each target's MAPE and share of rows within 5 %."""
    for target, mape in figures.per_target.items():
        within = figures.per_target_within[target]
        print(f"    {target:20} {mape:6.2f} % MAPE, {within:5.1f} % of rows ≤ 5 %")


def mean_line(name: str, found: list[Accuracy]) -> str:
    """The mean over seeds of a stream's figures in one scope, as a row of :data:`HEADER`:
    what a change to the estimator is judged on, since one seed's figure moves by as much as
    the change by chance alone (``docs/benchmarks.md``)."""

    def mean(values: list[float]) -> float:
        kept = [value for value in values if not math.isnan(value)]
        return statistics.fmean(kept) if kept else math.nan

    return (
        f"{name + ' mean':16} {found[0].scope:5} {round(mean([f.rows for f in found])):6d} "
        f"{mean([f.coverage_percent for f in found]):9.1f} "
        f"{mean([f.mape_percent for f in found]):7.2f} "
        f"{mean([f.worst_target_mape_percent for f in found]):16.2f} "
        f"{mean([f.within_percent for f in found]):9.1f} "
        f"{mean([f.worst_target_within_percent for f in found]):14.1f} "
        f"{'':>9} {max(f.worst_rapl_gap_w for f in found):9.2g}"
    )


HEADER = (
    f"{'stream':16} {'scope':5} {'rows':>6} {'covered %':>9} {'MAPE %':>7} "
    f"{'worst ctr MAPE %':>16} {'rows ≤5 %':>9} {'worst ctr ≤5 %':>14} {'ctrs':>9} "
    f"{'Σ−RAPL W':>9}"
)
"""The columns: the pooled MAPE (``MAPE %``, the figure kept since the benchmark began) and,
beside it, the per-container figures: the worst container's MAPE, the share of rows within
5 % pooled and in the worst container, and how many containers have a row at or above the
floor (1 W unless ``--min-truth-w``) of how many have any row after the learning phase."""


def line(name: str, figures: Accuracy) -> str:
    """One stream and scope's row of :data:`HEADER`."""
    measured = f"{len(figures.per_target)}/{figures.targets}"
    return (
        f"{name:16} {figures.scope:5} {figures.rows:6d} {figures.coverage_percent:9.1f} "
        f"{figures.mape_percent:7.2f} {figures.worst_target_mape_percent:16.2f} "
        f"{figures.within_percent:9.1f} {figures.worst_target_within_percent:14.1f} "
        f"{measured:>9} {figures.worst_rapl_gap_w:9.2g}"
    )


if __name__ == "__main__":
    main()
