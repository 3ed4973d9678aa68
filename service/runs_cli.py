"""``wattflow runs …`` and ``wattflow export …``: recording, browsing and exporting runs.

Three parts, each in one place: the command lines' parsing (:func:`runs_parser`,
:func:`export_parser` and the readers of their values), what the commands do with the store
(importing files, marking, choosing runs), and what they print, built by functions that take
data and return rows or lines (:func:`run_row`, :func:`energy_row`, :func:`show_lines`,
:func:`import_lines`), so that what a user reads is tested without a store or a terminal.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, get_args

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
from rich.table import Table

from wattflow.actors.exporters import exporters
from wattflow.actors.run_store import (
    RunStore,
    StoreError,
    discard_if_empty,
    mark,
    open_store,
    parse_run_id,
    run_id,
    sqlite_path,
)
from wattflow.formats import jsonl, powerapi
from wattflow.formats.errors import DecodeError
from wattflow.formats.reports import (
    EventName,
    EventReport,
    Report,
    TargetEnergyReport,
    report_kind,
    to_utc,
)
from wattflow.formats.runs import (
    RecordedSystem,
    Run,
    merge_system,
    number_text,
    parameter_settings,
)

EVENT_NAMES = list(get_args(EventName))

FAR_S = 3600.0
"""How far outside a run's window ``runs mark`` may put an event at now, unasked: a live run's
window reaches about now, and an hour covers a service paused or a long step between marks."""

NOTABLE_S = 60.0
"""How much a mark may widen a run's window before ``runs mark`` warns that it did."""

KIND_BY_PAYLOAD = (
    ("power", "PowerReport"),
    ("groups", "HWPCReport"),
    ("devices", "GPUReport"),
    ("channels", "MeterReport"),
    ("event", "EventReport"),
    ("energy", "TargetEnergyReport"),
    ("usage", "ProcfsReport"),
)
"""A JSON report's kind, told by its payload's key (PowerAPI's JSON layout names no kind)."""


# --- parsing --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise StoreError(f"{self.prog}: {message}")


def runs_parser() -> _Parser:
    """``wattflow runs``' command line."""
    parser = _Parser(prog="wattflow runs")
    parser.add_argument("--store", help="sqlite:///path or mongodb://host/db (default: "
                        "runs.db in the user's data directory)")  # fmt: skip
    commands = parser.add_subparsers(dest="action", required=True)
    importing = commands.add_parser("import", help="put recorded reports into a run")
    importing.add_argument("files", nargs="+", type=Path)
    importing.add_argument("--store", dest="store_", default=None)
    importing.add_argument("--experiment", required=True)
    importing.add_argument("--benchmark", required=True)
    importing.add_argument("--settings", help="names the run's directory, e.g. 250W or "
                           "877MHz,1065MHz (default: its parameters, e.g. p=4)")  # fmt: skip
    importing.add_argument("--repetition", type=int, required=True)
    importing.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    importing.add_argument("--system-info", type=Path, default=None, metavar="FILE",
                           help="JSON object describing the machine the recording was made on, "
                           "in system_info.json's keys")  # fmt: skip
    importing.add_argument("--model", default=None, help="report kind of every line")
    listing = commands.add_parser("list", help="the runs in the store")
    listing.add_argument("--store", dest="store_", default=None)
    listing.add_argument("--experiment")
    listing.add_argument("--benchmark")
    showing = commands.add_parser("show", help="one run in detail")
    showing.add_argument("run", help="experiment/benchmark/settings/repetition")
    showing.add_argument("--store", dest="store_", default=None)
    energy = commands.add_parser(
        "energy", help="each workload's energy, as the energy formula reported it when it ended"
    )
    energy.add_argument("run", help="experiment/benchmark/settings/repetition")
    energy.add_argument("--store", dest="store_", default=None)
    marking = commands.add_parser("mark", help="record an event in a run, now")
    marking.add_argument("event", choices=EVENT_NAMES)
    marking.add_argument("data", nargs="?", help="the event's index (an epoch number, say)")
    marking.add_argument("--store", dest="store_", default=None)
    marking.add_argument("--run", help="experiment/benchmark/settings/repetition (default: the "
                         "latest run)")  # fmt: skip
    marking.add_argument("--at", metavar="TIME", help="the event's time (default: now): ISO 8601 "
                         "(UTC unless it says), +SECONDS after the run's start, or now; needed "
                         f"to mark a run that ended over {FAR_S / 3600:g} h ago")  # fmt: skip
    return parser


