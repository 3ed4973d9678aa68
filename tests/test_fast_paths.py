"""The fast decoders and encoders give exactly what the general ones give, bad input included."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import gc
import io
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wattflow.actors.pullers.files import split_lines
from wattflow.actors.pullers.socket import SocketPuller, SocketPullerConfig
from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.formats import powerapi
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.errors import DecodeError
from wattflow.formats.frames import Column, Frame, PowerFrame
from wattflow.formats.report_table import encode_json_lines, float_texts
from wattflow.formats.reports import (
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    to_millis,
    to_utc,
)

from .conftest import run_async

# --- JSON input -------------------------------------------------------------------------------

GROUPS = {"core": {"0": {"0": {"INSTRUCTIONS_RETIRED": 5, "time_enabled": 10}}}}

JSON_LINES: list[dict[str, Any]] = [
    {"timestamp": "2020-09-08T15:46:44.856", "sensor": "s", "target": "all", "groups": GROUPS},
    {"timestamp": 1599580004856, "sensor": "s", "target": "c", "groups": GROUPS},
    {"timestamp": "1599580004856", "sensor": "s", "target": "c", "groups": GROUPS},
    {"timestamp": 1599580004856.5, "sensor": "s", "target": "c"},
    {"timestamp": "2020-09-08T17:46:44.856+02:00", "sensor": "s", "target": "c"},
    {"timestamp": 1, "sensor": "s", "target": "t", "metadata": {"tag": [1, {"a": None}]}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": GROUPS, "_id": "extra keys"},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": {"x": 1.5}}}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": {"x": 2**70}}}}},
    # What msgspec refuses: pydantic decides, coercing or naming the field.
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": {"x": "7"}}}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": {"x": True}}}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": {"x": "a"}}}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": {"0": [1]}}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": {"g": {"0": 5}}},
    {"timestamp": 1, "sensor": "s", "target": "t", "groups": None},
    {"timestamp": 1, "sensor": "", "target": "t"},
    {"timestamp": 1, "sensor": "s"},
    {"timestamp": True, "sensor": "s", "target": "t"},
    {"timestamp": "yesterday", "sensor": "s", "target": "t"},
    {"timestamp": 10**20, "sensor": "s", "target": "t"},
    {"timestamp": None, "sensor": "s", "target": "t"},
    {"timestamp": 1, "sensor": 5, "target": "t"},
    {"timestamp": 1, "sensor": "s", "target": "t", "metadata": []},
]
RAW_LINES = ["{not json", "[1, 2]", '"text"', "", "   ", "\r", '{"timestamp": 1, "sens']


def one_at_a_time(line: str | bytes) -> Report | str:
    """What decoding a line alone gives, through pydantic only: the reference."""
    try:
        if isinstance(line, str) and not line.strip():
            return "blank"
        report = HWPCReport.model_validate_json(line)
    except Exception:
        try:
            powerapi.decode_json(HWPCReport, line, "in.jsonl", 1)
        except DecodeError as error:
            return error.problem
        raise
    return report


def leaves(report: Report) -> list[tuple[str, type]]:
    assert isinstance(report, HWPCReport)
    return [
        (event, type(value))
        for sockets in report.groups.values()
        for cpus in sockets.values()
        for events in cpus.values()
        for event, value in events.items()
    ]


@pytest.mark.parametrize("as_bytes", [False, True])
def test_json_lines_decode_as_pydantic_decodes_each_line(as_bytes: bool) -> None:
    lines: list[Any] = [json.dumps(d) for d in JSON_LINES] + RAW_LINES
    if as_bytes:
        lines = [line.encode() for line in lines]
    reports, errors = powerapi.decode_json_lines(HWPCReport, lines, "in.jsonl", 10)
    decoded = iter(reports)
    failed = iter(errors)
    for number, line in enumerate(lines, start=10):
        expected = one_at_a_time(line)
        if expected == "blank" or (isinstance(line, bytes) and not line.strip()):
            continue
        if isinstance(expected, Report):
            report = next(decoded)
            assert report == expected
            assert leaves(report) == leaves(expected)
            assert report.model_dump() == expected.model_dump()
        else:
            error, raw = next(failed)
            assert raw == line
            assert str(error) == f"in.jsonl:{number}: {expected}"
            assert str(error) == str(powerapi_error(line, number))
    assert next(decoded, None) is None
    assert next(failed, None) is None


def powerapi_error(line: str | bytes, number: int) -> DecodeError:
    with pytest.raises(DecodeError) as caught:
        powerapi.decode_json(HWPCReport, line, "in.jsonl", number)
    return caught.value


def test_other_kinds_of_json_lines_go_through_pydantic() -> None:
    good = '{"timestamp": 1, "sensor": "s", "target": "t", "power": 2.5}'
    reports, errors = powerapi.decode_json_lines(PowerReport, [good, "", '{"x": 1}'], "p", 1)
    assert reports == [PowerReport.model_validate_json(good)]
    assert [(str(e), raw) for e, raw in errors] == [
        (
            "p:3: PowerReport: missing field 'timestamp'; missing field 'sensor'; "
            "missing field 'target'; and 1 more",
            '{"x": 1}',
        )
    ]


def test_a_tick_shares_one_timestamp_object() -> None:
    first: dict[str, Any] = JSON_LINES[0]
    lines = [json.dumps({**first, "target": f"c{i}"}) for i in range(3)]
    reports, _ = powerapi.decode_json_lines(HWPCReport, lines, "in", 1)
    assert reports[0].timestamp is reports[1].timestamp is reports[2].timestamp


@pytest.mark.parametrize(
    ("data", "lines", "rest"),
    [
        (b"a\nb\nc", [b"a", b"b"], b"c"),
        (b"a\r\nb\r\n", [b"a", b"b"], b""),
        (b"a\rb\r\nc\r", [b"a", b"b"], b"c\r"),
        (b"a\r", [], b"a\r"),
        (b"\r\n", [b""], b""),
    ],
)
def test_lines_end_as_in_text_files(data: bytes, lines: list[bytes], rest: bytes) -> None:
    assert split_lines(data) == (lines, rest)
    # The whole data, the rest read as a last line at the end of the input, as a text file.
    whole = lines + (split_lines(rest + b"\n")[0] if rest else [])
    text = io.TextIOWrapper(io.BytesIO(data), newline=None).read().split("\n")
    if text[-1] == "":
        text.pop()
    assert [line.encode() for line in text] == whole


# --- CSV input --------------------------------------------------------------------------------

HEADER = "timestamp,sensor,target,socket,cpu,A,B"


def comparable(items: Any) -> tuple[list[Any], list[str]]:
    """Reports in order (frames as the reports they stand for: their documents, the type of
    every counter and the groups' order) and dead letters in order. A dead letter from a row of
    a tick that came as a frame comes after that tick's reports, not between them."""
    reports: list[Any] = []
    errors: list[str] = []
    for item in items:
        if isinstance(item, DecodeError):
            errors.append(str(item))
            continue
        for report in item.reports() if isinstance(item, Frame) else [item]:
            assert isinstance(report, HWPCReport)
            reports.append((report.model_dump(), leaves(report), list(report.groups)))
    return reports, errors


def write(path: Path, text: str, newline: str = "\n") -> Path:
    path.write_bytes(text.replace("\n", newline).encode())
    return path


ROWS = "1000,s,all,0,0,1,2\n1000,s,all,0,1,3,4\n1000,s,c,1,2,5,6\n2000,s,all,0,0,7,8\n"

CSV_CASES = {
    "plain": f"{HEADER}\n{ROWS}",
    "no final newline": f"{HEADER}\n1000,s,all,0,0,1,2\n2000,s,all,0,0,7,8",
    "empty cells": f"{HEADER}\n1000,s,all,0,0,1,\n1000,,all,0,0,1,2\n2000,s,all,0,0,1,2\n",
    "bad numbers": f"{HEADER}\n1000,s,all,0,0,1,abc\n1000,s,all,0,1,+5,1.5\n"
    "1000,s,all,0,2,1e3,-0\n",
    "big and odd numbers": f"{HEADER}\n1000,s,all,0,0,{2**70},007\n1000,s,all,0,1, 5,6 \n",
    "widths": f"{HEADER}\n1000,s,all,0,0,1\n1000,s,all,0,0,1,2,3\n\n1000,s,all,0,1,1,2\n",
    "iso timestamps": f"{HEADER}\n2020-01-01T00:00:00.001,s,all,0,0,1,2\n"
    "1577836800001,s,all,0,1,3,4\n",
    "bad timestamps": f"{HEADER}\nsoon,s,all,0,0,1,2\n{10**20},s,all,0,0,1,2\n3000,s,all,0,0,1,2\n",
    "quoted": f'{HEADER}\n1000,"s,1",all,0,0,1,2\n1000,"s\n2",all,0,0,"3",4\n2000,s,all,0,0,1,2\n',
    "brackets": f"{HEADER}\n1000,s[1],all,0,0,1,2\n1000,s,all,0,0,1],[2\n",
    "duplicate cpus": f"{HEADER}\n1000,s,all,0,0,1,2\n1000,s,c,0,0,1,2\n1000,s,all,0,0,3,4\n",
    "unsorted": f"{HEADER}\n2000,s,all,0,0,1,2\n1000,s,all,0,0,3,4\n2000,s,all,0,1,5,6\n",
    "lone cr": f"{HEADER}\n1000,s,all,0,0,1,2\r1000,s,all,0,1,1,2\n",
}


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("case", sorted(CSV_CASES))
def test_csv_fast_way_reads_as_the_row_by_row_way(case: str, newline: str, tmp_path: Path) -> None:
    path = write(tmp_path / "core.csv", CSV_CASES[case], newline)
    expected = comparable(powerapi.read_hwpc_csv([path]))
    # Chunks that cut ticks, rows and \r\n pairs in two.
    for size in (7, 40, 64, 1 << 21):
        assert comparable(read_hwpc_csv_frames([path], size)) == expected, size


def test_csv_errors_keep_their_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path / "core.csv", CSV_CASES["empty cells"], "\r\n")
    errors = [str(i) for i in powerapi.read_hwpc_csv([path]) if isinstance(i, DecodeError)]
    assert errors == [f"{path}:2: empty value for 'B'", f"{path}:3: empty value for 'sensor'"]


