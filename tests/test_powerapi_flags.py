"""Every flag of PowerAPI 2.10's command line goes through wattflow's, in every combination.

The flags are not listed here: they are read from PowerAPI 2.10.0's own parser
(``CommonCLIParsingManager`` in ``powerapi/cli/common_cli_parsing_manager.py``, the
``powerapi==2.10.0`` test dependency) by walking its groups: each backend of each group in
:data:`GROUPS`, each of its arguments under each of its names. A flag PowerAPI gains or a
backend it adds shows up here as a failure until wattflow takes it (and :data:`VALUES` gives it
a value to try).

The formula's flags are SmartWatts 2.4.1's, which its own package adds to PowerAPI's parser
(``generate_smartwatts_parser`` in ``smartwatts/__main__.py``). SmartWatts 2.4.1 requires
``powerapi[everything]``, the Kubernetes client among it, too heavy for a test dependency, so
:data:`SMARTWATTS_FLAGS` is a table extracted from that function by hand (its
``pm.add_argument`` calls: name, and whether it is a flag without a value), named after its
source and version.

Each combination is checked twice:

1. parsed (every subset of a backend's arguments, short names and long ones, ``--x v`` and
   ``--x=v``): wattflow takes each flag and puts its value in the setting of that name;
2. validated: every subset that holds what PowerAPI 2.10 itself needs to start the backend
   (:func:`needed`, read from its generator, ``powerapi/cli/generator.py``)
   builds a configuration, as the whole set does from PowerAPI's JSON keys and its
   ``POWERAPI_<GROUP>_<NAME>_<ARGUMENT>`` variables.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from powerapi.cli.common_cli_parsing_manager import (  # type: ignore[import-untyped]
    CommonCLIParsingManager,
)

from wattflow.service import config as service_config
from wattflow.service.cli import load_run_config, parse_run_args
from wattflow.service.config import ConfigError, ServiceConfig, flag_keys, renamed_settings

GROUPS = ["input", "output", "pre-processor"]
"""The groups of PowerAPI's parser this test covers; what PowerAPI needs to start a
pre-processor is read from ``PreProcessorGenerator`` (:func:`powerapi_processor_needs`). The
groups not covered are named in
:func:`test_every_group_of_powerapis_parser_is_covered_or_named`."""

NOT_YET = {
    "post-processor": "PowerAPI 2.10 defines no post-processor",
}
"""Groups of PowerAPI's parser that wattflow does not cover yet, and why."""

ENV_GROUPS = {"input": "INPUT", "output": "OUTPUT", "pre-processor": "PRE_PROCESSOR"}
"""Each group's part of its variables' names (PowerAPI's ``POWERAPI_<GROUP>_`` prefixes)."""

BOUND_INPUT = "puller"
"""The input a pre-processor's command line is checked with (PowerAPI's, like wattflow's,
needs ``--puller`` to name an input)."""
BOUND_INPUT_FLAGS = ["--input", "socket", "--name", BOUND_INPUT]

