"""Frames: the columnar way from PowerAPI's CSV input to its CSV output gives what the
report-by-report way gives, to the byte, and hands over to it for anything it cannot vouch for."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import wattflow
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.node import NodeConfig, NodeFormula
from wattflow.actors.formulas.rapl import RaplConfig, RaplFormula
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.actors.formulas.smartwatts_frames import index_reports
from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.actors.runtime import Mailbox
from wattflow.formats import csv_frames, powerapi
from wattflow.formats.batch import expand
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.frames import EventsTable, HWPCFrame, PowerFrame, canonical_rows
from wattflow.formats.reports import Report

from .parser_oracle import as_comparable, both_readers, reports_and_dead_letters

START_MS = 1_767_603_600_000
CORE_EVENTS = ("CPU_CLK_THREAD_UNHALTED:REF_P", "INSTRUCTIONS_RETIRED", "LLC_MISSES")


def write_recording(
    directory: Path,
    *,
    ticks: int = 40,
    targets: int = 4,
    sensors: tuple[str, ...] = ("node-1",),
    multiplexed: float = 0.0,
    line_end: str = "\n",
    seed: int = 7,
    target_prefix: str = "container-",
) -> list[Path]:
    """hwpc-sensor's CSV files for a node whose package power follows its counters."""
    rng = np.random.default_rng(seed)
    rapl = ["timestamp,sensor,target,socket,cpu,RAPL_ENERGY_PKG,RAPL_ENERGY_DRAM"]
    msr = ["timestamp,sensor,target,socket,cpu,APERF,MPERF,TSC"]
    core = [
        "timestamp,sensor,target,socket,cpu," + ",".join(CORE_EVENTS) + ",time_enabled,time_running"
    ]
    for tick in range(ticks):
        millis = START_MS + tick * 1000 + int(rng.integers(-3, 4))
        for sensor in sensors:
            load = 1.0 + 0.8 * np.sin(tick / 5) + (0.6 if tick > ticks // 2 else 0.0)
            watts = {0: 20.0, 1: 22.0}
            for socket in (0, 1):
                for cpu in (2 * socket, 2 * socket + 1):
                    mperf = 2_100_000_000
                    aperf = int(mperf * (0.9 + 0.3 * load))
                    msr.append(f"{millis},{sensor},all,{socket},{cpu},{aperf},{mperf},{mperf}")
                    core.append(f"{millis},{sensor},all,{socket},{cpu},1,2,3,{10**9},{10**9}")
            for number in range(targets):
                name = f"{target_prefix}{number}"
                for socket in (0, 1):
                    for cpu in (2 * socket, 2 * socket + 1):
                        cycles = int(rng.integers(1, 9) * 10**8 * load)
                        instructions = int(cycles * (0.5 + rng.random()))
                        misses = int(rng.integers(10**4, 10**6))
                        enabled = 10**9
                        running = enabled
                        if rng.random() < multiplexed:
                            running = int(enabled * (0.3 + 0.6 * rng.random()))
                        core.append(
                            f"{millis},{sensor},{name},{socket},{cpu},{cycles},{instructions},"
                            f"{misses},{enabled},{running}"
                        )
                        watts[socket] += cycles * 2e-9 + instructions * 1e-9
            for socket in (0, 1):
                pkg = int(watts[socket] * 2**32 * (1 + 0.01 * rng.random()))
                dram = int(watts[socket] / 5 * 2**32)
                rapl.append(f"{millis},{sensor},all,{socket},{2 * socket},{pkg},{dram}")
    paths = []
    for name, lines in (("rapl", rapl), ("msr", msr), ("core", core)):
        path = directory / f"{name}.csv"
        path.write_bytes((line_end.join(lines) + line_end).encode())
        paths.append(path)
    return paths


@pytest.mark.parametrize("chunk_bytes", [700, 5_000, 1 << 22])
@pytest.mark.parametrize(
    "recording",
    [
        {},
        {"line_end": "\r\n"},
        {"multiplexed": 0.3},
        {"sensors": ("node-1", "node-2")},
        {"target_prefix": "/kubepods/burstable/pod-0123456789abcdef/container-"},
    ],
    ids=["plain", "crlf", "multiplexed", "two-sensors", "long-names"],
)
def test_frames_stand_for_the_reports_the_row_reader_makes(
    tmp_path: Path, chunk_bytes: int, recording: dict[str, Any]
) -> None:
    paths = write_recording(tmp_path, **recording)
    framed, rows = both_readers(paths, chunk_bytes)
    assert all(isinstance(item, HWPCFrame) for item in framed)
    assert (
        sum(len(item) for item in framed)
        == len(rows)
        == 40 * 5 * len(recording.get("sensors", ("node-1",)))
    )
    assert as_comparable(framed) == as_comparable(rows)


def test_a_last_line_without_its_line_break_is_read(tmp_path: Path) -> None:
    paths = write_recording(tmp_path)
    core = paths[2]
    core.write_bytes(core.read_bytes().rstrip(b"\n"))
    framed, rows = both_readers(paths, 1 << 22)
    assert all(isinstance(item, HWPCFrame) for item in framed)
    assert as_comparable(framed) == as_comparable(rows)


def _replace_line(path: Path, number: int, change: Any) -> None:
    lines = path.read_text().split("\n")
    lines[number] = change(lines[number])
    path.write_text("\n".join(lines))


def _cell(index: int, value: str) -> Any:
    def change(line: str) -> str:
        cells = line.split(",")
        cells[index] = value
        return ",".join(cells)

    return change


@pytest.mark.parametrize(
    "change",
    [
        _cell(6, ""),  # an empty counter
        _cell(6, "1.5"),  # a counter that is not an integer
        _cell(6, "007"),  # a counter with leading zeros
        _cell(6, "+7"),  # a counter with a sign
        _cell(6, str(2**63)),  # a counter beyond 63 bits
        _cell(1, "n" * 1024),  # a sensor name as long as the fast way's longest
        _cell(2, '"container-1"'),  # quoting
        _cell(3, "01"),  # a socket that reads back as another text
        _cell(3, "65536"),  # a socket beyond its bound
        _cell(4, "1048576"),  # a cpu beyond its bound
        _cell(4, str(10**18)),  # a cpu wider than the fast way's records
        _cell(0, "2026-01-05T09:06:40"),  # an ISO timestamp
        _cell(0, str(START_MS - 10_000)),  # a timestamp going back
        lambda line: line + ",7",  # a cell too many
        lambda line: line + "\n",  # a blank line
        lambda line: line + "\r" + line,  # two rows apart by a lone carriage return
    ],
    ids=[
        "empty",
        "float",
        "leading-zeros",
        "plus-sign",
        "counter-huge",
        "long-sensor",
        "quoted",
        "socket-text",
        "socket-bound",
        "cpu-bound",
        "cpu-huge",
        "iso-time",
        "going-back",
        "extra",
        "blank",
        "lone-cr",
    ],
)
def test_rows_the_fast_way_cannot_vouch_for_go_the_row_by_row_way_from_there(
    tmp_path: Path, change: Any
) -> None:
    paths = write_recording(tmp_path)
    lines = paths[2].read_text().count("\n")
    _replace_line(paths[2], lines * 3 // 4, change)
    framed, rows = both_readers(paths, 5_000)
    assert isinstance(framed[0], HWPCFrame), "the rows before the bad one are framed"
    assert not isinstance(framed[-1], HWPCFrame), "the rest goes the row-by-row way"
    assert as_comparable(framed) == as_comparable(rows)


def test_without_the_c_parser_every_file_goes_the_row_by_row_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wattflow installs without its C extension where no compiler is at hand: CSV replay
    then reads every row one by one, and reads the same."""
    monkeypatch.setattr(csv_frames, "_hwpc_lines", None)
    framed, rows = both_readers(write_recording(tmp_path), 5_000)
    assert not any(isinstance(item, HWPCFrame) for item in framed)
    assert as_comparable(framed) == as_comparable(rows)


def _feed(
    formula: Formula[Any], batches: list[list[Any]]
) -> tuple[dict[str, list[Any]], int, list[str]]:
    """What a formula makes of batches: its reports by kind (the order between kinds is the
    outputs' own), the inputs it absorbed and the ones it rejected, with the reason."""
    produced: dict[str, list[Any]] = {}
    absorbed = 0
    rejected: list[str] = []
    for batch in [*batches, None]:
        out = Output()
        if batch is None:
            formula.flush(out)
        else:
            formula.process(batch, out)
        for report in expand(out.items()):
            produced.setdefault(report.kind, []).append(report.model_dump())
        absorbed += out.absorbed
        rejected.extend(f"{report.target} {reason}" for report, reason in out.rejected)
    return produced, absorbed, rejected


Fed = tuple[dict[str, list[Any]], int, list[str]]


def _by_frames_and_by_reports(
    formula: type[Formula[Any]], config: FormulaConfig, paths: list[Path], chunk_bytes: int
) -> tuple[Fed, Fed]:
    frames = [item for item in read_hwpc_csv_frames(paths, chunk_bytes)]
    assert all(isinstance(frame, HWPCFrame) for frame in frames)
    reports = expand(frames)  # type: ignore[arg-type]
    parts = [
        [part]
        for frame in frames
        for _, part in formula.frame_parts(frame) or []  # type: ignore[arg-type]
    ]
    assert parts, "the formula takes the frames"
    taken = [r for r in reports if formula.dispatch_key(r) is not None]
    batches = [taken[at : at + 97] for at in range(0, len(taken), 97)]
    return _feed(formula(config, "node-1"), parts), _feed(formula(config, "node-1"), batches)


@pytest.mark.parametrize("chunk_bytes", [3_000, 1 << 22])
@pytest.mark.parametrize("multiplexed", [0.0, 0.4])
def test_smartwatts_on_frames_gives_the_same_reports_to_the_bit(
    tmp_path: Path, chunk_bytes: int, multiplexed: float
) -> None:
    paths = write_recording(tmp_path, ticks=60, multiplexed=multiplexed)
    config = SmartWattsConfig(learn_min_samples_required=5)
    SmartWattsFormula.prepare(config)
    (framed, absorbed, rejected), expected = _by_frames_and_by_reports(
        SmartWattsFormula, config, paths, chunk_bytes
    )
    assert framed.keys() == expected[0].keys() == {"PowerReport", "FormulaReport"}
    for kind in framed:
        assert framed[kind] == expected[0][kind], kind
    assert (absorbed, rejected) == expected[1:]
    powers = [r for r in framed["PowerReport"] if r["target"] != "global"]
    assert len(powers) > 100, "the models were learned and the targets estimated"
    assert any(r["metadata"]["ratio"] > 0 for r in powers)
    assert rejected == []


@pytest.mark.parametrize(
    ("formula", "config"),
    [(RaplFormula, RaplConfig()), (NodeFormula, NodeConfig())],
    ids=["rapl", "node"],
)
def test_rapl_and_node_formulas_on_frames_match_their_reports(
    tmp_path: Path, formula: type[Formula[Any]], config: FormulaConfig
) -> None:
    paths = write_recording(tmp_path, ticks=30)
    framed, expected = _by_frames_and_by_reports(formula, config, paths, 3_000)
    assert framed == expected


def test_a_frame_with_a_bad_counter_is_estimated_report_by_report(tmp_path: Path) -> None:
    """A negative delta is a dead letter with its reason: the formula takes that frame's
    reports one by one, and the rest of the recording is estimated as before."""
    paths = write_recording(tmp_path, ticks=30)
    _replace_line(paths[2], 200, _cell(6, "-5"))
    config = SmartWattsConfig(learn_min_samples_required=5)
    framed, expected = _by_frames_and_by_reports(SmartWattsFormula, config, paths, 4_000)
    assert framed == expected
    assert any("negative counter delta -5" in reason for reason in framed[2])


def test_a_frame_counts_as_its_reports_in_a_mailbox_and_travels_alone(tmp_path: Path) -> None:
    frame = next(read_hwpc_csv_frames(write_recording(tmp_path, ticks=3), 1 << 22))
    assert isinstance(frame, HWPCFrame)
    assert len(frame) == 15

    async def scenario() -> list[list[Any]]:
        mailbox: Mailbox[Any] = Mailbox(21, "test")
        reports = frame.reports()
        await mailbox.put(reports[:4])
        await mailbox.put([frame])
        await mailbox.put(reports[4:6])
        assert len(mailbox) == 4 + 15 + 2
        blocked = asyncio.create_task(mailbox.put(reports[6:7]))
        await asyncio.sleep(0.01)
        assert not blocked.done(), "full: the frame's 15 reports count"
        taken = [await mailbox.get(100)]
        await asyncio.wait_for(blocked, 1.0)
        taken += [await mailbox.get(100), await mailbox.get(100)]
        return [batch for batch in taken if batch is not None]

    batches = asyncio.run(scenario())
    assert [len(batch) for batch in batches] == [4, 1, 3]
    assert batches[1] == [frame]


def test_the_ticks_a_formula_keeps_for_later_do_not_keep_the_whole_frame_alive(
    tmp_path: Path,
) -> None:
    """SmartWatts holds the last ticks of each frame until later ones come: that part must hold
    its own rows, not views that keep every row of the frame it was cut from in memory."""
    frame = next(read_hwpc_csv_frames(write_recording(tmp_path, ticks=3), 1 << 22))
    assert isinstance(frame, HWPCFrame)
    ticks = sorted({int(t) for table in frame.tables for t in table.millis})
    upto, later = frame.after(ticks[0])
    assert upto is not None
    assert later is not None
    assert len(upto) + len(later) == len(frame)
    assert [r.model_dump() for r in [*upto.reports(), *later.reports()]] == [
        r.model_dump() for r in frame.reports()
    ]
    for whole, part in zip(frame.tables, later.tables, strict=True):
        for column in ("millis", "sensors", "targets", "sockets", "cpus", "values"):
            assert not np.shares_memory(getattr(whole, column), getattr(part, column)), column
    _, everything = frame.after(ticks[0] - 1)
    assert everything is not None
    assert everything.tables == frame.tables  # nothing cut: nothing copied


def _power_frames(paths: list[Path]) -> list[PowerFrame]:
    config = SmartWattsConfig(learn_min_samples_required=5)
    formula = SmartWattsFormula(config, "node-1")
    frames: list[PowerFrame] = []
    for item in read_hwpc_csv_frames(paths, 3_000):
        assert isinstance(item, HWPCFrame)
        for _, part in SmartWattsFormula.frame_parts(item) or []:
            out = Output()
            formula.process([part], out)
            frames.extend(r for r in out.frames if isinstance(r, PowerFrame))
    return frames


def _write_both_ways(frames: list[PowerFrame], directory: Path, max_open_files: int) -> None:
    """Write the frames to ``directory/framed`` as frames and to ``directory/reports`` as
    their reports; neither refuses a report."""

    async def write(out: Path, as_reports: bool) -> None:
        config = CsvPusherConfig(
            type="csv", name="out", directory=out, max_open_files=max_open_files
        )
        pusher = CsvPusher(config)
        for frame in frames:
            batch: list[Report] = frame.reports() if as_reports else [frame]  # type: ignore[list-item]
            assert await pusher.write(batch) == []
        await pusher.close()

    asyncio.run(write(directory / "framed", False))
    asyncio.run(write(directory / "reports", True))


def test_the_csv_output_writes_a_frame_as_it_writes_its_reports(tmp_path: Path) -> None:
    frames = _power_frames(write_recording(tmp_path, ticks=40))
    assert frames
    _write_both_ways(frames, tmp_path, max_open_files=256)
    written = sorted(
        p.relative_to(tmp_path / "framed") for p in (tmp_path / "framed").rglob("*.csv")
    )
    assert len(written) == 5  # global and four containers
    for path in written:
        assert (tmp_path / "framed" / path).read_bytes() == (
            tmp_path / "reports" / path
        ).read_bytes()


def test_the_csv_output_writes_frames_to_more_files_than_it_keeps_open(tmp_path: Path) -> None:
    """A frame whose rows go to more files than ``max_open_files`` reopens the ones it closed;
    a file that holds the same columns in another order gets its rows in that order."""
    frames = _power_frames(write_recording(tmp_path, ticks=40))
    other_order = "timestamp,sensor,target,power,socket,scope,ratio,formula\r\n"
    for name in ("framed", "reports"):
        existing = tmp_path / name / "node-1-container-2" / "PowerReport.csv"
        existing.parent.mkdir(parents=True)
        existing.write_bytes(other_order.encode())

    _write_both_ways(frames, tmp_path, max_open_files=2)
    written = sorted((tmp_path / "framed").rglob("*.csv"))
    assert len(written) == 5
    for path in written:
        twin = tmp_path / "reports" / path.relative_to(tmp_path / "framed")
        assert path.read_bytes() == twin.read_bytes()
    reordered = (tmp_path / "framed" / "node-1-container-2" / "PowerReport.csv").read_text()
    first_row = reordered.splitlines()[1].split(",")
    assert first_row[5] in ("cpu", "dram")
    assert len(first_row[7]) == 40  # the model's hash, last as the header says


def test_the_csv_output_refuses_frame_rows_a_file_has_no_column_for(tmp_path: Path) -> None:
    frames = _power_frames(write_recording(tmp_path, ticks=40))
    existing = tmp_path / "out" / "node-1-container-1" / "PowerReport.csv"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"timestamp,sensor,target,power,socket,scope\r\n")

    async def write() -> list[tuple[Report, str]]:
        pusher = CsvPusher(CsvPusherConfig(type="csv", name="out", directory=tmp_path / "out"))
        refused = []
        for frame in frames:
            refused.extend(await pusher.write([frame]))  # type: ignore[list-item]
        await pusher.close()
        return refused

    refused = asyncio.run(write())
    assert refused
    assert {report.target for report, _ in refused} == {"container-1"}
    assert all("has no column" in reason for _, reason in refused)
    assert existing.read_bytes() == b"timestamp,sensor,target,power,socket,scope\r\n"
    assert (tmp_path / "out" / "node-1-container-2" / "PowerReport.csv").stat().st_size > 0


def test_wattflow_run_writes_the_same_files_by_frames_as_report_by_report(
    tmp_path: Path,
) -> None:
    """End to end: a replay (``--replay-speed``) reads the files row by row; without it the
    same files go through frames. Both write the same bytes, and the ledger balances."""
    paths = write_recording(tmp_path, ticks=50, multiplexed=0.2)
    files = ",".join(str(p) for p in paths)
    outputs = {}
    for name, extra in (("framed", []), ("rows", ["--replay-speed", "100000"])):
        out = tmp_path / name
        shutil.rmtree(out, ignore_errors=True)
        result = wattflow(
            "run", "--input", "csv", "--model", "HWPCReport", "--name", "in", "--files", files,
            *extra, "--output", "csv", "--model", "PowerReport", "--name", "out",
            "--directory", str(out), "--learn-min-samples-required", "5",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "entered=250 " in result.stderr
        assert "dead_in=0" in result.stderr
        outputs[name] = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.csv")}
    assert len(outputs["framed"]) == 6  # rapl, global and four containers
    assert outputs["framed"] == outputs["rows"]


MUTATIONS = (b",", b'"', b"\r", b"\n", b"\r\n", b"-", b"+", b".", b"0", b"9", b"x", b" ", b"\0",
             b"\xff", b"")  # fmt: skip
"""What a byte of a recording may become in the mutation sweep: cell and line breaks,
quoting, signs, digits, text, NUL, a byte that is not UTF-8, nothing."""


def test_any_mutated_recording_reads_the_same_both_ways_and_never_raises(tmp_path: Path) -> None:
    """A sweep of 300 recordings with one or two bytes replaced, removed or added anywhere
    after the header: the fast way (C parser, frames) and the row-by-row way give the same
    reports and the same dead letters, and no byte makes either raise (a byte that is not
    UTF-8 is a dead letter naming its line, not the end of the replay)."""
    paths = write_recording(tmp_path, ticks=6, targets=2)
    originals = [path.read_bytes() for path in paths]
    rng = np.random.default_rng(11)
    not_utf8 = 0
    for _ in range(300):
        which = int(rng.integers(len(paths)))
        data = bytearray(originals[which])
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.integers(data.index(b"\n") + 1, len(data)))
            data[at : at + int(rng.integers(0, 3))] = MUTATIONS[int(rng.integers(len(MUTATIONS)))]
        for path, original in zip(paths, originals, strict=True):
            path.write_bytes(bytes(data) if path == paths[which] else original)
        framed, rows = both_readers(paths, 700)
        assert reports_and_dead_letters(framed) == reports_and_dead_letters(rows)
        not_utf8 += any("not valid UTF-8" in str(item) for item in rows)
    assert not_utf8 >= 10, "the sweep puts bytes that are not UTF-8 in rows"


@pytest.mark.parametrize(
    "cell", [b"RAPL_ENERGY_PKG\r", b'"RAPL_ENERGY\nPKG"'], ids=["lone-cr", "quoted-line-break"]
)
def test_a_header_that_is_more_or_less_than_its_first_line_is_read_row_by_row(
    tmp_path: Path, cell: bytes
) -> None:
    """The csv module ends a header at a lone carriage return, and reads a quoted line break
    into it: the fast way, which takes the first line for the header, leaves such a file to the
    row-by-row way, and reads what it reads (it refused the first as unreadable)."""
    paths = write_recording(tmp_path, ticks=4)
    paths[0].write_bytes(paths[0].read_bytes().replace(b"RAPL_ENERGY_PKG", cell, 1))
    framed, rows = both_readers(paths, 700)
    assert not any(isinstance(item, HWPCFrame) for item in framed)
    assert as_comparable(framed) == as_comparable(rows)


def test_a_byte_that_is_not_utf8_is_a_dead_letter_and_the_replay_goes_on(tmp_path: Path) -> None:
    """One row of a recording with a byte that is not UTF-8 in a target's name: that row is a
    dead letter naming its file and line, every other row is read, and the service exits 0."""
    paths = write_recording(tmp_path, ticks=20)
    core = paths[2]
    lines = core.read_bytes().split(b"\n")
    number = next(i for i, line in enumerate(lines) if i > 40 and b"container-2" in line)
    lines[number] = lines[number].replace(b"container-2", b"container-\xff")
    core.write_bytes(b"\n".join(lines))
    letters = tmp_path / "dead.jsonl"
    result = wattflow(
        "run", "--input", "csv", "--files", ",".join(str(p) for p in paths),
        "--output", "jsonl", "--file", str(tmp_path / "power.jsonl"),
        "--dead-letters", str(letters),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    dead = [json.loads(line) for line in letters.read_text().splitlines()]
    assert [letter["reason"] for letter in dead] == [f"{core}:{number + 1}: not valid UTF-8"]
    assert "entered=100 " in result.stderr  # 20 ticks × (global + 4 containers)
    # In a header, the same byte is bad usage: nothing could be read by its columns.
    paths[0].write_bytes(paths[0].read_bytes().replace(b"RAPL_ENERGY_PKG", b"RAPL_\xffPKG", 1))
    refused = wattflow(
        "run", "--input", "csv", "--files", ",".join(str(p) for p in paths),
        "--output", "jsonl", "--file", str(tmp_path / "refused.jsonl"),
    )  # fmt: skip
    assert refused.returncode == 2
    assert f"{paths[0]}:1: the CSV header is not valid UTF-8" in refused.stderr


def _far_apart_frame() -> HWPCFrame:
    """Two ticks 2**48 ms (8,900 years) apart, 65,536 names, socket 65,535: every key made of
    milliseconds, target codes and sockets multiplied together would wrap around 64 bits and
    make the two ticks' rows collide."""
    names = [f"name-{code}" for code in range(2**16)]
    first = powerapi.FIRST_MILLIS
    millis = np.array([first, first, first + 2**48, first + 2**48], dtype=np.int64)
    table = EventsTable(
        "core",
        ("CYCLES",),
        millis,
        np.zeros(4, dtype=np.int64),
        np.array([1, 2, 1, 2], dtype=np.int64),
        np.full(4, 65_535, dtype=np.int64),
        np.zeros(4, dtype=np.int64),
        np.array([[1], [2], [3], [4]], dtype=np.int64),
    )
    return HWPCFrame(names, [table])


def test_keys_of_ticks_centuries_apart_do_not_wrap_around() -> None:
    """The frame is canonical, holds four reports, and each can be picked out alone."""
    frame = _far_apart_frame()
    assert canonical_rows(frame.tables)
    index = index_reports(frame)
    first = powerapi.FIRST_MILLIS
    assert index.millis.tolist() == [first, first, first + 2**48, first + 2**48]
    assert index.targets.tolist() == [1, 2, 1, 2]
    assert len(frame) == 4
    picked = frame.of_reports(
        np.array([first + 2**48], dtype=np.int64), np.array([1], dtype=np.int64)
    )
    assert picked.tables[0].values.tolist() == [[3]]
