"""PowerAPI 2.10 encodings, checked against PowerAPI's own recordings."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import bson
import pytest

from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.formats import jsonl, powerapi
from wattflow.formats.errors import DecodeError
from wattflow.formats.reports import (
    FormulaReport,
    HWPCReport,
    PowerReport,
    Report,
    to_millis,
    to_utc,
)

from .conftest import wattflow

JSON_FIXTURES = ["hwpc.json", "hwpc_rapl_2_socket.json"]
GOOD_CSV = [
    "rapl2.csv",
    "core2.csv",
    "pcu2.csv",
    "rapl1_miss_first.csv",
    "rapl1_miss_second.csv",
    "core1_miss_first.csv",
    "core1_miss_second.csv",
]
BAD_CSV = {
    "bad_common_miss_target.csv": "target",
    "bad_common_miss_sensor.csv": "sensor",
    "bad_common_miss_timestamp.csv": "timestamp",
}


def fixture_reports(path: Path) -> list[HWPCReport]:
    items = list(jsonl.read_reports_document(HWPCReport, path))
    assert all(isinstance(i, HWPCReport) for i in items)
    return [i for i in items if isinstance(i, HWPCReport)]


@pytest.mark.parametrize("name", JSON_FIXTURES)
def test_json_fixture_round_trips_through_json_and_mongodb(fixtures: Path, name: str) -> None:
    raw = json.loads((fixtures / name).read_text())["reports"]
    reports = fixture_reports(fixtures / name)
    assert len(reports) == len(raw)
    for report in reports:
        line = powerapi.encode_json(report)
        assert powerapi.decode_json(HWPCReport, line, "test", 1) == report
        document = powerapi.to_mongodb(report)
        assert isinstance(document["timestamp"], datetime)
        assert document["timestamp"].tzinfo is None
        assert powerapi.from_mongodb(HWPCReport, document) == report
    # Values survive exactly, whatever their JSON type was.
    by_time = {r["timestamp"]: r for r in raw}
    for report in reports:
        original = by_time[powerapi.format_timestamp(report.timestamp)]
        assert report.groups == original["groups"]
        assert report.sensor == original["sensor"]


def test_json_timestamps_are_written_as_hwpc_sensor_writes_them(fixtures: Path) -> None:
    raw = json.loads((fixtures / "hwpc.json").read_text())["reports"]
    reports = fixture_reports(fixtures / "hwpc.json")
    assert sorted(powerapi.format_timestamp(r.timestamp) for r in reports) == sorted(
        r["timestamp"] for r in raw
    )


def test_reports_document_is_replayed_in_time_order(fixtures: Path) -> None:
    reports = fixture_reports(fixtures / "hwpc.json")
    stamps = [r.timestamp for r in reports]
    assert stamps == sorted(stamps)
    assert stamps[0] == datetime(2020, 9, 8, 15, 46, 35, 826000, tzinfo=UTC)


def read_csv_table(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def hwpc_csv_rows(report: HWPCReport) -> Iterator[tuple[str, list[str], list[str]]]:
    """A report in PowerAPI's CSV input layout: ``(group, header, row)`` per socket and cpu."""
    millis = str(to_millis(report.timestamp))
    for group, sockets in report.groups.items():
        for socket, cpus in sockets.items():
            for cpu, events in cpus.items():
                header = [*powerapi.CSV_HWPC, *events]
                row = [millis, report.sensor, report.target, socket, cpu]
                yield group, header, row + [str(value) for value in events.values()]


@pytest.mark.parametrize("name", GOOD_CSV)
def test_csv_fixture_round_trips(fixtures: Path, name: str, tmp_path: Path) -> None:
    source = fixtures / "csv" / name
    reports = list(powerapi.read_hwpc_csv([source]))
    assert reports
    assert all(isinstance(r, HWPCReport) for r in reports)
    group = powerapi.csv_group_name(source)
    out = tmp_path / name
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        header_written = False
        for report in reports:
            assert isinstance(report, HWPCReport)
            for row_group, header, row in hwpc_csv_rows(report):
                assert row_group == group
                if not header_written:
                    writer.writerow(header)
                    header_written = True
                writer.writerow(row)
    assert read_csv_table(out) == read_csv_table(source)
    assert list(powerapi.read_hwpc_csv([out])) == reports


