"""What the C parser (``formats/_hwpc_lines.c``) must agree with: the Python way of each input.

The parser may decline anything, but what it makes must be what the Python way makes of the same
bytes. These checks are shared by the parser's tests (``test_hwpc_lines.py``, ``test_frames.py``)
and its fuzz targets (``fuzz_targets.py``), so that a fuzzer holds the parser to the very
assertions the tests do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from wattflow.formats import json_frames, powerapi
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Frame, HWPCFrame, canonical_rows
from wattflow.formats.json_frames import Layout, compiled_hwpc_frames

# --- hwpc-sensor's JSON lines ---------------------------------------------------------------


def python_way(lines: list[Any], layouts: dict[str, Layout]) -> list[HWPCFrame] | None:
    """``decode_hwpc_frames`` without the C parser."""
    documents = json_frames._plain_lines(lines)
    return None if documents is None else json_frames._frames_learning_again(documents, layouts)


def assert_canonical(frames: list[HWPCFrame]) -> None:
    """The decoder promises canonical rows: the promise holds."""
    for frame in frames:
        assert frame.canonical
        assert canonical_rows(frame.tables)


def assert_same_frames(mine: list[HWPCFrame], theirs: list[HWPCFrame]) -> None:
    assert len(mine) == len(theirs)
    assert_canonical(mine)
    assert_canonical(theirs)
    for frame, twin in zip(mine, theirs, strict=True):
        assert frame.names == twin.names
        assert frame.count == twin.count
        assert [(t.group, t.events) for t in frame.tables] == [
            (t.group, t.events) for t in twin.tables
        ]
        for table, other in zip(frame.tables, twin.tables, strict=True):
            for name in ("millis", "sensors", "targets", "sockets", "cpus", "values"):
                column, expected = getattr(table, name), getattr(other, name)
                assert column.dtype == expected.dtype, name
                assert column.shape == expected.shape, name
                assert np.array_equal(column, expected), name
        assert frame.reports() == twin.reports()


def agree(lines: list[Any], layouts: dict[str, Layout] | None = None) -> bool:
    """Check the C parser against the Python way on one batch; whether it made frames."""
    mine_layouts = dict(layouts or {})
    theirs_layouts = dict(layouts or {})
    mine = compiled_hwpc_frames(lines, mine_layouts)
    theirs = python_way(lines, theirs_layouts)
    if mine is None:
        assert mine_layouts == (layouts or {}), "a declined batch leaves the layouts alone"
        assert_canonical(theirs or [])
        return False
    assert theirs is not None, "the C parser made frames of a batch the Python way refuses"
    assert_same_frames(mine, theirs)
    assert mine_layouts == theirs_layouts
    return True


# --- PowerAPI's CSV files -------------------------------------------------------------------


def as_comparable(items: list[Any]) -> list[Any]:
    """Reports as their full documents, errors as their text, frames replaced by their reports."""
    found: list[Any] = []
    for item in items:
        if isinstance(item, Frame):
            found.extend(report.model_dump() for report in item.reports())
        elif isinstance(item, DecodeError):
            found.append(str(item))
        else:
            found.append(item.model_dump())
    return found


def both_readers(paths: list[Path], chunk_bytes: int) -> tuple[list[Any], list[Any]]:
    return (
        list(read_hwpc_csv_frames(paths, chunk_bytes)),
        list(powerapi.read_hwpc_csv(paths)),
    )


def reports_and_dead_letters(items: list[Any]) -> tuple[list[Any], list[Any]]:
    """The reports in order and the dead letters in order. Where a frame stands for a tick, the
    dead letters of rows merged into that tick come after it, not between its reports."""
    comparable = as_comparable(items)
    return (
        [item for item in comparable if not isinstance(item, str)],
        [item for item in comparable if isinstance(item, str)],
    )
