"""JSON Lines input: one report per line, optionally following the files as they grow."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller
from wattflow.actors.pullers.files import (
    INLINE_DECODE_BYTES,
    BatchEmitter,
    FileFollower,
    FilePullerConfig,
    FollowedFile,
    check_files_exist,
    split_lines,
)
from wattflow.actors.pullers.threaded import InThread
from wattflow.formats import jsonl
from wattflow.formats.errors import DecodeError
from wattflow.formats.json_frames import Decoded, Layout, decode_json_batch
from wattflow.formats.reports import Report, report_kind

_CHUNK_BYTES = 1 << 20
"""Bytes read at once: hundreds of reports, decoded and handed on together."""


class JsonlPullerConfig(FilePullerConfig):
    """Settings of the JSON Lines input (``--input jsonl --model KIND --files a.jsonl``)."""

    type: Literal["jsonl"] = "jsonl"
    follow: bool = Field(
        default=False,
        description="Keep reading as the files grow, like `tail -f` (implied by --stream).",
    )
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="How often a followed file is checked for new lines."
    )
    max_line_bytes: PositiveInt = Field(
        default=1 << 20, description="Longest line accepted while following, in bytes."
    )

    @classmethod
    def example(cls) -> JsonlPullerConfig:
        """A recording of hwpc-sensor reports, one per line."""
        return cls(type="jsonl", files=[Path("hwpc.jsonl")])


@pullers.register("jsonl")
class JsonlPuller(Puller[JsonlPullerConfig]):
    """Reads the files in the order given; following, it reads them all at once."""

    config_model = JsonlPullerConfig

    async def check(self) -> None:
        try:
            report_kind(self.config.model)
        except ValueError as error:
            raise DecodeError(f"input '{self.config.name}'", None, str(error)) from None
        if not (self.config.follow or self.stream):
            check_files_exist(self.config)

    async def pull(self, emitter: Emitter) -> None:
        kind = report_kind(self.config.model)
        if self.config.follow or self.stream:
            await self._follow_all(emitter)
            return
        batcher = BatchEmitter(emitter, self.config.max_batch, self.config.replay_speed)
        paths = list(self.config.files)
        async with InThread(lambda: _replay(kind, paths), name="jsonl input") as parts:
            async for part in parts:
                if isinstance(part, tuple):
                    await batcher.add_batch(*part)
                else:
                    for item in part:
                        await batcher.add(item)
                if emitter.stopping.is_set():
                    break
        await batcher.flush()

    @property
    def resumable(self) -> bool:
        """Following, the input reports each file's position (device, inode, byte and line) at
        its batch boundaries, and goes on from the saved one at a start."""
        return self.config.follow or self.stream

    async def _follow_all(self, emitter: Emitter) -> None:
        """Follow every file at once; each hands its lines on under one lock, so the positions
        reported together stand at a boundary of every file."""
        saved = self.saved_position if isinstance(self.saved_position, dict) else {}
        names = {str(path) for path in self.config.files}
        self._positions: dict[str, Any] = {k: v for k, v in saved.items() if k in names}
        self._lock = asyncio.Lock()
        await self.boundary(dict(self._positions))
        await asyncio.gather(*(self._follow(path, emitter) for path in self.config.files))

    async def _follow(self, path: Path, emitter: Emitter) -> None:
        """Tail one file (:class:`FileFollower`: complete lines only, the new file read from its
        start when it is rotated or truncated)."""
        batcher = BatchEmitter(emitter, self.config.max_batch, None)
        place = FollowedFile(path)
        follower = FileFollower(
            place,
            self._positions.get(str(path)),
            following=True,
            poll_interval_s=self.config.poll_interval_s,
            stopping=emitter.stopping,
        )
        partial = b""
        layouts: dict[str, Layout] = {}
        try:
            async with contextlib.aclosing(follower.chunks()) as chunks:
                async for chunk, fresh in chunks:
                    if fresh:
                        partial = b""
                    async with self._lock:
                        partial = await self._hand_on(place, partial + chunk, batcher, layouts)
            if partial.strip() and not self.checkpointed:
                # A last line without its newline: at a stop it is read as it is, a report or
                # (a writer cut off mid-line) a dead letter naming its line, never dropped.
                # With checkpoints it stays for the next run, which reads it whole.
                decoded, errors = decode_json_batch(
                    report_kind(self.config.model), [partial], str(path), place.line + 1, layouts
                )
                await batcher.add_batch(decoded, errors)
        finally:
            await batcher.flush()

    async def _hand_on(
        self, place: FollowedFile, data: bytes, batcher: BatchEmitter, layouts: dict[str, Layout]
    ) -> bytes:
        """Hand on the complete lines of ``data`` and report the position after them; return
        the incomplete rest."""
        emitter = batcher.emitter
        lines = data.split(b"\n")
        partial = lines.pop()
        consumed = len(data) - len(partial)
        if len(partial) > self.config.max_line_bytes:
            emitter.reject(
                None,
                f"{place.path}:{place.line + len(lines) + 1}: line longer than "
                f"{self.config.max_line_bytes} bytes, skipped",
            )
            consumed, partial = len(data), b""
        decoded, errors = await _decode(
            len(data),
            report_kind(self.config.model),
            lines,
            str(place.path),
            place.line + 1,
            layouts,
        )
        await batcher.add_batch(decoded, errors)
        await batcher.flush()
        place.handed_on(consumed, len(lines))
        self._positions[str(place.path)] = place.position()
        await self.boundary(dict(self._positions))
        return partial


def _replay(
    kind: type[Report], paths: list[Path]
) -> Iterator[Decoded | list[Report | DecodeError]]:
    """The files read and decoded in turn, in the replay's thread (:class:`InThread`): each chunk
    of a JSON Lines file as what :func:`decode_json_batch` makes of its lines, a document of
    PowerAPI's file input as the list of its reports and dead letters."""
    for path in paths:
        if jsonl.is_reports_document(path):
            yield list(jsonl.read_reports_document(kind, path))
            continue
        with path.open("rb") as handle:
            layouts: dict[str, Layout] = {}
            line_number = 1
            rest = b""
            empty = True
            while chunk := handle.read(_CHUNK_BYTES):
                lines, rest = split_lines(rest + chunk)
                yield decode_json_batch(kind, lines, str(path), line_number, layouts)
                line_number += len(lines)
                empty = False
            if empty:
                yield [], []  # nothing, but the input looks at its stop between files
            elif rest:
                lines, _ = split_lines(rest + b"\n")
                yield decode_json_batch(kind, lines, str(path), line_number, layouts)


async def _decode(
    size_bytes: int,
    kind: type[Report],
    lines: list[bytes],
    source: str,
    first_line: int,
    layouts: dict[str, Layout],
) -> Decoded:
    """:func:`decode_json_batch` of a followed file's lines: on the loop up to
    :data:`INLINE_DECODE_BYTES`, in a thread beyond."""
    if size_bytes <= INLINE_DECODE_BYTES:
        return decode_json_batch(kind, lines, source, first_line, layouts)
    return await asyncio.to_thread(decode_json_batch, kind, lines, source, first_line, layouts)
