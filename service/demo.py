"""``wattflow demo``: the whole product on bundled recordings, in a few seconds, with no server.

One node (``demo-node``: 2 sockets, 4 containers, 2 GPUs, a metered power supply) replayed
through the formulas:

- hwpc-sensor's reports (``data/demo-hwpc.jsonl``) → SmartWatts: cpu and dram power per
  container (and RAPL per socket);
- the NVML sampler's GPUReports (``data/demo-gpu.jsonl``) → the GPU formula: power per process
  on each GPU, the idle power staying with the GPU;
- a PDU logger's readings (``data/demo-meter.csv``, the ``meter`` input's CSV) → the node
  formula: the node's wall power against cpu + dram + gpu, and the rest of the system;
- the training job's events (``data/demo-events.jsonl``) mark its phases.

Its output is a live table, PowerAPI-layout CSV files, and a run in a run store (as ``wattflow
run --run E/B/S/N`` records one), which it then exports to a GPU measurement directory and to
Extra-P's text format. Everything goes to one directory, a new temporary one unless named.
``scripts/make_demo_recordings.py`` makes the GPU, meter and event recordings and documents
their physics.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from wattflow.actors.exporters import exporters
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import FormulaConfig
from wattflow.actors.formulas.gpu import GpuConfig
from wattflow.actors.formulas.node import NodeConfig
from wattflow.actors.formulas.smartwatts import SmartWattsConfig
from wattflow.actors.pipeline import Pipeline, PipelineResult
from wattflow.actors.pullers.base import Puller
from wattflow.actors.pullers.jsonl import JsonlPuller, JsonlPullerConfig
from wattflow.actors.pullers.meter import MeterPuller, MeterPullerConfig
from wattflow.actors.pushers.base import Pusher
from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.actors.pushers.runs import RunRecorder, RunRecorderConfig
from wattflow.actors.pushers.table import TablePusher, TablePusherConfig
from wattflow.actors.run_store import RunStore, StoreError, open_store, run_id
from wattflow.formats.errors import WattflowError
from wattflow.formats.reports import GPUReport, PowerReport
from wattflow.formats.runs import Run
from wattflow.service.pipeline import serve

RECORDING = "demo-hwpc.jsonl"
GPU_RECORDING = "demo-gpu.jsonl"
METER_RECORDING = "demo-meter.csv"
EVENTS_RECORDING = "demo-events.jsonl"
SENSOR = "demo-node"
"""The node's name in every recording: how the node formula matches meter, RAPL and GPUs."""

EXPERIMENT, BENCHMARK, SETTINGS = "wattflow-demo", "ml-training", "400W"
PARAMETERS = {"gpus": 2.0}
"""The run's free parameter, for Extra-P (one run is one point: Extra-P models a constant)."""

DEFAULT_SPEED = 10.0
GPU_LEAD_S = 3.0
"""The GPU sampler, the meter and the events start this long (recorded time) before
hwpc-sensor's first report, so that the GPU formula sees the GPUs rest and learns their idle
power. Each input paces its own replay, so an interval's GPU readings reach the node formula
``GPU_LEAD_S / speed`` seconds after hwpc-sensor's: the node formula waits that much longer."""

DEMO_SETTINGS: dict[str, FormulaConfig] = {
    # 30 ticks is short: let each frequency layer learn from 5 samples instead of 10.
    "smartwatts": SmartWattsConfig(learn_min_samples_required=5),
    # Three processes in two containers: show each process, not each container.
    "gpu": GpuConfig(gpu_targets="process"),
}


