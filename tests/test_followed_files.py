"""A followed JSON Lines file goes on where the last run stopped (``--follow``/``-s`` with
``--state-file``).

The input reports each file's position (device, inode, byte, line) at its batch boundaries; the
checkpoint commits it with the formulas' state once the outputs wrote what came before it. A
restart takes both back: it reads only the lines added since, with the models it had. A file
replaced or truncated since is read from its start, with a warning.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.checkpoints import decode_checkpoint
from wattflow.formats import powerapi

from .conftest import Service, wait_until, wattflow
from .test_cli import rapl_line
from .test_smartwatts import reports_of, workload
from .test_state_file import powers

TICKS = 40
PER_TICK = 4
WAIT_S = 60.0


def saved_positions(state: Path) -> dict[str, Any]:
    """The positions of the last checkpoint saved to ``state`` (none before the first)."""
    if not state.exists():
        return {}
    checkpoint = decode_checkpoint(state.read_bytes())
    assert checkpoint is not None
    return dict(checkpoint["positions"].get("puller_jsonl") or {})


def committed_to_the_end(state: Path, source: Path) -> bool:
    """Whether the last checkpoint stands at the end of ``source``."""
    place = saved_positions(state).get(str(source))
    return place is not None and place["offset"] == source.stat().st_size


def follow(tmp_path: Path, log: str, source: Path, state: Path, *outputs: str) -> Service:
    return Service(
        tmp_path / log, "run", "-s", "--state-file", str(state), "--state-interval-s", "0.2",
        "--input", "jsonl", "--files", str(source), "--poll-interval-s", "0.05", *outputs,
    )  # fmt: skip


def test_a_followed_file_goes_on_where_the_last_run_stopped(tmp_path: Path) -> None:
    lines = [powerapi.encode_json(r) + "\n" for r in reports_of(workload(TICKS))]
    whole, source, state = tmp_path / "all.jsonl", tmp_path / "hwpc.jsonl", tmp_path / "state"
    whole.write_text("".join(lines))
    clean = wattflow(
        "run", "--input", "jsonl", "--files", str(whole),
        "--output", "jsonl", "--file", str(tmp_path / "clean.jsonl"),
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr
    half = TICKS // 2 * PER_TICK
    source.write_text("".join(lines[:half]))

    runs = []
    for run, more in enumerate((lines[half:], [])):
        out = tmp_path / f"run{run}.jsonl"
        record = ["--output", "jsonl", "--file", str(out)]
        with follow(tmp_path, f"run{run}.log", source, state, *record) as service:
            wait_until(
                lambda: service.alive() and committed_to_the_end(state, source),
                WAIT_S,
                "a checkpoint at the end of the file",
            )
            log = service.stop()
        runs.append((out, log))
        with source.open("a") as growing:
            growing.write("".join(more))

    first, second = runs
    assert "going on from line 81" in second[1], second[1][-2000:]
    assert "restored the state of 2 formula instances" in second[1]
    expected = powers(tmp_path / "clean.jsonl")
    got = powers(first[0])
    later = powers(second[0])
    assert got
    assert later
    assert not set(got) & set(later), "a report written by both runs"
    got.update(later)
    assert set(got) == set(expected)
    assert all(abs(got[key] - value) <= 1e-6 * max(1.0, value) for key, value in expected.items())


def recorded_stamps(path: Path) -> list[str]:
    return [json.loads(line)["timestamp"] for line in path.read_text().splitlines()]


def stamp(index: int) -> str:
    return str(json.loads(rapl_line(index))["timestamp"])


@pytest.mark.parametrize("change", ["replaced", "truncated"])
def test_a_file_replaced_or_truncated_since_is_read_from_its_start(
    tmp_path: Path, change: str
) -> None:
    source, state = tmp_path / "hwpc.jsonl", tmp_path / "state"
    source.write_text("".join(rapl_line(i) + "\n" for i in range(10)))
    record = ["--output", "jsonl", "--model", "HWPCReport"]
    first = tmp_path / "first.jsonl"
    with follow(tmp_path, "first.log", source, state, *record, "--file", str(first)) as service:
        wait_until(
            lambda: service.alive() and committed_to_the_end(state, source),
            WAIT_S,
            "a checkpoint at the end of the file",
        )
        service.stop()
    assert recorded_stamps(first) == [stamp(i) for i in range(10)]
    newer = "".join(rapl_line(i) + "\n" for i in range(100, 104))
    if change == "replaced":  # a rotation: a new file under the same name
        fresh = tmp_path / "fresh.jsonl"
        fresh.write_text(newer)
        os.replace(fresh, source)
    else:
        source.write_text(newer)  # the same file, cut shorter and written again
    second = tmp_path / "second.jsonl"
    with follow(tmp_path, "second.log", source, state, *record, "--file", str(second)) as service:
        service.wait_for_lines(second, 4, WAIT_S)
        log = service.stop()
    assert "was replaced or truncated since the last checkpoint" in log
    assert recorded_stamps(second) == [stamp(i) for i in range(100, 104)]


def test_an_unfinished_last_line_waits_for_the_next_run(tmp_path: Path) -> None:
    """With checkpoints, a line whose writer has not ended it yet is left at a stop: the next
    run reads it whole, rather than this one reading half of it as a dead letter."""
    source, state = tmp_path / "hwpc.jsonl", tmp_path / "state"
    whole = "".join(rapl_line(i) + "\n" for i in range(5))
    source.write_text(whole + rapl_line(5)[:20])
    record = ["--output", "jsonl", "--model", "HWPCReport"]
    first, letters = tmp_path / "first.jsonl", tmp_path / "dead.jsonl"
    with follow(
        tmp_path, "first.log", source, state, "--dead-letters", str(letters), *record,
        "--file", str(first),
    ) as service:  # fmt: skip
        wait_until(
            lambda: (
                service.alive()
                and saved_positions(state).get(str(source), {}).get("offset") == len(whole)
            ),
            WAIT_S,
            "a checkpoint after the fifth line",
        )
        service.stop()
    assert recorded_stamps(first) == [stamp(i) for i in range(5)]
    assert not letters.exists() or letters.read_text() == ""
    with source.open("a") as growing:
        growing.write(rapl_line(5)[20:] + "\n" + rapl_line(6) + "\n")
    second = tmp_path / "second.jsonl"
    with follow(tmp_path, "second.log", source, state, *record, "--file", str(second)) as service:
        service.wait_for_lines(second, 2, WAIT_S)
        service.stop()
    assert recorded_stamps(second) == [stamp(5), stamp(6)]


def meter_rows(start: int, count: int) -> str:
    """Wattmeter CSV rows, a quarter second apart, each reading its index in mW on d0c0."""
    first_ms = 1_772_323_200_000
    return "".join(f"{first_ms + 250 * i},{i}.0,1.0\n" for i in range(start, start + count))


def test_a_followed_meter_log_goes_on_after_its_last_reading_with_its_header(
    tmp_path: Path,
) -> None:
    """The meter input keeps its files' positions like the JSON Lines input, and each CSV
    file's header with them: a restart reads only the rows added since, decoded by the header
    it no longer reads again (no reading twice, none missing, no row 'before the header')."""
    source, state, letters = tmp_path / "meter.csv", tmp_path / "state", tmp_path / "dead.jsonl"
    source.write_text("timestamp,d0c0,d0c1\n" + meter_rows(0, 10))

    def meter(log: str, out: Path) -> Service:
        return Service(
            tmp_path / log, "run", "-s", "--state-file", str(state), "--state-interval-s", "0.2",
            "--input", "meter", "--files", str(source), "--sensor", "node-1",
            "--poll-interval-s", "0.05", "--dead-letters", str(letters),
            "--output", "jsonl", "--model", "MeterReport", "--file", str(out),
        )  # fmt: skip

    def committed(rows: int) -> bool:
        if not state.exists():
            return False
        checkpoint = decode_checkpoint(state.read_bytes())
        assert checkpoint is not None
        place = dict(checkpoint["positions"].get("puller_meter") or {}).get(str(source))
        return place is not None and place["line"] == rows + 1

    first = tmp_path / "first.jsonl"
    with meter("first.log", first) as service:
        wait_until(lambda: service.alive() and committed(10), WAIT_S, "a checkpoint at row 10")
        service.stop()
    with source.open("a") as growing:
        growing.write(meter_rows(10, 5))
    second = tmp_path / "second.jsonl"
    with meter("second.log", second) as service:
        service.wait_for_lines(second, 5, WAIT_S)
        wait_until(lambda: service.alive() and committed(15), WAIT_S, "a checkpoint at row 15")
        log = service.stop()
    assert "going on from line 12" in log, log[-2000:]
    readings = [
        json.loads(line)["channels"]["d0c0"]
        for path in (first, second)
        for line in path.read_text().splitlines()
    ]
    assert readings == [float(i) for i in range(15)]
    assert not letters.exists() or letters.read_text() == ""


@pytest.mark.parametrize("rotation", ["create", "copytruncate"])
@pytest.mark.parametrize("kind", ["jsonl", "meter"])
def test_a_log_rotated_while_followed_is_read_on_in_its_new_file(
    tmp_path: Path, kind: str, rotation: str
) -> None:
    """Loggers rotate their files, by moving the file away and starting a new one (logrotate's
    ``create``) or by copying it and cutting it back to nothing (``copytruncate``). The input
    reads the old file to its end, then the new file from its start: every reading once."""
    if kind == "jsonl":
        source = tmp_path / "hwpc.jsonl"
        header, model = "", "HWPCReport"
        before = "".join(rapl_line(i) + "\n" for i in range(6))
        after = "".join(rapl_line(i) + "\n" for i in range(6, 10))
        flags = ["--input", "jsonl"]
    else:
        source = tmp_path / "meter.csv"
        header, model = "timestamp,d0c0,d0c1\n", "MeterReport"
        before, after = meter_rows(0, 6), meter_rows(6, 4)
        flags = ["--input", "meter", "--sensor", "node-1"]
    source.write_text(header + before)
    out, letters = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    with Service(
        tmp_path / "run.log", "run", "-s", *flags, "--files", str(source),
        "--poll-interval-s", "0.05", "--dead-letters", str(letters),
        "--output", "jsonl", "--model", model, "--file", str(out),
    ) as service:  # fmt: skip
        service.wait_for_lines(out, 6, WAIT_S)
        if rotation == "create":
            source.rename(tmp_path / f"{source.name}.1")
            source.write_text(header + after)
        else:
            (tmp_path / f"{source.name}.1").write_bytes(source.read_bytes())
            with source.open("r+") as cut:
                cut.truncate(0)
            source.write_text(header + after)
        service.wait_for_lines(out, 10, WAIT_S)
        log = service.stop()
    assert "was rotated: reading the new file from its start" in log, log[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    if kind == "jsonl":
        assert [r["timestamp"] for r in records] == [stamp(i) for i in range(10)]
    else:
        assert [r["channels"]["d0c0"] for r in records] == [float(i) for i in range(10)]
    assert not letters.exists() or letters.read_text() == ""


def test_a_dead_letter_is_in_its_file_before_the_checkpoint_past_it_and_a_kill_loses_none(
    tmp_path: Path,
) -> None:
    """A line dead-lettered by a followed input, then a checkpoint past it, then SIGKILL: the
    dead letter is in the ``--dead-letters`` file (it was buffered in the process, and lost
    with it, before), and the restart, which goes on after the checkpoint, does not read it
    again: it is in the file once, and each good line is written once by one of the runs."""
    source, state, letters = tmp_path / "hwpc.jsonl", tmp_path / "state", tmp_path / "dead.jsonl"
    good = [rapl_line(i) + "\n" for i in range(40)]
    source.write_text("".join(good[:20]) + "{not json\n" + "".join(good[20:]))
    record = ["--output", "jsonl", "--model", "HWPCReport", "--dead-letters", str(letters)]
    first = tmp_path / "first.jsonl"
    with follow(tmp_path, "first.log", source, state, *record, "--file", str(first)) as service:
        wait_until(
            lambda: service.alive() and committed_to_the_end(state, source),
            WAIT_S,
            "a checkpoint at the end of the file",
        )
        service.stop(signal.SIGKILL, code=-signal.SIGKILL)
    kept = [json.loads(line) for line in letters.read_text().splitlines()]
    assert [(letter["reason"].split(":")[:2], letter["payload"]) for letter in kept] == [
        ([str(source), "21"], "{not json")
    ]
    second = tmp_path / "second.jsonl"
    with source.open("a") as growing:
        growing.write(rapl_line(40) + "\n")
    with follow(tmp_path, "second.log", source, state, *record, "--file", str(second)) as service:
        service.wait_for_lines(second, 1, WAIT_S)
        service.stop()
    assert [json.loads(line)["payload"] for line in letters.read_text().splitlines()] == [
        "{not json"
    ]
    assert recorded_stamps(first) + recorded_stamps(second) == [stamp(i) for i in range(41)]
