"""The actor runtime: bounded mailboxes, supervised actors and an accounted, draining shutdown.

Every stage of the pipeline is an :class:`Actor`: an asyncio task that reads batches from a
bounded :class:`Mailbox`. A full mailbox makes its producer wait, so a slow pusher slows the
router, which slows the pullers, which stop reading their input: memory stays bounded and nothing
is dropped to make room.

The :class:`Supervisor` restarts an actor whose loop fails, with exponential backoff, and gives
up (failing the pipeline) only after too many restarts in a short window. The :class:`Ledger`
counts every report that enters and how it leaves, so a drained pipeline can prove it lost
nothing: every delivery to a formula is consumed or dead-lettered, and every delivery to a pusher is
written or dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import singledispatch
from pathlib import Path
from typing import Any, BinaryIO, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from wattflow.formats.batch import batch_size, expand, indivisible
from wattflow.formats.errors import WattflowError
from wattflow.formats.powerapi import encode_json
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ActorClosed(RuntimeError):
    """Raised by :meth:`Mailbox.put` once the mailbox no longer takes reports."""


class QueueConfig(BaseModel):
    """Bounds of one mailbox.

    Only ``block`` exists: a full mailbox makes its producer wait. Dropping is never silent and
    never the default; a policy that drops would have to dead-letter what it drops.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_reports: PositiveInt = Field(
        default=10_000, description="Reports a mailbox holds before its producers wait."
    )
    max_batch: PositiveInt = Field(
        default=1_000, description="Largest batch an actor takes from its mailbox at once."
    )
    when_full: Literal["block"] = Field(
        default="block", description="What a producer does when the mailbox is full: wait."
    )


