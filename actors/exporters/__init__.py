"""Exporters: one module per research format, each registered under its format name."""

from wattflow.actors.exporters.base import Exporter
from wattflow.actors.registry import Registry

exporters: Registry[type[Exporter]] = Registry("export format")

_MODULES = {
    "gpu-dir": "gpu_dir",
    "ross": "ross",
    "hpctoolkit": "hpctoolkit",
}
for _name, _module in _MODULES.items():
    exporters.declare(_name, f"wattflow.actors.exporters.{_module}")

__all__ = ["exporters"]
