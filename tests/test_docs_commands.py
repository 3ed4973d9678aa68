"""Every ``wattflow run``, ``wattflow sensor`` and ``wattflow check`` command line in the code
blocks of the README and docs/ parses: no flag the command refuses, no unknown backend.

A user copies these commands first; one with a flag that does not exist (``--bucket`` for the
influxdb2 output's ``--db``) fails at the first step. Each command goes through the command's own
argument parsing and the validation of its settings (:func:`~wattflow.service.cli.
load_run_config`, with no environment): nothing is run or contacted, so a path or an address in
an example needs to exist nowhere. Two kinds are parsed only, their settings not validated: a
command shown failing (the block's next line is ``wattflow: error: …``), and one that reads a
``--config-file`` (the reader's file).

Placeholders follow two rules. ``…`` or ``...`` (flags left out: an example's input) is dropped,
and brackets around an optional part (``[--rp RP]``) are taken off, so that what is left is
checked. A command with a word in capitals where a backend's type goes (``--input TYPE``), the
shape of a command rather than one, is skipped.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from wattflow.formats.errors import WattflowError
from wattflow.service.cli import load_run_config, parse_run_args, sensor_run_args
from wattflow.service.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*```")
SUBCOMMANDS = ("run", "sensor", "check")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
LEFT_OUT = {"…", "..."}
"""A word that stands for flags left out of the example."""
TYPE_FLAGS = ("--input", "--output", "--pre-processor")


@dataclass(frozen=True)
class Command:
    """One command line of a page's code block: where it is, its subcommand and arguments."""

    where: str
    subcommand: str
    args: list[str]
    parse_only: bool = False
    """Whether only its flags are checked, not its settings (the module's docstring)."""


def code_lines(page: Path) -> list[tuple[int, str]]:
    """The lines inside the page's fenced code blocks, each line continued with ``\\`` joined
    to the next, numbered by its first line; each block ends with an empty line."""
    lines: list[tuple[int, str]] = []
    inside = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            if inside:  # an empty line ends the block: what follows a command is in its block
                lines.append((number, ""))
            inside, pending = not inside, None
            continue
        if not inside:
            continue
        start, text = pending if pending is not None else (number, "")
        text += line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
        else:
            pending = None
            lines.append((start, text))
    return lines


def shown(page: Path) -> str:
    """The page's path as the test names it: from the repository's root."""
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def commands_of(page: Path) -> list[Command]:
    """The ``wattflow run|sensor|check`` commands of the page's code blocks, each cut at the
    first shell operator (a pipe, ``&&``, a redirection); comments dropped."""
    found = []
    lines = code_lines(page)
    followed_by = [text for _, text in lines[1:]] + [""]
    for (number, line), after in zip(lines, followed_by, strict=False):
        if "wattflow" not in line:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (a JSON or YAML block quoting a command)
            continue
        for index, word in enumerate(words[:-1]):
            if word == "wattflow" and words[index + 1] in SUBCOMMANDS:
                rest = words[index + 2 :]
                cut = next((i for i, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))
                where = f"{shown(page)}:{number}"
                args = rest[:cut]
                parse_only = after.startswith("wattflow: error:") or "--config-file" in args
                found.append(Command(where, words[index + 1], args, parse_only))
    return found


def is_a_shape(args: list[str]) -> bool:
    """Whether the command is the shape of commands (``--input TYPE``), not one to run."""
    kinds = [args[i + 1] for i, word in enumerate(args[:-1]) if word in TYPE_FLAGS]
    return any(kind.isupper() for kind in kinds)


def filled(args: list[str]) -> list[str]:
    """The arguments without the words that stand for flags left out, and with the brackets
    of an optional part taken off (``[--user U`` ``--password-file F]``)."""
    words = [word for word in args if word not in LEFT_OUT]
    return [
        word.removeprefix("[").removesuffix("]") if word.strip("[]") else word for word in words
    ]


COMMANDS = [command for page in PAGES for command in commands_of(page)]
CHECKED = [command for command in COMMANDS if not is_a_shape(command.args)]


def run_args(command: Command) -> list[str]:
    """The ``wattflow run`` arguments the command stands for (``wattflow sensor`` is ``wattflow
    run --input nvml …``; ``wattflow check`` takes ``wattflow run``'s)."""
    args = filled(command.args)
    return sensor_run_args(args) if command.subcommand == "sensor" else args


def test_the_pages_hold_commands_and_most_are_checked() -> None:
    """The extraction finds the commands (a change of the pages' layout that hid them all would
    pass every check below), and the placeholder rule skips few."""
    assert len(COMMANDS) > 40
    assert len(CHECKED) > 0.95 * len(COMMANDS)


@pytest.mark.parametrize("command", CHECKED, ids=[command.where for command in CHECKED])
def test_a_documented_command_line_parses(command: Command) -> None:
    args = run_args(command)
    if "--help" in args or "-h" in args[:1]:
        pytest.skip("help, which prints and exits")
    try:
        if command.parse_only:
            parse_run_args(args)
        else:
            load_run_config(args, environ={})
    except WattflowError as error:
        pytest.fail(f"{command.where}: wattflow {command.subcommand}: {error}")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "wattflow run --input socket --output influxdb2 --uri http://i:8086 --bucket power",
            "unrecognized arguments: --bucket power",
        ),
        ("wattflow run --input sockets --port 9080", "--input sockets: unknown input"),
        (
            "wattflow run --input csv --output jsonl --file out.jsonl",
            "input.puller_csv.files: required setting is missing",
        ),
    ],
)
def test_the_check_finds_a_flag_or_a_backend_that_does_not_exist(
    tmp_path: Path, line: str, message: str
) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"Text.\n\n```sh\n{line}\n```\n")
    (command,) = commands_of(page)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config(run_args(command), environ={})


def test_a_command_shown_failing_is_only_parsed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```\n$ wattflow run --input csv --output jsonl --file o.jsonl\n"
        "wattflow: error: input.puller_csv.files: required setting is missing\n"
        "$ wattflow run --input csv --files a.csv --output jsonl --file o.jsonl\n```\n"
    )
    assert [command.parse_only for command in commands_of(page)] == [True, False]
