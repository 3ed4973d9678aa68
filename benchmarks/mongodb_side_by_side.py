"""wattflow beside SmartWatts 2.4.1 on the same MongoDB input, writing to MongoDB (and InfluxDB).

For each number of containers, a recording from ``generate_hwpc.py`` is inserted into a MongoDB
server (SecantusDB, started here on a free port) the way hwpc-sensor stores it: BSON dates and
double counters. Then, on that one collection:

- SmartWatts reads it (``--input mongodb``, not in stream mode, so the collection is kept) and
  writes PowerReports to MongoDB;
- wattflow does the same with the same flags, pinned to one core;
- wattflow writes to InfluxDB 1.x instead, when ``influxd`` is installed (Debian's influxdb);
- SmartWatts in stream mode (``-s``) is timed until it has consumed a copy of the collection:
  PowerAPI's stream mode deletes every document it reads, one round trip each.

Throughput is input reports per second, each tool's start-up (timed on a one-tick collection)
left out. The MongoDB server runs on the same two cores, so both tools pay for it alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from pymongo import MongoClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_hwpc import record
from side_by_side import SMARTWATTS_VENV, smartwatts_python

FORMULA_FLAGS = [
    "--cpu-base-freq", "2100", "--cpu-tdp", "400", "--sensor-reports-frequency", "1000",
    "--learn-min-samples-required", "10", "--learn-history-window-size", "60",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on port {port} after {timeout_s} s")


def hwpc_sensor_document(line: bytes) -> dict[str, Any]:
    """A generated report as hwpc-sensor's MongoDB output stores it."""
    document: dict[str, Any] = orjson.loads(line)
    document["timestamp"] = datetime.fromisoformat(document["timestamp"]).replace(tzinfo=UTC)
    for sockets in document["groups"].values():
        for cpus in sockets.values():
            for events in cpus.values():
                for name, value in events.items():
                    events[name] = float(value)
    return document


def load(client: MongoClient[dict[str, Any]], name: str, jsonl: Path) -> int:
    """Insert a recording into ``bench.<name>``; return how many documents it holds."""
    collection = client["bench"][name]
    collection.drop()
    batch: list[dict[str, Any]] = []
    count = 0
    with jsonl.open("rb") as lines:
        for line in lines:
            batch.append(hwpc_sensor_document(line))
            if len(batch) == 5000:
                collection.insert_many(batch)
                count += len(batch)
                batch = []
    if batch:
        collection.insert_many(batch)
        count += len(batch)
    return count


def timed(command: list[str], log: Path) -> float:
    """Run a command to its end; return its wall time."""
    started = time.perf_counter()
    with log.open("w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=ENV)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{log.read_text()[-3000:]}")
    return wall


ENV = {**os.environ, "TZ": "UTC"}


def smartwatts(python: Path, uri: str, source: str, target: str, *extra: str) -> list[str]:
    return [
        str(python), "-m", "smartwatts", *extra,
        "--input", "mongodb", "-u", uri, "-d", "bench", "-c", source,
        "--output", "mongodb", "-u", uri, "-d", "bench", "-c", target, *FORMULA_FLAGS,
    ]  # fmt: skip


def wattflow(uri: str, source: str, output: list[str]) -> list[str]:
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    return [
        *pin, sys.executable, "-m", "wattflow.service", "run",
        "--input", "mongodb", "-u", uri, "-d", "bench", "-c", source, *output, *FORMULA_FLAGS,
    ]  # fmt: skip


