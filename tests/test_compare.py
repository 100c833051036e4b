"""`python tools/compare.py`: fabricated run folders (fast), the --baseline row with the tiny
BERT, and one real tiny run compared end to end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import common
from conftest import ROOT
from tools import compare as tool

TASKS = common.STS_TASKS
SIMCSE_ARGS = {"data": "data/wiki1m_for_simcse.txt", "model": "bert-base-uncased", "output_dir": "runs/x",
               "max_steps": 0, "epochs": 1, "batch_size": 64, "max_len": 32, "lr": 3e-5, "seed": 42,
               "eval_every": 125, "sts_dir": "data/sts", "resume": False, "tau": 0.05,
               "pooler": "cls_before_pooler", "log_every": 10, "cache_dir": "", "compile": True}
FOCAL_ARGS = {**SIMCSE_ARGS, "tau": 0.07, "m": 0.3, "modulate": True}


def make_run(folder: Path, args: dict | None, scores: list[float] | None, script: str | None = "simcse.py",
             pooler: str | None = "cls_before_pooler",
             curve: list[tuple[int, float]] = ((2, 50.0), (4, 55.0)), tasks: list[str] = TASKS,
             align_uniform: list[tuple[float, float]] | None = None,
             code: dict[str, str] | None = None) -> Path:
    """A run folder written by hand: args.json, run.json, metrics.jsonl, best/test_metrics.json.
    `scores` = one figure a task (avg = their mean); None leaves the run unfinished.
    `align_uniform` = (alignment, uniformity) of each evaluation in `curve`; None writes a log
    from before they were recorded. `code` = {file: text}: the code the run started with, as a
    run records it (run.json's "code": each file's sha256; code/: the copies); None: a run from
    before code was recorded."""
    folder.mkdir(parents=True)
    if args is not None:
        (folder / "args.json").write_text(json.dumps({**args, "output_dir": str(folder)}))
    if script is not None:
        record = {"script": script, "data_sha256": "0" * 64}
        if code is not None:
            record["code"] = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in code.items()}
            for name, text in code.items():
                (folder / "code" / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / "code" / name).write_bytes(text.encode())
        (folder / "run.json").write_text(json.dumps(record))
    lines = []
    for i, (step, dev) in enumerate(curve):
        lines.append(json.dumps({"step": step - 1, "loss": 1.0, "lr": 1e-5, "sent_per_s": 9.0, "epoch": 0}))
        au = {} if align_uniform is None else dict(zip(("alignment", "uniformity"), align_uniform[i]))
        lines.append(json.dumps({"step": step, "stsb_dev": dev, "sickr_dev": dev - 5, "avg_dev": dev - 2,
                                 "best_stsb_dev": dev, **au}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if scores is not None:
        (folder / "best").mkdir()
        res = {t: {"spearman": s, "n": 100} for t, s in zip(tasks, scores)}
        res["avg"] = float(np.mean(scores))
        if pooler is not None:
            res["pooler"] = pooler
        (folder / "best" / "test_metrics.json").write_text(json.dumps(res))
    return folder


# the code of this checkout as a run records it now (the script, common.py, plumbing/), as a run of
# 664f320 recorded it (the script and common.py), and the student's ablation: the temperature doubled
# inside simcse_loss
TAU_LINE = "    return F.cross_entropy(sim / tau, labels)"
TAU_DOUBLED = "    return F.cross_entropy(sim / (2 * tau), labels)"
MODULES = ["simcse.py", "common.py",
           *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("plumbing/*.py"))]
CHECKOUT = {name: (ROOT / name).read_bytes().decode("utf-8") for name in MODULES}
OLD_RECORD = {name: CHECKOUT[name] for name in ("simcse.py", "common.py")}
EDITED = {**CHECKOUT, "simcse.py": CHECKOUT["simcse.py"].replace(TAU_LINE, TAU_DOUBLED)}
assert EDITED["simcse.py"] != CHECKOUT["simcse.py"] and "plumbing/inputs.py" in CHECKOUT


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org",
                           *argv], check=True, capture_output=True, text=True).stdout.strip()


class Repo(type(Path())):
    short: str      # its HEAD, as git abbreviates it


@pytest.fixture(autouse=True)
def repo(tmp_path, monkeypatch) -> Repo:
    """The checkout compare names code against: a copy of this repository's modules, committed in a
    git repository of its own (so that no test depends on the state of the real checkout); its
    HEAD's short hash in .short."""
    repo = Repo(tmp_path / "repo")
    for f in [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py")]:
        (repo / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, repo / f.relative_to(ROOT))
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the code as committed")
    monkeypatch.setattr(tool, "ROOT", repo)
    repo.short = git(repo, "rev-parse", "--short", "HEAD")
    return repo


def code_id(code: dict[str, str]) -> str:
    """The 6 hex digits a code's default folder is named after (run_folder.code_id)."""
    shas = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in code.items()}
    return hashlib.sha256(json.dumps(shas, sort_keys=True).encode()).hexdigest()[:6]


def compare(argv: list[str]) -> None:
    tool.main([*map(str, argv)])


