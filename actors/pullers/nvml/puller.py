"""The NVML sampler: one GPUReport per tick with every GPU's readings, through ``nvidia-ml-py``.

The registered input (``--input nvml``): it samples the GPUs every ``--interval-ms`` and hands
each tick to the pipeline as a GPUReport. The sampler runs on a thread of its own (``pacing``)
that keeps time and hands ticks over in batches (``--batch-ms``), because at 10 Hz a hand-off
per tick would cost more than sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller
from wattflow.actors.pullers.nvml.api import now_us
from wattflow.actors.pullers.nvml.config import NvmlPullerConfig
from wattflow.actors.pullers.nvml.pacing import Pacer
from wattflow.actors.pullers.nvml.sampler import NvmlSampler, Tick
from wattflow.formats.reports import GPUReport, Report

logger = logging.getLogger(__name__)


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
            sampler.open(now_us())
            sampler.close()

        await asyncio.to_thread(probe)

    def not_ready(self) -> str | None:
        return None if self.sampling else "NVML not opened yet"

    async def pull(self, emitter: Emitter) -> None:
        sampler = await asyncio.to_thread(NvmlSampler, self.config)
        await asyncio.to_thread(sampler.open, now_us())
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

        pacer = Pacer(sampler, self.config.interval_ms / 1000, self.config.batch_ms / 1000, hand)
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
                        devices=tick.devices(),
                    )
                    for tick in item
                ]
                await emitter.emit(reports)
                self.ticks += len(reports)
                pacer.slot.release()
        finally:
            stopper.cancel()
            await asyncio.gather(stopper, return_exceptions=True)
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


async def _stop_when_asked(stopping: asyncio.Event, pacer: Pacer) -> None:
    await stopping.wait()
    pacer.stop()