def generated_files(directory: Path) -> list[Path]:
    """Three groups, sensors and targets interleaved as hwpc-sensor writes them."""
    groups = {"rapl": ["RAPL_ENERGY_PKG"], "msr": ["APERF", "MPERF"], "core": ["X", "Y", "Z"]}
    paths = []
    for index, (group, events) in enumerate(groups.items()):
        rows = [",".join(["timestamp", "sensor", "target", "socket", "cpu", *events])]
        for tick in range(40):
            for sensor in ("n1", "n2"):
                targets = ["all"] if group != "core" else ["all", "c1", "c2"]
                for target in targets:
                    for socket_id in ("0", "1"):
                        for cpu in range(2):
                            values = [str(tick * 7 + cpu + i + index) for i in range(len(events))]
                            row = [str(1000 * tick), sensor, target, socket_id, str(cpu), *values]
                            rows.append(",".join(row))
        paths.append(write(directory / f"{group}.csv", "\n".join(rows) + "\n"))
    return paths


def test_csv_groups_merge_as_row_by_row(tmp_path: Path) -> None:
    paths = generated_files(tmp_path)
    (tmp_path / "again").mkdir()
    again = write(tmp_path / "again" / "core.csv", (tmp_path / "core.csv").read_text())
    for files in (paths, paths[::-1], [*paths, again]):
        expected = comparable(powerapi.read_hwpc_csv(files))
        assert len(expected[0]) == 40 * (2 + 2 * 2)
        assert not expected[1]
        for size in (1 << 20, 333, 4096):
            assert comparable(read_hwpc_csv_frames(files, size)) == expected, size


