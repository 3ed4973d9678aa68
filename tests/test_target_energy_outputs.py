"""Every output writes a workload's energy record (``TargetEnergyReport``), read back from the
real thing: documents from a MongoDB-wire server, points from InfluxDB 1.x and from
VictoriaMetrics (InfluxDB 2's write API), messages from a real ZeroMQ socket decoded by
wattflow's own input, lines of JSON Lines, rows of wattflow's CSV layout, and series a real
Prometheus server scrapes. The records are the energy formula's own, made from named
PowerReports of a shared node (a Slurm job's CPU, DRAM and GPU cgroups, a pod's container, a
GPU's idle target)."""

from __future__ import annotations

import asyncio
import csv
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families
from pymongo import MongoClient

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.energy import EnergyConfig, EnergyFormula
from wattflow.actors.naming import TargetNaming
from wattflow.actors.pullers.zeromq import ZeroMQPuller, ZeroMQPullerConfig
from wattflow.actors.pushers.base import Pusher
from wattflow.actors.pushers.csv import CsvPusher, CsvPusherConfig
from wattflow.actors.pushers.influxdb import InfluxDBPusher, InfluxDBPusherConfig, query
from wattflow.actors.pushers.influxdb2 import InfluxDB2Pusher, InfluxDB2PusherConfig
from wattflow.actors.pushers.jsonl import JsonlPusher, JsonlPusherConfig
from wattflow.actors.pushers.mongodb import MongoDBPusher, MongoDBPusherConfig
from wattflow.actors.pushers.zeromq import ZeroMQPusher, ZeroMQPusherConfig
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report, TargetEnergyReport, to_millis
from wattflow.formats.targets import LABEL_KEYS

from .conftest import Service, run_async, wait_until, wattflow
from .servers import ServerProcess, free_port, mongodb_uri
from .servers_influx import influx_uri
from .servers_prometheus import PrometheusServer, promtool_check_metrics, scrape
from .test_prometheus import Exposed
from .test_target_energy import DEMO, shared_node_recordings
from .test_zeromq import Collector, eventually, pulling, until_subscribed

START = datetime(2026, 5, 4, 8, 0, tzinfo=UTC)
JOB = "/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0"
JOB_GPU = "/system.slice/slurmstepd.scope/job_4242/step_0/user/task_1"
POD = (
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod435532e3_546d_45e2_8862_"
    "d3c7b320d2d9.slice/cri-containerd-" + "7c" * 32 + ".scope"
)
"""A pod's container whose cgroup stops reporting after 4 s: it ends (silent) mid-stream."""


def _power(second: float, target: str, scope: str, watts: float) -> PowerReport:
    return PowerReport(
        timestamp=START + timedelta(seconds=second),
        sensor="node-7",
        target=target,
        power=watts,
        metadata={"scope": scope, "socket": 0, "formula": "f", "ratio": 0.5},
    )


def records() -> list[TargetEnergyReport]:
    """The energy formula's records of 12 s of a shared node: the pod (ended, silent), then at
    the stop the Slurm job (cpu, dram, gpu over two cgroups) and the GPU's own target."""
    formula = EnergyFormula(EnergyConfig(target_energy=True, target_end_silence_s=3), "node-7")
    naming = TargetNaming()
    out = Output()
    for tick in range(12):
        second = tick + 0.001 * (tick % 3)  # ticks a millisecond or two late, as a sensor's
        tick_reports = [
            _power(second, JOB, "cpu", 21.5 + tick),
            _power(second, JOB, "dram", 3.25),
            _power(second, JOB_GPU, "gpu", 140.0 + 0.5 * tick),
            _power(second, "gpu0", "gpu", 61.75),
        ]
        if tick < 4:
            tick_reports.append(_power(second, POD, "cpu", 7.125))
        named = [r for r in naming(tick_reports) if isinstance(r, Report)]
        formula.process(named, out)
    formula.flush(out)
    assert not out.rejected
    found = [r for r in out.items() if isinstance(r, TargetEnergyReport)]
    assert [(r.target, r.reason) for r in found] == [
        ("pod/435532e3-546d-45e2-8862-d3c7b320d2d9/" + "7c" * 32, "silent"),
        ("gpu0", "running"),  # those still running at the stop, by name
        ("slurm/4242", "running"),
    ]
    pod, gpu, job = found
    return [pod, job, gpu]


def write(pusher: Pusher[Any], *batches: list[TargetEnergyReport]) -> list[tuple[Report, str]]:
    """Open the output, write each batch, close it: what its actor does."""

    async def go() -> list[tuple[Report, str]]:
        await pusher.check()
        await pusher.open()
        refused: list[tuple[Report, str]] = []
        try:
            for batch in batches:
                refused += await pusher.write(list(batch))
        finally:
            await pusher.close()
        return refused

    return run_async(go())


