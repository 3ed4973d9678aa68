"""Recording runs: live from the service (``--run``), and from programs (a small Python API).

The service records a run by adding one more output, which stores every report the pipeline
carries except hwpc-sensor's raw counters (the formulas' PowerReports, and the GPU, meter and
event reports), and stretches the run's window as they come. A run created here gets the
system info of the machine recording it, the node itself. With ``--export``, it exports the
run when the run ends (:mod:`wattflow.service.run_exports`).

The service and a program may record the same run at once, in either order: each holds its own
copy of the run, so each only widens the stored window and never drops what the other stored
(the store merges parameters and system info, see :meth:`RunStore.save_run`).

Programs mark what they are doing with events, which is what the exporters turn into phases::

    from wattflow.service.recording import record

    with record("clock-limit", "bert", settings="877MHz,1065MHz", repetition=0,
                parameters={"batch": 32}) as run:
        run.mark("train_begin")
        for epoch in range(3):
            run.mark("epoch_begin", epoch)
            ...
            run.mark("epoch_end", epoch)
        run.mark("train_end")

and :class:`TrainingCallback` does the same from a training loop's hooks (its method names are
those of Keras' callbacks, so it can be mixed into one).
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats.reports import EventName, EventReport, Report, to_millis
from wattflow.formats.runs import Run
from wattflow.service.run_exports import RunExports
from wattflow.service.runs import (
    RunStore,
    StoreError,
    default_store_uri,
    open_store,
    parse_run_id,
    run_id,
)
from wattflow.service.runs_cli import event_data, system_info

NOT_RECORDED = frozenset({"HWPCReport"})
"""hwpc-sensor's per-cpu counters: large, and what the formulas turn into the power recorded."""


class RunRecorderConfig(PusherConfig):
    """The output ``--run`` adds; not chosen with ``--output``."""

    type: Literal["run-store"] = "run-store"
    run: str
    store: str | None = None
    export: list[str] = Field(default_factory=list)
    """Formats to export the run in when it ends."""
    export_dir: Path | None = None


class RunRecorder(Pusher[RunRecorderConfig]):
    """Stores the pipeline's reports in a run, widening its window to cover them."""

    config_model: ClassVar[type[PusherConfig]] = RunRecorderConfig

    def __init__(self, config: RunRecorderConfig) -> None:
        super().__init__(config)
        self.experiment, self.benchmark, self.settings, self.repetition = parse_run_id(config.run)
        self.store: RunStore | None = None
        self.run: Run | None = None
        self._provisional = False
        self.exports: RunExports | None = None
        if config.export:
            if config.export_dir is None:
                raise ValueError("export needs export_dir")
            self.exports = RunExports(
                config.run, config.store or default_store_uri(), config.export, config.export_dir
            )
        self._unexported = 0
        """Reports stored since the latest export was asked for."""
        self._asked = False

    def accepts(self, kind: str) -> bool:
        return kind not in NOT_RECORDED

    async def check(self) -> None:
        open_store(self.config.store).close()

    async def open(self) -> None:
        self.store = await asyncio.to_thread(open_store, self.config.store)
        identifier = run_id(self.experiment, self.benchmark, self.settings, self.repetition)
        now = datetime.now(UTC)
        try:
            self.run = self.store.get(identifier)
        except StoreError:  # a new run
            # Its window is now until reports come; then it is theirs, so that a recording
            # replayed through the service gets the window it was measured in, not one from
            # then until today.
            self._provisional = True
            self.run = Run(
                id=identifier,
                experiment=self.experiment,
                benchmark=self.benchmark,
                settings=self.settings,
                repetition=self.repetition,
                system=system_info(),
                start=now,
                end=now,
            )
        # Widening: a program's record() may have created the run since it was looked up.
        await asyncio.to_thread(self.store.save_run, self.run, widen=True)

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        assert self.store is not None, "open() first"
        assert self.run is not None, "open() first"
        # The mailbox hands over what is ready without waiting, so this is when the pipeline
        # finished with these reports.
        processed = datetime.now(UTC)
        await asyncio.to_thread(self.store.add_reports, self.run.id, batch, processed)
        first = min(report.timestamp for report in batch)
        last = max(report.timestamp for report in batch)
        if self._provisional:
            self._provisional = False
            await asyncio.to_thread(self._settle, first, last)
        elif first < self.run.start or last > self.run.end:
            self.run = self.run.model_copy(
                update={"start": min(first, self.run.start), "end": max(last, self.run.end)}
            )
            await asyncio.to_thread(self.store.save_run, self.run, widen=True)
        self._unexported += len(batch)
        if self.exports is not None and any(
            isinstance(report, EventReport) and report.event == "experiment_end" for report in batch
        ):
            self.exports.request()  # the run ended: export it as it now is
            self._unexported, self._asked = 0, True
        return []

    def _settle(self, first: datetime, last: datetime) -> None:
        """Give a run this recorder created the window of its first reports, unless another
        writer (a program's ``record()``) has widened the stored one since: then only widen."""
        assert self.store is not None
        assert self.run is not None
        stored = self.store.get(self.run.id)
        untouched = (to_millis(stored.start), to_millis(stored.end)) == (
            to_millis(self.run.start), to_millis(self.run.end))  # fmt: skip
        self.run = self.run.model_copy(update={"start": first, "end": last})
        self.store.save_run(self.run, widen=not untouched)
        if not untouched:
            self.run = self.run.model_copy(
                update={"start": min(first, stored.start), "end": max(last, stored.end)}
            )

    async def close(self) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None
        if self.exports is not None:
            # The service stops: the run ends here unless it ended already with nothing since.
            await self.exports.close(export=self._unexported > 0 or not self._asked)


