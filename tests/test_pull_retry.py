"""An input that is unavailable for now is retried with backoff, for a bounded time.

The socket input whose port another program holds raises an error marked retryable: the
service retries it (logging each retry), takes the port once it is free, and reads hwpc-sensor's
reports as usual; if the port stays busy past ``--retry-for-s``, the run fails with the reason.
Real ports, a real service process.
"""

from __future__ import annotations

import socket
from pathlib import Path

from wattflow.actors.runtime import Backoff

from .conftest import Service, wattflow

LINE = b'{"timestamp": 1700000000000, "sensor": "node-1", "target": "all", "groups": {}}\n'


def test_a_busy_port_is_retried_until_it_is_free(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    out = tmp_path / "hwpc.jsonl"
    try:
        with Service(
            tmp_path / "service.log",
            "run", "-s", "--input", "socket", "--port", str(port), "--retry-for-s", "60",
            "--disable-smartwatts-formula",
            "--output", "jsonl", "--model", "HWPCReport", "--file", str(out),
        ) as service:  # fmt: skip
            service.wait_for_log("cannot listen on 127.0.0.1", count=2)
            assert "retrying in" in service.text()
            held.close()
            service.wait_for_log("listening for hwpc-sensor")
            with socket.create_connection(("127.0.0.1", port)) as sensor:
                sensor.sendall(LINE)
            service.wait_for_lines(out, 1)
            log = service.stop()
    finally:
        held.close()
    assert "failed" not in log


def test_a_port_busy_for_longer_than_the_retries_fails_the_run(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        done = wattflow(
            "run", "-s", "--input", "socket", "--port", str(held.getsockname()[1]),
            "--retry-for-s", "1", "--disable-smartwatts-formula",
            "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("retrying in") >= 2
    assert "cannot listen on 127.0.0.1" in done.stderr


def test_backoff_doubles_its_step_and_draws_each_delay_within_it() -> None:
    backoff = Backoff(0.1, 1.0)
    delays = [backoff.next_s() for _ in range(6)]
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert all(step / 2 <= delay <= step for delay, step in zip(delays, steps, strict=True))
    many = [Backoff(1.0, 1.0).next_s() for _ in range(50)]
    assert len(set(many)) > 40, "jitter: failures at the same moment retry at different ones"
    backoff.reset()
    assert backoff.next_s() <= 0.1
