"""One GPU as the sampler keeps it between ticks, and the readings of the device itself.

:class:`DeviceState` holds what the sampler remembers about a GPU (its readers, the schedule
of its slow readings, the newest sample taken from each buffer) and accounts for every NVML
call made for it: a reading the GPU does not support (or that fails this time) is left out of
the report, never written as 0, so a consumer can tell "not measured" from "zero".

The readings here are the device's own: power and the energy counter (field values), the
driver's sample buffers, the slow readings (clocks, temperature, settings) and PCIe
throughput. Per-process utilisation is in ``processes``, GPU instances under MIG in ``mig``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from wattflow.actors.pullers.nvml.api import (
    FieldReader,
    GpmInstances,
    Nvml,
    NvmlError,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
    ProcessReader,
    RunningProcessReader,
    SampleReader,
    UtilizationReader,
    typed,
)
from wattflow.formats.reports import GPUSampleKind

logger = logging.getLogger(__name__)

SAMPLE_TYPES: tuple[tuple[GPUSampleKind, str], ...] = (
    ("TOTAL_POWER", "NVML_TOTAL_POWER_SAMPLES"),
    ("GPU_UTILIZATION", "NVML_GPU_UTILIZATION_SAMPLES"),
    ("MEMORY_UTILIZATION", "NVML_MEMORY_UTILIZATION_SAMPLES"),
)
"""The driver's sample buffers the sampler reads, with pynvml's name of each."""

UNION_MEMBER = dict(enumerate(("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")))
"""Which member of NVML's value union holds a sample, by its NVML_VALUE_TYPE_*."""

WINDOW_SAMPLES: tuple[GPUSampleKind, ...] = ("TOTAL_POWER",)
"""The buffers read every ``--window-ms``."""

BUFFER_SAMPLES: tuple[GPUSampleKind, ...] = ("GPU_UTILIZATION", "MEMORY_UTILIZATION")
"""The buffers read every ``BUFFERS_S``."""

FAILURES_BEFORE_WARNING = 3
"""Failures in a row after which a reading is said, once, to keep failing."""

STATE_S = 1.0
"""How often clocks, temperature and the performance state are read."""

BUFFERS_S = 5.0
"""How often the driver's GPU and memory utilisation sample buffers are read: they cost a
firmware round trip each and the driver keeps more than this many seconds of them."""

SETTINGS_S = 60.0
"""How often the application clocks and the power limit are read: settings, not readings."""

NOT_FOUND = object()
"""What :meth:`DeviceState.call` returns when the driver answers NOT_FOUND."""

SlowReading = tuple[str, str, Any, tuple[Any, ...]]
"""(report field, reading, pynvml function, its arguments after the handle)."""


