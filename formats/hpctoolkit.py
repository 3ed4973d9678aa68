"""HPCToolkit databases (experiment.xml 4.0, profile.db, cct.db, trace.db) from one run's power.

HPCToolkit's viewer shows measurements per application thread ("profile") and per calling
context; wattflow maps its own notions onto those so that hpcviewer's profile, thread and trace
views work on energy measurements:

- a profile is a target (application thread): one per (node, target) for CPU-side domains
  (cpu, dram, node) and one per (node, target, GPU device) for ``gpu`` scope, because a GPU is
  a separate executor whose power is measured apart from the CPU's;
- a profile's identifier tuple is ``Node`` (the report's sensor: physical value a 32-bit CRC of
  its name, as ``gethostid()`` is 32 bits; logical value its index), then ``Rank`` for a process
  target (physical value the pid) or ``Thread`` for a container target (physical value a CRC of
  the target name), logical value a dense index; GPU profiles add ``GPU Device`` (the report's
  ``device``) after it, so two processes on one GPU stay two profiles. The summary profile
  (index 0, as the spec requires) has the one-element tuple ``(0 "Summary", 0, 0)``, the kind
  HPCToolkit itself gives it;
- the calling context tree is root → node → container → process → phase…: ``pid:N`` is process
  N in container ``<no container>``; a cgroup path (``/system.slice/docker-abc.scope``) is the
  container named by its last component, with process ``<all processes>``; any other name is
  the container itself. Phases come from the run's events as in
  :func:`~wattflow.formats.runs.summarise` and nest as they are open (``train`` → ``epoch``); a
  report belongs to the chain of phases open at its timestamp, its energy to the innermost;
- metrics are energy (J) and mean power (W) per domain, each inclusive and exclusive (partner
  columns, as hpcprof writes them). Energy is :func:`summarise`'s integral (a report's power
  holds from the previous report of its series); mean power is a context's energy over the
  time its phase chain was open (the whole run for root, node, container and a process's
  inclusive value). Values are summed over profiles into the summary profile;
- trace lines hold the time series' shape: one line per profile, one (timestamp ns, context)
  sample per PowerReport, naming the deepest context (process or innermost phase) the target
  was in. A context-type trace sample has no value field, so the power itself lives in the
  metrics; consecutive identical samples (several domains or sockets at one time) are kept
  once, and a sample earlier than its line's last one is dropped so lines stay sorted.

Memory grows with contexts and profiles, not with reports: energy is folded as reports stream
past, and trace samples go to a small buffer per profile that is spilled to a temporary file
per profile (in the database directory) whenever all buffers together pass a limit; trace.db
is assembled from those files at the end.

Binary files follow the spec's layout: big-endian integers and doubles, version bytes 4 and 0,
a header padded to 128 bytes, sections placed one after another, footers as the on-disk bytes
``tfBDFORP``, ``rtfBDTCC`` and ``tfBDCART``. Where the spec contradicts itself (cct.db's block
size names ``num_nzctxs`` and its look-up multiplies by 10 where pairs are 12 bytes), the
field sizes win: a block is ``num_vals * 12 + (num_nzmids + 1) * 10`` bytes.
"""

from __future__ import annotations

import re
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import IntEnum
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO, Literal
from xml.etree import ElementTree as ET

from wattflow.formats.runs import (
    DOMAINS,
    PhaseClock,
    PowerPage,
    Run,
    Series,
    micro_phases,
    phases_of,
)

VERSION = (4, 0)
HEADER_SIZE = 128
"""Every binary file's header region; the first section starts here."""

PROFILE_MAGIC = b"HPCPROF-profdb__"
CCT_MAGIC = b"HPCPROF-cctdb___"
TRACE_MAGIC = b"HPCPROF-tracedb_"
PROFILE_FOOTER = b"tfBDFORP"
CCT_FOOTER = b"rtfBDTCC"
TRACE_FOOTER = b"tfBDCART"
PROFILE_END_MARKER = 0x656E6421
CCT_END_MARKER = 0x6564
TRACE_TYPE_CONTEXT = 0

