"""Every relative link in README.md and docs/*.md (markdown links and images) names a file of the
repository, and an anchor (`page.md#heading`) names a heading of that page, as GitHub makes its
ids. Links inside code (fenced blocks, indented blocks, `inline code`) are not links."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str, inline_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) of the text outside code blocks (fenced and indented), inline code
    blanked unless `inline_code`."""
    lines, fence, previous_blank = [], None, True
    for n, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"\s{0,3}(```+|~~~+)", line)
        if fence:
            if marker and marker.group(1)[0] == fence[0] and len(marker.group(1)) >= len(fence):
                fence = None
            continue
        if marker:
            fence = marker.group(1)
            continue
        if previous_blank and line.startswith(("    ", "\t")):
            continue                                 # an indented code block (keeps previous_blank)
        previous_blank = not line.strip()
        lines.append((n, line if inline_code else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)))
    return lines


def github_ids(text: str) -> set[str]:
    """The ids GitHub gives the headings of a page: lower case, punctuation dropped, spaces to
    hyphens, a repeated id suffixed -1, -2, ..."""
    ids, seen = set(), {}
    for _, line in prose(text, inline_code=True):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def broken_links(page: Path) -> list[str]:
    """What is wrong with each relative link of `page`: 'page:line: target (why)'."""
    bad = []
    text = page.read_text(encoding="utf-8")
    for n, line in prose(text):
        targets = LINK.findall(line) + [m.group(1) for m in [REFERENCE.match(line)] if m]
        for target in targets:
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue                             # http:, https:, mailto: ...: not a file here
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{n}: {target}"
            if ROOT.resolve() not in (file, *file.parents):
                bad.append(f"{where} (outside the repository)")
            elif not file.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in github_ids(file.read_text("utf-8")):
                bad.append(f"{where} (no heading #{anchor})")
    return bad


def test_every_relative_link_resolves():
    assert len(pages()) > 1
    bad = [b for page in pages() for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_pages_link_to_each_other():
    """Each page of docs/ is linked from README.md or from another page: none is left orphaned."""
    linked = set()
    for page in pages():
        for _, line in prose(page.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                linked.add((page.parent / target.partition("#")[0]).resolve())
    orphans = [p.name for p in pages()[1:] if p.resolve() not in linked]
    assert not orphans, orphans


def test_the_checker_finds_what_is_broken(tmp_path, monkeypatch):
    """A missing file, a missing heading, a path out of the repository are caught; a link in code,
    a web address, an image that is there and a good anchor are not."""
    import sys
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pic.png").write_bytes(b"")
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("\n".join([
        "# Title", "", "## Some heading", "",
        "[ok](other.md) [ok](other.md#a-code-heading) ![img](pic.png) [web](https://x.org/a.md)",
        "`[in code](nope.md)` [self](#some-heading)", "", "    [indented](nope.md)", "",
        "```", "[fenced](nope.md)", "```",
        "[missing](missing.md) [anchor](other.md#nope) [out](../../outside.md) [self](#nah)",
        "[ref]: gone.md",
    ]), encoding="utf-8")
    bad = broken_links(page)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)", "other.md#nope (no heading #nope)",
        "../../outside.md (outside the repository)", "#nah (no heading #nah)",
        "gone.md (no such file)"], bad
