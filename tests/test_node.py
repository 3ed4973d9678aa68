"""External meters and the node formula: meter − (cpu + dram + gpu) = the rest of the node."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import random
import signal
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from pymongo import MongoClient

from wattflow.actors.checkpoints import decode_checkpoint
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas import node as node_formula
from wattflow.actors.formulas.base import FormulaActor, Output
from wattflow.actors.formulas.node import NodeConfig, NodeFormula
from wattflow.actors.pullers.meter import MeterPuller, MeterPullerConfig
from wattflow.actors.runtime import DeadLetters, Ledger, QueueConfig
from wattflow.formats import powerapi
from wattflow.formats.frames import Frame
from wattflow.formats.reports import (
    GPUDevice,
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    Report,
)
from wattflow.service.cli import load_run_config
from wattflow.service.pipeline import assemble

from .conftest import Collector, Service, run_async, wait_until, wattflow
from .servers import ServerProcess, free_port, mongodb_uri, port_open

START = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
CPU_W_PER_SOCKET, DRAM_W, GPU_W, METER_W = 20.0, 5.0, 100.0, 200.0
REST_W = METER_W - 2 * CPU_W_PER_SOCKET - 2 * DRAM_W - GPU_W  # 50 W


def millis(seconds: float) -> int:
    return int((START + timedelta(seconds=seconds)).timestamp() * 1000)


def rapl(second: int) -> HWPCReport:
    """hwpc-sensor's global report: a second of RAPL energy on two sockets."""
    per_socket = {
        str(s): {
            str(4 * s): {
                "RAPL_ENERGY_PKG": CPU_W_PER_SOCKET * 2**32,
                "RAPL_ENERGY_DRAM": DRAM_W * 2**32,
            }
        }
        for s in range(2)
    }
    return HWPCReport(
        timestamp=START + timedelta(seconds=second),
        sensor="node-1",
        target="all",
        groups={"rapl": per_socket},
    )


def gpu(half_second: int) -> GPUReport:
    """The NVML sampler every half second: an energy counter rising at GPU_W."""
    return GPUReport(
        timestamp=START + timedelta(seconds=half_second / 2),
        sensor="node-1",
        target="all",
        devices={"0": GPUDevice(total_energy=GPU_W * 1000 * half_second / 2)},
    )


def write_jsonl(path: Path, reports: list[Any]) -> Path:
    path.write_text("".join(powerapi.encode_json(r) + "\n" for r in reports))
    return path


def meter_csv(path: Path, seconds: int, offset_ms: int = 0) -> Path:
    """A wattmeter log every quarter second, two channels adding up to METER_W."""
    rows = ["timestamp,d0c0,d0c1"]
    for quarter in range(4 * seconds + 1):
        stamp = millis(quarter / 4) - offset_ms
        rows.append(f"{stamp},{METER_W * 1000 * 0.75},{METER_W * 1000 * 0.25}")
    path.write_text("\n".join(rows) + "\n")
    return path


def node_reports(out: Path) -> dict[str, list[dict[str, Any]]]:
    by_target: dict[str, list[dict[str, Any]]] = {}
    for line in out.read_text().splitlines():
        report = json.loads(line)
        if report["metadata"].get("scope") == "node":
            by_target.setdefault(report["target"], []).append(report)
    return by_target