def test_csv_reports_of_a_tick_share_one_timestamp(tmp_path: Path) -> None:
    reports = list(powerapi.read_hwpc_csv(generated_files(tmp_path)))
    assert isinstance(reports[0], HWPCReport)
    assert isinstance(reports[1], HWPCReport)
    assert reports[0].timestamp is reports[1].timestamp


# --- Outputs ----------------------------------------------------------------------------------


def power(target: str = "t", watts: float = 19.25, **metadata: Any) -> PowerReport:
    return PowerReport.trusted(
        timestamp=to_utc(1539260665189),
        sensor="s",
        target=target,
        power=watts,
        metadata={"socket": "0", "scope": "cpu", **metadata},
    )


def test_json_lines_encode_as_one_report_at_a_time() -> None:
    stamp = datetime(2020, 1, 1, tzinfo=UTC)
    reports: list[Report] = [
        power(),
        power(target='quote " and \\ and \n', ratio=0.1, extra={1: [None, 2.5]}),
        PowerReport.trusted(
            timestamp=stamp + timedelta(microseconds=5),
            sensor="s",
            target="t",
            power=1,
            metadata={},
        ),
        FormulaReport.trusted(timestamp=stamp, sensor="s", target="f", metadata={"coef": [1.0]}),
        HWPCReport.trusted(timestamp=stamp, sensor="s", target="all", groups=GROUPS),
    ]
    expected = b"".join(powerapi.encode_json(r).encode() + b"\n" for r in reports)
    assert encode_json_lines(reports) == expected
    assert encode_json_lines([]) == b""


