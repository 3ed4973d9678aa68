"""A GPU's power over a tick, from what one GPUReport holds: the one definition the GPU formula
and the node formula share.

A device tick may carry three readings of power, each from its own NVML call: the driver's
power samples (every ~20 ms, read once a window, so most of them belong to earlier ticks), one
power reading taken at the tick, and, every ``--energy-ms``, the energy counter. A tick's own
power is the mean of the samples stamped in it, else its power reading, else the mean of the
samples it brought; a device with only an energy counter has none (its counter readings give
its power over the spans between them). The counter is the truth over a span; the GPU formula
shares a span's energy among its ticks by their own power, and the node formula takes a span's
energy where every tick of the device reads the counter.
"""

from __future__ import annotations

from wattflow.formats.reports import GPUDevice


class NoReading(Exception):
    """A device tick that gives no power figure at all."""


def samples_mean_mw(samples: list[tuple[int, float]], start_us: int, end_us: int) -> float | None:
    """The mean of the power samples stamped in (``start_us``, ``end_us``], or ``None``."""
    own = [value for stamp, value in samples if start_us < stamp <= end_us]
    return sum(own) / len(own) if own else None


def power_samples(device: GPUDevice) -> list[tuple[int, float]]:
    """The driver's power samples a tick brought: [Unix µs, mW] pairs."""
    return (device.samples or {}).get("TOTAL_POWER", [])


def tick_power_w(device: GPUDevice, start_us: int, end_us: int) -> float | None:
    """The device's own power over the tick (``start_us``, ``end_us``], in W (see the module's
    text); ``None`` for a device that gives only its energy counter.

    Raises:
        NoReading: the tick has no power reading, samples or counter.
    """
    samples = power_samples(device)
    own = samples_mean_mw(samples, start_us, end_us)
    if own is not None:
        return own / 1000.0
    if device.power is not None:
        return device.power / 1000.0
    if samples:
        return sum(value for _, value in samples) / len(samples) / 1000.0
    if device.total_energy is not None:
        return None
    raise NoReading("no power reading (no energy counter, samples or power)")
