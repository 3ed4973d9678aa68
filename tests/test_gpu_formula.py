"""The GPU formula on known splits: device power, idle, and the share of each process."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.checkpoints import (
    STATE_VERSION,
    Checkpoints,
    decode_checkpoint,
    encode_checkpoint,
    pack_floats,
)
from wattflow.actors.formulas.base import FormulaActor, Output
from wattflow.actors.formulas.gpu import GpuConfig, GpuFormula
from wattflow.actors.runtime import DeadLetters, Ledger, QueueConfig
from wattflow.formats import powerapi
from wattflow.formats.frames import Frame
from wattflow.formats.reports import GPUDevice, GPUProcess, GPUReport, PowerReport, Report

from .conftest import wattflow

START = datetime(2026, 3, 1, tzinfo=UTC)


def tick(
    second: float,
    *,
    energy_j: float | None = None,
    power_w: float | None = None,
    samples_w: list[float] | None = None,
    util: float | None = None,
    processes: Sequence[tuple[int, float, str | None]] = (),
    device: str = "0",
    window: tuple[float, float] | None = None,
) -> GPUReport:
    readings: dict[str, Any] = {
        "total_energy": None if energy_j is None else energy_j * 1000,
        "power": None if power_w is None else power_w * 1000,
        "util_gpu": util,
        "processes": [GPUProcess(pid=p, sm_util=sm, cgroup=cg) for p, sm, cg in processes],
    }
    if window is not None:
        readings["process_window"] = tuple(_us(second) for second in window)
    if samples_w:  # the driver's samples, 20 ms apart, the last at the tick
        last = len(samples_w) - 1
        readings["samples"] = {
            "TOTAL_POWER": [
                (_us(second) - (last - i) * 20_000, w * 1000) for i, w in enumerate(samples_w)
            ]
        }
    return GPUReport(
        timestamp=START + timedelta(seconds=second),
        sensor="node-1",
        target="all",
        devices={device: GPUDevice(**readings)},
    )


def _us(second: float) -> int:
    return (START - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) + round(
        second * 1e6
    )


def run(reports: list[GPUReport], **settings: Any) -> Output:
    formula = GpuFormula(GpuConfig(**settings), "node-1")
    out = Output()
    formula.process(list(reports), out)
    return out


def powers_at(out: Output, second: float) -> dict[str, float]:
    stamp = START + timedelta(seconds=second)
    return {
        r.target: r.power
        for r in out.reports
        if isinstance(r, PowerReport) and r.timestamp == stamp
    }


def test_two_processes_at_60_and_20_percent_share_active_power_3_to_1() -> None:
    out = run(
        [
            tick(0, energy_j=0.0, util=80, processes=[(10, 60, None), (11, 20, None)]),
            tick(1, energy_j=250.0, util=80, processes=[(10, 60, None), (11, 20, None)]),
        ],
        gpu_idle_power=50.0,
    )
    powers = powers_at(out, 1)
    assert powers["pid:10"] == pytest.approx(150.0)
    assert powers["pid:11"] == pytest.approx(50.0)
    assert powers["gpu0"] == pytest.approx(50.0)
    assert out.absorbed == 1, "the counter's first reading only starts the interval"
    report = next(r for r in out.reports if r.target == "pid:10")
    assert {k: v for k, v in report.metadata.items() if not k.startswith("active_power")} == {
        "scope": "gpu",
        "device": "0",
        "formula": "gpu",
        "ratio": 0.75,
        "split": "time",
    }, "two windows teach nothing yet: the split is by time, and says so"
    assert {"active_power_w", "active_power_stderr_w"} <= set(report.metadata), (
        "every process report has the same keys, learned or not (a CSV header is fixed)"
    )


def test_processes_of_one_container_add_up_and_targets_sum_to_the_device() -> None:
    container = "/system.slice/docker-abc.scope"
    processes = [(1, 30.0, container), (2, 30.0, container), (3, 20.0, "/user.slice")]
    out = run(
        [tick(0, power_w=180.0, util=80, processes=processes)],
        gpu_idle_power=20.0,
    )
    powers = powers_at(out, 0)
    assert powers[container] == pytest.approx(120.0)
    assert powers["/user.slice"] == pytest.approx(40.0)
    assert sum(powers.values()) == pytest.approx(180.0)
    by_process = powers_at(run([tick(0, power_w=180.0, processes=processes)],
                               gpu_idle_power=20.0, gpu_targets="process"), 0)  # fmt: skip
    assert set(by_process) == {"pid:1", "pid:2", "pid:3", "gpu0"}


def test_idle_is_learned_from_ticks_without_sm_use() -> None:
    busy = [(7, 50.0, None)]
    out = run(
        [
            tick(0, power_w=120.0, util=50, processes=busy),  # idle unknown yet: 0 W
            tick(1, power_w=40.0, util=0),
            tick(2, power_w=35.0, util=0),
            tick(3, power_w=135.0, util=50, processes=busy),
        ]
    )
    assert powers_at(out, 0) == {"gpu0": 0.0, "pid:7": pytest.approx(120.0)}
    # Without a counter each tick is a span; fewer than 6 s of rest so far: idle is their mean.
    assert powers_at(out, 3)["gpu0"] == pytest.approx(37.5)
    assert powers_at(out, 3)["pid:7"] == pytest.approx(97.5)


def test_learned_idle_is_not_pulled_low_by_the_counter_s_100_ms_steps() -> None:
    """A GPU resting at 60 W whose counter moves in 6 J steps every 100 ms, read every 20
    ticks of 104.5 ms: each 2.09 s span holds 20 or 21 steps, so its ticks read 57.4 or
    60.3 W. Idle is learned as a 6 s mean, within 2 % of 60 W, not as the lowest tick."""
    period_s, step_j = 0.1045, 6.0
    reports: list[Report] = []
    for index in range(400):
        second = index * period_s
        energy = step_j * int(second / 0.1) if index % 20 == 0 else None
        reports.append(tick(second, energy_j=energy, power_w=60.0, util=0))
    formula = GpuFormula(GpuConfig(), "node-1")
    out = Output()
    formula.process(reports, out)
    device_w = [r.power for r in out.reports if isinstance(r, PowerReport)]
    assert min(device_w) < 58.0, "no span read low: the case tests nothing"
    state = formula.devices["0"]
    assert state.idle_w == pytest.approx(60.0, rel=0.02)


def _late_counter_bursts(power_w: list[float]) -> tuple[GpuFormula, Output]:
    """The formula (idle learned) over 100 ms ticks of these powers, a process busy on every
    tick above 60 W, and a counter read every 20 ticks and one step (a tick) late."""
    busy = [(7, 50.0, None)]
    reports: list[Report] = []
    for index, watts in enumerate(power_w):
        energy = sum(power_w[:index]) * 0.1 if index % 20 == 0 else None  # a tick late
        working = watts > 60.0
        reports.append(tick(index * 0.1, energy_j=energy, power_w=watts, util=50 if working else 0,
                            processes=busy if working else ()))  # fmt: skip
    formula = GpuFormula(GpuConfig(), "node-1")
    out = Output()
    formula.process(reports, out)
    return formula, out


def test_learned_idle_is_not_pulled_high_by_a_burst_s_energy_late_in_the_counter() -> None:
    """A GPU resting at 60 W, busy at 260 W for 2.1 s every 6 s, its counter read every 20
    ticks of 100 ms and one step (100 ms) late: the reading that ends a burst's first span
    misses the burst's last tick, so the next span, one busy tick then 19 resting ones, holds
    26 J more than its ticks' readings say, and its resting ticks read 68.6 W. The span after
    it rests whole and reads 60 W: idle is learned from it alone, and every busy tick from
    there on leaves exactly 60 W to the device's target."""
    power_w = [260.0 if index == 0 or (index - 1) % 60 <= 20 else 60.0 for index in range(601)]
    _, out = _late_counter_bursts(power_w)
    assert powers_at(out, 2.5)["gpu0"] == pytest.approx(60.0 * 160 / 140), "a span reads high"
    # The first span in which every tick rested ends at 6 s; each busy tick after it.
    idle_w = [powers_at(out, index * 0.1)["gpu0"] for index in range(61, 601)
              if power_w[index] > 60.0]  # fmt: skip
    assert len(idle_w) > 100
    assert max(idle_w) == pytest.approx(60.0, rel=1e-9)
    assert min(idle_w) == pytest.approx(60.0, rel=1e-9)