def test_the_records_are_the_energy_of_each_workload() -> None:
    """What the other tests read back: each record's figures, worked out by hand."""
    pod, job, gpu = records()
    assert pod.energy == {"cpu": pytest.approx(7.125 * 3.0), "dram": 0.0, "gpu": 0.0}
    assert (pod.start, pod.end) == (START, START + timedelta(seconds=3))  # its first tick's start
    cpu = sum(
        (21.5 + t) * (t + 0.001 * (t % 3) - (t - 1) - 0.001 * ((t - 1) % 3)) for t in range(1, 12)
    )
    assert job.energy["cpu"] == pytest.approx(cpu)
    assert job.energy["dram"] == pytest.approx(3.25 * 11.002)
    assert job.metadata["slurm_job"] == "4242"
    assert gpu.metadata == {}  # a GPU's own target names no workload


# --- JSON Lines and CSV ------------------------------------------------------------------------


def test_json_lines_hold_each_record_as_it_was_made(tmp_path: Path) -> None:
    made = records()
    path = tmp_path / "energy.jsonl"
    pusher = JsonlPusher(JsonlPusherConfig(model="TargetEnergyReport", file=path))
    assert write(pusher, made[:1], made[1:]) == []
    lines = path.read_text().splitlines()
    read = [
        powerapi.decode_json(TargetEnergyReport, line, str(path), n)
        for n, line in enumerate(lines, 1)
    ]
    assert read == made


def csv_records(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_csv_writes_one_file_per_sensor_in_wattflows_own_layout(tmp_path: Path) -> None:
    made = records()
    pusher = CsvPusher(CsvPusherConfig(model="TargetEnergyReport", directory=tmp_path))
    # the GPU's record (no names) first: the header has the names' columns whatever comes first
    assert write(pusher, [made[2]], made[:2]) == []
    path = tmp_path / "node-7" / "TargetEnergyReport.csv"
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*.csv")] == [
        path.relative_to(tmp_path)
    ]
    header = path.read_text().splitlines()[0].split(",")
    assert header == [
        "timestamp", "sensor", "target", "start", "end", "cpu_j", "dram_j", "gpu_j", "reason",
        *LABEL_KEYS,
    ]  # fmt: skip
    rows = csv_records(path)
    assert [row["target"] for row in rows] == [made[2].target, made[0].target, made[1].target]
    for row, record in zip(rows, [made[2], *made[:2]], strict=True):
        assert int(row["timestamp"]) == to_millis(record.timestamp)
        assert (int(row["start"]), int(row["end"])) == (
            to_millis(record.start),
            to_millis(record.end),
        )
        assert {s: float(row[f"{s}_j"]) for s in ("cpu", "dram", "gpu")} == record.energy
        assert row["reason"] == record.reason
        assert {k: row[k] for k in LABEL_KEYS} == {
            k: record.metadata.get(k, "") for k in LABEL_KEYS
        }
    # a record whose names the file has no column for is refused, not written askew
    odd = made[1].model_copy(update={"metadata": {**made[1].metadata, "k8s_namespace": "hpc"}})
    again = CsvPusher(CsvPusherConfig(model="TargetEnergyReport", directory=tmp_path))
    (refused,) = write(again, [odd])
    assert "metadata ['k8s_namespace'] has no column" in refused[1]
    assert len(csv_records(path)) == 3


def test_the_command_takes_csv_and_prometheus_outputs_of_records(tmp_path: Path) -> None:
    source = tmp_path / "records.jsonl"
    source.write_text("".join(powerapi.encode_json(r) + "\n" for r in records()))
    done = wattflow(
        "run", "--input", "jsonl", "--model", "TargetEnergyReport", "--files", str(source),
        "--output", "csv", "--model", "TargetEnergyReport", "--directory", str(tmp_path / "csv"),
        "--output", "prometheus", "--model", "TargetEnergyReport", "--port", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(csv_records(tmp_path / "csv" / "node-7" / "TargetEnergyReport.csv")) == 3
    refused = wattflow(
        "run", "--input", "jsonl", "--model", "TargetEnergyReport", "--files", str(source),
        "--output", "csv", "--model", "GPUReport",
    )  # fmt: skip
    assert refused.returncode == 2
    assert "no CSV layout with columns for GPUReport" in refused.stderr


# --- MongoDB, InfluxDB 1.x and 2 -----------------------------------------------------------------


def test_mongodb_holds_one_document_per_record(mongodb_server: ServerProcess) -> None:
    made = records()
    config = MongoDBPusherConfig(
        model="TargetEnergyReport", uri=mongodb_uri(mongodb_server), db="hpc", collection="jobs"
    )
    # the second write is a retry of the first record, as after a timeout: nothing is added
    assert write(MongoDBPusher(config), made, made[:1]) == []
    client: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri(mongodb_server))
    try:
        documents = list(client["hpc"]["jobs"].find().sort("target", 1))
    finally:
        client.close()
    assert len(documents) == 3
    job = next(d for d in documents if d["target"] == "slurm/4242")
    assert list(job) == [
        "_id", "timestamp", "sensor", "target", "metadata", "start", "end", "energy", "reason",
    ]  # fmt: skip
    read = [powerapi.from_mongodb(TargetEnergyReport, d) for d in documents]
    assert sorted(read, key=lambda r: r.target) == sorted(made, key=lambda r: r.target)


