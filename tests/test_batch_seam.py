"""The batch is one type: no stage asks for itself whether a batch holds reports or a frame.

``formats/batch.py`` is the batch's own module and ``formats/frames.py`` the columnar
representation's; every other module of the library asks them what it needs of a batch
(its size, its reports, a sensor's share, its hwpc-sensor frame …). A test of a class against a
frame type, or against ``Report`` (which, on a batch's item, tells a report from a frame),
anywhere else is a second place that must change with the representation, which is what this
test refuses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "formats", "service")
THE_BATCH_TYPE = {Path("formats/batch.py"), Path("formats/frames.py")}
REPRESENTATION_TYPES = {"Frame", "HWPCFrame", "PowerFrame", "FormulaFrame", "Report"}
REPRESENTATION_PROBES = {"holds_frame"}


def _named(node: ast.expr) -> set[str]:
    """The class names an ``isinstance`` second argument spells (``A``, ``(A, B)``, ``A | B``,
    ``module.A``)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return set().union(*(_named(element) for element in node.elts))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _named(node.left) | _named(node.right)
    return set()


def representation_branches(source: str) -> list[tuple[int, str]]:
    """The lines of a module that ask which representation a batch's item is."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func
        name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
        if name == "isinstance" and len(node.args) == 2:
            tested = _named(node.args[1]) & REPRESENTATION_TYPES
            if tested:
                found.append((node.lineno, f"isinstance(…, {'/'.join(sorted(tested))})"))
        elif name in REPRESENTATION_PROBES:
            found.append((node.lineno, f"{name}(…)"))
    return found


def library_modules() -> list[Path]:
    return sorted(
        path.relative_to(LIBRARY)
        for package in PACKAGES
        for path in (LIBRARY / package).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def test_the_check_sees_each_way_of_asking() -> None:
    source = """
isinstance(item, HWPCFrame)
isinstance(item, (PowerReport, Frame))
isinstance(item, frames.PowerFrame | GPUReport)
holds_frame(batch)
isinstance(item, PowerReport)
isinstance(item, GPUReport | MeterReport)
"""
    assert [line for line, _ in representation_branches(source)] == [2, 3, 4, 5]


@pytest.mark.parametrize("module", library_modules(), ids=str)
def test_no_stage_branches_on_the_batch_representation(module: Path) -> None:
    if module in THE_BATCH_TYPE:
        return
    found = representation_branches((LIBRARY / module).read_text(encoding="utf-8"))
    assert not found, f"{module} asks which representation a batch holds: " + ", ".join(
        f"line {line}: {what}" for line, what in found
    )
