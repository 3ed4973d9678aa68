"""The C parser's fuzz targets: a fuzzer's bytes handed to each entry point of
``formats/_hwpc_lines.c`` the way wattflow's inputs hand it theirs, and the answer held to the
Python way's (``parser_oracle.py``), not only to "no crash".

``scripts/fuzz_parser.py`` runs them under atheris (libFuzzer) on the sanitized, coverage-
instrumented build; ``test_fuzz_regressions.py`` replays every input kept under
``tests/data/fuzz-regressions/`` on whichever build the tests run. An ``AssertionError`` here is
a disagreement: the fuzzer stops and keeps the input.
"""

from __future__ import annotations

import json
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
    assert framed == rows, f"the fast way read {framed!r:.3000}\nthe row-by-row way {rows!r:.3000}"


def _hwpc_line(target: str, groups: dict[str, dict[str, int]]) -> bytes:
    """hwpc-sensor's line of one cpu per group, in its compact form."""
    document = {
        "timestamp": 1_767_603_600_000,
        "sensor": "node-1",
        "target": target,
        "groups": {group: {"0": {"0": events}} for group, events in groups.items()},
    }
    return json.dumps(document, separators=(",", ":")).encode()


def json_lines_at_the_limits() -> list[bytes]:
    """Batches at and past the bounds of the C parser's fixed tables (``MAX_EVENTS``,
    ``MAX_GROUPS_PER_LINE``, ``MAX_SIGNATURES``, ``MAX_SHAPES`` in ``_hwpc_lines.c``), and with
    more distinct names than its first table of names holds (128, then it grows): branches that
    hwpc-sensor's own batches, and the mutations of a few bytes of them, do not reach."""
    batches = [
        _hwpc_line("all", {"core": {f"e{i}": i for i in range(width)}}) for width in (127, 128, 129)
    ]
    batches += [_hwpc_line("all", {f"g{i}": {"e": 1} for i in range(count)}) for count in (64, 65)]
    for events in ("e", "e{}"):  # the same events in every group (one signature), or not
        lines = [
            _hwpc_line(target, {f"g{i}": {events.format(i): 1} for i in numbers})
            for target, numbers in (("a", range(40)), ("b", range(40, 70)))
        ]
        batches.append(b"\n".join(lines))
    return batches


def csv_files_at_the_limits() -> list[bytes]:
    """CSV files with more distinct names than the parser's first table of names holds, and
    with a name as long as it reads and one byte longer (``CSV_LONGEST_NAME``)."""
    header = b"timestamp,sensor,target,socket,cpu,e\n"
    many = b"".join(b"1,node-1,t%d,0,0,1\n" % number for number in range(150))
    named = [b"1767603600000,node-1,%s,0,0,1\n" % (b"n" * size) for size in (1023, 1024)]
    return [header + many, *(header + row for row in named)]


def _outcome(read: Callable[[], list[Any]]) -> tuple[list[Any], list[Any]] | str:
    """What a reader makes of the file: its reports and dead letters, or the error with which
    it refuses the file (a header without the columns it needs)."""
    try:
        return reports_and_dead_letters(read())
    except DecodeError as error:
        return f"refused: {error}"
