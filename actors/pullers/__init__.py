"""Pullers: one module per input backend, each registered under its type name."""

from typing import Any

from wattflow.actors.pullers.base import Puller
from wattflow.actors.registry import Registry

pullers: Registry[type[Puller[Any]]] = Registry("input")

for _name in ("csv", "filedb", "jsonl", "meter", "mongodb", "socket", "zeromq"):
    pullers.declare(_name, f"wattflow.actors.pullers.{_name}")
# A package split by concern; the module that registers it is its ``puller``.
pullers.declare("nvml", "wattflow.actors.pullers.nvml.puller")

__all__ = ["pullers"]