def test_influxdb_holds_a_target_energy_point_per_record(influxdb_server: ServerProcess) -> None:
    made = records()
    uri = influx_uri(influxdb_server)
    config = InfluxDBPusherConfig(model="TargetEnergyReport", uri=uri, db="hpc")
    assert write(InfluxDBPusher(config), made) == []
    rows = {row["target"]: row for row in query(uri, "hpc", "SELECT * FROM target_energy")}
    assert set(rows) == {r.target for r in made}
    for record in made:
        row = rows[record.target]
        assert row["time"] == to_millis(record.timestamp)
        assert {s: row[f"{s}_j"] for s in ("cpu", "dram", "gpu")} == pytest.approx(record.energy)
        assert row["start_ms"] == to_millis(record.start)
        assert row["duration_s"] == (record.end - record.start).total_seconds()
        assert (row["sensor"], row["reason"]) == ("node-7", record.reason)
    assert rows["slurm/4242"]["slurm_job"] == "4242"
    per_job = query(uri, "hpc", "SELECT sum(cpu_j) FROM target_energy GROUP BY slurm_job")
    assert {row.get("slurm_job", "") for row in per_job} == {"", "4242"}


def test_influxdb2s_write_api_takes_the_records(
    victoria_metrics_server: ServerProcess, tmp_path: Path
) -> None:
    made = records()
    uri = influx_uri(victoria_metrics_server)
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    config = InfluxDB2PusherConfig(
        model="TargetEnergyReport", uri=uri, org="hpc", db="jobs", token_file=token
    )
    assert write(InfluxDB2Pusher(config), made) == []
    urllib3.request("GET", f"{uri}/internal/force_flush")
    response = urllib3.request(
        "GET", f"{uri}/api/v1/export", fields={"match[]": '{__name__="target_energy_gpu_j"}'}
    )
    series = [orjson.loads(line) for line in response.data.splitlines()]
    by_target = {s["metric"]["target"]: s for s in series}
    assert set(by_target) == {r.target for r in made}
    for record in made:
        found = by_target[record.target]
        assert found["values"] == [pytest.approx(record.energy["gpu"])]
        assert found["timestamps"] == [to_millis(record.timestamp)]
        assert found["metric"]["reason"] == record.reason
    assert by_target["slurm/4242"]["metric"]["target_kind"] == "slurm_job"


# --- ZeroMQ ------------------------------------------------------------------------------------


def test_zeromq_carries_records_to_wattflows_own_input() -> None:
    made = records()
    uri = f"tcp://127.0.0.1:{free_port()}"
    pusher = ZeroMQPusher(ZeroMQPusherConfig(model="TargetEnergyReport", uri=[uri]))
    puller = ZeroMQPuller(ZeroMQPullerConfig(model="TargetEnergyReport", uri=[uri]))
    collector = Collector()
    warm_up = made[2].model_copy(update={"target": "warm-up"})

    async def go() -> None:
        await pusher.check()
        await pusher.open()
        async with pulling(puller, collector):
            await until_subscribed(lambda: pusher.write([warm_up]), collector)
            await pusher.write(list(made))
            await eventually(lambda: len(collector.received()) >= len(made), "3 records")
        await pusher.close()

    run_async(go())
    assert collector.received() == made
    assert collector.rejected == []


# --- Prometheus --------------------------------------------------------------------------------


Sample = tuple[str, tuple[tuple[str, str], ...]]


