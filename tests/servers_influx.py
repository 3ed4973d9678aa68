"""InfluxDB 1.x (Debian's influxd) and VictoriaMetrics, started for a test on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from .conftest import wait_until
from .servers import ServerProcess, free_port


def _answers(url: str, status: int) -> bool:
    try:
        return urllib3.request("GET", url, timeout=1, retries=False).status == status
    except urllib3.exceptions.HTTPError:
        return False


def influxd_server(directory: Path, *, auth: bool = False) -> ServerProcess:
    """influxd with its storage, its HTTP API and its RPC port all of the test's own.

    With ``auth``, every request needs a user; influxd lets the first one (an admin) be
    created without credentials: see :func:`create_admin`.
    """
    http, rpc = free_port(), free_port()
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "influxdb.conf"
    config.write_text(
        f'reporting-disabled = true\nbind-address = "127.0.0.1:{rpc}"\n'
        f'[meta]\n  dir = "{directory}/meta"\n'
        f'[data]\n  dir = "{directory}/data"\n  wal-dir = "{directory}/wal"\n'
        f'[http]\n  bind-address = "127.0.0.1:{http}"\n  log-enabled = false\n'
        f"  auth-enabled = {'true' if auth else 'false'}\n"
    )
    return ServerProcess(
        ["influxd", "-config", str(config)], http, directory / "influxd.log", "influxd"
    )


def start_influxd(server: ServerProcess) -> None:
    server.start()
    wait_until(lambda: _answers(influx_uri(server) + "/ping", 204), 30, "influxd /ping")


def influx_uri(server: ServerProcess) -> str:
    return f"http://127.0.0.1:{server.port}"


def create_admin(server: ServerProcess, user: str, password: str) -> None:
    """The first user of an influxd with auth, which influxd accepts without credentials."""
    statement = f"CREATE USER {user} WITH PASSWORD '{password}' WITH ALL PRIVILEGES"
    response = urllib3.request("POST", influx_uri(server) + "/query", fields={"q": statement})
    assert response.status == 200, response.data
    assert b"error" not in response.data, response.data


@pytest.fixture
def influxdb_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Debian's influxd 1.6.7: ``/write`` and InfluxQL; ``influx_uri(server)`` reaches it."""
    server = influxd_server(tmp_path_factory.mktemp("influxd"))
    start_influxd(server)
    try:
        yield server
    finally:
        server.stop(kill=True)


def victoria_metrics(directory: Path) -> ServerProcess:
    """victoria-metrics with its storage and HTTP port of the test's own, not started yet."""
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    return ServerProcess(
        [
            "victoria-metrics",
            f"-storageDataPath={directory}/data",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",
        ],
        port,
        directory / "victoria-metrics.log",
        "victoria-metrics",
    )


def start_victoria_metrics(server: ServerProcess) -> None:
    server.start()
    wait_until(lambda: _answers(influx_uri(server) + "/health", 200), 30, "victoria-metrics")


@pytest.fixture
def victoria_metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Debian's victoria-metrics, which takes InfluxDB 2's ``/api/v2/write``."""
    server = victoria_metrics(tmp_path_factory.mktemp("victoria-metrics"))
    start_victoria_metrics(server)
    try:
        yield server
    finally:
        server.stop(kill=True)
