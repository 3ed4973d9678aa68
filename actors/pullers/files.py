"""What the file pullers share: the list of files flag, batching with optional pacing, and
following files as they grow and rotate."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import IO, Annotated, Any

from pydantic import BeforeValidator, Field, PositiveInt

from wattflow.actors.backend import split_commas
from wattflow.actors.pullers.base import Emitter, PullerConfig
from wattflow.formats.batch import alone_and_joined, expand
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

INLINE_DECODE_BYTES = 1 << 16
"""The most bytes of a followed file's new lines decoded on the event loop (the JSON Lines and
meter inputs): a live sensor's or meter's few lines take less time to decode there than a
thread's round trip; more (a file caught up with at a start, a burst) is decoded in a thread,
so that a live input of the same process keeps its turns."""

FileList = Annotated[list[Path], BeforeValidator(split_commas)]
"""Files given as a list, or as PowerAPI's comma-separated ``--files a.csv,b.csv``."""


class FilePullerConfig(PullerConfig):
    """Settings of the inputs that read files."""

    files: FileList = Field(
        min_length=1,
        description="Files to read, comma-separated.",
        json_schema_extra={"flags": ["-f", "--files"]},
    )
    max_batch: PositiveInt = Field(default=1000, description="Reports handed on at once.")
    replay_speed: float | None = Field(
        default=None,
        gt=0,
        description="Replay at this multiple of recorded time (1 = real time); unset reads as "
        "fast as the pipeline takes reports.",
    )


def check_files_exist(config: FilePullerConfig) -> None:
    """Raise a :class:`DecodeError` naming the first file that cannot be read."""
    for path in config.files:
        if not path.is_file():
            raise DecodeError(str(path), None, f"input '{config.name}': no such file")


