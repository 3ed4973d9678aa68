"""What a cgroup path is: a container, a Kubernetes pod's container, a VM, a Slurm job, a
systemd service, the system itself, or something else.

SmartWatts' targets are cgroup paths as hwpc-sensor names them (relative to the cgroup
mount, ``/kubepods.slice/…/cri-containerd-<64 hex>.scope``), and the GPU formula's targets
are the cgroups of the processes on the GPU (``/proc/<pid>/cgroup``). Both go through
:func:`resolve_cgroup`, so that one pod's or one job's CPU, DRAM and GPU power carry the same
names and can be summed. The conventions are those the runtimes write (sources in
``docs/recipes/slurm.md`` and the test data under ``tests/data/cgroups/``):

- runc's systemd driver makes a unit ``<prefix>-<id>.scope`` (Docker ``docker-``, containerd's
  CRI plugin ``cri-containerd-``, CRI-O ``crio-``, podman ``libpod-``); the cgroupfs drivers
  a directory ``<parent>/<id>`` (Docker ``/docker/<id>``, CRI-O ``crio-<id>``, podman
  ``libpod-<id>``). crun and rootless podman may add a child (``…/container``) under it, and
  conmon has its own ``crio-conmon-<id>`` or ``libpod-conmon-<id>`` cgroup: both count as
  the container's.
- kubelet puts a pod under ``kubepods[/<qos>]/pod<uid>`` (cgroupfs) or
  ``kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _>.slice`` (systemd),
  Guaranteed pods with no QoS level; the container's cgroup is below the pod's.
- libvirt names a domain's scope ``machine-qemu\\x2d<n>\\x2d<name>.scope`` (systemd escapes
  ``-`` as ``\\x2d``) or, without systemd, ``qemu-<n>-<name>.libvirt-qemu``.
- Slurm's cgroup/v2 puts jobs under ``…slurmstepd.scope/job_<id>`` (up to 25.11) or the
  job's SLUID (``s`` and 13 Crockford base32 characters, 26.05 and later), then
  ``step_<s>/user/task_<n>``; cgroup/v1 under ``/slurm[_<node>]/uid_<uid>/job_<id>/step_<s>``.

The resolver is pure (no I/O, no state) and total: any string resolves, to ``other`` when it
is none of these, so a report is never lost for its target's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Final

KINDS: Final = ("container", "pod", "vm", "slurm_job", "service", "system", "other")
"""Every value of :attr:`CgroupTarget.kind`."""

LABEL_KEYS: Final = (
    "target_kind",
    "target_name",
    "container_runtime",
    "container_id",
    "pod_uid",
    "vm",
    "slurm_job",
    "service",
)
"""The keys of :meth:`CgroupTarget.labels`, the same for every kind (empty where a kind has
no such name): Prometheus needs one label set per metric, and every value is fixed for the
life of a target, so the labels add no series beyond the targets themselves."""

_HEX64 = r"[0-9a-f]{64}"
_CONTAINER_UNIT = re.compile(
    r"^(?:(?P<prefix>docker|cri-containerd|containerd|crio|libpod)-)"
    r"(?:conmon-|payload-)?(?P<id>" + _HEX64 + r")(?:\.scope)?$"
)
"""A runtime's unit or directory for a container (conmon's and podman's split payload
included)."""
_BARE_ID = re.compile(r"^" + _HEX64 + r"$")
_COLON_UNIT = re.compile(
    r"^(?P<slice>[^:]*\.slice):(?P<prefix>cri-containerd|crio|docker):(?P<id>" + _HEX64 + r")$"
)
"""cgroup v1's systemd hierarchy under containerd: ``<pod slice>:cri-containerd:<id>``."""
_RUNTIMES: Final = {
    "docker": "docker",
    "cri-containerd": "containerd",
    "containerd": "containerd",
    "crio": "crio",
    "libpod": "podman",
}
_POD_SLICE = re.compile(
    r"^(?:[a-z0-9_]+-)?kubepods(?:-(?P<qos>burstable|besteffort))?-pod(?P<uid>[0-9a-fA-F_]+)"
    r"\.slice$"
)
"""A pod's systemd slice; kind's nodes nest kubelet's slices under ``kubelet.slice``, whose
names it prefixes (``kubelet-kubepods-besteffort-pod<uid>.slice``)."""
_POD_DIR = re.compile(r"^pod(?P<uid>[0-9a-fA-F-]+)$")
_QOS_DIRS: Final = ("burstable", "besteffort")
_BARE_ID_PARENTS: Final = {"docker": "docker", "containerd": "containerd"}
"""cgroupfs parents whose 64-hex children are containers of a known runtime."""
_HIERARCHY = re.compile(r"^\d+:[^:]*:")
_VM_SCOPE = re.compile(
    r"^(?:machine-)?(?P<driver>qemu|kvm|lxc)-(?:(?P<number>\d+)-)?(?P<name>.+?)"
    r"(?:\.scope|\.libvirt-(?:qemu|lxc))$"
)
_SLURM_V2_ROOT = re.compile(r"^(?:.+_)?slurmstepd\.scope$")
_SLURM_V1_ROOT = re.compile(r"^slurm(?:_.+)?$")
_JOB_DIR = re.compile(r"^job_(?P<id>\d+)$")
_SLUID = re.compile(r"^s[0-9A-HJKMNP-TV-Z]{13}$")
_STEP_DIR = re.compile(r"^step_(?P<step>\d+(?:\+\d+)?|batch|extern|interactive)$")
_TASK_DIR = re.compile(r"^task_(?P<task>\d+|special)$")
_UID_DIR = re.compile(r"^uid_(?P<uid>\d+)$")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_SYSTEM_TARGETS: Final = frozenset({"", "/", "all", "global"})


