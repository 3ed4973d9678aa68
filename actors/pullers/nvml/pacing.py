"""The sampler's threads: one keeps time and samples, one keeps PCIe throughput fresh.

Neither runs on the event loop: NVML is a blocking C library whose calls spin the calling
thread for up to milliseconds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from wattflow.actors.pullers.nvml.sampler import NvmlSampler, Tick

logger = logging.getLogger(__name__)

STOP_CHECK_S = 0.25
"""Longest the sampler's thread sleeps without looking whether it should stop."""

PCIE_REFRESH_S = 5.0
"""How often the PCIe throughput that ticks report is read again (see ``read_pcie``)."""


class PcieReader(threading.Thread):
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


class Pacer(threading.Thread):
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
        pcie = PcieReader(self.sampler, self._stopping)
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
