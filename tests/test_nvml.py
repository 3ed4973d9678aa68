"""The NVML sampler through the real ``nvidia-ml-py`` binding, over the C stand-in library.

Each scenario runs ``wattflow run --input nvml … --output jsonl --model GPUReport`` as a user
would, with the stand-in first on ``LD_LIBRARY_PATH``. The stand-in's power curves are functions
of absolute time, so every reading and sample can be checked against the value it must have at
its own timestamp; nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import ctypes.util
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Service
from tests.nvml_fake import (
    SamplerRun,
    build_fake_nvml,
    nvml_environment,
    run_sampler,
    write_scenario,
)
from wattflow.actors.pullers.nvml.processes import cgroup_of

PERIOD_US = 1_000_000
STEPS = ((0, 100_000), (250_000, 250_000), (750_000, 100_000))
"""Device 0's power curve: (offset in the second, µs → mW). Its edges sit halfway between the
100 ms ticks, so a reading taken just after its tick began sees the same step as the tick's
timestamp."""

MISSING_PID = 4_194_305
"""One past the largest pid_max Linux allows: no process has it, so it has no cgroup."""

REPORTS = 62
"""Six seconds at 10 Hz: every group of the sampler's schedule is read at least twice."""


def power_at(t_us: int) -> int:
    """Device 0's power in mW at absolute time ``t_us``."""
    offset = t_us % PERIOD_US
    return [mw for start, mw in STEPS if start <= offset][-1]


