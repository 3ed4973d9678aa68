"""The container image built from docker/Dockerfile and run, with Debian's podman.

Opt-in (``pytest -m image``, or ``scripts/test-image``): it takes about three minutes on the
development machine, as long as the rest of the suite, and needs podman, runc, mmdebstrap and
their helpers from Debian (scripts/test-image installs them). No registry is reachable here, so
the test makes its base image itself: Debian bookworm's Python 3.11 by mmdebstrap, imported into
podman, standing in for python:3.11-slim-bookworm; wattflow's dependencies come as wheels
downloaded on the host into the build context's wheelhouse, and the build runs with
``PIP_NO_INDEX=1``. podman builds with ``--isolation=chroot`` and runs with the ``runc`` runtime
and lowered ``nofile``/``nproc`` limits, which is what works inside this sandbox.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, wait_until
from .servers import free_port

pytestmark = pytest.mark.image

BASE = "localhost/wattflow-test-python:bookworm"
BUILD_BASE = "localhost/wattflow-test-python-build:bookworm"
"""The build stage's base: the same Python with a C compiler and Python's headers, as
python:3.11-bookworm has them, so that the wheel is built with wattflow's C parser."""
IMAGE = "localhost/wattflow:test"
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
RUN = [*PODMAN, "run", "--rm", *LIMITS]
"""A container run to its end."""
START = [*PODMAN, "run", "-d", *LIMITS]
"""A container started in the background (``--name`` it)."""


