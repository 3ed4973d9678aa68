"""Per-process GPU power that follows what each process draws, on seeded stand-in streams.

The streams are what ``wattflow run --input nvml`` reads from the NVML stand-in's tenant
processes (``simulate_sampler`` in ``tests/nvml_fake.py`` applies the stand-in's rules, hashes
included, without waiting for real time), so each run here is deterministic: a fixed seed and a
fixed start give the same driver samples every time. The truth is exact: which tenant held the
engine in every millisecond, times its power above idle.

The H200-like pair is the case measured on a real H200: a bf16-matmul job drawing 610 W above
idle while it computes, in bursts, beside a one-SM spinner drawing 47 W all the time. A split
by engine time alone gives the spinner about half of the shared time's energy; the truth gives
it a few percent.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from datetime import datetime

import pytest

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.gpu import STATE_VERSION, GpuConfig, GpuFormula
from wattflow.formats.reports import GPUReport, PowerReport

from .nvml_fake import Tenant, Tenants, simulate_sampler

HEAVY, LIGHT = 4_194_401, 4_194_402
START_MS = 1_790_000_000_000
IDLE_W = 90.0


def h200_pair(seed: int) -> Tenants:
    """610 W above idle in 3 s stretches half of the time; 47 W all the time."""
    return Tenants(
        [Tenant(HEAVY, 610_000, duty=50, stretch_ms=3000), Tenant(LIGHT, 47_000)],
        idle_mw=round(IDLE_W * 1000),
        seed=seed,
    )


def _us(timestamp: datetime) -> int:
    return round(timestamp.timestamp() * 1_000_000)


def split(reports: list[GPUReport], formula: GpuFormula | None = None) -> list[PowerReport]:
    formula = formula or GpuFormula(
        GpuConfig(gpu_targets="process", gpu_idle_power_w=IDLE_W), "node-1"
    )
    out = Output()
    formula.process(list(reports), out)
    return [r for r in out.reports if isinstance(r, PowerReport)]


def energies_j(power: list[PowerReport], since_us: int) -> tuple[dict[str, float], int, int]:
    """Each target's energy (Σ W·Δt) over the ticks from ``since_us``, and the span."""
    by_tick: dict[int, dict[str, float]] = defaultdict(dict)
    for report in power:
        by_tick[_us(report.timestamp)][report.target] = report.power
    stamps = [stamp for stamp in sorted(by_tick) if stamp >= since_us]
    energy: dict[str, float] = defaultdict(float)
    for earlier, later in itertools.pairwise(stamps):
        for target, watts in by_tick[later].items():
            energy[target] += watts * (later - earlier) / 1e6
    return dict(energy), stamps[0], stamps[-1]


def share_errors(
    power: list[PowerReport], tenants: Tenants, since_s: float
) -> tuple[dict[int, float], float]:
    """Each pid's share of the processes' energy against its true share of the active energy
    (points), and the part of the true active energy the processes got."""
    energy, start_us, end_us = energies_j(power, (START_MS + round(since_s * 1000)) * 1000)
    truth = {pid: mj / 1000 for (pid, _), mj in tenants.active_mj(start_us, end_us).items()}
    given = {pid: energy.get(f"pid:{pid}", 0.0) for pid in truth}
    errors = {
        pid: 100 * (given[pid] / sum(given.values()) - truth[pid] / sum(truth.values()))
        for pid in truth
    }
    return errors, sum(given.values()) / sum(truth.values())


