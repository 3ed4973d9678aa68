"""InfluxDB 2.x output, with PowerAPI's flags: the ``influxdb-client`` write API.

The same points as the 1.x output (see :mod:`wattflow.formats.lineprotocol`), written
synchronously from a worker thread with millisecond precision, so each batch is known to be
stored, or known to have failed, before the next is taken (the client's batching mode would
acknowledge reports it may still lose). A bucket that does not exist is created, as PowerAPI
does. Anything that speaks ``/api/v2/write`` works, VictoriaMetrics included (it has no bucket
API and needs none).

The client connects on the first write, so a server down at start is waited for. Errors are
sorted as in the 1.x output: unreachable, 5xx or 429 → :class:`PushUnavailable` (retried with
backoff); 401/403 → :class:`PushError` (the batch is a dead letter); another 4xx → that request's
reports are dead letters with the server's message. A retried request rewrites points InfluxDB
already holds, which overwrites them with themselves: nothing is duplicated. The token is only
in the client's ``Authorization`` header, never in a message.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Literal, Self, cast
from urllib.parse import urlparse

import urllib3
from influxdb_client.client.influxdb_client import InfluxDBClient
from influxdb_client.client.write_api import SYNCHRONOUS, WriteApi
from influxdb_client.domain.write_precision import WritePrecision
from influxdb_client.rest import ApiException
from pydantic import Field, PositiveInt, SecretStr, model_validator

from wattflow.actors.connections import read_secret, redact_uri
from wattflow.actors.errors import PushError, PushUnavailable
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.pushers.csv import TagList
from wattflow.formats import lineprotocol
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

_MILLISECONDS = cast(WritePrecision, WritePrecision.MS)
"""The client's precision constants are plain strings, typed as the class."""


class InfluxDB2PusherConfig(PusherConfig):
    """Settings of the InfluxDB 2.x output, PowerAPI's ``--output influxdb2`` group."""

    type: Literal["influxdb2"] = "influxdb2"
    uri: str = Field(
        description="Server address, e.g. http://127.0.0.1:8086.",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Port, when the address has none (as PowerAPI takes it).",
        json_schema_extra={"flags": ["-p", "--port"]},
    )
    org: str = Field(
        min_length=1, description="Organisation.", json_schema_extra={"flags": ["-g", "--org"]}
    )
    db: str = Field(
        min_length=1,
        description="Bucket; created when it does not exist.",
        json_schema_extra={"flags": ["-d", "--db"]},
    )
    token: SecretStr | None = Field(
        default=None,
        description="API token (or --token-file).",
        json_schema_extra={"flags": ["-k", "--token"]},
    )
    token_file: Path | None = Field(default=None, description="File holding the API token.")
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
    def _one_token(self) -> Self:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give the token with one of --token, --token-file")
        if not self.uri.startswith(("http://", "https://")):
            raise ValueError("--uri must start with http:// or https://")
        if urlparse(self.uri).port is None and self.port is None:
            raise ValueError("--uri has no port: add one, or give --port")
        return self

    @property
    def url(self) -> str:
        """The address with the port PowerAPI appends when ``--port`` is given apart."""
        if urlparse(self.uri).port is None and self.port is not None:
            return f"{self.uri.rstrip('/')}:{self.port}"
        return self.uri

    @classmethod
    def example(cls) -> InfluxDB2PusherConfig:
        """PowerReports into a local InfluxDB 2's ``power`` bucket."""
        return cls(type="influxdb2", uri="http://127.0.0.1:8086", org="org", db="power")


@pushers.register("influxdb2")
class InfluxDB2Pusher(Pusher[InfluxDB2PusherConfig]):
    """Writes each batch in requests of ``--batch-size`` points, synchronously."""

    config_model = InfluxDB2PusherConfig

    def __init__(self, config: InfluxDB2PusherConfig) -> None:
        super().__init__(config)
        self.where = f"output '{config.name}' (influxdb2 {redact_uri(config.uri)}, {config.db})"
        self._tags = tuple(config.tags)
        self._powerapi_layout = config.points_compat is not None
        self._client: InfluxDBClient | None = None
        self._writer: WriteApi | None = None
        self._bucket_checked = False

    def _token(self) -> str:
        if self.config.token is not None:
            return self.config.token.get_secret_value()
        if self.config.token_file is not None:
            return read_secret(self.config.token_file, "--token-file")
        return ""

    async def check(self) -> None:
        self._token()

    async def open(self) -> None:
        self._client = InfluxDBClient(
            url=self.config.url,
            token=self._token(),
            org=self.config.org,
            timeout=int(self.config.server_timeout_s * 1000),
            retries=False,
        )
        self._writer = self._client.write_api(write_options=SYNCHRONOUS)

    async def probe(self) -> str:
        await self.open()
        assert self._client is not None
        try:
            ready = await asyncio.to_thread(self._client.ping)
        finally:
            await self.close()
        if not ready:
            raise PushError(f"{self.where}: the server does not answer /ping")
        return "answers /ping"

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        found, unwritable = lineprotocol.requests(
            batch, self._tags, self.config.batch_size, self._powerapi_layout
        )
        refused = [(report, f"{self.where}: {reason}") for report, reason in unwritable]
        for reports, request_lines in found:
            problem = await asyncio.to_thread(self._write, request_lines)
            if problem is not None:
                refused += [(report, problem) for report in reports]
        return refused

    def _write(self, records: list[str]) -> str | None:
        assert self._writer is not None, "open() first"
        try:
            self._writer.write(
                bucket=self.config.db,
                org=self.config.org,
                record=records,
                write_precision=_MILLISECONDS,
            )
        except ApiException as error:
            status = error.status or 0
            body = str(error.body or error.reason)[:300]
            if status == 404 and "bucket" in body and not self._bucket_checked:
                self._create_bucket()
                return self._write(records)
            return self._refusal(status, body)
        except (urllib3.exceptions.HTTPError, OSError) as error:
            reason: Any = getattr(error, "reason", None) or error
            raise PushUnavailable(f"{self.where}: {redact_uri(str(reason))}") from None
        return None

    def _refusal(self, status: int, body: str) -> str:
        """What an error answer means: raise for one a retry may cure (the server's fault, a
        rate limit, no answer) or that ends the output (not authorised); else the reason the
        batch is refused, for its dead letters."""
        if status in (401, 403):
            raise PushError(f"{self.where}: not authorised ({status}): {body}") from None
        if status >= 500 or status in (0, 429):
            raise PushUnavailable(f"{self.where}: server answered {status}: {body}") from None
        return f"{self.where}: server refused the write ({status}): {body}"

    def _create_bucket(self) -> None:
        assert self._client is not None
        self._bucket_checked = True
        logger.info("%s: creating the bucket", self.where)
        try:
            self._client.buckets_api().create_bucket(
                bucket_name=self.config.db, org=self.config.org
            )
        except ApiException as error:
            raise PushError(
                f"{self.where}: cannot create the bucket ({error.status}): {error.body}"
            ) from None

    async def close(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None
            self._writer = None