def run(*command: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


def _base_image(scratch: Path, name: str, packages: str) -> None:
    """Debian bookworm with Python 3.11 and pip, as python:3.11-slim-bookworm provides them
    (``python`` and ``pip`` on the path, pip free to install), and ``packages``."""
    if run("podman", "image", "exists", name).returncode == 0:
        return
    tarball = scratch / f"{name.rsplit('/', 1)[-1].replace(':', '-')}.tar"
    hook = (
        'rm -f "$1"/usr/lib/python3.*/EXTERNALLY-MANAGED; '
        'ln -sf python3 "$1"/usr/bin/python; ln -sf pip3 "$1"/usr/bin/pip; '
        'rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*'
    )
    made = run(
        "mmdebstrap",
        "--variant=minbase",
        f"--include=python3,python3-pip,passwd{packages}",
        f"--customize-hook={hook}",
        "bookworm",
        str(tarball),
    )
    assert made.returncode == 0, made.stderr[-3000:]
    imported = run("podman", "import", str(tarball), name)
    assert imported.returncode == 0, imported.stderr


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """docker/Dockerfile built with podman, offline, on the local base image."""
    scratch = tmp_path_factory.mktemp("image")
    started = time.monotonic()
    _base_image(scratch, BASE, "")
    _base_image(scratch, BUILD_BASE, ",python3-dev,gcc,libc6-dev")
    wheelhouse = ROOT / "docker" / "wheelhouse"
    downloaded = run(
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--dest",
        str(wheelhouse),
        f"{ROOT}[kubernetes,compat]",  # the image holds the k8s client and scikit-learn
        "setuptools",
        "wheel",
    )
    assert downloaded.returncode == 0, downloaded.stderr[-3000:]
    try:
        built = run(
            "podman",
            "build",
            "--isolation=chroot",
            "--format=docker",
            "-f",
            str(ROOT / "docker" / "Dockerfile"),
            "--build-arg",
            f"PYTHON_IMAGE={BASE}",
            "--build-arg",
            f"BUILD_IMAGE={BUILD_BASE}",
            "--build-arg",
            "PIP_NO_INDEX=1",
            "-t",
            IMAGE,
            str(ROOT),
        )
    finally:
        for wheel in wheelhouse.glob("*.whl"):
            wheel.unlink()
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    print(f"image built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return IMAGE


def test_the_image_runs_wattflow_as_an_unprivileged_user(image: str) -> None:
    version = run(*RUN, image, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().startswith("wattflow ")
    user = run(*RUN, "--entrypoint", "id", image, "-u")
    assert user.stdout.strip() == "10001"
    compiler = run(*RUN, "--entrypoint", "sh", image, "-c", "command -v gcc cc || true")
    assert compiler.stdout.strip() == ""
    parser = run(
        *RUN, "--entrypoint", "python", image, "-c",
        "from wattflow.formats.json_frames import c_parser_built; print(c_parser_built())",
    )  # fmt: skip
    assert parser.stdout.strip() == "True", "the image decodes with the C parser: " + (
        parser.stdout + parser.stderr
    )
    compat = run(*RUN, "--entrypoint", "python", image, "-c", "import sklearn.linear_model")
    assert compat.returncode == 0, "the image runs --compat smartwatts-2.4: " + compat.stderr
    inspected = run("podman", "image", "inspect", image, "--format", "{{.Config.Healthcheck}}")
    assert "/health" in inspected.stdout


def test_the_image_holds_this_checkout(image: str) -> None:
    """The image's wattflow is the code at hand, not an earlier build's (a builder that reused
    a cached install layer would pass every other test with old code)."""
    code = (
        "import hashlib, importlib; "
        "print(*(hashlib.sha256(open(importlib.import_module(m).__file__, 'rb').read())"
        ".hexdigest() for m in ('wattflow.service.config', 'wattflow.actors.pipeline')))"
    )
    found = run(*RUN, "--entrypoint", "python", image, "-c", code)
    assert found.returncode == 0, found.stderr
    here = [
        hashlib.sha256((ROOT / path).read_bytes()).hexdigest()
        for path in ("service/config.py", "actors/pipeline.py")
    ]
    assert found.stdout.split() == here


def test_the_demo_runs_in_the_image(image: str) -> None:
    demo = run(*RUN, image, "demo", timeout_s=300)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "power reports" in demo.stdout


def test_the_socket_input_takes_reports_from_outside_the_container(
    image: str, tmp_path: Path
) -> None:
    """Listening on 0.0.0.0 inside the container, as compose.yml configures it, the socket
    input takes hwpc-sensor's reports through a published port."""
    port = free_port()
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    name = f"wattflow-socket-{port}"
    command = [
        *START,
        "--name",
        name,
        "-p",
        f"127.0.0.1:{port}:9080",
        "-v",
        f"{out}:/out",
        image,
        "run",
        "--disable-smartwatts-formula",
        "--input",
        "socket",
        "--host",
        "0.0.0.0",
        "--output",
        "jsonl",
        "--file",
        "/out/power.jsonl",
    ]
    started = run(*command)
    assert started.returncode == 0, started.stderr
    try:
        payload = (ROOT / "service" / "data" / "demo-hwpc.jsonl").read_bytes()

        def sent() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
                    connection.sendall(payload)
                return True
            except OSError:
                return False

        wait_until(sent, 60, "the container's socket input")
        wait_until(lambda: (out / "power.jsonl").exists(), 60, "power.jsonl")
        stopped = run(*PODMAN, "stop", "--time", "30", name)
        assert stopped.returncode == 0, stopped.stderr
        logs = run(*PODMAN, "logs", name)
        assert "listening for hwpc-sensor on 0.0.0.0:9080" in logs.stdout + logs.stderr
        assert (out / "power.jsonl").read_text().count('"target":"rapl"') > 0
    finally:
        run(*PODMAN, "rm", "--force", name)


def test_the_health_endpoint_answers_in_the_container(image: str) -> None:
    """The image's own health check passes against `wattflow run --http-port 9100`."""
    name = f"wattflow-health-{free_port()}"
    started = run(
        *START,
        "--name",
        name,
        image,
        "run",
        "--http-port",
        "9100",
        "--input",
        "socket",
        "--output",
        "jsonl",
        "--file",
        "/tmp/power.jsonl",
    )
    assert started.returncode == 0, started.stderr
    try:

        def healthy() -> bool:
            state = run(*PODMAN, "inspect", name, "--format", "{{.State.Running}}")
            assert state.stdout.strip() == "true", run(*PODMAN, "logs", name).stderr
            return run(*PODMAN, "healthcheck", "run", name).returncode == 0

        wait_until(healthy, 60, "the container's health check")
    finally:
        run(*PODMAN, "rm", "--force", name)


def test_podman_is_there() -> None:
    """The tools this module needs (scripts/test-image installs them)."""
    for tool in ("podman", "runc", "mmdebstrap"):
        assert shutil.which(tool), f"{tool} is missing: run scripts/test-image"
