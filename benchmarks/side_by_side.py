"""wattflow beside PowerAPI SmartWatts 2.4.1, on the same input and with the same settings.

Creates (once) a Python 3.12 virtual environment with SmartWatts 2.4.1 from PyPI, generates a
realistic hwpc-sensor recording with known per-target power (PowerAPI's CSV layout, plus the same
recording as JSON Lines), runs both formulas on the CSV files with the same flags, each writing
PowerAPI's CSV output, and prints for each: input reports, wall time, start-up time (the same
command on a one-tick input), throughput in input reports per second net of start-up, memory,
and the error of the per-target power against the ground truth on the ticks both estimated.
With ``--repeat N`` each formula runs N times, taking turns, and the median wall time counts.

wattflow runs pinned to one core (``taskset -c 0``); SmartWatts, whose actors are processes,
gets every core of the machine; this script keeps off core 0 while it measures. wattflow runs
from a virtual environment of its own, as a user's ``pip install`` makes it (reinstalled from
this checkout each time, so it measures the code at hand); ``--wattflow-python`` runs it with
another interpreter instead. Run it from the repository root:

    python benchmarks/side_by_side.py --ticks 10000 --containers 10 --repeat 3
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_hwpc import GROUP_FILES, PHENOMENA, Phenomena, record

ROOT = Path(__file__).resolve().parent.parent
SMARTWATTS_VENV = ROOT / "benchmarks" / ".smartwatts-venv"
WATTFLOW_VENV = ROOT / "benchmarks" / ".wattflow-venv"
PYTHON_312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"
SMARTWATTS = "smartwatts==2.4.1"

Key = tuple[int, str, str]
"""(timestamp in ms, sensor, target)"""


@dataclass
class Outcome:
    """What one formula did with the input."""

    name: str
    reports: int
    wall_s: float
    startup_s: float
    largest_rss_mb: float
    tree_peak_mb: float
    output: Path
    output_files: list[str] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)
    written: int = 0
    walls: list[float] = field(default_factory=list)
    cpu_s: float = math.nan
    startup_cpu_s: float = math.nan

    @property
    def throughput(self) -> float:
        """Input reports per second, start-up left out (NaN when the input was too small)."""
        working = self.wall_s - self.startup_s
        return self.reports / working if working > 0 else math.nan

    @property
    def cpu_throughput(self) -> float:
        """Input reports per second of CPU time, the start-up's CPU time left out.

        Other work on the machine stretches wall times but hardly CPU times, so on a shared
        machine this rate moves less; SmartWatts' actors poll while they wait, which counts.
        """
        working = self.cpu_s - self.startup_cpu_s
        return self.reports / working if working > 0 else math.nan


ENV = {**os.environ, "TZ": "UTC"}
"""PowerAPI turns CSV timestamps into local time and back; UTC rules out a DST hour."""


def smartwatts_python(venv: Path) -> Path:
    """The venv's interpreter, creating the venv with SmartWatts 2.4.1 on first use.

    SmartWatts 2.4.1 needs Python 3.12, while wattflow runs on 3.11 too, so it gets its own
    environment, kept between runs because installing scikit-learn takes a while.
    """
    python = venv / "bin" / "python"
    installed = venv / ".installed"  # written last: an install cut short is done again
    if not installed.exists():
        if not python.exists():
            subprocess.run([python_312(), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", SMARTWATTS], check=True)
        installed.write_text(SMARTWATTS + "\n")
    return python


def python_312() -> str:
    """``python3.12`` on the PATH if it runs (a pyenv shim with no 3.12 selected does not),
    else pyenv's 3.12.1."""
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    return PYTHON_312


def wattflow_python(venv: Path) -> Path:
    """The interpreter of wattflow's own venv, with this checkout installed as a user would.

    The venv is kept between runs (its dependencies take a while to install), and wattflow
    itself is reinstalled every time, without its test extras: a development environment may
    hold older libraries that a test dependency pins.
    """
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # with the compat extra: --wattflow-args '--compat smartwatts-2.4' needs scikit-learn
        install = [str(python), "-m", "pip", "install", "--quiet", f"{ROOT}[compat]"]
        subprocess.run(install, check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            str(ROOT),
        ],
        check=True,
    )
    return python


