"""OpenTSDB output: PowerReports as data points posted to OpenTSDB's HTTP ``/api/put``.

PowerAPI 2.10 writes through the ``opentsdb-py`` client (0.6), whose default protocol is HTTP:
gzip-compressed JSON arrays of at most 50 points ``{"metric", "timestamp", "value", "tags"}``
posted to ``http://URI:PORT/api/put?details=true``, with the report's target as the ``host``
tag and the time in whole seconds. This output posts the same requests, so any server that
took PowerAPI's takes these (OpenTSDB, VictoriaMetrics' ``-opentsdbHTTPListenAddr``).

By default each point also carries the sensor and the metadata keys ``--tags`` names
(``scope`` and ``socket``), and its time in milliseconds: PowerAPI's points of one target
(cpu and dram, each socket, reports less than a second apart) share metric, tags and second,
so the server keeps one of them. ``--points-compat powerapi-2.10`` writes PowerAPI's points as
they are. Points written twice (a retry after a timeout that hid whether the first request
landed) are the same points again.

The connection is made on the first write; errors are sorted like the InfluxDB outputs':
unreachable, timed out, 5xx or 429 are retried for ``--retry-for-s``; 401 or 403 make the batch
a dead letter; a 400 refuses the points the server names (``details``), or the request's points
when it names none, and the rest of the batch is still written.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Any, Literal, Self
from urllib.parse import urlparse

import orjson
import urllib3
from pydantic import Field, PositiveInt, field_validator, model_validator

from wattflow.actors.connections import redact_uri
from wattflow.actors.errors import PushError, PushUnavailable
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.csv import TagList
from wattflow.formats.reports import PowerReport, Report, to_millis

logger = logging.getLogger(__name__)

METRIC_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")
"""What an OpenTSDB metric name may hold (``opentsdb-py`` refuses any other before sending)."""


class OpenTSDBPusherConfig(PusherConfig):
    """Settings of the OpenTSDB output (``--output opentsdb -u HOST -p PORT --metric-name M``)."""

    type: Literal["opentsdb"] = "opentsdb"
    uri: str = Field(
        min_length=1,
        description="Server: a host name, as PowerAPI takes it, or an http:// or https:// URL.",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Port, when --uri gives none; 4242 (OpenTSDB's) when neither does.",
        json_schema_extra={"flags": ["-p", "--port"]},
    )
    metric_name: str = Field(
        min_length=1,
        description="Metric the power is written under (letters, digits, - _ . /).",
        json_schema_extra={"flags": ["--metric-name"]},
    )
    tags: TagList = Field(
        default=["scope", "socket"],
        description="Metadata keys written as tags besides host (the target) and sensor, "
        "comma-separated; a report without one is written without that tag.",
        json_schema_extra={"flags": ["-t", "--tags"]},
    )
    points_compat: Literal["powerapi-2.10"] | None = Field(
        default=None,
        description="powerapi-2.10: PowerAPI 2.10's points, the target as the only tag and "
        "the time in whole seconds (reports of one target within a second overwrite each "
        "other).",
    )
    batch_size: PositiveInt = Field(
        default=50, description="Most points in one request (opentsdb-py's limit)."
    )
    server_timeout_s: float = Field(
        default=5.0, gt=0, description="How long one request waits for the server."
    )

    @field_validator("model")
    @classmethod
    def _power_only(cls, value: str) -> str:
        """A point is a report's power: no other kind has one."""
        if value != "PowerReport":
            raise ValueError("the opentsdb output writes PowerReports (a point per power)")
        return value

    @field_validator("metric_name")
    @classmethod
    def _metric_characters(cls, value: str) -> str:
        bad = sorted(set(value) - METRIC_CHARACTERS)
        if bad:
            raise ValueError(f"a metric name holds letters, digits, - _ . / only, not {bad}")
        return value

    @model_validator(mode="after")
    def _address(self) -> Self:
        self.base_url()
        return self

    def base_url(self) -> str:
        """``http://host:port`` from ``--uri`` and ``--port``, as ``opentsdb-py`` builds it."""
        if "://" not in self.uri:
            return f"http://{self.uri}:{self.port or 4242}"
        parsed = urlparse(self.uri)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("--uri must be a host name or an http:// or https:// URL")
        if parsed.port is not None and self.port is not None and parsed.port != self.port:
            raise ValueError(f"--uri says port {parsed.port}, --port {self.port}: give one")
        base = self.uri.rstrip("/")
        return base if parsed.port is not None else f"{base}:{self.port or 4242}"

    @classmethod
    def example(cls) -> OpenTSDBPusherConfig:
        """PowerReports to a local OpenTSDB as the metric ``power``."""
        return cls(type="opentsdb", uri="127.0.0.1", port=4242, metric_name="power")


