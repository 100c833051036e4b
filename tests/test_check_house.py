"""tools/check_house.py, the house's shape check, as a tool: on a copy of the repository it names
each rule an edit breaks, in one line with the file and the rule, and exits 1. Whether this
repository keeps those rules is the tool's own run (CI's .ci/run), not a test: an experiment that
lengthens a script, or edits one without rebuilding its page, passes pytest."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from tools import check_house, pages

CI = os.environ.get("CI", "").lower() == "true"


# what a copy of the repository leaves out: git's store, what runs and downloads write, the page
# toolchain's node_modules (the build reads KaTeX from this checkout's tools/katex)
NOT_COPIED = shutil.ignore_patterns(".git", "node_modules", "__pycache__", ".pytest_cache", ".venv", ".cache",
                                    "runs", "data", "models", "screenshots")


@pytest.fixture
def house(tmp_path) -> Path:
    """A copy of the repository (a page links only the files that exist beside it, so all of them)."""
    root = tmp_path / "house"
    shutil.copytree(ROOT, root, ignore=NOT_COPIED)
    return root


def broken_by(house: Path, name: str, edit, check) -> list[str]:
    """The lines `check` gives after `edit` of house/name that it did not give before."""
    before = check(house)
    path = house / name
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    return [line for line in check(house) if line not in before]


def insert(text: str, line: int, added: list[str]) -> str:
    """`text` with `added` inserted as lines before line number `line` (1-based)."""
    lines = text.splitlines()
    return "\n".join(lines[:line - 1] + added + lines[line - 1:]) + "\n"


def test_ifcl_grown_past_its_cap_is_named_and_the_command_exits_1(house):
    """A variant of a loss added to ifcl.py (20 lines, or as many as take it past its 460): the
    rule names the file and the cap; the command prints that line and exits 1."""
    source = (house / "ifcl.py").read_text(encoding="utf-8")
    added = max(20, 460 + 1 - len(source.splitlines()))
    where = check_house.functions(source)["identical_loss"][0]          # its first line, decorators included
    variant = ["def identical_loss_variant(h, h_pos, tau):"] + [f"    x = h * {k}" for k in range(added - 4)]
    new = broken_by(house, "ifcl.py", lambda text: insert(text, where, variant + ["    return x", "", ""]),
                    check_house.ifcl_stays_short)
    assert new == [f"ifcl.py: the script at most 460 lines (it has {len(source.splitlines()) + added})"], new
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_house.py"), "--root", str(house)],
                          capture_output=True, text=True, cwd=house)
    assert done.returncode == 1 and new[0] in done.stdout.splitlines(), done.stdout + done.stderr


def pad_function(name: str, n: int):
    """An edit that puts n comment lines at the top of function `name`'s body."""
    def edit(text: str) -> str:
        node = next(f for f in ast.parse(text).body if getattr(f, "name", None) == name)
        first = node.body[0]
        return insert(text, first.lineno, [" " * first.col_offset + "# a note"] * n)
    return edit


def after_docstring(n: int):
    """An edit that puts n comment lines right after the module's docstring."""
    return lambda text: insert(text, ast.parse(text).body[0].end_lineno + 1, ["# a note"] * n)