def error_of(argv: list[str], capsys) -> str:
    """What `python tools/compare.py ...` prints on stderr, checking it ends with exit status 2."""
    with pytest.raises(SystemExit) as e:
        common.run_main(tool.main, [*map(str, argv)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.fixture
def runs(tmp_path):
    """Three seeds of SimCSE tau 0.05 (one with another cache_dir, log_every and resume), one of
    tau 0.1, one Focal-InfoNCE run and one with --no-modulate."""
    base = [60.0, 70.0, 65.0, 75.0, 72.0, 74.0, 68.0]
    r = {}
    for i, (seed, shift) in enumerate([(1, 0.0), (2, 1.0), (3, 2.5)]):
        extra = {"cache_dir": "/elsewhere", "log_every": 1, "resume": True} if i == 2 else {}
        r[f"s{seed}"] = make_run(tmp_path / f"simcse-s{seed}", {**SIMCSE_ARGS, "seed": seed, **extra},
                                 [b + shift for b in base])
    r["tau"] = make_run(tmp_path / "simcse-tau0.1", {**SIMCSE_ARGS, "tau": 0.1}, [b - 1 for b in base])
    r["focal"] = make_run(tmp_path / "focal", FOCAL_ARGS, [b + 3 for b in base], script="focal_infonce.py")
    r["nomod"] = make_run(tmp_path / "focal-nomod", {**FOCAL_ARGS, "modulate": False}, base,
                          script="focal_infonce.py")
    return r


# ------------------------------------------------------------------------ grouping, numbers

def test_seeds_form_one_row_with_mean_and_sample_std(runs):
    groups = tool.group_runs([tool.read_run(runs[k]) for k in ("s1", "tau", "s2", "s3")])
    table = tool.compare_table(groups)
    assert table["tasks"] == TASKS
    rows = table["rows"]
    assert [r["n"] for r in rows] == [3, 1]               # cache_dir, log_every, resume ignored
    assert rows[0]["runs"] == [runs["s1"], runs["s2"], runs["s3"]]
    # per task: the three seeds are base, base + 1, base + 2.5
    shifts = np.array([0.0, 1.0, 2.5])
    assert rows[0]["mean"]["STS12"] == pytest.approx(60 + shifts.mean())
    assert rows[0]["std"]["STS12"] == pytest.approx(np.std(shifts, ddof=1))      # 1.258, not 1.027
    assert rows[0]["std"]["STS12"] == pytest.approx(1.2583057, abs=1e-6)
    assert rows[0]["mean"]["avg"] == pytest.approx(np.mean([60, 70, 65, 75, 72, 74, 68]) + shifts.mean())
    assert rows[0]["std"]["avg"] == pytest.approx(np.std(shifts, ddof=1))
    assert rows[1]["mean"]["SICKRelatedness"] == pytest.approx(67.0) and rows[1]["std"]["avg"] is None
    text = tool.format_compare(table)
    assert "61.17 ± 1.26" in text and " 67.00 " in text + " "
    assert "mean ± sample std (ddof=1)" in text


def test_sts_dir_and_compile_are_ignored_like_the_other_not_training_flags(tmp_path):
    """One list: seed plus common.NOT_TRAINING. A run that differs only in where its STS data
    lives or whether its step was compiled is one more seed of the row, and no label names them."""
    assert tool.IGNORED == ("seed", *common.NOT_TRAINING)
    assert {"resume", "cache_dir", "log_every", "sts_dir", "compile", "output_dir"} <= set(tool.IGNORED)
    a = make_run(tmp_path / "a", {**SIMCSE_ARGS, "seed": 1}, [70.0] * 7)
    b = make_run(tmp_path / "b", {**SIMCSE_ARGS, "seed": 2, "sts_dir": "/elsewhere/data/sts",
                                  "compile": False}, [72.0] * 7)
    c = make_run(tmp_path / "c", {**SIMCSE_ARGS, "tau": 0.1, "sts_dir": "elsewhere/sts"}, [71.0] * 7)
    groups = tool.group_runs([tool.read_run(p) for p in (a, b, c)])
    assert [len(g["runs"]) for g in groups] == [2, 1]
    assert [g["label"] for g in groups] == ["simcse.py tau=0.05 [cls_before_pooler]",
                                            "simcse.py tau=0.1 [cls_before_pooler]"]


def test_labels_name_script_distinguishing_flags_and_pooler(runs):
    groups = tool.group_runs([tool.read_run(runs[k]) for k in ("s1", "s2", "tau", "focal", "nomod")])
    labels = [g["label"] for g in groups]
    # tau differs between groups, modulate between the two Focal runs; m (same wherever it is)
    # and the ignored seed / output_dir are not named
    assert labels == ["simcse.py tau=0.05 [cls_before_pooler]",
                      "simcse.py tau=0.1 [cls_before_pooler]",
                      "focal_infonce.py modulate=True tau=0.07 [cls_before_pooler]",
                      "focal_infonce.py modulate=False tau=0.07 [cls_before_pooler]"]
    text = tool.format_compare(tool.compare_table(groups))
    lines = text.splitlines()
    assert lines[1].startswith("simcse.py tau=0.05 [cls_before_pooler]") and lines[1].split()[3] == "2"


def test_paths_in_labels_are_shortened_to_what_tells_them_apart(tmp_path):
    a = make_run(tmp_path / "a", {**SIMCSE_ARGS, "model": "../models/all-MiniLM-L6-v2",
                                  "data": "x/one/train.txt"}, [70.0] * 7)
    b = make_run(tmp_path / "b", {**SIMCSE_ARGS, "data": "x/two/train.txt"}, [70.0] * 7, pooler="avg")
    labels = [g["label"] for g in tool.group_runs([tool.read_run(a), tool.read_run(b)])]
    assert labels == ["simcse.py data=one/train.txt model=all-MiniLM-L6-v2 [cls_before_pooler]",
                      "simcse.py data=two/train.txt model=bert-base-uncased [avg]"]


# ------------------------------------------------------------------------ the code a run started with

def test_an_edit_of_the_code_is_a_row_of_its_own_not_seed_noise(tmp_path, capsys, monkeypatch, repo):
    """The student's ablation: the same command, once with the committed code and once with the
    temperature doubled in simcse_loss: two rows of n 1 (not one row of n 2, 75.81 ± 0.68), their
    code told apart in the labels, the table and the plot's legend; no "same seed twice"."""
    base = [70.0, 78.0, 74.0, 82.0, 78.0, 80.0, 72.03]                      # avg 76.29
    original = make_run(tmp_path / "original", SIMCSE_ARGS, base, code=CHECKOUT)
    edited = make_run(tmp_path / "edited", SIMCSE_ARGS, [b - 0.96 for b in base], code=EDITED)
    import matplotlib.figure
    saved, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1])
    compare([original, edited, "--plot", tmp_path / "dev.png"])
    out, err = capsys.readouterr()
    labels = [f"simcse.py [cls_before_pooler] as committed ({repo.short})",
              "simcse.py [cls_before_pooler] simcse.py edited"]
    rows = out.splitlines()
    assert rows[1].startswith(labels[0]) and rows[1].split()[-1] == "76.29"
    assert rows[2].startswith(labels[1]) and rows[2].split()[-1] == "75.33"
    assert [row[len(label):].split()[0] for row, label in zip(rows[1:3], labels)] == ["1", "1"]
    assert "±" not in rows[1] + rows[2]
    assert tool.code_note(tool.committed()) in out and f"committed at {repo.short} (git HEAD)" in out
    assert "--code_diff" in out and "same seed twice" not in err
    assert code_id(CHECKOUT) not in out and code_id(EDITED) not in out      # no hex that reads as a commit
    (fig,) = saved
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == [f"{label}, n=1" for label in labels]


def test_labels_read_forwards_whatever_the_working_tree_holds(tmp_path, capsys, repo):
    """The loop as a student runs it, in a git checkout: a run of the committed simcse.py, the file
    edited in place and run again, then `git checkout simcse.py`. Each row names its code against
    the commit, before the edit is undone and after (the labels of a tree-relative reading swap)."""
    script = repo / "simcse.py"
    committed = {name: (repo / name).read_text() for name in MODULES}
    original = make_run(tmp_path / "original", SIMCSE_ARGS, [70.0] * 7, code=committed)
    script.write_text(script.read_text().replace(TAU_LINE, TAU_DOUBLED))          # the edit, in place
    edited = make_run(tmp_path / "edited", SIMCSE_ARGS, [71.0] * 7,
                      code={name: (repo / name).read_text() for name in MODULES})
    expected = [f"simcse.py [cls_before_pooler] as committed ({repo.short})",
                "simcse.py [cls_before_pooler] simcse.py edited"]

    def labels() -> list[str]:
        return [g["label"] for g in tool.group_runs([tool.read_run(original), tool.read_run(edited)])]
    assert labels() == expected                                     # while the edit is in place
    git(repo, "checkout", "simcse.py")
    assert script.read_text() == committed["simcse.py"]
    assert labels() == expected                                     # after it is undone
    compare([edited, "--code_diff"])                                # the edit, against the commit
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"--- simcse.py (committed at {repo.short})", f"+++ {edited}/code/simcse.py"]
    assert [line for line in out if line[:1] in "-+" and line[:3] not in ("---", "+++")] == [
        "-" + TAU_LINE + " " * 33 + "# ()", "+" + TAU_DOUBLED + " " * 33 + "# ()"]
    # the edit committed: the edited run is now the committed code, the other its edit
    script.write_text(EDITED["simcse.py"])
    git(repo, "commit", "-q", "-am", "tau doubled")
    short = git(repo, "rev-parse", "--short", "HEAD")
    assert labels() == ["simcse.py [cls_before_pooler] simcse.py edited",
                        f"simcse.py [cls_before_pooler] as committed ({short})"]


