"""A formula that raises: the unit it failed on (a tick) is a dead letter, nothing else moves.

The faults are raised inside SmartWatts' model step, once the step has changed the models (the
sample and its error are stored): the hazard is a formula whose state the failed call already
changed. Each test runs a real pipeline and compares with the same run without the fault.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.conftest import run_async
from tests.test_frames import write_recording
from wattflow.actors.formulas.base import Formula, FormulaConfig, Output
from wattflow.actors.formulas.gpu import GpuConfig, GpuFormula
from wattflow.actors.formulas.node import NodeConfig, NodeFormula
from wattflow.actors.formulas.power_model import ErrorMethod, FrequencyModel, PowerModel
from wattflow.actors.formulas.rapl import RaplConfig, RaplFormula
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.actors.pipeline import Pipeline, PipelineResult
from wattflow.actors.pullers.base import Emitter, Puller, PullerConfig
from wattflow.actors.pullers.csv import CsvPuller, CsvPullerConfig
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.runtime import DeadLetter, DeadLetters, QueueConfig
from wattflow.formats import powerapi
from wattflow.formats.batch import Batch, expand
from wattflow.formats.csv_frames import read_hwpc_csv_frames
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.reports import (
    GPUDevice,
    GPUProcess,
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    Report,
    to_millis,
)

THRESHOLD_W = 2.0
"""The error threshold of both scopes (SmartWatts' default), over which a model relearns."""
REASON = "failed on its tick: ModelFault: the model step diverged"
FORMULA_LOGGER = "wattflow.actors.formulas.base"


class ModelFault(RuntimeError):
    """The injected error."""


class ListPuller(Puller[PullerConfig]):
    """Hands fixed reports on in batches that cut across ticks, as a live input does."""

    config_model = PullerConfig

    def __init__(self, reports: list[Report], batch: int = 37) -> None:
        super().__init__(PullerConfig(type="list", name="list", model=reports[0].kind))
        self.reports = reports
        self.batch = batch

    async def pull(self, emitter: Emitter) -> None:
        for start in range(0, len(self.reports), self.batch):
            await emitter.emit(self.reports[start : start + self.batch])


class MemoryPusher(Pusher[PusherConfig]):
    """Keeps every PowerReport and FormulaReport it is given, in order."""

    config_model = PusherConfig

    def __init__(self) -> None:
        super().__init__(PusherConfig(type="memory", name="memory"))
        self.written: list[Report] = []

    def accepts(self, kind: str) -> bool:
        return kind in ("PowerReport", "FormulaReport")

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        self.written.extend(batch)
        return []


class KeptDeadLetters(DeadLetters):
    """Dead letters kept in memory, payloads included, for the test to read."""

    def __init__(self) -> None:
        super().__init__()
        self.letters: list[DeadLetter] = []

    def add(self, letter: DeadLetter) -> None:
        super().add(letter)
        self.letters.append(letter)


@dataclass
class Fault:
    """Makes the model step of one (scope, socket) raise on chosen steps.

    Steps are counted among those that do not relearn (error window at or under the
    threshold): the step raises after the sample and its error are stored and right where the
    relearning would be decided, so a step that raises leaves the models exactly as the same
    step without the fault does. It raises at the same step whichever way (reports or frames)
    the formula goes, since both step each model through the same ticks in the same order.
    """

    scope: str
    socket: str
    steps: frozenset[int]
    pipeline: Pipeline | None = None
    seen: int = 0

    def owns(self, model: PowerModel) -> bool:
        assert self.pipeline is not None
        (formula,) = self.pipeline.formulas[0].instances.values()
        assert isinstance(formula, SmartWattsFormula)
        (scope,) = [scope for scope in formula.scopes if scope.name == self.scope]
        layers = scope.layers.get(self.socket)
        return layers is not None and any(m is model for m in layers.models.values())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Count (and fail) steps where each step judges its error window: one by one. A run
        of steps (:meth:`FrequencyModel.track_run`) judges many windows in one call, so runs
        are turned off here, in the clean run as in the faulty one;
        ``test_runs_of_steps_give_what_steps_one_by_one_give`` holds runs to the same
        figures."""
        original = PowerModel.window_error
        monkeypatch.setattr(FrequencyModel, "track_run", lambda *_, **__: [])

        def window_error(model: PowerModel, method: ErrorMethod) -> float:
            value = original(model, method)
            if value <= THRESHOLD_W and self.owns(model):
                self.seen += 1
                if self.seen in self.steps:
                    raise ModelFault("the model step diverged")
            return value

        monkeypatch.setattr(PowerModel, "window_error", window_error)


@dataclass
class Run:
    """What one pipeline run left: its outputs, dead letters, result and log."""

    written: list[dict[str, Any]]
    letters: list[DeadLetter]
    result: PipelineResult
    tracebacks: list[logging.LogRecord]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.written if r["kind"] == kind]


def run_smartwatts(
    way: str,
    paths: list[Path],
    caplog: pytest.LogCaptureFixture,
    *,
    compat: bool = False,
    fault: Fault | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> Run:
    """SmartWatts over the recording, by frames (the CSV input) or by reports in batches."""
    puller: Puller[Any]
    if way == "frames":
        config = CsvPullerConfig(type="csv", name="in", files=paths)
        puller = CsvPuller(config)
    else:
        puller = ListPuller(list(powerapi.read_hwpc_csv(paths)))  # type: ignore[arg-type]
    pusher = MemoryPusher()
    dead_letters = KeptDeadLetters()
    settings = SmartWattsConfig(
        learn_min_samples_required=5,
        cpu_base_clock=500,  # few frequency layers: most ticks estimate rather than learn
        cpu_error_threshold=THRESHOLD_W,
        dram_error_threshold=THRESHOLD_W,
        compat="smartwatts-2.4" if compat else None,
    )
    built = Pipeline(
        [puller],
        [(SmartWattsFormula, settings)],
        [pusher],
        queue=QueueConfig(max_reports=200, max_batch=50),
        dead_letters=dead_letters,
    )
    if fault is not None:
        assert monkeypatch is not None
        fault.pipeline = built
        fault.install(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger=FORMULA_LOGGER):
        result = run_async(built.run())
        tracebacks = [
            record
            for record in caplog.records
            if record.name == FORMULA_LOGGER and record.levelno == logging.ERROR
        ]
    written = [{"kind": r.kind, **r.model_dump()} for r in pusher.written]
    return Run(written, dead_letters.letters, result, tracebacks)


def timestamps_of(letters: list[DeadLetter]) -> set[datetime]:
    return {letter.payload.timestamp for letter in letters}


def dumped(reports: list[Any]) -> list[dict[str, Any]]:
    return sorted((r.model_dump() for r in reports), key=lambda d: (d["timestamp"], d["target"]))


@pytest.mark.parametrize(
    ("way", "compat"),
    [("reports", False), ("frames", False), ("reports", True)],
    ids=["reports", "frames", "compat"],
)
def test_a_tick_whose_model_step_raises_is_a_dead_letter_and_the_others_are_untouched(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    way: str,
    compat: bool,
) -> None:
    paths = write_recording(tmp_path, ticks=60)
    inputs = [r for r in powerapi.read_hwpc_csv(paths) if isinstance(r, HWPCReport)]
    counted = Fault("dram", "1", frozenset())
    clean = run_smartwatts(
        way, paths, caplog, compat=compat, fault=counted, monkeypatch=monkeypatch
    )
    monkeypatch.undo()
    # The last socket and scope of a tick: every model has then stepped as without the fault.
    # The last step is the last tick's, which waits in the formula until shutdown.
    fault = Fault("dram", "1", frozenset({10, 17, 24, counted.seen}))
    faulty = run_smartwatts(way, paths, caplog, compat=compat, fault=fault, monkeypatch=monkeypatch)

    assert fault.seen == counted.seen > 24, "every faulty step was reached"
    # Exactly the failed ticks' reports are dead letters, each once, with the error.
    failed = timestamps_of(faulty.letters)
    assert len(failed) == 4
    assert max(failed) == max(report.timestamp for report in inputs)
    assert {letter.reason for letter in faulty.letters} == {REASON}
    assert {letter.actor for letter in faulty.letters} == {"formula:smartwatts"}
    assert dumped([letter.payload for letter in faulty.letters]) == dumped(
        [report for report in inputs if report.timestamp in failed]
    )
    assert faulty.result.ledger.dead_in == 4 * 5  # a global report and four targets a tick
    assert clean.letters == []
    assert clean.result.ledger.dead_in == 0
    # Every other tick's reports are produced exactly as without the fault.
    failed_texts = {timestamp.isoformat() for timestamp in failed}
    lost = [r for r in clean.written if r["timestamp"].isoformat() in failed_texts]
    assert len(lost) >= 4 * 4 * 6, "the failed ticks had estimates without the fault"
    assert faulty.written == [r for r in clean.written if r not in lost]
    # The ledger balances, the run is not a failure, and the traceback is logged once.
    assert faulty.result.ok
    assert faulty.result.ledger.balanced()
    assert faulty.result.ledger.produced == clean.result.ledger.produced - len(lost)
    (record,) = faulty.tracebacks
    assert record.exc_info is not None
    assert record.exc_info[0] is ModelFault
    assert REASON in record.getMessage()
    assert clean.tracebacks == []


def test_the_frame_way_fails_a_tick_as_the_report_way_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault on the first socket and scope: the steps before it in the tick keep what they
    did to their models and those after it skip the tick, on both ways, which then go on
    from the same models and so give the same numbers for every later tick."""
    paths = write_recording(tmp_path, ticks=60, multiplexed=0.2)
    runs = {}
    for way in ("reports", "frames"):
        fault = Fault("cpu", "0", frozenset({6}))
        runs[way] = run_smartwatts(way, paths, caplog, fault=fault, monkeypatch=monkeypatch)
        monkeypatch.undo()
        assert fault.seen > 6
    by_reports, by_frames = runs["reports"], runs["frames"]
    for kind in ("PowerReport", "FormulaReport"):
        assert by_frames.of_kind(kind) == by_reports.of_kind(kind), kind
    assert len(timestamps_of(by_frames.letters)) == 1
    assert dumped([x.payload for x in by_frames.letters]) == dumped(
        [x.payload for x in by_reports.letters]
    )
    assert {x.reason for x in by_frames.letters} == {x.reason for x in by_reports.letters}
    assert {x.reason for x in by_frames.letters} == {REASON}
    for run in runs.values():
        assert run.result.ledger.balanced()
        assert len(run.tracebacks) == 1


class FaultyRapl(RaplFormula):
    """Raises on one tick after the interval's start has moved to it."""

    failing: ClassVar[set[int]] = set()

    def _tick(self, millis: int) -> float | str | None:
        interval = super()._tick(millis)
        if millis in self.failing:
            raise ModelFault("the energy went missing")
        return interval


@pytest.mark.parametrize("way", ["reports", "frames"])
def test_a_rapl_tick_that_raises_is_a_dead_letter_and_the_next_one_is_measured_from_it(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    way: str,
) -> None:
    """Reports in batches and frames go the same way: the tick that raises is the dead
    letter, and the next tick's interval starts at it."""
    paths = write_recording(tmp_path, ticks=20)
    inputs = [r for r in powerapi.read_hwpc_csv(paths) if isinstance(r, HWPCReport)]
    ticks = sorted({r.timestamp for r in inputs})

    def run() -> tuple[list[dict[str, Any]], KeptDeadLetters, PipelineResult, int]:
        puller: Puller[Any]
        formulas: list[tuple[type[Formula[Any]], FormulaConfig]] = [(FaultyRapl, RaplConfig())]
        if way == "frames":
            puller = CsvPuller(CsvPullerConfig(type="csv", name="in", files=paths))
            # A frame goes whole only to formulas one of which takes all of it.
            formulas.append((SmartWattsFormula, SmartWattsConfig(learn_min_samples_required=5)))
        else:
            puller = ListPuller(list(inputs), batch=13)
        pusher = MemoryPusher()
        dead_letters = KeptDeadLetters()
        built = Pipeline([puller], formulas, [pusher], dead_letters=dead_letters)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger=FORMULA_LOGGER):
            result = run_async(built.run())
            errors = sum(1 for r in caplog.records if r.levelno == logging.ERROR)
        written = [r.model_dump() for r in pusher.written if r.target == "rapl"]
        return written, dead_letters, result, errors

    clean, _, _, _ = run()
    monkeypatch.setattr(FaultyRapl, "failing", {to_millis(ticks[7]), to_millis(ticks[12])})
    written, dead_letters, result, errors = run()
    assert [letter.payload.timestamp for letter in dead_letters.letters] == [ticks[7], ticks[12]]
    assert {letter.reason for letter in dead_letters.letters} == {
        "failed on its tick: ModelFault: the energy went missing"
    }
    failed = {ticks[7].isoformat(), ticks[12].isoformat()}
    assert written == [r for r in clean if r["timestamp"].isoformat() not in failed]
    assert len(written) == len(clean) - 2 * 2 * 2  # two sockets, two domains
    assert result.ledger.balanced()
    assert result.ledger.dead_in == 2
    assert errors == 1  # one traceback for the one reason