_PROFILE_HEADER = struct.Struct(">16sBBIHQQQQ")
_PROFILE_INFO = struct.Struct(">QQQQQIQ")
_TUPLE_LENGTH = struct.Struct(">H")
_TUPLE_ELEMENT = struct.Struct(">HQQ")
_PROFILE_VALUE = struct.Struct(">dH")
_PROFILE_CONTEXT = struct.Struct(">IQ")
_SECTIONED_HEADER = struct.Struct(">16sBBIHQQ")
_CONTEXT_INFO = struct.Struct(">IQHQ")
_CCT_VALUE = struct.Struct(">dI")
_CCT_METRIC = struct.Struct(">HQ")
_TRACE_HEADER = struct.Struct(">IHQQ")
_SAMPLE = struct.Struct(">QI")

NO_CONTAINER = "<no container>"
ALL_PROCESSES = "<all processes>"
SPOOL_BYTES = 4 << 20
"""Trace samples held in memory, all profiles together, before they are spilled to disk."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_PID = re.compile(r"pid:(\d+)")


class IdKind(IntEnum):
    """Identifier tuple element kinds (the spec's list, plus HPCToolkit's summary kind)."""

    SUMMARY = 0
    NODE = 1
    RANK = 2
    THREAD = 3
    GPU_DEVICE = 4
    GPU_CONTEXT = 5
    GPU_STREAM = 6
    CORE = 7


ID_KIND_NAMES = {
    IdKind.SUMMARY: "Summary",
    IdKind.NODE: "Node",
    IdKind.RANK: "Rank",
    IdKind.THREAD: "Thread",
    IdKind.GPU_DEVICE: "GPU Device",
    IdKind.GPU_CONTEXT: "GPU Context",
    IdKind.GPU_STREAM: "GPU Stream",
    IdKind.CORE: "Core",
}


@dataclass(frozen=True)
class IdElement:
    """One element of a profile's hierarchical identifier tuple."""

    kind: IdKind
    physical: int
    logical: int


Quantity = Literal["energy", "power"]
QUANTITIES: tuple[Quantity, ...] = ("energy", "power")
UNITS: dict[Quantity, str] = {"energy": "J", "power": "W"}


@dataclass(frozen=True)
class Metric:
    """One column of hpcviewer: a quantity of one domain, inclusive or exclusive."""

    id: int
    domain: str
    quantity: Quantity
    inclusive: bool

    @property
    def partner(self) -> int:
        """The same quantity's other scope: hpcviewer pairs (I) and (E) columns by it."""
        return self.id ^ 1

    @property
    def name(self) -> str:
        """Column title, suffixed (I) or (E) like hpcprof's."""
        scope = "I" if self.inclusive else "E"
        return f"{self.domain} {self.quantity} ({UNITS[self.quantity]}) ({scope})"


METRICS = tuple(
    Metric(4 * d + 2 * q + (0 if inclusive else 1), domain, quantity, inclusive)
    for d, domain in enumerate(DOMAINS)
    for q, quantity in enumerate(QUANTITIES)
    for inclusive in (True, False)
)
"""Every metric, its id its index: every database has the same columns, so runs compare."""


def metric_id(domain: str, quantity: Quantity, inclusive: bool) -> int:
    """The id :data:`METRICS` gives a (domain, quantity, scope)."""
    return 4 * DOMAINS.index(domain) + (2 if quantity == "power" else 0) + (0 if inclusive else 1)


ContextKind = Literal["root", "node", "container", "process", "phase"]


@dataclass
class Context:
    """A calling context: a node of the tree node → container → process → phase…."""

    id: int
    kind: ContextKind
    label: str
    parent: Context | None
    children: dict[str, Context] = field(default_factory=dict)
    chain: tuple[str, ...] = ()
    """Phases open in this context (empty above phase level)."""

    @property
    def name(self) -> str:
        """What hpcviewer shows: the kind first, since containers and phases share names."""
        return "<root>" if self.kind == "root" else f"{self.kind}: {self.label}"

    def ancestry(self) -> Iterable[Context]:
        """This context, then its parents up to the root."""
        context: Context | None = self
        while context is not None:
            yield context
            context = context.parent


