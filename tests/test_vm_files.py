"""The VM chain's files: the virtiofs output (host), the filedb output and input (guest).

Real files in real directories, and PowerAPI 2.10.0's own database classes (installed as a
test dependency) beside wattflow's: what PowerAPI writes is read back by wattflow, and where
PowerAPI fails or writes elsewhere the test says so, as the docs do.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from powerapi.database.file import FileDB  # type: ignore[import-untyped]
from powerapi.database.virtiofs import VirtioFSDB  # type: ignore[import-untyped]
from powerapi.report import PowerReport as PowerAPIPowerReport  # type: ignore[import-untyped]

from wattflow.actors.errors import PullError
from wattflow.actors.pullers.filedb import FileDBPuller, FileDBPullerConfig
from wattflow.actors.pushers.filedb import FileDBPusher, FileDBPusherConfig
from wattflow.actors.pushers.virtiofs import VirtioFSPusher, VirtioFSPusherConfig
from wattflow.formats import powerapi
from wattflow.formats.reports import HWPCReport, PowerReport, Report, to_millis

from .conftest import Collector, Service, run_async, wait_until, wattflow

START = datetime(2026, 2, 1, tzinfo=UTC)
VM_REGEXP = r".*machine-qemu\\x2d[0-9]+\\x2d([^/.]+)\.scope"
"""libvirt's QEMU machines under systemd: ``machine-qemu\\x2d<id>\\x2d<name>.scope``."""


def target_of(vm: str, number: int) -> str:
    return f"/machine.slice/machine-qemu\\x2d{number}\\x2d{vm}.scope/libvirt/vcpu0"


def estimates(ticks: int, targets: list[str]) -> list[PowerReport]:
    """SmartWatts' order: per tick and target, cpu then dram, each socket."""
    return [
        PowerReport(
            timestamp=START + timedelta(seconds=tick),
            sensor="host-1",
            target=target,
            power=round(10.0 * index + socket + (0.5 if scope == "dram" else 0.0) + tick, 3),
            metadata={"scope": scope, "socket": str(socket), "formula": "f0", "ratio": 0.5},
        )
        for tick in range(ticks)
        for index, target in enumerate(targets, start=1)
        for scope in ("cpu", "dram")
        for socket in (0, 1)
    ]


def write_jsonl(path: Path, reports: list[PowerReport]) -> Path:
    path.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    return path


def powerapi_report(report: PowerReport) -> Any:
    """The same report as PowerAPI 2.10's object (an aware time: its ``timestamp()`` is then
    the same instant whatever the machine's time zone)."""
    return PowerAPIPowerReport(
        report.timestamp, report.sensor, report.target, report.power, dict(report.metadata)
    )


# --- virtiofs -----------------------------------------------------------------------------


def test_each_vm_gets_its_package_power_through_powerapis_flags(tmp_path: Path) -> None:
    root = tmp_path / "vms"
    for vm in ("alpha", "beta"):
        (root / f"vm-{vm}.d").mkdir(parents=True)
    targets = [target_of("alpha", 1), target_of("beta", 2), "/system.slice/sshd.service"]
    reports = estimates(3, targets)
    source = write_jsonl(tmp_path / "power.jsonl", reports)
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "virtiofs", "-r", VM_REGEXP, "-d", str(root), "-p", "vm-", "-s", ".d",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    last = {
        (r.target, r.metadata["socket"]): r.power for r in reports if r.metadata["scope"] == "cpu"
    }
    for number, vm in enumerate(("alpha", "beta"), start=1):
        directory = root / f"vm-{vm}.d"
        assert sorted(p.name for p in directory.iterdir()) == [
            "power_consumption_package0",
            "power_consumption_package1",
        ]
        for socket in ("0", "1"):
            text = (directory / f"power_consumption_package{socket}").read_text()
            assert text == str(last[(target_of(vm, number), socket)])  # "22.0": no newline
    assert sorted(p.name for p in root.iterdir()) == ["vm-alpha.d", "vm-beta.d"]


