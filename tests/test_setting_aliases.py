"""Settings renamed to give their unit still answer to their old name: flag, key and variable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.formulas.gpu import GpuConfig
from wattflow.actors.formulas.smartwatts import SmartWattsConfig
from wattflow.service import config as service_config
from wattflow.service.cli import _global_parser, load_run_config
from wattflow.service.config import ConfigError, ServiceConfig

RENAMED = sorted(
    (formula, old, new)
    for formula, model in service_config.formula_settings().items()
    for old, new in service_config.renamed_settings([model]).items()
)
IDS = [f"{old}->{new}" for _, old, new in RENAMED]


def test_the_settings_without_their_unit_were_renamed() -> None:
    assert ("smartwatts", "tick_lateness", "tick_lateness_ms") in RENAMED
    assert ("gpu", "gpu_idle_power", "gpu_idle_power_w") in RENAMED


def setting(config: ServiceConfig, formula: str, name: str) -> Any:
    return getattr(config.formulas[formula], name)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize(("formula", "old", "new"), RENAMED, ids=IDS)
def test_the_old_flag_sets_the_new_setting(formula: str, old: str, new: str) -> None:
    assert setting(load_run_config([flag(old), "123"], environ={}), formula, new) == 123
    assert setting(load_run_config([flag(new), "124"], environ={}), formula, new) == 124


@pytest.mark.parametrize(("formula", "old", "new"), RENAMED, ids=IDS)
def test_the_old_config_key_sets_the_new_setting(
    formula: str, old: str, new: str, tmp_path: Path
) -> None:
    toml = tmp_path / "wattflow.toml"
    toml.write_text(f"{old} = 123\n", encoding="utf-8")
    config = load_run_config(["--config-file", str(toml)], environ={})
    assert setting(config, formula, new) == 123
    powerapi_json = tmp_path / "powerapi.json"  # PowerAPI's layout: dashes
    powerapi_json.write_text(json.dumps({old.replace("_", "-"): 124}), encoding="utf-8")
    config = load_run_config(["--config-file", str(powerapi_json)], environ={})
    assert setting(config, formula, new) == 124


@pytest.mark.parametrize("prefix", ["WATTFLOW_", "POWERAPI_"])
@pytest.mark.parametrize(("formula", "old", "new"), RENAMED, ids=IDS)
def test_the_old_variable_sets_the_new_setting(
    formula: str, old: str, new: str, prefix: str
) -> None:
    config = load_run_config([], environ={prefix + old.upper(): "123"})
    assert setting(config, formula, new) == 123


@pytest.mark.parametrize(("formula", "old", "new"), RENAMED, ids=IDS)
def test_layers_override_each_other_whichever_name_each_gives(
    formula: str, old: str, new: str, tmp_path: Path
) -> None:
    toml = tmp_path / "wattflow.toml"
    toml.write_text(f"{new} = 1\n", encoding="utf-8")
    file = ["--config-file", str(toml)]
    assert (
        setting(load_run_config(file, environ={f"WATTFLOW_{old.upper()}": "2"}), formula, new) == 2
    )
    config = load_run_config([*file, flag(old), "3"], environ={f"WATTFLOW_{new.upper()}": "2"})
    assert setting(config, formula, new) == 3
    toml.write_text(f"{old} = 1\n", encoding="utf-8")
    assert (
        setting(load_run_config(file, environ={f"WATTFLOW_{new.upper()}": "2"}), formula, new) == 2
    )
    assert setting(load_run_config([*file, flag(new), "3"], environ={}), formula, new) == 3


@pytest.mark.parametrize(("formula", "old", "new"), RENAMED, ids=IDS)
def test_both_names_in_one_file_the_new_one_wins(
    formula: str, old: str, new: str, tmp_path: Path
) -> None:
    toml = tmp_path / "wattflow.toml"
    toml.write_text(f"{old} = 1\n{new} = 2\n", encoding="utf-8")
    config = load_run_config(["--config-file", str(toml)], environ={})
    assert setting(config, formula, new) == 2


def test_a_bad_value_under_the_old_name_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="tick-lateness-ms"):
        load_run_config(["--tick-lateness", "-5"], environ={})


def test_the_help_shows_the_old_flags_as_deprecated() -> None:
    text = _global_parser().format_help()
    assert "--tick-lateness-ms TICK_LATENESS_MS, --tick-lateness TICK_LATENESS_MS" in text
    assert "--gpu-idle-power-w GPU_IDLE_POWER_W, --gpu-idle-power GPU_IDLE_POWER_W" in text
    assert "deprecated: --tick-lateness." in " ".join(text.split())


def test_python_code_may_still_use_the_old_keyword() -> None:
    assert SmartWattsConfig(tick_lateness=500).tick_lateness_ms == 500
    assert SmartWattsConfig(tick_lateness_ms=600).tick_lateness_ms == 600
    assert GpuConfig(gpu_idle_power=40.0).gpu_idle_power_w == 40.0
    assert GpuConfig.model_validate({"gpu_idle_power_w": 41.0}).gpu_idle_power_w == 41.0


def test_powerapi_settings_keep_their_names_and_say_their_unit() -> None:
    fields = SmartWattsConfig.model_fields
    for name, unit in [
        ("cpu_tdp", "W"),
        ("cpu_base_clock", "MHz"),
        ("cpu_base_freq", "MHz"),
        ("cpu_error_threshold", "W"),
        ("dram_error_threshold", "W"),
        ("sensor_reports_frequency", "ms"),
    ]:
        extra = fields[name].json_schema_extra
        assert isinstance(extra, dict)
        assert extra["unit"] == unit, name
        assert not service_config.old_names(name, fields[name]), name