VALUES: dict[tuple[str, str, str], str] = {
    ("input", "mongodb", "uri"): "mongodb://127.0.0.1:27017",
    ("input", "mongodb", "db"): "powerapi",
    ("input", "mongodb", "collection"): "hwpc",
    ("input", "socket", "host"): "0.0.0.0",
    ("input", "socket", "port"): "9080",
    ("input", "csv", "files"): "rapl.csv,msr.csv,core.csv",
    ("input", "filedb", "filename"): "hwpc.json",
    ("output", "filedb", "filename"): "power.json",
    ("output", "virtiofs", "vm_name_regexp"): r".*machine-qemu\\x2d[0-9]+\\x2d([^/.]+)\.scope",
    ("output", "virtiofs", "root_directory_name"): "/var/lib/wattflow/vms",
    ("output", "virtiofs", "vm-directory-name-prefix"): "vm-",
    ("output", "virtiofs", "vm-directory-name-suffix"): ".d",
    ("output", "mongodb", "uri"): "mongodb://127.0.0.1:27017",
    ("output", "mongodb", "db"): "powerapi",
    ("output", "mongodb", "collection"): "power",
    ("output", "prometheus", "tags"): "scope,socket",
    ("output", "prometheus", "uri"): "127.0.0.1",
    ("output", "prometheus", "port"): "9100",
    ("output", "prometheus", "metric-name"): "power",
    ("output", "prometheus", "metric-description"): "power in W",
    ("output", "csv", "directory"): "out",
    ("output", "csv", "tags"): "scope",
    ("output", "opentsdb", "uri"): "127.0.0.1",
    ("output", "opentsdb", "port"): "4242",
    ("output", "opentsdb", "metric-name"): "power",
    ("output", "influxdb2", "uri"): "http://127.0.0.1:8086",
    ("output", "influxdb2", "tags"): "scope",
    ("output", "influxdb2", "token"): "t0ken",
    ("output", "influxdb2", "org"): "org",
    ("output", "influxdb2", "db"): "power",
    ("output", "influxdb2", "port"): "8086",
    ("pre-processor", "k8s", "api-mode"): "local",
    ("pre-processor", "k8s", "api-key"): "t0ken",
    ("pre-processor", "k8s", "api-host"): "https://10.0.0.1:6443",
    ("pre-processor", "k8s", "puller"): BOUND_INPUT,
}
"""A value PowerAPI and wattflow both take for each argument (``model`` and ``name`` are
given for every backend by :func:`value_of`)."""


def powerapi_needs() -> dict[str, set[str]]:
    """What PowerAPI 2.10's generator reads without a default, per database type, normalised
    (dashes as underscores): the settings of ``db_config[…]`` in each function of
    ``DBActorGenerator.db_factory`` (``powerapi/cli/generator.py``), less those it first asks
    for with ``'…' in db_config``. The module is read, not imported: importing it imports the
    Kubernetes client."""
    spec = importlib.util.find_spec("powerapi.cli.generator")
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    (factory,) = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(t, ast.Attribute) and t.attr == "db_factory" for t in node.targets)
    ]
    needs: dict[str, set[str]] = {}
    for key, function in zip(factory.keys, factory.values, strict=True):
        assert isinstance(key, ast.Constant)
        nodes = list(ast.walk(function))
        read = {
            n.slice.value
            for n in nodes
            if isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Name)
            and n.value.id == "db_config"
            and isinstance(n.slice, ast.Constant)
        }
        asked = {
            n.left.value
            for n in nodes
            if isinstance(n, ast.Compare)
            and isinstance(n.left, ast.Constant)
            and any(isinstance(c, ast.Name) and c.id == "db_config" for c in n.comparators)
        }
        needs[str(key.value)] = {str(k).replace("-", "_") for k in read - asked}
    return needs


def powerapi_processor_needs() -> dict[str, set[str]]:
    """What PowerAPI 2.10's generator reads without a default for each pre-processor type:
    ``processor_config[KEY]`` in its ``_<type>_pre_processor_factory`` (read, not imported, as
    above), less the keys the generator sets itself (the actor's name) and the main config's
    (``verbose``)."""
    spec = importlib.util.find_spec("powerapi.cli.generator")
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    constants = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    set_by_generator = {
        constants.get(t.slice.id)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Name)
    }
    needs: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_pre_processor_factory"):
            read = {
                constants.get(n.slice.id)
                for n in ast.walk(node)
                if isinstance(n, ast.Subscript)
                and isinstance(n.value, ast.Name)
                and n.value.id == "processor_config"
                and isinstance(n.slice, ast.Name)
            }
            kind = node.name.removeprefix("_").removesuffix("_pre_processor_factory")
            needs[kind] = {str(k) for k in read - set_by_generator - {"verbose", None}}
    return needs


