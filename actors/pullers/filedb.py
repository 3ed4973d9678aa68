"""filedb input: one report in a file, read again whenever it changes.

PowerAPI 2.10's ``--input filedb -f FILE``: the file holds one JSON report of ``--model``
(hwpc-sensor's document for HWPCReport), which a writer replaces; the input reads the whole
file, hands on its report, and in stream mode reads it again, handing a report on only when
the content changed. Without ``--stream`` it reads the file once.

What the file may hold, besides PowerAPI's one document:

- the filedb output's document, ``{"PowerReport": [{…}]}``: its reports, which must be of
  ``--model``; also when written as PowerAPI 2.10's output writes it, Python's ``str()`` of
  that dict (single quotes), which PowerAPI's own input cannot read;
- a bare number, as the virtiofs output writes a VM's power (``12.5``), with ``--model
  PowerReport``: the guest's side of that chain. It becomes a PowerReport of that power, timed
  by the file's modification, of sensor ``--sensor`` and target ``--target``, with the socket
  that ends the file's name (``power_consumption_package0``) and scope cpu in its metadata.
  The same number written again is a new reading (the file's modification time tells).

A file that is empty (a writer that truncates, then writes) is read again at the next poll;
content that is no report is a dead letter naming the file, once per content. A missing file
is an error without ``--stream``; with it, the input waits for the file.
"""

from __future__ import annotations

import ast
import asyncio
import math
import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import Field

from wattflow.actors.errors import PullError
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.formats.errors import DecodeError
from wattflow.formats.powerapi import decode_document
from wattflow.formats.reports import PowerReport, Report, report_kind, to_utc

SOCKET_SUFFIX = re.compile(r"(\d+)$")
"""The socket that ends a virtiofs file's name (``power_consumption_package0``)."""


class FileDBPullerConfig(PullerConfig):
    """Settings of the filedb input (``--input filedb -f FILE``)."""

    type: Literal["filedb"] = "filedb"
    filename: Path = Field(
        description="File that holds one report, replaced by its writer.",
        json_schema_extra={"flags": ["-f", "--filename"]},
    )
    poll_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="With --stream, how often the file is read again to see whether it changed.",
    )
    sensor: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="Sensor of the reports made from a bare number (a virtiofs file); "
        "default: this machine's host name.",
    )
    target: str = Field(
        default="all",
        min_length=1,
        description="Target of the reports made from a bare number (a virtiofs file).",
    )

    @classmethod
    def example(cls) -> FileDBPullerConfig:
        """The last report another wattflow wrote to power.json, as PowerReports."""
        return cls(type="filedb", model="PowerReport", filename=Path("power.json"))


@pullers.register("filedb")
class FileDBPuller(Puller[FileDBPullerConfig]):
    """Reads the file on a worker thread, once or at every poll."""

    config_model = FileDBPullerConfig

    def __init__(self, config: FileDBPullerConfig, *, stream: bool = False) -> None:
        super().__init__(config, stream=stream)
        self.kind = report_kind(config.model)
        self.source = f"input '{config.name}' ({config.filename})"

    async def check(self) -> None:
        """The file must exist unless the input waits for it; its directory must."""
        file = self.config.filename
        if not file.parent.is_dir():
            raise PullError(f"{self.source}: {file.parent} is not a directory")
        if not self.stream and not file.is_file():
            raise PullError(f"{self.source}: no such file (give --stream to wait for it)")

    async def pull(self, emitter: Emitter) -> None:
        seen: tuple[bytes, int] | None = None
        while True:
            read = await asyncio.to_thread(self._read)
            if read is None and not self.stream:
                raise PullError(f"{self.source}: no such file")
            if read is not None and read[0].strip():
                content, modified_ns = read
                # A document carries its own time; a bare number is new when written again.
                key = (content, modified_ns if self._is_number(content) else 0)
                if key != seen:
                    seen = key
                    await self._hand_on(content, modified_ns, emitter)
            if not self.stream:
                return
            try:
                await asyncio.wait_for(emitter.stopping.wait(), self.config.poll_interval_s)
                return
            except TimeoutError:
                continue

    def _read(self) -> tuple[bytes, int] | None:
        """The file's content and modification time (ns), or None when there is no file."""
        try:
            with open(self.config.filename, "rb") as handle:
                return handle.read(), os.fstat(handle.fileno()).st_mtime_ns
        except FileNotFoundError:
            return None
        except OSError as error:
            raise PullError(f"{self.source}: {error.strerror or error}") from None

    @staticmethod
    def _is_number(content: bytes) -> bool:
        try:
            float(content)
        except ValueError:
            return False
        return True

    async def _hand_on(self, content: bytes, modified_ns: int, emitter: Emitter) -> None:
        try:
            reports = self.decode(content, modified_ns)
        except DecodeError as error:
            emitter.reject(content.decode("utf-8", "replace"), str(error))
            return
        await emitter.emit(reports)

    def decode(self, content: bytes, modified_ns: int) -> list[Report]:
        """The reports a content holds.

        Raises:
            DecodeError: naming the file and what is wrong.
        """
        if self._is_number(content):
            return [self._from_number(float(content), modified_ns)]
        document = self._parse(content)
        if isinstance(document, dict) and len(document) == 1:
            ((key, value),) = document.items()
            if isinstance(value, list) and key[:1].isupper() and "timestamp" not in document:
                return self._listed(key, value)
        return [decode_document(self.kind, document, self.source, None)]

    def _parse(self, content: bytes) -> Any:
        """JSON, or the Python literal PowerAPI 2.10's filedb output writes."""
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as error:
            json_error = str(error)
        try:
            return ast.literal_eval(content.decode("utf-8"))
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
            raise DecodeError(self.source, None, f"not valid JSON: {json_error}") from None

    def _listed(self, key: str, documents: list[Any]) -> list[Report]:
        """The reports of ``{"Kind": [documents]}``, which must be of ``--model``."""
        if key != self.kind.kind:
            raise DecodeError(
                self.source, None, f"the file holds {key} reports, the input reads {self.kind.kind}"
            )
        return [decode_document(self.kind, document, self.source, None) for document in documents]

    def _from_number(self, power: float, modified_ns: int) -> Report:
        """A virtiofs file's power as a PowerReport."""
        if self.kind is not PowerReport:
            raise DecodeError(
                self.source, None, "a bare number is a power: give --model PowerReport"
            )
        if not math.isfinite(power):
            raise DecodeError(self.source, None, f"the power {power} is not a finite number")
        metadata: dict[str, Any] = {"scope": "cpu"}
        found = SOCKET_SUFFIX.search(self.config.filename.name)
        if found is not None:
            metadata["socket"] = found.group(1)
        return PowerReport(
            timestamp=to_utc(modified_ns / 1_000_000),
            sensor=self.config.sensor,
            target=self.config.target,
            power=power,
            metadata=metadata,
        )
