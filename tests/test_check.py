"""``wattflow check``: what works on this machine, and why not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from rich.console import Console

from wattflow.service.check import check_command, rapl_perf, rapl_powercap

from .conftest import wattflow
from .servers import ServerProcess, free_port, mongodb_uri


def test_powercap_zones_are_listed_from_sysfs(tmp_path: Path) -> None:
    for index, name in enumerate(["package-0", "package-1"]):
        zone = tmp_path / f"intel-rapl:{index}"
        zone.mkdir()
        (zone / "name").write_text(name + "\n")
        (zone / "energy_uj").write_text("123456\n")
    found = rapl_powercap(tmp_path)
    assert found.works
    assert found.detail == "2 zones readable: package-0, package-1"
    missing = rapl_powercap(tmp_path / "nowhere")
    assert not missing.works
    assert "does not exist" in missing.detail
    assert not rapl_perf(tmp_path / "no-pmu").works


def test_check_contacts_every_configured_server(mongodb_server: ServerProcess) -> None:
    dead_port = free_port()
    done = wattflow(
        "check",
        "--input", "mongodb", "-u", mongodb_uri(mongodb_server), "-d", "powerapi", "-c", "hwpc",
        "--output", "mongodb", "-u", f"mongodb://127.0.0.1:{dead_port}/", "-d", "p", "-c", "w",
        "--server-timeout-s", "0.5",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    reachable = next(line for line in lines if "input puller_mongodb" in line)
    assert "ok" in reachable
    assert "replica set" in done.stdout
    unreachable = next(line for line in lines if "output pusher_mongodb" in line)
    assert " no " in unreachable
    assert str(dead_port) in done.stdout
    for what in ("RAPL via powercap", "RAPL via perf", "NVML"):
        assert what in done.stdout
    assert "Traceback" not in done.stderr


def test_check_without_servers_reports_the_machine_and_exits_0() -> None:
    done = wattflow("check")
    assert done.returncode == 0, done.stderr
    assert "NVML" in done.stdout
    # The test command installs wattflow with a compiler: the C parser is built and named.
    assert "C parser (straight into columns)" in done.stdout
    assert "scikit-learn installed" in done.stdout  # the test extras include wattflow[compat]
    bad = wattflow("check", "--output", "nowhere")
    assert bad.returncode == 2
    assert "unknown output 'nowhere'" in bad.stderr


def test_check_help_describes_check() -> None:
    done = wattflow("check", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: wattflow check")
    assert "wattflow run" in done.stdout  # it takes run's flags, and says where they are listed


def test_the_compat_line_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where scikit-learn is missing, the screen says to install ``wattflow[compat]``: the
    brackets printed as they are, not read as the console's markup (they vanished)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "sklearn" else real_find_spec(name, *rest),
    )
    console = Console(record=True, width=200)
    assert check_command([], console) == 0
    assert "needs scikit-learn: pip install 'wattflow[compat]'" in console.export_text()


def test_check_reads_the_configuration_as_run_does(tmp_path: Path) -> None:
    """The file ``WATTFLOW_CONFIG_FILE`` names, and the ``POWERAPI_*`` variables, configure
    what ``wattflow check`` contacts, as they configure ``wattflow run``: a node checked with
    the service's own environment checks the service's own outputs."""
    dead_port = free_port()
    config = tmp_path / "cfg.toml"
    config.write_text(
        f'[output.db]\ntype = "mongodb"\nuri = "mongodb://127.0.0.1:{dead_port}/"\n'
        'db = "p"\ncollection = "w"\nserver_timeout_s = 0.5\n'
    )
    from_file = wattflow("check", env={"WATTFLOW_CONFIG_FILE": str(config)})
    assert from_file.returncode == 1, from_file.stdout + from_file.stderr
    unreachable = next(line for line in from_file.stdout.splitlines() if "output db" in line)
    assert " no " in unreachable
    assert f"127.0.0.1:{dead_port}" in from_file.stdout
    assert "Give the service's" not in from_file.stdout
    variables = {
        "POWERAPI_OUTPUT_VARS_TYPE": "mongodb",
        "POWERAPI_OUTPUT_VARS_URI": f"mongodb://127.0.0.1:{dead_port}/",
        "POWERAPI_OUTPUT_VARS_DB": "p",
        "POWERAPI_OUTPUT_VARS_COLLECTION": "w",
        "POWERAPI_OUTPUT_VARS_SERVER_TIMEOUT_S": "0.5",
    }
    from_variables = wattflow("check", env=variables)
    assert from_variables.returncode == 1, from_variables.stdout + from_variables.stderr
    assert "output vars (mongodb)" in from_variables.stdout
    bogus = wattflow("check", env={"POWERAPI_BOGUS": "1"})
    assert bogus.returncode == 2
    assert "wattflow: error: bogus: unknown setting" in bogus.stderr


def test_a_setting_run_refuses_at_start_is_exit_2_in_check_too(tmp_path: Path) -> None:
    """A missing secret file stops ``wattflow run`` with exit 2 before anything runs; ``wattflow
    check`` gives the same code and the same line, after its screen."""
    missing = tmp_path / "influxdb2-token"
    flags = ["--output", "influxdb2", "--uri", "http://127.0.0.1:1", "--org", "o", "--db", "b"]
    flags += ["--token-file", str(missing)]
    run = wattflow("run", "--input", "socket", "--port", str(free_port()), *flags)
    checked = wattflow("check", *flags)
    assert run.returncode == 2, run.stderr
    assert checked.returncode == 2, checked.stdout + checked.stderr
    error = f"wattflow: error: --token-file file {missing}: No such file or directory"
    assert error in run.stderr
    assert error in checked.stderr
    assert "output pusher_influxdb2" in checked.stdout  # the screen is printed all the same