class Mailbox(Generic[T]):
    """A FIFO of batches bounded by the number of reports it holds.

    A batch is accepted when it fits, or when the mailbox is empty (so a batch larger than the
    capacity cannot deadlock its producer); a batch of no reports (a checkpoint's barrier) is
    taken at once. The bound is therefore ``capacity`` plus one batch.
    A frame (:mod:`wattflow.formats.frames`) counts as the reports it stands for, and is taken
    alone: a reader gets either one frame or a list of reports (or, with :meth:`get_frames`,
    the frames queued next, each as its own batch).
    """

    def __init__(self, capacity: int, name: str = "mailbox") -> None:
        self.name = name
        self.capacity = capacity
        self._batches: deque[tuple[Sequence[T], int, bool]] = deque()
        self._size = 0
        self._closed = False
        self._producers = 1
        self._changed = asyncio.Condition()
        self.high_water = 0
        self.received = 0
        """Reports ever queued: what the actor behind it was handed."""

    def __len__(self) -> int:
        return self._size

    async def put(self, batch: Sequence[T]) -> None:
        """Queue a batch, waiting while the mailbox is full.

        Raises:
            ActorClosed: when the mailbox was closed before the batch could be queued.
        """
        if not batch:
            return
        size = batch_size(batch)
        framed = indivisible(batch)
        async with self._changed:
            while size and not self._closed and self._size and self._size + size > self.capacity:
                await self._changed.wait()
            if self._closed:
                raise ActorClosed(f"{self.name} is closed")
            self._batches.append((batch, size, framed))
            self._size += size
            self.received += size
            self.high_water = max(self.high_water, self._size)
            self._changed.notify_all()

    async def get(self, max_items: int) -> list[T] | None:
        """Take up to ``max_items`` items, waiting for at least one.

        Returns:
            The items, or ``None`` once the mailbox is closed and empty.
        """
        async with self._changed:
            while not self._batches and not self._closed:
                await self._changed.wait()
            if not self._batches:
                return None
            taken: list[T] = []
            count = 0
            while self._batches and count < max_items:
                head, size, framed = self._batches[0]
                if framed:
                    if not taken:  # a frame goes alone, whatever its size
                        self._batches.popleft()
                        taken, count = list(head), size
                    break
                room = max_items - count
                if size <= room:
                    taken.extend(self._batches.popleft()[0])
                    count += size
                else:
                    taken.extend(head[:room])
                    self._batches[0] = (head[room:], size - room, False)
                    count += room
            self._size -= count
            self._changed.notify_all()
            return taken

    async def get_frames(self, max_reports: int) -> list[Sequence[T]]:
        """The frames queued next, each as the batch it came in, while together they hold
        ``max_reports`` reports at most; waits for none (``[]`` when the next batch is not a
        frame). A barrier (a frame of no reports) is never taken: it stays the next batch,
        handled alone, after what came before it.

        A reader that writes several frames as cheaply as one (an output appending them to a
        file) calls it after :meth:`get` returned a frame: the frames that queued meanwhile (a
        tick's SmartWatts and RAPL estimates, other sensors' ticks) go in one write.
        """
        taken: list[Sequence[T]] = []
        if not self._batches or not self._batches[0][2]:
            return taken
        async with self._changed:
            count = 0
            while self._batches:
                head, size, framed = self._batches[0]
                if not framed or not size or count + size > max_reports:
                    break
                self._batches.popleft()
                taken.append(head)
                count += size
            self._size -= count
            self._changed.notify_all()
        return taken

    def expect_producers(self, count: int) -> None:
        """Stay open until ``close`` has been called ``count`` times, once by each producer."""
        self._producers = count

    async def close(self) -> None:
        """Stop taking batches; readers still get what is queued, then ``None``.

        With several producers (:meth:`expect_producers`), the last one to close closes it.
        """
        async with self._changed:
            self._producers -= 1
            if self._producers > 0:
                return
            self._closed = True
            self._changed.notify_all()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Something that could not be processed, and why."""

    actor: str
    reason: str
    payload: Any
    count: int = 1


class DeadLetters:
    """Where undeliverable input goes: counted by reason, logged, and optionally written out.

    Each distinct reason is logged once at WARNING and then only counted, so a stream of bad
    input cannot flood the log. With a file, every dead letter is kept as one JSON line holding
    the actor, the reason and the payload, so nothing is lost even when it cannot be processed.

    The file is written unbuffered, as the file outputs write theirs
    (:mod:`~wattflow.actors.pushers.appending`): each dead letter, or each batch of them, is
    handed to the operating system before :meth:`add` returns. A dead letter is thus in the
    file before anything can acknowledge what it came from (an input's position saved in a
    checkpoint only after the actor that dead-lettered it has moved on), and a killed process
    loses none of them. Like the outputs, it does not ``fsync``: what the kernel holds is lost
    only with the machine.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_actor: Counter[str] = Counter()
        """Dead letters per actor: a bounded count (reasons are free text)."""
        self.path = path
        self._file: BinaryIO | None = None

    @property
    def total(self) -> int:
        """Number of dead letters so far."""
        return sum(self.by_reason.values())

    def open(self) -> None:
        """Open the dead-letter file before the pipeline starts.

        Opening it on the first dead letter would find an unwritable path only mid-run, in the
        actor that was rejecting something, and lose what that actor held.

        Raises:
            WattflowError: naming the path and why it cannot be written.
        """
        if self.path is None or self._file is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab", buffering=0)
        except OSError as error:
            reason = error.strerror or str(error)
            raise WattflowError(f"--dead-letters {self.path}: {reason}") from None

    def add_all(self, actor: str, reason: str, batch: Sequence[Any]) -> None:
        """Record every report of a batch (frames replaced by their reports) as dead letters,
        written to the file in one write."""
        letters = [DeadLetter(actor, reason, report) for report in expand(batch)]
        for letter in letters:
            self._count(letter)
        self._write(letters)

    def add(self, letter: DeadLetter) -> None:
        """Record one dead letter (``letter.count`` items)."""
        self._count(letter)
        self._write([letter])

    def _count(self, letter: DeadLetter) -> None:
        key = f"{letter.actor}: {letter.reason}"
        if key not in self.by_reason:
            logger.warning("dead letter from %s: %s", letter.actor, letter.reason)
        self.by_reason[key] += letter.count
        self.by_actor[letter.actor] += letter.count

    def _write(self, letters: list[DeadLetter]) -> None:
        """Append the letters' lines with unbuffered writes: in the OS when this returns."""
        if self.path is None or not letters:
            return
        if self._file is None:
            self.open()
        assert self._file is not None
        view = memoryview(b"".join(map(dead_letter_line, letters)))
        fd = self._file.fileno()
        while view:
            view = view[os.write(fd, view) :]

    def close(self) -> None:
        """Close the dead-letter file, if any (everything is written already)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def dead_letter_line(letter: DeadLetter) -> bytes:
    """One dead letter as the file holds it: a JSON line with the actor, the reason, the count
    and the payload.

    A report's payload is the report exactly as the JSON Lines output writes it (PowerAPI's
    JSON layout, :func:`~wattflow.formats.powerapi.encode_json`), so ``jq -c .payload`` gives
    lines that the ``jsonl`` input reads back into the same reports; other payloads (a raw
    input line, a document) are written as JSON, anything else as its text.
    """
    head = json.dumps({"actor": letter.actor, "reason": letter.reason, "count": letter.count})
    return f'{head[:-1]}, "payload": {payload_json(letter.payload)}}}\n'.encode()


@singledispatch
def payload_json(payload: Any) -> str:
    """A dead letter's payload as JSON: as it is (a raw input line, a document), or its text."""
    return json.dumps(payload, default=str)


@payload_json.register
def _model_json(payload: BaseModel) -> str:
    return json.dumps(payload.model_dump(mode="json"))