def samples(text: str) -> dict[Sample, float]:
    """Each sample by its name and its non-empty labels."""
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def expected_samples(made: list[TargetEnergyReport]) -> dict[Sample, float]:
    found: dict[Sample, float] = {}
    for record in made:
        names = {k: str(v) for k, v in record.metadata.items() if k in LABEL_KEYS and v}
        labels = {"sensor": record.sensor, "target": record.target, **names}
        for scope, joules in record.energy.items():
            key = tuple(sorted({**labels, "scope": scope}.items()))
            found["wattflow_target_energy_joules_total", key] = joules
        key = tuple(sorted(labels.items()))
        found["wattflow_target_start_timestamp_seconds", key] = record.start.timestamp()
        found["wattflow_target_end_timestamp_seconds", key] = record.end.timestamp()
    return found


def test_prometheus_exposes_ended_workloads_beside_the_power_series() -> None:
    made = records()

    async def go() -> str:
        async with Exposed() as out:
            assert out.pusher.accepts("PowerReport")
            assert out.pusher.accepts("TargetEnergyReport")
            assert await out.pusher.write([_power(0, "web", "cpu", 4.0), *made]) == []
            return scrape(out.url)

    text = run_async(go())
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""
    found = samples(text)
    ended = {key: value for key, value in found.items() if key[0].startswith("wattflow_target_")}
    assert ended == pytest.approx(expected_samples(made))
    assert any(key[0] == "wattflow_power_watts" for key in found)
    assert "reason" not in text  # a workload's series are one, whatever it ended for


def test_a_second_record_of_a_workload_adds_to_its_counter() -> None:
    """A workload evicted and seen again, or one whose name comes back: the counter only goes
    up, and the span covers both records."""
    job = records()[1]
    later = job.model_copy(
        update={
            "start": job.end + timedelta(seconds=60),
            "end": job.end + timedelta(seconds=90),
            "timestamp": job.end + timedelta(seconds=90),
        }
    )

    async def go() -> str:
        async with Exposed(model="TargetEnergyReport") as out:
            assert not out.pusher.accepts("PowerReport")
            assert await out.pusher.write([job]) == []
            assert await out.pusher.write([later]) == []
            return scrape(out.url)

    found = samples(run_async(go()))
    assert not any(key[0].startswith("wattflow_power") for key in found)
    cpu = [
        v for k, v in found.items() if k[0].endswith("joules_total") and ("scope", "cpu") in k[1]
    ]
    assert cpu == [pytest.approx(2 * job.energy["cpu"])]
    (end,) = [v for k, v in found.items() if k[0] == "wattflow_target_end_timestamp_seconds"]
    (start,) = [v for k, v in found.items() if k[0] == "wattflow_target_start_timestamp_seconds"]
    assert (start, end) == (job.start.timestamp(), later.end.timestamp())


