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
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any, cast

from wattflow.formats.frames import FormulaFrame, Frame, PowerFrame
from wattflow.formats.reports import FormulaReport, PowerReport, Report

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