@payload_json.register
def _report_json(payload: Report) -> str:
    """A report as the JSON Lines output writes it."""
    return encode_json(payload)


@dataclass
class Ledger:
    """What entered the pipeline and how it left: the proof that a drain lost nothing.

    Attributes:
        rejected_input: input that never became a report (an undecodable line), dead-lettered.
        entered: reports pullers handed to the router.
        skipped: reports of sensors another instance takes (``--partition``): read and let
            go, neither entered nor dead letters.
        dropped: reports a pre-processor let go by design, by reason (PowerAPI 2.10's k8s
            layout drops a pod's container the API does not name): never entered.
        sorted: reports the router has dispatched or dead-lettered.
        unused: reports that no enabled formula takes and no output takes as they are (a
            per-container report while only the RAPL formula runs), counted by kind and named
            in the log, not dead-lettered.
        routed: deliveries to formulas (a report two formulas take counts twice).
        consumed: deliveries a formula took in, into an output or into its state.
        absorbed: the part of ``consumed`` that produced no output by design (a first tick).
        dead_in: deliveries a formula could not process, dead-lettered with the reason.
        produced: reports the formulas emitted.
        unrequested: produced reports that no configured pusher takes (for example
            FormulaReports when no output asks for them), counted rather than written.
        dispatched: deliveries of produced reports to pushers.
        delivered: deliveries a pusher has written.
        dead_out: deliveries a pusher could not write, dead-lettered.
    """

    rejected_input: int = 0
    entered: int = 0
    skipped: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    sorted: int = 0
    unused: Counter[str] = field(default_factory=Counter)
    routed: int = 0
    consumed: int = 0
    absorbed: int = 0
    dead_in: int = 0
    produced: int = 0
    unrequested: int = 0
    dispatched: int = 0
    delivered: int = 0
    dead_out: int = 0
    delivered_by_pusher: Counter[str] = field(default_factory=Counter)

    def balanced(self) -> bool:
        """Whether every report that entered has left, as output or as a dead letter."""
        return (
            self.entered == self.sorted
            and self.routed == self.consumed + self.dead_in
            and self.dispatched == self.delivered + self.dead_out
        )

    def summary(self) -> str:
        """One line for the log at the end of a run."""
        return (
            f"entered={self.entered} rejected_input={self.rejected_input} "
            f"skipped={self.skipped} dropped={sum(self.dropped.values())} "
            f"unused={sum(self.unused.values())} consumed={self.consumed} "
            f"(absorbed={self.absorbed}) "
            f"dead_in={self.dead_in} produced={self.produced} delivered={self.delivered} "
            f"dead_out={self.dead_out} unrequested={self.unrequested}"
        )


class Actor(ABC):
    """A supervised asyncio task.

    ``run`` is the actor's loop; it returns when its work is done (its mailbox closed and
    drained, or its input at an end). If it raises, the supervisor calls :meth:`on_crash` and
    then ``run`` again, so state that must survive a restart lives on the instance.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    async def run(self) -> None:
        """The actor's loop."""

    async def on_crash(self, error: BaseException) -> None:  # noqa: B027 - optional hook
        """Settle what was in flight when ``run`` failed, before a restart."""

    async def on_finished(self) -> None:  # noqa: B027 - optional hook
        """Called once after ``run`` returned for good; e.g. close downstream mailboxes."""

    async def run_abandoned(self, reason: str) -> None:  # noqa: B027 - optional hook
        """After the supervisor gave up: settle the mailbox (dead letters) until it closes.

        Upstream actors keep flowing and the ledger stays balanced even though this actor's
        work can no longer be done.
        """


@dataclass(frozen=True)
class RestartPolicy:
    """How a failed actor is restarted: exponential backoff, bounded by a budget."""

    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    max_restarts: int = 10
    window_s: float = 60.0


