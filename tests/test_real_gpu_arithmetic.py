"""The arithmetic of ``benchmarks/nvml_real_gpu.py --protocol mixed``, without a GPU.

The protocol runs only where a GPU is at hand; its figures (truth from each load's solo energy
per unit of work, shares, closure, the split's source) go into the docs from there. These tests
check that arithmetic on hand-computed numbers, the loads' schedule on a clock of their own, and
the whole analysis on recordings made up to have known answers, so that a slip shows in CI
rather than in a figure on a GPU.
"""

from __future__ import annotations

import math
import random
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

# The benchmarks' modules, imported as the benchmarks import them (a script folder, not a
# package), so that one module has one name for mypy and for Python.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from nvml_real_gpu import (
    MARGIN_S,
    SETTLE_S,
    Phase,
    analyse_mixed,
    closure,
    energy_per_unit_j,
    finite,
    follow_schedule,
    measured_windows,
    mixed_schedule,
    shares,
    split_source,
    time_weights,
    true_energy_j,
    units_in,
    window_figures,
)


def test_truth_comes_from_each_loads_solo_energy_per_unit() -> None:
    # Solo: the heavy load used 3,000 J above idle for 1,000 kernels, the light one 600 J for
    # 3,000 kernels.
    per_unit = {"heavy": energy_per_unit_j(3000.0, 1000.0), "light": energy_per_unit_j(600, 3000)}
    assert per_unit == {"heavy": 3.0, "light": pytest.approx(0.2)}
    # Shared: 800 heavy kernels (2,400 J) and 1,500 light ones (300 J), 3,000 J measured.
    units = {"heavy": 800.0, "light": 1500.0}
    true_j = true_energy_j(units, per_unit)
    assert true_j == {"heavy": 2400.0, "light": pytest.approx(300.0)}
    assert closure(true_j, 3000.0) == pytest.approx(0.9)
    assert shares(true_j) == {"heavy": pytest.approx(8 / 9), "light": pytest.approx(1 / 9)}


def test_a_load_without_units_has_no_truth_even_without_a_solo_figure() -> None:
    assert math.isnan(energy_per_unit_j(100.0, 0.0))
    assert true_energy_j({"heavy": 0.0}, {"heavy": math.nan}) == {"heavy": 0.0}
    assert math.isnan(shares({"heavy": 0.0, "light": 0.0})["heavy"])
    assert math.isnan(closure({"heavy": 1.0}, 0.0))


def test_window_figures_against_the_truth_and_the_time_split() -> None:
    figures = window_figures(
        active_j=3000.0,
        wattflow_j={"heavy": 1200.0, "light": 1800.0},
        units={"heavy": 800.0, "light": 1500.0},
        per_unit_j={"heavy": 3.0, "light": 0.2},
        time_weight={"heavy": 20.0, "light": 80.0},
    )
    assert figures["active_j"] == 3000.0
    assert figures["true_j"] == pytest.approx(2700.0)
    assert figures["closure"] == pytest.approx(0.9)
    assert figures["to_processes"] == 1.0
    heavy, light = figures["loads"]["heavy"], figures["loads"]["light"]
    assert heavy["true_share"] == pytest.approx(0.8889, abs=1e-4)
    assert heavy["wattflow_share"] == pytest.approx(0.4)
    assert heavy["difference_points"] == pytest.approx(-48.89, abs=0.01)
    assert light["difference_points"] == pytest.approx(48.89, abs=0.01)
    assert heavy["time_share"] == pytest.approx(0.2)
    assert heavy["time_difference_points"] == pytest.approx(-68.89, abs=0.01)


def test_units_at_a_windows_edges_count_for_their_part_inside() -> None:
    units = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert units_in(units, 0.5, 2.25) == pytest.approx(0.5 + 1 + 0.25)
    assert units_in(units, 3.0, 4.0) == 0.0
    assert units_in(units, -1.0, 10.0) == 3.0