def export_parser() -> _Parser:
    """``wattflow export``'s command line."""
    parser = _Parser(prog="wattflow export")
    directories = [name for name in exporters.names() if exporters.get(name).writes_directory]
    parser.add_argument("format", choices=exporters.names(), help="the format to write")
    parser.add_argument("--store", default=None, help="sqlite:///path or mongodb://host/db "
                        "(default: runs.db in the user's data directory)")  # fmt: skip
    parser.add_argument("--experiment", help="only this experiment's runs")
    parser.add_argument("--benchmark", help="only this benchmark's runs")
    parser.add_argument("--run", action="append", default=[], metavar="E/B/S/N",
                        help="only this run (repeat for several)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="where to write: a directory "
                        f"for {', '.join(directories)}; a file for the others")  # fmt: skip
    parser.add_argument("--model", action="store_true", help="add fitted models (extrap)")
    return parser


def parameters_of(pairs: Sequence[str]) -> dict[str, float]:
    """``--param NAME=VALUE``s, each a finite number."""
    found = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise StoreError(f"--param {pair!r}: write NAME=NUMBER") from None
        if not math.isfinite(number):
            raise StoreError(f"--param {pair!r}: give a finite number")
        if not name.strip():
            raise StoreError(f"--param {pair!r}: the name is empty")
        found[name.strip()] = number
    return found


def read_system_info(path: Path) -> dict[str, Any]:
    """``--system-info FILE``: a JSON object in the keys of the GPU measurement directory's
    ``system_info.json`` (``device_name``, ``driver_version``, ``platform``, …, and ``node``).

    Raises:
        StoreError: when the file cannot be read or is not a JSON object.
    """
    try:
        document = orjson.loads(path.read_bytes())
    except OSError as error:
        raise StoreError(f"--system-info {path}: {error.strerror or error}") from None
    except orjson.JSONDecodeError as error:
        raise StoreError(f"--system-info {path}: not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise StoreError(
            f"--system-info {path}: give a JSON object such as "
            '{"device_name": "Tesla V100-SXM2-16GB", "driver_version": "450.51.06"}'
        )
    return document


# --- the commands ---------------------------------------------------------------------------------


def runs_command(argv: Sequence[str], console: Console | None = None) -> int:
    """``wattflow runs import|list|show|energy|mark``."""
    console = console or Console()
    args = runs_parser().parse_args(argv)
    if args.action == "import":
        return import_command(args, console)
    with open_store(args.store_ or args.store, create=False) as store:
        if args.action == "list":
            runs = store.runs(args.experiment, args.benchmark)
            print_rows(console, RUNS_HEADER, [run_row(run, store.count(run)) for run in runs])
        elif args.action == "show":
            run = store.get(args.run)
            print_lines(console, show_lines(run, Counter(r.kind for r in store.reports(run))))
        elif args.action == "energy":
            reports = store.reports(store.get(args.run), [TargetEnergyReport.kind])
            rows = [energy_row(r) for r in reports if isinstance(r, TargetEnergyReport)]
            print_rows(console, ENERGY_HEADER, rows)
        else:
            mark_command(store, args, console)
    return 0