class EscapingConfig(FormulaConfig):
    pass


class EscapingFormula(Formula[EscapingConfig]):
    """Notes the size of each batch it is given, and raises on the target named ``poison``:
    a formula that does not guard its units and is not replayable."""

    name: ClassVar[str] = "escaping"
    inputs: ClassVar[frozenset[str]] = frozenset({"HWPCReport"})
    config_model = EscapingConfig
    replayable: ClassVar[bool] = False
    calls: ClassVar[list[int]] = []

    @classmethod
    def dispatch_key(cls, report: Report) -> Hashable | None:
        return report.sensor

    def process(self, reports: Batch, out: Output) -> None:
        self.calls.append(len(reports))
        for report in expand(reports):
            if report.target == "poison":
                raise ModelFault("poisoned state")
            out.emit(
                PowerReport.trusted(
                    timestamp=report.timestamp, sensor=report.sensor, target="x", power=1.0
                )
            )


def test_an_error_that_escapes_a_stateful_formula_dead_letters_its_batch_unreplayed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reports: list[Report] = [
        HWPCReport(
            timestamp=1_700_000_000_000 + 1000 * index,
            sensor="s",
            target="poison" if index in (13, 27) else "ok",
            groups={},
        )
        for index in range(40)
    ]
    EscapingFormula.calls = []
    pusher = MemoryPusher()
    dead_letters = KeptDeadLetters()
    built = Pipeline(
        [ListPuller(reports, batch=10)],
        [(EscapingFormula, EscapingConfig())],
        [pusher],
        queue=QueueConfig(max_reports=10, max_batch=10),
        dead_letters=dead_letters,
    )
    with caplog.at_level(logging.ERROR, logger=FORMULA_LOGGER):
        result = run_async(built.run())
    assert EscapingFormula.calls == [10, 10, 10, 10], "no batch replayed report by report"
    assert [letter.payload for letter in dead_letters.letters] == reports[10:30]
    assert {letter.reason for letter in dead_letters.letters} == {
        "failed on its batch: ModelFault: poisoned state"
    }
    assert len(pusher.written) == 20
    assert result.ledger.balanced()
    assert result.ledger.dead_in == 20
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


