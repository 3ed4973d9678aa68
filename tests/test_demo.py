"""``wattflow demo`` as a user runs it: every part of the product on the bundled recordings."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from itertools import pairwise
from pathlib import Path

import pandas as pd  # type: ignore[import-untyped]
import pytest
from extrap.fileio.file_reader.text_file_reader import TextFileReader

from wattflow.actors.run_store import open_store
from wattflow.formats.reports import GPUReport, to_millis

from .conftest import ROOT, wattflow

RUN = "wattflow-demo/ml-training/400W/0"
CONTAINERS = ("ml-training", "postgres", "redis", "web-frontend")


@dataclass
class Demo:
    directory: Path
    stdout: str
    rows: list[dict[str, str]]
    """Every row of every PowerReport*.csv the demo wrote (cpu and dram, GPU, node)."""


def bundled(name: str) -> str:
    """A recording as the installed package holds it."""
    return (resources.files("wattflow.service") / "data" / name).read_text()


def gpu_recording() -> list[GPUReport]:
    return [GPUReport.model_validate_json(line) for line in bundled("demo-gpu.jsonl").splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """One demo run at its default speed, as a user would start it."""
    directory = tmp_path_factory.mktemp("demo")
    done = wattflow("demo", "--directory", str(directory))
    assert done.returncode == 0, done.stdout + done.stderr
    rows: list[dict[str, str]] = []
    for path in sorted(directory.glob("*/PowerReport*.csv")):
        with path.open(newline="") as handle:
            rows += csv.DictReader(handle)
    return Demo(directory, done.stdout, rows)


def by(rows: list[dict[str, str]], **wanted: str) -> list[dict[str, str]]:
    return [row for row in rows if all(row.get(k) == v for k, v in wanted.items())]


def test_it_prints_where_everything_went(demo: Demo) -> None:
    out = demo.stdout
    assert "power per target" in out
    assert "every report accounted for: yes; dead letters: 0" in out
    for where in (
        f"{demo.directory}/<sensor>-<target>/PowerReport.csv",
        f"sqlite:///{demo.directory / 'runs.db'}: run {RUN}",
        f"{demo.directory / 'gpu-dir' / RUN}/",
        f"{demo.directory / 'extrap' / 'wattflow-demo.txt'}",
    ):
        assert where in out, where


def test_the_counts_it_prints_add_up_by_kind(demo: Demo) -> None:
    """It said "the formulas made 918 reports" beside "818 power reports": the 100 others,
    SmartWatts' FormulaReports, are now named."""
    out = " ".join(demo.stdout.split())
    found = re.search(r"the formulas made (\d+) reports: (\d+) PowerReports and (\d+) "
                      r"FormulaReports;", out)  # fmt: skip
    assert found is not None, out
    made, power, formula = map(int, found.groups())
    assert made == power + formula
    assert formula > 0
    assert power == len(demo.rows)
    assert f"power per target ({power} reports)" in out
    assert f"{power} power reports" in out


def test_cpu_and_dram_power_per_container(demo: Demo) -> None:
    for container in CONTAINERS:
        for scope in ("cpu", "dram"):
            rows = by(demo.rows, target=container, scope=scope)
            assert {r["socket"] for r in rows} == {"0", "1"}, (container, scope)
            assert len(rows) >= 20, (container, scope)  # SmartWatts reports once it has learned
            assert all(0 <= float(r["power"]) < 200 for r in rows)
    # The containers of a socket share its package and DRAM power, never more.
    rapl = {
        (r["timestamp"], r["socket"], r["scope"]): float(r["power"])
        for r in by(demo.rows, target="rapl")
    }
    shared: dict[tuple[str, str, str], float] = defaultdict(float)
    for row in demo.rows:
        if row["target"] in CONTAINERS:
            shared[(row["timestamp"], row["socket"], row["scope"])] += float(row["power"])
    assert shared
    for key, watts in shared.items():
        assert 0 < watts <= rapl[key] * (1 + 1e-9), key


