"""docs/architecture.md is the map of the code: the test fails when the map and the code part.

The page's "Layout" table has one row per folder of the repository. In the rows of
``formats/``, ``actors/``, ``service/``, ``scripts/`` and ``tests/``, a name in backticks
(`` `runtime.py` ``, `` `pullers/nvml/` ``, `` `pushers/appending.py` ``) is a path, resolved
in this order, the first that exists winning:

1. under the row's folder (`` `pushers/appending.py` `` in the ``actors/`` row is
   ``actors/pushers/appending.py``);
2. under a folder the same row named before it, the nearest first (`` `api.py` `` after
   `` `pullers/nvml/` `` is ``actors/pullers/nvml/api.py``; `` `pods.py` `` after
   `` `preprocessors/` `` is ``actors/preprocessors/pods.py``);
3. under the repository's root (`` `setup.py` ``, `` `tests/data/cgroups/` ``).

A name that looks like a module (it ends in ``.py``, ``.pyi``, ``.c`` or ``/``) and resolves to
nothing fails the test. Other names (flags, classes) are not paths unless they resolve
(``scripts/``' `` `test` ``).

What a row covers: each file it names; for each folder it names, the folder's ``__init__.py``
and the modules directly in it that register themselves by name (a line that starts with
``@pullers.register(``, ``@pushers.register(``, ``@formulas.register(``,
``@exporters.register(``, ``@preprocessors.register(``): the page says "one module per backend
or formula" in ``pullers/``, ``formulas/``, ``pushers/`` and ``exporters/``, and a backend's own
page describes it. Every other module must be named: a shared helper (``pushers/appending.py``,
``pullers/files.py``, ``formulas/base.py``) or a module of a package split by concern
(``pullers/nvml/``) that is not on the page fails the test, and so does a new module in a
folder the page does not name at all. Each row folder's own ``__init__.py`` is covered.

Which files must be covered:

- every ``.py``, ``.pyi`` and ``.c`` file under ``actors/``, ``formats/`` and ``service/``;
- every file in ``scripts/``;
- in ``tests/``, every entry that is not a ``test_*.py`` module (helpers, ``conftest.py``, the
  data and stand-in folders), and the helper modules (not ``test_*.py``) of its subpackages.

Apart from the table, any backticked path anywhere on the page that names a module
(``.py``, ``.pyi``, ``.c``), or a folder rooted in ``actors/``, ``formats/``, ``service/``,
``scripts/`` or ``tests/``, must exist: a path rooted in one of them exactly, a shorter path
(`` `pullers/files.py` ``) as the end of some path in them, a bare file name as the name of
some file in them or at the root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PAGE_NAME = "docs/architecture.md"

PACKAGES = ("actors", "formats", "service")
"""The three Python packages, every module of which the Layout table names."""
CHECKED_ROWS = (*PACKAGES, "scripts", "tests")
"""The Layout rows whose folder's contents must all be on the page."""
MODULE_SUFFIXES = (".py", ".pyi", ".c")
SKIPPED = {"__pycache__"}

BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH_LIKE = re.compile(r"\w[\w.-]*(?:/\w[\w.-]*)*/?")
"""A relative path: no flag (``--workers``), no absolute path, no ``..``."""
ROW_FOLDER = re.compile(r"^\|\s*`([\w.-]+)/`\s*\|")
REGISTERS = re.compile(r"^@\w+\.register\(", re.MULTILINE)


def looks_like_module(name: str) -> bool:
    """Whether a backticked name must be a path: a source file or a folder."""
    return name.endswith("/") or name.endswith(MODULE_SUFFIXES)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def layout_rows() -> dict[str, str]:
    """The Layout table's rows: each row's folder (``actors``) and the text of the row."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)
    assert len(section) == 2, f"{PAGE_NAME} has no '## Layout' section"
    body = section[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in body.splitlines():
        match = ROW_FOLDER.match(line)
        if match is not None:
            rows[match.group(1)] = line[match.end() :]
    return rows


@dataclass
class Row:
    """What one Layout row names, resolved to paths."""

    folder: str
    resolved: list[Path] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    """Module-like names that resolve to nothing, each with its path under the row's folder."""

    @classmethod
    def read(cls, folder: str, text: str) -> Row:
        row = cls(folder)
        base = ROOT / folder
        named_folders: list[Path] = []
        for name in (m.group(1).strip() for m in BACKTICKED.finditer(text)):
            if PATH_LIKE.fullmatch(name) is None:
                continue
            bases = [base, *reversed(named_folders), ROOT]
            found = next((b / name for b in bases if (b / name).exists()), None)
            if found is None:
                if looks_like_module(name):
                    row.missing.append((name, relative(base / name)))
                continue
            row.resolved.append(found)
            if found.is_dir():
                named_folders.append(found)
        return row

    def covered(self) -> set[Path]:
        """The files and folders this row accounts for."""
        covered = {ROOT / self.folder / "__init__.py"}
        for path in self.resolved:
            covered.add(path)
            if path.is_dir():
                covered.add(path / "__init__.py")
                covered.update(
                    module
                    for module in path.glob("*.py")
                    if REGISTERS.search(module.read_text(encoding="utf-8"))
                )
        return covered


