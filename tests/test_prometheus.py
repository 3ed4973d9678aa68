"""The Prometheus output: what it exposes, promtool's verdict, and a real Prometheus scraping it."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from wattflow.actors.naming import TargetNaming
from wattflow.actors.pushers.prometheus import (
    BOUNDED_LABELS,
    PrometheusPusher,
    PrometheusPusherConfig,
)
from wattflow.formats import powerapi
from wattflow.formats.reports import PowerReport, Report

from .conftest import Service, run_async, wait_until, wattflow
from .servers import free_port
from .servers_prometheus import PrometheusServer, promtool_check_metrics, scrape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record

START = datetime(2026, 3, 1, tzinfo=UTC)
LABELS = ("sensor", "target", "scope", "socket", "device")
Series = tuple[str, ...]


def power(
    second: float, watts: float, target: str = "web", socket: str = "0", **metadata: Any
) -> PowerReport:
    return PowerReport(
        timestamp=START + timedelta(seconds=second),
        sensor="node-1",
        target=target,
        power=watts,
        metadata={"scope": "cpu", "socket": socket, "formula": "f00d", "ratio": 0.25, **metadata},
    )


def exposed(text: str) -> dict[str, dict[Series, float]]:
    """Each metric's samples by their labels (sensor, target, scope, socket, device; absent
    is empty), as the text format says them."""
    found: dict[str, dict[Series, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name][tuple(sample.labels.get(k, "") for k in LABELS)] = sample.value
    return found


class Exposed:
    """A Prometheus output opened in this process on a free port."""

    def __init__(self, **settings: Any) -> None:
        self.pusher = PrometheusPusher(PrometheusPusherConfig(port=0, **settings))

    async def __aenter__(self) -> Exposed:
        await self.pusher.check()
        await self.pusher.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pusher.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.pusher.port}/metrics"

    async def write(self, *reports: Report) -> list[tuple[Report, str]]:
        return await self.pusher.write(list(reports))


def test_power_is_the_newest_report_and_energy_its_integral_over_time() -> None:
    async def go() -> str:
        async with Exposed() as out:
            assert await out.write(power(0, 10.0), power(1, 20.0), power(3, 30.0)) == []
            # 2.5 s is older than the series' newest (3 s), whose interval covers it
            assert await out.write(power(2.5, 1000.0), power(1, 30.0, socket="1")) == []
            return scrape(out.url)

    text = run_async(go())
    found = exposed(text)
    web0 = ("node-1", "web", "cpu", "0", "")
    web1 = ("node-1", "web", "cpu", "1", "")
    assert found["wattflow_power_watts"] == {web0: 30.0, web1: 30.0}
    # the first report starts the series; then 20 W over 1 s and 30 W over 2 s
    assert found["wattflow_energy_joules_total"] == {web0: 20.0 * 1 + 30.0 * 2, web1: 0.0}
    # ratio and formula are no labels, nor is anything but the bounded keys
    assert "ratio" not in text
    assert "f00d" not in text


def test_a_workloads_names_label_its_series_and_add_none(prometheus_server: Any) -> None:
    """The naming step's keys (a Slurm job's) are labels; a target without them has none of
    them, nor any other empty label, so one job's series sum by ``slurm_job`` and each target is
    one series. promtool and a real Prometheus take the series' differing label sets."""
    job = "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
    names = TargetNaming()([power(0, 5.0, target=job), power(1, 5.0, target=job)])

    async def go() -> tuple[str, list[dict[str, Any]]]:
        async with Exposed() as out:
            assert await out.write(*[r for r in names if isinstance(r, PowerReport)]) == []
            assert await out.write(power(1, 2.0, target="postgres")) == []
            server: PrometheusServer = await asyncio.to_thread(
                prometheus_server, [f"127.0.0.1:{out.pusher.port}"]
            )
            promql = "sum by (slurm_job) (wattflow_power_watts)"

            def answered() -> bool:
                return len(server.query(promql)) == 2

            await asyncio.to_thread(wait_until, answered, 30, "Prometheus to scrape the series")
            return scrape(out.url), server.query(promql)

    text, by_job = run_async(go(), timeout_s=90)
    assert '=""' not in text  # no empty label is served
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["wattflow_power_watts"].samples
    assert len(samples) == 2
    by_target = {sample.labels["target"]: sample.labels for sample in samples}
    assert by_target[job]["slurm_job"] == "7"
    assert by_target[job]["target_name"] == "slurm/7"
    assert by_target[job]["target_kind"] == "slurm_job"
    assert set(by_target["postgres"]) == {"sensor", "target", "scope", "socket"}
    watts = {e["metric"].get("slurm_job", ""): float(e["value"][1]) for e in by_job}
    assert watts == {"7": 5.0, "": 2.0}


