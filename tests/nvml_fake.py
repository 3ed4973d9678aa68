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
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from wattflow.formats.reports import GPUDevice, GPUProcess, GPUReport

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
        who = self._slot(ms)
        return 0 if who.startswith("~") else self._alive(who, ms)

    def resident(self, ms: int) -> int:
        """The pid whose context is resident on the engine during millisecond ``ms`` (running
        work or not: ``~pid``); 0 for nobody."""
        return self._alive(self._slot(ms).lstrip("~"), ms)

    def _slot(self, ms: int) -> str:
        offset = (ms % self.period_ms + self.rotation(ms // self.period_ms)) % self.period_ms
        return [w for at, w in self.slots if at <= offset][-1]

    def _alive(self, who: str, ms: int) -> int:
        if who.startswith("-") or not int(who):
            return 0
        pid = int(who)
        life = self.lives.get(pid)
        return pid if life is None or life[0] <= ms < life[1] else 0

    def sampled_mj(self, start_us: int, end_us: int, sample_ms: int) -> dict[int, float]:
        """Each pid's energy above idle over (start_us, end_us] as the driver's samples tell
        it, by the stand-in's rules: a sample every ``sample_ms`` of Unix time names the pid
        resident at its instant and holds the engine's busy % over its period, so it stands
        for that many ms of that pid's engine time. Over whole slicing periods this is the
        truth (``active_mj``); a span that cuts a period differs from it by what the samples
        there happen to catch."""
        energy: dict[int, float] = {}
        first = start_us // 1000 // sample_ms * sample_ms + sample_ms
        for stamp in range(first, end_us // 1000 + 1, sample_ms):
            pid = self.resident(stamp - 1)
            busy_ms = sum(self.running(ms) != 0 for ms in range(stamp - sample_ms, stamp))
            if pid and busy_ms:
                mw = self.pid_mw.get(pid, 200_000)
                energy[pid] = energy.get(pid, 0.0) + mw * busy_ms / 1000
        return energy

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


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser, as ``mix`` in ``fake_nvml.c``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Tenant(NamedTuple):
    """One ``dN.tenant`` process: its power above idle while it holds the engine (mW), the
    share of stretches it wants the engine in, and its life (Unix ms; 0, 0: always)."""

    pid: int
    mw: int
    duty: int = 100
    stretch_ms: int = 1000
    life_ms: tuple[int, int] = (0, 0)
    together_with: int = 0
    """A pid whose stretches it follows (a pair that never runs apart)."""


class Tenants:
    """The stand-in's tenant processes (``dN.tenant``), mirrored to compute exact truths and to
    simulate what the sampler reads from them, with the same hashes as ``fake_nvml.c``."""

    def __init__(
        self, tenants: list[Tenant], *, idle_mw: int, timeslice_ms: int = 1, seed: int = 0
    ) -> None:
        self.tenants = tenants
        self.idle_mw = idle_mw
        self.timeslice_ms = timeslice_ms
        self.seed = seed

    def lines(self, device: int = 0) -> list[str]:
        """The scenario lines of these tenants on ``device`` (and the global seed)."""
        lines = [f"seed={self.seed}", f"d{device}.idle_mw={self.idle_mw}",
                 f"d{device}.timeslice_ms={self.timeslice_ms}"]  # fmt: skip
        for t in self.tenants:
            life = f":{t.life_ms[0]}:{t.life_ms[1]}" if t.life_ms[1] else ""
            lines.append(f"d{device}.tenant={t.pid}:{t.mw}:{t.duty}:{t.stretch_ms}{life}")
        lines += [f"d{device}.together={t.pid}:{t.together_with}"
                  for t in self.tenants if t.together_with]  # fmt: skip
        return lines

    def _wants(self, tenant: Tenant, ms: int) -> bool:
        if tenant.life_ms[1] and not tenant.life_ms[0] <= ms < tenant.life_ms[1]:
            return False
        leader = next((t for t in self.tenants if t.pid == tenant.together_with), tenant)
        if leader.duty >= 100:
            return True
        stretch = ms // (leader.stretch_ms or 1000)
        return _mix(self.seed ^ _mix(leader.pid * 1000003 + stretch)) % 100 < leader.duty

    def holder(self, ms: int) -> Tenant | None:
        """The tenant holding the engine during millisecond ``ms``, or None."""
        wanting = [t for t in self.tenants if self._wants(t, ms)]
        if not wanting:
            return None
        slice_ = ms // (self.timeslice_ms or 1)
        return wanting[_mix((self.seed * 31 + slice_) & _MASK64) % len(wanting)]

    def active_mj(self, start_us: int, end_us: int) -> dict[tuple[int, int], float]:
        """Each tenant's energy above idle over [start_us, end_us), in mJ, keyed by (pid, the
        start of its life): a reused pid is another process."""
        energy: dict[tuple[int, int], float] = {}
        ms = start_us // 1000
        while ms * 1000 < end_us:
            cell = min(end_us, (ms + 1) * 1000) - max(start_us, ms * 1000)
            tenant = self.holder(ms)
            if tenant is not None:
                key = (tenant.pid, tenant.life_ms[0])
                energy[key] = energy.get(key, 0.0) + tenant.mw * cell / 1e6
            ms += 1
        return energy


def simulate_sampler(
    tenants: Tenants,
    start_ms: int,
    seconds: float,
    *,
    sensor: str = "node-1",
    tick_ms: int = 100,
    window_ms: int = 1000,
    energy_ms: int = 2000,
    util_sample_ms: int = 200,
    power_sample_ms: int = 20,
    energy_step_ms: int = 100,
    buffers_ms: int = 5000,
    started: dict[int, int] | None = None,
) -> list[GPUReport]:
    """The GPUReports that ``wattflow run --input nvml`` writes over the stand-in's tenants, in
    no time: the same driver rules (a utilisation sample every ``util_sample_ms`` holding the
    engine's busy % over its period and the ONE pid resident at its instant, averaged per pid
    since the last answer, rounded to whole %; power samples every ``power_sample_ms``; the
    energy counter stepping every ``energy_step_ms``) read on the sampler's schedule (power
    and utilisation every tick, the process window and power samples every ``window_ms``, the
    counter every ``energy_ms``, the utilisation buffer every ``buffers_ms``), each reading
    taken at its tick's instant. For seeded tests of the GPU formula's statistics, which a
    real-time run cannot repeat exactly.

    ``started`` gives a pid's process start time for its life starting at that Unix ms (the
    key), as the NVML input reads it from /proc."""
    end_ms = start_ms + round(seconds * 1000)
    first_ms = start_ms - max(window_ms, buffers_ms, energy_ms) - util_sample_ms
    holders = [tenants.holder(ms) for ms in range(first_ms, end_ms + 1)]

    def held(ms: int) -> Tenant | None:
        return holders[ms - first_ms]

    def power_mw(ms: int) -> int:
        tenant = held(ms)
        return tenants.idle_mw + (tenant.mw if tenant else 0)

    def read_mw(at_ms: int) -> int:  # as the stand-in reads power: its sensor's mean
        return sum(power_mw(ms) for ms in range(at_ms - power_sample_ms, at_ms)) // power_sample_ms

    def busy_percent(at_ms: int) -> int:
        busy = sum(held(ms) is not None for ms in range(at_ms - util_sample_ms, at_ms))
        return busy * 100 // util_sample_ms

    energy_mw_ms = 0  # integral of power from first_ms
    integral = [0]
    for ms in range(first_ms, end_ms + 1):
        energy_mw_ms += power_mw(ms)
        integral.append(energy_mw_ms)

    def energy_mj(at_ms: int) -> float:
        stepped = at_ms - at_ms % energy_step_ms if energy_step_ms else at_ms
        return float(integral[stepped - first_ms] // 1000)

    def grid(period_ms: int, after_ms: int, now_ms: int) -> list[int]:
        first = after_ms // period_ms * period_ms + period_ms
        return list(range(first, now_ms - now_ms % period_ms + 1, period_ms))

    reports: list[GPUReport] = []
    last_process_ms = last_power_ms = last_util_ms = start_ms
    for now_ms in range(start_ms + tick_ms, end_ms + 1, tick_ms):
        since = now_ms - start_ms
        fields: dict[str, Any] = {
            "power": float(read_mw(now_ms)),
            "power_averaged": False,
            "util_gpu": float(busy_percent(now_ms - now_ms % util_sample_ms)),
        }
        if since % energy_ms == 0:
            fields["total_energy"] = energy_mj(now_ms)
        samples: dict[str, list[tuple[int, float]]] = {}
        if since % window_ms == 0:
            stamps = grid(power_sample_ms, last_power_ms, now_ms)
            samples["TOTAL_POWER"] = [(ms * 1000, float(read_mw(ms))) for ms in stamps]
            last_power_ms = stamps[-1] if stamps else last_power_ms
            fields["processes"], window = _simulated_window(
                tenants, held, busy_percent, grid(util_sample_ms, last_process_ms, now_ms),
                last_process_ms, now_ms, started or {},
            )  # fmt: skip
            fields["process_window"] = (window[0] * 1000, window[1] * 1000)
            fields["running_pids"] = sorted(
                {t.pid for t in tenants.tenants if not t.life_ms[1]
                 or t.life_ms[0] <= now_ms < t.life_ms[1]}
            )  # fmt: skip
            last_process_ms = window[1]
        else:
            fields["processes"] = []
            fields["process_window"] = (last_process_ms * 1000, last_process_ms * 1000)
        if since % buffers_ms == 0:
            stamps = grid(util_sample_ms, last_util_ms, now_ms)
            samples["GPU_UTILIZATION"] = [(ms * 1000, float(busy_percent(ms))) for ms in stamps]
            last_util_ms = stamps[-1] if stamps else last_util_ms
        if samples:
            fields["samples"] = samples
        reports.append(
            GPUReport(
                timestamp=datetime.fromtimestamp(now_ms / 1000, UTC),
                sensor=sensor,
                target="all",
                devices={"0": GPUDevice(**fields)},
            )
        )
    return reports


def _simulated_window(
    tenants: Tenants,
    held: Callable[[int], Tenant | None],
    busy_percent: Callable[[int], int],
    stamps: list[int],
    start_ms: int,
    now_ms: int,
    started: dict[int, int],
) -> tuple[list[GPUProcess], tuple[int, int]]:
    """One answer of the per-process utilisation over the driver samples ``stamps``, as the
    stand-in gives it and the NVML input reads it."""
    sums: dict[int, int] = {}
    newest: dict[int, int] = {}
    lives: dict[int, int] = {}
    for stamp in stamps:
        tenant = held(stamp - 1)  # resident at the sample's instant
        if tenant is None:
            continue
        sums[tenant.pid] = sums.get(tenant.pid, 0) + busy_percent(stamp)
        newest[tenant.pid] = stamp
        lives[tenant.pid] = tenant.life_ms[0]
    kept = {pid: total for pid, total in sums.items() if total}
    if not kept:
        end_ms = now_ms - 1000
        return [], (start_ms, max(start_ms, end_ms))
    count = len(stamps)
    processes = [
        GPUProcess(
            pid=pid,
            sm_util=float((total + count // 2) // count),
            started=started.get(lives[pid]),
        )
        for pid, total in sorted(kept.items())
    ]
    return processes, (start_ms, max(newest.values()))