def test_before_a_whole_resting_span_idle_comes_from_the_resting_ticks_readings() -> None:
    """Bursts of 2.1 s at 260 W every 4 s: no 2 s counter span ever rests whole, so idle comes
    from the resting ticks alone. The counter is read one step late, so the span holding each
    burst's last tick and then 19 resting ones holds two busy ticks' energy, and its resting
    ticks read 68.6 W (what idle was when learned from their share of the counter); their
    own readings say 60 W, and idle is their median, 60 W, on every busy tick."""
    power_w = [260.0 if 1 <= index % 40 <= 21 else 60.0 for index in range(401)]
    formula, out = _late_counter_bursts(power_w)
    assert not formula.devices["0"].idle_spans, "a span rested whole: the case tests nothing"
    resting_w = [powers_at(out, index * 0.1)["gpu0"] for index in range(41, 400)
                 if power_w[index] == 60.0]  # fmt: skip
    assert max(resting_w) > 65.0, "no resting tick took a burst's energy: nothing is tested"
    idle_w = [powers_at(out, index * 0.1)["gpu0"] for index in range(41, 400)
              if power_w[index] > 60.0]  # fmt: skip
    assert len(idle_w) > 150
    assert min(idle_w) == pytest.approx(60.0, rel=1e-9)
    assert max(idle_w) == pytest.approx(60.0, rel=1e-9)


