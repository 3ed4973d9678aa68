"""MongoDB output: PowerAPI's document layouts, written in bulk, each report exactly once.

Documents are what PowerAPI writes (``timestamp`` as a BSON date, ``sensor``, ``target``,
``metadata``, and the payload such as ``power``), with one addition: a deterministic ``_id``.
It is an ObjectId whose first six bytes are the report's time (its seconds, as in the ids
MongoDB makes, then its millisecond in that second: ``_id`` order is time order to the
millisecond, as the ``mongodb`` input reads it) and whose last six hash what identifies the
report: its kind, time, sensor, target, and the scope, socket and device it is for. Writing a
batch again, after a timeout that hid whether the first attempt landed, or after the service
restarted and read its input again, adds nothing: the duplicates are refused by the ``_id``
index and counted as already written; a report whose id another report holds (the hashes of
one millisecond's reports alike) takes its next id.

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
from wattflow.formats.errors import DecodeError
from wattflow.formats.reports import Report, report_kind, to_millis

logger = logging.getLogger(__name__)

_DUPLICATE_KEY = 11000
_AUTHENTICATION_FAILED = {18, 13}
_IDENTIFYING_METADATA = ("scope", "socket", "device")
"""Metadata that tells apart reports sharing kind, time, sensor and target."""
ID_HASH_BYTES = 6
"""The bytes of an ``_id`` that hash a report's identity (after its time): two reports of one
millisecond (a tick's targets) share them with a chance of one in 2⁴⁸ per pair, and then the
second takes its next id (:meth:`MongoDBPusher._insert`), so none is lost for it."""
ID_ATTEMPTS = 16
"""The ids a report tries before it is refused: past the first, each is needed only where
every id before it holds another report."""


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


def _identity(report: Report) -> str:
    """What tells a report apart from every other of its output: kind, time, sensor, target,
    and the scope, socket and device it is for (not what a formula recomputes after a
    restart, such as its power, its model or its ratio)."""
    metadata = report.metadata
    return "\x1f".join(
        (
            report.kind,
            str(to_millis(report.timestamp)),
            report.sensor,
            report.target,
            *(str(metadata.get(key, "")) for key in _IDENTIFYING_METADATA),
        )
    )


def document_id(report: Report, attempt: int = 0) -> ObjectId:
    """The report's deterministic ``_id``: its time in seconds and its millisecond in that
    second, then a hash of its identity (of its identity and ``attempt``, for the rare report
    whose first ids another report holds: see :meth:`MongoDBPusher._insert`).

    The millisecond keeps ``_id`` order the reports' time order within a second: the
    ``mongodb`` input reads a collection in ``_id`` order, and a sensor's ticks do not keep
    to whole seconds (a tick a few milliseconds early shares its second with the one before);
    with the hash right after the seconds, such ticks came back in the hash's order, and a
    formula took the later one first and the earlier one as late."""
    identity = _identity(report) if not attempt else f"{_identity(report)}\x1f{attempt}"
    digest = hashlib.blake2b(identity.encode(), digest_size=ID_HASH_BYTES).digest()
    millis = to_millis(report.timestamp)
    seconds, millisecond = divmod(millis, 1000)
    if not 0 <= seconds <= 0xFFFFFFFF:  # beyond what four bytes of seconds hold: at an end
        seconds, millisecond = (0, 0) if seconds < 0 else (0xFFFFFFFF, 999)
    return ObjectId((struct.pack(">IH", seconds, millisecond) + digest).ljust(12, b"\0"))


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
        """Insert one bulk; documents already there count as written, others as refused.

        A refused ``_id`` usually holds this very report (a retried batch, a re-read input),
        but it may hold another that hashes alike: the stored documents are read back, and a
        report whose id another holds goes again under its next id, until it finds its own
        or a free one. Retried, it finds the same ids in the same order: still written once.
        """
        refused: list[tuple[Report, str]] = []
        attempts = [0] * len(part)
        waiting = list(range(len(part)))
        while waiting:
            taken = await self._insert_once([part[at] for at in waiting], attempts, waiting)
            held: dict[int, str | None] = {at: None for at, error in taken.items() if error is None}
            refused += [(part[at], error) for at, error in taken.items() if error is not None]
            waiting = await self._held_by_others(part, attempts, held)
            for at in waiting:
                attempts[at] += 1
                if attempts[at] >= ID_ATTEMPTS:
                    refused.append((part[at], f"{self.where}: no free _id in {ID_ATTEMPTS}"))
            waiting = [at for at in waiting if attempts[at] < ID_ATTEMPTS]
        return refused

    async def _insert_once(
        self, reports: list[Report], attempts: list[int], places: list[int]
    ) -> dict[int, str | None]:
        """Insert reports (at ``places`` of the bulk) under their current ids; the places
        refused: ``None`` for an id already taken, else why."""
        documents = [
            {"_id": document_id(r, attempts[at]), **powerapi.to_mongodb(r)}
            for r, at in zip(reports, places, strict=True)
        ]
        try:
            await self._collection.insert_many(documents, ordered=False)
        except BulkWriteError as error:
            if error.details.get("writeConcernErrors"):
                raise PushUnavailable(
                    f"{self.where}: write concern not met: {error.details['writeConcernErrors']}"
                ) from None
            return {
                places[failure["index"]]: None
                if failure.get("code") == _DUPLICATE_KEY
                else f"{self.where}: {failure['errmsg']}"
                for failure in error.details.get("writeErrors", [])
            }
        return {}

    async def _held_by_others(
        self, part: list[Report], attempts: list[int], taken: dict[int, str | None]
    ) -> list[int]:
        """Of the places whose id was taken, those whose id holds another report; the others
        were written before (counted in :attr:`duplicates`)."""
        if not taken:
            return []
        ids: dict[ObjectId, list[int]] = {}
        for at in taken:  # a report the input gave twice takes one id twice
            ids.setdefault(document_id(part[at], attempts[at]), []).append(at)
        same = set()
        async for document in self._collection.find({"_id": {"$in": list(ids)}}):
            for at in ids[document["_id"]]:
                report = part[at]
                try:
                    theirs = _identity(powerapi.from_mongodb(type(report), document))
                except DecodeError:  # not a report of this kind: another's
                    continue
                if theirs == _identity(report):
                    same.add(at)
        self.duplicates += len(same)
        return [at for at in taken if at not in same]

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
