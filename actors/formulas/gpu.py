"""GPU formula: NVML readings → power per process or container on each GPU, and the GPU's idle.

For each device and sampling tick:

1. **Device power** is the energy counter's increase over the real interval (Volta and newer),
   else the mean of the driver's power samples taken within the interval, else the power
   reading itself. The first tick of a device with only an energy counter starts its interval.
2. **Idle power** is ``--gpu-idle-power-w`` watts when given. Otherwise it is learned: the lowest
   device power seen at ticks where no process used the SMs (utilisation at most
   ``--gpu-idle-util``), over the last ``--gpu-idle-window`` such ticks. Until the device has
   been idle once, the lowest power seen so far stands in (an overestimate that shrinks to
   the true idle the first time the device rests).
3. **Active power** = device power − idle, never below zero.
4. **Per process.** Active power is split among the processes by their share of SM
   utilisation in the interval. Processes are grouped into their cgroup (a container) unless
   ``--gpu-targets process`` asks for one target per process (``pid:<pid>``); a process with
   no known cgroup is always its own target.
5. **The device's own target** (``gpu<index>``) keeps the idle power, plus the active power
   when no process shows SM use (a context that only holds memory, or a sampling gap), so the
   targets of a device always add up to its measured power.

Limits: SM utilisation is a time share, not an energy share, so a memory-bound process and a
compute-bound one at the same utilisation get the same power. Under MIG the driver reports no
per-process utilisation: everything above idle stays with the device target. Processes that
run between two samples of the driver's utilisation buffer are not seen.

State (:meth:`GpuFormula.state`, kept by checkpoints): per device, the last tick's time and
energy counter (so the first tick after a restart has its interval at once), the idle
readings of the window and the lowest power seen (so the learned idle power is not learned
again). At most ``--gpu-idle-window`` readings per device are kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, PositiveInt

from wattflow.actors.checkpoints import pack_floats, unpack_floats
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.formats.reports import GPUDevice, GPUReport, PowerReport, Report

FORMULA_NAME = "gpu"

STATE_VERSION = 1
"""The layout of :meth:`GpuFormula.state`; a state of another version is not restored."""


class GpuConfig(FormulaConfig):
    """Settings of the GPU formula."""

    gpu_idle_power_w: float | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("gpu_idle_power_w", "gpu_idle_power"),
        description="Idle power of every GPU in W; learned from the readings when unset.",
    )
    gpu_idle_util: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="SM utilisation (%) up to which a tick counts as idle, to learn idle power.",
        json_schema_extra={"unit": "%"},
    )
    gpu_idle_window: PositiveInt = Field(
        default=600, description="Idle ticks over which the lowest power is taken as idle."
    )
    gpu_targets: Literal["cgroup", "process"] = Field(
        default="cgroup",
        description="Attribute GPU power to containers (cgroups) or to single processes.",
    )


@dataclass
class _DeviceState:
    """What a device's previous tick left behind."""

    timestamp: datetime | None = None
    energy_mj: float | None = None
    idle_readings: deque[float] = field(default_factory=deque)
    lowest_seen_w: float | None = None