def mark_command(store: RunStore, args: argparse.Namespace, console: Console) -> None:
    """``wattflow runs mark``: the event at ``--at`` or now, refused when now would stretch a
    run that ended long ago (an imported one) to today, and a warning when it widens the run's
    window by more than :data:`NOTABLE_S`."""
    run = run_to_mark(store, args.run)
    moment = mark_time(run, args.at, datetime.now(UTC))
    marked = mark(store, run, args.event, args.data, at=moment)
    shown = f"marked {args.event} in {run.id} at {moment.isoformat()}"
    console.print(shown, highlight=False, markup=False, soft_wrap=True)
    warning = widening_warning(run, marked)
    if warning is not None:
        Console(stderr=True).print(warning, highlight=False, markup=False, soft_wrap=True)


def mark_time(run: Run, at: str | None, now: datetime) -> datetime:
    """The time ``runs mark`` gives its event: ``--at`` (an ISO 8601 time, naive ones UTC;
    ``+SECONDS`` after the run's start; ``now``), or now when it is not more than
    :data:`FAR_S` outside the run's window. A run recorded live has a window up to about now;
    one imported from a recording of January does not, and marking it now would stretch it to
    today, an export then spanning months: that is refused, saying how to place the event.

    Raises:
        StoreError: for a time that cannot be read, or now far outside the window without
            ``--at``.
    """
    if at is None:
        gap = outside_s(run, now)
        if gap > FAR_S:
            raise StoreError(
                f"run {run.id} spans {run.start.isoformat()} – {run.end.isoformat()}: marking "
                f"it now would stretch its window by {span_text(gap)}. Give --at TIME to place "
                f"the event in the run (ISO 8601, UTC unless it says, or +SECONDS after its "
                f"start), or --at now to stretch it"
            )
        return now
    if at == "now":
        return now
    try:
        if at.startswith("+"):
            seconds = float(at[1:])
            if not math.isfinite(seconds):
                raise ValueError(at)
            return run.start + timedelta(seconds=seconds)
        return to_utc(at)
    except (ValueError, OverflowError):
        raise StoreError(
            f"--at {at!r}: give an ISO 8601 time (2026-01-15T10:00:03, UTC unless it says), "
            f"+SECONDS after the run's start, or now"
        ) from None


def outside_s(run: Run, moment: datetime) -> float:
    """How far ``moment`` is outside the run's window, in seconds (0 inside it)."""
    return max(0.0, (run.start - moment).total_seconds(), (moment - run.end).total_seconds())


def widening_warning(before: Run, after: Run) -> str | None:
    """What ``runs mark`` says when the event widened the run's window by more than
    :data:`NOTABLE_S`: exports then span the new window."""
    widened = after.duration_s - before.duration_s
    if widened <= NOTABLE_S:
        return None
    return (
        f"warning: the event is outside run {after.id}'s window, which it widened by "
        f"{span_text(widened)}: it now spans {after.start.isoformat()} – "
        f"{after.end.isoformat()} ({span_text(after.duration_s)})"
    )