def test_the_file_and_its_content_are_powerapis_where_powerapi_can_write_them(
    tmp_path: Path,
) -> None:
    """PowerAPI 2.10 fails on every report it would write (its report has no ``in``), and
    joins the directory and the file name without a separator. With ``in`` and ``[]`` given to
    its report, and a suffix ending with ``/``, it writes the file wattflow writes, with the
    same content."""
    (tmp_path / "vm-alpha").mkdir()
    report = estimates(1, [target_of("alpha", 7)])[1]  # cpu, socket 1
    database = VirtioFSDB(PowerAPIPowerReport, VM_REGEXP, str(tmp_path), "vm-", "/")
    with pytest.raises(TypeError, match="not iterable"):
        database.save(powerapi_report(report))

    class Readable(PowerAPIPowerReport):  # type: ignore[misc]
        def __contains__(self, key: str) -> bool:
            return key in self.metadata

        def __getitem__(self, key: str) -> Any:
            return self.metadata[key]

    VirtioFSDB(Readable, VM_REGEXP, str(tmp_path), "vm-", "/").save(
        Readable(report.timestamp, report.sensor, report.target, report.power, report.metadata)
    )
    theirs = tmp_path / "vm-alpha" / "power_consumption_package1"
    expected = theirs.read_bytes()
    theirs.unlink()
    config = VirtioFSPusherConfig(
        vm_name_regexp=VM_REGEXP,
        root_directory_name=tmp_path,
        vm_directory_name_prefix="vm-",
        vm_directory_name_suffix="/",
    )
    assert run_async(VirtioFSPusher(config).write([report])) == []
    assert theirs.read_bytes() == expected == b"11.0"


