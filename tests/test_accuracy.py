"""SmartWatts' default mode keeps its accuracy on streams with what production nodes do.

The streams are the benchmarks' (``benchmarks/accuracy.py``, from ``generate_hwpc.py`` with a
fixed seed): a node with DVFS, workload phases, heterogeneous containers, jittered intervals or
counter multiplexing, each alone and all together, and today's plain recordings. After the
learning phase, every stream must give per-target powers within 5 % MAPE of the truth over at
least 99 % of the target-ticks, and the targets of a socket must add up to its measured RAPL
power on every tick. The same holds on one socket crowded with 20–30 containers on 4–8 cpus,
but for the shapes listed in :data:`CROWDED_OVER_5_PERCENT`, where it is expected to fail (and
held to its figures). ``benchmarks/side_by_side.py --phenomena …`` measures SmartWatts 2.4.1 on
the same streams; this test runs only wattflow, in this process.

The issue asks for 5 % MAPE *per container*: the MAPE of each container over its own rows, not
the MAPE of every container's rows pooled, in which a container far off hides behind the
others' rows. The pooled figure stays guarded as it was; every stream is also held to its worst
container's MAPE: within 5 %, but for the streams of :data:`WORST_CONTAINER_OVER_5_PERCENT`,
held to their figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from accuracy import (
    Accuracy,
    Recording,
    Stream,
    accuracy,
    crowded_streams,
    estimate,
    record,
    streams,
)

SETTINGS = {"cpu_base_freq": 2100, "cpu_tdp": 400}
"""The benchmarks' SmartWatts settings (the rest at SmartWatts' defaults)."""
MAX_MAPE_PERCENT = 5.0
MIN_COVERAGE_PERCENT = 99.0
PLAIN_BEFORE = {"plain-10": (3.39, 1.48), "plain-16": (6.89, 2.78)}
"""The plain streams' cpu and dram MAPE (%) before the frequency-aware model, from the
per-layer one: the default mode must do no worse on them."""

_recordings: dict[str, Recording] = {}


def recording(stream: Stream) -> Recording:
    """Each stream simulated once for the module's tests."""
    if stream.name not in _recordings:
        _recordings[stream.name] = record(stream)
    return _recordings[stream.name]


_figures: dict[str, list[Accuracy]] = {}


def figures_of(stream: Stream) -> list[Accuracy]:
    """Each stream's per-scope figures, estimated once for the module's tests."""
    if stream.name not in _figures:
        found = recording(stream)
        _figures[stream.name] = accuracy(found, estimate(found, SETTINGS))
    return _figures[stream.name]


def within_5_percent_over_99_percent_of_rows(stream: Stream) -> list[Accuracy]:
    """The stream's figures, once checked against the criterion: per scope, per-target MAPE
    within 5 % over at least 99 % of the target-ticks, and targets adding up to RAPL."""
    figures = figures_of(stream)
    assert [f.scope for f in figures] == ["cpu", "dram"]
    cpu = figures[0]
    assert cpu.rows > 1000, "the stream has targets above 1 W to check"
    for scope in figures:
        if not scope.rows:
            continue  # a stream whose DRAM power per target stays under 1 W
        assert scope.coverage_percent >= MIN_COVERAGE_PERCENT, (scope.scope, scope)
        assert scope.mape_percent <= MAX_MAPE_PERCENT, (scope.scope, scope.per_target)
        # Per-target powers add up to the measured RAPL power of their socket, every tick.
        assert scope.worst_rapl_gap_w < 1e-9, scope.scope
    return figures


@pytest.mark.parametrize("stream", streams(), ids=lambda stream: stream.name)
def test_per_target_power_within_5_percent_over_99_percent_of_rows(stream: Stream) -> None:
    figures = within_5_percent_over_99_percent_of_rows(stream)
    if stream.name in PLAIN_BEFORE:
        before = PLAIN_BEFORE[stream.name]
        assert all(f.mape_percent <= b for f, b in zip(figures, before, strict=True)), before


