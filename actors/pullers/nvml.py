"""The NVML sampler: one GPUReport per tick with every GPU's readings, through ``nvidia-ml-py``.

NVML is a blocking C library, so every call runs on the sampler's own thread, never the event
loop; that thread also keeps time, and hands ticks to the pipeline in batches (``--batch-ms``)
because at 10 Hz a hand-off per tick would cost more than sampling. Each reading is its own call
in its own ``try``: a reading the GPU does not support (or that fails this time) is left out of the
report, never written as 0, so a consumer can tell "not measured" from "zero".

The driver's sample buffers (power, GPU and memory utilisation) and per-process utilisation are
read from the newest timestamp already seen, each buffer from its own, so consecutive reports
hold every sample once: none missed while the buffer still held it, none repeated. The first
tick starts from the sampler's start: what the driver buffered before then belongs to no run.

``pynvml`` is imported when the sampler starts, not with this module: nodes without GPUs load
the registry of inputs without needing the package.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, NonNegativeInt, PositiveInt, field_validator

from wattflow.actors.backend import split_commas
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.actors.pullers.nvml_api import (
    FieldReader,
    GpmInstances,
    Nvml,
    NvmlError,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnavailable,
    ProcessReader,
    SampleReader,
    UtilizationReader,
    gpm_supported,
    mig_devices,
    typed,
)
from wattflow.formats.reports import (
    EMPTY_DEVICE,
    GPUDevice,
    GPUInstanceActivity,
    GPUProcess,
    GPUReport,
    GPUSampleKind,
    Report,
    trusted_device,
)

logger = logging.getLogger(__name__)

DeviceList = Annotated[list[NonNegativeInt], BeforeValidator(split_commas)]
"""GPU indexes, as a list or comma-separated (``--devices 0,2``)."""


class NvmlPullerConfig(PullerConfig):
    """Settings of the NVML sampler (``--input nvml``)."""

    type: Literal["nvml"] = "nvml"
    model: str = Field(
        default="GPUReport",
        description="Report kind the sampler writes: always GPUReport.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    interval_ms: PositiveInt = Field(default=100, description="Sampling period in ms.")
    window_ms: PositiveInt = Field(
        default=1000,
        description="How often the per-process utilisation and the driver's power samples "
        "are read, in ms (each read costs milliseconds of CPU on recent drivers).",
    )
    energy_ms: PositiveInt = Field(
        default=2000,
        description="How often the energy counter is read, in ms (4 ms of CPU a read on an "
        "H100); the ticks in between report power readings, and the GPU formula shares the "
        "counter's increase among them. Keep it below the formula's --gpu-hold-ms.",
    )
    batch_ms: PositiveInt = Field(
        default=1000,
        description="How often sampled ticks go down the pipeline, in ms: every tick is still "
        "its own report, but a batch costs the pipeline about what one report does, so "
        "larger batches cost less CPU and smaller ones arrive sooner.",
    )
    devices: DeviceList | None = Field(
        default=None, description="GPU indexes to sample, comma-separated (default: all)."
    )
    cgroup_root: Path = Field(
        default=Path("/proc"),
        description="Where the processes' <pid>/cgroup files are (the host's /proc when the "
        "sampler runs in a container).",
    )
    sensor: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="Sensor name of the reports (default: the host name).",
        json_schema_extra={"default_doc": "the host name"},
    )

    @field_validator("model")
    @classmethod
    def _gpu_reports_only(cls, value: str) -> str:
        if value != GPUReport.kind:
            raise ValueError(f"the nvml input writes GPUReport, not {value!r}")
        return value


_SAMPLE_TYPES: tuple[tuple[GPUSampleKind, str], ...] = (
    ("TOTAL_POWER", "NVML_TOTAL_POWER_SAMPLES"),
    ("GPU_UTILIZATION", "NVML_GPU_UTILIZATION_SAMPLES"),
    ("MEMORY_UTILIZATION", "NVML_MEMORY_UTILIZATION_SAMPLES"),
)

_UNION_MEMBER = dict(enumerate(("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")))
"""Which member of NVML's value union holds a sample, by its NVML_VALUE_TYPE_*."""

_WINDOW_SAMPLES: tuple[GPUSampleKind, ...] = ("TOTAL_POWER",)
_BUFFER_SAMPLES: tuple[GPUSampleKind, ...] = ("GPU_UTILIZATION", "MEMORY_UTILIZATION")

FAILURES_BEFORE_WARNING = 3
"""Failures in a row after which a reading is said, once, to keep failing."""


def read_cgroup(root: str, pid: int) -> str | None:
    """The cgroup of a process: the unified (v2) hierarchy's path, else the first one listed.

    ``None`` when the process has gone or its file cannot be read: a process that ended
    between NVML's sample and this read still has its utilisation reported.
    """
    try:
        with open(f"{root}/{pid}/cgroup") as file:
            text = file.read()
    except OSError:
        return None
    first: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            return parts[2]
        if first is None:
            first = parts[2]
    return first