def span_text(seconds: float) -> str:
    """A length of time as a person reads it: seconds, minutes, hours or days."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def import_command(args: argparse.Namespace, console: Console) -> int:
    """``wattflow runs import``: the one command that creates a store, and so the one that
    must not leave an empty one behind when it fails. Its arguments and files are checked
    before the store is opened; a store it created and then could not fill is removed."""
    parameters = parameters_of(args.param)
    settings = args.settings if args.settings is not None else _settings_of(parameters)
    run_id(args.experiment, args.benchmark, settings, args.repetition)
    for path in args.files:
        if not path.is_file():
            raise StoreError(f"{path}: no such file")
    if args.model is not None:
        report_kind(args.model)
    system = None if args.system_info is None else read_system_info(args.system_info)
    uri = args.store_ or args.store
    path = sqlite_path(uri)
    created = path if path is not None and not path.exists() else None
    try:
        with open_store(uri) as store:
            run, count = import_files(
                store, args.files, experiment=args.experiment, benchmark=args.benchmark,
                settings=settings, repetition=args.repetition, parameters=parameters,
                model=args.model, system=system,
            )  # fmt: skip
            lines = import_lines(run, count, store.count(run))
    except BaseException:
        if created is not None:
            discard_if_empty(created)
        raise
    print_lines(console, lines)
    return 0


def run_to_mark(store: RunStore, identifier: str | None) -> Run:
    """``wattflow runs mark``'s run: the one named, or else the latest to start.

    Raises:
        StoreError: when the store has no such run, or none at all.
    """
    if identifier is not None:
        return store.get(identifier)
    runs = store.runs()
    if not runs:
        raise StoreError("no run in the store to mark; give --run or start one")
    return max(runs, key=lambda r: r.start)


def export_command(argv: Sequence[str], console: Console | None = None) -> int:
    """``wattflow export FORMAT --store URI [--experiment E] [--benchmark B] [--run E/B/S/N]
    --out PATH``.

    Each exported run notes that it was written in this format (:attr:`Run.exports`); a store
    that cannot take the note only costs a warning.
    """
    console = console or Console(stderr=True)
    args = export_parser().parse_args(argv)
    exporter = exporters.get(args.format)(model=args.model)
    with open_store(args.store, create=False) as store:
        runs = store.runs(args.experiment, args.benchmark)
        if args.run:
            for identifier in args.run:
                parse_run_id(identifier)  # a mistyped id says how to write one
            runs = [run for run in runs if run.id in args.run]
        if not runs:
            raise StoreError("no run matches: see `wattflow runs list`")
        total = sum(store.count(run) for run in runs)
        columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn())  # fmt: skip
        with Progress(*columns, console=console, transient=not console.is_terminal) as progress:
            task = progress.add_task(f"{args.format} ← {counted(len(runs), 'run')}", total=total)
            exporter.export(runs, store, args.out, lambda count: progress.advance(task, count))
        for run in runs:
            try:
                store.note_export(run.id, args.format, "written")
            except StoreError as error:
                console.print(f"wrote the export, but could not note it in the store: {error}")
                break
    console.print(
        f"wrote {args.out} from {counted(len(runs), 'run')}, {counted(total, 'report')}",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
    return 0


# --- importing ------------------------------------------------------------------------------------


def read_json_lines(path: Path, model: str | None) -> Iterator[Report]:
    """Reports from a JSON Lines file, each line's kind told by ``model`` or by its payload."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                document = orjson.loads(line)
            except orjson.JSONDecodeError as error:
                raise DecodeError(str(path), number, f"not valid JSON: {error}") from None
            kind = model or kind_of(document)
            yield powerapi.decode_document(report_kind(kind), document, str(path), number)


def kind_of(document: Any) -> str:
    """The kind of a JSON report, from its payload's key."""
    if not isinstance(document, dict):
        return "FormulaReport"
    return next((name for key, name in KIND_BY_PAYLOAD if key in document), "FormulaReport")


def read_reports_document(path: Path, model: str | None) -> Iterator[Report]:
    """PowerAPI's file-input recordings: one ``{"reports": [...]}`` document, as the service's
    ``jsonl`` input reads them too. Its reports are all of one kind, told by ``model`` or by
    the first report's payload."""
    if model is None:
        try:
            entries = orjson.loads(path.read_bytes()).get("reports") or [None]
        except (orjson.JSONDecodeError, AttributeError):
            entries = [None]
        model = kind_of(entries[0])
    for item in jsonl.read_reports_document(report_kind(model), path):
        if isinstance(item, DecodeError):
            raise item
        yield item


def read_file(path: Path, model: str | None) -> Iterator[Report]:
    """Reports from a recorded file: JSON Lines, PowerAPI's ``{"reports": [...]}`` document, or
    PowerAPI's CSV (PowerReport.csv)."""
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    if path.suffix.lower() == ".csv":
        for item in powerapi.read_power_csv(path):
            if isinstance(item, DecodeError):
                raise item
            yield item
        return
    if jsonl.is_reports_document(path):
        yield from read_reports_document(path, model)
        return
    yield from read_json_lines(path, model)


