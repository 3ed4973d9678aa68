"""A live table of the latest power per target on stdout, for people watching a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PositiveInt

from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.formats.reports import PowerReport, Report


class TablePusherConfig(PusherConfig):
    """Settings of the live table."""

    type: Literal["table"] = "table"
    max_rows: PositiveInt = Field(default=40, description="Rows shown, highest power first.")
    refresh_per_second: float = Field(
        default=4.0, gt=0, description="Redraws per second.", json_schema_extra={"unit": "Hz"}
    )


if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

RowKey = tuple[str, str, str, str]


def _place(metadata: dict[str, Any]) -> str:
    """Where on the node a report's power is: its CPU socket, or its GPU (``gpu 1``), so that a
    container on two GPUs gets a row per GPU."""
    if "socket" in metadata:
        return str(metadata["socket"])
    if "device" in metadata:
        return f"gpu {metadata['device']}"
    return ""


@pushers.register("table")
class TablePusher(Pusher[TablePusherConfig]):
    """Keeps the latest PowerReport per (sensor, target, scope, socket or GPU) and draws them.

    On a terminal the table redraws live; otherwise (a pipe, CI) it is printed once at the end,
    so logs hold one final table instead of escape sequences.
    """

    config_model = TablePusherConfig

    def __init__(self, config: TablePusherConfig, console: Console | None = None) -> None:
        super().__init__(config)
        if console is None:
            # rich takes a tenth of wattflow's start-up to import: only a table output needs it.
            from rich.console import Console

            console = Console()
        self.console = console
        self.latest: dict[RowKey, PowerReport] = {}
        self.reports_seen = 0
        self._live: Live | None = None

    async def open(self) -> None:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(
                self.render(),
                console=self.console,
                refresh_per_second=self.config.refresh_per_second,
                transient=False,
            )
            self._live.start()

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        for report in batch:
            if isinstance(report, PowerReport):
                meta = report.metadata
                key = (
                    report.sensor,
                    report.target,
                    str(meta.get("scope", "")),
                    _place(meta),
                )
                self.latest[key] = report
        self.reports_seen += len(batch)
        if self._live is not None:
            self._live.update(self.render())
        return []

    def render(self) -> Table:
        """The table as it stands."""
        from rich.table import Table

        table = Table(title=f"wattflow: power per target ({self.reports_seen} reports)")
        for column in ("sensor", "target", "scope", "socket/gpu", "time (UTC)"):
            table.add_column(column)
        table.add_column("power (W)", justify="right")
        rows = sorted(self.latest.items(), key=lambda item: -item[1].power)
        for (sensor, target, scope, place), report in rows[: self.config.max_rows]:
            when = report.timestamp.strftime("%H:%M:%S.%f")[:-3]
            table.add_row(sensor, target, scope, place, when, f"{report.power:9.2f}")
        return table

    async def close(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None
        else:
            self.console.print(self.render())
