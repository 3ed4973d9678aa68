"""SmartWatts' power models: sample and error windows, fitting and prediction.

A model maps a socket's hardware counters to its RAPL power. Two kinds:

- in ``compat`` mode, SmartWatts 2.4.1's: one :class:`PowerModel` per frequency layer (the
  package running near one frequency), learned from a window of (counters, RAPL power) samples
  with scikit-learn's ``ElasticNet(positive=True)`` on the raw counters, with an intercept only
  once the window is full, and relearned when the window of recent errors says it drifted, so
  that its numbers can be reproduced;
- in the default mode, one :class:`FrequencyModel` per socket and scope for every frequency,
  with terms in the frequency, fitted by non-negative least squares on tick-to-tick differences
  with everything learned kept (its docstring says why).

scikit-learn or SciPy is imported when the service starts (see :func:`load_regression`).
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from wattflow.actors.checkpoints import Packed
from wattflow.formats.errors import WattflowError

FloatArray = npt.NDArray[np.float64]

ErrorMethod = Literal["median", "mean"]


@dataclass(frozen=True, slots=True)
class Relearning:
    """When a layer's model is learned again, and which models are kept: one scope's settings."""

    max_intercept_w: float
    """A model whose intercept (idle power) is not under this (the TDP) is discarded."""
    error_threshold_w: float
    """The model is learned again once its window of errors sums up above this."""
    error_method: ErrorMethod
    """How the window of errors is summed up."""


class Previous(msgspec.Struct, frozen=True):
    """The last sample already in a :class:`FrequencyModel`'s equations."""

    features: Packed
    power: float


class ModelState(msgspec.Struct, kw_only=True, frozen=True):
    """A model and its windows, as a checkpoint keeps them (floats to the bit); the fields
    after ``events`` are a :class:`FrequencyModel`'s, left at their defaults in compat mode."""

    frequency: int
    samples: Packed | None
    """The sample window's rows (``None``: empty, as the states before versions said)."""
    powers: Packed
    errors: Packed
    coef: Packed | None
    intercept: float
    hash: str
    id: int
    events: tuple[str, ...]
    information: Packed | None = None
    moment: Packed | None = None
    count: float = 0.0
    pending: Packed | None = None
    pending_powers: Packed | None = None
    previous: Previous | None = None


