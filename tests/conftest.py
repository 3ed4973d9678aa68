"""Shared fixtures: the PowerAPI recordings and helpers to run pipelines in tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest

from tests.parser_build import use_parser_build

T = TypeVar("T")

# The checks the C parser's tests and fuzz targets share (parser_oracle.py, fuzz_targets.py):
# their asserts explain themselves too.
pytest.register_assert_rewrite("tests.parser_oracle", "tests.fuzz_targets")

PARSER_BUILD = use_parser_build()
"""The C parser build ``C_PARSER_BUILD`` names (``scripts/test-parser``: the sanitized one),
loaded before any test module imports the parser; ``None``: the installed build."""


def pytest_report_header() -> str:
    """Which build of the C parser the run tests: a sanitized run must say it is one."""
    return f"C parser: {PARSER_BUILD or 'the installed build'}"


# Fixtures that start real servers (MongoDB, InfluxDB, VictoriaMetrics, Prometheus) on loopback.
pytest_plugins = ["tests.servers", "tests.servers_influx", "tests.servers_prometheus"]

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "powerapi-2.10.0"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    """PowerAPI 2.10's real hwpc-sensor recordings."""
    assert FIXTURES.is_dir(), f"PowerAPI fixtures not found at {FIXTURES}"
    return FIXTURES


def run_async(coroutine: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    """Run a coroutine to completion with a time limit, so a hung pipeline fails the test."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


def wattflow(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``wattflow`` command as a user would."""
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "wattflow.service", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=environment,
        cwd=cwd,
    )


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``ready`` until it is true, or fail the test naming ``what``: how tests wait for
    what they need (a port, a row, a log line) instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not ready after {timeout_s} s")


class Collector:
    """The pipeline as a puller run on its own sees it: keeps what the puller emits and the
    dead letters it rejects, so a test can drive an input's decoding without a pipeline."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.items: list[Any] = []
        self.rejected: list[tuple[Any, str]] = []
        self.skipped = 0

    async def emit(self, batch: Any) -> None:
        self.items.extend(batch)

    def reject(self, payload: Any, reason: str) -> None:
        self.rejected.append((payload, reason))

    def skip(self, count: int) -> None:
        self.skipped += count


def complete_lines(path: Path) -> int:
    """How many whole lines (ended by a newline) a file being written holds so far."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


class Service:
    """``wattflow`` run in the background as an operator runs the service, until a test stops it.

    Its stdout and stderr go to a log file (a pipe could fill and stall it) that the test can
    watch while it runs. Tests wait for what they need (lines written, a log line), never for a
    fixed time: a slow machine only makes them slower. Use it in a ``with`` block, which kills
    the process if the test fails before stopping it.
    """

    def __init__(
        self,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        """Start ``python -m wattflow.service ARGS`` (or ``command``) in the environment
        ``env`` (by default this one's), logging to ``log``."""
        self.log = log
        with log.open("ab") as handle:
            self.process = subprocess.Popen(
                command or [sys.executable, "-m", "wattflow.service", *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=dict(os.environ) if env is None else env,
            )

    def __enter__(self) -> Service:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.kill()

    def text(self) -> str:
        """Everything the service has logged so far."""
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        """True while the service runs; one that exited fails the test, with its log."""
        code = self.process.poll()
        assert code is None, f"the service exited with {code}:\n{self.text()[-4000:]}"
        return True

    def wait_for_log(self, text: str, count: int = 1, timeout_s: float = 60.0) -> None:
        """Wait until the log holds ``text`` (``count`` times), while the service runs."""
        wait_until(
            lambda: self.alive() and self.text().count(text) >= count,
            timeout_s,
            f"{text!r} ×{count} in {self.log.name}",
        )

    def wait_for_lines(self, path: Path, count: int, timeout_s: float = 60.0) -> None:
        """Wait until the service has written ``count`` whole lines to ``path``."""
        wait_until(
            lambda: self.alive() and complete_lines(path) >= count,
            timeout_s,
            f"{count} lines in {path.name}",
        )

    def send_signal(self, sent: signal.Signals = signal.SIGTERM) -> None:
        """Send a signal, as an operator would (``kill``, Ctrl-C)."""
        self.process.send_signal(sent)

    def stop(
        self, sent: signal.Signals = signal.SIGTERM, code: int | None = 0, timeout_s: float = 60.0
    ) -> str:
        """Send ``sent`` and wait for the service to drain and exit; check its exit ``code``
        (unless None) and return its log."""
        self.send_signal(sent)
        return self.finish(code, timeout_s)

    def finish(self, code: int | None = 0, timeout_s: float = 60.0) -> str:
        """Wait for a run that ends by itself (its input read) to exit; check its exit
        ``code`` (unless None) and return its log."""
        self.process.wait(timeout=timeout_s)
        text = self.text()
        if code is not None:
            assert self.process.returncode == code, text
        return text

    def stop_once_written(
        self, path: Path, count: int, sent: signal.Signals = signal.SIGTERM
    ) -> str:
        """Wait until ``count`` lines are in ``path``, then stop the service (it must drain and
        exit 0); return its log."""
        self.wait_for_lines(path, count)
        return self.stop(sent)

    def kill(self) -> None:
        """Kill the service if it still runs (the clean-up of a test that failed)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def drained_ledger(log: str) -> dict[str, int]:
    """The counts of the ledger line a drained pipeline logs (``pipeline drained: entered=10
    … dead_out=0``), by field name; the test fails if the log holds no such line."""
    lines = [line for line in log.splitlines() if "pipeline drained: " in line]
    assert lines, f"no ledger line in the log:\n{log[-4000:]}"
    fields = lines[-1].split("pipeline drained: ", 1)[1].replace("(", "").replace(")", "")
    return {name: int(value) for name, value in (f.split("=") for f in fields.split())}
