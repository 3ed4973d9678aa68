"""SIGKILL while following a growing JSON Lines file, restart: no PowerReport missing.

``wattflow run -s --input jsonl --files F --state-file S`` follows a file that hwpc-sensor's
reports are appended to, with SmartWatts and RAPL, into a MongoDB output (SecantusDB) and a
JSON Lines output. It is killed twice, in the middle of a stream of appends and once the
checkpoint has reached the end of the file after an idle spell (SmartWatts still holding its
last ticks), and started again each time. The MongoDB output must then hold exactly a clean
run's PowerReports: none missing, none doubled (it is idempotent), the same values. The JSON
Lines output appends: it must hold every report, and what it repeats (what was written after
the last checkpoint before a kill) must be the same reports with the same values.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from wattflow.formats import powerapi

from ..conftest import wait_until, wattflow
from ..servers import ServerProcess, mongodb_uri
from ..test_followed_files import committed_to_the_end, saved_positions
from ..test_smartwatts import reports_of, workload
from .crashes import Document, Restarts, assert_same_powers, power_of

TICKS = 60
PER_TICK = 4
WAIT_S = 60.0


def outputs(uri: str, collection: str, jsonl: Path) -> list[str]:
    return [
        "--output", "mongodb", "-u", uri, "-d", "powerapi", "-c", collection,
        "--output", "jsonl", "--file", str(jsonl),
    ]  # fmt: skip


def append(path: Path, lines: list[str]) -> None:
    """Append as a sensor's recorder does: a tick's lines at a time, paced."""
    for start in range(0, len(lines), PER_TICK):
        with path.open("a") as growing:
            growing.write("".join(lines[start : start + PER_TICK]))
        time.sleep(0.05)


def lines_written(path: Path) -> Counter[tuple[Any, ...]]:
    """How often each PowerReport is in a JSON Lines output, with its power."""
    found = Counter[tuple[Any, ...]]()
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        document = json.loads(line)
        metadata = document.get("metadata", {})
        found[
            (
                document["timestamp"],
                document["target"],
                metadata.get("scope"),
                metadata.get("socket"),
                round(float(document["power"]), 6),
            )
        ] += 1
    return found


def test_sigkill_while_following_a_file_loses_nothing(
    mongodb_server: ServerProcess, tmp_path: Path
) -> None:
    uri = mongodb_uri(mongodb_server)
    client: MongoClient[Document] = MongoClient(uri, tz_aware=True)
    lines = [powerapi.encode_json(r) + "\n" for r in reports_of(workload(TICKS))]
    whole, source, state = tmp_path / "all.jsonl", tmp_path / "hwpc.jsonl", tmp_path / "state"
    whole.write_text("".join(lines))
    clean = wattflow(
        "run", "--input", "jsonl", "--files", str(whole),
        *outputs(uri, "clean", tmp_path / "clean.jsonl"), timeout_s=WAIT_S,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr
    expected = power_of(client, "clean")
    out = tmp_path / "power.jsonl"

    runs = Restarts(
        tmp_path, "run", "-s", "--state-file", str(state),
        "--state-interval-s", "0.2", "--input", "jsonl", "--files", str(source),
        "--poll-interval-s", "0.05", *outputs(uri, "power", out),
    )  # fmt: skip

    def written() -> int:
        return client["powerapi"]["power"].count_documents({})

    try:
        source.write_text("".join(lines[: 10 * PER_TICK]))
        # 1. Killed in the middle of a stream of appends, after a checkpoint.
        with runs.start() as first:
            wait_until(lambda: first.alive() and written() > 0, WAIT_S, "reports written")
            writer = threading.Thread(
                target=append, args=(source, lines[10 * PER_TICK : 40 * PER_TICK])
            )
            writer.start()
            wait_until(
                lambda: first.alive() and len(saved_positions(state)) > 0,
                WAIT_S,
                "a checkpoint saved",
            )
            runs.crash(first)
            writer.join(WAIT_S)

        # 2. Killed after an idle spell: the checkpoint reached the end of the file while
        #    SmartWatts still held its last ticks.
        with runs.start() as second:
            second.wait_for_log("going on from line", timeout_s=WAIT_S)
            wait_until(
                lambda: second.alive() and committed_to_the_end(state, source),
                WAIT_S,
                "the checkpoint at the end of the file",
            )
            runs.crash(second)

        # 3. Restarted: it goes on with the models it had, and the rest of the file.
        with runs.start() as third:
            third.wait_for_log("going on from line", timeout_s=WAIT_S)
            third.wait_for_log("restored the state of", timeout_s=WAIT_S)
            append(source, lines[40 * PER_TICK :])
            wait_until(
                lambda: third.alive() and committed_to_the_end(state, source),
                WAIT_S,
                "the whole file read",
            )
            log = third.stop(timeout_s=WAIT_S)
        assert "Traceback" not in log
        got = power_of(client, "power")
    finally:
        client.close()

    assert_same_powers(expected, got)

    # The appending output: every report, some twice, each time the same one.
    clean_lines = lines_written(tmp_path / "clean.jsonl")
    appended = lines_written(out)
    assert set(appended) == set(clean_lines), "the JSON Lines output differs from a clean run's"
    repeated = sum(count - 1 for count in appended.values())
    assert repeated < len(clean_lines) // 4, "a restart read the file again from its start"
    print(
        f"\nJSON Lines output: {sum(appended.values())} lines for {len(clean_lines)} "
        f"PowerReports, {repeated} repeated after the two kills"
    )
