"""Exporting a run as it ends, from the service: ``wattflow run --run … --export FORMAT``.

The run recorder asks for an export when it has stored the run's ``experiment_end`` event, and
once more when the service stops if reports came since (or none was asked for). Each export is
``wattflow export FORMAT --store URI --run E/B/S/N --out PATH``, run as a child process from a
thread of its own:

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
import logging
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from wattflow.actors.connections import redact_uri
from wattflow.actors.exporters import exporters
from wattflow.actors.exporters.base import run_output
from wattflow.service.runs import StoreError, open_store, parse_run_id

logger = logging.getLogger(__name__)

TAIL_CHARS = 2000
"""How much of a failed export's error output is kept for the log."""


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
