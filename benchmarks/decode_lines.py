"""Decoding hwpc-sensor's JSON lines, per line, against the time ``orjson.loads`` takes.

The live path's decode (socket → frames) is most of wattflow's CPU time; this measures it
apart, in one process, on the lines ``live_socket.py`` sends (``sensor_streams``: 2 sockets ×
4 cpus each, a global report and one report per container each tick), each sensor's lines cut
into batches of ``--batch`` lines as the socket input hands them on:

1. ``orjson.loads``, one call per line: the anchor, the physical limit of a JSON parse into
   Python objects.
2. msgspec's checked parse of each line (``json_frames._decode_whole``), which the Python way
   starts with.
3. ``decode_hwpc_frames`` with the C parser set aside: the Python way, parse and columns.
4. ``compiled_hwpc_frames``: the C parser (``formats/_hwpc_lines.c``) writing the counters
   straight into columns, and numpy checking and assembling the same frames.
5. The C parser alone (``_hwpc_lines.parse``), without the frames.

Each batch keeps what the input remembers of its sensor (``layouts``), as the socket input does.
The rounds alternate the ways (so that a loaded machine slows each alike), with the garbage
collector off; each way's best round counts, in CPU time (``time.process_time``). It prints µs
per line and each way's time as a multiple of orjson's, and checks that both frame ways made
the same frames (names, columns, reports). Run from the repository root:

    python benchmarks/decode_lines.py --sensors 100 --containers 100 --ticks 4
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_socket import sensor_streams

from wattflow.formats import json_frames
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.json_frames import Layout, compiled_hwpc_frames

Batches = list[list[bytes]]


def batches_of(streams: Sequence[Sequence[bytes]], size: int) -> Batches:
    """Each sensor's lines in batches of ``size``, sensor after sensor."""
    return [list(lines[at : at + size]) for lines in streams for at in range(0, len(lines), size)]


def orjson_way(batches: Batches) -> None:
    loads = orjson.loads
    for batch in batches:
        for line in batch:
            loads(line)


def msgspec_way(batches: Batches) -> None:
    decode = json_frames._decode_whole
    for batch in batches:
        for line in batch:
            decode(line)


def python_frames(batches: Batches) -> list[list[HWPCFrame] | None]:
    """``decode_hwpc_frames`` as it decodes without the C parser."""
    layouts: dict[str, Layout] = {}
    documents = json_frames._plain_lines
    learn = json_frames._frames_learning_again
    made: list[list[HWPCFrame] | None] = []
    for batch in batches:
        plain = documents(batch)
        made.append(None if plain is None else learn(plain, layouts))
    return made


def compiled_frames(batches: Batches) -> list[list[HWPCFrame] | None]:
    layouts: dict[str, Layout] = {}
    return [compiled_hwpc_frames(batch, layouts) for batch in batches]


def c_parse(batches: Batches) -> None:
    from wattflow.formats._hwpc_lines import parse

    for batch in batches:
        parse(batch)


def same_frames(left: list[HWPCFrame], right: list[HWPCFrame]) -> bool:
    """The same frames: names, counts, each table's columns, and the reports they give."""
    if len(left) != len(right):
        return False
    for one, other in zip(left, right, strict=True):
        if one.names != other.names or one.count != other.count:
            return False
        if len(one.tables) != len(other.tables):
            return False
        for table, twin in zip(one.tables, other.tables, strict=True):
            if (table.group, table.events) != (twin.group, twin.events):
                return False
            for name in ("millis", "sensors", "targets", "sockets", "cpus", "values"):
                mine, theirs = getattr(table, name), getattr(twin, name)
                if mine.dtype != theirs.dtype or not np.array_equal(mine, theirs):
                    return False
        if one.reports() != other.reports():
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sensors", type=int, default=100)
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--ticks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch", type=int, default=500, help="lines per batch (default 500)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not json_frames.c_parser_built():
        print("the C parser (wattflow.formats._hwpc_lines) is not built", file=sys.stderr)
        return 1
    streams = sensor_streams(args.sensors, args.containers, args.ticks, args.seed)
    batches = batches_of(streams, args.batch)
    lines = sum(map(len, batches))
    size = sum(len(line) for batch in batches for line in batch)
    print(f"{lines:,} lines ({size / lines:,.0f} bytes each) in {len(batches):,} batches")

    python_made, compiled_made = python_frames(batches), compiled_frames(batches)
    declined = sum(made is None for made in compiled_made)
    for mine, theirs in zip(compiled_made, python_made, strict=True):
        if mine is not None and (theirs is None or not same_frames(mine, theirs)):
            print("the C parser made other frames than the Python way", file=sys.stderr)
            return 1
    print(f"same frames both ways; batches the C parser left to the Python way: {declined}")

    ways: dict[str, Callable[[Batches], object]] = {
        "orjson.loads": orjson_way,
        "msgspec checked parse": msgspec_way,
        "decode_hwpc_frames (Python)": python_frames,
        "compiled_hwpc_frames (C + numpy)": compiled_frames,
        "  of which the C parse": c_parse,
    }
    best = dict.fromkeys(ways, float("inf"))
    gc.disable()
    try:
        for _ in range(args.rounds):
            for name, way in ways.items():
                start = time.process_time()
                way(batches)
                best[name] = min(best[name], time.process_time() - start)
    finally:
        gc.enable()
    anchor = best["orjson.loads"]
    print(f"best of {args.rounds} rounds, CPU time, GC off")
    print(f"{'':34} {'µs/line':>8} {'× orjson':>9}")
    for name, seconds in best.items():
        print(f"{name:34} {seconds / lines * 1e6:8.2f} {seconds / anchor:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
