"""A run as ROSS instrumentation binary: PE, KP, LP and model samples, and an event trace.

ROSS (the Rensselaer Optimistic Simulation System) samples its engine as raw C structs; tools
built for it (ross-binary-reader, ROSS-Vis) read those structs. Writing a measurement run in
that shape lets them show how wattflow's pipeline and the measured targets evolved. The byte
layouts follow ROSS's "Data Sample Format" page and ``st-instrumentation.h``: native byte order
(little-endian, as on x86-64) with natural alignment, which for these structs means no padding
at all, so every format below is spelled with an explicit ``<``.

Records of the sample stream (``<stem>.bin``), each a 24-byte metadata head ``<iidd``
(sample_type, sample_sz, virtual_time, real_time) followed by ``sample_sz`` bytes:

- type 0, PE, ``<13I13f`` (104 bytes);
- type 1, KP, ``<9I2f`` (44 bytes);
- type 2, LP, ``<8If`` (36 bytes; newer ROSS puts a u64 before ``efficiency``, not done here);
- type 3, model: ``sample_sz`` is 24, the model metadata ``<3IfiI`` (pe_id, kp_id, lp_id, gvt,
  stats_type, model_sz), then ``model_sz`` bytes of model data.

Records of the event trace (``<stem>-evtrace.bin``) have no metadata head: ``<2I3fI``
(src_lp, dest_lp, send_vts, recv_vts, real_ts, model_data_sz), then the model data. They live in
a file of their own because nothing in them tells them apart from samples.

What the simulation terms stand for:

- PE 0 is the wattflow service: one process.
- A KP is one formula actor, told apart by the ``scope`` its PowerReports carry: the scope is
  stable for the whole run, while ``metadata["formula"]`` is a model hash that SmartWatts
  changes every time it relearns. KP ids are fixed scope codes so that they mean the same in
  every run: ``cpu`` 0, ``dram`` 1, ``gpu`` 2, ``node`` 3; any other scope (a missing one is
  ``""``) gets 4, 5, … in the order it first appears.
- An LP is one target as one formula actor sees it: (scope, target). A target measured in two
  scopes is two LPs, because a ROSS LP belongs to exactly one KP. LP ids count up from 0 in the
  order of each LP's first PowerReport. ``rapl`` and ``global`` are LPs like any other.
- Virtual time is measurement time: seconds since the run's start.
- Real time is processing time: seconds from the run's start to the moment the service had
  finished processing the latest report read when the record was written (live recordings
  with ``--run`` store that moment with every report). It runs behind virtual time by the
  pipeline's latency, which is what it is there to show. Imported reports were processed
  elsewhere and have no such moment: for them real time falls back to the measurement time of
  the latest report read, the point the replay had reached, and the description says
  ``"real_time": "measurement"`` instead of ``"processing"``.

Samples are taken every ``interval_s`` of virtual time (1 s unless told), at ``k * interval_s``
for k = 1, 2, … while that is before the run's end, and once more at the end (or at the last
report, when one lies beyond it). A sample at ``t`` has read every report at or before ``t``.
Each sample writes one PE record, one KP record per KP seen so far (by id), one LP record per LP
seen so far (by id), then one model record per LP (by id). Counters are cumulative since the
run's start; take differences for per-interval values. The ``float`` fields ROSS fills with
time spent in GVT, rollbacks, queues and so on are 0.0: a replay does none of that.

Counters (unsigned, saturating at 2**32 - 1):

- events_processed: reports read, of every kind, for the PE; PowerReports for a KP and an LP;
- network_receives: the same as events_processed (everything the actor took in);
- network_sends: PowerReports emitted (for the PE, all of them);
- num_GVTs (PE): samples taken so far, this one included;
- events_aborted (PE): reports the service dropped, and events_rolled_back (PE): reports it
  took in late. A stored run knows neither, unless its system info holds the service's ledger
  (``system["ledger"]``): then dropped = ``rejected_input + dead_in + dead_out`` and late =
  ``late``. The ledger is taken when the run ends, so these appear in the final sample only;
  they are the whole service's, so KPs and LPs keep 0.
- efficiency: ``100 * (1 - rolled_back / processed)`` for the PE, 100.0 for KPs and LPs;
- every other counter, and time_ahead_gvt (a replay never runs ahead), is 0.

Model data, 24 bytes, ``<ddII``, one record per LP at each sample:

====== ======== ==================================================================
offset C type   meaning
====== ======== ==================================================================
0      double   power_w: the LP's power at the sample, in W (the latest report of
                each of its series, summed; series = socket and device)
8      double   energy_j: the LP's energy since the run's start, in J
16     uint32   scope: the KP id (the scope code above)
20     uint32   reports: the LP's PowerReports read so far
====== ======== ==================================================================

Energy integrates power as :func:`~wattflow.formats.runs.summarise` does: a report's power holds
from the previous report of the same series to its own timestamp, so a series' first report adds
nothing. Model metadata: pe_id 0, the LP's KP and LP ids, gvt = the sample's virtual time as a
float, stats_type 3 (ROSS's ``VT_STATS``: virtual-time sampling), model_sz 24.

Event data, 8 bytes, ``<d``: power_w, the PowerReport's power in W. One event per PowerReport,
a self-send of its LP (src_lp = dest_lp: the formula actor is a KP, not an LP), send_vts =
recv_vts = its virtual time, real_ts = its own real time as above. These three are 32-bit
floats: about 8 ms resolution after a day.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, BinaryIO

from wattflow.formats.errors import WattflowError
from wattflow.formats.reports import to_micros
from wattflow.formats.runs import DOMAINS, NOT_POWER, Run, Series, TimelinePage

METADATA = struct.Struct("<iidd")
PE_SAMPLE = struct.Struct("<13I13f")
KP_SAMPLE = struct.Struct("<9I2f")
LP_SAMPLE = struct.Struct("<8If")
MODEL_METADATA = struct.Struct("<3IfiI")
EVENT = struct.Struct("<2I3fI")
MODEL_DATA = struct.Struct("<ddII")
EVENT_DATA = struct.Struct("<d")
# Records written as one struct each: the same bytes as their parts packed one after the
# other, since no format here has padding.
_EVENT_RECORD = struct.Struct(EVENT.format + EVENT_DATA.format[1:])
_LP_RECORD = struct.Struct(METADATA.format + LP_SAMPLE.format[1:])
_MODEL_RECORD = struct.Struct(METADATA.format + MODEL_METADATA.format[1:] + MODEL_DATA.format[1:])

PE_TYPE, KP_TYPE, LP_TYPE, MODEL_TYPE = 0, 1, 2, 3
VT_STATS = 3
"""ROSS's ``stats_types_enum`` value for virtual-time sampling."""

