"""Print the functions in actors/ whose cyclomatic complexity is above the house limit.

Formulas and backends are read by people who did not write them: a function with more than
twelve paths through it is one that nobody can hold in their head. The test command prints
this list every run; ``--fail`` makes it an error, for when the list is empty.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parent.parent
HOUSE_LIMIT = 12


def over_limit(folder: Path, limit: int) -> list[tuple[int, str]]:
    """(complexity, "path:line name") of every function and method above ``limit``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for block in cc_visit(path.read_text(encoding="utf-8")):
            if block.complexity > limit:
                where = f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname}"
                found.append((block.complexity, where))
    return sorted(found, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=HOUSE_LIMIT)
    parser.add_argument("--fail", action="store_true", help="exit 1 when any is over the limit")
    args = parser.parse_args()
    found = over_limit(ROOT / "actors", args.limit)
    print(f"complexity: {len(found)} functions in actors/ above {args.limit}")
    for complexity, where in found:
        print(f"  {complexity:3d}  {where}")
    return 1 if found and args.fail else 0


if __name__ == "__main__":
    sys.exit(main())
