"""Formulas: one module per formula, each registered under its type name."""

from typing import Any

from wattflow.actors.formulas.base import Formula
from wattflow.actors.registry import Registry

formulas: Registry[type[Formula[Any]]] = Registry("formula")

from wattflow.actors.formulas import (  # noqa: E402 - register themselves
    energy,
    gpu,
    node,
    rapl,
    smartwatts,
)

__all__ = ["energy", "formulas", "gpu", "node", "rapl", "smartwatts"]