def keep_off_the_measured_core() -> None:
    """Run this script (and its memory sampler, which reads /proc five times a second) on the
    cores wattflow is not pinned to, so that it takes no time from the run it measures.

    The formulas' commands set their own cores: wattflow core 0, SmartWatts all of them.
    """
    cores = os.cpu_count() or 1
    if cores > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(1, cores)))


def versions(python: Path) -> str:
    """The Python and numpy versions wattflow runs with: numpy parses the CSV input."""
    probe = "import platform, numpy; print(platform.python_version(), numpy.__version__)"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    python_version, numpy_version = found.stdout.split()
    return f"Python {python_version}, numpy {numpy_version}"


@dataclass(frozen=True)
class Shape:
    """The simulated machine and its load: sockets, cpus per socket, containers per sensor."""

    sockets: int
    cpus_per_socket: int
    containers: int

    def __str__(self) -> str:
        return f"{self.sockets}×{self.cpus_per_socket} cpus, {self.containers} containers"

    @property
    def slug(self) -> str:
        """A directory name."""
        return f"s{self.sockets}-c{self.cpus_per_socket}-k{self.containers}"


def shapes_to_run(
    base: Shape,
    sockets: list[int],
    cpus: list[int],
    containers: list[int],
    *,
    grid: bool,
    small_nodes: bool = True,
) -> list[Shape]:
    """Every combination of the values (``grid``), or the base shape and then one dimension
    varied at a time, the others at the base's values; then, with ``small_nodes``,
    :data:`SMALL_NODES`."""
    if grid:
        found = [Shape(*values) for values in itertools.product(sockets, cpus, containers)]
    else:
        found = [base]
        found += [replace(base, sockets=n) for n in sockets]
        found += [replace(base, cpus_per_socket=n) for n in cpus]
        found += [replace(base, containers=n) for n in containers]
    if small_nodes:
        found += SMALL_NODES
    return list(dict.fromkeys(found))


SMALL_NODES = [
    Shape(1, cpus, containers) for cpus, containers in itertools.product((4, 8), (2, 5, 10))
]
"""Most HPC and edge nodes: one socket of 4 or 8 cpus with a few containers, where a tick has
few reports and what each tick costs whatever its size weighs most."""


def shape_ticks(shape: Shape, args: argparse.Namespace) -> int:
    """Ticks for about ``--shape-reports`` input reports, and at least ``--shape-min-ticks``.

    A budget in reports bounds SmartWatts' time, which goes with the reports it handles;
    the floor keeps every shape estimating for most of its ticks rather than learning.
    """
    per_tick: int = args.sensors * (shape.containers + 1)
    budget: int = args.shape_reports
    floor: int = args.shape_min_ticks
    return max(floor, round(budget / per_tick))


def write_input(
    directory: Path, args: argparse.Namespace, ticks: int, shape: Shape, *, everything: bool = True
) -> int:
    """Generate the recording (CSV per group, and with ``everything`` JSON Lines and the
    truth); return its report count."""
    return record(
        ticks=ticks,
        containers=shape.containers,
        sockets=shape.sockets,
        cpus_per_socket=shape.cpus_per_socket,
        sensors=[f"node-{n + 1}" for n in range(args.sensors)],
        multiplex=args.multiplex,
        seed=args.seed,
        jsonl=directory / "hwpc.jsonl" if everything else None,
        csv_dir=directory,
        truth=directory / "truth.csv" if everything else None,
        phenomena=args.phenomena,
    )


def tree_memory_mb(root: int) -> float:
    """Proportional set size (PSS) of a process and all its descendants, in MB.

    SmartWatts forks one process per actor; their resident sets share most pages (the
    interpreter and scikit-learn, loaded before the fork), so adding up RSS would count those
    pages once per actor. PSS splits each shared page between the processes that map it.
    """
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        tree.update(children)
        frontier.extend(children)
    total_kb = 0
    for pid in tree:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            if line.startswith("Pss:"):
                total_kb += int(line.split()[1])
                break
    return total_kb / 1024


