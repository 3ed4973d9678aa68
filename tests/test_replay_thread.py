"""Replays read and parse in a thread of their own (``actors/pullers/threaded.py``).

The CSV input and the JSON Lines input replaying files run their reading and parsing in a
dedicated thread, handed to the event loop a few chunks ahead, so that a live input of the same
process (a socket) keeps its turns while a chunk is parsed. These tests run the real readers and
parsers; a wrapper around them only notes which thread runs each step, or holds a step until
the loop has shown that it runs meanwhile. They wait for conditions, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.pullers import csv as csv_input
from wattflow.actors.pullers import jsonl as jsonl_input
from wattflow.actors.pullers import meter as meter_input
from wattflow.actors.pullers.csv import CsvPuller, CsvPullerConfig
from wattflow.actors.pullers.files import INLINE_DECODE_BYTES
from wattflow.actors.pullers.jsonl import JsonlPuller, JsonlPullerConfig
from wattflow.actors.pullers.meter import LineDecoder, MeterPuller, MeterPullerConfig
from wattflow.actors.pullers.socket import SocketPuller, SocketPullerConfig
from wattflow.actors.pullers.threaded import InThread, batched
from wattflow.formats import jsonl, powerapi
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Frame, HWPCFrame
from wattflow.formats.json_frames import decode_json_batch
from wattflow.formats.reports import HWPCReport, Report

from .conftest import Collector, run_async

WAIT_S = 20.0
"""How long a test waits for a condition before it fails: never reached when all is well."""

GROUPS = {"rapl": ["RAPL_ENERGY_PKG"], "msr": ["APERF", "MPERF"], "core": ["X", "Y", "Z"]}


def recording(directory: Path, ticks: int = 600) -> list[Path]:
    """hwpc-sensor's CSV files for ``ticks`` ticks of one machine and two containers: enough
    rows for several chunks (frames) when read in small chunks."""
    paths = []
    for index, (group, events) in enumerate(GROUPS.items()):
        rows = [",".join(["timestamp", "sensor", "target", "socket", "cpu", *events])]
        targets = ["all"] if group != "core" else ["all", "c1", "c2"]
        for tick in range(ticks):
            for target in targets:
                for socket_id in ("0", "1"):
                    for cpu in range(2):
                        values = [str(tick * 7 + cpu + i + index) for i in range(len(events))]
                        rows.append(
                            ",".join([str(1000 * tick), "n1", target, socket_id, str(cpu), *values])
                        )
        path = directory / f"{group}.csv"
        path.write_text("\n".join(rows) + "\n")
        paths.append(path)
    return paths


def reports_of(items: list[Any]) -> list[Report]:
    """What a puller emitted, frames as the reports they stand for."""
    return [r for item in items for r in (item.reports() if isinstance(item, Frame) else [item])]


def hwpc_reports(paths: list[Path]) -> list[HWPCReport]:
    """The reports of hwpc-sensor's CSV files, read row by row."""
    return [item for item in powerapi.read_hwpc_csv(paths) if isinstance(item, HWPCReport)]


def threads_named(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name]


def open_paths() -> set[str]:
    """The files this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return found


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait on the loop for ``condition()``, failing after :data:`WAIT_S`."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} in {WAIT_S} s"
        await asyncio.sleep(0.01)


def waiting_for_room(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits in :class:`InThread`'s bound (its semaphore), read from its
    stack rather than guessed from time."""
    assert thread.ident is not None
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "acquire" and frame.f_back is not None:
            return frame.f_back.f_code.co_name == "_run"
        frame = frame.f_back
    return False


# --- InThread ---------------------------------------------------------------------------------


def test_items_come_in_order_from_another_thread() -> None:
    steps: list[int] = []

    def numbers() -> Iterator[int]:
        for number in range(10):
            steps.append(threading.get_ident())
            yield number

    async def scenario() -> list[int]:
        async with InThread(numbers) as items:
            return [item async for item in items]

    assert run_async(scenario()) == list(range(10))
    assert steps
    assert threading.get_ident() not in steps


def test_the_thread_stays_at_most_ahead_items_in_front_of_the_loop() -> None:
    """Back-pressure: with the loop not taking items, the thread makes ``ahead`` of them and
    waits for room; nothing is dropped."""
    made: list[int] = []

    def numbers() -> Iterator[int]:
        for number in range(50):
            made.append(number)
            yield number

    async def scenario() -> list[int]:
        async with InThread(numbers, ahead=2) as items:
            assert items.thread is not None
            taken = [await items.__anext__()]
            thread = items.thread
            for _ in range(3):
                await until(
                    lambda: len(made) >= len(taken) + 2 and waiting_for_room(thread),
                    "the thread waiting for room",
                )
                assert len(made) == len(taken) + 2
                taken.append(await items.__anext__())
            return taken + [item async for item in items]

    assert run_async(scenario()) == list(range(50))


