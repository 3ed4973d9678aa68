"""Checkpoints written by the release before formula states were typed and versioned, one per
formula, and the streams they were taken from.

A user upgrading keeps the state file (or the MongoDB checkpoint document) the previous release
saved; the new release must read it, or refuse it whole with a clear message, never half-read
it. So the files in ``tests/data/checkpoints/`` hold what that release's ``Formula.state()``
gave for each formula after the first part of a short deterministic stream (and one whole
checkpoint as ``--state-file`` saves it), and ``tests/test_formula_state.py`` restores each into
a fresh instance and checks that it goes on with the rest of the stream exactly as an instance
that was never stopped.

``python -m tests.checkpoint_fixtures`` wrote them, with that release's code. It is not to be
run again for those files: run now, it writes the current layout, which is what the files must
not be. (``--out DIR`` writes the current layout elsewhere, to compare.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from wattflow.actors.checkpoints import STATE_VERSION, encode_checkpoint
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.energy import EnergyConfig, EnergyFormula
from wattflow.actors.formulas.gpu import GpuConfig, GpuFormula
from wattflow.actors.formulas.node import NodeConfig, NodeFormula
from wattflow.actors.formulas.rapl import RaplConfig, RaplFormula
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.formats.batch import expand
from wattflow.formats.reports import HWPCReport, Report

from .nvml_fake import simulate_sampler
from .test_gpu_formula import busy_stream
from .test_gpu_sharing import IDLE_W, START_MS, h200_pair
from .test_node import node_stream
from .test_target_energy import _named, _power

DIRECTORY = Path(__file__).parent / "data" / "checkpoints"
CHECKPOINT_FILE = "checkpoint.state"
"""The whole checkpoint, as ``--state-file`` saves it, holding every formula's state below."""

START = datetime(2026, 4, 1, 8, 0, tzinfo=UTC)
UNIT = 2.0**32
"""RAPL's unit in hwpc-sensor's reports: 2⁻³² J."""
BASE_MHZ = 2100
SOCKETS = {"0": ("0", "1"), "1": ("2", "3")}
"""Two sockets of two cpus each, as SmartWatts sees a two-socket server."""
TARGETS = ("web", "db", "batch")

Batches = list[list[Report]]


@dataclass(frozen=True)
class Case:
    """One formula's instance, the stream before its checkpoint and the stream after it."""

    name: str
    formula: type[Formula[Any]]
    config: FormulaConfig
    key: str
    before: Batches
    after: Batches
    in_checkpoint: bool = True
    """Whether the whole checkpoint holds this state too (one setting per formula there, as
    in a run)."""
    reported_before: int | None = None
    """How many reports the previous release had made of :attr:`before` when it saved the
    state, where this release makes another number of them (``None``: the same): the node
    formula held every interval then (its lateness was real time), and reports as its
    sources come now. What it held is reported after the restart instead."""

    @property
    def path(self) -> Path:
        return DIRECTORY / f"{self.name}.json"

    def fresh(self) -> Formula[Any]:
        return self.formula(self.config, self.key)

    def saved(self) -> Any:
        """The state the previous release saved after :attr:`before`."""
        return orjson.loads(self.path.read_bytes())


def run(formula: Formula[Any], batches: Batches, *, flush: bool = False) -> list[Report]:
    """Every report the formula makes of the batches (then of its flush), in order."""
    produced: list[Report] = []
    for batch in batches:
        out = Output()
        formula.process(batch, out)
        produced.extend(expand(out.items()))
    if flush:
        out = Output()
        formula.flush(out)
        produced.extend(expand(out.items()))
    return produced


def _by_tick(reports: list[Report]) -> Batches:
    """Reports in batches of one timestamp, in order: a live sensor's ticks."""
    batches: dict[datetime, list[Report]] = {}
    for report in reports:
        batches.setdefault(report.timestamp, []).append(report)
    return list(batches.values())


def _cut(batches: Batches, at: int) -> tuple[Batches, Batches]:
    return batches[:at], batches[at:]


