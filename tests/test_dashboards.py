"""Grafana's dashboards in docker/grafana/dashboards, each panel's query run against a real
server that wattflow filled from the demo's recordings. No Grafana server installs here, so
the tests stand in for Grafana's part: its macros ($timeFilter, $__interval) and variables are
replaced as Grafana replaces them, and the query goes to the database as Grafana sends it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3

from .conftest import ROOT, Service, wait_until, wattflow
from .servers import ServerProcess, free_port
from .servers_influx import influx_uri

DASHBOARDS = ROOT / "docker" / "grafana" / "dashboards"
DATA = ROOT / "service" / "data"
SENSOR = "demo-node"


def dashboard(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DASHBOARDS / name).read_text())
    return loaded


def targets(board: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def influxql(server: ServerProcess, query: str) -> dict[str, Any]:
    """One InfluxQL statement's result, as Grafana's InfluxDB data source asks for it."""
    response = urllib3.request(
        "POST",
        influx_uri(server) + "/query",
        body=urlencode({"db": "power", "q": query, "epoch": "ms"}),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert response.status == 200, response.data
    result: dict[str, Any] = json.loads(response.data)["results"][0]
    return result


DEMO_INPUTS = (
    "--learn-min-samples-required", "5", "--gpu-targets", "process",
    "--input", "jsonl", "--files", str(DATA / "demo-hwpc.jsonl"),
    "--input", "jsonl", "--name", "gpu", "--model", "GPUReport",
    "--files", str(DATA / "demo-gpu.jsonl"),
    "--input", "meter", "--files", str(DATA / "demo-meter.csv"), "--sensor", SENSOR,
)  # fmt: skip
"""The demo's recordings as inputs of `wattflow run`: hwpc-sensor (SmartWatts and RAPL), the
NVML sampler (the GPU formula, one target per process) and a power meter (the node formula)."""


@pytest.fixture
def filled_influxdb(influxdb_server: ServerProcess) -> ServerProcess:
    """InfluxDB 1.x filled by wattflow from the demo's recordings: hwpc-sensor (SmartWatts and
    RAPL), the NVML sampler (the GPU formula, one target per process) and a power meter (the
    node formula), PowerReports and FormulaReports, as the compose stack writes them."""
    uri = influx_uri(influxdb_server)
    result = wattflow(
        "run",
        *DEMO_INPUTS,
        "--output",
        "influxdb",
        "--uri",
        uri,
        "--db",
        "power",
        "--output",
        "influxdb",
        "--name",
        "models",
        "--model",
        "FormulaReport",
        "--uri",
        uri,
        "--db",
        "power",
    )
    assert result.returncode == 0, result.stderr
    return influxdb_server


def as_grafana_sends_it(query: str, start_ms: int, end_ms: int) -> str:
    """Grafana's replacements: the time range, the interval, the variables (one sensor, as
    Grafana formats a variable for a regex, and top 3)."""
    return (
        query.replace("$timeFilter", f"time >= {start_ms}ms AND time <= {end_ms}ms")
        .replace("$__interval", "5s")
        .replace("$sensor", f"({SENSOR})")
        .replace("$top", "3")
    )


def test_every_influxql_panel_shows_data_from_what_wattflow_wrote(
    filled_influxdb: ServerProcess,
) -> None:
    board = dashboard("wattflow-influxdb.json")
    span = influxql(filled_influxdb, 'SELECT first("power") FROM power_consumption')
    start_ms = int(span["series"][0]["values"][0][0])
    bounds = influxql(filled_influxdb, 'SELECT last("power") FROM power_consumption')
    end_ms = int(bounds["series"][0]["values"][0][0])
    assert end_ms > start_ms
    empty = []
    checked = 0
    for title, target in targets(board):
        result = influxql(filled_influxdb, as_grafana_sends_it(target["query"], start_ms, end_ms))
        assert "error" not in result, f"{title} ({target['refId']}): {result['error']}"
        values = [v for s in result.get("series", []) for row in s["values"] for v in row[1:]]
        if not [v for v in values if v is not None]:
            empty.append(f"{title} ({target['refId']})")
        checked += 1
    assert checked >= 12
    assert not empty, f"panels with no data: {empty}"


def test_the_sensor_variable_lists_the_sensors_wattflow_wrote(
    filled_influxdb: ServerProcess,
) -> None:
    board = dashboard("wattflow-influxdb.json")
    (sensor,) = [v for v in board["templating"]["list"] if v["name"] == "sensor"]
    result = influxql(filled_influxdb, sensor["query"])
    assert [row[1] for row in result["series"][0]["values"]] == [SENSOR]


def test_the_container_panels_leave_out_rapl_global_and_the_gpu_devices(
    filled_influxdb: ServerProcess,
) -> None:
    """Per-container panels show targets only: not RAPL's or the model's whole-socket reports,
    nor the GPUs' own idle power, nor the node formula's."""
    board = dashboard("wattflow-influxdb.json")
    (energy,) = [t for title, t in targets(board) if title.startswith("Energy per container")]
    result = influxql(filled_influxdb, as_grafana_sends_it(energy["query"], 0, 2**62 // 10**6))
    shown = {series["tags"]["target"] for series in result["series"]}
    assert {"web-frontend", "ml-training", "pid:4242"} <= shown
    assert not shown & {"rapl", "global", "gpu0", "gpu1", "node", "rest"}


@pytest.mark.parametrize("name", ["wattflow-influxdb.json", "wattflow-prometheus.json"])
def test_dashboards_take_their_data_source_from_a_variable(name: str) -> None:
    """Portable dashboards: every panel and query names the data source through the
    `datasource` variable, never a fixed name; ids and grid positions are set."""
    board = dashboard(name)
    assert board["uid"].startswith("wattflow-")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"sensor", "top"} <= set(variables)
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


# --- Prometheus ------------------------------------------------------------------------------

PROMETHEUS_MACROS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$sensor": ".*",
    "$top": "5",
}


def promql(query: str, sensor: str = ".*") -> str:
    """A panel's PromQL as Grafana sends it: macros and variables replaced."""
    for macro, value in {**PROMETHEUS_MACROS, "$sensor": sensor}.items():
        query = query.replace(macro, value)
    return query


