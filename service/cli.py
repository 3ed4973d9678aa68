"""The ``wattflow`` command.

``wattflow run`` takes SmartWatts' command line: global flags, then any number of
``--input TYPE …`` and ``--output TYPE …`` groups whose flags belong to that backend. Flags are
generated from each backend's and formula's pydantic config model, so the model is the one place
that documents, validates and names a setting.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from wattflow.formats.errors import WattflowError

if TYPE_CHECKING:
    from wattflow.actors.pipeline import Pipeline, PipelineResult
    from wattflow.actors.registry import Registry
    from wattflow.service.config import ServiceConfig

# The service's modules (actors, formulas, configuration) are imported where they are used:
# `wattflow runs` and `wattflow export` start without them, which is most of their start-up.

logger = logging.getLogger("wattflow")

GROUP_FLAGS = ("--input", "--output", "--pre-processor")


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors become one-line :class:`ConfigError`s."""

    def error(self, message: str) -> NoReturn:
        from wattflow.service.config import ConfigError

        raise ConfigError(message)


def flag_names(name: str, field: FieldInfo, prefix: str = "") -> list[str]:
    """A setting's flags: those its field names, else ``--the-field-name``; then the flags of
    its old names (:func:`old_flag_names`), which still work.

    ``prefix`` goes before the setting's name in the flags made from it (``--queue-max-batch``).
    """
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flags = extra.get("flags")
    if isinstance(flags, list):
        return [str(f) for f in flags] + old_flag_names(name, field, prefix)
    return [_flag(prefix + name), *old_flag_names(name, field, prefix)]


def old_flag_names(name: str, field: FieldInfo, prefix: str = "") -> list[str]:
    """The flags of a renamed setting's old names (``--tick-lateness`` for ``tick_lateness_ms``)."""
    from wattflow.service import config as service_config

    return [_flag(prefix + old) for old in service_config.old_names(name, field)]


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _add_model_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str], prefix: str = ""
) -> set[str]:
    """Add a flag per field of ``model``; return the field names added."""
    added = set()
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kwargs: dict[str, Any] = {"dest": prefix + name, "default": argparse.SUPPRESS}
        if field.annotation is bool:
            kwargs.update(action="store_const", const=True)
        else:
            kwargs["metavar"] = name.upper()
        description = field.description or ""
        if field.default not in (None, "", PydanticUndefined) and field.annotation is not bool:
            description += f" Default: {field.default}."
        old = old_flag_names(name, field, prefix)
        if old:
            description += f" Old name, deprecated: {', '.join(old)}."
        # argparse formats help with %: a literal one ("utilisation (%)") must be doubled.
        help_text = description.replace("%", "%%")
        parser.add_argument(*flag_names(name, field, prefix), help=help_text, **kwargs)
        added.add(name)
    return added


def _backend_parser(
    group: str, kind: str, prog: str | None = None, usage: str | None = None, epilog: str = ""
) -> argparse.ArgumentParser:
    """The flags of one group (``--input csv``, ``--pre-processor k8s``). No ``-h``: PowerAPI's
    k8s pre-processor takes it for ``--api-host``; ``--help`` lists the group's flags.

    ``prog``, ``usage`` and ``epilog`` are for a command that stands for the group (``wattflow
    sensor nvml``), whose help names that command and says what else it takes.
    """
    from wattflow.service import config as service_config
    from wattflow.service.config import ConfigError

    registry: Registry[Any] = service_config._registry(group.replace("-", "_"))
    try:
        model = registry.get(kind).config_model
    except ValueError as error:
        raise ConfigError(f"--{group} {kind}: {error}") from None
    parser = _Parser(
        prog=prog or f"wattflow run --{group} {kind}", usage=usage, add_help=False, epilog=epilog
    )
    parser.add_argument("--help", action="help", help="Show this backend's flags and exit.")
    _add_model_flags(parser, model, skip={"type"})
    return parser


