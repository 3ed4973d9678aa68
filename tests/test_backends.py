"""Every registered input and output: its example works, and its flags say what its model says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from wattflow.actors.backend import BackendConfig
from wattflow.actors.pullers import pullers
from wattflow.actors.pushers import pushers
from wattflow.service.cli import flag_names, load_run_config

BACKENDS = [("input", name, cls.config_model) for name, cls in pullers.items()] + [
    ("output", name, cls.config_model) for name, cls in pushers.items()
]


def as_flags(config: BaseModel) -> list[str]:
    flags = []
    for name, field in type(config).model_fields.items():
        if name == "type":
            continue
        value: Any = getattr(config, name)
        flag = flag_names(name, field)[-1]
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, list):
            if value:
                flags += [flag, ",".join(str(v) for v in value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@pytest.mark.parametrize(
    ("group", "name", "model"), BACKENDS, ids=[b[1] + "-" + b[0] for b in BACKENDS]
)
def test_example_round_trips_through_the_command_line(
    group: str, name: str, model: type[BackendConfig]
) -> None:
    example = model.example()
    assert example.type == name
    assert example.name == f"{'puller' if group == 'input' else 'pusher'}_{name}"
    other_group = "output" if group == "input" else "input"
    other = (pushers if group == "input" else pullers).get("jsonl").config_model.example()
    argv = [f"--{group}", name, *as_flags(example), f"--{other_group}", "jsonl", *as_flags(other)]
    config = load_run_config(argv, environ={})
    built = (config.inputs if group == "input" else config.outputs)[example.name]
    assert built == example


@pytest.mark.parametrize(
    ("group", "name", "model"), BACKENDS, ids=[b[1] + "-" + b[0] for b in BACKENDS]
)
def test_every_setting_is_documented(group: str, name: str, model: type[BackendConfig]) -> None:
    for field_name, field in model.model_fields.items():
        if field_name == "type":  # the backend's own name
            continue
        assert field.description, f"{group} {name}: {field_name} has no description"
        assert field.description.endswith((".", ")")), f"{field_name}: write a full sentence"


def test_backend_construction_from_examples(tmp_path: Path) -> None:
    for _, cls in pullers.items():
        assert cls(cls.config_model.example()).config.type
    for _, pusher_cls in pushers.items():
        assert pusher_cls(pusher_cls.config_model.example()).config.type
