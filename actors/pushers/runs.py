"""The run recorder: the ``runs`` output, which records the pipeline's reports in a run.

``wattflow run --run E/B/S/N [--store URI] [--export FORMAT --export-dir DIR]`` stands for this
output (named ``run_store``); ``--output runs --run E/B/S/N …`` gives it as any other. It
stores every report the pipeline carries except hwpc-sensor's raw counters (the formulas'
PowerReports, and the GPU, meter and event reports), and stretches the run's window as they
come. A run created here gets the system info of the machine recording it, the node itself.

The service and a program may record the same run at once, in either order: each holds its own
copy of the run, so each only widens the stored window and never drops what the other stored
(the store merges parameters and system info, see
:meth:`~wattflow.actors.run_store.RunStore.save_run`).

With ``--export``, the recorder asks for an export when the run's ``experiment_end`` event is
stored, and once more when the service stops if reports came since (or none was asked for).
The event may come through the pipeline, or be stored by another process: ``wattflow runs mark
experiment_end`` and a program's ``record()`` write to the store, not to the service. So the
recorder also looks in the store, every :data:`WATCH_S` seconds, for ``experiment_end`` events
stamped since its last look (:class:`StoredEnds`): a read of the run's newest rows by the store's
index, bounded by what was stored meanwhile, not by the run's length. Each end is exported once,
however it was seen. Each export is ``wattflow export FORMAT --store URI --run E/B/S/N --out PATH``,
run as a child process from a thread of its own (:class:`RunExports`):

- the event loop never waits for it, and, being another process, it does not take the
  interpreter's lock from the live pipeline either, nor its memory;
- it is bounded: one export runs at a time, and requests that come while one runs make one
  more, never a queue;
- a failed export loses nothing (the reports are in the store): it is logged at ERROR with the
  command that writes it, and noted in the run (``wattflow runs list`` shows it), so
  ``wattflow export`` can write it later.

Where each format goes below ``--export-dir`` is :func:`~wattflow.actors.exporters.base.run_output`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from wattflow.actors.backend import CommaList
from wattflow.actors.connections import redact_uri
from wattflow.actors.exporters import exporters, known_formats
from wattflow.actors.exporters.base import run_output
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import Pusher, PusherConfig
from wattflow.actors.run_store import (
    RunStore,
    StoreError,
    default_store_uri,
    new_run,
    open_store,
    parse_run_id,
)
from wattflow.formats.reports import EventReport, Report, to_millis
from wattflow.formats.runs import Run

logger = logging.getLogger(__name__)

NOT_RECORDED = frozenset({"HWPCReport"})
"""hwpc-sensor's per-cpu counters: large, and what the formulas turn into the power recorded."""

TAIL_CHARS = 2000
"""How much of a failed export's error output is kept for the log."""

WATCH_S = 1.0
"""How often the recorder looks in the store for an ``experiment_end`` another process stored
(with ``--export`` only): the longest an export waits for it to be noticed."""

LATE_S = 60.0
"""How far before its last look the recorder looks again. An event is stamped when it is made
and stored a moment later (after waiting for the store's lock, five seconds at most in SQLite),
so one stamped just before a look can be stored just after it."""


class RunRecorderConfig(PusherConfig):
    """Records every report but hwpc-sensor's counters in a measurement run of a run store."""

    type: Literal["runs"] = "runs"
    run: str = Field(description="The run: experiment/benchmark/settings/repetition.")
    store: str | None = Field(
        default=None,
        description="Run store: sqlite:///path or mongodb://host/db (default: runs.db in the "
        "user's data directory).",
    )
    export: CommaList = Field(
        default_factory=list,
        description="Export the run in these formats (comma-separated: see `wattflow export "
        "--help`) as soon as it ends (its experiment_end event, or the service's stop), into "
        "the export directory.",
    )
    export_dir: Path | None = Field(
        default=None,
        description="Directory the exports are written into: a folder per format (see the "
        "exports page).",
    )

    @classmethod
    def example(cls) -> RunRecorderConfig:
        """Run clock-limit/bert/250W/0 in the default store."""
        return cls(type="runs", run="clock-limit/bert/250W/0")

    _known_formats = field_validator("export")(known_formats)

    @model_validator(mode="after")
    def _export_needs_a_directory(self) -> RunRecorderConfig:
        if self.export and self.export_dir is None:
            raise ValueError("export needs export_dir")
        return self


