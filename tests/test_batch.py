"""The batch's operations (``formats/batch.py``): what every stage relies on, whatever a batch
holds. Batches are drawn at random (seeded) from hwpc-sensor's reports and frames of several
sensors, SmartWatts-like PowerFrames and other reports, and each operation is held to what it
must keep: every report once, in order, each frame alone, the sensors taken and no others."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from wattflow.formats import powerapi
from wattflow.formats.batch import (
    Batch,
    batch_size,
    expand,
    fill,
    hwpc_frame,
    kinds_in,
    pieces,
    reports_left,
    sensors_share,
    with_labels,
)
from wattflow.formats.frames import Column, Frame, HWPCFrame, PowerFrame
from wattflow.formats.reports import GPUDevice, GPUReport, HWPCReport, PowerReport, Report

START = datetime(2026, 5, 1, tzinfo=UTC)
SENSORS = ("node-1", "node-2", "node-3")
GROUPS = {
    "core": {
        "0": {"0": {"CPU_CLK_THREAD_UNHALTED:REF_P": 100, "time_enabled": 5, "time_running": 5}}
    }
}
DRAWS = 200


def hwpc(second: int, sensor: str, target: str) -> HWPCReport:
    stamp = START + timedelta(seconds=second)
    return HWPCReport.trusted(timestamp=stamp, sensor=sensor, target=target, groups=GROUPS)


def hwpc_frame_of(draw: random.Random) -> HWPCFrame:
    """hwpc-sensor's frame of one to three sensors, a few ticks each."""
    sensors = draw.sample(SENSORS, draw.randint(1, 3))
    reports = [
        hwpc(second, sensor, target)
        for second in range(draw.randint(1, 3))
        for sensor in sensors
        for target in ("all", *(f"c{n}" for n in range(draw.randint(0, 3))))
    ]
    frame, left = HWPCFrame.from_reports(reports)
    assert not left
    return frame