def time_split_share(reports: list[GPUReport], pid: int, since_s: float) -> float:
    """The pid's share of the engine time by the driver's samples: what the split by time
    alone gives it."""
    since_us = (START_MS + round(since_s * 1000)) * 1000
    held: dict[int, float] = defaultdict(float)
    for report in reports:
        device = report.devices["0"]
        if device.process_window is None or device.process_window[0] < since_us:
            continue
        seconds = (device.process_window[1] - device.process_window[0]) / 1e6
        for process in device.processes or ():
            held[process.pid] += process.sm_util * seconds
    return held[pid] / sum(held.values())


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_a_heavy_and_a_light_process_get_their_true_energy_shares(seed: int) -> None:
    """After 30 s of learning, over the next 90 s each process's share of the energy is within
    5 points of the truth, and the processes get at least 95 % of the active energy; the split
    by engine time alone is over 40 points off on the same stream."""
    tenants = h200_pair(seed)
    reports = simulate_sampler(tenants, START_MS, 120)
    power = split(reports)
    errors, reached = share_errors(power, tenants, since_s=30)
    print(f"seed {seed}: errors {errors} points, reached {reached:.4f}")
    assert all(abs(error) <= 5.0 for error in errors.values()), errors
    assert 0.95 <= reached <= 1.0 + 1e-9
    truth = tenants.active_mj(
        (START_MS + 30_000) * 1000, (START_MS + 120_000) * 1000
    )  # the time split gives the spinner its half of the shared time: far off
    true_light = truth[(LIGHT, 0)] / sum(truth.values())
    assert time_split_share(reports, LIGHT, 30) - true_light > 0.4
    late = [
        r
        for r in power
        if r.target.startswith("pid:") and _us(r.timestamp) > (START_MS + 60_000) * 1000
    ]
    assert {r.metadata["split"] for r in late} == {"power"}
    light = [r.metadata for r in late if r.target == f"pid:{LIGHT}"][-1]
    stderr_w = light["active_power_stderr_w"]
    assert stderr_w < 0.25 * light["active_power_w"]
    assert abs(light["active_power_w"] - 47.0) <= max(3 * stderr_w, 4.7), "within its own error"


def test_targets_add_up_to_the_energy_counter_between_its_readings() -> None:
    """Conservation: between two readings of the energy counter, the processes and the
    device's target add up to its increase, whatever the learned powers made of the split;
    and no target is ever given negative power."""
    reports = simulate_sampler(h200_pair(1), START_MS, 60)
    power = split(reports)
    assert all(report.power >= 0 for report in power)
    by_tick: dict[int, float] = defaultdict(float)
    for report in power:
        by_tick[_us(report.timestamp)] += report.power
    stamps = [_us(r.timestamp) for r in reports]
    counter = {
        _us(r.timestamp): r.devices["0"].total_energy
        for r in reports
        if r.devices["0"].total_energy is not None
    }
    readings = sorted(counter)
    checked = 0
    for earlier, later in itertools.pairwise(readings):
        ticks = [t for t in stamps if earlier < t <= later]
        if not all(t in by_tick for t in ticks):
            continue  # not released yet at the end of the stream
        energy_mj = sum(by_tick[t] * 100.0 for t in ticks)  # 100 ms ticks
        assert energy_mj == pytest.approx(counter[later] - counter[earlier], rel=1e-9)
        checked += 1
    assert checked >= len(readings) - 3


def test_a_pair_that_never_runs_apart_gets_the_time_split_and_says_so() -> None:
    """Both busy all the time: no window tells their powers apart, so the split stays by
    engine time, and every report says so."""
    tenants = Tenants(
        [Tenant(HEAVY, 610_000), Tenant(LIGHT, 47_000)], idle_mw=round(IDLE_W * 1000), seed=3
    )
    reports = simulate_sampler(tenants, START_MS, 90)
    power = split(reports)
    processes = [r for r in power if r.target.startswith("pid:")]
    assert processes
    assert {r.metadata["split"] for r in processes} == {"time"}
    assert all(r.metadata.keys() >= {"active_power_w", "active_power_stderr_w"} for r in processes)
    energy, _, _ = energies_j(power, (START_MS + 10_000) * 1000)
    given = energy[f"pid:{LIGHT}"] / (energy[f"pid:{LIGHT}"] + energy[f"pid:{HEAVY}"])
    assert given == pytest.approx(time_split_share(reports, LIGHT, 10), abs=0.01)


def test_equal_powers_70_30_keep_the_time_split() -> None:
    """Two processes drawing the same power, one running 70 % of the stretches: learned
    powers equal, the split is the time split, within 2 points of the truth."""
    tenants = Tenants(
        [Tenant(HEAVY, 250_000, duty=70, stretch_ms=2000),
         Tenant(LIGHT, 250_000, duty=30, stretch_ms=2000, together_with=0)],
        idle_mw=60_000, seed=5,
    )  # fmt: skip
    reports = simulate_sampler(tenants, START_MS, 120)
    power = split(reports, GpuFormula(GpuConfig(gpu_targets="process", gpu_idle_power_w=60.0), "n"))
    errors, reached = share_errors(power, tenants, since_s=30)
    assert all(abs(error) <= 2.0 for error in errors.values()), errors
    assert reached == pytest.approx(1.0, abs=0.02)