def two_sockets(ticks: int, *, seed: int = 11) -> list[HWPCReport]:
    """hwpc-sensor's reports of a two-socket server: per tick a global report (package and
    DRAM energy, APERF/MPERF at one of three frequencies) and one report per target (its
    instructions and LLC misses on every cpu), the power following the counters."""
    rng = np.random.default_rng(seed)
    reports: list[HWPCReport] = []
    for tick in range(ticks):
        when = START + timedelta(seconds=tick)
        mhz = (2800, 3000, 2200)[tick // 7 % 3]
        load = {name: rng.uniform(0.2e9, 3e9, size=4) for name in TARGETS}
        rapl: dict[str, dict[str, dict[str, int]]] = {}
        msr: dict[str, dict[str, dict[str, int]]] = {}
        for socket, cpus in SOCKETS.items():
            rows = [sum(load[name][int(cpu)] for name in TARGETS) for cpu in cpus]
            package_w = 12.0 + 2.5 * sum(rows) / 1e9 * (mhz / BASE_MHZ) ** 2
            dram_w = 3.0 + 0.8 * sum(rows) / 1e9
            rapl[socket] = {
                cpus[0]: {
                    "RAPL_ENERGY_PKG": int(package_w * UNIT),
                    "RAPL_ENERGY_DRAM": int(dram_w * UNIT),
                }
            }
            mperf = 2_100_000
            msr[socket] = {
                cpu: {"APERF": int(mperf * mhz / BASE_MHZ), "MPERF": mperf} for cpu in cpus
            }
        groups: dict[str, Any] = {"rapl": rapl, "msr": msr}
        reports.append(HWPCReport(timestamp=when, sensor="node", target="all", groups=groups))
        for name in TARGETS:
            core = {
                socket: {
                    cpu: {
                        "INSTRUCTIONS_RETIRED": int(load[name][int(cpu)]),
                        "LLC_MISSES": int(load[name][int(cpu)] / 400),
                    }
                    for cpu in cpus
                }
                for socket, cpus in SOCKETS.items()
            }
            reports.append(
                HWPCReport(timestamp=when, sensor="node", target=name, groups={"core": core})
            )
    return reports


def smartwatts_config(**settings: Any) -> SmartWattsConfig:
    """Small windows, so that a short stream fills and rolls them."""
    return SmartWattsConfig(
        learn_min_samples_required=5,
        learn_history_window_size=12,
        learn_error_window_size=8,
        **settings,
    )


def cases() -> list[Case]:
    """Every formula, each in the setting whose state holds the most."""
    hwpc = _by_tick(list[Report](two_sockets(30)))
    before_hwpc, after_hwpc = _cut(hwpc, 20)
    gpu_before, gpu_after = _cut([[report] for report in busy_stream()], 34)
    sharing = simulate_sampler(h200_pair(4), START_MS, 40)
    sharing_before = [list[Report](sharing[: len(sharing) // 2])]
    sharing_after = [list[Report](sharing[len(sharing) // 2 :])]
    stream = node_stream(4)
    energy = [
        _named(*(_power(second, target, scope, watts) for target, scope, watts in workloads))
        for second, workloads in enumerate(_energy_workloads(12))
    ]
    node_before, node_after = [stream[: len(stream) // 2]], [stream[len(stream) // 2 :]]
    return [
        Case("smartwatts", SmartWattsFormula, smartwatts_config(), "node", before_hwpc, after_hwpc),
        Case(
            "smartwatts-compat",
            SmartWattsFormula,
            smartwatts_config(compat="smartwatts-2.4"),
            "node",
            before_hwpc,
            after_hwpc,
            in_checkpoint=False,
        ),
        Case("rapl", RaplFormula, RaplConfig(), "node", before_hwpc, after_hwpc),
        Case("gpu", GpuFormula, GpuConfig(gpu_hold_ms=250), "node-1", gpu_before, gpu_after),
        Case(
            "gpu-sharing",
            GpuFormula,
            GpuConfig(gpu_targets="process", gpu_idle_power_w=IDLE_W),
            "node-1",
            sharing_before,
            sharing_after,
            in_checkpoint=False,
        ),
        Case(
            "node",
            NodeFormula,
            NodeConfig(node_lateness_ms=600_000, node_shares=True),
            "node-1",
            node_before,
            node_after,
            reported_before=0,
        ),
        Case(
            "energy",
            EnergyFormula,
            EnergyConfig(target_energy=True, target_end_silence_s=3),
            "node-1",
            energy[:6],
            energy[6:],
        ),
    ]


def _energy_workloads(seconds: int) -> list[list[tuple[str, str, float]]]:
    """Per second, the (target, scope, W) of three workloads: a Slurm job's two tasks on cpu
    and gpu, a container that stops after 4 s (silence then ends it), a service on cpu and dram
    all along (every scope goes on, so none holds the stream's time back)."""
    job = "/system.slice/slurmstepd.scope/job_101/step_0/user/task_"
    container = "/system.slice/docker-" + "cd" * 32 + ".scope"
    found = []
    for second in range(seconds):
        ticks = [
            (job + "0", "cpu", 4.0 + second % 3),
            (job + "1", "gpu", 50.0 + second),
            ("/system.slice/sshd.service", "cpu", 0.5),
            ("/system.slice/sshd.service", "dram", 0.25),
        ]
        if second < 4:
            ticks.append((container, "dram", 1.5))
        found.append(ticks)
    return found


def write(directory: Path) -> None:
    """Each case's state after its first part, as JSON, and the whole checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    formulas: dict[str, dict[str, Any]] = {}
    for case in cases():
        formula = case.fresh()
        run(formula, case.before)
        state = formula.state()
        (directory / f"{case.name}.json").write_bytes(
            orjson.dumps(state, option=orjson.OPT_INDENT_2) + b"\n"
        )
        if case.in_checkpoint:
            formulas[case.formula.name] = {case.key: state}
    checkpoint = {"version": STATE_VERSION, "positions": {}, "formulas": formulas}
    (directory / CHECKPOINT_FILE).write_bytes(encode_checkpoint(checkpoint))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DIRECTORY)
    write(parser.parse_args().out)


if __name__ == "__main__":
    main()
