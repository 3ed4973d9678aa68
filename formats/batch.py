"""The batch: what moves from stage to stage, and the one place that asks how it is held.

A batch is reports, or a frame standing for many (:mod:`wattflow.formats.frames`; a frame travels
alone in its batch). Inputs emit batches, mailboxes carry them, the router splits them, the
formulas take them and the outputs write them. Which of the two a batch holds is the columnar
fast path's business: the stages ask this module what they need of a batch (its size, its
reports, its share of sensors, its hwpc-sensor frame …) and never test for themselves, so a new
representation, or a stage, changes one module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any, TypeVar, cast

from wattflow.formats.frames import FormulaFrame, Frame, HWPCFrame, PowerFrame
from wattflow.formats.reports import FormulaReport, HWPCReport, PowerReport, Report

Batch = Sequence[Report | Frame]
"""What moves from stage to stage: reports, or a frame standing for many (a frame travels
alone in its batch). The formulas take it (:meth:`Formula.process`), the outputs write it."""


def batch_size(batch: Sequence[Any]) -> int:
    """How many reports a batch holds: a frame travels alone and counts as its reports.

    Items are reports, frames, or ``(key, report)`` pairs as formula mailboxes hold them.
    """
    if len(batch) == 1:
        item = batch[0]
        if type(item) is tuple:
            item = item[1]
        if isinstance(item, Frame):
            return len(item)
    return len(batch)


def reports_in(batch: Sequence[Any]) -> int:
    """How many reports a batch of reports and frames holds, each frame counting as its
    reports: :func:`batch_size`, also for the frames an output takes together
    (:attr:`~wattflow.actors.pushers.base.Pusher.takes_frame_runs`)."""
    return sum(len(item) if isinstance(item, Frame) else 1 for item in batch)


def indivisible(batch: Sequence[Any]) -> bool:
    """Whether a mailbox must hand the batch on whole, neither cut nor joined to the batches
    beside it: a frame, which travels alone (reports can be cut and joined)."""
    if len(batch) != 1:
        return False
    item = batch[0]
    if type(item) is tuple:
        item = item[1]
    return isinstance(item, Frame)


def expand(batch: Batch) -> list[Report]:
    """The reports of a batch, frames replaced by the reports they stand for."""
    if not any(isinstance(item, Frame) for item in batch):
        return cast(list[Report], list(batch))  # no frame in it: reports only
    reports: list[Report] = []
    for item in batch:
        if isinstance(item, Frame):
            reports.extend(item.reports())
        else:
            reports.append(item)
    return reports


# --- the outputs' side ----------------------------------------------------------------------


def pieces(batch: Batch) -> list[Batch]:
    """A batch as the batches it joins: each frame alone, the reports between frames together
    (a formula's output, the frames an output takes in one write)."""
    if not any(isinstance(item, Frame) for item in batch):
        return [batch] if batch else []
    found: list[Batch] = []
    run: list[Report] = []
    for item in batch:
        if isinstance(item, Frame):
            if run:
                found.append(run)
                run = []
            found.append([item])
        else:
            run.append(item)
    if run:
        found.append(run)
    return found


_kind = attrgetter("kind")


def kinds_in(batch: Batch) -> Counter[str]:
    """How many reports of each kind a batch holds (a frame's under its own kind)."""
    if len(batch) == 1 and isinstance(batch[0], Frame):
        return Counter({batch[0].kind: len(batch[0])})
    return Counter(map(_kind, batch))


def power_frame(batch: Batch) -> PowerFrame | None:
    """The batch's PowerFrame when it is one: the column path of the outputs that write
    tables; ``None`` for anything else, to be taken as its reports (:func:`expand`)."""
    if len(batch) == 1 and isinstance(batch[0], PowerFrame):
        return batch[0]
    return None


def newest_ms(batch: Batch) -> int | None:
    """The timestamp, in Unix ms, of a batch's last report (a formula's newest tick)."""
    if not batch:
        return None
    item = batch[-1]
    if isinstance(item, Report):
        return int(item.timestamp.timestamp() * 1000)
    millis = getattr(item, "millis", None)
    if millis is not None and len(millis):
        return int(millis[-1])
    if isinstance(item, FormulaFrame) and item.rows:
        return int(item.rows[-1][0])
    return None


def formula_metadata(batch: Batch) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Each FormulaReport's sensor and metadata (a model's error, scope, socket …), a
    FormulaFrame's rows included, without building their reports."""
    for item in batch:
        if isinstance(item, FormulaFrame):
            keys = item.keys
            for _, _, values in item.rows:
                yield item.sensor, dict(zip(keys, values, strict=True))
        elif item.kind == FormulaReport.kind and isinstance(item, Report):
            yield item.sensor, item.metadata


