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


def known_formats(names: list[str]) -> list[str]:
    """``--export``'s formats, each one ``wattflow export`` writes (a config validator)."""
    for name in names:
        if name not in exporters.names():
            raise ValueError(f"{name!r} is no export format; give {', '.join(exporters.names())}")
    return names


__all__ = ["exporters", "known_formats"]
