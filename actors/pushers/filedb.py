"""filedb output: the last report, alone in a file rewritten by every batch.

PowerAPI 2.10's ``--output filedb -f FILE``: each report replaces the file's content with
``{"PowerReport": [{"sensor", "target", "timestamp", "power"}]}``, the timestamp in Unix
milliseconds, so the file always holds the newest report. A reader polls it (the
:mod:`~wattflow.actors.pullers.filedb` input, in a VM or on another node sharing the file).

Where wattflow differs from PowerAPI 2.10, and why (docs/backends/output-filedb.md):

- The document is JSON. PowerAPI writes Python's ``str()`` of the dict (single quotes), which
  no JSON reader takes, PowerAPI's own filedb input included; wattflow's filedb input reads
  both.
- The report's metadata follows its power under ``metadata`` when it has any (scope, socket:
  what tells a reader which estimate it holds); PowerAPI's input reads that key too.
- The file is replaced whole (:mod:`~wattflow.actors.pushers.replacing`), so a reader never
  sees it empty or cut, as it can when PowerAPI truncates and writes it in place.
- Any kind can be written (its own fields after ``timestamp``); PowerAPI writes PowerReports.

A batch writes the file once, with its last report (what writing each in turn leaves); the
others count as written. File errors a retry can mend (a full disk, a permission) are retried
for ``--retry-for-s``; a path that cannot be a file makes the batch a dead letter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import Field

from wattflow.actors.errors import PushError
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.appending import check_output_path, file_error
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.replacing import replace_file
from wattflow.formats.powerapi import payload_of
from wattflow.formats.reports import Report, to_millis


class FileDBPusherConfig(PusherConfig):
    """Settings of the filedb output (``--output filedb -f FILE``)."""

    type: Literal["filedb"] = "filedb"
    filename: Path = Field(
        description="File that holds the last report, rewritten whole by every batch.",
        json_schema_extra={"flags": ["-f", "--filename"]},
    )

    @classmethod
    def example(cls) -> FileDBPusherConfig:
        """The last PowerReport in power.json."""
        return cls(type="filedb", filename=Path("power.json"))


def filedb_document(report: Report) -> bytes:
    """The file's content for ``report``: PowerAPI 2.10's layout, as JSON."""
    line: dict[str, Any] = {
        "sensor": report.sensor,
        "target": report.target,
        "timestamp": to_millis(report.timestamp),
        **payload_of(report),
    }
    if report.metadata:
        line["metadata"] = report.metadata
    return orjson.dumps({report.kind: [line]}, option=orjson.OPT_NON_STR_KEYS)


@pushers.register("filedb")
class FileDBPusher(Pusher[FileDBPusherConfig]):
    """Replaces the file with each batch's last report, from a worker thread."""

    config_model = FileDBPusherConfig

    async def check(self) -> None:
        """The file's directory must exist, and take new files (each batch's file is made
        beside it, then renamed over it): PowerAPI checks that the file itself does, which
        only a run before this one could have made. A directory that cannot be written stops
        the command at start (exit 2), instead of each batch being retried for
        ``--retry-for-s``."""
        file = self.config.filename
        where = f"output '{self.config.name}': --filename {file}"
        if file.is_dir():
            raise PushError(f"{where}: {file} is a directory")
        await asyncio.to_thread(check_output_path, where, file.parent, makes_directories=False)

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        if batch:
            await asyncio.to_thread(self._replace, filedb_document(batch[-1]))
        return []

    def _replace(self, data: bytes) -> None:
        try:
            replace_file(self.config.filename, data)
        except OSError as error:
            raise file_error(self.config.name, error, self.config.filename) from error