def test_gpu_power_per_process_adds_up_to_each_device_per_tick(demo: Demo) -> None:
    readings = gpu_recording()
    assert len(readings) >= 30
    assert all(set(r.devices) == {"0", "1"} for r in readings)
    gpu_rows = by(demo.rows, scope="gpu")
    attributed: dict[tuple[str, int], float] = defaultdict(float)
    for row in gpu_rows:
        attributed[(row["device"], int(row["timestamp"]))] += float(row["power"])
    expected: dict[tuple[str, int], float] = {}
    for previous, reading in zip([None, *readings], readings, strict=False):
        for index, device in reading.devices.items():
            if previous is None:  # the first reading: no interval yet, the power field
                assert device.power is not None
                watts = device.power / 1000
            else:
                before = previous.devices[index].total_energy
                assert device.total_energy is not None
                assert before is not None
                seconds = (reading.timestamp - previous.timestamp).total_seconds()
                watts = (device.total_energy - before) / 1000 / seconds
            expected[(index, to_millis(reading.timestamp))] = watts
    assert set(attributed) == set(expected)
    for key, watts in expected.items():
        assert attributed[key] == pytest.approx(watts, rel=1e-9), key
    # Per process: the active power goes by SM share, the processes of each tick as sampled.
    processes = {r["target"] for r in gpu_rows if r["target"].startswith("pid:")}
    assert processes == {"pid:4242", "pid:4243", "pid:5117"}
    for reading in readings:
        stamp = str(to_millis(reading.timestamp))
        for index, device in reading.devices.items():
            busy = {f"pid:{p.pid}": p.sm_util for p in device.processes or () if p.sm_util > 0}
            rows = {r["target"]: r for r in by(gpu_rows, timestamp=stamp, device=index)}
            assert set(rows) == {*busy, f"gpu{index}"}
            for target, sm in busy.items():
                assert float(rows[target]["ratio"]) == pytest.approx(sm / sum(busy.values()))
    training = [float(r["power"]) for r in by(gpu_rows, target="pid:4242")]
    assert max(training) > 200  # a training process at 90 % SM on a 400 W GPU


def test_the_node_against_the_meter_with_the_rest_of_the_system(demo: Demo) -> None:
    nodes = {r["timestamp"]: r for r in by(demo.rows, target="node", scope="node")}
    rests = {r["timestamp"]: r for r in by(demo.rows, target="rest", scope="node")}
    assert len(nodes) == 29  # every hwpc-sensor interval
    assert set(rests) == set(nodes)
    rapl: dict[str, float] = defaultdict(float)
    for row in by(demo.rows, target="rapl", scope="cpu"):
        rapl[row["timestamp"]] += float(row["power"])
    gpu: dict[str, float] = defaultdict(float)
    for row in by(demo.rows, scope="gpu"):
        gpu[row["timestamp"]] += float(row["power"])
    stamps = sorted(nodes, key=int)
    for previous, stamp in pairwise(stamps):
        node, rest = nodes[stamp], float(rests[stamp]["power"])
        meter = float(node["power"])
        parts = [float(node[part]) for part in ("cpu", "dram", "gpu")]
        assert meter == pytest.approx(sum(parts) + rest, abs=1e-3)
        assert float(node["cpu"]) == pytest.approx(rapl[stamp], abs=1e-3)
        if int(stamp) % 1000 == 0 and int(previous) % 1000 == 0:
            # hwpc-sensor's interval is the GPU sampler's: the same GPU power
            assert float(node["gpu"]) == pytest.approx(gpu[stamp], abs=1e-3)
        # fans, disks, NICs, the board and supply losses of a 2-GPU server
        assert 80 < rest < 250, stamp
    assert max(float(n["power"]) for n in nodes.values()) > 900  # training on both GPUs
    assert min(float(n["power"]) for n in nodes.values()) < 400  # after it


def test_the_replay_is_a_run_in_the_store(demo: Demo) -> None:
    with open_store(f"sqlite:///{demo.directory / 'runs.db'}", create=False) as store:
        run = store.get(RUN)
        kinds: dict[str, int] = defaultdict(int)
        for report in store.reports(run):
            kinds[report.kind] += 1
    assert run.parameters == {"gpus": 2.0}
    assert [event.event for event in run.events][:2] == ["experiment_begin", "train_begin"]
    assert kinds["GPUReport"] == len(bundled("demo-gpu.jsonl").splitlines())
    assert kinds["MeterReport"] == len(bundled("demo-meter.csv").splitlines()) - 1  # header
    assert kinds["EventReport"] == len(bundled("demo-events.jsonl").splitlines())
    assert kinds["PowerReport"] == len(demo.rows)
    listed = wattflow("runs", "list", "--store", f"sqlite:///{demo.directory / 'runs.db'}")
    assert listed.returncode == 0, listed.stderr
    [row] = [line.split("\t") for line in listed.stdout.splitlines() if line.startswith(RUN)]
    assert row[-1] == "extrap-text, gpu-dir", "the demo's exports, as `wattflow export` notes them"


