"""The SmartWatts formula on streams whose true per-target power is known."""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import wattflow
from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.power_model import FrequencyLayers
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.formats.batch import expand
from wattflow.formats.reports import FormulaReport, HWPCReport, PowerReport

START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
UNIT = 2.0**32
IDLE_W = 10.0
WATTS_PER_GINSTR = 3.0
BASE_MHZ = 2100


def stamp(tick: int, jitter_ms: float = 0.0) -> datetime:
    return START + timedelta(seconds=tick, milliseconds=jitter_ms)


def global_report(
    tick: int,
    package_w: float,
    *,
    interval_s: float = 1.0,
    frequency_mhz: float = 2800.0,
    when: datetime | None = None,
    dram: int | None = None,
) -> HWPCReport:
    energy = {"RAPL_ENERGY_PKG": int(package_w * interval_s * UNIT)}
    if dram is not None:
        energy["RAPL_ENERGY_DRAM"] = dram
    mperf = 2_100_000  # so that APERF = 1000 × MHz exactly
    return HWPCReport(
        timestamp=when or stamp(tick),
        sensor="node",
        target="all",
        groups={
            "rapl": {"0": {"0": energy}},
            "msr": {
                "0": {
                    cpu: {"APERF": int(mperf * frequency_mhz / BASE_MHZ), "MPERF": mperf}
                    for cpu in ("0", "1")
                }
            },
        },
    )


def target_report(
    tick: int,
    name: str,
    instructions: float,
    *,
    when: datetime | None = None,
    running_share: float = 1.0,
) -> HWPCReport:
    """A target whose instructions are spread over two cpus, the second one multiplexed."""
    enabled = 1_000_000_000
    running = int(enabled * running_share)
    half = instructions / 2
    return HWPCReport(
        timestamp=when or stamp(tick),
        sensor="node",
        target=name,
        groups={
            "core": {
                "0": {
                    "0": {"INSTRUCTIONS_RETIRED": int(half), "LLC_MISSES": int(half / 500)},
                    "1": {
                        "INSTRUCTIONS_RETIRED": int(half * running_share),
                        "LLC_MISSES": int(half / 500 * running_share),
                        "time_enabled": enabled,
                        "time_running": running,
                    },
                }
            }
        },
    )


def workload(ticks: int, seed: int = 7) -> list[tuple[int, dict[str, float], float]]:
    """Per tick: each target's instructions and the package power they cause, plus idle."""
    rng = np.random.default_rng(seed)
    stream = []
    for tick in range(ticks):
        load = {
            "web": float(rng.uniform(0.5e9, 2e9)),
            "db": float(rng.uniform(1e9, 4e9)),
            "batch": float(rng.uniform(0.1e9, 6e9)),
        }
        power = IDLE_W + sum(load.values()) / 1e9 * WATTS_PER_GINSTR
        stream.append((tick, load, power))
    return stream


def feed(formula: SmartWattsFormula, reports: list[HWPCReport], *, flush: bool = True) -> Output:
    """What the formula makes of a batch of reports, its frames replaced by their reports."""
    out = Output()
    formula.process(list(reports), out)
    if flush:
        formula.flush(out)
    out.reports, out.frames = expand(out.items()), []
    return out


def reports_of(stream: list[tuple[int, dict[str, float], float]]) -> list[HWPCReport]:
    reports: list[HWPCReport] = []
    for tick, load, power in stream:
        reports.append(global_report(tick, power))
        reports.extend(target_report(tick, name, value) for name, value in load.items())
    return reports


def powers(out: Output, target: str | None = None) -> list[PowerReport]:
    return [
        r
        for r in out.reports
        if isinstance(r, PowerReport) and (target is None or r.target == target)
    ]


def formula(**settings: Any) -> SmartWattsFormula:
    config = SmartWattsConfig(learn_min_samples_required=5, disable_dram_formula=True, **settings)
    return SmartWattsFormula(config, "node")


