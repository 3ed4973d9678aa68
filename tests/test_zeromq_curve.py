"""CURVE with an allow-list between wattflow processes, as an operator runs them.

Each case runs a sending service (its reports fed through a plain PULL input) and a receiving
service over CURVE, one of them the server with ``--curve-authorized-keys``, and a third service
whose key is not authorised: the authorised pair must carry every report, the stranger must get
or deliver none, and both the server and the stranger must say why in a warning.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
import zmq.auth

from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import Report

from .conftest import Service, complete_lines, wait_until
from .servers import free_port
from .test_zeromq import make_keys, power_reports

REPORTS = 100


@dataclass(frozen=True)
class Case:
    """Which pattern, and which side binds as the CURVE server with the allow-list."""

    output_socket: str
    input_socket: str
    server: str  # "output" or "input"

    def flags(self, role: str, keys: dict[str, Path], key: str) -> list[str]:
        """The CURVE and bind flags of one side: the server binds, the client connects."""
        if role == self.server:
            return [
                "--bind",
                "--curve-secret-key", str(keys["server_secret"]),
                "--curve-authorized-keys", str(keys["authorised"]),
            ]  # fmt: skip
        return [
            "--connect",
            "--curve-secret-key", str(keys[f"{key}_secret"]),
            "--curve-server-key", str(keys["server"]),
        ]  # fmt: skip


CASES = [
    Case("PUB", "SUB", server="output"),
    Case("PUB", "SUB", server="input"),
    Case("PUSH", "PULL", server="output"),
    Case("PUSH", "PULL", server="input"),
]


@contextmanager
def feeder() -> Iterator[tuple[int, zmq.Socket[bytes]]]:
    """A plain PUSH socket feeding a sending service's PULL input, and that input's port."""
    port = free_port()
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield port, socket
    finally:
        socket.close(linger=0)
        context.term()


def sender(
    tmp_path: Path, name: str, feed_port: int, case: Case, uri: str, curve: list[str]
) -> Service:
    """A service that publishes (or pushes) what its plain PULL input is fed."""
    return Service(
        tmp_path / f"{name}.log",
        "run", "-v",
        "--input", "zeromq", "--model", "PowerReport", "--socket-type", "PULL",
        "--uri", f"tcp://127.0.0.1:{feed_port}",
        "--output", "zeromq", "--socket-type", case.output_socket, "--uri", uri,
        "--send-timeout-s", "1", "--retry-for-s", "1", *curve,
    )  # fmt: skip


def receiver(tmp_path: Path, name: str, case: Case, uri: str, curve: list[str]) -> Service:
    """A service that subscribes (or pulls) and writes what it gets to ``<name>.jsonl``."""
    topics = ["--topics", "PowerReport:"] if case.input_socket == "SUB" else []
    return Service(
        tmp_path / f"{name}.log",
        "run", "-v",
        "--input", "zeromq", "--model", "PowerReport", "--socket-type", case.input_socket,
        "--uri", uri, *topics, *curve,
        "--output", "jsonl", "--model", "PowerReport", "--file", str(tmp_path / f"{name}.jsonl"),
    )  # fmt: skip


def sensors(path: Path) -> list[str]:
    """The sensor of each whole line written so far (the service may be writing the last)."""
    if not path.exists():
        return []
    return [json.loads(line)["sensor"] for line in path.read_text().split("\n")[:-1]]


def z85_public(path: Path) -> str:
    return zmq.auth.load_certificate(str(path))[0].decode()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.output_socket}-{c.server}-binds")
def test_curve_allow_list_lets_the_authorised_peer_in_and_keeps_the_stranger_out(
    tmp_path: Path, case: Case
) -> None:
    keys = make_keys(tmp_path)
    uri = f"tcp://127.0.0.1:{free_port()}"
    reports: list[Report] = list(power_reports(REPORTS, sensor="node-1"))
    strangers: list[Report] = list(power_reports(REPORTS, sensor="stranger-node"))
    with ExitStack() as stack:
        port, feed = stack.enter_context(feeder())
        out_flags = case.flags("output", keys, "client")
        in_flags = case.flags("input", keys, "client")
        publisher = stack.enter_context(sender(tmp_path, "sender", port, case, uri, out_flags))
        client = stack.enter_context(receiver(tmp_path, "receiver", case, uri, in_flags))
        # The stranger takes the client's side: a receiver when the sender is the server.
        stranger_flags = case.flags(
            "input" if case.server == "output" else "output", keys, "stranger"
        )
        if case.server == "output":
            stranger = stack.enter_context(
                receiver(tmp_path, "stranger", case, uri, stranger_flags)
            )
            server = publisher
        else:
            stranger_port, stranger_feed = stack.enter_context(feeder())
            stranger = stack.enter_context(
                sender(tmp_path, "stranger", stranger_port, case, uri, stranger_flags)
            )
            server = client
        # A subscription takes a while to reach a publisher: warm up until one report arrives.
        out = tmp_path / "receiver.jsonl"
        warm_up = encode_json_lines(list(power_reports(1, sensor="warm-up")))
        deadline = time.monotonic() + 30
        while complete_lines(out) == 0:
            assert time.monotonic() < deadline, f"nothing came through:\n{publisher.text()}"
            feed.send(warm_up)
            client.alive()
            time.sleep(0.1)
        # The server names whom it refused; the stranger says its key was refused.
        server.wait_for_log(
            f"refused CURVE client 127.0.0.1 (public key {z85_public(keys['stranger'])})"
        )
        assert "WARNING" in server.text()
        stranger.wait_for_log("the server refused our CURVE key")
        if case.server == "input":  # the stranger sends first: its reports would come first
            stranger_feed.send(encode_json_lines(strangers))
        feed.send(encode_json_lines(reports))
        wait_until(
            lambda: client.alive() and sensors(out).count("node-1") >= REPORTS,
            60,
            f"{REPORTS} reports in {out.name}",
        )
        if case.server == "input":
            # Its input took its reports (long ago), its output could hand them to no one.
            assert "': 1 ZeroMQ messages received" in stranger.stop(code=None)
        got = [s for s in sensors(out) if s != "warm-up"]
        assert got == ["node-1"] * REPORTS
        client_log = client.stop()
        assert "ZeroMQ messages received" in client_log
        if case.server == "output":
            stranger_log = stranger.stop()
            assert sensors(tmp_path / "stranger.jsonl") == []
            assert "': 0 ZeroMQ messages received" in stranger_log
        publisher.stop(code=None)
