"""The gpu-dir export read back as its analysis code reads it: every file, every kind of run."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime
from pathlib import Path

import pandas as pd  # type: ignore[import-untyped]
import pytest

from wattflow.actors.run_store import open_store
from wattflow.formats.gpu_dir import SYSTEM_INFO_KEYS, event_index
from wattflow.formats.reports import (
    EventReport,
    GPUDevice,
    GPUReport,
    MeterReport,
    PowerReport,
    Report,
)
from wattflow.formats.runs import RecordedSystem
from wattflow.service.recording import record

from .conftest import wattflow
from .test_runs import at, recording, write_jsonl

SAMPLE_FILES = (
    "total_power_samples.csv",
    "gpu_utilization_samples.csv",
    "memory_utilization_samples.csv",
)


def import_into(store: str, source: Path, settings: str, *extra: str) -> None:
    done = wattflow(
        "runs", "import", str(source), "--store", store, "--experiment", "exp",
        "--benchmark", "bench", "--settings", settings, "--repetition", "0", *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def export(store: str, out: Path) -> None:
    done = wattflow("export", "gpu-dir", "--store", store, "--out", str(out))
    assert done.returncode == 0, done.stderr


def every_sample(seconds: int = 3) -> list[Report]:
    """A GPU that gives all three sample buffers, and epochs marked with integer indexes."""
    reports: list[Report] = []
    for tenth in range(10 * seconds):
        micros = int(at(tenth / 10).timestamp() * 1e6)
        device = GPUDevice(
            power=150_000.0,
            util_gpu=50.0,
            enforced_power_limit=250_000.0,
            samples={
                "TOTAL_POWER": [(micros, 150_000.0)],
                "GPU_UTILIZATION": [(micros, 50.0)],
                "MEMORY_UTILIZATION": [(micros, 20.0)],
            },
        )
        reports.append(
            GPUReport(
                timestamp=at(tenth / 10),
                sensor="gpu-node-7",
                target="all",
                devices={"0": device},
                metadata={"device_name": "Tesla V100-SXM2-16GB", "driver_version": "450.51.06"},
            )
        )
    reports += [
        EventReport(timestamp=at(0), sensor="gpu-node-7", target="all", event="experiment_begin"),
        EventReport(
            timestamp=at(1), sensor="gpu-node-7", target="all", event="epoch_begin", data=0
        ),
        EventReport(timestamp=at(2), sensor="gpu-node-7", target="all", event="epoch_end", data=0),
        EventReport(timestamp=at(3), sensor="gpu-node-7", target="all", event="experiment_end"),
    ]
    return sorted(reports, key=lambda r: r.timestamp)


def meter_only(seconds: int = 3) -> list[Report]:
    """A node without a GPU reading: a meter and the formulas' power."""
    reports: list[Report] = []
    for second in range(seconds):
        reports.append(
            MeterReport(timestamp=at(second), sensor="n", target="all", channels={"d0c0": 1e5})
        )
        reports.append(
            PowerReport(
                timestamp=at(second),
                sensor="n",
                target="t",
                power=10.0,
                metadata={"scope": "cpu"},
            )
        )
    return reports


def check_loads(repetition: Path) -> set[str]:
    """Every CSV file as the analysis code loads it: each but timestamps.csv with pandas'
    default index, which must come back as integers 0, 1, 2, …; return the files' names."""
    names = {path.name for path in repetition.iterdir()}
    for name in sorted(names - {"timestamps.csv", "system_info.json"}):
        table = pd.read_csv(repetition / name, index_col=0)
        assert len(table) > 0, name
        assert table.index.dtype.kind == "i", (name, table.index.dtype)
        assert list(table.index) == list(range(len(table))), name
        assert table["timestamp"].dtype.kind in "iO" or str(table["timestamp"].dtype) == "str"
        if name.endswith("_samples.csv"):
            assert list(table.columns) == ["timestamp", "value"]
            assert table["timestamp"].dtype.kind == "i", name
    events = pd.read_csv(repetition / "timestamps.csv")
    assert list(events.columns) == ["timestamp", "event", "data"]
    assert events["data"].dtype.kind == "i", events["data"].dtype
    assert {"experiment_begin", "experiment_end"} <= set(events["event"])
    times = [datetime.fromisoformat(text) for text in events["timestamp"]]
    assert times == sorted(times), "timestamps.csv in time order"
    assert events["event"].iloc[0] == "experiment_begin"
    assert events["event"].iloc[-1] == "experiment_end"
    return names