@dataclass
class DeviceState:
    """What the sampler remembers about one GPU between ticks."""

    index: int
    handle: Any
    api: Nvml
    """The NVML seam the calls go through (its binding's raw errors are typed by it)."""
    slack_s: float
    """How early a reading may be taken before it is due (half a tick), so that one due
    every second is not pushed a tick later each time."""
    last_sample_us: dict[GPUSampleKind, int]
    last_process_us: int
    samples: dict[GPUSampleKind, SampleReader] = field(default_factory=dict)
    processes: ProcessReader | None = None
    running: RunningProcessReader | None = None
    """The processes holding a context, read with each process window (made at the first)."""
    running_pids: list[int] | None = None
    """Their pids at the newest window; ``None`` where they cannot be read."""
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
    next_due_s: float = 0.0
    """The earliest of ``due`` (monotonic s): before then a tick reads power and utilisation
    only, without going through the schedule."""
    latest: dict[str, float | int] = field(default_factory=dict)
    """The slow readings' latest values, repeated in every tick until read again."""
    unsupported: set[str] = field(default_factory=set)
    """Readings that answered NOT_SUPPORTED or NO_PERMISSION: neither changes while the
    sampler runs, so they are not asked for again."""
    failing: dict[str, int] = field(default_factory=dict)
    """Readings failing now, with how many times in a row."""
    pcie: dict[str, float] = field(default_factory=dict)
    """Latest PCIe throughput (``pci_tx``, ``pci_rx``), from :func:`read_pcie`."""
    cgroups: dict[int, str | None] = field(default_factory=dict)
    """cgroups of the processes seen last window (``None``: unreadable, or gone): a process
    keeps its cgroup while it runs, so its file is read when it appears, not every window. A
    pid absent for a window is forgotten, so a new process that reuses it is read afresh.
    Under MIG, the processes on the GPU instances."""
    started: dict[int, int | None] = field(default_factory=dict)
    """Start times (clock ticks since boot) of the processes seen last window, read with their
    cgroups: the GPU formula tells a reused pid from the process before by it."""
    gpm_supported: bool = False
    """Whether the GPU is in MIG mode and has GPM counters (Hopper and newer)."""
    gpm: GpmInstances | None = None
    """Its GPU instances' GPM samples, where it has any instance."""
    instance_end_us: int = 0
    """End of the last GPM window reported (at first, when the sampler started)."""

    def call(self, reading: str, function: Any, *args: Any) -> Any:
        """``function(*args)``, one NVML call; ``None`` when it fails, so the reading is left
        out of the report, and ``NOT_FOUND`` when the driver answers NOT_FOUND (nothing new
        since the timestamp given).

        NOT_SUPPORTED and NO_PERMISSION are remembered per reading; any other error is counted
        and the reading tried again when next due (a GPU busy resetting answers again later).
        """
        if reading in self.unsupported:
            return None
        try:
            value = function(*args)
        except NvmlError as error:
            return self.failed(reading, error)
        except self.api.module.NVMLError as raw:
            return self.failed(reading, self.api.error(raw, reading))
        if self.failing:
            self.answered(reading)
        return value

    def failed(self, reading: str, error: NvmlError) -> Any:
        """Account for a failed reading; what :meth:`call` returns for it."""
        if isinstance(error, NvmlNotFound):
            if self.failing:
                self.answered(reading)
            return NOT_FOUND
        if isinstance(error, NvmlNotSupported | NvmlNoPermission):
            self.unsupported.add(reading)
            level = logging.INFO if isinstance(error, NvmlNotSupported) else logging.WARNING
            logger.log(level, "GPU %d: %s: %s; left out", self.index, reading, error)
            return None
        count = self.failing[reading] = self.failing.get(reading, 0) + 1
        if count == FAILURES_BEFORE_WARNING:
            logger.warning(
                "GPU %d: %s keeps failing (%s, %d times in a row); left out of the reports "
                "while it fails",
                self.index,
                reading,
                error,
                count,
            )
        else:
            logger.debug("GPU %d: %s failed: %s", self.index, reading, error)
        return None

    def answered(self, reading: str) -> None:
        """A reading answered: if it had been failing, say it answers again."""
        count = self.failing.pop(reading, 0)
        if count >= FAILURES_BEFORE_WARNING:
            logger.warning(
                "GPU %d: %s answers again after failing %d times", self.index, reading, count
            )

    def is_due(self, group: str, period_s: float, now: float) -> bool:
        """Whether a group of readings is due at this tick (and if so, when it is next)."""
        if now < self.due.get(group, 0.0):
            return False
        self.due[group] = now + period_s - self.slack_s
        return True