WATTFLOW_NEEDS_MORE: dict[tuple[str, str], dict[str, str]] = {
    ("input", "csv"): {
        "files": "PowerAPI starts a CSV input without --files and reads nothing; wattflow "
        "refuses an input with nothing to read",
    },
}
"""Settings wattflow needs where PowerAPI 2.10 does not, each with why: the only refusals of
a command line PowerAPI would start."""

SMARTWATTS_FLAGS: list[tuple[str, bool, str]] = [
    ("disable-cpu-formula", True, ""),
    ("disable-dram-formula", True, ""),
    ("cpu-rapl-ref-event", False, "RAPL_ENERGY_PKG"),
    ("dram-rapl-ref-event", False, "RAPL_ENERGY_DRAM"),
    ("cpu-tdp", False, "125"),
    ("cpu-base-clock", False, "100"),
    ("cpu-base-freq", False, "2100"),
    ("cpu-error-threshold", False, "2.0"),
    ("dram-error-threshold", False, "2.0"),
    ("sensor-reports-frequency", False, "1000"),
    ("learn-min-samples-required", False, "10"),
    ("learn-history-window-size", False, "60"),
    ("learn-error-window-size", False, "60"),
    ("learn-error-window-method", False, "median"),
]
"""SmartWatts 2.4.1's own flags, from ``generate_smartwatts_parser`` in
``smartwatts/__main__.py`` (each ``pm.add_argument(name, …)``: its name, whether it is a flag
without a value, ``is_flag=True``), with a value to try; extracted by hand from the installed
package, since SmartWatts cannot be a test dependency (see the module's docstring)."""


class Argument:
    """One argument of a PowerAPI backend: its names and whether it takes a value."""

    def __init__(self, names: list[str], is_flag: bool, default: Any = None) -> None:
        self.names = names
        self.default = default
        self.long = max(names, key=len)
        self.short = next((n for n in names if len(n) == 1), None)
        self.is_flag = is_flag


def powerapi_backends() -> Iterator[tuple[str, str, list[Argument]]]:
    """Each backend of PowerAPI 2.10's parser: its group, its type and its arguments, read from
    the parser itself."""
    manager = CommonCLIParsingManager()
    for group, backends in manager.subparser.items():
        for kind, backend in backends.items():
            unique = {id(a): a for a in backend.cli_parser.arguments.values()}.values()
            yield group, kind, [Argument(list(a.names), a.is_flag, a.default_value) for a in unique]


def powerapi_root_flags() -> list[Argument]:
    """The top-level flags of PowerAPI 2.10's parser, groups and help left out."""
    manager = CommonCLIParsingManager()
    unique = {id(a): a for a in manager.cli_parser.arguments.values()}.values()
    skip = {"help", *manager.subparser, *NOT_YET}
    return [Argument(list(a.names), a.is_flag) for a in unique if max(a.names, key=len) not in skip]


BACKENDS = [b for b in powerapi_backends() if b[0] in GROUPS]
NEEDS = powerapi_needs() | powerapi_processor_needs()


def needed(group: str, kind: str, arguments: list[Argument]) -> set[str]:
    """The long names of the arguments PowerAPI needs to start the backend: what its generator
    reads without a default, less what its parser gives a default; and what wattflow needs
    more (:data:`WATTFLOW_NEEDS_MORE`). A setting the generator reads under another spelling
    than its parser's (virtiofs: ``vm-name-regexp`` for ``vm_name_regexp``, so PowerAPI 2.10
    cannot start that output) counts under the parser's name."""
    without_default = {a.long for a in arguments if a.default is None}
    names = {a.long.replace("-", "_"): a.long for a in arguments}
    assert NEEDS[kind] <= set(names), f"{kind}: PowerAPI reads {NEEDS[kind] - set(names)}"
    powerapi = {names[k] for k in NEEDS[kind]} & without_default
    return powerapi | set(WATTFLOW_NEEDS_MORE.get((group, kind), {}))


