"""How a GPU's active energy is shared among the processes that time-slice it.

The driver's per-process samples say which ONE process held the engine at each sample (every
~200 ms) and how busy the engine was over the sample's period; they say nothing of what the
process drew. A split by those time shares alone gives a one-SM spinner as much power as a
matrix multiplication on every SM for the same engine time. So the GPU formula learns, per
device and per process, its **active power**: what the GPU draws above idle while that process
holds the engine (``k``, in W).

**Learning** (:meth:`ProcessPowers.learn`). Each process window of the NVML input (about a
second) is one observation: the device's active energy over it (J, from the energy counter,
via the ticks released in it) against the engine time each process held (s: its share of the
window's samples × the window's length). A process with :data:`MIN_SOLO_S` of engine time in
windows it had alone (no other process named in them or in the second before) takes its ``k``
from those: their median, as a window in which another process began unseen reads far off.
The others' ``k`` come from a non-negative least-squares fit (``scipy.optimize.nnls``) of
every window's energy to its engine times, with the solo figures fixed, older windows weighing
less (half-life :data:`HALF_LIFE_S`). Only sums of products are kept (a Gram matrix of at most
:data:`MAX_PROCESSES` processes) and the newest :data:`SOLO_WINDOWS` solo figures, so memory is
bounded whatever the run's length.

Engine times are themselves noisy: each driver sample is one draw of who held the engine, so a
window of 5 samples gives a process holding half the engine 0 %, 20 %, … 100 %. A fit on such
regressors is biased towards the mean (errors in variables); the fit subtracts the draws'
(multinomial) covariance, estimated without bias from each window's shares, from the Gram
matrix, which removes the bias. Windows weigh 1 / (their shares' variance +
:data:`WEIGHT_FLOOR`), the variance taken at the shares before them, so that a window one
process had alone weighs about twice one that two shared.

**Identified or not.** The data tell processes apart only if their engine times vary apart
(one runs alone for a while, or their mix changes). A process counts as identified when it has
its solo figure, or when the fit holds :data:`MIN_WINDOWS` windows, at least
:data:`MIN_INDEPENDENCE` of its engine time's variation is not explained by the others', and
its ``k`` is precise (standard error within :data:`MAX_RELATIVE_STDERR` of it, and
:data:`MIN_STDERRS_ABOVE_ZERO` standard errors above 0 W). Until then its share of a tick is
by time, said in its report (``split: time``). A small pull of every ``k`` toward the pooled
active power (all energy over all engine time, :data:`RIDGE`) keeps processes the data cannot
tell apart at one common figure. Once identified, a process keeps its last identified figure
for its whole life (``learned``), even if later data stop telling it apart; a reused pid is
another process (the NVML input reads each process's start time), so it inherits nothing.

**Splitting a tick** (:meth:`ProcessPowers.split`). A tick's engine times come from the
windows that overlap it, each as noisy as its window's samples. The tick's own active energy is
a second measurement of them: the estimate is corrected towards engine times that explain that
energy, weighing each process's correction by its sampling variance (the linear minimum-variance
update, a Kalman step), never below zero. Each process then gets ``k × corrected engine time``,
scaled so the processes take exactly the tick's active energy: conservation holds on every tick.
With two processes sharing a busy engine and their ``k`` known, the correction gives each its
true engine time in every tick, however few samples named it.

**State** (:meth:`ProcessPowers.state`): the sums, each process's recent share and its learned
figure; checkpointed with the formula's, so a restart keeps what was learned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from wattflow.actors.checkpoints import Packed

MAX_PROCESSES = 32
"""Processes a device learns at once; past that, the one seen longest ago is forgotten."""

HALF_LIFE_S = 600.0
"""Seconds of windows after which an observation weighs half: a process whose kernels change
is learned again within minutes, and a fit holds hundreds of windows."""

RIDGE = 0.01
"""Weight of the pull towards the pooled active power, as a part of each process's own weight
of windows: the data soon outweigh it; where they cannot tell processes apart, it decides."""

MAX_RELATIVE_STDERR = 0.25
"""A process with less of its own variation counts as learned once its active power's standard
error is within this part of it."""

MIN_WINDOWS = 20.0
"""Windows a fit must hold before it tells processes apart: fewer, and the draws' noise can
pass for a difference."""

MIN_STDERRS_ABOVE_ZERO = 3.0
"""A learned power must also stand this many standard errors above 0 W: a process holding the
engine draws something, and a fit that puts one at 0 W (the bound of the non-negative fit) has
not learned it yet."""

MIN_INDEPENDENCE = 0.3
"""Least part of a process's engine-time variation that the others' must leave unexplained
for it to be told apart (1 − R² of its engine time on theirs)."""

PRIOR_SAMPLES = 5.0
"""How many samples' worth a process's recent share weighs in the variance of a window's
share: a window whose 5 samples all missed a running process still gives it some variance."""

SHARE_MEMORY = 0.3
"""Weight of the newest window in a process's recent share."""

