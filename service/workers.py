"""``wattflow run --workers N``: N worker processes, one parent that supervises them.

Each worker is a whole pipeline (``wattflow run`` as it runs alone) that takes one share of the
sensors: worker ``j`` is partition ``j/N`` of the instance's (``--partition i/M`` splits
further, see :meth:`~wattflow.actors.partition.Partition.split`), so a sensor's formula state
lives in one worker. The parent:

- listens on each socket input itself and hands each connection to the worker of its sensor
  (:mod:`wattflow.actors.handoff`): the reports are decoded once, by their worker;
- starts the workers (``spawn``: a fresh interpreter each, nothing inherited from the parent's
  event loop) and restarts one that dies, a bounded number of times, counting each death: it
  is logged, in ``/metrics`` (``wattflow_worker_restarts_total``), named at the exit, and makes
  the exit code 1, since a killed process sends no ledger;
- on SIGTERM or SIGINT stops accepting and tells every worker to drain (SIGTERM); a second
  signal tells them to stop at once (SIGUSR1); a worker still running
  ``drain_timeout_s + DRAIN_SETTLE_S + WORKER_EXIT_MARGIN_S`` after the first is killed;
- sums the workers' ledgers into the exit line, and serves ``/health``, ``/ready`` and
  ``/metrics`` for all of them (each worker serves its own on a loopback port that only the
  parent asks).

MongoDB, ZeroMQ and file inputs are read by every worker, each keeping its share (the
partition filter, which lets go of the others' reports right after decoding, or before it for
ZeroMQ topics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from wattflow.actors.handoff import OUTCOMES, Acceptor, raise_open_files_limit, settle
from wattflow.actors.partition import Partition
from wattflow.actors.pipeline import DRAIN_SETTLE_S
from wattflow.actors.pullers.socket import SocketPuller
from wattflow.actors.pushers.jsonl import JsonlPusherConfig
from wattflow.actors.runtime import Backoff, Ledger, task_group
from wattflow.actors.status import Snapshot
from wattflow.formats.errors import WattflowError
from wattflow.service.config import ConfigError, ServiceConfig

logger = logging.getLogger("wattflow.workers")

ONE_PROCESS_INPUTS = {"nvml": "samples this machine's GPUs", "meter": "reads one meter"}
"""Inputs that are one device: N workers would read it N times."""
ONE_PROCESS_OUTPUTS = {
    "table": "draws one table on the terminal",
    "prometheus": "listens on one port for scrapes",
}
MAX_RESTARTS = 5
"""A worker that dies more often than this within :data:`RESTART_WINDOW_S` ends the run."""
RESTART_WINDOW_S = 60.0
WORKER_EXIT_MARGIN_S = 10.0
"""Beyond the drain deadline and its settling, how long a worker may take to exit (its
interpreter's shutdown) before it is killed."""
STATUS_FETCH_S = 2.0
"""Longest wait for one worker's ``/health``, ``/ready`` or ``/metrics``."""


def refuse(config: ServiceConfig) -> None:
    """Stop a ``--workers`` run that N processes cannot do, naming why.

    Raises:
        ConfigError: an input, output or setting that needs one process.
    """
    for name, settings in config.inputs.items():
        if settings.type in ONE_PROCESS_INPUTS:
            raise ConfigError(
                f"--workers: input '{name}' ({settings.type}) {ONE_PROCESS_INPUTS[settings.type]}"
                ": run it with --workers 1 (or alone, sending to the workers' input)"
            )
        if settings.type == "zeromq":
            zmq_settings: Any = settings
            if zmq_settings.socket_type == "PULL":
                raise ConfigError(
                    f"--workers: input '{name}' is a ZeroMQ PULL socket, which deals messages "
                    "to the workers in turn, not by sensor: use --socket-type SUB"
                )
            if zmq_settings.binds:
                raise ConfigError(
                    f"--workers: input '{name}' binds, and only one process can bind an "
                    "address: connect to the publishers instead"
                )
    for name, out in config.outputs.items():
        if out.type in ONE_PROCESS_OUTPUTS:
            raise ConfigError(
                f"--workers: output '{name}' ({out.type}) {ONE_PROCESS_OUTPUTS[out.type]}: "
                "use --workers 1"
            )
        if out.type == "zeromq" and getattr(out, "bind", False):
            raise ConfigError(
                f"--workers: output '{name}' binds, and only one process can bind an address"
            )
    if config.run is not None:
        raise ConfigError("--workers: --run records one run from one process: use --workers 1")


def per_worker_path(path: Path, index: int) -> Path:
    """Worker ``index``'s own file for a file that N writers would share:
    ``power.jsonl`` → ``power.worker0.jsonl``."""
    return path.with_name(f"{path.stem}.worker{index}{path.suffix}")


def worker_config(config: ServiceConfig, index: int) -> ServiceConfig:
    """The config worker ``index`` of ``config.workers`` runs."""
    instance = config.partition_spec() or Partition(0, 1)
    outputs = {
        name: (
            out.model_copy(update={"file": per_worker_path(out.file, index)})
            if isinstance(out, JsonlPusherConfig)
            else out
        )
        for name, out in config.outputs.items()
    }
    update: dict[str, Any] = {
        "workers": 1,
        "partition": str(instance.split(config.workers)[index]),
        "outputs": outputs,
    }
    if config.dead_letters is not None:
        update["dead_letters"] = per_worker_path(config.dead_letters, index)
    if config.state_file is not None:  # each worker's formulas hold only its sensors' state
        update["state_file"] = per_worker_path(config.state_file, index)
    if config.http_port is not None:  # the parent asks; nobody else need reach it
        update.update(http_port=0, http_addr="127.0.0.1")
    return config.model_copy(update=update)


# --- in the worker process -----------------------------------------------------------------


def worker_main(
    config: ServiceConfig,
    index: int,
    count: int,
    instance: Partition | None,
    channels: dict[str, socket.socket],
    to_parent: Connection,
) -> None:
    """A worker's life: its pipeline, run until its input ends or the parent says stop.

    It tells the parent its status port (``("http", port)``) and, at the end, its ledger and
    problems (``("done", ledger, problems)``); its exit code is ``wattflow run``'s.
    """
    from wattflow.service.cli import configure_logging, few_collections, run_problems
    from wattflow.service.pipeline import Interrupted, assemble, check, serve, status_server

    label = f"worker {index}/{count}"
    configure_logging(config.verbose, label=f"[{label}] ")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides
    try:
        pipeline = assemble(config, label=label)
        for actor in pipeline.pullers:
            channel = channels.get(actor.puller.config.name)
            if isinstance(actor.puller, SocketPuller) and channel is not None:
                actor.puller.handoff = channel
                actor.puller.instance = instance
        asyncio.run(check(pipeline))
        status = status_server(config, pipeline)
    except WattflowError as error:
        logger.error("%s cannot start: %s", label, error)
        to_parent.send(("failed", str(error)))
        sys.exit(2)
    if status is not None:
        to_parent.send(("http", status.port))
    try:
        with few_collections():  # as a single process runs its pipeline
            result = asyncio.run(serve(pipeline, status, worker=True))
    except Interrupted as interrupted:
        to_parent.send(("done", pipeline.ledger, [str(interrupted)]))
        os._exit(1)
    problems = run_problems(result, pipeline)
    to_parent.send(("done", result.ledger, problems))
    logging.shutdown()
    os._exit(1 if problems else 0)


# --- in the parent -------------------------------------------------------------------------


@dataclass
class Worker:
    """One worker slot: its current process and what it said."""

    index: int
    process: Any = None
    to_parent: Connection | None = None
    http_port: int | None = None
    ledger: Ledger | None = None
    problems: list[str] = field(default_factory=list)
    exit_code: int | None = None
    restarts: list[float] = field(default_factory=list)
    """Monotonic times of its restarts within the last :data:`RESTART_WINDOW_S` (the bound)."""
    restarted: int = 0
    """Restarts of this slot over the whole run (``wattflow_worker_restarts_total``)."""
    deaths: list[str] = field(default_factory=list)
    """How each process of this slot that ended without sending its ledger ended (``was
    killed by SIGKILL``): the ledger cannot count what it had read, and what it held is lost."""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None


def sum_ledgers(ledgers: list[Ledger]) -> Ledger:
    """The workers' ledgers added field by field: the whole service's."""
    total = Ledger()
    for ledger in ledgers:
        for item in fields(Ledger):
            mine = getattr(total, item.name)
            theirs = getattr(ledger, item.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            else:
                setattr(total, item.name, mine + theirs)
    return total


class WorkerPool:
    """The parent: workers, acceptors, signals, restarts and the summed result."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.count = config.workers
        self.context = multiprocessing.get_context("spawn")
        self.workers = [Worker(index) for index in range(self.count)]
        self.acceptors: dict[str, Acceptor] = {}
        self.channels: dict[str, list[tuple[socket.socket, socket.socket]]] = {}
        """Per socket input, per worker: (the parent's end, the worker's end)."""
        self.stopping = False
        self.aborted = False
        self.failure: str | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        instance = config.partition_spec() or Partition(0, 1)
        for name, settings in config.inputs.items():
            if settings.type != "socket":
                continue
            pairs = [
                socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(self.count)
            ]
            for parent_end, _ in pairs:
                parent_end.setblocking(False)
            self.channels[name] = pairs
            socket_settings: Any = settings
            self.acceptors[name] = Acceptor(
                socket_settings.host,
                socket_settings.port,
                [parent_end for parent_end, _ in pairs],
                instance,
                socket_settings.max_line_bytes,
            )

    def listen(self) -> None:
        """Listen on every socket input before any worker starts, with an open-files limit
        raised for a connection per sensor (the workers inherit it); each acceptor holds at
        most half the limit in connections waiting for their first line or their worker."""
        if not self.acceptors:
            return
        limit = raise_open_files_limit()
        for acceptor in self.acceptors.values():
            acceptor.max_pending = max(16, min(acceptor.max_pending, limit // 2))
            acceptor.listen()

    def _spawn(self, worker: Worker) -> None:
        config = worker_config(self.config, worker.index)
        instance = self.config.partition_spec()
        channels = {name: pairs[worker.index][1] for name, pairs in self.channels.items()}
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=worker_main,
            args=(config, worker.index, self.count, instance, channels, sender),
            name=f"wattflow-worker-{worker.index}",
        )
        # The worker starts with SIGINT ignored: a terminal's Ctrl-C reaches every process of
        # its group, and only the parent should act on it.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        sender.close()
        logger.info("worker %d/%d started (pid %d)", worker.index, self.count, process.pid)
        worker.process, worker.to_parent = process, receiver
        worker.http_port, worker.ledger, worker.problems, worker.exit_code = None, None, [], None

    def _read_messages(self, worker: Worker) -> None:
        receiver = worker.to_parent
        if receiver is None:
            return
        with contextlib.suppress(EOFError, OSError):
            while receiver.poll():
                message = receiver.recv()
                if message[0] == "http":
                    worker.http_port = message[1]
                elif message[0] == "done":
                    worker.ledger, worker.problems = message[1], list(message[2])
                elif message[0] == "failed":
                    worker.problems = [message[1]]

    async def _wait_for_exit(self, worker: Worker) -> None:
        """Until the worker's process ends, reading what it says on the way."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        receiver = worker.to_parent
        assert receiver is not None
        loop.add_reader(worker.process.sentinel, settle, ended)
        loop.add_reader(receiver.fileno(), self._read_messages, worker)
        try:
            await ended
        finally:
            loop.remove_reader(worker.process.sentinel)
            loop.remove_reader(receiver.fileno())
        worker.process.join()
        self._read_messages(worker)
        receiver.close()
        worker.exit_code = worker.process.exitcode

    def _may_restart(self, worker: Worker) -> bool:
        """Whether a worker that died (not asked to) is started again."""
        if self.stopping:
            return False
        if not (self.config.stream or self.acceptors):
            return False  # files: a second reading would write their reports twice
        now = time.monotonic()
        worker.restarts = [t for t in worker.restarts if now - t < RESTART_WINDOW_S]
        return len(worker.restarts) < MAX_RESTARTS

    async def _keep(self, worker: Worker) -> None:
        """Run one worker slot: start, wait, restart (bounded) if it died."""
        backoff = Backoff()
        while True:
            self._spawn(worker)
            await self._wait_for_exit(worker)
            if worker.ledger is None:
                worker.deaths.append(_exit_reason(worker.exit_code))
            if worker.exit_code == 0 or self.stopping:
                return
            why = _exit_reason(worker.exit_code)
            if not self._may_restart(worker):
                self.failure = f"worker {worker.index}/{self.count} {why}" + (
                    f": {worker.problems[0]}" if worker.problems else ""
                )
                logger.error("%s; stopping the other workers", self.failure)
                self.stop()
                return
            worker.restarts.append(time.monotonic())
            worker.restarted += 1
            logger.error(
                "worker %d/%d %s%s: restarting it (restart %d of the run; %d of %d within %g s)",
                worker.index,
                self.count,
                why,
                "" if worker.ledger is not None else "; the reports it held are lost",
                worker.restarted,
                len(worker.restarts),
                MAX_RESTARTS,
                RESTART_WINDOW_S,
            )
            await asyncio.sleep(backoff.next_s())

    def stop(self) -> None:
        """Stop accepting, and ask every worker to drain."""
        if self.stopping:
            return
        self.stopping = True
        logger.info("stopping: the workers drain")
        for acceptor in self.acceptors.values():
            acceptor.close()
        self._signal_all(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        limit_s = self.config.drain_timeout_s + DRAIN_SETTLE_S + WORKER_EXIT_MARGIN_S
        loop.call_later(limit_s, self._kill_all, limit_s)

    def abort(self) -> None:
        """A second signal: every worker stops at once."""
        self.aborted = True
        self._signal_all(signal.SIGUSR1)

    def _signal_all(self, sent: signal.Signals) -> None:
        for worker in self.workers:
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sent)

    def _kill_all(self, limit_s: float) -> None:
        still = [w for w in self.workers if w.alive]
        if still:
            logger.error(
                "workers %s still running %g s after the stop: killed",
                ", ".join(str(w.index) for w in still),
                limit_s,
            )
        for worker in still:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGKILL)

    async def run(self) -> int:
        """Run every worker until all have ended; return the exit code."""
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if self.stopping:
                self.abort()
            else:
                self.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            async with task_group() as tasks:  # the acceptors end, and are waited for, here
                accepting = [tasks.create_task(a.serve()) for a in self.acceptors.values()]
                try:
                    await asyncio.gather(*(self._keep(worker) for worker in self.workers))
                finally:
                    for task in accepting:
                        task.cancel()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            for pairs in self.channels.values():
                for parent_end, worker_end in pairs:
                    parent_end.close()
                    worker_end.close()
        return self._outcome()

    def _outcome(self) -> int:
        """Log the summed ledger, print one line per problem, and return the exit code: 1
        when a worker died (even one restarted and drained cleanly after), as its ledger is
        not in the sum."""
        ledger = sum_ledgers([w.ledger for w in self.workers if w.ledger is not None])
        closed: Counter[str] = Counter()
        for acceptor in self.acceptors.values():
            closed.update(acceptor.closed)
        self._log_drained(ledger, closed)
        problems = self._problems(ledger, closed)
        for problem in dict.fromkeys(problems):
            print(f"wattflow: error: {problem}", file=sys.stderr)
        return 1 if problems or self.aborted else 0

    def _log_drained(self, ledger: Ledger, closed: Counter[str]) -> None:
        """The exit line: the summed ledger, the workers' restarts and deaths (an error when
        one died) and, with acceptors, the sensor connections handed and closed unhanded."""
        deaths = sum(len(w.deaths) for w in self.workers)
        logger.log(
            logging.ERROR if deaths else logging.INFO,
            "pipeline drained: %s workers=%d worker_restarts=%d worker_deaths=%d%s",
            ledger.summary(),
            self.count,
            sum(w.restarted for w in self.workers),
            deaths,
            (
                f" connections_handed={sum(sum(a.handed) for a in self.acceptors.values())}"
                f" connections_closed={sum(closed[o] for o in CLOSED_UNHANDED)}"
                if self.acceptors
                else ""
            ),
        )

    def _problems(self, ledger: Ledger, closed: Counter[str]) -> list[str]:
        """What the exit says went wrong, the failure that stopped the pool first."""
        problems = [f"worker {w.index}/{self.count}: {p}" for w in self.workers for p in w.problems]
        problems += [_death_line(w, self.count) for w in self.workers if w.deaths]
        if closed["stalled"] + closed["failed"]:
            problems.append(
                f"{closed['stalled'] + closed['failed']} sensor connections closed unread: "
                "their worker did not take them (see the errors above)"
            )
        if self.failure is not None:
            problems.insert(0, self.failure)
        if not ledger.balanced():
            problems.append(f"reports unaccounted for: {ledger.summary()}")
        return problems


CLOSED_UNHANDED = ("silent", "stalled", "failed", "stopped")
"""Outcomes of the connections the acceptor closed itself, handed to no worker: the exit
line's ``connections_closed``."""


def _death_line(worker: Worker, count: int) -> str:
    """What the exit says of a worker slot whose processes died: which, how, how often it was
    restarted, and that the ledger above does not count them (it cannot be called balanced
    for reports nobody could count)."""
    how = "; ".join(
        f"{why} ×{times}" if times > 1 else why for why, times in Counter(worker.deaths).items()
    )
    return (
        f"worker {worker.index}/{count} died ({how}) and was restarted {worker.restarted} "
        f"time{'s' if worker.restarted != 1 else ''}: what it had read before is not in the "
        "ledger, and the reports it held were not written"
    )


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


# --- health and metrics of all the workers -------------------------------------------------


class WorkersStatus:
    """``/health``, ``/ready`` and ``/metrics`` of every worker, for the parent's status server.

    Each worker serves its own on a loopback port; a request to the parent asks every worker
    at once and answers for all: unhealthy (not ready) when one is, every worker's metrics with
    a ``worker`` label. The workers' ``process_*`` metrics are left out (the parent's own are
    served; they would share names).
    """

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    async def snapshot(self) -> Snapshot:
        answers = await asyncio.gather(*(self._ask(w) for w in self.pool.workers))
        unhealthy: list[str] = []
        not_ready: list[str] = []
        families: dict[str, Metric] = {}
        alive = GaugeMetricFamily("wattflow_workers_running", "Worker processes running.")
        alive.add_metric([], sum(1 for w in self.pool.workers if w.alive))
        restarts = CounterMetricFamily(
            "wattflow_worker_restarts",
            "Times the worker's process died and the parent started it again.",
            labels=["worker"],
        )
        for worker, (health, ready, metrics) in zip(self.pool.workers, answers, strict=True):
            name = f"worker {worker.index}/{self.pool.count}"
            unhealthy += [f"{name}: {line}" for line in health]
            not_ready += [f"{name}: {line}" for line in ready]
            restarts.add_metric([str(worker.index)], worker.restarted)
            _merge(families, metrics, str(worker.index))
        if self.pool.stopping:
            unhealthy.append("draining: the service is stopping")
            not_ready.append("draining: the service is stopping")
        accepted = self._acceptors()
        return Snapshot(unhealthy, not_ready, [alive, restarts, *accepted, *families.values()])

    def _acceptors(self) -> list[Metric]:
        """Each socket input's acceptor: what became of its connections, and how many it
        holds now (waiting for their first line, or for their worker's channel)."""
        connections = CounterMetricFamily(
            "wattflow_acceptor_connections",
            "Sensor connections the parent accepted, by outcome: handed (to the worker), "
            "silent (no complete first line in time), peer_closed (before a byte), stalled "
            "(the worker took none for too long), failed, stopped (at shutdown).",
            labels=["input", "outcome", "worker"],
        )
        held = GaugeMetricFamily(
            "wattflow_acceptor_pending",
            "Connections accepted and not handed yet: waiting for their first line or for "
            "room in their worker's channel.",
            labels=["input"],
        )
        for name, acceptor in self.pool.acceptors.items():
            for index, count in enumerate(acceptor.handed):
                connections.add_metric([name, "handed", str(index)], count)
            for outcome in OUTCOMES[1:]:
                connections.add_metric([name, outcome, ""], acceptor.closed[outcome])
            held.add_metric([name], acceptor.held)
        return [connections, held]

    async def _ask(self, worker: Worker) -> tuple[list[str], list[str], str]:
        if not worker.alive:
            why = "is restarting" if not self.pool.stopping else "has stopped"
            return [why], [why], ""
        if worker.http_port is None:
            return [], ["is starting"], ""
        base = f"http://127.0.0.1:{worker.http_port}"
        health, ready, metrics = await asyncio.gather(
            asyncio.to_thread(_fetch, base + "/health"),
            asyncio.to_thread(_fetch, base + "/ready"),
            asyncio.to_thread(_fetch, base + "/metrics"),
        )
        return _reasons(health), _reasons(ready), metrics[1]


def _fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=STATUS_FETCH_S) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, f"does not answer: {error}"