@dataclass
class _DeviceState:
    """What the sampler remembers about one GPU between ticks."""

    index: int
    handle: Any
    last_sample_us: dict[GPUSampleKind, int]
    last_process_us: int
    samples: dict[GPUSampleKind, SampleReader] = field(default_factory=dict)
    processes: ProcessReader | None = None
    power_field: int | None = None
    """The field value read for power each tick (instantaneous, else the 1 s average); None:
    the legacy ``nvmlDeviceGetPowerUsage``."""
    energy_field: bool = False
    """Whether the energy counter comes with the power field in one call."""
    power_reader: FieldReader | None = None
    """The power field alone, in an array made once."""
    energy_reader: FieldReader | None = None
    """The power field and the energy counter, in an array made once."""
    utilization: UtilizationReader | None = None
    due: dict[str, float] = field(default_factory=dict)
    """When (monotonic s) each group of readings of the schedule is read next."""
    latest: dict[str, float | int] = field(default_factory=dict)
    """The slow readings' latest values, repeated in every tick until read again."""
    unsupported: set[str] = field(default_factory=set)
    """Readings that answered NOT_SUPPORTED or NO_PERMISSION: neither changes while the
    sampler runs, so they are not asked for again."""
    failing: dict[str, int] = field(default_factory=dict)
    """Readings failing now, with how many times in a row."""
    pcie: dict[str, float] = field(default_factory=dict)
    """Latest PCIe throughput (``pci_tx``, ``pci_rx``), from :meth:`NvmlSampler.read_pcie`."""
    cgroups: dict[int, str | None] = field(default_factory=dict)
    """cgroups of the processes seen last window (``None``: unreadable, or gone): a process
    keeps its cgroup while it runs, so its file is read when it appears, not every window. A
    pid absent for a window is forgotten, so a new process that reuses it is read afresh.
    Under MIG, the processes on the GPU instances."""
    gpm_supported: bool = False
    """Whether the GPU is in MIG mode and has GPM counters (Hopper and newer)."""
    gpm: GpmInstances | None = None
    """Its GPU instances' GPM samples, where it has any instance."""
    instance_end_us: int = 0
    """End of the last GPM window reported (at first, when the sampler started)."""


@dataclass
class Tick:
    """One tick's readings, taken on the sampler's thread."""

    timestamp: datetime
    devices: dict[str, GPUDevice]
    rejected: list[tuple[Any, str]]


STATE_S = 1.0
"""How often clocks, temperature and the performance state are read."""

BUFFERS_S = 5.0
"""How often the driver's GPU and memory utilisation sample buffers are read: they cost a
firmware round trip each and the driver keeps more than this many seconds of them."""

SETTINGS_S = 60.0
"""How often the application clocks and the power limit are read: settings, not readings."""

_NOT_FOUND = object()