def test_two_edits_of_the_same_file_are_numbered_in_the_order_their_runs_started(tmp_path, repo):
    base = [70.0] * 7
    second = {**CHECKOUT, "simcse.py": CHECKOUT["simcse.py"].replace(TAU_LINE, "    return F.cross_entropy("
                                                                      "sim / tau, labels) * 2")}
    runs = {"late": make_run(tmp_path / "late", SIMCSE_ARGS, base, code=second),
            "early": make_run(tmp_path / "early", SIMCSE_ARGS, base, code=EDITED),
            "early-s2": make_run(tmp_path / "early-s2", {**SIMCSE_ARGS, "seed": 2}, base, code=EDITED),
            "original": make_run(tmp_path / "original", SIMCSE_ARGS, base, code=CHECKOUT)}
    for k, name in enumerate(["original", "early", "late", "early-s2"]):       # when each run started
        for f in ("run.json", "args.json"):
            os.utime(runs[name] / f, (1_700_000_000 + 60 * k,) * 2)
    groups = tool.group_runs([tool.read_run(p) for p in runs.values()])        # given late first
    assert [(g["label"], len(g["runs"])) for g in groups] == [
        ("simcse.py [cls_before_pooler] simcse.py edited (edit 2)", 1),
        ("simcse.py [cls_before_pooler] simcse.py edited (edit 1)", 2),
        (f"simcse.py [cls_before_pooler] as committed ({repo.short})", 1)]


def test_labels_name_every_file_that_differs_plumbing_included(tmp_path, repo):
    """An edit anywhere in the modules a run ran is named, plumbing/ included; a module the commit
    does not hold is `not committed`; a record of an earlier version (the script and common.py only)
    still reads, and says that plumbing/ was not recorded."""
    base = [70.0] * 7
    inputs = {**CHECKOUT, "plumbing/inputs.py": CHECKOUT["plumbing/inputs.py"] + "# one sentence less\n"}
    both = {**inputs, "simcse.py": EDITED["simcse.py"]}
    new = {**CHECKOUT, "plumbing/extra.py": "# a module of the student's\n"}
    codes = [CHECKOUT, inputs, both, new, OLD_RECORD, {**OLD_RECORD, "simcse.py": EDITED["simcse.py"]}]
    runs = [make_run(tmp_path / f"r{k}", SIMCSE_ARGS, base, code=code) for k, code in enumerate(codes)]
    assert [g["label"].removeprefix("simcse.py [cls_before_pooler] ") for g in tool.group_runs(
        [tool.read_run(p) for p in runs])] == [
        f"as committed ({repo.short})", "plumbing/inputs.py edited", "simcse.py, plumbing/inputs.py edited",
        "plumbing/extra.py not committed", f"as committed ({repo.short}; plumbing/ not recorded)",
        "simcse.py edited (plumbing/ not recorded)"]


def test_outside_a_git_checkout_codes_are_numbered_by_start_and_the_note_says_why(tmp_path, capsys,
                                                                                monkeypatch):
    folder = tmp_path / "unpacked"                        # the repository from an archive: no .git
    (folder / "plumbing").mkdir(parents=True)
    for name in MODULES:
        (folder / name).write_text(CHECKOUT[name])
    monkeypatch.setattr(tool, "ROOT", folder)
    assert tool.committed() == "not a git checkout"
    base = [70.0] * 7
    original = make_run(tmp_path / "original", SIMCSE_ARGS, base, code=CHECKOUT)
    edited = make_run(tmp_path / "edited", SIMCSE_ARGS, [71.0] * 7, code=EDITED)
    os.utime(edited / "run.json", (1_700_000_000,) * 2)                         # the edited one first
    compare([original, edited])
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert rows[1].startswith("simcse.py [cls_before_pooler] code 2: simcse.py differs from code 1 ")
    assert rows[2].startswith("simcse.py [cls_before_pooler] code 1 ")
    assert "numbered in the order their runs started; this folder is not a git checkout, so there is no " \
           "committed code to name them against" in out
    compare([edited, "--code_diff"])                       # one run: against this folder's files
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["--- simcse.py (this folder)", f"+++ {edited}/code/simcse.py"]


def test_the_code_part_is_added_only_where_the_code_differs(tmp_path, repo):
    """Flags only: today's labels. Flags and code: the flags, and the code too (a row whose code
    differs says so, whatever else differs). A script whose rows share their code: no code part,
    even beside another script's rows that differ."""
    base = [70.0] * 7
    same = [make_run(tmp_path / "a", SIMCSE_ARGS, base, code=CHECKOUT),
            make_run(tmp_path / "b", {**SIMCSE_ARGS, "tau": 0.1}, base, code=CHECKOUT)]
    assert [g["label"] for g in tool.group_runs([tool.read_run(p) for p in same])] == [
        "simcse.py tau=0.05 [cls_before_pooler]", "simcse.py tau=0.1 [cls_before_pooler]"]
    assert not tool.compare_table(tool.group_runs([tool.read_run(p) for p in same]))["code_note"]
    both = [same[0], make_run(tmp_path / "c", {**SIMCSE_ARGS, "tau": 0.1}, base, code=EDITED)]
    focal_code = {"focal_infonce.py": "# focal\n", "common.py": "# an older common.py\n"}
    focal = [make_run(tmp_path / f"focal-s{seed}", {**FOCAL_ARGS, "seed": seed}, base, "focal_infonce.py",
                      code=focal_code) for seed in (1, 2)]
    groups = tool.group_runs([tool.read_run(p) for p in (*both, *focal)])
    labels = [g["label"] for g in groups]
    assert labels[0] == f"simcse.py tau=0.05 [cls_before_pooler] as committed ({repo.short})"
    assert labels[1] == "simcse.py tau=0.1 [cls_before_pooler] simcse.py edited"
    assert labels[2] == "focal_infonce.py tau=0.07 [cls_before_pooler]" and len(groups[2]["runs"]) == 2
    # a code that differs from the commit in two files names both
    two = {**OLD_RECORD, "simcse.py": "# another\n", "common.py": "# another\n"}
    (g1, g2) = tool.group_runs([tool.read_run(same[0]), tool.read_run(
        make_run(tmp_path / "d", SIMCSE_ARGS, base, code=two))])
    assert g2["label"].endswith("[cls_before_pooler] simcse.py, common.py edited (plumbing/ not recorded)")


def test_a_run_whose_code_is_not_recorded_is_a_row_of_its_own(tmp_path, capsys, repo):
    """Runs from before code was recorded: never merged with a run whose code is known (its code is
    unknown), merged with each other as before."""
    base = [70.0] * 7
    old = [make_run(tmp_path / f"old-s{seed}", {**SIMCSE_ARGS, "seed": seed}, base) for seed in (1, 2)]
    new = make_run(tmp_path / "new", {**SIMCSE_ARGS, "seed": 3}, base, code=CHECKOUT)
    groups = tool.group_runs([tool.read_run(p) for p in (*old, new)])
    assert [(g["label"], len(g["runs"])) for g in groups] == [
        ("simcse.py [cls_before_pooler] code not recorded", 2),
        (f"simcse.py [cls_before_pooler] as committed ({repo.short})", 1)]
    assert [g["label"] for g in tool.group_runs([tool.read_run(p) for p in old])] == [
        "simcse.py [cls_before_pooler]"]
    (new / "run.json").write_text(json.dumps({"script": "simcse.py", "code": {"../etc/passwd": "0" * 64}}))
    err = error_of([new], capsys)
    assert f"{new / 'run.json'}: its \"code\" is not {{file: sha256 hex}}" in err


