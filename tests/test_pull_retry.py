"""An input that is unavailable for now is retried with backoff, for a bounded time; one that
cannot work at start stops the command at once.

A port another program holds when the service starts is a misconfiguration: ``wattflow run``
exits 2 with one line naming the flag, and ``wattflow check`` says so. A port taken after that
check (in the moment before the input listens) raises an error marked retryable: the pipeline
retries it, takes the port once it is free, and reads hwpc-sensor's reports as usual. Real
ports, a real service process, a real pipeline.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.socket import SocketPuller, SocketPullerConfig
from wattflow.actors.pushers.jsonl import JsonlPusher, JsonlPusherConfig
from wattflow.actors.runtime import Backoff

from .conftest import complete_lines, run_async, wattflow

LINE = b'{"timestamp": 1700000000000, "sensor": "node-1", "target": "all", "groups": {}}\n'


def test_a_port_taken_after_the_check_is_retried_until_it_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    out = tmp_path / "hwpc.jsonl"
    puller = SocketPuller(SocketPullerConfig(port=port, retry_for_s=60))
    pusher = JsonlPusher(JsonlPusherConfig(model="HWPCReport", file=out))

    async def scenario() -> None:
        pipeline = Pipeline([puller], [], [pusher])
        running = asyncio.create_task(pipeline.run())
        while caplog.text.count("cannot listen on 127.0.0.1") < 2:
            assert not running.done(), caplog.text
            await asyncio.sleep(0.02)
        assert "retrying in" in caplog.text
        held.close()
        await asyncio.wait_for(puller.listening.wait(), 20)
        with socket.create_connection(("127.0.0.1", port)) as sensor:
            sensor.sendall(LINE)
            while complete_lines(out) < 1:
                await asyncio.sleep(0.02)
        pipeline.stop()
        result = await running
        assert not result.failures

    try:
        run_async(scenario())
    finally:
        held.close()
    assert json.loads(out.read_text())["sensor"] == "node-1"


@pytest.mark.parametrize("kind", ["socket", "meter"])
def test_a_port_busy_at_start_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    """A listening input whose port another program holds: ``wattflow run`` stops at once with
    exit 2 and one line naming the flag (it was retried for ``--retry-for-s``, then exit 1 with
    a traceback), and ``wattflow check`` says the input cannot work (it said ``ok``)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        flags = ["--input", kind, "--port", port, "--retry-for-s", "30",
                 "--output", "jsonl", "--file", str(tmp_path / "out.jsonl")]  # fmt: skip
        done = wattflow("run", "-s", *flags, timeout_s=20)
        checked = wattflow("check", *flags, env={"COLUMNS": "200"})
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"wattflow: error: input 'puller_{kind}': --port {port}: cannot listen on "
        f"127.0.0.1:{port}: Address already in use\n"
    )
    assert checked.returncode == 2, checked.stdout  # what run refuses at start: exit 2 too
    [line] = [line for line in checked.stdout.splitlines() if f"input puller_{kind}" in line]
    assert "│ no │" in line, checked.stdout
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in line


def test_an_address_not_of_this_machine_names_the_host_flag(tmp_path: Path) -> None:
    done = wattflow(
        "run", "-s", "--input", "socket", "--host", "192.0.2.1", "--port", "0",
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"), timeout_s=20,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "wattflow: error: input 'puller_socket': --host 192.0.2.1: cannot listen on "
        "192.0.2.1:0: Cannot assign requested address\n"
    )


def test_a_free_port_is_ok_in_wattflow_check(tmp_path: Path) -> None:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = str(spare.getsockname()[1])
    checked = wattflow(
        "check", "--input", "socket", "--port", port,
        "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"), env={"COLUMNS": "200"},
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout
    assert f"can listen on 127.0.0.1:{port}" in checked.stdout


def test_backoff_doubles_its_step_and_draws_each_delay_within_it() -> None:
    backoff = Backoff(0.1, 1.0)
    delays = [backoff.next_s() for _ in range(6)]
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert all(step / 2 <= delay <= step for delay, step in zip(delays, steps, strict=True))
    many = [Backoff(1.0, 1.0).next_s() for _ in range(50)]
    assert len(set(many)) > 40, "jitter: failures at the same moment retry at different ones"
    backoff.reset()
    assert backoff.next_s() <= 0.1


def test_a_port_still_taken_after_the_retries_is_one_line_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The input gives up after ``--retry-for-s``: the error says why in one line, without the
    traceback of an error raised on purpose."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        puller = SocketPuller(SocketPullerConfig(port=port, retry_for_s=0.3))
        pusher = JsonlPusher(JsonlPusherConfig(file=tmp_path / "out.jsonl"))
        result = run_async(Pipeline([puller], [], [pusher]).run())
    [failure] = result.failures.values()
    assert failure.endswith(f"failed: cannot listen on 127.0.0.1:{port}: Address already in use")
    [given_up] = [record for record in caplog.records if "giving up" in record.getMessage()]
    assert given_up.exc_info is None
    assert "Traceback" not in caplog.text
