"""The actor runtime: bounded mailboxes, supervision, and a drain that loses nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import pytest

from wattflow.actors.errors import PushUnavailable
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.pipeline import Pipeline
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.runtime import ActorClosed, Mailbox, QueueConfig, RestartPolicy
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, expand
from wattflow.formats.reports import HWPCReport, PowerReport, Report, to_utc

from .conftest import run_async, wattflow


def hwpc(index: int, target: str = "all", sensor: str = "s") -> HWPCReport:
    return HWPCReport(
        timestamp=to_utc(1_700_000_000_000) + timedelta(seconds=index),
        sensor=sensor,
        target=target,
        groups={"core": {"0": {"0": {"INSTRUCTIONS_RETIRED": index}}}},
    )


class ListPuller(Puller[PullerConfig]):
    """Emits a fixed list of reports in batches, like a file puller."""

    config_model = PullerConfig

    def __init__(self, reports: list[Report], batch: int = 10) -> None:
        super().__init__(PullerConfig(type="list", name="list"))
        self.reports = reports
        self.batch = batch
        self.emitted = 0

    async def pull(self, emitter: Emitter) -> None:
        for start in range(0, len(self.reports), self.batch):
            if emitter.stopping.is_set():
                return
            chunk = self.reports[start : start + self.batch]
            await emitter.emit(chunk)
            self.emitted += len(chunk)


class EchoConfig(FormulaConfig):
    pass


class EchoFormula(Formula[EchoConfig]):
    """One PowerReport per input; raises on the target named ``poison``."""

    name: ClassVar[str] = "echo"
    inputs: ClassVar[frozenset[str]] = frozenset({"HWPCReport"})
    config_model = EchoConfig

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        return report.sensor

    def process(self, reports: Batch, out: Output) -> None:
        for report in expand(reports):
            if report.target == "poison":
                raise ValueError("poisoned counter")
            out.emit(
                PowerReport.trusted(
                    timestamp=report.timestamp,
                    sensor=report.sensor,
                    target=report.target,
                    power=1.0,
                )
            )


class HoldingFormula(EchoFormula):
    """Holds every report until shutdown, like a formula waiting for a tick to complete."""

    def __init__(self, config: EchoConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.held: list[Report] = []

    def process(self, reports: Batch, out: Output) -> None:
        self.held.extend(expand(reports))

    def flush(self, out: Output) -> None:
        super().process(self.held, out)
        self.held = []


class MemoryPusher(Pusher[PusherConfig]):
    config_model = PusherConfig

    def __init__(self, delay_s: float = 0.0, fail_first: int = 0, crash_first: int = 0) -> None:
        super().__init__(PusherConfig(type="memory", name="memory"))
        self.written: list[Report] = []
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.crash_first = crash_first
        self.closed = False

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        if self.crash_first:
            self.crash_first -= 1
            raise RuntimeError("disk on fire")
        if self.fail_first:
            self.fail_first -= 1
            raise PushUnavailable("sink restarting")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.written.extend(batch)
        return []

    async def close(self) -> None:
        self.closed = True


def pipeline(
    reports: list[Report],
    pusher: MemoryPusher,
    formula: type[EchoFormula] = EchoFormula,
    queue: QueueConfig | None = None,
) -> tuple[Pipeline, ListPuller]:
    puller = ListPuller(reports)
    built = Pipeline(
        [puller],
        [(formula, EchoConfig())],
        [pusher],
        queue=queue or QueueConfig(max_reports=50, max_batch=10),
        restart_policy=RestartPolicy(initial_backoff_s=0.001),
    )
    return built, puller


def test_mailbox_blocks_its_producer_when_full() -> None:
    async def scenario() -> None:
        box: Mailbox[int] = Mailbox(capacity=4)
        await box.put([1, 2, 3])
        blocked = asyncio.create_task(box.put([4, 5]))
        await asyncio.sleep(0.01)
        assert not blocked.done(), "a put over capacity must wait"
        assert await box.get(2) == [1, 2]
        await asyncio.wait_for(blocked, 1)
        assert len(box) == 3
        await box.close()
        assert await box.get(10) == [3, 4, 5]
        assert await box.get(10) is None
        with pytest.raises(ActorClosed):
            await box.put([6])

    run_async(scenario())


def test_every_report_leaves_at_end_of_input() -> None:
    reports: list[Report] = [hwpc(i, target=f"c{i % 7}") for i in range(1000)]
    pusher = MemoryPusher()
    built, _ = pipeline(reports, pusher, formula=HoldingFormula)
    result = run_async(built.run())
    # The formula held everything back until shutdown: the drain still flushed all of it.
    assert len(pusher.written) == 1000
    assert sorted(r.timestamp for r in pusher.written) == [r.timestamp for r in reports]
    assert pusher.closed
    assert result.ok
    assert result.ledger.balanced()
    assert result.ledger.entered == result.ledger.consumed == result.ledger.delivered == 1000


def test_stop_mid_stream_drains_everything_that_entered() -> None:
    reports: list[Report] = [hwpc(i) for i in range(5000)]
    pusher = MemoryPusher(delay_s=0.001)
    built, puller = pipeline(reports, pusher, formula=HoldingFormula)

    async def scenario() -> None:
        task = asyncio.create_task(built.run())
        while puller.emitted < 200:
            await asyncio.sleep(0.001)
        built.stop()
        await task

    run_async(scenario())
    assert 200 <= puller.emitted < 5000, "stop must end the input early"
    assert len(pusher.written) == puller.emitted == built.ledger.entered
    assert built.ledger.balanced()


def test_a_formula_that_raises_on_one_report_does_not_stop_the_pipeline() -> None:
    reports: list[Report] = [hwpc(i) for i in range(30)]
    reports[13] = hwpc(13, target="poison")
    pusher = MemoryPusher()
    built, _ = pipeline(reports, pusher)
    result = run_async(built.run())
    assert len(pusher.written) == 29
    assert "poison" not in {r.target for r in pusher.written}
    assert result.ledger.dead_in == 1
    (reason,) = built.dead_letters.by_reason
    assert "poisoned counter" in reason
    assert result.ok
    assert result.ledger.balanced()


def test_a_crashed_actor_is_restarted_and_its_batch_dead_lettered() -> None:
    reports: list[Report] = [hwpc(i) for i in range(100)]
    pusher = MemoryPusher(crash_first=1)
    built, _ = pipeline(reports, pusher)
    result = run_async(built.run())
    assert result.restarts == {"pusher:memory": 1}
    assert result.ledger.dead_out >= 1
    assert len(pusher.written) + result.ledger.dead_out == 100
    assert result.ledger.balanced()


def test_a_retryable_push_error_is_retried_without_loss() -> None:
    reports: list[Report] = [hwpc(i) for i in range(40)]
    pusher = MemoryPusher(fail_first=2)
    built, _ = pipeline(reports, pusher)
    result = run_async(built.run())
    assert len(pusher.written) == 40
    assert result.ledger.dead_out == 0


def test_a_slow_pusher_slows_the_puller_instead_of_growing_memory() -> None:
    reports: list[Report] = [hwpc(i) for i in range(3000)]
    pusher = MemoryPusher(delay_s=0.002)
    queue = QueueConfig(max_reports=50, max_batch=10)
    built, puller = pipeline(reports, pusher, queue=queue)
    # Three mailboxes of 50 reports plus one batch in flight in each of three actors, plus one
    # batch the puller is handing over.
    bound = 3 * queue.max_reports + 4 * queue.max_batch
    in_flight_seen: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(built.run())
        while not task.done():
            in_flight_seen.append(puller.emitted - len(pusher.written))
            await asyncio.sleep(0.001)
        await task

    run_async(scenario(), timeout_s=60)
    assert len(pusher.written) == 3000
    assert max(in_flight_seen) <= bound
    for mailbox in (built.router.mailbox, built.formulas[0].mailbox, built.pushers[0].mailbox):
        assert mailbox.high_water <= queue.max_reports + queue.max_batch


def test_reports_no_formula_takes_are_counted_not_lost() -> None:
    class PickyFormula(EchoFormula):
        @classmethod
        def dispatch_key(cls, report: Report) -> Hashable | None:
            return None if report.target == "ignored" else report.sensor

    reports: list[Report] = [hwpc(i, target="ignored" if i % 2 else "kept") for i in range(10)]
    pusher = MemoryPusher()
    built, _ = pipeline(reports, pusher, formula=PickyFormula)
    result = run_async(built.run())
    assert len(pusher.written) == 5
    assert dict(result.ledger.unused) == {"HWPCReport taken by no enabled formula nor output": 5}
    assert result.ledger.balanced()


def test_reports_no_formula_takes_are_named_once_per_kind_not_per_target(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node runs thousands of containers: the log names a kind no formula takes once, with
    its first target, not once per target."""

    class PickyFormula(EchoFormula):
        @classmethod
        def dispatch_key(cls, report: Report) -> Hashable | None:
            return report.sensor if report.target == "all" else None

    reports: list[Report] = [hwpc(i, target=f"container-{i}") for i in range(50)]
    built, _ = pipeline(reports, MemoryPusher(), formula=PickyFormula)
    with caplog.at_level("INFO", logger="wattflow.actors.router"):
        result = run_async(built.run())
    lines = [r.getMessage() for r in caplog.records if r.name == "wattflow.actors.router"]
    assert lines == [
        "HWPCReports that no enabled formula and no output takes (the first: target "
        "'container-0') are counted as unused; said once per kind"
    ]
    assert sum(result.ledger.unused.values()) == 50


