"""GPU power per MIG GPU instance, through GPM, end to end over the NVML stand-in.

Under MIG the driver gives no per-process utilisation. On a GPU with GPM counters (Hopper and
newer) the ``nvml`` input reads one GPM sample per GPU instance each window, reports each
instance's graphics activity between two samples, and the GPU formula splits the GPU's power
above idle among the instances (targets ``gpu<index>/gi<id>``) by that activity. On an older
GPU everything stays with the device target, as before.

The stand-in's instances are busy a constant share of every moment, and its power is a
constant reading (no energy counter), so every tick's truth is known exactly: 250 W, of which
60 W idle and 190 W active, split as the activities are. The checks therefore do not depend on
timing; only how many ticks a run lasts does.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import Service, wattflow
from tests.nvml_fake import build_fake_nvml, nvml_environment, write_scenario
from tests.test_gpu_formula import everything, through_checkpoint
from tests.test_nvml import micros, own_cgroup
from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.gpu import GpuConfig, GpuFormula
from wattflow.formats import powerapi
from wattflow.formats.reports import GPUDevice, GPUInstanceActivity, GPUReport, Report

POWER_W, IDLE_W = 250.0, 60.0
NOBODY = 4_194_401
"""A pid above Linux's largest pid_max: no process has it, so it has no cgroup."""

MIG_GPM = [
    "devices=1", "d0.mig=1", "d0.gpm=1", f"d0.power=0:{POWER_W * 1000:.0f}",
    "d0.unsupported=energy", "d0.gi=1:70:60", "d0.gi=3:30:25",
    f"d0.gi_proc=1:{os.getpid()}", f"d0.gi_proc=3:{NOBODY}",
]  # fmt: skip
"""One H100-like GPU in MIG mode with GPM: instance 1 busy 70 % of the time (60 % of its SMs)
with this test's process on it, instance 3 busy 30 % (25 %) with a process that has no
cgroup; a constant 250 W reading and no energy counter, so each tick's power is exact."""


class Run(NamedTuple):
    power: list[dict[str, Any]]
    gpu: list[dict[str, Any]]
    log: str
    calls: dict[str, int]