def value_of(group: str, kind: str, argument: Argument) -> str:
    if argument.long == "model":
        return "HWPCReport" if group == "input" else "PowerReport"
    if argument.long == "name":
        return f"my_{kind}"
    try:
        return VALUES[(group, kind, argument.long)]
    except KeyError:
        raise AssertionError(
            f"PowerAPI's --{group} {kind} has --{argument.long}: give it a value in VALUES"
        ) from None


def setting(group: str, kind: str, argument: Argument) -> str:
    """The wattflow setting a PowerAPI argument sets: the one its long name names (dashes as
    underscores), as a setting's own name, a name of its flags, or its former name."""
    model = service_config._registry(_key(group)).get(kind).config_model
    names = {**flag_keys(model), **renamed_settings([model])}
    key = argument.long.replace("-", "_")
    return names.get(key, key)


def command_line(group: str, kind: str, arguments: tuple[Argument, ...], style: str) -> list[str]:
    """``--group kind`` and the arguments: ``short`` names where there is one, else ``long``
    (``--x v``), or ``equals`` (``--x=v``)."""
    tokens = [f"--{group}", kind]
    for argument in arguments:
        value = value_of(group, kind, argument)
        if style == "short" and argument.short is not None:
            tokens += [f"-{argument.short}", value]
        elif style == "equals":
            tokens.append(f"--{argument.long}={value}")
        else:
            tokens += [f"--{argument.long}", value]
    return tokens


def subsets(arguments: list[Argument]) -> Iterator[tuple[Argument, ...]]:
    for size in range(len(arguments) + 1):
        yield from itertools.combinations(arguments, size)


def test_every_group_of_powerapis_parser_is_covered_or_named() -> None:
    groups = set(CommonCLIParsingManager().subparser) | set(NOT_YET)
    assert groups == set(GROUPS) | set(NOT_YET), "a group neither covered nor named in NOT_YET"
    assert {k for _, k, _ in BACKENDS} <= set(NEEDS), "a backend PowerAPI's generator lacks"


@pytest.mark.parametrize(
    ("group", "kind", "arguments"), BACKENDS, ids=[f"{g}-{k}" for g, k, _ in BACKENDS]
)
def test_every_combination_of_a_backends_flags_is_taken(
    group: str, kind: str, arguments: list[Argument]
) -> None:
    checked = 0
    required = needed(group, kind, arguments)
    for chosen in subsets(arguments):
        names = {a.long for a in chosen}
        for style in ("short", "long", "equals"):
            argv = command_line(group, kind, chosen, style)
            try:
                layer, _ = parse_run_args(argv)
            except ConfigError as error:
                raise AssertionError(f"wattflow refuses {argv}: {error}") from None
            ((name, settings),) = layer[_key(group)].items()
            expected_name = value_of(group, kind, Argument(["name"], False))
            assert name == (expected_name if "name" in names else f"{_role(group)}_{kind}")
            for argument in chosen:
                if argument.long != "name":
                    assert settings[setting(group, kind, argument)] == value_of(
                        group, kind, argument
                    ), argv
            if required <= names:
                _validates(argv, group)
            checked += 1
    assert checked == 3 * 2 ** len(arguments)


def _role(group: str) -> str:
    return {"input": "puller", "output": "pusher"}.get(group, "pre_processor")


def _key(group: str) -> str:
    """The group's key in a settings layer (``pre_processor`` for ``--pre-processor``)."""
    return group.replace("-", "_")


def _validates(argv: list[str], group: str) -> ServiceConfig:
    if group == "pre-processor":
        argv = [*BOUND_INPUT_FLAGS, *argv]
    try:
        config = load_run_config(argv, environ={})
    except ConfigError as error:
        raise AssertionError(f"wattflow refuses {argv}: {error}") from None
    built = {
        "input": len(config.inputs),
        "output": len(config.outputs),
        "pre-processor": len(config.pre_processors),
    }
    assert built[group] == 1
    return config