CANDIDATE_US = 5_000_000
"""A process seen in a window this recently may have held the engine in a later window that
none of whose samples named it."""

WEIGHT_FLOOR = 0.09
"""Added to a window's share variance in its weight, 1 / (variance + this): a window that one
process had alone weighs about twice one that two shared half and half, no more, so that the
few windows whose weight is high by chance (at a change of mix) do not decide the fit."""

SOLO_WINDOWS = 120
"""Solo windows a process keeps: two minutes of them."""

MIN_SOLO_S = 3.0
"""Engine-seconds alone after which a process's active power is taken from those windows."""

SOLO_QUIET_US = 1_000_000
"""How long no other process must have been named before a window counts as one process's
alone: a process the samples missed for a window was named in one before."""

TICK_MEMORY = 0.02
"""Weight of the newest tick in the smoothed error of ticks' energy."""

RESIDUAL_FLOOR = 0.02
"""Least model error assumed in a tick's energy, as a part of the pooled active power (and at
least 1 W): a perfect fit never turns the correction into a division by zero."""

Split = Literal["power", "time"]

Floats = npt.NDArray[np.float64]


class ProcessState(msgspec.Struct, array_like=True, frozen=True):
    """A process as a checkpoint keeps it: ``[key, target, recent share, seen (µs), learned
    (power, stderr) or null, [solo powers, solo engine times, engine time]]``."""

    key: str
    target: str
    recent_share: float
    seen_us: int
    learned: tuple[float, float] | None
    solo: tuple[list[float], list[float], float]


class PowersState(msgspec.Struct, kw_only=True, frozen=True):
    """What a device's :class:`ProcessPowers` keeps across a restart."""

    processes: list[ProcessState]
    gram: Packed
    noise: Packed
    cross: Packed
    sums: tuple[float, float, float, float, float]
    """Σ weighted energy², the model error, windows, active energy and engine time."""


@dataclass(slots=True)
class Learned:
    """A process's active power while it holds the engine, once the data told it apart."""

    power_w: float
    stderr_w: float


@dataclass(slots=True)
class _Process:
    target: str
    recent_share: float = 0.0
    """Share of the newest windows' engine time (smoothed by :data:`SHARE_MEMORY`)."""
    seen_us: int = 0
    """End of the newest window whose samples named it."""
    learned: Learned | None = None
    solo_w: list[float] = field(default_factory=list)
    """Its power in each of the newest windows it had alone (no other process named for
    :data:`SOLO_QUIET_US` before), at most :data:`SOLO_WINDOWS` of them."""
    solo_s: list[float] = field(default_factory=list)
    """Its engine time in each of those windows."""
    engine_s: float = 0.0
    """Its engine time in every window learned from (decayed as the sums are): a fit counts
    for a process only once it has :data:`MIN_SOLO_S` of it."""

    def solo_power(self) -> tuple[float, float]:
        """Active power from the solo windows: their median, since a window in which another
        process began unseen by the samples is no solo window and reads far off; and its
        standard error (from the median absolute deviation)."""
        powers = np.asarray(self.solo_w)
        median = float(np.median(powers))
        spread = 1.4826 * float(np.median(np.abs(powers - median)))
        return median, 1.2533 * spread / float(np.sqrt(len(powers)))