@dataclass(frozen=True, slots=True)
class CgroupTarget:
    """What a cgroup path stands for.

    ``kind`` is one of :data:`KINDS`; the other fields are set where that kind has them. A
    Slurm job's ``job`` is its numeric id or its SLUID, as the directory names it; ``step``
    and ``task`` are the directory's (``0``, ``batch``, ``extern``…), ``None`` for the job's
    own cgroup. A pod's ``container_id`` is ``None`` for the pod's own cgroup (its sandbox
    and the kubelet's accounting). Namespace and pod name are not in a cgroup path: they come
    from the Kubernetes API, by ``pod_uid`` or ``container_id``.
    """

    kind: str
    path: str
    runtime: str | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    qos: str | None = None
    vm_name: str | None = None
    job: str | None = None
    step: str | None = None
    task: str | None = None
    user_id: int | None = None
    service: str | None = None

    @property
    def name(self) -> str:
        """A short name a user recognises, one per workload (a job, not its tasks; a
        container, not its conmon): ``slurm/1234``, ``pod/<uid>/<container id>``,
        ``vm/<domain>``, ``docker/<container id>``, ``service/sshd.service``; the path itself
        for ``system`` and ``other``."""
        if self.kind == "slurm_job":
            return f"slurm/{self.job}"
        if self.kind == "pod":
            return f"pod/{self.pod_uid}" + (f"/{self.container_id}" if self.container_id else "")
        if self.kind == "vm":
            return f"vm/{self.vm_name}"
        if self.kind == "container":
            return f"{self.runtime}/{self.container_id}"
        if self.kind == "service":
            return f"service/{self.service}"
        return self.path

    def labels(self) -> dict[str, str]:
        """The target's names as labels or tags: every key of :data:`LABEL_KEYS`, empty where
        the kind has no such name. Steps, tasks and user ids stay out: they would not let a
        job's series be summed any better, and one job's steps are many."""
        return {
            "target_kind": self.kind,
            "target_name": self.name,
            "container_runtime": self.runtime or "",
            "container_id": self.container_id or "",
            "pod_uid": self.pod_uid or "",
            "vm": self.vm_name or "",
            "slurm_job": self.job or "",
            "service": self.service or "",
        }