def start_influxd(work: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    """Debian's influxd on free ports in a scratch directory, or None where it is missing."""
    if shutil.which("influxd") is None:
        return None
    http, rpc = free_port(), free_port()
    config = work / "influxdb.conf"
    config.write_text(
        f'reporting-disabled = true\nbind-address = "127.0.0.1:{rpc}"\n'
        f'[meta]\n  dir = "{work}/influx/meta"\n'
        f'[data]\n  dir = "{work}/influx/data"\n  wal-dir = "{work}/influx/wal"\n'
        f'[http]\n  bind-address = "127.0.0.1:{http}"\n  log-enabled = false\n'
    )
    process = subprocess.Popen(
        ["influxd", "-config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_port(http)
    return process, http


def stream_consumption(
    python: Path, uri: str, client: MongoClient[Any], name: str, window_s: float
) -> float:
    """Documents per second SmartWatts' stream mode consumes (deletes) from a copy, measured
    over at most ``window_s`` seconds (it is slow enough that a whole copy can take hours)."""
    copy = f"{name}_consumed"
    client["bench"][copy].drop()
    client["bench"][name].aggregate([{"$match": {}}, {"$out": copy}])
    total = client["bench"][copy].count_documents({})
    if total == 0:  # no $out on this server: copy by hand
        client["bench"][copy].insert_many(list(client["bench"][name].find({}, {"_id": 0})))
    process = subprocess.Popen(
        smartwatts(python, uri, copy, f"{name}_sw_stream", "-s"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,
    )
    total = client["bench"][copy].count_documents({})
    time.sleep(10)  # its start-up, left out as for the other runs
    before = client["bench"][copy].count_documents({})
    started = time.perf_counter()
    try:
        left = before
        while left > 0 and time.perf_counter() - started < window_s:
            if process.poll() is not None:
                raise SystemExit("SmartWatts' stream mode ended before consuming its input")
            time.sleep(0.5)
            left = client["bench"][copy].count_documents({})
        elapsed = time.perf_counter() - started
        assert total >= before
        return (before - left) / elapsed
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--containers", default="10,25,50,100")
    parser.add_argument("--no-stream", action="store_true", help="skip SmartWatts' stream mode")
    parser.add_argument(
        "--stream-window", type=float, default=30.0, help="seconds to time SmartWatts' -s mode"
    )
    parser.add_argument("--venv", type=Path, default=SMARTWATTS_VENV)
    args = parser.parse_args()
    python = smartwatts_python(args.venv)
    work = Path(tempfile.mkdtemp(prefix="wattflow-mongodb-bench-"))
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "secantus",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--storage-path",
            str(work / "mongodb"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    influxd = start_influxd(work)
    try:
        wait_for_port(port)
        uri = f"mongodb://127.0.0.1:{port}/"
        client: MongoClient[dict[str, Any]] = MongoClient(uri)
        record(ticks=1, containers=2, jsonl=work / "tiny.jsonl")
        load(client, "tiny", work / "tiny.jsonl")
        startup = {
            "SmartWatts": statistics.median(
                timed(smartwatts(python, uri, "tiny", "tiny_sw"), work / "startup-sw.log")
                for _ in range(3)
            ),
            "wattflow": statistics.median(
                timed(
                    wattflow(
                        uri,
                        "tiny",
                        ["--output", "mongodb", "-u", uri, "-d", "bench", "-c", "tiny_wf"],
                    ),
                    work / "startup-wf.log",
                )
                for _ in range(3)
            ),
        }
        print(
            f"MongoDB: SecantusDB on loopback; InfluxDB: {'influxd' if influxd else 'absent'}; "
            f"start-up SmartWatts {startup['SmartWatts']:.2f} s, "
            f"wattflow {startup['wattflow']:.2f} s (left out below)"
        )
        print(
            f"{'containers':>10} {'reports':>8} {'SW rep/s':>9} {'SW -s rep/s':>11} "
            f"{'wf→mongo':>9} {'wf→influx':>9} {'ratio':>6} {'vs -s':>7} {'SW wall':>8} "
            f"{'wf wall':>8} {'SW out':>7} {'wf out':>7}"
        )
        for containers in (int(c) for c in args.containers.split(",")):
            name = f"hwpc_{containers}"
            record(ticks=args.ticks, containers=containers, jsonl=work / f"{name}.jsonl")
            reports = load(client, name, work / f"{name}.jsonl")
            sw_wall = timed(smartwatts(python, uri, name, f"{name}_sw"), work / f"{name}-sw.log")
            sw_working = sw_wall - startup["SmartWatts"]
            # Its start-up varies by seconds: a run not clearly longer cannot be timed.
            sw_rate = reports / sw_working if sw_working > 1.0 else float("nan")
            to_mongo = ["--output", "mongodb", "-u", uri, "-d", "bench", "-c", f"{name}_wf"]
            wf_wall = timed(wattflow(uri, name, to_mongo), work / f"{name}-wf.log")
            wf_rate = reports / max(wf_wall - startup["wattflow"], 1e-9)
            influx_rate = float("nan")
            if influxd is not None:
                to_influx = [
                    "--output", "influxdb", "--uri", f"http://127.0.0.1:{influxd[1]}",
                    "--db", f"bench_{containers}",
                ]  # fmt: skip
                influx_wall = timed(wattflow(uri, name, to_influx), work / f"{name}-influx.log")
                influx_rate = reports / max(influx_wall - startup["wattflow"], 1e-9)
            stream_rate = float("nan")
            if not args.no_stream:
                stream_rate = stream_consumption(python, uri, client, name, args.stream_window)
            sw_out = client["bench"][f"{name}_sw"].count_documents({})
            wf_out = client["bench"][f"{name}_wf"].count_documents({})
            versus_stream = wf_rate / stream_rate if stream_rate > 0 else float("inf")
            print(
                f"{containers:>10} {reports:>8} {sw_rate:>9.0f} {stream_rate:>11.1f} "
                f"{wf_rate:>9.0f} {influx_rate:>9.0f} {wf_rate / sw_rate:>5.1f}× "
                f"{versus_stream:>6.0f}× {sw_wall:>7.1f}s {wf_wall:>7.1f}s {sw_out:>7} {wf_out:>7}",
                flush=True,
            )
        print(
            "ratio: wattflow→MongoDB over SmartWatts→MongoDB, both reading the collection once "
            "(both bound by the server's writes); vs -s: wattflow over SmartWatts' stream mode, "
            "which deletes each document it reads (wattflow's stream mode reads a backlog the "
            "same way as a single read). At one tick per second a sensor with N containers "
            "sends N+1 reports/s."
        )
        print(f"logs in {work}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        if influxd is not None:
            os.killpg(influxd[0].pid, signal.SIGTERM)
            influxd[0].wait()


if __name__ == "__main__":
    main()
