"""The batch: what moves from stage to stage, and the one place that asks how it is held.

A batch is reports, or a frame standing for many (:mod:`wattflow.formats.frames`; a frame travels
alone in its batch). Inputs emit batches, mailboxes carry them, the router splits them, the
formulas take them and the outputs write them. Which of the two a batch holds is the columnar
fast path's business: the stages ask this module what they need of a batch (its size, its
reports, its share of sensors, its hwpc-sensor frame …) and never test for themselves, so a new
representation, or a stage, changes one module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.reports import HWPCReport, Report

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


def holds_frame(batch: Sequence[Any]) -> bool:
    """Whether a batch is a frame travelling alone (see :func:`batch_size`)."""
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


# --- the formulas' side ---------------------------------------------------------------------

T = TypeVar("T")


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
