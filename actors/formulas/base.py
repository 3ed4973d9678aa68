"""What every formula is, and the actor that runs the instances of one formula.

A formula is keyed like PowerAPI's dispatcher: :meth:`Formula.dispatch_key` names the instance a
report belongs to (for example one per sensor), and the :class:`FormulaActor` creates that
instance on the first report with that key. Instances see batches of their own reports.

Failures have a unit: the part of a formula's work that succeeds or fails as a whole (a tick, a
report). A formula that holds state runs each unit inside a guard: it takes a
:meth:`Output.mark` before the unit and, when the unit raises, :meth:`Output.fail` discards what
the unit wrote and dead-letters the unit's own reports with the error; the formula goes on with
its next unit from the state the failed one left, and nothing is replayed onto it.

Time. A formula that holds work for a while (the node formula waits for late sources) says when
that work is due with :meth:`Formula.deadline`; the actor calls :meth:`Formula.wake` once the
deadline has passed, with or without new input, so a stream that pauses does not leave the
held work unreported until shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from wattflow.actors.checkpoints import Barrier, barrier_of
from wattflow.actors.runtime import Actor, DeadLetter, DeadLetters, Ledger, Mailbox, QueueConfig
from wattflow.formats.batch import Batch, batch_size, expand
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import Report

if TYPE_CHECKING:
    from wattflow.actors.checkpoints import Checkpoints

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES = 100
"""Distinct failure reasons whose traceback an actor logs; later ones are only dead letters
(which log each new reason at WARNING), so a formula failing in ever new words cannot flood the
log with tracebacks."""

MIN_WAKE_S = 0.05
"""Shortest wait between two wakes of an instance whose deadline does not move past the time
it was woken: a formula that keeps saying "due now" is woken 20 times a second at most, never
in a busy loop."""

Mark = tuple[int, int, int, int]
"""Where an :class:`Output` stood before a unit of work (see :meth:`Output.mark`)."""


class FormulaConfig(BaseModel):
    """Settings every formula shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Output:
    """What one call of a formula produced: reports, absorbed inputs and rejected inputs."""

    __slots__ = ("absorbed", "failures", "frames", "rejected", "reports")

    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.frames: list[Frame] = []
        """Frames of reports, which go on after ``reports``: a formula that makes both in one
        call makes the reports of earlier ticks."""
        self.absorbed = 0
        self.rejected: list[tuple[Report, str]] = []
        self.failures: list[tuple[str, BaseException]] = []
        """Errors the formula survived, with the reason each gave; the actor logs the
        traceback of each reason once."""

    @property
    def produced(self) -> int:
        """The number of reports produced, a frame counting as the reports it stands for."""
        return len(self.reports) + sum(len(frame) for frame in self.frames)

    def items(self) -> list[Report | Frame]:
        """Everything produced, in the order it goes on."""
        return [*self.reports, *self.frames]

    def emit_frame(self, frame: Frame) -> None:
        """Send a frame of many reports on at once; an empty frame is not sent."""
        if len(frame):
            self.frames.append(frame)

    def emit(self, report: Report) -> None:
        """Send a report on to the pushers."""
        self.reports.append(report)

    def emit_all(self, reports: Iterable[Report]) -> None:
        """Send several reports on at once (one call where a formula makes many per tick)."""
        self.reports.extend(reports)

    def absorb(self, count: int = 1) -> None:
        """Note inputs that went into the formula's state without an output of their own."""
        self.absorbed += count

    def reject(self, report: Report, reason: str) -> None:
        """Dead-letter an input the formula cannot use, saying why."""
        self.rejected.append((report, reason))

    def mark(self) -> Mark:
        """Where the output stands: taken before a unit of work, for :meth:`fail` to undo it."""
        return len(self.reports), len(self.frames), self.absorbed, len(self.rejected)

    def rollback(self, mark: Mark) -> None:
        """Forget everything written since ``mark``."""
        reports, frames, absorbed, rejected = mark
        del self.reports[reports:]
        del self.frames[frames:]
        self.absorbed = absorbed
        del self.rejected[rejected:]

    def fail(
        self,
        reports: Iterable[Report],
        error: BaseException,
        *,
        unit: str,
        since: Mark | None = None,
    ) -> None:
        """A unit of work raised: dead-letter its own ``reports`` with the error's type and text.

        ``since`` is the :meth:`mark` taken before the unit: what the unit emitted, absorbed or
        rejected is forgotten first, so each of its reports leaves once, as this dead letter.
        Leave it out only where the unit cannot have written anything before it raised. The
        reason names the unit, not the report, so that the same error on many units is one
        reason (one line in the log, one traceback).
        """
        if since is not None:
            self.rollback(since)
        reason = f"failed on its {unit}: {type(error).__name__}: {error}"
        self.rejected.extend((report, reason) for report in reports)
        self.failures.append((reason, error))


