"""A recording replayed through the formulas gives exactly what the live run gave.

The live run follows three files as a node's samplers write them, second after second, the
meter's log lagging five seconds behind hwpc-sensor's and the GPU sampler's (a logger that
flushes late). Every formula is on: SmartWatts (cpu and dram), RAPL, the GPU formula, the node
formula sharing the meter among the targets, and the energy formula. The same files replayed
afterwards, read each at its own pace, must give the same documents byte for byte: each
formula holds a tick or an interval by the sources' own timestamps
(:mod:`wattflow.actors.formulas.window`), never by the pace at which they came.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from wattflow.actors.checkpoints import decode_checkpoint

from .conftest import Service, wait_until, wattflow
from .test_target_energy import DEMO, shared_node_recordings

METER_LAG_S = 5
"""How far (seconds of the recording) the meter's log is written behind the other files."""
STEP_S = 0.1
"""Real time between two seconds of the recording in the live run: a sensor ten times fast."""
WAIT_S = 120.0

FORMULAS = (
    "--learn-min-samples-required", "5",
    "--node-shares", "--node-lateness-ms", "600000",
    "--target-energy", "--target-end-silence-s", "8",
)  # fmt: skip
"""Every formula on. The lateness is longer than the test, so that no source counts as quiet
even on a loaded machine: intervals are reported once every source came past them, or at the
stop."""


def _inputs(hwpc: Path, gpu: Path, meter: Path, *each: str) -> list[str]:
    """The three inputs, each with the flags ``each``."""
    return [
        "--input", "jsonl", "--model", "HWPCReport", "--name", "hwpc", "--files", str(hwpc),
        *each,
        "--input", "jsonl", "--model", "GPUReport", "--name", "gpus", "--files", str(gpu),
        *each,
        "--input", "meter", "--name", "meter", "--files", str(meter), "--sensor", "demo-node",
        *each,
    ]  # fmt: skip


def _outputs(out: Path) -> list[str]:
    return [
        "--output", "jsonl", "--model", "PowerReport", "--name", "power",
        "--file", str(out / "power.jsonl"),
        "--output", "jsonl", "--model", "TargetEnergyReport", "--name", "energy",
        "--file", str(out / "energy.jsonl"),
        *FORMULAS,
    ]  # fmt: skip


def _second(line: str, key: str = "timestamp") -> str:
    return str(json.loads(line)[key])[:19]


def _by_second(lines: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        grouped[_second(line)].append(line)
    return grouped


def _meter_by_second(rows: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        grouped[row.split(",", 1)[0][:19]].append(row)
    return grouped


def _read_all(state: Path, files: dict[str, tuple[Path, int]]) -> bool:
    """Whether the last checkpoint has every input at the end (a byte offset) of its file."""
    if not state.exists():
        return False
    checkpoint = decode_checkpoint(state.read_bytes())
    if checkpoint is None:
        return False
    positions: dict[str, Any] = checkpoint["positions"]
    for name, (path, end) in files.items():
        place = dict(positions.get(name) or {}).get(str(path)) or {}
        if place.get("offset") != end:
            return False
    return True


def _formula(document: dict[str, Any]) -> str:
    """The formula that wrote a document (SmartWatts names its model, RAPL its event)."""
    scope = document.get("metadata", {}).get("scope")
    if "energy" in document and "reason" in document:
        return "energy"
    if document["target"] == "rapl":
        return "rapl"
    return {"node": "node", "gpu": "gpu", "cpu": "smartwatts", "dram": "smartwatts"}[scope]


def _documents(out: Path) -> dict[str, list[str]]:
    """Each formula's documents in the order it wrote them (the formulas' documents
    interleave in one file as their actors run; each formula's own order is its output's)."""
    by_formula: dict[str, list[str]] = defaultdict(list)
    for name in ("power.jsonl", "energy.jsonl"):
        for line in (out / name).read_text().splitlines():
            by_formula[_formula(json.loads(line))].append(line)
    return dict(by_formula)


def test_a_replay_of_a_live_run_gives_what_the_live_run_gave(tmp_path: Path) -> None:
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    shared_node_recordings(recordings)
    hwpc_lines = (recordings / "hwpc.jsonl").read_text().splitlines()
    gpu_lines = (recordings / "gpu.jsonl").read_text().splitlines()
    header, *meter_rows = (DEMO / "demo-meter.csv").read_text().splitlines()
    hwpc_at, gpu_at = _by_second(hwpc_lines), _by_second(gpu_lines)
    meter_at = _meter_by_second(meter_rows)
    seconds = sorted(set(hwpc_at) | set(gpu_at) | set(meter_at))

    live_dir, hwpc, gpu = tmp_path / "live", tmp_path / "hwpc.jsonl", tmp_path / "gpu.jsonl"
    meter = tmp_path / "meter.csv"
    live_dir.mkdir()
    hwpc.touch()
    gpu.touch()
    meter.write_text(header + "\n")
    state = tmp_path / "state"
    with (
        Service(
            tmp_path / "live.log",
            "run",
            "-s",
            "--state-file",
            str(state),
            "--state-interval-s",
            "0.2",
            *_inputs(hwpc, gpu, meter, "--poll-interval-s", "0.05"),
            *_outputs(live_dir),
        ) as live,  # fmt: skip
        hwpc.open("a") as hwpc_log,
        gpu.open("a") as gpu_log,
        meter.open("a") as meter_log,
    ):
        for step, second in enumerate([*seconds, *[None] * METER_LAG_S]):
            for lines, log in ((hwpc_at, hwpc_log), (gpu_at, gpu_log)):
                log.writelines(line + "\n" for line in lines.get(second or "", []))
                log.flush()
            if step >= METER_LAG_S:
                lagging = seconds[step - METER_LAG_S]
                meter_log.writelines(row + "\n" for row in meter_at.get(lagging, []))
                meter_log.flush()
            time.sleep(STEP_S)  # the samplers' pace, not a wait for the service
        ends = {
            "hwpc": (hwpc, hwpc.stat().st_size),
            "gpus": (gpu, gpu.stat().st_size),
            "meter": (meter, meter.stat().st_size),
        }
        wait_until(lambda: _read_all(state, ends), WAIT_S, "every file read to its end")
        node_before_stop = [
            line
            for line in (live_dir / "power.jsonl").read_text().splitlines()
            if '"formula":"node"' in line.replace(" ", "")
        ]
        live.stop()

    replay_dir = tmp_path / "replay"
    replay_dir.mkdir()
    replay = wattflow("run", *_inputs(hwpc, gpu, meter), *_outputs(replay_dir))
    assert replay.returncode == 0, replay.stderr

    live_documents, replayed = _documents(live_dir), _documents(replay_dir)
    assert set(live_documents) == {"smartwatts", "rapl", "gpu", "node", "energy"}
    for formula, documents in live_documents.items():
        assert replayed.get(formula) == documents, f"{formula} differs"
    assert set(replayed) == set(live_documents)
    # the live run reported intervals as their sources came, not only at its stop
    assert node_before_stop, "no interval reported before the stop"
    ended = [json.loads(line) for line in live_documents["energy"]]
    assert {record["reason"] for record in ended} == {"silent", "running"}
    assert all(datetime.fromisoformat(r["end"]) for r in ended)