def test_csv_groups_merge_by_timestamp_and_target(fixtures: Path) -> None:
    files = [fixtures / "csv" / f for f in ("rapl2.csv", "core2.csv", "pcu2.csv")]
    reports = [r for r in powerapi.read_hwpc_csv(files) if isinstance(r, HWPCReport)]
    assert [to_utc(1539260664189), to_utc(1539260665189)] == [r.timestamp for r in reports]
    second = reports[1]
    assert second.sensor == "grvingt-12"
    assert second.target == "system"
    assert set(second.groups) == {"rapl2", "core2", "pcu2"}
    assert second.groups["rapl2"]["0"]["58"]["RAPL_ENERGY_PKG"] == 83577274368
    assert set(second.groups["core2"]["1"]) == {"49", "13"}
    assert second.groups["core2"]["0"]["56"]["INSTRUCTIONS_RETIRED"] == 351781


def test_csv_files_with_missing_ticks_merge_what_exists(fixtures: Path) -> None:
    files = [fixtures / "csv" / f for f in ("rapl1_miss_first.csv", "core1_miss_second.csv")]
    reports = [r for r in powerapi.read_hwpc_csv(files) if isinstance(r, HWPCReport)]
    assert [set(r.groups) for r in reports] == [{"core1_miss_second"}, {"rapl1_miss_first"}]


@pytest.mark.parametrize(("name", "field"), sorted(BAD_CSV.items()))
def test_bad_csv_names_file_line_and_missing_field(fixtures: Path, name: str, field: str) -> None:
    path = fixtures / "csv" / name
    with pytest.raises(DecodeError) as caught:
        list(powerapi.read_hwpc_csv([path]))
    message = str(caught.value)
    assert message.startswith(f"{path}:1: ")
    assert f"missing field '{field}'" in message
    assert "\n" not in message


def test_bad_csv_row_becomes_an_error_in_place(tmp_path: Path) -> None:
    path = tmp_path / "rapl.csv"
    path.write_text(
        "timestamp,sensor,target,socket,cpu,RAPL_ENERGY_PKG\n"
        "1000,s,all,0,0,5\n"
        "2000,s,all,0,0,\n"
        "3000,s,all,0,0,abc\n"
        "4000,s,all,0,0,7\n"
    )
    items = list(powerapi.read_hwpc_csv([path]))
    errors = [str(i) for i in items if isinstance(i, DecodeError)]
    good = [i for i in items if isinstance(i, HWPCReport)]
    assert [r.groups["rapl"]["0"]["0"]["RAPL_ENERGY_PKG"] for r in good] == [5, 7]
    assert errors == [
        f"{path}:3: empty value for 'RAPL_ENERGY_PKG'",
        f"{path}:4: counter is not a number: could not convert string to float: 'abc'",
    ]


def test_csv_rows_with_sockets_or_cpus_out_of_bounds_are_errors_in_place(tmp_path: Path) -> None:
    """Sockets from 65,536 on and cpus from 1,048,576 on (or negative ones) are refused row by
    row, naming the field; the largest numbers within bounds are read."""
    path = tmp_path / "rapl.csv"
    path.write_text(
        "timestamp,sensor,target,socket,cpu,RAPL_ENERGY_PKG\n"
        "1000,s,all,65535,1048575,5\n"
        "2000,s,all,65536,0,6\n"
        f"3000,s,all,0,{2**40},7\n"
        "4000,s,all,-1,0,8\n"
        "5000,s,all,0,0,9\n"
    )
    items = list(powerapi.read_hwpc_csv([path]))
    errors = [str(i) for i in items if isinstance(i, DecodeError)]
    good = [i for i in items if isinstance(i, HWPCReport)]
    assert [r.groups["rapl"] for r in good] == [
        {"65535": {"1048575": {"RAPL_ENERGY_PKG": 5}}},
        {"0": {"0": {"RAPL_ENERGY_PKG": 9}}},
    ]
    assert errors == [
        f"{path}:3: field 'socket': '65536' is not a socket number (0 to 65535)",
        f"{path}:4: field 'cpu': '{2**40}' is not a cpu number (0 to 1048575)",
        f"{path}:5: field 'socket': '-1' is not a socket number (0 to 65535)",
    ]


