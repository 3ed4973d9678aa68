"""The router: sends each report to the formulas that take its kind, keyed per instance."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Set
from operator import attrgetter

from wattflow.actors.checkpoints import barrier_of
from wattflow.actors.formulas.base import FormulaActor
from wattflow.actors.runtime import Actor, DeadLetter, DeadLetters, Ledger, Mailbox, QueueConfig
from wattflow.formats.batch import batch_size, expand, hwpc_parts
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

_kind = attrgetter("kind")


class Router(Actor):
    """Dispatches reports by kind and by each formula's dispatch key.

    A report that no enabled formula takes, of a kind no output takes as it is either, is
    counted as unused under a reason that names its kind, and logged once per kind (with the
    first such report's target): with only the RAPL formula enabled, per-container reports have
    nowhere to go, and the user should see that rather than lose them unseen. One kind and not
    each target: a node runs thousands of containers. A report of a kind the outputs take as it
    is (``passed_through``: a collector's ``--model PowerReport`` input and output) is written
    by them, so it is not unused; that no formula takes its kind is said once, at INFO.
    """

    def __init__(
        self,
        formulas: list[FormulaActor],
        *,
        queue: QueueConfig,
        ledger: Ledger,
        dead_letters: DeadLetters,
        passed_through: Set[str] = frozenset(),
    ) -> None:
        super().__init__("router")
        self.queue = queue
        self.mailbox: Mailbox[Report | Frame] = Mailbox(queue.max_reports, self.name)
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.formulas = formulas
        self.by_kind: dict[str, list[FormulaActor]] = {}
        for actor in formulas:
            for kind in actor.formula.inputs:
                self.by_kind.setdefault(kind, []).append(actor)
        self.passed_through = passed_through
        """Input kinds the outputs take as they are, besides the formulas (the pipeline's)."""
        self._told: set[str] = set()
        """Kinds whose reports no formula takes that the log has named already."""
        self._in_flight: list[Report | Frame] = []
        self.delivered = 0
        """Deliveries to formulas (a report two formulas take counts twice)."""

    async def run(self) -> None:
        while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
            barrier = barrier_of(batch)
            if barrier is not None:  # a checkpoint: on to every formula, behind what came first
                for actor in self.formulas:
                    await actor.mailbox.put([(None, barrier)])
                continue
            self._in_flight = batch
            size = batch_size(batch)
            parts = hwpc_parts(batch, self._route_frame)
            if parts is not None:
                for actor, pairs in parts.items():
                    for pair in pairs:  # a frame travels alone
                        routed = batch_size([pair])
                        self.ledger.routed += routed
                        self.delivered += routed
                        await actor.mailbox.put([pair])
            else:
                for actor, items in self._route(expand(batch)).items():
                    self.ledger.routed += len(items)
                    self.delivered += len(items)
                    await actor.mailbox.put(items)
            self.ledger.sorted += size
            self._in_flight = []

    def _route_frame(
        self, frame: HWPCFrame
    ) -> dict[FormulaActor, list[tuple[Hashable, Report | Frame]]] | None:
        """Each formula's parts of a frame, or ``None`` when the frame must go as reports.

        A frame goes whole only when every formula that takes its kind takes frames, and one of
        them takes all of its reports, so that none goes unused uncounted.
        """
        actors = self.by_kind.get(frame.kind, [])
        routes: dict[FormulaActor, list[tuple[Hashable, Report | Frame]]] = {}
        covered = False
        for actor in actors:
            parts = actor.formula.frame_parts(frame)
            if parts is None:
                return None
            covered |= sum(len(part) for _, part in parts) == len(frame)
            for key, part in parts:
                if len(part):
                    # one frame per batch: several parts are put one after another
                    routes.setdefault(actor, []).append((key, part))
        if not covered:
            return None
        return routes

    def _route(self, batch: list[Report]) -> dict[FormulaActor, list[tuple[Hashable, Report]]]:
        """Each formula's share of a batch, in arrival order, keyed by its dispatch key.

        A batch of one report kind (the usual case: an input of hwpc-sensor reports) is routed
        one formula at a time, each formula's dispatch keys computed in one pass over the batch,
        instead of one report at a time through every formula.
        """
        kinds = set(map(_kind, batch))
        if len(kinds) != 1:
            return self._route_mixed(batch)
        actors = self.by_kind.get(kinds.pop(), [])
        per_actor: dict[FormulaActor, list[tuple[Hashable, Report]]] = {}
        columns: list[list[Hashable | None]] = []
        for actor in actors:
            keys = list(map(actor.formula.dispatch_key, batch))
            items = [pair for pair in zip(keys, batch, strict=True) if pair[0] is not None]
            if items:
                per_actor[actor] = items
            columns.append(keys)
        self._count_untaken(batch, columns)
        return per_actor

    def _count_untaken(self, batch: list[Report], columns: list[list[Hashable | None]]) -> None:
        """Count the reports of a one-kind batch that no formula took: ``columns`` holds each
        formula's dispatch keys for the batch, ``None`` for a report it does not take.

        Where every formula took every report (the usual case) no row is looked at.
        """
        if not columns:
            self._unused(batch)
        elif all(None in keys for keys in columns):
            taken = [any(key is not None for key in row) for row in zip(*columns, strict=True)]
            self._unused([r for r, t in zip(batch, taken, strict=True) if not t])

    def _route_mixed(
        self, batch: list[Report]
    ) -> dict[FormulaActor, list[tuple[Hashable, Report]]]:
        per_actor: dict[FormulaActor, list[tuple[Hashable, Report]]] = {}
        unused: list[Report] = []
        for report in batch:
            taken = False
            for actor in self.by_kind.get(report.kind, ()):
                key = actor.formula.dispatch_key(report)
                if key is not None:
                    per_actor.setdefault(actor, []).append((key, report))
                    taken = True
            if not taken:
                unused.append(report)
        self._unused(unused)
        return per_actor

    def _unused(self, reports: list[Report]) -> None:
        """Count the reports no formula took, by kind; name each kind in the log once."""
        if not reports:
            return
        counts = Counter(map(_kind, reports))
        for kind, count in counts.items():
            if kind not in self.passed_through:
                self.ledger.unused[f"{kind} taken by no enabled formula nor output"] += count
        untold = counts.keys() - self._told
        for report in reports if untold else ():
            if report.kind in untold:
                untold.discard(report.kind)
                self._told.add(report.kind)
                self._tell(report)
                if not untold:
                    break

    def _tell(self, report: Report) -> None:
        """The one line that says what becomes of a kind's reports that no formula takes."""
        kind, target = report.kind, report.target
        if kind in self.passed_through:
            logger.info(
                "%ss that no enabled formula takes (the first: target %r) are written as they "
                "are by the outputs that take %ss; said once per kind",
                kind,
                target,
                kind,
            )
        else:
            logger.info(
                "%ss that no enabled formula and no output takes (the first: target %r) are "
                "counted as unused; said once per kind",
                kind,
                target,
            )

    async def on_crash(self, error: BaseException) -> None:
        for report in expand(self._in_flight):
            self.dead_letters.add(DeadLetter(self.name, f"router crashed: {error!r}", report))
        self.ledger.sorted += batch_size(self._in_flight)
        self._in_flight = []

    async def run_abandoned(self, reason: str) -> None:
        while (batch := await self.mailbox.get(self.queue.max_batch)) is not None:
            for report in expand(batch):
                self.dead_letters.add(DeadLetter(self.name, f"abandoned: {reason}", report))
            self.ledger.sorted += batch_size(batch)

    async def on_finished(self) -> None:
        for actor in self.formulas:
            await actor.mailbox.close()
