"""The target resolver against cgroup paths as runtimes and schedulers write them
(``tests/data/cgroups/``, each file named after its source)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from wattflow.actors.pullers.nvml.processes import cgroup_of
from wattflow.formats.targets import (
    KINDS,
    LABEL_KEYS,
    CgroupTarget,
    path_of_line,
    resolve_cgroup,
    unescape_systemd,
)

DATA = Path(__file__).parent / "data" / "cgroups"
_FIELDS = {field.name for field in fields(CgroupTarget)} - {"kind", "path"}


def _cases() -> list[tuple[str, str, str, dict[str, str]]]:
    """Every (file, line, kind, fields) the data files hold."""
    cases = []
    for file in sorted(DATA.glob("*.tsv")):
        for line in file.read_text().splitlines():
            if not line or line.startswith("#"):
                continue
            path, kind, *rest = line.split("\t")
            expected = dict(item.split("=", 1) for item in " ".join(rest).split())
            cases.append((file.name, path, kind, expected))
    return cases


CASES = _cases()


def test_every_source_file_has_cases() -> None:
    names = {case[0] for case in CASES}
    assert names == {file.name for file in DATA.glob("*.tsv")}
    assert len(CASES) >= 60


@pytest.mark.parametrize(
    ("source", "line", "kind", "expected"), CASES, ids=[f"{c[0]}:{c[1][-40:]}" for c in CASES]
)
def test_resolves_paths_as_their_sources_write_them(
    source: str, line: str, kind: str, expected: dict[str, str]
) -> None:
    path = path_of_line(line)
    target = resolve_cgroup(path)
    assert target.kind == kind
    assert target.path == path
    assert set(expected) <= _FIELDS, f"{source}: unknown field in {expected}"
    for name in _FIELDS:
        value = getattr(target, name)
        want = expected.get(name)
        assert (None if value is None else str(value)) == want, f"{name} of {path}"


def test_labels_have_the_same_keys_for_every_kind() -> None:
    kinds = set()
    for _source, line, _kind, _expected in CASES:
        target = resolve_cgroup(path_of_line(line))
        labels = target.labels()
        assert tuple(labels) == LABEL_KEYS
        assert all(isinstance(value, str) for value in labels.values())
        kinds.add(target.kind)
    assert kinds == set(KINDS)


def test_a_jobs_tasks_and_steps_share_one_name() -> None:
    """What lets one job's CPU, DRAM and GPU series be summed: every cgroup of the job
    (its steps, tasks, slurmstepd) has the job's name and labels."""
    paths = [
        "/system.slice/slurmstepd.scope/job_77",
        "/system.slice/slurmstepd.scope/job_77/step_0/user/task_0",
        "/system.slice/slurmstepd.scope/job_77/step_0/user/task_1",
        "/system.slice/slurmstepd.scope/job_77/step_batch/slurm",
        "/system.slice/slurmstepd.scope/job_77/step_extern/user",
    ]
    labels = {tuple(resolve_cgroup(path).labels().items()) for path in paths}
    assert len(labels) == 1
    assert resolve_cgroup(paths[1]).name == "slurm/77"
    assert resolve_cgroup("/system.slice/slurmstepd.scope/job_78/step_0").name == "slurm/78"


def test_a_containers_conmon_and_child_cgroup_are_the_container() -> None:
    cid = "0bc5eac79e3ae7a0c2651f14722aa10fa333eb2325c2ca97da33aa284cda81b0"
    names = {
        resolve_cgroup(f"/machine.slice/libpod-{cid}.scope").name,
        resolve_cgroup(f"/machine.slice/libpod-conmon-{cid}.scope").name,
        resolve_cgroup(f"/machine.slice/libpod-{cid}.scope/container").name,
    }
    assert names == {f"podman/{cid}"}


def test_a_pods_name_carries_its_uid_and_container() -> None:
    target = resolve_cgroup(
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-"
        "podad412dfe_3589_4056_965a_592356172968.slice/crio-" + "7" * 64 + ".scope"
    )
    assert target.name == "pod/ad412dfe-3589-4056-965a-592356172968/" + "7" * 64
    assert target.labels()["pod_uid"] == "ad412dfe-3589-4056-965a-592356172968"
    assert target.labels()["slurm_job"] == ""


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/",
        "\x00",
        "/docker/" + "a" * 63,
        "/docker/" + "A" * 64,
        "/kubepods/burstable/notapod/" + "a" * 64,
        "/system.slice/slurmstepd.scope/job_/step_0",
        "/system.slice/slurmstepd.scope/job_12x",
        "/slurm/uid_x/job_1",
        "/machine.slice/machine-qemu\\x2.scope",
        "////",
        "a" * 10_000,
    ],
)
def test_anything_resolves_to_a_kind_never_an_error(path: str) -> None:
    target = resolve_cgroup(path)
    assert target.kind in ("system", "other")
    assert target.name == path


def test_resolution_is_frozen_and_pure() -> None:
    first = resolve_cgroup("/system.slice/ssh.service")
    with pytest.raises(AttributeError):
        first.kind = "other"  # type: ignore[misc]
    assert resolve_cgroup("/system.slice/ssh.service") == first


def test_unescape_and_hierarchy_prefix() -> None:
    assert unescape_systemd("machine-qemu\\x2d1\\x2dvm.scope") == "machine-qemu-1-vm.scope"
    assert unescape_systemd("no\\xzzescape") == "no\\xzzescape"
    assert path_of_line("12:cpu,cpuacct:/slurm/uid_1/job_2\n") == "/slurm/uid_1/job_2"
    assert path_of_line("0::/init.scope") == "/init.scope"
    assert path_of_line("/docker/x") == "/docker/x"


def test_a_gpu_processs_cgroup_is_the_one_hwpc_sensor_names() -> None:
    """The NVML input's pick among a process's cgroups: v2's line; on v1, perf_event's (the
    hierarchy hwpc-sensor reads), else the deepest (Slurm's v1 jobs are in some controllers
    only), so the GPU formula's target resolves as the CPU's does."""
    v1 = (
        "12:rdma:/\n11:cpuset:/slurm/uid_1001/job_123/step_0\n"
        "4:perf_event:/slurm/uid_1001/job_123/step_0/task_1\n1:name=systemd:/system.slice\n"
    )
    assert cgroup_of(v1) == "/slurm/uid_1001/job_123/step_0/task_1"
    no_perf = "12:rdma:/\n7:memory:/slurm/uid_1001/job_123/step_0/task_0\n5:pids:/user.slice\n"
    assert cgroup_of(no_perf) == "/slurm/uid_1001/job_123/step_0/task_0"
    assert resolve_cgroup(cgroup_of(no_perf) or "").job == "123"
    assert cgroup_of("0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n") == (
        "/system.slice/slurmstepd.scope/job_9/step_0/user/task_0"
    )
    assert cgroup_of("garbage") is None
    # A hybrid host: v1's controllers hold the container, v2's unused hierarchy is the root.
    hybrid = "4:memory:/process_api/d70e4c\n1:name=systemd:/process_api/d70e4c\n0::/\n"
    assert cgroup_of(hybrid) == "/process_api/d70e4c"
    assert cgroup_of("0::/\n") == "/"
