"""The one seam between wattflow and NVML: loading the binding, typed errors, and the readers
that cost one C call each.

Everything that talks to the NVIDIA driver (the ``nvml`` input, ``wattflow check``, the
benchmarks) goes through :class:`Nvml`, so an NVML error always reaches the caller as one of
the :class:`NvmlError` classes below, named for what a user can do about it, never as a bare
return code. ``pynvml`` is imported when an :class:`Nvml` is made, not with this module: nodes
without GPUs load the registry of inputs without needing the package.

Why the buffer readers are here and not ``pynvml``'s: on recent drivers (Hopper) every NVML
query is a round trip to the GPU's firmware processor during which the calling thread spins,
about 1 ms each for the utilisation buffers on an H100. ``pynvml`` asks each buffer twice, once
for its size and once to fill it; these readers keep one buffer per device and kind, sized once,
and fill it in one call.
"""

from __future__ import annotations

import ctypes
import importlib
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
            text = self.nvml.module.nvmlErrorString(code)
            if isinstance(text, bytes):
                text = text.decode(errors="replace")
            raise typed(code, self.name, str(text))


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
