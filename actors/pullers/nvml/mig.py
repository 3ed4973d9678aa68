"""Under MIG: the GPU instances of a GPU and their activity between two GPM samples.

NVML answers per-process utilisation only for a whole GPU, not under MIG. On a GPU with GPM
counters (Hopper and newer) each GPU instance's graphics activity between two samples tells
how its power above idle is split among the instances, and the processes on each instance
tell whose it is.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from wattflow.actors.pullers.nvml.api import GpmInstances, gpm_supported, mig_devices, now_us
from wattflow.actors.pullers.nvml.device import NOT_FOUND, SETTINGS_S, DeviceState
from wattflow.actors.pullers.nvml.processes import read_cgroup
from wattflow.formats.reports import GPUInstanceActivity

logger = logging.getLogger(__name__)


def open_gpm(state: DeviceState, since_us: int, *, window_ms: int, announce: bool) -> None:
    """Under MIG: whether the GPU has GPM, and its GPU instances' first samples. Said once
    in the log (at INFO when ``announce``), since it decides how the GPU's power is
    attributed."""
    index = state.index
    state.instance_end_us = since_us
    state.gpm_supported = bool(state.call("gpm", gpm_supported, state.api, state.handle))
    level = logging.INFO if announce else logging.DEBUG
    if not state.gpm_supported:
        logger.log(
            level,
            "GPU %d is in MIG mode without GPM counters (before Hopper): NVML gives no "
            "per-process or per-instance activity there; its power above idle stays with "
            "gpu%d",
            index,
            index,
        )
        return
    state.due["instances"] = time.monotonic() + SETTINGS_S - state.slack_s
    list_instances(state)
    count = 0 if state.gpm is None else len(state.gpm.ids)
    logger.log(
        level,
        "GPU %d is in MIG mode with GPM: its power above idle is split among its %d GPU "
        "instances by their GPM activity (targets gpu%d/gi<id>), read every %d ms",
        index,
        count,
        index,
        window_ms,
    )


def list_instances(state: DeviceState) -> None:
    """(Re)list the GPU's instances; a new set gets new samples, starting a new window."""
    instances = state.call("gpm", mig_devices, state.api, state.handle)
    if instances is None or instances is NOT_FOUND:
        return
    if state.gpm is not None:
        if state.gpm.ids == sorted(instances):
            return
        logger.info("GPU %d: its GPU instances are now %s", state.index, sorted(instances))
        state.gpm.close()
        state.gpm = None
    if instances:
        state.gpm = state.call("gpm", GpmInstances, state.api, state.handle, instances)
    if state.gpm is not None:
        state.call("gpm", state.gpm.read, now_us())


def instance_window(
    state: DeviceState,
    now: float,
    cgroup_root: str,
    rejected: list[tuple[Any, str]],
    *,
    asked: bool,
) -> tuple[list[GPUInstanceActivity], tuple[int, int]] | None:
    """Under MIG with GPM: each GPU instance's activity since the previous window, and that
    window, (previous GPM samples, these]. None where the GPU cannot tell.

    Between windows, and when a read fails (the next one starts over: the time between is
    covered by no window), a window of no length. The instances are listed again every
    ``SETTINGS_S``, and at the tick after a sample answered NOT_FOUND (an instance was
    destroyed)."""
    if not state.gpm_supported or "gpm" in state.unsupported:
        return None
    if state.is_due("instances", SETTINGS_S, now):
        list_instances(state)
    last = state.instance_end_us
    if not asked or state.gpm is None:
        return [], (last, last)
    answer = state.call("gpm", state.gpm.read, now_us())
    if answer is NOT_FOUND:  # an instance is gone: list them again at the next tick
        state.due["instances"] = 0.0
    if answer is None or answer is NOT_FOUND:
        return [], (last, last)
    start, end, activity = answer
    if not _possible(activity):
        rejected.append(
            ({"gpu": state.index, "instances": activity},
             f"GPU {state.index}: impossible GPM activity")
        )  # fmt: skip
        return [], (last, last)
    state.instance_end_us = end
    return _on_instances(state, cgroup_root, activity), (start, end)


def _on_instances(
    state: DeviceState, cgroup_root: str, activity: dict[int, tuple[float, float | None]]
) -> list[GPUInstanceActivity]:
    """The instances' activity with the processes on each and their cgroups (read when a
    process appears, as for per-process utilisation)."""
    assert state.gpm is not None
    known = state.cgroups
    state.cgroups = {}
    found = []
    for gi, (graphics, sm) in sorted(activity.items()):
        pids: set[int] = set()
        for reader in state.gpm.processes[gi]:
            answer = state.call("instance_processes", reader.read)
            if isinstance(answer, list):
                pids.update(answer)
        cgroups = []
        for pid in sorted(pids):
            cgroup = known[pid] if pid in known else read_cgroup(cgroup_root, pid)
            state.cgroups[pid] = cgroup
            cgroups.append(cgroup)
        found.append(
            GPUInstanceActivity.model_construct(
                id=gi, graphics_util=graphics, sm_util=sm, pids=sorted(pids), cgroups=cgroups
            )
        )
    return found


def _possible(activity: dict[int, tuple[float, float | None]]) -> bool:
    """Whether every instance's GPM activity (graphics %, SM % or None) is a percentage."""
    return all(0 <= g <= 100 and (s is None or 0 <= s <= 100) for g, s in activity.values())