def test_the_rest_of_the_node_is_the_meter_minus_cpu_dram_and_gpu(tmp_path: Path) -> None:
    seconds = 6
    hwpc = write_jsonl(tmp_path / "hwpc.jsonl", [rapl(s) for s in range(seconds + 1)])
    nvml = write_jsonl(tmp_path / "gpu.jsonl", [gpu(h) for h in range(2 * seconds + 1)])
    # The logger's clock runs 3 s behind the node's; --clock-offset-ms puts it right.
    meter = meter_csv(tmp_path / "meter.csv", seconds, offset_ms=3000)
    out = tmp_path / "power.jsonl"
    done = wattflow(
        "run", "--disable-smartwatts-formula",
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "jsonl", "--model", "GPUReport", "--files", str(nvml),
        "--input", "meter", "--files", str(meter), "--sensor", "node-1",
        "--clock-offset-ms", "3000",
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reports = node_reports(out)
    assert len(reports["node"]) == seconds
    assert [r["power"] for r in reports["node"]] == pytest.approx([METER_W] * seconds)
    assert [r["power"] for r in reports["rest"]] == pytest.approx([REST_W] * seconds)
    first = reports["node"][0]["metadata"]
    assert first["cpu"] == pytest.approx(2 * CPU_W_PER_SOCKET)
    assert first["dram"] == pytest.approx(2 * DRAM_W)
    assert first["gpu"] == pytest.approx(GPU_W)
    assert reports["rest"][0]["metadata"]["ratio"] == pytest.approx(REST_W / METER_W)


def test_each_targets_share_of_node_power_when_asked(tmp_path: Path) -> None:
    seconds = 3
    hwpc = write_jsonl(tmp_path / "hwpc.jsonl", [rapl(s) for s in range(seconds + 1)])
    targets = [
        PowerReport(
            timestamp=START + timedelta(seconds=s),
            sensor="node-1",
            target=name,
            power=watts,
            metadata={"scope": scope, "socket": "0"},
        )
        for s in range(1, seconds + 1)
        for name, watts, scope in (("web", 10.0, "cpu"), ("web", 2.0, "dram"), ("db", 30.0, "cpu"))
    ]
    estimates = write_jsonl(tmp_path / "targets.jsonl", targets)
    meter = meter_csv(tmp_path / "meter.csv", seconds)
    out = tmp_path / "power.jsonl"
    done = wattflow(
        "run", "--disable-smartwatts-formula", "--disable-rapl-formula", "--node-shares",
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "jsonl", "--model", "PowerReport", "--files", str(estimates),
        "--input", "meter", "--files", str(meter), "--sensor", "node-1",
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reports = node_reports(out)
    assert [r["power"] for r in reports["web"]] == pytest.approx([12.0] * seconds)
    assert [r["metadata"]["ratio"] for r in reports["db"]] == pytest.approx([0.15] * seconds)
    assert [r["power"] for r in reports["rest"]] == pytest.approx([METER_W - 50.0] * seconds)


def test_a_meter_on_a_tcp_socket_and_its_bad_lines(tmp_path: Path) -> None:
    port = free_port()
    out, letters = tmp_path / "power.jsonl", tmp_path / "dead.jsonl"
    hwpc = write_jsonl(tmp_path / "hwpc.jsonl", [rapl(s) for s in range(4)])
    service = Service(
        tmp_path / "service.log", "run", "-s", "--disable-smartwatts-formula",
        # hwpc-sensor's ticks are read at once, the meter's readings come when the test sends
        # them: a lateness longer than the test has them all in each interval at shutdown
        "--node-lateness-ms", "600000",
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "meter", "--port", str(port), "--sensor", "node-1",
        "--output", "jsonl", "--file", str(out), "--dead-letters", str(letters),
    )  # fmt: skip

    def listening() -> bool:
        service.alive()  # one that exited fails the test, with its log
        return port_open(port)

    with service:
        wait_until(listening, 30, "the meter socket")
        with socket.create_connection(("127.0.0.1", port)) as meter:
            lines = [
                json.dumps({"timestamp": millis(q / 4), "d0c0": METER_W * 1000}) for q in range(13)
            ]
            lines.insert(3, '{"timestamp": 5, "d0c0": "lots"}')
            lines.insert(5, "not a reading")
            meter.sendall(("\n".join(lines) + "\n").encode())
            meter.shutdown(socket.SHUT_WR)
            # The service hangs up once it has taken every line in: then they are all in.
            meter.settimeout(60)
            assert meter.recv(1) == b"", "the service answered a meter"
        service.stop()
    reports = node_reports(out)
    assert [r["power"] for r in reports["node"]] == pytest.approx([METER_W] * 3)
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert len(reasons) == 2
    assert "'lots' is not a reading in mW" in reasons[0]
    assert "CSV row before the header" in reasons[1]
    assert reasons[0].startswith("meter:127.0.0.1:")


METER_BYTES = (b",", b"\r", b"\n", b"-", b".", b"0", b"9", b"x", b" ", b"\0", b"\xff", b"",
               b"{", b"}", b'"', b":")  # fmt: skip
"""What a byte of a meter log may become in the mutation sweep: cell and line breaks, digits,
text, NUL, a byte that is not UTF-8, JSON's punctuation, nothing."""
METER_CELLS = (b"", b"x", b"nan", b"-inf", b"1e999", b"null", b"[]", b"{}", b'"d0c0"',
               b"9999-12-31T23:59:59", b"-62135596800000", b"253402300799999")  # fmt: skip
"""What a whole cell, key or value may become: nothing, text, numbers that are no readings,
JSON of the wrong kind, and timestamps at either end of the calendar, off it once
--clock-offset-ms moves them."""


def _mutated_meter_log(rng: random.Random) -> bytes:
    rows = [b"timestamp,d0c0,d0c1"]
    for quarter in range(4):
        rows.append(b"%d,%.1f,18000" % (millis(quarter / 4), 61250.5 + quarter))
        reading = {"timestamp": millis(quarter / 4 + 0.1), "channels": {"d0c0": 1234.5}}
        rows.append(json.dumps(reading).encode())
    data = bytearray(b"\n".join(rows) + b"\n")
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.4:  # a byte or two anywhere
            at = rng.randrange(len(data))
            data[at : at + rng.randint(0, 2)] = rng.choice(METER_BYTES)
        else:  # a whole cell, key or value
            starts = [0, *(m + 1 for m in range(len(data) - 1) if data[m] == ord("\n"))]
            line = rng.randrange(len(starts))
            end = data.find(b"\n", starts[line]) % (len(data) + 1)  # -1: the end of the data
            ends = [m for m in range(starts[line], end) if data[m] in b", "]
            cells = [starts[line], *(m + 1 for m in ends)]
            which = rng.randrange(len(cells))
            stop = ends[which] if which < len(ends) else end
            data[cells[which] : stop] = rng.choice(METER_CELLS)
    return bytes(data)


def test_any_mutated_meter_log_becomes_readings_and_dead_letters_never_an_error(
    tmp_path: Path,
) -> None:
    """A sweep of 300 meter logs (CSV rows and JSON lines) with bytes or cells replaced, removed
    or added, read with the clock offset 0, +1.5 s and −1.5 s: no line stops the input. Every
    line is a reading, a header or a dead letter naming the file and the line and holding it,
    and every reading is finite (a timestamp the offset moves off the calendar stopped the whole
    input before; ``nan`` or ``inf`` mW in a row passed as a reading)."""
    rng = random.Random(7)
    path = tmp_path / "meter.log"
    out_of_range = not_finite = 0
    for case in range(300):
        data = _mutated_meter_log(rng)
        path.write_bytes(data)
        offset_ms = (0, 1500, -1500)[case % 3]
        config = MeterPullerConfig(files=[path], sensor="node-1", clock_offset_ms=offset_ms)
        collector = Collector()
        run_async(MeterPuller(config).pull(collector))
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        texts = [line.decode("utf-8", "replace") for line in lines]
        rejected = {}
        for payload, reason in collector.rejected:
            where, _, problem = reason.partition(": ")
            number = int(where.removeprefix(f"{path}:"))
            assert payload == texts[number - 1], reason
            rejected[number] = problem
        headers = [
            number
            for number, text in enumerate(texts, start=1)
            if text.strip().split(",")[0].strip() == "timestamp" and number not in rejected
        ]
        filled = sum(1 for text in texts if text.strip())
        assert len(collector.items) == filled - len(rejected) - len(headers), data
        assert all(
            math.isfinite(mw) for report in collector.items for mw in report.channels.values()
        )
        out_of_range += any("--clock-offset-ms" in problem for problem in rejected.values())
        not_finite += any("is not a reading in mW" in problem for problem in rejected.values())
    assert out_of_range >= 5, "the sweep moves timestamps off the calendar"
    assert not_finite >= 5, "the sweep puts numbers that are no readings in rows"


def test_a_timestamp_off_the_calendar_or_nan_mw_is_a_dead_letter_and_the_log_goes_on(
    tmp_path: Path,
) -> None:
    """End to end: a meter log with a row the clock offset moves before year 1, a row of ``nan``
    mW and a JSON reading whose sensor is a list: each is a dead letter naming its line, the
    other readings are written and the service exits 0."""
    meter = tmp_path / "meter.csv"
    meter.write_text(
        "timestamp,d0c0\n"
        f"{millis(0)},5000\n"
        "-62135596800000,7000\n"
        f"{millis(1)},nan\n"
        f"{millis(2)},6000\n"
        f'{{"timestamp": {millis(3)}, "d0c0": 8000, "sensor": ["node-1"]}}\n'
    )
    out, letters = tmp_path / "meter.jsonl", tmp_path / "dead.jsonl"
    done = wattflow(
        "run", "--input", "meter", "--files", str(meter), "--sensor", "node-1",
        "--clock-offset-ms", "-1500",
        "--output", "jsonl", "--model", "MeterReport", "--file", str(out),
        "--dead-letters", str(letters),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [json.loads(line)["channels"]["d0c0"] for line in out.read_text().splitlines()]
    assert written == [5000.0, 6000.0]
    reasons = [json.loads(line)["reason"] for line in letters.read_text().splitlines()]
    assert reasons == [
        f"{meter}:3: timestamp '-62135596800000' with --clock-offset-ms -1500 is out of range",
        f"{meter}:4: 'nan' is not a reading in mW",
        f"{meter}:6: sensor ['node-1'] is not a name",
    ]


def test_a_paused_meter_stream_has_its_held_intervals_reported_without_new_input(
    tmp_path: Path,
) -> None:
    """A live meter sends its readings and then nothing more, its connection still open: each
    interval comes out once it has waited ``--node-lateness-ms``, the formula's timer waking it
    without new input, not at shutdown; the shutdown reports nothing twice."""
    port = free_port()
    out = tmp_path / "power.jsonl"
    readings = 13  # 12 intervals of the meter's own ticks
    service = Service(
        tmp_path / "service.log", "run", "-s", "--node-lateness-ms", "300",
        "--input", "meter", "--port", str(port), "--sensor", "node-1",
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip

    def listening() -> bool:
        service.alive()
        return port_open(port)

    with service:
        wait_until(listening, 30, "the meter socket")
        with socket.create_connection(("127.0.0.1", port)) as meter:
            lines = [
                json.dumps({"timestamp": millis(q / 4), "d0c0": METER_W * 1000})
                for q in range(readings)
            ]
            meter.sendall(("\n".join(lines) + "\n").encode())
            # node and rest per interval, while the meter is still connected and silent
            service.wait_for_lines(out, 2 * (readings - 1))
            assert len(node_reports(out)["node"]) == readings - 1
            service.stop()
    reports = node_reports(out)
    assert [r["power"] for r in reports["node"]] == pytest.approx([METER_W] * (readings - 1))
    assert [r["power"] for r in reports["rest"]] == pytest.approx([METER_W] * (readings - 1))
    ends = [r["timestamp"] for r in reports["node"]]
    assert ends == sorted(set(ends)), "each interval reported once, in order"


def test_only_a_formula_with_deadlines_waits_for_its_mailbox_with_a_timeout() -> None:
    """The timer costs nothing to the formulas that hold nothing for a time: their actors read
    the mailbox as before, with no timeout, and only the node and energy formulas' are timed."""

    async def dispatch(produced: list[Report | Frame]) -> None:
        del produced

    timed = {
        name: FormulaActor(
            formula,
            formula.config_model(),
            queue=QueueConfig(),
            ledger=Ledger(),
            dead_letters=DeadLetters(),
            dispatch=dispatch,
        ).timed
        for name, formula in formulas.items()
    }
    assert {"energy", "gpu", "node", "rapl", "smartwatts"} <= set(timed)
    # the energy formula holds workloads until the stream has been silent for a time, too
    assert sorted(name for name, is_timed in timed.items() if is_timed) == ["energy", "node"]


def test_shares_of_the_targets_smartwatts_estimates_in_one_service(tmp_path: Path) -> None:
    from .test_smartwatts import START as SW_START
    from .test_smartwatts import reports_of, workload

    ticks = 16
    hwpc = write_jsonl(tmp_path / "hwpc.jsonl", reports_of(workload(ticks)))
    rows = ["timestamp,d0c0"]
    for quarter in range(4 * ticks):
        moment = SW_START + timedelta(seconds=quarter / 4)
        rows.append(f"{int(moment.timestamp() * 1000)},{METER_W * 1000}")
    meter = tmp_path / "meter.csv"
    meter.write_text("\n".join(rows) + "\n")
    out = tmp_path / "power.jsonl"
    done = wattflow(
        "run", "--node-shares", "--learn-min-samples-required", "5",
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "meter", "--files", str(meter), "--sensor", "node",
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    estimated: dict[tuple[str, str], float] = {}
    for report in written:
        if report["metadata"].get("scope") in ("cpu", "dram") and report["target"] in (
            "web", "db", "batch",
        ):  # fmt: skip
            key = (report["timestamp"], report["target"])
            estimated[key] = estimated.get(key, 0.0) + report["power"]
    shares = {
        (r["timestamp"], r["target"]): r
        for r in written
        if r["metadata"].get("scope") == "node" and r["target"] in ("web", "db", "batch")
    }
    assert len(estimated) >= 3 * 8, "SmartWatts estimated the targets"
    assert set(shares) == set(estimated)
    for key, report in shares.items():
        assert report["power"] == pytest.approx(estimated[key])
        assert report["metadata"]["ratio"] == pytest.approx(estimated[key] / METER_W)


def test_meter_readings_over_zeromq_reach_the_node_formula(tmp_path: Path) -> None:
    import zmq

    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    hwpc = write_jsonl(tmp_path / "hwpc.jsonl", [rapl(s) for s in range(4)])
    out, readings = tmp_path / "power.jsonl", tmp_path / "readings.jsonl"
    service = Service(
        tmp_path / "service.log", "run", "--disable-smartwatts-formula",
        "--node-lateness-ms", "600000",  # as above: the readings come when the test sends them
        "--input", "jsonl", "--files", str(hwpc),
        "--input", "zeromq", "--uri", uri, "--socket-type", "PULL", "--model", "MeterReport",
        "--output", "jsonl", "--file", str(out),
        "--output", "jsonl", "--model", "MeterReport", "--file", str(readings),
    )  # fmt: skip
    with service:
        context = zmq.Context()
        sender = context.socket(zmq.PUSH)
        sender.connect(uri)  # the service binds; what is sent before it listens waits here
        try:
            lines = [
                json.dumps(
                    {
                        "timestamp": millis(q / 4),
                        "sensor": "node-1",
                        "target": "all",
                        "channels": {"d0c0": METER_W * 1000},
                    }
                )
                for q in range(13)
            ]
            sender.send("\n".join(lines).encode())
            # Once the readings are recorded, they are in: the stop drains them to the formula.
            service.wait_for_lines(readings, len(lines))
            service.stop()
        finally:
            sender.close(linger=0)
            context.term()
    reports = node_reports(out)
    assert [r["power"] for r in reports["node"]] == pytest.approx([METER_W] * 3)


def test_meter_channels_from_a_flag_or_the_environment_are_comma_separated() -> None:
    """A list setting arrives as one string from a flag or a variable, as PowerAPI's lists do."""
    groups = ["--input", "meter", "--files", "m.csv", "--output", "jsonl", "--file", "o.jsonl"]
    from_flag = load_run_config([*groups, "--node-channels", "d0c0,d0c1"], {})
    from_environment = load_run_config(groups, {"WATTFLOW_NODE_CHANNELS": "d0c0, d1c0"})
    for config, expected in ((from_flag, ["d0c0", "d0c1"]), (from_environment, ["d0c0", "d1c0"])):
        node = config.formulas["node"]
        assert isinstance(node, NodeConfig)
        assert node.node_channels == expected


def node_stream(seconds: int) -> list[Report]:
    """A node's readings in time order: RAPL every second, the GPU every half second, the
    meter every quarter second, and SmartWatts-like estimates of two targets every second
    (varied, so that a reading taken twice or lost changes the figures)."""
    timed: list[tuple[float, int, Report]] = []
    for second in range(seconds + 1):
        timed.append((second, 0, rapl(second)))
        for name, watts in (("web", 10.0 + second), ("db", 30.0 - second)):
            estimate = PowerReport(
                timestamp=START + timedelta(seconds=second),
                sensor="node-1",
                target=name,
                power=watts,
                metadata={"scope": "cpu", "socket": "0"},
            )
            timed.append((second, 1, estimate))
    for half in range(2 * seconds + 1):
        timed.append((half / 2, 2, gpu(half)))
    for quarter in range(4 * seconds + 1):
        reading = MeterReport(
            timestamp=START + timedelta(seconds=quarter / 4),
            sensor="node-1",
            target="all",
            channels={"d0c0": (METER_W + quarter % 3) * 1000},
        )
        timed.append((quarter / 4, 3, reading))
    return [report for _, _, report in sorted(timed, key=lambda item: item[:2])]


def node_outputs(parts: list[list[Report]], config: NodeConfig, *, restart: bool) -> list[Any]:
    """What the node formula reports from a stream given in ``parts``, then flushed; with
    ``restart``, each part goes to a new instance restored from the last one's state, as a
    checkpoint saves and restores it (through JSON)."""
    formula = NodeFormula(config, "node-1")
    produced: list[Report | Frame] = []
    for at, part in enumerate(parts):
        if at and restart:
            saved = orjson.loads(orjson.dumps(formula.state()))
            formula = NodeFormula(config, "node-1")
            formula.restore(saved)
        out = Output()
        formula.process(part, out)
        assert not out.rejected
        produced.extend(out.items())
    out = Output()
    formula.flush(out)
    produced.extend(out.items())
    return [
        (r.timestamp, r.target, round(r.power, 9), r.metadata)
        for r in produced
        if isinstance(r, PowerReport)
    ]


def _waiting_for_every_source() -> NodeConfig:
    """The settings of a node whose inputs give the meter, RAPL, the GPUs and cpu estimates
    (as :meth:`NodeFormula.configured` finds them), none of them ever counted as quiet."""
    config = NodeConfig(node_lateness_ms=600_000, node_shares=True)
    config._sources_expected = frozenset({"meter", "rapl", "gpu", "cpu estimates"})
    return config


def _source_of(report: Report) -> str:
    return type(report).__name__


def test_the_intervals_are_the_same_whatever_order_the_sources_come_in() -> None:
    """A live node's sources come interleaved, a replay's file after file, in any order. The
    node formula reports an interval once every source came past it, in their own time, so
    every order gives the same reports, and those of the interleaved stream come as it goes,
    not only at the end."""
    config = _waiting_for_every_source()
    stream = node_stream(6)
    interleaved = node_outputs([stream], config, restart=False)
    assert len(interleaved) == 6 * 4
    draw = random.Random(7)
    kinds = sorted({_source_of(r) for r in stream})
    for order in [kinds, kinds[::-1], *(draw.sample(kinds, len(kinds)) for _ in range(4))]:
        by_source = [r for kind in order for r in stream if _source_of(r) == kind]
        assert node_outputs([by_source], config, restart=False) == interleaved, order
    formula, out = NodeFormula(config, "node-1"), Output()
    formula.process(stream, out)
    assert len([r for r in out.items() if isinstance(r, PowerReport)]) == 5 * 4, (
        "every interval but the last reported before the end (its estimates come with the next)"
    )


def test_a_source_that_starts_later_and_comes_first_loses_no_interval() -> None:
    """The GPU sampler started three seconds after hwpc-sensor and the meter, and a replay
    hands on its file, then the meter's, before hwpc-sensor's (each input a batch at a time,
    as a replay's threads deliver them). The intervals follow RAPL's ticks once they come,
    from its first: the meter's readings before the GPU's start are kept for them, not
    forgotten while the GPU's ticks led (the node's first seconds then went unreported)."""
    config = _waiting_for_every_source()
    late_start = START + timedelta(seconds=3)
    stream = [
        r for r in node_stream(8) if not (isinstance(r, GPUReport) and r.timestamp < late_start)
    ]
    interleaved = node_outputs([stream], config, restart=False)
    assert interleaved[0][0] == START + timedelta(seconds=1)
    kinds = sorted({_source_of(r) for r in stream})
    for order in itertools.permutations(kinds):
        parts = [[r for r in stream if _source_of(r) == kind] for kind in order]
        assert node_outputs(parts, config, restart=False) == interleaved, order


def test_a_lesser_sources_intervals_wait_for_the_better_sources_first_readings() -> None:
    """hwpc-sensor started after the GPU sampler and the meter. A replay hands on the GPU's
    and the meter's files, then hwpc-sensor's first tick alone (its RAPL reading only starts a
    delta), then the rest. The GPU's ticks set intervals until RAPL's take over; reported in
    between, they would be intervals of their own, without cpu or dram, that a run whose
    hwpc-sensor came first never had (the demo's second run wrote such a node report one run
    in a few). They wait for the better source instead."""
    config = _waiting_for_every_source()
    hwpc_start = START + timedelta(seconds=3)  # the GPU sampler and the meter started before
    stream = [
        r for r in node_stream(8) if not (isinstance(r, HWPCReport) and r.timestamp < hwpc_start)
    ]
    interleaved = node_outputs([stream], config, restart=False)
    rapl_ticks: list[Report] = [r for r in stream if isinstance(r, HWPCReport)]
    others = [r for r in stream if not isinstance(r, HWPCReport)]
    parts = [others, rapl_ticks[:1], rapl_ticks[1:]]
    assert node_outputs(parts, config, restart=False) == interleaved


def test_a_source_far_behind_the_others_holds_a_bounded_number_of_intervals(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A meter that keeps sending but lags ever further behind in its own time would have the
    node hold every interval since: past ``MAX_HELD_INTERVALS`` the oldest are reported without
    it (no node figure then: the meter has not covered them), and a warning says so once."""
    monkeypatch.setattr(node_formula, "MAX_HELD_INTERVALS", 3)
    formula, out = NodeFormula(_waiting_for_every_source(), "node-1"), Output()
    stream = [r for r in node_stream(8) if not isinstance(r, MeterReport)]
    with caplog.at_level(logging.WARNING):
        for report in stream:
            formula.process([report], out)
            assert len(formula.anchor_ends) <= 3 + 1
    assert [r.getMessage() for r in caplog.records].count(
        "node node-1: a source lags more than 3 intervals behind the others; the oldest "
        "intervals are reported without it"
    ) == 1
    assert not [r for r in out.items() if isinstance(r, PowerReport)], "no meter, no figure"


@pytest.mark.parametrize("lateness_ms", [0, 600_000])
def test_the_node_formula_restored_from_its_state_goes_on_as_if_never_stopped(
    lateness_ms: int,
) -> None:
    """Wherever a stream is cut, an instance restored from the state of the one before goes on
    exactly as that one would have: the same intervals with the same figures, none lost (the
    intervals held for late sources at the cut included) and none twice."""
    config = NodeConfig(node_lateness_ms=lateness_ms, node_shares=True)
    stream = node_stream(4)
    whole = node_outputs([stream], config, restart=False)
    assert {target for _, target, _, _ in whole} == {"node", "rest", "web", "db"}
    assert len(whole) == 4 * 4
    for cut in range(1, len(stream)):
        parts = [stream[:cut], stream[cut:]]
        continued = node_outputs(parts, config, restart=False)
        assert node_outputs(parts, config, restart=True) == continued, f"cut at {cut}"
        if lateness_ms:  # nothing reported before the end: the same as one batch
            assert continued == whole


@pytest.mark.parametrize("restarted_lateness_ms", ["600000", "300"])
def test_intervals_held_at_a_crash_are_reported_after_the_restart(
    tmp_path: Path, restarted_lateness_ms: str
) -> None:
    """The node formula holds each interval until every source came past it, or one quiet
    for ``--node-lateness-ms`` lets it go: an hwpc-sensor input whose RAPL readings never come
    holds them all. Killed while it holds them, after a checkpoint, and started again on the
    same ``--state-file`` with nothing more to read, it reports them at its stop, or, with a
    shorter lateness, once that has passed while every input is idle: exactly a clean run's
    reports."""
    seconds = 8
    meter = meter_csv(tmp_path / "meter.csv", seconds)
    clean_out = tmp_path / "clean.jsonl"
    clean = wattflow(
        "run", "--input", "meter", "--files", str(meter), "--sensor", "node-1",
        "--output", "jsonl", "--file", str(clean_out),
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr
    expected = node_reports(clean_out)
    assert len(expected["node"]) == 4 * seconds
    state, out = tmp_path / "state", tmp_path / "power.jsonl"
    silent = tmp_path / "hwpc.jsonl"
    silent.touch()
    args = (
        "run", "-s", "--state-file", str(state), "--state-interval-s", "0.2",
        "--node-lateness-ms", "600000",
        "--input", "meter", "--name", "meter", "--files", str(meter),
        "--poll-interval-s", "0.05", "--sensor", "node-1",
        "--input", "jsonl", "--name", "hwpc", "--files", str(silent),
        "--output", "jsonl", "--file", str(out),
    )  # fmt: skip

    def held_intervals() -> int:
        if not state.exists():
            return 0
        checkpoint = decode_checkpoint(state.read_bytes())
        assert checkpoint is not None
        node = checkpoint["formulas"].get("node", {}).get("node-1")
        return 0 if node is None else len(node["anchor_ends"]) - 1

    with Service(tmp_path / "first.log", *args) as first:
        wait_until(
            lambda: first.alive() and held_intervals() == 4 * seconds,
            60,
            "a checkpoint holding every interval",
        )
        first.process.kill()
        first.process.wait()
    assert not out.exists() or not node_reports(out), "the lateness held every interval"
    restarted = [restarted_lateness_ms if arg == "600000" else arg for arg in args]
    with Service(tmp_path / "second.log", *restarted) as second:
        second.wait_for_log("restored the state of 1 formula instances")
        if restarted_lateness_ms != "600000":  # reported by the formula's timer, no input
            second.wait_for_lines(out, 2 * 4 * seconds)
        log = second.stop()
    assert "Traceback" not in log
    assert node_reports(out) == expected


def test_other_inputs_wait_for_the_state_the_mongodb_input_restores(
    tmp_path: Path, mongodb_server: ServerProcess
) -> None:
    """With the MongoDB input in stream mode, the formulas' state lives in its checkpoint
    document, which it reads once it has reached its server. Another input (a meter here; the
    GPU samples over ZeroMQ in the compose stack) must not hand on its reports before: the
    node formula's instance would start afresh and the state saved for it be ignored. With the
    server paused while the service starts, the meter's readings wait for the restore, and the
    first of them continues the interval from the last reading before the restart."""
    uri = mongodb_uri(mongodb_server)
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    # Something for the MongoDB input to hand on (its checkpoint needs a position): containers'
    # reports, which no enabled formula takes.
    containers = [
        HWPCReport(
            timestamp=START + timedelta(seconds=s),
            sensor="node-1",
            target="web",
            groups={"core": {"0": {"0": {"CPU_CLK_THREAD_UNHALTED:REF_P": 1000}}}},
        )
        for s in range(3)
    ]
    client["powerapi"]["hwpc"].insert_many([powerapi.to_mongodb(r) for r in containers])
    common = (
        "run", "-s", "--disable-smartwatts-formula", "--disable-rapl-formula",
        "--state-interval-s", "0.2",
        "--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", "hwpc",
        "--input", "meter", "--sensor", "node-1", "--poll-interval-s", "0.05",
    )  # fmt: skip
    first_out = tmp_path / "first.jsonl"
    meter = meter_csv(tmp_path / "meter.csv", 2)  # readings 0 to 2 s
    with Service(
        tmp_path / "first.log", *common, "--files", str(meter),
        "--output", "jsonl", "--file", str(first_out),
    ) as first:  # fmt: skip
        first.wait_for_lines(first_out, 2 * 8)  # node and rest of 8 intervals
        first.stop()

    later = tmp_path / "later.csv"  # readings after 2 s: 2.25 s to 4 s
    rows = [f"{millis(2 + q / 4)},{METER_W * 1000},0" for q in range(1, 9)]
    later.write_text("timestamp,d0c0,d0c1\n" + "\n".join(rows) + "\n")
    out = tmp_path / "second.jsonl"
    config = load_run_config(
        [*common[1:], "--files", str(later), "--output", "jsonl", "--file", str(out)]
    )

    async def second_run() -> None:
        pipeline = assemble(config)
        meter_input = next(a.emitter for a in pipeline.pullers if a.puller.config.type == "meter")
        assert mongodb_server.process is not None
        os.killpg(mongodb_server.process.pid, signal.SIGSTOP)
        try:
            running = asyncio.ensure_future(pipeline.run())
            async with asyncio.timeout(60):
                while not (meter_input.pending or meter_input.emitted):
                    await asyncio.sleep(0.01)
        finally:
            os.killpg(mongodb_server.process.pid, signal.SIGCONT)
        async with asyncio.timeout(60):
            while meter_input.emitted < len(rows):
                assert not running.done(), running.result()
                await asyncio.sleep(0.01)
        pipeline.stop()  # the drain reports what the node formula holds
        result = await running
        assert result.ok, result.failures

    try:
        run_async(second_run())
    finally:
        client.close()
    reports = node_reports(out)
    ends = [datetime.fromisoformat(r["timestamp"]).replace(tzinfo=UTC) for r in reports["node"]]
    assert ends == [START + timedelta(seconds=2 + q / 4) for q in range(1, 9)], (
        "the first reading after the restart continues the last one before it"
    )


def test_estimates_of_intervals_without_a_meter_reading_are_not_kept() -> None:
    """A meter that sends nothing (down, or not yet connected) leaves the node's intervals
    without a figure: they pass unreported, and the targets' estimates waiting for them go
    with them rather than pile up in memory and in every checkpoint."""
    formula = NodeFormula(NodeConfig(node_lateness_ms=0, node_shares=True), "node-1")
    without_meter = [r for r in node_stream(60) if not isinstance(r, MeterReport)]
    out = Output()
    for report in without_meter:
        formula.process([report], out)
    assert not out.reports
    assert not out.rejected
    assert len(formula.state()["targets"]) <= 1


def test_gpu_power_read_every_tick_and_its_counter_every_2_s_give_one_series() -> None:
    """The NVML input's stream: power every 100 ms tick, the energy counter every 20th tick.
    The node formula takes each tick's own power (the GPU formula's definition) and never
    mixes a counter reading with a power reading (it took 12,500 W of GPU at every counter
    reading, a rest of -12,500 W); a recording with the counter on every tick uses it."""
    from wattflow.formats.reports import GPUDevice, GPUReport, MeterReport, PowerReport

    start = datetime(2026, 3, 1, tzinfo=UTC)

    def stream(counter_every: int) -> list[PowerReport]:
        formula = NodeFormula(NodeConfig(node_lateness_ms=0), "node-1")
        out = Output()
        reports: list[Any] = []
        energy_mj = 1_000_000.0
        for tick in range(1, 61):
            stamp = start + timedelta(milliseconds=100 * tick)
            energy_mj += 300.0 * 100  # 300 W over 100 ms
            readings: dict[str, Any] = {"power": 300_000.0}
            if tick % counter_every == 0:
                readings["total_energy"] = energy_mj
            reports.append(GPUReport(timestamp=stamp, sensor="node-1", target="all",
                                     devices={"0": GPUDevice(**readings)}))  # fmt: skip
            reports.append(MeterReport(timestamp=stamp, sensor="node-1", target="all",
                                       channels={"d0c0": 500_000.0}))  # fmt: skip
        formula.process(reports, out)
        formula.flush(out)
        return [r for r in out.reports if isinstance(r, PowerReport) and r.target == "rest"]

    for counter_every in (20, 1):
        rests = stream(counter_every)
        assert len(rests) >= 55, counter_every
        assert all(r.power == pytest.approx(200.0) for r in rests), counter_every


def test_a_source_that_starts_or_stops_inside_an_interval_counts_for_what_it_covers() -> None:
    """At a stream's edges the sources' ticks do not meet: here the GPU sampler reads at the
    half seconds, from 0.5 s to 9.5 s, and hwpc-sensor's last tick is a millisecond late
    (10.001 s). The first and last intervals count the GPU energy measured in them, and only
    the part no reading covers is in the rest: leaving the GPU out of an interval would put
    the energy it did measure in the rest as well as in the GPU's targets (the energy
    formula's records), counting it twice."""
    formula = NodeFormula(NodeConfig(node_lateness_ms=0), "node-1")
    timed: list[tuple[float, Report]] = [(s, rapl(s)) for s in range(10)]
    last = rapl(10).model_copy(update={"timestamp": START + timedelta(seconds=10.001)})
    timed.append((10.001, last))
    for half in range(1, 20, 2):
        reading = GPUDevice(power=GPU_W * 1000)
        stamp = START + timedelta(seconds=half / 2)
        timed.append((half / 2, GPUReport(timestamp=stamp, sensor="node-1", target="all",
                                          devices={"0": reading})))  # fmt: skip
    for quarter in range(42):
        stamp = START + timedelta(seconds=quarter / 4)
        timed.append((quarter / 4, MeterReport(timestamp=stamp, sensor="node-1", target="all",
                                               channels={"d0c0": METER_W * 1000})))  # fmt: skip
    out = Output()
    formula.process([report for _, report in sorted(timed, key=lambda pair: pair[0])], out)
    formula.flush(out)
    nodes = [r for r in out.reports if isinstance(r, PowerReport) and r.target == "node"]
    rests = [r for r in out.reports if isinstance(r, PowerReport) and r.target == "rest"]
    assert len(nodes) == len(rests) == 10
    gpu_w = [node.metadata["gpu"] for node in nodes]
    # (0, 1]: measured from 0.5 s; (9, 10.001]: until 9.5 s; every interval between, whole
    assert gpu_w[0] == pytest.approx(GPU_W * 0.5)
    assert gpu_w[1:-1] == pytest.approx([GPU_W] * 8)
    assert gpu_w[-1] == pytest.approx(GPU_W * 0.5 / 1.001, abs=1e-6)
    for node, rest in zip(nodes, rests, strict=True):
        parts = sum(node.metadata[scope] for scope in ("cpu", "dram", "gpu"))
        assert rest.power == pytest.approx(node.power - parts, abs=1e-5)
    assert rests[4].power == pytest.approx(REST_W)


def _node_ends_after(batches: list[list[Report]]) -> list[float]:
    """The seconds (since START) at which the node's reports end, from a node formula that
    waits for no quiet source (``--node-lateness-ms 0``, as a live run long past its start)
    and is given ``batches`` one after the other, then flushed."""
    config = NodeConfig(node_lateness_ms=0)
    config._sources_expected = frozenset({"meter", "rapl"})
    formula, out = NodeFormula(config, "node-1"), Output()
    for batch in batches:
        formula.process(batch, out)
    formula.flush(out)
    return [
        (r.timestamp - START).total_seconds()
        for r in out.items()
        if isinstance(r, PowerReport) and r.target == "node"
    ]


def _meter(quarters: range) -> list[Report]:
    return [
        MeterReport(
            timestamp=START + timedelta(seconds=quarter / 4),
            sensor="node-1",
            target="all",
            channels={"d0c0": METER_W * 1000},
        )
        for quarter in quarters
    ]


@pytest.mark.parametrize(
    ("first_rapl_s", "case"),
    [(7, "hwpc-sensor started a second after the last interval reported"), (3, "behind it")],
)
def test_a_better_source_that_starts_late_takes_over_where_the_reports_are(
    first_rapl_s: int, case: str
) -> None:
    """The meter ran alone long enough for the node's intervals to be reported by its
    readings (0 to 6 s); then hwpc-sensor's ticks come and set the intervals. They go on from
    the last interval reported, through the meter's held ones, so that the node's reports tile
    the time: before, the meter's held intervals were dropped (no report of 6 to 7 s). With
    hwpc-sensor's first ticks behind what was reported, none of that time is reported again."""
    alone = _meter(range(0, 25))
    together = sorted(
        [*_meter(range(25, 49)), *(rapl(second) for second in range(first_rapl_s, 13))],
        key=lambda report: report.timestamp,
    )
    ends = _node_ends_after([alone, together])
    assert ends[:24] == [quarter / 4 for quarter in range(1, 25)], case
    steps = [later - earlier for earlier, later in itertools.pairwise(ends)]
    assert all(0 < step <= 1 for step in steps), (case, ends)
    assert ends[-1] == 12, case
