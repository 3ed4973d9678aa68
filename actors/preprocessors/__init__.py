"""Pre-processors: what PowerAPI puts between an input and the formulas (``--pre-processor``),
one module per type, registered under its type name."""

from typing import Any

from wattflow.actors.preprocessors.base import PreProcessor
from wattflow.actors.registry import Registry

preprocessors: Registry[type[PreProcessor[Any]]] = Registry("pre-processor")

preprocessors.declare("k8s", "wattflow.actors.preprocessors.k8s")

__all__ = ["preprocessors"]
