"""What every pusher is: a config model, open, write a batch, close."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import Field

from wattflow.actors.backend import BackendConfig
from wattflow.actors.checkpoints import Checkpoints, barrier_of
from wattflow.actors.errors import PushError
from wattflow.actors.runtime import (
    Actor,
    DeadLetters,
    Ledger,
    Mailbox,
    QueueConfig,
    retry_with_backoff,
)
from wattflow.formats.batch import Batch, batch_size, expand, indivisible, reports_in
from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report


class PusherConfig(BackendConfig):
    """Settings every pusher shares, named as PowerAPI's ``--output`` group names them."""

    role: ClassVar[str] = "pusher"

    model: str = Field(
        default="PowerReport",
        description="Report kind this output writes.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    retry_for_s: float = Field(
        default=300.0,
        ge=0,
        description="How long a batch is retried while the sink is unreachable or failing, "
        "before it becomes a dead letter. Meanwhile the mailbox fills and the inputs slow down.",
    )


C = TypeVar("C", bound=PusherConfig)


class Pusher(ABC, Generic[C]):
    """Writes batches of one report kind to a sink.

    ``write`` writes the batch and returns the reports it refused, each with the reason (a report
    the sink's layout cannot hold); or it raises a :class:`~wattflow.actors.errors.PushError` whose
    ``retryable`` says whether the same batch may be tried again, having written none of it.
    ``close`` returns after everything written is flushed.
    """

    config_model: ClassVar[type[PusherConfig]]
    takes_frames: ClassVar[bool] = False
    """Whether ``write`` also takes a batch of one frame; other pushers get its reports."""
    takes_frame_runs: ClassVar[bool] = False
    """Whether ``write`` also takes a batch of several frames (of :attr:`takes_frames`): the
    frames queued together are then written in one go (one append to a file), not one write
    each."""

    def __init__(self, config: C) -> None:
        self.config = config

    def accepts(self, kind: str) -> bool:
        """Whether this output writes reports of ``kind``."""
        return kind == self.config.model

    async def probe(self) -> str:
        """Contact the server or file behind this backend; return what was found.

        ``wattflow check`` calls it. It raises an error saying why the backend cannot work;
        a backend with nothing to contact says so.
        """
        return "nothing to contact before it runs"

    async def check(self) -> None:
        """Raise an error that says why the sink cannot be written, before the pipeline starts."""

    async def open(self) -> None:
        """Connect or open files."""

    @abstractmethod
    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        """Write a batch of reports; return the refused ones with the reason."""

    async def write_batch(self, batch: Batch) -> list[tuple[Report, str]]:
        """Write what the actor hands over: an output that :attr:`takes_frames` writes frames
        as they are (it overrides this); the others get the reports they stand for."""
        return await self.write(expand(batch))

    async def close(self) -> None:
        """Flush and release the sink."""