def place_of(target: str) -> tuple[str, str]:
    """(container, process) a target names: the rule the module docstring documents."""
    match = _PID.fullmatch(target)
    if match:
        return NO_CONTAINER, match.group(1)
    if target.startswith("/"):
        parts = [part for part in target.split("/") if part]
        return (parts[-1] if parts else "/"), ALL_PROCESSES
    return target, ALL_PROCESSES


def nanoseconds(moment: datetime) -> int:
    """Nanoseconds since the epoch, exactly (no float rounding of microseconds)."""
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def chain_seconds(run: Run) -> dict[tuple[str, ...], float]:
    """Seconds of the run's window spent with exactly each chain of phases open."""
    phases = phases_of(run.events)
    bounds = sorted(
        {run.start, run.end}
        | {min(max(moment, run.start), run.end) for s, e, _ in phases for moment in (s, e)}
    )
    clock = PhaseClock(phases)
    seconds: dict[tuple[str, ...], float] = {}
    for low, high in pairwise(bounds):
        chain = clock.chain(low + (high - low) / 2)
        seconds[chain] = seconds.get(chain, 0.0) + (high - low).total_seconds()
    return seconds


@dataclass
class Profile:
    """One application thread's identity, energy per context and trace line state."""

    index: int
    identifier: tuple[IdElement, ...]
    energy_j: dict[int, dict[str, float]] = field(default_factory=dict)
    """Context id → domain → exclusive energy in J."""
    last_sample: tuple[int, int] | None = None


class _TraceSpool:
    """Trace samples per profile: buffered, spilled to a file per profile past a limit."""

    def __init__(self, directory: Path, limit_bytes: int) -> None:
        self._directory = directory
        self._limit = limit_bytes
        self._buffers: dict[int, bytearray] = {}
        self._buffered = 0
        self._spilled: set[int] = set()
        self.counts: dict[int, int] = {}

    def add(self, profile: int, timestamp_ns: int, context: int) -> None:
        buffer = self._buffers.setdefault(profile, bytearray())
        buffer += _SAMPLE.pack(timestamp_ns, context)
        self.counts[profile] = self.counts.get(profile, 0) + 1
        self._buffered += _SAMPLE.size
        if self._buffered > self._limit:
            self._spill()

    def _path(self, profile: int) -> Path:
        return self._directory / f"{profile}.samples"

    def _spill(self) -> None:
        for profile, buffer in self._buffers.items():
            if buffer:
                with self._path(profile).open("ab") as handle:
                    handle.write(buffer)
                self._spilled.add(profile)
                buffer.clear()
        self._buffered = 0

    def copy_into(self, profile: int, out: BinaryIO) -> None:
        """Write the profile's samples, in the order they were added."""
        if profile in self._spilled:
            with self._path(profile).open("rb") as handle:
                shutil.copyfileobj(handle, out)
        out.write(self._buffers.get(profile, b""))


@dataclass(slots=True, eq=False)
class _SeriesState:
    """One series of the run as a database sees it."""

    sensor: str
    target: str
    domain: str
    profile: Profile
    previous: list[int | None]
    """Shared by every series of one (target, domain, socket, device)."""
    chain: tuple[str, ...] | None = None
    """The phase chain :attr:`context` was found for."""
    context: int = 0


_UNSEEN: Any = object()


