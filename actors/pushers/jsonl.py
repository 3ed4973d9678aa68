"""JSON Lines output: one report per line in PowerAPI's JSON layout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import Field

from wattflow.actors.errors import PushError
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import Report


class JsonlPusherConfig(PusherConfig):
    """Settings of the JSON Lines output (``--output jsonl --file F``)."""

    type: Literal["jsonl"] = "jsonl"
    file: Path = Field(
        description="File the reports are appended to.",
        json_schema_extra={"flags": ["-f", "--file"]},
    )

    @classmethod
    def example(cls) -> JsonlPusherConfig:
        """PowerReports appended to power.jsonl."""
        return cls(type="jsonl", file=Path("power.jsonl"))


@pushers.register("jsonl")
class JsonlPusher(Pusher[JsonlPusherConfig]):
    """Appends each batch and flushes it, so a reader following the file sees whole batches.

    A batch, a frame or reports, is encoded as one table, a column at a time
    (:func:`~wattflow.formats.report_table.encode_json_lines`).
    """

    config_model = JsonlPusherConfig
    takes_frames = True

    def __init__(self, config: JsonlPusherConfig) -> None:
        super().__init__(config)
        self._handle: BinaryIO | None = None

    async def check(self) -> None:
        if self.config.file.is_dir():
            raise PushError(f"output '{self.config.name}': {self.config.file} is a directory")

    async def open(self) -> None:
        # File systems block (a full disk, a hung NFS mount, a FIFO): never on the event loop.
        self._handle = await asyncio.to_thread(self._open)

    def _open(self) -> BinaryIO:
        self.config.file.parent.mkdir(parents=True, exist_ok=True)
        # Bytes: orjson writes UTF-8, which a text file would only decode and encode again.
        return self.config.file.open("ab")

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        handle = self._handle
        assert handle is not None, "open() first"
        data = encode_json_lines(batch)
        try:
            await asyncio.to_thread(_write_and_flush, handle, data)
        except OSError as error:
            raise PushError(f"output '{self.config.name}': {error}") from error
        return []

    async def close(self) -> None:
        if self._handle is not None:
            await asyncio.to_thread(self._handle.close)
            self._handle = None


def _write_and_flush(handle: BinaryIO, data: bytes) -> None:
    handle.write(data)
    handle.flush()
