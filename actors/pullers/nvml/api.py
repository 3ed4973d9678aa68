"""The one seam between wattflow and NVML: loading the binding, typed errors, and the readers
that cost one C call each.

Everything that talks to the NVIDIA driver (the ``nvml`` input, ``wattflow check``, the
benchmarks) goes through :class:`Nvml` and the readers here, so an NVML error always reaches
the caller as one of the :class:`NvmlError` classes below, named for what a user can do about
it, never as a bare return code. ``pynvml`` is imported when an :class:`Nvml` is made, not
with this module: nodes without GPUs load the registry of inputs without needing the package.

Why the buffer readers are here and not ``pynvml``'s: on recent drivers (Hopper) every NVML
query is a round trip to the GPU's firmware processor during which the calling thread spins,
about 1 ms each for the utilisation buffers on an H100. ``pynvml`` asks each buffer twice, once
for its size and once to fill it; these readers keep one buffer per device and kind, sized once,
and fill it in one call.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import time
from types import ModuleType
from typing import Any, ClassVar

from wattflow.actors.errors import PullError


class NvmlUnavailable(PullError):
    """NVML cannot be used on this node: no driver, no GPU, no permission, or no binding."""


class NvmlError(PullError):
    """An NVML call failed; ``code`` is NVML's return code, ``call`` what was asked."""

    codes: ClassVar[frozenset[int]] = frozenset()
    """The NVML_ERROR_* codes this class stands for (empty: any code no other class takes)."""
    persistent: ClassVar[bool] = False
    """Whether asking again cannot help until something changes on the node."""

    def __init__(self, code: int, call: str, text: str) -> None:
        super().__init__(f"{call}: {text}")
        self.code = code
        self.call = call


class NvmlNotSupported(NvmlError):
    """This GPU or driver does not offer the reading (old GPU, MIG, vGPU, old driver)."""

    codes = frozenset({3, 13})  # NOT_SUPPORTED, FUNCTION_NOT_FOUND
    persistent = True


class NvmlNoPermission(NvmlError):
    """The reading needs more rights than the process has (root, or a device cgroup rule)."""

    codes = frozenset({4})
    persistent = True


class NvmlNotFound(NvmlError):
    """Nothing to answer: no sample newer than the timestamp given, no such process."""

    codes = frozenset({6})


class NvmlGpuLost(NvmlError):
    """The GPU fell off the bus or needs a reset: nothing answers until it is back."""

    codes = frozenset({15, 16, 28})  # GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND


class NvmlTimeout(NvmlError):
    """The driver did not answer in time (a busy or resetting GPU)."""

    codes = frozenset({10, 27})  # TIMEOUT, NOT_READY


class NvmlDriverError(NvmlError):
    """Any other NVML error (UNKNOWN, a driver/library mismatch, an interrupt problem…)."""


_CLASSES: dict[int, type[NvmlError]] = {
    code: kind
    for kind in (NvmlNotSupported, NvmlNoPermission, NvmlNotFound, NvmlGpuLost, NvmlTimeout)
    for code in kind.codes
}

INSUFFICIENT_SIZE = 7
MAX_BUFFER_ENTRIES = 4096
"""Most entries a buffer reader grows to when the driver asks for more: a driver keeps about
a hundred samples per buffer, so this is a bound, not a size ever reached."""


def typed(code: int, call: str, text: str) -> NvmlError:
    """The :class:`NvmlError` class for an NVML return code."""
    return _CLASSES.get(code, NvmlDriverError)(code, call, text)


def describe_init_error(error: NvmlError) -> str:
    """One line saying why NVML did not start and what to look at."""
    if error.code == 12:  # LIBRARY_NOT_FOUND
        return (
            "NVML: no NVIDIA driver found (libnvidia-ml.so.1 not loadable); "
            "is the driver installed?"
        )
    if error.code == 9:  # DRIVER_NOT_LOADED
        return (
            "NVML: the NVIDIA kernel driver is not loaded (libnvidia-ml.so.1 found); "
            "is the nvidia module loaded (lsmod | grep nvidia)?"
        )
    if isinstance(error, NvmlNoPermission):
        return "NVML: no permission to open the NVIDIA devices (/dev/nvidia*)"
    return f"NVML: initialisation failed: {error}"


def load_pynvml() -> ModuleType:
    """The ``pynvml`` module of ``nvidia-ml-py``.

    Raises:
        NvmlUnavailable: when the package is not installed.
    """
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailable(
            "NVML: the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
        ) from None


