"""The README and docs/: every relative link resolves, the README stays a short page
without dated measurements, and each generated table is what the committed results make.

A link is ``[text](target)`` or ``![alt](target)`` outside fenced code; a target with a
``#fragment`` into a Markdown file must name one of its headings (GitHub's anchors:
lower case, punctuation dropped, spaces as hyphens).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from benchmarks import docs_tables
from embgeom.testing.serve import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = [*PAGES, REPO / "CHANGELOG.md"]  # every page whose links must resolve
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _prose(text: str) -> str:
    """The Markdown without its fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda g: g.group(1) or "", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(page.read_text(encoding="utf-8")))]


def test_the_link_walker_finds_links_and_anchors():
    text = ("# A `code` title\n## Production: one Redis, many workers\n## Twice\n## Twice\n"
            "see [a](x.md#y) and ![i](f/p.png \"t\") but not `[c](no.md)`\n```\n[d](no2.md)\n```\n")
    assert anchors(text) == {"a-code-title", "production-one-redis-many-workers", "twice", "twice-1"}
    assert [m.group(1) for m in LINK.finditer(_prose(text))] == ["x.md#y", "f/p.png"]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_reaches_every_docs_page():
    readme = REPO / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) < 200
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(readme)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_the_readme_carries_no_dated_measurement():
    """Figures live in docs/ (generated, with their machine) and history in CHANGELOG.md."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b|tok/s|tokens/s", text) == []


@pytest.mark.parametrize("table", docs_tables.TABLES, ids=lambda t: t.name)
def test_each_generated_table_is_what_the_committed_results_make(table):
    res = json.loads(table.results.read_text(encoding="utf-8"))
    assert res.get("machine") and res.get("started"), f"{table.results.name} names no machine or date"
    assert table.page.read_text(encoding="utf-8") == docs_tables.generated(table), (
        f"{table.page.relative_to(REPO)} differs from {table.results.relative_to(REPO)}: "
        "run python -m benchmarks.docs_tables")


def test_a_table_is_rewritten_between_its_markers_only():
    start, end = docs_tables.markers("x")
    page = f"before\n{start}\nold\n| a |\n{end}\nafter\n"
    assert docs_tables.rewrite(page, "x", "new") == f"before\n{start}\nnew\n{end}\nafter\n"
    with pytest.raises(ValueError):
        docs_tables.rewrite("no markers", "x", "new")
