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

from wattflow.formats.batch import Batch, reports_left, sensors_share
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

    def select(self, batch: Batch) -> tuple[list[Batch], int]:
        """This partition's share of a batch: the batches to hand on (a frame of several
        partitions' sensors is cut per sensor taken), and how many reports were left."""
        return sensors_share(batch, self.owns)

    def divide(self, batch: Batch) -> tuple[list[Batch], list[Report]]:
        """This partition's share of a batch (as :meth:`select` cuts it), and the reports of
        the others' sensors, built: for an input that must dead-letter them, since the instance
        that owns them will not see them (a ZeroMQ topic that misnamed their sensor), rather
        than let them go.
        """
        kept, left = self.select(batch)
        return kept, (reports_left(batch, self.owns) if left else [])

    def of(self, sensor: str) -> Partition:
        """The partition of this partition's count that takes ``sensor``."""
        return Partition(partition_of(sensor, self.count), self.count)