class FaultyGpu(GpuFormula):
    """Raises on the second device of one tick, once the first device's reports are out and
    the second device's state has moved on."""

    failing: ClassVar[datetime | None] = None

    def _device(self, report: GPUReport, index: str, device: GPUDevice, out: Output) -> int:
        emitted = super()._device(report, index, device, out)
        if index == "1" and report.timestamp == self.failing:
            raise ModelFault("the sampler lost a process")
        return emitted


def test_a_gpu_tick_that_raises_leaves_no_partial_output(monkeypatch: pytest.MonkeyPatch) -> None:
    start = datetime(2026, 3, 1, tzinfo=UTC)
    reports: list[Report] = [
        GPUReport(
            timestamp=start + timedelta(seconds=second),
            sensor="node-1",
            target="all",
            devices={
                index: GPUDevice(
                    total_energy=(100.0 + 10 * int(index)) * second * 1000,
                    util_gpu=50.0,
                    processes=[GPUProcess(pid=7 + second % 2, sm_util=40.0, cgroup=None)],
                )
                for index in ("0", "1")
            },
        )
        for second in range(12)
    ]

    def run() -> tuple[list[dict[str, Any]], KeptDeadLetters, PipelineResult]:
        pusher = MemoryPusher()
        dead_letters = KeptDeadLetters()
        built = Pipeline(
            [ListPuller(reports, batch=5)],
            [(FaultyGpu, GpuConfig(gpu_idle_power_w=30.0))],
            [pusher],
            dead_letters=dead_letters,
        )
        result = run_async(built.run())
        return [r.model_dump() for r in pusher.written], dead_letters, result

    clean, _, _ = run()
    monkeypatch.setattr(FaultyGpu, "failing", reports[6].timestamp)
    written, dead_letters, result = run()
    assert [letter.payload for letter in dead_letters.letters] == [reports[6]]
    assert [r for r in clean if r["timestamp"] == reports[6].timestamp], "it had estimates"
    assert written == [r for r in clean if r["timestamp"] != reports[6].timestamp]
    assert result.ledger.balanced()


