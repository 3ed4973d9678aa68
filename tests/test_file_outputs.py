"""The CSV and JSON Lines outputs when their files fail: ``wattflow run`` as users run it, on real
files, with the kernel's own errors (a file size limit, ``/dev/full``)."""

from __future__ import annotations

import csv
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, drained_ledger, wattflow

DATA = ROOT / "tests" / "data" / "smartwatts-2.4.1" / "input"
RECORDING = [
    "run", "--input", "csv", "--files",
    ",".join(str(DATA / name) for name in ("rapl.csv", "msr.csv", "core.csv")),
    "--cpu-base-freq", "2100", "--cpu-tdp", "400",
]  # fmt: skip
"""45 ticks through SmartWatts: 736 PowerReports for five targets."""


def run_with_file_size_limit(limit_bytes: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``wattflow`` whose files cannot grow past ``limit_bytes``: a write beyond fails with
    EFBIG part-way, as a full disk fails a write part-way (Python ignores SIGXFSZ)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        [sys.executable, "-m", "wattflow.service", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )


def csv_rows(directory: Path) -> list[list[str]]:
    """Every row under every header of the output, each checked to have the header's cells."""
    rows = []
    for path in sorted(directory.rglob("*.csv")):
        text = path.read_bytes()
        if not text:  # its first batch was taken back whole, header and all
            continue
        assert text.endswith(b"\r\n"), f"{path} ends with a row cut short"
        header, *body = list(csv.reader(text.decode().splitlines()))
        assert all(len(row) == len(header) for row in body), path
        rows += body
    return rows


def test_a_jsonl_output_that_fills_up_keeps_whole_batches_and_no_report_twice(
    tmp_path: Path,
) -> None:
    out = tmp_path / "power.jsonl"
    done = run_with_file_size_limit(64 * 1024, *RECORDING, "--output", "jsonl", "--file", str(out))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "File too large" in done.stderr
    ledger = drained_ledger(done.stderr)
    assert ledger["delivered"] > 0
    assert ledger["dead_out"] > 0
    assert ledger["delivered"] + ledger["dead_out"] + ledger["unrequested"] == ledger["produced"]
    data = out.read_bytes()
    assert data.endswith(b"\n"), "the file ends with a line cut short"
    lines = data.decode().splitlines()
    assert [json.loads(line)["sensor"] for line in lines] == ["node-1"] * len(lines)
    # What is in the file is exactly what was counted as written: the rest are dead letters.
    assert len(lines) == ledger["delivered"]


def test_a_csv_output_that_fills_up_keeps_whole_batches_and_no_report_twice(
    tmp_path: Path,
) -> None:
    out = tmp_path / "power"
    done = run_with_file_size_limit(
        8 * 1024, *RECORDING, "--output", "csv", "--directory", str(out)
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "PowerReport.csv: File too large" in done.stderr
    ledger = drained_ledger(done.stderr)
    assert ledger["delivered"] > 0
    assert ledger["dead_out"] > 0
    assert len(csv_rows(out)) == ledger["delivered"]


def test_a_full_disk_is_retried_for_retry_for_s_before_its_reports_become_dead_letters(
    tmp_path: Path,
) -> None:
    """``/dev/full`` answers every write with ENOSPC, as a full disk does: the batch is tried
    again (a cluster's scratch space is freed, a quota raised), then dead-lettered."""
    letters = tmp_path / "dead.jsonl"
    done = wattflow(
        *RECORDING, "--dead-letters", str(letters),
        "--output", "jsonl", "--file", "/dev/full", "--retry-for-s", "0.5",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "retrying in" in done.stderr
    assert "after: output 'pusher_jsonl': /dev/full: No space left on device" in done.stderr
    ledger = drained_ledger(done.stderr)
    assert ledger["delivered"] == 0
    assert len(letters.read_text().splitlines()) == ledger["dead_out"] == 736


def test_an_existing_csv_file_whose_header_is_not_csv_refuses_its_rows_only(
    tmp_path: Path,
) -> None:
    out = tmp_path / "power"
    existing = {
        "node-1-rapl": b"\xff\xfe\0not text\n",
        "node-1-global": b"a,b\r\n",
        "node-1-postgres": b"x" * (2 << 20),  # not read whole: no line break in the first MiB
    }
    for target, data in existing.items():
        (out / target).mkdir(parents=True)
        (out / target / "PowerReport.csv").write_bytes(data)
    letters = tmp_path / "dead.jsonl"
    done = wattflow(*RECORDING, "--dead-letters", str(letters), "--output", "csv", "-d", str(out))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    reasons = {json.loads(line)["reason"] for line in letters.read_text().splitlines()}
    assert reasons == {
        f"{out}/node-1-rapl/PowerReport.csv:1: the CSV header is not valid UTF-8",
        f"{out}/node-1-global/PowerReport.csv:1: missing field 'timestamp' in the CSV header",
        f"{out}/node-1-postgres/PowerReport.csv:1: the first line is longer than 1048576 bytes: "
        "not a CSV header",
    }
    assert drained_ledger(done.stderr)["dead_out"] == 176 + 140 + 140
    for target, data in existing.items():
        assert (out / target / "PowerReport.csv").read_bytes() == data
    assert len(csv_rows(out / "node-1-web-frontend")) == 140


@pytest.mark.parametrize("output", ["jsonl", "csv"])
def test_a_file_whose_last_line_was_cut_short_gets_new_lines_of_their_own(
    tmp_path: Path, output: str
) -> None:
    """A writer killed mid-line leaves a last line without its line break; appending to it
    would glue the first new report to the broken line."""
    if output == "jsonl":
        path = tmp_path / "power.jsonl"
        path.write_text('{"timestamp":"2026-01-05T09:00:01.000","sensor":"no')
        flags = ["--file", str(path)]
    else:
        path = tmp_path / "power" / "node-1-rapl" / "PowerReport.csv"
        path.parent.mkdir(parents=True)
        path.write_text("timestamp,sensor,target,power,socket,formula,ratio,scope\r\n1,node-1,ra")
        flags = ["--directory", str(tmp_path / "power")]
    done = wattflow(*RECORDING, "--output", output, *flags)
    assert done.returncode == 0, done.stderr
    assert f"{path} does not end with a line break" in done.stderr
    lines = path.read_text().splitlines()
    if output == "jsonl":
        assert lines[0] == '{"timestamp":"2026-01-05T09:00:01.000","sensor":"no'
        assert len([json.loads(line) for line in lines[1:]]) == 736
    else:
        assert lines[1] == "1,node-1,ra"
        assert all(line.startswith("1767") and line.count(",") == 7 for line in lines[2:])


@pytest.mark.parametrize(("output", "flag"), [("jsonl", "--file"), ("csv", "--directory")])
def test_an_output_path_under_a_file_is_one_line_and_exit_2(
    tmp_path: Path, output: str, flag: str
) -> None:
    (tmp_path / "plain").write_text("a file where a directory should be")
    done = wattflow(*RECORDING, "--output", output, flag, str(tmp_path / "plain" / "x" / "out"))
    assert done.returncode == 2, done.stderr
    path = tmp_path / "plain" / "x" / "out"
    assert done.stderr.strip() == (
        f"wattflow: error: output 'pusher_{output}': {flag} {path}: {tmp_path / 'plain'} is not "
        "a directory"
    )


UNWRITABLE = [
    (
        ["--output", "jsonl", "--file", "/proc/x/y.jsonl"],
        "output 'pusher_jsonl': --file /proc/x/y.jsonl: cannot create the directory /proc/x "
        "(in /proc): ",
    ),
    (
        ["--output", "csv", "--directory", "/proc/x/power"],
        "output 'pusher_csv': --directory /proc/x/power: cannot create the directory "
        "/proc/x/power (in /proc): ",
    ),
    (
        ["--output", "filedb", "-f", "/proc/power.json"],
        "output 'pusher_filedb': --filename /proc/power.json: cannot create files in /proc: ",
    ),
    (
        ["--output", "filedb", "-f", "/nonexistent-wattflow/power.json"],
        "output 'pusher_filedb': --filename /nonexistent-wattflow/power.json: "
        "/nonexistent-wattflow does not exist (this output does not create it)",
    ),
]
"""Paths no write can succeed at, and what the error says before the kernel's reason. ``/proc``
takes no new names, even from root: the kernel says ENOENT to root and EACCES to others."""


REASONS = ("No such file or directory", "Permission denied", "Read-only file system")


@pytest.mark.parametrize(("args", "message"), UNWRITABLE)
def test_an_output_path_that_cannot_be_written_stops_the_command_at_start_with_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Not retried for ``--retry-for-s`` (300 s) batch by batch, as it was: the command says
    which flag is wrong, at once, before reading anything."""
    letters = tmp_path / "dead.jsonl"
    done = wattflow(*RECORDING, *args, "--dead-letters", str(letters))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"wattflow: error: {message}")
    if message.endswith(": "):
        assert line.removeprefix(f"wattflow: error: {message}") in REASONS
    assert not letters.exists() or not letters.read_text()  # nothing was read, none retried


def test_the_start_check_leaves_nothing_behind_and_the_output_still_makes_its_directory(
    tmp_path: Path,
) -> None:
    """The check makes and removes a file where the output's directory would be made: the
    directory appears at the first write, as before, and no check file is left."""
    out = tmp_path / "new" / "deeper" / "power.jsonl"
    done = wattflow(*RECORDING, "--output", "jsonl", "--file", str(out))
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 736
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deeper", "new", "power.jsonl"]
