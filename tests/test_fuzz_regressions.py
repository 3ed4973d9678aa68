"""Every input on which the fuzzer (``scripts/fuzz_parser.py``) caught the C parser or its
Python glue out, kept under ``tests/data/fuzz-regressions/TARGET/`` and replayed through the
fuzz target that found it (``fuzz_targets.py``): the fast way and the Python way agree on it, on
whichever build of the parser the run tests (``scripts/test-parser`` runs this file on the
sanitized one too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .fuzz_targets import csv_file, csv_files_at_the_limits, json_lines, json_lines_at_the_limits

REGRESSIONS = Path(__file__).resolve().parent / "data" / "fuzz-regressions"
TARGETS = ("csv", "json-lines")


def kept() -> list[Path]:
    """Every kept input, of every target."""
    return sorted(path for path in REGRESSIONS.glob("*/*") if path.is_file())


def test_every_kept_input_belongs_to_a_target() -> None:
    """An input kept under any other folder would be replayed by nothing."""
    assert kept(), "the fuzzer's findings are kept"
    assert {path.parent.name for path in kept()} <= set(TARGETS)


@pytest.mark.parametrize("path", kept(), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_what_the_fuzzer_found_is_read_the_same_both_ways(path: Path, tmp_path: Path) -> None:
    if path.parent.name == "csv":
        csv_file(path.read_bytes(), tmp_path)
    else:
        json_lines(path.read_bytes())


def test_inputs_at_the_parsers_limits_are_read_the_same_both_ways(tmp_path: Path) -> None:
    """The inputs the fuzzer is also seeded with at the bounds of the parser's tables, and with
    a table of names that grows: here, they are read on the sanitized build too."""
    for data in json_lines_at_the_limits():
        json_lines(data)
    for data in csv_files_at_the_limits():
        csv_file(data, tmp_path)