@pushers.register("runs")
class RunRecorder(Pusher[RunRecorderConfig]):
    """Stores the pipeline's reports in a run, widening its window to cover them."""

    config_model = RunRecorderConfig

    def __init__(self, config: RunRecorderConfig) -> None:
        super().__init__(config)
        parse_run_id(config.run)  # a mistyped id says how to write one, before the start
        self.store: RunStore | None = None
        self.run: Run | None = None
        self._provisional = False
        self.exports: RunExports | None = None
        if config.export and config.export_dir is not None:
            self.exports = RunExports(
                config.run, config.store or default_store_uri(), config.export, config.export_dir
            )
        self._unexported = 0
        """Reports stored since the latest export was asked for."""
        self._asked = False
        self._ends = StoredEnds(config.run)
        self._watcher: asyncio.Task[None] | None = None
        self._storing = asyncio.Lock()
        """Held while a thread uses the store: the watcher and ``write`` share its connection."""
        self._closing = asyncio.Event()

    def accepts(self, kind: str) -> bool:
        return kind not in NOT_RECORDED

    async def check(self) -> None:
        open_store(self.config.store).close()

    async def open(self) -> None:
        self.store = await asyncio.to_thread(open_store, self.config.store)
        self.run = await asyncio.to_thread(self.store.find, self.config.run)
        if self.run is None:
            # A new run: its window is now until reports come; then it is theirs, so that a
            # recording replayed through the service gets the window it was measured in, not
            # one from then until today.
            self._provisional = True
            self.run = new_run(self.config.run)
        # Widening: a program's record() may have created the run since it was looked up.
        await asyncio.to_thread(self.store.save_run, self.run, widen=True)
        if self.exports is not None:
            # Ends stored before the service started are the past: only later ones export.
            await asyncio.to_thread(self._ends.new_ends, self.store, datetime.now(UTC))
            self._watcher = asyncio.create_task(self._watch(), name=f"watch {self.config.run}")

    async def _watch(self) -> None:
        """Every :data:`WATCH_S` until :meth:`close`, export the run if another process stored
        its end. A look that fails (a store busy or unreachable) is logged and tried again."""
        assert self.store is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), WATCH_S)
                return  # close() waits for a look under way rather than cancel its thread
            try:
                async with self._storing:
                    ended = await asyncio.to_thread(
                        self._ends.new_ends, self.store, datetime.now(UTC)
                    )
            except Exception as error:  # either store's driver errors: the look is retried
                logger.warning("run %s: could not look for its end in the store: %s",
                               self.config.run, error)  # fmt: skip
                continue
            if ended:
                self._export_now()

    def _export_now(self) -> None:
        """The run ended: export it as it now is."""
        assert self.exports is not None
        self.exports.request()
        self._unexported, self._asked = 0, True

    async def write(self, batch: list[Report]) -> list[tuple[Report, str]]:
        ends = [r for r in batch if isinstance(r, EventReport) and r.event == "experiment_end"]
        async with self._storing:
            await self._store(batch)
            for end in ends:
                self._ends.saw(end)  # stored here: the watcher must not export it again
        self._unexported += len(batch)
        if self.exports is not None and ends:
            self._export_now()
        return []

    async def _store(self, batch: list[Report]) -> None:
        """Store a batch in the run, widening its window to hold it."""
        assert self.store is not None, "open() first"
        assert self.run is not None, "open() first"
        # The mailbox hands over what is ready without waiting, so this is when the pipeline
        # finished with these reports.
        processed = datetime.now(UTC)
        await asyncio.to_thread(self.store.add_reports, self.run.id, batch, processed)
        first = min(report.timestamp for report in batch)
        last = max(report.timestamp for report in batch)
        if self._provisional:
            self._provisional = False
            await asyncio.to_thread(self._settle, first, last)
        elif first < self.run.start or last > self.run.end:
            self.run = self.run.model_copy(
                update={"start": min(first, self.run.start), "end": max(last, self.run.end)}
            )
            await asyncio.to_thread(self.store.save_run, self.run, widen=True)

    def _settle(self, first: datetime, last: datetime) -> None:
        """Give a run this recorder created the window of its first reports, unless another
        writer (a program's ``record()``) has widened the stored one since: then only widen."""
        assert self.store is not None
        assert self.run is not None
        stored = self.store.get(self.run.id)
        untouched = (to_millis(stored.start), to_millis(stored.end)) == (
            to_millis(self.run.start), to_millis(self.run.end))  # fmt: skip
        self.run = self.run.model_copy(update={"start": first, "end": last})
        self.store.save_run(self.run, widen=not untouched)
        if not untouched:
            self.run = self.run.model_copy(
                update={"start": min(first, stored.start), "end": max(last, stored.end)}
            )

    async def close(self) -> None:
        if self._watcher is not None:
            self._closing.set()
            await self._watcher
            self._watcher = None
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None
        if self.exports is not None:
            # The service stops: the run ends here unless it ended already with nothing since.
            await self.exports.close(export=self._unexported > 0 or not self._asked)