def _iso(moment: float) -> str:
    """A Unix time as wattflow writes report timestamps: naive UTC."""
    return datetime.fromtimestamp(moment, UTC).replace(tzinfo=None).isoformat()


def test_the_split_source_is_read_when_present_and_counted_unknown_when_absent() -> None:
    def report(moment: float, target: str, **metadata: Any) -> dict[str, Any]:
        return {"timestamp": _iso(moment), "target": target, "power": 1.0, "metadata": metadata}

    power = [
        report(100.0, "pid:1", split="power", active_power_w=240.0, active_power_stderr_w=9.0),
        report(101.0, "pid:1", split="time"),
        report(102.0, "pid:1"),  # a formula without the power-aware estimator
        report(103.0, "pid:1", split="power", active_power_w=250.0, active_power_stderr_w=5.0),
        report(104.0, "pid:1", split="power", active_power_w=251.0, active_power_stderr_w=4.0),
        report(110.0, "pid:1", split="power", active_power_w=999.0),  # after the window
        report(103.0, "pid:2", split="time"),  # another target
        report(103.0, "gpu0"),
    ]
    source = split_source(power, "pid:1", 99.0, 105.0)
    assert source == {
        "reports": 5,
        "power": 0.6,
        "time": 0.2,
        "unknown": 0.2,
        "active_power_w": 251.0,
        "active_power_stderr_w": 4.0,
    }
    nothing = split_source(power, "pid:3", 99.0, 105.0)
    assert nothing["reports"] == 0
    assert nothing["active_power_w"] is None
    assert math.isnan(nothing["power"])


def test_the_time_split_weighs_sm_utilisation_by_the_drivers_window() -> None:
    reports = [
        {
            "timestamp": _iso(100.0),
            "devices": {
                "0": {
                    "processes": [
                        {"pid": 1, "sm_util": 50.0},
                        {"pid": 2, "sm_util": 100.0},
                        {"pid": 9, "sm_util": 100.0},
                    ],
                    "process_window": [99_800_000, 100_000_000],
                }
            },
        },
        {  # a recording from before process windows: the report weighs 1 s
            "timestamp": _iso(101.0),
            "devices": {"0": {"processes": [{"pid": 1, "sm_util": 30.0}]}},
        },
        {"timestamp": _iso(102.0), "devices": {"0": {"power": 1.0}}},  # no processes
        {
            "timestamp": _iso(200.0),  # outside the window
            "devices": {"0": {"processes": [{"pid": 1, "sm_util": 100.0}]}},
        },
    ]
    weights = time_weights(reports, 0, [1, 2], 99.0, 105.0)
    assert weights == {1: pytest.approx(0.2 * 50 + 30), 2: pytest.approx(0.2 * 100)}


def test_the_schedule_goes_heavy_both_light_with_idle_stretches_between() -> None:
    phases = mixed_schedule(1000.0, 60.0, 10.0, 0.5)
    assert [(p.name, p.start, p.end, p.heavy_duty, p.light_duty) for p in phases] == [
        ("heavy alone", 1000.0, 1060.0, 1.0, 0.0),
        ("idle after heavy", 1060.0, 1070.0, 0.0, 0.0),
        ("both", 1070.0, 1130.0, 0.5, 1.0),
        ("idle after both", 1130.0, 1140.0, 0.0, 0.0),
        ("light alone", 1140.0, 1200.0, 0.0, 1.0),
    ]
    assert [p.name for p in mixed_schedule(0.0, 5.0, 0.0, 1.0)] == [
        "heavy alone",
        "both",
        "light alone",
    ]
    windows = measured_windows(phases)
    assert windows == {
        "heavy alone": (1000.0 + SETTLE_S, 1060.0 - MARGIN_S),
        "both": (1070.0 + SETTLE_S, 1130.0 - MARGIN_S),
        "light alone": (1140.0 + SETTLE_S, 1200.0 - MARGIN_S),
        "whole run": (1000.0 + SETTLE_S, 1200.0 - MARGIN_S),
    }


