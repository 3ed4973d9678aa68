"""``wattflow demo``: the embedded default, a bundled recording replayed through the formulas.

It needs no server and no configuration: the recording ships inside the package, the output goes
to a live table and to PowerAPI-layout CSV files in a directory it names.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console

from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import FormulaConfig
from wattflow.actors.formulas.smartwatts import SmartWattsConfig
from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.jsonl import JsonlPuller, JsonlPullerConfig
from wattflow.actors.pushers.base import Pusher
from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.actors.pushers.table import TablePusher, TablePusherConfig
from wattflow.service.pipeline import serve

RECORDING = "demo-hwpc.jsonl"

DEMO_SETTINGS: dict[str, FormulaConfig] = {
    # 30 ticks is short: let each frequency layer learn from 5 samples instead of 10.
    "smartwatts": SmartWattsConfig(learn_min_samples_required=5),
}


def demo_command(argv: Sequence[str]) -> int:
    """Replay the bundled recording; exit 0 when every report was accounted for."""
    parser = argparse.ArgumentParser(
        prog="wattflow demo",
        description="Replay a bundled hwpc-sensor recording through the formulas: a live table, "
        "and PowerAPI-layout CSV files in a directory it names. Needs no server.",
    )
    parser.add_argument(
        "--directory",
        type=Path,
        default=None,
        help="Where to write the CSV output (default: a new temporary directory).",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=10.0,
        help="Replay speed as a multiple of real time (default: 10).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    directory = args.directory or Path(tempfile.mkdtemp(prefix="wattflow-demo-"))
    console = Console()
    with resources.as_file(resources.files("wattflow.service") / "data" / RECORDING) as recording:
        puller = JsonlPuller(
            JsonlPullerConfig(
                type="jsonl",
                name="recording",
                files=[recording],
                replay_speed=args.speed,
                max_batch=100,
            )
        )
        pushers: list[Pusher[Any]] = [
            TablePusher(TablePusherConfig(type="table", name="table"), console=console),
            CsvPusher(CsvPusherConfig(type="csv", name="csv", directory=directory)),
        ]
        enabled = [
            (cls, DEMO_SETTINGS.get(name, cls.config_model())) for name, cls in formulas.items()
        ]
        result = asyncio.run(serve(Pipeline([puller], enabled, list(pushers))))
    ledger = result.ledger
    console.print(
        f"Replayed {ledger.entered} reports from the bundled recording: "
        f"{ledger.delivered_by_pusher['csv']} power reports written as CSV under {directory}"
    )
    if ledger.unused:
        console.print(
            "Not used by any formula: "
            + "; ".join(f"{count} × {reason}" for reason, count in ledger.unused.items())
        )
    return 0 if result.ok and ledger.balanced() else 1