def prometheus_server(directory: Path, scrape_ports: tuple[int, ...] = ()) -> ServerProcess:
    """Debian's prometheus on a free loopback port; it scrapes ``scrape_ports`` every second."""
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    jobs = ""
    if scrape_ports:
        listed = ", ".join(f"'127.0.0.1:{scraped}'" for scraped in scrape_ports)
        jobs = (
            "scrape_configs:\n  - job_name: wattflow\n    scrape_interval: 1s\n"
            f"    static_configs:\n      - targets: [{listed}]\n"
        )
    config = directory / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n" + jobs)
    return ServerProcess(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={directory}/data",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        port,
        directory / "prometheus.log",
        "prometheus",
    )


def prometheus_query(server: ServerProcess, query: str) -> dict[str, Any]:
    response = urllib3.request(
        "GET",
        f"http://127.0.0.1:{server.port}/api/v1/query",
        fields={"query": query},
        timeout=30,
    )
    assert response.headers.get("Content-Type", "").startswith("application/json"), (
        response.status,
        response.data[:500],
    )
    answer: dict[str, Any] = json.loads(response.data)
    return answer


def _ready(server: ServerProcess) -> bool:
    """Prometheus answers 503 with plain text until its storage is open: wait for /-/ready."""
    try:
        url = f"http://127.0.0.1:{server.port}/-/ready"
        return urllib3.request("GET", url, timeout=1, retries=False).status == 200
    except urllib3.exceptions.HTTPError:
        return False


def start_prometheus(server: ServerProcess) -> None:
    server.start()
    wait_until(lambda: _ready(server), 30, "prometheus /-/ready")


def test_every_promql_panel_parses_in_prometheus(tmp_path: Path) -> None:
    """Each panel's PromQL, and the sensor variable's metric, is a query Prometheus accepts
    (a syntax error is a 400 `bad_data`). Whether they show data is the next test's."""
    board = dashboard("wattflow-prometheus.json")
    server = prometheus_server(tmp_path / "prometheus")
    try:
        start_prometheus(server)
        queries = [(title, target["expr"]) for title, target in targets(board)]
        (sensor,) = [v for v in board["templating"]["list"] if v["name"] == "sensor"]
        metric = sensor["definition"].removeprefix("label_values(").split(",")[0]
        queries.append(("sensor variable", metric))
        assert len(queries) >= 15
        for title, expr in queries:
            answer = prometheus_query(server, promql(expr))
            assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
    finally:
        server.stop(kill=True)


def test_every_promql_panel_shows_data_that_prometheus_scraped_from_wattflow(
    tmp_path: Path,
) -> None:
    """wattflow follows the demo's recordings with the prometheus output and its HTTP port,
    Prometheus scrapes both, and every panel's query returns data, the pipeline's too. The
    recordings are read at once and the stream then pauses: the node panel has data because
    the node formula's timer reports each interval once it has waited --node-lateness-ms,
    without new input, while the service still runs. The sensor variable lists the demo's
    sensor."""
    port = free_port()
    power_port = free_port()
    args = [
        "run",
        "-s",
        "--http-port",
        str(port),
        "--http-addr",
        "127.0.0.1",
        *DEMO_INPUTS,
        "--output",
        "prometheus",
        "--addr",
        "127.0.0.1",
        "--port",
        str(power_port),
    ]
    server = prometheus_server(tmp_path / "prometheus", scrape_ports=(port, power_port))
    with Service(tmp_path / "wattflow.log", *args) as service:
        try:
            start_prometheus(server)

            def scraped_twice() -> bool:
                """Both endpoints scraped twice: what rate() over counters needs."""
                service.alive()
                return all(
                    any(
                        float(r["value"][1]) >= 2
                        for r in prometheus_query(server, f"count_over_time({name}[1m])")["data"][
                            "result"
                        ]
                    )
                    for name in ("wattflow_power_watts", "wattflow_actor_reports_in_total")
                )

            wait_until(scraped_twice, 60, "two scrapes of both endpoints")
            board = dashboard("wattflow-prometheus.json")
            panels = list(targets(board))
            assert len(panels) >= 15
            empty: list[str] = []

            def every_panel_shows_data() -> bool:
                """Each panel's query answers, and with data; ``empty`` names those without."""
                service.alive()
                empty.clear()
                for title, target in panels:
                    answer = prometheus_query(server, promql(target["expr"], SENSOR))
                    assert answer["status"] == "success", f"{title}: {answer.get('error')}"
                    if not answer["data"]["result"]:
                        empty.append(f"{title} ({target['refId']})")
                return not empty

            try:
                wait_until(every_panel_shows_data, 60, "data in every panel")
            except AssertionError as error:
                raise AssertionError(f"{error}: panels with no data: {empty}") from None
            (sensor,) = [v for v in board["templating"]["list"] if v["name"] == "sensor"]
            metric = sensor["definition"].removeprefix("label_values(").split(",")[0]
            listed = prometheus_query(server, metric)["data"]["result"]
            assert {series["metric"]["sensor"] for series in listed} == {SENSOR}
        finally:
            server.stop(kill=True)
        service.stop()
