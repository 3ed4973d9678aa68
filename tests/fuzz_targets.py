"""The C parser's fuzz targets: a fuzzer's bytes handed to each entry point of
``formats/_hwpc_lines.c`` the way wattflow's inputs hand it theirs, and the answer held to the
Python way's (``parser_oracle.py``), not only to "no crash".

``test_fuzz_regressions.py`` replays every input kept under ``tests/data/fuzz-regressions/``
through them, on whichever build the tests run. An ``AssertionError`` here is a disagreement: a
fuzzer stops and keeps the input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from wattflow.formats import powerapi
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.json_frames import Layout

from .parser_oracle import agree, python_way, reports_and_dead_letters

CSV_CHUNK_BYTES = 128
"""The framed CSV reader's first chunk: small, so that an input of a few kilobytes is parsed in
many calls, each cut at a line break somewhere else."""

CSV_FILE_NAME = "core.csv"
"""The fuzzed file's name: the readers name its group after it."""


def json_lines(data: bytes) -> None:
    """``data`` cut at its line breaks, as the socket and JSON Lines inputs cut what they read,
    is one batch for ``parse``: what the C parser frames (``compiled_hwpc_frames``) must be what
    the Python way frames, or be declined. Then again without the first line, with the layouts
    the Python way learned from it: what an input remembers of the lines before a batch decides
    whether the parser's frames may stand."""
    lines: list[Any] = data.split(b"\n")
    agree(lines)
    if len(lines) > 1:
        layouts: dict[str, Layout] = {}
        python_way(lines[:1], layouts)
        if layouts:
            agree(lines[1:], layouts)


def csv_file(data: bytes, directory: Path) -> None:
    """``data`` as a hwpc-sensor CSV events file, header and rows: the framed reader (the rows
    through ``parse_csv``, a chunk at a time) gives the reports and dead letters the row-by-row
    reader gives, or refuses the header as it does."""
    path = directory / CSV_FILE_NAME
    path.write_bytes(data)
    framed = _outcome(lambda: list(read_hwpc_csv_frames([path], CSV_CHUNK_BYTES)))
    rows = _outcome(lambda: list(powerapi.read_hwpc_csv([path])))
    assert framed == rows


def _outcome(read: Callable[[], list[Any]]) -> tuple[list[Any], list[Any]] | str:
    """What a reader makes of the file: its reports and dead letters, or the error with which
    it refuses the file (a header without the columns it needs)."""
    try:
        return reports_and_dead_letters(read())
    except DecodeError as error:
        return f"refused: {error}"