def test_a_process_that_exits_and_a_reused_pid_inherit_nothing() -> None:
    """The heavy process exits mid-window at 60.5 s; at 75 s a light one starts under the same
    pid (another start time, as /proc tells): it gets no energy from the heavy one's learned
    power, and no report after the exit carries the heavy one's learned power."""
    exit_ms, reuse_ms = START_MS + 60_500, START_MS + 75_000
    tenants = Tenants(
        [Tenant(HEAVY, 610_000, duty=50, stretch_ms=3000, life_ms=(START_MS - 60_000, exit_ms)),
         Tenant(HEAVY, 47_000, life_ms=(reuse_ms, START_MS + 200_000)),
         Tenant(LIGHT, 47_000)],
        idle_mw=round(IDLE_W * 1000), seed=2,
    )  # fmt: skip
    started = {START_MS - 60_000: 1000, reuse_ms: 9000}
    reports = simulate_sampler(tenants, START_MS, 110, started=started)
    power = split(reports)
    heavy = [r for r in power if r.target == f"pid:{HEAVY}"]
    before = [r for r in heavy if _us(r.timestamp) < (exit_ms - 2000) * 1000]
    assert any(r.metadata.get("active_power_w", 0) > 400 for r in before)
    after = [r for r in heavy if _us(r.timestamp) > (reuse_ms + 2000) * 1000]
    assert after
    assert all(r.metadata.get("active_power_w", 0) < 200 for r in after)
    gap = [r for r in heavy if (exit_ms + 2000) * 1000 < _us(r.timestamp) < reuse_ms * 1000]
    assert sum(r.power for r in gap) == 0.0, (
        "an exited process gets nothing once the NVML input no longer lists it as running"
    )
    _, reached = share_errors(power, tenants, since_s=reuse_ms / 1000 - START_MS / 1000 + 5)
    assert reached == pytest.approx(1.0, abs=0.05)


def test_a_restart_keeps_what_was_learned() -> None:
    """State through JSON at 60 s: the restored formula splits the next minute exactly as the
    uninterrupted one does, learned powers included."""
    tenants = h200_pair(4)
    reports = simulate_sampler(tenants, START_MS, 120)
    config = GpuConfig(gpu_targets="process", gpu_idle_power_w=IDLE_W)
    whole = split(reports, GpuFormula(config, "node-1"))
    first = GpuFormula(config, "node-1")
    cut = len(reports) // 2
    early = split(reports[:cut], first)
    restored = GpuFormula(config, "node-1")
    restored.restore(json.loads(json.dumps(first.state())))
    late = split(reports[cut:], restored)
    assert [(r.timestamp, r.target, r.power, r.metadata) for r in early + late] == [
        (r.timestamp, r.target, r.power, r.metadata) for r in whole
    ]
    learned = [r.metadata for r in late if r.target == f"pid:{HEAVY}"]
    assert learned[0]["split"] == "power", "learned before the cut, known right after it"


def test_a_state_of_the_previous_release_is_read_with_nothing_learned() -> None:
    """A version 1 checkpoint (before active powers were learned): its windows and held ticks
    are read, and the split goes on by time until the data teach the powers."""
    formula = GpuFormula(GpuConfig(gpu_targets="process", gpu_idle_power_w=IDLE_W), "node-1")
    reports = simulate_sampler(h200_pair(1), START_MS, 6)
    split(reports[:30], formula)
    state = formula.state()
    device = state["devices"]["0"]
    device["windows"] = [
        [
            w["us"][0],
            w["us"][1],
            {f"pid:{k.split('@')[0]}": v * 100 for k, v in w["shares"].items()},
            w["busy"],
        ]
        for w in device["windows"]
    ]  # the layout version 1 wrote
    for key in ("powers", "sample_us"):
        del device[key]
    old = GpuFormula(GpuConfig(gpu_targets="process", gpu_idle_power_w=IDLE_W), "node-1")
    old.restore(json.loads(json.dumps({**state, "version": 1})))
    assert STATE_VERSION == 2
    power = split(reports[30:], old)
    assert power
    assert all(r.metadata.get("split", "time") == "time" for r in power[:20])
