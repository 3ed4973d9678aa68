"""MongoDB output: PowerAPI's document layouts, written in bulk, each report exactly once.

Documents are what PowerAPI writes (``timestamp`` as a BSON date, ``sensor``, ``target``,
``metadata``, and the payload such as ``power``), with one addition: a deterministic ``_id``.
It is an ObjectId whose first four bytes are the report's time (so ``_id`` order is time order,
as with the ids MongoDB makes) and whose last eight are a hash of what identifies the report:
its kind, time, sensor, target, and the scope, socket and device it is for. Writing a batch
again, after a timeout that hid whether the first attempt landed, or after the service
restarted and read its input again, adds nothing: the duplicates are refused by the ``_id``
index and counted as already written.

Inserts are unordered, so one refused document does not hold back the rest of its batch.
The collection gets an index on (sensor, target, timestamp), the query every dashboard makes.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any, Literal, Self

from bson import ObjectId
from pydantic import Field, PositiveInt, model_validator
from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, OperationFailure, PyMongoError

from wattflow.actors.connections import describe_driver_error, redact_uri
from wattflow.actors.errors import PushError, PushUnavailable
from wattflow.actors.pullers.mongodb import connection_string
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats import powerapi
from wattflow.formats.reports import Report, report_kind, to_millis

logger = logging.getLogger(__name__)

_DUPLICATE_KEY = 11000
_AUTHENTICATION_FAILED = {18, 13}
_IDENTIFYING_METADATA = ("scope", "socket", "device")
"""Metadata that tells apart reports sharing kind, time, sensor and target."""


class MongoDBPusherConfig(PusherConfig):
    """Settings of the MongoDB output (``--output mongodb -u URI -d DB -c COLLECTION``)."""

    type: Literal["mongodb"] = "mongodb"
    uri: str | None = Field(
        default=None,
        description="Connection string, e.g. mongodb://127.0.0.1:27017 (or use --uri-file).",
        json_schema_extra={"flags": ["-u", "--uri"]},
    )
    uri_file: Path | None = Field(
        default=None,
        description="File holding the connection string, for one with a password in it.",
    )
    db: str = Field(
        min_length=1,
        description="Database to write to.",
        json_schema_extra={"flags": ["-d", "--db"]},
    )
    collection: str = Field(
        min_length=1,
        description="Collection to write to.",
        json_schema_extra={"flags": ["-c", "--collection"]},
    )
    batch_size: PositiveInt = Field(
        default=5000, description="Most documents sent in one bulk insert."
    )
    server_timeout_s: float = Field(
        default=5.0, gt=0, description="How long one attempt waits for an unreachable server."
    )

    @model_validator(mode="after")
    def _one_uri(self) -> Self:
        if (self.uri is None) == (self.uri_file is None):
            raise ValueError("give the connection string with exactly one of --uri, --uri-file")
        return self

    @classmethod
    def example(cls) -> MongoDBPusherConfig:
        """PowerReports into a local server."""
        return cls(
            type="mongodb", uri="mongodb://127.0.0.1:27017", db="powerapi", collection="power"
        )


def document_id(report: Report) -> ObjectId:
    """The report's deterministic ``_id``: its time in seconds, then a hash of its identity."""
    millis = to_millis(report.timestamp)
    metadata = report.metadata
    identity = "\x1f".join(
        (
            report.kind,
            str(millis),
            report.sensor,
            report.target,
            *(str(metadata.get(key, "")) for key in _IDENTIFYING_METADATA),
        )
    )
    digest = hashlib.blake2b(identity.encode(), digest_size=8).digest()
    seconds = max(0, min(millis // 1000, 0xFFFFFFFF))
    return ObjectId(struct.pack(">I", seconds) + digest)


def to_document(report: Report) -> dict[str, Any]:
    """PowerAPI's document for the report, with its deterministic ``_id`` first."""
    return {"_id": document_id(report), **powerapi.to_mongodb(report)}


@pushers.register("mongodb")
class MongoDBPusher(Pusher[MongoDBPusherConfig]):
    """Connects on the first write, so a server that is down at start is waited for."""

    config_model = MongoDBPusherConfig

    def __init__(self, config: MongoDBPusherConfig) -> None:
        super().__init__(config)
        self.where = f"output '{config.name}' (mongodb {config.db}.{config.collection})"
        self._client: AsyncMongoClient[dict[str, Any]] | None = None
        self._indexed = False
        self.duplicates = 0

    async def probe(self) -> str:
        """Ping the server and say what it is."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            connection_string(self.config.uri, self.config.uri_file),
            serverSelectionTimeoutMS=int(self.config.server_timeout_s * 1000),
        )
        try:
            hello = await client.admin.command("hello")
            count = await client[self.config.db][self.config.collection].estimated_document_count()
        except PyMongoError as error:
            raise PushError(describe_driver_error(error)) from None
        finally:
            await client.close()
        replica = f"replica set {hello['setName']}" if hello.get("setName") else "standalone"
        return f"{replica}; {self.config.db}.{self.config.collection} holds {count} documents"

    async def check(self) -> None:
        try:
            report_kind(self.config.model)
        except ValueError as error:
            raise PushError(f"{self.where}: {error}") from None
        connection_string(self.config.uri, self.config.uri_file)

    async def open(self) -> None:
        self._client = AsyncMongoClient(
            connection_string(self.config.uri, self.config.uri_file),
            tz_aware=True,
            serverSelectionTimeoutMS=int(self.config.server_timeout_s * 1000),
            appname="wattflow",
        )

    @property
    def _collection(self) -> AsyncCollection[dict[str, Any]]:
        assert self._client is not None, "open() first"
        return self._client[self.config.db][self.config.collection]

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        refused: list[tuple[Report, str]] = []
        try:
            if not self._indexed:
                await self._collection.create_index(
                    [("sensor", ASCENDING), ("target", ASCENDING), ("timestamp", ASCENDING)]
                )
                self._indexed = True
            size = self.config.batch_size
            for start in range(0, len(batch), size):
                part = batch[start : start + size]
                refused += await self._insert(part)
        except OperationFailure as error:
            message = f"{self.where}: {redact_uri(str(error))}"
            if error.code in _AUTHENTICATION_FAILED:
                raise PushError(message) from None
            raise PushUnavailable(message) from None
        except PyMongoError as error:
            raise PushUnavailable(f"{self.where}: {describe_driver_error(error)}") from None
        return refused

    async def _insert(self, part: list[Report]) -> list[tuple[Report, str]]:
        """Insert one bulk; documents already there count as written, others as refused."""
        documents = [to_document(report) for report in part]
        try:
            await self._collection.insert_many(documents, ordered=False)
        except BulkWriteError as error:
            refused = []
            for failure in error.details.get("writeErrors", []):
                if failure.get("code") == _DUPLICATE_KEY:
                    self.duplicates += 1
                else:
                    refused.append((part[failure["index"]], f"{self.where}: {failure['errmsg']}"))
            if error.details.get("writeConcernErrors"):
                raise PushUnavailable(
                    f"{self.where}: write concern not met: {error.details['writeConcernErrors']}"
                ) from None
            return refused
        return []

    async def close(self) -> None:
        if self.duplicates:
            logger.info(
                "%s: %d reports were already written (a retried batch or a re-read input)",
                self.where,
                self.duplicates,
            )
        if self._client is not None:
            await self._client.close()
            self._client = None