def import_files(
    store: RunStore,
    files: Sequence[Path],
    *,
    experiment: str,
    benchmark: str,
    settings: str | None,
    repetition: int,
    parameters: dict[str, float],
    model: str | None = None,
    system: dict[str, Any] | None = None,
) -> tuple[Run, int]:
    """Put recorded reports into a run; its window spans them (or its experiment events).

    Without ``settings`` the run is named after its parameters (``p=4``; see
    :func:`parameter_settings`). Its system info is ``system`` (``--system-info``), then what
    the run already holds, then what the recording says (:class:`RecordedSystem`): never this
    machine's, which only imports the recording.
    """
    if settings is None:
        settings = _settings_of(parameters)
    identifier = run_id(experiment, benchmark, settings, repetition)
    existing = store.find(identifier)
    if existing is not None:
        _refuse_other_parameters(existing, parameters, settings)
    window = _ImportedWindow(existing)
    for path in files:
        store.add_reports(identifier, window.watched(read_file(path, model)))
    if window.first is None or window.last is None:
        raise StoreError("no reports in " + ", ".join(map(str, files)))
    known = merge_system(window.recorded.info(), existing.system if existing else {})
    run = Run(
        id=identifier,
        experiment=experiment,
        benchmark=benchmark,
        settings=settings,
        repetition=repetition,
        parameters={**(existing.parameters if existing else {}), **parameters},
        system=merge_system(known, system or {}),
        start=window.begin or window.first,
        end=window.end or window.last,
    )
    store.save_run(run)
    return run, window.count


def _settings_of(parameters: dict[str, float]) -> str:
    """The settings a run without ``--settings`` is named by: its parameters (``p=4``).

    Raises:
        StoreError: with no parameters, or one whose name would cut the run's id.
    """
    if not parameters:
        raise StoreError(
            "give --settings (the run's settings, e.g. 250W or 877MHz,1065MHz), or "
            "--param NAME=VALUE to name the run after its parameters"
        )
    for name in parameters:
        if "/" in name:
            raise StoreError(f"--param {name}: a name with '/' cannot name a run; give --settings")
    return parameter_settings(parameters)


def _refuse_other_parameters(existing: Run, parameters: dict[str, float], settings: str) -> None:
    """A run is named by its experiment, benchmark, settings and repetition, not by its
    parameters: files imported with other values of the existing run's parameters are another
    run, which the error says how to name (or how to add them to this one).

    Raises:
        StoreError: when a parameter has another value in ``existing``.
    """
    conflicts = [
        name
        for name, value in parameters.items()
        if name in existing.parameters and existing.parameters[name] != value
    ]
    if not conflicts:
        return
    stored = ", ".join(f"{n}={number_text(existing.parameters[n])}" for n in conflicts)
    wanted = parameter_settings(parameters)
    keep = " ".join(f"--param {n}={number_text(existing.parameters[n])}" for n in conflicts)
    raise StoreError(
        f"run {existing.id} already exists with {stored}, and a run is named by its "
        f"experiment, benchmark, settings and repetition, not by its parameters: to "
        f"import {wanted} as a run of its own, give --settings {settings},{wanted} "
        f"(without --settings, the run is named {wanted}); to add these files to the "
        f"existing run, give {keep}"
    )