class FaultyNode(NodeFormula):
    """Raises while reporting one interval, after its first report is out."""

    failing: ClassVar[int | None] = None

    def _emit(
        self, start: int, end: int, active: list[str], targets: dict[str, float], out: Output
    ) -> None:
        super()._emit(start, end, active, targets, out)
        if end == self.failing:
            raise ModelFault("the meter's clock jumped")


def test_a_node_interval_that_raises_is_logged_and_the_next_ones_are_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its inputs are already in the formula's state: there is nothing to dead-letter, so the
    interval is dropped, with its traceback in the log, and the formula goes on."""
    start_ms = 1_767_603_600_000
    reports: list[Report] = [
        MeterReport(
            timestamp=start_ms + 1000 * second,
            sensor="node-1",
            target="all",
            channels={"d0c0": 100_000.0 + 1000 * second},
        )
        for second in range(10)
    ]

    def run() -> tuple[list[dict[str, Any]], PipelineResult, int]:
        pusher = MemoryPusher()
        built = Pipeline(
            [ListPuller(reports, batch=3)],
            [(FaultyNode, NodeConfig(node_lateness_ms=0))],
            [pusher],
        )
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger=FORMULA_LOGGER):
            result = run_async(built.run())
            errors = sum(1 for r in caplog.records if r.levelno == logging.ERROR)
        return [r.model_dump() for r in pusher.written], result, errors

    clean, _, _ = run()
    monkeypatch.setattr(FaultyNode, "failing", start_ms + 4000)
    written, result, errors = run()
    failed = [r for r in clean if r["timestamp"] == reports[4].timestamp]
    assert [r["target"] for r in failed] == ["node", "rest"]
    assert written == [r for r in clean if r not in failed]
    assert errors == 1
    assert result.ledger.balanced()
    assert result.ledger.dead_in == 0


class FaultyWakeNode(NodeFormula):
    """Raises on its first wake by the actor's timer, before doing anything. It waits for
    RAPL readings too, as with an hwpc-sensor input that gives none: the intervals are held
    until that source has been quiet for the lateness, and the timer releases them."""

    @classmethod
    def configured(cls, config: FormulaConfig, given: frozenset[str]) -> FormulaConfig:
        return super().configured(config, given | {HWPCReport.kind})

    def __init__(self, config: NodeConfig, key: Hashable) -> None:
        super().__init__(config, key)
        self.wakes = 0

    def wake(self, out: Output) -> None:
        self.wakes += 1
        if self.wakes == 1:
            raise ModelFault("the timer fired too soon")
        super().wake(out)


class PausedPuller(ListPuller):
    """Hands its reports on in one batch, then stays silent, as a live input that pauses,
    until ``until`` holds (what the formula was to produce without more input)."""

    def __init__(self, reports: list[Report], until: Callable[[], bool]) -> None:
        super().__init__(reports, batch=len(reports))
        self.until = until

    async def pull(self, emitter: Emitter) -> None:
        await super().pull(emitter)
        while not self.until():
            await asyncio.sleep(0.01)  # polled; run_async bounds the whole run


def test_a_wake_that_raises_is_logged_and_the_timer_wakes_the_formula_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The timer's wake is a unit of failure too: its error is logged once and the instance is
    woken again (not in a busy loop), and the intervals still come out while the input is
    silent, before the shutdown's flush."""
    start_ms = 1_767_603_600_000
    readings = 10
    reports: list[Report] = [
        MeterReport(
            timestamp=start_ms + 1000 * second,
            sensor="node-1",
            target="all",
            channels={"d0c0": 100_000.0},
        )
        for second in range(readings)
    ]
    pusher = MemoryPusher()
    built = Pipeline(
        [PausedPuller(reports, until=lambda: len(pusher.written) >= 2 * (readings - 1))],
        [(FaultyWakeNode, NodeConfig(node_lateness_ms=50))],
        [pusher],
    )
    with caplog.at_level(logging.ERROR, logger=FORMULA_LOGGER):
        result = run_async(built.run())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["formula:node failed on its wake: ModelFault: the timer fired too soon"]
    (formula,) = built.formulas[0].instances.values()
    assert isinstance(formula, FaultyWakeNode)
    assert formula.wakes == 2
    node = [r for r in pusher.written if isinstance(r, PowerReport) and r.target == "node"]
    assert [r.power for r in node] == [100.0] * (readings - 1)
    assert result.ledger.balanced()