def test_tags_that_leave_a_key_out_add_its_parts_and_a_repeat_replaces_itself() -> None:
    async def go() -> dict[str, dict[Series, float]]:
        async with Exposed(tags="scope") as out:
            await out.write(power(0, 10.0, socket="0"), power(0, 5.0, socket="1"))
            await out.write(power(2, 10.0, socket="0"), power(2, 7.0, socket="1"))
            await out.write(power(2, 8.0, socket="1"))  # socket 1 at 2 s again, corrected
            return exposed(scrape(out.url))

    found = run_async(go())
    web = ("node-1", "web", "cpu", "", "")
    assert found["wattflow_power_watts"] == {web: 18.0}
    assert found["wattflow_energy_joules_total"] == {web: pytest.approx(18.0 * 2)}


def test_a_series_that_stops_reporting_is_removed_and_the_others_stay() -> None:
    async def go() -> tuple[dict[str, dict[Series, float]], dict[str, dict[Series, float]]]:
        async with Exposed(series_expiry_s=0.5) as out:
            await out.write(power(0, 1.0, target="gone"), power(0, 2.0, target="stays"))
            before = exposed(scrape(out.url))
            second = 1

            async def only_stays_left() -> bool:
                nonlocal second
                await out.write(power(second, 2.0, target="stays"))
                second += 1
                targets = {key[1] for key in exposed(scrape(out.url))["wattflow_power_watts"]}
                return targets == {"stays"}

            await wait_async(only_stays_left, 20, "the silent series to expire")
            return before, exposed(scrape(out.url))

    before, after = run_async(go(), timeout_s=40)
    assert {key[1] for key in before["wattflow_power_watts"]} == {"gone", "stays"}
    assert {key[1] for key in after["wattflow_energy_joules_total"]} == {"stays"}