class RunDatabase:
    """Folds one run's PowerReports into an HPCToolkit database, in one pass."""

    def __init__(self, run: Run, spool: Path, spool_bytes: int = SPOOL_BYTES) -> None:
        self.run = run
        self.root = Context(0, "root", "", None)
        self.contexts: list[Context] = [self.root]
        self.profiles: list[Profile] = [Profile(0, (IdElement(IdKind.SUMMARY, 0, 0),))]
        self._by_key: dict[tuple[str, str, str | None], Profile] = {}
        self._contexts_by_key: dict[tuple[str, str, tuple[str, ...]], Context] = {}
        self._logical: dict[tuple[IdKind, str], int] = {}
        self._kinds_seen: dict[IdKind, int] = {}
        self._clock = PhaseClock(micro_phases(run))
        self._moment = -1
        self._chain: tuple[str, ...] = ()
        self._by_series: dict[int, _SeriesState | None] = {}
        self._previous: dict[tuple[str, str, str, str], list[int | None]] = {}
        """Per (target, domain, socket, device), whatever the sensor: its latest report's
        time in Unix µs."""
        self._traces = _TraceSpool(spool, spool_bytes)
        self.min_ns: int | None = None
        self.max_ns: int | None = None

    def add(self, page: PowerPage) -> None:
        """Take some of the run's power rows, the next ones in time order."""
        for micros, number, power in page.rows:
            state = self._by_series.get(number, _UNSEEN)
            if state is _UNSEEN:
                state = self._by_series[number] = self._series(page.series[number])
            if state is None:
                continue
            if micros != self._moment:
                self._reach(micros)
            if state.chain is not self._chain:
                state.chain = self._chain
                state.context = self._context(state.sensor, state.target, self._chain).id
            last_sample = state.profile.last_sample
            nanos = micros * 1000
            # Most rows repeat their profile's last sample (its other domains and sockets).
            if (
                last_sample is None
                or nanos > last_sample[0]
                or (nanos == last_sample[0] and state.context != last_sample[1])
            ):
                self._sample(state.profile, nanos, state.context)
            previous = state.previous
            last = previous[0]
            previous[0] = micros
            if last is None or micros <= last:
                continue
            energy = state.profile.energy_j.setdefault(state.context, {})
            seconds = (micros - last) / 1_000_000
            energy[state.domain] = energy.get(state.domain, 0.0) + power * seconds

    def _reach(self, micros: int) -> None:
        """A new moment: the phases open then. The chain stays the same object while the
        phases do not change, so that a series tells by identity that its context holds."""
        self._moment = micros
        chain = self._clock.chain(micros)
        if chain != self._chain:
            self._chain = chain

    def _series(self, series: Series) -> _SeriesState | None:
        """What one series of the run adds to: None for a scope that is not a domain, and
        for the ``rapl`` and ``global`` targets (whole-socket figures)."""
        domain = series.scope
        if domain not in DOMAINS or series.target in ("rapl", "global"):
            return None
        device = series.device
        profile = self._profile(series.sensor, series.target, device if domain == "gpu" else None)
        previous = self._previous.setdefault((series.target, domain, series.socket, device), [None])
        return _SeriesState(series.sensor, series.target, domain, profile, previous)

    def _sample(self, profile: Profile, timestamp_ns: int, context: int) -> None:
        last = profile.last_sample
        if last is not None and (last == (timestamp_ns, context) or timestamp_ns < last[0]):
            return
        profile.last_sample = (timestamp_ns, context)
        self._traces.add(profile.index, timestamp_ns, context)
        self.min_ns = timestamp_ns if self.min_ns is None else min(self.min_ns, timestamp_ns)
        self.max_ns = timestamp_ns if self.max_ns is None else max(self.max_ns, timestamp_ns)

    def _logical_index(self, kind: IdKind, key: str) -> int:
        found = self._logical.get((kind, key))
        if found is None:
            found = self._logical[(kind, key)] = self._kinds_seen.get(kind, 0)
            self._kinds_seen[kind] = found + 1
        return found

    def _profile(self, sensor: str, target: str, device: str | None) -> Profile:
        key = (sensor, target, device)
        found = self._by_key.get(key)
        if found is not None:
            return found
        node = self._logical_index(IdKind.NODE, sensor)
        elements = [IdElement(IdKind.NODE, _crc(sensor), node)]
        process = place_of(target)[1]
        if process.isdigit():
            logical = self._logical_index(IdKind.RANK, f"{sensor}\0{target}")
            pid = int(process)
            elements.append(IdElement(IdKind.RANK, pid if pid < 1 << 64 else _crc(target), logical))
        else:
            logical = self._logical_index(IdKind.THREAD, f"{sensor}\0{target}")
            elements.append(IdElement(IdKind.THREAD, _crc(target), logical))
        if device is not None:
            physical = int(device) if device.isdigit() else _crc(device)
            logical = self._logical_index(IdKind.GPU_DEVICE, f"{sensor}\0{device}")
            elements.append(IdElement(IdKind.GPU_DEVICE, physical, logical))
        profile = Profile(len(self.profiles), tuple(elements))
        self.profiles.append(profile)
        self._by_key[key] = profile
        return profile

    def _child(self, parent: Context, kind: ContextKind, label: str) -> Context:
        found = parent.children.get(label)
        if found is None:
            chain = (*parent.chain, label) if kind == "phase" else ()
            found = Context(len(self.contexts), kind, label, parent, chain=chain)
            parent.children[label] = found
            self.contexts.append(found)
        return found

    def _context(self, sensor: str, target: str, chain: tuple[str, ...]) -> Context:
        found = self._contexts_by_key.get((sensor, target, chain))
        if found is None:
            found = self._contexts_by_key[(sensor, target, chain)] = self._walk(
                sensor, target, chain
            )
        return found

    def _walk(self, sensor: str, target: str, chain: tuple[str, ...]) -> Context:
        container, process = place_of(target)
        context = self._child(self._child(self.root, "node", sensor), "container", container)
        context = self._child(context, "process", process)
        for phase in chain:
            context = self._child(context, "phase", phase)
        return context

    def values(self) -> list[dict[int, dict[int, float]]]:
        """Per profile (summary first): context id → metric id → non-zero value."""
        spans = self._spans()
        tables: list[dict[int, dict[int, float]]] = [{} for _ in self.profiles]
        summary = tables[0]
        for profile in self.profiles[1:]:
            table = tables[profile.index]
            self._add_energy(table, profile)
            _add_power(table, spans)
            for context_id, by_metric in table.items():
                for metric, value in by_metric.items():
                    _add(summary, context_id, metric, value)
        return _non_zero(tables)

    def _spans(self) -> list[tuple[float, float]]:
        """Per context id, the (inclusive, exclusive) seconds its mean power is taken over:
        the time its phase chain was open for a process or a phase, the whole run (and no
        exclusive time) for the root, a node or a container."""
        run_s = self.run.duration_s
        exclusive_s = chain_seconds(self.run)
        inclusive_s: dict[tuple[str, ...], float] = {}
        for chain, seconds in exclusive_s.items():
            for length in range(len(chain) + 1):
                inclusive_s[chain[:length]] = inclusive_s.get(chain[:length], 0.0) + seconds
        return [
            (inclusive_s.get(context.chain, 0.0), exclusive_s.get(context.chain, 0.0))
            if context.kind in ("process", "phase")
            else (run_s, 0.0)
            for context in self.contexts
        ]

    def _add_energy(self, table: dict[int, dict[int, float]], profile: Profile) -> None:
        """A profile's energy into its table: exclusive in the context it was spent in,
        inclusive there and in every context above it."""
        for context_id, by_domain in profile.energy_j.items():
            context = self.contexts[context_id]
            for domain, joules in by_domain.items():
                _add(table, context_id, metric_id(domain, "energy", False), joules)
                for ancestor in context.ancestry():
                    _add(table, ancestor.id, metric_id(domain, "energy", True), joules)

    def write(self, directory: Path) -> None:
        """Write experiment.xml, profile.db, cct.db and trace.db into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        values = self.values()
        tuples = [profile.identifier for profile in self.profiles]
        write_profile_db(directory / "profile.db", tuples, values)
        write_cct_db(directory / "cct.db", len(self.contexts), values[1:])
        counts = [self._traces.counts.get(p.index, 0) for p in self.profiles[1:]]
        write_trace_db(
            directory / "trace.db",
            [(p.index, count) for p, count in zip(self.profiles[1:], counts, strict=True)],
            self._traces.copy_into,
        )
        window = (
            self.min_ns if self.min_ns is not None else nanoseconds(self.run.start),
            self.max_ns if self.max_ns is not None else nanoseconds(self.run.end),
        )
        write_experiment_xml(directory / "experiment.xml", self.run, self.root, window)


def _add(table: dict[int, dict[int, float]], context: int, metric: int, value: float) -> None:
    by_metric = table.setdefault(context, {})
    by_metric[metric] = by_metric.get(metric, 0.0) + value


def _add_power(table: dict[int, dict[int, float]], spans: list[tuple[float, float]]) -> None:
    """Mean power beside each energy in the table: the energy over its context's span
    (:meth:`RunDatabase._spans`), inclusive and exclusive; none where the span is empty."""
    for context_id, by_metric in list(table.items()):
        inclusive, exclusive = spans[context_id]
        for domain in DOMAINS:
            for scope, seconds in ((True, inclusive), (False, exclusive)):
                if seconds > 0:
                    joules = by_metric.get(metric_id(domain, "energy", scope), 0.0)
                    _add(table, context_id, metric_id(domain, "power", scope), joules / seconds)


def _non_zero(tables: list[dict[int, dict[int, float]]]) -> list[dict[int, dict[int, float]]]:
    """The tables as sparse blocks list them: only non-zero values, only contexts that keep
    one, contexts and metrics in id order."""
    kept = [
        {c: {m: v for m, v in sorted(ms.items()) if v != 0.0} for c, ms in sorted(t.items())}
        for t in tables
    ]
    return [{c: ms for c, ms in table.items() if ms} for table in kept]


def write_run(
    run: Run,
    power: Iterable[PowerPage],
    directory: Path,
    advance: Callable[[int], None] | None = None,
    spool_bytes: int = SPOOL_BYTES,
) -> RunDatabase:
    """Stream a run's power rows (:meth:`~wattflow.formats.runs.RunData.power`) into an
    HPCToolkit database in ``directory``; ``advance`` gets the number of rows of each page."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wattflow-trace-", dir=directory) as spool:
        database = RunDatabase(run, Path(spool), spool_bytes)
        for page in power:
            if advance is not None:
                advance(len(page.rows))
            database.add(page)
        database.write(directory)
    return database


