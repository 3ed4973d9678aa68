"""Exporters: one module per research format, each registered under its format name."""

from wattflow.actors.exporters.base import Exporter
from wattflow.actors.registry import Registry

exporters: Registry[type[Exporter]] = Registry("export format")

from wattflow.actors.exporters import gpu_dir  # noqa: E402, F401

__all__ = ["exporters"]
