"""What SmartWatts reads from a frame of hwpc-sensor reports, as arrays over all its ticks.

The formula works tick by tick on (socket, scope) models, but everything around the models is
the same arithmetic for every tick: each target's counters summed over its cpus (multiplexing
undone), the sum over targets, RAPL energy, the package frequency. :func:`frame_ticks` computes
those for every tick of a frame at once, exactly as the report-by-report way computes them
(the same operations in the same order, so the same bits), or returns ``None`` for anything
that way would treat otherwise: a dead letter to write, a tick without its global report,
a duplicate. The formula then takes the frame's reports one by one instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from wattflow.actors.formulas.rapl import GLOBAL_TARGETS
from wattflow.formats.frames import EventsTable, FloatArray, HWPCFrame, IntArray, run_starts

WRAPPED_COUNTER = 2**48
"""The smallest delta taken as a counter that wrapped around (see the SmartWatts formula)."""

TIME_EVENTS = ("time_enabled", "time_running")

_GROUPS = {"rapl", "msr", "core"}


@dataclass(slots=True, eq=False)
class FrameTicks:
    """A frame's ticks as SmartWatts needs them; sockets in the order the RAPL rows give them.

    Target blocks: ``blocks[t, s]`` is the slice of ``counts`` rows holding tick ``t``'s targets
    on socket ``s``, in the order the targets' reports come in the tick.
    """

    millis: IntArray  # (ticks,)
    sockets: list[str]
    events: tuple[str, ...]  # the features, sorted
    energy: dict[str, IntArray]  # RAPL event → (ticks, sockets)
    frequency: IntArray  # (ticks, sockets): the package frequency in MHz
    targets: IntArray  # (ticks,): target reports in each tick
    counts: FloatArray  # (rows, events): one target's counters on one socket, summed over cpus
    target_codes: IntArray  # (rows,): the target of each row, a code into the frame's names
    block_start: IntArray  # (ticks, sockets)
    block_stop: IntArray  # (ticks, sockets)
    global_counts: FloatArray  # (ticks, sockets, events): the sum of each block's rows


class FrameTables(NamedTuple):
    """A frame's three groups, when it has exactly those, and the code of its global target."""

    rapl: EventsTable
    msr: EventsTable
    core: EventsTable
    global_code: int


class TargetRows(NamedTuple):
    """Every target's counters per socket, summed over its cpus, in the order SmartWatts reads
    them: by tick, socket (only sockets with RAPL rows), then the target's place in its tick."""

    events: tuple[str, ...]
    """The features' names, sorted."""
    counts: FloatArray
    """(rows, events): one target's counters on one socket, summed over its cpus."""
    target_codes: IntArray
    """Each row's target, a code into the frame's names."""
    tick_of_row: IntArray
    socket_of_row: IntArray
    """Each row's socket, as its place in the RAPL order."""
    targets: IntArray
    """(ticks,): the target reports of each tick."""


class TargetBlocks(NamedTuple):
    """The rows of each tick and socket, and their sum (see :class:`FrameTicks`)."""

    start: IntArray
    stop: IntArray
    global_counts: FloatArray


class ReadOrder(NamedTuple):
    """Where each segment (a target's rows of one socket and tick) goes, and the targets."""

    segments: IntArray
    """The segments on sockets with RAPL rows, in the order SmartWatts reads them."""
    targets: IntArray
    """(ticks,): the target reports of each tick, each counted once whatever its sockets."""


def frame_ticks(
    frame: HWPCFrame, base_frequency: int, *, scale_multiplexed: bool
) -> FrameTicks | None:
    """The frame's ticks as arrays, or ``None`` when one of its reports needs the slow way."""
    tables = _tables(frame)
    if tables is None:
        return None
    millis, tick_of_rapl = np.unique(tables.rapl.millis, return_inverse=True)
    tick_of_rapl = tick_of_rapl.reshape(-1)
    ticks = len(millis)
    sockets = _socket_order(tables.rapl.sockets, tick_of_rapl, ticks)
    if sockets is None:
        return None
    position = {socket: at for at, socket in enumerate(sockets)}
    energy = _energy(tables.rapl, tick_of_rapl, position, ticks)

    frequency = _frequency(tables.msr, millis, position, ticks, base_frequency)
    if frequency is None:
        return None

    core = tables.core
    is_target = core.targets != tables.global_code
    if not bool(np.isin(core.millis[~is_target], millis).all()):
        return None  # a global report without RAPL rows
    rows = _features(core.where(is_target), millis, position, scale_multiplexed)
    if rows is None:
        return None
    blocks = _blocks(rows, ticks, len(sockets))
    return FrameTicks(
        millis=millis,
        sockets=[str(socket) for socket in sockets],
        events=rows.events,
        energy=energy,
        frequency=frequency,
        targets=rows.targets,
        counts=rows.counts,
        target_codes=rows.target_codes,
        block_start=blocks.start,
        block_stop=blocks.stop,
        global_counts=blocks.global_counts,
    )