class FakeClock:
    """A clock that only moves when a unit runs or the load sleeps."""

    def __init__(self, now: float, unit_s: float) -> None:
        self.now, self.unit_s = now, unit_s

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def unit(self) -> None:
        self.now += self.unit_s


def test_a_load_works_only_inside_its_stints_and_at_its_duty() -> None:
    clock = FakeClock(0.0, 0.02)
    stints = [(10.0, 70.0, 1.0), (80.0, 140.0, 0.0), (150.0, 750.0, 0.4)]
    units = follow_schedule(clock.unit, stints, random.Random(1), clock.time, clock.sleep)
    inside = [10.0 <= start < end <= 70.0 or 150.0 <= start < end <= 750.0 for start, end in units]
    assert all(inside)
    assert units_in(units, 10.0, 70.0) == pytest.approx(60 / 0.02, abs=1)
    assert units_in(units, 80.0, 140.0) == 0.0
    busy_share = units_in(units, 150.0, 750.0) * 0.02 / 600
    assert busy_share == pytest.approx(0.4, abs=0.05)
    assert clock.now <= 750.0


def test_a_load_slowed_by_the_other_does_not_spill_far_past_its_stint() -> None:
    clock = FakeClock(0.0, 0.02)
    slow_s = [0.02]

    def unit() -> None:  # the other load arrives: units take twice as long
        clock.now += slow_s[0]
        slow_s[0] = 0.04

    units = follow_schedule(unit, [(0.0, 1.0, 1.0)], random.Random(1), clock.time, clock.sleep)
    assert units[-1][1] <= 1.0
    assert len(units) == 1 + int((1.0 - 0.02) / 0.04 + 1e-9)


