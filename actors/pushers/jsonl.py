"""JSON Lines output: one report per line in PowerAPI's JSON layout."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import Field

from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.appending import (
    INLINE_WRITE_BYTES,
    append,
    check_output_path,
    file_error,
    start_on_a_new_line,
    take_back,
    writes_inline,
)
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats.batch import Batch, pieces
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
    """Appends each batch whole or not at all, so a reader following the file sees whole batches.

    A batch, a frame or reports, is encoded as one table, a column at a time
    (:func:`~wattflow.formats.report_table.encode_json_lines`), and written with unbuffered
    writes; a batch that fails part-way is cut off the file again and retried for
    ``--retry-for-s`` (:mod:`~wattflow.actors.pushers.appending`). The file is opened on the
    first write, so that an error opening it is a failed batch like any other.
    """

    config_model = JsonlPusherConfig
    takes_frames = True
    takes_frame_runs = True

    def __init__(self, config: JsonlPusherConfig) -> None:
        super().__init__(config)
        self._handle: BinaryIO | None = None
        self._regular = True
        """Whether the file is a regular file (not a FIFO or a device), which can be cut back."""
        self._inline = False
        """Whether small batches are appended on the event loop (a regular file on a local
        file system, :func:`~wattflow.actors.pushers.appending.writes_inline`)."""

    async def check(self) -> None:
        """A file that cannot be written stops the command at start (exit 2), instead of each
        batch being retried for ``--retry-for-s`` (:func:`check_output_path`)."""
        file = self.config.file
        where = f"output '{self.config.name}': --file {file}"
        await asyncio.to_thread(check_output_path, where, file.parent, file=file)

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        return await self.write_batch(batch)

    async def write_batch(self, batch: Batch) -> list[tuple[Report, str]]:
        data = b"".join(map(encode_json_lines, pieces(batch)))  # frames queued together
        if self._inline and len(data) <= INLINE_WRITE_BYTES:
            # A live sensor's tick: a few kB to the page cache, cheaper than a thread's round trip.
            self._write(data)
            return []
        # Other file systems block (a full disk, a hung NFS mount, a FIFO): never on the event
        # loop; nor does a large batch, whose copy into the page cache takes a while.
        await asyncio.to_thread(self._write, data)
        return []

    def _write(self, data: bytes) -> None:
        path = self.config.file
        try:
            if self._handle is None:
                self._handle = self._open()
            fd = self._handle.fileno()
            size = os.fstat(fd).st_size
        except OSError as error:
            raise file_error(self.config.name, error, path) from error
        try:
            append(fd, data)
        except OSError as error:
            if self._regular:
                take_back({path: size})
            raise file_error(self.config.name, error, path) from error

    def _open(self) -> BinaryIO:
        path = self.config.file
        path.parent.mkdir(parents=True, exist_ok=True)
        self._regular = not path.exists() or path.is_file()
        if not self._regular:  # a FIFO or a device: written to as it is, nothing to cut back
            return path.open("ab", buffering=0)
        # Read and append: the last byte is read to see whether a line was left cut short.
        handle = path.open("a+b", buffering=0)
        start_on_a_new_line(handle.fileno(), path)
        self._inline = writes_inline(handle.fileno())
        return handle

    async def close(self) -> None:
        if self._handle is not None:
            await asyncio.to_thread(self._handle.close)
            self._handle = None
