"""``--state-file``: the formulas' learned state outlives the process.

A recording is split in two and each half run by its own ``wattflow run`` with the same state
file. The second run restores what the first learned (SmartWatts' models and windows, RAPL's
last tick), so together they write exactly what one run over the whole recording writes: the
second run's first ticks are estimated at once, with no relearning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wattflow.actors.checkpoints import STATE_VERSION, decode_checkpoint
from wattflow.actors.partition import partition_of
from wattflow.formats import powerapi

from .conftest import wattflow
from .test_smartwatts import reports_of, workload

TICKS = 40


def run(source: Path, out: Path, *extra: str) -> str:
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--file", str(out), *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def powers(path: Path) -> dict[tuple[Any, ...], float]:
    found: dict[tuple[Any, ...], float] = {}
    for line in path.read_text().splitlines():
        document = json.loads(line)
        metadata = document.get("metadata", {})
        key = (
            document["timestamp"],
            document["target"],
            metadata.get("scope"),
            metadata.get("socket"),
            metadata.get("formula"),
        )
        assert key not in found, f"{key} written twice"
        found[key] = float(document["power"])
    return found


def test_a_second_run_goes_on_from_the_state_the_first_saved(tmp_path: Path) -> None:
    reports = reports_of(workload(TICKS))
    lines = [powerapi.encode_json(report) + "\n" for report in reports]
    whole, first, second = (tmp_path / name for name in ("all.jsonl", "a.jsonl", "b.jsonl"))
    whole.write_text("".join(lines))
    half = len(lines) // 2
    first.write_text("".join(lines[:half]))
    second.write_text("".join(lines[half:]))
    state = tmp_path / "state" / "wattflow.state"

    run(whole, tmp_path / "clean.jsonl")
    run(first, tmp_path / "first.jsonl", "--state-file", str(state))
    saved = decode_checkpoint(state.read_bytes())
    assert saved is not None
    assert saved["version"] == STATE_VERSION
    assert set(saved["formulas"]) == {"smartwatts", "rapl"}
    log = run(second, tmp_path / "second.jsonl", "--state-file", str(state))
    assert "restored the state of 2 formula instances" in log

    expected = powers(tmp_path / "clean.jsonl")
    got = powers(tmp_path / "first.jsonl")
    later = powers(tmp_path / "second.jsonl")
    assert not set(got) & set(later), "a report written by both runs"
    got.update(later)
    assert set(got) == set(expected)
    assert all(abs(got[key] - value) <= 1e-6 * max(1.0, value) for key, value in expected.items())


def test_without_a_state_file_the_second_run_relearns(tmp_path: Path) -> None:
    """The loss the state file prevents: on its own, the second half starts from nothing."""
    reports = reports_of(workload(TICKS))
    lines = [powerapi.encode_json(report) + "\n" for report in reports]
    second = tmp_path / "b.jsonl"
    second.write_text("".join(lines[len(lines) // 2 :]))
    run(second, tmp_path / "second.jsonl")
    targets = {key[0] for key in powers(tmp_path / "second.jsonl") if key[1] == "web"}
    assert len(targets) < TICKS // 2 - 5, "relearning leaves the first ticks unestimated"


def saved_states(state: Path) -> dict[str, dict[str, Any]]:
    """Each formula's instance states, by sensor, in the checkpoint saved to ``state``."""
    saved = decode_checkpoint(state.read_bytes())
    assert saved is not None
    return dict(saved["formulas"])


def saved_sensors(state: Path) -> dict[str, set[str]]:
    """The sensors each formula has a state for in the checkpoint saved to ``state``."""
    return {formula: set(states) for formula, states in saved_states(state).items()}


def test_a_sensor_that_sends_nothing_after_a_restart_keeps_its_learned_state(
    tmp_path: Path,
) -> None:
    """A run restores what the state file holds for every sensor it takes, whether or not the
    sensor sends anything (its node may be down for a while): the checkpoints it saves hold
    that state again, so a later run still has it. A sensor another partition takes is not
    this instance's: it is not restored here."""
    lines = [powerapi.encode_json(report) + "\n" for report in reports_of(workload(TICKS))]
    recording, silent = tmp_path / "all.jsonl", tmp_path / "silent.jsonl"
    recording.write_text("".join(lines))
    silent.write_text("")
    state = tmp_path / "wattflow.state"
    run(recording, tmp_path / "first.jsonl", "--state-file", str(state))
    learned = saved_sensors(state)
    assert learned == {"smartwatts": {"node"}, "rapl": {"node"}}
    models = saved_states(state)["smartwatts"]["node"]

    log = run(silent, tmp_path / "second.jsonl", "--state-file", str(state))
    assert "restored the state of 2 formula instances" in log
    assert saved_sensors(state) == learned
    assert saved_states(state)["smartwatts"]["node"] == models, "the silent sensor's models changed"

    owner = partition_of("node", 2)
    run(silent, tmp_path / "third.jsonl", "--state-file", str(state), "--partition", f"{owner}/2")
    assert saved_sensors(state) == learned
    other = f"{1 - owner}/2"
    run(silent, tmp_path / "fourth.jsonl", "--state-file", str(state), "--partition", other)
    assert saved_sensors(state) == {"smartwatts": set(), "rapl": set()}
    assert not (tmp_path / "fourth.jsonl").exists() or not (tmp_path / "fourth.jsonl").read_text()