C = TypeVar("C", bound=FormulaConfig)


class Formula(ABC, Generic[C]):
    """One instance of a formula, owning the state of one dispatch key."""

    name: ClassVar[str]
    inputs: ClassVar[frozenset[str]]
    config_model: ClassVar[type[FormulaConfig]]
    needs: ClassVar[frozenset[str] | None] = None
    """Kinds of which the formula needs one to report anything (all of ``inputs`` when unset):
    the pipeline does not start a formula none of whose needed kinds an input gives."""
    replayable: ClassVar[bool] = True
    """Whether a batch on which :meth:`process` raised may be replayed one report at a time, so
    that only the reports that raise become dead letters. That is right only for a formula that
    keeps nothing of a failed call (each report turned into its outputs). A formula that holds
    state sets it ``False`` and guards its own units (:meth:`Output.fail`): an error that still
    escapes :meth:`process` dead-letters the batch, which is never replayed onto the state the
    failed call changed."""

    def __init__(self, config: C, key: Hashable) -> None:
        self.config = config
        self.key = key

    @classmethod
    def prepare(cls, config: FormulaConfig) -> None:
        """Load what the instances will need (a library), before the pipeline starts."""

    @classmethod
    def configured(cls, config: FormulaConfig, given: frozenset[str]) -> FormulaConfig:
        """The settings the instances get once the kinds the pipeline's inputs give (``given``)
        are known: the settings as they are, unless the formula needs to know what will come
        (the energy formula: which scopes to wait for)."""
        return config

    @classmethod
    def enabled(cls, config: FormulaConfig) -> bool:
        """Whether the settings ask for this formula at all (a formula that is off unless
        asked for, such as the energy formula, says so here): one that is not is not started."""
        return True

    @classmethod
    def takes_formula_output(cls, config: FormulaConfig) -> bool:
        """Whether this formula also reads what the other formulas produce (the node formula
        sharing node power among the targets the CPU and GPU formulas estimated)."""
        return False

    @classmethod
    @abstractmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        """The instance a report belongs to; ``None`` when it holds nothing for this formula."""

    @classmethod
    def frame_parts(cls, frame: HWPCFrame) -> list[tuple[Hashable, Frame]] | None:
        """An hwpc-sensor frame's parts for each instance, each standing for the reports
        ``dispatch_key`` would send it; ``None`` for a formula that takes the frame's reports.

        A formula that returns parts receives them in :meth:`process`, alone in their batch.
        """
        return None

    @abstractmethod
    def process(self, reports: Batch, out: Output) -> None:
        """Turn a batch of this instance's reports into outputs.

        A formula whose :meth:`frame_parts` gives parts also gets batches of one frame.
        """

    def flush(self, out: Output) -> None:
        """At shutdown, emit or reject whatever the instance still holds."""

    def deadline(self) -> float | None:
        """When (``time.monotonic()`` seconds) the instance has work due without new input,
        such as an interval that has waited long enough for late sources; ``None`` when it has
        none. The actor calls :meth:`wake` once that time has passed."""
        return None

    def wake(self, out: Output) -> None:
        """Do the work due by now (see :meth:`deadline`), as :meth:`process` does after a batch;
        the actor calls it without input, so a paused stream does not hold it back."""

    def state(self) -> Any:
        """What the instance learned and still holds, as JSON-ready values (a checkpoint keeps
        it; :meth:`restore` takes it back after a restart), or ``None`` when it keeps nothing
        worth saving. It must not share mutable objects with the instance: it is encoded
        later, while the instance goes on.

        A formula's state is a :class:`~wattflow.actors.checkpoints.FormulaState`, typed and
        tagged with its layout's version, returned through
        :func:`~wattflow.actors.checkpoints.encode_state` (whose values are copies)."""
        return None

    def restore(self, state: Any) -> None:
        """Take back what :meth:`state` gave, on a fresh instance, before its first report:
        all of it, or none. A state this release cannot read (another version, a body that
        does not fit, :func:`~wattflow.actors.checkpoints.decode_state`) raises a
        ``ValueError`` that names the formula, before the instance is changed; the actor logs
        it and starts the instance afresh."""


Dispatch = Callable[[list[Report | Frame]], Awaitable[None]]

Observer = Callable[[list[Report | Frame]], None]
"""Told of each batch a formula made, as it made it (see :attr:`FormulaActor.observers`)."""


