"""Per-process utilisation: each window's processes with their share of the GPU, and the
cgroup each process runs in (what the GPU formula attributes power to).

The driver's per-process samples are read from the newest timestamp already seen, so
consecutive windows hold every sample once: none missed while the driver still held it, none
repeated. The first window starts from the sampler's start: what the driver buffered before
then belongs to no run.
"""

from __future__ import annotations

from typing import Any

from wattflow.actors.pullers.nvml.api import RunningProcessReader, now_us
from wattflow.actors.pullers.nvml.device import NOT_FOUND, DeviceState
from wattflow.formats.reports import GPUProcess

PROCESS_SETTLE_US = 1_000_000
"""How long after a moment the sampler takes the driver's NOT_FOUND for "no process used the
SMs up to then": a driver publishes its samples a little after taking them, and a window
once closed is never reopened."""


def read_cgroup(root: str, pid: int) -> str | None:
    """The cgroup of a process: the unified (v2) hierarchy's path; on cgroup v1, the
    ``perf_event`` hierarchy's (the one hwpc-sensor reads, so that a process's GPU target is
    the cgroup its CPU target is), else the deepest path listed (Slurm's v1 plugin builds the
    job's directories in some controllers only, the others say ``/``).

    ``None`` when the process has gone or its file cannot be read: a process that ended
    between NVML's sample and this read still has its utilisation reported.
    """
    try:
        with open(f"{root}/{pid}/cgroup") as file:
            text = file.read()
    except OSError:
        return None
    return cgroup_of(text)


def cgroup_of(text: str) -> str | None:
    """The cgroup :func:`read_cgroup` picks from a ``/proc/<pid>/cgroup`` file's text: cgroup
    v2's line; on v1, the ``perf_event`` hierarchy's (hwpc-sensor's), else the deepest.

    On a hybrid host (v1 controllers beside an unused v2 hierarchy) v2's line is the root,
    ``0::/``, for every process, while a container runtime places it in the v1 hierarchies:
    the root is then taken only where no v1 line says more."""
    deepest: str | None = None
    unified: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            if parts[2] != "/":
                return parts[2]
            unified = parts[2]
        elif "perf_event" in parts[1].split(","):
            return parts[2]
        elif deepest is None or parts[2].count("/") > deepest.count("/"):
            deepest = parts[2]
    return deepest if deepest is not None else unified


def read_start_ticks(root: str, pid: int) -> int | None:
    """When a process started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``):
    with its pid, what tells it from an earlier process that had the same pid. ``None`` when
    the process has gone or its file cannot be read."""
    try:
        with open(f"{root}/{pid}/stat", "rb") as file:
            text = file.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses: the
    # fields after it start after the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 is the 20th after the name
    except (IndexError, ValueError):
        return None


def process_window(
    state: DeviceState, cgroup_root: str, rejected: list[tuple[Any, str]], *, asked: bool
) -> tuple[list[GPUProcess], tuple[int, int]] | None:
    """The driver's per-process utilisation since its previous answer, and the window it
    covers: (previous answer's newest sample, this answer's newest sample].

    The driver records every ~200 ms which one process holds the engine; NVML gives each
    process's mean over the samples of the window (a sample naming another process
    counts as 0), one entry per process. A driver that gives several entries for a pid is
    averaged over them. When nothing is new the window has no length; when the driver
    answers NOT_FOUND for longer than ``PROCESS_SETTLE_US`` (no process used the SMs), the
    window runs to that margin before now with no process in it.

    None where the device cannot tell (left out of the report). A tick that does not ask
    (``asked`` false: between windows) reports a window of no length.
    """
    start = state.last_process_us
    if state.processes is None or "processes" in state.unsupported:
        return None
    if not asked:
        return [], (start, start)
    answer = state.call("processes", state.processes.read, start)
    if "processes" in state.unsupported:
        return None
    _read_running(state)
    if answer is None:  # failed this time: the next answer covers this window too
        return [], (start, start)
    if answer is NOT_FOUND:
        end = now_us() - PROCESS_SETTLE_US
        if end <= start:
            return [], (start, start)
        state.last_process_us = end
        return [], (start, end)
    sums: dict[int, list[float]] = {}
    end = start
    for sample in answer:
        stamp = int(sample.timeStamp)
        if stamp <= start:
            continue
        end = max(end, stamp)
        totals = sums.setdefault(int(sample.pid), [0.0, 0.0, 0])
        totals[0] += sample.smUtil
        totals[1] += sample.memUtil
        totals[2] += 1
    state.last_process_us = end
    return _named(state, cgroup_root, sums, rejected), (start, end)


def _read_running(state: DeviceState) -> None:
    """The pids holding a compute context now (a cheap call, 10 µs on an H200), for the GPU
    formula to know which processes have ended; ``None`` where the driver does not answer."""
    if state.running is None and "running_processes" not in state.unsupported:
        state.running = state.call(
            "running_processes", RunningProcessReader, state.api, state.handle
        )
    found = None if state.running is None else state.call("running_processes", state.running.read)
    state.running_pids = found if isinstance(found, list) else None


def _named(
    state: DeviceState,
    cgroup_root: str,
    sums: dict[int, list[float]],
    rejected: list[tuple[Any, str]],
) -> list[GPUProcess]:
    """The window's processes with their cgroups, impossible readings dead-lettered.

    A cgroup and a start time are read when a process appears and kept while the process is
    in every window; a pid missing from a window is read afresh if it comes back (pid reuse)."""
    processes = []
    known, known_started = state.cgroups, state.started
    state.cgroups, state.started = {}, {}
    for pid, (sm, mem, count) in sorted(sums.items()):
        sm_util, mem_util = sm / count, mem / count
        if not (0 <= sm_util <= 100 and 0 <= mem_util <= 100):
            rejected.append(
                (
                    {"gpu": state.index, "pid": pid, "sm_util": sm_util, "mem_util": mem_util},
                    f"GPU {state.index}: impossible utilisation for pid {pid}",
                )
            )
            continue
        cgroup = known[pid] if pid in known else read_cgroup(cgroup_root, pid)
        started = known_started[pid] if pid in known else read_start_ticks(cgroup_root, pid)
        state.cgroups[pid], state.started[pid] = cgroup, started
        # Checked above, and built once a window per process: no second validation.
        processes.append(
            GPUProcess.model_construct(
                pid=pid, sm_util=sm_util, mem_util=mem_util, cgroup=cgroup, started=started
            )
        )
    return processes
