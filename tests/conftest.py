"""Shared fixtures: the PowerAPI recordings and helpers to run pipelines in tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

# Fixtures that start real servers (MongoDB, InfluxDB, VictoriaMetrics) on loopback.
pytest_plugins = ["tests.servers", "tests.servers_influx"]

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