@pytest.mark.parametrize(
    "groups",
    [
        {"rapl": {str(10**18): {"0": {"e": 1}}}},
        {"rapl": {"65536": {"0": {"e": 1}}}},
        {"rapl": {"0": {str(2**63): {"e": 1}}}},
        {"rapl": {"0": {"1048576": {"e": 1}}}},
        {"rapl": {"0": {"-1": {"e": 1}}}},
        {"rapl": {"0": {"1.0": {"e": 1}}}},
        {"rapl": {"x": {"0": {"e": 1}}}},
    ],
)
def test_hwpc_reports_with_sockets_or_cpus_out_of_bounds_are_refused(
    groups: dict[str, Any],
) -> None:
    """Whichever way a report is decoded (the JSON fast way, pydantic, a MongoDB document), a
    socket or cpu key that is not a number within bounds is refused, naming the key."""
    document = {"timestamp": 1000, "sensor": "s", "target": "t", "groups": groups}
    key = next(iter(groups["rapl"]))
    bad = key if key != "0" else next(iter(groups["rapl"]["0"]))
    with pytest.raises(DecodeError) as caught:
        powerapi.decode_json(HWPCReport, json.dumps(document), "in.jsonl", 7)
    assert str(caught.value).startswith("in.jsonl:7: HWPCReport: field 'groups'")
    assert f"'{bad}'" in str(caught.value)
    reports, errors = powerapi.decode_json_lines(HWPCReport, [json.dumps(document)], "in", 1)
    assert reports == []
    assert [str(error) for error, _ in errors] == [str(caught.value).replace("in.jsonl:7", "in:1")]
    with pytest.raises(DecodeError, match=f"'{re.escape(bad)}'"):
        powerapi.from_mongodb(HWPCReport, {**document, "_id": 5})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"sensor": "s", "target": "t", "groups": {}}', "missing field 'timestamp'"),
        ('{"timestamp": 1, "target": "t", "groups": {}}', "missing field 'sensor'"),
        ('{"timestamp": 1, "sensor": "s", "groups": {}}', "missing field 'target'"),
        ('{"timestamp": "yesterday", "sensor": "s", "target": "t"}', "field 'timestamp'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a report must be a JSON object"),
    ],
)
def test_bad_json_names_source_line_and_field(line: str, expected: str) -> None:
    with pytest.raises(DecodeError) as caught:
        powerapi.decode_json(HWPCReport, line, "in.jsonl", 7)
    assert str(caught.value).startswith("in.jsonl:7: ")
    assert expected in str(caught.value)


def written_csv(directory: Path, report: Report) -> list[list[str]]:
    """The rows of the file the CSV output writes ``report`` to (header first)."""
    pusher = CsvPusher(CsvPusherConfig(type="csv", directory=directory, model=report.kind))

    async def write() -> None:
        assert await pusher.write([report]) == []
        await pusher.close()

    asyncio.run(write())
    name = powerapi.csv_output_name(report.kind, report.metadata.get("scope"))
    path = powerapi.csv_output_path(directory, report.sensor, report.target, name)
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_power_report_csv_layout_matches_powerapi(tmp_path: Path) -> None:
    report = PowerReport(
        timestamp=to_utc(1539260665189),
        sensor="grvingt-12",
        target="rapl",
        power=19.5,
        metadata={"socket": "0", "scope": "cpu", "formula": "f", "ratio": 1.0},
    )
    header, row = written_csv(tmp_path, report)
    assert header == [
        "timestamp",
        "sensor",
        "target",
        "power",
        "socket",
        "formula",
        "ratio",
        "scope",
    ]
    assert row == [
        "1539260665189",
        "grvingt-12",
        "rapl",
        "19.5",
        "0",
        "f",
        "1.0",
        "cpu",
    ]
    assert (tmp_path / "grvingt-12-rapl" / "PowerReport.csv").is_file()
    formula = FormulaReport(timestamp=to_utc(5), sensor="s", target="t", metadata={"layer": 2100})
    assert written_csv(tmp_path, formula) == [
        ["timestamp", "sensor", "target", "metadata"],
        ["5", "s", "t", '{"layer": 2100}'],
    ]


def test_power_report_csv_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "PowerReport.csv"
    path.write_text("timestamp,sensor,target,power,socket,scope\n1000,s,t,2.5,0,cpu\n")
    (report,) = list(powerapi.read_power_csv(path))
    assert isinstance(report, PowerReport)
    assert report.power == 2.5
    assert report.metadata == {"socket": "0", "scope": "cpu"}
    assert report.timestamp == to_utc(1000)


def _reports_document(*sensors: bytes) -> bytes:
    entries = [
        b'{"timestamp": %d, "sensor": "%s", "target": "t", "power": 1.5}' % (at, sensor)
        for at, sensor in enumerate(sensors, start=1)
    ]
    return b'{"reports": [' + b", ".join(entries) + b"]}"