def test_json_lines_of_texts_that_hold_where_objects_meet() -> None:
    """The metadata and payloads of a batch are encoded in one call and cut where one object
    ends and the next begins: a text holding that sequence (``},{``) is encoded all the same."""
    stamp = datetime(2020, 1, 1, tzinfo=UTC)
    odd = {"a": "},{", "b": {"c": "}},{{"}}
    reports: list[Report] = [power(note="},{"), power(), power(extra=odd)]
    hwpc: list[Report] = [
        HWPCReport.trusted(timestamp=stamp, sensor="s", target=t, groups=GROUPS, metadata=m)
        for t, m in (("all", {}), ("},{", odd), ("c", {"x": 1}))
    ]
    for batch in (reports, hwpc, reports[1:2] + hwpc[:1]):
        expected = b"".join(powerapi.encode_json(r).encode() + b"\n" for r in batch)
        assert encode_json_lines(batch) == expected


def rapl_frame_with_own_metadata() -> PowerFrame:
    """A frame as the RAPL formula makes it from reports that carry metadata: each row has its
    input report's metadata besides the frame's columns."""
    return PowerFrame(
        sensor="s",
        millis=np.array([1000, 1000, 2000, 2000], dtype=np.int64),
        targets=np.zeros(4, dtype=np.int64),
        target_names=["rapl"],
        power=np.array([10.5, 2.25, 11.0, 2.5]),
        metadata={
            "scope": Column(np.array([0, 1, 0, 1], dtype=np.int64), ["cpu", "dram"]),
            "socket": Column(np.zeros(4, dtype=np.int64), ["0"]),
            "ratio": np.ones(4),
        },
        report_metadata=[{"job": "a"}, {"job": "a"}, {"job": "b", "node": "n1"}, {"job": "b"}],
    )


def test_outputs_write_a_frames_rows_with_their_own_metadata(tmp_path: Path) -> None:
    """A frame whose rows carry their input reports' metadata is written as its reports are,
    that metadata included, by the JSON Lines and the CSV output alike."""
    frame = rapl_frame_with_own_metadata()
    reports = frame.reports()
    assert reports[2].metadata["node"] == "n1"
    expected = b"".join(powerapi.encode_json(r).encode() + b"\n" for r in reports)
    assert encode_json_lines([frame]) == expected

    async def write(directory: Path, batch: list[Any]) -> list[tuple[Report, str]]:
        pusher = CsvPusher(CsvPusherConfig(type="csv", directory=directory))
        refused = await pusher.write(batch)
        await pusher.close()
        return refused

    for name, batch in (("framed", [frame]), ("reports", reports)):
        refused = run_async(write(tmp_path / name, batch))
        path = tmp_path / name / "s-rapl" / "PowerReport.csv"
        assert refused == [
            (reports[2], f"{path}: metadata ['node'] has no column in the file's header")
        ]
    written = (tmp_path / "framed" / "s-rapl" / "PowerReport.csv").read_bytes()
    assert written == (tmp_path / "reports" / "s-rapl" / "PowerReport.csv").read_bytes()
    assert (
        written.decode().splitlines()[0] == "timestamp,sensor,target,power,socket,job,ratio,scope"
    )
    assert written.decode().splitlines()[3] == "2000,s,rapl,2.5,0,b,1.0,dram"


def test_csv_output_refuses_what_lacks_a_tag(tmp_path: Path) -> None:
    """With ``--tags``, a report, or a frame's row, without one of them is refused with the
    reason, in the order of the batch; the others are written."""
    reports: list[Report] = [
        power(target="a", job="x", site="p"),
        power(target="b", job="y"),
        power(target="a", site="q"),
        power(target="a", job="z", site="r"),
    ]
    pusher = CsvPusher(CsvPusherConfig(type="csv", directory=tmp_path, tags=["job", "site"]))

    async def write(batch: list[Any]) -> list[tuple[Report, str]]:
        refused = await pusher.write(batch)
        await pusher.close()
        return refused

    refused = run_async(write(reports))
    assert [(r.target, reason) for r, reason in refused] == [
        ("b", f"{tmp_path / 's-b' / 'PowerReport.csv'}: no tag 'site' in the report"),
        ("a", f"{tmp_path / 's-a' / 'PowerReport.csv'}: no tag 'job' in the report"),
    ]
    assert not (tmp_path / "s-b").exists()
    rows = (tmp_path / "s-a" / "PowerReport.csv").read_text().splitlines()
    assert [row.split(",")[5] for row in rows] == ["job", "x", "z"]
    frame = rapl_frame_with_own_metadata()
    refused = run_async(write([frame]))
    assert [r.timestamp for r, _ in refused] == [r.timestamp for r in frame.reports()]
    assert {reason.rsplit(": ", 1)[1] for _, reason in refused} == {"no tag 'site' in the report"}


