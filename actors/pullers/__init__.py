"""Pullers: one module per input backend, each registered under its type name."""

from typing import Any

from wattflow.actors.pullers.base import Puller
from wattflow.actors.registry import Registry

pullers: Registry[type[Puller[Any]]] = Registry("input")

from wattflow.actors.pullers import csv, jsonl, meter, mongodb, nvml, socket, zeromq  # noqa: E402, F401 - they register themselves

__all__ = ["pullers"]