def _tables(frame: HWPCFrame) -> FrameTables | None:
    """The frame's rapl, msr and core tables, or ``None`` for anything the slow way treats
    otherwise: other groups, no RAPL or msr rows, target rows in them, counters that cannot be
    real (dead letters for the slow way to write, with their reasons)."""
    tables = {table.group: table for table in frame.tables}
    if set(tables) != _GROUPS or len(tables) != len(frame.tables):
        return None
    rapl, msr, core = tables["rapl"], tables["msr"], tables["core"]
    if not len(rapl) or not len(msr):
        return None
    global_code = _global_code(frame, rapl)
    if global_code is None:
        return None
    for table in (rapl, msr):
        if not bool((table.targets == global_code).all()):
            return None
    if not _counters_real(frame):
        return None
    return FrameTables(rapl, msr, core, global_code)


def _counters_real(frame: HWPCFrame) -> bool:
    """Whether no counter of the frame is negative or wrapped around."""
    return not any(
        len(table) and (int(table.values.min()) < 0 or int(table.values.max()) >= WRAPPED_COUNTER)
        for table in frame.tables
    )


def _blocks(rows: TargetRows, ticks: int, sockets: int) -> TargetBlocks:
    """Each tick and socket's block of target rows, and the sum of each block's rows."""
    blocks = rows.tick_of_row * sockets + rows.socket_of_row
    edges = np.searchsorted(blocks, np.arange(ticks * sockets + 1))
    block_start = edges[:-1].reshape(ticks, sockets)
    block_stop = edges[1:].reshape(ticks, sockets)
    global_counts = np.zeros((ticks, sockets, len(rows.events)))
    filled = block_stop > block_start
    counts = rows.counts
    if len(counts):
        integral = bool((counts == np.floor(counts)).all()) and float(counts.max()) < 2**52
        sums = ordered_sums(counts, block_start[filled].reshape(-1), exact=integral)
        global_counts[filled] = sums
    return TargetBlocks(block_start, block_stop, global_counts)


def _global_code(frame: HWPCFrame, rapl: EventsTable) -> int | None:
    """The one global target name the frame uses ('all', or 'system' in older recordings)."""
    codes = {code for code, name in enumerate(frame.names) if name in GLOBAL_TARGETS}
    used = set(np.unique(rapl.targets).tolist())
    if len(used) != 1:
        return None
    code = used.pop()
    if code not in codes:
        return None
    for table in frame.tables:  # the other global name would be a report of its own
        if bool(np.isin(table.targets, list(codes - {code})).any()):
            return None
    return int(code)


def _socket_order(sockets: IntArray, tick_of_row: IntArray, ticks: int) -> list[int] | None:
    """The sockets of every tick's RAPL rows, in row order, when it is the same in each."""
    keys = tick_of_row * (int(sockets.max()) + 1) + sockets
    _, first = np.unique(keys, return_index=True)
    first.sort()
    per_tick = np.bincount(tick_of_row[first], minlength=ticks)
    width = int(per_tick[0])
    if not bool((per_tick == width).all()):
        return None
    order = sockets[first].reshape(ticks, width)
    if not bool((order == order[0]).all()):
        return None
    return [int(socket) for socket in order[0]]


def _energy(
    rapl: EventsTable, tick_of_row: IntArray, position: dict[int, int], ticks: int
) -> dict[str, IntArray]:
    """Each RAPL event's energy per tick and socket: its first cpu's value, as SmartWatts reads."""
    slot = tick_of_row * len(position) + _positions(rapl.sockets, position)
    _, first_rows = np.unique(slot, return_index=True)  # every slot has a row (socket order)
    return {
        event: rapl.values[first_rows, column].reshape(ticks, len(position))
        for column, event in enumerate(rapl.events)
        if event not in TIME_EVENTS
    }