def test_power_comes_from_samples_when_there_is_no_counter() -> None:
    out = run([tick(0, samples_w=[100.0, 110.0, 120.0], power_w=500.0)], gpu_idle_power=10.0)
    assert powers_at(out, 0)["gpu0"] == pytest.approx(110.0)


def test_the_samples_a_window_brings_count_for_the_ticks_they_were_taken_in() -> None:
    """The NVML input reads the driver's power samples once a second: the first tick after a
    1 s burst at 260 W brings 50 samples, 45 of them from the burst. Its own power is 60 W (its
    own 5 samples and its reading say so), and the counter's increase over the span is shared
    by what each tick's own samples say: the burst's energy stays with the burst's ticks."""
    power_w = [260.0 if index < 10 else 60.0 for index in range(41)]
    reports = []
    for index, watts in enumerate(power_w):
        energy = sum(power_w[1 : index + 1]) * 0.1 if index % 20 == 0 else None
        samples = [260.0] * 45 + [60.0] * 5 if index == 10 else None
        reports.append(tick(index * 0.1, energy_j=energy, power_w=watts, samples_w=samples))
    out = run(reports, gpu_idle_power=60.0)
    assert powers_at(out, 1.0)["gpu0"] == pytest.approx(60.0)
    assert powers_at(out, 0.5)["gpu0"] == pytest.approx(260.0)


def test_without_per_process_readings_everything_stays_with_the_device() -> None:
    out = run([tick(0, power_w=90.0, util=70)], gpu_idle_power=30.0)
    assert powers_at(out, 0) == {"gpu0": pytest.approx(90.0)}


def test_a_device_without_any_power_reading_is_a_dead_letter() -> None:
    out = run([tick(0, util=10)])
    assert out.reports == []
    [(_, reason)] = out.rejected
    assert "no power reading" in reason


