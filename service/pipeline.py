"""Wiring: a validated :class:`ServiceConfig` becomes a running, signal-aware pipeline."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Any

from wattflow.actors.checkpoints import FileStateStore
from wattflow.actors.formulas import formulas
from wattflow.actors.pipeline import Pipeline, PipelineResult
from wattflow.actors.preprocessors import preprocessors
from wattflow.actors.pullers import pullers
from wattflow.actors.pushers import pushers
from wattflow.actors.runtime import DeadLetters
from wattflow.service.config import ConfigError, ServiceConfig

if TYPE_CHECKING:  # prometheus_client is imported only for --http-port
    from wattflow.service.status_server import StatusServer


def assemble(config: ServiceConfig, label: str = "pipeline") -> Pipeline:
    """Build the pipeline a config describes.

    Raises:
        ConfigError: when the config has no input or no output.
    """
    if not config.inputs:
        raise ConfigError("input: no input given (e.g. --input csv --files a.csv,b.csv)")
    if not config.outputs:
        raise ConfigError("output: no output given (e.g. --output csv --directory out)")
    puller_objects: list[Any] = [
        pullers.get(c.type)(c, stream=config.stream) for c in config.inputs.values()
    ]
    pusher_objects: list[Any] = [pushers.get(c.type)(c) for c in config.outputs.values()]
    formula_list = [(formulas.get(name), c) for name, c in config.formulas.items()]
    # SmartWatts 2.4.1 runs on PowerAPI 2.10: its compat mode gets 2.10's pre-processor layout.
    compat = getattr(config.formulas.get("smartwatts"), "compat", None) is not None
    pre_processors = [
        preprocessors.get(c.type)(c, compat=compat) for c in config.pre_processors.values()
    ]
    return Pipeline(
        puller_objects,
        formula_list,
        pusher_objects,
        queue=config.queue,
        dead_letters=DeadLetters(config.dead_letters),
        drain_timeout_s=config.drain_timeout_s,
        partition=config.partition_spec(),
        label=label,
        state_store=None if config.state_file is None else FileStateStore(config.state_file),
        checkpoint_interval_s=config.state_interval_s,
        name_targets=config.target_names == "on" or _energy_on(config),
        pre_processors=pre_processors,
    )


def _energy_on(config: ServiceConfig) -> bool:
    """Whether the energy formula runs: it sums each workload's energy by its names, so it
    names the targets whatever ``--target-names`` says."""
    energy = config.formulas.get("energy")
    return energy is not None and formulas.get("energy").enabled(energy)


async def check(pipeline: Pipeline) -> None:
    """Probe every input and output, and open the dead-letter file, before starting, so a bad
    one fails with exit 2."""
    pipeline.dead_letters.open()
    for puller in pipeline.pullers:
        await puller.puller.check()
    for pre_processor in pipeline.pre_processors.values():
        await pre_processor.check()
    for pusher in pipeline.pushers:
        await pusher.pusher.check()


def status_server(config: ServiceConfig, pipeline: Pipeline) -> StatusServer | None:
    """Listen for ``/health``, ``/ready`` and ``/metrics`` when ``--http-port`` is given.

    It listens before the pipeline starts, so probes get 503 ("starting") rather than no
    answer, and a port in use stops the command with exit 2.

    Raises:
        WattflowError: when the address and port cannot be listened on.
    """
    if config.http_port is None:
        return None
    from wattflow.actors.status import PipelineStatus
    from wattflow.service.status_server import StatusServer

    server = StatusServer(PipelineStatus(pipeline), config.http_addr, config.http_port)
    server.listen()
    return server


class Interrupted(Exception):
    """A second signal arrived while draining: the run stopped without finishing the drain."""


async def serve(
    pipeline: Pipeline, status: StatusServer | None = None, *, worker: bool = False
) -> PipelineResult:
    """Run the pipeline; SIGTERM and SIGINT make it stop reading and drain.

    A second signal during the drain stops at once and raises :class:`Interrupted`, for the
    operator whose sink is gone and who would rather lose what is in flight than wait.
    ``status`` answers from this pipeline while it runs, and is closed when it ends.

    A ``worker`` (``--workers``) takes its orders from its parent alone: SIGTERM drains, again
    or not (a service manager may signal every process of the service as well as the parent),
    and SIGUSR1, the parent's answer to a second signal, stops at once.
    """
    loop = asyncio.get_running_loop()
    if status is not None:
        status.attach(loop)
    main = asyncio.current_task()
    handled = []

    def on_signal() -> None:
        if not pipeline.stopping.is_set():
            pipeline.stop()
        elif main is not None and not worker:
            main.cancel("second signal")

    def on_abort() -> None:
        if main is not None:
            main.cancel("second signal")

    handlers = {signal.SIGTERM: on_signal, signal.SIGINT: on_signal}
    if worker:
        handlers = {signal.SIGTERM: on_signal, signal.SIGUSR1: on_abort}
    for sig, handler in handlers.items():
        try:
            loop.add_signal_handler(sig, handler)
            handled.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        return await pipeline.run()
    except asyncio.CancelledError:
        await pipeline.supervisor.cancel_all()
        pipeline.dead_letters.close()
        in_flight = pipeline.ledger.entered - pipeline.ledger.delivered
        raise Interrupted(
            f"interrupted twice: stopped without draining; up to {in_flight} reports that "
            f"entered were not written ({pipeline.ledger.summary()})"
        ) from None
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        if status is not None:
            await asyncio.to_thread(status.close)
