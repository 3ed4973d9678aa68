"""The blocking part of the NVML sampler: one tick's readings of every GPU.

NVML is a blocking C library, so the sampler is driven from threads of its own (``pacing``),
never the event loop. Each reading is its own call in its own ``try`` (``DeviceState.call``):
a reading the GPU does not support (or that fails this time) is left out of the report, never
written as 0, so a consumer can tell "not measured" from "zero".

The driver's sample buffers (power, GPU and memory utilisation) and per-process utilisation are
read from the newest timestamp already seen, each buffer from its own, so consecutive reports
hold every sample once: none missed while the buffer still held it, none repeated. The first
tick starts from the sampler's start: what the driver buffered before then belongs to no run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from wattflow.actors.pullers.nvml.api import (
    Nvml,
    NvmlError,
    NvmlUnavailable,
    ProcessReader,
    UtilizationReader,
)
from wattflow.actors.pullers.nvml.config import NvmlPullerConfig
from wattflow.actors.pullers.nvml.device import (
    BUFFER_SAMPLES,
    BUFFERS_S,
    SAMPLE_TYPES,
    WINDOW_SAMPLES,
    DeviceState,
    learn_fields,
    open_buffers,
    read_pcie,
    read_power,
    read_samples,
    read_slow,
    slow_groups,
)
from wattflow.actors.pullers.nvml.mig import instance_window, open_gpm
from wattflow.actors.pullers.nvml.processes import process_window
from wattflow.formats.reports import EMPTY_DEVICE, GPUDevice, trusted_device

logger = logging.getLogger(__name__)


@dataclass
class Tick:
    """One tick's readings, taken on the sampler's thread."""

    timestamp: datetime
    readings: dict[str, dict[str, Any]]
    """Each device's report fields, by GPU index: every field of a GPUDevice, unset ones None."""
    rejected: list[tuple[Any, str]]

    def devices(self) -> dict[str, GPUDevice]:
        """The tick's devices as a GPUReport holds them.

        Made when a batch is handed on, ten ticks in a row, not on the sampler's thread at
        each tick: building the models was about 40 % of a tick's Python there, and that
        thread wakes every tick on cold caches, where each step costs many times what it
        does in a loop."""
        # Every value is already a float, int, bool or a checked list: skip validation.
        return {index: trusted_device(fields) for index, fields in self.readings.items()}


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
        self.devices: list[DeviceState] = []
        self.announce = True
        """Whether :meth:`open` logs how each GPU in MIG mode is attributed (the start's
        probe opens NVML quietly, so the log says it once)."""
        self._cgroup_root = str(config.cgroup_root)
        self._window_s = config.window_ms / 1000
        self._energy_s = config.energy_ms / 1000
        self._slack_s = config.interval_ms / 2000
        self._groups = slow_groups(self.nvml)

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
                held = "index 0" if count == 1 else f"indexes 0-{count - 1}"
                raise NvmlUnavailable(
                    f"NVML: no GPU with index {missing[0]}; this node has {count} ({held})"
                )
            self.devices = [self._device(index, since_us) for index in sorted(set(wanted))]
        except NvmlError as error:
            self.close()
            raise NvmlUnavailable(f"NVML: cannot list the GPUs: {error}") from None
        except NvmlUnavailable:
            self.close()
            raise

    def _device(self, index: int, since_us: int) -> DeviceState:
        """Look a GPU up, learn which calls it answers, and make its buffer readers."""
        handle = self.api.call(self.nvml.nvmlDeviceGetHandleByIndex, index)
        state = DeviceState(
            index=index,
            handle=handle,
            api=self.api,
            slack_s=self._slack_s,
            last_sample_us={kind: since_us for kind, _ in SAMPLE_TYPES},
            last_process_us=since_us,
        )
        open_buffers(state)
        if self.api.mig_enabled(handle):
            # NVML answers per-process utilisation only for the whole GPU, not under MIG.
            state.unsupported.add("processes")
            open_gpm(state, since_us, window_ms=self.config.window_ms, announce=self.announce)
        else:
            state.processes = state.call("processes", ProcessReader, self.api, handle)
        state.utilization = state.call("utilization", UtilizationReader, self.api, handle)
        learn_fields(state)
        return state

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
        - PCIe throughput on its own thread (:meth:`read_pcie`).
        """
        timestamp = datetime.now(UTC)
        now = time.monotonic()
        rejected: list[tuple[Any, str]] = []
        devices = {str(state.index): self._read(state, now, rejected) for state in self.devices}
        return Tick(timestamp, devices, rejected)

    def read_pcie(self) -> None:
        """Read every device's PCIe throughput, for the ticks that follow to report.

        NVML counts the bytes over 20 ms inside the call, so each of the two calls blocks that
        long: with them in the tick, an 8-GPU node would spend 320 ms of every 100 ms tick
        waiting. So they are made apart from the ticks (on their own thread, every
        ``PCIE_REFRESH_S``), and each tick reports the latest answer.
        """
        for state in self.devices:
            read_pcie(state)

    def _read(
        self, state: DeviceState, now: float, rejected: list[tuple[Any, str]]
    ) -> dict[str, Any]:
        """One device's readings at this tick, as report fields.

        Most ticks read power and utilisation only; the schedule is looked at in full only
        when something is due (``DeviceState.next_due_s``): at 10 Hz the sampler's thread
        wakes on cold caches, where a tick that takes 0.01 ms in a loop took 0.2 ms (over the
        stand-in), and the NVML calls of most ticks cost less than the Python around them."""
        due = now >= state.next_due_s
        window = due and state.is_due("window", self._window_s, now)
        energy = due and state.is_due("energy", self._energy_s, now)
        fields = EMPTY_DEVICE.copy()
        fields.update(read_power(state, energy))
        if state.utilization is not None:
            rates = state.call("utilization", state.utilization.read)
            if rates is not None:
                fields["util_gpu"] = float(rates[0])
                fields["util_mem"] = float(rates[1])
        if due:
            self._read_due(state, now, window, fields)
        fields.update(state.latest)
        fields.update(state.pcie)
        processes = process_window(state, self._cgroup_root, rejected, asked=window)
        if processes is not None:
            fields["processes"], fields["process_window"] = processes
            if window and state.running_pids is not None:
                fields["running_pids"] = state.running_pids
        instances = instance_window(state, now, self._cgroup_root, rejected, asked=window)
        if instances is not None:
            fields["instances"], fields["instance_window"] = instances
        if due:
            state.next_due_s = min(state.due.values())
        return fields

    def _read_due(
        self, state: DeviceState, now: float, window: bool, fields: dict[str, Any]
    ) -> None:
        """The slow readings and the sample buffers that are due at this tick."""
        read_slow(state, self._groups, now)
        kinds = WINDOW_SAMPLES if window else ()
        if state.is_due("buffers", BUFFERS_S, now):
            kinds = (*kinds, *BUFFER_SAMPLES)
        if kinds:
            samples = read_samples(state, kinds)
            if samples:
                fields["samples"] = samples
