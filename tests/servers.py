"""Real servers for the backend tests, started on free loopback ports and stopped by PID.

Each fixture starts its server in a scratch directory, waits until it answers, and stops it at
the end. A test that needs to see a server fail (a restart mid-stream) gets a handle that can
stop and start it again on the same port and storage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import wait_until


def free_port() -> int:
    """A TCP port nobody listens on right now, on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on the loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class ServerProcess:
    """A server command that can be stopped and started again on the same port and storage."""

    def __init__(self, command: list[str], port: int, log: Path, name: str) -> None:
        self.command = command
        self.port = port
        self.log = log
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until its port accepts connections."""
        assert self.process is None, f"{self.name} is already running"
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(lambda: self._alive() and port_open(self.port), timeout_s, self.name)

    def _alive(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.process.returncode}: "
                + self.log.read_text(errors="replace")[-2000:]
            )
        return True

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGKILL when ``kill``, as a crash would) and wait for it to exit."""
        if self.process is None:
            return
        with_signal = signal.SIGKILL if kill else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, with_signal)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        wait_until(lambda: not port_open(self.port), 10, f"{self.name} port release")


def mongodb_command(port: int, storage: Path) -> list[str]:
    """SecantusDB, a MongoDB-wire server, as a separate process so that it can be killed.

    Commits are synced to disk, as MongoDB's journal does, so that a server killed with SIGKILL
    comes back with every acknowledged write.
    """
    return [
        sys.executable, "-m", "secantus", "--sync-on-commit",
        "--host", "127.0.0.1", "--port", str(port), "--storage-path", str(storage),
    ]  # fmt: skip


@pytest.fixture
def mongodb_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A MongoDB-wire server of this test's own; ``.port`` says where, ``.uri`` how to reach it."""
    directory = tmp_path_factory.mktemp("mongodb")
    port = free_port()
    server = ServerProcess(
        mongodb_command(port, directory / "data"), port, directory / "server.log", "mongodb"
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(kill=True)


def mongodb_uri(server: ServerProcess) -> str:
    """The connection string of a test's MongoDB server."""
    return f"mongodb://127.0.0.1:{server.port}/"