def test_what_cannot_be_written_is_a_dead_letter_and_the_rest_is_written(
    tmp_path: Path,
) -> None:
    (tmp_path / "alpha").mkdir()
    reports: list[Report] = [
        *estimates(1, [target_of("alpha", 1), target_of("gone", 2)]),
        PowerReport(timestamp=START, sensor="s", target=target_of("alpha", 1), power=3.0),
    ]
    config = VirtioFSPusherConfig(vm_name_regexp=VM_REGEXP, root_directory_name=tmp_path)
    refused = run_async(VirtioFSPusher(config).write(reports))
    reasons = [(r.target, reason) for r, reason in refused]
    assert len(reasons) == 3  # gone's 2 cpu reports, and the report without a socket
    assert sum(f"{tmp_path / 'gone'} does not exist" in reason for _, reason in reasons) == 2
    assert sum("no socket" in reason for _, reason in reasons) == 1
    assert (tmp_path / "alpha" / "power_consumption_package0").read_text() == "10.0"
    every = VirtioFSPusherConfig(vm_name_regexp=VM_REGEXP, root_directory_name=tmp_path, scope="")
    run_async(VirtioFSPusher(every).write(reports[:4]))  # PowerAPI's: dram comes last
    assert (tmp_path / "alpha" / "power_consumption_package0").read_text() == "10.5"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"vm_name_regexp": "vm-.*"}, "needs a group"),
        ({"vm_name_regexp": "vm-(.*"}, "not a regular expression"),
        ({"vm_name_regexp": "vm-(.*)", "model": "HWPCReport"}, "writes PowerReports"),
    ],
)
def test_bad_settings_say_why(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VirtioFSPusherConfig.model_validate({"root_directory_name": "/", **settings})


def test_a_reader_never_sees_a_file_half_written(tmp_path: Path) -> None:
    """A guest polls its file while the host rewrites it: every read is one whole value."""
    (tmp_path / "alpha").mkdir()
    path = tmp_path / "alpha" / "power_consumption_package0"
    config = VirtioFSPusherConfig(vm_name_regexp=VM_REGEXP, root_directory_name=tmp_path)
    pusher = VirtioFSPusher(config)
    written = {f"{1000.0 + n / 7}" for n in range(300)}
    reads: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with contextlib.suppress(FileNotFoundError):
                reads.append(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()

    async def write_all() -> None:
        for n in range(300):
            report = PowerReport(
                timestamp=START,
                sensor="s",
                target=target_of("alpha", 1),
                power=1000.0 + n / 7,
                metadata={"socket": "0", "scope": "cpu"},
            )
            assert await pusher.write([report]) == []

    try:
        run_async(write_all())
        wait_until(lambda: len(reads) > 300, 30, "the reader's reads")
    finally:
        done.set()
        reader.join()
    assert set(reads) <= written
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


# --- filedb ---------------------------------------------------------------------------------


def test_the_filedb_output_writes_powerapis_document_as_json(tmp_path: Path) -> None:
    reports = estimates(2, ["c1", "c2"])
    source = write_jsonl(tmp_path / "power.jsonl", reports)
    file = tmp_path / "last.json"
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "filedb", "-f", str(file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    last = reports[-1]
    ours = json.loads(file.read_text())
    assert ours == {
        "PowerReport": [
            {
                "sensor": "host-1",
                "target": "c2",
                "timestamp": to_millis(last.timestamp),
                "power": last.power,
                "metadata": last.metadata,
            }
        ]
    }
    theirs = tmp_path / "powerapi.txt"
    theirs.touch()
    FileDB(PowerAPIPowerReport, str(theirs)).save(powerapi_report(last))
    with pytest.raises(json.JSONDecodeError):  # Python's str() of the dict, not JSON
        json.loads(theirs.read_text())
    powerapi_document = ast.literal_eval(theirs.read_text())
    del ours["PowerReport"][0]["metadata"]
    assert powerapi_document == ours


def read_once(config: FileDBPullerConfig, stream: bool = False) -> Collector:
    puller = FileDBPuller(config, stream=stream)
    collector = Collector()
    run_async(puller.check())
    run_async(puller.pull(collector))
    return collector


def test_the_filedb_input_reads_powerapis_wattflows_and_hwpc_sensors_documents(
    tmp_path: Path, fixtures: Path
) -> None:
    report = estimates(1, ["c1"])[2]
    powerapi_file = tmp_path / "powerapi.txt"
    powerapi_file.touch()
    FileDB(PowerAPIPowerReport, str(powerapi_file)).save(powerapi_report(report))
    read = read_once(FileDBPullerConfig(model="PowerReport", filename=powerapi_file))
    assert read.items == [report.model_copy(update={"metadata": {}})]
    ours = tmp_path / "ours.json"
    run_async(FileDBPusher(FileDBPusherConfig(filename=ours)).write([report]))
    assert read_once(FileDBPullerConfig(model="PowerReport", filename=ours)).items == [report]
    hwpc = orjson.loads((fixtures / "hwpc.json").read_bytes())["reports"][0]
    del hwpc["_id"]
    sensor_file = tmp_path / "hwpc.json"
    sensor_file.write_bytes(orjson.dumps(hwpc))
    (got,) = read_once(FileDBPullerConfig(filename=sensor_file)).items
    assert isinstance(got, HWPCReport)
    assert got.groups.keys() == hwpc["groups"].keys()
    assert got.sensor == "sensor"


@pytest.mark.parametrize(
    ("content", "model", "reason"),
    [
        (b"{not json", "PowerReport", "not valid JSON"),
        (b'{"PowerReport": [{"sensor": "s"}]}', "PowerReport", "PowerReport"),
        (b'{"HWPCReport": []}', "PowerReport", "holds HWPCReport reports"),
        (b"12.5", "HWPCReport", "give --model PowerReport"),
        (b"nan", "PowerReport", "not a finite number"),
    ],
)
def test_content_that_is_no_report_is_a_dead_letter_naming_the_file(
    tmp_path: Path, content: bytes, model: str, reason: str
) -> None:
    file = tmp_path / "power_consumption_package0"
    file.write_bytes(content)
    read = read_once(FileDBPullerConfig(model=model, filename=file))
    assert read.items == []
    ((payload, message),) = read.rejected
    assert str(file) in message
    assert reason in message
    assert payload == content.decode()


def test_a_missing_file_is_an_error_unless_the_input_waits(tmp_path: Path) -> None:
    config = FileDBPullerConfig(model="PowerReport", filename=tmp_path / "absent")
    with pytest.raises(PullError, match="no such file"):
        run_async(FileDBPuller(config).check())
    run_async(FileDBPuller(config, stream=True).check())
    gone = FileDBPullerConfig(model="PowerReport", filename=tmp_path / "no" / "file")
    with pytest.raises(PullError, match="is not a directory"):
        run_async(FileDBPuller(gone, stream=True).check())


def test_the_stream_reads_each_change_once(tmp_path: Path) -> None:
    """A writer rewrites the number (the same value too, a new reading) and a document twice
    (the same one: not a new report); the input hands on each change once."""
    file = tmp_path / "power_consumption_package1"
    config = FileDBPullerConfig(
        model="PowerReport", filename=file, poll_interval_s=0.01, sensor="guest", target="vm"
    )
    puller = FileDBPuller(config, stream=True)
    collector = Collector()

    async def scenario() -> None:
        task = asyncio.create_task(puller.pull(collector))

        async def until(count: int) -> None:
            while len(collector.items) < count:
                await asyncio.sleep(0.01)

        file.write_text("12.5")
        await until(1)
        first = file.stat().st_mtime_ns
        file.write_text("")  # a writer that truncates, then writes: nothing to read yet
        file.write_text("12.5")
        os.utime(file, ns=(first + 1_000_000, first + 1_000_000))  # a clock coarser than 1 ms
        await until(2)
        document = FileDBPusherConfig(filename=file)
        await FileDBPusher(document).write([estimates(1, ["c1"])[0]])
        await until(3)
        await FileDBPusher(document).write([estimates(1, ["c1"])[0]])
        file.write_text("13.0")
        await until(4)
        collector.stopping.set()
        await task

    run_async(scenario())
    powers = [r.power for r in collector.items if isinstance(r, PowerReport)]
    assert powers == [12.5, 12.5, 10.0, 13.0]
    first = collector.items[0]
    assert (first.sensor, first.target) == ("guest", "vm")
    assert first.metadata == {"scope": "cpu", "socket": "1"}
    assert collector.rejected == []


def test_the_vm_chain_end_to_end(tmp_path: Path) -> None:
    """The host writes each VM's power to its share; the guest's wattflow reads its own file
    as it changes and writes it where the guest's tools read it (JSON Lines here)."""
    share = tmp_path / "share"
    (share / "alpha").mkdir(parents=True)
    guest_file = share / "alpha" / "power_consumption_package0"
    guest_output = tmp_path / "guest.jsonl"
    host_args = ("--output", "virtiofs", "-r", VM_REGEXP, "-d", str(share))
    with Service(
        tmp_path / "guest.log",
        "run", "--stream", "--input", "filedb", "--model", "PowerReport",
        "-f", str(guest_file), "--poll-interval-s", "0.05", "--target", "alpha",
        "--output", "jsonl", "--model", "PowerReport", "--file", str(guest_output),
    ) as guest:  # fmt: skip
        for tick in range(2):
            reports = estimates(tick + 1, [target_of("alpha", 1)])[-4:]
            source = write_jsonl(tmp_path / f"host-{tick}.jsonl", reports)
            host = wattflow(
                "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
                *host_args,
            )  # fmt: skip
            assert host.returncode == 0, host.stderr
            guest.wait_for_lines(guest_output, tick + 1)
        guest.stop()
    lines = [orjson.loads(line) for line in guest_output.read_text().splitlines()]
    assert [(line["target"], line["power"]) for line in lines] == [("alpha", 10.0), ("alpha", 11.0)]
    assert lines[0]["metadata"] == {"scope": "cpu", "socket": "0"}
