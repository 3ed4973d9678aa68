"""Targets named as users know them, the same for CPU, DRAM and GPU, and each workload's energy
when it ends: the naming step (``actors/naming.py``) and the energy formula
(``actors/formulas/energy.py``), on the bundled demo node's recordings turned into a shared
Slurm node (two jobs, a Docker container, a service of no workload) and replayed through
``wattflow run`` as a user runs it."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT, wait_until, wattflow
from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.energy import EnergyConfig, EnergyFormula
from wattflow.actors.naming import TargetNaming
from wattflow.formats.frames import Column, PowerFrame
from wattflow.formats.lineprotocol import lines
from wattflow.formats.reports import (
    GPUReport,
    HWPCReport,
    PowerReport,
    Report,
    TargetEnergyReport,
)
from wattflow.formats.targets import LABEL_KEYS

DEMO = ROOT / "service" / "data"
JOB_CPU = "/system.slice/slurmstepd.scope/job_101/step_0/user/task_0"
JOB_GPU = "/system.slice/slurmstepd.scope/job_101/step_0/user/task_1"
"""Job 101's CPU task and the task that runs its GPU process: two cgroups, one job."""
SHORT_JOB = "/system.slice/slurmstepd.scope/job_102/step_batch/user/task_0"
"""Job 102 ends at :data:`SHORT_JOB_END` (its cgroup's reports and GPU process stop)."""
SHORT_JOB_END = "2026-01-05T09:00:15"
CONTAINER = "/system.slice/docker-" + "ab" * 32 + ".scope"
FIRST_ATTRIBUTED = "2026-01-05T09:00:05"
"""The first tick SmartWatts shares among the targets (its model needs 5 ticks first): the
GPU recording is cut to start there, so that every source covers the same ticks."""


def _second(timestamp: str) -> str:
    """hwpc-sensor's tick rounded to the second (its ticks jitter by a millisecond or two),
    so that its ticks, the GPU sampler's and the meter's intervals meet exactly."""
    moment = datetime.fromisoformat(timestamp)
    return datetime.fromtimestamp(round(moment.timestamp()), moment.tzinfo).isoformat(
        timespec="milliseconds"
    )


JITTER_MS = 1
JITTER_SEED = 33
LATE_EDGES = (5, 29)
"""The seconds whose tick the jittered stream makes late by :data:`JITTER_MS`, whatever the
seed draws: the first tick SmartWatts attributes (so the GPU's energy just before it, which
its records hold, is outside the node's intervals) and the last tick (so the GPU sampler's
last tick ends inside the node's last interval)."""


def _jittered(seed: int) -> Callable[[str], str]:
    """hwpc-sensor's ticks on the second, each moved by -1, 0 or +1 ms as a seeded draw says
    (the same draw for every report of a tick): the jitter a live sensor's ticks have."""
    draw = random.Random(seed)
    shifts: dict[int, int] = {}

    def stamp(timestamp: str) -> str:
        moment = datetime.fromisoformat(timestamp)
        second = round(moment.timestamp())
        if second not in shifts:
            late = second % 60 in LATE_EDGES
            shifts[second] = JITTER_MS if late else draw.choice((-JITTER_MS, 0, JITTER_MS))
        shifted = second + shifts[second] / 1000
        return datetime.fromtimestamp(shifted, moment.tzinfo).isoformat(timespec="milliseconds")

    return stamp


def _hwpc(line: str, stamp: Callable[[str], str] = _second) -> str | None:
    report = json.loads(line)
    report["timestamp"] = stamp(report["timestamp"])
    target = {"ml-training": JOB_CPU, "web-frontend": SHORT_JOB, "redis": CONTAINER}.get(
        report["target"], report["target"]
    )
    if target == SHORT_JOB and report["timestamp"] > SHORT_JOB_END:
        return None
    report["target"] = target
    return json.dumps(report)


