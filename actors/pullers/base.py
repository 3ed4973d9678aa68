"""What every puller is: a config model, a health check and a loop that emits batches."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import Field

from wattflow.actors.backend import BackendConfig
from wattflow.actors.partition import Partition
from wattflow.formats.batch import Batch, handed_on
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.json_frames import Layout, LineRun, decode_json_runs
from wattflow.formats.reports import Report

if TYPE_CHECKING:
    from wattflow.actors.checkpoints import StateStore


class PullerConfig(BackendConfig):
    """Settings every puller shares, named as PowerAPI's ``--input`` group names them."""

    role: ClassVar[str] = "puller"

    model: str = Field(
        default="HWPCReport",
        description="Report kind the input holds.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    retry_for_s: float = Field(
        default=60.0,
        ge=0,
        description="How long an input that is unavailable for now (its port busy, its server "
        "down) is retried, with backoff, before the run fails.",
    )


class Emitter(Protocol):
    """The pipeline as a puller sees it.

    ``emit`` waits while the pipeline is full: a puller that awaits it reads its input no faster
    than the pipeline can process it.
    """

    stopping: asyncio.Event

    async def emit(self, batch: Batch) -> None:
        """Hand decoded reports, or one frame, to the router, waiting while its mailbox is
        full."""

    def reject(self, payload: Any, reason: str) -> None:
        """Dead-letter input that could not become a report, naming where it came from."""

    def skip(self, count: int) -> None:
        """Count reports of other partitions' sensors let go without decoding them.

        ``emit`` lets such reports go by itself; a puller calls this only when it can tell
        whose they are before decoding (a ZeroMQ topic)."""


class Acknowledger(Protocol):
    """The pipeline's checkpoints as an input that can resume sees them.

    The pipeline commits the input's position once the outputs wrote what came before it
    (:mod:`wattflow.actors.checkpoints`), so the input reports its position here rather than
    saving it itself. A puller run on its own (a test, a tool) has none: it keeps its position
    itself, if it can.
    """

    async def boundary(self, position: Any) -> None:
        """The input handed on everything up to ``position``; a checkpoint due starts here."""

    def restore(self, data: bytes | None) -> None:
        """Hand the formulas the state an input read from its own store beside its position
        (``None`` when it holds none), before the input hands anything on."""


async def hand_on(emitter: Emitter, decoded: list[HWPCFrame] | list[Report]) -> None:
    """Emit what a decoder made of a batch
    (:func:`~wattflow.formats.json_frames.decode_json_runs`, ``decode_documents``): each frame
    on its own, or the reports as one batch."""
    for batch in handed_on(decoded):
        await emitter.emit(batch)


class LineOutbox:
    """Complete JSON lines an input read and has not handed on yet, decoded together when they
    are: a busy sensor's reads, however the network cut them, become one frame
    (:func:`~wattflow.formats.json_frames.decode_json_runs`) rather than one per read, and
    the frame engine's costs per frame are shared by hundreds of reports."""

    def __init__(self, kind: type[Report], source: str) -> None:
        self.kind = kind
        self.source = source
        self.runs: list[LineRun] = []
        """Runs of consecutive lines, each with the number of its first line."""
        self.size = 0
        """The number of lines held."""
        self.layouts: dict[str, Layout] = {}
        """Each sensor's groups, remembered from one batch to the next."""

    def add(self, lines: list[bytes], first_line: int) -> None:
        """Hold consecutive lines, the first numbered ``first_line``."""
        if lines:
            self.runs.append((self.source, first_line, lines))
            self.size += len(lines)

    async def emit(self, emitter: Emitter) -> None:
        """Decode what is held and hand it on: frames when every line is plain, else reports,
        each line that is not one dead-lettered with its number."""
        runs, self.runs, self.size = self.runs, [], 0
        if not runs:
            return
        decoded, errors = decode_json_runs(self.kind, runs, self.layouts)
        for error, raw in errors:
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            emitter.reject(text, str(error))
        await hand_on(emitter, decoded)


C = TypeVar("C", bound=PullerConfig)


class Puller(ABC, Generic[C]):
    """Reads one input and emits reports in batches.

    ``pull`` returns at the end of the input, or soon after ``emitter.stopping`` is set; it
    never leaves a decoded report un-emitted. In stream mode a puller waits for more input
    instead of ending.
    """

    config_model: ClassVar[type[PullerConfig]]

    partition: Partition | None = None
    """The sensors this instance takes (``--partition``), set by the pipeline before ``pull``:
    ``emit`` already lets the others go; an input uses it to keep a position of its own (the
    MongoDB checkpoint) or to avoid decoding what is not its own."""

    acknowledger: Acknowledger | None = None
    """Where the input reports its positions, set by the pipeline before ``pull`` (its
    emitter, which commits them by acknowledgement); ``None`` for a puller run on its own."""

    def __init__(self, config: C, *, stream: bool = False) -> None:
        self.config = config
        self.stream = stream

    async def probe(self) -> str:
        """Contact the server or file behind this backend; return what was found.

        ``wattflow check`` calls it. It raises an error saying why the backend cannot work;
        a backend with nothing to contact says so.
        """
        return "nothing to contact before it runs"

    async def check(self) -> None:
        """Raise an error that says why the input cannot be read, before the pipeline starts."""

    @property
    def resumable(self) -> bool:
        """Whether the input can be read again from a position after a restart: it then reports
        its position at each batch boundary (:meth:`boundary`), and the pipeline commits it
        once the outputs wrote what came before it (:mod:`wattflow.actors.checkpoints`)."""
        return False

    @property
    def checkpoint_interval_s(self) -> float:
        """How often this input, when it can resume, would have its position committed (the
        pipeline takes the shortest of its inputs' unless ``--state-interval-s`` is given)."""
        return 5.0

    async def boundary(self, position: Any) -> None:
        """Tell the pipeline the input handed on everything up to ``position``; nothing when
        the puller runs on its own (no :attr:`acknowledger`)."""
        if self.acknowledger is not None:
            await self.acknowledger.boundary(position)

    def resume_from(self, position: Any) -> None:
        """Take the position saved with the last checkpoint (``None`` before the first), before
        ``pull``: the pipeline calls it when it commits checkpoints to a store it reads at the
        start (``--state-file``). An input that keeps its position itself (MongoDB) ignores it."""
        self.saved_position = position
        self.checkpointed = True

    saved_position: Any = None
    """The position :meth:`resume_from` handed over."""
    checkpointed: bool = False
    """Whether the positions this input reports are committed, to be handed back at a restart:
    it then leaves an incomplete last line for the next run instead of reading it at a stop."""

    def state_store(self) -> StateStore | None:
        """Where this input keeps checkpoints when no ``--state-file`` is given: beside its
        position (the MongoDB input's checkpoint document), or ``None``."""
        return None

    def not_ready(self) -> str | None:
        """Why the input is not connected yet, or None once it is (``/ready``).

        Called while ``pull`` runs. An input of files is ready as soon as it reads; one that
        listens or has a server to reach says when it listens or has reached it.
        """
        return None

    @abstractmethod
    async def pull(self, emitter: Emitter) -> None:
        """Read the input and emit its reports."""