class NvmlSampler:
    """The blocking part: NVML calls, from the sampler's thread and the PCIe reader's.

    Each figure is read only as often as it changes (see :meth:`tick` for the schedule), since
    on recent drivers each query spins the calling thread for up to milliseconds.

    NVML is thread-safe; the two threads share nothing but ``unsupported`` (set additions,
    atomic under the GIL), ``failing`` (one key per reading, each touched by one thread) and
    ``pcie`` (replaced whole).

    Kept apart from the asyncio puller so that a benchmark or a ``sensor`` command can drive it
    without an event loop.
    """

    def __init__(self, config: NvmlPullerConfig, api: Nvml | None = None) -> None:
        self.config = config
        self.api = api if api is not None else Nvml()
        self.nvml = self.api.module
        self.devices: list[_DeviceState] = []
        self.announce = True
        """Whether :meth:`open` logs how each GPU in MIG mode is attributed (the start's
        probe opens NVML quietly, so the log says it once)."""
        self._cgroup_root = str(config.cgroup_root)
        self._window_s = config.window_ms / 1000
        self._energy_s = config.energy_ms / 1000
        self._slack_s = config.interval_ms / 2000
        nvml: Any = self.nvml
        self._energy_field = nvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
        # The slow readings, by group: (report field, reading, function, args).
        self._groups: dict[str, tuple[float, tuple[tuple[str, str, Any, tuple[Any, ...]], ...]]]
        self._groups = {
            "state": (
                STATE_S,
                (
                    ("clock_gpu", "clock", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_SM,)),
                    ("clock_mem", "clock_mem", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_MEM,)),
                    ("temperature", "temperature", nvml.nvmlDeviceGetTemperature, (0,)),
                    ("power_state", "power_state", nvml.nvmlDeviceGetPowerState, ()),
                ),
            ),
            "settings": (
                SETTINGS_S,
                (
                    ("app_clock_gpu", "app_clock", nvml.nvmlDeviceGetApplicationsClock,
                     (nvml.NVML_CLOCK_SM,)),
                    ("app_clock_mem", "app_clock_mem", nvml.nvmlDeviceGetApplicationsClock,
                     (nvml.NVML_CLOCK_MEM,)),
                    ("enforced_power_limit", "power_limit",
                     nvml.nvmlDeviceGetEnforcedPowerLimit, ()),
                ),
            ),
        }  # fmt: skip

    def open(self, since_us: int) -> None:
        """Start NVML and look up the devices; samples older than ``since_us`` are skipped.

        Raises:
            NvmlUnavailable: no driver, no GPU, or a requested index that does not exist.
        """
        self.api.init()
        try:
            count = int(self.api.call(self.nvml.nvmlDeviceGetCount))
            if count == 0:
                raise NvmlUnavailable("NVML: no NVIDIA GPU found (the driver reports 0 devices)")
            wanted = self.config.devices if self.config.devices is not None else range(count)
            missing = [index for index in wanted if index >= count]
            if missing:
                raise NvmlUnavailable(
                    f"NVML: no GPU with index {missing[0]}; this node has {count} "
                    f"(indexes 0-{count - 1})"
                )
            self.devices = [self._device(index, since_us) for index in sorted(set(wanted))]
        except NvmlError as error:
            self.close()
            raise NvmlUnavailable(f"NVML: cannot list the GPUs: {error}") from None
        except NvmlUnavailable:
            self.close()
            raise

    def _device(self, index: int, since_us: int) -> _DeviceState:
        """Look a GPU up, learn which calls it answers, and make its buffer readers."""
        handle = self.api.call(self.nvml.nvmlDeviceGetHandleByIndex, index)
        state = _DeviceState(
            index=index,
            handle=handle,
            last_sample_us={kind: since_us for kind, _ in _SAMPLE_TYPES},
            last_process_us=since_us,
        )
        for kind, constant in _SAMPLE_TYPES:
            reader = self._call(state, f"samples_{kind}", SampleReader, self.api, handle,
                                getattr(self.nvml, constant))  # fmt: skip
            if reader is not None:
                state.samples[kind] = reader
        if self.api.mig_enabled(handle):
            # NVML answers per-process utilisation only for the whole GPU, not under MIG.
            state.unsupported.add("processes")
            self._open_gpm(state, since_us)
        else:
            state.processes = self._call(state, "processes", ProcessReader, self.api, handle)
        state.utilization = self._call(state, "utilization", UtilizationReader, self.api, handle)
        self._learn_fields(state)
        return state

    def _open_gpm(self, state: _DeviceState, since_us: int) -> None:
        """Under MIG: whether the GPU has GPM, and its GPU instances' first samples. Said once
        in the log, since it decides how the GPU's power is attributed."""
        index = state.index
        state.instance_end_us = since_us
        state.gpm_supported = bool(self._call(state, "gpm", gpm_supported, self.api, state.handle))
        level = logging.INFO if self.announce else logging.DEBUG
        if not state.gpm_supported:
            logger.log(
                level,
                "GPU %d is in MIG mode without GPM counters (before Hopper): NVML gives no "
                "per-process or per-instance activity there; its power above idle stays with "
                "gpu%d",
                index,
                index,
            )
            return
        state.due["instances"] = time.monotonic() + SETTINGS_S - self._slack_s
        self._list_instances(state)
        count = 0 if state.gpm is None else len(state.gpm.ids)
        logger.log(
            level,
            "GPU %d is in MIG mode with GPM: its power above idle is split among its %d GPU "
            "instances by their GPM activity (targets gpu%d/gi<id>), read every %d ms",
            index,
            count,
            index,
            self.config.window_ms,
        )

    def _list_instances(self, state: _DeviceState) -> None:
        """(Re)list the GPU's instances; a new set gets new samples, starting a new window."""
        instances = self._call(state, "gpm", mig_devices, self.api, state.handle)
        if instances is None or instances is _NOT_FOUND:
            return
        if state.gpm is not None:
            if state.gpm.ids == sorted(instances):
                return
            logger.info("GPU %d: its GPU instances are now %s", state.index, sorted(instances))
            state.gpm.close()
            state.gpm = None
        if instances:
            state.gpm = self._call(state, "gpm", GpmInstances, self.api, state.handle, instances)
        if state.gpm is not None:
            self._call(state, "gpm", state.gpm.read, _now_us())

    def _learn_fields(self, state: _DeviceState) -> None:
        """Which power field the GPU answers, and whether the energy counter comes with it
        (one call for both on the ticks that read energy)."""
        nvml = self.nvml
        wanted = [nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_FI_DEV_POWER_AVERAGE]
        values = self._call(state, "power_fields", nvml.nvmlDeviceGetFieldValues,
                            state.handle, [*wanted, self._energy_field])  # fmt: skip
        if values is None:
            return
        answered = {int(v.fieldId) for v in values if v.nvmlReturn == nvml.NVML_SUCCESS}
        state.power_field = next((f for f in wanted if f in answered), None)
        state.energy_field = self._energy_field in answered and state.power_field is not None
        if state.power_field is not None:
            state.power_reader = self._call(state, "power_fields", FieldReader, self.api,
                                            state.handle, [state.power_field])  # fmt: skip
            state.energy_reader = self._call(state, "power_fields", FieldReader, self.api,
                                             state.handle, [state.power_field,
                                                            self._energy_field])  # fmt: skip

    def close(self) -> None:
        """Shut NVML down, saying which readings were still failing; safe to call twice."""
        for state in self.devices:
            for reading, count in sorted(state.failing.items()):
                logger.warning(
                    "GPU %d: %s was still failing at stop (%d times in a row)",
                    state.index,
                    reading,
                    count,
                )
            state.failing.clear()
            if state.gpm is not None:
                state.gpm.close()
                state.gpm = None
        try:
            self.api.shutdown()
        except NvmlError as error:
            logger.warning("NVML shutdown failed: %s", error)

    def tick(self) -> Tick:
        """Read every device once, each figure at its own rate:

        - every tick: power (one field value, or the legacy call) and utilisation rates;
        - every ``--window-ms``: the per-process utilisation and the driver's power samples, or
          under MIG one GPM sample per GPU instance and the processes on each;
        - every ``--energy-ms``: the energy counter (in the same field-values call as power);
        - every ``STATE_S``: clocks, temperature and performance state;
        - every ``BUFFERS_S``: the GPU and memory utilisation sample buffers;
        - every ``SETTINGS_S`` (and at the first tick): application clocks, power limit; under
          MIG with GPM, the list of GPU instances (from the sampler's start);
        - PCIe throughput on its own thread (``read_pcie``).
        """
        timestamp = datetime.now(UTC)
        now = time.monotonic()
        rejected: list[tuple[Any, str]] = []
        devices = {str(state.index): self._read(state, now, rejected) for state in self.devices}
        return Tick(timestamp, devices, rejected)

    def _due(self, state: _DeviceState, group: str, period_s: float, now: float) -> bool:
        """Whether a group of readings is due at this tick (and if so, when it is next)."""
        if now < state.due.get(group, 0.0):
            return False
        state.due[group] = now + period_s - self._slack_s
        return True

    def read_pcie(self) -> None:
        """Read every device's PCIe throughput, for the ticks that follow to report.

        NVML counts the bytes over 20 ms inside the call, so each of the two calls blocks that
        long: with them in the tick, an 8-GPU node would spend 320 ms of every 100 ms tick
        waiting. So they are made apart from the ticks (on their own thread, every
        ``PCIE_REFRESH_S``), and each tick reports the latest answer.
        """
        nvml = self.nvml
        for state in self.devices:
            readings: dict[str, float] = {}
            for name, counter in (
                ("pci_tx", nvml.NVML_PCIE_UTIL_TX_BYTES),
                ("pci_rx", nvml.NVML_PCIE_UTIL_RX_BYTES),
            ):
                value = self._call(state, name, nvml.nvmlDeviceGetPcieThroughput, state.handle,
                                   counter)  # fmt: skip
                if value is not None:
                    readings[name] = float(value)
            state.pcie = readings  # one assignment: a tick sees the old pair or the new one

    def _call(self, state: _DeviceState, reading: str, function: Any, *args: Any) -> Any:
        """``function(*args)``, one NVML call; ``None`` when it fails, so the reading is left
        out of the report, and ``_NOT_FOUND`` when the driver answers NOT_FOUND (nothing new
        since the timestamp given).

        NOT_SUPPORTED and NO_PERMISSION are remembered per reading; any other error is counted
        and the reading tried again when next due (a GPU busy resetting answers again later).
        """
        if reading in state.unsupported:
            return None
        try:
            value = function(*args)
        except NvmlError as error:
            return self._failed(state, reading, error)
        except self.nvml.NVMLError as raw:
            return self._failed(state, reading, self.api.error(raw, reading))
        if state.failing:
            self._answered(state, reading)
        return value

    def _failed(self, state: _DeviceState, reading: str, error: NvmlError) -> Any:
        """Account for a failed reading; what :meth:`_call` returns for it."""
        if isinstance(error, NvmlNotFound):
            if state.failing:
                self._answered(state, reading)
            return _NOT_FOUND
        if isinstance(error, NvmlNotSupported | NvmlNoPermission):
            state.unsupported.add(reading)
            level = logging.INFO if isinstance(error, NvmlNotSupported) else logging.WARNING
            logger.log(level, "GPU %d: %s: %s; left out", state.index, reading, error)
            return None
        count = state.failing[reading] = state.failing.get(reading, 0) + 1
        if count == FAILURES_BEFORE_WARNING:
            logger.warning(
                "GPU %d: %s keeps failing (%s, %d times in a row); left out of the reports "
                "while it fails",
                state.index,
                reading,
                error,
                count,
            )
        else:
            logger.debug("GPU %d: %s failed: %s", state.index, reading, error)
        return None

    def _answered(self, state: _DeviceState, reading: str) -> None:
        count = state.failing.pop(reading, 0)
        if count >= FAILURES_BEFORE_WARNING:
            logger.warning(
                "GPU %d: %s answers again after failing %d times", state.index, reading, count
            )

    def _read(self, state: _DeviceState, now: float, rejected: list[tuple[Any, str]]) -> GPUDevice:
        window = self._due(state, "window", self._window_s, now)
        fields = EMPTY_DEVICE.copy()
        fields.update(self._power(state, self._due(state, "energy", self._energy_s, now)))
        if state.utilization is not None:
            rates = self._call(state, "utilization", state.utilization.read)
            if rates is not None:
                fields["util_gpu"] = float(rates[0])
                fields["util_mem"] = float(rates[1])
        self._slow(state, now)
        fields.update(state.latest)
        fields.update(state.pcie)
        kinds = _WINDOW_SAMPLES if window else ()
        if self._due(state, "buffers", BUFFERS_S, now):
            kinds = (*kinds, *_BUFFER_SAMPLES)
        samples = self._samples(state, kinds)
        if samples:
            fields["samples"] = samples
        processes = self._processes(state, rejected, asked=window)
        if processes is not None:
            fields["processes"], fields["process_window"] = processes
        instances = self._instances(state, now, rejected, asked=window)
        if instances is not None:
            fields["instances"], fields["instance_window"] = instances
        # Every value above is already a float, int, bool or a checked list: skip validation.
        return trusted_device(fields)

    def _slow(self, state: _DeviceState, now: float) -> None:
        """Read the groups of slow readings that are due into ``state.latest``."""
        for group, (period_s, readings) in self._groups.items():
            if self._due(state, group, period_s, now):
                for name, reading, function, args in readings:
                    value = self._call(state, reading, function, state.handle, *args)
                    if value is None:
                        state.latest.pop(name, None)
                    else:
                        state.latest[name] = int(value) if name == "power_state" else float(value)

    def _power(self, state: _DeviceState, energy: bool) -> dict[str, Any]:
        """Power (and, when ``energy``, the energy counter) in as few calls as the GPU allows:
        one field-values call for both where it answers them, else the legacy calls.

        The field values say whether power is instantaneous or the driver's 1 s average (what
        ``nvmlDeviceGetPowerUsage`` answers since Ampere, without saying so: then
        ``power_averaged`` is unset).
        """
        nvml = self.nvml
        found: dict[str, Any] = {}
        if state.power_field is not None:
            found = self._fields(state, energy)
        else:
            usage = self._call(state, "power_usage", nvml.nvmlDeviceGetPowerUsage, state.handle)
            if usage is not None:
                found["power"] = float(usage)
        if energy and not state.energy_field:
            energy = self._call(state, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption,
                                state.handle)  # fmt: skip
            if energy is not None:
                found["total_energy"] = float(energy)
        return found

    def _fields(self, state: _DeviceState, energy: bool) -> dict[str, Any]:
        """Power, and energy when ``energy`` and the GPU has it there, in one field-values
        call; a field that fails is accounted like a failed call."""
        nvml = self.nvml
        found: dict[str, Any] = {}
        reader = state.energy_reader if energy and state.energy_field else state.power_reader
        if reader is None:
            return found
        values = self._call(state, "power_fields", reader.read)
        for value in values or ():
            reading = "energy" if value.fieldId == self._energy_field else "power"
            if value.nvmlReturn != nvml.NVML_SUCCESS:
                code = int(value.nvmlReturn)
                self._failed(state, reading, typed(code, f"field {value.fieldId}", str(code)))
                continue
            if state.failing:
                self._answered(state, reading)
            if reading == "energy":
                found["total_energy"] = _union(value)
            else:
                found["power"] = _union(value)
                found["power_averaged"] = value.fieldId == nvml.NVML_FI_DEV_POWER_AVERAGE
        return found

    def _samples(
        self, state: _DeviceState, kinds: tuple[GPUSampleKind, ...]
    ) -> dict[GPUSampleKind, list[tuple[int, float]]]:
        """Each asked buffer's samples newer than the last one taken from it.

        NVML answers NOT_FOUND when nothing is newer; the older samples a driver may still
        return are dropped here too, so a sample never appears in two reports.
        """
        found: dict[GPUSampleKind, list[tuple[int, float]]] = {}
        for kind in kinds:
            reader = state.samples.get(kind)
            if reader is None:
                continue
            last = state.last_sample_us[kind]
            answer = self._call(state, f"samples_{kind}", reader.read, last)
            if answer is None or answer is _NOT_FOUND:
                continue
            value_type, raw = answer
            member = _UNION_MEMBER.get(value_type, "uiVal")
            taken = sorted(
                (int(s.timeStamp), float(getattr(s.sampleValue, member)))
                for s in raw
                if s.timeStamp > last
            )
            if taken:
                state.last_sample_us[kind] = taken[-1][0]
                found[kind] = taken
        return found

    def _processes(
        self, state: _DeviceState, rejected: list[tuple[Any, str]], *, asked: bool
    ) -> tuple[list[GPUProcess], tuple[int, int]] | None:
        """The driver's per-process utilisation since its previous answer, and the window it
        covers: (previous answer's newest sample, this answer's newest sample].

        The driver records every ~200 ms which one process holds the engine; NVML gives each
        process's mean over the samples of the window (a sample naming another process
        counts as 0), one entry per process. A driver that gives several entries for a pid is
        averaged over them. When nothing is new the window has no length; when the driver
        answers NOT_FOUND for longer than ``PROCESS_SETTLE_US`` (no process used the SMs), the
        window runs to that margin before now with no process in it.

        None where the device cannot tell (left out of the report). A tick that does not ask
        (``asked`` false: between windows) reports a window of no length.
        """
        start = state.last_process_us
        if state.processes is None or "processes" in state.unsupported:
            return None
        if not asked:
            return [], (start, start)
        answer = self._call(state, "processes", state.processes.read, start)
        if "processes" in state.unsupported:
            return None
        if answer is None:  # failed this time: the next answer covers this window too
            return [], (start, start)
        if answer is _NOT_FOUND:
            end = _now_us() - PROCESS_SETTLE_US
            if end <= start:
                return [], (start, start)
            state.last_process_us = end
            return [], (start, end)
        sums: dict[int, list[float]] = {}
        end = start
        for sample in answer:
            stamp = int(sample.timeStamp)
            if stamp <= start:
                continue
            end = max(end, stamp)
            totals = sums.setdefault(int(sample.pid), [0.0, 0.0, 0])
            totals[0] += sample.smUtil
            totals[1] += sample.memUtil
            totals[2] += 1
        state.last_process_us = end
        return self._named(state, sums, rejected), (start, end)

    def _instances(
        self, state: _DeviceState, now: float, rejected: list[tuple[Any, str]], *, asked: bool
    ) -> tuple[list[GPUInstanceActivity], tuple[int, int]] | None:
        """Under MIG with GPM: each GPU instance's activity since the previous window, and that
        window, (previous GPM samples, these]. None where the GPU cannot tell.

        Between windows, and when a read fails (the next one starts over: the time between is
        covered by no window), a window of no length. The instances are listed again every
        ``SETTINGS_S``, and at the tick after a sample answered NOT_FOUND (an instance was
        destroyed)."""
        if not state.gpm_supported or "gpm" in state.unsupported:
            return None
        if self._due(state, "instances", SETTINGS_S, now):
            self._list_instances(state)
        last = state.instance_end_us
        if not asked or state.gpm is None:
            return [], (last, last)
        answer = self._call(state, "gpm", state.gpm.read, _now_us())
        if answer is _NOT_FOUND:  # an instance is gone: list them again at the next tick
            state.due["instances"] = 0.0
        if answer is None or answer is _NOT_FOUND:
            return [], (last, last)
        start, end, activity = answer
        if not _possible(activity):
            rejected.append(
                ({"gpu": state.index, "instances": activity},
                 f"GPU {state.index}: impossible GPM activity")
            )  # fmt: skip
            return [], (last, last)
        state.instance_end_us = end
        return self._on_instances(state, activity), (start, end)

    def _on_instances(
        self, state: _DeviceState, activity: dict[int, tuple[float, float | None]]
    ) -> list[GPUInstanceActivity]:
        """The instances' activity with the processes on each and their cgroups (read when a
        process appears, as for per-process utilisation)."""
        assert state.gpm is not None
        known = state.cgroups
        state.cgroups = {}
        found = []
        for gi, (graphics, sm) in sorted(activity.items()):
            pids: set[int] = set()
            for reader in state.gpm.processes[gi]:
                answer = self._call(state, "instance_processes", reader.read)
                if isinstance(answer, list):
                    pids.update(answer)
            cgroups = []
            for pid in sorted(pids):
                cgroup = known[pid] if pid in known else read_cgroup(self._cgroup_root, pid)
                state.cgroups[pid] = cgroup
                cgroups.append(cgroup)
            found.append(
                GPUInstanceActivity.model_construct(
                    id=gi, graphics_util=graphics, sm_util=sm, pids=sorted(pids), cgroups=cgroups
                )
            )
        return found

    def _named(
        self, state: _DeviceState, sums: dict[int, list[float]], rejected: list[tuple[Any, str]]
    ) -> list[GPUProcess]:
        """The window's processes with their cgroups, impossible readings dead-lettered.

        A cgroup is read when a process appears and kept while the process is in every
        window; a pid missing from a window is read afresh if it comes back (pid reuse)."""
        processes = []
        known = state.cgroups
        state.cgroups = {}
        for pid, (sm, mem, count) in sorted(sums.items()):
            sm_util, mem_util = sm / count, mem / count
            if not (0 <= sm_util <= 100 and 0 <= mem_util <= 100):
                rejected.append(
                    (
                        {"gpu": state.index, "pid": pid, "sm_util": sm_util, "mem_util": mem_util},
                        f"GPU {state.index}: impossible utilisation for pid {pid}",
                    )
                )
                continue
            cgroup = known[pid] if pid in known else read_cgroup(self._cgroup_root, pid)
            state.cgroups[pid] = cgroup
            # Checked above, and built 10 times a second per process: no second validation.
            processes.append(
                GPUProcess.model_construct(
                    pid=pid, sm_util=sm_util, mem_util=mem_util, cgroup=cgroup
                )
            )
        return processes