def test_an_error_reaches_the_loop_with_its_traceback_after_the_items_before_it() -> None:
    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("row 3 is not a row")

    async def scenario() -> list[int]:
        taken: list[int] = []
        async with InThread(failing) as items:
            async for item in items:
                taken.append(item)
        return taken

    with pytest.raises(ValueError, match="row 3 is not a row") as raised:
        run_async(scenario())
    assert "failing" in [entry.name for entry in raised.traceback]


def test_an_early_stop_closes_the_generator_in_its_thread_and_ends_the_thread() -> None:
    closed_in: list[int] = []
    before = threading.active_count()

    def endless() -> Iterator[int]:
        number = 0
        try:
            while True:
                yield number
                number += 1
        finally:
            closed_in.append(threading.get_ident())

    async def scenario() -> threading.Thread:
        async with InThread(endless) as items:
            async for item in items:
                if item == 3:
                    break
        assert items.thread is not None
        return items.thread

    thread = run_async(scenario())
    assert not thread.is_alive()
    assert closed_in == [thread.ident]
    assert threading.active_count() == before


def test_a_cancelled_reader_stops_the_thread_once_its_step_is_done() -> None:
    """Cancelled while the thread is in the middle of a step, the block waits for that step,
    then the generator is closed in its thread and the thread ends."""
    in_step = threading.Event()
    finish_step = threading.Event()
    closed_in: list[int] = []

    def slow() -> Iterator[int]:
        try:
            in_step.set()
            assert finish_step.wait(WAIT_S)
            yield 1
        finally:
            closed_in.append(threading.get_ident())

    async def scenario() -> threading.Thread:
        block = InThread(slow)

        async def read() -> None:
            async with block as items:
                async for _ in items:
                    raise AssertionError("the step was cancelled before its item")

        reading = asyncio.create_task(read())
        await until(in_step.is_set, "the step")
        reading.cancel()
        await until(lambda: block._stop.is_set(), "the stop")
        finish_step.set()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert block.thread is not None
        return block.thread

    thread = run_async(scenario())
    assert not thread.is_alive()
    assert closed_in == [thread.ident]