def test_code_diff_shows_the_lines_that_differ_named_by_run(tmp_path, capsys, repo):
    """Two runs: a unified diff of each file whose recorded code differs, from their code/ copies
    (an unfinished run's too). One run: the committed file (-) against the run's copy (+). A run
    without a record of its code says so in one line; a copy changed after the run, in a note."""
    original = make_run(tmp_path / "original", SIMCSE_ARGS, [70.0] * 7, code=CHECKOUT)
    edited = make_run(tmp_path / "edited", SIMCSE_ARGS, None, code=EDITED)             # Ctrl-C'd: no best/
    compare([original, edited, "--code_diff"])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"--- {original}/code/simcse.py", f"+++ {edited}/code/simcse.py"]
    shape = "                                 # ()"
    assert [line for line in out if line[:1] in "-+" and line[:3] not in ("---", "+++")] == [
        "-" + TAU_LINE + shape, "+" + TAU_DOUBLED + shape]
    assert out[-1] == f"the same in both: {', '.join(MODULES[1:])}"
    compare([edited, "--code_diff"])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"--- simcse.py (committed at {repo.short})", f"+++ {edited}/code/simcse.py"]
    assert "+" + TAU_DOUBLED + shape in out
    compare([original, "--code_diff"])
    assert capsys.readouterr().out == (f"the code committed at {repo.short} and {original}: the same code "
                                       f"({', '.join(MODULES)})\n")
    old = make_run(tmp_path / "old", SIMCSE_ARGS, [70.0] * 7)
    compare([old, edited, "--code_diff"])
    assert capsys.readouterr().out == (f"{old}: no record of its code (no run.json with \"code\": a run "
                                       f"of an earlier version); nothing to diff\n")
    with open(edited / "code" / "simcse.py", "a") as f:
        f.write("# changed after the run started\n")
    compare([original, edited, "--code_diff"])
    out = capsys.readouterr().out
    assert f"note: {edited}/code/simcse.py: not the file {edited}/run.json records" in out
    assert "+# changed after the run started" in out
    err = error_of([original, edited, old, "--code_diff"], capsys)
    assert "--code_diff: 3 run folders" in err and "give two runs, or one" in err
    assert "leave out --plot" in error_of([original, "--code_diff", "--plot", tmp_path / "a.png"], capsys)