class StoredEnds:
    """The run's ``experiment_end`` events, as the recorder has seen them: each one it stored
    itself or found in the store, so that each end is exported once, whoever stored it.

    An event is known by its time (ms) and sensor. Only events stamped since the last look,
    less :data:`LATE_S`, are read again; those before it are forgotten, as no look returns them.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.since: datetime | None = None
        """Where the next look starts: None before the first, which reads the last LATE_S."""
        self.seen: set[tuple[int, str]] = set()

    def saw(self, event: EventReport) -> None:
        """An end the recorder stored (or found)."""
        self.seen.add((to_millis(event.timestamp), event.sensor))

    def new_ends(self, store: RunStore, now: datetime) -> bool:
        """Whether the store holds an end of the run not seen before; it is seen now."""
        late = now - timedelta(seconds=LATE_S)
        since = late if self.since is None else min(self.since, late)
        found = False
        for event in store.events_since(self.run, since):
            key = (to_millis(event.timestamp), event.sensor)
            if event.event == "experiment_end" and key not in self.seen:
                self.seen.add(key)
                found = True
        self.since = late
        self.seen = {key for key in self.seen if key[0] >= to_millis(late)}
        return found


class RunExports:
    """Exports one run in the given formats, each time :meth:`request` asks, in a thread."""

    def __init__(self, run: str, store: str, formats: Sequence[str], directory: Path) -> None:
        self.run = run
        self.store = store
        self.formats = list(formats)
        self.directory = directory
        self.exported = 0
        """Exports run to their end (written or failed), for tests and logs."""
        self._wanted = False
        self._closing = False
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def commands(self) -> list[tuple[str, list[str]]]:
        """(format, the ``wattflow export`` command that writes the run in it)."""
        named = parse_run_id(self.run)
        found = []
        for name in self.formats:
            out = run_output(exporters.get(name), named, self.directory)
            found.append((name, ["wattflow", "export", name, "--store", self.store,
                                 "--run", self.run, "--out", str(out)]))  # fmt: skip
        return found

    def request(self) -> None:
        """Export the run as it is now stored, soon; never waits."""
        with self._condition:
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=f"export {self.run}", daemon=True
                )
                self._thread.start()
            self._condition.notify()

    async def close(self, *, export: bool) -> None:
        """Export once more if ``export``, and wait (off the event loop) for the exports asked
        for to end."""
        if export:
            self.request()
        with self._condition:
            self._closing = True
            self._condition.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _work(self) -> None:
        while True:
            with self._condition:
                while not self._wanted and not self._closing:
                    self._condition.wait()
                if not self._wanted:
                    return
                self._wanted = False
            for name, command in self.commands():
                self._export(name, command)
                self.exported += 1

    def _export(self, name: str, command: list[str]) -> None:
        shown = shlex.join([redact_uri(part) for part in command])
        try:
            done = subprocess.run(
                [sys.executable, "-m", "wattflow.service", *command[1:]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                check=False,
            )
        except OSError as error:
            self._failed(name, str(error), shown)
            return
        if done.returncode == 0:
            logger.info("exported run %s as %s: %s", self.run, name, command[-1])
            return
        errors = done.stderr.decode(errors="replace")[-TAIL_CHARS:].strip().splitlines()
        self._failed(name, errors[-1] if errors else f"exit code {done.returncode}", shown)

    def _failed(self, name: str, reason: str, shown: str) -> None:
        reason = redact_uri(reason.removeprefix("wattflow: error: "))
        logger.error(
            "run %s was not exported as %s: %s. Its reports are in the store; write it with: %s",
            self.run, name, reason, shown,
        )  # fmt: skip
        try:
            with open_store(self.store, create=False) as store:
                store.note_export(self.run, name, f"failed: {reason}")
        except StoreError as error:
            logger.error("could not note the failed export in the store either: %s", error)
