"""The container image, the compose stack and the other deployment files, checked by the tools
that read them: hadolint, the Compose Specification's schema, and wattflow's own parser for
every wattflow command line they hold."""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from wattflow.actors.pipeline import DRAIN_SETTLE_S
from wattflow.service.config import ServiceConfig

from .deployment import (
    DOCKER,
    KUBERNETES,
    SYSTEMD,
    TOOLS,
    active_services,
    bind_mounts,
    check_wattflow_command,
    compose_file,
    interpolate,
    read_env_file,
)

INPUTS = ("socket", "mongodb")
OUTPUTS = ("influxdb2", "influxdb", "prometheus", "mongodb")
GRAFANA_OUTPUTS = {"influxdb2", "influxdb", "prometheus"}


def tool(name: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run one of the test extra's tools from this environment."""
    return subprocess.run(
        [str(TOOLS / name), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_the_dockerfile_passes_hadolint_with_no_finding() -> None:
    result = tool("hadolint", "--no-color", DOCKER / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "", result.stdout


def test_the_dockerfile_has_a_slim_non_root_final_stage_with_a_health_check() -> None:
    """What hadolint does not require but the image promises: the wheel built in a first stage,
    a slim base, no root at run time, wattflow as the entry point, and a health check."""
    text = (DOCKER / "Dockerfile").read_text()
    stages = [line.split() for line in text.splitlines() if line.startswith("FROM ")]
    assert [stage[-1] for stage in stages[:3]] == ["build", "cpu", "nvml"]
    assert "slim" in next(line for line in text.splitlines() if line.startswith("ARG PYTHON_IMAGE"))
    assert "pip wheel" in text
    assert "from=build,source=/wheels" in text
    assert "USER 10001:10001" in text
    assert 'ENTRYPOINT ["wattflow"]' in text
    assert "HEALTHCHECK" in text
    assert "/health" in text
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in text


def test_compose_file_follows_the_compose_specification() -> None:
    result = tool(
        "check-jsonschema", "--builtin-schema", "vendor.compose-spec", DOCKER / "compose.yml"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_setting_compose_uses_is_in_env_with_its_documentation() -> None:
    env, comments = read_env_file(DOCKER / ".env")
    text = (DOCKER / "compose.yml").read_text()
    used = {name for name in env if f"${{{name}}}" in text or f"${{{name}:" in text}
    compose_file(env)  # every variable compose.yml uses is set: strict interpolation
    unused = set(env) - used - {"COMPOSE_PROFILES", "STACK_INPUT", "STACK_OUTPUT"}
    assert not unused, f"set in .env but used nowhere: {sorted(unused)}"
    undocumented = [name for name, lines in comments.items() if not lines]
    assert not undocumented, f"no comment above: {undocumented}"
    # wattflow reads every WATTFLOW_* and POWERAPI_* variable as its own setting.
    assert not [name for name in env if name.startswith(("WATTFLOW_", "POWERAPI_"))]


def test_images_are_pinned_to_versions() -> None:
    env, _ = read_env_file(DOCKER / ".env")
    images = {name: value for name, value in env.items() if name.endswith("_IMAGE")}
    assert len(images) >= 8
    for name, image in images.items():
        tag = image.rpartition(":")[2]
        assert tag != "latest", f"{name}={image}"
        assert any(c.isdigit() for c in tag), f"{name}={image}"
    model = compose_file(env)
    for service in model["services"].values():
        assert service["restart"] == "unless-stopped"


@pytest.mark.parametrize(("stack_input", "stack_output"), list(itertools.product(INPUTS, OUTPUTS)))
def test_each_profile_combination_starts_a_wattflow_its_cli_accepts(
    stack_input: str, stack_output: str, tmp_path: Path
) -> None:
    """Compose as ``docker compose up`` would run it for each input and output (with and
    without the gpu profile): the files it mounts exist, and each wattflow command line, with
    its environment and config file, is valid for wattflow's parser."""
    env, _ = read_env_file(DOCKER / ".env")
    env.update(STACK_INPUT=stack_input, STACK_OUTPUT=stack_output)
    model = compose_file(env)
    for extra in (set(), {"gpu"}):
        profiles = {stack_input, stack_output} | extra
        services = active_services(model, profiles)
        assert ("grafana" in services) == (stack_output in GRAFANA_OUTPUTS)
        assert ("mongodb" in services) == ("mongodb" in profiles)
        assert ("wattflow-nvml" in services) == ("gpu" in profiles)
        for name, service in services.items():
            mounts = bind_mounts(service, DOCKER)
            for path in mounts.values():
                assert path.exists(), f"{name} mounts {path}, which does not exist"
            image = str(service.get("image", ""))
            if not image.startswith("wattflow:"):
                continue
            environment = {k: str(v) for k, v in service.get("environment", {}).items()}
            config = check_wattflow_command(service["command"], environment, mounts)
            assert_grace_covers_the_drain(compose_seconds(service["stop_grace_period"]), config)
            if name == "wattflow":
                check_formula_service(config, stack_input, stack_output)


def compose_seconds(duration: str) -> float:
    """A Compose duration (``30s``, ``1m30s``) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert duration, "an empty duration"
    assert parts is not None, f"not a duration of minutes and seconds: {duration}"
    minutes, seconds = (int(part or 0) for part in parts.groups())
    return 60.0 * minutes + seconds


def assert_grace_covers_the_drain(grace_s: float, config: ServiceConfig) -> None:
    """What stops the service waits longer than its drain may take: the drain deadline, then
    the settling time after it; and no longer than Kubernetes' default of 30 s (an output that
    is down should not hold a rollout for minutes)."""
    assert config.drain_timeout_s + DRAIN_SETTLE_S < grace_s <= 30


def check_formula_service(config: ServiceConfig, stack_input: str, stack_output: str) -> None:
    """The formula service follows its input, hears the NVML sampler, writes to its output."""
    assert config.stream
    assert {backend.type for backend in config.inputs.values()} == {stack_input, "zeromq"}
    if stack_input == "socket":  # listening where hwpc-sensor's container can reach it
        assert getattr(config.inputs["sensor"], "host", None) == "0.0.0.0"
    assert {backend.type for backend in config.outputs.values()} == {stack_output}


def test_hwpc_sensor_configurations_send_where_wattflow_listens() -> None:
    """hwpc-sensor's JSON (its keys as hwpc-sensor 1.7.0's config_json.c reads them) writes to
    the socket wattflow's socket configurations listen on, or to the collection its MongoDB
    configurations follow."""
    socket = json.loads((DOCKER / "hwpc-sensor" / "socket.json").read_text())
    mongodb = json.loads((DOCKER / "hwpc-sensor" / "mongodb.json").read_text())
    known = {"name", "verbose", "frequency", "cgroup_basepath", "output", "system", "container"}
    for config in (socket, mongodb):
        assert set(config) <= known
        assert set(config["system"]) == {"rapl", "msr"}
    assert socket["output"] == {"type": "socket", "uri": "wattflow", "port": 9080}
    assert mongodb["output"]["type"] == "mongodb"
    listening = tomllib.loads((DOCKER / "wattflow" / "socket-influxdb2.toml").read_text())
    assert listening["input"]["sensor"]["port"] == socket["output"]["port"]
    following = tomllib.loads((DOCKER / "wattflow" / "mongodb-influxdb2.toml").read_text())
    sensor_input = following["input"]["sensor"]
    assert sensor_input["uri"] == mongodb["output"]["uri"]
    assert (sensor_input["db"], sensor_input["collection"]) == (
        mongodb["output"]["database"],
        mongodb["output"]["collection"],
    )


def test_prometheus_scrapes_the_port_compose_gives_wattflow() -> None:
    env, _ = read_env_file(DOCKER / ".env")
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    command = compose_file(env)["services"]["wattflow"]["command"]
    power = [
        tomllib.loads((DOCKER / "wattflow" / f"{source}-prometheus.toml").read_text())["output"][
            "power"
        ]["port"]
        for source in ("socket", "mongodb")
    ]
    assert power[0] == power[1]
    http_port = command[command.index("--http-port") + 1]
    assert targets == [f"wattflow:{http_port}", f"wattflow:{power[0]}"]


def test_interpolation_follows_compose_rules() -> None:
    env = {"A": "a", "EMPTY": ""}
    assert interpolate("${A}-${EMPTY:-d}-${EMPTY-d}-${UNSET:-u}-$$A-${A:+set}", env) == (
        "a-d--u-$A-set"
    )
    with pytest.raises(KeyError, match="UNSET"):
        interpolate("${UNSET}", env)


# --- Kubernetes ------------------------------------------------------------------------------

DAEMONSETS = ("base", "overlays/nvml")
"""Kustomizations that run wattflow beside hwpc-sensor on every node."""
KUSTOMIZATIONS = (*DAEMONSETS, "overlays/statefulset")
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
"""The oldest release the manifests promise (native runtime classes and Pod Security labels
are older) and the newest kubernetes-validate knows."""


def kustomize(directory: str, into: Path) -> tuple[Path, list[dict[str, Any]]]:
    """``kubectl kustomize`` of one kustomization: the file it wrote and its documents."""
    result = tool("kubectl", "kustomize", KUBERNETES / directory)
    assert result.returncode == 0, result.stderr
    path = into / (directory.replace("/", "-") + ".yaml")
    path.write_text(result.stdout)
    return path, [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomize_builds_manifests_that_kubernetes_schemas_accept_strictly(
    directory: str, tmp_path: Path
) -> None:
    path, documents = kustomize(directory, tmp_path)
    kinds = sorted(document["kind"] for document in documents)
    central = directory == "overlays/statefulset"
    # The DaemonSet's wattflow reads pods (rbac.yaml); the central tier reads none.
    rbac = [] if central else ["ClusterRole", "ClusterRoleBinding"]
    account = [] if central else ["ServiceAccount"]
    expected = ["ConfigMap", "ConfigMap", *rbac, "DaemonSet", "Namespace", "Service", *account]
    assert kinds == sorted([*expected, *(["StatefulSet"] if central else [])])
    for version in KUBERNETES_VERSIONS:
        result = tool("kubernetes-validate", "--strict", "--quiet", "-k", version, path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "ERROR" not in result.stdout + result.stderr


def _pod(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = [d for d in documents if d["kind"] == "DaemonSet"]
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return pod


def _config_map(documents: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    (config_map,) = [
        d
        for d in documents
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(prefix)
    ]
    data: dict[str, str] = config_map["data"]
    return data


@pytest.mark.parametrize("directory", DAEMONSETS)
def test_the_daemonset_runs_a_wattflow_its_cli_accepts_beside_hwpc_sensor(
    directory: str, tmp_path: Path
) -> None:
    """The wattflow container's arguments and environment are valid for wattflow's parser,
    and hwpc-sensor, in the same pod, writes to the socket wattflow listens on."""
    _, documents = kustomize(directory, tmp_path)
    pod = _pod(documents)
    assert pod["hostPID"] is True
    containers = {container["name"]: container for container in pod["containers"]}
    sensor, formula = containers["hwpc-sensor"], containers["wattflow"]
    assert sensor["securityContext"]["privileged"] is True
    assert formula["securityContext"]["runAsNonRoot"] is True
    assert formula["securityContext"]["allowPrivilegeEscalation"] is False
    environment = _config_map(documents, "wattflow-settings")
    args = [arg.replace("$(NODE_NAME)", "node-1") for arg in formula["args"]]
    config = check_wattflow_command(args, environment, {})
    assert_grace_covers_the_drain(pod["terminationGracePeriodSeconds"], config)
    assert (directory == "overlays/nvml") == ("nvml" in {i.type for i in config.inputs.values()})
    assert (directory == "overlays/nvml") == (pod.get("runtimeClassName") == "nvidia")
    socket = next(i for i in config.inputs.values() if i.type == "socket")
    hwpc = json.loads(_config_map(documents, "hwpc-sensor")["hwpc-sensor.json"])
    assert hwpc["output"] == {
        "type": "socket",
        "uri": getattr(socket, "host", None),
        "port": getattr(socket, "port", None),
    }
    assert hwpc["output"]["uri"] == "127.0.0.1"  # the pod's loopback, no one else's
    probes = {
        formula["readinessProbe"]["httpGet"]["path"],
        formula["livenessProbe"]["httpGet"]["path"],
    }
    assert probes == {"/ready", "/health"}
    assert_the_pre_processor_reads_this_nodes_pods(documents, pod, formula, config)
    http_port = formula["args"][formula["args"].index("--http-port") + 1]
    power_port = formula["args"][formula["args"].index("prometheus") + 4]  # --addr A --port P
    (service,) = [d for d in documents if d["kind"] == "Service"]
    assert [str(p["port"]) for p in service["spec"]["ports"]] == [http_port, power_port]


def assert_the_pre_processor_reads_this_nodes_pods(
    documents: list[dict[str, Any]],
    pod: dict[str, Any],
    formula: dict[str, Any],
    config: ServiceConfig,
) -> None:
    """wattflow's k8s pre-processor takes the socket input's reports, knows its node from the
    downward API, and its service account may get, list and watch pods and nothing more."""
    ((_, pre),) = config.pre_processors.items()
    assert pre.type == "k8s"
    assert config.inputs[pre.puller].type == "socket"
    assert getattr(pre, "api_mode", None) == "cluster"
    node = {e["name"]: e.get("valueFrom") for e in formula["env"]}["NODE_NAME"]
    assert node == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    by_kind = {d["kind"]: d for d in documents}
    account = by_kind["ServiceAccount"]["metadata"]
    assert pod["serviceAccountName"] == account["name"]
    assert by_kind["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = by_kind["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


def test_the_statefulset_runs_one_partition_per_pod_on_the_collection_hwpc_sensor_fills(
    tmp_path: Path,
) -> None:
    """Each of the N pods runs a wattflow its CLI accepts, following the collection that
    hwpc-sensor (alone on every node) writes to, with partition <its ordinal>/N; the Service
    selects these pods, not the sensors'."""
    _, documents = kustomize("overlays/statefulset", tmp_path)
    (statefulset,) = [d for d in documents if d["kind"] == "StatefulSet"]
    (service,) = [d for d in documents if d["kind"] == "Service"]
    (daemonset,) = [d for d in documents if d["kind"] == "DaemonSet"]
    assert [c["name"] for c in _pod(documents)["containers"]] == ["hwpc-sensor"]
    pod = statefulset["spec"]["template"]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    selector = service["spec"]["selector"].items()
    assert selector <= pod["metadata"]["labels"].items()
    assert not selector <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    (formula,) = pod["spec"]["containers"]
    env = {variable["name"]: variable for variable in formula["env"]}
    # The ordinal, from the label Kubernetes (1.28 and later) puts on each StatefulSet pod.
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    count = int(env["PARTITION_COUNT"]["value"])
    assert count == statefulset["spec"]["replicas"] >= 2
    mounts = {m["name"]: m["mountPath"] for m in formula["volumeMounts"]}
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v
    }
    hwpc = json.loads(_config_map(documents, "hwpc-sensor")["hwpc-sensor.json"])
    assert hwpc["output"]["type"] == "mongodb"
    partitions = []
    for ordinal in range(count):
        args = [
            arg.replace("$(POD_INDEX)", str(ordinal)).replace("$(PARTITION_COUNT)", str(count))
            for arg in formula["args"]
        ]
        config = check_wattflow_command(args, _config_map(documents, "wattflow-settings"), {})
        assert config.stream
        partitions.append(config.partition)
        (source,) = config.inputs.values()
        assert source.type == "mongodb"
        assert (getattr(source, "db", None), getattr(source, "collection", None)) == (
            hwpc["output"]["database"],
            hwpc["output"]["collection"],
        )
        uri_file = Path(str(getattr(source, "uri_file", "")))
        assert any(uri_file.parent == Path(mounts[name]) for name in secrets)
    assert partitions == [f"{ordinal}/{count}" for ordinal in range(count)]
    probes = {
        formula["readinessProbe"]["httpGet"]["path"],
        formula["livenessProbe"]["httpGet"]["path"],
    }
    assert probes == {"/ready", "/health"}
    assert formula["securityContext"]["runAsNonRoot"] is True


# --- systemd ---------------------------------------------------------------------------------


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` with no warning. It checks that ExecStart's program exists, so
    the check runs on a copy pointing at this environment's wattflow."""
    unit = (SYSTEMD / "wattflow.service").read_text()
    assert "ExecStart=/opt/wattflow/bin/wattflow " in unit
    copy = tmp_path / "wattflow.service"
    copy.write_text(unit.replace("/opt/wattflow/bin/wattflow", str(TOOLS / "wattflow")))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


def test_the_systemd_unit_runs_a_wattflow_its_cli_accepts(tmp_path: Path) -> None:
    unit = (SYSTEMD / "wattflow.service").read_text()
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    program, *argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert program.endswith("/wattflow")
    files = {"/etc/wattflow/wattflow.toml": SYSTEMD / "wattflow.toml"}
    config = check_wattflow_command(argv, {}, files)
    assert [i.type for i in config.inputs.values()] == ["socket"]
    stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)[1])  # type: ignore[index]
    assert_grace_covers_the_drain(stop_s, config)