def test_code_diff_checks_every_copy_against_run_json_plumbing_included(tmp_path, capsys, repo):
    """Every copy in code/ is held to the sha256 run.json records: one that is not (edited after
    the run started) or is missing is said so, and two runs whose records agree are then never
    "the same code"; an edit of a plumbing/ module is diffed like the script's; a record of an
    earlier version is diffed on the files it holds, the others named."""
    inputs = {**CHECKOUT, "plumbing/inputs.py": CHECKOUT["plumbing/inputs.py"] + "# one sentence less\n"}
    a = make_run(tmp_path / "a", SIMCSE_ARGS, [70.0] * 7, code=CHECKOUT)
    b = make_run(tmp_path / "b", {**SIMCSE_ARGS, "seed": 2}, [70.0] * 7, code=CHECKOUT)
    compare([a, b, "--code_diff"])
    assert capsys.readouterr().out == f"{a} and {b}: the same code ({', '.join(MODULES)})\n"
    tampered = b / "code" / "plumbing" / "inputs.py"
    tampered.write_text(CHECKOUT["plumbing/inputs.py"].replace("def ", "def  ", 1))
    (b / "code" / "common.py").unlink()
    compare([a, b, "--code_diff"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"note: {b}/code/common.py: missing, though {b}/run.json records it: its lines cannot be "
                   f"shown",
                   f"note: {tampered}: not the file {b}/run.json records (changed after the run started?): "
                   f"run.json's sha256 is what ran; a diff below shows this copy's lines",
                   f"{a} and {b}: run.json records the same sha256 for each file ({', '.join(MODULES)}), "
                   f"but a copy in code/ is not that file (above)"]
    assert not any("the same code" in line for line in out)
    c = make_run(tmp_path / "c", SIMCSE_ARGS, [70.0] * 7, code=inputs)
    compare([a, c, "--code_diff"])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"--- {a}/code/plumbing/inputs.py", f"+++ {c}/code/plumbing/inputs.py"]
    assert [line for line in out if line[:1] in "-+" and line[:3] not in ("---", "+++")] == [
        "+# one sentence less"]
    old = make_run(tmp_path / "old", SIMCSE_ARGS, [70.0] * 7, code=OLD_RECORD)
    compare([old, c, "--code_diff"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"only in {c}'s code: {', '.join(MODULES[2:])} ({old}'s run.json records simcse.py, "
                   f"common.py only: an earlier version's record)", "the same in both: simcse.py, common.py"]


# ------------------------------------------------------------------------ seed noise under the table

def test_a_one_seed_comparison_says_it_is_one_seed(tmp_path, capsys):
    """Focal --m 0.1 against 0.3, one seed each (+0.22): one line says the rows are one seed, with
    the spread measured for the script and where; two seeds a row: no such line."""
    base = [70.0] * 7
    m3 = make_run(tmp_path / "m0.3", FOCAL_ARGS, base, "focal_infonce.py")
    m1 = make_run(tmp_path / "m0.1", {**FOCAL_ARGS, "m": 0.1}, [70.22] * 7, "focal_infonce.py")
    md = tmp_path / "t.md"
    compare([m3, m1, "--markdown", md])
    out = capsys.readouterr().out.splitlines()
    line = ("one seed: every row is one run (n = 1), and one seed cannot tell a difference from seed noise: "
            "two seeds of focal_infonce.py ended 0.07 apart on the laptop testbed (seeds 1 and 2: "
            "75.80 ± 0.05 and, --no-modulate, 75.31 ± 0.05, docs/results.md)")
    assert [x for x in out if x.startswith(("one seed", "within seed noise"))] == [line]   # +0.22 > 0.07
    assert f"- {line}" in md.read_text().splitlines()
    m1_s2 = make_run(tmp_path / "m0.1-s2", {**FOCAL_ARGS, "m": 0.1, "seed": 2}, [70.3] * 7,
                     "focal_infonce.py")
    compare([m3, m1, m1_s2])
    out = capsys.readouterr().out
    assert ("one seed: focal_infonce.py m=0.3 [cls_before_pooler] is one run (n = 1), and one seed "
            "cannot tell") in out
    compare([m1, m1_s2])                                        # one row of two seeds: nothing to say
    assert "seed noise" not in capsys.readouterr().out


def test_a_difference_within_the_seed_spread_says_so(tmp_path, capsys):
    """Two rows of two seeds whose averages differ by less than two seeds of SimCSE ended apart on the
    laptop testbed (0.24): one line with the spread and where it was measured; 0.30 apart: none.
    Across scripts, the larger of their spreads; none where neither script's was measured."""
    base = [70.0] * 7
    rows = {}
    for name, shift, tau in [("a", 0.0, 0.05), ("b", 0.10, 0.1), ("c", 0.30, 0.2)]:
        rows[name] = [make_run(tmp_path / f"{name}-s{seed}", {**SIMCSE_ARGS, "tau": tau, "seed": seed},
                               [b + shift + 0.01 * seed for b in base]) for seed in (1, 2)]
    compare([*rows["a"], *rows["b"], *rows["c"]])
    out = [x for x in capsys.readouterr().out.splitlines() if "seed noise" in x]
    spread = ("two seeds of simcse.py ended 0.24 apart on the laptop testbed (seed 42: 75.67, README.md's "
              "results table; seeds 1 and 2: 75.43 ± 0.00, docs/results.md)")
    assert out == [f"within seed noise: simcse.py tau=0.1 [cls_before_pooler] against simcse.py tau=0.05 "
                   f"[cls_before_pooler]: +0.10 on the average, less than {spread}",
                   f"within seed noise: simcse.py tau=0.2 [cls_before_pooler] against simcse.py tau=0.1 "
                   f"[cls_before_pooler]: +0.20 on the average, less than {spread}"]     # a-c: 0.30, not said
    rows_ = [{"label": "x", "script": "ifcl.py", "n": 2, "mean": {"avg": 74.56}},
             {"label": "y", "script": "conisi.py", "n": 2, "mean": {"avg": 74.06}},
             {"label": "z", "script": "mine.py", "n": 2, "mean": {"avg": 74.90}},     # measured for neither:
             {"label": "w", "script": "mine.py", "n": 2, "mean": {"avg": 74.90}}]     # nothing said
    assert tool.noise_lines(rows_) == [
        "within seed noise: y against x: -0.50 on the average, less than two seeds of conisi.py ended 0.71 "
        "apart on the laptop testbed (seeds 1 and 2, --lam 0: 74.61 ± 0.50, docs/results.md)"]


def test_the_seed_spreads_are_the_figures_the_docs_print():
    """Each script's spread quotes figures docs/results.md's testbed table (and README's first run)
    prints, and is what they make: two seeds with sample std s are s * sqrt(2) apart."""
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    testbed = results[results.index("## What the testbed measured"):results.index("## The untrained encoder")]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert set(tool.SEED_SPREAD) == {"simcse.py", "focal_infonce.py", "ifcl.py", "conisi.py", "rcl.py"}
    for script, (spread, where) in tool.SEED_SPREAD.items():
        quoted = re.findall(r"(\d+\.\d\d) ± (\d\.\d\d)", where)
        assert quoted and all(f"{mean} ± {std}" in testbed for mean, std in quoted), script
        if script == "simcse.py":
            assert "seed 42: 75.67" in readme and "README.md" in where
            assert spread == pytest.approx(75.67 - float(quoted[0][0]))
        else:
            assert spread == round(max(float(std) for _, std in quoted) * 2 ** 0.5, 2), script


def test_runs_from_before_scripts_and_poolers_were_recorded(tmp_path):
    """No run.json, no pooler in test_metrics.json: the folder names the row; the pooler comes
    from --pooler in args.json where the script has one, else it says it is not recorded."""
    old1 = make_run(tmp_path / "old-s1", {**SIMCSE_ARGS, "seed": 1}, [70.0] * 7, script=None, pooler=None)
    old2 = make_run(tmp_path / "old-s2", {**SIMCSE_ARGS, "seed": 2}, [72.0] * 7, script=None, pooler=None)
    ifcl = {k: v for k, v in SIMCSE_ARGS.items() if k != "pooler"} | {"lam": 0.002}
    old3 = make_run(tmp_path / "ifcl-old", ifcl, [71.0] * 7, script=None, pooler=None)
    groups = tool.group_runs([tool.read_run(p) for p in (old1, old2, old3)])
    assert [g["label"] for g in groups] == [f"{tmp_path}/old-s [cls_before_pooler]",
                                            f"{tmp_path}/ifcl-old [pooler not recorded]"]
    rows = tool.compare_table(groups)["rows"]
    assert rows[0]["n"] == 2 and rows[0]["std"]["STS13"] == pytest.approx(np.std([70, 72], ddof=1))


def test_command_prints_table_and_writes_markdown(runs, tmp_path, capsys):
    md = tmp_path / "out" / "table.md"
    compare([runs["s1"], runs["s2"], runs["tau"], "--markdown", md])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["run", "n", "STS12", "STS13", "STS14", "STS15", "STS16",
                                           "STS-B", "SICK-R", "Avg."]
    assert "60.50 ± 0.71" in out                               # STS12 of seeds 1 and 2: 60, 61
    assert f"{runs['s1']} (seed 1), {runs['s2']} (seed 2)" in err
    lines = md.read_text().splitlines()
    assert lines[0] == "| run | n | STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |"
    assert lines[1] == "|---|---|---|---|---|---|---|---|---|---|"
    assert lines[2].startswith("| simcse.py tau=0.05 [cls_before_pooler] | 2 | 60.50 ± 0.71 | 70.50 ± 0.71 |")
    assert lines[3] == ("| simcse.py tau=0.1 [cls_before_pooler] | 1 | 59.00 | 69.00 | 64.00 | 74.00 | "
                        "71.00 | 73.00 | 67.00 | 68.14 |")
    assert f"Made with `python tools/compare.py {runs['s1']} {runs['s2']} {runs['tau']} --markdown {md}`" \
        in md.read_text()


def _log_training(folder: Path, records: list[dict]) -> None:
    """Append training records (step, lr and the given figures) to a run's metrics.jsonl."""
    with open(folder / "metrics.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps({"loss": 1.0, "lr": 1e-5, "epoch": 0, **r}) + "\n")


def test_the_mechanism_table_shows_each_methods_own_figures_at_the_start_and_the_end(tmp_path, capsys):
    """IFCL's margin and twins gap, RCL's regulators and each entropy model's phi * H: the first and
    the last training record, mean ± std over the seeds; SimCSE has no such figure (no line)."""
    base = [60.0, 70.0, 65.0, 75.0, 72.0, 74.0, 68.0]
    ifcl_args = {**SIMCSE_ARGS, "no_twins": False}
    runs = []
    for seed, (m0, m1) in [(1, (0.02, 0.03)), (2, (0.04, 0.05))]:
        r = make_run(tmp_path / f"ifcl-s{seed}", {**ifcl_args, "seed": seed}, base, "ifcl.py", curve=())
        _log_training(r, [{"step": 10, "margin": m0, "twins_gap": 0.5}, {"step": 20, "margin": 0.0},
                          {"step": 40, "margin": m1, "twins_gap": 0.1}, {"step": 30, "margin": 9.0}])
        runs.append(r)
    rcl_run = make_run(tmp_path / "rcl", {**SIMCSE_ARGS, "phi": [0.01]}, base, script="rcl.py", curve=())
    _log_training(rcl_run, [{"step": 10, "contrastive": 2.0, "regulators": 4.0},
                            {"step": 20, "contrastive": 1.0, "regulators": 0.5}])
    stage = rcl_run / "entropy_phi0.01"
    stage.mkdir()
    _log_training(stage, [{"step": 5, "phi_entropy": 0.0004, "entropy": 0.04},
                          {"step": 10, "phi_entropy": 0.0002, "entropy": 0.02}])
    simcse_run = make_run(tmp_path / "simcse", SIMCSE_ARGS, base)
    md = tmp_path / "t.md"
    compare([*runs, rcl_run, simcse_run, "--markdown", md])
    out = capsys.readouterr().out
    rows = {r["label"].split()[0] + r["label"].partition(" / ")[2]: r for r in tool.mechanism_rows(
        tool.group_runs([tool.read_run(p) for p in (*runs, rcl_run, simcse_run)]))}
    # the last record is step 40's, whatever the order of the lines; seeds: mean±std
    assert rows["ifcl.py"]["figures"]["margin"] == "0.03±0.01 → 0.04±0.01"
    assert rows["ifcl.py"]["figures"]["twins_gap"] == "0.5±0 → 0.1±0"
    assert rows["ifcl.py"]["steps"] == "1-10 → 31-40"
    assert rows["rcl.py"]["figures"] == {"contrastive": "2 → 1", "regulators": "4 → 0.5"}
    stage = rows["rcl.pyentropy_phi0.01"]
    assert stage["figures"]["phi_entropy"] == "0.0004 → 0.0002" and "loss" in stage["figures"]
    assert stage["steps"] == "1-5 → 6-10"
    assert set(rows) == {"ifcl.py", "rcl.py", "rcl.pyentropy_phi0.01"}          # SimCSE: no figure of its own
    assert "phi_entropy" in out and "0.03±0.01 → 0.04±0.01" in out
    text = md.read_text()
    assert "| run | steps | margin | twins_gap |" in text
    assert "| run | steps | contrastive | regulators |" in text


def test_a_folder_of_runs_stands_for_every_run_under_it(tmp_path, capsys):
    """runs/simcse, where the default --output_dir puts each run: its runs, in name order; a run
    folder's own best/ and entropy_phi*/ are not runs; an empty folder is still refused."""
    base = [60.0, 70.0, 65.0, 75.0, 72.0, 74.0, 68.0]
    make_run(tmp_path / "runs" / "simcse" / "default", SIMCSE_ARGS, base)
    make_run(tmp_path / "runs" / "simcse" / "tau0.1", {**SIMCSE_ARGS, "tau": 0.1}, base)
    rcl_run = make_run(tmp_path / "runs" / "rcl" / "default", {**SIMCSE_ARGS, "phi": [0.01]}, base, "rcl.py")
    make_run(rcl_run / "entropy_phi0.01", None, None, script=None)
    (tmp_path / "runs" / "simcse" / ".tmp").mkdir()
    assert tool.run_folders(tmp_path / "runs") == [rcl_run, tmp_path / "runs" / "simcse" / "default",
                                                   tmp_path / "runs" / "simcse" / "tau0.1"]
    assert tool.run_folders(rcl_run) == [rcl_run]
    compare([tmp_path / "runs" / "simcse", tmp_path / "runs" / "rcl"])
    out = capsys.readouterr().out
    assert "simcse.py tau=0.05" in out and "simcse.py tau=0.1" in out and "rcl.py" in out
    (tmp_path / "nothing" / "inside").mkdir(parents=True)
    assert f"{tmp_path / 'nothing'}: not a run folder" in error_of([tmp_path / "nothing"], capsys)


def test_a_folder_of_runs_leaves_out_its_unfinished_runs_with_one_note(tmp_path, capsys):
    """A Ctrl-C'd run in runs/simcse no longer stops `compare runs/simcse`: the unfinished runs are
    named in one note and the rest compared; --plot still draws those that have a log; a run named
    by itself is still refused in one line."""
    base = [60.0, 70.0, 65.0, 75.0, 72.0, 74.0, 68.0]
    folder = tmp_path / "runs" / "simcse"
    make_run(folder / "default", SIMCSE_ARGS, base)
    make_run(folder / "tau0.1", {**SIMCSE_ARGS, "tau": 0.1}, base)
    stopped = make_run(folder / "a-stopped", {**SIMCSE_ARGS, "tau": 0.2}, None)     # Ctrl-C'd, a log kept
    (stopped / "last").mkdir()
    just = make_run(folder / "b-just-started", {**SIMCSE_ARGS, "tau": 0.3}, None)
    (just / "metrics.jsonl").unlink()                                               # no log yet
    compare([folder])
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines()[1:3]] == ["tau=0.05", "tau=0.1"]
    note = (f"note: left out, unfinished (no best/test_metrics.json): {stopped}, {just} — finish each with "
            f"its command plus --resume")
    assert [line for line in err.splitlines() if line.startswith("note:")] == [note]
    compare([folder, "--plot", tmp_path / "dev.png"])
    err = capsys.readouterr().err
    assert f"note: {stopped}: no final result; its curve is drawn" in err
    assert (f"note: left out, unfinished (no best/test_metrics.json): {just} — finish each with its command "
            f"plus --resume") in err
    err = error_of([folder / "default", stopped], capsys)
    assert err.count("\n") == 1 and f"{stopped}: unfinished run: no best/test_metrics.json" in err
    only = tmp_path / "only"
    make_run(only / "stopped", SIMCSE_ARGS, None)
    err = error_of([only], capsys)
    assert err.startswith(f"error: no finished run to compare: left out, unfinished (no "
                          f"best/test_metrics.json): {only / 'stopped'}") and "--plot FILE.png" in err


def test_the_docstrings_examples_run(tmp_path, monkeypatch, capsys):
    """The commands at the top of tools/compare.py, verbatim, in a folder that holds such runs
    (the one with --baseline needs the hub: its flags are checked by the other tests)."""
    base = [60.0, 70.0, 65.0, 75.0, 72.0, 74.0, 68.0]
    focal_code = {"focal_infonce.py": (ROOT / "focal_infonce.py").read_bytes().decode(), **CHECKOUT}
    del focal_code["simcse.py"]
    for name, args in [("runs/simcse/default", SIMCSE_ARGS), ("runs/focal_infonce/default", FOCAL_ARGS),
                       ("runs/simcse-s1", {**SIMCSE_ARGS, "seed": 1}),
                       ("runs/simcse-s2", {**SIMCSE_ARGS, "seed": 2}), ("runs/focal", FOCAL_ARGS),
                       ("runs/simcse-edited", {**SIMCSE_ARGS, "seed": 1})]:
        focal = "focal" in name
        make_run(tmp_path / name, args, base, "focal_infonce.py" if focal else "simcse.py",
                 code=focal_code if focal else EDITED if name.endswith("edited") else CHECKOUT)
    monkeypatch.chdir(tmp_path)
    examples = [line.split("#")[0].split()[2:] for line in tool.__doc__.splitlines()
                if line.strip().startswith("python tools/compare.py") and not line.rstrip().endswith("\\")]
    assert len(examples) == 3
    for argv in examples:
        compare(argv)
    assert (tmp_path / "table.md").is_file() and (tmp_path / "dev.png").is_file()
    assert f"+{TAU_DOUBLED}" in capsys.readouterr().out             # --code_diff: the edited line


# ------------------------------------------------------------------------ bad input

def test_bad_inputs_name_the_folder_and_what_to_do(runs, tmp_path, capsys):
    err = error_of([], capsys)
    assert "give at least one run folder" in err
    err = error_of([tmp_path / "nope"], capsys)
    assert f"{tmp_path / 'nope'}: no such folder" in err
    (tmp_path / "empty").mkdir()
    err = error_of([runs["s1"], tmp_path / "empty"], capsys)
    assert f"{tmp_path / 'empty'}: not a run folder" in err and "--output_dir of a training run" in err
    err = error_of([runs["s1"] / "best"], capsys)
    assert "checkpoint folder" in err and f"run folder {runs['s1']} instead" in err
    unfinished = make_run(tmp_path / "running", SIMCSE_ARGS, None)
    err = error_of([runs["s1"], unfinished], capsys)
    assert f"{unfinished}: unfinished run: no best/test_metrics.json" in err and "--resume" in err
    few = make_run(tmp_path / "few", SIMCSE_ARGS, [70.0, 71.0], tasks=["STSBenchmark", "SICKRelatedness"])
    err = error_of([runs["s1"], few], capsys)
    assert f"{few}: its best/test_metrics.json holds STSBenchmark, SICKRelatedness, but {runs['s1']}" in err
    assert "same tasks" in err
    entropy = make_run(runs["s1"] / "entropy_phi0.01", None, None, script=None)
    err = error_of([entropy], capsys)
    assert f"{entropy}: no args.json" in err and "--plot" in err
    (runs["s2"] / "args.json").write_text('{"seed": 2, "ta')
    err = error_of([runs["s2"]], capsys)
    assert f"{runs['s2'] / 'args.json'}: not a readable JSON object (Unterminated string" in err
    (runs["s2"] / "args.json").write_text("[2]")
    assert "(not a JSON object)" in error_of([runs["s2"]], capsys)
    err = error_of([runs["s1"], runs["s2"], runs["s1"]], capsys)
    assert f"{runs['s1']}: given twice" in err
    (runs["tau"] / "best" / "test_metrics.json").write_text('{"STS12": {"spearman": 70.0}}')
    err = error_of([runs["tau"]], capsys)
    assert "test_metrics.json: no STS task results and average in it" in err
    err = error_of([runs["s1"], "--pooler", "avg"], capsys)
    assert "--pooler applies to the --baseline row only" in err
    err = error_of([runs["s1"], "--plot", tmp_path / "curves.txt"], capsys)
    assert "ending in .png, .pdf or .svg" in err


def test_command_line_exit_status_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "compare.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {tmp_path}: not a run folder")
    assert "Traceback" not in r.stderr and r.stdout == ""


