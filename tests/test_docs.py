"""The README and the pages under docs/: every relative link resolves (the file exists and, for a
`#anchor` into a Markdown file, a heading with that GitHub slug exists), and the README stays a
front door of at most 300 lines."""

import os
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) or ![alt](target), with an optional "title"; the text may hold code spans.
LINK = re.compile(r"!?\[(?:[^\[\]]|`[^`]*`)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for heading in HEADING.findall(without_code_blocks(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(without_code_blocks(path.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, …
    ]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {os.path.relpath(linked, REPO)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_the_readme_is_at_most_300_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_checker_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## What a resumed run is\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Two `code` words, and: punctuation!\n\n"
        "[ok](other.md#what-a-resumed-run-is) [ok](#two-code-words-and-punctuation) "
        "[web](https://example.com/#x)\n"
        "[missing](nowhere.md) [bad anchor](other.md#stopping) [bad here](#nothing)\n"
        "```bash\n[in code](not_checked.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == [
        "nowhere.md",
        "other.md#stopping",
        "#nothing",
    ]


def figures(text: str) -> set[str]:
    """The numbers of `text`, thousands separators dropped (`10,749` is `10749`)."""
    return {n.replace(",", "") for n in re.findall(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?", text)}


def results_rows() -> list[list[str]]:
    """The cells of each row of the README's Results table."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("| script | task, steps | Cleanba | reference | report |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_each_figure_of_the_readmes_results_table_is_in_the_report_it_links():
    """A result or reference of the table (a number with decimals, or of three digits or more:
    not a seed's or a count's) appears in the report of its row."""
    rows = results_rows()
    assert len(rows) > 10
    for script, task, result, reference, report in rows:
        link = re.search(r"\]\((benchmark/results/[^)#]+)\)", report)
        assert link, f"{script}, {task}: no report linked"
        in_report = figures((REPO / link.group(1)).read_text())
        claimed = [
            n for n in figures(f"{result} {reference}") if "." in n or len(n.lstrip("-")) >= 3
        ]
        missing = [n for n in claimed if n not in in_report]
        assert not missing, f"{script}, {task}: {missing} not in {link.group(1)}"
