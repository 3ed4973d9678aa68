"""The pipeline: pullers → router → formula actors → pushers, started and drained in order.

Shutdown, whether at the end of the input or on SIGTERM/SIGINT, goes front to back: pullers stop
reading and hand on what they decoded, then the router, the formulas (which flush what they still
hold) and the pushers (which flush their sinks) each finish their mailbox before the next stage
is closed. The :class:`~wattflow.actors.runtime.Ledger` then shows that every report that entered
left as output or as a dead letter.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from wattflow.actors.formulas.base import Formula, FormulaActor, FormulaConfig
from wattflow.actors.partition import Partition
from wattflow.actors.pullers.base import Puller
from wattflow.actors.pushers.base import Pusher, PusherActor
from wattflow.actors.router import Router
from wattflow.actors.runtime import (
    Actor,
    DeadLetter,
    DeadLetters,
    Ledger,
    QueueConfig,
    RestartPolicy,
    Supervisor,
)
from wattflow.formats.frames import Frame, batch_size, expand
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

_kind = attrgetter("kind")


def _fed(formula: type[Formula[Any]], given: set[str]) -> bool:
    """Whether an input gives one of the kinds the formula needs to report anything.

    The node formula reads RAPL energy too, but reports only against a meter: with no meter
    input it would take every global report and never write a thing.
    """
    needs = formula.inputs if formula.needs is None else formula.needs
    if needs & given:
        return True
    logger.debug(
        "formula %s not started: no input gives %s", formula.name, ", ".join(sorted(needs))
    )
    return False


def _assign(partition: Partition | None, pullers: list[Puller[Any]]) -> Partition | None:
    """Tell each puller the partition it reads for; none when there is only one."""
    taken = None if partition is None or partition.count == 1 else partition
    for puller in pullers:
        puller.partition = taken
    return taken


class _Emitter:
    """The router's mailbox as one puller sees it.

    With a partition, the reports of sensors other instances take are let go here, right
    after decoding, whatever the input: counted as skipped, never entered.
    """

    def __init__(self, pipeline: Pipeline, name: str) -> None:
        self._pipeline = pipeline
        self._name = name
        self.stopping = pipeline.stopping
        self.emitted = 0
        """Reports this puller handed to the router."""
        self.skipped = 0
        """Reports of other partitions' sensors this puller read and let go."""

    async def emit(self, batch: Sequence[Report] | Sequence[Frame]) -> None:
        partition = self._pipeline.partition
        if partition is None or not batch:
            await self._emit(batch)
            return
        taken, skipped = partition.select(batch)
        self.skip(skipped)
        for part in taken:
            await self._emit(part)

    def skip(self, count: int) -> None:
        """Count reports of other partitions that the puller let go before decoding them."""
        self.skipped += count
        self._pipeline.ledger.skipped += count

    async def _emit(self, batch: Sequence[Report] | Sequence[Frame]) -> None:
        if batch:
            if self._pipeline.passed_through:
                await self._pipeline.pass_through(expand(batch))
            await self._pipeline.router.mailbox.put(batch)
            size = batch_size(batch)
            self._pipeline.ledger.entered += size
            self.emitted += size

    def reject(self, payload: Any, reason: str) -> None:
        self._pipeline.ledger.rejected_input += 1
        self._pipeline.dead_letters.add(DeadLetter(self._name, reason, payload))


class PullerActor(Actor):
    """Runs one puller until its input ends or the pipeline stops."""

    def __init__(self, puller: Puller[Any], emitter: _Emitter) -> None:
        super().__init__(f"puller:{puller.config.name}")
        self.puller = puller
        self.emitter = emitter

    async def run(self) -> None:
        await self.puller.pull(self.emitter)