def package_modules(folder: str) -> list[Path]:
    return sorted(
        path
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
        and path.suffix in MODULE_SUFFIXES
        and not SKIPPED.intersection(path.relative_to(ROOT).parts)
    )


def scripts() -> list[Path]:
    return sorted(
        path
        for path in (ROOT / "scripts").iterdir()
        if path.is_file() and not path.name.startswith(".")
    )


def helper_entries() -> list[Path]:
    """What in tests/ is not a test module: helpers, fixtures, data and stand-ins."""
    tests = ROOT / "tests"
    found = [
        entry
        for entry in tests.iterdir()
        if not entry.name.startswith((".", "test_"))
        and entry.name not in SKIPPED
        and entry.name != "__init__.py"
    ]
    for package in tests.iterdir():
        if package.is_dir() and (package / "__init__.py").is_file():
            found.extend(
                module
                for module in package.glob("*.py")
                if not module.name.startswith("test_") and module.name != "__init__.py"
            )
    return sorted(found)


def must_be_named(folder: str) -> list[Path]:
    if folder in PACKAGES:
        return package_modules(folder)
    if folder == "scripts":
        return scripts()
    return helper_entries()


def test_layout_rows_name_what_exists() -> None:
    rows = layout_rows()
    stale = [
        f"{PAGE_NAME} names {path} (`{name}` in its Layout row `{folder}/`), which does "
        "not exist (nor under a folder the row names before it, nor at the repository's root)"
        for folder in CHECKED_ROWS
        if folder in rows
        for name, path in Row.read(folder, rows[folder]).missing
    ]
    assert not stale, "\n".join(stale)


def test_layout_table_names_every_module() -> None:
    rows = layout_rows()
    absent = [folder for folder in CHECKED_ROWS if folder not in rows]
    assert not absent, f"{PAGE_NAME}'s Layout table has no row for {', '.join(absent)}"
    unnamed: list[str] = []
    for folder in CHECKED_ROWS:
        covered = Row.read(folder, rows[folder]).covered()
        unnamed.extend(
            f"{relative(path)} is not in {PAGE_NAME}'s Layout table (row `{folder}/`)"
            for path in must_be_named(folder)
            if path not in covered
        )
    assert not unnamed, "\n".join(unnamed)


def repository_files() -> list[str]:
    """Every file and folder under the folders the page's paths may point into."""
    found: list[str] = []
    for folder in CHECKED_ROWS:
        found.append(f"{folder}/")
        for path in (ROOT / folder).rglob("*"):
            if SKIPPED.intersection(path.relative_to(ROOT).parts):
                continue
            found.append(relative(path) + ("/" if path.is_dir() else ""))
    return found


def names_a_module(name: str) -> bool:
    """Whether a word in backticks is a module's path, or a folder's rooted in the repository."""
    if PATH_LIKE.fullmatch(name) is None:
        return False
    if name.endswith("/"):
        return name.split("/", 1)[0] in CHECKED_ROWS
    return name.endswith(MODULE_SUFFIXES)


def test_every_module_path_on_the_page_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    files = repository_files()
    names = {Path(path.rstrip("/")).name for path in files if not path.endswith("/")}
    stale = set()
    for quoted in BACKTICKED.findall(text):
        for name in filter(names_a_module, quoted.split()):
            if "/" in name and name.split("/", 1)[0] in CHECKED_ROWS:
                exists = (ROOT / name).exists()
            elif "/" in name:
                exists = any(path == name or path.endswith("/" + name) for path in files)
            else:
                exists = name in names or (ROOT / name).is_file()
            if not exists:
                stale.add(name)
    assert not stale, "\n".join(
        f"{PAGE_NAME} names {name}, which does not exist" for name in sorted(stale)
    )