class PowerModel:
    """One frequency layer's model and the windows it is learned from, as SmartWatts 2.4.1 has
    them (compat mode); :class:`FrequencyModel` builds the default mode's on its windows."""

    __slots__ = (
        "coef",
        "compat",
        "errors",
        "events",
        "frequency",
        "hash",
        "id",
        "intercept",
        "min_samples",
        "powers",
        "samples",
        "sorted_errors",
        "window",
    )

    def __init__(
        self,
        frequency: int,
        *,
        min_samples: int,
        history_window: int,
        error_window: int,
        compat: bool,
    ) -> None:
        self.frequency = frequency
        self.min_samples = min_samples
        self.window = history_window
        self.compat = compat
        self.samples: deque[list[float]] = deque(maxlen=history_window)
        self.powers: deque[float] = deque(maxlen=history_window)
        self.errors: deque[float] = deque(maxlen=error_window)
        self.sorted_errors: list[float] | None = []
        """The error window in order, kept as errors come and go (``None`` after a NaN)."""
        self.coef: FloatArray | None = None
        self.intercept = 0.0
        self.hash = "uninitialized"
        self.id = 0
        self.events: tuple[str, ...] = ()

    @property
    def fitted(self) -> bool:
        """Whether a model has been accepted yet."""
        return self.coef is not None

    def use_events(self, events: tuple[str, ...]) -> None:
        """Start over when the counters the sensor reports change: old samples no longer fit."""
        if events != self.events:
            self.events = events
            self.samples.clear()
            self.powers.clear()
            self.clear_errors()
            self.coef = None
            self.intercept = 0.0
            self.hash = "uninitialized"

    def store(self, power_w: float, features: list[float]) -> None:
        """Add a (counters, reference power) sample to the learning window."""
        self.samples.append(features)
        self.powers.append(power_w)

    def first_fit(self, power_w: float, features: list[float], max_intercept_w: float) -> bool:
        """The step of a layer that has no model yet: store the sample and learn (the sample
        stays in the window either way), then start a new error window. Whether a model was
        accepted, which can then predict this very sample."""
        self.store(power_w, features)
        learned = self.learn(max_intercept_w)
        self.clear_errors()
        return learned

    def track(
        self,
        power_w: float,
        features: list[float],
        predicted_w: float,
        relearning: Relearning,
        *,
        stored: bool,
    ) -> float:
        """The rest of a step, once the model predicted ``predicted_w`` for the sample: store
        the sample (unless :meth:`first_fit` already did) and its error, and relearn when the
        window of errors says the model drifted. Returns the error in W."""
        error_w = abs(power_w - predicted_w)
        if not stored:
            self.store(power_w, features)
        self.store_error(error_w)
        if self.drifted(relearning):
            self.relearn(relearning.max_intercept_w)
        return error_w

    def drifted(self, relearning: Relearning) -> bool:
        """Whether the error window says the model drifted: its median (or mean) is over the
        threshold, however few errors it holds, as in SmartWatts."""
        return self.window_error(relearning.error_method) > relearning.error_threshold_w

    def store_error(self, error: float) -> None:
        """Add one tick's |reference − predicted| to the error window."""
        ordered = self.sorted_errors
        if ordered is not None:
            if math.isnan(error):
                self.sorted_errors = ordered = None
            else:
                if len(self.errors) == self.errors.maxlen:
                    del ordered[bisect.bisect_left(ordered, self.errors[0])]
                bisect.insort(ordered, error)
        self.errors.append(error)

    def clear_errors(self) -> None:
        """Start a new error window."""
        self.errors.clear()
        self.sorted_errors = []

    def window_error(self, method: ErrorMethod) -> float:
        """The error window's median or mean, which decides when to relearn.

        The median is :func:`statistics.median`'s, read from the window kept in order, since
        sorting it again on every tick of every socket and scope costs more than the rest.
        """
        if method == "mean":
            return statistics.fmean(self.errors)
        ordered = self.sorted_errors
        if ordered is None:
            return statistics.median(self.errors)
        middle = len(ordered) // 2
        if len(ordered) % 2:
            return ordered[middle]
        return (ordered[middle - 1] + ordered[middle]) / 2

    def relearn(self, max_intercept_w: float) -> None:
        """Learn from the sample window, then start a new error window, as SmartWatts does.

        A model whose intercept is negative or not under ``max_intercept_w`` (the TDP) is
        discarded and the previous one kept.
        """
        self.learn(max_intercept_w)
        self.clear_errors()

    def learn(self, max_intercept_w: float) -> bool:
        """Fit a model on the sample window; whether it was accepted."""
        if len(self.samples) < self.min_samples:
            return False
        x = np.asarray(self.samples, dtype=np.float64)
        y = np.asarray(self.powers, dtype=np.float64)
        coef, intercept = _fit_elastic_net(x, y, fit_intercept=len(y) == self.window)
        return self.accept(coef, intercept, max_intercept_w)

    def accept(self, coef: FloatArray, intercept: float, max_intercept_w: float) -> bool:
        """Take a fitted model unless its intercept is negative or not under the TDP, or, but in
        compat mode, its coefficients are all zero (it would give every target 0 W, whatever
        the counters, and their powers would no longer add up to the measured one)."""
        if not 0.0 <= intercept < max_intercept_w or not (self.compat or coef.any()):
            return False
        self.coef = coef
        self.intercept = intercept
        self.id += 1
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"{self.frequency}:{self.id}:{intercept!r}:".encode())
        digest.update(coef.tobytes())
        self.hash = digest.hexdigest()
        return True

    def state(self) -> ModelState:
        """The model and its windows, for a checkpoint."""
        return ModelState(
            frequency=self.frequency,
            samples=Packed.of(self.samples),
            powers=Packed.of(self.powers),
            errors=Packed.of(self.errors),
            coef=None if self.coef is None else Packed.of(self.coef),
            intercept=self.intercept,
            hash=self.hash,
            id=self.id,
            events=self.events,
        )

    def restore(self, state: ModelState) -> None:
        """Take back what :meth:`state` gave, on a new model (the windows keep their
        lengths)."""
        self.events = state.events
        self.samples.extend([] if state.samples is None else state.samples.values())
        self.powers.extend(state.powers.values())
        self.errors.extend(state.errors.values())
        errors = list(self.errors)
        self.sorted_errors = None if any(map(math.isnan, errors)) else sorted(errors)
        self.coef = None if state.coef is None else state.coef.array()
        self.intercept = state.intercept
        self.hash = state.hash
        self.id = state.id


