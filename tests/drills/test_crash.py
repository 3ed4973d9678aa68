"""SIGKILL mid-stream, restart: no PowerReport missing or doubled, and no relearning.

``wattflow run -s --input mongodb … --output mongodb`` follows hwpc-sensor's collection on a real
MongoDB-wire server (SecantusDB) with SmartWatts and RAPL. It is killed three times: right after
its start (its change stream just opened), in the middle of a stream of inserts, and after the
stream has been idle long enough for the checkpoint to reach the last document while SmartWatts
still holds the ticks its lateness window keeps (the case a timer-driven checkpoint lost). Each
time it is started again. The PowerReports in the output must then be exactly a clean run's
(one read of the whole collection): none missing, none doubled, the same values, which also
shows that the restarted SmartWatts estimated its first ticks with the models it had learned
(a relearning one reports no target for its first ten ticks).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pymongo import MongoClient

from ..conftest import wait_until, wattflow
from ..servers import ServerProcess, mongodb_uri
from ..test_mongodb import hwpc_documents
from .crashes import Document, Restarts, assert_same_powers, power_of

TICKS = 60
PER_TICK = 4  # the global report and three targets
WAIT_S = 60.0
TARGETS = {"web", "db", "batch"}
"""The workload's containers: only SmartWatts estimates them (RAPL reports the sockets)."""


def flags(uri: str, collection: str, output: str) -> list[str]:
    return [
        "--input", "mongodb", "-u", uri, "-d", "powerapi", "-c", collection,
        "--checkpoint-interval-s", "0.2", "--poll-interval-s", "0.05",
        "--output", "mongodb", "-u", uri, "-d", "powerapi", "-c", output,
    ]  # fmt: skip


def checkpoint(client: MongoClient[Document]) -> Document | None:
    return client["powerapi"]["wattflow_checkpoints"].find_one()


def insert(client: MongoClient[Document], documents: list[Document], per_batch: int) -> None:
    """Insert as a sensor does: a tick's documents at a time, paced."""
    collection = client["powerapi"]["hwpc"]
    for start in range(0, len(documents), per_batch):
        collection.insert_many(documents[start : start + per_batch])
        time.sleep(0.02)


def test_sigkill_mid_stream_loses_and_doubles_nothing(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    uri = mongodb_uri(mongodb_server)
    client: MongoClient[Document] = MongoClient(uri, tz_aware=True)
    documents = hwpc_documents(TICKS)
    assert len(documents) == TICKS * PER_TICK
    client["powerapi"]["all"].insert_many([dict(d) for d in documents])
    clean = wattflow("run", *flags(uri, "all", "clean"), timeout_s=WAIT_S)
    assert clean.returncode == 0, clean.stderr
    expected = power_of(client, "clean")
    assert len({key[0] for key in expected}) > TICKS - 5, "the clean run estimated most ticks"

    runs = Restarts(tmp_path, "run", "-s", *flags(uri, "hwpc", "power"))

    def written() -> int:
        return client["powerapi"]["power"].count_documents({})

    try:
        insert(client, documents[: 10 * PER_TICK], PER_TICK)
        # 1. Killed right after its start: its change stream just opened.
        with runs.start() as first:
            wait_until(
                lambda: first.alive() and (checkpoint(client) or {}).get("token") is not None,
                WAIT_S,
                "the change stream opened",
            )
            runs.crash(first)

        # 2. Killed in the middle of a stream of inserts.
        with runs.start() as second:
            inserter = threading.Thread(
                target=insert, args=(client, documents[10 * PER_TICK : 40 * PER_TICK], PER_TICK)
            )
            inserter.start()
            wait_until(
                lambda: second.alive() and written() > 0 and checkpoint_has_state(client),
                WAIT_S,
                "reports written and a checkpoint with state",
            )
            runs.crash(second)
            inserter.join(WAIT_S)

        # 3. Killed after an idle spell: the checkpoint reached the last document while
        #    SmartWatts still held its last ticks (nothing newer closed them).
        last_id = documents[40 * PER_TICK - 1]["_id"]
        with runs.start() as third:
            wait_until(
                lambda: (
                    third.alive()
                    and (checkpoint(client) or {}).get("last_id") == last_id
                    and checkpoint_has_state(client)
                ),
                WAIT_S,
                "the checkpoint at the last document",
            )
            until_now = {key[0] for key in expected if key[0] <= tick_ms(documents, 39)}
            targets = {key[0] for key in power_of(client, "power") if key[2] in TARGETS}
            assert targets < until_now, "SmartWatts still holds the last ticks"
            runs.crash(third)

        # 4. Restarted: it goes on with the models it had, and the rest of the stream.
        with runs.start() as fourth:
            fourth.wait_for_log("restored the state of", timeout_s=WAIT_S)
            insert(client, documents[40 * PER_TICK :], PER_TICK)
            near_end = tick_ms(documents, TICKS - 5)
            wait_until(
                lambda: fourth.alive() and newest_ms(client) >= near_end,
                WAIT_S,
                "the rest of the stream written",
            )
            log = fourth.stop(timeout_s=WAIT_S)
        assert "Traceback" not in log
        got = power_of(client, "power")
    finally:
        client.close()

    assert_same_powers(expected, got)


def tick_ms(documents: list[Document], tick: int) -> int:
    return int(documents[tick * PER_TICK]["timestamp"].timestamp() * 1000)


def checkpoint_has_state(client: MongoClient[Document]) -> bool:
    return (checkpoint(client) or {}).get("state") is not None


def newest_ms(client: MongoClient[Document]) -> int:
    """The newest PowerReport written (0 before the first)."""
    newest = client["powerapi"]["power"].find_one(sort=[("timestamp", -1)])
    return 0 if newest is None else int(newest["timestamp"].timestamp() * 1000)