def _reasons(answer: tuple[int, str]) -> list[str]:
    status, text = answer
    return [] if status == 200 else [line for line in text.splitlines() if line] or [str(status)]


def _merge(families: dict[str, Metric], text: str, worker: str) -> None:
    """Add one worker's metrics (exposition text) to ``families``, labelled ``worker``."""
    for family in text_string_to_metric_families(text):
        if family.name.startswith("process_"):
            continue
        merged = families.get(family.name)
        if merged is None:
            merged = families[family.name] = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            merged.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))


def run_workers(config: ServiceConfig) -> int:
    """``wattflow run --workers N``: exit 0 when done, 2 for bad usage, 1 at run time, which
    includes a worker that died, even one restarted after (:meth:`WorkerPool._outcome`)."""
    from wattflow.service.pipeline import assemble, check
    from wattflow.service.status_server import StatusServer

    try:
        refuse(config)
        # One worker's pipeline, probed here: a bad input or output stops the command with
        # exit 2 before any process starts, as without workers.
        asyncio.run(check(assemble(worker_config(config, 0))))
        pool = WorkerPool(config)
        pool.listen()
        status = None
        if config.http_port is not None:
            status = StatusServer(WorkersStatus(pool), config.http_addr, config.http_port)
            status.listen()
    except WattflowError as error:
        print(f"wattflow: error: {error}", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    try:
        if status is not None:
            status.attach(loop)
        return loop.run_until_complete(pool.run())
    finally:
        if status is not None:
            status.close()
        loop.close()
