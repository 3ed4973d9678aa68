"""Where the live path's time goes, stage by stage, against orjson's parse of the same lines.

``live_socket.py`` measures the live path end to end, through sockets, the event loop and a
file; its figures move with the load on the machine. This script runs each stage of the same
path in one process, on the same lines, with the garbage collector off, and takes CPU time
(best of ``--repeat`` rounds, the stages taking turns): what each stage costs per input report,
and that cost as a multiple of ``orjson.loads`` on one line, the physical limit
``live_socket.py`` compares against.

Stages, as the socket input runs them (batches of ``--batch`` lines of one sensor, the socket
input's ``--max-batch``):

1. **msgspec parse**: msgspec's checked parse of each line, the first step of the Python way of
   decoding (``formats/json_frames.py``), shown for comparison;
2. **decode into frames**: the whole decode of a batch into HWPCFrames, through the function
   every JSON input calls (``decode_json_runs``): with the C parser where it was built (the
   label says which);
3. **route**: the router's split of each frame for the RAPL and node formulas (``global_parts``)
   and for SmartWatts (per sensor);
4. **SmartWatts** and **RAPL**: each formula's ``process`` on its parts, one instance per sensor,
   with the flags of ``live_socket.py``;
5. **encode**: the JSON Lines output's encoding of the PowerFrames the formulas made.

The live path reaches 40 % of the decode rate when everything together costs at most 2.5 times
orjson's parse; the script prints that budget beside the sum. What the sum leaves out (socket
reads, the event loop, mailboxes, the write itself) is what ``live_socket.py`` adds.

    python benchmarks/live_stages.py --sensors 10 --containers 100 --ticks 60
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_lines import batches_of, msgspec_way, orjson_way
from live_socket import sensor_streams

from wattflow.actors.formulas.base import Formula, Output
from wattflow.actors.formulas.rapl import RaplConfig, RaplFormula
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.actors.pullers.socket import SocketPullerConfig
from wattflow.formats.frames import Frame, HWPCFrame, PowerFrame
from wattflow.formats.json_frames import c_parser_built, decode_json_runs
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import HWPCReport, Report

TARGET_SHARE = 0.40
"""The share of orjson's decode rate the live path is to reach."""


def best_cpu_s(
    rounds: dict[str, list[float]], name: str, run: Callable[..., Any], *args: Any
) -> Any:
    """Run ``run(*args)`` once, adding its CPU time to ``rounds[name]``; return its result."""
    start = time.process_time()
    result = run(*args)
    rounds.setdefault(name, []).append(time.process_time() - start)
    return result


def decode_all(batches: list[list[bytes]]) -> list[list[HWPCFrame]]:
    """Each batch's frames, remembering each sensor's layout as the socket input does."""
    layouts: dict[str, Any] = {}
    decoded = []
    for batch in batches:
        frames, _ = decode_json_runs(HWPCReport, [("socket", 1, batch)], layouts)
        if not frames or not isinstance(frames[0], HWPCFrame):
            raise SystemExit("a batch did not decode into frames: the generator changed?")
        decoded.append(frames)
    return decoded


def route(frames: list[HWPCFrame]) -> list[tuple[type[Formula[Any]], Hashable, Frame]]:
    """Each formula's parts of each frame, as the router hands them on."""
    parts: list[tuple[type[Formula[Any]], Hashable, Frame]] = []
    for frame in frames:
        for formula in (SmartWattsFormula, RaplFormula):
            for key, part in formula.frame_parts(frame) or []:
                parts.append((formula, key, part))
    return parts


def estimate(
    parts: list[tuple[type[Formula[Any]], Hashable, Frame]],
    formula: type[Formula[Any]],
    config: Any,
) -> list[PowerFrame]:
    """A formula's PowerFrames from its parts, one instance per dispatch key, flushed at the
    end."""
    instances: dict[Hashable, Formula[Any]] = {}
    made: list[Report | Frame] = []
    for owner, key, part in parts:
        if owner is not formula:
            continue
        instance = instances.get(key)
        if instance is None:
            instance = instances[key] = formula(config, key)
        out = Output()
        instance.process([part], out)
        made.extend(out.items())
    for instance in instances.values():
        out = Output()
        instance.flush(out)
        made.extend(out.items())
    return [item for item in made if isinstance(item, PowerFrame)]


def encode_all(frames: list[PowerFrame]) -> int:
    """The JSON Lines output's bytes for every frame; their length."""
    return sum(len(encode_json_lines([frame])) for frame in frames)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sensors", type=int, default=10)
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument(
        "--batch",
        type=int,
        default=SocketPullerConfig.model_fields["max_batch"].default,
        help="lines per batch of one sensor (default: the socket input's --max-batch)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is printed")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    streams = sensor_streams(args.sensors, args.containers, args.ticks, args.seed)
    lines = [line for stream in streams for line in stream]
    batches = batches_of(streams, args.batch)
    smartwatts = SmartWattsConfig(
        sensor_reports_frequency=1000,
        learn_min_samples_required=10,
        cpu_base_freq=2100,
        cpu_tdp=400,
    )
    SmartWattsFormula.prepare(smartwatts)
    rapl = RaplConfig(sensor_reports_frequency=1000)
    decoding = f"decode ({'C parser' if c_parser_built() else 'Python way'})"
    rounds: dict[str, list[float]] = {}
    power_rows = 0
    gc.disable()
    try:
        for _ in range(args.repeat):
            best_cpu_s(rounds, "orjson.loads (the limit)", orjson_way, batches)
            best_cpu_s(rounds, "msgspec parse", msgspec_way, batches)
            decoded = best_cpu_s(rounds, decoding, decode_all, batches)
            frames = [frame for found in decoded for frame in found]
            parts = best_cpu_s(rounds, "route", route, frames)
            made = best_cpu_s(rounds, "SmartWatts", estimate, parts, SmartWattsFormula, smartwatts)
            made += best_cpu_s(rounds, "RAPL", estimate, parts, RaplFormula, rapl)
            best_cpu_s(rounds, "encode (JSON Lines)", encode_all, made)
            power_rows = sum(len(frame) for frame in made)
            gc.collect()
    finally:
        gc.enable()

    count = len(lines)
    best = {name: min(times) / count * 1e6 for name, times in rounds.items()}
    limit = best["orjson.loads (the limit)"]
    print(
        f"{args.sensors} sensors × {args.containers} containers × {args.ticks} ticks: "
        f"{count:,} reports ({sum(map(len, lines)) / count:,.0f} bytes a line), "
        f"{power_rows:,} PowerReports; CPU per input report, best of {args.repeat}, GC off"
    )
    for name, micros in best.items():
        print(f"  {name:<26} {micros:7.2f} µs  {micros / limit:5.2f}× orjson")
    path = [n for n in best if n not in ("orjson.loads (the limit)", "msgspec parse")]
    total = sum(best[name] for name in path)
    print(
        f"  {'decode + route + formulas + encode':<26} {total:7.2f} µs  {total / limit:5.2f}× "
        f"orjson = {limit / total:.1%} of the decode rate before sockets and the event loop; "
        f"{TARGET_SHARE:.0%} allows {1 / TARGET_SHARE:.2f}×"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
