"""The GPU measurement directory: one repetition's CSV files, as its analysis code loads them.

Layout: ``<root>/<experiment>/<benchmark>/<settings>/<repetition>/`` holding
``system_info.json``, ``timestamps.csv``, ``gpu-power.csv``, ``power-external.csv`` (when a
meter was read) and, when the GPU gave such samples, ``total_power_samples.csv``,
``gpu_utilization_samples.csv`` and ``memory_utilization_samples.csv``. The facts its loader
depends on:

- ``gpu-power.csv``, ``power-external.csv`` and the sample files start with pandas' default
  index (an unnamed first column of 0, 1, 2, …); ``timestamps.csv`` has none, exactly
  ``timestamp,event,data``, where ``data`` is the event's integer index, 0 when unused;
- ``gpu-power.csv``, ``power-external.csv`` and ``timestamps.csv`` hold naive local times as
  ``str(datetime)`` (``2020-05-01 12:00:00.123456``); sample files hold integer Unix µs;
- ``gpu-power.csv``'s columns come in its collector's order, unsupported ones left out;
- ``gpu-power.csv`` and ``total_power_samples.csv`` (its ``value`` is power in mW) are what
  it loads in every repetition.

No CSV file is written without rows: pandas reads a file of only a header with an index of
dtype object, and the loader fails on it with an error that stops the whole load, whereas a
missing file makes it skip that one repetition, naming the file.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson

from wattflow.formats.reports import EventReport, GPUDevice, GPUReport, MeterReport, Report

GPU_COLUMNS = (
    ("clock-mem", "clock_mem"), ("clock-gpu", "clock_gpu"), ("app-clock-mem", "app_clock_mem"),
    ("app-clock-gpu", "app_clock_gpu"), ("enforced-power-limit", "enforced_power_limit"),
    ("total-energy", "total_energy"), ("power-state", "power_state"), ("power", "power"),
    ("tmp", "temperature"), ("pci-tx", "pci_tx"), ("pci-rx", "pci_rx"),
    ("util-gpu", "util_gpu"), ("util-mem", "util_mem"),
)  # fmt: skip
"""gpu-power.csv's columns after ``timestamp``, in its collector's order, with our field."""

SAMPLE_FILES = {
    "TOTAL_POWER": "total_power_samples.csv",
    "GPU_UTILIZATION": "gpu_utilization_samples.csv",
    "MEMORY_UTILIZATION": "memory_utilization_samples.csv",
}

SYSTEM_INFO_KEYS = (
    "device_name", "cuda_capability", "driver_version", "cuda_version", "nvml_version",
    "platform", "os_release", "os_version", "machine", "distro", "python_version",
    "pip_packages", "effective_power_limit",
)  # fmt: skip


def local_text(moment: datetime) -> str:
    """A time as the collector wrote it: naive local time, ``str(datetime)``."""
    return str(moment.astimezone().replace(tzinfo=None))


def event_index(data: int | str | None) -> int | str:
    """An event's ``data`` as ``timestamps.csv`` holds it: the spec's integer index, 0 when
    unused. Text that is a whole number (as earlier recordings stored epoch numbers) becomes
    that number; other text is written as it is."""
    if data is None:
        return 0
    if isinstance(data, int):
        return data
    text = data.strip()
    if not text:
        return 0
    if re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text)
    return data


class _IndexedCsv:
    """A CSV file with pandas' default index column, written row by row, created with its
    first row: a file of only a header is never written."""

    def __init__(self, path: Path, header: list[str]) -> None:
        self.path = path
        self.header = header
        self.handle: IO[str] | None = None
        self.writer: Any = None
        self.index = 0

    def row(self, values: Iterable[Any]) -> None:
        if self.writer is None:
            self.handle = self.path.open("w", newline="", encoding="utf-8")
            self.writer = csv.writer(self.handle)
            self.writer.writerow(["", *self.header])
        self.writer.writerow([self.index, *values])
        self.index += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


class RepetitionWriter:
    """Writes one repetition's files as its reports stream by, in time order."""

    def __init__(self, directory: Path, device: str | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # Files are written only when they get rows: those of an earlier export into the same
        # directory must not stay behind as if this run had them.
        for name in ("gpu-power.csv", "power-external.csv", *SAMPLE_FILES.values()):
            (directory / name).unlink(missing_ok=True)
        self.directory = directory
        self.device = device
        self.gpu: _IndexedCsv | None = None
        self.gpu_fields: list[tuple[str, str]] = []
        self.power_limit: float | None = None
        """The enforced power limit of the first GPU reading, in mW."""
        self.meter: _IndexedCsv | None = None
        self.meter_channels: list[str] = []
        self.samples = {
            kind: _IndexedCsv(directory / name, ["timestamp", "value"])
            for kind, name in SAMPLE_FILES.items()
        }
        self.timestamps = (directory / "timestamps.csv").open("w", newline="", encoding="utf-8")
        self.events = csv.writer(self.timestamps)
        self.events.writerow(["timestamp", "event", "data"])

    def add(self, report: Report) -> None:
        if isinstance(report, GPUReport):
            self._gpu(report)
        elif isinstance(report, MeterReport):
            self._meter(report)
        elif isinstance(report, EventReport):
            self.events.writerow(
                [local_text(report.timestamp), report.event, event_index(report.data)]
            )

    def _gpu(self, report: GPUReport) -> None:
        device = self._device(report)
        if device is None:
            return
        gpu = self.gpu if self.gpu is not None else self._open_gpu(device)
        values = [getattr(device, field) for _, field in self.gpu_fields]
        gpu.row([local_text(report.timestamp), *("" if v is None else _number(v) for v in values)])
        for kind, samples in (device.samples or {}).items():
            for micros, value in samples:
                self.samples[kind].row([micros, _number(value)])

    def _device(self, report: GPUReport) -> GPUDevice | None:
        """The one GPU a repetition's directory describes: the one asked for, else the
        lowest-numbered; ``None`` when the report has no reading of it."""
        if not report.devices:
            return None
        index = self.device if self.device is not None else min(report.devices, key=int)
        return report.devices.get(index)

    def _open_gpu(self, device: GPUDevice) -> _IndexedCsv:
        """gpu-power.csv, with the columns the device gave in its first reading: the others it
        does not support."""
        self.gpu_fields = [(c, f) for c, f in GPU_COLUMNS if getattr(device, f) is not None]
        header = ["timestamp", *(column for column, _ in self.gpu_fields)]
        self.gpu = _IndexedCsv(self.directory / "gpu-power.csv", header)
        self.power_limit = device.enforced_power_limit
        return self.gpu

    def _meter(self, report: MeterReport) -> None:
        if self.meter is None:
            self.meter_channels = sorted(report.channels)
            header = ["timestamp", *self.meter_channels]
            self.meter = _IndexedCsv(self.directory / "power-external.csv", header)
        values = [report.channels.get(channel, "") for channel in self.meter_channels]
        self.meter.row([local_text(report.timestamp), *map(_number, values)])

    def close(self, system: dict[str, Any]) -> None:
        """Close the CSV files and write ``system_info.json`` from the run's system info.

        The run's own values are written as they are; a key it lacks is ``null``, except
        ``effective_power_limit``, which the written GPU's first reading gives (in mW, as the
        collector's NVML call gave it).
        """
        for writer in (self.gpu, self.meter, *self.samples.values()):
            if writer is not None:
                writer.close()
        self.timestamps.close()
        info = {key: system.get(key) for key in SYSTEM_INFO_KEYS}
        if info["effective_power_limit"] is None and self.power_limit is not None:
            info["effective_power_limit"] = _number(self.power_limit)
        info.update({k: v for k, v in system.items() if k not in info})
        (self.directory / "system_info.json").write_bytes(
            orjson.dumps(info, option=orjson.OPT_INDENT_2)
        )


def _number(value: Any) -> Any:
    """Integers as integers (``100`` rather than ``100.0``), as the collector wrote NVML's ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
