"""Print the functions of the library (actors/, formats/, service/) whose cyclomatic complexity
is above the house limit.

Formulas, formats and backends are read by people who did not write them: a function with more
than twelve paths through it is one that nobody can hold in their head. The test command prints
this list every run; ``--fail`` makes it an error for any function on it but those of
``BEING_REWORKED``.
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

BEING_REWORKED = {
    # TEMPORARY: functions over the limit that are being reworked right now on another branch
    # (PowerAPI's decoders and CSV readers in powerapi.py), let through until that work lands.
    # Each entry names one function, not a file: a new function over the limit, in that file
    # too, fails. Remove an entry once its function is at the limit or below (this script then
    # says so), and this list with its last entry.
    ("formats/powerapi.py", "read_hwpc_csv"),
    ("formats/powerapi.py", "_rows"),
    ("formats/powerapi.py", "decode_json_lines"),
    ("formats/powerapi.py", "_hwpc_rows"),
}
"""(path, function) pairs that ``--fail`` lets through while they are reworked."""


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
    parser.add_argument(
        "--fail", action="store_true", help="exit 1 when any but those being reworked is over"
    )
    args = parser.parse_args()
    found = sorted(
        (entry for package in PACKAGES for entry in over_limit(ROOT / package, args.limit)),
        reverse=True,
    )
    folders = ", ".join(f"{package}/" for package in PACKAGES)
    print(f"complexity: {len(found)} functions in {folders} above {args.limit}")
    failing = 0
    for complexity, path, line, name in found:
        allowed = (path, name) in BEING_REWORKED
        failing += not allowed
        note = "  (being reworked: let through for now)" if allowed else ""
        print(f"  {complexity:3d}  {path}:{line} {name}{note}")
    for path, name in sorted(BEING_REWORKED - {(path, name) for _, path, _, name in found}):
        print(f"  {path} {name} is no longer above {args.limit}: take it off BEING_REWORKED")
    return 1 if failing and args.fail else 0


if __name__ == "__main__":
    sys.exit(main())