def _gpu(line: str, last: str) -> str | None:
    report = json.loads(line)
    if not FIRST_ATTRIBUTED <= report["timestamp"][:19] <= last:
        return None
    late = report["timestamp"][:19] > SHORT_JOB_END
    for device in report["devices"].values():
        processes = []
        for process in device.get("processes") or []:
            cgroup = {"/ml-training": JOB_GPU, "/web-frontend": SHORT_JOB}[process["cgroup"]]
            if cgroup == SHORT_JOB and late:
                continue
            processes.append({**process, "cgroup": cgroup})
        device["processes"] = processes
    return json.dumps(report)


@dataclass
class Node:
    """What ``wattflow run`` wrote for the shared node."""

    power: list[dict[str, Any]]
    energy: list[dict[str, Any]]
    store: str
    log: str


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    return _shared_node(tmp_path_factory.mktemp("shared-node"), _second)


@pytest.fixture(scope="module")
def jittered_node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    return _shared_node(tmp_path_factory.mktemp("jittered-node"), _jittered(JITTER_SEED))


def shared_node_recordings(out: Path, stamp: Callable[[str], str] = _second) -> None:
    """Write the demo node's recordings as a shared Slurm node's, ``hwpc.jsonl`` and
    ``gpu.jsonl`` in ``out``, with hwpc-sensor's ticks stamped by ``stamp``."""
    lines = (DEMO / "demo-hwpc.jsonl").read_text().splitlines()
    hwpc = [_hwpc(line, stamp) for line in lines]
    hwpc_lines = [line for line in hwpc if line]
    last = max(json.loads(line)["timestamp"][:19] for line in hwpc_lines)
    gpu = [_gpu(line, last) for line in (DEMO / "demo-gpu.jsonl").read_text().splitlines()]
    (out / "hwpc.jsonl").write_text("\n".join(hwpc_lines) + "\n")
    (out / "gpu.jsonl").write_text("\n".join(line for line in gpu if line) + "\n")


