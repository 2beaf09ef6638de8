"""The documentation a newcomer reads: README.md stays an entry point (at most 400 lines) whose Quick start
keeps the test command CI runs verbatim, every relative link of README.md and docs/*.md reaches a file (and
its #anchor a heading), and the README's headline cells are those of the generated table they excerpt."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_the_readme_is_an_entry_point():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move reference text to docs/"


def test_the_readme_keeps_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = ci[ci.index(next(line for line in ci if "--- the README's test command, verbatim ---" in line)) + 1].strip()
    assert command.startswith("pip install -e") and command in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_headline_cells_are_the_generated_tables():
    """Each `n/m [low, high]` of the README's fidelity excerpt is a cell of the generated protocol table."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    excerpt = readme[readme.index("### Fidelity"):readme.index("### Speed")]
    page = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    block = page[page.index("<!-- kvpot-readme:smollm2-protocol -->"):page.index("<!-- /kvpot-readme:smollm2-protocol -->")]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in block.splitlines() if line.startswith("| ")}
    cells = re.compile(r"\d+/\d+ \[\d\.\d\d, \d\.\d\d\]")
    checked = 0
    for line in excerpt.splitlines():
        if not line.startswith("| ") or not cells.search(line):
            continue
        label = line.split(" | ")[0].lstrip("| ")
        source = next(text for name, text in rows.items() if name.startswith(label))  # `Label (`spec`)`
        for cell in cells.findall(line):
            assert cell in source, f"README's {label} cell {cell} is not in docs/evaluation.md's table"
            checked += 1
    assert checked >= 20