def unescape_systemd(text: str) -> str:
    """A systemd unit name's ``\\xNN`` escapes as the characters they stand for
    (``machine-qemu\\x2d1\\x2dvm.scope`` → ``machine-qemu-1-vm.scope``)."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 16)), text)


def path_of_line(line: str) -> str:
    """The path of a ``/proc/<pid>/cgroup`` line (``0::/system.slice/…``,
    ``4:perf_event:/slurm/…``): the text after the hierarchy's number and controllers; a
    path that has no such prefix is returned as it is."""
    return _HIERARCHY.sub("", line.strip(), count=1)


@lru_cache(maxsize=4096)
def resolve_cgroup(path: str) -> CgroupTarget:
    """What the cgroup ``path`` is (a line of ``/proc/<pid>/cgroup`` without its
    ``N:controllers:`` prefix, or hwpc-sensor's target).

    Workloads are looked for from the most specific: a Slurm job (its tasks may run
    containers, which are the job's), a pod, a container, a VM, then a service. Cached: a
    node's targets are few and come back every tick.
    """
    parts = tuple(part for part in path.split("/") if part)
    return (
        _slurm(path, parts)
        or _pod(path, parts)
        or _container(path, parts)
        or _vm(path, parts)
        or _service_or_system(path, parts)
    )


def _slurm(path: str, parts: tuple[str, ...]) -> CgroupTarget | None:
    """A Slurm job's cgroup, v2 (``…slurmstepd.scope/<job>/…``) or v1
    (``/slurm…/uid_<n>/job_<id>/…``)."""
    for index, part in enumerate(parts):
        if _SLURM_V2_ROOT.match(part) and index + 1 < len(parts):
            job = _job_id(parts[index + 1])
            if job is not None:
                return _slurm_target(path, job, parts[index + 2 :], None)
        if _SLURM_V1_ROOT.match(part) and index + 2 < len(parts):
            user = _UID_DIR.match(parts[index + 1])
            job_dir = _JOB_DIR.match(parts[index + 2])
            if user and job_dir:
                uid = int(user.group("uid"))
                return _slurm_target(path, job_dir.group("id"), parts[index + 3 :], uid)
    return None


def _job_id(part: str) -> str | None:
    """The job a v2 job directory names: its numeric id (``job_<id>``) or its SLUID."""
    numeric = _JOB_DIR.match(part)
    if numeric:
        return numeric.group("id")
    return part if _SLUID.match(part) else None


def _slurm_target(path: str, job: str, below: tuple[str, ...], user_id: int | None) -> CgroupTarget:
    """The job's target with the step and task found below its directory."""
    step = task = None
    for part in below:
        step_dir = _STEP_DIR.match(part)
        task_dir = _TASK_DIR.match(part)
        if step_dir and step is None:
            step = step_dir.group("step")
        elif task_dir and step is not None:
            task = task_dir.group("task")
    return CgroupTarget("slurm_job", path, job=job, step=step, task=task, user_id=user_id)


def _pod(path: str, parts: tuple[str, ...]) -> CgroupTarget | None:
    """A pod's cgroup or one of its containers', by either of kubelet's drivers (and the
    v1 systemd hierarchy's ``<pod slice>:<prefix>:<id>``)."""
    for index, part in enumerate(parts):
        found = _pod_part(parts, index, part)
        if found is None:
            continue
        uid, qos = found
        runtime, container_id = _first_container(parts[index + 1 :], bare_ids=True)
        return CgroupTarget(
            "pod", path, runtime=runtime, container_id=container_id, pod_uid=uid, qos=qos
        )
    for part in parts:
        colon = _COLON_UNIT.match(part)
        pod_slice = colon and _POD_SLICE.match(colon.group("slice"))
        if colon and pod_slice:
            return CgroupTarget(
                "pod",
                path,
                runtime=_RUNTIMES[colon.group("prefix")],
                container_id=colon.group("id"),
                pod_uid=pod_slice.group("uid").replace("_", "-"),
                qos=pod_slice.group("qos") or "guaranteed",
            )
    return None


def _pod_part(parts: tuple[str, ...], index: int, part: str) -> tuple[str, str] | None:
    """The pod uid and QoS class a path component names, if it is a pod's cgroup: a
    systemd pod slice, or a ``pod<uid>`` directory under ``kubepods[/<qos>]``."""
    pod_slice = _POD_SLICE.match(part)
    if pod_slice:
        return pod_slice.group("uid").replace("_", "-"), pod_slice.group("qos") or "guaranteed"
    pod_dir = _POD_DIR.match(part)
    if pod_dir is None or index == 0:
        return None
    parent = parts[index - 1]
    if parent == "kubepods":
        return pod_dir.group("uid"), "guaranteed"
    if parent in _QOS_DIRS and index >= 2 and parts[index - 2] == "kubepods":
        return pod_dir.group("uid"), parent
    return None


def _first_container(parts: tuple[str, ...], *, bare_ids: bool) -> tuple[str | None, str | None]:
    """The runtime and id of the first container cgroup among ``parts``; a bare 64-hex
    directory counts only where the parent is known to hold containers (a pod's cgroupfs
    directory), and its runtime is not written in the path."""
    for part in parts:
        unit = _CONTAINER_UNIT.match(part)
        if unit:
            return _RUNTIMES[unit.group("prefix")], unit.group("id")
        if bare_ids and _BARE_ID.match(part):
            return None, part
    return None, None


def _container(path: str, parts: tuple[str, ...]) -> CgroupTarget | None:
    """A container outside Kubernetes: a runtime's unit or directory anywhere in the path,
    or Docker's cgroupfs ``/docker/<id>``."""
    runtime, container_id = _first_container(parts, bare_ids=False)
    if container_id is None:
        for parent, part in pairwise(parts):
            if parent in _BARE_ID_PARENTS and _BARE_ID.match(part):
                runtime, container_id = _BARE_ID_PARENTS[parent], part
                break
    if container_id is None:
        return None
    return CgroupTarget("container", path, runtime=runtime, container_id=container_id)


def _vm(path: str, parts: tuple[str, ...]) -> CgroupTarget | None:
    """A libvirt domain's cgroup (its scope, or the emulator and vCPU cgroups below it)."""
    for part in parts:
        scope = _VM_SCOPE.match(unescape_systemd(part))
        if scope:
            return CgroupTarget(
                "vm", path, runtime=scope.group("driver"), vm_name=scope.group("name")
            )
    return None


def _service_or_system(path: str, parts: tuple[str, ...]) -> CgroupTarget:
    """The deepest systemd service in the path, the system's own cgroups (the root,
    ``init.scope``, hwpc-sensor's ``all``, and slices, which only group other cgroups: a
    slice that is a target is measured as the sum of what it holds), or ``other``."""
    last = parts[-1] if parts else ""
    if path.strip() in _SYSTEM_TARGETS or last == "init.scope" or last.endswith(".slice"):
        return CgroupTarget("system", path)
    for part in reversed(parts):
        if part.endswith(".service"):
            return CgroupTarget("service", path, service=unescape_systemd(part))
    return CgroupTarget("other", path)