@formulas.register(FORMULA_NAME)
class GpuFormula(Formula[GpuConfig]):
    """One instance per sensor (node); it keeps the state of each of the node's devices."""

    name: ClassVar[str] = FORMULA_NAME
    inputs: ClassVar[frozenset[str]] = frozenset({GPUReport.kind})
    config_model: ClassVar[type[FormulaConfig]] = GpuConfig
    replayable: ClassVar[bool] = False  # a report (a sampling tick) is the unit of failure

    def __init__(self, config: GpuConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.devices: dict[str, _DeviceState] = {}

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        return report.sensor if isinstance(report, GPUReport) else None

    def state(self) -> dict[str, Any]:
        """Each device's last reading and what it learned of its idle power."""
        return {
            "version": STATE_VERSION,
            "devices": {
                index: {
                    "timestamp": None if d.timestamp is None else d.timestamp.isoformat(),
                    "energy_mj": d.energy_mj,
                    "idle_w": pack_floats(list(d.idle_readings)),
                    "lowest_seen_w": d.lowest_seen_w,
                }
                for index, d in self.devices.items()
            },
        }

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state of version {state.get('version')}, not {STATE_VERSION}")
        window = self.config.gpu_idle_window
        for index, saved in state["devices"].items():
            readings = unpack_floats(saved["idle_w"])
            stamp = saved["timestamp"]
            energy, lowest = saved["energy_mj"], saved["lowest_seen_w"]
            self.devices[str(index)] = _DeviceState(
                timestamp=None if stamp is None else datetime.fromisoformat(stamp),
                energy_mj=None if energy is None else float(energy),
                idle_readings=deque(() if readings is None else readings.tolist()[-window:]),
                lowest_seen_w=None if lowest is None else float(lowest),
            )

    def process(self, reports: list[Report], out: Output) -> None:
        for report in reports:
            assert isinstance(report, GPUReport)
            mark = out.mark()
            try:
                self._tick(report, out)
            except Exception as error:  # the devices' state keeps what the tick did to it
                out.fail([report], error, unit="tick", since=mark)

    def _tick(self, report: GPUReport, out: Output) -> None:
        """One sampling tick of the node's devices: the unit of failure."""
        produced = 0
        problems = []
        for index, device in report.devices.items():
            try:
                produced += self._device(report, index, device, out)
            except _NoReading as error:
                problems.append(f"gpu {index}: {error}")
        if problems and not produced:
            out.reject(report, "; ".join(problems))
        elif not produced:
            out.absorb()

    def _device(self, report: GPUReport, index: str, device: GPUDevice, out: Output) -> int:
        """Emit the device's reports for this tick; return how many."""
        state = self.devices.setdefault(index, _DeviceState())
        power_w = self._device_power(report.timestamp, device, state)
        if power_w is None:
            return 0
        idle_w = min(self._idle(device, power_w, state), power_w)
        active_w = power_w - idle_w
        shares = self._shares(device)
        total_share = sum(shares.values())
        unattributed_w = active_w if total_share <= 0 else 0.0
        emitted = 0
        for target, share in sorted(shares.items()):
            if total_share <= 0:
                break
            ratio = share / total_share
            out.emit(self._report(report, target, index, active_w * ratio, ratio))
            emitted += 1
        device_w = idle_w + unattributed_w
        device_ratio = device_w / power_w if power_w > 0 else 1.0
        out.emit(self._report(report, f"gpu{index}", index, device_w, device_ratio))
        return emitted + 1

    def _device_power(
        self, timestamp: datetime, device: GPUDevice, state: _DeviceState
    ) -> float | None:
        """The device's power in W over the interval that ends at ``timestamp`` (step 1 of the
        module's description); ``None`` for the first reading of an energy counter. The state
        keeps this reading for the next tick."""
        previous_time, previous_energy = state.timestamp, state.energy_mj
        state.timestamp = timestamp
        state.energy_mj = device.total_energy
        interval_s = _interval_s(previous_time, timestamp)
        counted_w = _counter_power_w(device.total_energy, previous_energy, interval_s)
        if counted_w is not None:
            return counted_w
        return _reading_power_w(device)

    def _idle(self, device: GPUDevice, power_w: float, state: _DeviceState) -> float:
        if self.config.gpu_idle_power_w is not None:
            return self.config.gpu_idle_power_w
        state.lowest_seen_w = (
            power_w if state.lowest_seen_w is None else min(state.lowest_seen_w, power_w)
        )
        busy = max((p.sm_util for p in device.processes or ()), default=0.0)
        utilisation = device.util_gpu if device.util_gpu is not None else busy
        if utilisation <= self.config.gpu_idle_util and busy <= self.config.gpu_idle_util:
            state.idle_readings.append(power_w)
            while len(state.idle_readings) > self.config.gpu_idle_window:
                state.idle_readings.popleft()
        if state.idle_readings:
            return min(state.idle_readings)
        return state.lowest_seen_w

    def _shares(self, device: GPUDevice) -> dict[str, float]:
        """SM utilisation per target, processes grouped as configured."""
        shares: dict[str, float] = {}
        for process in device.processes or ():
            if process.sm_util <= 0:
                continue
            if self.config.gpu_targets == "cgroup" and process.cgroup:
                target = process.cgroup
            else:
                target = f"pid:{process.pid}"
            shares[target] = shares.get(target, 0.0) + process.sm_util
        return shares

    def _report(
        self, report: GPUReport, target: str, index: str, power_w: float, ratio: float
    ) -> PowerReport:
        return PowerReport(
            timestamp=report.timestamp,
            sensor=report.sensor,
            target=target,
            power=power_w,
            metadata={
                **report.metadata,
                "scope": "gpu",
                "device": index,
                "formula": FORMULA_NAME,
                "ratio": ratio,
            },
        )


def _interval_s(previous: datetime | None, timestamp: datetime) -> float | None:
    """Seconds since the device's previous tick; ``None`` at its first tick."""
    if previous is None:
        return None
    interval_s = (timestamp - previous).total_seconds()
    if interval_s <= 0:
        raise _NoReading(f"tick at {timestamp.isoformat()} is not after the previous one")
    return interval_s


def _counter_power_w(
    energy_mj: float | None, previous_mj: float | None, interval_s: float | None
) -> float | None:
    """Power in W from the energy counter's increase over the interval; ``None`` without two
    readings of it, or when it went back (a reset): then the other readings stand in."""
    if (
        energy_mj is not None
        and previous_mj is not None
        and interval_s is not None
        and energy_mj >= previous_mj
    ):
        return (energy_mj - previous_mj) / 1000.0 / interval_s
    return None


def _reading_power_w(device: GPUDevice) -> float | None:
    """Power in W from the driver's samples in the interval, else from its power reading;
    ``None`` for a device with only an energy counter, whose first reading starts the
    interval."""
    samples = (device.samples or {}).get("TOTAL_POWER", [])
    if samples:
        return sum(value for _, value in samples) / len(samples) / 1000.0
    if device.power is not None:
        return device.power / 1000.0
    if device.total_energy is not None:
        return None  # the first reading of a counter only starts the interval
    raise _NoReading("no power reading (no energy counter, samples or power)")


class _NoReading(Exception):
    """A device tick that cannot give a power figure."""