class PusherActor(Actor):
    """Feeds one pusher from its mailbox, retrying what the sink says may succeed later.

    While a batch is being retried the mailbox fills, and the stages before it wait: a slow or
    absent sink slows the inputs instead of growing memory. A batch that still fails after the
    retry budget, or that the sink rejects outright, becomes a dead letter with the reason.
    """

    def __init__(
        self,
        pusher: Pusher[Any],
        *,
        queue: QueueConfig,
        ledger: Ledger,
        dead_letters: DeadLetters,
    ) -> None:
        super().__init__(f"pusher:{pusher.config.name}")
        self.pusher = pusher
        self.queue = queue
        self.mailbox: Mailbox[Report | Frame] = Mailbox(queue.max_reports, self.name)
        self.ledger = ledger
        self.dead_letters = dead_letters
        self._opened = False
        self._in_flight: list[Report | Frame] = []
        self.retries = 0
        """Writes tried again after an error that a retry may mend."""
        self.outages = 0
        """Times the sink became unreachable: a failed write while it counted as reachable,
        from the start (as :meth:`not_ready` counts it until a write fails: a sink down from the
        start is one outage) or since the last write that worked."""
        self.unreachable: str | None = None
        """Why the sink is unreachable, from the first failed write until one works again."""
        self.given_up: str | None = None
        """Why the output stopped writing before its mailbox closed (the drain deadline)."""
        self._task: asyncio.Task[Any] | None = None
        self._busy = False
        """Whether the actor is opening the sink or writing a batch (not waiting for one)."""
        self.checkpoints: Checkpoints | None = None
        """Told when a barrier comes: every batch before it is written."""

    def not_ready(self) -> str | None:
        """Why the output cannot take reports yet, or None (``/ready``).

        An output that connects on its first write counts as reachable until a write fails.
        """
        if not self._opened:
            return "not open yet"
        if self.unreachable is not None:
            return f"unreachable: {self.unreachable}"
        return None

    def _retrying(self, error: BaseException) -> None:
        self.retries += 1
        if self.unreachable is None:
            self.outages += 1
        self.unreachable = str(error)

    def give_up(self, reason: str) -> None:
        """Stop writing: the batch being written or retried, and every batch after it, become
        dead letters with ``reason``; the mailbox is still read to its end, so the stages
        before it drain. The pipeline calls it when its drain deadline has passed."""
        self.given_up = reason
        if self._busy and self._task is not None:
            self._task.cancel(reason)

    async def run(self) -> None:
        self._task = asyncio.current_task()
        try:
            await self._write_all()
        except asyncio.CancelledError:
            # Only the cancel that give_up sent is ours to absorb; any other one goes on.
            if self.given_up is None or self._task is None or self._task.uncancel() > 0:
                raise
            self._busy = False
            self._reject(self._in_flight, self.given_up)
            self._in_flight = []
            while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
                self._reject(batch, self.given_up)
        await self.pusher.close()

    async def _write_all(self) -> None:
        self._busy = True
        if not self._opened:
            await self.pusher.open()
            self._opened = True
        self._busy = False
        while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
            barrier = barrier_of(batch)
            if barrier is not None:
                if self.given_up is None and self.checkpoints is not None:
                    self.checkpoints.ack(barrier)
                continue
            self._busy = True
            if self.pusher.takes_frame_runs and indivisible(batch):
                batch = await self._with_queued_frames(batch)
            self._in_flight = batch
            if self.given_up is not None:
                self._reject(batch, self.given_up)
            else:
                await self._write(batch)
            self._in_flight = []
            self._busy = False

    async def _with_queued_frames(self, batch: list[Report | Frame]) -> list[Report | Frame]:
        """A frame and the frames queued behind it, up to a mailbox batch of reports: one
        write instead of one per frame (a live sensor's tick is a small frame of each
        formula; many sensors' ticks queue while the sink is busy)."""
        room = self.queue.max_batch - batch_size(batch)
        more = await self.mailbox.get_frames(room) if room > 0 else []
        return [*batch, *(item for queued in more for item in queued)] if more else batch

    async def _write(self, batch: list[Report | Frame]) -> None:
        try:
            refused = await retry_with_backoff(
                lambda: self.pusher.write_batch(batch),
                retryable=lambda error: getattr(error, "retryable", False),
                give_up_after_s=self.pusher.config.retry_for_s,
                on_retry=self._retrying,
            )
        except PushError as error:
            self._reject(batch, str(error))
            if self.checkpoints is not None:
                self.checkpoints.withhold(self.name, str(error))
        else:
            self.unreachable = None
            for report, reason in refused:
                self._reject([report], reason)
            written = reports_in(batch) - len(refused)
            self.ledger.delivered += written
            self.ledger.delivered_by_pusher[self.pusher.config.name] += written

    def _reject(self, batch: list[Report | Frame] | list[Report], reason: str) -> None:
        self.ledger.dead_out += reports_in(batch)
        self.dead_letters.add_all(self.name, reason, batch)

    async def run_abandoned(self, reason: str) -> None:
        while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
            self._reject(batch, f"abandoned: {reason}")

    async def on_crash(self, error: BaseException) -> None:
        self._reject(self._in_flight, f"{self.name} crashed: {error!r}")
        self._in_flight = []
