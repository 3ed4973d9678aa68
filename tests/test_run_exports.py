"""``wattflow run --run … --export FORMAT``: a run exported by the service as soon as it ends,
and a failed export logged with the command that writes it later."""

from __future__ import annotations

import re
import shlex
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd  # type: ignore[import-untyped]

from wattflow.actors.run_store import open_store
from wattflow.formats.reports import EventReport, GPUReport, MeterReport, Report

from .conftest import Service, wait_until, wattflow
from .test_runs import at, recording, write_jsonl

RUN = "live/bert/250W/3"


def inputs(tmp_path: Path, *, ended: bool = True) -> list[str]:
    """The flags of three JSON Lines inputs: GPU readings, a meter and the run's events (without
    experiment_end when not ``ended``)."""
    reports = recording(3)
    events: list[Report] = [
        r for r in reports if isinstance(r, EventReport) and r.timestamp <= at(3)
    ]
    if not ended:
        events = [
            e for e in events if not (isinstance(e, EventReport) and e.event == "experiment_end")
        ]
    files: dict[str, list[Report]] = {
        "GPUReport": [r for r in reports if isinstance(r, GPUReport)],
        "MeterReport": [r for r in reports if isinstance(r, MeterReport)],
        "EventReport": events,
    }
    flags = []
    for kind, chosen in files.items():
        path = write_jsonl(tmp_path / f"{kind}.jsonl", chosen)
        flags += ["--input", "jsonl", "--model", kind, "--files", str(path)]
    return flags


def listed_exports(store: str) -> str:
    listed = wattflow("runs", "list", "--store", store)
    assert listed.returncode == 0, listed.stderr
    [row] = [line for line in listed.stdout.splitlines() if line.startswith(RUN)]
    return row.split("\t")[-1]


def test_a_live_run_leaves_its_directory_behind_as_soon_as_it_ends(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    out = tmp_path / "exports"
    repetition = out / "gpu-dir" / "live" / "bert" / "250W" / "3"
    service = Service(
        tmp_path / "service.log", "run", "-s", *inputs(tmp_path), "--gpu-idle-power", "50",
        "--run", RUN, "--store", store, "--export", "gpu-dir,ross", "--export-dir", str(out),
    )  # fmt: skip
    with service:
        # Following its inputs, the service never ends by itself: what is exported was
        # exported when the run's experiment_end was stored.
        wait_until(
            lambda: service.alive() and (repetition / "timestamps.csv").exists(),
            60,
            "the GPU directory of the run",
        )
        service.wait_for_log("exported run live/bert/250W/3 as ross")
        log = service.stop()
    assert "was not exported" not in log, log
    gpu = pd.read_csv(repetition / "gpu-power.csv", index_col=0)
    assert len(gpu) == 30, "every GPU reading, those stored after experiment_end included"
    events = pd.read_csv(repetition / "timestamps.csv")
    assert list(events["event"])[-1] == "experiment_end"
    assert (out / "ross" / "live-bert-250W-3.bin").stat().st_size > 0
    assert listed_exports(store) == "gpu-dir, ross"


def test_a_failed_export_is_logged_with_the_command_that_writes_it(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    out = tmp_path / "exports"
    out.mkdir()
    (out / "gpu-dir").write_text("in the way")  # where the GPU directory would go
    # No experiment_end: the run ends with the service, which ends with its inputs.
    done = wattflow(
        "run", *inputs(tmp_path, ended=False), "--gpu-idle-power", "50", "--run", RUN,
        "--store", store, "--export", "gpu-dir", "--export-dir", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "was not exported as gpu-dir" in line]
    assert "ERROR" in line
    command = re.search(r"write it with: (wattflow export .*)$", line)
    assert command is not None, line
    assert listed_exports(store).startswith("gpu-dir (failed: [Errno 20] Not a directory")
    with open_store(store) as opened:
        assert opened.count(opened.get(RUN)) > 0, "the reports are in the store"

    (out / "gpu-dir").unlink()
    again = wattflow(*shlex.split(command.group(1))[1:])
    assert again.returncode == 0, again.stderr
    repetition = out / "gpu-dir" / "live" / "bert" / "250W" / "3"
    assert list(pd.read_csv(repetition / "timestamps.csv")["event"])[-1] == "experiment_end"
    assert listed_exports(store) == "gpu-dir"


def test_an_end_marked_from_a_shell_exports_the_live_run_once(tmp_path: Path) -> None:
    """``wattflow runs mark experiment_end`` writes to the store, not to the service: the
    recorder finds the end there, exports the run then, and not again when it stops."""
    shift = datetime.now(UTC) - at(3)  # a run recorded until now, as a live one is
    reports = [
        r.model_copy(update={"timestamp": r.timestamp + shift})
        for r in recording(3)
        if r.timestamp <= at(3)
    ]
    flags = []
    for kind in ("GPUReport", "MeterReport", "EventReport"):
        chosen = [
            r for r in reports if r.kind == kind and getattr(r, "event", "") != "experiment_end"
        ]
        path = write_jsonl(tmp_path / f"{kind}.jsonl", chosen)
        flags += ["--input", "jsonl", "--model", kind, "--files", str(path)]
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    out = tmp_path / "exports"
    timestamps = out / "gpu-dir" / "live" / "bert" / "250W" / "3" / "timestamps.csv"
    service = Service(
        tmp_path / "service.log", "run", "-s", *flags, "--gpu-idle-power", "50",
        "--run", RUN, "--store", store, "--export", "gpu-dir", "--export-dir", str(out),
    )  # fmt: skip
    with service:

        def recorded() -> bool:
            with open_store(store) as opened:
                run = opened.find(RUN)
                return run is not None and opened.count(run) >= len(reports) - 1

        wait_until(lambda: service.alive() and recorded(), 60, "the run's reports in the store")
        assert not timestamps.exists(), "no end yet, no export"
        marked = wattflow("runs", "mark", "experiment_end", "--run", RUN, "--store", store)
        assert marked.returncode == 0, marked.stderr
        service.wait_for_log(f"exported run {RUN} as gpu-dir")
        assert list(pd.read_csv(timestamps)["event"])[-1] == "experiment_end"
        log = service.stop()
    assert log.count("exported run") == 1, "nothing came after the end: no export at the stop"
    assert listed_exports(store) == "gpu-dir"
