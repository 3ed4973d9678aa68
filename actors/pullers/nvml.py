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
import importlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, NonNegativeInt, PositiveInt, field_validator

from wattflow.actors.backend import split_commas
from wattflow.actors.errors import PullError
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.formats.reports import GPUDevice, GPUProcess, GPUReport, GPUSampleKind, Report

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


class NvmlUnavailable(PullError):
    """NVML cannot be used on this node: no driver, no GPU, no permission, or no binding."""


_SAMPLE_TYPES: tuple[tuple[GPUSampleKind, str], ...] = (
    ("TOTAL_POWER", "NVML_TOTAL_POWER_SAMPLES"),
    ("GPU_UTILIZATION", "NVML_GPU_UTILIZATION_SAMPLES"),
    ("MEMORY_UTILIZATION", "NVML_MEMORY_UTILIZATION_SAMPLES"),
)

_UNION_MEMBER = dict(enumerate(("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")))
"""Which member of NVML's value union holds a sample, by its NVML_VALUE_TYPE_*."""


def load_pynvml() -> ModuleType:
    """The ``pynvml`` module of ``nvidia-ml-py``.

    Raises:
        NvmlUnavailable: when the package is not installed.
    """
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailable(
            "NVML: the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
        ) from None


def describe_init_error(nvml: ModuleType, error: Exception) -> str:
    """One line saying why NVML did not start and what to look at."""
    code = getattr(error, "value", None)
    if code == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            "NVML: no NVIDIA driver found (libnvidia-ml.so.1 not loadable); "
            "is the driver installed?"
        )
    if code == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return (
            "NVML: the NVIDIA kernel driver is not loaded (libnvidia-ml.so.1 found); "
            "is the nvidia module loaded (lsmod | grep nvidia)?"
        )
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return "NVML: no permission to open the NVIDIA devices (/dev/nvidia*)"
    return f"NVML: initialisation failed: {error}"


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
    unsupported: set[str] = field(default_factory=set)
    """Readings that answered NOT_SUPPORTED: the hardware will not change its mind, so they
    are not asked for again."""
    pcie: dict[str, float] = field(default_factory=dict)
    """Latest PCIe throughput (``pci_tx``, ``pci_rx``), from :meth:`NvmlSampler.read_pcie`."""
    cgroups: dict[int, str | None] = field(default_factory=dict)
    """cgroups of the processes seen last tick (``None``: unreadable, or gone): a process keeps
    its cgroup while it runs, so its file is read when it appears, not every tick. A pid absent
    for a tick is forgotten, so a new process that reuses it is read afresh."""


@dataclass
class Tick:
    """One tick's readings, taken on the sampler's thread."""

    timestamp: datetime
    devices: dict[str, GPUDevice]
    rejected: list[tuple[Any, str]]


