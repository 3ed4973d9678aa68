"""PowerAPI's CSV input: one file per events group, merged into reports by timestamp and target."""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Literal

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller
from wattflow.actors.pullers.files import BatchEmitter, FilePullerConfig, check_files_exist
from wattflow.actors.pullers.threaded import InThread, batched
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, fill
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import HWPCReport, PowerReport, Report


class CsvPullerConfig(FilePullerConfig):
    """Settings of the CSV input (``--input csv --model HWPCReport --files a.csv,b.csv``)."""

    type: Literal["csv"] = "csv"

    @classmethod
    def example(cls) -> CsvPullerConfig:
        """hwpc-sensor's CSV output for the three groups SmartWatts needs."""
        return cls(type="csv", files=[Path("rapl.csv"), Path("msr.csv"), Path("core.csv")])


@pullers.register("csv")
class CsvPuller(Puller[CsvPullerConfig]):
    """Reads HWPCReports from per-group files, or PowerReports from PowerReport.csv files."""

    config_model = CsvPullerConfig

    async def check(self) -> None:
        if self.config.model not in (HWPCReport.kind, PowerReport.kind):
            raise DecodeError(
                f"input '{self.config.name}'",
                None,
                f"the CSV input reads HWPCReport or PowerReport, not {self.config.model}",
            )
        check_files_exist(self.config)
        required = (
            powerapi.CSV_HWPC
            if self.config.model == HWPCReport.kind
            else (*powerapi.CSV_COMMON, "power")
        )
        for path in self.config.files:
            with path.open(newline="", encoding="utf-8", errors=powerapi.CSV_ERRORS) as handle:
                powerapi.read_csv_header(path, csv.reader(handle), required)

    async def pull(self, emitter: Emitter) -> None:
        """Read and parse the files in a thread of their own (:class:`InThread`), a chunk's
        frame or a list of reports at a time, and hand them on from the event loop."""
        paths = list(self.config.files)
        max_batch = self.config.max_batch
        if self.config.model == HWPCReport.kind and self.config.replay_speed is None:
            async with InThread(
                lambda: _frames_alone(read_hwpc_csv_frames(paths), max_batch), name="csv input"
            ) as runs:
                await self._pull_unpaced(runs, emitter)
            return
        hwpc = self.config.model == HWPCReport.kind

        def read() -> Iterator[list[Report | DecodeError]]:
            reports: Iterator[Report | DecodeError]
            reports = powerapi.read_hwpc_csv(paths) if hwpc else _power_reports(paths)
            return batched(reports, max_batch)

        batcher = BatchEmitter(emitter, max_batch, self.config.replay_speed)
        async with InThread(read, name="csv input") as chunks:
            async for chunk in chunks:
                for item in chunk:
                    await batcher.add(item)
                    if emitter.stopping.is_set():
                        break
                if emitter.stopping.is_set():
                    break
        await batcher.flush()

    async def _pull_unpaced(
        self, runs: AsyncIterator[list[HWPCReport | DecodeError] | Batch], emitter: Emitter
    ) -> None:
        """Hand frames on as they come, and reports a full batch at a time."""

        def accepted(run: Sequence[Report | DecodeError | Frame]) -> Iterator[Report | Frame]:
            for item in run:
                if isinstance(item, DecodeError):
                    emitter.reject(None, str(item))
                else:
                    yield item

        batch: list[Report] = []
        async for run in runs:
            for due in fill(batch, accepted(run), self.config.max_batch):
                for ready in due:
                    await emitter.emit(ready)
                if emitter.stopping.is_set():
                    break
            if emitter.stopping.is_set():
                break
        await emitter.emit(batch)


def _power_reports(paths: list[Path]) -> Iterator[PowerReport | DecodeError]:
    """Every PowerReport file's rows, one file after the other."""
    for path in paths:
        yield from powerapi.read_power_csv(path)


def _frames_alone(
    items: Iterator[HWPCFrame | HWPCReport | DecodeError], size: int
) -> Iterator[list[HWPCReport | DecodeError] | Batch]:
    """What :func:`read_hwpc_csv_frames` yields, as lists that cross to the event loop at once:
    each frame alone (a chunk's worth of reports), the reports and dead letters of files read
    row by row ``size`` at a time."""
    run: list[HWPCReport | DecodeError] = []
    try:
        for due in fill(run, items, size):
            yield from filter(None, due)  # no empty run before a frame
        if run:
            yield run
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # its files close in this thread, at a stop as at the end