def test_batched_hands_lists_and_closes_its_source() -> None:
    closed: list[bool] = []

    def numbers() -> Iterator[int]:
        try:
            yield from range(7)
        finally:
            closed.append(True)

    assert list(batched(numbers(), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    chunks = batched(numbers(), 3)
    assert next(chunks) == [0, 1, 2]
    chunks.close()
    assert closed == [True, True]


# --- the CSV input ----------------------------------------------------------------------------


def small_chunks(steps: list[int]) -> Callable[[list[Path]], Iterator[Any]]:
    """The real CSV reader in small chunks (several frames), noting each step's thread."""

    def read(paths: list[Path]) -> Iterator[Any]:
        for item in read_hwpc_csv_frames(paths, 4096):
            steps.append(threading.get_ident())
            yield item

    return read


def test_the_csv_input_parses_in_a_thread_and_hands_on_the_same_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = recording(tmp_path)
    steps: list[int] = []
    monkeypatch.setattr(csv_input, "read_hwpc_csv_frames", small_chunks(steps))
    collector = Collector()
    puller = CsvPuller(CsvPullerConfig(type="csv", files=paths))
    run_async(puller.pull(collector))

    expected = list(read_hwpc_csv_frames(paths, 4096))
    assert len(expected) > 3  # several chunks, several hand-offs
    frames = [item for item in collector.items if isinstance(item, HWPCFrame)]
    assert [len(frame) for frame in frames] == [
        len(frame) for frame in expected if isinstance(frame, HWPCFrame)
    ]
    assert reports_of(collector.items) == reports_of(expected)
    assert collector.rejected == []
    assert steps
    assert threading.get_ident() not in steps
    assert threads_named("csv input") == []


@pytest.mark.parametrize("model", ["paced HWPCReport", "PowerReport"])
def test_the_csv_inputs_report_by_report_ways_parse_in_a_thread(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paced replay of hwpc-sensor's files and PowerReport files go row by row, in lists
    of reports that cross to the loop together; the batches are those of before."""
    steps: list[int] = []
    real: Callable[..., Iterator[Any]]
    if model == "PowerReport":
        path = tmp_path / "PowerReport.csv"
        rows = [f"{1000 * t},n1,c{t % 3},{t * 1.5},socket,0" for t in range(2500)]
        path.write_text("timestamp,sensor,target,power,scope,socket\n" + "\n".join(rows) + "\n")
        paths, real, name = [path], powerapi.read_power_csv, "read_power_csv"
        config = CsvPullerConfig(type="csv", model="PowerReport", files=paths, max_batch=300)
        expected: list[Any] = list(real(path))
    else:
        paths, real, name = recording(tmp_path, ticks=40), powerapi.read_hwpc_csv, "read_hwpc_csv"
        config = CsvPullerConfig(type="csv", files=paths, max_batch=7, replay_speed=1e9)
        expected = list(real(paths))

    def noted(*args: Any) -> Iterator[Any]:
        for item in real(*args):
            steps.append(threading.get_ident())
            yield item

    monkeypatch.setattr(powerapi, name, noted)
    batches: list[int] = []
    collector = Collector()
    collect = collector.emit

    async def emit(batch: Any) -> None:
        batches.append(len(batch))
        await collect(batch)

    collector.emit = emit  # type: ignore[method-assign]
    run_async(CsvPuller(config).pull(collector))
    assert collector.items == expected
    assert steps
    assert threading.get_ident() not in steps
    if model == "PowerReport":  # full batches, then the rest: as a batcher makes them
        assert batches == [300] * 8 + [100]
    assert threads_named("csv input") == []


def test_a_csv_replay_stopped_early_closes_its_files_and_ends_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = recording(tmp_path)
    steps: list[int] = []
    closed_in: list[int] = []
    read = small_chunks(steps)

    def closing(paths: list[Path]) -> Iterator[Any]:
        try:
            yield from read(paths)
        finally:
            closed_in.append(threading.get_ident())

    monkeypatch.setattr(csv_input, "read_hwpc_csv_frames", closing)
    collector = Collector()
    collect = collector.emit

    async def emit(batch: Any) -> None:
        await collect(batch)
        if any(isinstance(item, Frame) for item in batch):
            collector.stopping.set()  # a stop as the first frame is handed on

    collector.emit = emit  # type: ignore[method-assign]
    before = threading.active_count()
    run_async(CsvPuller(CsvPullerConfig(type="csv", files=paths)).pull(collector))

    frames = [item for item in collector.items if isinstance(item, Frame)]
    assert len(frames) == 1
    assert reports_of(frames) == reports_of(list(read_hwpc_csv_frames(paths, 4096))[:1])
    assert len(closed_in) == 1
    assert closed_in[0] != threading.get_ident()
    assert not {str(path) for path in paths} & open_paths()
    assert threads_named("csv input") == []
    assert threading.active_count() == before


def test_csv_errors_reach_the_input_as_before(tmp_path: Path) -> None:
    """A bad row is the same dead letter, naming its file and line; a file the reader refuses
    whole raises the same error from the input."""
    paths = recording(tmp_path, ticks=30)
    text = paths[2].read_text().splitlines()
    text[40] = "x" + text[40]  # a timestamp that is not one: the rest goes row by row
    paths[2].write_text("\n".join(text) + "\n")
    expected = list(read_hwpc_csv_frames(paths))
    errors = [str(item) for item in expected if isinstance(item, DecodeError)]
    assert errors
    assert all(f"{paths[2]}:" in error for error in errors)

    collector = Collector()
    run_async(CsvPuller(CsvPullerConfig(type="csv", files=paths)).pull(collector))
    assert [reason for _, reason in collector.rejected] == errors
    assert reports_of(collector.items) == reports_of(
        [item for item in expected if not isinstance(item, DecodeError)]
    )

    paths[0].write_text("timestamp,sensor,socket,cpu,RAPL_ENERGY_PKG\n0,n1,0,0,1\n")
    with pytest.raises(DecodeError) as direct:
        list(read_hwpc_csv_frames(paths))
    with pytest.raises(DecodeError) as through_input:
        run_async(CsvPuller(CsvPullerConfig(type="csv", files=paths)).pull(Collector()))
    assert str(through_input.value) == str(direct.value)
    assert threads_named("csv input") == []


def test_a_live_socket_input_is_not_stalled_behind_a_csv_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CSV replay's step that parses its second chunk is held until a line sent to a socket
    input of the same loop has been handed on: on the loop, the step would hold the loop, and
    the line would never come (the wait would run out and the test fail)."""
    paths = recording(tmp_path)
    in_step = threading.Event()
    live_through = threading.Event()
    held: list[bool] = []

    def holding(paths: list[Path]) -> Iterator[Any]:
        for number, item in enumerate(read_hwpc_csv_frames(paths, 4096)):
            if number == 1:
                in_step.set()
                held.append(live_through.wait(WAIT_S))
            yield item

    monkeypatch.setattr(csv_input, "read_hwpc_csv_frames", holding)
    replay, live = Collector(), Collector()
    socket_input = SocketPuller(SocketPullerConfig(type="socket", port=0, gather_ms=1))
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while not live_through.is_set():
            if in_step.is_set():
                turns += 1
            await asyncio.sleep(0)

    async def scenario() -> None:
        listening = asyncio.create_task(socket_input.pull(live))
        await asyncio.wait_for(socket_input.listening.wait(), WAIT_S)
        assert socket_input.bound_port is not None
        sensor = socket.create_connection(("127.0.0.1", socket_input.bound_port))
        replaying = asyncio.create_task(
            CsvPuller(CsvPullerConfig(type="csv", files=paths)).pull(replay)
        )
        counting = asyncio.create_task(count_turns())
        await until(in_step.is_set, "the replay's second step")
        line = {"timestamp": 1234, "sensor": "live", "target": "all", "groups": {}}
        sensor.sendall(json.dumps(line).encode() + b"\n")
        await until(lambda: len(live.items) == 1, "the live sensor's report")
        live_through.set()
        await asyncio.wait_for(replaying, WAIT_S)
        await counting
        live.stopping.set()
        await asyncio.wait_for(listening, WAIT_S)
        sensor.close()

    run_async(scenario(), timeout_s=3 * WAIT_S)
    assert held == [True]  # the line went through while the replay's step was held
    assert turns > 0
    assert isinstance(live.items[0], HWPCReport)
    assert live.items[0].sensor == "live"
    assert reports_of(replay.items) == reports_of(list(read_hwpc_csv_frames(paths, 4096)))


def test_the_c_parser_reads_a_csv_chunk_without_the_interpreters_lock() -> None:
    """With threads never made to take turns (a switch interval of 100 s), the thread that
    woke the main thread keeps the interpreter's lock until it lets go of it: the main thread
    runs before the chunk is parsed only if ``parse_csv`` lets go while it reads the rows."""
    parse_csv = pytest.importorskip("wattflow.formats._hwpc_lines").parse_csv
    rows = b"".join(b"%d,node,t%d,0,%d,1,2,3\n" % (i, i % 50, i % 8) for i in range(300_000))
    started, parsed = threading.Event(), threading.Event()
    names: list[str] = []

    def parse() -> None:
        started.set()
        result = parse_csv(rows, 8)
        parsed.set()
        assert result is not None
        names.extend(result[0])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        worker = threading.Thread(target=parse)
        worker.start()
        started.wait(WAIT_S)
        parsed_first = parsed.is_set()
        worker.join(WAIT_S)
    finally:
        sys.setswitchinterval(interval)
    assert not parsed_first
    assert names == ["node", *(f"t{i}" for i in range(50))]  # by first appearance


# --- the JSON Lines input ---------------------------------------------------------------------


def test_the_json_lines_replay_decodes_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = hwpc_reports(recording(tmp_path, ticks=200))
    path = tmp_path / "hwpc.jsonl"
    lines = [powerapi.encode_json(report) for report in reports]
    lines[5] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    steps: list[int] = []

    def noted(*args: Any) -> Any:
        steps.append(threading.get_ident())
        return decode_json_batch(*args)

    monkeypatch.setattr(jsonl_input, "decode_json_batch", noted)
    collector = Collector()
    config = JsonlPullerConfig(type="jsonl", files=[path])
    run_async(JsonlPuller(config).pull(collector))

    decoded, errors = decode_json_batch(HWPCReport, path.read_bytes().splitlines(), str(path), 1)
    assert reports_of(collector.items) == reports_of(decoded)
    assert collector.rejected == [
        (raw.decode() if isinstance(raw, bytes) else raw, str(error)) for error, raw in errors
    ]
    assert [reason for _, reason in collector.rejected] == [str(errors[0][0])]
    assert f"{path}:6" in str(errors[0][0])
    assert steps
    assert threading.get_ident() not in steps
    assert threads_named("jsonl input") == []


def test_a_document_of_powerapis_file_input_is_read_in_a_thread(
    fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = fixtures / "hwpc.json"
    steps: list[int] = []
    real = jsonl.read_reports_document

    def noted(kind: type[Report], path: Path) -> Iterator[Report | DecodeError]:
        steps.append(threading.get_ident())
        yield from real(kind, path)

    monkeypatch.setattr(jsonl, "read_reports_document", noted)
    collector = Collector()
    config = JsonlPullerConfig(type="jsonl", files=[document])
    run_async(JsonlPuller(config).pull(collector))
    assert collector.items == [item for item in real(HWPCReport, document)]
    assert steps
    assert threading.get_ident() not in steps

    broken = tmp_path / "broken.json"
    broken.write_text('{"reports": [1, 2')
    with pytest.raises(DecodeError) as direct:
        list(real(HWPCReport, broken))
    with pytest.raises(DecodeError) as through_input:
        run_async(JsonlPuller(JsonlPullerConfig(type="jsonl", files=[broken])).pull(Collector()))
    assert str(through_input.value) == str(direct.value)
    assert threads_named("jsonl input") == []


def test_a_followed_files_large_chunk_is_decoded_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Following, a chunk beyond ``INLINE_DECODE_BYTES`` (a file caught up with at a start) is
    decoded in a thread; a live sensor's few lines are decoded on the loop."""
    reports = hwpc_reports(recording(tmp_path, ticks=300))
    path = tmp_path / "hwpc.jsonl"
    data = "\n".join(powerapi.encode_json(report) for report in reports) + "\n"
    assert len(data) > INLINE_DECODE_BYTES
    path.write_text(data)
    steps: list[tuple[int, int]] = []

    def noted(*args: Any) -> Any:
        steps.append((threading.get_ident(), len(args[1])))
        return decode_json_batch(*args)

    monkeypatch.setattr(jsonl_input, "decode_json_batch", noted)
    collector = Collector()
    puller = JsonlPuller(JsonlPullerConfig(type="jsonl", files=[path], follow=True))

    async def scenario() -> None:
        following = asyncio.create_task(puller.pull(collector))
        await until(lambda: len(reports_of(collector.items)) == len(reports), "the file's reports")
        with path.open("a") as handle:
            handle.write(powerapi.encode_json(reports[0]) + "\n")
        await until(
            lambda: len(reports_of(collector.items)) == len(reports) + 1, "the appended line"
        )
        collector.stopping.set()
        await asyncio.wait_for(following, WAIT_S)

    run_async(scenario())
    assert reports_of(collector.items) == [*reports, reports[0]]
    loop_thread = threading.get_ident()
    assert steps[0][0] != loop_thread  # the file's first megabyte
    assert steps[-1] == (loop_thread, 1)  # the appended line


# --- the meter input --------------------------------------------------------------------------


def test_a_meter_logs_large_chunk_is_decoded_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A meter log caught up with (more than ``INLINE_DECODE_BYTES`` read at once) is decoded in
    a thread; the readings, their batches and the dead letters are those of a decoding line by
    line."""
    path = tmp_path / "meter.csv"
    rows = ["timestamp,d0c0,d0c1", *(f"{1000 * t},{t}.5,{t * 2}" for t in range(6000))]
    rows[100] = "1234,not a reading,3"
    path.write_text("\n".join(rows) + "\n")
    assert path.stat().st_size > INLINE_DECODE_BYTES
    config = MeterPullerConfig(type="meter", files=[path], sensor="node-1", max_batch=500)
    decoder = LineDecoder(config, str(path))
    expected, reasons = [], []
    for number, row in enumerate(rows, start=1):
        try:
            reading = decoder.decode(row)
        except ValueError as error:
            reasons.append(f"{path}:{number}: {error}")
            continue
        if reading is not None:
            expected.append(reading)
    steps: list[int] = []
    real = meter_input._decode_lines

    def noted(*args: Any) -> Any:
        steps.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(meter_input, "_decode_lines", noted)
    batches: list[int] = []
    collector = Collector()
    collect = collector.emit

    async def emit(batch: Any) -> None:
        batches.append(len(batch))
        await collect(batch)

    collector.emit = emit  # type: ignore[method-assign]
    run_async(MeterPuller(config).pull(collector))
    assert collector.items == expected
    assert [reason for _, reason in collector.rejected] == reasons
    assert f"{path}:101: " in reasons[0]
    assert len(steps) == 1  # one chunk of the file
    assert threading.get_ident() not in steps
    assert batches == [500] * (len(expected) // 500) + [len(expected) % 500]  # as before