@dataclass
class Run:
    """One run of a formula."""

    wall_s: float
    largest_rss_mb: float
    tree_peak_mb: float
    cpu_s: float
    """User and system time of the process and the descendants it waited for: SmartWatts'
    actors are processes that its main process joins, so they count."""


def run_measured(command: list[str], env: dict[str, str], log: Path) -> Run:
    """Run a command; return its wall time, its largest process's RSS, its tree's peak PSS and
    its CPU time.

    The largest RSS and the CPU time come from the kernel (``wait4`` reports them over the child
    and the descendants it waited for); the tree's total is sampled every 0.2 s, so it can miss
    a short peak.
    """
    peak = 0.0
    done = threading.Event()
    started = time.perf_counter()
    with log.open("w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.2):
                peak = max(peak, tree_memory_mb(process.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{log.read_text()[-3000:]}")
    return Run(wall, usage.ru_maxrss / 1024, peak, usage.ru_utime + usage.ru_stime)


def formula_flags(args: argparse.Namespace) -> list[str]:
    """SmartWatts' settings, the same on both sides."""
    return [
        "--cpu-base-freq", "2100",
        "--cpu-tdp", "400",
        "--sensor-reports-frequency", "1000",
        "--learn-min-samples-required", str(args.min_samples),
        "--learn-history-window-size", str(args.history_window),
        *shlex.split(args.formula_args),
    ]  # fmt: skip


def command(
    name: str, python: Path, inputs: Path, output: Path, args: argparse.Namespace
) -> list[str]:
    """The command line of one formula: SmartWatts' own, which wattflow accepts as it is.

    The files go in the order PowerAPI's CSV input needs (see ``GROUP_FILES``).
    """
    files = ",".join(str(inputs / f) for f in GROUP_FILES)
    io = [
        "--input", "csv", "--model", "HWPCReport", "--name", "puller", "--files", files,
        "--output", "csv", "--model", "PowerReport", "--name", "pusher",
        "--directory", str(output),
    ]  # fmt: skip
    every = ["taskset", "-c", f"0-{(os.cpu_count() or 1) - 1}"] if shutil.which("taskset") else []
    if name == "SmartWatts":
        return [*every, str(python), "-m", "smartwatts", *io, *formula_flags(args)]
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    run = [*pin, str(args.wattflow_python), "-m", "wattflow.service", "run"]
    return [*run, *io, *formula_flags(args), *shlex.split(args.wattflow_args)]


def startup(name: str, python: Path, work: Path, args: argparse.Namespace) -> list[Run]:
    """``--startup-runs`` runs on the one-tick input: their median is the start-up."""
    runs = []
    for attempt in range(args.startup_runs):
        out = work / f"{name}-startup-{attempt}"
        shutil.rmtree(out, ignore_errors=True)
        log = work / f"{name}-startup-{attempt}.log"
        runs.append(run_measured(command(name, python, work / "tiny", out, args), ENV, log))
    return runs


def full_run(
    name: str, python: Path, work: Path, args: argparse.Namespace, inputs: str = "input"
) -> Run:
    """One run on the whole input (``inputs``: its folder in ``work``)."""
    output = work / f"{name}-out"
    shutil.rmtree(output, ignore_errors=True)  # both formulas append to existing CSV files
    return run_measured(
        command(name, python, work / inputs, output, args), ENV, work / f"{name}.log"
    )


def median_or_zero(values: list[float]) -> float:
    """The median, or 0 when there is none (``--startup-runs 0``: start-up not left out)."""
    return statistics.median(values) if values else 0.0


def measure(
    names: list[str],
    python: Path,
    work: Path,
    args: argparse.Namespace,
    reports: int,
    longer: dict[str, tuple[str, int]] | None = None,
) -> list[Outcome]:
    """Start-ups, then ``--repeat`` rounds of full runs, the formulas taking turns in each.

    Taking turns puts both formulas' runs of a round in the same stretch of the machine's
    speed, which on a shared or virtual machine drifts by more than the difference being
    measured; each outcome's wall time is the median of its rounds.

    ``longer``: the formulas whose full runs read a longer recording instead, each with its
    folder in ``work`` and its report count (see ``--wattflow-longer``).
    """
    longer = longer or {}
    startups = {name: startup(name, python, work, args) for name in names}
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for _ in range(args.repeat):
        for name in names:
            inputs = longer[name][0] if name in longer else "input"
            runs[name].append(full_run(name, python, work, args, inputs))
    outcomes = []
    for name in names:
        output = work / f"{name}-out"
        files = sorted({p.name for p in output.glob("*/*")})
        written = sum(sum(1 for _ in p.open()) - 1 for p in output.glob("*/*.csv"))
        walls = [run.wall_s for run in runs[name]]
        starts = [run.wall_s for run in startups[name]]
        outcomes.append(
            Outcome(
                name,
                longer[name][1] if name in longer else reports,
                statistics.median(walls),
                median_or_zero(starts),
                max(run.largest_rss_mb for run in runs[name]),
                max(run.tree_peak_mb for run in runs[name]),
                output,
                files,
                starts,
                written,
                walls,
                statistics.median(run.cpu_s for run in runs[name]),
                median_or_zero([run.cpu_s for run in startups[name]]),
            )
        )
    return outcomes


def files_written(output: Path) -> dict[str, str]:
    """Per file a formula wrote (``sensor-target/PowerReport.csv``): its header line."""
    found = {}
    for path in sorted(output.glob("*/*")):
        with path.open() as handle:
            found[f"{path.parent.name}/{path.name}"] = handle.readline().strip()
    return found


def disagreements(outcomes: list[Outcome]) -> list[str]:
    """Where the formulas' outputs differ in which files (one per sensor and target) they wrote
    or in those files' columns; empty when they agree.

    The rows may differ (SmartWatts loses its last ticks and the first ticks of each new model,
    and the powers are each formula's own estimates), but every target one formula reports, the
    other must report too, under the same header.
    """
    first, *others = outcomes
    mine = files_written(first.output)
    found = []
    for other in others:
        theirs = files_written(other.output)
        for name in sorted(mine.keys() - theirs.keys()):
            found.append(f"only {first.name} wrote {name}")
        for name in sorted(theirs.keys() - mine.keys()):
            found.append(f"only {other.name} wrote {name}")
        for name in sorted(mine.keys() & theirs.keys()):
            if mine[name] != theirs[name]:
                found.append(
                    f"{name}: {first.name}'s header {mine[name]!r}, {other.name}'s {theirs[name]!r}"
                )
    return found


def power_by_tick(output: Path, scope: str) -> dict[Key, float]:
    """Per (tick, sensor, target): the scope's power summed over sockets, from PowerAPI CSV."""
    found: dict[Key, float] = defaultdict(float)
    for path in output.glob("*/PowerReport.csv"):
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                if row["target"] in ("rapl", "global") or row.get("scope") != scope:
                    continue
                key = (int(row["timestamp"]), row["sensor"], row["target"])
                found[key] += float(row["power"])
    return found


def truth_by_tick(path: Path, scope: str) -> dict[Key, float]:
    """Ground truth per (tick, sensor, target), idle power attributed as the formulas do."""
    found = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row["target"].startswith("rapl-socket"):
                continue
            stamp = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=UTC)
            key = (round(stamp.timestamp() * 1000), row["sensor"], row["target"])
            found[key] = float(row[f"{scope}_attributed_w"])
    return found


def on_truth_ticks(estimated: dict[Key, float], truth: dict[Key, float]) -> dict[Key, float]:
    """Re-key estimates on the truth's ticks, allowing for PowerAPI's 1 ms of float rounding."""
    matched = {}
    for (millis, sensor, target), power in estimated.items():
        for candidate in (millis, millis - 1, millis + 1):
            if (candidate, sensor, target) in truth:
                matched[(candidate, sensor, target)] = power
                break
    return matched


def errors(
    estimated: dict[Key, float], truth: dict[Key, float], keys: set[Key]
) -> tuple[float, float]:
    """MAPE in % (on targets whose truth is at least 1 W) and mean absolute error in W."""
    relative = [abs(estimated[k] - truth[k]) / truth[k] for k in keys if truth[k] >= 1.0]
    absolute = [abs(estimated[k] - truth[k]) for k in keys]
    mape = 100 * statistics.fmean(relative) if relative else math.nan
    return mape, statistics.fmean(absolute) if absolute else math.nan


def after_learning(truth: dict[Key, float], learning_ticks: int) -> set[Key]:
    """The truth's target-ticks of 1 W or more, each sensor's first ``learning_ticks`` left out:
    the rows a formula should estimate once its models are learned."""
    ticks: dict[str, set[int]] = defaultdict(set)
    for millis, sensor, _ in truth:
        ticks[sensor].add(millis)
    learned = {sensor: sorted(found)[learning_ticks:] for sensor, found in ticks.items()}
    first = {sensor: found[0] if found else math.inf for sensor, found in learned.items()}
    return {k for k, watts in truth.items() if watts >= 1.0 and k[0] >= first[k[1]]}


def print_accuracy(outcomes: list[Outcome], truth_file: Path, learning_ticks: int) -> None:
    """Per scope and formula: coverage and MAPE after the learning phase, then on every tick
    both formulas estimated."""
    print(
        f"\nper-target power against the truth (summed over sockets, idle attributed by "
        f"activity), after a learning phase of {learning_ticks} ticks"
    )
    print(
        f"{'':11} {'scope':>5} {'rows':>6} {'covered %':>9} {'MAPE %':>7}   "
        f"{'target-ticks':>12} {'common':>7} {'MAPE %':>7} {'MAE W':>7}"
    )
    for scope in ("cpu", "dram"):
        truth = truth_by_tick(truth_file, scope)
        rows = after_learning(truth, learning_ticks)
        estimates = {
            o.name: on_truth_ticks(power_by_tick(o.output, scope), truth) for o in outcomes
        }
        common = set.intersection(*(set(e) for e in estimates.values()))
        for o in outcomes:
            mine = estimates[o.name]
            covered = rows & set(mine)
            learned_mape, _ = errors(mine, truth, covered)
            share = 100 * len(covered) / len(rows) if rows else math.nan
            mape, mae = errors(mine, truth, common)
            print(
                f"{o.name:11} {scope:>5} {len(rows):6d} {share:9.1f} {learned_mape:7.2f}   "
                f"{len(mine):12d} {len(common):7d} {mape:7.2f} {mae:7.3f}"
            )
    print(
        "(rows: target-ticks of 1 W or more after the learning phase; MAPE over those the "
        "formula estimated. Then over every tick both estimated: MAPE on targets of 1 W or "
        "more, MAE on all)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ticks", type=int, default=600)
    parser.add_argument("--containers", type=int, default=10)
    parser.add_argument("--sensors", type=int, default=1)
    parser.add_argument("--sockets", type=int, default=2)
    parser.add_argument("--cpus-per-socket", type=int, default=4)
    parser.add_argument("--multiplex", type=float, default=0.0)
    parser.add_argument(
        "--phenomena",
        type=Phenomena.parse,
        help="simulate a node with these phenomena ('all', 'none' or some of "
        f"{', '.join(PHENOMENA)}, comma-separated) instead of the plain recording",
    )
    parser.add_argument(
        "--learning-ticks",
        type=int,
        default=80,
        help="ticks at the start left out of the coverage and its MAPE (the learning phase)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--min-samples", type=int, default=10)
    parser.add_argument("--history-window", type=int, default=60)
    parser.add_argument(
        "--formula-args", default="", help="more SmartWatts flags, given to both formulas"
    )
    parser.add_argument(
        "--wattflow-args",
        default="",
        help="flags for wattflow only, e.g. '--compat smartwatts-2.4'",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="full runs of each formula, taking turns; wall times are their medians",
    )
    parser.add_argument(
        "--startup-runs",
        type=int,
        default=3,
        help="one-tick runs of each formula, whose median is its start-up (0: none, and "
        "start-up is not left out)",
    )
    shapes = parser.add_argument_group(
        "shapes",
        "with --shapes, one run per shape of machine and load instead of one run: --sockets, "
        "--cpus-per-socket and --containers give the base shape, --ticks is left to the budget",
    )
    shapes.add_argument(
        "--shapes",
        nargs="?",
        const="axes",
        choices=("axes", "grid"),
        help="'axes' (the default): the base shape, then each value of each dimension with the "
        "others at the base's; 'grid': every combination",
    )
    shapes.add_argument("--shape-sockets", type=int_list, default=[1, 2], metavar="N,N")
    shapes.add_argument("--shape-cpus-per-socket", type=int_list, default=[4, 8, 32])
    shapes.add_argument("--shape-containers", type=int_list, default=[10, 100, 1000])
    shapes.add_argument(
        "--shape-reports",
        type=int,
        default=30_000,
        help="input reports per shape, which set its ticks (SmartWatts takes 15-60 s on 30,000)",
    )
    shapes.add_argument(
        "--shape-min-ticks", type=int, default=30, help="ticks per shape at least (30)"
    )
    shapes.add_argument(
        "--small-nodes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add one socket of 4 and 8 cpus with 2, 5 and 10 containers to the shapes (on by "
        "default: most HPC and edge nodes)",
    )
    shapes.add_argument(
        "--smartwatts-longer",
        type=int,
        default=3,
        metavar="K",
        help="SmartWatts' rate is measured on a recording of the shape K times as long (3): "
        "its start-up is about 4 s, and on a one-socket shape its 30,000 reports take little "
        "more, so that its rate less the start-up would be noise too",
    )
    shapes.add_argument(
        "--wattflow-longer",
        type=int,
        default=10,
        metavar="K",
        help="wattflow's rate is measured on a recording of the shape K times as long (10): "
        "on the shape's own, small shapes take wattflow less time than its start-up, and "
        "the rate left after the start-up is noise; its outputs are still compared on the "
        "shape's own recording",
    )
    parser.add_argument("--venv", type=Path, default=SMARTWATTS_VENV)
    parser.add_argument(
        "--wattflow-python",
        type=Path,
        help="run wattflow with this interpreter instead of its own venv "
        f"({WATTFLOW_VENV.relative_to(ROOT)}), e.g. to measure a development environment",
    )
    parser.add_argument(
        "--keep", type=Path, help="write inputs, outputs and logs here, and keep them"
    )
    return parser.parse_args(argv)


def int_list(text: str) -> list[int]:
    """``1,2,4`` as integers."""
    return [int(part) for part in text.split(",") if part.strip()]


def run_one(python: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """The single-input report: speed, memory, output and accuracy of both formulas; returns
    where their outputs disagree."""
    shape = Shape(args.sockets, args.cpus_per_socket, args.containers)
    reports = write_input(work / "input", args, args.ticks, shape)
    write_input(work / "tiny", args, 1, shape)
    outcomes = measure(["SmartWatts", "wattflow"], python, work, args, reports)

    shows = (
        f"multiplexed share {args.multiplex}"
        if args.phenomena is None
        else f"phenomena {args.phenomena.label}"
    )
    print(
        f"input: {reports} reports, {args.ticks} ticks × {args.sensors} sensor(s), "
        f"{args.containers} containers, {args.sockets}×{args.cpus_per_socket} cpus, "
        f"{shows}; flags: {shlex.join(formula_flags(args))}"
    )
    print(
        f"wattflow pinned to one core (extra flags: {args.wattflow_args or 'none'}; "
        f"{versions(args.wattflow_python)}); SmartWatts on all {os.cpu_count()} cores\n"
    )
    print(
        f"{'':11} {'reports':>8} {'wall s':>7} {'start s':>8} {'reports/s':>10} "
        f"{'max RSS MB':>11} {'tree PSS MB':>12} {'written':>8}   output files"
    )
    for o in outcomes:
        print(
            f"{o.name:11} {o.reports:8d} {o.wall_s:7.2f} {o.startup_s:8.2f} {o.throughput:10.0f} "
            f"{o.largest_rss_mb:11.0f} {o.tree_peak_mb:12.0f} {o.written:8d}   "
            f"{', '.join(o.output_files)}"
        )
    print(
        "written: PowerReport rows in the output; SmartWatts loses at least its last 5 ticks at "
        "exit, and a formula actor stopped while busy loses more"
    )
    for o in outcomes:
        runs = ", ".join(f"{s:.2f}" for s in o.startups)
        print(f"{o.name} one-tick runs: {runs or 'none'} s (the median is its start-up)")
    smartwatts, wattflow = outcomes
    if args.repeat > 1:
        for o in outcomes:
            print(f"{o.name} full runs: {', '.join(f'{w:.2f}' for w in o.walls)} s (median used)")
        rounds = [
            (wattflow.reports / (w - wattflow.startup_s))
            / (smartwatts.reports / (s - smartwatts.startup_s))
            for s, w in zip(smartwatts.walls, wattflow.walls, strict=True)
        ]
        print(f"ratio per round: {', '.join(f'{r:.2f}×' for r in rounds)}")
    ratio = wattflow.throughput / smartwatts.throughput
    print(f"\nthroughput ratio wattflow / SmartWatts: {ratio:.2f}×")
    cpu_ratio = wattflow.cpu_throughput / smartwatts.cpu_throughput
    print(
        f"by CPU time (start-up's left out): {cpu_ratio:.2f}× "
        f"(SmartWatts {smartwatts.cpu_s:.2f} s, wattflow {wattflow.cpu_s:.2f} s)"
    )
    if any(o.wall_s < 2 * o.startup_s for o in outcomes):
        print(
            "note: a run took less than twice its start-up, so reports/s is mostly noise; "
            "SmartWatts runs about 5 s between starting its actors and stopping them even on one "
            "tick, and processes a small input within that time: use more --ticks"
        )
    found = disagreements(outcomes)
    if not found:
        print(f"outputs: both wrote the same {len(files_written(wattflow.output))} files")
    print_accuracy(outcomes, work / "input" / "truth.csv", args.learning_ticks)
    return found


@dataclass
class ShapeResult:
    """One shape's measurement."""

    shape: Shape
    ticks: int
    smartwatts: Outcome
    wattflow: Outcome
    files: int
    disagreements: list[str]
    load: float
    """The machine's 1-minute load average when the shape's runs ended."""
    reports: int = 0
    """The input reports of the shape's own recording (each rate may be over a longer one)."""

    @property
    def ratio(self) -> float:
        return self.wattflow.throughput / self.smartwatts.throughput

    @property
    def cpu_ratio(self) -> float:
        return self.wattflow.cpu_throughput / self.smartwatts.cpu_throughput

    @property
    def short(self) -> bool:
        """A run took less than twice its start-up: its rate is mostly noise."""
        return any(o.wall_s < 2 * o.startup_s for o in (self.smartwatts, self.wattflow))


SHAPE_HEADER = (
    f"{'shape':30} {'ticks':>6} {'reports':>8} {'SmartWatts/s':>12} {'wattflow/s':>11} "
    f"{'ratio':>8} {'CPU ratio':>9} {'files':>6} {'load':>5}"
)


def shape_row(result: ShapeResult) -> str:
    """A line of the shapes table."""
    sw, wf = result.smartwatts, result.wattflow
    agree = "same" if not result.disagreements else f"{len(result.disagreements)} differ"
    mark = "*" if result.short else " "
    return (
        f"{result.shape!s:30} {result.ticks:6d} {result.reports:8d} {sw.throughput:12,.0f} "
        f"{wf.throughput:11,.0f} {result.ratio:7.1f}×{mark}{result.cpu_ratio:8.1f}× "
        f"{result.files:6d} {result.load:5.1f}   {agree}"
    )


def measure_shape(shape: Shape, python: Path, work: Path, args: argparse.Namespace) -> ShapeResult:
    """Generate the shape's recordings in ``work`` and run both formulas on them."""
    ticks = shape_ticks(shape, args)
    reports = write_input(work / "input", args, ticks, shape, everything=False)
    write_input(work / "tiny", args, 1, shape, everything=False)
    longer: dict[str, tuple[str, int]] = {}
    made: dict[int, int] = {}
    for name, times in (("SmartWatts", args.smartwatts_longer), ("wattflow", args.wattflow_longer)):
        if times > 1:
            if times not in made:
                made[times] = write_input(
                    work / f"longer-{times}", args, ticks * times, shape, everything=False
                )
            longer[name] = (f"longer-{times}", made[times])
    names = ["SmartWatts", "wattflow"]
    smartwatts, wattflow = measure(names, python, work, args, reports, longer)
    for name in longer:  # the outputs compared are of the same recording: the shape's own
        full_run(name, python, work, args)
    found = disagreements([smartwatts, wattflow])
    files = len(files_written(wattflow.output))
    load = os.getloadavg()[0]
    return ShapeResult(shape, ticks, smartwatts, wattflow, files, found, load, reports)


def run_shapes(python: Path, work: Path, args: argparse.Namespace) -> list[ShapeResult]:
    """Measure every shape, printing each one's line of the table as it ends."""
    base = Shape(args.sockets, args.cpus_per_socket, args.containers)
    shapes = shapes_to_run(
        base,
        args.shape_sockets,
        args.shape_cpus_per_socket,
        args.shape_containers,
        grid=args.shapes == "grid",
        small_nodes=args.small_nodes,
    )
    print(
        f"{len(shapes)} shapes ({args.shapes}), about {args.shape_reports:,} input reports each "
        f"and at least {args.shape_min_ticks} ticks, {args.sensors} sensor(s); "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; flags: {shlex.join(formula_flags(args))}"
    )
    print(
        f"wattflow pinned to one core (extra flags: {args.wattflow_args or 'none'}; "
        f"{versions(args.wattflow_python)}); SmartWatts on all {os.cpu_count()} cores; "
        f"{args.startup_runs} one-tick run(s) and {args.repeat} full run(s) each\n"
    )
    print(SHAPE_HEADER, flush=True)
    results = []
    for shape in shapes:
        shape_work = work / shape.slug
        result = measure_shape(shape, python, shape_work, args)
        results.append(result)
        print(shape_row(result), flush=True)
        if not args.keep:
            shutil.rmtree(shape_work, ignore_errors=True)
    print(
        "\nreports/s: input reports over wall time less the start-up (median of the one-tick "
        f"runs), each formula on a recording of the shape --smartwatts-longer "
        f"({args.smartwatts_longer}) and --wattflow-longer ({args.wattflow_longer}) times as "
        "long as the one counted under ticks and reports; ratio: wattflow's over "
        "SmartWatts'; CPU ratio: the same by CPU time (user + system, every process), "
        "start-ups' left out; files: PowerReport files (one per sensor "
        "and target) wattflow wrote, 'same' when SmartWatts wrote the same ones with the same "
        "columns; load: the 1-minute load average at the shape's end"
    )
    if any(r.short for r in results):
        print("*: a run took less than twice its start-up, so its rate is mostly noise")
    if results:
        worst = min(results, key=lambda r: r.ratio)
        print(
            f"worst ratio: {worst.ratio:.1f}× ({worst.shape}); by CPU time: "
            f"{min(r.cpu_ratio for r in results):.1f}×"
        )
    for result in results:
        for line in result.disagreements:
            print(f"{result.shape}: {line}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the exit status is 1 when the formulas' outputs disagree."""
    args = parse_args(argv)
    keep_off_the_measured_core()
    python = smartwatts_python(args.venv)
    if args.wattflow_python is None:
        args.wattflow_python = wattflow_python(WATTFLOW_VENV)
    work = args.keep or Path(tempfile.mkdtemp(prefix="wattflow-side-by-side-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.shapes:
        found = [line for r in run_shapes(python, work, args) for line in r.disagreements]
    else:
        found = run_one(python, work, args)
        for line in found:
            print(f"outputs differ: {line}")
    if args.keep or not args.shapes:
        print(f"\ninputs, outputs and logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