def test_the_gpu_measurement_directory(demo: Demo) -> None:
    repetition = demo.directory / "gpu-dir" / RUN
    readings = gpu_recording()
    gpu = pd.read_csv(repetition / "gpu-power.csv", index_col=0)
    assert len(gpu) == len(readings)
    assert list(gpu["power"]) == [r.devices["0"].power for r in readings]
    assert list(gpu["total-energy"]) == [r.devices["0"].total_energy for r in readings]
    external = pd.read_csv(repetition / "power-external.csv", index_col=0)
    assert list(external.columns) == ["timestamp", "d0c0", "d0c1"]
    assert len(external) == len(bundled("demo-meter.csv").splitlines()) - 1
    events = pd.read_csv(repetition / "timestamps.csv")
    expected = [json.loads(line)["event"] for line in bundled("demo-events.jsonl").splitlines()]
    assert list(events["event"]) == expected
    samples = pd.read_csv(repetition / "total_power_samples.csv", index_col=0)
    in_recording = sum(len((r.devices["0"].samples or {}).get("TOTAL_POWER", [])) for r in readings)
    assert len(samples) == in_recording > 0
    assert samples["timestamp"].is_monotonic_increasing
    assert (repetition / "system_info.json").is_file()


def series_energy(rows: list[dict[str, str]]) -> float:
    """J, as the exporters integrate: each power holds from the previous report of its series."""
    energy = 0.0
    series: dict[tuple[str, ...], list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        series[(row["scope"], row.get("socket", ""), row.get("device", ""))].append(row)
    for members in series.values():
        members.sort(key=lambda r: int(r["timestamp"]))
        for before, row in pairwise(members):
            seconds = (int(row["timestamp"]) - int(before["timestamp"])) / 1000
            energy += float(row["power"]) * seconds
    return energy


def test_the_extrap_export_reads_back(demo: Demo) -> None:
    reader = TextFileReader()
    reader.keep_values = True
    experiment = reader.read_experiment(demo.directory / "extrap" / "wattflow-demo.txt")
    assert [p.name for p in experiment.parameters] == ["gpus"]
    names = {callpath.name for callpath in experiment.callpaths}
    assert {"node", "rest", "pid:4242", "gpu0", *CONTAINERS} <= names
    assert "pid:4242->epoch" in names

    def energy(callpath: str, metric: str) -> list[float]:
        key = next(
            (c, m) for c, m in experiment.measurements if c.name == callpath and m.name == metric
        )
        (measurement,) = experiment.measurements[key]
        assert measurement.coordinate[0] == 2.0
        return list(measurement.values)

    training = by(demo.rows, target="pid:4242")
    assert energy("pid:4242", "energy_gpu") == pytest.approx([series_energy(training)])
    node = by(demo.rows, target="node")
    assert energy("node", "energy_node") == pytest.approx([series_energy(node)])
    assert energy("node", "energy_node")[0] > energy("rest", "energy_node")[0] > 0


def test_a_second_demo_in_the_same_directory_is_the_next_repetition(tmp_path: Path) -> None:
    for _ in range(2):
        done = wattflow("demo", "--directory", str(tmp_path), "--speed", "1000")
        assert done.returncode == 0, done.stdout + done.stderr
    assert "wattflow-demo/ml-training/400W/1" in done.stdout
    assert (tmp_path / "gpu-dir" / "wattflow-demo/ml-training/400W/0" / "gpu-power.csv").is_file()
    assert (tmp_path / "gpu-dir" / "wattflow-demo/ml-training/400W/1" / "gpu-power.csv").is_file()
    reader = TextFileReader()
    reader.keep_values = True
    experiment = reader.read_experiment(tmp_path / "extrap" / "wattflow-demo.txt")
    key = next(
        (c, m) for c, m in experiment.measurements if c.name == "node" and m.name == "energy"
    )
    (measurement,) = experiment.measurements[key]
    first, second = measurement.values
    assert first == pytest.approx(second)  # the same recording twice


def test_help_says_the_default_speed() -> None:
    done = wattflow("demo", "--help")
    assert done.returncode == 0
    assert "default: 10" in done.stdout


def test_the_bundled_recordings_are_what_the_script_makes() -> None:
    script = ROOT / "scripts" / "make_demo_recordings.py"
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert bundled("demo-gpu.jsonl") == (ROOT / "service" / "data" / "demo-gpu.jsonl").read_text()
