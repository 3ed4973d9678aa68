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
