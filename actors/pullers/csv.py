"""PowerAPI's CSV input: one file per events group, merged into reports by timestamp and target."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller
from wattflow.actors.pullers.files import BatchEmitter, FilePullerConfig, check_files_exist
from wattflow.formats import powerapi
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Frame
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
        batcher = BatchEmitter(emitter, self.config.max_batch, self.config.replay_speed)
        if self.config.model == HWPCReport.kind:
            if self.config.replay_speed is None:
                await self._pull_unpaced(read_hwpc_csv_frames(list(self.config.files)), emitter)
                return
            items = powerapi.read_hwpc_csv(list(self.config.files))
            for item in items:
                await batcher.add(item)
                if emitter.stopping.is_set():
                    break
        else:
            for path in self.config.files:
                for power in powerapi.read_power_csv(path):
                    await batcher.add(power)
                    if emitter.stopping.is_set():
                        break
        await batcher.flush()

    async def _pull_unpaced(
        self, items: Iterator[Frame | HWPCReport | DecodeError], emitter: Emitter
    ) -> None:
        """Hand frames on as they come, and reports a full batch at a time."""
        batch: list[Report] = []
        max_batch = self.config.max_batch
        for item in items:
            if isinstance(item, DecodeError):
                emitter.reject(None, str(item))
                continue
            if isinstance(item, Frame):
                await emitter.emit(batch)
                batch = []
                await emitter.emit([item])
                if emitter.stopping.is_set():
                    break
                continue
            batch.append(item)
            if len(batch) >= max_batch:
                await emitter.emit(batch)
                batch = []
                if emitter.stopping.is_set():
                    break
        await emitter.emit(batch)