RUN_EXIT_CODES = (
    "Exit codes: 0 when done (the input ended or a signal stopped it) with every report that "
    "entered written or dead-lettered; 1 for a failure at run time: an input that broke off, "
    "an actor that kept failing, reports not written or unaccounted for, a second signal "
    "during the drain, or a --workers worker that died, even one restarted and drained "
    "cleanly after; 2 for bad usage or configuration, found before anything runs."
)
"""The end of ``wattflow run --help``: what a script or a supervisor learns from the exit code
(docs/operations.md, Exit codes and errors)."""


def _global_parser() -> argparse.ArgumentParser:
    from wattflow.actors.pullers import pullers
    from wattflow.actors.pushers import pushers
    from wattflow.actors.runtime import QueueConfig
    from wattflow.service import config as service_config
    from wattflow.service.config import ServiceConfig

    parser = _Parser(
        prog="wattflow run",
        description="Run the formula service. Inputs and outputs are given as groups: "
        "--input TYPE [its flags] … --output TYPE [its flags] …; "
        f"input types: {', '.join(pullers.names())}; output types: {', '.join(pushers.names())}. "
        "`wattflow run --input TYPE --help` lists a backend's flags.",
        epilog=RUN_EXIT_CODES,
    )
    _add_model_flags(
        parser, ServiceConfig, skip={"inputs", "outputs", "formulas", "queue", "pre_processors"}
    )
    parser.add_argument(
        "--config-file",
        dest="config_file",
        type=Path,
        default=None,
        help="PowerAPI JSON config file, or wattflow TOML (by its suffix).",
    )
    _add_model_flags(parser, QueueConfig, skip={"when_full"}, prefix="queue_")
    seen: set[str] = set()
    for name, model in service_config.formula_settings().items():
        parser.add_argument(
            f"--disable-{name}-formula",
            dest=f"disable_{name}_formula",
            action="store_const",
            const=True,
            default=argparse.SUPPRESS,
            help=f"Do not run the {name} formula.",
        )
        seen |= _add_model_flags(parser, model, skip=seen)
    return parser


