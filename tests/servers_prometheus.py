"""Debian's Prometheus server and promtool, for the tests of what wattflow exposes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import urllib3

from .conftest import wait_until
from .servers import ServerProcess, free_port


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` on an exposition, as Prometheus' own linter reads it."""
    return subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


def scrape(url: str) -> str:
    """What a scrape of ``url`` reads (an AssertionError unless it answers 200)."""
    response = urllib3.request("GET", url, timeout=5, retries=False)
    assert response.status == 200, (response.status, response.data[:500])
    text: str = response.data.decode()
    return text


class PrometheusServer(ServerProcess):
    """A Prometheus server that scrapes the given targets every 200 ms, on a port of its own."""

    def __init__(self, directory: Path, targets: list[str]) -> None:
        port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "prometheus.yml"
        listed = ", ".join(f'"{target}"' for target in targets)
        config.write_text(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n"
            "scrape_configs:\n  - job_name: wattflow\n"
            f"    static_configs:\n      - targets: [{listed}]\n"
        )
        super().__init__(
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

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        super().start(timeout_s)
        wait_until(self._ready, timeout_s, "prometheus /-/ready")

    def _ready(self) -> bool:
        try:
            response = urllib3.request("GET", self.uri + "/-/ready", timeout=1, retries=False)
        except urllib3.exceptions.HTTPError:
            return False
        return response.status == 200

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant PromQL query through the HTTP API: its vector's elements."""
        response = urllib3.request(
            "GET", self.uri + "/api/v1/query", fields={"query": promql}, timeout=5, retries=False
        )
        body = orjson.loads(response.data)
        assert response.status == 200, body
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


@pytest.fixture
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A factory: ``prometheus_server(["127.0.0.1:PORT"])`` starts a server scraping those."""
    started: list[PrometheusServer] = []

    def start(targets: list[str]) -> PrometheusServer:
        server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), targets)
        started.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop(kill=True)
