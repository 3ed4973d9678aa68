"""Recording runs from programs: a small Python API around the run store.

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
those of Keras' callbacks, so it can be mixed into one). The service fills the run with reports
(``wattflow run --run``, the ``runs`` output in :mod:`wattflow.actors.pushers.runs`),
before or after the program starts: the store merges what each writer gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from wattflow.actors.run_store import RunStore, mark, new_run, open_store, run_id
from wattflow.formats.reports import EventName
from wattflow.formats.runs import Run


class Recording:
    """A run being recorded by a program: ``mark`` adds events to it."""

    def __init__(self, store: RunStore, run: Run) -> None:
        self.store = store
        self.run = run

    def mark(self, event: EventName, data: object | None = None) -> None:
        """Record an event now. ``data`` is the event's index (an epoch or batch number, as
        the GPU measurement directory's spec has it); text that is not a whole number is
        kept as text."""
        self.run = mark(self.store, self.run, event, data)


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
    run = opened.find(identifier)
    if run is None:
        run = new_run(identifier, parameters)
    else:
        run = run.model_copy(
            update={
                "parameters": {**run.parameters, **(parameters or {})},
                "start": min(run.start, datetime.now(UTC)),
            }
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