@dataclass(slots=True)
class _Fit:
    power_w: Floats
    stderr_w: Floats
    identified: npt.NDArray[np.bool_]
    pooled_w: float


@dataclass(slots=True)
class ProcessWindow:
    """What the splitting and the learning need of one process window."""

    seconds: float
    shares: dict[str, float]
    """Each process's engine time over the window's length (0-1)."""
    samples: float
    """How many driver samples the window holds."""
    noise: dict[str, float]
    """The shares the sampling variance is taken at: the window's own, drawn towards each
    process's recent share, over every process that may have run (see :data:`CANDIDATE_US`)."""


@dataclass(slots=True)
class ProcessEnergy:
    """One process's part of a tick's active energy, and how it was had."""

    key: str
    target: str
    energy_j: float
    split: Split
    power_w: float
    """The active power it was split by: learned where ``split`` is ``power``, else the fit's
    figure so far (the pooled one before any)."""
    stderr_w: float


class ProcessPowers:
    """A device's processes and what the windows taught about their active power."""

    def __init__(self) -> None:
        self.processes: dict[str, _Process] = {}
        """Known processes, in the order of the rows of the sums below."""
        self.gram = np.zeros((0, 0))
        """Σ x xᵀ over windows: x = each process's engine time (s)."""
        self.noise = np.zeros((0, 0))
        """Σ of the expected covariance of x, from the samples' draws."""
        self.cross = np.zeros(0)
        """Σ x × active energy (J·s)."""
        self.energy_sq = 0.0
        """Σ weight × active energy² (J², weighted)."""
        self.windows = 0.0
        self.model_error_w2 = 0.0
        """A tick's energy error beyond what the draws explain, per second² (W², smoothed over
        ticks): how far a tick's own energy is trusted to correct its engine times."""
        self.energy_j = 0.0
        self.engine_s = 0.0
        self._fit: _Fit | None = None

    # --- learning ----------------------------------------------------------------------------

    def noise_shares(
        self,
        shares: dict[str, float],
        samples: float,
        end_us: int,
        running: list[int] | None = None,
    ) -> dict[str, float]:
        """The shares at which a window's sampling variance is taken (see
        :attr:`ProcessWindow.noise`); they add up to the window's busy part. A process that
        may have run unseen is one seen in the last :data:`CANDIDATE_US` that still holds a
        context (``running``: the pids that do, where the NVML input read them)."""
        busy = sum(shares.values())
        if busy <= 0:
            return {}
        self._retire_reused(shares)
        alive = None if running is None else {str(pid) for pid in running}
        drawn = {key: samples * share for key, share in shares.items()}
        for key, process in self.processes.items():
            if alive is not None and key.partition("@")[0] not in alive:
                continue
            if key in drawn or end_us - process.seen_us <= CANDIDATE_US:
                drawn[key] = drawn.get(key, 0.0) + PRIOR_SAMPLES * process.recent_share
        total = sum(drawn.values())
        return {key: value * busy / total for key, value in drawn.items() if value > 0}

    def _retire_reused(self, shares: dict[str, float]) -> None:
        """A pid seen as another process (another start time) means the earlier one ended:
        it is no longer a process that may have run unseen."""
        pids = {key.partition("@")[0]: key for key in shares}
        for key, process in self.processes.items():
            other = pids.get(key.partition("@")[0])
            if other is not None and other != key:
                process.recent_share = 0.0
                process.seen_us = -CANDIDATE_US

    def learn(
        self, window: ProcessWindow, active_j: float, end_us: int, targets: dict[str, str]
    ) -> None:
        """Add a whole window's active energy against its processes' engine times, weighed by
        how well it can tell them (:meth:`_weight`)."""
        decay = 0.5 ** (window.seconds / HALF_LIFE_S)
        for name in ("gram", "noise", "cross"):
            setattr(self, name, getattr(self, name) * decay)
        self.energy_sq *= decay
        self.windows *= decay
        self.energy_j *= decay
        self.engine_s *= decay
        for key in window.shares:  # a process of ``noise`` only is known already
            self._row(key, targets.get(key, key), end_us, keep=window.shares)
        index = {key: row for row, key in enumerate(self.processes)}
        engine = np.zeros(len(index))
        for key, share in window.shares.items():
            engine[index[key]] = share * window.seconds
        weight = self._weight(window)
        self.gram += weight * np.outer(engine, engine)
        self.cross += weight * engine * active_j
        self.energy_sq += weight * active_j * active_j
        self.windows += 1.0
        self.energy_j += active_j
        self.engine_s += float(engine.sum())
        if window.samples > 1:  # the draws' covariance, estimated without bias from the shares
            rows = [index[key] for key in window.shares]
            drawn = np.fromiter(window.shares.values(), dtype=np.float64)
            covariance = _draws(drawn, window.samples - 1)  # n - 1: unbiased from the shares
            self.noise[np.ix_(rows, rows)] += weight * covariance * window.seconds**2
        self._learn_solo(window, active_j, end_us, decay)
        for key, process in self.processes.items():
            share = window.shares.get(key, 0.0)
            process.recent_share += SHARE_MEMORY * (share - process.recent_share)
            if share > 0:
                process.seen_us = end_us
        self._fit = None

    def _learn_solo(
        self, window: ProcessWindow, active_j: float, end_us: int, decay: float
    ) -> None:
        """A window that one process had alone, no other named for :data:`SOLO_QUIET_US`
        before it, gives that one's power."""
        for key, process in self.processes.items():
            process.engine_s = process.engine_s * decay + (
                window.shares.get(key, 0.0) * window.seconds
            )
        if len(window.shares) != 1:
            return
        ((key, share),) = window.shares.items()
        since_us = end_us - round(window.seconds * 1e6) - SOLO_QUIET_US
        if share <= 0 or any(
            other != key and process.seen_us > since_us for other, process in self.processes.items()
        ):
            return
        engine_s = share * window.seconds
        process = self.processes[key]
        process.solo_w.append(active_j / engine_s)
        process.solo_s.append(engine_s)
        del process.solo_w[:-SOLO_WINDOWS], process.solo_s[:-SOLO_WINDOWS]

    def _weight(self, window: ProcessWindow) -> float:
        """1 / the variance expected of the window's shares, from the draws of who held the
        engine (plus :data:`WEIGHT_FLOOR`): a window that one process had alone is exact and
        weighs most. The variance is taken at the processes' shares BEFORE this window (a
        process new in it, at its own), so
        the weight does not follow this window's draws, which would bias the fit; and it does
        not depend on the fit, so early windows weigh as later ones do.
        """
        drawn = {
            key: process.recent_share if process.recent_share > 0 else window.shares.get(key, 0)
            for key, process in self.processes.items()
            if key in window.shares or key in window.noise
        }
        busy = sum(window.shares.values())
        total = sum(drawn.values())
        variance = 0.0
        if total > 0 and busy > 0 and window.samples > 0:
            shares = np.fromiter(drawn.values(), dtype=np.float64) * busy / total
            variance = float((shares * (busy - shares)).sum()) / window.samples
        return 1.0 / ((variance + WEIGHT_FLOOR) * window.seconds**2)

    def _pooled_w(self) -> float:
        return self.energy_j / self.engine_s if self.engine_s > 0 else 0.0

    def _row(self, key: str, target: str, end_us: int, keep: dict[str, float]) -> None:
        """Make room for a process in the sums (a new one, or one seen again)."""
        if key in self.processes:
            return
        if len(self.processes) >= MAX_PROCESSES:
            gone = min(
                (k for k in self.processes if k not in keep),
                key=lambda k: self.processes[k].seen_us,
                default=None,
            )
            if gone is None:
                return
            self._drop(gone)
        self.processes[key] = _Process(target, seen_us=end_us)
        size = len(self.processes)
        self.gram = _grown(self.gram, size)
        self.noise = _grown(self.noise, size)
        self.cross = np.append(self.cross, 0.0)

    def _drop(self, key: str) -> None:
        row = list(self.processes).index(key)
        del self.processes[key]
        self.gram = np.delete(np.delete(self.gram, row, 0), row, 1)
        self.noise = np.delete(np.delete(self.noise, row, 0), row, 1)
        self.cross = np.delete(self.cross, row)
        self._fit = None

    # --- the fit -------------------------------------------------------------------------------

    def fit(self) -> _Fit:
        """Every process's active power from the windows so far (computed once per window):
        a process with :data:`MIN_SOLO_S` of engine time alone has it from those windows; the
        others by the fit, with those fixed."""
        if self._fit is not None:
            return self._fit
        size = len(self.processes)
        pooled_w = self._pooled_w()
        solo = np.array([sum(p.solo_s) >= MIN_SOLO_S for p in self.processes.values()])
        power_w = np.zeros(size)
        stderr_w = np.zeros(size)
        for row, process in enumerate(self.processes.values()):
            if solo[row]:
                power_w[row], stderr_w[row] = process.solo_power()
        data = self.gram - self.noise
        free = ~solo
        if free.any():
            power_w[free], stderr_w[free] = self._fit_free(data, free, power_w, pooled_w)
        data_values, data_vectors = np.linalg.eigh(data)
        floor = 1e-9 * max(float(data_values.max(initial=0.0)), 1e-300)
        information = 1.0 / (data_vectors**2 / np.maximum(data_values, floor)).sum(axis=1)
        independence = information / np.maximum(np.diag(data), floor)
        engine_s = np.array([p.engine_s for p in self.processes.values()])
        identified = solo | (
            (self.windows >= MIN_WINDOWS)
            & (independence >= MIN_INDEPENDENCE)
            & (engine_s >= MIN_SOLO_S)
            & (stderr_w <= MAX_RELATIVE_STDERR * np.maximum(power_w, pooled_w))
            & (power_w >= MIN_STDERRS_ABOVE_ZERO * stderr_w)
        )
        for row, process in enumerate(self.processes.values()):
            if identified[row]:
                process.learned = Learned(float(power_w[row]), float(stderr_w[row]))
        self._fit = _Fit(power_w, stderr_w, identified, pooled_w)
        return self._fit

    def _fit_free(
        self, data: Floats, free: npt.NDArray[np.bool_], power_w: Floats, pooled_w: float
    ) -> tuple[Floats, Floats]:
        """The non-negative fit of the processes not known from their solo windows, with the
        known ones' power fixed: (power, standard error) of each free one."""
        known = ~free
        gram = data[np.ix_(free, free)]
        ridge = RIDGE * np.maximum(np.diag(self.gram)[free], 1e-12)  # each process's own scale
        values, vectors = np.linalg.eigh(gram + np.diag(ridge))
        values = np.maximum(values, float(ridge.min()) / 2)
        rhs = self.cross[free] - data[np.ix_(free, known)] @ power_w[known] + ridge * pooled_w
        scaled = np.sqrt(values)
        found = nnls(scaled[:, None] * vectors.T, (vectors.T @ rhs) / scaled)[0]
        everything = power_w.copy()
        everything[free] = found
        rss = float(
            self.energy_sq - 2 * everything @ self.cross + everything @ self.gram @ everything
        )
        sigma2 = max(rss, 0.0) / max(self.windows - len(found), 1.0)
        return found, np.sqrt(sigma2 * (vectors**2 / values).sum(axis=1))

    # --- splitting a tick ----------------------------------------------------------------------

    def split(
        self,
        overlaps: list[tuple[float, ProcessWindow]],
        active_j: float,
        targets: dict[str, str],
    ) -> list[ProcessEnergy]:
        """Share ``active_j`` among the processes of the windows overlapping a tick, each
        given with the seconds of it that the window covers."""
        names, engine, variance = _tick_engine(overlaps)
        power_w, stderr_w, how = self._powers(names)
        weights = engine
        if "power" in how and active_j > 0:
            error_j2 = self._error(engine, variance, power_w, active_j)
            weights = power_w * _corrected(engine, variance, power_w, active_j, error_j2)
            if weights.sum() <= 0:
                weights, how = engine, ["time"] * len(names)
        total = float(weights.sum())
        found = []
        for row, key in enumerate(names):
            if engine[row] <= 0 and weights[row] <= 0:
                continue
            process = self.processes.get(key)
            target = targets.get(key) or (process.target if process is not None else key)
            energy_j = active_j * float(weights[row]) / total if total > 0 else 0.0
            found.append(
                ProcessEnergy(
                    key, target, energy_j, how[row], float(power_w[row]), float(stderr_w[row])
                )
            )
        return found

    def _powers(self, names: list[str]) -> tuple[Floats, Floats, list[Split]]:
        """Each process's active power for a split, its standard error, and whether it was
        learned (else the fit's common figure, with the time split as its label)."""
        fit = self.fit() if self.processes else None
        rows = {key: row for row, key in enumerate(self.processes)}
        powers = np.zeros(len(names))
        stderrs = np.zeros(len(names))
        how: list[Split] = []
        for column, key in enumerate(names):
            process = self.processes.get(key)
            row = rows.get(key)
            if fit is not None and row is not None and fit.identified[row]:
                powers[column], stderrs[column] = fit.power_w[row], fit.stderr_w[row]
                how.append("power")
            elif process is not None and process.learned is not None:
                powers[column] = process.learned.power_w
                stderrs[column] = process.learned.stderr_w
                how.append("power")
            elif fit is not None and row is not None:  # not told apart: the fit's figure
                powers[column], stderrs[column] = fit.power_w[row], fit.stderr_w[row]
                how.append("time")
            else:
                powers[column] = fit.pooled_w if fit is not None else 0.0
                how.append("time")
        return powers, stderrs, how

    def _error(self, engine: Floats, variance: Floats, power_w: Floats, active_j: float) -> float:
        """Variance (J²) of a tick's energy about what its true engine times would give: the
        part of the squared innovation (energy − predicted) that the draws do not explain,
        smoothed over ticks (:data:`TICK_MEMORY`), per second² of the tick's engine time; at
        least :data:`RESIDUAL_FLOOR`. Learned as it goes, since it depends on how the driver
        reads power as much as on the model."""
        seconds = float(engine.sum())
        if seconds <= 0:
            return 0.0
        spread_j2 = float(power_w @ variance @ power_w)
        innovation_j = active_j - float(power_w @ engine)
        excess_w2 = (innovation_j**2 - spread_j2) / seconds**2
        self.model_error_w2 += TICK_MEMORY * (excess_w2 - self.model_error_w2)
        floor_w = max(RESIDUAL_FLOOR * self._pooled_w(), 1.0)
        return max(self.model_error_w2, floor_w**2) * seconds**2

    # --- checkpoints ---------------------------------------------------------------------------

    def state(self) -> PowersState:
        """The sums and each process's recent share and learned figure."""
        return PowersState(
            processes=[
                ProcessState(
                    key,
                    p.target,
                    p.recent_share,
                    p.seen_us,
                    None if p.learned is None else (p.learned.power_w, p.learned.stderr_w),
                    (p.solo_w, p.solo_s, p.engine_s),
                )
                for key, p in self.processes.items()
            ],
            gram=Packed.of(self.gram.ravel()),
            noise=Packed.of(self.noise.ravel()),
            cross=Packed.of(self.cross),
            sums=(self.energy_sq, self.model_error_w2, self.windows, self.energy_j, self.engine_s),
        )

    @classmethod
    def restore(cls, saved: PowersState) -> ProcessPowers:
        powers = cls()
        for process in saved.processes[:MAX_PROCESSES]:
            learned = process.learned
            solo_w, solo_s, engine_s = process.solo
            powers.processes[process.key] = _Process(
                process.target,
                process.recent_share,
                process.seen_us,
                None if learned is None else Learned(*learned),
                solo_w[-SOLO_WINDOWS:],
                solo_s[-SOLO_WINDOWS:],
                engine_s,
            )
        size = len(powers.processes)
        powers.gram = _matrix(saved.gram, size)
        powers.noise = _matrix(saved.noise, size)
        powers.cross = saved.cross.array()[:size]
        powers.energy_sq, powers.model_error_w2, powers.windows, powers.energy_j = saved.sums[:4]
        powers.engine_s = saved.sums[4]
        return powers