PE_ID = 0
SCOPE_CODES = {scope: code for code, scope in enumerate(DOMAINS)}
"""KP ids of the scopes wattflow's formulas emit; other scopes follow from ``len(DOMAINS)``."""

_U32 = 0xFFFFFFFF
_FULL = 100.0


def _u32(count: int) -> int:
    """ROSS's counters are 32 bits; a longer run saturates rather than wrapping to small."""
    return count if count <= _U32 else _U32


def _ledger_count(ledger: dict[str, Any], key: str) -> int:
    """A count from a stored ledger; anything that is not a non-negative number counts 0."""
    value = ledger.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return 0
    return int(value)


@dataclass(slots=True, eq=False)
class _Lp:
    """One (scope, target): its counters and the state its power and energy come from."""

    id: int
    kp: int
    scope: str
    target: str
    reports: int = 0
    energy_j: float = 0.0
    powers: list[float] = field(default_factory=list)
    """The latest power of each of its series (socket and device), in W, in the order they
    first appeared: the LP's power is their sum."""
    series: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    """Per (socket, device): its state in :meth:`RossWriter.add`, ``[its latest report's
    time in Unix µs (_NOT_YET before the first), this LP, its place in powers, the LP's
    id]``."""

    def power_w(self) -> float:
        """The latest power of each series, summed."""
        return float(sum(self.powers))


_NOT_YET = 1 << 63
"""A series' latest time before its first report: later than any report's time in Unix µs, so
that the first report adds no energy."""


MAX_SAMPLES = 10_000_000
"""Samples one run may take: at 1 s, 115 days. A longer window is almost always a run whose
window was stretched by a stray timestamp, and would write gigabytes of samples."""


class RossError(WattflowError, ValueError):
    """A run this format cannot hold."""


def check_window(run: Run, interval_s: float) -> None:
    """Refuse a run whose window would take more than ``MAX_SAMPLES`` samples."""
    if run.duration_s / interval_s > MAX_SAMPLES:
        raise RossError(
            f"run {run.id}: its window ({run.start} to {run.end}, {run.duration_s:,.0f} s) "
            f"would take over {MAX_SAMPLES:,} samples of {interval_s:g} s; check its reports' "
            "timestamps (`wattflow runs show`)"
        )