class NvmlSampler:
    """The blocking part: NVML calls, from the sampler's thread and the PCIe reader's.

    NVML is thread-safe; the two threads share nothing but ``unsupported`` (set additions,
    atomic under the GIL) and ``pcie`` (replaced whole).

    Kept apart from the asyncio puller so that a benchmark or a ``sensor`` command can drive it
    without an event loop.
    """

    def __init__(self, config: NvmlPullerConfig, nvml: ModuleType | None = None) -> None:
        self.config = config
        self.nvml = nvml if nvml is not None else load_pynvml()
        self.devices: list[_DeviceState] = []
        self._open = False
        self._cgroup_root = str(config.cgroup_root)
        self._not_supported: tuple[int, ...] = (
            self.nvml.NVML_ERROR_NOT_SUPPORTED,
            self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        )
        self._field_unknown = (*self._not_supported, self.nvml.NVML_ERROR_INVALID_ARGUMENT)
        nvml = self.nvml
        # Readings of one call and one number each: (report field, reading, function, args).
        self._simple: tuple[tuple[str, str, Any, tuple[Any, ...]], ...] = (
            ("clock_gpu", "clock", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_SM,)),
            ("clock_mem", "clock_mem", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_MEM,)),
            (
                "app_clock_gpu",
                "app_clock",
                nvml.nvmlDeviceGetApplicationsClock,
                (nvml.NVML_CLOCK_SM,),
            ),
            (
                "app_clock_mem",
                "app_clock_mem",
                nvml.nvmlDeviceGetApplicationsClock,
                (nvml.NVML_CLOCK_MEM,),
            ),
            ("enforced_power_limit", "power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, ()),
            ("temperature", "temperature", nvml.nvmlDeviceGetTemperature, (0,)),
        )

    def open(self, since_us: int) -> None:
        """Start NVML and look up the devices; samples older than ``since_us`` are skipped.

        Raises:
            NvmlUnavailable: no driver, no GPU, or a requested index that does not exist.
        """
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            raise NvmlUnavailable(describe_init_error(nvml, error)) from None
        self._open = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                raise NvmlUnavailable("NVML: no NVIDIA GPU found (the driver reports 0 devices)")
            wanted = self.config.devices if self.config.devices is not None else range(count)
            missing = [index for index in wanted if index >= count]
            if missing:
                raise NvmlUnavailable(
                    f"NVML: no GPU with index {missing[0]}; this node has {count} "
                    f"(indexes 0-{count - 1})"
                )
            self.devices = [
                _DeviceState(
                    index=index,
                    handle=nvml.nvmlDeviceGetHandleByIndex(index),
                    last_sample_us={kind: since_us for kind, _ in _SAMPLE_TYPES},
                    last_process_us=since_us,
                )
                for index in sorted(set(wanted))
            ]
        except nvml.NVMLError as error:
            self.close()
            raise NvmlUnavailable(f"NVML: cannot list the GPUs: {error}") from None
        except NvmlUnavailable:
            self.close()
            raise

    def close(self) -> None:
        """Shut NVML down; safe to call twice."""
        if self._open:
            self._open = False
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as error:
                logger.warning("NVML shutdown failed: %s", error)

    def tick(self) -> Tick:
        """Read every device once."""
        timestamp = datetime.now(UTC)
        rejected: list[tuple[Any, str]] = []
        devices = {str(state.index): self._read(state, rejected) for state in self.devices}
        return Tick(timestamp, devices, rejected)

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
                value = self._call(state, name, nvml.nvmlDeviceGetPcieThroughput, counter)
                if value is not None:
                    readings[name] = float(value)
            state.pcie = readings  # one assignment: a tick sees the old pair or the new one

    def _call(
        self, state: _DeviceState, reading: str, function: Any, *args: Any, not_found: Any = None
    ) -> Any:
        """One NVML call; ``None`` when it fails, so the reading is left out of the report, and
        ``not_found`` when the driver answers NOT_FOUND (nothing new since the timestamp given).

        NOT_SUPPORTED is remembered per reading; any other error is logged and tried again
        next tick (a GPU busy resetting, say, answers again later).
        """
        if reading in state.unsupported:
            return None
        try:
            return function(state.handle, *args)
        except self.nvml.NVMLError as error:
            code = getattr(error, "value", None)
            if code in self._not_supported:
                state.unsupported.add(reading)
                logger.info("GPU %d: %s not supported; left out", state.index, reading)
            elif code == self.nvml.NVML_ERROR_NOT_FOUND:
                return not_found
            else:
                logger.debug("GPU %d: %s failed: %s", state.index, reading, error)
            return None

    def _read(self, state: _DeviceState, rejected: list[tuple[Any, str]]) -> GPUDevice:
        nvml = self.nvml
        fields: dict[str, Any] = {}
        fields.update(self._power(state))
        energy = self._call(state, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption)
        if energy is not None:
            fields["total_energy"] = float(energy)
        utilization = self._call(state, "utilization", nvml.nvmlDeviceGetUtilizationRates)
        if utilization is not None:
            fields["util_gpu"] = float(utilization.gpu)
            fields["util_mem"] = float(utilization.memory)
        for name, reading, function, args in self._simple:
            value = self._call(state, reading, function, *args)
            if value is not None:
                fields[name] = float(value)
        fields.update(state.pcie)
        power_state = self._call(state, "power_state", nvml.nvmlDeviceGetPowerState)
        if power_state is not None:
            fields["power_state"] = int(power_state)
        samples = self._samples(state)
        if samples:
            fields["samples"] = samples
        processes = self._processes(state, rejected)
        if processes is not None:
            fields["processes"], fields["process_window"] = processes
        # Every value above is already a float, int, bool or a checked list: skip validation.
        return GPUDevice.model_construct(**fields)

    def _power(self, state: _DeviceState) -> dict[str, Any]:
        """Instantaneous power where the driver has it, else its average, else the legacy call.

        Since Ampere, ``nvmlDeviceGetPowerUsage`` answers a one-second average; the field
        values say which kind they are, the legacy call does not (``power_averaged`` unset).
        """
        nvml = self.nvml
        if "power_fields" not in state.unsupported:
            values = self._call(
                state,
                "power_fields",
                nvml.nvmlDeviceGetFieldValues,
                [nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_FI_DEV_POWER_AVERAGE],
            )
            if values is not None:
                for value, averaged in zip(values, (False, True), strict=True):
                    if value.nvmlReturn == nvml.NVML_SUCCESS:
                        return {"power": float(_union(value)), "power_averaged": averaged}
                if all(value.nvmlReturn in self._field_unknown for value in values):
                    # Drivers older than these fields: ask the legacy call from now on.
                    state.unsupported.add("power_fields")
        usage = self._call(state, "power_usage", nvml.nvmlDeviceGetPowerUsage)
        return {} if usage is None else {"power": float(usage)}

    def _samples(self, state: _DeviceState) -> dict[GPUSampleKind, list[tuple[int, float]]]:
        """Each buffer's samples newer than the last one taken from it.

        NVML answers NOT_FOUND when nothing is newer; the older samples a driver may still
        return are dropped here too, so a sample never appears in two reports.
        """
        nvml = self.nvml
        found: dict[GPUSampleKind, list[tuple[int, float]]] = {}
        for kind, constant in _SAMPLE_TYPES:
            answer = self._call(
                state,
                f"samples_{kind}",
                nvml.nvmlDeviceGetSamples,
                getattr(nvml, constant),
                state.last_sample_us[kind],
            )
            if answer is None:
                continue
            value_type, raw = answer
            last = state.last_sample_us[kind]
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
        self, state: _DeviceState, rejected: list[tuple[Any, str]]
    ) -> tuple[list[GPUProcess], tuple[int, int]] | None:
        """The driver's per-process utilisation since its previous answer, and the window it
        covers: (previous answer's newest sample, this answer's newest sample].

        The driver records every ~200 ms which one process holds the engine; NVML gives each
        process's mean over the samples of the window (a sample naming another process
        counts as 0), one entry per process. A driver that gives several entries for a pid is
        averaged over them. When nothing is new the window has no length; when the driver
        answers NOT_FOUND for longer than ``PROCESS_SETTLE_US`` (no process used the SMs), the
        window runs to that margin before now with no process in it.

        None where the device cannot tell (left out of the report).
        """
        start = state.last_process_us
        answer = self._call(
            state,
            "processes",
            self.nvml.nvmlDeviceGetProcessUtilization,
            start,
            not_found=(),
        )
        if "processes" in state.unsupported:
            return None
        if answer is None:  # failed this time: the next answer covers this window too
            return [], (start, start)
        if not answer:
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

PCIE_REFRESH_S = 1.0
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
