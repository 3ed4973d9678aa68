"""Print the functions of the library (actors/, formats/, service/) whose cyclomatic complexity
is above the house limit.

Formulas, formats and backends are read by people who did not write them: a function with more
than twelve paths through it is one that nobody can hold in their head. The test command prints
this list every run; ``--fail`` makes it an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parent.parent
HOUSE_LIMIT = 12
PACKAGES = ("actors", "formats", "service")
"""The library's three packages (docs/architecture.md, Layout)."""


def over_limit(folder: Path, limit: int) -> list[tuple[int, str, int, str]]:
    """(complexity, path, line, name) of every function and method above ``limit``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for block in cc_visit(path.read_text(encoding="utf-8")):
            if block.complexity > limit:
                where = path.relative_to(ROOT).as_posix()
                found.append((block.complexity, where, block.lineno, block.fullname))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=HOUSE_LIMIT)
    parser.add_argument("--fail", action="store_true", help="exit 1 when any is over the limit")
    args = parser.parse_args()
    found = sorted(
        (entry for package in PACKAGES for entry in over_limit(ROOT / package, args.limit)),
        reverse=True,
    )
    folders = ", ".join(f"{package}/" for package in PACKAGES)
    print(f"complexity: {len(found)} functions in {folders} above {args.limit}")
    for complexity, path, line, name in found:
        print(f"  {complexity:3d}  {path}:{line} {name}")
    return 1 if found and args.fail else 0


if __name__ == "__main__":
    sys.exit(main())
