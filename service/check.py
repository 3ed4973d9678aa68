"""``wattflow check``: one screen saying what works on this machine, and why not where it doesn't.

Each line is a thing the service may need: RAPL through powercap and through perf (what
hwpc-sensor reads), NVML (what the GPU sampler reads), the C parser of hwpc-sensor's JSON lines,
and every input and output configured, contacted as the service would. The configuration is
read as ``wattflow run`` reads it (``--config-file`` or ``WATTFLOW_CONFIG_FILE``, then the
``POWERAPI_*``/``WATTFLOW_*`` variables, then the flags), so that checking a node checks what
its service will run. A line that fails says the reason a user can act on (a permission, a
missing driver, a refused connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wattflow.formats.errors import WattflowError

if TYPE_CHECKING:
    from wattflow.service.config import ServiceConfig

POWERCAP = Path("/sys/class/powercap")
POWER_PMU = Path("/sys/bus/event_source/devices/power")
PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}


@dataclass
class Finding:
    """One line of the screen."""

    what: str
    works: bool
    detail: str
    misconfigured: bool = False
    """A setting ``wattflow run`` refuses before it starts (exit 2 there, and here), rather
    than a server it would wait for (exit 1 here)."""


def rapl_powercap(root: Path = POWERCAP) -> Finding:
    """RAPL through the powercap sysfs interface (``energy_uj`` per domain)."""
    what = "RAPL via powercap"
    if not root.is_dir():
        return Finding(what, False, f"{root} does not exist (no powercap driver, or not Linux)")
    zones = sorted(p for p in root.glob("intel-rapl:*") if (p / "energy_uj").exists())
    if not zones:
        return Finding(what, False, f"no RAPL zones under {root} (not an Intel or AMD CPU?)")
    readable, refused = [], []
    for zone in zones:
        name = (zone / "name").read_text().strip() if (zone / "name").exists() else zone.name
        try:
            (zone / "energy_uj").read_text()
            readable.append(name)
        except PermissionError:
            refused.append(name)
    if not readable:
        return Finding(
            what,
            False,
            f"{len(refused)} zones, none readable: energy_uj is root-only since "
            "Linux 5.10; run as root or grant read access",
        )
    return Finding(what, True, f"{len(readable)} zones readable: {', '.join(readable)}")


def rapl_perf(pmu: Path = POWER_PMU) -> Finding:
    """RAPL through perf events (the ``power`` PMU), which hwpc-sensor uses."""
    what = "RAPL via perf"
    if not (pmu / "type").exists():
        return Finding(what, False, f"no perf power PMU ({pmu} missing): no RAPL in this kernel")
    pmu_type = int((pmu / "type").read_text())
    events = sorted(e.name for e in (pmu / "events").glob("energy-*") if "." not in e.name)
    if not events:
        return Finding(what, False, "the power PMU lists no energy events")
    config_text = (pmu / "events" / events[0]).read_text().strip()
    config = int(config_text.split("=")[1], 0) if "=" in config_text else 0
    opened = _perf_event_open(pmu_type, config)
    if isinstance(opened, str):
        return Finding(what, False, f"{events[0]}: perf_event_open failed: {opened}")
    return Finding(what, True, f"events {', '.join(events)}")


def _perf_event_open(pmu_type: int, config: int) -> int | str:
    """Open (and close) a system-wide counter on cpu 0; return the fd, or why it failed."""
    number = PERF_EVENT_OPEN.get(platform.machine())
    if number is None:
        return f"unsupported architecture {platform.machine()}"
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    attr = (ctypes.c_uint8 * 128)()
    ctypes.memmove(attr, ctypes.byref(ctypes.c_uint32(pmu_type)), 4)
    ctypes.memmove(ctypes.addressof(attr) + 4, ctypes.byref(ctypes.c_uint32(128)), 4)
    ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_uint64(config)), 8)
    fd = libc.syscall(number, attr, -1, 0, -1, 0)
    if fd < 0:
        error = ctypes.get_errno()
        paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
        hint = (
            f" (perf_event_paranoid is {paranoid.read_text().strip()})" if paranoid.exists() else ""
        )
        return f"{os.strerror(error)}{hint}"
    os.close(fd)
    return int(fd)


def json_decoder() -> Finding:
    """Whether hwpc-sensor's JSON lines are parsed by wattflow's C parser, or the Python way
    (about seven times the CPU per line: the live path then takes about twice the CPU)."""
    from wattflow.formats.json_frames import c_parser_built

    what = "hwpc-sensor JSON decoder"
    if c_parser_built():
        return Finding(what, True, "C parser (straight into columns)")
    return Finding(
        what,
        False,
        "Python only: wattflow was installed where no C compiler built its parser; reinstall "
        "with gcc and Python's headers (python3-dev) for the faster decoder",
    )


def compat_regression() -> Finding:
    """Whether ``--compat smartwatts-2.4`` can run: it fits with scikit-learn, which only the
    ``compat`` extra installs (the default mode fits with SciPy)."""
    what = "--compat smartwatts-2.4"
    if importlib.util.find_spec("sklearn") is not None:
        return Finding(what, True, "scikit-learn installed (SmartWatts 2.4.1's ElasticNet)")
    return Finding(what, False, "needs scikit-learn: pip install 'wattflow[compat]'")


def nvml() -> Finding:
    """NVML through the sampler's own seam (``nvml.api``), and what each GPU offers: under MIG
    the driver gives no per-process utilisation, so power goes per GPU instance where the GPU
    has GPM counters, else stays per device."""
    from wattflow.actors.pullers.nvml.api import Nvml, NvmlError, NvmlUnavailable

    what = "NVML (GPUs)"
    try:
        api = Nvml()
        api.init()
    except NvmlUnavailable as error:
        return Finding(what, False, str(error))
    module = api.module
    try:
        count = int(api.call(module.nvmlDeviceGetCount))
        driver = api.call(module.nvmlSystemGetDriverVersion)
        gpus = [_gpu(api, index) for index in range(count)]
    except NvmlError as error:
        return Finding(what, False, f"NVML: {error}")
    finally:
        with contextlib.suppress(NvmlError):
            api.shutdown()
    if count == 0:
        return Finding(what, False, f"driver {driver}, but no GPU")
    return Finding(what, True, f"driver {driver}; {count} GPU(s): {'; '.join(gpus)}")


def _gpu(api: Any, index: int) -> str:
    """One GPU's name, and whether the GPU formula can split its power per process."""
    from wattflow.actors.pullers.nvml.api import NvmlNotFound, NvmlNotSupported, ProcessReader

    module = api.module
    handle = api.call(module.nvmlDeviceGetHandleByIndex, index)
    name = str(api.call(module.nvmlDeviceGetName, handle))
    if api.mig_enabled(handle):
        return f"{index}: {name}, {_mig(api, handle, index)}"
    try:
        ProcessReader(api, handle).read(time.time_ns() // 1000 - 1_000_000)
    except NvmlNotFound:
        pass  # no process used it in the last second: the call itself works
    except NvmlNotSupported:
        return f"{index}: {name}, no per-process utilisation: power is attributed per device"
    return f"{index}: {name}"


def _mig(api: Any, handle: Any, index: int) -> str:
    """How a GPU in MIG mode is attributed: per GPU instance where it has GPM counters (Hopper
    and newer), else per device."""
    from wattflow.actors.pullers.nvml.api import NvmlError, gpm_supported, mig_devices

    try:
        if not gpm_supported(api, handle):
            return (
                "MIG mode without GPM (before Hopper): no per-process or per-instance activity; "
                "power is attributed per device"
            )
        instances = mig_devices(api, handle)
    except NvmlError as error:
        return f"MIG mode: GPM or the GPU instances cannot be read ({error})"
    ids = ", ".join(f"gpu{index}/gi{gi}" for gi in sorted(instances)) or "none yet"
    return (
        f"MIG mode with GPM: power is attributed per GPU instance by its activity "
        f"({len(instances)} instance(s): {ids})"
    )


async def backends(config: ServiceConfig) -> list[Finding]:
    """Check every input and output of ``config`` as ``wattflow run`` does before it starts,
    then contact each one's server."""
    from wattflow.actors.pullers import pullers
    from wattflow.actors.pushers import pushers

    found = []
    for role, registry, configs in (
        ("input", pullers, config.inputs),
        ("output", pushers, config.outputs),
    ):
        for name, settings in configs.items():
            backend = registry.get(settings.type)(settings)
            found.append(await _contact(f"{role} {name} ({settings.type})", backend))
    found += [
        await _pre_processor(name, settings) for name, settings in config.pre_processors.items()
    ]
    return found


async def _contact(what: str, backend: Any) -> Finding:
    """A backend's line: what ``wattflow run`` refuses at start (its ``check``: a missing
    secret file, a port in use) is a misconfiguration; a server that does not answer its
    ``probe`` is one the service would wait for."""
    try:
        await backend.check()
    except (WattflowError, OSError) as error:
        return Finding(what, False, str(error) or type(error).__name__, misconfigured=True)
    try:
        detail = await asyncio.wait_for(backend.probe(), 30)
    except (WattflowError, OSError, TimeoutError) as error:
        return Finding(what, False, str(error) or type(error).__name__)
    return Finding(what, True, detail)


async def _pre_processor(name: str, settings: Any) -> Finding:
    """A pre-processor's own contact (the k8s one lists this node's pods)."""
    from wattflow.actors.preprocessors import preprocessors

    backend = preprocessors.get(settings.type)(settings)
    return await _contact(f"pre-processor {name} ({settings.type})", backend)


def check_command(
    argv: Sequence[str], console: Console | None = None, environ: dict[str, str] | None = None
) -> int:
    """Print the screen; return 0 when every configured input and output works, 1 when one
    cannot be reached, 2 when one is misconfigured (what ``wattflow run`` refuses at start,
    each named on standard error as run names it).

    The configuration is ``wattflow run``'s own, from the same file, variables and flags
    (``environ`` stands for the process' environment). RAPL, NVML, decoder and compat lines
    are information (a GPU-less node has no NVML), so they do not change the exit code.

    Raises:
        ConfigError: the configuration itself is wrong (exit 2, before the screen).
    """
    from wattflow.service.cli import load_run_config

    config = load_run_config(argv, environ)
    console = console or Console()
    machine = [rapl_powercap(), rapl_perf(), nvml(), json_decoder(), compat_regression()]
    configured = asyncio.run(backends(config))
    table = Table(title=f"wattflow check on {platform.node()}", show_lines=False)
    table.add_column("")
    table.add_column("what")
    table.add_column("details")
    for finding in machine + configured:
        mark = "[green]ok[/green]" if finding.works else "[red]no[/red]"
        table.add_row(mark, escape(finding.what), escape(finding.detail))  # [compat] is text
    console.print(table)
    if not configured:
        console.print(
            "Give the service's --input/--output flags, or its --config-file, to check its "
            "servers too."
        )
    misconfigured = [f for f in configured if f.misconfigured]
    for finding in misconfigured:
        print(f"wattflow: error: {finding.detail}", file=sys.stderr)
    if misconfigured:
        return 2
    return 0 if all(f.works for f in configured) else 1