def sample(
    fake_nvml: Path, directory: Path, scenario: list[str], ticks: int, *more_flags: str
) -> Run:
    """The sampler and the GPU formula (idle 60 W) for ``ticks`` ticks of 100 ms; SIGINT."""
    directory.mkdir(parents=True, exist_ok=True)
    calls = directory / "calls.txt"
    environment = {
        **nvml_environment(fake_nvml, write_scenario(directory / "scenario.txt", scenario)),
        "FAKE_NVML_CALLS": str(calls),
    }
    power, gpu = directory / "power.jsonl", directory / "gpu.jsonl"
    command = [
        sys.executable, "-m", "wattflow.service", "run", "--input", "nvml",
        "--gpu-idle-power-w", str(IDLE_W),
        "--output", "jsonl", "--file", str(power),
        "--output", "jsonl", "--model", "GPUReport", "--file", str(gpu), *more_flags,
    ]  # fmt: skip
    with Service(directory / "run.log", command=command, env=environment) as service:
        service.wait_for_lines(gpu, ticks, timeout_s=ticks / 10 * 4 + 30)
        log = service.stop(signal.SIGINT, code=0, timeout_s=30)
    counts = {
        name: int(count)
        for name, count in (line.split() for line in calls.read_text().splitlines())
    }
    return Run(_lines(power), _lines(gpu), log, counts)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_tick(run: Run) -> dict[int, dict[str, float]]:
    """Each tick's power per target (W), by the tick's Unix µs."""
    ticks: dict[int, dict[str, float]] = defaultdict(dict)
    for report in run.power:
        ticks[micros(report)][report["target"]] = report["power"]
    return dict(ticks)


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture(scope="module")
def mig_run(fake_nvml: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return sample(fake_nvml, tmp_path_factory.mktemp("mig-gpm"), MIG_GPM, ticks=50)


def test_two_instances_at_70_and_30_percent_get_70_and_30_percent_of_the_active_energy(
    mig_run: Run,
) -> None:
    """Over the ticks the GPM windows cover, the instances get all of the active energy (the
    device target keeps the idle), split 70/30. The stand-in's activity is constant, so every
    window says exactly 70 % and 30 % and every covered tick splits exactly so: the tolerance
    is float rounding, not noise."""
    covered = max(r["devices"]["0"]["instance_window"][1] for r in mig_run.gpu)
    ticks = by_tick(mig_run)
    stamps = [stamp for stamp in sorted(ticks) if stamp <= covered]
    assert len(stamps) >= 30, "the windows cover most of the run"
    energy: dict[str, float] = defaultdict(float)
    active_j = 0.0
    for earlier, later in itertools.pairwise(stamps):
        seconds = (later - earlier) / 1e6
        active_j += (POWER_W - IDLE_W) * seconds
        for target, watts in ticks[later].items():
            energy[target] += watts * seconds
    assert set(energy) == {"gpu0", "gpu0/gi1", "gpu0/gi3"}, "instance targets only"
    on_instances = energy["gpu0/gi1"] + energy["gpu0/gi3"]
    print(f"instances {on_instances:.3f} J of {active_j:.3f} J active; {dict(energy)}")
    assert energy["gpu0/gi1"] / on_instances == pytest.approx(0.70, abs=1e-6)
    assert on_instances / active_j >= 0.98
    assert on_instances / active_j == pytest.approx(1.0, abs=1e-6)


def test_every_tick_adds_up_to_the_device_power_and_idle_stays_on_the_device(
    mig_run: Run,
) -> None:
    """On every tick, covered or not (the last ones are released uncovered at the stop), the
    instances and the device target add up to the GPU's 250 W and the device keeps at least
    the idle 60 W."""
    ticks = by_tick(mig_run)
    assert len(ticks) >= 45
    for stamp, targets in ticks.items():
        assert sum(targets.values()) == pytest.approx(POWER_W, abs=1e-6), stamp
        assert targets["gpu0"] >= IDLE_W - 1e-6, stamp
    covered = max(r["devices"]["0"]["instance_window"][1] for r in mig_run.gpu)
    split = [targets for stamp, targets in ticks.items() if stamp <= covered]
    assert len(split) >= 30
    assert all(t["gpu0"] == pytest.approx(IDLE_W, abs=1e-6) for t in split), "idle alone"
    assert all(t["gpu0/gi1"] == pytest.approx(0.7 * (POWER_W - IDLE_W)) for t in split)


def test_the_input_reports_each_instance_and_its_processes_once_a_window(mig_run: Run) -> None:
    """Each window's report names both instances with their activity and the processes on
    them (with this process's cgroup); the ticks between windows report a window of no
    length; windows follow each other with no gap."""
    windows = [r["devices"]["0"] for r in mig_run.gpu if r["devices"]["0"]["instances"]]
    assert len(windows) >= 4
    for device in windows:
        assert "processes" not in device, "no per-process utilisation under MIG"
        assert device["instances"] == [
            {"id": 1, "graphics_util": 70.0, "sm_util": 60.0, "pids": [os.getpid()],
             "cgroups": [own_cgroup()]},
            {"id": 3, "graphics_util": 30.0, "sm_util": 25.0, "pids": [NOBODY], "cgroups": [None]},
        ]  # fmt: skip
    spans = [tuple(device["instance_window"]) for device in windows]
    assert all(end - start >= 100_000 for start, end in spans), "GPM samples >= 100 ms apart"
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "no gap between windows"
    between = [r["devices"]["0"] for r in mig_run.gpu if not r["devices"]["0"]["instances"]]
    assert all(d["instance_window"][0] == d["instance_window"][1] for d in between)


def test_gpm_is_read_once_a_window_not_every_tick(mig_run: Run) -> None:
    """The stand-in's call counts: one GPM sample per instance when NVML is opened (twice: the
    start's check, then the run) and one per instance per window; the metrics and the process
    lists once per instance per window; windows come once a second, not every 100 ms tick."""
    windows = sum(1 for r in mig_run.gpu if r["devices"]["0"]["instances"])
    assert windows <= len(mig_run.gpu) / 10 + 1
    print(f"{windows} windows over {len(mig_run.gpu)} ticks: {mig_run.calls}")
    assert mig_run.calls["gpm_support"] == 2
    assert mig_run.calls["gpm_sample"] == 2 * (windows + 2)
    assert mig_run.calls["gpm_metrics"] == 2 * windows
    assert mig_run.calls["running_processes"] == 2 * windows
    assert mig_run.log.count("split among its 2 GPU instances") == 1


def test_without_gpm_a_mig_gpu_stays_per_device(fake_nvml: Path, tmp_path: Path) -> None:
    """A GPU in MIG mode without GPM (before Hopper): the input reports no instances and makes
    no GPM call, the log says why once, and all power stays with ``gpu0``."""
    scenario = [line for line in MIG_GPM if line != "d0.gpm=1"]
    run = sample(fake_nvml, tmp_path, scenario, ticks=15)
    assert {r["target"] for r in run.power} == {"gpu0"}
    assert all(r["power"] == pytest.approx(POWER_W) for r in run.power)
    assert all("instances" not in r["devices"]["0"] for r in run.gpu)
    assert run.calls["gpm_sample"] == run.calls["gpm_metrics"] == 0
    assert run.calls["running_processes"] == 0
    assert run.log.count("in MIG mode without GPM counters (before Hopper)") == 1


def test_a_failing_gpm_sample_leaves_the_power_on_the_device_and_says_so(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """GPM samples that fail every time (a lost GPU): no window is reported, so after
    ``--gpu-hold-ms`` the ticks go whole to ``gpu0``, counted; the log says both."""
    run = sample(fake_nvml, tmp_path, [*MIG_GPM, "d0.fail=gpm_sample:GPU_IS_LOST"], ticks=35)
    assert {r["target"] for r in run.power} == {"gpu0"}
    assert all(r["devices"]["0"]["instances"] == [] for r in run.gpu)
    assert run.calls["gpm_metrics"] == 0
    assert "GPU 0: gpm keeps failing (nvmlGpmMigSampleGet: GPU is lost, 3 times" in run.log
    assert "GPU 0: no per-process or per-instance activity covered a tick" in run.log


def test_impossible_gpm_activity_is_a_dead_letter_and_its_window_covers_no_tick(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """A GPU instance whose GPM graphics activity reads above 100 % (a driver fault): each such
    window is dead-lettered with the instances' readings, none is reported, and the power
    stays with the device target, counted, instead of being split by a number that cannot be
    a share."""
    letters = tmp_path / "dead.jsonl"
    scenario = [line if line != "d0.gi=1:70:60" else "d0.gi=1:170:60" for line in MIG_GPM]
    assert scenario != MIG_GPM
    run = sample(fake_nvml, tmp_path, scenario, 35, "--dead-letters", str(letters))
    dead = [json.loads(line) for line in letters.read_text().splitlines()]
    assert dead, "the impossible windows are dead letters"
    assert all(letter["reason"] == "GPU 0: impossible GPM activity" for letter in dead)
    assert all(r["devices"]["0"]["instances"] == [] for r in run.gpu)
    assert {r["target"] for r in run.power} == {"gpu0"}
    assert "GPU 0: no per-process or per-instance activity covered a tick" in run.log


def test_a_destroyed_instance_is_dropped_and_the_others_go_on(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Instance 3 is destroyed 3 s after the run opens NVML (the stand-in's clock, not the
    test's): its next GPM sample answers Not Found, the sampler lists the instances again at
    the next tick and goes on with instance 1 alone, which then gets all of the active energy.
    The window in which it went is covered by none, so its ticks stay with gpu0. Windows come
    every second from the first tick, so instance 3 is found gone by the fourth at the latest
    and instance 1 alone has at least three windows in the 8 s of ticks."""
    run = sample(fake_nvml, tmp_path, [*MIG_GPM, "d0.gi_until_ms=3:3000"], ticks=80)
    assert "GPU 0: its GPU instances are now [1]" in run.log
    windows = [r["devices"]["0"] for r in run.gpu if r["devices"]["0"]["instances"]]
    ids = [[i["id"] for i in device["instances"]] for device in windows]
    change = ids.index([1])
    assert ids[:change] == [[1, 3]] * change
    assert change >= 1
    assert ids[change:] == [[1]] * (len(ids) - change)
    assert len(ids) - change >= 3
    alone = [tuple(device["instance_window"]) for device in windows[change:]]
    ticks = by_tick(run)
    for stamp, targets in ticks.items():
        assert sum(targets.values()) == pytest.approx(POWER_W, abs=1e-6), stamp
    inside = [  # the ticks (earlier, later] wholly inside a window of instance 1 alone
        ticks[later]
        for earlier, later in itertools.pairwise(sorted(ticks))
        if any(a <= earlier and later <= b for a, b in alone)
    ]
    assert len(inside) >= 5
    assert all(t == pytest.approx({"gpu0/gi1": POWER_W - IDLE_W, "gpu0": IDLE_W}) for t in inside)


def test_check_says_which_mig_gpus_are_split_per_instance(fake_nvml: Path, tmp_path: Path) -> None:
    """`wattflow check`: GPU 0 (MIG with GPM) is attributed per GPU instance, naming them;
    GPU 1 (MIG, no GPM) per device."""
    lines = ["devices=2", *MIG_GPM[1:], "d1.mig=1", "d1.gi=1:50"]
    scenario = write_scenario(tmp_path / "scenario.txt", lines)
    done = wattflow("check", env={**nvml_environment(fake_nvml, scenario), "COLUMNS": "500"})
    assert done.returncode == 0, done.stderr
    line = " ".join(next(line for line in done.stdout.splitlines() if "NVML" in line).split())
    assert (
        "0: NVML stand-in GPU, MIG mode with GPM: power is attributed per GPU instance by its "
        "activity (2 instance(s): gpu0/gi1, gpu0/gi3)" in line
    )
    assert "1: NVML stand-in GPU, MIG mode without GPM (before Hopper)" in line
    assert line.count("power is attributed per device") == 1


# --- the report's new fields and the formula's state, without the stand-in ----------------------

START = datetime(2026, 3, 1, tzinfo=UTC)


def _us(second: float) -> int:
    return (START - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) + round(
        second * 1e6
    )


def instance_tick(
    second: float, shares: dict[int, float], window: tuple[float, float]
) -> GPUReport:
    device = GPUDevice(
        power=POWER_W * 1000,
        instances=[
            GPUInstanceActivity(id=gi, graphics_util=util, pids=[100 + gi], cgroups=[None])
            for gi, util in shares.items()
        ],
        instance_window=(_us(window[0]), _us(window[1])),
    )
    return GPUReport(
        timestamp=START + timedelta(seconds=second), sensor="n", target="all", devices={"0": device}
    )


def instance_stream() -> list[GPUReport]:
    """Three seconds of ticks every 0.1 s; a window every 0.5 s ending 0.2 s before its tick
    (so ticks wait for it); the shares move from 50/50 to 90/10 halfway; one window idle."""
    reports = []
    for step in range(31):
        second = step / 10
        fresh = step % 5 == 0 and step >= 5
        shares = {1: 50.0, 2: 50.0} if step < 15 else {1: 90.0, 2: 10.0}
        if step == 20:
            shares = {1: 0.0, 2: 0.0}
        window = (second - 0.7, second - 0.2) if fresh else (second, second)
        reports.append(instance_tick(second, shares if fresh else {}, window))
    return reports


def test_instance_windows_split_ticks_and_survive_a_restart_at_any_checkpoint() -> None:
    """The formula splits each tick among the windows that cover it, per instance; an idle
    window leaves the tick's active power on the device; cut after any tick, the state through
    a checkpoint's encoding gives exactly the reports of one uninterrupted run."""
    reports = instance_stream()
    settings = {"gpu_idle_power_w": IDLE_W, "gpu_hold_ms": 2000}
    whole_formula = GpuFormula(GpuConfig(**settings), "n")
    whole = Output()
    whole_formula.process(list[Report](reports), whole)
    whole_formula.flush(whole)
    at = {(r[0], r[1]): r[2] for r in everything(whole)}
    one = START + timedelta(seconds=0.5)  # covered by the first window, 50/50
    assert at[(one, "gpu0/gi1")] == pytest.approx(95.0)
    assert at[(one, "gpu0/gi2")] == pytest.approx(95.0)
    late = START + timedelta(seconds=2.5)  # window (2.3, 2.8]: 90/10
    assert at[(late, "gpu0/gi1")] == pytest.approx(171.0)
    assert at[(late, "gpu0/gi2")] == pytest.approx(19.0)
    idle = START + timedelta(seconds=1.5)  # the idle window (1.3, 1.8]
    assert (idle, "gpu0/gi1") not in at
    assert at[(idle, "gpu0")] == pytest.approx(POWER_W)
    for cut in range(1, len(reports)):
        first = GpuFormula(GpuConfig(**settings), "n")
        out = Output()
        first.process(list[Report](reports[:cut]), out)
        second = GpuFormula(GpuConfig(**settings), "n")
        second.restore(through_checkpoint(first))
        second.process(list[Report](reports[cut:]), out)
        second.flush(out)
        assert everything(out) == everything(whole), f"cut after tick {cut}"


def test_instances_survive_the_json_and_mongodb_encodings() -> None:
    """The report's instances and their window come back equal from PowerAPI's JSON (files,
    sockets, the run store's documents) and MongoDB layouts; a report without them still
    decodes, with none."""
    report = instance_tick(1.0, {1: 70.0, 3: 30.0}, (0.0, 1.0))
    line = powerapi.encode_json(report)
    assert powerapi.decode_json(GPUReport, line, "test", 1) == report
    assert powerapi.from_mongodb(GPUReport, powerapi.to_mongodb(report)) == report
    plain = GPUReport(
        timestamp=START, sensor="n", target="all", devices={"0": GPUDevice(power=1.0)}
    )
    decoded = powerapi.decode_json(GPUReport, powerapi.encode_json(plain), "test", 1)
    assert isinstance(decoded, GPUReport)
    assert decoded.devices["0"].instances is None


def test_idle_is_learned_from_windows_in_which_no_instance_was_busy() -> None:
    """Without --gpu-idle-power-w: ticks covered by windows where no GPU instance was busy are
    rest, and their median power (resting 1.1 s, less than the 6 s over which idle is a mean) is
    the idle the busy ticks keep on the device."""
    reports = []
    for step in range(21):
        second = step / 10
        busy = step > 10
        shares = {1: 75.0, 2: 25.0} if busy else {1: 0.0, 2: 0.0}
        window = (second - 0.1, second) if step else (second, second)
        report = instance_tick(second, shares, window)
        power_w = 200.0 if busy else 48.0 + 4 * (step % 2)  # 48 and 52 W: 50 W on average
        device = report.devices["0"].model_copy(update={"power": power_w * 1000})
        reports.append(report.model_copy(update={"devices": {"0": device}}))
    out = Output()
    GpuFormula(GpuConfig(), "n").process(list[Report](reports), out)
    at = {(r[0], r[1]): r[2] for r in everything(out)}
    busy_tick = START + timedelta(seconds=1.5)
    # Ticks 1 to 10 rest (tick 0 has no window to cover it): 48 and 52 W five times each.
    assert at[(busy_tick, "gpu0")] == pytest.approx(50.0), "the resting median"
    assert at[(busy_tick, "gpu0/gi1")] == pytest.approx(112.5)
    assert at[(busy_tick, "gpu0/gi2")] == pytest.approx(37.5)