def test_a_reports_document_entry_with_bytes_not_utf8_is_a_dead_letter(tmp_path: Path) -> None:
    """In a ``{"reports": [...]}`` recording, an entry holding a byte that is not UTF-8 is a dead
    letter naming its place, and the other entries are read (the whole file stopped the input
    with Python's UnicodeDecodeError, naming no file, before)."""
    source = tmp_path / "recording.json"
    source.write_bytes(_reports_document(b"node-1", b"node-\xff", b"node-1"))
    out, letters = tmp_path / "power.jsonl", tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "jsonl", "--file", str(out), "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 2
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert reasons == [f"{source} reports[1]: not valid UTF-8"]


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (b'{"reports": [\xff]}', "not valid JSON: Expecting value"),
        (b'{"reports": ' + b"[" * 5000 + b"]" * 5000 + b"}", "maximum recursion depth"),
        (b'{"reports": [' + b"9" * 5000 + b"]}", "Exceeds the limit (4300 digits)"),
    ],
    ids=["a byte not UTF-8 outside the entries", "deep nesting", "an integer of 5,000 digits"],
)
def test_a_reports_document_that_is_not_json_is_refused_naming_the_file(
    tmp_path: Path, document: bytes, problem: str
) -> None:
    """A recording that is not JSON at all stops the input, as documented; the error names the
    file and says it is not valid JSON, whatever Python's parser raised."""
    source = tmp_path / "recording.json"
    source.write_bytes(document)
    with pytest.raises(DecodeError) as refused:
        list(jsonl.read_reports_document(PowerReport, source))
    assert str(refused.value).startswith(f"{source}")
    assert "not valid JSON" in str(refused.value)
    assert problem in str(refused.value)


POWER_CSV_MUTATIONS = (b",", b'"', b"\r", b"\n", b"-", b".", b"0", b"9", b"x", b" ", b"\0",
                       b"\xff", b"", b"nan", b"1e999", b"9999-12-31T23:59:59-01:00", b"9" * 5000,
                       b"99999999999999999999999", b"x" * 140_000)  # fmt: skip
"""What bytes of a PowerReport.csv may become in the mutation sweep: cell and line breaks,
quoting, digits, text, NUL, a byte that is not UTF-8, numbers that are no power, timestamps off
the calendar, and a field longer than the csv module reads (128 KiB)."""


def test_any_mutated_power_csv_becomes_reports_and_dead_letters_never_an_error(
    tmp_path: Path,
) -> None:
    """A sweep of 300 PowerReport.csv files with one to three places anywhere (the header
    included) replaced, removed or added: reading never raises but to refuse a header (exit 2),
    every dead letter names the file and a line of it, and every report can be written as JSON
    and as BSON. Before, a field longer than 128 KiB raised csv.Error, which stopped the input."""
    rng = random.Random(17)
    path = tmp_path / "PowerReport.csv"
    rows = [b"timestamp,sensor,target,power,socket,scope"]
    rows += [b"%d,node-1,web,%d.5,0,cpu" % (1_767_603_600_000 + 1000 * i, i) for i in range(10)]
    original = b"\n".join(rows) + b"\n"
    too_long = 0
    refused: list[int | None] = []
    for _ in range(300):
        data = bytearray(original)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            data[at : at + rng.randint(0, 3)] = rng.choice(POWER_CSV_MUTATIONS)
        path.write_bytes(bytes(data))
        lines = bytes(data).count(b"\n") + 1
        try:
            items = list(powerapi.read_power_csv(path))
        except DecodeError as header:
            refused.append(header.line)
            continue
        for item in items:
            if isinstance(item, DecodeError):
                assert item.source == str(path)
                assert item.line is not None
                assert 1 < item.line <= lines
                too_long += "field larger than field limit" in item.problem
            else:
                assert math.isfinite(item.power), "nan, inf and 1e999 are dead letters"
                assert powerapi.encode_json(item)
                assert bson.encode(powerapi.to_mongodb(item))
    assert set(refused) == {1}, "only headers are refused, and some are"
    assert too_long >= 10, "the sweep puts fields beyond the limit in rows"