Labeller = Callable[[str], Mapping[str, str] | None]
"""A target's labels (its names), or ``None`` for a target that has none."""


def with_labels(batch: Batch, labels_of: Labeller) -> list[Report | Frame]:
    """The batch with each PowerReport's target labels added to its metadata (before the
    report's own keys), a PowerFrame's rows too; everything else as it was."""
    return [_labelled(item, labels_of) for item in batch]


def _labelled(item: Report | Frame, labels_of: Labeller) -> Report | Frame:
    if isinstance(item, PowerFrame):
        return _labelled_frame(item, labels_of)
    if isinstance(item, PowerReport):
        labels = labels_of(item.target)
        if labels is None:
            return item
        return PowerReport.trusted(
            timestamp=item.timestamp,
            sensor=item.sensor,
            target=item.target,
            power=item.power,
            metadata={**labels, **item.metadata},
        )
    return item


def _labelled_frame(frame: PowerFrame, labels_of: Labeller) -> PowerFrame:
    """The frame with each labelled row's labels as its own metadata (the frame's
    ``report_metadata``, which comes before the columns); the frame itself where no row is
    labelled, so the frames of unnamed targets stay on the outputs' column path."""
    codes = frame.targets.tolist()
    by_code = {code: labels_of(frame.target_names[code]) for code in set(codes)}
    if not any(by_code.values()):
        return frame
    own = frame.report_metadata
    rows: list[dict[str, Any]] = []
    for row, code in enumerate(codes):
        labels = by_code[code]
        before = {} if own is None else own[row]
        rows.append(before if labels is None else {**labels, **before})
    return PowerFrame(
        sensor=frame.sensor,
        millis=frame.millis,
        targets=frame.targets,
        target_names=frame.target_names,
        power=frame.power,
        metadata=frame.metadata,
        report_metadata=rows,
    )


# --- the inputs' side -----------------------------------------------------------------------


def alone_and_joined(decoded: Sequence[Frame] | list[Report]) -> tuple[list[Batch], list[Report]]:
    """What a decoder made: the batches that go on alone (each frame), and the reports that go
    on together, in one batch or joined to those an input has queued."""
    if decoded and isinstance(decoded[0], Frame):
        return [[frame] for frame in cast(Sequence[Frame], decoded)], []
    return [], cast(list[Report], decoded)


def handed_on(decoded: Sequence[Frame] | list[Report]) -> list[Batch]:
    """What a decoder made, as the batches an input hands on: each frame alone, the reports
    in one (even none)."""
    alone, joined = alone_and_joined(decoded)
    return alone or [joined]


def sensors_share(batch: Batch, takes: Callable[[str], bool]) -> tuple[list[Batch], int]:
    """The share of a batch of the sensors ``takes`` accepts: the batches to hand on (a frame
    that holds others becomes one frame per sensor taken), and how many reports are left,
    none of them built."""
    if len(batch) == 1 and isinstance(batch[0], Frame):
        return _frame_share(batch[0], takes)
    reports: list[Report] = [r for r in batch if isinstance(r, Report)]
    if len(reports) != len(batch):  # frames among reports: not how pullers emit
        raise TypeError("a batch is reports, or one frame alone")
    kept = [report for report in reports if takes(report.sensor)]
    return ([kept] if kept else []), len(reports) - len(kept)