def power_frame_of(draw: random.Random) -> PowerFrame:
    """A formula's PowerFrame of one sensor: two targets over a few ticks."""
    rows = 2 * draw.randint(1, 3)
    return PowerFrame(
        sensor=draw.choice(SENSORS),
        millis=np.repeat(np.arange(rows // 2, dtype=np.int64) * 1000, 2) + 1_000_000,
        targets=np.tile(np.array([0, 1], dtype=np.int64), rows // 2),
        target_names=["/kubepods/a", "/system.slice/b"],
        power=np.arange(rows, dtype=np.float64) + 0.5,
        metadata={"scope": Column(np.zeros(rows, dtype=np.int64), ["cpu"]), "ratio": np.ones(rows)},
    )


def some_report(draw: random.Random) -> Report:
    sensor, second = draw.choice(SENSORS), draw.randint(0, 9)
    stamp = START + timedelta(seconds=second)
    pick = draw.randrange(3)
    if pick == 0:
        return hwpc(second, sensor, draw.choice(("all", "c0", "c1")))
    if pick == 1:
        return PowerReport(timestamp=stamp, sensor=sensor, target="/kubepods/a", power=1.5)
    devices = {"0": GPUDevice(total_energy=float(second))}
    return GPUReport(timestamp=stamp, sensor=sensor, target="all", devices=devices)


def batches(seed: int) -> Iterator[Batch]:
    """Batches as stages hand them on: a frame alone, reports, and (a formula's output, the
    frames an output takes in one write) frames among reports."""
    draw = random.Random(seed)
    for _ in range(DRAWS):
        shape = draw.randrange(4)
        if shape == 0:
            yield [hwpc_frame_of(draw)]
        elif shape == 1:
            yield [power_frame_of(draw)]
        elif shape == 2:
            yield [some_report(draw) for _ in range(draw.randint(1, 8))]
        else:
            yield [
                draw.choice((power_frame_of, hwpc_frame_of, some_report))(draw)
                for _ in range(draw.randint(1, 6))
            ]


def texts(reports: list[Report]) -> list[str]:
    """Reports as comparable values: their PowerAPI JSON."""
    return [powerapi.encode_json(report) for report in reports]


@pytest.mark.parametrize("seed", [1, 2])
def test_pieces_keep_every_report_in_order_each_frame_alone(seed: int) -> None:
    for batch in batches(seed):
        found = pieces(batch)
        assert texts([r for piece in found for r in expand(piece)]) == texts(expand(batch))
        for piece in found:
            frames = [item for item in piece if isinstance(item, Frame)]
            assert piece
            assert frames == [] or (len(piece) == 1 and frames == list(piece))
        counts = kinds_in(expand(batch))
        assert sum(counts.values()) == len(expand(batch))
        for piece in found:
            assert sum(kinds_in(piece).values()) == batch_size(piece)


@pytest.mark.parametrize("seed", [3, 4])
def test_a_share_of_sensors_and_the_reports_left_make_the_batch_once(seed: int) -> None:
    draw = random.Random(seed)
    for batch in batches(seed):
        if len(batch) > 1 and any(isinstance(item, Frame) for item in batch):
            with pytest.raises(TypeError):
                sensors_share(batch, lambda sensor: True)
            continue
        taken = set(draw.sample(SENSORS, draw.randint(0, 3)))
        kept, left = sensors_share(batch, taken.__contains__)
        kept_reports = [r for part in kept for r in expand(part)]
        others = reports_left(batch, taken.__contains__)
        assert all(r.sensor in taken for r in kept_reports)
        assert all(r.sensor not in taken for r in others)
        assert left == len(others)
        assert sorted(texts(kept_reports) + texts(others)) == sorted(texts(expand(batch)))
        for part in kept:
            frames = [item for item in part if isinstance(item, Frame)]
            assert frames == [] or len(part) == 1  # a frame cut per sensor still goes alone


@pytest.mark.parametrize("seed", [5, 6])
def test_fill_hands_on_every_item_in_order_frames_alone_reports_by_size(seed: int) -> None:
    draw = random.Random(seed)
    for batch in batches(seed):
        items = [*batch, *(some_report(draw) for _ in range(draw.randint(0, 9)))]
        draw.shuffle(items)
        size = draw.randint(1, 4)
        queue: list[Report] = []
        due = [ready for falling in fill(queue, items, size) for ready in falling]
        handed = [*due, queue]
        assert [item for ready in handed for item in ready] == items
        for ready in due:
            frames = [item for item in ready if isinstance(item, Frame)]
            assert (len(ready) == 1 and frames) or (not frames and len(ready) <= size)


def test_the_hwpc_frame_of_a_batch_is_the_frame_itself_or_made_of_its_hwpc_reports() -> None:
    draw = random.Random(7)
    frame = hwpc_frame_of(draw)
    assert hwpc_frame([frame], lambda reports: None) is frame
    made: list[list[Report]] = []
    others: list[Report] = []

    def of_reports(reports: list[Report]) -> HWPCFrame | None:
        made.append(reports)
        return HWPCFrame.from_reports([r for r in reports if isinstance(r, HWPCReport)])[0]

    assert hwpc_frame([frame], of_reports, as_it_is=lambda frame: False) is not frame
    assert texts(made.pop()) == texts(frame.reports()), "a frame it does not take: its reports"
    mixed = [some_report(draw) for _ in range(40)]
    rebuilt = hwpc_frame(mixed, of_reports, others=others.append)
    assert texts(made.pop()) == texts([r for r in mixed if isinstance(r, HWPCReport)])
    assert texts(others) == texts([r for r in mixed if not isinstance(r, HWPCReport)])
    assert rebuilt is not None
    none = [r for r in mixed if not isinstance(r, HWPCReport)]
    assert hwpc_frame(none, of_reports, others=others.append) is None
    assert not made, "no frame is made of no hwpc-sensor report"


def test_labels_go_on_power_reports_and_frame_rows_before_their_own_metadata() -> None:
    draw = random.Random(8)
    frame = power_frame_of(draw)
    assert with_labels([frame], lambda target: None)[0] is frame, "nothing named: as it was"
    labels = {"/kubepods/a": {"k8s_pod_name": "web", "ratio": "shadowed"}}
    named = with_labels([frame], labels.get)
    for before, after in zip(frame.reports(), expand(named), strict=True):
        extra = labels.get(before.target, {})
        assert after.metadata == {**extra, **before.metadata}
        assert list(after.metadata) == list({**extra, **before.metadata})
    report = PowerReport(timestamp=START, sensor="s", target="/kubepods/a", power=1.0)
    gpu = some_report(draw)
    [named_report, same] = expand(with_labels([report, gpu], labels.get))
    assert named_report.metadata == labels["/kubepods/a"]
    assert same is gpu