class _ImportedWindow:
    """What the imported reports say of the run's window, seen as they stream into the
    store: their first and last times (from the existing run's window, when adding to one),
    the experiment's begin and end events, how many, and the system they were recorded on."""

    def __init__(self, existing: Run | None) -> None:
        self.first: datetime | None = existing.start if existing else None
        self.last: datetime | None = existing.end if existing else None
        self.begin: datetime | None = None
        self.end: datetime | None = None
        self.count = 0
        self.recorded = RecordedSystem()

    def watched(self, reports: Iterator[Report]) -> Iterator[Report]:
        for report in reports:
            self.count += 1
            self.recorded.add(report)
            moment = report.timestamp
            self.first = moment if self.first is None else min(self.first, moment)
            self.last = moment if self.last is None else max(self.last, moment)
            if isinstance(report, EventReport):
                self._event(report)
            yield report

    def _event(self, report: EventReport) -> None:
        if report.event == "experiment_begin":
            self.begin = report.timestamp
        if report.event == "experiment_end":
            self.end = report.timestamp


# --- what the commands print ----------------------------------------------------------------------

RUNS_HEADER = ("run", "parameters", "start (UTC)", "duration s", "reports", "exports")
"""``wattflow runs list``'s columns."""

ENERGY_HEADER = (
    "sensor", "workload", "kind", "start (UTC)", "end (UTC)", "duration s",
    "cpu J", "dram J", "gpu J", "total J", "reason",
)  # fmt: skip
"""``wattflow runs energy``'s columns."""


def run_row(run: Run, reports: int) -> tuple[str, ...]:
    """``wattflow runs list``: a run, its parameters, window, reports and exports."""
    return (
        run.id,
        ", ".join(f"{k}={v:g}" for k, v in run.parameters.items()),
        run.start.strftime("%Y-%m-%d %H:%M:%S"),
        f"{run.duration_s:.1f}",
        str(reports),
        ", ".join(
            name if outcome == "written" else f"{name} ({outcome})"
            for name, outcome in sorted(run.exports.items())
        ),
    )


def energy_row(report: TargetEnergyReport) -> tuple[str, ...]:
    """``wattflow runs energy``: one TargetEnergyReport, the energy formula's record of a
    workload that ended."""
    energy = report.energy
    return (
        report.sensor,
        report.target,
        str(report.metadata.get("target_kind", "")),
        report.start.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
        report.end.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
        f"{(report.end - report.start).total_seconds():.3f}",
        *(f"{energy.get(scope, 0.0):.3f}" for scope in ("cpu", "dram", "gpu")),
        f"{sum(energy.values()):.3f}",
        report.reason,
    )


def show_lines(run: Run, kinds: Mapping[str, int]) -> list[str]:
    """``wattflow runs show``: a run's description, its reports by kind, events, system info
    and exports, in rich's markup."""
    lines = [
        f"[bold]{run.id}[/bold]",
        f"window: {run.start.isoformat()} – {run.end.isoformat()} ({run.duration_s:.1f} s)",
        f"parameters: {run.parameters or '-'}",
        "reports: " + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"),
    ]
    for event in run.events:
        data = "" if event.data is None else event.data
        lines.append(f"  {event.timestamp.isoformat()}  {event.event}  {data}")
    lines.append(f"system: {orjson.dumps(run.system).decode()}")
    lines += [f"export {name}: {outcome}" for name, outcome in sorted(run.exports.items())]
    return lines


def import_lines(run: Run, imported: int, held: int) -> list[str]:
    """``wattflow runs import``'s answer; it says when the run held reports already, as
    importing a file twice stores its reports twice."""
    lines = [f"imported {counted(imported, 'report')} into {run.id} ({run.start} – {run.end})"]
    if held > imported:
        lines.append(
            f"{run.id} already held reports; it now holds {held} (importing "
            f"a file twice stores its reports twice)"
        )
    return lines


def counted(number: int, noun: str) -> str:
    """``1 run``, ``3 runs``: a count with its noun, singular for one."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def print_lines(console: Console, lines: Sequence[str]) -> None:
    """Lines on the console, each as rich prints it."""
    for line in lines:
        console.print(line)


def print_rows(console: Console, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on a terminal; tab-separated lines, the header first, for scripts."""
    if console.is_terminal:
        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    for row in (header, *rows):
        print("\t".join(row))
