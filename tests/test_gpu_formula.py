"""The GPU formula on known splits: device power, idle, and the share of each process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.checkpoints import STATE_VERSION, decode_checkpoint, encode_checkpoint
from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.gpu import GpuConfig, GpuFormula
from wattflow.formats import powerapi
from wattflow.formats.reports import GPUDevice, GPUProcess, GPUReport, PowerReport

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
) -> GPUReport:
    readings: dict[str, Any] = {
        "total_energy": None if energy_j is None else energy_j * 1000,
        "power": None if power_w is None else power_w * 1000,
        "util_gpu": util,
        "processes": [GPUProcess(pid=p, sm_util=sm, cgroup=cg) for p, sm, cg in processes],
    }
    if samples_w:
        readings["samples"] = {
            "TOTAL_POWER": [(int(second * 1e6) + i, w * 1000) for i, w in enumerate(samples_w)]
        }
    return GPUReport(
        timestamp=START + timedelta(seconds=second),
        sensor="node-1",
        target="all",
        devices={device: GPUDevice(**readings)},
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
    assert report.metadata == {"scope": "gpu", "device": "0", "formula": "gpu", "ratio": 0.75}


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
            tick(0, power_w=120.0, util=50, processes=busy),  # not idle yet: lowest seen
            tick(1, power_w=40.0, util=0),
            tick(2, power_w=35.0, util=0),
            tick(3, power_w=135.0, util=50, processes=busy),
        ]
    )
    assert powers_at(out, 0) == {"gpu0": pytest.approx(120.0), "pid:7": 0.0}
    assert powers_at(out, 3)["gpu0"] == pytest.approx(35.0)
    assert powers_at(out, 3)["pid:7"] == pytest.approx(100.0)


def test_power_comes_from_samples_when_there_is_no_counter() -> None:
    out = run([tick(0, samples_w=[100.0, 110.0, 120.0], power_w=500.0)], gpu_idle_power=10.0)
    assert powers_at(out, 0)["gpu0"] == pytest.approx(110.0)


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


def stream_with_an_idle_spell() -> list[GPUReport]:
    """Energy-counter ticks of one device: busy, idle for two ticks (35 W), busy again."""
    busy = [(7, 50.0, "/web")]
    watts = [120.0, 40.0, 35.0, 135.0, 140.0, 130.0, 150.0]
    reports = []
    energy_j = 0.0
    for second, power_w in enumerate(watts):
        energy_j += power_w
        idle = power_w < 100
        reports.append(
            tick(second, energy_j=energy_j, util=0 if idle else 50, processes=() if idle else busy)
        )
    return reports


def summary(out: Output) -> list[tuple[datetime, str, float]]:
    return [(r.timestamp, r.target, r.power) for r in out.reports if isinstance(r, PowerReport)]


def test_a_restored_gpu_formula_goes_on_with_the_idle_power_it_learned() -> None:
    """The state, through a checkpoint's encoding, carries the learned idle power and the
    energy counter's last reading: split anywhere, the two halves give one run's reports."""
    reports = stream_with_an_idle_spell()
    whole = run(reports)
    for cut in range(1, len(reports)):
        first = GpuFormula(GpuConfig(), "node-1")
        out = Output()
        first.process(list(reports[:cut]), out)
        saved = decode_checkpoint(encode_checkpoint({"version": STATE_VERSION, "s": first.state()}))
        assert saved is not None
        second = GpuFormula(GpuConfig(), "node-1")
        second.restore(saved["s"])
        second.process(list(reports[cut:]), out)
        assert summary(out) == summary(whole), f"cut after tick {cut}"
    # Without the state, the part after the idle spell starts from nothing: its first tick only
    # starts the counter's interval, and the idle power is not known.
    fresh = run(reports[4:])
    assert powers_at(fresh, 4) == {}
    assert powers_at(whole, 5)["gpu0"] == pytest.approx(35.0)
    assert powers_at(fresh, 5)["gpu0"] != pytest.approx(35.0)


def test_the_gpu_state_is_bounded_by_the_window_and_versioned() -> None:
    formula = GpuFormula(GpuConfig(gpu_idle_window=600), "node-1")
    idle = [tick(second, power_w=30.0 + second, util=0) for second in range(20)]
    formula.process(list(idle), Output())
    state = formula.state()
    narrower = GpuFormula(GpuConfig(gpu_idle_window=5), "node-1")
    narrower.restore(state)
    assert list(narrower.devices["0"].idle_readings) == [45.0, 46.0, 47.0, 48.0, 49.0]
    with pytest.raises(ValueError, match="version"):
        GpuFormula(GpuConfig(), "node-1").restore({**state, "version": 0})
