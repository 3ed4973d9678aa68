"""MongoDB input: hwpc-sensor's documents, read once, or followed as the sensor inserts them.

PowerAPI's stream mode consumes its input: it calls ``find_one_and_delete`` for every document,
so a crash loses the document in hand and nothing else can read the collection. This input
never deletes or changes a document. It follows the collection through a change stream (or, on a
server without replica-set features, by polling ``_id``), and keeps its position in a checkpoint
document beside the input, so a restarted service resumes where it stopped.

Stream mode, step by step:

1. On the first start, a change stream is opened and its resume token saved: from then on no
   insert can be missed.
2. The documents already in the collection (the backlog) are read in ``_id`` order.
3. The change stream is followed from the saved token. Documents inserted while the backlog was
   read show up in both; the ids read near the end of the backlog are remembered (a bounded
   number) and skipped once.
4. The position is committed by acknowledgement: at a batch boundary, once an interval, a
   checkpoint barrier follows the documents handed on through the pipeline, and once every
   output has written what came before it, the position is saved with the formulas' state in
   one document (:mod:`wattflow.actors.checkpoints`). A crash re-reads only what was in flight
   after that barrier; the MongoDB and InfluxDB outputs write each report once all the same.
   A clean stop commits the exact position after the drain. Run on its own (no pipeline), the
   input saves its position at a clean stop.

A server that goes away is waited for, with backoff, for as long as the service runs; the
change stream resumes from its token, so an outage loses nothing. A token the server refuses
(history lost, damaged, another collection's) sends the input back to step 2 from the last id
it handed on, with a fresh change stream: the stream is never stranded on a bad token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Self

import orjson
from bson import Binary, ObjectId, json_util
from pydantic import Field, PositiveInt, model_validator
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import ConfigurationError, InvalidURI, OperationFailure, PyMongoError
from pymongo.uri_parser import parse_uri

from wattflow.actors.checkpoints import StateStore
from wattflow.actors.connections import describe_driver_error, read_secret, redact_uri
from wattflow.actors.errors import PullError
from wattflow.actors.partition import Partition
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig, hand_on
from wattflow.actors.runtime import Backoff
from wattflow.formats.json_frames import Layout, decode_documents
from wattflow.formats.reports import Report, report_kind

logger = logging.getLogger(__name__)

Document = dict[str, Any]

_NO_CHANGE_STREAMS = {40573, 40415, 136}
"""Server error codes meaning "no change streams here" (standalone server, or disabled)."""

_AUTHENTICATION_FAILED = {18, 13}

_TOKEN_REFUSED = {9, 260, 280, 286}
"""Server error codes meaning "not from this token": FailedToParse, InvalidResumeToken,
ChangeStreamFatalError (e.g. a token of another collection), ChangeStreamHistoryLost (the oplog
rolled over past it)."""


def refuses_token(error: OperationFailure) -> bool:
    """Whether the server refused to resume a change stream from the token it was given (some
    servers answer a token of another namespace with code 13, naming the token)."""
    message = str(error.details.get("errmsg", "") if error.details else error)
    return error.code in _TOKEN_REFUSED or "resume token" in message.lower()


class MongoDBPullerConfig(PullerConfig):
    """Settings of the MongoDB input (``--input mongodb -u URI -d DB -c COLLECTION``)."""

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
        description="Database of the collection.",
        json_schema_extra={"flags": ["-d", "--db"]},
    )
    collection: str = Field(
        min_length=1,
        description="Collection hwpc-sensor writes to.",
        json_schema_extra={"flags": ["-c", "--collection"]},
    )
    max_batch: PositiveInt = Field(default=1000, description="Documents handed on at once.")
    checkpoint_collection: str = Field(
        default="wattflow_checkpoints",
        min_length=1,
        description="Collection, in the same database, where stream mode keeps its position.",
    )
    checkpoint_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often stream mode commits its position and the formulas' state, "
        "each time once every output has written what came before it.",
    )
    poll_interval_s: float = Field(
        default=0.2,
        gt=0,
        description="Longest wait for new documents before checking whether to stop.",
    )
    server_timeout_s: float = Field(
        default=5.0, gt=0, description="How long one attempt waits for an unreachable server."
    )
    recent_ids: PositiveInt = Field(
        default=100_000,
        description="Ids remembered from the end of the backlog, to skip them in the stream.",
    )

    @model_validator(mode="after")
    def _one_uri(self) -> Self:
        if (self.uri is None) == (self.uri_file is None):
            raise ValueError("give the connection string with exactly one of --uri, --uri-file")
        return self

    @classmethod
    def example(cls) -> MongoDBPullerConfig:
        """hwpc-sensor's collection on a local server."""
        return cls(
            type="mongodb", uri="mongodb://127.0.0.1:27017", db="powerapi", collection="hwpc"
        )


