"""Event time, the one window every formula holds its ticks by: how far a stream has come.

Every formula that holds ticks decides when a moment of its stream is complete: SmartWatts
when hwpc-sensor's stream has gone ``--tick-lateness-ms`` past a tick, the GPU formula when the
device's has gone ``--gpu-hold-ms`` past one, the node formula when each of its sources (a
meter, RAPL, the GPUs, the targets' estimates) came past an interval, the energy formula when
its slowest scope has been silent long enough. Deciding by real time ("report an interval two
seconds after its end is known") makes the output depend on the pace the reports came at: a
replay, which reads one file faster than another, then gives something other than the live run
gave.

:class:`StreamTime` decides by the sources' own timestamps instead. The stream has come as far
as its slowest source: a moment is complete once every source has reported a reading at or
after it, whatever order the readings came in. Real time has one role left, to stop waiting for
a source that has gone quiet: a source silent for ``idle_s`` of real time no longer holds the
others back (nor, at the start, one expected that has not come yet), so a sampler that stops
does not stall the node. A replay, whose every source keeps coming until it ends, is therefore
cut the same way as the live run that recorded it (``tests/test_replay_equals_live.py``).
"""

from __future__ import annotations

import math
import time

import msgspec


class SourceTime(msgspec.Struct):
    """One source: its newest timestamp (ms) and when (``time.monotonic()``) it last came."""

    newest_ms: int
    seen_at: float


class StreamTime:
    """The event time of a stream of one or several sources, each held back by the slowest;
    the moments at least ``lateness`` behind it are ripe (in the sources' own unit: ms for
    hwpc-sensor's ticks, µs for the GPU's)."""

    def __init__(
        self,
        idle_s: float = math.inf,
        expected: frozenset[str] = frozenset(),
        started: float | None = None,
        lateness: int = 0,
    ) -> None:
        self.idle_s = idle_s
        self.lateness = lateness
        self.expected = expected
        """The sources the stream will have (known from the pipeline's inputs): at the start,
        one yet to come holds the others back as one that went quiet does."""
        self.started = time.monotonic() if started is None else started
        self.sources: dict[str, SourceTime] = {}
        self.asked_at = -math.inf
        """When :meth:`time_ms` was last asked: :meth:`deadline` is the next change after it."""

    def observe(self, source: str, millis: int, now: float) -> None:
        """A reading of ``source`` at ``millis`` (its own clock), come at ``now``."""
        known = self.sources.get(source)
        if known is None:
            self.sources[source] = SourceTime(millis, now)
            return
        known.newest_ms = max(known.newest_ms, millis)
        known.seen_at = now

    def newest_ms(self, source: str) -> int | None:
        known = self.sources.get(source)
        return None if known is None else known.newest_ms

    def time_ms(self, now: float) -> int | None:
        """How far the stream has come: the newest timestamp of its slowest source among those
        that came within ``idle_s`` of ``now``; the newest of any source when all went quiet;
        ``None`` while an expected source is yet to come (for ``idle_s`` at most) or none came.
        """
        self.asked_at = now
        live_after = now - self.idle_s
        if self.started > live_after and not self.expected <= self.sources.keys():
            return None
        live = [s.newest_ms for s in self.sources.values() if s.seen_at >= live_after]
        if live:
            return min(live)
        return max((s.newest_ms for s in self.sources.values()), default=None)

    def horizon(self, now: float = 0.0) -> int | None:
        """The newest moment that is ripe: ``lateness`` behind the stream's time (``None``
        while it has none). ``now`` matters only for sources that can go quiet."""
        time_ms = self.time_ms(now)
        return None if time_ms is None else time_ms - self.lateness

    def deadline(self) -> float | None:
        """When the stream's time next moves without a reading, after it was last asked
        (:meth:`time_ms`): when a source still counted goes quiet, or the wait for the expected
        ones ends; ``None`` when nothing is left to go quiet."""
        asked = self.asked_at
        if self.started + self.idle_s > asked and not self.expected <= self.sources.keys():
            return self.started + self.idle_s
        quiet_at = [s.seen_at + self.idle_s for s in self.sources.values()]
        return min((at for at in quiet_at if at > asked), default=None)

    def state(self) -> dict[str, int]:
        """Each source's newest timestamp; when they came is not kept (real time restarts)."""
        return {source: known.newest_ms for source, known in self.sources.items()}

    def restore(self, newest: dict[str, int], seen_at: float = -math.inf) -> None:
        """Take back each source's newest timestamp, as come at ``seen_at``: never (the
        default), so that the sources restored hold nothing back, or the restart's time, so
        that they wait ``idle_s`` for their late readings again."""
        self.sources = {
            source: SourceTime(int(millis), seen_at) for source, millis in newest.items()
        }