def test_csv_output_writes_what_the_csv_module_writes(tmp_path: Path) -> None:
    odd = ["comma, here", 'quote " here', "line\nbreak", "cr\rhere", "plain", ""]
    reports: list[Report] = [power(target="t", formula=text, ratio=0.5) for text in odd]
    reports.append(power(target="t", formula=None, ratio=1.0))
    reports.append(power(target="x,y", formula="f", ratio=0.25))
    formula = FormulaReport.trusted(
        timestamp=to_utc(5), sensor="s", target="m", metadata={"a": 'q"uote', "b": [1, 2]}
    )
    reports.append(formula)
    assert_written_as_csv_module_writes(tmp_path, reports, files=3)


FLOATS = [0.0, -0.0, 1.0, -7.25, 0.1, 1 / 3, 1e-4, 9.999999999999999e-05, 1e-7, 123456.789]
FLOATS += [1e15, 9999999999999998.0, 1e16, 1.5e300, float("nan"), float("inf"), -float("inf")]


def test_floats_are_written_as_str_writes_them() -> None:
    rng = random.Random(7)
    values = FLOATS + [rng.uniform(-1, 1) * 10.0 ** rng.randint(-8, 18) for _ in range(5000)]
    array = np.array(values)
    assert float_texts(array) == [str(v) for v in values]
    assert float_texts(array[::3]) == [str(v) for v in values[::3]]
    assert float_texts(array[:3]) == ["0.0", "-0.0", "1.0"]


def test_csv_output_of_many_rows_and_files_writes_what_the_csv_module_writes(
    tmp_path: Path,
) -> None:
    """The column-at-a-time way: floats of every magnitude, other value types, several files
    and a file whose metadata columns differ from the others'."""
    rng = random.Random(3)
    values: list[Any] = [*FLOATS, 3, None, True, "text", np.float64(0.125), 2**70]
    reports: list[Report] = []
    for tick in range(40):
        for target in ("a", "b", "c"):
            ratio = values[(tick * 3 + len(target)) % len(values)]
            watts = rng.choice(FLOATS) if tick % 7 == 0 else rng.uniform(0, 300)
            reports.append(power(target=target, watts=watts, formula="f", ratio=ratio))
        extra = PowerReport.trusted(
            timestamp=to_utc(tick), sensor="s", target="d", power=1.5, metadata={"x": tick}
        )
        reports.append(extra)
    assert_written_as_csv_module_writes(tmp_path, reports, files=4)


def assert_written_as_csv_module_writes(tmp_path: Path, reports: list[Report], files: int) -> None:
    """One batch through the CSV output gives, byte for byte, what the csv module writes."""
    pusher = CsvPusher(CsvPusherConfig(type="csv", directory=tmp_path))

    async def scenario() -> list[tuple[Report, str]]:
        await pusher.open()
        refused = await pusher.write(reports)
        await pusher.close()
        return refused

    assert run_async(scenario()) == []
    expected: dict[Path, io.StringIO] = {}
    for report in reports:
        name = powerapi.csv_output_name(report.kind, report.metadata.get("scope"))
        path = powerapi.csv_output_path(tmp_path, report.sensor, report.target, name)
        if path not in expected:
            expected[path] = io.StringIO()
            header = powerapi.csv_output_header(report.kind, report.metadata)
            csv.writer(expected[path], lineterminator="\r\n").writerow(header)
        with path.open(newline="") as handle:
            header = next(csv.reader(handle))
        csv.writer(expected[path], lineterminator="\r\n").writerow(powerapi_row(report, header))
    assert len(expected) == files
    for path, text in expected.items():
        assert path.read_bytes() == text.getvalue().encode()


def powerapi_row(report: Report, header: list[str]) -> list[str]:
    """A report's cells under ``header`` as PowerAPI's CSV output lays them out, one report at
    a time: ``str`` of each value, empty for ``None``; a FormulaReport's metadata as JSON."""
    millis = str(to_millis(report.timestamp))
    if isinstance(report, FormulaReport):
        return [millis, report.sensor, report.target, json.dumps(report.metadata)]
    assert isinstance(report, PowerReport)
    values: dict[str, Any] = {**report.metadata, "power": report.power}
    values.update(timestamp=millis, sensor=report.sensor, target=report.target)
    return ["" if values.get(c) is None else str(values[c]) for c in header]


# --- Socket input -----------------------------------------------------------------------------


