"""Pullers: one module per input backend, each registered under its type name."""

from typing import Any

from wattflow.actors.pullers.base import Puller
from wattflow.actors.registry import Registry

pullers: Registry[type[Puller[Any]]] = Registry("input")

for _name in ("csv", "jsonl", "meter", "mongodb", "nvml", "socket", "zeromq"):
    pullers.declare(_name, f"wattflow.actors.pullers.{_name}")

__all__ = ["pullers"]
