"""Which sensors an instance takes: ``--partition i/N``.

N instances of the service share one stream of reports (one MongoDB collection, one ZeroMQ
publisher) by sensor: each takes the sensors whose hash falls to it and lets the others go.
Every report of a sensor (its hwpc-sensor reports, its GPU and meter reports) goes to the same
instance, so the formulas' state for that sensor lives in one place.

The hash is CRC-32 of the sensor's name in UTF-8, modulo N: stable across processes, machines
and Python versions (Python's own ``hash()`` of a string is salted per process, so two
instances would not agree). This module is the one place that maps a sensor to a partition.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache

from wattflow.formats.batch import Batch
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import Report

_FORMAT = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def partition_of(sensor: str, count: int) -> int:
    """The partition (``0`` to ``count - 1``) that takes ``sensor``'s reports."""
    return _crc32(sensor) % count


@lru_cache(maxsize=65_536)
def _crc32(sensor: str) -> int:
    """A sensor's hash, cached: a stream holds few sensors, each in many reports."""
    return zlib.crc32(sensor.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition ``index`` of ``count``: the sensors this instance takes."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"the number of partitions must be 1 or more, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"partition {self.index} of {self.count} does not exist: give 0 to {self.count - 1}"
            )

    @classmethod
    def parse(cls, text: str) -> Partition:
        """``"i/N"``, e.g. ``"0/3"``.

        Raises:
            ValueError: not of that form, or ``i`` not in ``0 … N-1``.
        """
        match = _FORMAT.match(text)
        if match is None:
            raise ValueError(f"expected i/N (e.g. 0/3: the first of 3 instances), got {text!r}")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def split(self, workers: int) -> list[Partition]:
        """This partition shared by ``workers`` processes (``--workers``): worker ``j`` takes
        partition ``index + count * j`` of ``count * workers``.

        A sensor whose hash ``h`` gives ``h mod (count * workers) = index + count * j`` has
        ``h mod count = index``: the workers together take exactly this partition's sensors,
        each sensor in one worker.
        """
        if workers < 1:
            raise ValueError(f"the number of workers must be 1 or more, got {workers}")
        total = self.count * workers
        return [Partition(self.index + self.count * j, total) for j in range(workers)]

    def worker_of(self, sensor: str, workers: int) -> int | None:
        """Which of :meth:`split`'s workers takes ``sensor``; None when this partition does
        not take it at all."""
        if not self.owns(sensor):
            return None
        return (_crc32(sensor) % (self.count * workers)) // self.count

    def owns(self, sensor: str) -> bool:
        """Whether this instance takes ``sensor``'s reports."""
        return self.count == 1 or _crc32(sensor) % self.count == self.index

    def select(self, batch: Batch) -> tuple[list[list[Report] | list[Frame]], int]:
        """This partition's share of a batch: the batches to hand on, and how many reports
        were left to the other partitions.

        A frame travels alone; one holding sensors of several partitions becomes one frame per
        sensor taken.
        """
        if len(batch) == 1 and isinstance(batch[0], Frame):
            return self._select_frame(batch[0])
        reports: list[Report] = [r for r in batch if isinstance(r, Report)]
        if len(reports) != len(batch):  # frames among reports: not how pullers emit
            raise TypeError("a batch is reports, or one frame alone")
        kept = [report for report in reports if self.owns(report.sensor)]
        return ([kept] if kept else []), len(reports) - len(kept)

    def divide(self, batch: Batch) -> tuple[list[list[Report] | list[Frame]], list[Report]]:
        """This partition's share of a batch (as :meth:`select` cuts it), and the reports of
        the others' sensors, built one by one: for an input that must dead-letter them, since
        the instance that owns them will not see them (a ZeroMQ topic that misnamed their
        sensor), rather than let them go.
        """
        kept, left = self.select(batch)
        return kept, (self._others(batch) if left else [])

    def _others(self, batch: Batch) -> list[Report]:
        """The reports of a batch that other partitions take; a frame of hwpc-sensor's is cut
        per sensor first, so only those sensors' reports are built."""
        if len(batch) == 1 and isinstance(batch[0], HWPCFrame):
            frame = batch[0]
            others = [s for s in frame.sensors() if not self.owns(s)]
            return [r for s in others for r in frame.of_sensor(s).reports()]
        reports = batch[0].reports() if len(batch) == 1 and isinstance(batch[0], Frame) else batch
        return [r for r in reports if isinstance(r, Report) and not self.owns(r.sensor)]

    def of(self, sensor: str) -> Partition:
        """The partition of this partition's count that takes ``sensor``."""
        return Partition(partition_of(sensor, self.count), self.count)

    def _select_frame(self, frame: Frame) -> tuple[list[list[Report] | list[Frame]], int]:
        if isinstance(frame, HWPCFrame):
            sensors = frame.sensors()
            taken = [sensor for sensor in sensors if self.owns(sensor)]
            whole: list[Frame] = [frame]
            if len(taken) == len(sensors):
                return [whole], 0
            parts: list[Frame] = [frame.of_sensor(sensor) for sensor in taken]
            return [[part] for part in parts], len(frame) - sum(map(len, parts))
        sensor = getattr(frame, "sensor", None)
        if isinstance(sensor, str):  # frames of one sensor (PowerFrame, FormulaFrame)
            return ([[frame]], 0) if self.owns(sensor) else ([], len(frame))
        kept = [report for report in frame.reports() if self.owns(report.sensor)]
        return ([kept] if kept else []), len(frame) - len(kept)