class Supervisor:
    """Runs actors, restarts failed ones with backoff, and stops them in order."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.restarts: Counter[str] = Counter()
        self.failures: dict[str, str] = {}
        self.restarting: dict[str, str] = {}
        """Actors waiting out their backoff before a restart, with the error that stopped them."""
        self.on_give_up: Callable[[str], None] | None = None
        self.group: asyncio.TaskGroup | None = None
        """The task group that owns the actors' tasks, set by the pipeline while it runs (so
        that none outlives it, whatever ends it); a supervisor used on its own starts them as
        tasks of the loop's."""
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, actor: Actor, *, restart: bool = True) -> asyncio.Task[None]:
        """Start an actor under supervision; without ``restart`` its first failure is final."""
        supervised = self._supervise(actor, restart)
        if self.group is not None:
            task = self.group.create_task(supervised, name=actor.name)
        else:
            task = asyncio.create_task(supervised, name=actor.name)
        self._tasks[actor.name] = task
        return task

    async def _supervise(self, actor: Actor, restart: bool) -> None:
        failures: deque[float] = deque()
        backoff = Backoff(self.policy.initial_backoff_s, self.policy.max_backoff_s)
        while True:
            try:
                await actor.run()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                now = time.monotonic()
                failures.append(now)
                while failures and now - failures[0] > self.policy.window_s:
                    failures.popleft()
                await actor.on_crash(error)
                if not restart or len(failures) > self.policy.max_restarts:
                    reason = f"{actor.name} failed: {error}"
                    if restart:
                        reason = f"{actor.name} failed {len(failures)} times, last: {error!r}"
                    # An error raised on purpose says all in its message (the docs promise
                    # one line); an unexpected one keeps its traceback, and -v shows both.
                    expected = isinstance(error, WattflowError)
                    shown = not expected or logger.isEnabledFor(logging.DEBUG)
                    logger.error("%s; giving up", reason, exc_info=error if shown else None)
                    self.failures[actor.name] = reason
                    if self.on_give_up is not None:
                        self.on_give_up(reason)
                    await actor.run_abandoned(reason)
                    await actor.on_finished()
                    return
                logger.warning("actor %s failed: %r; restarting", actor.name, error, exc_info=error)
                self.restarts[actor.name] += 1
                self.restarting[actor.name] = repr(error)
                await asyncio.sleep(backoff.next_s())
                del self.restarting[actor.name]
                continue
            await actor.on_finished()
            return

    def started(self) -> set[str]:
        """Names of the actors started so far."""
        return set(self._tasks)

    def finished(self) -> set[str]:
        """Names of the started actors whose loop has ended, for good or by failing."""
        return {name for name, task in self._tasks.items() if task.done()}

    async def wait(self, names: Sequence[str] | None = None) -> None:
        """Wait for the named actors (all by default)."""
        chosen = (
            [self._tasks[n] for n in names] if names is not None else list(self._tasks.values())
        )
        if chosen:
            await asyncio.gather(*chosen)

    async def cancel_all(self) -> None:
        """Cancel every actor still running, and wait until each has ended; used only when a
        drain cannot complete. Calling it again, or after the actors ended, does nothing."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


@asynccontextmanager
async def task_group() -> AsyncIterator[asyncio.TaskGroup]:
    """An :class:`asyncio.TaskGroup` that raises the first error of its tasks or body as
    itself, not wrapped in an exception group: what ends a pipeline's run is what its caller
    handles (an actor's error, a cancellation), as it was before the run owned its tasks.

    The group's guarantee is kept: when it is left, whatever way, every task it started has
    ended, the others cancelled once one failed.
    """
    error: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as errors:
        error = errors.exceptions[0]
    if error is not None:
        raise error


async def first_set(*events: asyncio.Event) -> None:
    """Wait until one of ``events`` is set. The waits it starts have ended when it returns
    (or raises): none is left pending on an event that may never be set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


class Backoff:
    """Exponential backoff with jitter, the one every retry in wattflow waits with.

    Each delay is drawn between half and all of the current step ("equal jitter"), and the
    step doubles up to ``max_s``: inputs, outputs and actors that failed at the same moment
    (a server that went down for all of them) do not all retry at the same moment, and each
    still waits at least half its step.
    """

    def __init__(self, initial_s: float = 0.1, max_s: float = 5.0) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._step_s = initial_s

    def next_s(self) -> float:
        """The delay before the next attempt; the step after it is doubled."""
        step = self._step_s
        self._step_s = min(step * 2, self.max_s)
        return random.uniform(step / 2, step)

    def reset(self) -> None:
        """Start again from the first step (after a success)."""
        self._step_s = self.initial_s


async def retry_with_backoff(
    attempt: Callable[[], Awaitable[T]],
    *,
    retryable: Callable[[BaseException], bool],
    attempts: int | None = None,
    give_up_after_s: float | None = None,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 5.0,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``attempt`` until it succeeds, retrying retryable errors with :class:`Backoff`.

    Retries stop after ``attempts`` calls or once ``give_up_after_s`` seconds have passed since
    the first call, whichever comes first; with neither, they go on until the call succeeds.
    ``on_retry`` is told of each error that is about to be retried (for the service's metrics).

    Raises:
        The last error, once the budget is spent or an error is not retryable.
    """
    backoff = Backoff(initial_backoff_s, max_backoff_s)
    deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
    number = 0
    while True:
        number += 1
        try:
            return await attempt()
        except Exception as error:
            delay_s = backoff.next_s()
            out_of_attempts = attempts is not None and number >= attempts
            out_of_time = deadline is not None and time.monotonic() + delay_s > deadline
            if out_of_attempts or out_of_time or not retryable(error):
                raise
            logger.warning("retrying in %.1f s after: %s (attempt %d)", delay_s, error, number)
            if on_retry is not None:
                on_retry(error)
            await asyncio.sleep(delay_s)