def _split_groups(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """Split argv into global tokens and ``(group, type, tokens)`` backend groups."""
    from wattflow.service.config import ConfigError

    head: list[str] = []
    groups: list[tuple[str, str, list[str]]] = []
    tokens = list(argv)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        flag, _, inline = token.partition("=")
        if flag in GROUP_FLAGS:
            if inline:
                kind = inline
            elif index + 1 < len(tokens) and not tokens[index + 1].startswith("-"):
                index += 1
                kind = tokens[index]
            else:
                raise ConfigError(f"{flag}: expected a backend type after it")
            groups.append((flag[2:], kind, []))
        elif groups:
            groups[-1][2].append(token)
        else:
            head.append(token)
        index += 1
    return head, groups


DEFAULT_NAMES = {"input": "puller", "output": "pusher", "pre_processor": "pre_processor"}
"""An unnamed group's name is this and its type (``puller_csv``), as PowerAPI names it."""


def parse_run_args(argv: Sequence[str]) -> tuple[dict[str, Any], Path | None]:
    """Turn ``wattflow run``'s command line into a settings layer and the config file path.

    Raises:
        ConfigError: on an unknown flag or backend.
    """
    from wattflow.service.config import normalise

    head, groups = _split_groups(argv)
    layer: dict[str, Any] = {}
    names: dict[str, set[str]] = {}
    for group, kind, tokens in groups:
        parsed, rest = _backend_parser(group, kind).parse_known_args(tokens)
        settings = {"type": kind, **vars(parsed)}
        key = normalise(group)
        name = normalise(str(settings.pop("name", f"{DEFAULT_NAMES[key]}_{kind}")))
        base, number = name, 2
        taken = names.setdefault(key, set())
        while name in taken:
            name, number = f"{base}_{number}", number + 1
        taken.add(name)
        layer.setdefault(key, {})[name] = settings
        head.extend(rest)
    parsed_head = vars(_global_parser().parse_args(head))
    config_file = parsed_head.pop("config_file", None)
    queue = {
        k[len("queue_") :]: parsed_head.pop(k) for k in list(parsed_head) if k.startswith("queue_")
    }
    if queue:
        layer["queue"] = queue
    layer.update(parsed_head)
    return layer, config_file


def load_run_config(argv: Sequence[str], environ: dict[str, str] | None = None) -> ServiceConfig:
    """Layer the config file, the environment and the flags, and validate them.

    Raises:
        ConfigError: naming the setting at fault.
    """
    from wattflow.service import config as service_config
    from wattflow.service.config import normalise

    flags, config_file = parse_run_args(argv)
    file_layer = service_config.load_file(config_file) if config_file else {}
    environ = dict(os.environ) if environ is None else environ
    if config_file is None and (env_file := environ.get("WATTFLOW_CONFIG_FILE")):
        file_layer = service_config.load_file(Path(env_file))
    env_layer = service_config.load_environment(
        {k: v for k, v in environ.items() if k != "WATTFLOW_CONFIG_FILE"}
    )
    raw = service_config.merge(file_layer, env_layer, flags)
    return service_config.build({normalise(k): v for k, v in raw.items()})


def configure_logging(verbose: bool, quiet: bool = False, label: str = "") -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {label}%(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _fail(message: str, code: int) -> int:
    print(f"wattflow: error: {message}", file=sys.stderr)
    return code


YOUNG_COLLECTION_THRESHOLD = 100_000
"""Net allocations of tracked objects between two young garbage collections while running."""


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most memory arenas it keeps (``malloc.h``)."""


def one_malloc_arena() -> bool:
    """Have glibc's malloc keep one arena for every thread of the process; whether it could.

    The CSV and JSON Lines replays parse in a thread of their own, whose arrays the event loop
    frees: with an arena per thread, glibc gives that thread's arena back to the system and
    takes it again chunk after chunk (60 % more page faults on a one-socket replay, 4 % more
    CPU). The threads of a run take turns on the interpreter lock anyway, so they hardly
    contend for one arena. Only the command sets it, as it owns its process; elsewhere
    (another C library, a Python without ``ctypes``) nothing changes.
    """
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (ImportError, OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, 1))


@contextmanager
def few_collections() -> Iterator[None]:
    """Collect cyclic garbage rarely while ``wattflow run`` runs its pipeline (in each worker
    under ``--workers``), and while ``wattflow export`` reads a run (its pages of rows are the
    same kind of short-lived mass).

    Reports are nested dicts, thousands of them in the mailboxes at any time, and almost all
    are freed by reference counting once written. With the default threshold (700 net
    allocations) the collector runs every few dozen reports and, every so often, walks every
    report in flight: a fifth of the run's time for no garbage found. The objects that exist
    before the run (modules, schemas, configuration) are frozen out of the collector's walks
    for the same reason.

    It also keeps malloc to one arena (:func:`one_malloc_arena`). The collector's settings
    belong to the whole process, so only the command, which owns its process, changes them;
    the library (``Pipeline.run``) leaves them to whatever program embeds it. The collector's
    are undone when the run ends, for callers of :func:`main` in a longer process; the one
    arena stays, harmless to any program.
    """
    one_malloc_arena()
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], YOUNG_COLLECTION_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def run_command(argv: Sequence[str]) -> int:
    """``wattflow run``: exit 0 when done, 2 for bad usage or configuration, 1 at run time
    (:data:`RUN_EXIT_CODES`)."""
    import asyncio

    from wattflow.service.pipeline import Interrupted, assemble, check, serve, status_server

    try:
        config = load_run_config(argv)
        configure_logging(config.verbose)
        if config.workers > 1:
            from wattflow.service.workers import run_workers

            with few_collections():
                return run_workers(config)
        pipeline = assemble(config)
        asyncio.run(check(pipeline))
        status = status_server(config, pipeline)
    except WattflowError as error:  # configuration, or an input or output that cannot work
        return _fail(str(error), 2)
    loop = asyncio.new_event_loop()
    try:
        with few_collections():
            result = loop.run_until_complete(serve(pipeline, status))
    except Interrupted as interrupted:
        _fail(str(interrupted), 1)
        # A thread may be stuck in the sink (that is why the operator insisted): leave without
        # joining it, which asyncio.run and a normal exit would both wait for.
        _exit_now(1)
    if not result.deadline_passed:  # else a thread may be stuck in a sink: do not join it
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
    problems = run_problems(result, pipeline)
    for problem in problems:
        _fail(problem, 1)
    code = 1 if problems else 0
    if result.deadline_passed:
        _exit_now(code)
    return code


def run_problems(result: PipelineResult, pipeline: Pipeline) -> list[str]:
    """What makes a finished run exit 1: an actor failed, reports not written or unaccounted."""
    ledger = result.ledger
    problems = list(result.failures.values())
    if ledger.dead_out:
        problems.append(f"{ledger.dead_out} reports could not be written: {_reasons(pipeline)}")
    if not ledger.balanced():
        problems.append(f"reports unaccounted for: {ledger.summary()}")
    return problems


def _exit_now(code: int) -> NoReturn:
    """Leave without joining threads: one may be stuck in a sink that never answers (a second
    signal, or a drain deadline that cancelled writes in progress), and a normal exit would wait for
    it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reasons(pipeline: Pipeline) -> str:
    reasons = pipeline.dead_letters.by_reason.most_common(3)
    return "; ".join(f"{count} × {reason}" for reason, count in reasons)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wattflow`` console script."""
    parser = argparse.ArgumentParser(
        prog="wattflow", description="Watts per process, container and GPU, PowerAPI-compatible."
    )
    parser.add_argument(
        "--version", action="version", version=f"wattflow {metadata.version('wattflow')}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each command parses its own flags (`wattflow run --help`), so these only name them.
    commands.add_parser("run", add_help=False, help="the formula service; takes SmartWatts' flags")
    commands.add_parser(
        "demo", add_help=False, help="replay a bundled recording through the formulas"
    )
    commands.add_parser(
        "sensor",
        add_help=False,
        help="sample a sensor and send its reports to outputs: `wattflow sensor nvml --output …`",
    )
    commands.add_parser(
        "check",
        add_help=False,
        help="say whether RAPL, NVML and the given inputs and outputs work on this machine",
    )
    commands.add_parser("runs", add_help=False, help="import, list, show and mark measurement runs")
    commands.add_parser(
        "export", add_help=False, help="write runs as gpu-dir, Extra-P, ROSS or HPCToolkit"
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command in ("runs", "export"):
        return _runs(args.command, rest)
    if args.command == "run":
        return run_command(rest)
    if args.command == "sensor":
        return sensor_command(rest)
    if args.command == "check":
        return _check(rest)
    return _demo(rest)


SENSORS = {
    "nvml": "NVIDIA GPUs through NVML: power, energy, utilisation and each process's share, as "
    "GPUReports (its flags: `wattflow sensor nvml --help`)",
}
"""The sensors ``wattflow sensor`` runs, and what each reads."""

SENSOR_OUTPUTS = (
    "Outputs are given after the sensor's flags, as for `wattflow run`: --output TYPE [its flags] "
    "…, any number of them; types: {types}. Each writes GPUReports unless it names another "
    "--model; `wattflow run --output TYPE --help` lists a type's flags. Global flags of "
    "`wattflow run` (--dead-letters, --http-port, …) are taken too. No formula runs."
)
"""The end of ``wattflow sensor NAME --help``: how outputs are given."""


def sensor_usage() -> str:
    """``wattflow sensor --help``: the sensors, what each reads, and how outputs are given."""
    from wattflow.actors.pushers import pushers

    listed = "\n".join(
        textwrap.fill(
            what,
            79,
            break_on_hyphens=False,
            initial_indent=f"  {name:<8}",
            subsequent_indent=" " * 10,
        )
        for name, what in SENSORS.items()
    )
    outputs = SENSOR_OUTPUTS.format(types=", ".join(pushers.names()))
    outputs = textwrap.fill(outputs, 79, break_on_hyphens=False)
    return (
        "usage: wattflow sensor NAME [its flags] --output TYPE [its flags] …\n\n"
        "Run a sensor alone, without formulas, and write its readings to outputs.\n\n"
        f"sensors:\n{listed}\n\n{outputs}"
    )


def _sensor_help(argv: Sequence[str]) -> str | None:
    """The help that ``wattflow sensor ARGV`` asks for, or None when it asks for none: ``-h`` or
    ``--help`` alone, or among a sensor's own flags (before its first ``--output``)."""
    from wattflow.actors.pushers import pushers

    if not argv or argv[0] in ("-h", "--help"):
        return sensor_usage() if argv else None
    head, _ = _split_groups(argv[1:])
    if argv[0] not in SENSORS or not {"-h", "--help"} & set(head):
        return None
    epilog = SENSOR_OUTPUTS.format(types=", ".join(pushers.names()))
    prog = f"wattflow sensor {argv[0]}"
    usage = f"{prog} [its flags] --output TYPE [its flags] …"
    return _backend_parser("input", argv[0], prog, usage, epilog).format_help()


def sensor_command(argv: Sequence[str]) -> int:
    """``wattflow sensor nvml [its flags] --output TYPE …``: the sampler alone, no formula.
    ``--help`` is answered here, in the sensor's terms: passed on to ``wattflow run`` it would
    describe that command's input instead."""
    from wattflow.service.config import ConfigError

    try:
        help_text = _sensor_help(argv)
        if help_text is not None:
            print(help_text)
            return 0
        tokens = sensor_run_args(argv)
    except ConfigError as error:
        return _fail(str(error), 2)
    return run_command(tokens)


def sensor_run_args(argv: Sequence[str]) -> list[str]:
    """The ``wattflow run`` command line that ``wattflow sensor ARGV`` stands for.

    It is ``wattflow run --input nvml`` with the formulas off and every output writing the
    sampler's reports (``--model GPUReport`` unless an output names another kind).

    Raises:
        ConfigError: no sensor named, or an unknown one.
    """
    from wattflow.service import config as service_config
    from wattflow.service.config import ConfigError

    if not argv or argv[0].startswith("-"):
        raise ConfigError(
            "sensor: name the sensor to run, e.g. `wattflow sensor nvml --output …` "
            "(`wattflow sensor --help` lists them)"
        )
    kind, rest = argv[0], list(argv[1:])
    if kind not in SENSORS:
        raise ConfigError(f"sensor: unknown sensor {kind!r}; known: {', '.join(SENSORS)}")
    head, groups = _split_groups(rest)
    tokens = ["--input", kind, *head]
    for group, backend, flags in groups:
        named = any(flag in ("-m", "--model") or flag.startswith("--model=") for flag in flags)
        extra = [] if group != "output" or named else ["--model", "GPUReport"]
        tokens += [f"--{group}", backend, *extra, *flags]
    disable = [f"--disable-{name}-formula" for name in service_config.formula_settings()]
    return [*tokens, *disable]


def _runs(command: str, argv: Sequence[str]) -> int:
    from wattflow.service.runs_cli import export_command, runs_command

    configure_logging(verbose=False, quiet=True)
    try:
        if command == "runs":
            return runs_command(argv)
        with few_collections():  # an export reads a run's reports a page at a time, as a run
            return export_command(argv)
    except (WattflowError, ValueError, OSError) as error:  # a bad run, store or output path
        return _fail(str(error), 2)


CHECK_USAGE = """usage: wattflow check [--config-file FILE] [--input TYPE [its flags]] …
                      [--output TYPE [its flags]] …

Check this node before running the service: RAPL through powercap and perf, and NVML. It reads
the configuration as `wattflow run` does (--config-file or the file WATTFLOW_CONFIG_FILE names,
the POWERAPI_*/WATTFLOW_* variables, the flags) and contacts each input and output it
configures. Exit 0: each works; 1: a server cannot be reached; 2: bad flags or a setting
`wattflow run` would refuse at start (a missing secret file, a port in use).
`wattflow run --input TYPE --help` lists a backend's flags."""


def _check(argv: Sequence[str]) -> int:
    from wattflow.service.check import check_command

    if argv[:1] in (["-h"], ["--help"]):
        print(CHECK_USAGE)
        return 0
    try:
        return check_command(argv)
    except WattflowError as error:
        return _fail(str(error), 2)


def _demo(argv: Sequence[str]) -> int:
    from wattflow.service.demo import demo_command

    return demo_command(argv)


if __name__ == "__main__":
    sys.exit(main())