# ------------------------------------------------------------------------ --plot

def test_plot_writes_a_png_of_runs_and_entropy_models(runs, tmp_path, capsys):
    entropy = make_run(runs["focal"] / "entropy_phi0.01", None, None, script=None,
                       curve=[(1, 40.0), (2, 41.0), (3, 39.0)])
    unfinished = make_run(tmp_path / "running", {**SIMCSE_ARGS, "tau": 0.2}, None, curve=[(2, 30.0)])
    png = tmp_path / "plots" / "dev.png"
    compare([runs["s1"], runs["s2"], entropy, unfinished, "--plot", png])
    out, err = capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"{entropy}: no final result; its curve is drawn" in err
    assert f"{unfinished}: no final result" in err
    assert len(out.splitlines()) == 3                           # header, the one finished row, note
    groups = tool.group_runs([tool.read_run(p, plot=True) for p in (runs["s1"], entropy, unfinished)])
    assert [g["label"] for g in groups] == ["simcse.py tau=0.05 [cls_before_pooler]",
                                            "focal_infonce.py entropy_phi0.01",
                                            "simcse.py tau=0.2 [cls_before_pooler] (unfinished)"]
    assert tool.dev_curve(entropy) == ([1, 2, 3], [40.0, 41.0, 39.0])


