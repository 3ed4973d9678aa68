"""SmartWatts' per-frequency-layer power models: sample and error windows, fitting and prediction.

A layer's model maps a socket's hardware counters to its RAPL power while the package runs near
one frequency. It is learned from a window of (counters, RAPL power) samples and relearned when the
window of recent errors says it drifted. Two ways to fit it:

- ``compat`` mode fits what SmartWatts 2.4.1 fits, scikit-learn's ``ElasticNet(positive=True)``
  on the raw counters, with an intercept only once the sample window is full, so that its numbers
  can be reproduced;
- the default mode solves the non-negative least-squares problem directly on counters scaled to
  unit range, with the intercept (the socket's idle power) as one more non-negative unknown from
  the first fit on. The raw counters span ten orders of magnitude, and coordinate descent on them
  stops far from the optimum; scaled NNLS finds it, and costs tens of microseconds, so relearning
  never slows the stream.

scikit-learn or SciPy is imported when the service starts (see :func:`load_regression`).
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

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


class PowerModel:
    """One frequency layer's model and the windows it is learned from."""

    __slots__ = (
        "coef",
        "coef_text",
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
        self.coef_text = ""
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
        if self.window_error(relearning.error_method) > relearning.error_threshold_w:
            self.relearn(relearning.max_intercept_w)
        return error_w

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
        if self.compat:
            coef, intercept = _fit_elastic_net(x, y, fit_intercept=len(y) == self.window)
        else:
            coef, intercept = _fit_scaled_nnls(x, y)
        if not 0.0 <= intercept < max_intercept_w:
            return False
        self.coef = coef
        self.coef_text = str(coef)  # as SmartWatts writes it; formatting it per tick is slow
        self.intercept = intercept
        self.id += 1
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"{self.frequency}:{self.id}:{intercept!r}:".encode())
        digest.update(coef.tobytes())
        self.hash = digest.hexdigest()
        return True

    def predict(self, features: FloatArray) -> FloatArray:
        """Raw power predictions, intercept included, one per row of ``features``."""
        assert self.coef is not None
        return dynamic_power(features, self.coef) + self.intercept


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


def _fit_scaled_nnls(x: FloatArray, y: FloatArray) -> tuple[FloatArray, float]:
    """Non-negative least squares with a non-negative intercept, on unit-range columns."""
    from scipy.optimize import nnls

    scale = np.abs(x).max(axis=0)
    scale[scale == 0.0] = 1.0
    design = np.empty((x.shape[0], x.shape[1] + 1))
    design[:, :-1] = x / scale
    design[:, -1] = 1.0
    solution, _ = nnls(design, y)
    return solution[:-1] / scale, float(solution[-1])


def load_regression(compat: bool) -> None:
    """Import the regression library now, at start-up.

    scikit-learn takes about a second to import and SciPy about a fifth of one. Imported on the
    first fit they would stall the stream (and backpressure the sensors) for that long; imported
    in the background they would take that time from the first reports on a busy core.
    """
    importlib.import_module("sklearn.linear_model" if compat else "scipy.optimize")


class FrequencyLayers:
    """The models of one (scope, socket): one per frequency layer, created when first used.

    SmartWatts' layers are the multiples of the base clock from 1 to 100 times it; a tick's layer
    is the highest one at or under the package frequency.
    """

    def __init__(
        self,
        *,
        base_clock: int,
        min_samples: int,
        history_window: int,
        error_window: int,
        compat: bool,
    ) -> None:
        self.base_clock = base_clock
        self.min_samples = min_samples
        self.history_window = history_window
        self.error_window = error_window
        self.compat = compat
        self.models: dict[int, PowerModel] = {}

    def layer_frequency(self, package_frequency: int) -> int:
        """The layer a package frequency (MHz) falls in."""
        ratio = min(max(package_frequency // self.base_clock, 1), 100)
        return ratio * self.base_clock

    def model(self, package_frequency: int) -> PowerModel:
        """The model of the layer ``package_frequency`` falls in."""
        frequency = self.layer_frequency(package_frequency)
        found = self.models.get(frequency)
        if found is None:
            found = self.models[frequency] = PowerModel(
                frequency,
                min_samples=self.min_samples,
                history_window=self.history_window,
                error_window=self.error_window,
                compat=self.compat,
            )
        return found
