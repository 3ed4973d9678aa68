"""Exporters: one module per research format, each registered under its format name."""

from wattflow.actors.exporters.base import Exporter
from wattflow.actors.registry import Registry

exporters: Registry[type[Exporter]] = Registry("export format")

_MODULES = {
    "gpu-dir": "gpu_dir",
    "extrap-text": "extrap",
    "extrap-json": "extrap",
    "extrap-jsonl": "extrap",
    "extrap-talpas": "extrap",
    "extrap": "extrap",
    "ross": "ross",
    "hpctoolkit": "hpctoolkit",
}
for _name, _module in _MODULES.items():
    exporters.declare(_name, f"wattflow.actors.exporters.{_module}")

__all__ = ["exporters"]