def test_layers_are_multiples_of_the_base_clock_at_or_under_the_package_frequency() -> None:
    for compat in (True, False):
        layers = FrequencyLayers(
            base_clock=100, min_samples=10, history_window=60, error_window=60, compat=compat
        )
        assert layers.layer_frequency(2774) == 2700
        assert layers.layer_frequency(2700) == 2700
        assert layers.layer_frequency(2699) == 2600
        assert layers.layer_frequency(40) == 100  # under the lowest layer: the lowest
        assert layers.layer_frequency(25_000) == 10_000  # SmartWatts' layers stop at 100 × clock
        assert layers.model(2750) is layers.model(2710)
    # SmartWatts learns each layer on its own; the default mode has one model for all of them.
    compat_layers = FrequencyLayers(
        base_clock=100, min_samples=10, history_window=60, error_window=60, compat=True
    )
    assert compat_layers.model(2750) is not compat_layers.model(2810)
    assert layers.model(2750) is layers.model(2810) is layers.model(1200)


def test_the_formula_reports_the_layer_its_aperf_mperf_ratio_selects() -> None:
    smartwatts = formula()
    reports: list[HWPCReport] = []
    for tick, load, power in workload(12):
        reports.append(global_report(tick, power, frequency_mhz=2777.0))
        reports.extend(target_report(tick, name, value) for name, value in load.items())
    out = feed(smartwatts, reports)
    models = [r for r in out.reports if isinstance(r, FormulaReport)]
    assert models
    assert {m.metadata["layer_frequency"] for m in models} == {2700}
    assert {m.metadata["pkg_frequency"] for m in models} == {2777}


def test_per_target_power_is_recovered_and_sums_to_the_measured_package_power() -> None:
    stream = workload(40)
    out = feed(formula(), reports_of(stream))
    assert not out.rejected
    by_tick: dict[datetime, dict[str, float]] = {}
    for report in powers(out):
        by_tick.setdefault(report.timestamp, {})[report.target] = report.power
    for tick, load, measured in stream[10:]:
        estimated = by_tick[stamp(tick)]
        total_dynamic = sum(load.values())
        for name, instructions in load.items():
            truth = measured * instructions / total_dynamic  # idle shared like SmartWatts does
            assert estimated[name] == pytest.approx(truth, rel=1e-3)
        assert sum(estimated[n] for n in load) == pytest.approx(measured, rel=1e-9)


def test_estimates_start_on_the_tick_that_brings_the_minimum_samples() -> None:
    out = feed(formula(), reports_of(workload(8)))
    estimated = sorted({r.timestamp for r in powers(out, "web")})
    assert estimated[0] == stamp(5)  # the 5th sample (the first tick only starts the interval)
    learned = next(r for r in out.reports if isinstance(r, FormulaReport))
    assert learned.timestamp == stamp(5)
    assert learned.metadata["samples"] == 5
    compat = feed(formula(compat="smartwatts-2.4"), reports_of(workload(8)))
    assert sorted({r.timestamp for r in powers(compat, "web")})[0] == stamp(5)  # the 6th tick


def test_no_tick_is_lost_at_shutdown_in_either_mode() -> None:
    for mode in (None, "smartwatts-2.4"):
        out = feed(formula(compat=mode), reports_of(workload(30)))
        assert max(r.timestamp for r in powers(out, "db")) == stamp(29), mode


def test_the_interval_comes_from_the_timestamps() -> None:
    stream = workload(20)
    reports: list[HWPCReport] = []
    for tick, load, power in stream:
        interval = 2.0 if tick % 2 else 1.0  # every other tick comes a second late
        when = START + timedelta(seconds=sum(2.0 if t % 2 else 1.0 for t in range(1, tick + 1)))
        reports.append(global_report(tick, power, interval_s=interval, when=when))
        reports.extend(target_report(tick, n, v * interval, when=when) for n, v in load.items())
    out = feed(formula(), reports)
    # Powers, not energies: the same load gives the same watts whatever the interval.
    global_powers = [r.power for r in powers(out, "global")]
    truth = [p for _, _, p in stream][-len(global_powers) :]
    assert global_powers == pytest.approx(truth, rel=1e-3)