class FormulaActor(Actor):
    """Runs every instance of one formula.

    A formula that raises does not stop the pipeline. The formulas that hold state catch their
    errors unit by unit (:meth:`Output.fail`); an error that escapes :meth:`Formula.process`
    dead-letters the batch, or, for a :attr:`Formula.replayable` formula, the batch is replayed
    one report at a time and the reports that raise become dead letters. Either way the
    traceback of each distinct reason is logged once, at ERROR.
    """

    def __init__(
        self,
        formula: type[Formula[Any]],
        config: FormulaConfig,
        *,
        queue: QueueConfig,
        ledger: Ledger,
        dead_letters: DeadLetters,
        dispatch: Dispatch,
        on_done: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(f"formula:{formula.name}")
        self.formula = formula
        self.config = config
        self.queue = queue
        self.mailbox: Mailbox[tuple[Hashable, Report | Frame]] = Mailbox(
            queue.max_reports, self.name
        )
        self.instances: dict[Hashable, Formula[Any]] = {}
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.dispatch = dispatch
        self.observers: list[Observer] = []
        """Told of each batch of output the formula made (never empty, never a barrier), in
        order, before :attr:`dispatch` hands it on: so they see it as the formula made it,
        before it is named. The status (``--http-port``) watches the output here; with no
        observer a batch costs one test of an empty list."""
        self.on_done = on_done
        """What the actor does once it is done: close the mailboxes it feeds."""
        self._in_flight: list[tuple[Hashable, Report | Frame]] = []
        self._logged_failures: set[str] = set()
        self.produced = 0
        """Reports this formula emitted."""
        self.checkpoints: Checkpoints | None = None
        """Where instance states go at a barrier and come from at creation."""
        self.producers = 1
        """Stages that send this formula barriers: it snapshots on the last copy of each."""
        self._copies: dict[int, int] = {}
        self._final: Barrier | None = None
        self.timed = formula.deadline is not Formula.deadline
        """Whether the formula has work due by time (:meth:`Formula.deadline`): only then does
        the actor wait for its mailbox with a timeout."""

    def instance(self, key: Hashable) -> Formula[Any]:
        """The instance for ``key``, created on first use."""
        found = self.instances.get(key)
        if found is None:
            found = self.instances[key] = self.formula(self.config, key)
            if self.checkpoints is not None:
                self._restore(found, self.checkpoints.restored_state(self.formula.name, key))
        return found

    def adopt_restored(self, owns: Callable[[str], bool] | None) -> None:
        """Create now the instance of every key the restored checkpoint holds a state for
        (its sensor, of those ``owns`` says this pipeline takes), rather than on its first
        report: a sensor that sends nothing more still has what its instance held reported and
        saved again in the next checkpoint."""
        if self.checkpoints is None:
            return
        for key in list(self.checkpoints.restored.get(self.formula.name, ())):
            if owns is None or owns(key):
                self.instance(key)

    def _restore(self, instance: Formula[Any], state: Any) -> None:
        if state is None:
            return
        try:
            instance.restore(state)
        except Exception as error:  # a state it cannot take: start that instance afresh
            logger.warning(
                "%s: saved state of %s not restored (%s: %s); it starts afresh",
                self.name,
                instance.key,
                type(error).__name__,
                error,
            )
            self.instances[instance.key] = self.formula(self.config, instance.key)

    async def _at_barrier(self, barrier: Barrier) -> None:
        """Snapshot every instance and pass the barrier on, once every producer's copy came;
        the final one waits for the flush."""
        copies = self._copies.pop(barrier.epoch, 0) + 1
        if copies < self.producers:
            self._copies[barrier.epoch] = copies
            return
        if barrier.final:
            self._final = barrier
            return
        await self._snapshot(barrier)

    async def _snapshot(self, barrier: Barrier) -> None:
        states: dict[str, Any] = {}
        for key, instance in self.instances.items():
            state = instance.state()
            if state is not None:
                states[str(key)] = state
        await self.dispatch([barrier])
        if self.checkpoints is not None:
            self.checkpoints.snapshot(barrier, self.formula.name, states)

    async def run(self) -> None:
        while (batch := await self._next_batch()) is not None:
            barrier = barrier_of(batch)
            if barrier is not None:
                await self._at_barrier(barrier)
                continue
            self._in_flight = batch
            groups: dict[Hashable, list[Report | Frame]] = {}
            for key, report in batch:
                groups.setdefault(key, []).append(report)
            produced: list[Report | Frame] = []
            for key, reports in groups.items():
                produced.extend(self._process(self.instance(key), reports))
            self._in_flight = []
            if self.observers:
                self._observe(produced)
            await self.dispatch(produced)
        produced = []
        for formula in self.instances.values():
            out = Output()
            try:
                formula.flush(out)
            except Exception as error:  # what it still held is lost with it: say so, loudly
                out = Output()
                out.fail((), error, unit="flush")
            produced.extend(self._settle(out, 0))
        if self.observers:
            self._observe(produced)
        await self.dispatch(produced)
        if self._final is not None:
            await self._snapshot(self._final)

    def _observe(self, produced: list[Report | Frame]) -> None:
        """Tell the observers of a batch the formula made (an empty one is not told)."""
        if produced:
            for observer in self.observers:
                observer(produced)

    async def _next_batch(self) -> list[tuple[Hashable, Report | Frame]] | None:
        """The next batch of the mailbox (``None`` once it is closed and empty); for a formula
        with deadlines, the instances whose deadline passes meanwhile are woken and their
        output dispatched, through the drain as well.

        Only a wait on an empty mailbox while a deadline is set has a timeout; otherwise the
        mailbox is read as for a formula without deadlines (deadlines are set only by
        :meth:`Formula.process` and :meth:`Formula.wake`, never while the actor waits). The
        timeout cancels a wait that has taken nothing: the mailbox gives only on return."""
        if not self.timed:
            return await self.mailbox.get(self.queue.max_batch)
        while True:
            produced, wait_s = self._wake_due()
            if produced:
                if self.observers:
                    self._observe(produced)
                await self.dispatch(produced)
            if wait_s is None or len(self.mailbox):
                return await self.mailbox.get(self.queue.max_batch)
            try:
                async with asyncio.timeout(wait_s):
                    return await self.mailbox.get(self.queue.max_batch)
            except TimeoutError:
                continue  # a deadline passed: wake the instances it is due for

    def _wake_due(self) -> tuple[list[Report | Frame], float | None]:
        """Wake every instance whose deadline has passed; return what they produced and the
        seconds until the next deadline (``None``: none is set)."""
        now = time.monotonic()
        produced: list[Report | Frame] = []
        next_at: float | None = None
        for formula in self.instances.values():
            at = formula.deadline()
            if at is not None and at <= now:
                out = Output()
                try:
                    formula.wake(out)
                except Exception as error:  # logged once per reason; the formula goes on
                    out = Output()
                    out.fail((), error, unit="wake")
                produced.extend(self._settle(out, 0))
                at = formula.deadline()
                at = None if at is None else max(at, now + MIN_WAKE_S)
            if at is not None and (next_at is None or at < next_at):
                next_at = at
        return produced, None if next_at is None else next_at - now

    def _process(
        self, formula: Formula[Any], reports: list[Report | Frame]
    ) -> list[Report | Frame]:
        out = Output()
        try:
            formula.process(reports, out)
        except Exception as error:
            if formula.replayable:
                return self._process_one_by_one(formula, expand(reports))
            out = Output()
            out.fail(expand(reports), error, unit="batch")
        return self._settle(out, batch_size(reports))

    def _process_one_by_one(
        self, formula: Formula[Any], reports: list[Report]
    ) -> list[Report | Frame]:
        produced: list[Report | Frame] = []
        for report in reports:
            out = Output()
            try:
                formula.process([report], out)
            except Exception as error:
                out = Output()
                out.fail([report], error, unit="report")
            produced.extend(self._settle(out, 1))
        return produced

    def _settle(self, out: Output, taken: int) -> list[Report | Frame]:
        for report, reason in out.rejected:
            self._reject(report, reason)
        if out.failures:
            self._log_failures(out.failures)
        self.ledger.consumed += taken - len(out.rejected)
        self.ledger.absorbed += out.absorbed
        self.ledger.produced += out.produced
        self.produced += out.produced
        return out.items()

    def _log_failures(self, failures: list[tuple[str, BaseException]]) -> None:
        """Each new reason's traceback, once: a formula failing on every tick logs once."""
        logged = self._logged_failures
        for reason, error in failures:
            if reason in logged or len(logged) >= MAX_LOGGED_FAILURES:
                continue
            logged.add(reason)
            logger.error("%s %s", self.name, reason, exc_info=error)

    def _reject(self, report: Report, reason: str) -> None:
        self.ledger.dead_in += 1
        self.dead_letters.add(DeadLetter(self.name, reason, report))

    async def on_crash(self, error: BaseException) -> None:
        for report in expand([report for _, report in self._in_flight]):
            self._reject(report, f"{self.name} crashed: {error!r}")
        self._in_flight = []

    async def run_abandoned(self, reason: str) -> None:
        while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
            for report in expand([report for _, report in batch]):
                self._reject(report, f"abandoned: {reason}")

    async def on_finished(self) -> None:
        if self.on_done is not None:
            await self.on_done()