@pytest.mark.parametrize("name, edit, check, rule", [
    ("ifcl.py", pad_function("main", 30), check_house.ifcl_stays_short, "ifcl.py: main() at most 25 lines"),
    ("simcse.py", lambda t: insert(t, 2, ["a line of the docstring"] * 30),
     check_house.scripts_open_on_their_paper, "simcse.py: its docstring ends by line 30"),
    ("rcl.py", after_docstring(150), check_house.scripts_open_on_their_paper,
     "rcl.py: its first `# Eq. (` line by line 140"),
    ("common.py", pad_function("train", 100), check_house.common_reads_top_down,
     "common.py: train() at most 90"),
    ("common.py", pad_function("train_step", 30), check_house.common_reads_top_down,
     "common.py: train_step() at most 30"),
    ("common.py", after_docstring(check_house.COMMON_CAP), check_house.common_reads_top_down,
     f"common.py: the module at most {check_house.COMMON_CAP}"),
    ("common.py", lambda t: t + "x = os.replace\n", check_house.common_reads_top_down,
     "leaves what keeps a run safe to plumbing/ (it calls os.replace)"),
    ("plumbing/errors.py", lambda t: t + "# a note\n" * check_house.PLUMBING_CAP,
     check_house.plumbing_stays_small,
     f"plumbing/: at most {check_house.PLUMBING_CAP} lines in all"),
    ("plumbing/errors.py", lambda t: t + "#" * 111 + "\n", check_house.plumbing_stays_small,
     "a line of at most 110 columns (it has 111)"),
    ("plumbing/errors.py", lambda t: t + "x = 1\n" * 900, check_house.plumbing_stays_small,
     "lines of docstrings and comments a line of code"),
])
def test_each_rule_is_named_when_broken(house, name, edit, check, rule):
    new = broken_by(house, name, edit, check)
    assert any(rule in line for line in new) and all(line.startswith(name.split("/")[0]) for line in new), new


def test_a_script_edited_without_rebuilding_its_page_is_named(house):
    """An edited comment changes simcse.py's page; the check names that page and the command that
    rebuilds it (and only that page: the copy's pages are rebuilt before the edit)."""
    missing = pages.katex_ready() or pages.pygments_differs()
    if missing:
        if CI:
            pytest.fail(f"{missing} (under CI, .ci/run installs it)")
        pytest.skip(missing)
    pages.write(pages.generate(house), house / pages.OUT)     # fresh pages first, whatever the checkout's are
    new = broken_by(house, "simcse.py", lambda t: t.replace("# Eq. (4): l_i", "# Eq. (4), edited: l_i", 1),
                    check_house.pages_are_fresh)
    assert new == ["docs/pages/simcse.html: differs from a fresh build (rebuild: python tools/pages.py)"], new


def test_the_command_exits_0_when_no_rule_is_broken(monkeypatch, capsys):
    monkeypatch.setattr(check_house, "CHECKS", [lambda root: []])
    assert check_house.main([]) == 0 and "1 checks pass" in capsys.readouterr().out


def test_an_experiment_measured_on_an_earlier_script_is_named(house):
    """figures.json records the sha256 of the script each experiment was measured on: after an edit
    of that script, the check names each of its measured experiments to measure again, and no other
    script's, and its docs page's section, which now says so, is named as not rebuilt."""
    from tools import experiment
    exps = experiment.load_experiments(house)
    sha = {e.script: experiment.sha256((house / e.script).read_bytes()) for e in exps}
    figures = {e.name: {"code": {e.script: sha[e.script]}, "commit": "abc1234",
                        "change": {"patch": (experiment.sha256(experiment.patch_path(e, house).read_bytes())
                                             if experiment.patch_path(e, house).is_file() else None),
                                   "flags": e.flags, "settings": e.settings},
                        "arms": {role: {"seeds": {"1": {"avg": 75.0, "stsb_dev": 80.0, "wall_s": 60.0,
                                                        "figures": {}}}} for role in ("control", "changed")}}
               for e in exps}
    experiment.write_json(house / "docs" / "experiments" / "figures.json", figures)
    for path, text in experiment.method_pages(house).items():
        path.write_text(text, encoding="utf-8")
    assert check_house.experiments_are_current(house) == []
    new = broken_by(house, "focal_infonce.py", lambda text: text.replace("return s * factor / tau",
                                                                         "return s * factor / (2 * tau)"),
                    check_house.experiments_are_current)
    focal = sorted(e.name for e in exps if e.script == "focal_infonce.py")
    named = sorted(line.split(": ")[1] for line in new if "measure again" in line)
    assert named == focal, new
    assert all("focal_infonce" in line for line in new), new
    assert any(line.startswith("docs/experiments: docs/focal_infonce.md") for line in new), new