def slow_groups(nvml: Any) -> dict[str, tuple[float, tuple[SlowReading, ...]]]:
    """The slow readings, by group: each group's period in s and its readings."""
    return {
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


def read_slow(
    state: DeviceState, groups: dict[str, tuple[float, tuple[SlowReading, ...]]], now: float
) -> None:
    """Read the groups of slow readings that are due into ``state.latest``."""
    for group, (period_s, readings) in groups.items():
        if state.is_due(group, period_s, now):
            for name, reading, function, args in readings:
                value = state.call(reading, function, state.handle, *args)
                if value is None:
                    state.latest.pop(name, None)
                else:
                    state.latest[name] = int(value) if name == "power_state" else float(value)


def open_buffers(state: DeviceState) -> None:
    """Make the readers of the driver's sample buffers the GPU answers."""
    module = state.api.module
    for kind, constant in SAMPLE_TYPES:
        reader = state.call(f"samples_{kind}", SampleReader, state.api, state.handle,
                            getattr(module, constant))  # fmt: skip
        if reader is not None:
            state.samples[kind] = reader


def learn_fields(state: DeviceState) -> None:
    """Which power field the GPU answers, and whether the energy counter comes with it
    (one call for both on the ticks that read energy)."""
    nvml = state.api.module
    energy_field = nvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    wanted = [nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_FI_DEV_POWER_AVERAGE]
    values = state.call("power_fields", nvml.nvmlDeviceGetFieldValues,
                        state.handle, [*wanted, energy_field])  # fmt: skip
    if values is None:
        return
    answered = {int(v.fieldId) for v in values if v.nvmlReturn == nvml.NVML_SUCCESS}
    state.power_field = next((f for f in wanted if f in answered), None)
    state.energy_field = energy_field in answered and state.power_field is not None
    if state.power_field is not None:
        state.power_reader = state.call("power_fields", FieldReader, state.api,
                                        state.handle, [state.power_field])  # fmt: skip
        state.energy_reader = state.call("power_fields", FieldReader, state.api,
                                         state.handle, [state.power_field,
                                                        energy_field])  # fmt: skip


def read_power(state: DeviceState, energy: bool) -> dict[str, Any]:
    """Power (and, when ``energy``, the energy counter) in as few calls as the GPU allows:
    one field-values call for both where it answers them, else the legacy calls.

    The field values say whether power is instantaneous or the driver's 1 s average (what
    ``nvmlDeviceGetPowerUsage`` answers since Ampere, without saying so: then
    ``power_averaged`` is unset).
    """
    nvml = state.api.module
    found: dict[str, Any] = {}
    if state.power_field is not None:
        found = _read_fields(state, energy)
    else:
        usage = state.call("power_usage", nvml.nvmlDeviceGetPowerUsage, state.handle)
        if usage is not None:
            found["power"] = float(usage)
    if energy and not state.energy_field:
        energy = state.call("energy", nvml.nvmlDeviceGetTotalEnergyConsumption, state.handle)
        if energy is not None:
            found["total_energy"] = float(energy)
    return found


def _read_fields(state: DeviceState, energy: bool) -> dict[str, Any]:
    """Power, and energy when ``energy`` and the GPU has it there, in one field-values
    call; a field that fails is accounted like a failed call."""
    nvml = state.api.module
    energy_field = nvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    found: dict[str, Any] = {}
    reader = state.energy_reader if energy and state.energy_field else state.power_reader
    if reader is None:
        return found
    values = state.call("power_fields", reader.read)
    for value in values or ():
        reading = "energy" if value.fieldId == energy_field else "power"
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            code = int(value.nvmlReturn)
            state.failed(reading, typed(code, f"field {value.fieldId}", str(code)))
            continue
        if state.failing:
            state.answered(reading)
        if reading == "energy":
            found["total_energy"] = union(value)
            if value.timestamp > 0:  # the driver's own time of the reading
                found["total_energy_us"] = int(value.timestamp)
        else:
            found["power"] = union(value)
            found["power_averaged"] = value.fieldId == nvml.NVML_FI_DEV_POWER_AVERAGE
    return found


def read_samples(
    state: DeviceState, kinds: tuple[GPUSampleKind, ...]
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
        answer = state.call(f"samples_{kind}", reader.read, last)
        if answer is None or answer is NOT_FOUND:
            continue
        value_type, raw = answer
        member = UNION_MEMBER.get(value_type, "uiVal")
        taken = sorted(
            (int(s.timeStamp), float(getattr(s.sampleValue, member)))
            for s in raw
            if s.timeStamp > last
        )
        if taken:
            state.last_sample_us[kind] = taken[-1][0]
            found[kind] = taken
    return found


def read_pcie(state: DeviceState) -> None:
    """Read the GPU's PCIe throughput into ``state.pcie``, for the ticks that follow to
    report (NVML counts the bytes over 20 ms inside each call: see ``pacing``)."""
    nvml = state.api.module
    readings: dict[str, float] = {}
    for name, counter in (
        ("pci_tx", nvml.NVML_PCIE_UTIL_TX_BYTES),
        ("pci_rx", nvml.NVML_PCIE_UTIL_RX_BYTES),
    ):
        value = state.call(name, nvml.nvmlDeviceGetPcieThroughput, state.handle, counter)
        if value is not None:
            readings[name] = float(value)
    state.pcie = readings  # one assignment: a tick sees the old pair or the new one


def union(field_value: Any) -> float:
    """The number an ``nvmlFieldValue_t`` holds, from the union member its type names."""
    member = UNION_MEMBER.get(int(field_value.valueType), "uiVal")
    return float(getattr(field_value.value, member))