def point(report: Report, config: OpenTSDBPusherConfig) -> dict[str, Any]:
    """One report as an OpenTSDB data point."""
    assert isinstance(report, PowerReport)
    if config.points_compat is not None:
        return {
            "metric": config.metric_name,
            "timestamp": to_millis(report.timestamp) // 1000,
            "value": report.power,
            "tags": {"host": report.target},
        }
    tags = {"host": report.target, "sensor": report.sensor}
    for key in config.tags:
        value = report.metadata.get(key)
        if value is not None and value != "":
            tags[key] = str(value)
    return {
        "metric": config.metric_name,
        "timestamp": to_millis(report.timestamp),
        "value": report.power,
        "tags": tags,
    }


@pushers.register("opentsdb")
class OpenTSDBPusher(Pusher[OpenTSDBPusherConfig]):
    """Posts each ``--batch-size`` points from a worker thread."""

    config_model = OpenTSDBPusherConfig

    def __init__(self, config: OpenTSDBPusherConfig) -> None:
        super().__init__(config)
        self.base_url = config.base_url()
        self.where = f"output '{config.name}' (opentsdb {redact_uri(self.base_url)})"
        self._http: urllib3.PoolManager | None = None

    async def open(self) -> None:
        timeout = urllib3.Timeout(connect=self.config.server_timeout_s, read=30.0)
        self._http = urllib3.PoolManager(timeout=timeout, retries=False)

    async def probe(self) -> str:
        """OpenTSDB answers ``/api/version``; a server that only takes puts (VictoriaMetrics'
        listener refuses any other path) is tried with an empty put, which writes nothing."""
        await self.open()
        status, body = await asyncio.to_thread(self._request, "GET", "/api/version", None)
        if status < 300:
            return f"OpenTSDB {body[:80]}"
        empty = gzip.compress(b"[]")
        put, answer = await asyncio.to_thread(self._request, "POST", "/api/put", empty)
        if put < 300:
            return f"takes /api/put (answered {put}; /api/version: {status})"
        raise PushError(
            f"{self.where}: /api/version answered {status} {body[:100]}, an empty /api/put "
            f"{put} {answer[:100]}"
        )

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        refused: list[tuple[Report, str]] = []
        size = self.config.batch_size
        for start in range(0, len(batch), size):
            reports = batch[start : start + size]
            points = [point(report, self.config) for report in reports]
            refused += await asyncio.to_thread(self._put, reports, points)
        return refused

    def _put(self, reports: list[Report], points: list[dict[str, Any]]) -> list[tuple[Report, str]]:
        """Post one request; return the reports the server refused, or raise if a retry may
        help."""
        body = gzip.compress(orjson.dumps(points))
        status, text = self._request("POST", "/api/put?details=true", body)
        if status < 300:
            return self._failed_points(reports, points, text)
        if status in (401, 403):
            raise PushError(f"{self.where}: not authorised ({status}): {text[:200]}")
        if status >= 500 or status == 429:
            raise PushUnavailable(f"{self.where}: server answered {status}: {text[:200]}")
        named = self._failed_points(reports, points, text)
        if named:
            return named
        reason = f"{self.where}: server refused the request ({status}): {text[:300]}"
        return [(report, reason) for report in reports]

    def _failed_points(
        self, reports: list[Report], points: list[dict[str, Any]], text: str
    ) -> list[tuple[Report, str]]:
        """The reports whose points OpenTSDB's ``details`` answer names as failed."""
        try:
            answer = orjson.loads(text) if text.strip() else {}
        except orjson.JSONDecodeError:
            return []
        errors = answer.get("errors") if isinstance(answer, dict) else None
        if not isinstance(errors, list):
            return []
        refused: list[tuple[Report, str]] = []
        for error in errors:
            if not isinstance(error, dict) or error.get("datapoint") not in points:
                continue
            index = points.index(error["datapoint"])
            refused.append((reports[index], f"{self.where}: {error.get('error', 'refused')}"))
        return refused

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, str]:
        assert self._http is not None, "open() first"
        headers = {"Content-Type": "application/json"}
        if body is not None:
            headers["Content-Encoding"] = "gzip"
        try:
            response = self._http.request(method, self.base_url + path, body=body, headers=headers)
        except urllib3.exceptions.HTTPError as error:
            reason = getattr(error, "reason", None) or error
            raise PushUnavailable(f"{self.where}: {redact_uri(str(reason))}") from None
        return response.status, response.data.decode("utf-8", "replace")

    async def close(self) -> None:
        if self._http is not None:
            self._http.clear()
            self._http = None
