"""``--pre-processor k8s`` as PowerAPI 2.10 takes it: flags, JSON, variables, and its checks.

The flag set is PowerAPI 2.10.0's (``powerapi/cli/common_cli_parsing_manager.py``:
``-a/--api-mode``, ``-k/--api-key``, ``-h/--api-host``, ``-p/--puller``, ``-n/--name``); the
table on ``docs/pre-processors/k8s.md`` is checked against the parser here, the backends' pages
in ``test_reference_docs.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from wattflow.actors.preprocessors.k8s import K8sPreProcessor
from wattflow.service import config as service_config
from wattflow.service.cli import _backend_parser, load_run_config, parse_run_args
from wattflow.service.config import ConfigError
from wattflow.service.pipeline import assemble

ROOT = Path(__file__).resolve().parent.parent
SOCKET = ["--input", "socket", "--name", "puller", "--output", "jsonl", "--file", "out.jsonl"]


def _page() -> Any:
    path = ROOT / "scripts" / "reference_docs.py"
    spec = importlib.util.spec_from_file_location("reference_docs_k8s", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.pre_processor_settings("k8s")


SETTINGS = _page()


def test_the_table_lists_every_flag_the_group_takes() -> None:
    in_table = {flag for s in SETTINGS for flag in s.flags}
    parser = _backend_parser("pre-processor", "k8s")
    options = {flag for action in parser._actions for flag in action.option_strings}
    assert in_table == options - {"--help"}
    # PowerAPI 2.10's own flags are among them, -h included (its --api-host, not help).
    assert {"-a", "--api-mode", "-k", "--api-key", "-h", "--api-host", "-p", "--puller"} <= options
    assert {"-n", "--name"} <= options


def test_every_flag_and_variable_of_the_table_sets_its_key() -> None:
    for setting in SETTINGS:
        value = {"api_mode": "local", "layout": "wattflow"}.get(setting.key, "x7")
        for flag in setting.flags:
            layer, _ = parse_run_args([*SOCKET, "--pre-processor", "k8s", flag, value])
            ((name, settings),) = layer["pre_processor"].items()
            found = name if setting.key == "name" else settings[setting.key]
            assert found == value, f"{flag} does not set {setting.key}"
        for prefix in ("WATTFLOW_", "POWERAPI_"):
            variable = setting.env.replace("WATTFLOW_", prefix).replace("<NAME>", "P1")
            layer = service_config.load_environment({variable: value})
            assert layer["pre_processor"]["p1"][setting.key] == value, variable


MODES = [["-a", "local"], ["--api-mode", "manual"], ["-a", "cluster"], []]
HOSTS = [["-h", "https://10.0.0.1:6443"], ["--api-host", "http://localhost:8001"], []]
KEYS = [["-k", "t0ken"], ["--api-key", "Bearer t0ken"], []]
NAMES = [["-n", "k8s"], ["--name", "my_pre"], []]
PULLERS = [["-p", "puller"], ["--puller", "puller"]]


@pytest.mark.parametrize("mode", MODES, ids=[" ".join(m) or "default mode" for m in MODES])
def test_every_combination_of_powerapis_flags_is_taken(mode: list[str]) -> None:
    for host, key, name, puller in itertools.product(HOSTS, KEYS, NAMES, PULLERS):
        group = ["--pre-processor", "k8s", *mode, *host, *key, *name, *puller]
        if mode[1:] == ["manual"] and not host:
            with pytest.raises(ConfigError, match="needs --api-host"):
                load_run_config([*SOCKET, *group], environ={})
            continue
        config = load_run_config([*SOCKET, *group], environ={})
        ((pre_name, pre),) = config.pre_processors.items()
        assert pre_name == (name[1] if name else "pre_processor_k8s")
        assert pre.puller == "puller"
        assert pre.api_mode == (mode[1] if mode else "cluster")  # type: ignore[attr-defined]


def test_powerapis_json_file_and_variables(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "verbose": True,
                "input": {"puller": {"type": "socket", "model": "HWPCReport", "port": 8080}},
                "output": {"pusher": {"type": "jsonl", "file": "out.jsonl"}},
                "pre-processor": {
                    "k8s": {
                        "type": "k8s",
                        "api-mode": "manual",
                        "api-host": "http://h:1",
                        "puller": "puller",
                    }
                },
            }
        )
    )
    environ = {"POWERAPI_PRE_PROCESSOR_K8S_API_KEY": "t0ken"}
    config = load_run_config(["--config-file", str(path)], environ=environ)
    pre = config.pre_processors["k8s"]
    assert (pre.api_mode, pre.api_host, pre.puller) == ("manual", "http://h:1", "puller")  # type: ignore[attr-defined]
    assert pre.api_key.get_secret_value() == "t0ken"  # type: ignore[attr-defined]
    assert "t0ken" not in repr(config)
    # The variables alone, as PowerAPI's documentation writes them.
    environ = {
        "POWERAPI_PRE_PROCESSOR_P1_TYPE": "k8s",
        "POWERAPI_PRE_PROCESSOR_P1_API_MODE": "local",
        "POWERAPI_PRE_PROCESSOR_P1_PULLER": "puller",
    }
    config = load_run_config(SOCKET, environ=environ)
    assert config.pre_processors["p1"].api_mode == "local"  # type: ignore[attr-defined]


def test_wattflows_toml_table(tmp_path: Path) -> None:
    path = tmp_path / "wattflow.toml"
    path.write_text(
        '[input.puller]\ntype = "socket"\n[output.pusher]\ntype = "jsonl"\nfile = "o.jsonl"\n'
        '[pre_processor.k8s]\ntype = "k8s"\npuller = "puller"\nnode_name = "worker-1"\n'
    )
    config = load_run_config(["--config-file", str(path)], environ={})
    assert config.pre_processors["k8s"].node_name == "worker-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (["-a", "local"], "pre-processor.pre_processor_k8s.puller: required setting is missing"),
        (
            ["-p", "sensor"],
            "pre-processor.pre_processor_k8s.puller: no input named 'sensor' (inputs: puller)",
        ),
        (
            ["-p", "puller", "-a", "remote"],
            "pre-processor.pre_processor_k8s.api_mode: Input should be 'local', 'manual' or "
            "'cluster'",
        ),
        (
            ["-p", "puller", "-a", "manual", "-k", "t"],
            "pre-processor.pre_processor_k8s: --api-mode manual needs --api-host (the API "
            "server's URL)",
        ),
        (
            ["-p", "puller", "--pre-processor", "k8s", "-p", "puller"],
            "pre-processor.pre_processor_k8s_2.puller: input 'puller' already has pre-processor "
            "'pre_processor_k8s'; one per input",
        ),
        (["-p", "puller", "--labels", "app"], "unrecognized arguments: --labels app"),
    ],
)
def test_a_bad_group_is_one_line_naming_the_setting(group: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_run_config([*SOCKET, "--pre-processor", "k8s", *group], environ={})
    assert str(error.value) == message


def test_an_unknown_pre_processor_type_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown pre-processor 'libvirt'; known: k8s"):
        load_run_config([*SOCKET, "--pre-processor", "libvirt", "-p", "puller"], environ={})


@pytest.mark.parametrize(
    ("flags", "powerapi_layout"),
    [
        ([], False),
        (["--compat", "smartwatts-2.4"], True),
        (["--compat", "smartwatts-2.4", "--layout", "wattflow"], False),
        (["--layout", "powerapi-2.10"], True),
    ],
)
def test_the_layout_follows_smartwatts_compat_unless_given(
    flags: list[str], powerapi_layout: bool
) -> None:
    group = ["--pre-processor", "k8s", "-p", "puller", *flags]
    pipeline = assemble(load_run_config([*SOCKET, *group], environ={}))
    (pre,) = pipeline.pre_processors.values()
    assert isinstance(pre, K8sPreProcessor)
    assert pre.powerapi_layout is powerapi_layout