class _Peer:
    """A connection that gives its data in the pieces given, then closes (or goes quiet)."""

    name = "socket:127.0.0.1:4000"

    def __init__(self, pieces: list[bytes], *, closes: bool = True) -> None:
        self.pieces = pieces
        self.closes = closes

    async def read(self, wait_s: float | None) -> bytes | None:
        if self.pieces:
            return self.pieces.pop(0)
        return b"" if self.closes else None

    async def readable(self, wait_s: float | None) -> bool:
        return bool(self.pieces) or self.closes


class _Emitter:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.reports: list[Report] = []
        self.rejected: list[tuple[Any, str]] = []
        self.skipped = 0

    async def emit(self, batch: list[Report]) -> None:
        self.reports.extend(batch)

    def reject(self, payload: Any, reason: str) -> None:
        self.rejected.append((payload, reason))

    def skip(self, count: int) -> None:
        self.skipped += count


def line(index: int) -> bytes:
    return json.dumps({"timestamp": index, "sensor": "s", "target": "all"}).encode()


@pytest.mark.parametrize("piece", [1, 7, 50, 10_000])
def test_socket_lines_are_read_whatever_the_chunks(piece: int) -> None:
    data = (
        b"\n".join([line(1), b"x" * 300, b"{broken", line(2), b"", b"y" * 120, line(3)])
        + b"\n"
        + line(4)
    )
    puller = SocketPuller(SocketPullerConfig(type="socket", max_line_bytes=100))
    emitter = _Emitter()

    async def scenario() -> None:
        pieces = [data[start : start + piece] for start in range(0, len(data), piece)]
        await puller._read(_Peer(pieces), emitter)  # type: ignore[arg-type]
        assert puller.budget.held_bytes == 0  # every byte read was given back

    run_async(scenario())
    assert [r.timestamp for r in emitter.reports] == [to_utc(i) for i in (1, 2, 3, 4)]
    assert [reason for _, reason in emitter.rejected] == [
        "socket:127.0.0.1:4000:2: line longer than 100 bytes, skipped",
        "socket:127.0.0.1:4000:3: not valid JSON: Invalid JSON: key must be a string at line 1 "
        "column 2",
        "socket:127.0.0.1:4000:6: line longer than 100 bytes, skipped",
    ]


def test_socket_line_cut_at_shutdown_is_a_dead_letter() -> None:
    puller = SocketPuller(SocketPullerConfig(type="socket"))
    emitter = _Emitter()

    async def scenario() -> None:
        emitter.stopping.set()
        await puller._read(_Peer([line(1) + b"\n" + line(2)[:10]], closes=False), emitter)  # type: ignore[arg-type]

    run_async(scenario())
    assert [r.timestamp for r in emitter.reports] == [to_utc(1)]
    assert emitter.rejected == [
        (line(2)[:10].decode(), "socket:127.0.0.1:4000:2: connection cut at shutdown mid-line")
    ]


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for ``condition()`` (polled on the event loop) for ``timeout_s`` at most."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} in {timeout_s} s"
        await asyncio.sleep(0.01)


def test_at_a_stop_a_quiet_sensor_is_let_go_and_a_sending_one_cut_after_the_grace() -> None:
    """Real connections: at a stop, a sensor that has sent everything is read to its last line
    and closed (the half line it left is a dead letter); one that keeps sending is read for
    ``drain_grace_s`` and then cut off, so that the input ends whatever the sensors do."""
    puller = SocketPuller(SocketPullerConfig(type="socket", port=0, drain_grace_s=0.3))
    emitter = _Emitter()
    talking = threading.Event()
    talking.set()

    def talk(connection: socket.socket) -> None:
        index = 100
        with contextlib.suppress(OSError):  # cut off: the send fails
            while talking.is_set():
                connection.sendall(line(index) + b"\n")
                index += 1
                time.sleep(0.001)

    async def scenario() -> tuple[bytes, threading.Thread]:
        pulling = asyncio.create_task(puller.pull(emitter))  # type: ignore[arg-type]
        await asyncio.wait_for(puller.listening.wait(), 10)
        assert puller.bound_port is not None
        address = ("127.0.0.1", puller.bound_port)
        quiet = socket.create_connection(address)
        quiet.sendall(line(1) + b"\n" + line(2)[:10])
        talker = threading.Thread(target=talk, args=(socket.create_connection(address),))
        talker.start()

        def both_read() -> bool:
            stamps = {report.timestamp for report in emitter.reports}
            return to_utc(1) in stamps and to_utc(101) in stamps

        await _until(both_read, "reports of both sensors")
        emitter.stopping.set()
        await asyncio.wait_for(pulling, 20)
        quiet.settimeout(10)
        with quiet:
            return quiet.recv(1), talker

    try:
        closed, talker = run_async(scenario())
    finally:
        talking.clear()
    assert closed == b""  # the quiet sensor's connection was closed
    talker.join(10)
    assert not talker.is_alive(), "the sending sensor was never cut off"
    assert [
        payload
        for payload, reason in emitter.rejected
        if reason.endswith(":2: connection cut at shutdown mid-line")
    ] == [line(2)[:10].decode()]


