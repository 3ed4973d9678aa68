"""``wattflow run`` and ``wattflow demo`` as users run them: real processes, real files."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from .conftest import Service, drained_ledger, wait_until, wattflow
from .servers import free_port


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def csv_fixture_args(fixtures: Path, out: Path) -> list[str]:
    files = ",".join(str(fixtures / "csv" / f) for f in ("rapl2.csv", "core2.csv", "pcu2.csv"))
    return [
        "run",
        "--input",
        "csv",
        "--model",
        "HWPCReport",
        "--name",
        "puller",
        "--files",
        files,
        "--output",
        "csv",
        "--model",
        "PowerReport",
        "--name",
        "pusher",
        "--directory",
        str(out),
    ]


def test_smartwatts_csv_flags_write_powerapi_csv_with_rapl_powers(
    fixtures: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = wattflow(*csv_fixture_args(fixtures, out))
    assert done.returncode == 0, done.stderr
    path = out / "grvingt-12-rapl" / "PowerReport.csv"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.csv")) == [
        "grvingt-12-rapl/PowerReport.csv"
    ]
    header = path.read_text().splitlines()[0]
    assert header == "timestamp,sensor,target,power,socket,formula,ratio,scope"
    rows = {(r["socket"], r["scope"]): r for r in read_rows(path)}
    assert set(rows) == {("0", "cpu"), ("0", "dram"), ("1", "cpu"), ("1", "dram")}
    assert {r["timestamp"] for r in rows.values()} == {"1539260665189"}
    assert float(rows[("0", "cpu")]["power"]) == pytest.approx(19.46, abs=0.005)
    assert float(rows[("1", "cpu")]["power"]) == pytest.approx(7.872, abs=0.001)
    assert float(rows[("0", "dram")]["power"]) == pytest.approx(2.440, abs=0.001)


def test_rerun_appends_under_the_same_header(fixtures: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for _ in range(2):
        assert wattflow(*csv_fixture_args(fixtures, out)).returncode == 0
    lines = (out / "grvingt-12-rapl" / "PowerReport.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 4
    assert lines.count(lines[0]) == 1


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("bad_common_miss_target.csv", "target"),
        ("bad_common_miss_sensor.csv", "sensor"),
        ("bad_common_miss_timestamp.csv", "timestamp"),
    ],
)
def test_a_bad_fixture_gives_one_clear_line_and_no_traceback(
    fixtures: Path, tmp_path: Path, name: str, field: str
) -> None:
    bad = fixtures / "csv" / name
    done = wattflow(
        "run",
        "--input",
        "csv",
        "--files",
        str(bad),
        "--output",
        "csv",
        "--directory",
        str(tmp_path),
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"wattflow: error: {bad}:1: missing field '{field}' in the CSV header"]


JSONL_IN_OUT = ["--input", "jsonl", "--files", "a", "--output", "jsonl", "--file", "x"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--input", "csv", "--output", "csv", "--directory", "x"],
            "input.puller_csv.files: required setting is missing",
        ),
        (
            ["--input", "csv", "--files", "a.csv", "--output", "jsonl"],
            "output.pusher_jsonl.file: required setting is missing",
        ),
        (["--input", "nosuch", "--files", "a"], "--input nosuch: unknown input 'nosuch'"),
        (
            ["--input", "socket", "--port", "99999", "--output", "jsonl", "--file", "x"],
            "input.puller_socket.port: Input should be less than or equal to 65535",
        ),
        (
            [
                "--input",
                "jsonl",
                "--files",
                "a",
                "--output",
                "jsonl",
                "--file",
                "x",
                "--sensor-reports-frequency",
                "often",
            ],
            "sensor-reports-frequency: Input should be a valid integer",
        ),
        (
            ["--input", "jsonl", "--files", "missing.jsonl", "--output", "jsonl", "--file", "x"],
            "missing.jsonl: input 'puller_jsonl': no such file",
        ),
        (
            ["--input", "jsonl", "--files", "a", "--output", "jsonl", "-m", "powerreport"],
            "output.pusher_jsonl.model: unknown report model 'powerreport'; known: EventReport",
        ),
        (
            ["--input", "csvx", "--files", "a", "--output", "csv", "--directory", "d"],
            "--input csvx: unknown input 'csvx'; known: csv, filedb, jsonl, meter, mongodb",
        ),
        (
            [*JSONL_IN_OUT, "--disable-cpu-formula", "--disable-dram-formula"],
            "error: --disable-cpu-formula with --disable-dram-formula leaves SmartWatts nothing",
        ),
        (
            [*JSONL_IN_OUT, "--dead-letters", "."],
            "--dead-letters .: Is a directory",
        ),
        (
            [
                "--input",
                "jsonl",
                "--files",
                "a",
                "--output",
                "csv",
                "--model",
                "HWPCReport",
                "--directory",
                "d",
            ],
            "there is no CSV layout with columns for HWPCReport); record HWPCReport with "
            "--output jsonl --model HWPCReport",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--output", "csv", "--directory", "d"], "input: no input given"),
    ],
)
def test_bad_configuration_gets_one_line_naming_the_field_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = wattflow("run", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("wattflow: error: ")
    assert message in lines[0]
    assert "Value error" not in lines[0]


def test_config_file_environment_and_flags_layer_in_that_order(
    fixtures: Path, tmp_path: Path
) -> None:
    rapl = str(fixtures / "csv" / "rapl2.csv")
    config = {
        "verbose": False,
        "input": {"puller": {"type": "csv", "model": "HWPCReport", "files": rapl}},
        "output": {"pusher": {"type": "csv", "model": "PowerReport", "directory": "from-file"}},
        "sensor-reports-frequency": 1000,
    }
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    done = wattflow("run", "--config-file", str(config_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "from-file" / "grvingt-12-rapl" / "PowerReport.csv").is_file()

    env = {"POWERAPI_OUTPUT_PUSHER_DIRECTORY": "from-env"}
    done = wattflow("run", "--config-file", str(config_path), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "from-env" / "grvingt-12-rapl" / "PowerReport.csv").is_file()

    done = wattflow(
        "run",
        "--config-file",
        str(config_path),
        "--output",
        "csv",
        "--name",
        "pusher",
        "--directory",
        "from-flags",
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "from-flags" / "grvingt-12-rapl" / "PowerReport.csv").is_file()


def test_toml_config_is_read(fixtures: Path, tmp_path: Path) -> None:
    (tmp_path / "wattflow.toml").write_text(
        "stream = false\nsensor_reports_frequency = 1000\n"
        '[input.recording]\ntype = "csv"\n'
        f'files = ["{fixtures / "csv" / "rapl2.csv"}"]\n'
        '[output.lines]\ntype = "jsonl"\nfile = "out.jsonl"\n'
    )
    done = wattflow("run", "--config-file", "wattflow.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert {line["metadata"]["scope"] for line in lines} == {"cpu", "dram"}
    assert all(line["target"] == "rapl" for line in lines)


@pytest.mark.parametrize(
    ("name", "text", "read_as"),
    [
        ("rapl.csv", "timestamp,sensor,target\n", "JSON"),
        ("wattflow.toml", "stream = \n", "TOML"),
        ("config", "{", "JSON"),
    ],
)
def test_a_config_file_that_does_not_parse_names_the_format_it_was_read_as(
    tmp_path: Path, name: str, text: str, read_as: str
) -> None:
    """An input file given as the config file by mistake (``--config-file rapl.csv``) was
    said to be "not valid csv": it is read as JSON, and the error says so, and why."""
    (tmp_path / name).write_text(text)
    done = wattflow("run", "--config-file", name, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"wattflow: error: --config-file {name}: not valid {read_as} (a config file is TOML "
        "when its name ends in .toml, else PowerAPI's JSON): "
    ), line


def test_demo_needs_nothing_and_writes_csv_where_it_says(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = wattflow("demo", "--directory", str(out), "--speed", "100")
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout.replace("\n", "")
    assert "power per target" in done.stdout
    rows = read_rows(out / "demo-node-rapl" / "PowerReport.csv")
    assert len(rows) == 29 * 4
    assert all(0 < float(r["power"]) < 200 for r in rows)


def rapl_line(index: int) -> str:
    stamp = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=index)
    return json.dumps(
        {
            "timestamp": stamp.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3],
            "sensor": "node",
            "target": "all",
            "groups": {"rapl": {"0": {"0": {"RAPL_ENERGY_PKG": (10 + index) * 2**32}}}},
        }
    )


def start_service(tmp_path: Path, *args: str) -> Service:
    """``wattflow run ARGS`` in the background, its output in ``tmp_path``/service.log."""
    return Service(tmp_path / "service.log", "run", *args)


def connect(port: int, service: Service) -> socket.socket:
    """The sensor's connection, once the service listens."""
    connection: list[socket.socket] = []

    def accepted() -> bool:
        try:
            connection.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except ConnectionRefusedError:
            service.alive()  # one that exited fails the test, with its log
            return False
        return True

    wait_until(accepted, 20, "the service's socket")
    return connection[0]


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_everything_the_sensor_sent(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    port = free_port()
    out = tmp_path / "power.jsonl"
    ticks = 200
    service = start_service(
        tmp_path, "--input", "socket", "--port", str(port),
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    with service, connect(port, service) as sensor:
        sensor.sendall("".join(rapl_line(i) + "\n" for i in range(ticks)).encode())
        log = service.stop(stop_signal)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    # Every tick but the first (which only starts the first interval) became a power report,
    # the last ones included.
    assert len(written) == ticks - 1
    assert [w["power"] for w in written] == pytest.approx([10.0 + i for i in range(1, ticks)])
    assert "Traceback" not in log


def test_socket_input_skips_overlong_and_malformed_lines(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "power.jsonl"
    letters = tmp_path / "dead.jsonl"
    service = start_service(
        tmp_path, "--input", "socket", "--port", str(port), "--max-line-bytes", "2048",
        "--output", "jsonl", "--file", str(out), "--dead-letters", str(letters),
    )  # fmt: skip
    with service, connect(port, service) as sensor:
        payload = [rapl_line(0), "x" * 5000, "{broken", rapl_line(1), rapl_line(2)]
        sensor.sendall(("\n".join(payload) + "\n").encode())
        # The last line's report comes after the two bad lines: once it is written, all five
        # lines were read.
        service.stop_once_written(out, 2)
    assert len(out.read_text().splitlines()) == 2
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert len(reasons) == 2
    assert "line longer than 2048 bytes" in reasons[0]
    assert "not valid JSON" in reasons[1]


def test_a_timestamp_its_zone_moves_off_the_calendar_is_a_dead_letter(tmp_path: Path) -> None:
    """A sensor's line whose timestamp is in year 9999 an hour behind UTC (so after the last day
    Python holds, in UTC): that line is a dead letter naming its line, and the input goes on
    (the error stopped the whole input before)."""
    port = free_port()
    out = tmp_path / "power.jsonl"
    letters = tmp_path / "dead.jsonl"
    service = start_service(
        tmp_path, "--input", "socket", "--port", str(port),
        "--output", "jsonl", "--file", str(out), "--dead-letters", str(letters),
    )  # fmt: skip
    late = json.loads(rapl_line(1)) | {"timestamp": "9999-12-31T23:30:00-01:00"}
    with service, connect(port, service) as sensor:
        payload = [rapl_line(0), json.dumps(late), rapl_line(1), rapl_line(2)]
        sensor.sendall(("\n".join(payload) + "\n").encode())
        service.stop_once_written(out, 2)
    assert len(out.read_text().splitlines()) == 2
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert len(reasons) == 1
    assert reasons[0].startswith("socket:127.0.0.1:")
    assert reasons[0].endswith(
        ":2: HWPCReport: field 'timestamp': Value error, "
        "timestamp 9999-12-31T23:30:00-01:00 is out of range in UTC"
    )


def test_values_no_output_could_write_do_not_take_their_batch_down(tmp_path: Path) -> None:
    """A recording with a counter beyond 64 bits and a report whose metadata holds one: the
    counter is read as the double it is nearest, the metadata's report is a dead letter naming
    its line, and every other report is recorded (exit 0). Before, both passed the input and
    the output refused its whole batch: no report was written, exit 1."""
    lines = [json.loads(rapl_line(index)) for index in range(4)]
    lines[1]["groups"]["rapl"]["0"]["0"]["RAPL_ENERGY_PKG"] = 2**64 + 1
    lines[2]["metadata"] = {"run": 2**64}
    source = tmp_path / "hwpc.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, letters = tmp_path / "recorded.jsonl", tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--disable-rapl-formula", "--disable-smartwatts-formula",
        "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(out),
        "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 3
    assert written[1]["groups"]["rapl"]["0"]["0"]["RAPL_ENERGY_PKG"] == float(2**64)
    [letter] = [json.loads(line) for line in letters.read_text().splitlines()]
    assert letter["reason"] == (
        f"{source}:3: HWPCReport: field 'metadata': Value error, "
        f"metadata.run: the integer {2**64} is beyond 64 bits"
    )


def test_stream_mode_follows_a_growing_jsonl_file(tmp_path: Path) -> None:
    source = tmp_path / "hwpc.jsonl"
    source.write_text(rapl_line(0) + "\n")
    out = tmp_path / "power.jsonl"
    with start_service(
        tmp_path, "-s", "--input", "jsonl", "--files", str(source), "--poll-interval-s", "0.05",
        "--output", "jsonl", "--file", str(out),
    ) as service:  # fmt: skip
        with source.open("a") as growing:
            for index in range(1, 20):
                growing.write(rapl_line(index)[:20])
                growing.flush()
                time.sleep(0.01)  # a half-written line, for the service to come across
                growing.write(rapl_line(index)[20:] + "\n")
                growing.flush()
        service.stop_once_written(out, 19)
    assert len(out.read_text().splitlines()) == 19


@pytest.mark.parametrize("cut", [False, True])
def test_stream_mode_reads_a_last_line_without_newline_at_a_stop(tmp_path: Path, cut: bool) -> None:
    """A file whose writer has not ended its last line yet: at the stop, that line is a report
    (it was whole) or a dead letter naming its line (it was cut off), never dropped."""
    last = rapl_line(5)[:20] if cut else rapl_line(5)
    source = tmp_path / "hwpc.jsonl"
    source.write_text("".join(rapl_line(i) + "\n" for i in range(5)) + last)
    out, letters = tmp_path / "recorded.jsonl", tmp_path / "dead.jsonl"
    with start_service(
        tmp_path, "-s", "--dead-letters", str(letters),
        "--input", "jsonl", "--files", str(source), "--poll-interval-s", "0.05",
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(out),
    ) as service:  # fmt: skip
        service.stop_once_written(out, 5)
    recorded = out.read_text().splitlines()
    if cut:
        assert len(recorded) == 5
        [letter] = [json.loads(line) for line in letters.read_text().splitlines()]
        assert f"{source}:6:" in letter["reason"]
    else:
        assert len(recorded) == 6
        assert json.loads(recorded[-1])["timestamp"] == json.loads(rapl_line(5))["timestamp"]
        assert not letters.exists() or letters.read_text() == ""


def test_an_output_that_cannot_be_written_fails_the_run_and_keeps_the_reports(
    fixtures: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "grvingt-12-rapl").write_text("a file where a directory should be")
    letters = tmp_path / "dead.jsonl"
    done = wattflow(*csv_fixture_args(fixtures, blocked), "--dead-letters", str(letters))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "wattflow: error: 4 reports could not be written" in done.stderr
    kept = [json.loads(line) for line in letters.read_text().splitlines()]
    assert len(kept) == 4
    assert {k["payload"]["target"] for k in kept} == {"rapl"}


def test_a_second_signal_stops_without_waiting_for_a_stuck_output(tmp_path: Path) -> None:
    port = free_port()
    fifo = tmp_path / "never-read.jsonl"
    os.mkfifo(fifo)  # opening it for writing blocks: an output that never accepts anything
    service = start_service(
        tmp_path, "--input", "socket", "--port", str(port),
        "--output", "jsonl", "--file", str(fifo),
    )  # fmt: skip
    with service, connect(port, service) as sensor:
        sensor.sendall("".join(rapl_line(i) + "\n" for i in range(10)).encode())
        service.send_signal(signal.SIGTERM)
        service.wait_for_log("stopping: draining the pipeline")
        # The drain has begun, and cannot end while the output never opens. (A bounded look
        # for an exit that must not come: a slow machine cannot make it fail.)
        with pytest.raises(subprocess.TimeoutExpired):
            service.process.wait(timeout=1.0)
        log = service.stop(signal.SIGTERM, code=1)
    assert "wattflow: error: interrupted twice: stopped without draining" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "the following arguments are required: COMMAND"), (["nope"], "invalid choice: 'nope'")],
)
def test_an_unknown_command_is_a_usage_error(args: list[str], message: str) -> None:
    done = wattflow(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_an_output_of_the_inputs_kind_records_the_input_beside_the_formulas(
    tmp_path: Path,
) -> None:
    source = tmp_path / "hwpc.jsonl"
    source.write_text("".join(rapl_line(index) + "\n" for index in range(6)))
    power, archive = tmp_path / "power.jsonl", tmp_path / "hwpc-copy.jsonl"
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--file", str(power),
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(archive),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(power.read_text().splitlines()) == 5
    copied = [json.loads(line) for line in archive.read_text().splitlines()]
    originals = [json.loads(rapl_line(index)) for index in range(6)]
    assert [c["groups"] for c in copied] == [o["groups"] for o in originals]
    assert [c["timestamp"] for c in copied] == [o["timestamp"] for o in originals]


def test_version_names_the_installed_distribution() -> None:
    """``wattflow --version``: what an operator (or a container build) asks first."""
    from importlib import metadata

    result = wattflow("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wattflow {metadata.version('wattflow')}"


def test_a_run_keeps_malloc_to_one_arena_on_glibc() -> None:
    """The replays parse in a thread of their own; with an arena per thread glibc would hand
    that thread's arena back and take it again chunk after chunk. On glibc (every Linux the
    tests run on) the setting takes; run in a child process, since it lasts for the process."""
    import subprocess
    import sys

    code = "from wattflow.service.cli import one_malloc_arena; print(one_malloc_arena())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_sensor_help_lists_the_sensors_and_how_outputs_are_given(flag: str) -> None:
    """``wattflow sensor --help`` was an error (exit 2) asking for a sensor's name."""
    done = wattflow("sensor", flag)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: wattflow sensor NAME [its flags] --output TYPE")
    assert "\n  nvml    NVIDIA GPUs through NVML" in done.stdout
    assert "wattflow run --output TYPE --help" in done.stdout.replace("\n", " ")


@pytest.mark.parametrize("args", [["nvml", "--help"], ["nvml", "--devices", "0", "-h"]])
def test_a_sensors_help_names_the_sensor_command_and_says_how_outputs_are_given(
    args: list[str],
) -> None:
    """It was ``wattflow run --input nvml``'s help, which named another command and said
    nothing of the outputs the sensor needs."""
    done = wattflow("sensor", *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: wattflow sensor nvml [its flags] --output TYPE")
    assert "wattflow run" not in done.stdout.splitlines()[0]
    assert "--interval-ms INTERVAL_MS" in done.stdout
    text = " ".join(done.stdout.split())
    assert "Outputs are given after the sensor's flags" in text
    assert "types: csv, filedb, influxdb, influxdb2, jsonl" in text


def test_sensor_without_a_name_still_exits_2_and_points_at_the_help() -> None:
    done = wattflow("sensor")
    assert done.returncode == 2
    assert "`wattflow sensor --help` lists them" in done.stderr


def payload_text(letter: str) -> str:
    """A dead letter's payload as the file holds it, byte for byte (a JSON parser would
    re-write its numbers)."""
    return letter[letter.index(', "payload": ') + len(', "payload": ') : -1]


def test_dead_letters_hold_reports_as_the_jsonl_output_writes_them(
    fixtures: Path, tmp_path: Path
) -> None:
    """A report dead-lettered by an output is kept as the JSON Lines output writes it (the
    timestamp as hwpc-sensor writes it, not pydantic's ``…189000Z``): the payloads are the
    very lines ``--output jsonl`` writes, ``--input jsonl`` reads them back into reports
    written again byte for byte, and ``jq -c .payload`` gives the same documents."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "grvingt-12-rapl").write_text("a file where a directory should be")
    letters = tmp_path / "dead.jsonl"
    done = wattflow(*csv_fixture_args(fixtures, blocked), "--dead-letters", str(letters))
    assert done.returncode == 1, done.stderr
    args = csv_fixture_args(fixtures, blocked)
    reference = tmp_path / "power.jsonl"
    written = wattflow(*args[: args.index("--output")], "--output", "jsonl",
                       "--file", str(reference))  # fmt: skip
    assert written.returncode == 0, written.stderr
    expected = [line for line in reference.read_text().splitlines() if '"target":"rapl"' in line]
    assert len(expected) == 4
    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text(
        "".join(payload_text(line) + "\n" for line in letters.read_text().splitlines())
    )
    assert payloads.read_text().splitlines() == expected
    again = tmp_path / "again.jsonl"
    replayed = wattflow(
        "run", "--disable-rapl-formula", "--disable-smartwatts-formula",
        "--input", "jsonl", "--model", "PowerReport", "--files", str(payloads),
        "--output", "jsonl", "--model", "PowerReport", "--file", str(again),
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert again.read_text().splitlines() == expected
    picked = subprocess.run(
        ["jq", "-c", ".payload", str(letters)], capture_output=True, text=True, check=True
    )
    assert [json.loads(line) for line in picked.stdout.splitlines()] == [
        json.loads(line) for line in expected
    ]


def test_an_idle_sensor_still_connected_is_let_go_soon_after_a_stop(tmp_path: Path) -> None:
    """A sensor that sent its ticks and stays connected, quiet: at SIGTERM its connection is
    closed once quiet for 0.1 s, as documented, not at the end of ``--drain-grace-s`` (its
    reader waited for data with no deadline and did not see the stop). With a 10 s grace, the
    service is gone well within half of it; before, after all of it."""
    port, grace_s = free_port(), 10.0
    out = tmp_path / "power.jsonl"
    service = start_service(
        tmp_path, "--input", "socket", "--port", str(port), "--drain-grace-s", str(grace_s),
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    with service, connect(port, service) as sensor:
        sensor.sendall("".join(rapl_line(i) + "\n" for i in range(12)).encode())
        service.wait_for_lines(out, 11)
        started = time.monotonic()
        log = service.stop()
        took_s = time.monotonic() - started
        assert sensor.recv(1) == b""  # the service closed the connection
    assert took_s < grace_s / 2, f"the stop took {took_s:.1f} s:\n{log[-2000:]}"
    assert drained_ledger(log)["entered"] == 12


def test_an_idle_meter_logger_still_connected_does_not_hold_the_stop(tmp_path: Path) -> None:
    """A meter logger connected and quiet at SIGTERM: its connection is closed once quiet for
    0.1 s and the service exits at once, cleanly (its reader was left pending, waiting for a
    line: asyncio logged "Task was destroyed but it is pending!" at every such exit)."""
    port = free_port()
    out = tmp_path / "meter.jsonl"
    service = start_service(
        tmp_path, "--input", "meter", "--port", str(port), "--sensor", "node-1",
        "--output", "jsonl", "--model", "MeterReport", "--file", str(out),
    )  # fmt: skip
    with service, connect(port, service) as logger_connection:
        logger_connection.sendall(b"timestamp,d0c0\n1772323200000,1.0\n1772323200250,2.0\n")
        service.wait_for_lines(out, 2)
        started = time.monotonic()
        log = service.stop()
        took_s = time.monotonic() - started
        assert logger_connection.recv(1) == b""  # the service closed the connection
    assert took_s < 5.0, f"the stop took {took_s:.1f} s:\n{log[-2000:]}"
    assert "destroyed but it is pending" not in log
    assert "Traceback" not in log