@pytest.mark.parametrize(
    ("group", "kind", "arguments"), BACKENDS, ids=[f"{g}-{k}" for g, k, _ in BACKENDS]
)
def test_powerapis_json_keys_and_variables_give_what_its_flags_give(
    group: str, kind: str, arguments: list[Argument], tmp_path: Path
) -> None:
    """The whole set of a backend's arguments as PowerAPI's JSON config names them (its long
    names, and its short ones) and as its variables do: the same configuration as the flags."""
    flags = _validates(command_line(group, kind, tuple(arguments), "long"), group)
    name = value_of(group, kind, Argument(["name"], False))
    values = {a.long: value_of(group, kind, a) for a in arguments if a.long != "name"}
    for keys in ("long", "short"):
        document: dict[str, Any] = {"type": kind}
        for argument in arguments:
            if argument.long != "name":
                key = argument.short if keys == "short" and argument.short else argument.long
                document[key] = values[argument.long]
        path = tmp_path / f"powerapi-{keys}.json"
        bound = {"input": {BOUND_INPUT: {"type": "socket"}}} if group == "pre-processor" else {}
        path.write_text(json.dumps({**bound, group: {name: document}}))
        from_file = load_run_config(["--config-file", str(path)], environ={})
        assert from_file == flags, keys
    prefix = f"POWERAPI_{ENV_GROUPS[group]}_{name.upper()}_"
    environ = {prefix + "TYPE": kind}
    if group == "pre-processor":
        environ[f"POWERAPI_INPUT_{BOUND_INPUT.upper()}_TYPE"] = "socket"
    environ |= {prefix + k.upper().replace("-", "_"): v for k, v in values.items()}
    assert load_run_config([], environ=environ) == flags


def test_powerapis_root_flags_and_smartwatts_formula_flags_are_taken() -> None:
    argv: list[str] = []
    for argument in powerapi_root_flags():
        assert argument.is_flag, f"--{argument.long} takes a value: give it one here"
        for name in argument.names:
            flag = f"-{name}" if len(name) == 1 else f"--{name}"
            config = load_run_config([flag], environ={})
            assert getattr(config, argument.long) is True, flag
        argv.append(f"--{argument.long}")
    for name, is_flag, value in SMARTWATTS_FLAGS:
        one = [f"--{name}"] if is_flag else [f"--{name}", value]
        if name == "disable-cpu-formula":
            one += ["--disable-rapl-formula"]  # as SmartWatts alone: no other CPU formula
        load_run_config(one, environ={})
        if not (is_flag and name.startswith("disable")):
            argv += one
    load_run_config(argv, environ={})


def test_a_variable_that_splits_two_ways_takes_the_name_the_others_give() -> None:
    """``PULLER_SOCKET_TYPE`` (PowerAPI's default name of the socket input, and its type) also
    reads as the ZeroMQ input ``puller``'s ``socket_type``; the other variables tell which."""
    config = load_run_config(
        [],
        environ={
            "POWERAPI_INPUT_PULLER_SOCKET_TYPE": "socket",
            "POWERAPI_INPUT_PULLER_SOCKET_PORT": "9090",
            "WATTFLOW_INPUT_ZMQ_TYPE": "zeromq",
            "WATTFLOW_INPUT_ZMQ_URI": "tcp://127.0.0.1:5555",
            "WATTFLOW_INPUT_ZMQ_SOCKET_TYPE": "PULL",
        },
    )
    socket, zmq = config.inputs["puller_socket"], config.inputs["zmq"]
    assert (socket.type, getattr(socket, "port", None)) == ("socket", 9090)
    assert (zmq.type, getattr(zmq, "socket_type", None)) == ("zeromq", "PULL")
