"""Every link in README.md, docs/*.md and scripts/PERFORMANCE*.md resolves: a relative file exists, and an
#anchor names a heading of its target as GitHub slugs it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, *sorted((ROOT / "scripts").glob("PERFORMANCE*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    counts: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text(encoding="utf-8")):
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            found.add(f"{base}-{counts[base]}" if base in counts else base)  # GitHub numbers a repeated heading
            counts[base] = counts.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [target for line in prose(page.read_text(encoding="utf-8")) for target in LINK.findall(line)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    assert not [page.name for page in DOCS if page not in linked]


def test_slugs_follow_github():
    assert slug("Compiled steps on disk (`compile=True`)") == "compiled-steps-on-disk-compiletrue"
    assert slug("2026-11-27: bf16 + compile against llama.cpp bf16") == "2026-11-27-bf16--compile-against-llamacpp-bf16"