def _frequency(
    msr: EventsTable,
    millis: IntArray,
    position: dict[int, int],
    ticks: int,
    base_frequency: int,
) -> IntArray | None:
    """The package frequency per tick and socket: base × ΣAPERF / ΣMPERF over its cpus."""
    if "APERF" not in msr.events or "MPERF" not in msr.events:
        return None
    tick = _tick_of_rows(millis, msr.millis)
    if tick is None:
        return None  # msr rows of a tick without RAPL rows
    socket_slot = _positions(msr.sockets, position)
    known = socket_slot >= 0
    slot = (tick * len(position) + socket_slot)[known]
    size = ticks * len(position)
    rows = np.bincount(slot, minlength=size)
    # Integer sums: below 2**53, adding them as floats one cpu after another (as the slow way
    # does) gives the same number.
    aperf = msr.values[known, msr.events.index("APERF")]
    mperf = msr.values[known, msr.events.index("MPERF")]
    aperf_sum = np.zeros(size, dtype=np.int64)
    mperf_sum = np.zeros(size, dtype=np.int64)
    np.add.at(aperf_sum, slot, aperf)
    np.add.at(mperf_sum, slot, mperf)
    if not bool((rows > 0).all()) or not bool((mperf_sum > 0).all()):
        return None
    if int(aperf_sum.max()) >= 2**53 or int(mperf_sum.max()) >= 2**53:
        return None
    frequency = (base_frequency * aperf_sum.astype(np.float64)) / mperf_sum.astype(np.float64)
    return frequency.astype(np.int64).reshape(ticks, len(position))


def _tick_of_rows(millis: IntArray, row_millis: IntArray) -> IntArray | None:
    """Each row's tick (its place in ``millis``), or ``None`` if a row's tick is not there."""
    ticks = len(millis)
    tick = np.searchsorted(millis, row_millis)
    if bool((tick >= ticks).any()) or not bool(
        (millis[np.minimum(tick, ticks - 1)] == row_millis).all()
    ):
        return None
    return tick


def _features(
    core: EventsTable, millis: IntArray, position: dict[int, int], scale_multiplexed: bool
) -> TargetRows | None:
    """Every target's counters per socket, summed over its cpus, in the order SmartWatts reads."""
    ticks = len(millis)
    events = tuple(sorted(e for e in core.events if e not in TIME_EVENTS))
    if not events:
        return None
    if not len(core):
        empty = np.empty(0, dtype=np.int64)
        counts = np.empty((0, len(events)))
        return TargetRows(events, counts, empty, empty, empty, np.zeros(ticks, np.int64))
    tick = _tick_of_rows(millis, core.millis)
    if tick is None:
        return None  # a target's report in a tick without the global one
    starts = _segments(core, tick)
    if starts is None:
        return None
    sums = _segment_sums(core, events, starts, scale_multiplexed)
    segment_tick = tick[starts]
    segment_target = core.targets[starts]
    socket_of = _positions(core.sockets[starts], position)
    order = _read_order(segment_tick, segment_target, socket_of, ticks)
    segments = order.segments
    return TargetRows(
        events,
        np.ascontiguousarray(sums[segments]),
        segment_target[segments],
        segment_tick[segments],
        socket_of[segments],
        order.targets,
    )


def _segments(core: EventsTable, tick: IntArray) -> IntArray | None:
    """Where each segment (runs of rows of one tick, target and socket) starts; ``None`` when
    a segment comes apart or holds a cpu twice (the slow way merges or overwrites them)."""
    starts = run_starts(tick, core.targets, core.sockets)
    width = int(core.targets.max()) + 1
    sockets_span = int(core.sockets.max()) + 1
    segment_key = (tick[starts] * width + core.targets[starts]) * sockets_span + core.sockets[
        starts
    ]
    if len(np.unique(segment_key)) != len(starts):
        return None  # one target's rows of a socket apart in a tick: the slow way merges them
    if not _cpus_unique(core.cpus, starts):
        return None
    return starts