def _frame_share(frame: Frame, takes: Callable[[str], bool]) -> tuple[list[Batch], int]:
    if isinstance(frame, HWPCFrame):
        sensors = frame.sensors()
        taken = [sensor for sensor in sensors if takes(sensor)]
        if len(taken) == len(sensors):
            return [[frame]], 0
        parts = [frame.of_sensor(sensor) for sensor in taken]
        return [[part] for part in parts], len(frame) - sum(map(len, parts))
    sensor = getattr(frame, "sensor", None)
    if isinstance(sensor, str):  # frames of one sensor (PowerFrame, FormulaFrame)
        return ([[frame]], 0) if takes(sensor) else ([], len(frame))
    kept = [report for report in frame.reports() if takes(report.sensor)]
    return ([kept] if kept else []), len(frame) - len(kept)


def reports_left(batch: Batch, takes: Callable[[str], bool]) -> list[Report]:
    """The reports of a batch whose sensors ``takes`` refuses, built: an hwpc-sensor frame is
    cut per sensor first, so that only theirs are."""
    if len(batch) == 1 and isinstance(batch[0], HWPCFrame):
        frame = batch[0]
        others = [s for s in frame.sensors() if not takes(s)]
        return [r for s in others for r in frame.of_sensor(s).reports()]
    reports = batch[0].reports() if len(batch) == 1 and isinstance(batch[0], Frame) else batch
    return [r for r in reports if isinstance(r, Report) and not takes(r.sensor)]


T = TypeVar("T")


def fill(queue: list[T], items: Iterable[T | Frame], size: int) -> Iterator[list[list[T] | Batch]]:
    """Queue items after those ``queue`` holds, yielding the batches due as they fall due: the
    queue once it holds ``size``; at a frame, the queue (even empty) and the frame alone after
    it. What is left stays in ``queue``."""
    for item in items:
        if isinstance(item, Frame):
            due: list[list[T] | Batch] = [queue[:], [item]]
        else:
            queue.append(item)
            if len(queue) < size:
                continue
            due = [queue[:]]
        queue.clear()
        yield due


def any_target(batch: Batch, test: Callable[[str], bool]) -> bool:
    """Whether ``test`` accepts a target of the batch's reports: an hwpc-sensor frame answers
    from its names (its sensors' too) without building its reports; other frames are not
    asked."""
    for item in batch:
        if isinstance(item, HWPCFrame):
            if any(test(name) for name in item.names):
                return True
        elif isinstance(item, Report) and test(item.target):
            return True
    return False


# --- the formulas' side ---------------------------------------------------------------------


def hwpc_parts(batch: Sequence[Report | Frame], parts: Callable[[HWPCFrame], T | None]) -> T | None:
    """What ``parts`` makes of a batch that is hwpc-sensor's frame travelling alone (the
    formulas' shares of it, routed whole); ``None`` for any other batch: it goes as reports."""
    return parts(batch[0]) if len(batch) == 1 and isinstance(batch[0], HWPCFrame) else None


def hwpc_frame(
    batch: Batch,
    of_reports: Callable[[list[Report]], HWPCFrame | None],
    *,
    as_it_is: Callable[[HWPCFrame], bool] = lambda frame: True,
    others: Callable[[Report], object] | None = None,
) -> HWPCFrame | None:
    """A batch's hwpc-sensor reports as one frame: the frame travelling alone if ``as_it_is``
    takes it, else the one ``of_reports`` makes of the reports (dead-lettering those it cannot
    hold), after ``others``, when given, had each other report in order."""
    if len(batch) == 1 and isinstance(frame := batch[0], HWPCFrame) and as_it_is(frame):
        return frame
    reports = expand(batch)
    if others is not None:
        hwpc: list[Report] = []
        for report in reports:
            if isinstance(report, HWPCReport):
                hwpc.append(report)
            else:
                others(report)
        reports = hwpc
    return of_reports(reports) if reports else None
