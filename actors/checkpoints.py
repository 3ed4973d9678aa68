"""Acknowledged checkpoints: an input's position and the formulas' state, committed together
once every output has written what came before them.

An input that can resume (the MongoDB input in stream mode) reports its position at each batch
boundary (:meth:`Checkpoints.boundary`). Once an interval, when every such input stands at a
boundary, a :class:`Barrier` goes into the router's mailbox behind everything they handed on. It
travels the pipeline like any batch, in order: each formula actor, on taking it, snapshots the
state of its instances (:meth:`Formula.state`: learned models, their windows, and the ticks a
formula still holds) and passes it on; each output, on taking it, has written (or
dead-lettered with a reason other than an outage) every batch before it, and acknowledges it.
When the last acknowledgement is in, the positions and the snapshots are saved as one document
(:class:`StateStore`). A crash then re-reads only what came after that barrier, and the restored
formulas hold exactly what they held at it: nothing is lost, nothing is estimated from nothing
again, and an idempotent output (MongoDB by ``_id``, InfluxDB by series and time) writes each
report once.

The cost is one check per input batch and one barrier per interval: no per-report bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import orjson

from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report

logger = logging.getLogger(__name__)

STATE_VERSION = 1
"""The layout of a saved checkpoint; a checkpoint of another version is not restored."""

MAX_STATE_BYTES = 8 << 20
"""The largest compressed checkpoint saved (MongoDB's documents end at 16 MiB): a larger one is
not saved, the last one stays, and the log says so."""


class Barrier(Frame):
    """A checkpoint's marker: a frame of no reports, travelling alone through the mailboxes.

    ``final`` marks the one sent at a clean stop: the formulas snapshot after their flush.
    """

    kind: ClassVar[str] = "checkpoint barrier"
    __slots__ = ("epoch", "final")

    def __init__(self, epoch: int, *, final: bool = False) -> None:
        self.epoch = epoch
        self.final = final

    def __len__(self) -> int:
        return 0

    def reports(self) -> list[Report]:
        return []


def barrier_of(batch: Sequence[Any]) -> Barrier | None:
    """The barrier a batch is, if it is one (barriers travel alone; pairs as in formula
    mailboxes are looked into)."""
    if len(batch) != 1:
        return None
    item = batch[0]
    if type(item) is tuple:
        item = item[1]
    return item if type(item) is Barrier else None


# --- encoding state -------------------------------------------------------------------------

Saved = dict[str, Any]
"""A formula instance's state as a checkpoint holds it: the JSON object of its
:class:`FormulaState`, with that layout's ``version``."""


class FormulaState(msgspec.Struct, kw_only=True, frozen=True, tag_field="version"):
    """What a formula instance keeps across a restart, typed and versioned.

    Each formula's state is a subclass tagged with its layout's version (``tag=1``): the tag
    is written as ``version`` and checked on the way back. A layout is changed only by giving
    it a new version; one that merely drops a field or adds one with a default stays readable
    by both releases and keeps its number. :func:`decode_state` refuses, whole and with one
    message naming the formula and both versions, a state it cannot read, before the
    instance takes any of it: a restart never goes on from half a state.
    """

    formula: ClassVar[str]
    """The formula, as the messages about its state name it."""
    also_reads: ClassVar[frozenset[int | None]] = frozenset()
    """Other versions whose states this layout reads as they are (their fields are its
    fields, or have defaults); ``None`` for a state with no version at all, as the formulas
    saved them before states were versioned."""


S = TypeVar("S", bound=FormulaState)


def encode_state(state: FormulaState) -> Saved:
    """A formula's state as JSON-ready values, ``version`` first."""
    saved: Saved = msgspec.to_builtins(state)
    return saved


def decode_state(saved: object, kind: type[S]) -> S:
    """The state a checkpoint holds, as ``kind``; a ``ValueError`` naming the formula and the
    versions found and expected for one of another version or a body that does not fit."""
    expected = kind.__struct_config__.tag
    if not isinstance(saved, dict):
        raise ValueError(f"{kind.formula} state is not an object but {type(saved).__name__}")
    found = saved.get("version")
    if found != expected:
        if not (found is None or type(found) is int) or found not in kind.also_reads:
            raise ValueError(f"{kind.formula} state of version {found}, not {expected}")
        if found is not None:
            saved = {**saved, "version": expected}
    try:
        return msgspec.convert(saved, kind)
    except msgspec.ValidationError as error:
        raise ValueError(
            f"{kind.formula} state of version {found} does not fit version {expected}: {error}"
        ) from None


class Packed(msgspec.Struct, frozen=True, gc=False):
    """Floats kept to the bit: JSON has no NaN, and text loses nothing here but costs more.
    Its JSON is ``{"shape": [...], "f8": <base64 of the float64s>}``."""

    shape: tuple[int, ...]
    f8: bytes

    def __post_init__(self) -> None:
        """Refuse, as it is decoded, bytes that are not an array of the shape given."""
        if min(self.shape, default=0) < 0 or len(self.f8) != 8 * math.prod(self.shape):
            raise ValueError(f"{len(self.f8)} bytes for an array of shape {self.shape}")

    @classmethod
    def of(cls, values: Any) -> Packed:
        """The floats of a sequence, sequence of rows (all as long) or array."""
        array = np.asarray(values, dtype=np.float64)
        return cls(array.shape, array.tobytes())

    def array(self) -> npt.NDArray[np.float64]:
        """The floats, in their shape (an array of their own, not the state's buffer)."""
        return np.frombuffer(self.f8, dtype=np.float64).reshape(self.shape).copy()

    def values(self) -> Any:
        """The floats as (nested) lists of Python floats."""
        return np.frombuffer(self.f8, dtype=np.float64).reshape(self.shape).tolist()


def pack_floats(values: Any) -> Saved:
    """The JSON of :class:`Packed` of ``values``, as a state holds it (to write one by hand)."""
    packed: Saved = msgspec.to_builtins(Packed.of(values))
    return packed


def encode_checkpoint(checkpoint: dict[str, Any]) -> bytes:
    """A checkpoint as compressed JSON (an input's position values JSON has no type for, such
    as ObjectIds, as their text: an input that keeps its position itself reads its own)."""
    return zlib.compress(orjson.dumps(checkpoint, default=str), 3)


def decode_checkpoint(data: bytes) -> dict[str, Any] | None:
    """A checkpoint :func:`encode_checkpoint` made, or ``None`` for another version."""
    checkpoint: dict[str, Any] = orjson.loads(zlib.decompress(data))
    if checkpoint.get("version") != STATE_VERSION:
        logger.warning(
            "saved state of version %s, not %s: starting without it",
            checkpoint.get("version"),
            STATE_VERSION,
        )
        return None
    return checkpoint


class StateStore(ABC):
    """Where checkpoints are kept."""

    hands_back_positions: ClassVar[bool] = False
    """Whether :meth:`load` gives the inputs' positions back at the start (a file does); a
    store its input reads itself (the MongoDB checkpoint document) gives back the formulas'
    state only, and inputs that keep no position of their own start from the beginning."""

    restored_by: str | None = None
    """The input that reads this store back itself and hands the pipeline the state (the
    MongoDB input, its checkpoint document); ``None`` where the pipeline loads it at start."""

    @abstractmethod
    async def save(self, data: bytes, positions: dict[str, Any]) -> None:
        """Keep a checkpoint (``data``, :func:`encode_checkpoint`'s) and the inputs' positions
        it holds, replacing the previous one in one step."""

    async def load(self) -> bytes | None:
        """The checkpoint saved last, if any, before the pipeline starts (a store that is
        read by its input instead returns None and the input restores it)."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    @abstractmethod
    def describe(self) -> str:
        """Where, for the log."""


class FileStateStore(StateStore):
    """A local file (``--state-file``), replaced atomically on each save."""

    hands_back_positions = True

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        return str(self.path)

    async def load(self) -> bytes | None:
        try:
            return await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            return None

    async def save(self, data: bytes, positions: dict[str, Any]) -> None:
        await asyncio.to_thread(_replace_file, self.path, data)


def _replace_file(path: Path, data: bytes) -> None:
    """Write a file whole or not at all: a crash mid-save leaves the previous one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


class _Open:
    """A barrier on its way: what it carries and who has answered."""

    __slots__ = ("acks", "epoch", "positions", "sent", "states")

    def __init__(self, epoch: int, positions: dict[str, Any]) -> None:
        self.epoch = epoch
        self.positions = positions
        self.states: dict[str, dict[str, Any]] = {}
        self.sent = 0
        self.acks = 0


class Checkpoints:
    """Starts barriers, gathers the formulas' snapshots and the outputs' acknowledgements, and
    saves each checkpoint once it is complete (one save at a time, the newest one waiting).

    One barrier is on its way at a time: an output that cannot write holds the checkpoint back,
    and no more barriers pile up behind it.
    """

    def __init__(self, store: StateStore | None, interval_s: float, formulas: int) -> None:
        self.store = store
        self.interval_s = interval_s
        self.formulas = formulas
        """Formula actors that snapshot each barrier."""
        self.restored: dict[str, dict[str, Any]] = {}
        """Each formula's saved instance states, by key, until the instance is created."""
        self.positions: dict[str, Any] = {}
        """Each input's position saved with the state restored, by input name."""
        self.inputs: list[Any] = []
        """The emitters of inputs that can resume."""
        self.saved = 0
        """Checkpoints saved."""
        self._epoch = 0
        self._open: _Open | None = None
        self._started_at = time.monotonic()
        self._ready: tuple[bytes, dict[str, Any]] | None = None
        self._saver: asyncio.Task[None] | None = None
        self._warned = False
        self.store_blocked = False
        """Whether an output lost a batch: no checkpoint is saved any more."""

    # --- restoring -------------------------------------------------------------------------

    def restore(self, data: bytes | None) -> None:
        """Take the formulas' state from a saved checkpoint, for instances created later."""
        if not data:
            return
        try:
            checkpoint = decode_checkpoint(data)
        except (zlib.error, orjson.JSONDecodeError) as error:
            logger.warning("saved state unreadable (%s): starting without it", error)
            return
        if checkpoint is None:
            return
        self.restored = {
            name: dict(states) for name, states in checkpoint.get("formulas", {}).items()
        }
        positions = checkpoint.get("positions")
        self.positions = dict(positions) if isinstance(positions, dict) else {}
        count = sum(len(states) for states in self.restored.values())
        logger.info("restored the state of %d formula instances", count)

    def restored_state(self, formula: str, key: Any) -> Any:
        """The saved state of one instance (once: it is handed over)."""
        states = self.restored.get(formula)
        if not states:
            return None
        return states.pop(str(key), None)

    # --- barriers ---------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether a barrier should start now: the interval has passed, none is on its way, and
        every input that can resume stands at a batch boundary."""
        return (
            self._open is None
            and time.monotonic() - self._started_at >= self.interval_s
            and all(emitter.at_boundary for emitter in self.inputs)
        )

    def start(self, *, final: bool = False) -> Barrier:
        """A new barrier, carrying every resumable input's position."""
        self._epoch += 1
        positions = {emitter.name: emitter.position for emitter in self.inputs}
        self._open = _Open(self._epoch, positions)
        self._started_at = time.monotonic()
        return Barrier(self._epoch, final=final)

    def sent(self, barrier: Barrier, copies: int = 1) -> None:
        """Copies of a barrier were queued for outputs: as many acknowledgements are due."""
        if self._open is not None and self._open.epoch == barrier.epoch:
            self._open.sent += copies

    def snapshot(self, barrier: Barrier, formula: str, states: dict[str, Any]) -> None:
        """A formula actor's instance states at a barrier, given after it passed the barrier
        on (so every copy owed to outputs is counted by then)."""
        if self._open is not None and self._open.epoch == barrier.epoch:
            self._open.states[formula] = states
            self._complete()

    def ack(self, barrier: Barrier) -> None:
        """An output wrote everything before a copy of the barrier."""
        if self._open is not None and self._open.epoch == barrier.epoch:
            self._open.acks += 1
            self._complete()

    def withhold(self, output: str, why: str) -> None:
        """An output lost a batch (written nowhere but in dead letters): no later checkpoint is
        saved, so a restart reads that batch again."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s could not write a batch (%s): checkpoints stop advancing, so a restart "
                "reads again from the last one",
                output,
                why,
            )
        self.store_blocked = True

    def _complete(self) -> None:
        pending = self._open
        if pending is None or len(pending.states) < self.formulas or pending.acks < pending.sent:
            return
        self._open = None
        if self.store_blocked or self.store is None:
            return
        checkpoint = {
            "version": STATE_VERSION,
            "positions": pending.positions,
            "formulas": pending.states,
        }
        data = encode_checkpoint(checkpoint)
        if len(data) > MAX_STATE_BYTES:
            logger.error(
                "the state to save takes %d bytes, more than %d: not saved (the last "
                "checkpoint stays)",
                len(data),
                MAX_STATE_BYTES,
            )
            return
        self._ready = (data, pending.positions)
        if self._saver is None or self._saver.done():
            self._saver = asyncio.get_running_loop().create_task(self._save_ready())

    async def _save_ready(self) -> None:
        while self._ready is not None:
            data, positions = self._ready
            self._ready = None
            assert self.store is not None
            try:
                await self.store.save(data, positions)
            except Exception as error:  # the next checkpoint tries again
                logger.warning(
                    "could not save a checkpoint to %s: %s", self.store.describe(), error
                )
                continue
            self.saved += 1

    async def close(self) -> None:
        """Wait for the saves under way, then release the store."""
        if self._saver is not None:
            with contextlib.suppress(Exception):
                await self._saver
        if self.store is not None:
            await self.store.close()

    async def abandon(self) -> None:
        """The run failed or was cut short: cancel the save under way (a checkpoint of a run
        that did not drain is no clean stop's) and wait until it has ended, so that no save
        outlives the run. The store is left as it is."""
        saver, self._ready = self._saver, None
        if saver is not None and not saver.done():
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)
