"""``--compat smartwatts-2.4`` against SmartWatts 2.4.1's own output for the same recording.

tests/data/smartwatts-2.4.1/ holds a generated recording in PowerAPI's CSV layout (with
multiplexed readings, which SmartWatts takes as reported) and the PowerReport CSV files
SmartWatts 2.4.1 wrote for it (README.txt there says how). A user switching from SmartWatts with
``--compat smartwatts-2.4`` should get the same numbers in the same files.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, wattflow

DATA = ROOT / "tests" / "data" / "smartwatts-2.4.1"

Key = tuple[int, str, str, str]
"""(timestamp ms, target, socket, scope)"""

Reports = dict[Key, tuple[float, dict[str, str]]]
Both = tuple[Reports, Reports]


def power_reports(directory: Path) -> Reports:
    """Every PowerReport row under a PowerAPI CSV output directory, by its identity."""
    found: Reports = {}
    for path in sorted(directory.glob("*/PowerReport.csv")):
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                key = (int(row["timestamp"]), row["target"], row["socket"], row["scope"])
                assert key not in found, f"{key} written twice"
                found[key] = (float(row["power"]), row)
    return found


@pytest.fixture(scope="module")
def wattflow_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory wattflow wrote, run with SmartWatts' command line plus the compat flag."""
    out = tmp_path_factory.mktemp("compat")
    files = ",".join(str(DATA / "input" / name) for name in ("rapl.csv", "msr.csv", "core.csv"))
    result = wattflow(
        "run",
        "--input", "csv", "--model", "HWPCReport", "--name", "puller", "--files", files,
        "--output", "csv", "--model", "PowerReport", "--name", "pusher", "--directory", str(out),
        "--cpu-base-freq", "2100", "--cpu-tdp", "400", "--learn-min-samples-required", "10",
        "--learn-history-window-size", "20", "--sensor-reports-frequency", "1000",
        "--compat", "smartwatts-2.4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def outputs(wattflow_output: Path) -> Both:
    """SmartWatts' reports and wattflow's."""
    return power_reports(DATA / "output"), power_reports(wattflow_output)


def test_every_smartwatts_report_is_reproduced_within_one_percent(
    outputs: Both,
) -> None:
    smartwatts, ours = outputs
    targets = {key[1] for key in smartwatts}
    assert {"rapl", "global", "web-frontend", "postgres", "ml-training"} <= targets
    assert len(smartwatts) == 384  # the whole fixture was read
    for key, (expected, row) in smartwatts.items():
        assert key in ours, f"SmartWatts wrote {key}, wattflow did not"
        got, our_row = ours[key]
        assert got == pytest.approx(expected, rel=0.01, abs=1e-6), key
        assert float(our_row["ratio"]) == pytest.approx(float(row["ratio"]), rel=0.01, abs=1e-9)
        if key[1] == "rapl":
            assert our_row["formula"] == row["formula"], key


def test_files_have_smartwatts_layout(wattflow_output: Path) -> None:
    """Same files and headers, so that whatever reads SmartWatts' CSV output reads wattflow's."""
    expected = sorted(p.relative_to(DATA / "output") for p in (DATA / "output").glob("*/*"))
    assert sorted(p.relative_to(wattflow_output) for p in wattflow_output.glob("*/*")) == expected
    for path in expected:
        header = (DATA / "output" / path).read_text().splitlines()[0]
        assert (wattflow_output / path).read_text().splitlines()[0] == header, path


def test_models_change_where_smartwatts_relearned(
    outputs: Both,
) -> None:
    smartwatts, ours = outputs

    # Model hashes differ (SmartWatts hashes a pickle), but a new model starts on the same ticks.
    def changes(reports: Reports) -> set[Key]:
        previous: dict[tuple[str, str], str] = {}
        changed = set()
        for key in sorted(k for k in reports if k[1] == "global" and k in smartwatts):
            formula = reports[key][1]["formula"]
            if previous.get((key[2], key[3])) not in (None, formula):
                changed.add(key)
            previous[(key[2], key[3])] = formula
        return changed

    assert changes(smartwatts)  # the recording makes SmartWatts relearn
    assert changes(ours) == changes(smartwatts)


def test_the_ticks_smartwatts_loses_at_shutdown_are_processed(
    outputs: Both,
) -> None:
    smartwatts, ours = outputs
    last = max(key[0] for key in smartwatts)
    later = {key[0] for key in ours if key[0] > last}
    assert len(later) == 5


def test_without_scikit_learn_the_compat_mode_says_which_extra_to_install(tmp_path: Path) -> None:
    """scikit-learn is the compat mode's alone (``wattflow[compat]``): a service started with
    ``--compat smartwatts-2.4`` where it is missing stops before reading anything, exit 2,
    naming the extra, rather than failing at its first fit."""
    files = ",".join(str(DATA / "input" / name) for name in ("rapl.csv", "msr.csv", "core.csv"))
    argv = [
        "run",
        "--input", "csv", "--model", "HWPCReport", "--name", "puller", "--files", files,
        "--output", "csv", "--model", "PowerReport", "--name", "pusher",
        "--directory", str(tmp_path / "out"), "--compat", "smartwatts-2.4",
    ]  # fmt: skip
    as_if_not_installed = (
        "import sys; sys.modules['sklearn'] = None; "  # what a missing package raises
        "from wattflow.service.cli import main; sys.exit(main(sys.argv[1:]))"
    )

    def without_scikit_learn(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", as_if_not_installed, *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )

    result = without_scikit_learn(*argv)
    assert result.returncode == 2, result.stderr
    assert "pip install 'wattflow[compat]'" in result.stderr
    assert not any((tmp_path / "out").rglob("*.csv"))
    default_mode = [flag for flag in argv if flag not in ("--compat", "smartwatts-2.4")]
    result = without_scikit_learn(*default_mode)
    assert result.returncode == 0, result.stderr
    assert any((tmp_path / "out").rglob("PowerReport.csv")), "the default mode needs none"