def _header(magic: bytes, count: int, sections: Sequence[tuple[int, int]]) -> bytes:
    """A header: magic, version, count, sections' (size, offset), padded to 128 bytes."""
    head = struct.pack(">16sBBIH", magic, *VERSION, count, len(sections))
    head += b"".join(struct.pack(">QQ", size, offset) for size, offset in sections)
    return head.ljust(HEADER_SIZE, b"\0")


def _encode_tuple(elements: Sequence[IdElement]) -> bytes:
    return _TUPLE_LENGTH.pack(len(elements)) + b"".join(
        _TUPLE_ELEMENT.pack(e.kind, e.physical, e.logical) for e in elements
    )


def write_profile_db(
    path: Path,
    tuples: Sequence[Sequence[IdElement]],
    values: Sequence[dict[int, dict[int, float]]],
) -> None:
    """profile.db: per profile, (value, metric) pairs grouped by ascending context id.

    ``values[i]`` is profile ``i``'s context → metric → value, every value non-zero; profile 0
    is the summary.
    """
    encoded = [_encode_tuple(elements) for elements in tuples]
    info_ptr = HEADER_SIZE
    info_size = _PROFILE_INFO.size * len(tuples)
    tuple_ptr = info_ptr + info_size
    tuple_size = sum(len(e) for e in encoded)
    infos: list[bytes] = []
    tuple_at, block_at = tuple_ptr, tuple_ptr + tuple_size
    for encoded_tuple, table in zip(encoded, values, strict=True):
        num_vals = sum(len(by_metric) for by_metric in table.values())
        infos.append(_PROFILE_INFO.pack(tuple_at, 0, 0, 0, num_vals, len(table), block_at))
        tuple_at += len(encoded_tuple)
        block_at += num_vals * _PROFILE_VALUE.size + (len(table) + 1) * _PROFILE_CONTEXT.size
    with path.open("wb") as out:
        out.write(
            _header(PROFILE_MAGIC, len(tuples), ((info_size, info_ptr), (tuple_size, tuple_ptr)))
        )
        out.writelines(infos)
        out.writelines(encoded)
        for table in values:
            pairs = bytearray()
            index = bytearray()
            for context, by_metric in table.items():
                index += _PROFILE_CONTEXT.pack(context, len(pairs) // _PROFILE_VALUE.size)
                for metric, value in by_metric.items():
                    pairs += _PROFILE_VALUE.pack(value, metric)
            index += _PROFILE_CONTEXT.pack(PROFILE_END_MARKER, len(pairs) // _PROFILE_VALUE.size)
            out.write(pairs)
            out.write(index)
        out.write(PROFILE_FOOTER)


def write_cct_db(
    path: Path, num_contexts: int, values: Sequence[dict[int, dict[int, float]]]
) -> None:
    """cct.db: per context, (value, profile) pairs grouped by ascending metric id.

    ``values[i]`` belongs to profile ``i + 1``: the summary profile's values are left out,
    since a reader summing a context's profiles would count them twice.
    """
    by_context: list[dict[int, list[tuple[int, float]]]] = [{} for _ in range(num_contexts)]
    for profile, table in enumerate(values, start=1):
        for context, values_of in table.items():
            for metric, value in values_of.items():
                by_context[context].setdefault(metric, []).append((profile, value))
    info_ptr = HEADER_SIZE
    info_size = _CONTEXT_INFO.size * num_contexts
    infos: list[bytes] = []
    block_at = info_ptr + info_size
    for context, per_metric in enumerate(by_context):
        num_vals = sum(len(pairs) for pairs in per_metric.values())
        infos.append(_CONTEXT_INFO.pack(context, num_vals, len(per_metric), block_at))
        block_at += num_vals * _CCT_VALUE.size + (len(per_metric) + 1) * _CCT_METRIC.size
    with path.open("wb") as out:
        out.write(_header(CCT_MAGIC, num_contexts, ((info_size, info_ptr),)))
        out.writelines(infos)
        for per_metric in by_context:
            pairs = bytearray()
            index = bytearray()
            for metric in sorted(per_metric):
                index += _CCT_METRIC.pack(metric, len(pairs) // _CCT_VALUE.size)
                for profile, value in sorted(per_metric[metric]):
                    pairs += _CCT_VALUE.pack(value, profile)
            index += _CCT_METRIC.pack(CCT_END_MARKER, len(pairs) // _CCT_VALUE.size)
            out.write(pairs)
            out.write(index)
        out.write(CCT_FOOTER)


def write_trace_db(
    path: Path,
    lines: Sequence[tuple[int, int]],
    copy_samples: Callable[[int, BinaryIO], None],
) -> None:
    """trace.db: one context-type line per (profile index, sample count).

    ``copy_samples(profile, out)`` writes that profile's encoded samples, so lines are copied
    from wherever they were spooled instead of being held in memory.
    """
    header_ptr = HEADER_SIZE
    header_size = _TRACE_HEADER.size * len(lines)
    line_at = header_ptr + header_size
    headers: list[bytes] = []
    for profile, count in lines:
        end = line_at + count * _SAMPLE.size
        headers.append(_TRACE_HEADER.pack(profile, TRACE_TYPE_CONTEXT, line_at, end))
        line_at = end
    with path.open("wb") as out:
        out.write(_header(TRACE_MAGIC, len(lines), ((header_size, header_ptr),)))
        out.writelines(headers)
        for profile, count in lines:
            start = out.tell()
            copy_samples(profile, out)
            if out.tell() - start != count * _SAMPLE.size:
                raise RuntimeError(f"trace line of profile {profile} changed while written")
        out.write(TRACE_FOOTER)


def _metric_element(metric: Metric) -> ET.Element:
    element = ET.Element(
        "Metric",
        {
            "i": str(metric.id),
            "o": str(metric.id),
            "n": metric.name,
            "md": (
                f"{metric.domain} {metric.quantity} in {UNITS[metric.quantity]}, "
                + ("this context and below" if metric.inclusive else "this context alone")
            ),
            "v": "raw",
            "t": "inclusive" if metric.inclusive else "exclusive",
            "partner": str(metric.partner),
            "show": "1",
            "show-percent": "1" if metric.quantity == "energy" else "0",
            "fmt": "%.6g",
        },
    )
    # Over profiles (the summary) both sum: energies add, and powers of targets add up too.
    ET.SubElement(
        element, "MetricFormula", {"t": "combine", "frm": f"sum(${metric.id}, ${metric.id})"}
    )
    info = ET.SubElement(element, "Info")
    ET.SubElement(info, "NV", {"n": "units", "v": UNITS[metric.quantity]})
    return element


def write_experiment_xml(
    path: Path, run: Run, root: Context, trace_window_ns: tuple[int, int]
) -> None:
    """experiment.xml 4.0: names of identifier kinds, metrics, the trace window and the tree."""
    title = f"{run.experiment}/{run.benchmark}/{run.settings}/{run.repetition}"
    document = ET.Element("HPCToolkitExperiment", {"version": f"{VERSION[0]}.{VERSION[1]}"})
    header = ET.SubElement(document, "Header", {"n": title})
    info = ET.SubElement(header, "Info")
    facts = {
        "run": run.id,
        "experiment": run.experiment,
        "benchmark": run.benchmark,
        "settings": run.settings,
        "repetition": str(run.repetition),
        "start": run.start.isoformat(),
        "end": run.end.isoformat(),
        **{f"parameter {name}": repr(value) for name, value in sorted(run.parameters.items())},
    }
    for name, value in facts.items():
        ET.SubElement(info, "NV", {"n": name, "t": "string", "v": value})
    section = ET.SubElement(document, "SecCallPathProfile", {"i": "0", "n": title})
    sec_header = ET.SubElement(section, "SecHeader")
    names = ET.SubElement(sec_header, "IdentifierNameTable")
    for kind, name in ID_KIND_NAMES.items():
        ET.SubElement(names, "Identifier", {"i": str(int(kind)), "n": name})
    metrics = ET.SubElement(sec_header, "MetricTable")
    metrics.extend(_metric_element(metric) for metric in METRICS)
    metric_dbs = ET.SubElement(sec_header, "MetricDBTable")
    for metric in METRICS:
        ET.SubElement(metric_dbs, "MetricDB", {"i": str(metric.id), "n": metric.name})
    traces = ET.SubElement(sec_header, "TraceDBTable")
    ET.SubElement(
        traces,
        "TraceDB",
        {
            "i": "0",
            "u": "1000000000",
            "db-min-time": str(trace_window_ns[0]),
            "db-max-time": str(trace_window_ns[1]),
        },
    )
    modules = ET.SubElement(sec_header, "LoadModuleTable")
    ET.SubElement(modules, "LoadModule", {"i": "0", "n": "wattflow"})
    files = ET.SubElement(sec_header, "FileTable")
    ET.SubElement(files, "File", {"i": "0", "n": "<unknown file>"})
    procedures = ET.SubElement(sec_header, "ProcedureTable")
    procedure_ids: dict[str, int] = {}
    data = ET.SubElement(section, "SecCallPathProfileData")
    stack: list[tuple[Context, ET.Element]] = [(root, data)]
    while stack:
        context, element = stack.pop()
        for child in context.children.values():
            procedure = procedure_ids.get(child.name)
            if procedure is None:
                procedure = procedure_ids[child.name] = len(procedure_ids)
                ET.SubElement(
                    procedures, "Procedure", {"i": str(procedure), "n": child.name, "v": "0"}
                )
            frame = ET.SubElement(
                element,
                "PF",
                {
                    "i": str(child.id),
                    "it": str(child.id),
                    "n": str(procedure),
                    "s": str(procedure),
                    "l": "0",
                    "f": "0",
                    "lm": "0",
                },
            )
            stack.append((child, frame))
    ET.SubElement(sec_header, "Info")
    ET.indent(document)
    with path.open("w", encoding="utf-8") as out:
        out.write('<?xml version="1.0"?>\n')
        out.write(ET.tostring(document, encoding="unicode"))
        out.write("\n")