def test_a_power_that_is_not_finite_is_a_dead_letter_not_a_null(tmp_path: Path) -> None:
    """End to end: PowerReport rows with nan, inf or 1e999 watts (a CSV cell, a JSON number
    beyond a double) are dead letters naming their line. Before, the CSV input passed them and
    the JSON Lines output wrote ``"power": null``, which no input reads back."""
    source = tmp_path / "PowerReport.csv"
    rows = ["timestamp,sensor,target,power"]
    rows += [f"{1_767_603_600_000 + 1000 * i},node-1,web,{p}" for i, p in enumerate(
        ["0.5", "nan", "inf", "-inf", "1e999", "2.5"])]  # fmt: skip
    source.write_text("\n".join(rows) + "\n")
    recording = tmp_path / "power-in.jsonl"
    recording.write_text(
        '{"timestamp":1767603600000,"sensor":"n","target":"t","power":1e999}\n'
        '{"timestamp":1767603601000,"sensor":"n","target":"t","power":1.5}\n'
    )
    for flags, kept, refused_lines in (
        (["--input", "csv", "--model", "PowerReport", "--files", str(source)], [0.5, 2.5],
         [3, 4, 5, 6]),
        (["--input", "jsonl", "--model", "PowerReport", "--files", str(recording)], [1.5], [1]),
    ):  # fmt: skip
        out, letters = tmp_path / "power.jsonl", tmp_path / "dead.jsonl"
        out.unlink(missing_ok=True)
        letters.unlink(missing_ok=True)
        done = wattflow(
            "run", *flags, "--output", "jsonl", "--model", "PowerReport", "--file", str(out),
            "--dead-letters", str(letters),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert [json.loads(line)["power"] for line in out.read_text().splitlines()] == kept
        reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
        assert [int(reason.split(":")[1]) for reason in reasons] == refused_lines
        assert all("finite number" in reason for reason in reasons)


@pytest.mark.parametrize("model", ["HWPCReport", "PowerReport"])
def test_a_csv_header_beyond_the_field_limit_is_refused_with_its_file(
    tmp_path: Path, model: str
) -> None:
    """A header cell over 128 KiB (the most the csv module reads) is refused with exit 2 and
    an error naming the file. Before, the input's start-up check raised csv.Error, a
    traceback."""
    source = tmp_path / "core.csv"
    source.write_text("timestamp,sensor,target,socket,cpu,power," + "x" * 140_000 + "\n")
    done = wattflow(
        "run", "--input", "csv", "--model", model, "--files", str(source),
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"{source}:1: the CSV header is unreadable: field larger than field limit" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_power_csv_row_beyond_the_field_limit_is_a_dead_letter(tmp_path: Path) -> None:
    """End to end: a PowerReport.csv row with a 200 KiB cell is a dead letter naming its line,
    the rows after it are read and the service exits 0 (the csv module's error stopped the
    input before)."""
    source = tmp_path / "PowerReport.csv"
    rows = ["timestamp,sensor,target,power,socket,scope"]
    rows += [f"{1_767_603_600_000 + 1000 * i},node-1,web,{i}.5,0,cpu" for i in range(4)]
    rows[2] = rows[2].replace("web", "w" * 200_000)
    source.write_text("\n".join(rows) + "\n")
    out, letters = tmp_path / "power.jsonl", tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--input", "csv", "--model", "PowerReport", "--files", str(source),
        "--output", "jsonl", "--file", str(out), "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["power"] for line in out.read_text().splitlines()] == [0.5, 2.5, 3.5]
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert reasons == [f"{source}:3: not a CSV row: field larger than field limit (131072)"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1539260665189, datetime(2018, 10, 11, 12, 24, 25, 189000, tzinfo=UTC)),
        ("1539260665189", datetime(2018, 10, 11, 12, 24, 25, 189000, tzinfo=UTC)),
        ("2020-09-08T15:46:44.856", datetime(2020, 9, 8, 15, 46, 44, 856000, tzinfo=UTC)),
        ("2020-09-08T17:46:44.856+02:00", datetime(2020, 9, 8, 15, 46, 44, 856000, tzinfo=UTC)),
        (datetime(2020, 9, 8, 15, 46, 44), datetime(2020, 9, 8, 15, 46, 44, tzinfo=UTC)),
    ],
)
def test_timestamps_in_every_form_become_utc(value: object, expected: datetime) -> None:
    assert to_utc(value) == expected


def test_timestamp_format_keeps_sub_millisecond_precision() -> None:
    assert powerapi.format_timestamp(datetime(2020, 1, 1, tzinfo=UTC)) == "2020-01-01T00:00:00.000"
    stamp = datetime(2020, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    assert powerapi.format_timestamp(stamp) == "2020-01-01T00:00:00.123456"
