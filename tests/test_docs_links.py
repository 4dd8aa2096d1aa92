"""Unit tier: the docs live in the project. Every relative link of every Markdown file
of the repository resolves to a file inside it, and every #anchor to a heading there."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"node_modules", "build", "dist", "artifacts", "labextension", "__pycache__"}
OUTSIDE = os.path.join("..", "shared")  # where the docs once lay, beside the repository
MUST_EXIST = (
    "README.md",
    "RELIABILITY.md",
    "docs/api.md",
    "docs/architecture.md",
    "docs/testing.md",
)

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".md"))
    return sorted(out)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = HEADING.match(line)
        if fenced or m is None:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str) -> list[str]:
    return [m.group(1) for line in prose_lines(text) for m in LINK.finditer(line)]


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, mailto:, ...


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of ``path`` (its ``text``, when given)."""
    if text is None:
        text = path.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: ({target})"
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where} names no file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def test_the_contract_docs_are_in_the_repository():
    missing = [p for p in MUST_EXIST if not (ROOT / p).is_file()]
    assert not missing, f"missing docs: {missing}"


@pytest.mark.parametrize(
    "path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)).replace(os.sep, "/")
)
def test_every_relative_link_resolves(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_no_doc_points_outside_the_project():
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in markdown_files()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE in line
    ]
    assert not offenders, f"references to {OUTSIDE} (a clone has no such folder): {offenders}"


def test_the_checker_catches_what_it_should():
    """The checks themselves: a missing file, a missing anchor, a link out of the
    repository are each reported; code spans and fences are not links."""
    doc = ROOT / "docs" / "api.md"
    assert "meshstatus" in anchors(doc) and "python--m-benchmarks" in anchors(doc)
    assert slug("Bad input (`tests/reliability/test_bad_inputs.py`)") == (
        "bad-input-testsreliabilitytest_bad_inputspy"
    )
    text = (
        "[ok](api.md) [gone](nowhere.md) [anchor](api.md#no-such-heading)\n"
        "[out](../../outside.md) `[code](skipped.md)` [web](https://example.org)\n"
        "```\n[fenced](skipped.md)\n```\n"
    )
    assert links(text) == [
        "api.md",
        "nowhere.md",
        "api.md#no-such-heading",
        "../../outside.md",
        "https://example.org",
    ]
    found = broken_links(ROOT / "docs" / "probe.md", text)  # as if it lay in docs/
    assert len(found) == 3, found
    assert any("nowhere.md) names no file" in f for f in found)
    assert any("#no-such-heading" in f for f in found)
    assert any("leaves the repository" in f for f in found)
