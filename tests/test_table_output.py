"""The live table: one row per target and place on the node (CPU socket or GPU)."""

from __future__ import annotations

import asyncio
import io
from datetime import UTC, datetime

from rich.console import Console

from wattflow.actors.pushers.table import TablePusher, TablePusherConfig
from wattflow.formats.reports import PowerReport, Report

NOW = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)


def power(target: str, watts: float, **metadata: object) -> PowerReport:
    return PowerReport(
        timestamp=NOW, sensor="node-1", target=target, power=watts, metadata=metadata
    )


def test_a_target_on_two_sockets_and_two_gpus_gets_a_row_for_each() -> None:
    screen = io.StringIO()
    table = TablePusher(
        TablePusherConfig(type="table", name="table"),
        console=Console(file=screen, width=120, force_terminal=False),
    )
    reports: list[Report] = [
        power("job", 10.0, scope="cpu", socket=0),
        power("job", 11.0, scope="cpu", socket=1),
        power("job", 120.0, scope="gpu", device=0),
        power("job", 130.0, scope="gpu", device=1),
        power("job", 125.0, scope="gpu", device=0),  # newer reading of the same GPU
    ]

    async def show() -> None:
        await table.open()
        assert await table.write(reports) == []
        await table.close()

    asyncio.run(show())
    assert sorted(table.latest) == [
        ("node-1", "job", "cpu", "0"),
        ("node-1", "job", "cpu", "1"),
        ("node-1", "job", "gpu", "gpu 0"),
        ("node-1", "job", "gpu", "gpu 1"),
    ]
    assert table.latest["node-1", "job", "gpu", "gpu 0"].power == 125.0
    printed = screen.getvalue()
    assert "socket/gpu" in printed
    assert "gpu 1" in printed
    assert "130.00" in printed
