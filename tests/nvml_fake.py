"""The C stand-in for libnvidia-ml, built for tests, and helpers to run the sampler over it.

The stand-in (``tests/nvml_stub/fake_nvml.c``) is loaded by the real ``nvidia-ml-py`` binding
through the dynamic loader, so the sampler under test makes the same calls it makes on a GPU
node. ``LD_LIBRARY_PATH`` is read when a process starts; that is why the sampler runs as a
subprocess (the ``wattflow`` command), with its environment from :func:`nvml_environment`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import orjson

SOURCE = Path(__file__).resolve().parent / "nvml_stub" / "fake_nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"


def build_fake_nvml(directory: Path) -> Path:
    """Compile the stand-in into ``directory/libnvidia-ml.so.1``; return ``directory``."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "gcc is needed to build the NVML stand-in (apt-get install gcc)"
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(directory / LIBRARY_NAME),
            str(SOURCE),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return directory


def write_scenario(path: Path, settings: Mapping[str, object] | list[str]) -> Path:
    """Write a scenario file: a mapping of keys to values, or ready ``key=value`` lines.

    A list allows a key more than once (``d0.proc=…`` per process).
    """
    lines = settings if isinstance(settings, list) else [f"{k}={v}" for k, v in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def nvml_environment(library_dir: Path, scenario: Path | None) -> dict[str, str]:
    """The environment of a process that must load the stand-in (or, with an empty
    ``library_dir``, find no NVML at all)."""
    environment = {**os.environ, "LD_LIBRARY_PATH": str(library_dir)}
    environment.pop("FAKE_NVML_SCENARIO", None)
    if scenario is not None:
        environment["FAKE_NVML_SCENARIO"] = str(scenario)
    return environment


def sampler_command(output: Path, *flags: str) -> list[str]:
    """``wattflow run --input nvml … --output jsonl --model GPUReport --file output``."""
    return [
        sys.executable,
        "-m",
        "wattflow.service",
        "run",
        "--input",
        "nvml",
        *flags,
        "--output",
        "jsonl",
        "--model",
        "GPUReport",
        "--file",
        str(output),
    ]


def read_reports(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines written so far."""
    if not path.exists():
        return []
    text = path.read_bytes()
    return [orjson.loads(line) for line in text.split(b"\n")[:-1] if line.strip()]


class SamplerRun(NamedTuple):
    """How a sampler run ended and what it wrote."""

    code: int
    stderr: str
    reports: list[dict[str, Any]]


def run_sampler(
    environment: dict[str, str],
    output: Path,
    *flags: str,
    reports: int,
    timeout_s: float = 60.0,
) -> SamplerRun:
    """Run the sampler until it has written ``reports`` reports, then stop it as an operator
    would (SIGINT); return its exit code, its log (stderr and stdout) and what it wrote.

    The count of reports, not a duration, decides when to stop, so a slow machine only makes
    the test slower. ``timeout_s`` only catches a sampler that writes nothing.
    """
    from .conftest import Service  # here: benchmarks import this module without pytest

    log = output.with_name(output.name + ".log")
    with Service(log, command=sampler_command(output, *flags), env=environment) as service:
        service.wait_for_lines(output, reports, timeout_s)
        text = service.stop(signal.SIGINT, code=None, timeout_s=timeout_s)
    return SamplerRun(service.process.returncode, text, read_reports(output))
