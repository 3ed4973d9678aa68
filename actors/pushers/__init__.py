"""Pushers: one module per output backend, each registered under its type name."""

from typing import Any

from wattflow.actors.pushers.base import Pusher
from wattflow.actors.registry import Registry

pushers: Registry[type[Pusher[Any]]] = Registry("output")

for _name in (
    "csv",
    "filedb",
    "influxdb",
    "influxdb2",
    "jsonl",
    "mongodb",
    "opentsdb",
    "prometheus",
    "runs",
    "table",
    "virtiofs",
    "zeromq",
):
    pushers.declare(_name, f"wattflow.actors.pushers.{_name}")

__all__ = ["pushers"]