async def _wait(ready: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await ready():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not after {timeout_s} s"
        await asyncio.sleep(0.05)


def test_ended_workloads_expire_as_the_power_series_do() -> None:
    made = records()

    async def go() -> tuple[dict[Sample, float], dict[Sample, float]]:
        async with Exposed(series_expiry_s=0.5) as out:
            assert await out.pusher.write(list(made)) == []
            before = samples(scrape(out.url))
            second = 0

            async def only_the_power_left() -> bool:
                nonlocal second
                await out.pusher.write([_power(second, "web", "cpu", 4.0)])
                second += 1
                return not any(
                    k[0].startswith("wattflow_target_") for k in samples(scrape(out.url))
                )

            await _wait(only_the_power_left, 20, "the records' series to expire")
            return before, samples(scrape(out.url))

    before, after = run_async(go(), timeout_s=40)
    assert sum(k[0] == "wattflow_target_energy_joules_total" for k in before) == 9
    assert any(k[0] == "wattflow_power_watts" for k in after)
    assert len(after) == 2  # the one power series' gauge and counter


def test_max_series_counts_the_ended_workloads_too() -> None:
    made = records()

    async def go() -> list[tuple[Report, str]]:
        async with Exposed(max_series=2) as out:
            return await out.pusher.write(list(made))

    refused = run_async(go())
    assert [r.target for r, _ in refused] == ["gpu0"]
    assert "--max-series 2" in refused[0][1]


def test_a_prometheus_server_scrapes_each_jobs_energy(prometheus_server: Any) -> None:
    made = records()

    async def go() -> list[dict[str, Any]]:
        async with Exposed() as out:
            assert await out.pusher.write(list(made)) == []
            server: PrometheusServer = await asyncio.to_thread(
                prometheus_server, [f"127.0.0.1:{out.pusher.port}"]
            )
            promql = "sum by (slurm_job) (wattflow_target_energy_joules_total)"

            def answered() -> bool:
                return len(server.query(promql)) == 2

            await asyncio.to_thread(wait_until, answered, 30, "Prometheus to scrape the records")
            return server.query(promql)

    result = run_async(go(), timeout_s=90)
    by_job = {e["metric"].get("slurm_job", ""): float(e["value"][1]) for e in result}
    job = made[1]
    assert by_job["4242"] == pytest.approx(sum(job.energy.values()), rel=1e-9)
    others = sum(sum(r.energy.values()) for r in made if r is not job)
    assert by_job[""] == pytest.approx(others, rel=1e-9)


# --- through the service ----------------------------------------------------------------------


def test_the_service_serves_a_jobs_record_and_keeps_them_all_in_a_mongodb_run_store(
    tmp_path: Path, mongodb_server: ServerProcess
) -> None:
    """The shared node's recordings followed by ``wattflow run -s``: the records reach the
    Prometheus output beside the power (no ``--model`` given to it) as soon as the energy
    formula makes them, while the service runs; at the stop the MongoDB run store holds them
    all, and ``wattflow runs energy`` lists them as the JSON Lines output wrote them.

    The files are read at full speed, the GPU's ahead of hwpc-sensor's, and SmartWatts'
    first reports come after its model has learned: a job whose GPU work ends before then
    may end in the GPU's stream and start again in the CPU's, two records of one name (see
    the energy formula's page). So the figures are compared per name, each name's records
    added up, as the Prometheus output adds them."""
    shared_node_recordings(tmp_path)
    records_file = tmp_path / "energy.jsonl"
    port = free_port()
    store = mongodb_uri(mongodb_server) + "runs"
    with Service(
        tmp_path / "service.log", "run", "-s",
        "--input", "jsonl", "--model", "HWPCReport", "--name", "hwpc",
        "--files", str(tmp_path / "hwpc.jsonl"), "--poll-interval-s", "0.05",
        "--input", "jsonl", "--model", "GPUReport", "--name", "gpus",
        "--files", str(tmp_path / "gpu.jsonl"), "--poll-interval-s", "0.05",
        "--input", "meter", "--name", "meter", "--files", str(DEMO / "demo-meter.csv"),
        "--sensor", "demo-node",
        "--output", "jsonl", "--model", "TargetEnergyReport", "--file", str(records_file),
        "--output", "prometheus", "--port", str(port),
        "--learn-min-samples-required", "5", "--target-energy", "--target-end-silence-s", "5",
        "--run", "shared/node/jobs/2", "--store", store,
    ) as service:  # fmt: skip
        service.wait_for_log(f"metrics on http://127.0.0.1:{port}/metrics")

        def job_102() -> dict[str, float]:
            """Job 102's energy per scope, its records added up (it ended at 15 s)."""
            energy: dict[str, float] = {}
            for record in _records(records_file):
                if record["target"] == "slurm/102":
                    for scope, joules in record["energy"].items():
                        energy[scope] = energy.get(scope, 0.0) + joules
            return energy

        def exposed_102() -> dict[str, float]:
            return {
                dict(key[1])["scope"]: value
                for key, value in samples(scrape(f"http://127.0.0.1:{port}/metrics")).items()
                if key[0] == "wattflow_target_energy_joules_total"
                and ("slurm_job", "102") in key[1]
            }

        def served() -> bool:
            service.alive()
            wanted = job_102()
            every_scope = all(wanted.get(scope, 0.0) > 0 for scope in ("cpu", "dram", "gpu"))
            return every_scope and exposed_102() == pytest.approx(wanted, rel=1e-12)

        wait_until(served, 60, "job 102's cpu, dram and gpu energy on the metrics endpoint")
        service.stop()
    listed = wattflow("runs", "--store", store, "energy", "shared/node/jobs/2")
    assert listed.returncode == 0, listed.stderr
    header, *rows = [line.split("\t") for line in listed.stdout.splitlines()]
    stored: dict[str, float] = {}
    for row in rows:
        fields = dict(zip(header, row, strict=True))
        stored[fields["workload"]] = stored.get(fields["workload"], 0.0) + float(fields["total J"])
    written: dict[str, float] = {}
    for record in _records(records_file):
        written[record["target"]] = written.get(record["target"], 0.0) + sum(
            record["energy"].values()
        )
    assert len(rows) == len(_records(records_file))
    assert stored == pytest.approx(written, abs=1e-2)
    assert {"slurm/101", "slurm/102", "gpu0", "gpu1"} <= set(stored)


def _records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in _whole_lines(path)]


def _whole_lines(path: Path) -> list[bytes]:
    """The lines of a file a service is appending to, the last one only once it is whole."""
    if not path.exists():
        return []
    return path.read_bytes().split(b"\n")[:-1]