def test_the_stream_with_every_phenomenon_is_hard_for_smartwatts_way() -> None:
    """Per-layer models that relearn on a window, as SmartWatts 2.4.1 has them (compat mode),
    are far off on the stream with every phenomenon: the stream tests what it should."""
    stream = next(s for s in streams() if s.name == "all-16")
    found = recording(stream)
    cpu = accuracy(found, estimate(found, {**SETTINGS, "compat": "smartwatts-2.4"}))[0]
    assert cpu.mape_percent > 3 * MAX_MAPE_PERCENT
    assert cpu.coverage_percent < MIN_COVERAGE_PERCENT


CROWDED_OVER_5_PERCENT = {"crowded-4x30": 23.65, "crowded-6x24": 8.10, "crowded-6x30": 9.07}
"""The crowded streams whose cpu MAPE (%) is still over 5 %: the model's limit on them (see
``docs/formulas/smartwatts.md``, when containers outnumber cores). They are held to getting no
worse below; one that meets the criterion moves to the guarded streams."""


@pytest.mark.parametrize(
    "stream",
    [stream for stream in crowded_streams() if stream.name not in CROWDED_OVER_5_PERCENT],
    ids=lambda stream: stream.name,
)
def test_crowded_socket_per_target_power_within_5_percent_over_99_percent_of_rows(
    stream: Stream,
) -> None:
    """20–30 containers on 4–8 cpus of one socket, with every phenomenon (seed 42)."""
    within_5_percent_over_99_percent_of_rows(stream)


def test_crowded_streams_over_5_percent_get_no_worse() -> None:
    """The crowded streams still over 5 % stay estimated on every row, add up to RAPL, and are
    no further off than when their figures were written down."""
    for stream in crowded_streams():
        limit = CROWDED_OVER_5_PERCENT.get(stream.name)
        if limit is None:
            continue
        cpu = figures_of(stream)[0]
        assert cpu.coverage_percent >= MIN_COVERAGE_PERCENT, stream.name
        assert cpu.worst_rapl_gap_w < 1e-9, stream.name
        assert cpu.mape_percent <= limit + 0.005, (stream.name, cpu.mape_percent)


WORST_CONTAINER_OVER_5_PERCENT = {
    "all-24": 7.20,
    "crowded-4x20": 8.58,
    "crowded-4x30": 25.27,
    "crowded-6x20": 13.76,
    "crowded-6x24": 19.49,
    "crowded-6x30": 9.30,
    "crowded-8x20": 7.94,
    "crowded-8x30": 17.82,
}
"""The streams whose worst container's cpu MAPE (%, over its rows of 1 W or more after the
learning phase) is over 5 %, with that figure: the pooled MAPE of five of them is within 5 %,
and hides it. They are held to getting no worse; one that meets the criterion leaves the list."""


@pytest.mark.parametrize("stream", streams() + crowded_streams(), ids=lambda stream: stream.name)
def test_each_container_within_5_percent_or_no_worse(stream: Stream) -> None:
    """Per scope, every container's own MAPE is within 5 % (the issue's "MAPE per container"),
    or, on the streams listed, no worse than when its figure was written down."""
    for figures in figures_of(stream):
        if not figures.rows:
            continue  # a stream whose DRAM power per target stays under 1 W
        assert figures.per_target, (stream.name, figures.scope)
        limit = MAX_MAPE_PERCENT
        if figures.scope == "cpu":
            limit = max(limit, WORST_CONTAINER_OVER_5_PERCENT.get(stream.name, limit))
        worst = max(figures.per_target, key=figures.per_target.__getitem__)
        assert figures.worst_target_mape_percent <= limit, (stream.name, figures.scope, worst)


def test_the_per_container_measure_sees_a_container_that_the_pooled_one_hides() -> None:
    """On ``crowded-8x20`` the pooled MAPE is within 5 % while a container is off by more: the
    per-container measure is the stricter one, and the two differ where the test says."""
    stream = next(s for s in crowded_streams() if s.name == "crowded-8x20")
    cpu = figures_of(stream)[0]
    assert cpu.mape_percent <= MAX_MAPE_PERCENT < cpu.worst_target_mape_percent
    assert len(cpu.per_target) < cpu.targets  # containers that never draw 1 W are not measured