class FaultyNodeRapl(NodeFormula):
    """Raises on one RAPL tick once its interval is in the formula's state, before the tick is
    counted as absorbed (as every source of the node formula absorbs last)."""

    failing: ClassVar[int | None] = None

    def _anchor(self, name: str, start: int, end: int) -> None:
        super()._anchor(name, start, end)
        if name == "rapl" and end == self.failing:
            raise ModelFault("the RAPL clock jumped")


def test_a_node_rapl_tick_that_raises_in_a_frame_fails_as_it_does_report_by_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (frame,) = read_hwpc_csv_frames(write_recording(tmp_path, ticks=20))
    assert isinstance(frame, HWPCFrame)
    ((_, part),) = NodeFormula.frame_parts(frame) or []
    reports = [r for r in frame.reports() if NodeFormula.dispatch_key(r) is not None]
    monkeypatch.setattr(FaultyNodeRapl, "failing", to_millis(reports[7].timestamp))
    formulas = []
    batches: list[list[Any]] = [[part], reports]
    for batch in batches:
        waiting = NodeConfig(node_lateness_ms=600_000)  # for a meter that never comes
        config = NodeFormula.configured(waiting, frozenset({HWPCReport.kind, MeterReport.kind}))
        assert isinstance(config, NodeConfig)
        formula = FaultyNodeRapl(config, "node-1")
        out = Output()
        formula.process(batch, out)
        assert [(r, reason) for r, reason in out.rejected] == [
            (reports[7], "failed on its report: ModelFault: the RAPL clock jumped")
        ]
        assert out.absorbed == len(reports) - 1
        formulas.append(formula)
    by_frame, by_reports = formulas
    for source in ("cpu", "dram"):
        assert by_frame.series[source] == by_reports.series[source]
    assert by_frame.anchor_ends == by_reports.anchor_ends
    assert len(by_frame.anchor_ends) == len(reports), "the failed tick's interval is kept"


def test_runs_of_steps_give_what_steps_one_by_one_give(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay's ticks go through the default model in runs (one call stores, judges and
    estimates many); the reports and FormulaReports are those of one step per tick, to the
    bit, relearning included."""
    paths = write_recording(tmp_path, ticks=400)
    in_runs = run_smartwatts("frames", paths, caplog)
    taken: list[int] = []
    original = FrequencyModel.track_run

    def counted(model: FrequencyModel, *args: Any) -> list[float]:
        errors = original(model, *args)
        taken.append(len(errors))
        return errors

    monkeypatch.setattr(FrequencyModel, "track_run", counted)
    assert run_smartwatts("frames", paths, caplog).written == in_runs.written
    assert sum(taken) > 400, "most steps went in runs"
    monkeypatch.setattr(FrequencyModel, "track_run", lambda *_, **__: [])
    one_by_one = run_smartwatts("frames", paths, caplog)
    assert one_by_one.written == in_runs.written
    assert len(in_runs.of_kind("FormulaReport")) > 1000
    assert not in_runs.letters
    assert not in_runs.tracebacks