def test_dev_curve_keeps_stsb_records_and_skips_a_cut_line(tmp_path):
    run = make_run(tmp_path / "r", SIMCSE_ARGS, [70.0] * 7, curve=[(4, 50.0), (2, 45.0)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "stsb_d')
    assert tool.dev_curve(run) == ([2, 4], [45.0, 50.0])


def test_align_uniform_curve_is_in_training_order_and_skips_records_without_it(tmp_path):
    """Evaluations sorted by step (the log may hold them out of order, or a step twice after a
    --resume: the last record wins); an old record without the fields and a cut line are skipped."""
    run = make_run(tmp_path / "r", SIMCSE_ARGS, [70.0] * 7, curve=[(4, 50.0), (2, 45.0), (6, 52.0)],
                   align_uniform=[(0.21, -2.0), (0.18, -1.5), (0.24, -2.4)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 8, "stsb_dev": 53.0}) + "\n")            # from before the fields
        f.write(json.dumps({"step": 6, "stsb_dev": 52.5, "alignment": 0.25, "uniformity": -2.5}) + "\n")
        f.write('{"step": 10, "alignment": 0.3, "unif')
    assert tool.align_uniform_curve(run) == ([2, 4, 6], [0.18, 0.21, 0.25], [-1.5, -2.0, -2.5])
    assert tool.dev_curve(run) == ([2, 4, 6, 8], [45.0, 50.0, 52.5, 53.0])
    old = make_run(tmp_path / "old", SIMCSE_ARGS, [70.0] * 7)
    assert tool.align_uniform_curve(old) == ([], [], [])


def test_plot_draws_simcse_fig2_beside_the_dev_curves(runs, tmp_path, capsys, monkeypatch):
    """SimCSE's Fig. 2 from hand-written logs: l_uniform on x, l_align on y, one trajectory a
    run (seeds apart, labelled with the table's row label and the seed) through its evaluations
    in step order, the first one hollow, arrows from each evaluation to a later one; a run
    without the fields is left out with a note; one PNG holds both panels."""
    curve = [(4, 55.0), (2, 50.0), (6, 57.0)]                           # logged out of order
    s1 = make_run(tmp_path / "au-s1", {**SIMCSE_ARGS, "seed": 1}, [70.0] * 7, curve=curve,
                  align_uniform=[(0.20, -2.2), (0.15, -1.6), (0.22, -2.6)])
    s2 = make_run(tmp_path / "au-s2", {**SIMCSE_ARGS, "seed": 2}, [71.0] * 7, curve=curve,
                  align_uniform=[(0.19, -2.1), (0.16, -1.7), (0.21, -2.5)])
    unfinished = make_run(tmp_path / "au-running", {**SIMCSE_ARGS, "tau": 0.2}, None, curve=[(2, 30.0)],
                          align_uniform=[(0.3, -1.0)])
    entropy = make_run(s1 / "entropy_phi0.01", None, None, script=None, curve=[(1, 40.0), (2, 41.0)],
                       align_uniform=[(0.10, -0.5), (0.12, -0.9)])
    old = runs["tau"]                                                     # a log without the fields
    import matplotlib.figure
    saved, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1])
    png = tmp_path / "plots" / "fig2.png"
    compare([s1, s2, old, unfinished, entropy, "--plot", png])
    err = capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"note: {old}: no alignment/uniformity in metrics.jsonl" in err and "left out" in err
    for p in (s1, s2, unfinished, entropy):
        assert f"{p}: no alignment/uniformity" not in err
    assert f"alignment against uniformity (SimCSE Fig. 2): {png}" in err
    (fig,) = saved
    dev_ax, au_ax = fig.axes
    assert "l_{\\mathrm{uniform}}" in au_ax.get_xlabel() and "l_{\\mathrm{align}}" in au_ax.get_ylabel()
    # the dev panel is as before: one labelled line a group, every run drawn (the old one too)
    assert len(dev_ax.get_lines()) == 5
    assert [t.get_text() for t in dev_ax.get_legend().get_texts()][:2] == [
        "simcse.py tau=0.05 [cls_before_pooler], n=2", "simcse.py tau=0.1 [cls_before_pooler], n=1"]
    lines = [ln for ln in au_ax.get_lines() if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in lines] == [
        "simcse.py tau=0.05 [cls_before_pooler], seed 1", "simcse.py tau=0.05 [cls_before_pooler], seed 2",
        "simcse.py tau=0.2 [cls_before_pooler] (unfinished), seed 42", "simcse.py entropy_phi0.01"]
    assert [t.get_text() for t in au_ax.get_legend().get_texts()] == [ln.get_label() for ln in lines]
    # training order: steps 2, 4, 6, whatever the order of the lines in the log
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in lines] == [
        ([-1.6, -2.2, -2.6], [0.15, 0.20, 0.22]), ([-1.7, -2.1, -2.5], [0.16, 0.19, 0.21]),
        ([-1.0], [0.3]), ([-0.5, -0.9], [0.10, 0.12])]
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()   # a colour a group
    assert lines[0].get_marker() != lines[1].get_marker()                         # a marker a seed
    starts = [ln for ln in au_ax.get_lines() if ln.get_label() == "_start"]
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in starts] == [
        ([-1.6], [0.15]), ([-1.7], [0.16]), ([-1.0], [0.3]), ([-0.5], [0.10])]
    assert all(ln.get_markerfacecolor() == "white" for ln in starts)
    # the arrows point from one evaluation to the next: 2 for each 3-point run, 1 for the entropy model
    arrows = [(a.xyann, a.xy) for a in au_ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert sorted(arrows) == sorted([((-1.6, 0.15), (-2.2, 0.20)), ((-2.2, 0.20), (-2.6, 0.22)),
                                     ((-1.7, 0.16), (-2.1, 0.19)), ((-2.1, 0.19), (-2.5, 0.21)),
                                     ((-0.5, 0.10), (-0.9, 0.12))])


def test_plot_with_baseline_starts_the_runs_of_its_pooler_at_the_untrained_encoder(
        tmp_path, tiny_bert, small_sts, capsys, monkeypatch):
    """--baseline with --plot: the untrained encoder's alignment and uniformity (on STS-B test, as
    the log records them) are a black star in Fig. 2, and a dashed line joins it to the first
    evaluation of each run evaluated with the baseline's pooler, and of no other run."""
    cls = make_run(tmp_path / "cls", SIMCSE_ARGS, [70.0] * 7, curve=[(2, 50.0), (4, 55.0)],
                   align_uniform=[(0.20, -2.2), (0.15, -2.6)])
    avg = make_run(tmp_path / "avg", {**SIMCSE_ARGS, "pooler": "avg"}, [70.0] * 7, pooler="avg",
                   curve=[(2, 50.0)], align_uniform=[(0.30, -1.2)])
    import matplotlib.figure
    saved, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1])
    compare([cls, avg, "--baseline", tiny_bert, "--sts_dir", small_sts, "--plot", tmp_path / "f.png"])
    ref = common.alignment_uniformity(common.saved_encoder(tiny_bert, "cls_before_pooler"), small_sts)
    (fig,) = saved
    au_ax = fig.axes[1]
    label = f"{Path(tiny_bert).name} untrained [cls_before_pooler]"
    (star,) = [ln for ln in au_ax.get_lines() if ln.get_label() == label]
    assert star.get_marker() == "*" and (star.get_xdata()[0], star.get_ydata()[0]) == pytest.approx(
        (ref["uniformity"], ref["alignment"]))
    joins = [ln for ln in au_ax.get_lines() if ln.get_label() == "_from_untrained"]
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in joins] == [
        ([pytest.approx(ref["uniformity"]), -2.2], [pytest.approx(ref["alignment"]), 0.20])]
    assert label in [t.get_text() for t in au_ax.get_legend().get_texts()]
    assert (f"{label}: alignment {ref['alignment']:.3f} / uniformity {ref['uniformity']:.3f} on STS-B "
            f"test" in capsys.readouterr().err)