class Recording:
    """A run being recorded by a program: ``mark`` adds events to it."""

    def __init__(self, store: RunStore, run: Run) -> None:
        self.store = store
        self.run = run

    def mark(self, event: EventName, data: object | None = None) -> None:
        """Record an event now. ``data`` is the event's index (an epoch or batch number, as
        the GPU measurement directory's spec has it); text that is not a whole number is
        kept as text."""
        now = datetime.now(UTC)
        report = EventReport(
            timestamp=now,
            sensor=platform.node(),
            target="all",
            event=event,
            data=event_data(data),
        )
        self.store.add_reports(self.run.id, [report], processed=now)
        if now > self.run.end:
            self.run = self.run.model_copy(update={"end": now})
            self.store.save_run(self.run, widen=True)


@contextmanager
def record(
    experiment: str,
    benchmark: str,
    *,
    settings: str,
    repetition: int,
    parameters: dict[str, float] | None = None,
    store: str | None = None,
) -> Iterator[Recording]:
    """Record a run around a block: ``experiment_begin`` before it, ``experiment_end`` after.

    The service (``wattflow run --run …`` with the same run and store) or an import fills the
    run with reports; the window spans at least the block. The service may start before or
    after the block: the parameters given here are kept either way.
    """
    opened = open_store(store)
    identifier = run_id(experiment, benchmark, settings, repetition)
    now = datetime.now(UTC)
    try:
        run = opened.get(identifier)
        run = run.model_copy(
            update={
                "parameters": {**run.parameters, **(parameters or {})},
                "start": min(run.start, now),
            }
        )
    except StoreError:
        run = Run(
            id=identifier,
            experiment=experiment,
            benchmark=benchmark,
            settings=settings,
            repetition=repetition,
            parameters=parameters or {},
            system=system_info(),
            start=now,
            end=now,
        )
    opened.save_run(run, widen=True)
    recording = Recording(opened, run)
    recording.mark("experiment_begin")
    try:
        yield recording
    finally:
        recording.mark("experiment_end")
        opened.close()


class TrainingCallback:
    """Marks a training loop's train, epoch and batch boundaries in a run.

    Call the hooks from any loop, or mix it into a Keras callback: the names are Keras'.
    """

    def __init__(self, recording: Recording, *, batches: bool = False) -> None:
        self.recording = recording
        self.batches = batches

    def on_train_begin(self, logs: object = None) -> None:
        self.recording.mark("train_begin")

    def on_train_end(self, logs: object = None) -> None:
        self.recording.mark("train_end")

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.recording.mark("epoch_begin", epoch)

    def on_epoch_end(self, epoch: int, logs: object = None) -> None:
        self.recording.mark("epoch_end", epoch)

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        if self.batches:
            self.recording.mark("batch_begin", batch)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if self.batches:
            self.recording.mark("batch_end", batch)