def test_every_csv_loads_with_an_integer_index_and_samples_only_where_there_are(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    import_into(store, write_jsonl(tmp_path / "power.jsonl", recording(3)), "power-samples")
    import_into(store, write_jsonl(tmp_path / "all.jsonl", every_sample()), "all-samples")
    import_into(store, write_jsonl(tmp_path / "meter.jsonl", meter_only()), "no-gpu")
    # A run that marked its epochs but not its begin (a live run): the begin stands in first.
    unbegun = [
        r
        for r in every_sample()
        if not (isinstance(r, EventReport) and r.event == "experiment_begin")
    ]
    import_into(store, write_jsonl(tmp_path / "unbegun.jsonl", unbegun), "unbegun")
    out = tmp_path / "out"
    export(store, out)
    root = out / "exp" / "bench"
    # The GPU gave power samples only: no utilisation sample files.
    assert check_loads(root / "power-samples" / "0") == {
        "system_info.json", "timestamps.csv", "gpu-power.csv", "power-external.csv",
        "total_power_samples.csv",
    }  # fmt: skip
    assert check_loads(root / "all-samples" / "0") == {
        "system_info.json", "timestamps.csv", "gpu-power.csv", *SAMPLE_FILES,
    }  # fmt: skip
    utilisation = pd.read_csv(
        root / "all-samples" / "0" / "gpu_utilization_samples.csv", index_col=0
    )
    assert list(utilisation["value"]) == [50] * 30
    # No GPU reading: no GPU file at all (an empty one would stop the loader), the meter's.
    assert check_loads(root / "no-gpu" / "0") == {
        "system_info.json", "timestamps.csv", "power-external.csv",
    }  # fmt: skip
    events = pd.read_csv(root / "all-samples" / "0" / "timestamps.csv")
    assert list(events["data"]) == [0, 0, 0, 0]
    check_loads(root / "unbegun" / "0")
    unbegun_events = pd.read_csv(root / "unbegun" / "0" / "timestamps.csv")
    assert list(unbegun_events["event"]) == [
        "experiment_begin", "epoch_begin", "epoch_end", "experiment_end",
    ]  # fmt: skip


def test_exporting_again_leaves_no_file_this_run_does_not_have(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    import_into(store, write_jsonl(tmp_path / "power.jsonl", recording(2)), "s")
    out = tmp_path / "out"
    repetition = out / "exp" / "bench" / "s" / "0"
    repetition.mkdir(parents=True)
    stale = repetition / "gpu_utilization_samples.csv"
    stale.write_text(",timestamp,value\n")  # as earlier versions wrote it
    export(store, out)
    assert not stale.exists()
    check_loads(repetition)


def test_an_imported_runs_system_info_holds_nothing_of_the_exporting_machine(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    import_into(store, write_jsonl(tmp_path / "all.jsonl", every_sample()), "s")
    out = tmp_path / "out"
    export(store, out)
    info = json.loads((out / "exp" / "bench" / "s" / "0" / "system_info.json").read_text())
    assert list(info)[: len(SYSTEM_INFO_KEYS)] == list(SYSTEM_INFO_KEYS)
    this_machine = {
        platform.node(), platform.platform(), sys.version, platform.python_version(),
        platform.release(), platform.version(),
    }  # fmt: skip
    for key, value in info.items():
        assert value not in this_machine, key
        for mine in (platform.node(), platform.platform(), sys.version):
            assert mine not in json.dumps(value), key
    # What the recording says: its sensor, the GPU reports' metadata, the GPU's power limit.
    assert info == {
        **dict.fromkeys(SYSTEM_INFO_KEYS),
        "device_name": "Tesla V100-SXM2-16GB",
        "driver_version": "450.51.06",
        "effective_power_limit": 250_000,
        "node": "gpu-node-7",
    }


def test_system_info_from_a_file_describes_the_measured_machine(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    given = {
        "device_name": "NVIDIA A100-SXM4-40GB",
        "cuda_version": 11020,
        "platform": "Linux-5.4.0-x86_64-with-glibc2.29",
        "python_version": "3.8.10",
        "pip_packages": [["torch", "1.8.1"]],
        "node": "dgx-3",
    }
    system = tmp_path / "system.json"
    system.write_text(json.dumps(given))
    source = write_jsonl(tmp_path / "all.jsonl", every_sample())
    import_into(store, source, "s", "--system-info", str(system))
    with open_store(store) as opened:
        stored = opened.get("exp/bench/s/0").system
    # The file's values, then the recording's for what the file leaves out.
    assert stored == {**given, "driver_version": "450.51.06"}
    out = tmp_path / "out"
    export(store, out)
    info = json.loads((out / "exp" / "bench" / "s" / "0" / "system_info.json").read_text())
    assert info["device_name"] == "NVIDIA A100-SXM4-40GB"
    assert info["pip_packages"] == [["torch", "1.8.1"]]
    assert info["node"] == "dgx-3"
    assert info["os_release"] is None
    for bad, message in (("[1, 2]", "give a JSON object"), ("{", "not valid JSON")):
        system.write_text(bad)
        done = wattflow(
            "runs", "import", str(source), "--store", store, "--experiment", "exp",
            "--benchmark", "bench", "--settings", "t", "--repetition", "0",
            "--system-info", str(system),
        )  # fmt: skip
        assert done.returncode == 2
        assert f"--system-info {system}: {message}" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_run_recorded_on_this_machine_describes_it(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    with record("exp", "bench", settings="s", repetition=0, store=store) as run:
        run.mark("epoch_begin", 0)
    out = tmp_path / "out"
    export(store, out)
    repetition = out / "exp" / "bench" / "s" / "0"
    info = json.loads((repetition / "system_info.json").read_text())
    assert info["node"] == platform.node()
    assert info["platform"] == platform.platform()
    assert info["python_version"] == platform.python_version()
    # No GPU reading, no GPU file; the events alone.
    assert check_loads(repetition) == {"system_info.json", "timestamps.csv"}


def test_the_recordings_node_is_its_sensor_or_else_its_gpu_reports() -> None:
    one = RecordedSystem()
    for report in every_sample(1):
        one.add(report)
    assert one.info()["node"] == "gpu-node-7"
    mixed = RecordedSystem()
    for report in [*every_sample(1), *meter_only(1)]:
        mixed.add(report)
    assert mixed.info()["node"] == "gpu-node-7"
    unknown = RecordedSystem()
    for report in meter_only(1):
        unknown.add(report.model_copy(update={"sensor": f"s{report.kind}"}))
    assert "node" not in unknown.info()


@pytest.mark.parametrize(
    ("data", "written"),
    [(None, 0), (3, 3), ("3", 3), (" 4 ", 4), ("-1", -1), ("", 0), ("warm-up", "warm-up")],
)
def test_timestamps_csv_holds_the_event_index(data: int | str | None, written: int | str) -> None:
    assert event_index(data) == written