def test_connected_sensors_that_wait_between_ticks_hold_none_of_the_budget() -> None:
    """Sensors stay connected between their ticks: once a sensor's lines are handed on, its
    connection waits for more holding no room, so that many quiet sensors cannot hold the
    budget that a busy one needs for its batch."""
    puller = SocketPuller(SocketPullerConfig(type="socket", port=0, gather_ms=5))
    emitter = _Emitter()

    async def scenario() -> int:
        pulling = asyncio.create_task(puller.pull(emitter))  # type: ignore[arg-type]
        await asyncio.wait_for(puller.listening.wait(), 10)
        assert puller.bound_port is not None
        sensors = [socket.create_connection(("127.0.0.1", puller.bound_port)) for _ in range(5)]
        for number, sensor in enumerate(sensors):
            sensor.sendall(line(number) + b"\n")
        await _until(lambda: len(emitter.reports) == len(sensors), "the sensors' reports")
        await _until(lambda: puller.budget.held_bytes == 0, "the budget given back")
        connected = len(puller._connections)
        emitter.stopping.set()
        await asyncio.wait_for(pulling, 20)
        for sensor in sensors:
            sensor.close()
        return connected

    assert run_async(scenario()) == 5  # still connected, and holding nothing
    assert puller.budget.held_bytes == 0


class _TimedEmitter(_Emitter):
    """Notes when each report was handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[datetime, float] = {}

    async def emit(self, batch: list[Report]) -> None:
        await super().emit(batch)
        for report in batch:
            self.at[report.timestamp] = time.monotonic()


def test_a_quiet_sensors_tick_goes_on_with_the_next_gathering_that_ends() -> None:
    """Live sensors' ticks that came close together are handed on together: when one
    connection's gathering ends, another whose lines have waited a quarter of ``gather_ms``
    with nothing more coming goes on with it, before its own gathering would end; one whose
    data is still coming keeps gathering."""
    gather_s = 0.8
    puller = SocketPuller(SocketPullerConfig(type="socket", port=0, gather_ms=gather_s * 1000))
    emitter = _TimedEmitter()

    async def scenario() -> tuple[float, float, float]:
        pulling = asyncio.create_task(puller.pull(emitter))  # type: ignore[arg-type]
        await asyncio.wait_for(puller.listening.wait(), 10)
        assert puller.bound_port is not None
        address = ("127.0.0.1", puller.bound_port)
        first, second, third = (socket.create_connection(address) for _ in range(3))
        first.sendall(line(1) + b"\n")
        await asyncio.sleep(gather_s / 2)
        second.sendall(line(2) + b"\n")
        await asyncio.sleep(gather_s / 2 - 0.05)
        third.sendall(line(3) + b"\n")  # 50 ms before the first one's gathering ends
        await _until(lambda: len(emitter.reports) == 3, "the sensors' reports")
        emitter.stopping.set()
        await asyncio.wait_for(pulling, 20)
        for sensor in (first, second, third):
            sensor.close()
        return tuple(emitter.at[to_utc(n)] for n in (1, 2, 3))  # type: ignore[return-value]

    first_at, second_at, third_at = run_async(scenario())
    assert second_at - first_at < gather_s / 4  # with the first, not half a gathering later
    assert third_at - first_at > gather_s / 2  # still gathering then: its own time


def test_flooding_connections_hand_their_batches_on_whole_while_the_budget_holds_few() -> None:
    """Sixteen sensors send faster than the pipeline takes, and the input may hold only a few
    batches of lines: each connection, once it is seen to be busy, waits its turn for the room
    of a whole batch and hands on full batches, instead of all of them growing a read at a time
    until the budget is spread over them and every batch goes on small."""
    max_batch, batches, sensors = 200, 6, 16
    pad = "x" * 900

    def lines_of(sensor: int) -> bytes:
        return b"".join(
            json.dumps(
                {"timestamp": i, "sensor": f"s{sensor}", "target": "all", "metadata": {"p": pad}}
            ).encode()
            + b"\n"
            for i in range(1, max_batch * batches + 1)
        )

    config = SocketPullerConfig(
        type="socket", max_batch=max_batch, max_buffered_bytes=1_500_000, gather_ms=5
    )
    puller = SocketPuller(config)

    class SlowPipeline(_Emitter):
        """Takes a batch every 2 ms: the input fills its budget and waits."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[str, list[int]] = {}

        async def emit(self, batch: list[Report]) -> None:
            await asyncio.sleep(0.002)
            self.sizes.setdefault(batch[0].sensor, []).append(len(batch))
            await super().emit(batch)

    emitter = SlowPipeline()

    async def scenario() -> None:
        peers = []
        for sensor in range(sensors):
            data = lines_of(sensor)
            peer = _Peer([data[start : start + 65536] for start in range(0, len(data), 65536)])
            peer.name = f"socket:127.0.0.1:{5000 + sensor}"
            peers.append(peer)
        await asyncio.gather(*(puller._read(peer, emitter) for peer in peers))  # type: ignore[arg-type]
        assert puller.budget.held_bytes == 0  # every byte read was given back

    run_async(scenario())
    assert puller.budget.waits > 0, "the budget never ran out: nothing was tested"
    assert puller.budget.high_water_bytes <= config.max_buffered_bytes
    assert len(emitter.reports) == sensors * max_batch * batches
    for sensor in range(sensors):
        assert [r.timestamp for r in emitter.reports if r.sensor == f"s{sensor}"] == [
            to_utc(i) for i in range(1, max_batch * batches + 1)
        ]
        sizes = emitter.sizes[f"s{sensor}"]
        assert min(sizes[1:-1]) >= max_batch, (sensor, sizes)  # the first: before it was busy