def test_the_gpu_formula_runs_from_the_command_line(tmp_path: Path) -> None:
    source = tmp_path / "gpu.jsonl"
    reports = [
        tick(s, energy_j=200.0 * s, util=50, processes=[(10, 30, None), (11, 10, None)])
        for s in range(5)
    ]
    source.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    out = tmp_path / "power.jsonl"
    done = wattflow(
        "run", "--input", "jsonl", "--model", "GPUReport", "--files", str(source),
        "--gpu-idle-power", "40", "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 4 * 3
    assert {w["target"]: w["power"] for w in written[-3:]} == pytest.approx(
        {"pid:10": 120.0, "pid:11": 40.0, "gpu0": 40.0}
    )


def test_ticks_wait_for_the_window_that_covers_them_and_split_its_shares() -> None:
    """Driver windows every 0.2 s, ticks every 0.1 s: a tick with no new window waits for the
    next one, then gets that window's shares, so nothing stays with the device but idle."""
    reports = [tick(0, energy_j=0.0, processes=[], window=(0, 0))]
    for step in range(1, 9):
        second = step / 10
        fresh = step % 2 == 0
        window = (second - 0.2, second) if fresh else (second - 0.1, second - 0.1)
        owner = 10 if step <= 4 else 11
        reports.append(
            tick(second, energy_j=300.0 * second, processes=[(owner, 99, None)] if fresh else [],
                 window=window)
        )  # fmt: skip
    out = run(reports, gpu_idle_power=100.0)
    assert {round(r.timestamp.timestamp() - START.timestamp(), 1) for r in out.reports} == {
        round(s / 10, 1) for s in range(1, 9)
    }
    for step in range(1, 9):
        powers = powers_at(out, step / 10)
        assert sum(powers.values()) == pytest.approx(300.0)
        assert powers["gpu0"] == pytest.approx(100.0)
        assert powers[f"pid:{10 if step <= 4 else 11}"] == pytest.approx(200.0)


def test_a_window_spanning_ticks_splits_each_by_its_overlap() -> None:
    """One window over two ticks with pids at 75 % and 25 %; a tick half covered by a window
    without processes keeps that half's active power on the device."""
    reports = [
        tick(0, energy_j=0.0, processes=[], window=(0, 0)),
        tick(1, energy_j=300.0, processes=[], window=(0, 0)),
        tick(2, energy_j=600.0, processes=[(1, 75, None), (2, 25, None)], window=(0, 2)),
        tick(3, energy_j=900.0, processes=[], window=(2, 2.5)),
        tick(4, energy_j=1200.0, processes=[(1, 50, None)], window=(2.5, 4)),
    ]
    out = run(reports, gpu_idle_power=100.0)
    for second in (1, 2):
        assert powers_at(out, second) == pytest.approx({"pid:1": 150.0, "pid:2": 50.0,
                                                        "gpu0": 100.0})  # fmt: skip
    assert powers_at(out, 3) == pytest.approx({"pid:1": 100.0, "gpu0": 200.0})
    assert powers_at(out, 4) == pytest.approx({"pid:1": 200.0, "gpu0": 100.0})


def test_a_tick_no_window_covers_in_time_goes_to_the_device_and_is_counted() -> None:
    formula = GpuFormula(GpuConfig(gpu_idle_power=50.0, gpu_hold_ms=500), "node-1")
    out = Output()
    reports = [tick(s / 10, energy_j=200.0 * s / 10, processes=[], window=(0, 0))
               for s in range(0, 8)]  # fmt: skip
    formula.process(list[Report](reports), out)
    assert formula.uncovered_ticks == 2, "ticks 0.1 and 0.2 waited 0.5 s in vain"
    assert powers_at(out, 0.1) == {"gpu0": pytest.approx(200.0)}
    formula.flush(out)
    assert formula.uncovered_ticks == 7
    assert {r.target for r in out.reports} == {"gpu0"}


def test_a_reused_pid_in_another_cgroup_is_another_target() -> None:
    reports = [
        tick(0, energy_j=0.0, processes=[], window=(0, 0)),
        tick(1, energy_j=200.0, processes=[(7, 90, "/a.slice")], window=(0, 1)),
        tick(2, energy_j=400.0, processes=[], window=(1, 1.2)),
        tick(3, energy_j=600.0, processes=[(7, 90, "/b.slice")], window=(1.2, 3)),
    ]
    out = run(reports, gpu_idle_power=100.0)
    assert powers_at(out, 1) == pytest.approx({"/a.slice": 100.0, "gpu0": 100.0})
    assert powers_at(out, 2) == pytest.approx({"/b.slice": 80.0, "gpu0": 120.0})
    assert powers_at(out, 3) == pytest.approx({"/b.slice": 100.0, "gpu0": 100.0})


def test_ticks_between_counter_readings_share_its_increase_by_their_readings() -> None:
    """The counter read once a second, power every 0.25 s: the four ticks of a second share
    the counter's 400 J in proportion to their readings (100, 100, 300, 300 W → 50, 50, 150,
    150 % of the mean), and their targets add up to the counter over the span."""
    reports = [tick(0, energy_j=0.0, power_w=200)]
    readings = [100.0, 100.0, 300.0, 300.0]
    for i, watts in enumerate(readings, start=1):
        energy = 400.0 if i == 4 else None
        reports.append(tick(i / 4, energy_j=energy, power_w=watts))
    out = run(reports, gpu_idle_power_w=0)
    powers = [sum(powers_at(out, i / 4).values()) for i in range(1, 5)]
    assert powers == pytest.approx([200.0, 200.0, 600.0, 600.0])
    assert sum(p * 0.25 for p in powers) == pytest.approx(400.0)


def test_a_tick_the_counter_does_not_reach_in_time_keeps_its_own_reading() -> None:
    """No counter reading within --gpu-hold-ms: the tick is released with its own reading,
    and the next reading shares only what that tick did not already take."""
    reports = [tick(0, energy_j=0.0, power_w=100)]
    reports += [tick(i, power_w=100) for i in (1, 2, 3, 4)]
    reports.append(tick(5, energy_j=1000.0, power_w=100))
    out = run(reports, gpu_idle_power_w=0, gpu_hold_ms=2500)
    powers = {i: sum(powers_at(out, i).values()) for i in range(1, 6)}
    assert powers[1] == pytest.approx(100.0)  # 3 s old at tick 4: released on its reading
    # The others were still held when the counter came: they share the 900 J left.
    assert [powers[i] for i in (2, 3, 4, 5)] == pytest.approx([225.0] * 4)
    assert sum(powers.values()) == pytest.approx(1000.0)  # the counter's increase, over all


def busy_stream() -> list[GPUReport]:
    """Four and a half seconds of a node with two GPUs, ticks every 0.1 s. GPU 0 reads its
    counter every third tick and its process windows every second tick, each ending a tick
    before it comes (so ticks wait for them); it rests for a while, its windows stop for 0.6 s
    (ticks go uncovered), then its counter for 0.7 s (ticks go on their own readings). GPU 1 is
    a MIG device: power readings only, no processes."""
    reports = []
    energy_j = 0.0
    for step in range(46):
        second = step / 10
        resting = 15 <= step < 22
        power_w = (40.0 + step % 3) if resting else 150.0 + 10 * (step % 4)
        energy_j += power_w * 1.1 * 0.1
        fresh = step % 2 == 0 and not 26 <= step < 32
        processes = [] if resting or not fresh else [(10, 60.0, "/a.slice"), (11, 20.0, None)]
        window = (second - 0.3, second - 0.1) if fresh and step >= 2 else (second, second)
        counter = step % 3 == 0 and not 32 < step < 40
        report = tick(second, energy_j=energy_j if counter else None, power_w=power_w,
                      util=0 if resting else 80, processes=processes, window=window)  # fmt: skip
        mig = GPUDevice(power=(60.0 + step % 5) * 1000, util_gpu=30.0)
        devices = {**report.devices, "1": mig}
        reports.append(report.model_copy(update={"devices": devices, "metadata": {"n": step}}))
    return reports


def through_checkpoint(formula: GpuFormula) -> Any:
    """The formula's state as a restart finds it: encoded and decoded as a checkpoint is."""
    saved = decode_checkpoint(encode_checkpoint({"version": STATE_VERSION, "s": formula.state()}))
    assert saved is not None
    return saved["s"]


def everything(out: Output) -> list[tuple[datetime, str, float, dict[str, Any]]]:
    return [
        (r.timestamp, r.target, r.power, r.metadata)
        for r in out.reports
        if isinstance(r, PowerReport)
    ]


def test_a_restart_at_any_checkpoint_gives_the_reports_of_one_uninterrupted_run() -> None:
    """Cut the stream after every tick: the state, through a checkpoint's encoding, carries the
    counter, the learned idle, the windows and the ticks still held, so the two halves give
    exactly the reports (and uncovered-tick count) of one run, none lost and none twice."""
    reports = busy_stream()
    settings = {"gpu_hold_ms": 250}
    whole_formula = GpuFormula(GpuConfig(**settings), "node-1")
    whole = Output()
    whole_formula.process(list[Report](reports), whole)
    whole_formula.flush(whole)
    assert whole_formula.uncovered_ticks > 0, "the stream exercises uncovered ticks"
    assert {r.target for r in whole.reports} == {"/a.slice", "pid:11", "gpu0", "gpu1"}
    held_at_a_cut = 0
    for cut in range(1, len(reports)):
        first = GpuFormula(GpuConfig(**settings), "node-1")
        out = Output()
        first.process(list[Report](reports[:cut]), out)
        held_at_a_cut = max(held_at_a_cut, len(first.devices["0"].held))
        second = GpuFormula(GpuConfig(**settings), "node-1")
        second.restore(through_checkpoint(first))
        second.process(list[Report](reports[cut:]), out)
        second.flush(out)
        assert everything(out) == everything(whole), f"cut after tick {cut}"
        assert second.uncovered_ticks == whole_formula.uncovered_ticks
    assert held_at_a_cut >= 3, "some cuts fall while ticks wait for windows and the counter"
    # Without its state, the rest of the stream starts from nothing: reports differ.
    fresh = GpuFormula(GpuConfig(**settings), "node-1")
    out = Output()
    fresh.process(list[Report](reports[20:]), out)
    fresh.flush(out)
    assert everything(out) != everything(whole)[-len(everything(out)) :]


def test_the_gpu_state_is_bounded_by_the_idle_window_and_versioned() -> None:
    formula = GpuFormula(GpuConfig(gpu_idle_window=600), "node-1")
    formula.process([tick(second, power_w=30.0 + second, util=0) for second in range(20)],
                    Output())  # fmt: skip
    state = through_checkpoint(formula)
    narrower = GpuFormula(GpuConfig(gpu_idle_window=5), "node-1")
    narrower.restore(state)
    # Without an energy counter each tick is a span of its own, its reading its power.
    spans = narrower.devices["0"].idle_spans
    assert [energy_j / seconds for energy_j, seconds, _ in spans] == [45.0, 46.0, 47.0, 48.0, 49.0]
    with pytest.raises(ValueError, match="version 0, not 2"):
        GpuFormula(GpuConfig(), "node-1").restore({**state, "version": 0})


def test_a_state_saved_when_resting_ticks_taught_idle_still_teaches_it() -> None:
    """A checkpoint written before whole spans taught idle keeps the resting ticks' power: they
    teach idle (their median, the last ``--gpu-idle-window`` of them) until a span rests whole."""
    formula = GpuFormula(GpuConfig(), "node-1")
    formula.process([tick(0, power_w=200.0, util=50, processes=[(7, 50.0, None)])], Output())
    state = through_checkpoint(formula)
    device = state["devices"]["0"]
    del device["idle_spans"], device["span"]
    device["idle_w"] = pack_floats([10.0, 90.0, 58.0, 61.0, 60.0, 59.0, 75.0])
    restored = GpuFormula(GpuConfig(gpu_idle_window=5), "node-1")
    restored.restore(state)
    out = Output()
    restored.process([tick(1, power_w=200.0, util=50, processes=[(7, 50.0, None)])], out)
    assert powers_at(out, 1)["gpu0"] == pytest.approx(60.0)


def test_a_gpu_state_of_another_version_is_logged_and_the_instance_starts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    formula = GpuFormula(GpuConfig(), "node-1")
    formula.process([tick(second, power_w=30.0, util=0) for second in range(3)], Output())
    state = {**formula.state(), "version": 99}
    saved = {"version": STATE_VERSION, "formulas": {"gpu": {"node-1": state}}}

    async def dispatch(produced: list[Report | Frame]) -> None:
        del produced

    actor = FormulaActor(GpuFormula, GpuConfig(), queue=QueueConfig(), ledger=Ledger(),
                         dead_letters=DeadLetters(), dispatch=dispatch)  # fmt: skip
    actor.checkpoints = Checkpoints(None, 60.0, 1)
    actor.checkpoints.restore(encode_checkpoint(saved))
    with caplog.at_level(logging.WARNING):
        instance = actor.instance("node-1")
    assert (
        "saved state of node-1 not restored (ValueError: GPU formula state of version 99, "
        "not 2); it starts afresh" in caplog.text
    )
    assert isinstance(instance, GpuFormula)
    assert instance.devices == {}


def test_a_counter_read_late_after_a_stall_teaches_idle_by_the_reading_times() -> None:
    """A resting GPU at 60 W, its counter read every second; one reading comes 260 ms after its
    tick's timestamp (a sampler stalled between stamping the tick and reading the counter), so
    that span holds 1.26 s of energy and the next 0.74 s. By the driver's own reading times
    (``total_energy_us``) idle is 60 W, which a process then busy at 90 W leaves on the
    device's target; by the ticks' timestamps idle read 57.4 W."""
    late = {6: 0.26}
    reports = []
    energy_j = 0.0
    for second in range(16):
        busy = second >= 14
        read_s = second + late.get(second, 0.0)
        energy_j = 60.0 * min(read_s, 13.0) + 90.0 * max(read_s - 13.0, 0.0)
        processes = [GPUProcess(pid=7, sm_util=100.0)] if busy else []
        device = GPUDevice(
            total_energy=energy_j * 1000,
            total_energy_us=_us(read_s),
            power=90_000.0 if busy else 60_000.0,
            util_gpu=100.0 if busy else 0.0,
            processes=processes,
            process_window=(_us(max(second - 1, 0)), _us(second)),
        )
        reports.append(
            GPUReport(
                timestamp=START + timedelta(seconds=second),
                sensor="node-1",
                target="all",
                devices={"0": device},
            )
        )
    out = run(reports, gpu_targets="process")
    powers = powers_at(out, 14)
    assert powers["gpu0"] == pytest.approx(60.0)
    assert powers["pid:7"] == pytest.approx(30.0)