class BatchEmitter:
    """Collects decoded reports and rejects, emitting in batches and pacing a replay."""

    def __init__(self, emitter: Emitter, max_batch: int, replay_speed: float | None) -> None:
        self.emitter = emitter
        self.max_batch = max_batch
        self.replay_speed = replay_speed
        self.batch: list[Report] = []
        self._last_timestamp: float | None = None

    async def add(self, item: Report | DecodeError, raw: Any = None) -> None:
        """Queue a report (or dead-letter an error), emitting when the batch is full."""
        if isinstance(item, DecodeError):
            self.emitter.reject(raw, str(item))
            return
        if self.replay_speed is not None:
            await self._pace(item)
        self.batch.append(item)
        if len(self.batch) >= self.max_batch:
            await self.flush()

    async def _pace(self, report: Report) -> None:
        now = report.timestamp.timestamp()
        if self._last_timestamp is not None and now > self._last_timestamp:
            await self.flush()
            assert self.replay_speed is not None
            await asyncio.sleep(min(now - self._last_timestamp, 60.0) / self.replay_speed)
        self._last_timestamp = now

    async def add_decoded(
        self, reports: list[Report], errors: list[tuple[DecodeError, str | bytes]]
    ) -> None:
        """Queue what a decoder made of many lines at once, dead-lettering each line it refused.

        Without pacing the reports join the batch in one step rather than one call each: at tens
        of thousands of reports a second, the calls would cost more than the batching saves.
        """
        for error, raw in errors:
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            self.emitter.reject(text.rstrip("\n"), str(error))
        if self.replay_speed is not None:
            for report in reports:
                await self.add(report)
            return
        batch = self.batch
        batch.extend(reports)
        while len(batch) >= self.max_batch:
            self.batch = batch[self.max_batch :]
            await self.emitter.emit(batch[: self.max_batch])
            batch = self.batch

    async def add_batch(
        self,
        decoded: list[HWPCFrame] | list[Report],
        errors: list[tuple[DecodeError, str | bytes]],
    ) -> None:
        """Queue what :func:`~wattflow.formats.json_frames.decode_json_batch` made of many lines:
        each frame goes on whole, after the reports queued before it (as its reports when pacing
        a replay, which goes report by report)."""
        if self.replay_speed is not None:  # a paced replay goes report by report
            decoded = expand(decoded)
        alone, joined = alone_and_joined(decoded)
        if alone:  # after the reports queued before them
            await self.flush()
        for batch in alone:
            await self.emitter.emit(batch)
        await self.add_decoded(joined, errors)

    async def flush(self) -> None:
        """Emit what is queued."""
        batch, self.batch = self.batch, []
        await self.emitter.emit(batch)


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of a chunk of text, and the incomplete rest to prepend to the next chunk.

    Lines end as Python's text files end them (``\\n``, ``\\r\\n`` or a lone ``\\r``), so
    that line numbers are those a text editor shows. A chunk ending in ``\\r`` keeps it in the
    rest: it may be the first half of ``\\r\\n``.
    """
    if b"\r" in data:
        held = b""
        if data.endswith(b"\r"):
            data, held = data[:-1], b"\r"
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        return lines[:-1], lines[-1] + held
    lines = data.split(b"\n")
    return lines[:-1], lines[-1]


class FollowedFile:
    """Where a followed file stands: which file it is (device and inode) and how far it was
    handed on, in bytes and lines, always at the end of a line.

    It is the position a followed input reports at its batch boundaries
    (:meth:`position`), and the one it takes back at a start (:meth:`resume`): a file that is
    still the one saved, and at least as long, is read on from there; a file replaced, rotated
    or truncated since is read from its start, with a warning.
    """

    __slots__ = ("device", "inode", "line", "offset", "path")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.device = 0
        self.inode = 0
        self.offset = 0
        """Bytes handed on: the start of the first line not handed on yet."""
        self.line = 0
        """Lines handed on."""

    def opened(self, handle: IO[bytes]) -> None:
        """A (re)opened file, read from its start."""
        status = os.fstat(handle.fileno())
        self.device, self.inode = status.st_dev, status.st_ino
        self.offset = self.line = 0

    def resume(self, handle: IO[bytes], saved: Any) -> None:
        """Seek a file just opened to the position saved for it, if it is still that file."""
        self.opened(handle)
        if not isinstance(saved, dict):
            return
        try:
            device, inode = int(saved["device"]), int(saved["inode"])
            offset, line = int(saved["offset"]), int(saved["line"])
        except (KeyError, TypeError, ValueError):
            logger.warning(
                "%s: saved position %r unreadable: reading from the start", self.path, saved
            )
            return
        size = os.fstat(handle.fileno()).st_size
        if (device, inode) != (self.device, self.inode) or size < offset:
            logger.warning(
                "%s was replaced or truncated since the last checkpoint (%s): reading it from "
                "the start",
                self.path,
                "another file" if (device, inode) != (self.device, self.inode) else "shorter",
            )
            return
        handle.seek(offset)
        self.offset, self.line = offset, line
        logger.info("%s: going on from line %d (byte %d)", self.path, line + 1, offset)

    def handed_on(self, consumed_bytes: int, lines: int) -> None:
        """Whole lines were handed on."""
        self.offset += consumed_bytes
        self.line += lines

    def position(self) -> dict[str, int]:
        """The position as a checkpoint keeps it."""
        return {
            "device": self.device,
            "inode": self.inode,
            "offset": self.offset,
            "line": self.line,
        }


class FileFollower:
    """One log file read as it grows, for the inputs that tail files (JSON Lines, meter).

    Loggers rotate their files: the path then names a new file, or the file is cut back to
    nothing. Either way the follower first reads the old file to its end, then opens the file
    the path names now and reads it from its start, so no reading written before the rotation
    is lost and none is read twice. A file that does not exist yet is waited for. Reads run in
    a thread, so a slow disk does not hold up the event loop.
    """

    def __init__(
        self,
        place: FollowedFile,
        saved: Any,
        *,
        following: bool,
        poll_interval_s: float,
        stopping: asyncio.Event,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        self.place = place
        self.saved = saved
        """The position a checkpoint gave back, used for the first opening only."""
        self.following = following
        self.poll_interval_s = poll_interval_s
        self.stopping = stopping
        self.chunk_bytes = chunk_bytes

    def opened(self, handle: IO[bytes], saved: Any) -> None:
        """A file (re)opened: seek it to ``saved`` (``None`` after a rotation: its start).
        Inputs that keep more of a file's state (the meter's CSV header) extend this."""
        self.place.resume(handle, saved)

    async def chunks(self) -> AsyncGenerator[tuple[bytes, bool], None]:
        """The file's bytes as they are written, each chunk with whether it is the first of a
        newly opened file (a line left incomplete in the file before is then dropped: the
        logger never finished it). Without ``following``, the file is read to its end once."""
        handle: IO[bytes] | None = None
        saved, fresh = self.saved, False
        try:
            while not self.stopping.is_set():
                if handle is None:
                    handle = await asyncio.to_thread(self._open, saved)
                    if handle is None:
                        if not self.following:
                            return
                        await self._wait()
                        continue
                    saved, fresh = None, True
                chunk = await asyncio.to_thread(handle.read, self.chunk_bytes)
                if chunk:
                    yield chunk, fresh
                    fresh = False
                elif not self.following:
                    return
                elif await asyncio.to_thread(_rotated, self.place.path, handle):
                    logger.info(
                        "%s was rotated: reading the new file from its start", self.place.path
                    )
                    handle.close()
                    handle = None
                else:
                    await self._wait()
        finally:
            if handle is not None:
                handle.close()

    def _open(self, saved: Any) -> IO[bytes] | None:
        try:
            handle = self.place.path.open("rb")
        except FileNotFoundError:
            return None
        self.opened(handle, saved)
        return handle

    async def _wait(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), self.poll_interval_s)


def _rotated(path: Path, handle: IO[bytes]) -> bool:
    """Whether ``path`` names another file than ``handle`` now, or the file got shorter than
    what was read of it (cut back by ``copytruncate``)."""
    try:
        current = path.stat()
    except FileNotFoundError:
        return False  # moved away, the new one not created yet: wait for it
    opened = os.fstat(handle.fileno())
    if (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
        return True
    return current.st_size < handle.tell()