def energy_to(t_us: int) -> int:
    """Integral of device 0's curve from time 0 to ``t_us``, in mW·µs."""
    bounds = [start for start, _ in STEPS[1:]] + [PERIOD_US]
    per_period = sum(mw * (end - start) for (start, mw), end in zip(STEPS, bounds, strict=True))
    offset = t_us % PERIOD_US
    partial = sum(
        mw * (min(offset, end) - start)
        for (start, mw), end in zip(STEPS, bounds, strict=True)
        if offset > start
    )
    return per_period * (t_us // PERIOD_US) + partial


def micros(report: dict[str, Any]) -> int:
    """A report's timestamp in Unix µs, computed exactly."""
    stamp = datetime.fromisoformat(report["timestamp"]).replace(tzinfo=UTC)
    delta = stamp - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def own_cgroup() -> str:
    """This process's cgroup as the NVML input picks it from /proc/self/cgroup: the v2
    line; on v1, perf_event's, else the deepest (``processes.cgroup_of``)."""
    picked = cgroup_of(Path("/proc/self/cgroup").read_text())
    assert picked is not None
    return picked


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the stand-in as ``libnvidia-ml.so.1``, for ``LD_LIBRARY_PATH``."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture(scope="module")
def run(fake_nvml: Path, tmp_path_factory: pytest.TempPathFactory) -> SamplerRun:
    """Three GPUs sampled at 10 Hz for 62 ticks: a full one with a known power curve, one
    without energy counter, PCIe, clocks, temperature or power samples, and one that only
    has the legacy power call. Buffers keep 10 s of samples (the sampler reads the
    utilisation buffers every 5 s)."""
    directory = tmp_path_factory.mktemp("nvml-run")
    scenario = write_scenario(
        directory / "scenario.txt",
        [
            "devices=3",
            "power_sample_ms=20",
            "util_sample_ms=50",
            "buffer_samples=200",
            "d0.power=" + ",".join(f"{start // 1000}:{mw}" for start, mw in STEPS),
            "d0.util_gpu=70",
            "d0.util_mem=30",
            f"d0.proc={os.getpid()}:60:10",
            f"d0.proc={MISSING_PID}:20:5",
            "d1.power=0:150000",
            "d1.unsupported=power_instant,energy,pcie,app_clock,temperature,samples_power,"
            "processes",
            "d2.power=0:80000",
            "d2.unsupported=power_instant,power_average",
            "d2.proc=4194306:150:10",
        ],
    )
    return run_sampler(
        nvml_environment(fake_nvml, scenario),
        directory / "gpu.jsonl",
        "--interval-ms",
        "100",
        reports=REPORTS,
    )


def test_sampler_runs_and_stops_cleanly(run: SamplerRun) -> None:
    code, stderr, reports = run
    assert code == 0, stderr
    assert "Traceback" not in stderr
    assert len(reports) >= REPORTS
    assert {r["target"] for r in reports} == {"all"}
    assert all(set(r["devices"]) == {"0", "1", "2"} for r in reports)
    stamps = [micros(r) for r in reports]
    assert stamps == sorted(set(stamps))


def test_instant_power_follows_the_curve(run: SamplerRun) -> None:
    reports = run.reports
    checked = 0
    for report in reports:
        t = micros(report)
        device = report["devices"]["0"]
        assert device["power_averaged"] is False
        assert device["power"] in {100_000.0, 250_000.0}
        # A reading taken just before an edge may see the next step; skip those.
        if all(not 0 <= (edge - t % PERIOD_US) % PERIOD_US < 20_000 for edge, _ in STEPS):
            assert device["power"] == power_at(t), report["timestamp"]
            checked += 1
    assert checked >= REPORTS // 2


def window_reports(run: SamplerRun) -> list[dict[str, Any]]:
    """The ticks that read device 0's energy counter: one every 2 s (``--energy-ms``)."""
    return [r for r in run.reports if "total_energy" in r["devices"]["0"]]


def test_slow_readings_are_read_at_their_own_rate(run: SamplerRun) -> None:
    """Power every tick; processes and power samples once a second; energy every 2 s; the
    utilisation buffers every 5 s; the tick reports stay 10 Hz."""
    reports = run.reports
    assert all("power" in r["devices"][d] for r in reports for d in "012")
    energy = [i for i, r in enumerate(reports) if "total_energy" in r["devices"]["0"]]
    assert len(energy) >= 3
    assert all(later - earlier == 20 for earlier, later in itertools.pairwise(energy))
    windows = [i for i, r in enumerate(reports) if "TOTAL_POWER" in r["devices"]["0"].get(
        "samples", {})]  # fmt: skip
    assert len(windows) >= 6
    assert all(later - earlier == 10 for earlier, later in itertools.pairwise(windows))
    assert set(energy) <= set(windows)
    for i, report in enumerate(reports):
        samples = report["devices"]["0"].get("samples", {})
        assert ("TOTAL_POWER" in samples) <= (i in windows)
        assert bool(report["devices"]["0"]["processes"]) <= (i in windows)
    util_reads = [i for i, r in enumerate(reports) if "GPU_UTILIZATION" in r["devices"]["0"].get(
        "samples", {})]  # fmt: skip
    assert 1 <= len(util_reads) <= 2
    assert all(later - earlier == 50 for earlier, later in itertools.pairwise(util_reads))


def test_energy_counter_is_the_integral_of_power(run: SamplerRun) -> None:
    reports = window_reports(run)
    energies = [r["devices"]["0"]["total_energy"] for r in reports]
    assert energies == sorted(energies)
    first, last = reports[0], reports[-1]
    measured_mj = energies[-1] - energies[0]
    expected_mj = (energy_to(micros(last)) - energy_to(micros(first))) / 1e6
    assert measured_mj == pytest.approx(expected_mj, rel=0.03)
    # each reading says when the driver took it: at or after its tick's timestamp, well
    # before the next tick
    for report in reports:
        read_us = report["devices"]["0"]["total_energy_us"]
        assert micros(report) <= read_us < micros(report) + 100_000


def test_averaged_and_legacy_power_are_labelled(run: SamplerRun) -> None:
    reports = run.reports
    for report in reports:
        averaged, legacy = report["devices"]["1"], report["devices"]["2"]
        assert averaged["power"] == 150_000.0
        assert averaged["power_averaged"] is True
        assert legacy["power"] == 80_000.0
        assert "power_averaged" not in legacy


def test_unsupported_readings_are_left_out_not_zeroed(run: SamplerRun) -> None:
    reports = run.reports
    unsupported = {"pci_tx", "pci_rx", "app_clock_gpu", "app_clock_mem", "temperature"}
    for report in reports:
        full, partial = report["devices"]["0"], report["devices"]["1"]
        assert unsupported <= set(full)
        assert not unsupported & set(partial)
        assert partial["clock_gpu"] == full["clock_gpu"] == 1410.0
        assert "TOTAL_POWER" not in partial.get("samples", {})
        assert not partial.get("processes")
        assert "total_energy" not in partial
    assert window_reports(run)
    assert any("GPU_UTILIZATION" in r["devices"]["1"].get("samples", {}) for r in reports)


@pytest.mark.parametrize(
    ("device", "kind", "period_us"),
    [
        ("0", "TOTAL_POWER", 20_000),
        ("0", "GPU_UTILIZATION", 50_000),
        ("0", "MEMORY_UTILIZATION", 50_000),
        ("1", "GPU_UTILIZATION", 50_000),
        ("2", "TOTAL_POWER", 20_000),
    ],
)
def test_samples_are_neither_missed_nor_repeated(
    run: SamplerRun, device: str, kind: str, period_us: int
) -> None:
    reports = run.reports
    samples = [s for r in reports for s in r["devices"][device].get("samples", {}).get(kind, [])]
    times = [t for t, _ in samples]
    # Every grid point of the driver's buffer between the first and the last, once, in order.
    assert times == list(range(times[0], times[-1] + 1, period_us))
    # Read every second (power) or every 5 s (utilisation): at least 4 s of samples.
    assert (times[-1] - times[0]) // period_us + 1 >= 4_000_000 // period_us
    if (device, kind) == ("0", "TOTAL_POWER"):
        assert all(value == power_at(t) for t, value in samples)
        assert {value for _, value in samples} == {100_000.0, 250_000.0}
    if kind == "GPU_UTILIZATION" and device == "0":
        assert {value for _, value in samples} == {70.0}


def test_processes_carry_their_cgroup(run: SamplerRun) -> None:
    reports = run.reports
    with_processes = [r["devices"]["0"]["processes"] for r in window_reports(run)[1:]]
    assert all(with_processes)
    for processes in with_processes:
        by_pid = {p["pid"]: p for p in processes}
        assert set(by_pid) == {os.getpid(), MISSING_PID}
        me = by_pid[os.getpid()]
        assert (me["sm_util"], me["mem_util"], me["cgroup"]) == (60.0, 10.0, own_cgroup())
        # its start time, as /proc/<pid>/stat's field 22 gives it: a reused pid is told apart
        stat = Path(f"/proc/{os.getpid()}/stat").read_text()
        assert me["started"] == int(stat[stat.rfind(")") + 2 :].split()[19])
        assert by_pid[MISSING_PID]["sm_util"] == 20.0
        assert "cgroup" not in by_pid[MISSING_PID]
        assert "started" not in by_pid[MISSING_PID]
    # An impossible utilisation (150 %) is not passed on as a process reading.
    assert all(not r["devices"]["2"].get("processes") for r in reports)


def test_selected_devices_sensor_name_and_cgroup_layouts(fake_nvml: Path, tmp_path: Path) -> None:
    """``--devices`` picks GPUs; ``--cgroup-root`` reads a v1-only and a hybrid layout."""
    root = tmp_path / "proc"
    (root / "111").mkdir(parents=True)
    (root / "111" / "cgroup").write_text("4:memory:/docker/abc\n1:cpu:/docker/abc-cpu\n")
    (root / "222").mkdir()
    (root / "222" / "cgroup").write_text("1:cpu:/legacy\n0::/system.slice/job.scope\n")
    scenario = write_scenario(
        tmp_path / "scenario.txt",
        ["devices=3", "d0.proc=111:40:0", "d1.proc=333:10:0", "d2.proc=222:25:5"],
    )
    code, stderr, reports = run_sampler(
        nvml_environment(fake_nvml, scenario),
        tmp_path / "gpu.jsonl",
        "--devices",
        "0,2",
        "--interval-ms",
        "50",
        "--window-ms",
        "50",
        "--sensor",
        "gpu-node-7",
        "--cgroup-root",
        str(root),
        reports=3,
    )
    assert code == 0, stderr
    assert {r["sensor"] for r in reports} == {"gpu-node-7"}
    assert all(set(r["devices"]) == {"0", "2"} for r in reports)
    cgroups = {
        p["pid"]: p["cgroup"]
        for r in reports
        for d in r["devices"].values()
        for p in d["processes"]
    }
    assert cgroups == {111: "/docker/abc", 222: "/system.slice/job.scope"}


def _one_line_error(result_code: int, stderr: str) -> str:
    assert result_code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_no_library_is_one_clear_line(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed: the loader finds it without any path")
    from tests.conftest import wattflow

    empty = tmp_path / "no-nvml"
    empty.mkdir()
    result = wattflow(
        "run", "--input", "nvml", "--output", "jsonl", "--model", "GPUReport", "--file",
        str(tmp_path / "gpu.jsonl"),
        env=nvml_environment(empty, None),
    )  # fmt: skip
    line = _one_line_error(result.returncode, result.stderr)
    assert "no NVIDIA driver found (libnvidia-ml.so.1 not loadable)" in line
    assert not (tmp_path / "gpu.jsonl").exists() or not (tmp_path / "gpu.jsonl").read_text()


@pytest.mark.parametrize(
    ("settings", "flags", "expected"),
    [
        (["init_error=DRIVER_NOT_LOADED"], [], "NVIDIA kernel driver is not loaded"),
        (["init_error=NO_PERMISSION"], [], "no permission to open the NVIDIA devices"),
        (["devices=0"], [], "no NVIDIA GPU found"),
        (["devices=2"], ["--devices", "0,5"], "no GPU with index 5; this node has 2"),
    ],
)
def test_unusable_nvml_is_one_clear_line(
    fake_nvml: Path, tmp_path: Path, settings: list[str], flags: list[str], expected: str
) -> None:
    from tests.conftest import wattflow

    scenario = write_scenario(tmp_path / "scenario.txt", settings)
    result = wattflow(
        "run", "--input", "nvml", *flags, "--output", "jsonl", "--model", "GPUReport",
        "--file", str(tmp_path / "gpu.jsonl"),
        env=nvml_environment(fake_nvml, scenario),
    )  # fmt: skip
    line = _one_line_error(result.returncode, result.stderr)
    assert expected in line
    assert line.startswith("wattflow: error: NVML:")


STALL_SCRIPT = """
import asyncio, json, sys

from wattflow.actors.pullers.nvml.config import NvmlPullerConfig
from wattflow.actors.pullers.nvml.puller import NvmlPuller


class StallingPipeline:
    '''A pipeline whose mailbox is full once for 350 ms, then asks the sampler to stop.'''

    def __init__(self, stall_at, stop_at):
        self.stopping = asyncio.Event()
        self.reports = []
        self.batches = []
        self.rejected = []
        self.stall_at, self.stop_at = stall_at, stop_at

    async def emit(self, batch):
        self.reports.extend(batch)
        self.batches.append(len(batch))
        if len(self.batches) == self.stall_at:
            await asyncio.sleep(0.35)
        if len(self.reports) >= self.stop_at:
            self.stopping.set()

    def reject(self, payload, reason):
        self.rejected.append(reason)


async def main(batch_ms, stall_at, stop_at):
    puller = NvmlPuller(NvmlPullerConfig(interval_ms=100, window_ms=100, batch_ms=batch_ms))
    pipeline = StallingPipeline(stall_at, stop_at)
    await asyncio.wait_for(puller.pull(pipeline), 30)
    times = [report.timestamp.timestamp() for report in pipeline.reports]
    print(json.dumps({"ticks": puller.ticks, "skipped": puller.skipped_ticks,
                      "reports": len(pipeline.reports), "batches": pipeline.batches,
                      "times": times, "rejected": pipeline.rejected}))


asyncio.run(main(*map(int, sys.argv[1:])))
"""


def _stall(fake_nvml: Path, tmp_path: Path, *arguments: int) -> dict[str, Any]:
    scenario = write_scenario(tmp_path / "scenario.txt", ["devices=1", "d0.proc=77:150:0"])
    return _run_script(STALL_SCRIPT, fake_nvml, scenario, *arguments)


def _run_script(script: str, fake_nvml: Path, scenario: Path, *arguments: int) -> dict[str, Any]:
    """Run a puller script over the stand-in; what it printed, as JSON."""
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, arguments)],
        env=nvml_environment(fake_nvml, scenario),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outcome: dict[str, Any] = json.loads(result.stdout)
    return outcome