def test_plot_without_align_uniform_in_any_log_draws_the_dev_curves_alone(runs, tmp_path, capsys):
    png = tmp_path / "dev.png"
    compare([runs["s1"], runs["focal"], "--plot", png])
    err = capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for p in (runs["s1"], runs["focal"]):
        assert f"note: {p}: no alignment/uniformity in metrics.jsonl" in err
    assert f"STS-B dev curves: {png}" in err and "SimCSE Fig. 2" not in err
    fig = tool.figure(tool.group_runs([tool.read_run(runs["s1"]), tool.read_run(runs["focal"])]))
    assert len(fig.axes) == 1 and fig.axes[0].get_title() == "STS-B dev over training"
    assert [list(ln.get_ydata()) for ln in fig.axes[0].get_lines()] == [[50.0, 55.0], [50.0, 55.0]]


def test_plot_without_matplotlib_says_how_to_install_and_writes_nothing(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png, md = tmp_path / "dev.png", tmp_path / "t.md"
    err = error_of([runs["s1"], "--plot", png, "--markdown", md], capsys)
    assert "--plot needs matplotlib" in err and "`pip install matplotlib`" in err
    assert not png.exists() and not md.exists()
    compare([runs["s1"]])                                       # the table needs no matplotlib
    assert "simcse.py" in capsys.readouterr().out


# ------------------------------------------------------------------------ --baseline, end to end

def test_baseline_row_is_the_untrained_encoder(runs, tiny_bert, small_sts, capsys):
    compare([runs["s1"], "--baseline", tiny_bert, "--pooler", "avg", "--sts_dir", small_sts])
    out = capsys.readouterr().out.splitlines()
    ref = common.evaluate_encoder(str(tiny_bert), "avg", small_sts)
    name = Path(tiny_bert).name
    assert out[1].startswith(f"{name} untrained [avg]")
    cells = out[1][len(f"{name} untrained [avg]"):].split()
    assert cells[0] == "-"
    assert [float(c) for c in cells[1:]] == pytest.approx([ref[t]["spearman"] for t in TASKS] + [ref["avg"]],
                                                          abs=0.006)
    assert out[2].startswith("simcse.py [cls_before_pooler]")


def test_end_to_end_a_real_tiny_run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, capsys):
    """simcse.py as a program for 2 steps, then compare on its folder: the script and the pooler
    are recorded, and the row holds what the run wrote."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), "--model", str(tiny_bert),
                        "--data", str(corpus), "--sts_dir", str(small_sts), "--output_dir", str(run),
                        "--cache_dir", str(cache_dir), "--max_steps", "2", "--eval_every", "1",
                        "--batch_size", "8", "--log_every", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / "run.json").read_text())["script"] == "simcse.py"
    res = json.loads((run / "best" / "test_metrics.json").read_text())
    assert res["pooler"] == "cls_before_pooler"
    args = json.loads((run / "args.json").read_text())
    assert "script" not in args and args["max_steps"] == 2    # args.json is still exactly the Args
    png = tmp_path / "dev.png"
    compare([run, "--plot", png])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["simcse.py", "[cls_before_pooler]", "1"]
    assert [float(c) for c in out[1].split()[3:]] == pytest.approx(
        [res[t]["spearman"] for t in TASKS] + [res["avg"]], abs=0.006)
    assert tool.dev_curve(run)[0] == [1, 2] and png.stat().st_size > 0


def test_end_to_end_an_edited_copy_of_the_code_is_a_row_of_its_own(tmp_path, tiny_bert, corpus, small_sts,
                                                                    cache_dir, capsys, repo):
    """The student's ablation as a student does it: the repository copied twice, the temperature
    doubled in one copy's simcse_loss, the same command run from each copy into its own folder,
    then compare: two rows (not one of n 2), their labels telling the code apart, and --code_diff
    showing the edited line."""
    shutil.copytree(ROOT, tmp_path / "checkout", ignore=lambda d, names: [
        n for n in names if not n.endswith(".py") and not (Path(d) == ROOT and n == "plumbing")])
    shutil.copytree(tmp_path / "checkout", tmp_path / "edited")
    script = tmp_path / "edited" / "simcse.py"
    assert script.read_text().count(TAU_LINE) == 1
    script.write_text(script.read_text().replace(TAU_LINE, TAU_DOUBLED))
    runs = []
    for copy in ("checkout", "edited"):
        run = tmp_path / "runs" / copy
        r = subprocess.run([sys.executable, str(tmp_path / copy / "simcse.py"), "--model", str(tiny_bert),
                            "--data", str(corpus), "--sts_dir", str(small_sts), "--output_dir", str(run),
                            "--cache_dir", str(cache_dir), "--max_steps", "2", "--eval_every", "1",
                            "--batch_size", "8", "--log_every", "1"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(run)
    for run, copy in zip(runs, ("checkout", "edited")):
        record = json.loads((run / "run.json").read_text())
        assert "code" in record, f"{run}/run.json has no \"code\": the code record's writing side is not here"
        assert record["code"]["simcse.py"] == hashlib.sha256(
            (tmp_path / copy / "simcse.py").read_bytes()).hexdigest()
        assert (run / "code" / "simcse.py").read_bytes() == (tmp_path / copy / "simcse.py").read_bytes()
    compare(runs)
    out, err = capsys.readouterr()
    rows = out.splitlines()[1:3]
    # the copies hold the files committed in `repo` (plumbing/ recorded or not, by the code that ran)
    assert rows[0].startswith(f"simcse.py [cls_before_pooler] as committed ({repo.short}")
    assert rows[1].startswith("simcse.py [cls_before_pooler] simcse.py edited ")
    assert not out.splitlines()[3].startswith("simcse.py") and "same seed twice" not in err
    compare([*runs, "--code_diff"])
    diff = capsys.readouterr().out.splitlines()
    assert diff[:2] == [f"--- {runs[0]}/code/simcse.py", f"+++ {runs[1]}/code/simcse.py"]
    changed = [line for line in diff if line[:1] in "-+" and line[:3] not in ("---", "+++")]
    assert [line.split("#")[0].rstrip() for line in changed] == ["-" + TAU_LINE, "+" + TAU_DOUBLED]
