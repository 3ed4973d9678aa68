"""Every relative link in the README and docs/ leads to a file (and heading) that exists.

Pages move as the product grows; a newcomer following a dead link is lost at the first step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.DOTALL)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    found = set()
    for line in FENCED.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path_text, _, anchor = target.partition("#")
        linked = (page.parent / path_text).resolve() if path_text else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_somewhere() -> None:
    linked = set()
    for page in PAGES:
        for target in LINK.findall(CODE.sub("", page.read_text())):
            if not re.match(r"[a-z]+:", target) and target.partition("#")[0]:
                linked.add((page.parent / target.partition("#")[0]).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"pages no other page links to: {orphans}"
