"""One source for the paper rows: every row of a method's tables in docs/<script>.md that gives
a command selects, when its command is parsed as the script parses it, exactly the figures the
page publishes for it (PaperRow.headline). A row marked `ours:` selects none, and so does a row
of the extra table (`| row | published | command |`) that publishes no figure. Every row of
every script's PAPER_ROWS is checked by some row of its page."""

from __future__ import annotations

import importlib
import re
import shlex

import pytest

import common
from conftest import ROOT
from plumbing import flags

SCRIPTS = ("simcse", "focal_infonce", "ifcl", "conisi", "rcl")
NUMBER = re.compile(r"-?\d+\.\d+")
HEADERS = ("| paper row | published | command |", "| row | published | command |")


def page_rows() -> list[tuple[str, str, str, str, str]]:
    """(script, header, row cell, published cell, command cell) of every row table of every
    method's page: a table whose header is one of HEADERS, in docs/<script>.md."""
    rows = []
    for script in SCRIPTS:
        header = None
        for line in (ROOT / "docs" / f"{script}.md").read_text(encoding="utf-8").splitlines():
            if line.strip() in HEADERS:
                header = line.strip()
                continue
            if not line.startswith("|"):
                header = None
            if header and not line.startswith("|---"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                rows.append((script, header, *cells[:3]))
    return rows


def expand(script: str, header: str, row: str, published: str,
           command: str) -> list[tuple[str, str, str, list[float], str]]:
    """One (script, header, label, published figures, command) per run: an "(and so on)" row
    names its values in the row cell (`m = 0.1, 0.2, 0.3`), its figures one group each in the
    published cell (groups split by ', ', figures in a group by '/'), and the first value in its
    command."""
    code = re.search(r"`(python [^`]+)`", command)
    if code is None or "not implemented" in command:
        return []
    cmd = code.group(1)
    if "(and so on)" not in command:
        return [(script, header, row, [float(x) for x in NUMBER.findall(published)], cmd)]
    name, values = re.search(r"(\w+) = ((?:-?[\d.]+(?:, )?)+)", row).groups()
    values = values.split(", ")
    groups = published.split(", ")
    assert len(groups) == len(values), (row, published)
    flag = re.search(rf"(--\w+) {re.escape(values[0])}\b", cmd)
    assert flag, (row, cmd)
    return [(script, header, f"{row} [{v}]", [float(x) for x in NUMBER.findall(g)],
             cmd.replace(f"{flag.group(1)} {values[0]}", f"{flag.group(1)} {v}"))
            for v, g in zip(values, groups)]


CASES = [c for r in page_rows() for c in expand(*r)]


def checked_rows(script: str, header: str, row: str, published: list[float], command: str):
    """What a page row claims: (the PaperRows it checks, or None where it checks none, the
    rows its command picks, the note). None: not a training run, or a row that says no row."""
    argv = shlex.split(command)
    target = argv[1].removesuffix(".py")
    if target not in SCRIPTS:                 # python tools/eval.py ...: no training run
        return None, [], ""
    assert target == script, (script, command)
    module = importlib.import_module(target)
    args = common.parse_args(module.Args, argv[2:])
    picked, note = flags.select_rows(args, module.PAPER_ROWS)
    if row.startswith("ours") or not published:
        return None, picked, note
    if header == HEADERS[0]:
        table = re.match(r"((?:Tab|Fig)\. [\w.]+)", row).group(1)
        return [r for _, r in picked if r.table == table and r.headline() == published], picked, note
    return [r for _, r in picked if r.headline() == published], picked, note


def test_every_script_has_a_page_with_rows():
    assert {c[0] for c in CASES} == set(SCRIPTS)


@pytest.mark.parametrize("script,header,row,published,command", CASES,
                         ids=[f"{c[0]}: {c[2][:60]}" for c in CASES])
def test_a_page_row_selects_its_published_figures(script, header, row, published, command):
    checked, picked, note = checked_rows(script, header, row, published, command)
    if command.split()[1].removesuffix(".py") not in SCRIPTS:
        return
    if checked is None:
        assert picked == [] and note.startswith("the paper reports no row"), (command, picked)
        return
    assert checked, (command, row, published, [r.headline() for _, r in picked], note)


def test_every_paper_row_is_checked_by_a_row_of_its_page():
    """No row of PAPER_ROWS goes unchecked: each is the row that some page row's command selects
    with the figures that page row publishes."""
    covered = {script: set() for script in SCRIPTS}
    for case in CASES:
        checked, _, _ = checked_rows(*case)
        covered[case[0]] |= {r.label for r in checked or []}
    missing = [f"{s}: {r.label}" for s in SCRIPTS for r in importlib.import_module(s).PAPER_ROWS
               if r.label not in covered[s]]
    assert not missing, "\n".join(missing)


def test_every_paper_row_is_well_formed():
    """Figures under known keys, a known split, flags that are fields of the script's Args and
    change training (not the budget, the data or where a run is written)."""
    import dataclasses
    for script in SCRIPTS:
        module = importlib.import_module(script)
        fields = {f.name for f in dataclasses.fields(module.Args)}
        free = set(common.NOT_TRAINING) | set(flags.ROW_FREE) | set(module.Args.OWN_ROW_FREE) | {"model"}
        for r in module.PAPER_ROWS:
            assert r.split in ("test", "dev") and r.figures, r
            assert set(r.figures) <= set(common.FIGURE_KEYS), r
            assert set(r.flags) <= fields - free, r


def test_no_user_facing_text_names_a_folder_outside_the_repository():
    """What a user reads (README, docs/, --help and docstrings, comments, errors, the tests) names
    no file that a clone lacks: no folder beside the checkout, no spec notes. Real data is named
    by the repository's own data/ and models/ paths, or by the environment variable the tests
    read."""
    outside = re.compile(r"\.\./shared|\/work\/shared|\bspecs/|sts_protocol\.md|methods\.md")
    files = [ROOT / "README.md", ROOT / "requirements.txt", ROOT / "pyproject.toml",
             *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("tools/*.py"),
             *ROOT.glob("tests/*.py")]
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if outside.search(line)]
    assert len(files) > 20 and len(list(ROOT.glob("docs/*.md"))) >= 7 and not hits, "\n".join(hits)