def _tick_engine(
    overlaps: list[tuple[float, ProcessWindow]],
) -> tuple[list[str], Floats, Floats]:
    """The processes of the windows overlapping a tick, their engine times in it and the
    covariance of those times from the windows' draws (each window's, × the seconds of it in
    the tick, squared)."""
    keys: dict[str, int] = {}
    for _, window in overlaps:
        for key in (*window.shares, *window.noise):
            keys.setdefault(key, len(keys))
    engine = np.zeros(len(keys))
    variance = np.zeros((len(keys), len(keys)))
    for seconds, window in overlaps:
        for key, share in window.shares.items():
            engine[keys[key]] += share * seconds
        if window.noise and window.samples > 0:
            rows = [keys[key] for key in window.noise]
            drawn = np.fromiter(window.noise.values(), dtype=np.float64)
            variance[np.ix_(rows, rows)] += _draws(drawn, window.samples) * seconds**2
    return list(keys), engine, variance


def _draws(shares: Floats, samples: float) -> Floats:
    """The covariance of shares of a window from ``samples`` draws of who held the engine,
    each sample's busy part going to the one process it names (multinomial)."""
    busy = float(shares.sum())
    return (busy * np.diag(shares) - np.outer(shares, shares)) / samples


def _corrected(
    engine: Floats, variance: Floats, power_w: Floats, active_j: float, error_j2: float
) -> Floats:
    """The engine times corrected towards those that explain ``active_j``: the minimum-variance
    update of ``engine`` (covariance ``variance``) by the measurement ``power_w · engine =
    active_j`` (error variance ``error_j2``), never below zero (a process that would go below
    is held at zero and the others updated again)."""
    free = np.ones(len(engine), dtype=bool)
    corrected = engine
    for _ in range(len(engine)):
        prior = np.where(free, engine, 0.0)
        spread = (variance * np.outer(free, free)) @ power_w
        gain = spread / (power_w @ spread + error_j2)
        corrected = prior + gain * (active_j - power_w @ prior)
        negative = free & (corrected < 0)
        if not negative.any():
            break
        free &= ~negative
    return np.where(free, np.maximum(corrected, 0.0), 0.0)


def _grown(matrix: Floats, size: int) -> Floats:
    grown = np.zeros((size, size))
    old = matrix.shape[0]
    grown[:old, :old] = matrix
    return grown


def _matrix(packed: Packed, size: int) -> Floats:
    values = packed.array()
    if len(values) != size * size:
        return np.zeros((size, size))
    return values.reshape(size, size)
