"""Names a user recognises on the formulas' output: the one place targets are named.

SmartWatts' targets are cgroup paths and the GPU formula's are the cgroups of the processes
on the GPU; both are PowerReports (or SmartWatts' PowerFrames) by the time a formula hands
them on. :class:`TargetNaming` runs there, between every formula and what takes its output
(the outputs and the formulas that read other formulas', such as the node and energy
formulas), so one Slurm job's or one pod's CPU, DRAM and GPU reports carry the same names and
can be summed in any output.

A report whose target :func:`~wattflow.formats.targets.resolve_cgroup` recognises as a
workload (a container, a pod's container, a VM, a Slurm job, a service) gets the resolver's
labels as metadata keys (:data:`~wattflow.formats.targets.LABEL_KEYS`: ``target_kind``,
``target_name``, ``slurm_job``, ``pod_uid``…). Its ``target`` stays the cgroup path and nothing
it carried changes, so a PowerAPI document only gains keys; a target that names no workload
(``rapl``, ``global``, ``all``, a GPU's own ``gpu0``, a bare name) gains none, and its
documents stay byte for byte as before. The keys come before the formula's own (``scope``,
``socket``…), where PowerAPI's pre-processors put what they add. Each label's value is fixed
for the life of its target, so the labels add no series to InfluxDB or Prometheus beyond the
targets themselves, and those expire with their target as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from wattflow.formats.batch import Labeller, with_labels
from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report
from wattflow.formats.targets import resolve_cgroup

KNOWN_TARGETS = 65_536
"""Targets whose labels :class:`TargetNaming` keeps (a node's containers, a cluster's pods)."""

UNNAMED_KINDS = frozenset({"system", "other"})
"""Kinds whose name is their target itself: nothing is added to their reports."""


def target_labels(target: str) -> dict[str, str] | None:
    """The labels a report of ``target`` gains, or ``None`` when it names no workload."""
    resolved = resolve_cgroup(target)
    if resolved.kind in UNNAMED_KINDS:
        return None
    return resolved.labels()


class TargetNaming:
    """Adds the name labels to the PowerReports and PowerFrames of a formula's output.

    ``resolver``: the resolver's labels (``--target-names on``); ``extra``: the labellers of
    the pre-processors that name outputs (``--pre-processor k8s``'s wattflow layout), whose
    keys are added to the same reports. Reports are rebuilt, never changed in place: a
    formula's report may still be held by the formula or by another stage. Each target is
    resolved once: a live node sends the same targets every tick, and their labels are kept, up
    to :data:`KNOWN_TARGETS` of them (then forgotten all at once and resolved again as they
    come). The labellers are asked every time (a pod the API lists later gets its names then);
    they keep what they know themselves.
    """

    def __init__(self, *, resolver: bool = True, extra: Sequence[Labeller] = ()) -> None:
        self.resolver = resolver
        self.extra = tuple(extra)
        self.known: dict[str, dict[str, str] | None] = {}

    def labels(self, target: str) -> dict[str, str] | None:
        """Every label ``target``'s reports gain, or ``None`` for none."""
        labels = self._resolved(target) if self.resolver else None
        for labeller in self.extra:
            more = labeller(target)
            if more:
                labels = {**(labels or {}), **more}
        return labels

    def _resolved(self, target: str) -> dict[str, str] | None:
        """:func:`target_labels`, resolved once per target."""
        try:
            return self.known[target]
        except KeyError:
            if len(self.known) >= KNOWN_TARGETS:
                self.known.clear()
            found = self.known[target] = target_labels(target)
            return found

    def __call__(self, items: Sequence[Report | Frame]) -> list[Report | Frame]:
        return with_labels(items, self.labels)
