"""The pipeline: pullers → router → formula actors → pushers, started and drained in order.

Shutdown, whether at the end of the input or on SIGTERM/SIGINT, goes front to back: pullers stop
reading and hand on what they decoded, then the router, the formulas (which flush what they still
hold) and the pushers (which flush their sinks) each finish their mailbox before the next stage
is closed. The :class:`~wattflow.actors.runtime.Ledger` then shows that every report that entered
left as output or as a dead letter.

A drain asked for by :meth:`Pipeline.stop` (SIGTERM, SIGINT) is bounded by ``drain_timeout_s``:
past it the outputs stop writing and what they have not written becomes dead letters, the rest of
the pipeline flows through to them, and the ledger still balances. An actor still running
:data:`DRAIN_SETTLE_S` after that is cancelled and what it held is dead-lettered too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wattflow.actors.checkpoints import Barrier, Checkpoints, StateStore, barrier_of
from wattflow.actors.formulas.base import Dispatch, Formula, FormulaActor, FormulaConfig
from wattflow.actors.graph import INPUTS, ROUTER, StageGraph
from wattflow.actors.naming import TargetNaming
from wattflow.actors.partition import Partition
from wattflow.actors.preprocessors.base import PreProcessor
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
    first_set,
    retry_with_backoff,
    task_group,
)
from wattflow.formats.batch import Batch, batch_size, expand, kinds_in, pieces
from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)


DRAIN_SETTLE_S = 5.0
"""Seconds the pipeline may still take once its drain deadline has passed and the outputs have
stopped writing: the time to run what is queued through to dead letters. An actor still running
after that (stuck in a blocking call) is cancelled. A supervisor's grace period must cover the
drain deadline plus this."""


class DrainDeadline(Exception):
    """The drain deadline passed while an actor was still running; its work is dead-lettered."""


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


def _naming(name_targets: bool, pre_processors: Sequence[PreProcessor[Any]]) -> TargetNaming | None:
    """The naming step between every formula and what takes its output (the outputs, and the
    formulas that read other formulas'), so that every output and every reader sees the same
    names: the resolver's (``name_targets``) and those of the pre-processors that name outputs
    (the k8s one's pods); ``None`` when neither names anything."""
    labellers = [p.output_labels for p in pre_processors if p.names_outputs]
    if not name_targets and not labellers:
        return None
    return TargetNaming(resolver=name_targets, extra=labellers)


def _assign(partition: Partition | None, pullers: list[Puller[Any]]) -> Partition | None:
    """Tell each puller the partition it reads for; none when there is only one."""
    taken = None if partition is None or partition.count == 1 else partition
    for puller in pullers:
        puller.partition = taken
    return taken


class _Emitter:
    """The router's mailbox as one puller sees it (its
    :class:`~wattflow.actors.pullers.base.Emitter`), and the pipeline's checkpoints too (its
    :class:`~wattflow.actors.pullers.base.Acknowledger`, handed to the puller as such).

    With a partition, the reports of sensors other instances take are let go here, right
    after decoding, whatever the input: counted as skipped, never entered.
    """

    def __init__(self, pipeline: Pipeline, name: str, input_name: str) -> None:
        self._pipeline = pipeline
        self._name = name
        self.name = input_name
        self.stopping = pipeline.stopping
        self.emitted = 0
        """Reports this puller handed to the router."""
        self.pending: Batch = ()
        """A batch waiting for room in the router's mailbox (dead-lettered if never taken)."""
        self.skipped = 0
        """Reports of other partitions' sensors this puller read and let go."""
        self.pre_processor: PreProcessor[Any] | None = pipeline.pre_processors.get(input_name)
        """PowerAPI's pre-processor bound to this input (``--pre-processor … --puller``)."""
        self.dropped = 0
        """Reports the pre-processor let go (counted by reason in the ledger)."""
        self.position: Any = None
        """The input's position after the last batch it handed on whole."""
        self.at_boundary = False
        """Whether everything handed on since :attr:`position` was reported is none: a barrier
        put now stands exactly at that position."""

    async def boundary(self, position: Any) -> None:
        """The input handed on everything up to ``position``; a checkpoint due starts here."""
        self.position = position
        self.at_boundary = True
        await self._pipeline.checkpoint_if_due()

    def restore(self, data: bytes | None) -> None:
        """Hand the formulas the state saved with this input's position (read by the input
        from its own store, before it hands anything on; ``None`` when it holds none). Only
        the input whose store is the pipeline's restores: until it has, the other inputs hand
        nothing on (:meth:`Pipeline.wait_for_state`)."""
        pipeline = self._pipeline
        store = pipeline.checkpoints.store
        if store is None or store.restored_by != self.name or pipeline.state_ready.is_set():
            return
        pipeline.restore_state(data)
        pipeline.state_ready.set()

    async def emit(self, batch: Batch) -> None:
        partition = self._pipeline.partition
        if partition is None or not batch:
            await self._emit(self._pre_processed(batch))
            return
        taken, skipped = partition.select(batch)
        self.skip(skipped)
        for part in taken:
            await self._emit(self._pre_processed(part))

    def _pre_processed(self, batch: Batch) -> Batch:
        """The batch as the input's pre-processor leaves it; what it let go is counted."""
        if self.pre_processor is None or not batch:
            return batch
        kept, dropped = self.pre_processor.process(batch)
        if dropped:
            self._pipeline.ledger.dropped.update(dropped)
            self.dropped += sum(dropped.values())
        return kept

    def skip(self, count: int) -> None:
        """Count reports of other partitions that the puller let go before decoding them."""
        self.skipped += count
        self._pipeline.ledger.skipped += count

    async def _emit(self, batch: Batch) -> None:
        if batch:
            self.at_boundary = False
            self.pending = batch
            if not self._pipeline.state_ready.is_set():
                await self._pipeline.wait_for_state()
            if self._pipeline.passed_through:
                await self._pipeline.pass_through(expand(batch))
            await self._pipeline.router.mailbox.put(batch)
            self.pending = ()
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
        puller.acknowledger = emitter

    async def run(self) -> None:
        """Pull; an error the puller marks retryable (:class:`PullUnavailable`) is retried with
        backoff for ``retry_for_s``, and ends the input only after that, or at a stop."""
        await retry_with_backoff(
            lambda: self.puller.pull(self.emitter),
            retryable=lambda error: (
                getattr(error, "retryable", False) and not self.emitter.stopping.is_set()
            ),
            give_up_after_s=self.puller.config.retry_for_s,
        )


@dataclass
class PipelineResult:
    """How a run ended: the ledger and the failures that ended actors for good."""

    ledger: Ledger
    failures: dict[str, str] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    past_deadline: int = 0
    """Reports dead-lettered because the drain deadline passed before they were written."""
    deadline_passed: bool = False
    """Whether the drain deadline passed: writes in progress were cancelled, and a thread may
    still be stuck in a sink, so the program should not wait for its threads."""

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
        drain_timeout_s: float | None = None,
        partition: Partition | None = None,
        label: str = "pipeline",
        state_store: StateStore | None = None,
        checkpoint_interval_s: float | None = None,
        name_targets: bool = False,
        pre_processors: Sequence[PreProcessor[Any]] = (),
    ) -> None:
        self.label = label
        """What the log calls this pipeline (``worker 1/2`` under ``--workers``)."""
        self.pre_processors = {p.config.puller: p for p in pre_processors}
        """Each input's pre-processor, by the input's name."""
        self.queue = queue or QueueConfig()
        self.partition = _assign(partition, pullers)
        """The sensors this instance takes (``--partition``); None: every sensor."""
        self.drain_timeout_s = drain_timeout_s
        """Seconds a drain asked for by :meth:`stop` may take before the outputs stop writing;
        None: no deadline (each batch is still bounded by its output's ``retry_for_s``)."""
        self._past_deadline_reason: str | None = None
        self.ledger = Ledger()
        self.dead_letters = dead_letters or DeadLetters()
        self.stopping = asyncio.Event()
        self.state_ready = asyncio.Event()
        """Set once the formulas' saved state is restored, or known to be none: the inputs hand
        nothing on before (:meth:`wait_for_state`)."""
        self.supervisor = Supervisor(restart_policy)
        self.supervisor.on_give_up = self._on_give_up
        self.pushers = [
            PusherActor(p, queue=self.queue, ledger=self.ledger, dead_letters=self.dead_letters)
            for p in pushers
        ]
        self._pushers_by_kind: dict[str, list[PusherActor]] = {}
        self.naming = _naming(name_targets, pre_processors)
        """The naming step between every formula and what takes its output, if any."""
        self.formulas = self._formula_actors(formulas, {p.config.model for p in pullers})
        self.passed_through = self._passed_through({p.config.model for p in pullers})
        """Input kinds that outputs also take as they are (GPUReports from the NVML sampler
        to a GPUReport output), besides what the formulas make of them."""
        self.router = Router(
            list(self.formulas),
            queue=self.queue,
            ledger=self.ledger,
            dead_letters=self.dead_letters,
            passed_through=self.passed_through,
        )
        self.pullers = [
            PullerActor(p, _Emitter(self, f"puller:{p.config.name}", p.config.name))
            for p in pullers
        ]
        self.checkpoints = self._checkpoints(pullers, state_store, checkpoint_interval_s)
        self.graph = self._declare_graph()
        """Which stage feeds which, declared once: the mailboxes wait for their producers."""

    def _declare_graph(self) -> StageGraph:
        """The stage graph, and each mailbox and formula told how many producers feed it."""
        graph = StageGraph.of(
            [actor.name for actor in self.formulas],
            [a.name for a in self.formulas if a.formula.takes_formula_output(a.config)],
            [actor.name for actor in self.pushers],
            passed_through=bool(self.passed_through),
        )
        self._stages: dict[str, Router | FormulaActor | PusherActor] = {ROUTER: self.router}
        self._stages.update((actor.name, actor) for actor in self.formulas)
        self._stages.update((actor.name, actor) for actor in self.pushers)
        for edge in graph.edges:
            self._stages[edge.consumer].mailbox.expect_producers(len(edge.producers))
        for actor in self.formulas:
            actor.producers = len(graph.producers(actor.name))  # copies of each barrier
        self._readers = {
            actor.name: [self.formula_named(r) for r in graph.readers_of(actor.name)]
            for actor in self.formulas
        }
        return graph

    def _checkpoints(
        self,
        pullers: list[Puller[Any]],
        store: StateStore | None,
        interval_s: float | None,
    ) -> Checkpoints:
        """What commits the inputs' positions and the formulas' state: to ``store``, or to the
        first resumable input's own store (the MongoDB input's checkpoint document)."""
        resumable = [(p, a.emitter) for p, a in zip(pullers, self.pullers, strict=True)]
        resumable = [(p, e) for p, e in resumable if p.resumable]
        for puller, _ in resumable:
            store = store or puller.state_store()
        if interval_s is None:
            intervals = [p.checkpoint_interval_s for p, _ in resumable]
            interval_s = min(intervals, default=5.0)
        checkpoints = Checkpoints(store, interval_s, len(self.formulas))
        checkpoints.inputs = [emitter for _, emitter in resumable]
        for actor in self.formulas:
            actor.checkpoints = checkpoints
        for pusher in self.pushers:
            pusher.checkpoints = checkpoints
        return checkpoints

    async def wait_for_state(self) -> None:
        """Wait until the formulas' saved state is restored (:attr:`state_ready`), or the
        pipeline stops (the drain then hands on what waited, to formulas without it).

        Where the state is kept beside an input's position (the MongoDB input's checkpoint
        document), that input restores it only once it has reached its server. Reports another
        input (the GPU samples over ZeroMQ, a meter) handed on before would start their formula
        instances afresh, and the state saved for them would be ignored."""
        await first_set(self.state_ready, self.stopping)

    def restore_state(self, data: bytes | None) -> None:
        """Take the formulas' state from a saved checkpoint, and create at once every instance
        of this pipeline's sensors that it holds a state for: what an instance held then is
        reported (when its deadline passes, or at the end) and saved again, even if its sensor
        sends nothing more."""
        self.checkpoints.restore(data)
        owns = None if self.partition is None else self.partition.owns
        for actor in self.formulas:
            actor.adopt_restored(owns)

    async def checkpoint_if_due(self) -> None:
        """Start a checkpoint when one is due (see :meth:`Checkpoints.due`)."""
        if self.checkpoints.store is not None and self.checkpoints.due():
            await self._put_barrier(self.checkpoints.start())

    async def _put_barrier(self, barrier: Barrier) -> None:
        """Queue a barrier behind everything the inputs handed on: to the outputs that take
        inputs as they are, and through the router to the formulas."""
        for kind in self.passed_through:
            for actor in self._pushers_for(kind):
                self.checkpoints.sent(barrier)
                await actor.mailbox.put([barrier])
        await self.router.mailbox.put([barrier])

    async def _checkpoint_timer(self) -> None:
        """Start checkpoints when the inputs are quiet too (no boundary comes then)."""
        while True:
            await asyncio.sleep(self.checkpoints.interval_s / 2)
            await self.checkpoint_if_due()

    async def _pass_barrier(self, barrier: Barrier) -> None:
        """A formula passes a barrier on to every output."""
        for actor in self.pushers:
            self.checkpoints.sent(barrier)
            await actor.mailbox.put([barrier])

    def _formula_actors(
        self, formulas: list[tuple[type[Formula[Any]], FormulaConfig]], given: set[str]
    ) -> list[FormulaActor]:
        """An actor for each formula that the inputs (which give the kinds ``given``) feed."""
        actors = []
        for formula, config in formulas:
            if not formula.enabled(config) or not _fed(formula, given):
                continue
            config = formula.configured(config, frozenset(given))
            formula.prepare(config)
            stage = f"formula:{formula.name}"
            actor = FormulaActor(
                formula,
                config,
                queue=self.queue,
                ledger=self.ledger,
                dead_letters=self.dead_letters,
                dispatch=self._hand_on_from(stage),
                on_done=self._closes_after(stage),
            )
            actors.append(actor)
        return actors

    def _passed_through(self, given: set[str]) -> set[str]:
        """The input kinds that an output takes as they are."""
        return {kind for kind in given if self._pushers_for(kind)}

    def _pushers_for(self, kind: str) -> list[PusherActor]:
        found = self._pushers_by_kind.get(kind)
        if found is None:
            found = self._pushers_by_kind[kind] = [
                a for a in self.pushers if a.pusher.accepts(kind)
            ]
        return found

    async def _dispatch(self, produced: list[Report | Frame]) -> None:
        """Hand a formula's output to the pushers that take each kind, in order.

        A formula's output is mostly of one kind (PowerReports, with a FormulaReport per model
        in SmartWatts' case), so each pusher's share is picked out by kind in one pass, rather
        than each report looked up and appended on its own. Frames go whole to the pushers that
        write frames, and as their reports to the others; a frame of a kind no pusher takes is
        counted and never turned into reports.
        """
        barrier = barrier_of(produced)
        if barrier is not None:
            await self._pass_barrier(barrier)
            return
        for piece in pieces(produced):
            for actor, share in self._shares(piece):
                self.ledger.dispatched += batch_size(share)
                await actor.mailbox.put(share)

    def _shares(self, piece: Batch) -> list[tuple[PusherActor, Batch]]:
        """Each pusher's share of a frame or a run of reports, in order: the whole of it where
        a pusher takes every kind in it (a frame as its reports to a pusher that does not write
        frames); the reports that no pusher takes are counted as unrequested."""
        counts = kinds_in(piece)
        if len(counts) == 1:  # a frame, or reports of one kind: the whole of it to each taker
            ((kind, count),) = counts.items()
            return self._whole_to(self._pushers_for(kind), piece, count)
        return self._by_kind(expand(piece), counts)

    def _by_kind(
        self, reports: list[Report], counts: Counter[str]
    ) -> list[tuple[PusherActor, Batch]]:
        takers = {kind: self._pushers_for(kind) for kind in counts}
        self.ledger.unrequested += sum(counts[kind] for kind, found in takers.items() if not found)
        shares: list[tuple[PusherActor, Batch]] = []
        for actor in self.pushers:
            accepted = {kind for kind, found in takers.items() if actor in found}
            if len(accepted) == len(counts):
                shares.append((actor, reports))
            elif accepted:
                shares.append((actor, _of_kinds(reports, accepted)))
        return shares

    def _whole_to(
        self, takers: list[PusherActor], piece: Batch, count: int
    ) -> list[tuple[PusherActor, Batch]]:
        if not takers:
            self.ledger.unrequested += count
        shares: list[tuple[PusherActor, Batch]] = []
        reports: list[Report] | None = None
        for actor in takers:
            if actor.pusher.takes_frames:
                shares.append((actor, piece))
            else:
                reports = expand(piece) if reports is None else reports
                shares.append((actor, reports))
        return shares

    def formula_named(self, name: str) -> FormulaActor:
        """The formula actor of stage ``name`` (``formula:node``)."""
        found = self._stages[name]
        assert isinstance(found, FormulaActor)
        return found

    def _hand_on_from(self, stage: str) -> Dispatch:
        """How a formula's output goes on: named (the naming step, if any), to the formulas
        that read it (the graph's), then to the outputs, in order."""

        async def hand_on(produced: list[Report | Frame]) -> None:
            if self.naming is not None:
                produced = self.naming(produced)
            readers = self._readers.get(stage)
            if readers:
                await self._to_readers(readers, produced)
            await self._dispatch(produced)

        return hand_on

    async def _to_readers(
        self, readers: list[FormulaActor], produced: list[Report | Frame]
    ) -> None:
        """A formula's output (or the barrier it passes on) to each formula that reads it, as
        the router would hand it: to the instance its dispatch key names."""
        barrier = barrier_of(produced)
        if barrier is not None:
            for reader in readers:
                await reader.mailbox.put([(None, barrier)])
            return
        reports = expand(produced)
        for reader in readers:
            key_of = reader.formula.dispatch_key
            pairs = [(key, report) for report in reports if (key := key_of(report)) is not None]
            if pairs:
                self.ledger.routed += len(pairs)
                await reader.mailbox.put(pairs)

    def _closes_after(self, stage: str) -> Callable[[], Awaitable[None]]:
        """What a stage does once it is done: close the mailbox of each stage it feeds (one
        closes once every producer of its edge did)."""

        async def close() -> None:
            for consumer in self.graph.consumers(stage):
                await self._stages[consumer].mailbox.close()

        return close

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

    def _on_give_up(self, reason: str) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask the pullers to stop reading; what entered is still drained and written.

        Idempotent: a signal handler, the supervisor giving up and a test may all call it, any
        number of times; the first starts the drain (and its deadline), the others do nothing.
        """
        if not self.stopping.is_set():
            logger.info("stopping: draining the pipeline")
            self.stopping.set()

    async def run(self) -> PipelineResult:
        """Run until the input ends or :meth:`stop` is called, then drain; return the result.

        Every task of the run (each actor's, the checkpoint timer, the drain) belongs to one
        task group: when ``run`` returns or raises, none is left running. In order: the saved
        state is restored, the pre-processors start, the stages start back to front, the drain
        closes them front to back; then the pre-processors stop, the last checkpoint is saved
        and the dead-letter file closed. When the run fails or is cancelled (a second signal),
        the group cancels the actors still running and waits for them, the pre-processors still
        stop, and a checkpoint being saved is cancelled: it is not a clean stop's.

        Process-wide settings (the garbage collector's, signal handlers) are left to the program
        that runs the pipeline: ``wattflow run`` tunes the collector for itself.
        """
        logger.debug("%s stages: %s", self.label, "; ".join(self.graph.describe()))
        checkpoints = self.checkpoints
        store = checkpoints.store
        if store is not None and store.restored_by is None:
            self.restore_state(await store.load())
            for actor in self.pullers:
                if actor.puller.resumable and store.hands_back_positions:
                    actor.puller.resume_from(checkpoints.positions.get(actor.emitter.name))
        if store is None or store.restored_by is None:
            self.state_ready.set()
        for pre_processor in self.pre_processors.values():
            await pre_processor.start()
        try:
            async with task_group() as tasks:
                self.supervisor.group = tasks
                await self._run_stages(tasks)
        except BaseException:
            await checkpoints.abandon()
            raise
        finally:
            self.supervisor.group = None
            for pre_processor in self.pre_processors.values():
                await asyncio.to_thread(pre_processor.stop)
        await checkpoints.close()
        self.dead_letters.close()
        return self._result()

    async def _run_stages(self, tasks: asyncio.TaskGroup) -> None:
        """Start every stage, and the checkpoint timer, as tasks of ``tasks``; return once the
        drain is done (or, past its deadline, what still ran is cancelled)."""
        self._start_actors()
        timer = tasks.create_task(self._checkpoint_timer(), name="checkpoint timer")
        drained = tasks.create_task(self._drain(timer), name="drain")
        try:
            await self._within_deadline(drained, tasks)
        finally:
            timer.cancel()
            drained.cancel()

    def _start_actors(self) -> None:
        """Start every stage, back to front, so each consumer runs before its producers."""
        supervisor = self.supervisor
        for pusher in self.pushers:
            supervisor.start(pusher)
        for formula in self.formulas:
            supervisor.start(formula)
        supervisor.start(self.router)
        for puller in self.pullers:
            supervisor.start(puller, restart=False)

    async def _drain(self, timer: asyncio.Future[None]) -> None:
        """Wait for the inputs to end, then close each stage once its producers are done.

        A last checkpoint follows everything the inputs handed on; the formulas take their
        snapshot after their flush, so it holds their models and nothing still to report.
        """
        await self.supervisor.wait([p.name for p in self.pullers])
        timer.cancel()
        checkpoints = self.checkpoints
        if checkpoints.store is not None and all(e.at_boundary for e in checkpoints.inputs):
            await self._put_barrier(checkpoints.start(final=True))
        await self._closes_after(INPUTS)()
        await self.supervisor.wait()

    async def _within_deadline(
        self, drained: asyncio.Future[None], tasks: asyncio.TaskGroup
    ) -> None:
        """Wait for the drain; once :meth:`stop` is called, for ``drain_timeout_s`` at most.

        Past the deadline the outputs stop writing (:meth:`PusherActor.give_up`), so what is
        queued runs through to dead letters; whatever still runs :data:`DRAIN_SETTLE_S` later
        is cancelled (:meth:`_cancel_after_deadline`).
        """
        if self.drain_timeout_s is not None:
            stopped: asyncio.Future[Any] = tasks.create_task(self.stopping.wait(), name="stop")
            await asyncio.wait({drained, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not drained.done():
                await asyncio.wait({drained}, timeout=self.drain_timeout_s)
            if not drained.done():
                self._stop_writing(self.drain_timeout_s)
                await asyncio.wait({drained}, timeout=DRAIN_SETTLE_S)
            if not drained.done():
                await self._cancel_after_deadline(drained)
                return
        await drained

    def _stop_writing(self, timeout_s: float) -> None:
        reason = f"not written within the drain deadline (--drain-timeout-s {timeout_s:g})"
        logger.warning(
            "the drain has taken %g s: the outputs stop writing; what they have not written "
            "becomes dead letters",
            timeout_s,
        )
        self._past_deadline_reason = reason
        for actor in self.pushers:
            actor.give_up(reason)

    async def _cancel_after_deadline(self, drained: asyncio.Future[None]) -> None:
        """Cancel the actors still running after the deadline, and dead-letter what they held:
        batches waiting for room, in flight, or queued in their mailboxes."""
        still = sorted(self.supervisor.started() - self.supervisor.finished())
        logger.error(
            "%s still running %g s after the drain deadline: cancelling them",
            ", ".join(still),
            DRAIN_SETTLE_S,
        )
        drained.cancel()
        await self.supervisor.cancel_all()
        error = DrainDeadline(self._past_deadline_reason or "drain deadline")
        reason = str(error)
        for puller in self.pullers:
            if puller.emitter.pending:
                pending = batch_size(puller.emitter.pending)
                self.ledger.entered += pending
                self.ledger.sorted += pending
                self.dead_letters.add_all(puller.name, reason, puller.emitter.pending)
        actors: list[Actor] = [self.router, *self.formulas, *self.pushers]
        for actor in actors:
            if actor.name in still:
                await actor.on_crash(error)
        await self._dead_letter_queued(reason)

    async def _dead_letter_queued(self, reason: str) -> None:
        """Dead-letter what is still queued in every mailbox, counted where its stage counts."""
        mailbox = self.router.mailbox
        while len(mailbox):
            batch = await mailbox.get(self.queue.max_batch)
            assert batch is not None
            self.ledger.sorted += batch_size(batch)
            self.dead_letters.add_all(self.router.name, reason, batch)
        for formula in self.formulas:
            while len(formula.mailbox):
                pairs = await formula.mailbox.get(self.queue.max_batch)
                assert pairs is not None
                reports = expand([report for _, report in pairs])
                self.ledger.dead_in += len(reports)
                self.dead_letters.add_all(formula.name, reason, reports)
        for pusher in self.pushers:
            while len(pusher.mailbox):
                batch = await pusher.mailbox.get(self.queue.max_batch)
                assert batch is not None
                self.ledger.dead_out += batch_size(batch)
                self.dead_letters.add_all(pusher.name, reason, batch)

    def _result(self) -> PipelineResult:
        supervisor = self.supervisor
        past_deadline = 0
        if self._past_deadline_reason is not None:
            past_deadline = sum(
                count
                for key, count in self.dead_letters.by_reason.items()
                if key.endswith(self._past_deadline_reason)
            )
        result = PipelineResult(
            self.ledger,
            dict(supervisor.failures),
            dict(supervisor.restarts),
            past_deadline=past_deadline,
            deadline_passed=self._past_deadline_reason is not None,
        )
        logger.info("%s drained: %s", self.label, self.ledger.summary())
        if not self.ledger.balanced():
            logger.error("ledger does not balance: %s", self.ledger)
        return result


def _of_kinds(reports: list[Report], kinds: set[str]) -> list[Report]:
    return [report for report in reports if report.kind in kinds]