def _possible(activity: dict[int, tuple[float, float | None]]) -> bool:
    """Whether every instance's GPM activity (graphics %, SM % or None) is a percentage."""
    return all(0 <= g <= 100 and (s is None or 0 <= s <= 100) for g, s in activity.values())


def _union(field_value: Any) -> float:
    """The number an ``nvmlFieldValue_t`` holds, from the union member its type names."""
    member = _UNION_MEMBER.get(int(field_value.valueType), "uiVal")
    return float(getattr(field_value.value, member))


@pullers.register("nvml")
class NvmlPuller(Puller[NvmlPullerConfig]):
    """Samples the GPUs every ``interval_ms`` until the pipeline stops.

    Ticks fall on multiples of the interval in Unix time, so samplers on different nodes tick
    together. A tick that starts late (a stalled machine) skips to the next multiple instead of
    running the missed ones back to back; ``skipped_ticks`` counts them.
    """

    config_model = NvmlPullerConfig

    def __init__(self, config: NvmlPullerConfig, *, stream: bool = True) -> None:
        super().__init__(config, stream=True)
        self.sampling = False
        self.skipped_ticks = 0
        self.ticks = 0

    async def check(self) -> None:
        """Start and stop NVML once, so a node without a driver or GPU fails before running."""

        def probe() -> None:
            sampler = NvmlSampler(self.config)
            sampler.announce = False
            sampler.open(_now_us())
            sampler.close()

        await asyncio.to_thread(probe)

    def not_ready(self) -> str | None:
        return None if self.sampling else "NVML not opened yet"

    async def pull(self, emitter: Emitter) -> None:
        sampler = await asyncio.to_thread(NvmlSampler, self.config)
        await asyncio.to_thread(sampler.open, _now_us())
        self.sampling = True
        logger.info(
            "sampling GPUs %s every %d ms",
            ",".join(str(d.index) for d in sampler.devices),
            self.config.interval_ms,
        )
        try:
            await self._loop(sampler, emitter)
        finally:
            await asyncio.to_thread(sampler.close)

    async def _loop(self, sampler: NvmlSampler, emitter: Emitter) -> None:
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[list[Tick] | BaseException | None] = asyncio.Queue()

        def hand(item: list[Tick] | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(handed.put_nowait, item)

        pacer = _Pacer(sampler, self.config.interval_ms / 1000, self.config.batch_ms / 1000, hand)
        pacer.start()
        stopper = asyncio.create_task(_stop_when_asked(emitter.stopping, pacer))
        try:
            while (item := await handed.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                for tick in item:
                    for payload, reason in tick.rejected:
                        emitter.reject(payload, reason)
                reports: list[Report] = [
                    GPUReport.trusted(
                        timestamp=tick.timestamp,
                        sensor=self.config.sensor,
                        target="all",
                        metadata={},
                        devices=tick.devices,
                    )
                    for tick in item
                ]
                await emitter.emit(reports)
                self.ticks += len(reports)
                pacer.slot.release()
        finally:
            stopper.cancel()
            pacer.stop()
            pacer.slot.release()  # never leave the thread waiting for a batch nobody emits
            await asyncio.to_thread(pacer.join)
            self.skipped_ticks = pacer.skipped_ticks
            unsent = 0
            while not handed.empty():
                if isinstance(left := handed.get_nowait(), list):
                    unsent += len(left)
            if unsent:  # only when emitting failed: the pipeline is stopping on an error
                logger.error("NVML sampler: %d ticks not emitted: the pipeline failed", unsent)


async def _stop_when_asked(stopping: asyncio.Event, pacer: _Pacer) -> None:
    await stopping.wait()
    pacer.stop()


PROCESS_SETTLE_US = 1_000_000
"""How long after a moment the sampler takes the driver's NOT_FOUND for "no process used the
SMs up to then": a driver publishes its samples a little after taking them, and a window
once closed is never reopened."""

STOP_CHECK_S = 0.25
"""Longest the sampler's thread sleeps without looking whether it should stop."""

PCIE_REFRESH_S = 5.0
"""How often the PCIe throughput that ticks report is read again (see ``read_pcie``)."""


class _PcieReader(threading.Thread):
    """Keeps the sampler's PCIe readings fresh, off the ticks' thread."""

    def __init__(self, sampler: NvmlSampler, stopping: threading.Event) -> None:
        super().__init__(name="nvml-pcie", daemon=True)
        self.sampler = sampler
        self.stopping = stopping

    def run(self) -> None:
        while not self.stopping.wait(PCIE_REFRESH_S):
            try:
                self.sampler.read_pcie()
            except Exception:  # the ticks go on; their PCIe figures just stop being renewed
                logger.exception("NVML: PCIe throughput reader stopped")
                return


class _Pacer(threading.Thread):
    """Samples on its own thread, on time, and hands ticks to the event loop in batches.

    Each tick is its own GPUReport, but going through the pipeline costs about the same for
    one report as for ten, and at 10 Hz that fixed cost would dwarf sampling itself. So ticks
    go down the pipeline every ``batch_s``, and the thread sleeps between ticks without waking
    the event loop. One batch at a time may wait for the pipeline (``slot``); while it waits,
    the next one fills, and when that one is full too the thread waits instead of sampling: a
    stalled pipeline skips ticks (counted in ``skipped_ticks``) rather than growing memory.
    The driver's sample buffers are read from their last timestamps either way, so no driver
    sample is lost to a skip while the buffer still holds it.
    """

    def __init__(
        self,
        sampler: NvmlSampler,
        interval_s: float,
        batch_s: float,
        hand: Callable[[list[Tick] | BaseException | None], None],
    ) -> None:
        super().__init__(name="nvml-sampler", daemon=True)
        self.sampler = sampler
        self.interval_s = interval_s
        self.batch_s = batch_s
        self.hand = hand
        self.slot = threading.Semaphore(1)
        self.skipped_ticks = 0
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            self._sample()
        except Exception as error:  # an NVML or programming error ends the input, loudly
            self.hand(error)
        finally:
            self.hand(None)

    def _sample(self) -> None:
        # The first reading is there for the first tick; the reader renews it from then on.
        self.sampler.read_pcie()
        pcie = _PcieReader(self.sampler, self._stopping)
        pcie.start()
        try:
            self._pace()
        finally:
            self._stopping.set()
            pcie.join()

    def _pace(self) -> None:
        interval = self.interval_s
        deadline = math.floor(time.time() / interval + 1) * interval
        per_batch = max(1, round(self.batch_s / interval))
        pending: list[Tick] = []
        try:
            while True:
                delay = deadline - time.time()
                if delay > 0:
                    if self._sleep(delay):
                        break
                elif -delay >= interval:
                    # Whole ticks have passed (a stalled machine, a stalled pipeline): run the one
                    # due now rather than the missed ones back to back.
                    missed = math.floor(-delay / interval)
                    self.skipped_ticks += missed
                    deadline += missed * interval
                    logger.warning(
                        "NVML sampler %.0f ms late: skipped %d ticks (%d in all)",
                        -delay * 1000,
                        missed,
                        self.skipped_ticks,
                    )
                if self._stopping.is_set():
                    break
                pending.append(self.sampler.tick())
                deadline += interval
                if len(pending) >= per_batch:
                    self._hand_batch(pending)
                    pending = []
        finally:  # a failing tick or a stop: what was sampled still goes down the pipeline
            if pending:
                self._hand_batch(pending)

    def _sleep(self, seconds: float) -> bool:
        """Sleep, looking up every ``STOP_CHECK_S``; True when asked to stop.

        ``time.sleep`` rather than ``Event.wait``: a timed wait on an event allocates and
        releases a lock on every call, which on a small virtual machine costs more than half
        again as much per tick as the plain sleep.
        """
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, STOP_CHECK_S))
            if self._stopping.is_set():
                return True
        return self._stopping.is_set()

    def _hand_batch(self, batch: list[Tick]) -> None:
        """Wait until the previous batch is emitted, then hand this one over."""
        self.slot.acquire()
        self.hand(batch)


def _now_us() -> int:
    return time.time_ns() // 1000
