"""Pushers: one module per output backend, each registered under its type name."""

from typing import Any

from wattflow.actors.pushers.base import Pusher
from wattflow.actors.registry import Registry

pushers: Registry[type[Pusher[Any]]] = Registry("output")

from wattflow.actors.pushers import csv, influxdb, influxdb2, jsonl, mongodb, table, zeromq  # noqa: E402, F401 - they register themselves

__all__ = ["pushers"]
