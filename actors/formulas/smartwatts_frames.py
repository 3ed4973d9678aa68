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


def frame_ticks(
    frame: HWPCFrame, base_frequency: int, *, scale_multiplexed: bool
) -> FrameTicks | None:
    """The frame's ticks as arrays, or ``None`` when one of its reports needs the slow way."""
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
    for table in frame.tables:
        if len(table) and (
            int(table.values.min()) < 0 or int(table.values.max()) >= WRAPPED_COUNTER
        ):
            return None  # a dead letter for the slow way to write, with its reason

    millis, tick_of_rapl = np.unique(rapl.millis, return_inverse=True)
    tick_of_rapl = tick_of_rapl.reshape(-1)
    ticks = len(millis)
    sockets = _socket_order(rapl.sockets, tick_of_rapl, ticks)
    if sockets is None:
        return None
    position = {socket: at for at, socket in enumerate(sockets)}
    energy = _energy(rapl, tick_of_rapl, position, ticks)

    frequency = _frequency(msr, millis, position, ticks, base_frequency)
    if frequency is None:
        return None

    is_target = core.targets != global_code
    if not bool(np.isin(core.millis[~is_target], millis).all()):
        return None  # a global report without RAPL rows
    features = _features(core.where(is_target), millis, position, scale_multiplexed)
    if features is None:
        return None
    events, counts, target_codes, tick_of_row, socket_of_row, targets = features

    blocks = tick_of_row * len(sockets) + socket_of_row
    edges = np.searchsorted(blocks, np.arange(ticks * len(sockets) + 1))
    block_start = edges[:-1].reshape(ticks, len(sockets))
    block_stop = edges[1:].reshape(ticks, len(sockets))
    global_counts = np.zeros((ticks, len(sockets), len(events)))
    filled = block_stop > block_start
    if len(counts):
        integral = bool((counts == np.floor(counts)).all()) and float(counts.max()) < 2**52
        sums = ordered_sums(counts, block_start[filled].reshape(-1), exact=integral)
        global_counts[filled] = sums
    return FrameTicks(
        millis=millis,
        sockets=[str(socket) for socket in sockets],
        events=events,
        energy=energy,
        frequency=frequency,
        targets=targets,
        counts=counts,
        target_codes=target_codes,
        block_start=block_start,
        block_stop=block_stop,
        global_counts=global_counts,
    )


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
    tick = np.searchsorted(millis, msr.millis)
    if bool((tick >= ticks).any()) or not bool(
        (millis[np.minimum(tick, ticks - 1)] == msr.millis).all()
    ):
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


Features = tuple[tuple[str, ...], FloatArray, IntArray, IntArray, IntArray, IntArray]


def _features(
    core: EventsTable, millis: IntArray, position: dict[int, int], scale_multiplexed: bool
) -> Features | None:
    """Every target's counters per socket, summed over its cpus, in the order SmartWatts reads.

    Returns the features' names, the sums (rows × events, only sockets with RAPL rows), each
    row's target, tick and socket position, and the number of target reports of each tick.
    """
    ticks = len(millis)
    events = tuple(sorted(e for e in core.events if e not in TIME_EVENTS))
    if not events:
        return None
    if not len(core):
        empty = np.empty(0, dtype=np.int64)
        return (events, np.empty((0, len(events))), empty, empty, empty, np.zeros(ticks, np.int64))
    tick = np.searchsorted(millis, core.millis)
    if bool((tick >= ticks).any()) or not bool(
        (millis[np.minimum(tick, ticks - 1)] == core.millis).all()
    ):
        return None  # a target's report in a tick without the global one
    # Segments: runs of rows of one tick, target and socket.
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
    # Counters in feature order; a multiplexed cpu's scaled by time_enabled/time_running.
    columns = [core.events.index(e) for e in events]
    values = core.values[:, columns].astype(np.float64)
    scaled = False
    if scale_multiplexed and set(TIME_EVENTS) <= set(core.events):
        enabled = core.values[:, core.events.index("time_enabled")]
        running = core.values[:, core.events.index("time_running")]
        multiplexed = running < enabled
        if bool(multiplexed.any()):
            scale = np.ones(len(core))
            divided = multiplexed & (running > 0)
            scale[divided] = enabled[divided] / running[divided]
            scale[multiplexed & (running <= 0)] = 0.0
            values *= scale[:, None]
            scaled = True
    if (
        int(core.values[:, columns].max(initial=0)) * (int(np.diff(starts).max(initial=1)) + 1)
        >= 2**52
    ):
        scaled = True  # sums an int64 holds, but a float does not hold exactly
    sums = ordered_sums(values, starts, exact=not scaled)
    segment_tick = tick[starts]
    segment_target = core.targets[starts]
    # Target reports per tick, each counted once whatever its sockets.
    pair = segment_tick * width + segment_target
    reports, first_segment = np.unique(pair, return_index=True)
    targets = np.bincount(reports // width, minlength=ticks)
    # A target's place in its tick: where its first row comes.
    rank = np.empty(len(starts), dtype=np.int64)
    rank[:] = first_segment[np.searchsorted(reports, pair)]
    socket_of = _positions(core.sockets[starts], position)
    known = socket_of >= 0
    order = np.lexsort((rank, socket_of, segment_tick))
    order = order[known[order]]
    return (
        events,
        np.ascontiguousarray(sums[order]),
        segment_target[order],
        segment_tick[order],
        socket_of[order],
        targets,
    )


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