class FrequencyModel(PowerModel):
    """The default mode's model: one per socket and scope, for every package frequency.

    A package runs at many frequencies (DVFS moves it between P-states as the load changes, and
    a tick that switched reads between two), and learning each frequency layer from nothing
    leaves the targets without estimates for ten ticks at each new one. One model covers them
    all. Where the scope's power follows the cores' voltage (the package's: switching energy per
    event grows with V², and V with f), each counter rate ``r`` is a feature twice, as ``r`` and
    as ``r · (f / f_base)²`` (:func:`frequency_features`), and a target's power at frequency f
    is ``Σ r · (a + b · (f / f_base)²)``; the DRAM's energy per access does not depend on the
    cores' frequency, and its model takes the rates alone.

    Only differences from tick to tick are fitted: the change of the socket's power against the
    change of its counters. What no counter explains (idle power, leakage that follows the
    package's temperature, I/O) drifts slowly and cancels out of a difference, where it would
    otherwise be read as power of whichever counter happened to move with it. Loads that change
    together (a workload phase) make the biggest differences, and the most informative ones.

    Every difference is kept, in the normal equations of the least-squares problem (``X'X`` and
    ``X'y``), from the first sample on: within a phase the counters barely vary and say little,
    and what earlier phases said is still there. The solution is non-negative least squares on
    those equations, scaled to unit diagonal, with a small ridge towards the previous model, so
    that a direction the data do not determine stays where it was instead of drifting. It is
    solved again every ``min_samples`` samples until a window of samples is in; then once the
    samples since the last fit number a window or a quarter of those before, whichever is more
    (at most ten windows): the more it holds, the less one window more changes it. The
    intercept (idle power) is the mean of what the window of samples leaves unexplained. When
    the error window says the model drifted (a new kind of workload: the same counters cost
    other energy), what was learned before counts :data:`DRIFT_DISCOUNT` as much, so that new
    differences take over.
    """

    __slots__ = (
        "base_mhz",
        "count",
        "information",
        "moment",
        "pending",
        "pending_powers",
        "previous",
    )

    def __init__(
        self, base_mhz: int, *, min_samples: int, history_window: int, error_window: int
    ) -> None:
        super().__init__(
            0,
            min_samples=min_samples,
            history_window=history_window,
            error_window=error_window,
            compat=False,
        )
        self.base_mhz = base_mhz
        self.information: FloatArray | None = None
        """``X'X`` of every difference so far, discounted at each drift."""
        self.moment: FloatArray | None = None
        """``X'y`` of the same."""
        self.count = 0.0
        """How many differences they hold, discounted as they are."""
        self.pending: list[list[float]] = []
        """The samples since the last fit, whose differences are not yet in the equations."""
        self.pending_powers: list[float] = []
        self.previous: tuple[list[float], float] | None = None
        """The last sample already in the equations: the next one's difference is from it."""

    def use_events(self, events: tuple[str, ...]) -> None:
        if events != self.events:
            super().use_events(events)
            self.information = self.moment = self.previous = None
            self.pending = []
            self.pending_powers = []
            self.count = 0.0

    def store(self, power_w: float, features: list[float]) -> None:
        super().store(power_w, features)
        self.pending.append(features)
        self.pending_powers.append(power_w)

    def track(
        self,
        power_w: float,
        features: list[float],
        predicted_w: float,
        relearning: Relearning,
        *,
        stored: bool,
    ) -> float:
        error_w = super().track(power_w, features, predicted_w, relearning, stored=stored)
        if len(self.pending) >= self._refine_every():
            self.learn(relearning.max_intercept_w)
        return error_w

    def state(self) -> ModelState:
        previous = self.previous
        return msgspec.structs.replace(
            super().state(),
            information=None if self.information is None else Packed.of(self.information),
            moment=None if self.moment is None else Packed.of(self.moment),
            count=self.count,
            pending=Packed.of(self.pending),
            pending_powers=Packed.of(self.pending_powers),
            previous=None if previous is None else Previous(Packed.of(previous[0]), previous[1]),
        )

    def restore(self, state: ModelState) -> None:
        super().restore(state)
        self.information = None if state.information is None else state.information.array()
        self.moment = None if state.moment is None else state.moment.array()
        self.count = state.count
        self.pending = [] if state.pending is None else state.pending.values()
        self.pending_powers = [] if state.pending_powers is None else state.pending_powers.values()
        previous = state.previous
        self.previous = None if previous is None else (previous.features.values(), previous.power)

    def drifted(self, relearning: Relearning) -> bool:
        """As SmartWatts judges it, but only on a full error window.

        Judged on the few errors since the last relearning, as SmartWatts does, one tick off by
        more than the threshold is a drift: what was learned is discounted again, and again on
        the next tick if it is off too. A socket whose power no counter explains moves by more
        than the threshold now and then (leakage stepping with the P-state, a package warming
        up) would lose, tick after tick, everything its model learned: on a crowded socket a
        few such ticks in a row leave the model with a thousandth of its past, learning from
        nothing again. A full window's median (or mean) says whether the model drifted, not a
        tick's noise.
        """
        over = super().drifted(relearning)  # judged every step, as before: where it decides
        return over and len(self.errors) == self.errors.maxlen

    def track_run(
        self,
        powers_w: list[float],
        feature_rows: list[list[float]],
        predicted_w: list[float],
        relearning: Relearning,
    ) -> list[float]:
        """:meth:`track` for a run of samples at once, as far as it leaves the model as it is:
        up to the sample that would make it solved again or judge it drifted, which is left
        to :meth:`track`. Returns the errors of the samples taken (none: take them one by one).

        A replayed recording hands on thousands of ticks at a time, and between two solves
        a step only stores its sample and its error; the error window's medians of a run are
        then one numpy call instead of a sorted insertion and a comparison per tick. The
        models' windows and every figure are those :meth:`track` gives, to the last bit.
        """
        if relearning.error_method != "median" or self.sorted_errors is None:
            return []
        room = self._refine_every() - len(self.pending) - 1  # the last sample before a solve
        if room <= 0:
            return []
        errors = [
            abs(power - predicted)
            for power, predicted in zip(powers_w[:room], predicted_w, strict=False)
        ]
        if any(error != error for error in errors):  # NaN: the window is judged as SmartWatts'
            return []
        taken = self._before_drift(errors, relearning.error_threshold_w)
        if taken == 0:
            return []
        errors = errors[:taken]
        self.samples.extend(feature_rows[:taken])
        self.powers.extend(powers_w[:taken])
        self.pending.extend(feature_rows[:taken])
        self.pending_powers.extend(powers_w[:taken])
        self.errors.extend(errors)
        self.sorted_errors = sorted(self.errors)
        return errors

    def _before_drift(self, errors: list[float], threshold_w: float) -> int:
        """How many of ``errors`` can join the error window before a full window's median is
        over ``threshold_w`` (:meth:`drifted`): all of them when none is."""
        size = self.errors.maxlen or 0
        held = len(self.errors)
        first_full = max(0, size - held - 1)  # the first new error that fills the window
        if first_full >= len(errors):
            return len(errors)
        every = [*self.errors, *errors]
        # A window's median is over the threshold only if half its errors are: mostly, not
        # even half of all of them are, and no window needs looking at.
        if 2 * sum(error > threshold_w for error in every) < size:
            return len(errors)
        windows = np.lib.stride_tricks.sliding_window_view(np.array(every), size)
        # The window ending at new error i starts at held + i + 1 - size.
        ordered = np.sort(windows[held + first_full + 1 - size :], axis=1)
        middle = size // 2
        medians = ordered[:, middle]
        if size % 2 == 0:  # as statistics.median: (a + b) / 2, to the bit
            medians = (ordered[:, middle - 1] + medians) / 2
        over = (medians > threshold_w).nonzero()[0]
        return first_full + int(over[0]) if over.size else len(errors)

    def _refine_every(self) -> int:
        """How many new samples make the model solved again (see the class's docstring)."""
        if self.count < self.window:
            return self.min_samples
        return max(self.window, min(int(self.count) // 4, 10 * self.window))

    def relearn(self, max_intercept_w: float) -> None:
        if self.information is not None and self.moment is not None:
            self.information *= DRIFT_DISCOUNT
            self.moment *= DRIFT_DISCOUNT
            self.count *= DRIFT_DISCOUNT
        super().relearn(max_intercept_w)

    def learn(self, max_intercept_w: float) -> bool:
        if len(self.samples) < self.min_samples or not self._gather():
            return False
        assert self.information is not None
        assert self.moment is not None
        coef = _solve_ridge_nnls(self.information, self.moment, self.coef, RIDGE / self.count)
        unexplained = np.asarray(self.powers) - dynamic_power(np.asarray(self.samples), coef)
        return self.accept(coef, max(float(unexplained.mean()), 0.0), max_intercept_w)

    def _gather(self) -> bool:
        """Add the pending samples' differences to the normal equations; whether they hold
        any difference."""
        if self.pending:
            samples, powers_w = self.pending, self.pending_powers
            if self.previous is not None:
                samples = [self.previous[0], *samples]
                powers_w = [self.previous[1], *powers_w]
            self.previous = (self.pending[-1], self.pending_powers[-1])
            self.pending, self.pending_powers = [], []
            changes = np.diff(np.asarray(samples, dtype=np.float64), axis=0)
            powers = np.diff(np.asarray(powers_w, dtype=np.float64))
            self.count += len(powers)
            information = changes.T @ changes
            moment = changes.T @ powers
            if self.information is None or self.moment is None:
                self.information, self.moment = information, moment
            else:
                self.information += information
                self.moment += moment
        return self.information is not None


DRIFT_DISCOUNT = 0.1
"""What a :class:`FrequencyModel` keeps of its past when its error window says it drifted."""

RIDGE = 1e-2
"""The ridge towards the previous model, as many differences' worth of each feature's own
information: it settles what the data leave open, and fades as they accumulate."""


def _solve_ridge_nnls(
    information: FloatArray, moment: FloatArray, previous: FloatArray | None, ridge: float
) -> FloatArray:
    """Non-negative ``θ`` minimising ``θ'Aθ − 2θ'b + ρ‖D(θ − θ₀)‖²``, ``D² = diag(A)``.

    Scaled to a unit diagonal, the problem is ``‖L'u − L⁻¹c‖²`` with ``LL'`` the Cholesky factor
    of ``A/dd' + ρI`` and ``c = b/d + ρ·dθ₀``: an NNLS problem as small as the features.
    """
    from scipy.linalg import solve_triangular
    from scipy.optimize import nnls

    scale = np.sqrt(np.diag(information))
    scale[scale == 0.0] = 1.0
    size = len(scale)
    system = information / np.outer(scale, scale) + ridge * np.eye(size)
    target = moment / scale
    if previous is not None and len(previous) == size:
        target = target + ridge * previous * scale
    lower = np.linalg.cholesky(system)
    solution, _ = nnls(lower.T, solve_triangular(lower, target, lower=True, check_finite=False))
    return np.asarray(solution / scale, dtype=np.float64)


def frequency_features(
    rows: FloatArray, frequency_mhz: int | npt.NDArray[np.int64], base_mhz: int
) -> FloatArray:
    """Rows of counter rates with each rate again times ``(f / f_base)²``: the features of a
    :class:`FrequencyModel`. ``frequency_mhz`` is one frequency for every row, or one per row.

    The same arithmetic either way (a ratio, squared by a product), so that a tick's features
    are the same to the last bit whether its rows come one by one or a frame at a time.
    """
    ratio = np.divide(frequency_mhz, base_mhz, dtype=np.float64)
    square = ratio * ratio
    scaled = rows * (square[:, None] if square.ndim else square)
    return np.concatenate([rows, scaled], axis=-1)


def dynamic_power(features: FloatArray, coef: FloatArray) -> FloatArray:
    """The model's power without its intercept, one value per row of ``features``.

    Written as a row-wise sum of products rather than a matrix product: a row's result then
    does not depend on how many rows are computed at once (BLAS may order a dot product
    differently for other shapes), so a tick estimated alone and a tick estimated among
    thousands give the same watts to the last bit.
    """
    result: FloatArray = (features * coef).sum(axis=-1)
    return result


def _fit_elastic_net(
    x: FloatArray, y: FloatArray, *, fit_intercept: bool
) -> tuple[FloatArray, float]:
    """SmartWatts 2.4.1's regression, parameter for parameter."""
    import warnings

    from sklearn.linear_model import ElasticNet

    model = ElasticNet(fit_intercept=fit_intercept, positive=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SmartWatts silences convergence warnings too
        model.fit(x, y)
    return np.asarray(model.coef_, dtype=np.float64), float(model.intercept_)


def load_regression(compat: bool) -> None:
    """Import the regression library now, at start-up.

    scikit-learn takes about a second to import and SciPy about a fifth of one. Imported on the
    first fit they would stall the stream (and backpressure the sensors) for that long; imported
    in the background they would take that time from the first reports on a busy core.
    """
    if compat:
        try:
            importlib.import_module("sklearn.linear_model")
        except ImportError as error:
            raise WattflowError(
                "--compat smartwatts-2.4 fits SmartWatts' own regression, scikit-learn's "
                f"ElasticNet, which is not installed ({error}): pip install 'wattflow[compat]'"
            ) from None
    else:
        importlib.import_module("scipy.optimize")
        importlib.import_module("scipy.linalg")


class FrequencyLayers:
    """The models of one (scope, socket): one per frequency layer, created when first used.

    SmartWatts' layers are the multiples of the base clock from 1 to 100 times it; a tick's layer
    is the highest one at or under the package frequency. In compat mode each layer has its own
    model, as in SmartWatts; in the default mode one :class:`FrequencyModel` serves them all,
    with terms in the frequency when ``frequency_terms`` says the scope's power has them.
    """

    def __init__(
        self,
        *,
        base_clock: int,
        min_samples: int,
        history_window: int,
        error_window: int,
        compat: bool,
        base_mhz: int = 2100,
        frequency_terms: bool = False,
    ) -> None:
        self.base_clock = base_clock
        self.base_mhz = base_mhz
        self.frequency_terms = frequency_terms and not compat
        self.min_samples = min_samples
        self.history_window = history_window
        self.error_window = error_window
        self.compat = compat
        self.models: dict[int, PowerModel] = {}

    def state(self) -> list[ModelState]:
        """Every layer's model, for a checkpoint."""
        return [model.state() for model in self.models.values()]

    def restore(self, state: Iterable[ModelState]) -> None:
        """Take back what :meth:`state` gave, on new layers."""
        for saved in state:
            model = self.model(max(saved.frequency, self.base_clock) if self.compat else 0)
            model.restore(saved)
            self.models[saved.frequency] = model

    def layer_frequency(self, package_frequency: int) -> int:
        """The layer a package frequency (MHz) falls in."""
        ratio = min(max(package_frequency // self.base_clock, 1), 100)
        return ratio * self.base_clock

    def features(self, rows: FloatArray, package_frequency: npt.NDArray[np.int64]) -> FloatArray:
        """The features the models take from a socket's rows of counters, each row at its own
        package frequency: with the frequency terms of :func:`frequency_features` where the
        scope has them (the package's power, in the default mode), the rows themselves
        otherwise."""
        if not self.frequency_terms:
            return rows
        return frequency_features(rows, package_frequency, self.base_mhz)

    def model(self, package_frequency: int) -> PowerModel:
        """The model of the layer ``package_frequency`` falls in (in the default mode, the one
        model of every layer)."""
        frequency = self.layer_frequency(package_frequency) if self.compat else 0
        found = self.models.get(frequency)
        if found is None and not self.compat:
            found = self.models[frequency] = FrequencyModel(
                self.base_mhz,
                min_samples=self.min_samples,
                history_window=self.history_window,
                error_window=self.error_window,
            )
        elif found is None:
            found = self.models[frequency] = PowerModel(
                frequency,
                min_samples=self.min_samples,
                history_window=self.history_window,
                error_window=self.error_window,
                compat=self.compat,
            )
        return found