async def wait_async(ready: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """:func:`wait_until` for a check that runs on the event loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await ready():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not ready after {timeout_s} s")


def test_max_series_refuses_what_would_open_one_more() -> None:
    """The reason names the output by the port it listens on: with ``--port 0`` (as here), the
    one it picked, which the log gave, not 0."""

    async def go() -> tuple[list[tuple[Report, str]], int | None]:
        async with Exposed(max_series=2) as out:
            refused = await out.write(
                power(0, 1.0, target="a"), power(0, 1.0, target="b"), power(0, 1.0, target="c")
            )
            return refused, out.pusher.port

    refused, port = run_async(go())
    assert [report.target for report, _ in refused] == ["c"]
    assert port != 0
    assert refused[0][1].endswith(
        f" (prometheus 127.0.0.1:{port}): --max-series 2 series are exposed already"
    )


def test_a_power_that_is_not_a_number_is_refused() -> None:
    async def go() -> list[tuple[Report, str]]:
        async with Exposed() as out:
            # As a formula builds it, unvalidated: inputs refuse a power that is not finite.
            nan = power(0, 1.0).model_copy(update={"power": float("nan")})
            return await out.write(nan, power(1, 3.0))

    refused = run_async(go())
    assert len(refused) == 1
    assert "not a finite number" in refused[0][1]


def test_promtool_finds_nothing_to_lint() -> None:
    async def go() -> str:
        async with Exposed() as out:
            await out.write(power(0, 1.5), power(1, 2.5, target='a "quoted"\\target'))
            await out.write(
                power(1, 0.5, target="pid:42", scope="gpu", socket=None, device="0"),  # type: ignore[arg-type]
                power(2, 0.75, target="pid:42", scope="gpu", socket=None, device="0"),  # type: ignore[arg-type]
            )
            return scrape(out.url)

    text = run_async(go())
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""
    gpu = ("node-1", "pid:42", "gpu", "", "0")
    assert exposed(text)["wattflow_energy_joules_total"][gpu] == 0.75


def test_unbounded_tags_and_other_kinds_stop_the_command(tmp_path: Path) -> None:
    source = tmp_path / "power.jsonl"
    source.write_text(powerapi.encode_json(power(0, 1.0)) + "\n")
    common = ("run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source))
    tags = wattflow(*common, "--output", "prometheus", "--tags", "scope,ratio")
    assert tags.returncode == 2
    assert "ratio: not a label of the prometheus output" in tags.stderr
    kind = wattflow(*common, "--output", "prometheus", "--model", "FormulaReport")
    assert kind.returncode == 2
    assert "PowerReports only" in kind.stderr


def test_powerapi_2_10_flags_and_keys_are_taken() -> None:
    # the keys of SmartWatts' shipped prometheus JSON (2.10 called the address "uri")
    shipped = {"type": "prometheus", "uri": "0.0.0.0", "port": 9100, "tags": []}
    config = PrometheusPusherConfig.model_validate(
        {**shipped, "metric_name": "powerapi_energy_consumption"}
    )
    assert (config.addr, config.port) == ("0.0.0.0", 9100)
    assert config.metric_name == "powerapi_energy_consumption"
    assert config.tags == list(BOUNDED_LABELS)  # none given: every bounded key
    assert config.tags[:3] == ["scope", "socket", "device"]


def test_a_port_in_use_stops_the_command_before_it_starts(tmp_path: Path) -> None:
    async def go() -> Any:
        async with Exposed() as out:
            port = out.pusher.port
            assert port is not None
            source = tmp_path / "power.jsonl"
            source.write_text(powerapi.encode_json(power(0, 1.0)) + "\n")
            return wattflow(
                "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
                "--output", "prometheus", "--port", str(port),
            )  # fmt: skip

    done = run_async(go())
    assert done.returncode == 2
    assert "cannot listen" in done.stderr


def expected_series(path: Path) -> dict[str, dict[Series, float]]:
    """Power and energy per series, computed here from the PowerReports wattflow wrote to JSON
    Lines: the newest power, and each report's power times the time since the previous."""
    newest: dict[Series, tuple[datetime, float]] = {}
    energy: dict[Series, float] = defaultdict(float)
    for report in read_power(path):
        key = (
            report.sensor,
            report.target,
            *(str(report.metadata.get(k, "")) for k in ("scope", "socket", "device")),
        )
        previous = newest.get(key)
        interval_s = 0.0 if previous is None else (report.timestamp - previous[0]).total_seconds()
        energy[key] += report.power * interval_s
        newest[key] = (report.timestamp, report.power)
    return {
        "wattflow_power_watts": {key: watts for key, (_, watts) in newest.items()},
        "wattflow_energy_joules_total": dict(energy),
    }


def read_power(path: Path) -> Iterable[PowerReport]:
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # whole lines only
    return [
        powerapi.decode_json(PowerReport, line, str(path), number)  # type: ignore[misc]
        for number, line in enumerate(lines, 1)
    ]


def queried(server: PrometheusServer) -> dict[str, dict[Series, float]]:
    """What Prometheus answers for both metrics, by series."""
    found: dict[str, dict[Series, float]] = {}
    for metric in ("wattflow_power_watts", "wattflow_energy_joules_total"):
        found[metric] = {
            tuple(element["metric"].get(k, "") for k in LABELS): float(element["value"][1])
            for element in server.query(metric)
        }
    return found


def agree(got: dict[str, dict[Series, float]], want: dict[str, dict[Series, float]]) -> bool:
    return all(
        got.get(metric, {}).keys() == values.keys()
        and all(got[metric][key] == pytest.approx(value, rel=1e-9) for key, value in values.items())
        for metric, values in want.items()
    )


def test_a_prometheus_server_scrapes_what_smartwatts_computed(
    tmp_path: Path, prometheus_server: Any
) -> None:
    hwpc = tmp_path / "hwpc.jsonl"
    ticks = 30
    record(ticks=ticks, containers=3, sensors=("node-1", "node-2"), jsonl=hwpc)
    out = tmp_path / "power.jsonl"
    port = free_port()
    server: PrometheusServer = prometheus_server([f"127.0.0.1:{port}"])
    with Service(
        tmp_path / "service.log", "run", "-s",
        "--input", "jsonl", "--files", str(hwpc), "--poll-interval-s", "0.05",
        "--learn-min-samples-required", "10", "--tick-lateness-ms", "2000",
        "--output", "jsonl", "--file", str(out),
        "--output", "prometheus", "--port", str(port),
    ) as service:  # fmt: skip
        service.wait_for_log(f"metrics on http://127.0.0.1:{port}/metrics")

        def everything_but_the_held_ticks() -> bool:
            service.alive()
            stamps = {report.timestamp for report in read_power(out)}
            return len(stamps) >= ticks - 4

        wait_until(everything_but_the_held_ticks, 60, "the reports before the held ticks")
        wait_until(
            lambda: service.alive() and agree(queried(server), expected_series(out)),
            60,
            "Prometheus to answer what wattflow wrote",
        )
        want = expected_series(out)
        # PromQL over the series: the RAPL power of every socket and scope of node-1
        total = server.query('sum(wattflow_power_watts{sensor="node-1", target="rapl"})')
        service.stop()
    rapl = [w for key, w in want["wattflow_power_watts"].items() if key[:2] == ("node-1", "rapl")]
    assert len(rapl) >= 2
    assert float(total[0]["value"][1]) == pytest.approx(sum(rapl), rel=1e-9)
    targets = {key[1] for key in want["wattflow_power_watts"]}
    assert {"rapl", "global"} <= targets
    assert len(targets) >= 5  # three containers besides
    assert any(value > 0 for value in want["wattflow_energy_joules_total"].values())
