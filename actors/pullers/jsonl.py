"""JSON Lines input: one report per line, optionally following the files as they grow."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller
from wattflow.actors.pullers.files import (
    BatchEmitter,
    FilePullerConfig,
    check_files_exist,
    split_lines,
)
from wattflow.formats import jsonl
from wattflow.formats.errors import DecodeError
from wattflow.formats.json_frames import Layout, decode_json_batch
from wattflow.formats.reports import report_kind

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
            await asyncio.gather(*(self._follow(path, emitter) for path in self.config.files))
            return
        batcher = BatchEmitter(emitter, self.config.max_batch, self.config.replay_speed)
        for path in self.config.files:
            if jsonl.is_reports_document(path):
                items = jsonl.read_reports_document(kind, path)
                for item in items:
                    await batcher.add(item)
            else:
                with path.open("rb") as handle:
                    layouts: dict[str, Layout] = {}
                    line_number = 1
                    rest = b""
                    while chunk := handle.read(_CHUNK_BYTES):
                        lines, rest = split_lines(rest + chunk)
                        decoded, errors = decode_json_batch(
                            kind, lines, str(path), line_number, layouts
                        )
                        line_number += len(lines)
                        await batcher.add_batch(decoded, errors)
                        if emitter.stopping.is_set():
                            break
                    if rest and not emitter.stopping.is_set():
                        lines, _ = split_lines(rest + b"\n")
                        decoded, errors = decode_json_batch(
                            kind, lines, str(path), line_number, layouts
                        )
                        await batcher.add_batch(decoded, errors)
            if emitter.stopping.is_set():
                break
        await batcher.flush()

    async def _follow(self, path: Path, emitter: Emitter) -> None:
        """Tail one file: complete lines only, reopened when it is rotated or truncated."""
        kind = report_kind(self.config.model)
        batcher = BatchEmitter(emitter, self.config.max_batch, None)
        handle = None
        line_number = 0
        partial = b""
        layouts: dict[str, Layout] = {}
        try:
            while not emitter.stopping.is_set():
                if handle is None:
                    try:
                        handle = path.open("rb")
                    except FileNotFoundError:
                        await self._sleep(emitter)
                        continue
                    line_number, partial = 0, b""
                chunk = handle.read(1 << 16)
                if not chunk:
                    await batcher.flush()
                    if self._replaced(path, handle):
                        handle.close()
                        handle = None
                        continue
                    await self._sleep(emitter)
                    continue
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                if len(partial) > self.config.max_line_bytes:
                    emitter.reject(
                        None,
                        f"{path}:{line_number + 1}: line longer than "
                        f"{self.config.max_line_bytes} bytes, skipped",
                    )
                    partial = b""
                decoded, errors = decode_json_batch(
                    kind, lines, str(path), line_number + 1, layouts
                )
                line_number += len(lines)
                await batcher.add_batch(decoded, errors)
            if partial.strip():
                # A last line without its newline: at a stop it is read as it is, a report or
                # (a writer cut off mid-line) a dead letter naming its line, never dropped.
                decoded, errors = decode_json_batch(
                    kind, [partial], str(path), line_number + 1, layouts
                )
                await batcher.add_batch(decoded, errors)
        finally:
            await batcher.flush()
            if handle is not None:
                handle.close()

    @staticmethod
    def _replaced(path: Path, handle: object) -> bool:
        try:
            current = path.stat()
        except FileNotFoundError:
            return False
        opened = os.fstat(handle.fileno())  # type: ignore[attr-defined]
        position = handle.tell()  # type: ignore[attr-defined]
        return current.st_ino != opened.st_ino or current.st_size < position

    async def _sleep(self, emitter: Emitter) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(emitter.stopping.wait(), self.config.poll_interval_s)