def test_multiplexed_counters_are_scaled_by_enabled_over_running() -> None:
    stream = workload(20)
    plain = feed(formula(), reports_of(stream))
    reports: list[HWPCReport] = []
    for tick, load, power in stream:
        reports.append(global_report(tick, power))
        for name, value in load.items():
            share = 0.5 if name == "db" else 1.0
            reports.append(target_report(tick, name, value, running_share=share))
    multiplexed = feed(formula(), reports)
    assert [r.power for r in powers(multiplexed, "db")] == pytest.approx(
        [r.power for r in powers(plain, "db")], rel=1e-6
    )
    compat = feed(formula(compat="smartwatts-2.4"), reports)
    compat_plain = feed(formula(compat="smartwatts-2.4"), reports_of(stream))
    assert [r.power for r in powers(compat, "db")] != pytest.approx(
        [r.power for r in powers(compat_plain, "db")], rel=1e-3
    )


def test_relearning_when_the_workload_changes() -> None:
    smartwatts = formula()
    first = workload(40, seed=1)
    out = feed(smartwatts, reports_of(first), flush=False)
    fits = [r.metadata["error"] for r in out.reports if isinstance(r, FormulaReport)]
    assert fits
    assert max(fits) < 0.01  # the first workload's model fits it: its errors stay far under 2 W
    changed: list[HWPCReport] = []
    for tick, load, power in workload(90, seed=2):
        tick += 40
        # the same counters now cost twice the energy: a new workload mix on the same layer
        changed.append(global_report(tick, IDLE_W + 2 * (power - IDLE_W)))
        changed.extend(target_report(tick, name, value) for name, value in load.items())
    later = feed(smartwatts, changed)
    reports = [r for r in later.reports if isinstance(r, FormulaReport)]
    assert max(r.metadata["id"] for r in reports) > 1
    errors = [r.metadata["error"] for r in reports if r.timestamp >= stamp(40)]
    assert min(errors[:5]) > 10.0  # the old model is far off the new workload
    # Relearning goes on until the error window's median is back under the 2 W threshold.
    assert statistics.median(errors[-20:]) < 2.0


def test_a_tick_without_its_global_report_is_dead_lettered_after_the_lateness() -> None:
    reports = reports_of(workload(20))
    dropped = [r for r in reports if not (r.target == "all" and r.timestamp == stamp(12))]
    out = feed(formula(), dropped)
    reasons = [reason for report, reason in out.rejected]
    assert len(reasons) == 3
    assert all("no global report" in reason and "2000 ms" in reason for reason in reasons)
    assert {report.timestamp for report, _ in out.rejected} == {stamp(12)}
    assert stamp(12) not in {r.timestamp for r in powers(out)}
    assert stamp(13) in {r.timestamp for r in powers(out)}


def test_a_report_later_than_the_lateness_is_a_dead_letter() -> None:
    smartwatts = formula(tick_lateness=1000)
    reports = reports_of(workload(10))
    out = feed(smartwatts, reports, flush=False)
    late = target_report(2, "straggler", 1e9)
    out = feed(smartwatts, [late], flush=False)
    assert len(out.rejected) == 1
    assert "arrived after its tick was processed" in out.rejected[0][1]
    assert "--tick-lateness" in out.rejected[0][1]


@pytest.mark.parametrize(
    ("counter", "reason"),
    [(-5, "negative counter delta -5"), (2**63 - 7, "the counter wrapped around")],
)
def test_bad_counters_are_dead_letters_with_a_reason(counter: int, reason: str) -> None:
    reports = reports_of(workload(12))
    broken = target_report(6, "web", 1e9)
    broken.groups["core"]["0"]["0"]["INSTRUCTIONS_RETIRED"] = counter
    index = next(i for i, r in enumerate(reports) if r.target == "web" and r.timestamp == stamp(6))
    reports[index] = broken
    out = feed(formula(), reports)
    assert [r for r, _ in out.rejected] == [broken]
    assert reason in out.rejected[0][1]
    assert "INSTRUCTIONS_RETIRED" in out.rejected[0][1]


def test_a_target_report_without_counters_is_a_dead_letter_with_a_reason() -> None:
    reports = reports_of(workload(12))
    empty = target_report(6, "web", 1e9)
    for cpus in empty.groups["core"].values():
        for cpu in cpus:
            cpus[cpu] = {}
    index = next(i for i, r in enumerate(reports) if r.target == "web" and r.timestamp == stamp(6))
    reports[index] = empty
    out = feed(formula(), reports)
    assert [r for r, _ in out.rejected] == [empty]
    assert "its cpus report no events" in out.rejected[0][1]
    assert stamp(6) in {r.timestamp for r in powers(out)}


