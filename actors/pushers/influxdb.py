"""InfluxDB 1.x output: line protocol to the ``/write`` API, for Grafana dashboards.

Points are PowerAPI's (see :mod:`wattflow.formats.lineprotocol`), written with millisecond
precision in requests of at most ``--batch-size`` points. InfluxDB stores one point per
measurement, tag set and time: writing the same point again overwrites it with itself. So a
batch written twice (a retry after a timeout that hid whether the first attempt landed, or after
a failure half-way through a batch split into several requests) leaves the same data: retries
never duplicate, and the output needs no bookkeeping of what was already sent.

The connection is made on the first write, so a server that is down at start is waited for
instead of stopping the service. Errors are sorted by what a retry can do:

- unreachable, timed out, 5xx or 429: :class:`PushUnavailable`, retried with backoff for
  ``--retry-for-s`` (the batch waits, the mailbox fills, the inputs slow down);
- 404 "database not found": the database is created (``CREATE DATABASE``) and the write tried
  again;
- 401 or 403: :class:`PushError`, the whole batch is a dead letter (every request would fail);
- any other 4xx (400: a field whose type conflicts with earlier points): that request's reports
  become dead letters with the server's message and the rest of the batch is still written, so
  one bad point costs its request, not the batch.

The password never reaches a message: it is only in the ``Authorization`` header, and URIs in
errors pass through :func:`redact_uri`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlencode

import orjson
import urllib3
from pydantic import Field, PositiveInt, SecretStr, model_validator

from wattflow.actors.connections import read_secret, redact_uri
from wattflow.actors.errors import PushError, PushUnavailable
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.csv import TagList
from wattflow.formats import lineprotocol
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)


class InfluxDBPusherConfig(PusherConfig):
    """Settings of the InfluxDB 1.x output (``--output influxdb --uri URL --db DB``)."""

    type: Literal["influxdb"] = "influxdb"
    uri: str = Field(
        description="Server address, e.g. http://127.0.0.1:8086.",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    db: str = Field(
        min_length=1,
        description="Database; created when it does not exist.",
        json_schema_extra={"flags": ["-d", "--db"]},
    )
    rp: str | None = Field(default=None, description="Retention policy (the default one if unset).")
    user: str | None = Field(default=None, description="User name, for a server with auth.")
    password: SecretStr | None = Field(default=None, description="Password (or --password-file).")
    password_file: Path | None = Field(default=None, description="File holding the password.")
    token: SecretStr | None = Field(
        default=None, description="API token, for InfluxDB 2's v1-compatible /write."
    )
    tags: TagList = Field(
        default_factory=list,
        description="Metadata tags to keep, comma-separated (all when empty); naming ratio "
        "or formula makes it a tag rather than a field.",
        json_schema_extra={"flags": ["-t", "--tags"]},
    )
    points_compat: Literal["powerapi-2.10"] | None = Field(
        default=None,
        description="powerapi-2.10: every metadata key a tag, ratio and formula included, as "
        "PowerAPI 2.10 writes them (a new series per ratio value).",
    )
    batch_size: PositiveInt = Field(default=5000, description="Most points in one request.")
    server_timeout_s: float = Field(
        default=5.0, gt=0, description="How long one request waits for the server."
    )

    @model_validator(mode="after")
    def _credentials(self) -> Self:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give the password with one of --password, --password-file")
        if (self.password is not None or self.password_file is not None) and not self.user:
            raise ValueError("a password needs --user")
        if self.token is not None and self.user:
            raise ValueError("give either --token or --user and a password")
        if not self.uri.startswith(("http://", "https://")):
            raise ValueError("--uri must start with http:// or https://")
        return self

    @classmethod
    def example(cls) -> InfluxDBPusherConfig:
        """PowerReports into a local InfluxDB's ``power`` database."""
        return cls(type="influxdb", uri="http://127.0.0.1:8086", db="power")