def test_a_stall_skips_ticks_instead_of_catching_up(fake_nvml: Path, tmp_path: Path) -> None:
    """One tick per batch: while the pipeline stalls 350 ms the sampler holds one tick, then
    skips the ticks it could not hand over (counting them) instead of queueing them; it stops
    when the pipeline asks, emits every tick it took, and dead-letters an impossible reading."""
    outcome = _stall(fake_nvml, tmp_path, 100, 2, 6)
    assert outcome["ticks"] == outcome["reports"] >= 6
    assert set(outcome["batches"]) == {1}
    assert outcome["skipped"] >= 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(outcome["times"])]
    assert max(gaps) >= 0.2, "the stall shows as a gap, not as ticks sampled late in a burst"
    assert all(gap > 0 for gap in gaps)
    assert outcome["rejected"]
    assert all("impossible utilisation for pid 77" in reason for reason in outcome["rejected"])


def test_ticks_go_down_the_pipeline_in_batches_and_none_is_lost_at_stop(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Five ticks per batch, each its own report 100 ms after the previous; the pipeline asks
    to stop during the second batch, and the ticks sampled meanwhile still arrive."""
    outcome = _stall(fake_nvml, tmp_path, 500, 0, 7)
    assert outcome["batches"][:2] == [5, 5]
    assert outcome["ticks"] == outcome["reports"] == sum(outcome["batches"])
    assert outcome["skipped"] == 0
    # Ticks fall on the 100 ms grid, one per slot and none skipped: each is sampled in its own
    # slot (a loaded machine may start one a few ms late), never two in a burst.
    slots = [math.floor(t * 10 + 0.5) for t in outcome["times"]]
    assert slots == list(range(slots[0], slots[0] + len(slots)))


def _run_until(command: list[str], environment: dict[str, str], output: Path, count: int) -> str:
    log = output.with_name(output.name + ".log")
    with Service(log, command=command, env=environment) as service:
        return service.stop_once_written(output, count, signal.SIGINT)


def test_sensor_command_records_and_the_gpu_formula_splits_3_to_1(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """The sampler alone with `wattflow sensor nvml`, then through the GPU formula: two
    processes at 60 % and 20 % SM share the power above idle 3:1."""
    scenario = write_scenario(
        tmp_path / "scenario.txt",
        ["devices=1", "d0.power=0:250000", "d0.util_gpu=80", "d0.proc=4242:60:5",
         "d0.proc=4343:20:5"],
    )  # fmt: skip
    environment = nvml_environment(fake_nvml, scenario)
    recorded = tmp_path / "gpu.jsonl"
    wattflow_command = [sys.executable, "-m", "wattflow.service"]
    _run_until(
        [*wattflow_command, "sensor", "nvml", "--interval-ms", "50",
         "--output", "jsonl", "--file", str(recorded)],
        environment, recorded, 5,
    )  # fmt: skip
    assert all(json.loads(line)["devices"]["0"]["power"] == 250000.0
               for line in recorded.read_text().splitlines())  # fmt: skip
    power = tmp_path / "power.jsonl"
    _run_until(
        [*wattflow_command, "run", "--input", "nvml", "--interval-ms", "50", "--window-ms", "50",
         "--gpu-idle-power", "50", "--output", "jsonl", "--file", str(power)],
        environment, power, 12,
    )  # fmt: skip
    by_target: dict[str, list[float]] = {}
    for line in power.read_text().splitlines():
        report = json.loads(line)
        by_target.setdefault(report["target"], []).append(report["power"])
    # The median tick: the last one, split at shutdown, may not be covered by a window yet.
    assert statistics.median(by_target["pid:4242"]) == pytest.approx(150.0, rel=0.02)
    assert statistics.median(by_target["pid:4343"]) == pytest.approx(50.0, rel=0.02)
    assert statistics.median(by_target["gpu0"]) == pytest.approx(50.0, rel=0.02)


PCIE_SCRIPT = """
import asyncio, json, threading

import pynvml

from wattflow.actors.pullers.nvml.config import NvmlPullerConfig
from wattflow.actors.pullers.nvml.puller import NvmlPuller
from wattflow.actors.pullers.nvml.sampler import NvmlSampler

# Which PCIe calls a tick made: the blocking calls must all be on the reader's thread.
in_tick = threading.local()
calls_in_ticks = []
throughput, tick = pynvml.nvmlDeviceGetPcieThroughput, NvmlSampler.tick


def counted_throughput(*args):
    if getattr(in_tick, "on", False):
        calls_in_ticks.append(threading.current_thread().name)
    return throughput(*args)


def counted_tick(self):
    in_tick.on = True
    try:
        return tick(self)
    finally:
        in_tick.on = False


pynvml.nvmlDeviceGetPcieThroughput = counted_throughput
NvmlSampler.tick = counted_tick


class Pipeline:
    def __init__(self):
        self.stopping = asyncio.Event()
        self.reports = []

    async def emit(self, batch):
        self.reports.extend(batch)
        if len(self.reports) >= 15:
            self.stopping.set()

    def reject(self, payload, reason):
        raise AssertionError(reason)


async def main():
    puller = NvmlPuller(NvmlPullerConfig(interval_ms=100, batch_ms=100))
    pipeline = Pipeline()
    await asyncio.wait_for(puller.pull(pipeline), 30)
    print(json.dumps({
        "skipped": puller.skipped_ticks,
        "calls_in_ticks": calls_in_ticks,
        "times": [r.timestamp.timestamp() for r in pipeline.reports],
        "pcie": [[d.pci_tx, d.pci_rx] for r in pipeline.reports for d in r.devices.values()],
    }))


asyncio.run(main())
"""


def test_slow_pcie_queries_do_not_hold_up_the_ticks(fake_nvml: Path, tmp_path: Path) -> None:
    """NVML's PCIe throughput call blocks 20 ms; with 4 GPUs, two calls each, it would take
    160 ms of a 100 ms tick. The sampler reads it apart from the ticks (no tick makes the
    call), so every report still carries the latest figures and ticks fall on the 100 ms
    grid, one per slot.

    The ticks' times are checked by slot, not by their gaps: on a loaded machine a tick can
    start some ms late (a gap of 0.1 s ± 0.01 failed under a CPU burner), while a tick that
    made the PCIe calls would end 160 ms later and push the next one out of its slot."""
    scenario = write_scenario(
        tmp_path / "scenario.txt",
        ["devices=4", "pcie_delay_ms=20"] + [f"d{n}.pcie_tx={100 + n}" for n in range(4)],
    )
    outcome = _run_script(PCIE_SCRIPT, fake_nvml, scenario)
    assert outcome["calls_in_ticks"] == []
    slots = [math.floor(t * 10 + 0.5) for t in outcome["times"]]
    assert len(set(slots)) == len(slots), "two ticks in one 100 ms slot"
    assert outcome["skipped"] == len(set(range(slots[0], slots[-1] + 1)) - set(slots))
    assert len(outcome["pcie"]) == 4 * len(outcome["times"]) >= 60
    assert outcome["pcie"][:4] == [[100.0 + n, 2000.0] for n in range(4)]
    assert all(pair in ([100.0 + n, 2000.0] for n in range(4)) for pair in outcome["pcie"])


def test_nvml_errors_are_typed_and_a_failing_reading_warns_once_with_a_count(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """The energy counter fails with GPU_IS_LOST every time, the temperature with TIMEOUT,
    the SM clock with NO_PERMISSION: the first two are warned about once each when they have
    failed 3 times in a row (and again at stop, with the count), the third once, and never
    asked again; the readings that work are still reported."""
    from wattflow.actors.pullers.nvml.api import (
        NvmlDriverError,
        NvmlGpuLost,
        NvmlNoPermission,
        NvmlNotFound,
        NvmlNotSupported,
        NvmlTimeout,
        typed,
    )

    kinds = {3: NvmlNotSupported, 4: NvmlNoPermission, 6: NvmlNotFound, 15: NvmlGpuLost,
             10: NvmlTimeout, 999: NvmlDriverError}  # fmt: skip
    assert all(type(typed(code, "call", "text")) is kind for code, kind in kinds.items())
    scenario = write_scenario(
        tmp_path / "scenario.txt",
        ["devices=1", "d0.fail=energy:GPU_IS_LOST,temperature:TIMEOUT,clock:NO_PERMISSION"],
    )
    code, log, reports = run_sampler(
        nvml_environment(fake_nvml, scenario), tmp_path / "gpu.jsonl", "--energy-ms", "1000",
        reports=35,
    )  # fmt: skip
    assert code == 0, log
    devices = [r["devices"]["0"] for r in reports]
    assert all("power" in d and "total_energy" not in d and "temperature" not in d
               for d in devices)  # fmt: skip
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    energy = [line for line in warnings if "energy keeps failing" in line]
    assert len(energy) == 1, warnings
    assert "GPU is lost" in energy[0]
    assert "3 times in a row" in energy[0]
    assert len([line for line in warnings if "temperature keeps failing" in line]) == 1
    clock = [line for line in warnings if ": clock:" in line]
    assert len(clock) == 1, warnings
    assert "Insufficient Permissions" in clock[0]
    stopped = [line for line in warnings if "still failing at stop" in line]
    assert {line.split("GPU 0: ")[1].split(" ")[0] for line in stopped} == {"energy", "temperature"}
    counts = [int(line.rsplit("(", 1)[1].split()[0]) for line in stopped]
    assert all(count >= 3 for count in counts), stopped


def test_check_says_which_gpus_cannot_be_split_per_process(fake_nvml: Path, tmp_path: Path) -> None:
    """`wattflow check` through the sampler's seam: GPU 1 in MIG mode is named as attributed
    per device, GPU 0 is not."""
    from tests.conftest import wattflow

    scenario = write_scenario(tmp_path / "scenario.txt", ["devices=2", "d1.mig=1"])
    done = wattflow("check", env={**nvml_environment(fake_nvml, scenario), "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "NVML" in line)
    assert "driver 580.159.04-stand-in; 2 GPU(s)" in line
    assert "0: NVML stand-in GPU; 1: NVML stand-in GPU, MIG mode" in line
    assert "attributed per device" in line


def test_each_reading_is_asked_only_as_often_as_it_changes(fake_nvml: Path, tmp_path: Path) -> None:
    """Over the H100-like stand-in, the C calls per second per GPU (counted by the stand-in,
    pynvml's sizing calls included) follow the schedule: power and utilisation every tick,
    process utilisation once a second, energy (in the same field-values call) every 2 s, each buffer
    in one C call, the slow readings at their own rates. Counts, not CPU time: the time a call
    costs on a real driver is the benchmark's business (benchmarks/nvml_overhead.py)."""
    calls = tmp_path / "calls.txt"
    scenario = write_scenario(
        tmp_path / "scenario.txt",
        ["devices=2", "call_costs=h100", "d0.proc=4242:60:5", "d1.proc=4343:20:5"],
    )
    environment = {**nvml_environment(fake_nvml, scenario), "FAKE_NVML_CALLS": str(calls)}
    code, log, reports = run_sampler(environment, tmp_path / "gpu.jsonl", reports=60)
    assert code == 0, log
    per_second = len(reports) / 10 * 2  # GPU-seconds
    rate = {
        name: int(count) / per_second
        for name, count in (line.split() for line in calls.read_text().splitlines())
    }
    assert 9 <= rate["field_values"] <= 11  # power, every tick
    assert 9 <= rate["utilization"] <= 11
    assert 0.45 <= rate["field_values_energy"] <= 0.9  # energy, every 2 s (+ the first)
    assert rate["energy"] == 0  # never its own call where the field values have it
    assert 0.9 <= rate["processes"] <= 1.4  # once a second, one C call
    assert 0.9 <= rate["samples_power"] <= 1.4
    assert rate["samples_util"] <= 0.45  # every 5 s
    assert rate["samples_mem"] <= 0.45
    assert 1.8 <= rate["clock"] <= 2.8  # SM and memory, once a second
    assert 0.9 <= rate["temperature"] <= 1.4
    assert rate["app_clock"] <= 0.45  # at start, then every minute
    assert rate["power_limit"] <= 0.25
    assert rate["pcie"] <= 0.9  # two calls every 5 s, on their own thread
    assert rate["power_usage"] == 0


def test_the_real_gpu_benchmark_imports_and_explains_itself_without_a_gpu() -> None:
    """`benchmarks/nvml_real_gpu.py --help` works on a node without NVIDIA driver: the lead
    runs it on GPU nodes, and it must not need the driver to say how."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "nvml_real_gpu.py"
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--gpu-idle-power-w" in done.stdout
    assert "--duty" in done.stdout
    mixed = subprocess.run(
        [sys.executable, str(script), "--protocol", "mixed", "--help"], capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert mixed.returncode == 0, mixed.stderr
    for option in ("--heavy-duty", "--heavy-load", "--gap-seconds", "--summary"):
        assert option in mixed.stdout