def _segment_sums(
    core: EventsTable, events: tuple[str, ...], starts: IntArray, scale_multiplexed: bool
) -> FloatArray:
    """Each segment's counters in feature order, summed over its cpus as the slow way adds
    them; a multiplexed cpu's counters scaled by time_enabled/time_running first."""
    columns = [core.events.index(e) for e in events]
    values = core.values[:, columns].astype(np.float64)
    scaled = False
    if scale_multiplexed and set(TIME_EVENTS) <= set(core.events):
        scaled = _unmultiplex(core, values)
    if (
        int(core.values[:, columns].max(initial=0)) * (int(np.diff(starts).max(initial=1)) + 1)
        >= 2**52
    ):
        scaled = True  # sums an int64 holds, but a float does not hold exactly
    return ordered_sums(values, starts, exact=not scaled)


def _unmultiplex(core: EventsTable, values: FloatArray) -> bool:
    """Scale the counters (``values``, in place) of each cpu that perf multiplexed by
    time_enabled/time_running (0 if it never ran); whether there was one."""
    enabled = core.values[:, core.events.index("time_enabled")]
    running = core.values[:, core.events.index("time_running")]
    multiplexed = running < enabled
    if not bool(multiplexed.any()):
        return False
    scale = np.ones(len(core))
    divided = multiplexed & (running > 0)
    scale[divided] = enabled[divided] / running[divided]
    scale[multiplexed & (running <= 0)] = 0.0
    values *= scale[:, None]
    return True


def _read_order(
    segment_tick: IntArray, segment_target: IntArray, socket_of: IntArray, ticks: int
) -> ReadOrder:
    """The segments by tick, socket, then the place of the target's first row in its tick;
    those on a socket without RAPL rows (``socket_of`` -1) left out."""
    width = int(segment_target.max()) + 1
    # Target reports per tick, each counted once whatever its sockets.
    pair = segment_tick * width + segment_target
    reports, first_segment = np.unique(pair, return_index=True)
    targets = np.bincount(reports // width, minlength=ticks)
    # A target's place in its tick: where its first row comes.
    rank = np.empty(len(segment_tick), dtype=np.int64)
    rank[:] = first_segment[np.searchsorted(reports, pair)]
    known = socket_of >= 0
    order = np.lexsort((rank, socket_of, segment_tick))
    return ReadOrder(order[known[order]], targets)


def ordered_sums(values: FloatArray, starts: IntArray, *, exact: bool) -> FloatArray:
    """The sum of each run of rows (runs start at ``starts``), added one row after another.

    That is the order the report-by-report way adds in. Integers below 2**52 add up to the same
    float in any order (``exact``), and numpy's ``reduceat`` is then fastest; otherwise its
    pairwise order could change the last bit, so the rows are added in order, a run's first
    rows all at once, then its second rows, and so on.
    """
    if exact or not len(values):
        sums: FloatArray = np.add.reduceat(values, starts, axis=0)
        return sums
    lengths = np.diff(np.append(starts, len(values)))
    run_of_row = np.repeat(np.arange(len(starts)), lengths)
    place = np.arange(len(values)) - starts[run_of_row]
    padded = np.zeros((len(starts), int(lengths.max()), values.shape[1]))
    padded[run_of_row, place] = values
    total = padded[:, 0].copy()
    for column in range(1, padded.shape[1]):
        total += padded[:, column]  # adding the zeros that pad a short run changes nothing
    return total


def _positions(sockets: IntArray, position: dict[int, int]) -> IntArray:
    """Each socket's place in the RAPL order, -1 for a socket RAPL does not report."""
    table = np.full(max(int(sockets.max(initial=0)), *position) + 1, -1, dtype=np.int64)
    table[list(position)] = list(position.values())
    found: IntArray = table[sockets]
    return found


def _cpus_unique(cpus: IntArray, starts: IntArray) -> bool:
    """Whether no cpu comes twice in one segment (the slow way would keep its later values)."""
    segment_start = np.zeros(len(cpus), dtype=np.bool_)
    segment_start[starts] = True
    rising = np.empty(len(cpus), dtype=np.bool_)
    rising[0] = True
    rising[1:] = cpus[1:] > cpus[:-1]
    if bool((rising | segment_start).all()):
        return True
    segment = np.cumsum(segment_start)
    keys = segment * (int(cpus.max()) + 1) + cpus
    return len(np.unique(keys)) == len(keys)