# --- Runtime ----------------------------------------------------------------------------------


def test_the_collector_settings_come_back_after_a_run() -> None:
    from wattflow.actors.pipeline import Pipeline

    before = gc.get_threshold()
    result = run_async(Pipeline([], [], []).run())
    assert result.ok
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("gpu_first", [False, True], ids=["cpu-first", "gpu-first"])
def test_csv_output_writes_a_targets_gpu_and_node_power_beside_its_cpu_power(
    tmp_path: Path, gpu_first: bool
) -> None:
    """A container on a GPU node has SmartWatts' cpu and dram reports, the GPU formula's (with a
    ``device``) and the node formula's: each family in its own file, with one header whatever
    comes first, and none refused for a column the other family's header lacks."""
    stamp = to_utc(1_772_323_200_000)
    cpu = [
        PowerReport.trusted(
            timestamp=stamp, sensor="node-1", target="web", power=watts,
            metadata={"scope": scope, "socket": "0", "formula": "f", "ratio": 0.5},
        )
        for scope, watts in (("cpu", 12.5), ("dram", 2.0))
    ]  # fmt: skip
    gpu = PowerReport.trusted(
        timestamp=stamp, sensor="node-1", target="web", power=150.0,
        metadata={"scope": "gpu", "device": "0", "formula": "gpu", "ratio": 0.75},
    )  # fmt: skip
    node = PowerReport.trusted(
        timestamp=stamp, sensor="node-1", target="web", power=164.5,
        metadata={"scope": "node", "formula": "node", "ratio": 0.4},
    )  # fmt: skip
    batch: list[Report] = [gpu, node, *cpu] if gpu_first else [*cpu, gpu, node]

    async def write() -> list[tuple[Report, str]]:
        pusher = CsvPusher(CsvPusherConfig(type="csv", name="out", directory=tmp_path))
        refused = await pusher.write(batch)
        await pusher.close()
        return refused

    assert run_async(write()) == []
    folder = tmp_path / "node-1-web"
    assert sorted(p.name for p in folder.iterdir()) == [
        "PowerReport-gpu.csv",
        "PowerReport-node.csv",
        "PowerReport.csv",
    ]

    def rows(name: str) -> list[dict[str, str]]:
        with (folder / name).open(newline="") as handle:
            return list(csv.DictReader(handle))

    assert [(r["scope"], r["power"]) for r in rows("PowerReport.csv")] == [
        ("cpu", "12.5"),
        ("dram", "2.0"),
    ]
    (gpu_row,) = rows("PowerReport-gpu.csv")
    assert (gpu_row["device"], gpu_row["power"], gpu_row["ratio"]) == ("0", "150.0", "0.75")
    (node_row,) = rows("PowerReport-node.csv")
    assert (node_row["scope"], node_row["power"]) == ("node", "164.5")
    header = (folder / "PowerReport.csv").read_text().splitlines()[0]
    assert header == "timestamp,sensor,target,power,socket,formula,ratio,scope"