def _shared_node(out: Path, stamp: Callable[[str], str]) -> Node:
    """The shared node's recordings through ``wattflow run``, with hwpc-sensor's ticks
    stamped by ``stamp``."""
    shared_node_recordings(out, stamp)
    store = f"sqlite:///{out / 'runs.db'}"
    result = wattflow(
        "run",
        "--input", "jsonl", "--model", "HWPCReport", "--name", "hwpc",
        "--files", str(out / "hwpc.jsonl"),
        "--input", "jsonl", "--model", "GPUReport", "--name", "gpus",
        "--files", str(out / "gpu.jsonl"),
        "--input", "meter", "--name", "meter", "--files", str(DEMO / "demo-meter.csv"),
        "--sensor", "demo-node",
        "--output", "jsonl", "--model", "PowerReport", "--name", "power",
        "--file", str(out / "power.jsonl"),
        "--output", "jsonl", "--model", "TargetEnergyReport", "--name", "energy",
        "--file", str(out / "energy.jsonl"),
        "--learn-min-samples-required", "5",
        "--target-energy", "--target-end-silence-s", "5",
        "--run", "shared/node/jobs/1", "--store", store,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    read = [json.loads(line) for line in (out / "power.jsonl").read_text().splitlines()]
    energy = [json.loads(line) for line in (out / "energy.jsonl").read_text().splitlines()]
    return Node(read, energy, store, result.stderr)


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()


def test_a_jobs_cpu_dram_and_gpu_reports_carry_the_same_names(node: Node) -> None:
    job = [p for p in node.power if p["metadata"].get("slurm_job") == "101"]
    assert {p["metadata"]["scope"] for p in job} == {"cpu", "dram", "gpu"}
    assert {p["target"] for p in job} == {JOB_CPU, JOB_GPU}  # targets stay the cgroups
    names = {tuple(p["metadata"][key] for key in LABEL_KEYS) for p in job}
    assert names == {("slurm_job", "slurm/101", "", "", "", "", "101", "")}
    # the names come first, and nothing the formulas wrote is changed
    cpu = next(p for p in job if p["metadata"]["scope"] == "cpu")
    assert list(cpu["metadata"])[: len(LABEL_KEYS)] == list(LABEL_KEYS)
    assert {"scope", "socket", "formula", "ratio"} <= set(cpu["metadata"])
    container = {p["metadata"].get("container_id") for p in node.power if p["target"] == CONTAINER}
    assert container == {"ab" * 32}
    # targets that name no workload gain nothing: PowerAPI's documents stay as they were
    for target in ("rapl", "global", "postgres", "gpu0", "node", "rest"):
        rows = [p for p in node.power if p["target"] == target]
        assert rows, target
        assert not set(LABEL_KEYS) & {k for p in rows for k in p["metadata"]}, target


def test_each_workload_is_reported_once_with_its_energy_per_scope(node: Node) -> None:
    by_target = defaultdict(list)
    for record in node.energy:
        by_target[record["target"]].append(record)
    assert set(by_target) == {
        "slurm/101", "slurm/102", "docker/" + "ab" * 32, "postgres", "gpu0", "gpu1",
    }  # fmt: skip
    assert all(len(records) == 1 for records in by_target.values())
    short = by_target["slurm/102"][0]
    assert short["reason"] == "silent"  # ended in the stream's own time, not at the stop
    assert short["end"].startswith(SHORT_JOB_END)
    long = by_target["slurm/101"][0]
    assert long["reason"] == "running"  # still running when the recording ended
    assert all(long["energy"][scope] > 0 for scope in ("cpu", "dram", "gpu"))
    assert long["metadata"]["slurm_job"] == "101"
    # a record's energy is its reports' power over each tick of their scope
    ticks: dict[str, list[float]] = defaultdict(list)
    for p in node.power:
        if p["metadata"].get("scope") in ("cpu", "dram", "gpu") and p["target"] != "rapl":
            ticks[p["metadata"]["scope"]].append(_seconds(p["timestamp"]))
    interval = {
        scope: dict(zip(sorted(set(t))[1:], np.diff(sorted(set(t))), strict=True))
        for scope, t in ticks.items()
    }
    for name, (record,) in by_target.items():
        for scope in ("cpu", "dram", "gpu"):
            expected = sum(
                p["power"] * interval[scope].get(_seconds(p["timestamp"]), 0.0)
                for p in node.power
                if p["metadata"].get("scope") == scope
                and p["target"] not in ("rapl", "global")
                and p["metadata"].get("target_name", p["target"]) == name
            )
            assert record["energy"][scope] == pytest.approx(expected, rel=1e-9, abs=1e-9)


@dataclass
class Sums:
    """The node formula's energy over its intervals after the first tick SmartWatts
    attributes (the energy formula's first tick of each scope only starts its clock)."""

    attributed: str
    meter: float
    rest: float
    start: float
    """The start of the first interval counted, and the end of the last (Unix s)."""
    end: float
    without_gpu: list[str]
    """The intervals whose node report has no GPU figure."""


def _sums(node: Node) -> Sums:
    attributed = min(
        p["timestamp"] for p in node.power if p["metadata"].get("scope") == "cpu"
        and p["target"] not in ("rapl", "global")
    )  # fmt: skip
    reports = sorted(
        (p for p in node.power if p["metadata"].get("scope") == "node"),
        key=lambda p: p["timestamp"],
    )
    sums = Sums(attributed, 0.0, 0.0, _seconds(attributed), _seconds(attributed), [])
    previous: dict[str, float] = {}
    for p in reports:
        moment = _seconds(p["timestamp"])
        if p["target"] in previous and p["timestamp"] > attributed:
            joules = p["power"] * (moment - previous[p["target"]])
            if p["target"] == "node":
                sums.meter += joules
                sums.end = max(sums.end, moment)
                if p["metadata"].get("gpu") is None:
                    sums.without_gpu.append(p["timestamp"])
            else:
                sums.rest += joules
        previous[p["target"]] = moment
    return sums


def _records_j(node: Node) -> float:
    return sum(sum(record["energy"].values()) for record in node.energy)


def test_jobs_idle_and_the_rest_of_the_system_add_up_to_the_meter(node: Node) -> None:
    """On a shared node: the workloads' records (the jobs, the container, the other cgroups,
    each GPU's own target with its idle power) plus the node formula's rest of the system
    are the energy the meter measured, over the ticks every source covers."""
    sums = _sums(node)
    assert sums.attributed.startswith(FIRST_ATTRIBUTED)  # the GPU recording was cut there
    assert sums.without_gpu == []
    assert sums.meter > 10_000  # 24 s of a node drawing 700 W
    assert _records_j(node) + sums.rest == pytest.approx(sums.meter, rel=1e-6)
    jobs = sum(sum(r["energy"].values()) for r in node.energy if r["target"].startswith("slurm/"))
    assert 0.5 * sums.meter < jobs < sums.meter


def _gpu_ticks(node: Node) -> list[tuple[float, float]]:
    """The GPU formula's ticks: each one's time and its targets' power added up (W)."""
    power: dict[float, float] = defaultdict(float)
    for p in node.power:
        if p["metadata"].get("scope") == "gpu":
            power[_seconds(p["timestamp"])] += p["power"]
    return sorted(power.items())


def test_with_jittered_ticks_they_add_up_but_for_what_the_edges_hold(jittered_node: Node) -> None:
    """hwpc-sensor's ticks a millisecond early or late (seeded), the GPU sampler's on the
    second. Inside the stream every source's energy is in the node's intervals whatever
    their ticks, so the identity holds there exactly. At its two edges the sources cannot
    meet: the records hold the GPUs' energy from the GPU sampler's first tick to its last,
    the node's intervals run from hwpc-sensor's first attributed tick to its last. What the
    records hold outside the node's intervals (the GPUs' power over the milliseconds between
    those ticks) is the difference, exactly, and it is bounded by the GPUs' power over the
    jitter at each edge. (What the node's intervals hold and no GPU tick covers is in the
    rest, as all uncovered power is, and needs no term.)

    Before the node formula counted a source for the part of an interval it covers, the
    last interval, 1 ms longer than the GPU's last tick, had no GPU figure at all: its GPU
    energy was in the rest and in the records, 0.8 % of the node's energy counted twice."""
    sums = _sums(jittered_node)
    assert sums.without_gpu == []
    ticks = _gpu_ticks(jittered_node)
    outside = 0.0
    for (before, _), (moment, watts) in pairwise(ticks):
        early = max(0.0, min(moment, sums.start) - before)
        late = max(0.0, moment - max(before, sums.end))
        outside += watts * (early + late)
    gpu_w = max(watts for _, watts in ticks)
    assert 0 < outside <= 2 * JITTER_MS / 1000 * gpu_w  # here the first edge: 1 ms late
    assert sums.meter > 10_000
    difference = _records_j(jittered_node) + sums.rest - sums.meter
    assert difference == pytest.approx(outside, abs=1e-6 * sums.meter)


def test_runs_lists_each_workloads_energy(node: Node) -> None:
    result = wattflow("runs", "--store", node.store, "energy", "shared/node/jobs/1")
    assert result.returncode == 0, result.stderr
    header, *rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert header[:3] == ["sensor", "workload", "kind"]
    by_name = {row[1]: dict(zip(header, row, strict=True)) for row in rows}
    assert set(by_name) == {record["target"] for record in node.energy}
    job = by_name["slurm/102"]
    assert (job["kind"], job["reason"]) == ("slurm_job", "silent")
    record = next(r for r in node.energy if r["target"] == "slurm/102")
    assert float(job["total J"]) == pytest.approx(sum(record["energy"].values()), abs=1e-3)


def test_target_names_off_leaves_reports_as_the_formulas_make_them(tmp_path: Path) -> None:
    hwpc = [_hwpc(line) for line in (DEMO / "demo-hwpc.jsonl").read_text().splitlines()]
    (tmp_path / "hwpc.jsonl").write_text("\n".join(line for line in hwpc if line) + "\n")
    result = wattflow(
        "run", "--input", "jsonl", "--model", "HWPCReport", "--files", str(tmp_path / "hwpc.jsonl"),
        "--output", "jsonl", "--model", "PowerReport", "--file", str(tmp_path / "out.jsonl"),
        "--learn-min-samples-required", "5", "--target-names", "off",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert any(row["target"] == JOB_CPU for row in rows)
    assert not any("target_kind" in row["metadata"] for row in rows)
    refused = wattflow("run", "--target-names", "maybe", "--input", "jsonl", "--files", "x")
    assert refused.returncode == 2
    assert "target-names" in refused.stderr


# --- the parts, in this process -------------------------------------------------------------


def _power(second: int, target: str, scope: str, watts: float) -> PowerReport:
    return PowerReport(
        timestamp=1_767_600_000_000 + second * 1000,
        sensor="node-1",
        target=target,
        power=watts,
        metadata={"scope": scope, "socket": 0},
    )


def _named(*reports: Report) -> list[Report]:
    named = TargetNaming()(list(reports))
    return [item for item in named if isinstance(item, Report)]


def test_naming_a_frame_names_only_its_workloads_rows() -> None:
    names = ["rapl", JOB_CPU, "postgres"]
    frame = PowerFrame(
        sensor="node-1",
        millis=np.array([1000, 1000, 1000, 2000], dtype=np.int64),
        targets=np.array([0, 1, 2, 1], dtype=np.int64),
        target_names=names,
        power=np.array([10.0, 6.0, 4.0, 7.0]),
        metadata={"scope": Column(np.zeros(4, dtype=np.int64), ["cpu"])},
    )
    (named,) = TargetNaming()([frame])
    assert isinstance(named, PowerFrame)
    reports = named.reports()
    assert [r.metadata.get("slurm_job") for r in reports] == [None, "101", None, "101"]
    assert [r.metadata["scope"] for r in reports] == ["cpu"] * 4
    assert reports[0].metadata == {"scope": "cpu"}
    unnamed = PowerFrame(
        sensor="node-1",
        millis=frame.millis[:1],
        targets=frame.targets[:1],
        target_names=names,
        power=frame.power[:1],
        metadata={"scope": Column(np.zeros(1, dtype=np.int64), ["cpu"])},
    )
    assert TargetNaming()([unnamed])[0] is unnamed  # stays on the outputs' column path


def _run(formula: EnergyFormula, *reports: Report) -> list[TargetEnergyReport]:
    out = Output()
    formula.process(_named(*reports), out)
    assert not out.rejected
    return [r for r in out.items() if isinstance(r, TargetEnergyReport)]


def test_a_workload_whose_cgroups_are_gone_ends_at_the_next_tick(tmp_path: Path) -> None:
    for path in (JOB_CPU, JOB_GPU, CONTAINER):
        (tmp_path / path.lstrip("/")).mkdir(parents=True)
    formula = EnergyFormula(EnergyConfig(target_energy=True, target_cgroup_root=tmp_path), "node-1")
    assert _run(formula, _power(0, JOB_CPU, "cpu", 5.0), _power(0, JOB_GPU, "gpu", 50.0)) == []
    assert _run(formula, _power(1, JOB_CPU, "cpu", 5.0), _power(1, JOB_GPU, "gpu", 50.0)) == []
    (tmp_path / JOB_CPU.lstrip("/")).rmdir()
    # one of its cgroups is gone, the other still there: the job goes on
    assert _run(formula, _power(2, CONTAINER, "cpu", 1.0)) == []
    (tmp_path / JOB_GPU.lstrip("/")).rmdir()
    (ended,) = _run(formula, _power(3, CONTAINER, "cpu", 1.0))
    assert (ended.target, ended.reason) == ("slurm/101", "gone")
    assert ended.energy == {"cpu": 5.0, "dram": 0.0, "gpu": 50.0}  # the second tick's
    assert (ended.end - ended.start).total_seconds() == 1.0
    assert ended.metadata["slurm_job"] == "101"


def test_workloads_are_bounded_and_an_evicted_one_is_reported_not_lost() -> None:
    formula = EnergyFormula(EnergyConfig(target_energy=True, target_max=2), "node-1")
    _run(formula, _power(0, "a", "cpu", 1.0), _power(0, "b", "cpu", 1.0))
    _run(formula, _power(1, "a", "cpu", 1.0), _power(1, "b", "cpu", 2.0))
    (evicted,) = _run(formula, _power(2, "a", "cpu", 1.0), _power(2, "c", "cpu", 3.0))
    assert (evicted.target, evicted.reason, evicted.energy["cpu"]) == ("b", "evicted", 2.0)
    assert set(formula.workloads) == {"a", "c"}


def test_the_state_survives_a_restart_and_a_paused_stream_ends_everything() -> None:
    config = EnergyConfig(target_energy=True, target_end_silence_s=30)
    first = EnergyFormula(config, "node-1")
    _run(first, _power(0, JOB_CPU, "cpu", 4.0), _power(1, JOB_CPU, "cpu", 4.0))
    state = json.loads(json.dumps(first.state()))
    second = EnergyFormula(config, "node-1")
    second.restore(state)
    _run(second, _power(2, JOB_CPU, "cpu", 6.0))
    deadline = second.deadline()
    assert deadline is not None
    assert deadline == pytest.approx(second.last_input + 30)
    out = Output()
    second.wake(out)  # what the actor calls once the deadline has passed
    (ended,) = out.items()
    assert isinstance(ended, TargetEnergyReport)
    assert (ended.reason, ended.energy["cpu"]) == ("silent", 10.0)
    assert second.deadline() is None
    # after the pause, a tick's clock starts afresh: the pause is no one's energy
    assert _run(second, _power(500, JOB_CPU, "cpu", 6.0), _power(501, JOB_CPU, "cpu", 6.0)) == []
    assert second.workloads["slurm/101"].energy["cpu"] == 6.0


def test_a_gap_in_the_stream_is_not_integrated_over() -> None:
    formula = EnergyFormula(EnergyConfig(target_energy=True, target_end_silence_s=30), "node-1")
    _run(formula, _power(0, "a", "cpu", 1.0), _power(1, "a", "cpu", 1.0))
    (ended,) = _run(formula, _power(100, "b", "cpu", 1.0))  # 99 s later: "a" has ended
    assert (ended.target, ended.energy["cpu"]) == ("a", 1.0)
    assert formula.workloads["b"].energy["cpu"] == 0.0


def test_a_workloads_record_is_an_influxdb_point() -> None:
    formula = EnergyFormula(EnergyConfig(target_energy=True), "node-1")
    _run(formula, _power(0, JOB_CPU, "cpu", 2.0), _power(1, JOB_CPU, "cpu", 2.0))
    out = Output()
    formula.flush(out)
    (record,) = out.items()
    assert isinstance(record, TargetEnergyReport)
    (line,) = lines(record)
    assert line.startswith("target_energy,reason=running,")
    assert ",slurm_job=101," in line
    assert " cpu_j=2,dram_j=0,duration_s=1,gpu_j=0,start_ms=" in line
    assert ",pod_uid=" not in line  # empty names are left out of the tags


def test_what_is_not_a_target_is_not_counted() -> None:
    assert EnergyFormula.dispatch_key(_power(0, "rapl", "cpu", 1.0)) is None
    assert EnergyFormula.dispatch_key(_power(0, "node", "node", 1.0)) is None
    assert EnergyFormula.dispatch_key(_power(0, "gpu0", "gpu", 1.0)) == "node-1"
    assert not EnergyFormula.enabled(EnergyConfig())


def test_a_scope_whose_reports_lag_does_not_end_a_workload_early() -> None:
    """SmartWatts' reports come after the GPU formula's (it holds its ticks; a replay reads
    each file at full speed): the job's GPU process stops at 8 s and the GPU's own target
    goes on to 20 s before the job's CPU reports of those seconds arrive. The job is judged
    by the slower stream's time, so it ends once, with its CPU and GPU energy in one record,
    not as a GPU record now and a CPU record later."""
    formula = EnergyFormula(EnergyConfig(target_energy=True, target_end_silence_s=3), "node-1")
    assert _run(formula, _power(0, JOB_CPU, "cpu", 5.0)) == []  # both streams have begun
    for second in range(21):
        gpus = [_power(second, "gpu0", "gpu", 60.0)]
        if second <= 8:
            gpus.append(_power(second, JOB_GPU, "gpu", 100.0))
        assert _run(formula, *gpus) == []
    for second in range(1, 21):
        assert _run(formula, _power(second, JOB_CPU, "cpu", 5.0)) == []
    out = Output()
    formula.flush(out)
    job = [r for r in out.items() if isinstance(r, TargetEnergyReport) and r.target == "slurm/101"]
    assert [(r.reason, r.energy) for r in job] == [
        ("running", {"cpu": 100.0, "dram": 0.0, "gpu": 800.0})
    ]


def test_a_scope_that_stopped_reporting_holds_the_others_back_no_longer_than_the_silence() -> None:
    """The CPU stream stops (its input gone) while the GPU's goes on: once the CPU has sent
    nothing for ``--target-end-silence-s`` of real time, the stream's time is the GPU's and
    the CPU-only workload ends by it."""
    config = EnergyConfig(target_energy=True, target_end_silence_s=0.2)
    formula = EnergyFormula(config, "node-1")
    assert _run(formula, _power(0, "postgres", "cpu", 5.0), _power(0, "gpu0", "gpu", 60.0)) == []
    ended: list[TargetEnergyReport] = []
    second = 0

    def postgres_ended() -> bool:
        nonlocal second
        second += 1
        ended.extend(_run(formula, _power(second, "gpu0", "gpu", 60.0)))
        return any(r.target == "postgres" for r in ended)

    wait_until(postgres_ended, 10, "the CPU-only workload to end by the GPU's time")
    assert [r.reason for r in ended] == ["silent"]


def test_a_scope_yet_to_come_holds_the_others_back_at_the_streams_start() -> None:
    """A replay reads the GPU samples' file at full speed while SmartWatts is still learning:
    the GPU's reports of the whole stream come before the job's first CPU report. With hwpc
    and GPU inputs the formula waits for the cpu and dram scopes (as long as the silence, in
    real time), so the job is not ended by the GPU's time and then started again."""
    given = frozenset({HWPCReport.kind, GPUReport.kind})
    config = EnergyFormula.configured(
        EnergyConfig(target_energy=True, target_end_silence_s=3), given
    )
    assert isinstance(config, EnergyConfig)
    formula = EnergyFormula(config, "node-1")
    for second in range(21):
        gpus = [_power(second, "gpu0", "gpu", 60.0)]
        if second <= 8:
            gpus.append(_power(second, JOB_GPU, "gpu", 100.0))
        assert _run(formula, *gpus) == []
    for second in range(21):
        assert _run(formula, _power(second, JOB_CPU, "cpu", 5.0)) == []
    assert _run(formula, _power(20, JOB_CPU, "dram", 1.0)) == []  # every scope has come
    out = Output()
    formula.flush(out)
    job = [r for r in out.items() if isinstance(r, TargetEnergyReport) and r.target == "slurm/101"]
    assert [(r.reason, r.energy) for r in job] == [
        ("running", {"cpu": 100.0, "dram": 0.0, "gpu": 800.0})
    ]