class RossWriter:
    """Turns one run's reports, read in time order, into ROSS sample and event records.

    Only per-LP state is kept, so memory grows with the number of targets, not with the run.
    Reports come as the run's timeline (:meth:`~wattflow.formats.runs.RunData.timeline`): a
    PowerReport's series and power, and only the moment of every other report.
    """

    def __init__(
        self,
        run: Run,
        samples: BinaryIO,
        events: BinaryIO | None = None,
        *,
        interval_s: float = 1.0,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, not {interval_s!r}")
        check_window(run, interval_s)
        self.run = run
        self.samples = samples
        self.events = events
        self.interval_s = interval_s
        start = run.start
        self._start = start.replace(tzinfo=UTC) if start.tzinfo is None else start
        self.kps: dict[str, int] = {}
        self.lps: dict[tuple[str, str], _Lp] = {}
        self._by_id: list[_Lp] = []
        self.processed = 0
        self.samples_taken = 0
        self._k = 1
        self._last_vt = 0.0
        self._last_rt = 0.0
        self._epoch = self._start.timestamp()
        self._start_us = to_micros(self._start)
        self._by_series: dict[int, list[Any]] = {}
        """Per series id of the timeline: its state within its LP (:attr:`_Lp.series`)."""
        self._moment: int | None = None
        """The time in Unix µs of the latest report read."""
        self.timed = 0
        """Reports read that carried a processing time."""
        self._last_sample: float | None = None
        self.ledger: dict[str, Any] | None = None
        ledger = run.system.get("ledger")
        if isinstance(ledger, dict):
            self.ledger = ledger

    def _next_point(self) -> float:
        return self._k * self.interval_s

    def _kp(self, scope: str) -> int:
        kp = self.kps.get(scope)
        if kp is None:
            kp = SCOPE_CODES.get(scope)
            if kp is None:
                kp = len(DOMAINS) + sum(1 for s in self.kps if s not in SCOPE_CODES)
            self.kps[scope] = kp
        return kp

    def _lp(self, scope: str, target: str) -> _Lp:
        lp = self.lps.get((scope, target))
        if lp is None:
            lp = _Lp(len(self._by_id), self._kp(scope), scope, target)
            self.lps[(scope, target)] = lp
            self._by_id.append(lp)
        return lp

    @property
    def sent(self) -> int:
        """PowerReports read."""
        return sum(lp.reports for lp in self._by_id)

    def add(self, page: TimelinePage) -> None:
        """Read some of the run's reports, the next ones in time order: samples due before
        each are written first.

        The loop keeps its counters in locals and hands them back before each sample, which
        reads them: this runs once per report of the run. A moment's reports (a tick's, often
        hundreds) share their virtual time, computed once.
        """
        start_us, epoch = self._start_us, self._epoch
        by_series = self._by_series
        processed_count, timed = self.processed, self.timed
        last_rt, moment = self._last_rt, self._moment
        vt = self._last_vt
        next_point = self._next_point()
        events: list[bytes] = []
        append, write_events = events.append, self.events is not None
        pack = _EVENT_RECORD.pack
        data_size, not_power = EVENT_DATA.size, NOT_POWER
        for micros, number, power, processed, _, _ in page.rows:
            if micros != moment:
                moment = micros
                at = (micros - start_us) / 1_000_000
                if next_point < at:
                    self.processed, self.timed = processed_count, timed
                    self._last_vt, self._last_rt = vt, last_rt
                    next_point = self._sample_until(at)
                vt = at
            processed_count += 1
            # Reports of one batch are read in time order but stored together: real time never
            # goes back.
            if processed is None:
                if vt > last_rt:
                    last_rt = vt
            else:
                timed += 1
                if processed - epoch > last_rt:
                    last_rt = processed - epoch
            if number == not_power:
                continue
            state = by_series.get(number)
            if state is None:
                state = by_series[number] = self._series(page.series[number])
            last, lp = state[0], state[1]
            if micros > last:
                lp.energy_j += power * ((micros - last) / 1_000_000)
            state[0] = micros
            lp.powers[state[2]] = power
            lp.reports += 1
            if write_events:
                append(pack(state[3], state[3], vt, vt, last_rt, data_size, power))
        self.processed, self.timed = processed_count, timed
        self._last_vt, self._last_rt, self._moment = vt, last_rt, moment
        self._write_events(events)

    def _sample_until(self, at: float) -> float:
        """Write the samples due before ``at`` (virtual time, s), from the counters as
        :meth:`add` handed them back; the time of the next one."""
        while self._next_point() < at:
            self._sample(self._next_point())
            self._k += 1
        return self._next_point()

    def _write_events(self, events: list[bytes]) -> None:
        """A page's event records in one write (none without an event file)."""
        if events and self.events is not None:
            self.events.write(b"".join(events))

    def _series(self, series: Series) -> list[Any]:
        """A series' state (see :attr:`_Lp.series`), shared by the series of one LP, socket
        and device, whatever their sensor."""
        lp = self._lp(series.scope, series.target)
        key = (series.socket, series.device)
        state = lp.series.get(key)
        if state is None:
            state = lp.series[key] = [_NOT_YET, lp, len(lp.powers), lp.id]
            lp.powers.append(0.0)
        return state

    def close(self) -> None:
        """Write the samples left up to the run's end, the last one at the end itself."""
        end = max(self.run.duration_s, self._last_vt)
        while self._next_point() < end:
            self._sample(self._next_point())
            self._k += 1
        if self._last_sample is None or self._last_sample < end:
            self._sample(end, final=True)

    def _sample(self, vt: float, *, final: bool = False) -> None:
        self.samples_taken += 1
        self._last_sample = vt
        rt = self._last_rt
        dropped = late = 0
        if final and self.ledger is not None:
            dropped = sum(
                _ledger_count(self.ledger, key) for key in ("rejected_input", "dead_in", "dead_out")
            )
            late = _ledger_count(self.ledger, "late")
        processed = _u32(self.processed)
        efficiency = _FULL * (1.0 - late / self.processed) if self.processed else _FULL
        kp_reports = dict.fromkeys(self.kps.values(), 0)
        for lp in self._by_id:
            kp_reports[lp.kp] += lp.reports
        records = [
            METADATA.pack(PE_TYPE, PE_SAMPLE.size, vt, rt),
            PE_SAMPLE.pack(
                PE_ID, processed, _u32(dropped), _u32(late), 0, 0, 0, 0,
                _u32(sum(kp_reports.values())), processed, _u32(self.samples_taken), 0, 0,
                efficiency, *(0.0,) * 12,
            ),
        ]  # fmt: skip
        for kp in sorted(kp_reports):
            count = _u32(kp_reports[kp])
            records.append(METADATA.pack(KP_TYPE, KP_SAMPLE.size, vt, rt))
            records.append(KP_SAMPLE.pack(PE_ID, kp, count, 0, 0, 0, 0, count, count, 0.0, _FULL))
        lps = self._by_id
        counts = [lp.reports if lp.reports <= _U32 else _U32 for lp in lps]
        lp_record, model_record = _LP_RECORD.pack, _MODEL_RECORD.pack
        lp_type, lp_size = LP_TYPE, LP_SAMPLE.size
        records += [
            lp_record(lp_type, lp_size, vt, rt, PE_ID, lp.kp, lp.id, count, 0, 0, count, count,
                      _FULL)
            for lp, count in zip(lps, counts, strict=True)
        ]  # fmt: skip
        model_type, model_size, data_size = MODEL_TYPE, MODEL_METADATA.size, MODEL_DATA.size
        records += [
            model_record(model_type, model_size, vt, rt, PE_ID, lp.kp, lp.id, vt, VT_STATS,
                         data_size, float(sum(lp.powers)), lp.energy_j, lp.kp, count)
            for lp, count in zip(lps, counts, strict=True)
        ]  # fmt: skip
        self.samples.write(b"".join(records))

    def _real_time_source(self) -> str:
        if self.timed == 0:
            return "measurement"
        return "processing" if self.timed == self.processed else "processing where recorded live"

    def description(self) -> dict[str, Any]:
        """What the ids and the model data mean, for a reader that has only the binary files.

        ROSS's records carry numbers only; the names of the KPs and LPs travel beside them.
        """
        run = self.run
        return {
            "run": run.id,
            "experiment": run.experiment,
            "benchmark": run.benchmark,
            "settings": run.settings,
            "repetition": run.repetition,
            "start": run.start.isoformat(),
            "end": run.end.isoformat(),
            "interval_s": self.interval_s,
            "samples": self.samples_taken,
            "reports": self.processed,
            "power_reports": self.sent,
            "pe": {"id": PE_ID, "is": "the wattflow service"},
            "kps": [
                {"id": kp, "scope": scope}
                for scope, kp in sorted(self.kps.items(), key=lambda item: item[1])
            ],
            "lps": [
                {"id": lp.id, "kp": lp.kp, "scope": lp.scope, "target": lp.target}
                for lp in self._by_id
            ],
            "stats_type": VT_STATS,
            "real_time": self._real_time_source(),
            "model_data": {
                "struct": MODEL_DATA.format,
                "fields": ["power_w", "energy_j", "scope", "reports"],
            },
            "event_data": {"struct": EVENT_DATA.format, "fields": ["power_w"]},
            "ledger": self.ledger,
        }
