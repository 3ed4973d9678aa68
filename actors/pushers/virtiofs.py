"""virtiofs output: each VM's power in a file of a directory shared with that VM.

PowerAPI 2.10's ``--output virtiofs``: a report whose target the regular expression
``--vm_name_regexp`` matches (``re.match``: from the target's start) names a VM, its first
group; the VM's directory is ``ROOT/PREFIX + vm + SUFFIX``, which the VM manager creates and
shares with the VM (virtiofs, or 9p); the file ``power_consumption_package<socket>`` in it
holds the report's power in watts as Python writes a float (``12.5``), without a line break,
rewritten by every report. A guest reads its own package power there (the
:mod:`~wattflow.actors.pullers.filedb` input reads such a file).

Where wattflow differs from PowerAPI 2.10, and why (docs/backends/output-virtiofs.md):

- The file is written inside the VM's directory. PowerAPI joins the directory and the file
  name without a separator, so its file lands beside the directory, in the root
  (``ROOT/vm1power_consumption_package0``), unless the suffix ends with ``/``: with such a
  suffix both write the same file.
- Only reports of ``--scope`` (cpu by default: the package's power) are written. PowerAPI
  writes every report, so SmartWatts' dram estimate of a socket overwrites the package's a
  moment after it is written, and a reader sees either.
- The file is replaced whole (:mod:`~wattflow.actors.pushers.replacing`): PowerAPI truncates
  and writes it in place, so a guest may read it empty.
- A report without a socket is a dead letter, and so is one whose VM directory is missing:
  PowerAPI 2.10 fails on either (its report type has no ``in``; the directory check raises),
  and on a regular expression without a group, which wattflow refuses at start.

A batch writes each file once, with the last of its reports (what writing each in turn
leaves); the others count as written. Reports of targets the expression does not match are
not for this output and count as written, as PowerAPI skips them.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from wattflow.actors.errors import PushError
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.appending import file_error
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.replacing import replace_file
from wattflow.formats.reports import PowerReport, Report

FILE_PREFIX = "power_consumption_package"
"""The file's name before the socket, as PowerAPI 2.10 names it."""


class VirtioFSPusherConfig(PusherConfig):
    """Settings of the virtiofs output (``--output virtiofs -r REGEXP -d ROOT``)."""

    type: Literal["virtiofs"] = "virtiofs"
    vm_name_regexp: str = Field(
        min_length=1,
        description="Regular expression matched from the start of a report's target; its "
        "first group is the VM's name. Reports it does not match are not written.",
        json_schema_extra={"flags": ["-r", "--vm_name_regexp", "--vm-name-regexp"]},
    )
    root_directory_name: Path = Field(
        description="Directory that holds one directory per VM, each shared with its VM.",
        json_schema_extra={"flags": ["-d", "--root_directory_name", "--root-directory-name"]},
    )
    vm_directory_name_prefix: str = Field(
        default="",
        description="What a VM's directory name has before the VM's name.",
        json_schema_extra={"flags": ["-p", "--vm-directory-name-prefix"]},
    )
    vm_directory_name_suffix: str = Field(
        default="",
        description="What a VM's directory name has after the VM's name.",
        json_schema_extra={"flags": ["-s", "--vm-directory-name-suffix"]},
    )
    scope: str = Field(
        default="cpu",
        description="Write only reports of this scope (their metadata's), and those without "
        "one; empty: every report, as PowerAPI 2.10 does (dram then overwrites the package).",
    )

    @field_validator("model")
    @classmethod
    def _power_only(cls, value: str) -> str:
        """The file holds a power: no other kind has one."""
        if value != "PowerReport":
            raise ValueError("the virtiofs output writes PowerReports (a VM's power)")
        return value

    @field_validator("vm_name_regexp")
    @classmethod
    def _one_group(cls, value: str) -> str:
        """PowerAPI takes the VM's name from the first group: an expression without one fails
        at the first report there; here it fails at start, saying why."""
        try:
            compiled = re.compile(value)
        except re.error as error:
            raise ValueError(f"not a regular expression: {error}") from None
        if compiled.groups < 1:
            raise ValueError("the regular expression needs a group: (…) around the VM's name")
        return value

    @classmethod
    def example(cls) -> VirtioFSPusherConfig:
        """libvirt's QEMU machines (``machine-qemu\\x2d1\\x2dvm1.scope``, the scope alone)
        into /var/lib/power."""
        return cls(
            type="virtiofs",
            vm_name_regexp=r".*machine-qemu\\x2d[0-9]+\\x2d([^/.]+)\.scope$",
            root_directory_name=Path("/var/lib/power"),
        )


@pushers.register("virtiofs")
class VirtioFSPusher(Pusher[VirtioFSPusherConfig]):
    """Replaces each VM's file from a worker thread, once a batch."""

    config_model = VirtioFSPusherConfig

    def __init__(self, config: VirtioFSPusherConfig) -> None:
        super().__init__(config)
        self.pattern = re.compile(config.vm_name_regexp)
        self.where = f"output '{config.name}'"

    async def check(self) -> None:
        """The root must exist, as PowerAPI's output checks when it connects; the VMs'
        directories come and go with the VMs."""
        root = self.config.root_directory_name
        if not root.is_dir():
            raise PushError(f"{self.where}: {root} is not a directory")

    async def probe(self) -> str:
        await self.check()
        return f"{self.config.root_directory_name} is a directory"

    def path_of(self, report: Report) -> Path | str | None:
        """The file a report is written to; None when it is not for this output; the reason
        when it is but cannot be written."""
        match = self.pattern.match(report.target)
        if match is None or match.group(1) is None:
            return None
        scope = report.metadata.get("scope")
        if self.config.scope and scope is not None and scope != self.config.scope:
            return None
        socket = report.metadata.get("socket")
        if socket is None:
            return f"{self.where}: the report has no socket in its metadata"
        config = self.config
        directory = f"{config.vm_directory_name_prefix}{match.group(1)}"
        directory += config.vm_directory_name_suffix
        return config.root_directory_name / directory / f"{FILE_PREFIX}{socket}"

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        refused: list[tuple[Report, str]] = []
        files: dict[Path, list[Report]] = {}
        for report in batch:
            path = self.path_of(report)
            if isinstance(path, str):
                refused.append((report, path))
            elif path is not None:
                files.setdefault(path, []).append(report)
        if files:
            refused += await asyncio.to_thread(self._write_files, files)
        return refused

    def _write_files(self, files: dict[Path, list[Report]]) -> list[tuple[Report, str]]:
        """Replace each file with its last report's power; return the reports of the files
        that cannot be written, or raise if a retry may help (rewriting the files already
        written gives them the same content again)."""
        refused: list[tuple[Report, str]] = []
        for path, reports in files.items():
            last = reports[-1]
            assert isinstance(last, PowerReport)
            gone = f"{self.where}: the VM's directory {path.parent} does not exist"
            if not path.parent.is_dir():
                refused += [(report, gone) for report in reports]
                continue
            try:
                replace_file(path, str(last.power).encode())
            except FileNotFoundError:  # the VM went away meanwhile: not worth a retry
                refused += [(report, gone) for report in reports]
            except OSError as error:
                problem = file_error(self.config.name, error, path)
                if problem.retryable:
                    raise problem from error
                refused += [(report, str(problem)) for report in reports]
        return refused