def test_a_bad_global_report_takes_its_tick_with_it() -> None:
    reports = reports_of(workload(12))
    index = next(i for i, r in enumerate(reports) if r.target == "all" and r.timestamp == stamp(7))
    bad = global_report(7, 50.0)
    bad.groups["rapl"]["0"]["0"]["RAPL_ENERGY_PKG"] = -1
    reports[index] = bad
    out = feed(formula(), reports)
    assert len(out.rejected) == 4
    assert out.rejected[0] == (
        bad,
        "negative counter delta -1 for RAPL_ENERGY_PKG on socket 0 cpu 0",
    )
    assert all("global report of its tick was rejected" in reason for _, reason in out.rejected[1:])


def test_zero_and_tiny_intervals_are_dead_letters() -> None:
    reports = reports_of(workload(12))
    # A second copy of tick 5's global report 100 ms later: a tick 100 ms after the previous.
    echo = global_report(5, 40.0, when=stamp(5, jitter_ms=100))
    twin = target_report(5, "web", 1e9, when=stamp(5, jitter_ms=100))
    out = feed(formula(), [*reports[: 4 * 6], echo, twin, *reports[4 * 6 :]])
    reasons = {reason for _, reason in out.rejected}
    assert any("under a quarter of the sensor period" in r for r in reasons), reasons
    assert {report.timestamp for report, _ in out.rejected} == {stamp(5, jitter_ms=100)}


def test_compat_mode_splits_the_predicted_global_power_like_smartwatts() -> None:
    stream = workload(30)
    out = feed(formula(compat="smartwatts-2.4"), reports_of(stream))
    for tick in range(15, 25):
        targets = [r for r in powers(out) if r.timestamp == stamp(tick)]
        predicted = next(r.power for r in targets if r.target == "global")
        shares = [r for r in targets if r.target not in ("global", "rapl")]
        assert sum(r.metadata["ratio"] for r in shares) == pytest.approx(1.0)
        assert sum(r.power for r in shares) == pytest.approx(predicted)
        assert {r.metadata["scope"] for r in targets} == {"cpu"}
        assert {r.metadata["socket"] for r in targets} == {"0"}


def test_smartwatts_flags_through_the_command_line(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    stream = workload(25)
    lines = [r.model_dump_json() for r in reports_of(stream)]
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    result = wattflow(
        "run",
        "--input", "jsonl", "--model", "HWPCReport", "--files", str(source),
        "--output", "jsonl", "--model", "PowerReport", "--file", str(out),
        "--disable-dram-formula",
        "--learn-min-samples-required", "5",
        "--cpu-base-freq", "2100",
        "--learn-error-window-method", "mean",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    scopes = {(r["target"], r["metadata"]["scope"]) for r in written}
    assert ("web", "cpu") in scopes
    assert ("global", "cpu") in scopes
    assert not any(scope == "dram" and target != "rapl" for target, scope in scopes)
    bad = wattflow("run", "--disable-cpu-formula", "--disable-dram-formula")
    assert bad.returncode == 2
    assert "--disable-smartwatts-formula" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_counter_that_is_not_a_number_is_a_dead_letter(tmp_path: Path) -> None:
    lines = [r.model_dump_json() for r in reports_of(workload(12))]
    broken = json.loads(lines[5])
    assert broken["target"] != "all"
    broken["groups"]["core"]["0"]["0"]["INSTRUCTIONS_RETIRED"] = "lots"
    lines[5] = json.dumps(broken)
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    dead = tmp_path / "dead.jsonl"
    result = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
        "--dead-letters", str(dead), "--learn-min-samples-required", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    letters = [json.loads(line) for line in dead.read_text().splitlines()]
    assert len(letters) == 1
    assert "INSTRUCTIONS_RETIRED" in letters[0]["reason"]
    assert "valid number" in letters[0]["reason"]
    assert ":6:" in letters[0]["reason"], "the dead letter names the input line"
