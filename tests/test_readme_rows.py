"""One source for the paper rows: every row of a method's table in README.md that gives a
command selects, when its command is parsed as the script parses it, exactly the figures the
README publishes for it (PaperRow.headline). A row marked `ours:` selects none."""

from __future__ import annotations

import importlib
import re
import shlex

import pytest

import common
from conftest import ROOT

SCRIPTS = ("simcse", "focal_infonce", "ifcl", "conisi", "rcl")
NUMBER = re.compile(r"-?\d+\.\d+")


def readme_rows() -> list[tuple[str, str, str, str]]:
    """(script, row cell, published cell, command cell) of every method table: a table whose
    header is `| paper row | published | command |`, under a `### ... (`script.py`)` heading."""
    rows, script, in_table = [], None, False
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        heading = re.match(r"### .*\(`(\w+)\.py`\)", line)
        if heading:
            script = heading.group(1) if heading.group(1) in SCRIPTS else None
        if line.startswith("| paper row |"):
            in_table = script is not None
            continue
        if not line.startswith("|"):
            in_table = False
        if in_table and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((script, *cells[:3]))
    return rows


def expand(script: str, row: str, published: str, command: str) -> list[tuple[str, str, list[float], str]]:
    """One (script, label, published figures, command) per run: an "(and so on)" row names its
    values in the row cell (`m = 0.1, 0.2, 0.3`), its figures one group each in the published
    cell (groups split by ', ', figures in a group by '/'), and the first value in its command."""
    code = re.search(r"`(python [^`]+)`", command)
    if code is None or "not implemented" in command:
        return []
    cmd = code.group(1)
    if "(and so on)" not in command:
        return [(script, row, [float(x) for x in NUMBER.findall(published)], cmd)]
    name, values = re.search(r"(\w+) = ((?:-?[\d.]+(?:, )?)+)", row).groups()
    values = values.split(", ")
    groups = published.split(", ")
    assert len(groups) == len(values), (row, published)
    flag = re.search(rf"(--\w+) {re.escape(values[0])}\b", cmd)
    assert flag, (row, cmd)
    return [(script, f"{row} [{v}]", [float(x) for x in NUMBER.findall(g)],
             cmd.replace(f"{flag.group(1)} {values[0]}", f"{flag.group(1)} {v}"))
            for v, g in zip(values, groups)]


CASES = [c for r in readme_rows() for c in expand(*r)]


def test_the_readme_has_rows_for_every_script():
    assert {c[0] for c in CASES} == set(SCRIPTS)


@pytest.mark.parametrize("script,row,published,command", CASES, ids=[f"{c[0]}: {c[1][:60]}" for c in CASES])
def test_a_readme_row_selects_its_published_figures(script, row, published, command):
    argv = shlex.split(command)
    target = argv[1].removesuffix(".py")
    if target not in SCRIPTS:                 # python common.py eval ...: no training run
        return
    module = importlib.import_module(target)
    args = common.parse_args(module.Args, argv[2:])
    picked, note = common.select_rows(args, module.PAPER_ROWS)
    if row.startswith("ours"):
        assert picked == [] and note.startswith("the paper reports no row"), (command, picked)
        return
    table = re.match(r"((?:Tab|Fig)\. [\w.]+)", row).group(1)
    headlines = [r.headline() for _, r in picked if r.table == table]
    assert published in headlines, (command, table, published, headlines, note)


def test_every_paper_row_is_well_formed():
    """Figures under known keys, a known split, flags that are fields of the script's Args and
    change training (not the budget, the data or where a run is written)."""
    import dataclasses
    for script in SCRIPTS:
        module = importlib.import_module(script)
        fields = {f.name for f in dataclasses.fields(module.Args)}
        free = set(common.NOT_TRAINING) | set(common.ROW_FREE) | set(module.Args.row_free) | {"model"}
        for r in module.PAPER_ROWS:
            assert r.split in ("test", "dev") and r.figures, r
            assert set(r.figures) <= set(common.FIGURE_KEYS), r
            assert set(r.flags) <= fields - free, r


def test_no_user_facing_text_names_a_folder_outside_the_repository():
    """What a user reads (README, --help and docstrings, comments, errors, the tests) names no
    file that a clone lacks: no folder beside the checkout, no spec notes. Real data is named by
    the repository's own data/ and models/ paths, or by the environment variable the tests read."""
    outside = re.compile(r"\.\./shared|\bspecs/|sts_protocol\.md|methods\.md")
    files = [ROOT / "README.md", ROOT / "requirements.txt", ROOT / "pyproject.toml",
             *ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("tests/*.py")]
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if outside.search(line)]
    assert len(files) > 15 and not hits, "\n".join(hits)