class Nvml:
    """NVML through ``nvidia-ml-py``, every failure raised as an :class:`NvmlError`."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self.module = module if module is not None else load_pynvml()
        self._open = False

    def error(self, error: Exception, call: str) -> NvmlError:
        """The typed error for an exception of the binding."""
        code = int(getattr(error, "value", 999))
        return typed(code, call, str(error))

    def call(self, function: Any, *args: Any) -> Any:
        """``function(*args)``, a ``pynvml`` function; its NVMLError raised typed."""
        try:
            return function(*args)
        except self.module.NVMLError as error:
            raise self.error(error, function.__name__) from None

    def init(self) -> None:
        """Start NVML.

        Raises:
            NvmlUnavailable: no driver, a driver not loaded, no permission; the message says
                which, in one line.
        """
        try:
            self.call(self.module.nvmlInit)
        except NvmlError as error:
            raise NvmlUnavailable(describe_init_error(error)) from None
        self._open = True

    def shutdown(self) -> None:
        """Stop NVML; safe to call twice. Raises NvmlError when the driver refuses."""
        if self._open:
            self._open = False
            self.call(self.module.nvmlShutdown)

    def function(self, name: str) -> Any:
        """A C entry point of the loaded library (NvmlNotSupported when it lacks it)."""
        try:
            return self.module._nvmlGetFunctionPointer(name)
        except self.module.NVMLError as error:
            raise self.error(error, name) from None

    def mig_enabled(self, handle: Any) -> bool:
        """Whether the GPU runs in MIG mode now (False where the GPU has no MIG)."""
        try:
            current, _pending = self.call(self.module.nvmlDeviceGetMigMode, handle)
        except NvmlNotSupported:
            return False
        return bool(current)


class BufferReader:
    """One of the driver's buffers of one device, read in one C call into a buffer kept
    between calls.

    ``nvmlDeviceGetSamples`` fills as many samples as the buffer holds (the rest wait for the
    next read, newer than the last one taken); ``nvmlDeviceGetProcessUtilization`` answers
    INSUFFICIENT_SIZE with the count it needs, and the buffer grows to it, up to
    ``MAX_BUFFER_ENTRIES``, for this call and the next ones.
    """

    def __init__(self, nvml: Nvml, name: str, entry: type[ctypes.Structure], size: int) -> None:
        self.nvml = nvml
        self.name = name
        self.function = nvml.function(name)
        self.entry = entry
        self.size = size
        self.buffer: Any = (entry * size)()
        self.count = ctypes.c_uint(0)

    def _grow(self, wanted: int) -> bool:
        if wanted <= self.size or self.size >= MAX_BUFFER_ENTRIES:
            return False
        self.size = min(wanted, MAX_BUFFER_ENTRIES)
        self.buffer = (self.entry * self.size)()
        return True

    def _check(self, code: int) -> None:
        if code != 0:
            raise _typed_code(self.nvml, code, self.name)


def _typed_code(nvml: Nvml, code: int, call: str) -> NvmlError:
    """The typed error for a return code of a C entry point called directly."""
    text = nvml.module.nvmlErrorString(code)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return typed(code, call, str(text))


class SampleReader(BufferReader):
    """``nvmlDeviceGetSamples`` of one kind (power, GPU or memory utilisation) on one device."""

    def __init__(self, nvml: Nvml, handle: Any, kind: int, size: int = 256) -> None:
        super().__init__(nvml, "nvmlDeviceGetSamples", nvml.module.c_nvmlSample_t, size)
        self.handle = handle
        self.kind = kind
        self.value_type = ctypes.c_int(0)

    def read(self, since_us: int) -> tuple[int, list[Any]]:
        """(NVML_VALUE_TYPE_* of the values, the samples newer than ``since_us``).

        Raises:
            NvmlNotFound: nothing newer.
            NvmlError: any other failure.
        """
        self.count.value = self.size
        code = self.function(
            self.handle,
            self.kind,
            ctypes.c_ulonglong(since_us),
            ctypes.byref(self.value_type),
            ctypes.byref(self.count),
            self.buffer,
        )
        self._check(code)
        return self.value_type.value, self.buffer[: self.count.value]


class ProcessReader(BufferReader):
    """``nvmlDeviceGetProcessUtilization`` of one device."""

    def __init__(self, nvml: Nvml, handle: Any, size: int = 64) -> None:
        entry = nvml.module.c_nvmlProcessUtilizationSample_t
        super().__init__(nvml, "nvmlDeviceGetProcessUtilization", entry, size)
        self.handle = handle

    def read(self, since_us: int) -> list[Any]:
        """Each process's utilisation over the driver's samples newer than ``since_us``.

        Raises:
            NvmlNotFound: no sample newer (no process used the GPU since then).
            NvmlError: any other failure.
        """
        while True:
            self.count.value = self.size
            code = self.function(
                self.handle, self.buffer, ctypes.byref(self.count), ctypes.c_ulonglong(since_us)
            )
            if code == INSUFFICIENT_SIZE and self._grow(self.count.value):
                continue
            self._check(code)
            answer: list[Any] = self.buffer[: self.count.value]
            return answer


_PLAIN: dict[type[ctypes.Structure], type[ctypes.Structure]] = {}


def plain(structure: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """The same C layout as one of ``pynvml``'s structures, as a plain ``ctypes.Structure``.

    ``pynvml``'s structures decode bytes on every attribute read (a Python
    ``__getattribute__``); the readers that run every tick read numbers only.
    """
    found = _PLAIN.get(structure)
    if found is None:
        found = _PLAIN[structure] = type(
            f"Plain{structure.__name__}", (ctypes.Structure,), {"_fields_": structure._fields_}
        )
    return found


class FieldReader:
    """``nvmlDeviceGetFieldValues`` for a fixed list of fields of one device, into an array
    made once: the power reading of every tick, without ``pynvml``'s array, function lookup
    and structure wrappers on each call."""

    def __init__(self, nvml: Nvml, handle: Any, field_ids: list[int]) -> None:
        self.nvml = nvml
        self.handle = handle
        self.function = nvml.function("nvmlDeviceGetFieldValues")
        self.field_ids = tuple(field_ids)
        self.values: Any = (plain(nvml.module.c_nvmlFieldValue_t) * len(field_ids))()
        self.count = ctypes.c_int32(len(field_ids))
        self.reference = ctypes.byref(self.values)

    def read(self) -> Any:
        """The array of ``nvmlFieldValue_t``, each with its own ``nvmlReturn``.

        Raises:
            NvmlError: the call as a whole failed.
        """
        values = self.values
        for value, field_id in zip(values, self.field_ids, strict=True):
            value.fieldId = field_id  # an input the driver could overwrite: set every call
        code = self.function(self.handle, self.count, self.reference)
        if code != 0:
            raise _typed_code(self.nvml, code, "nvmlDeviceGetFieldValues")
        return values


class UtilizationReader:
    """``nvmlDeviceGetUtilizationRates`` of one device into a structure made once."""

    def __init__(self, nvml: Nvml, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.function = nvml.function("nvmlDeviceGetUtilizationRates")
        self.rates: Any = plain(nvml.module.c_nvmlUtilization_t)()
        self.reference = ctypes.byref(self.rates)

    def read(self) -> tuple[int, int]:
        """(GPU %, memory %) over the driver's last sample period.

        Raises:
            NvmlError: any failure.
        """
        code = self.function(self.handle, self.reference)
        if code != 0:
            raise _typed_code(self.nvml, code, "nvmlDeviceGetUtilizationRates")
        rates = self.rates
        return rates.gpu, rates.memory


class RunningProcessReader(BufferReader):
    """``nvmlDeviceGetComputeRunningProcesses_v3`` of one MIG device (a compute instance): the
    processes that hold a context on it, in one C call (``pynvml`` asks twice, size then fill)."""

    def __init__(self, nvml: Nvml, handle: Any, size: int = 16) -> None:
        entry = plain(nvml.module.c_nvmlProcessInfo_v3_t)
        super().__init__(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", entry, size)
        self.handle = handle

    def read(self) -> list[int]:
        """The pids, sorted, each once.

        Raises:
            NvmlError: any failure.
        """
        while True:
            self.count.value = self.size
            code = self.function(self.handle, ctypes.byref(self.count), self.buffer)
            if code == INSUFFICIENT_SIZE and self._grow(self.count.value):
                continue
            self._check(code)
            return sorted({int(info.pid) for info in self.buffer[: self.count.value]})


GPM_MIN_INTERVAL_US = 100_000
"""Shortest time between two GPM samples that NVML documents as meaningful (its counters
refresh about every 100 ms)."""


def gpm_supported(nvml: Nvml, handle: Any) -> bool:
    """Whether the GPU has GPM counters (Hopper and newer); False where the driver cannot say.

    Raises:
        NvmlError: a failure other than NOT_SUPPORTED (a lost GPU, a timeout…).
    """
    try:
        support = nvml.call(nvml.module.nvmlGpmQueryDeviceSupport, handle)
    except NvmlNotSupported:
        return False
    return bool(support.isSupportedDevice)


def mig_devices(nvml: Nvml, handle: Any) -> dict[int, list[Any]]:
    """The MIG devices (compute instances) of a GPU in MIG mode, by GPU instance id.

    Raises:
        NvmlError: the GPU cannot be listed.
    """
    module = nvml.module
    found: dict[int, list[Any]] = {}
    for index in range(int(nvml.call(module.nvmlDeviceGetMaxMigDeviceCount, handle))):
        try:
            mig = nvml.call(module.nvmlDeviceGetMigDeviceHandleByIndex, handle, index)
        except NvmlNotFound:  # no MIG device in that slot
            continue
        found.setdefault(int(nvml.call(module.nvmlDeviceGetGpuInstanceId, mig)), []).append(mig)
    return found


class GpmInstances:
    """The GPM activity of every GPU instance of one GPU in MIG mode: one
    ``nvmlGpmMigSampleGet`` per instance per read, and the metrics between a read's samples
    and the previous read's.

    Two sample buffers per instance, swapped at each read, allocated once. A read that fails
    for any instance starts over: its samples become the previous ones of no window, so a
    window always holds every instance, each over the same span.
    """

    METRICS = ("graphics_util", "sm_util")

    def __init__(self, nvml: Nvml, handle: Any, instances: dict[int, list[Any]]) -> None:
        module = nvml.module
        self.nvml = nvml
        self.handle = handle
        self.ids = sorted(instances)
        self.processes = {
            gi: [RunningProcessReader(nvml, mig) for mig in migs] for gi, migs in instances.items()
        }
        self.previous: dict[int, Any] = {}
        self.current: dict[int, Any] = {}
        try:
            for gi in self.ids:
                self.previous[gi] = nvml.call(module.nvmlGpmSampleAlloc)
                self.current[gi] = nvml.call(module.nvmlGpmSampleAlloc)
        except NvmlError:
            self.close()
            raise
        self.previous_us: int | None = None
        self.request: Any = module.c_nvmlGpmMetricsGet_t()
        self.request.version = module.NVML_GPM_METRICS_GET_VERSION
        self.request.numMetrics = 2
        self.request.metrics[0].metricId = module.NVML_GPM_METRIC_GRAPHICS_UTIL
        self.request.metrics[1].metricId = module.NVML_GPM_METRIC_SM_UTIL

    def read(self, now_us: int) -> tuple[int, int, dict[int, tuple[float, float | None]]] | None:
        """Sample every instance at ``now_us``; with the previous read's samples, each
        instance's (graphics %, SM % or None) over (previous read, now_us]. None at the first
        read, after a failed one, and sooner than ``GPM_MIN_INTERVAL_US`` after the last.

        Raises:
            NvmlError: a sample or the metrics failed (the next read starts over).
        """
        previous_us = self.previous_us
        if previous_us is not None and now_us - previous_us < GPM_MIN_INTERVAL_US:
            return None
        self.previous_us = None  # until every instance has answered
        module = self.nvml.module
        for gi in self.ids:
            self.nvml.call(module.nvmlGpmMigSampleGet, self.handle, gi, self.current[gi])
        activity = None if previous_us is None else {gi: self._metrics(gi) for gi in self.ids}
        self.previous, self.current = self.current, self.previous
        self.previous_us = now_us
        if previous_us is None or activity is None:
            return None
        return previous_us, now_us, activity

    def _metrics(self, gi: int) -> tuple[float, float | None]:
        request = self.request
        request.sample1, request.sample2 = self.previous[gi], self.current[gi]
        self.nvml.call(self.nvml.module.nvmlGpmMetricsGet, request)
        graphics, sm = request.metrics[0], request.metrics[1]
        if graphics.nvmlReturn != 0:
            raise _typed_code(self.nvml, int(graphics.nvmlReturn), "nvmlGpmMetricsGet")
        return float(graphics.value), float(sm.value) if sm.nvmlReturn == 0 else None

    def close(self) -> None:
        """Free the sample buffers; safe to call twice."""
        for samples in (self.previous, self.current):
            for sample in samples.values():
                with contextlib.suppress(NvmlError):
                    self.nvml.call(self.nvml.module.nvmlGpmSampleFree, sample)
            samples.clear()


def now_us() -> int:
    """Now in the driver's timestamps: Unix time in µs, as NVML stamps its samples."""
    return time.time_ns() // 1000