def test_reports_the_outputs_take_as_they_are_are_not_unused(tmp_path: Path) -> None:
    """A collector (PowerReports in, PowerReports out, no formula for them): every report is
    written, the ledger counts none as unused, and the log says once what became of them."""
    source, written = tmp_path / "power.jsonl", tmp_path / "collected.jsonl"
    lines = [
        powerapi.encode_json(
            PowerReport(
                timestamp=to_utc(1_700_000_000_000 + 1000 * tick),
                sensor="node-1",
                target=target,
                power=1.0,
            )
        )
        for tick in range(3)
        for target in ("rapl", "web", "db", "cache")
    ]
    source.write_text("".join(line + "\n" for line in lines))
    done = wattflow(
        "run", "--input", "jsonl", "--model", "PowerReport", "--files", str(source),
        "--output", "jsonl", "--file", str(written),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(written.read_text().splitlines()) == 12
    router = [line for line in done.stderr.splitlines() if "wattflow.actors.router" in line]
    assert len(router) == 1, router
    assert router[0].endswith(
        "PowerReports that no enabled formula takes (the first: target 'rapl') are written as "
        "they are by the outputs that take PowerReports; said once per kind"
    )
    assert "unused=0 " in done.stderr
    assert "delivered=12 " in done.stderr


def test_pipeline_result_lists_a_failed_input() -> None:
    class BrokenPuller(ListPuller):
        async def pull(self, emitter: Emitter) -> None:
            await emitter.emit([hwpc(0)])
            raise OSError("device unplugged")

    pusher = MemoryPusher()
    built = Pipeline([BrokenPuller([])], [(EchoFormula, EchoConfig())], [pusher])
    result = run_async(built.run())
    assert not result.ok
    assert "device unplugged" in result.failures["puller:list"]
    assert len(pusher.written) == 1, "what entered before the failure is still delivered"


def test_an_actor_that_keeps_failing_is_abandoned_without_blocking_its_inputs() -> None:
    reports: list[Report] = [hwpc(i) for i in range(200)]
    pusher = MemoryPusher(crash_first=10_000)
    built, puller = pipeline(reports, pusher)
    built.supervisor.policy = RestartPolicy(initial_backoff_s=0.0, max_restarts=2)
    result = run_async(built.run())
    assert not result.ok
    assert "memory failed 3 times" in result.failures["pusher:memory"]
    # The input was stopped, and whatever had entered was dead-lettered, not stuck.
    assert result.ledger.delivered == 0
    assert result.ledger.dead_out == result.ledger.dispatched == puller.emitted
    assert result.ledger.balanced()