def _recording(
    phases: list[Phase], pids: dict[str, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """GPUReports, PowerReports and the loads' units for a made-up run with known answers.

    Idle is 100 W. Alone, the heavy load draws 300 W above idle and the light one 50 W, each
    in 20 ms units; shared, each holds the engine half of the time (40 ms units), so together
    they draw 175 W above idle. wattflow is made to split by time in the shared phase (87.5 W
    each), the heavy load's reports saying so and the light one's saying nothing."""
    tick_s, idle_w = 0.1, 100.0
    start, end = phases[0].start, phases[-1].end
    reports, power = [], []
    energy_mj = 0.0
    for k in range(round((end - start) / tick_s) + 1):
        moment = start + k * tick_s
        phase = next((p for p in phases if p.start < moment <= p.end), phases[0])
        heavy_w = 300.0 * phase.heavy_duty * (0.5 if phase.light_duty else 1.0)
        light_w = 50.0 * phase.light_duty * (0.5 if phase.heavy_duty else 1.0)
        sm = {pid: 100.0 * phase.duty(role) * (0.5 if phase.heavy_duty and phase.light_duty
                                               else 1.0)
              for role, pid in pids.items()}  # fmt: skip
        if k:
            energy_mj += (idle_w + heavy_w + light_w) * tick_s * 1000
        stamp_us = round(moment * 1e6)
        reports.append({
            "timestamp": _iso(moment),
            "devices": {"0": {
                "total_energy": energy_mj,
                "processes": [{"pid": pid, "sm_util": util} for pid, util in sm.items() if util],
                "process_window": [stamp_us - round(tick_s * 1e6), stamp_us],
            }},
        })  # fmt: skip
        shared = phase.heavy_duty and phase.light_duty
        given = {"heavy": 87.5 if shared else heavy_w, "light": 87.5 if shared else light_w}
        learned = {"split": "power", "active_power_w": 300.0, "active_power_stderr_w": 3.0}
        for role, pid in pids.items():
            metadata = learned if role == "heavy" else {}
            power.append({"timestamp": _iso(moment), "target": f"pid:{pid}",
                          "power": given[role], "metadata": metadata})  # fmt: skip
        power.append({"timestamp": _iso(moment), "target": "gpu0", "power": idle_w,
                      "metadata": {}})  # fmt: skip
    loads: dict[str, dict[str, Any]] = {}
    for role, pid in pids.items():
        units: list[tuple[float, float]] = []
        for phase in phases:
            if phase.duty(role):
                unit_s = 0.04 if phase.heavy_duty and phase.light_duty else 0.02
                count = round((phase.end - phase.start) / unit_s)
                units += [(phase.start + i * unit_s, phase.start + (i + 1) * unit_s)
                          for i in range(count)]  # fmt: skip
        loads[role] = {"pid": pid, "units": units}
    return reports, power, loads


def test_the_analysis_of_a_made_up_run_gives_its_known_answers() -> None:
    phases = mixed_schedule(1_700_000_000.0, 20.0, 5.0, 1.0)
    pids = {"heavy": 11, "light": 22}
    reports, power, loads = _recording(phases, pids)
    analysis = analyse_mixed(phases, loads, power, reports, None, 0, idle_w=100.0)
    # Solo: 300 W over 50 units/s is 6 J a unit; 50 W over 50 units/s, 1 J.
    assert analysis["energy_per_unit_j"] == {
        "heavy": pytest.approx(6.0, rel=1e-6),
        "light": pytest.approx(1.0, rel=1e-6),
    }
    both = analysis["windows"]["both"]  # 17 s: 25 units/s each
    assert both["seconds"] == pytest.approx(17.0)
    assert both["active_j"] == pytest.approx(175 * 17, rel=1e-6)
    assert both["closure"] == pytest.approx(1.0, rel=1e-6)
    assert both["to_processes"] == pytest.approx(1.0, rel=1e-6)
    assert both["left_on_device_j"] == pytest.approx(0.0, abs=1e-6)
    heavy, light = both["loads"]["heavy"], both["loads"]["light"]
    assert heavy["units"] == pytest.approx(425.0)
    assert heavy["true_j"] == pytest.approx(2550.0, rel=1e-6)
    assert heavy["true_share"] == pytest.approx(150 / 175, rel=1e-6)
    assert heavy["wattflow_share"] == pytest.approx(0.5, rel=1e-6)
    assert heavy["difference_points"] == pytest.approx(100 * (0.5 - 150 / 175), rel=1e-6)
    assert heavy["time_share"] == pytest.approx(0.5, rel=1e-6)
    assert heavy["split"]["power"] == 1.0
    assert heavy["split"]["active_power_w"] == 300.0
    assert light["split"]["unknown"] == 1.0
    assert light["split"]["active_power_w"] is None
    # The whole run, 2 s to 69 s: heavy 18 s alone and 20 s shared, light 20 s shared and
    # 19 s alone; the idle stretches add nothing above idle.
    whole = analysis["windows"]["whole run"]
    assert whole["active_j"] == pytest.approx(300 * 18 + 175 * 20 + 50 * 19, rel=1e-6)
    assert whole["loads"]["heavy"]["true_j"] == pytest.approx((50 * 18 + 25 * 20) * 6, rel=1e-6)
    assert whole["loads"]["light"]["true_j"] == pytest.approx(25 * 20 + 50 * 19, rel=1e-6)
    assert whole["closure"] == pytest.approx(1.0, rel=1e-6)
    assert whole["loads"]["heavy"]["wattflow_j"] == pytest.approx(300 * 18 + 87.5 * 20, rel=1e-6)
    assert whole["loads"]["heavy"]["wattflow_share"] == pytest.approx(7150 / 9850, rel=1e-6)
    assert analysis["windows"]["heavy alone"]["loads"]["heavy"]["true_share"] == 1.0
    assert analysis["windows"]["light alone"]["loads"]["heavy"]["wattflow_j"] == 0.0
    assert finite({"a": [math.nan, 1.0], "b": math.inf}) == {"a": [None, 1.0], "b": None}
