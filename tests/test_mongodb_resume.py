"""The MongoDB input's change stream, resumed from a token the server refuses.

A checkpoint can hold a token the server no longer takes: its history is gone (the oplog rolled
over), the token is damaged, or it belongs to another collection. The input must not stop
there: it reads by ``_id`` after the last document it handed on, then follows a fresh change
stream, and every document arrives once. The refusals here are real ones, from a real
MongoDB-wire server given a damaged token and another collection's token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from wattflow.actors.pullers.mongodb import MongoDBPuller, MongoDBPullerConfig
from wattflow.formats.batch import expand

from .servers import ServerProcess, mongodb_uri
from .test_mongodb_frames import Recorder, documents_of, stream

Document = dict[str, Any]
WAIT_S = 30.0


def received(recorder: Recorder) -> Counter[tuple[Any, ...]]:
    """Each report handed on, by what identifies it."""
    return Counter(
        (report.timestamp, report.sensor, report.target)
        for batch in recorder.batches
        for report in expand(batch)
    )


async def handed_on(recorder: Recorder, task: asyncio.Task[None], count: int) -> None:
    """Wait, within a bound, until ``count`` reports were handed on (or the input failed)."""
    async with asyncio.timeout(WAIT_S):
        while received(recorder).total() < count:
            if task.done():
                task.result()
                raise AssertionError("the input ended before its reports came")
            await asyncio.sleep(0.01)


def follow(
    config: MongoDBPullerConfig,
    steps: list[tuple[int, list[Document]]],
    hwpc: Any,
) -> Recorder:
    """Follow the collection; at each step wait for that many reports, then insert the
    documents given; stop cleanly after the last step."""

    async def go() -> Recorder:
        recorder = Recorder()
        task = asyncio.create_task(MongoDBPuller(config, stream=True).pull(recorder))
        for count, documents in steps:
            await handed_on(recorder, task, count)
            if documents:
                await asyncio.to_thread(hwpc.insert_many, documents)
        recorder.stopping.set()
        await asyncio.wait_for(task, WAIT_S)
        return recorder

    return asyncio.run(go())


@pytest.mark.parametrize("refused", ["another collection's token", "a damaged token"])
def test_a_refused_resume_token_reads_by_id_then_follows_a_fresh_stream(
    tmp_path: Path,
    mongodb_server: ServerProcess,
    caplog: pytest.LogCaptureFixture,
    refused: str,
) -> None:
    documents = documents_of(stream(tmp_path, ticks=20))
    assert len(documents) == 120
    identities = Counter((d["timestamp"], d["sensor"], d["target"]) for d in documents)
    client: MongoClient[Document] = MongoClient(mongodb_uri(mongodb_server), tz_aware=True)
    try:
        hwpc = client["powerapi"]["hwpc"]
        checkpoints = client["powerapi"]["wattflow_checkpoints"]
        config = MongoDBPullerConfig(
            uri=mongodb_uri(mongodb_server),
            db="powerapi",
            collection="hwpc",
            max_batch=7,
            checkpoint_interval_s=0.05,
            poll_interval_s=0.05,
        )
        hwpc.insert_many(documents[:30])
        # The backlog, then documents that come through the change stream.
        first = follow(config, [(30, documents[30:60]), (60, [])], hwpc)
        [saved] = checkpoints.find()
        assert saved["token"] is not None
        assert saved["last_id"] == documents[59]["_id"], "the stream moved the position on"

        hwpc.insert_many(documents[60:90])  # while the service is down
        if refused == "a damaged token":
            token: Mapping[str, Any] | None = {"_data": "00DEADBEEF"}
        else:
            with client["powerapi"]["other"].watch() as changes:
                token = changes.resume_token
        checkpoints.update_one({"_id": saved["_id"]}, {"$set": {"token": token}})
        # A real refusal, from the server itself.
        with (
            pytest.raises(OperationFailure, match=r"(?i)resume token"),
            hwpc.watch(resume_after=token),
        ):
            pass

        with caplog.at_level(logging.WARNING, logger="wattflow.actors.pullers.mongodb"):
            second = follow(config, [(30, documents[90:]), (60, [])], hwpc)
        [saved] = checkpoints.find()
    finally:
        client.close()

    assert "refused to resume the change stream" in caplog.text
    assert first.rejected == second.rejected == []
    assert received(first) + received(second) == identities, "every document once"
    assert set(received(second)) == set(identities) - set(received(first))
    assert saved["token"] not in (None, token), "a fresh change stream's token was saved"
    assert saved["backlog_done"]
    assert saved["last_id"] == documents[-1]["_id"]