@dataclass
class PipelineResult:
    """How a run ended: the ledger and the failures that ended actors for good."""

    ledger: Ledger
    failures: dict[str, str] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the run ended without an actor failing for good."""
        return not self.failures


class Pipeline:
    """One partition of the service: its actors, mailboxes, ledger and dead letters."""

    def __init__(
        self,
        pullers: list[Puller[Any]],
        formulas: list[tuple[type[Formula[Any]], FormulaConfig]],
        pushers: list[Pusher[Any]],
        *,
        queue: QueueConfig | None = None,
        dead_letters: DeadLetters | None = None,
        restart_policy: RestartPolicy | None = None,
        partition: Partition | None = None,
    ) -> None:
        self.queue = queue or QueueConfig()
        self.partition = _assign(partition, pullers)
        """The sensors this instance takes (``--partition``); None: every sensor."""
        self.ledger = Ledger()
        self.dead_letters = dead_letters or DeadLetters()
        self.stopping = asyncio.Event()
        self.supervisor = Supervisor(restart_policy)
        self.supervisor.on_give_up = self._on_give_up
        self.pushers = [
            PusherActor(p, queue=self.queue, ledger=self.ledger, dead_letters=self.dead_letters)
            for p in pushers
        ]
        given = {puller.config.model for puller in pullers}
        formulas = [(f, c) for f, c in formulas if _fed(f, given)]
        for formula, config in formulas:
            formula.prepare(config)
        self.formulas = [
            FormulaActor(
                formula,
                config,
                queue=self.queue,
                ledger=self.ledger,
                dead_letters=self.dead_letters,
                dispatch=self._dispatch,
            )
            for formula, config in formulas
        ]
        for formula_actor in self.formulas:
            formula_actor.on_done = self._formula_done
        self._formulas_running = len(self.formulas)
        self._wire_second_stage()
        self.router = Router(
            list(self.formulas),
            queue=self.queue,
            ledger=self.ledger,
            dead_letters=self.dead_letters,
        )
        self.pullers = [PullerActor(p, _Emitter(self, f"puller:{p.config.name}")) for p in pullers]
        self._pushers_by_kind: dict[str, list[PusherActor]] = {}
        self.passed_through = {
            puller.config.model
            for puller in pullers
            if any(actor.pusher.accepts(puller.config.model) for actor in self.pushers)
        }
        """Input kinds that outputs also take as they are (GPUReports from the NVML sampler
        to a GPUReport output), besides what the formulas make of them."""
        if self.passed_through:
            # The pullers feed the outputs too: those close after the pullers are done as well.
            self._formulas_running += 1

    def _pushers_for(self, kind: str) -> list[PusherActor]:
        found = self._pushers_by_kind.get(kind)
        if found is None:
            found = self._pushers_by_kind[kind] = [
                a for a in self.pushers if a.pusher.accepts(kind)
            ]
        return found

    async def _dispatch(self, reports: list[Report | Frame]) -> None:
        """Hand a formula's output to the pushers that take each kind, in order.

        A formula's output is mostly of one kind (PowerReports, with a FormulaReport per model
        in SmartWatts' case), so each pusher's share is picked out by kind in one pass, rather
        than each report looked up and appended on its own. Frames go whole to the pushers that
        write frames, and as their reports to the others; a frame of a kind no pusher takes is
        counted and never turned into reports.
        """
        if not reports:
            return
        if any(isinstance(item, Frame) for item in reports):
            await self._dispatch_frames(reports)
            return
        counts = Counter(map(_kind, reports))
        takers = {kind: self._pushers_for(kind) for kind in counts}
        self.ledger.unrequested += sum(counts[kind] for kind, found in takers.items() if not found)
        for actor in self.pushers:
            accepted = {kind for kind, found in takers.items() if actor in found}
            if not accepted:
                continue
            if len(accepted) == len(counts):
                batch = reports
            else:
                batch = [report for report in reports if report.kind in accepted]
            self.ledger.dispatched += len(batch)
            await actor.mailbox.put(batch)

    async def _dispatch_frames(self, items: list[Report | Frame]) -> None:
        plain: list[Report] = []
        for item in items:
            if not isinstance(item, Frame):
                plain.append(item)
                continue
            if plain:
                await self._dispatch(plain)  # type: ignore[arg-type]
                plain = []
            takers = self._pushers_for(item.kind)
            if not takers:
                self.ledger.unrequested += len(item)
                continue
            reports: list[Report] | None = None
            for actor in takers:
                self.ledger.dispatched += len(item)
                if actor.pusher.takes_frames:
                    await actor.mailbox.put([item])
                    continue
                if reports is None:
                    reports = item.reports()
                await actor.mailbox.put(reports)
        if plain:
            await self._dispatch(plain)  # type: ignore[arg-type]

    def _wire_second_stage(self) -> None:
        """Let formulas that read the others' output (the node formula's shares) get it.

        Their mailbox then has several producers, the router and each other formula, and
        closes once all of them are done, so the drain still goes front to back.
        """
        second = [
            actor for actor in self.formulas if actor.formula.takes_formula_output(actor.config)
        ]
        if not second:
            return
        first = [actor for actor in self.formulas if actor not in second]
        for actor in second:
            actor.mailbox.expect_producers(1 + len(first))

        for actor in first:

            async def dispatch(produced: list[Report | Frame]) -> None:
                reports = expand(produced)
                for taker in second:
                    pairs = [
                        (key, report)
                        for report in reports
                        if (key := taker.formula.dispatch_key(report)) is not None
                    ]
                    if pairs:
                        self.ledger.routed += len(pairs)
                        await taker.mailbox.put(pairs)
                await self._dispatch(produced)

            async def done() -> None:
                for taker in second:
                    await taker.mailbox.close()
                await self._formula_done()

            actor.dispatch = dispatch
            actor.on_done = done

    async def pass_through(self, batch: list[Report]) -> None:
        """Hand input reports to the outputs that take their kind, as they are.

        This is how a sampler's reports are recorded (``--input nvml --output mongodb --model
        GPUReport``) while the formulas turn the same reports into power.
        """
        for kind in {report.kind for report in batch} & self.passed_through:
            reports = [report for report in batch if report.kind == kind]
            for actor in self._pushers_for(kind):
                self.ledger.dispatched += len(reports)
                await actor.mailbox.put(reports)

    async def _formula_done(self) -> None:
        self._formulas_running -= 1
        if self._formulas_running == 0:
            for actor in self.pushers:
                await actor.mailbox.close()

    def _on_give_up(self, reason: str) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask the pullers to stop reading; what entered is still drained and written."""
        if not self.stopping.is_set():
            logger.info("stopping: draining the pipeline")
            self.stopping.set()

    async def run(self) -> PipelineResult:
        """Run until the input ends or :meth:`stop` is called, then drain; return the result.

        Process-wide settings (the garbage collector's, signal handlers) are left to the program
        that runs the pipeline: ``wattflow run`` tunes the collector for itself.
        """
        supervisor = self.supervisor
        for pusher in self.pushers:
            supervisor.start(pusher)
        for formula in self.formulas:
            supervisor.start(formula)
        supervisor.start(self.router)
        if not self.formulas and not self.passed_through:
            await self._formula_done_without_formulas()
        for puller in self.pullers:
            supervisor.start(puller, restart=False)
        await supervisor.wait([p.name for p in self.pullers])
        if self.passed_through:
            await self._formula_done()
        await self.router.mailbox.close()
        await supervisor.wait()
        self.dead_letters.close()
        result = PipelineResult(self.ledger, dict(supervisor.failures), dict(supervisor.restarts))
        logger.info("pipeline drained: %s", self.ledger.summary())
        if not self.ledger.balanced():
            logger.error("ledger does not balance: %s", self.ledger)
        return result

    async def _formula_done_without_formulas(self) -> None:
        self._formulas_running = 1
        await self._formula_done()