def connection_string(uri: str | None, uri_file: Path | None) -> str:
    """The connection string, from the flag or from its file.

    Raises:
        PullError: a string pymongo cannot parse; the message shows it without its password.
    """
    text = uri if uri is not None else read_secret(uri_file, "--uri-file") if uri_file else ""
    try:
        parse_uri(text)
    except (InvalidURI, ConfigurationError, ValueError) as error:
        raise PullError(
            f"not a MongoDB connection string: {redact_uri(text)!r}: {redact_uri(str(error))}"
        ) from None
    return text


def printable(document: Mapping[str, Any]) -> str:
    """A document as MongoDB extended JSON, for a dead letter that keeps all of it."""
    return json_util.dumps(document)


class _Position:
    """Where stream mode stands: the change stream's token and how far the backlog was read."""

    def __init__(self, saved: Mapping[str, Any] | None) -> None:
        saved = saved or {}
        self.token: Mapping[str, Any] | None = saved.get("token")
        self.last_id: Any = saved.get("last_id")
        self.backlog_done: bool = bool(saved.get("backlog_done", False))
        self.polling: bool = bool(saved.get("polling", False))

    def snapshot(self) -> Document:
        return {
            "token": self.token,
            "last_id": self.last_id,
            "backlog_done": self.backlog_done,
            "polling": self.polling,
        }