def demo_command(argv: Sequence[str]) -> int:
    """Replay the bundled recordings; exit 0 when every report was accounted for, none was
    dead-lettered and every export was written."""
    parser = _demo_parser()
    args = parser.parse_args(argv)
    if not (args.speed > 0 and math.isfinite(args.speed)):
        parser.error(f"--speed {args.speed}: give a positive number")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    directory: Path = args.directory or Path(tempfile.mkdtemp(prefix="wattflow-demo-"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--directory {directory}: {error.strerror or error}")
    console = Console()
    store_uri = f"sqlite:///{directory / 'runs.db'}"
    with open_store(store_uri) as store:
        repetition = next_repetition(store)
    identifier = run_id(EXPERIMENT, BENCHMARK, SETTINGS, repetition)
    result, pipeline = _replay_recordings(console, directory, store_uri, identifier, args.speed)
    accounted = _print_accounting(console, result, pipeline)
    with open_store(store_uri) as store:
        try:
            run = store.get(identifier)
        except StoreError as error:  # the recorder failed: said above
            print_line(console, f"no run recorded: {error}")
            return 1
        run = run.model_copy(update={"parameters": PARAMETERS})
        store.save_run(run)
        show_summary(console, store, run)
        written = [
            ("CSV, PowerAPI's layout", f"{directory}/<sensor>-<target>/PowerReport.csv "
             f"(GPU and node power: PowerReport-gpu.csv, PowerReport-node.csv): "
             f"{result.ledger.delivered_by_pusher['csv']} power reports"),
            ("run store", f"{store_uri}: run {identifier}, {store.count(run)} reports"),
        ]  # fmt: skip
        exported = _export_runs(store, directory, repetition, written)
    console.print()
    print_line(console, "Written:")
    for what, where in written:
        print_line(console, f"  {what + ':':28} {where}")
    print_line(
        console,
        f"Other formats: wattflow export FORMAT --store {store_uri} --experiment {EXPERIMENT} "
        f"--out PATH (FORMAT: {', '.join(exporters.names())})",
    )
    return 0 if accounted and exported else 1


def _demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wattflow demo",
        description="Replay bundled recordings of one node (hwpc-sensor, 2 GPUs through the "
        "NVML sampler, a power meter, a training job's events) through the formulas: a live "
        "table, PowerAPI-layout CSV files, a run in a run store (runs.db) and its exports to a "
        "GPU measurement directory (gpu-dir/) and to Extra-P (extrap/), all in one directory. "
        "Needs no server; takes a few seconds.",
    )
    parser.add_argument(
        "--directory",
        type=Path,
        default=None,
        help="Where to write everything (default: a new temporary directory). Run again into "
        "the same directory, the demo records the next repetition and exports them all.",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=DEFAULT_SPEED,
        help=f"Replay speed as a multiple of real time (default: {DEFAULT_SPEED:g}: the 33 s "
        "recording replays in about 3 s; 1 replays it in real time).",
    )
    return parser


def _replay_recordings(
    console: Console, directory: Path, store_uri: str, identifier: str, speed: float
) -> tuple[PipelineResult, Pipeline]:
    """Run the pipeline on the bundled recordings, to the live table, the CSV files in
    ``directory`` and the run ``identifier`` in the store, until the recordings end."""
    with ExitStack() as files:
        data = resources.files("wattflow.service") / "data"
        paths = {
            name: files.enter_context(resources.as_file(data / name))
            for name in (RECORDING, GPU_RECORDING, METER_RECORDING, EVENTS_RECORDING)
        }
        pullers: list[Puller[Any]] = [
            replay("recording", paths[RECORDING], "HWPCReport", speed),
            replay("gpus", paths[GPU_RECORDING], "GPUReport", speed),
            replay("events", paths[EVENTS_RECORDING], "EventReport", speed),
            MeterPuller(
                MeterPullerConfig(
                    type="meter", name="meter", files=[paths[METER_RECORDING]], sensor=SENSOR
                )
            ),
        ]
        pushers: list[Pusher[Any]] = [
            TablePusher(TablePusherConfig(type="table", name="table"), console=console),
            CsvPusher(CsvPusherConfig(type="csv", name="csv", directory=directory)),
            RunRecorder(RunRecorderConfig(name="run_store", run=identifier, store=store_uri)),
        ]
        settings = {
            **DEMO_SETTINGS,
            "node": NodeConfig(node_lateness_ms=2000 + math.ceil(GPU_LEAD_S * 1000 / speed)),
        }
        enabled = [(cls, settings.get(name, cls.config_model())) for name, cls in formulas.items()]
        pipeline = Pipeline(pullers, enabled, pushers)
        return asyncio.run(serve(pipeline)), pipeline


def _print_accounting(console: Console, result: PipelineResult, pipeline: Pipeline) -> bool:
    """Print what the replay read and made, and what went wrong; whether every report was
    accounted for, with no actor failed and no dead letter."""
    ledger = result.ledger
    dead = ledger.rejected_input + ledger.dead_in + ledger.dead_out
    # The CSV output writes the PowerReports; the rest are SmartWatts' FormulaReports, which
    # only the run store keeps: said, so that the counts above and below add up.
    power = ledger.delivered_by_pusher["csv"]
    print_line(
        console,
        f"Replayed {ledger.entered} reports from the bundled recordings of {SENSOR} "
        f"(hwpc-sensor, 2 GPUs, a power meter, a training job's events): the formulas made "
        f"{ledger.produced} reports: {power} PowerReports and {ledger.produced - power} "
        "FormulaReports; every report accounted for: "
        f"{'yes' if result.ok and ledger.balanced() else 'NO'}; dead letters: {dead}.",
    )
    for actor, reason in result.failures.items():
        print_line(console, f"failed: {actor}: {reason}")
    for reason, count in pipeline.dead_letters.by_reason.items():
        print_line(console, f"dead letter: {count} × {reason}")
    if ledger.unused:
        print_line(
            console,
            "Recorded in the run, used by no formula: "
            + "; ".join(f"{count} × {reason}" for reason, count in ledger.unused.items()),
        )
    return result.ok and ledger.balanced() and dead == 0


def _export_runs(
    store: RunStore, directory: Path, repetition: int, written: list[tuple[str, str]]
) -> bool:
    """Export every demo run in the store to a GPU measurement directory and to Extra-P,
    adding where each went (or why it failed) to ``written``; whether both were written.

    Each run notes how its export in each format went, as ``wattflow export`` and the
    service's ``--export`` note it, so ``wattflow runs list`` shows the demo's exports too."""
    runs = store.runs(EXPERIMENT)
    counted = f"{len(runs)} run{'s' * (len(runs) > 1)}"
    exported = True
    for name, out, shown in (
        ("gpu-dir", directory / "gpu-dir", "GPU measurement directory"),
        ("extrap-text", directory / "extrap" / f"{EXPERIMENT}.txt", "Extra-P text input"),
    ):
        try:
            export(store, runs, name, out)
        except (WattflowError, ValueError, OSError) as error:
            exported = False
            written.append((shown, f"FAILED: {error}"))
            note_exports(store, runs, name, f"failed: {error}")
            continue
        note_exports(store, runs, name, "written")
        if name == "gpu-dir":
            where = f"{out / EXPERIMENT / BENCHMARK / SETTINGS / str(repetition)}/ ({counted})"
        else:
            where = (
                f"{out} ({counted}); open it with `extrap --text {out}` "
                "(pip install 'wattflow[extrap]')"
            )
        written.append((shown, where))
    return exported


def note_exports(store: RunStore, runs: list[Run], name: str, outcome: str) -> None:
    """Note in each run how its export in ``name`` went (:attr:`Run.exports`)."""
    for run in runs:
        store.note_export(run.id, name, outcome)


def replay(name: str, path: Path, model: str, speed: float) -> JsonlPuller:
    """A JSON Lines input that replays a recording at ``speed`` times real time."""
    return JsonlPuller(
        JsonlPullerConfig(
            type="jsonl", name=name, model=model, files=[path], replay_speed=speed, max_batch=100
        )
    )


def next_repetition(store: RunStore) -> int:
    """One more than the demo runs already in the store; 0 in a new one."""
    done = [run.repetition for run in store.runs(EXPERIMENT, BENCHMARK) if run.settings == SETTINGS]
    return max(done, default=-1) + 1


def export(store: RunStore, runs: list[Run], name: str, out: Path) -> None:
    """``wattflow export NAME --experiment wattflow-demo --out OUT``, without its progress."""
    exporter = exporters.get(name)()
    if not exporter.writes_directory:
        out.parent.mkdir(parents=True, exist_ok=True)
    exporter.export(runs, store, out, lambda _: None)


def print_line(console: Console, text: str) -> None:
    """Plain text, not wrapped (paths stay whole) and not read as rich markup."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def show_summary(console: Console, store: RunStore, run: Run) -> None:
    """Mean power per container, per GPU process and for the node, from the recorded run."""
    power = RecordedPower.of(store, run)
    for table in (
        containers_table(power.series),
        gpus_table(power.series, power.cgroups),
        meter_table(power.node),
    ):
        console.print(table)


SeriesKey = tuple[str, str, str]
"""(scope, target, device): one of the summary's power series."""


@dataclass
class RecordedPower:
    """A recorded run's power, as the summary's tables read it."""

    series: defaultdict[SeriesKey, dict[Any, float]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    """(scope, target, device) → timestamp → watts, summed over sockets."""
    node: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """The node formula's powers by target (``node``: the meter's, ``rest``: what the meter
    has beyond cpu, dram and gpu), and those three parts of the meter's, by name."""
    cgroups: dict[str, str] = field(default_factory=dict)
    """Each GPU process (``pid:N``) and its cgroup, to name the GPU table's targets."""

    @classmethod
    def of(cls, store: RunStore, run: Run) -> RecordedPower:
        """Read the run's PowerReports, and its GPUReports for the processes' cgroups."""
        recorded = cls()
        for report in store.reports(run, ["PowerReport", "GPUReport"]):
            if isinstance(report, GPUReport):
                recorded.add_processes(report)
            elif isinstance(report, PowerReport):
                recorded.add_power(report)
        return recorded

    def add_processes(self, report: GPUReport) -> None:
        """The cgroup of each process on the GPUs: the GPU formula's targets are ``pid:N``,
        which say nothing of the container they ran in."""
        for readings in report.devices.values():
            for process in readings.processes or ():
                self.cgroups[f"pid:{process.pid}"] = process.cgroup or "-"

    def add_power(self, report: PowerReport) -> None:
        """A PowerReport into its series, or the node's; RAPL's whole-socket figures are not
        a container's and are left out."""
        meta = report.metadata
        scope = str(meta.get("scope", ""))
        if scope == "node":
            self._add_node(report)
            return
        if meta.get("formula") == "rapl" or report.target in ("rapl", "global"):
            return
        ticks = self.series[(scope, report.target, str(meta.get("device", "")))]
        ticks[report.timestamp] = ticks.get(report.timestamp, 0.0) + report.power

    def _add_node(self, report: PowerReport) -> None:
        """The node formula's figure; the meter's (target ``node``) carries the cpu, dram and
        gpu parts it was set against, read from its metadata."""
        self.node[report.target].append(report.power)
        if report.target == "node":
            for part in ("cpu", "dram", "gpu"):
                self.node[part].append(float(report.metadata.get(part, math.nan)))


def _mean(values: Iterable[float]) -> float:
    found = list(values)
    return sum(found) / len(found) if found else math.nan


def containers_table(series: Mapping[SeriesKey, dict[Any, float]]) -> Table:
    """SmartWatts' cpu and dram power of each container, mean over the ticks it reported."""
    containers = Table(title="Containers, SmartWatts (mean W over the ticks it reported)")
    for column in ("container", "cpu W", "dram W"):
        containers.add_column(column, justify="left" if column == "container" else "right")
    for target in sorted({t for scope, t, _ in series if scope in ("cpu", "dram")}):
        cpu = _mean(series.get(("cpu", target, ""), {}).values())
        dram = _mean(series.get(("dram", target, ""), {}).values())
        containers.add_row(target, f"{cpu:.1f}", f"{dram:.1f}")
    return containers


def gpus_table(series: Mapping[SeriesKey, dict[Any, float]], cgroups: Mapping[str, str]) -> Table:
    """The GPU formula's power of each process on each GPU (and the idle power, which stays
    with the GPU), mean and largest while present."""
    gpus = Table(title="GPUs, per process (mean W while present)")
    for column in ("gpu", "target", "cgroup", "ticks", "mean W", "max W"):
        gpus.add_column(column, justify="right" if column.endswith(("W", "ticks")) else "left")
    for (scope, target, device), ticks in sorted(series.items()):
        if scope != "gpu":
            continue
        label = cgroups.get(target, "(idle, unattributed)" if target.startswith("gpu") else "-")
        gpus.add_row(
            device,
            target,
            label,
            str(len(ticks)),
            f"{_mean(ticks.values()):.1f}",
            f"{max(ticks.values()):.1f}",
        )
    return gpus


def meter_table(node: Mapping[str, list[float]]) -> Table:
    """The node formula's account of the meter: cpu, dram, gpu and the rest of the system."""
    meter = Table(title="Node against the power meter (mean W over hwpc-sensor's intervals)")
    for column in ("meter", "cpu", "dram", "gpu", "rest", "rest min–max"):
        meter.add_column(column, justify="right")
    rest = node.get("rest", [])
    meter.add_row(
        f"{_mean(node.get('node', [])):.1f}",
        f"{_mean(node.get('cpu', [])):.1f}",
        f"{_mean(node.get('dram', [])):.1f}",
        f"{_mean(node.get('gpu', [])):.1f}",
        f"{_mean(rest):.1f}",
        f"{min(rest):.1f}–{max(rest):.1f}" if rest else "-",
    )
    return meter
