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


class Slicing:
    """The stand-in's time-slicing scenario (``dN.slice``), mirrored to compute exact truths.

    The same rules as ``fake_nvml.c``: whole milliseconds of Unix time, each period's schedule
    rotated by the same hash, a pid running only within its lives (Unix ms) when it has any.
    """

    def __init__(
        self,
        period_ms: int,
        slots: list[tuple[int, str]],
        *,
        jitter_ms: int = 0,
        idle_mw: int = 0,
        pid_mw: Mapping[int, int] | None = None,
        lives: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        self.period_ms = period_ms
        self.slots = slots
        self.jitter_ms = jitter_ms
        self.idle_mw = idle_mw
        self.pid_mw = dict(pid_mw or {})
        self.lives = dict(lives or {})

    def lines(self, device: int = 0) -> list[str]:
        """The scenario lines that describe this slicing on ``device``."""
        steps = ",".join(f"{at}:{who}" for at, who in self.slots)
        lines = [f"d{device}.slice={self.period_ms}:{steps}", f"d{device}.idle_mw={self.idle_mw}"]
        lines.append(f"d{device}.slice_jitter_ms={self.jitter_ms}")
        lines += [f"d{device}.pid_power={pid}:{mw}" for pid, mw in self.pid_mw.items()]
        lines += [f"d{device}.life={pid}:{a}:{b}" for pid, (a, b) in self.lives.items()]
        return lines

    def rotation(self, k: int) -> int:
        if not self.jitter_ms:
            return 0
        h = (k * 2654435761) & 0xFFFFFFFF
        h ^= h >> 15
        return h % (self.jitter_ms + 1)

    def running(self, ms: int) -> int:
        """The pid running work on the engine during millisecond ``ms``; 0 for nobody."""
        offset = (ms % self.period_ms + self.rotation(ms // self.period_ms)) % self.period_ms
        who = [w for at, w in self.slots if at <= offset][-1]
        if who.startswith(("-", "~")):
            return 0
        pid = int(who)
        life = self.lives.get(pid)
        return pid if life is None or life[0] <= ms < life[1] else 0

    def active_mj(self, start_us: int, end_us: int) -> dict[int, float]:
        """Each pid's energy above idle over [start_us, end_us), in mJ."""
        energy: dict[int, float] = {}
        ms = start_us // 1000
        while ms * 1000 < end_us:
            cell = min(end_us, (ms + 1) * 1000) - max(start_us, ms * 1000)
            pid = self.running(ms)
            if pid:
                energy[pid] = energy.get(pid, 0.0) + self.pid_mw.get(pid, 200_000) * cell / 1e6
            ms += 1
        return energy