@pullers.register("mongodb")
class MongoDBPuller(Puller[MongoDBPullerConfig]):
    """Reads documents in batches and hands each batch on before reading more."""

    config_model = MongoDBPullerConfig

    def __init__(self, config: MongoDBPullerConfig, *, stream: bool = False) -> None:
        super().__init__(config, stream=stream)
        self.source = f"mongodb {config.db}.{config.collection}"
        self._recent: set[Any] = set()
        self._recent_order: deque[Any] = deque()
        self._down_since: float | None = None
        self._backoff = Backoff(0.1, 5.0)
        self._reached = False
        self._layouts: dict[str, Layout] = {}
        """Each sensor's groups, remembered from one batch to the next."""

    @property
    def resumable(self) -> bool:
        return self.stream

    def state_store(self) -> StateStore | None:
        return _CheckpointStore(self) if self.stream else None

    @property
    def checkpoint_interval_s(self) -> float:
        return self.config.checkpoint_interval_s

    async def _boundary(self, position: _Position) -> None:
        """Tell the pipeline the input handed on everything up to ``position`` (its snapshot
        is taken only when there is a pipeline to tell)."""
        if self.acknowledger is not None:
            await self.acknowledger.boundary(position.snapshot())

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
            raise PullError(describe_driver_error(error)) from None
        finally:
            await client.close()
        replica = f"replica set {hello['setName']}" if hello.get("setName") else "standalone"
        return f"{replica}; {self.config.db}.{self.config.collection} holds {count} documents"

    async def check(self) -> None:
        try:
            report_kind(self.config.model)
        except ValueError as error:
            raise PullError(f"input '{self.config.name}': {error}") from None
        connection_string(self.config.uri, self.config.uri_file)

    def _client(self) -> AsyncMongoClient[Document]:
        return AsyncMongoClient(
            connection_string(self.config.uri, self.config.uri_file),
            tz_aware=True,
            serverSelectionTimeoutMS=int(self.config.server_timeout_s * 1000),
            appname="wattflow",
        )

    async def pull(self, emitter: Emitter) -> None:
        kind = report_kind(self.config.model)
        client = self._client()
        try:
            collection = client[self.config.db][self.config.collection]
            if self.stream:
                await self._follow(client, collection, kind, emitter)
            else:
                await self._read_once(collection, kind, emitter)
        finally:
            await client.close()

    # --- reading -------------------------------------------------------------------------------

    async def _read_once(
        self, collection: AsyncCollection[Document], kind: type[Report], emitter: Emitter
    ) -> None:
        """Read the collection in ``_id`` order and end; an outage resumes after the last id."""
        last_id: Any = None
        done = False
        while not done and not emitter.stopping.is_set():
            try:
                last_id, done = await self._read_backlog(collection, kind, emitter, last_id)
            except PyMongoError as error:
                await self._wait_for_server(error, emitter)

    async def _read_backlog(
        self,
        collection: AsyncCollection[Document],
        kind: type[Report],
        emitter: Emitter,
        last_id: Any,
        position: _Position | None = None,
    ) -> tuple[Any, bool]:
        """Read documents after ``last_id`` in ``_id`` order; return the last id and whether
        the end was reached (rather than a stop)."""
        query = {} if last_id is None else {"_id": {"$gt": last_id}}
        cursor = collection.find(query).sort("_id", 1).batch_size(self.config.max_batch)
        try:
            while not emitter.stopping.is_set():
                documents = await cursor.to_list(self.config.max_batch)
                if not documents:
                    return last_id, True
                self._back_up()
                await self._emit(documents, kind, emitter)
                last_id = documents[-1]["_id"]
                if position is not None:
                    position.last_id = last_id
                    self._remember(documents)
                    await self._boundary(position)
            return last_id, False
        finally:
            await cursor.close()

    async def _follow(
        self,
        client: AsyncMongoClient[Document],
        collection: AsyncCollection[Document],
        kind: type[Report],
        emitter: Emitter,
    ) -> None:
        checkpoints = client[self.config.db][self.config.checkpoint_collection]
        position = await self._load_checkpoint(checkpoints, emitter)
        if position is None:  # stopped while the server was down
            return
        while not emitter.stopping.is_set():
            try:
                if position.token is None and not position.polling:
                    await self._open_stream(collection, position)
                    await self._save_stream_start(checkpoints, position)
                if not position.backlog_done:
                    _, position.backlog_done = await self._read_backlog(
                        collection, kind, emitter, position.last_id, position
                    )
                    await self._boundary(position)
                    continue
                if position.polling:
                    await self._poll(collection, kind, emitter, position, checkpoints)
                else:
                    await self._follow_changes(collection, kind, emitter, position, checkpoints)
            except OperationFailure as error:
                if error.code in _AUTHENTICATION_FAILED:
                    raise PullError(f"{self.source}: {redact_uri(str(error))}") from None
                await self._wait_for_server(error, emitter)
            except PyMongoError as error:
                await self._wait_for_server(error, emitter)
        if self.acknowledger is None:
            # On its own, at a clean stop, everything read has been handed on: the exact
            # position is saved. In a pipeline, the drain's last checkpoint saves it.
            await self._save_at_exit(checkpoints, position)

    async def _open_stream(
        self, collection: AsyncCollection[Document], position: _Position
    ) -> None:
        """Take the change stream's current token, or fall back to polling without one."""
        try:
            async with await collection.watch() as changes:
                position.token = changes.resume_token
        except OperationFailure as error:
            if error.code not in _NO_CHANGE_STREAMS:
                raise
            logger.warning(
                "%s: the server has no change streams (%s); polling by _id instead, which "
                "assumes ids grow in insertion order",
                self.source,
                error.details.get("errmsg") if error.details else error,
            )
            position.polling = True

    async def _follow_changes(
        self,
        collection: AsyncCollection[Document],
        kind: type[Report],
        emitter: Emitter,
        position: _Position,
        checkpoints: AsyncCollection[Document],
    ) -> None:
        inserts = [{"$match": {"operationType": "insert"}}]
        wait_ms = int(self.config.poll_interval_s * 1000)
        try:
            stream = await collection.watch(
                inserts,
                resume_after=position.token,
                max_await_time_ms=wait_ms,
                batch_size=self.config.max_batch,
            )
        except OperationFailure as error:
            if not refuses_token(error):
                raise
            self._read_ids_again(position, error)
            return
        async with stream as changes:
            self._back_up()
            while not emitter.stopping.is_set():
                documents: list[Document] = []
                while len(documents) < self.config.max_batch:
                    change = await changes.try_next()
                    if change is None:
                        break
                    document = change.get("fullDocument")
                    if document is not None and not self._seen_in_backlog(document):
                        documents.append(document)
                if documents:
                    await self._emit(documents, kind, emitter)
                    position.last_id = documents[-1]["_id"]
                elif self._recent:
                    # Caught up: every document the backlog read is behind us in the stream.
                    self._forget_backlog()
                position.token = changes.resume_token
                await self._boundary(position)

    def _read_ids_again(self, position: _Position, error: OperationFailure) -> None:
        """The server refused the saved token: read by ``_id`` after the last document handed
        on (the checkpoint's, at a start), then follow a fresh change stream, as on a first
        start. Nothing is lost or read twice as long as ids grow in insertion order."""
        logger.warning(
            "%s: the server refused to resume the change stream (%s); reading by _id after %s, "
            "then following a new change stream",
            self.source,
            error.details.get("errmsg") if error.details else error,
            position.last_id if position.last_id is not None else "the first document",
        )
        position.token = None
        position.backlog_done = False
        self._forget_backlog()

    async def _poll(
        self,
        collection: AsyncCollection[Document],
        kind: type[Report],
        emitter: Emitter,
        position: _Position,
        checkpoints: AsyncCollection[Document],
    ) -> None:
        while not emitter.stopping.is_set():
            position.last_id, _ = await self._read_backlog(
                collection, kind, emitter, position.last_id, position
            )
            self._forget_backlog()
            await self._boundary(position)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emitter.stopping.wait(), self.config.poll_interval_s)

    async def _emit(self, documents: list[Document], kind: type[Report], emitter: Emitter) -> None:
        """Hand a batch on as the JSON inputs do: hwpc-sensor's documents as one frame per
        sensor when the batch is plain, else document by document, each document that is not
        a report dead-lettered (:func:`~wattflow.formats.json_frames.decode_documents`)."""
        decoded, errors = decode_documents(kind, documents, self.source, self._layouts)
        for error, document in errors:
            emitter.reject(printable(document), str(error))
        await hand_on(emitter, decoded)

    # --- the overlap between backlog and stream -----------------------------------------------

    def _remember(self, documents: list[Document]) -> None:
        for document in documents:
            identifier = _hashable(document["_id"])
            self._recent.add(identifier)
            self._recent_order.append(identifier)
        while len(self._recent_order) > self.config.recent_ids:
            self._recent.discard(self._recent_order.popleft())

    def _seen_in_backlog(self, document: Document) -> bool:
        identifier = _hashable(document.get("_id"))
        if identifier in self._recent:
            self._recent.discard(identifier)
            return True
        return False

    def _forget_backlog(self) -> None:
        self._recent.clear()
        self._recent_order.clear()

    # --- checkpoints ---------------------------------------------------------------------------

    @property
    def _checkpoint_base(self) -> str:
        """The input and its collection: the key of its checkpoint without ``--partition``."""
        return f"{self.config.name}:{self.config.db}.{self.config.collection}"

    @property
    def _checkpoint_id(self) -> str:
        """The checkpoint's key: the input and its collection, and the partition when there
        is one, so that N instances following one collection (``--partition i/N``) each keep
        their own position rather than overwrite each other's."""
        key = self._checkpoint_base
        return key if self.partition is None else f"{key}:partition-{self.partition}"

    async def _start_of_new_partitioning(
        self, checkpoints: AsyncCollection[Document]
    ) -> Document | None:
        """Where an instance with no checkpoint of its own starts when the same input has
        checkpoints under another partitioning (N changed, ``--partition`` given or dropped):
        the earliest ``_id`` handed on by the instances of the partitioning saved last, so that
        only what one of them had not committed is read again, not the whole collection.

        Sensors move between instances when N changes, so each new instance reads from the
        old instances' earliest position. Documents of sensors whose old instance was further
        ahead are read again (written twice, by the outputs that append). The collection is
        read from its start when there is no other partitioning (``None``), or when one of its
        instances had handed on nothing.
        """
        own = "" if self.partition is None else str(self.partition.count)
        groups: dict[str, list[Document]] = {}
        async for saved in checkpoints.find({"collection": self.config.collection}):
            partitioning = _partitioning(str(saved["_id"]), self._checkpoint_base)
            if partitioning is not None and partitioning != own:
                groups.setdefault(partitioning, []).append(saved)
        if not groups:
            return None
        latest = max(groups.values(), key=lambda group: max(map(_saved_at, group)))
        names = ", ".join(sorted(str(d["_id"]) for d in latest))
        earliest = _earliest([d.get("last_id") for d in latest])
        logger.warning(
            "%s: no checkpoint %s, but %s: starting from the earliest document they had all "
            "handed on (%s); documents after it that some of them had handed on are read "
            "again, and sensors that moved to this instance start without learned state",
            self.source,
            self._checkpoint_id,
            names,
            earliest if earliest is not None else "the first document",
        )
        return {"last_id": earliest}

    async def _load_checkpoint(
        self, checkpoints: AsyncCollection[Document], emitter: Emitter
    ) -> _Position | None:
        while not emitter.stopping.is_set():
            try:
                saved = await checkpoints.find_one({"_id": self._checkpoint_id})
                start = None if saved else await self._start_of_new_partitioning(checkpoints)
            except OperationFailure as error:
                if error.code in _AUTHENTICATION_FAILED:
                    raise PullError(f"{self.source}: {redact_uri(str(error))}") from None
                await self._wait_for_server(error, emitter)
            except PyMongoError as error:
                await self._wait_for_server(error, emitter)
            else:
                self._back_up()
                if saved is not None:
                    logger.info("%s: resuming from checkpoint %s", self.source, self._checkpoint_id)
                state = None if saved is None else saved.get("state")
                if self.acknowledger is not None:  # with no state too: the others wait
                    self.acknowledger.restore(None if state is None else bytes(state))
                return _Position(saved or start)
        return None

    async def _save_stream_start(
        self, checkpoints: AsyncCollection[Document], position: _Position
    ) -> None:
        """Save a new change stream's token before reading the backlog, so that no insert made
        from now on can be missed. Only the stream's fields change: the committed ``last_id``
        (where the backlog is read again from) and the formulas' state stay as they are."""
        fields = {
            "token": position.token,
            "backlog_done": False,
            "polling": position.polling,
            "collection": self.config.collection,
            "saved": datetime.now(UTC),
        }
        # A new checkpoint starts at the position the input starts from (another
        # partitioning's, see _start_of_new_partitioning), not at the collection's start.
        await checkpoints.update_one(
            {"_id": self._checkpoint_id},
            {"$set": fields, "$setOnInsert": {"last_id": position.last_id}},
            upsert=True,
        )

    async def _save(
        self,
        checkpoints: AsyncCollection[Document],
        snapshot: Document,
        state: bytes | None = None,
    ) -> None:
        document = {**snapshot, "collection": self.config.collection, "saved": datetime.now(UTC)}
        if state is not None:
            document["state"] = Binary(state)
        await checkpoints.replace_one({"_id": self._checkpoint_id}, document, upsert=True)

    async def _save_at_exit(
        self, checkpoints: AsyncCollection[Document], position: _Position
    ) -> None:
        try:
            await self._save(checkpoints, position.snapshot())
        except PyMongoError as error:
            logger.warning(
                "%s: could not save the checkpoint at exit (%s); the next start re-reads "
                "from the last one",
                self.source,
                redact_uri(str(error)),
            )

    # --- outages -------------------------------------------------------------------------------

    async def _wait_for_server(self, error: PyMongoError, emitter: Emitter) -> None:
        """Log the outage once, then wait a little longer each time (:class:`Backoff`), until
        stopped."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._backoff.reset()
            logger.warning(
                "%s: server unavailable (%s); retrying until it is back",
                self.source,
                describe_driver_error(error),
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(emitter.stopping.wait(), self._backoff.next_s())

    def not_ready(self) -> str | None:
        if self._down_since is not None:
            return f"server unavailable for {time.monotonic() - self._down_since:.0f} s"
        return None if self._reached else "server not reached yet"

    def _back_up(self) -> None:
        self._reached = True
        if self._down_since is not None:
            logger.warning(
                "%s: server back after %.1f s", self.source, time.monotonic() - self._down_since
            )
            self._down_since = None


class _CheckpointStore(StateStore):
    """The input's checkpoint document, which then holds the formulas' state beside the
    position: both are replaced in one write. The input reads it back at its start."""

    def __init__(self, puller: MongoDBPuller) -> None:
        self.puller = puller
        self.restored_by = puller.config.name
        self._client: AsyncMongoClient[Document] | None = None

    def describe(self) -> str:
        config = self.puller.config
        return f"mongodb {config.db}.{config.checkpoint_collection}"

    async def save(self, data: bytes, positions: dict[str, Any]) -> None:
        position = positions.get(self.puller.config.name)
        if position is None:
            return  # the input never handed anything on: what is saved stays right
        if self._client is None:
            self._client = self.puller._client()
        config = self.puller.config
        checkpoints = self._client[config.db][config.checkpoint_collection]
        await self.puller._save(checkpoints, position, data)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _saved_at(checkpoint: Document) -> datetime:
    """When a checkpoint was saved (the epoch for one that does not say)."""
    saved = checkpoint.get("saved")
    if isinstance(saved, datetime) and saved.tzinfo is not None:
        return saved
    return datetime(1970, 1, 1, tzinfo=UTC)


def _partitioning(checkpoint_id: str, base: str) -> str | None:
    """How the instance that saved a checkpoint of input ``base`` was partitioned: ``""``
    without ``--partition``, else its N as text; ``None`` for another input's checkpoint."""
    if checkpoint_id == base:
        return ""
    prefix = f"{base}:partition-"
    if not checkpoint_id.startswith(prefix):
        return None
    try:
        return str(Partition.parse(checkpoint_id[len(prefix) :]).count)
    except ValueError:
        return None


def _earliest(last_ids: list[Any]) -> Any:
    """The least of the ids (``None`` if one is missing: that instance handed on nothing)."""
    if None in last_ids:
        return None
    try:
        return min(last_ids)
    except TypeError:  # ids of several BSON types, which Python does not order
        return None


def _hashable(identifier: Any) -> Any:
    """An ``_id`` usable in a set (ObjectIds are; a document ``_id`` is not)."""
    if (
        isinstance(identifier, ObjectId | str | int | float | bytes | datetime)
        or identifier is None
    ):
        return identifier
    return orjson.dumps(identifier, default=str)