@pushers.register("influxdb")
class InfluxDBPusher(Pusher[InfluxDBPusherConfig]):
    """Posts line protocol from a worker thread, one request per ``--batch-size`` points."""

    config_model = InfluxDBPusherConfig

    def __init__(self, config: InfluxDBPusherConfig) -> None:
        super().__init__(config)
        self.where = f"output '{config.name}' (influxdb {redact_uri(config.uri)}, db {config.db})"
        self._tags = tuple(config.tags)
        self._powerapi_layout = config.points_compat is not None
        self._http: urllib3.PoolManager | None = None
        self._headers: dict[str, str] = {}

    async def check(self) -> None:
        """Read the password file, so a missing secret stops the service before it starts.

        Only the configuration is checked: the server may come up later (see the module's
        docstring), which ``wattflow check`` finds out with :meth:`probe`.
        """
        self._headers = self._auth_headers()

    def _auth_headers(self) -> dict[str, str]:
        config = self.config
        if config.token is not None:
            return {"Authorization": f"Token {config.token.get_secret_value()}"}
        if config.user:
            password = (
                config.password.get_secret_value()
                if config.password is not None
                else read_secret(config.password_file, "--password-file")
                if config.password_file is not None
                else ""
            )
            pair = base64.b64encode(f"{config.user}:{password}".encode()).decode()
            return {"Authorization": f"Basic {pair}"}
        return {}

    async def open(self) -> None:
        self._headers = self._auth_headers()
        timeout = urllib3.Timeout(connect=self.config.server_timeout_s, read=30.0)
        self._http = urllib3.PoolManager(timeout=timeout, retries=False)

    async def probe(self) -> str:
        await self.open()
        status, body, headers = await asyncio.to_thread(self._request, "GET", "/ping", None, {})
        if status >= 300:
            raise PushError(f"{self.where}: /ping answered {status} {body[:200]}")
        return f"InfluxDB {headers.get('X-Influxdb-Version', '?')}"

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        found, unwritable = lineprotocol.requests(
            batch, self._tags, self.config.batch_size, self._powerapi_layout
        )
        refused = [(report, f"{self.where}: {reason}") for report, reason in unwritable]
        for reports, request_lines in found:
            problem = await asyncio.to_thread(self._write, "\n".join(request_lines).encode())
            if problem is not None:
                refused += [(report, problem) for report in reports]
        return refused

    def _write(self, body: bytes) -> str | None:
        """Post one request; return why the server refused it, or raise if a retry may help."""
        query = {"db": self.config.db, "precision": "ms"}
        if self.config.rp:
            query["rp"] = self.config.rp
        path = f"/write?{urlencode(query)}"
        status, text, _ = self._request("POST", path, body, {"Content-Type": "text/plain"})
        if status == 404 and "database not found" in text:
            self._create_database()
            status, text, _ = self._request("POST", path, body, {"Content-Type": "text/plain"})
        if status < 300:
            return None
        if status in (401, 403):
            raise PushError(f"{self.where}: not authorised ({status}): {text[:200]}")
        if status >= 500 or status == 429:
            raise PushUnavailable(f"{self.where}: server answered {status}: {text[:200]}")
        return f"{self.where}: server refused the write ({status}): {text[:300]}"

    def _create_database(self) -> None:
        logger.info("%s: creating the database", self.where)
        name = self.config.db.replace("\\", "\\\\").replace('"', '\\"')
        statement = f'CREATE DATABASE "{name}"'
        status, text, _ = self._request(
            "POST",
            "/query",
            urlencode({"q": statement}).encode(),
            {"Content-Type": "application/x-www-form-urlencoded"},
        )
        if status >= 300 or '"error"' in text:
            raise PushError(f"{self.where}: cannot create the database ({status}): {text[:200]}")

    def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, str, dict[str, str]]:
        assert self._http is not None, "open() first"
        url = self.config.uri.rstrip("/") + path
        try:
            response = self._http.request(
                method, url, body=body, headers={**self._headers, **headers}
            )
        except urllib3.exceptions.HTTPError as error:
            reason = getattr(error, "reason", None) or error
            raise PushUnavailable(f"{self.where}: {redact_uri(str(reason))}") from None
        return response.status, response.data.decode("utf-8", "replace"), dict(response.headers)

    async def close(self) -> None:
        if self._http is not None:
            self._http.clear()
            self._http = None


def query(uri: str, database: str, statement: str) -> list[dict[str, object]]:
    """Run an InfluxQL query and return the rows of its first series (for tests and tools)."""
    http = urllib3.PoolManager(retries=False)
    response = http.request(
        "GET",
        f"{uri.rstrip('/')}/query?{urlencode({'db': database, 'q': statement, 'epoch': 'ms'})}",
    )
    result = orjson.loads(response.data)["results"][0]
    rows: list[dict[str, object]] = []
    for series in result.get("series", []):
        columns = series["columns"]
        tags = series.get("tags", {})
        rows += [{**tags, **dict(zip(columns, values, strict=True))} for values in series["values"]]
    return rows
