"""tools/experiment.py and docs/experiments/: every patch applies and stays small, the manifest is sound,
each experiment's changed arm runs two steps on the tiny model from its own copy of the code, the summary
says what its figures say (synthetic run folders), a finished control is reused, and --check names the
experiments to measure again."""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import common
from conftest import ENV, ROOT
from tools import experiment as ex

EXPERIMENTS = ex.load_experiments()
PATCHES = sorted((ROOT / ex.HERE).glob("*.patch"))


# ------------------------------------------------------------------------------------
# The patches and the manifest
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_every_patch_applies_to_its_script_and_is_small(patch):
    done = subprocess.run(["git", "apply", "--check", str(patch.relative_to(ROOT))], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr}"
    n = ex.patch_size(patch.read_text(encoding="utf-8"))
    assert 0 < n <= 15, f"{patch.name} changes {n} lines: an experiment is one small change (at most 15)"
    exp = next((e for e in EXPERIMENTS if e.name == patch.stem), None)
    assert exp is not None, f"{patch.name} belongs to no experiment of experiments.toml"
    lines = patch.read_text(encoding="utf-8").splitlines()
    touched = {line[6:] for line in lines if line.startswith("+++ b/")}
    assert touched == {exp.script}, f"{patch.name} changes {touched}, not {exp.script} alone"


def test_the_manifest_is_sound():
    raw = ex.read_toml(ROOT / ex.HERE / ex.MANIFEST)["experiment"]
    names = [e["name"] for e in raw]
    assert len(names) == len(set(names)), "an experiment's name is given twice"
    assert [e.name for e in EXPERIMENTS] == names
    for exp in EXPERIMENTS:
        assert exp.flags or ex.patch_path(exp).is_file(), f"{exp.name}: neither a patch nor flags"
        assert exp.figures and all(exp.figures), f"{exp.name}: no figures to read"
        assert exp.title and exp.question
    # every script has at least three experiments (the "done when")
    for script in ("simcse.py", "focal_infonce.py", "ifcl.py", "conisi.py", "rcl.py"):
        assert sum(e.script == script for e in EXPERIMENTS) >= 3, script


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=[e.name for e in EXPERIMENTS])
def test_each_experiment_has_its_line_and_flags_its_script_takes(exp):
    text = (ROOT / exp.script).read_text(encoding="utf-8")
    n = ex.anchor_line(exp, text)
    line = text.splitlines()[n - 1]
    if exp.anchor:
        assert exp.anchor in line
    else:            # the patch's first change is that line (removed, or the one it adds before)
        number, want = ex.first_change(ex.patch_path(exp).read_text(encoding="utf-8"))
        assert line == want
    # the flags parse in the script's own Args, over the testbed's, and the changed arm differs
    module = importlib.import_module(Path(exp.script).stem)
    tb = ex.Testbed(model="models/m", data="data/d.txt", sts_dir="data/sts", multi30k="data/multi30k")
    control = common.parse_args(module.Args, ex.merge(tb.flags(exp.script), exp.settings))
    changed = common.parse_args(module.Args, ex.merge(tb.flags(exp.script), exp.settings, exp.flags))
    assert control.max_steps == changed.max_steps == 40 and control.eval_every == 20
    if exp.flags:
        assert changed != control, f"{exp.name}: its flags change nothing over the settings"


def test_anchor_line_follows_the_patch_and_names_a_missing_line(tmp_path):
    (tmp_path / ex.HERE).mkdir(parents=True)
    script = "a = 1\nb = 2\nc = 3\nd = 4\n"
    adds = "--- a/s.py\n+++ b/s.py\n@@ -2,2 +2,3 @@\n b = 2\n+x = 0\n c = 3\n"
    removes = "--- a/s.py\n+++ b/s.py\n@@ -1,3 +1,3 @@\n a = 1\n-b = 2\n+b = 5\n c = 3\n"
    exp = ex.Experiment(name="e", script="s.py", title="t", question="q", figures=["loss"])
    (tmp_path / ex.HERE / "e.patch").write_text(adds)
    assert ex.anchor_line(exp, script, tmp_path) == 3           # the line it adds before: c = 3
    assert ex.anchor_line(exp, "z = 0\n" + script, tmp_path) == 4  # found by its text, lines added above
    (tmp_path / ex.HERE / "e.patch").write_text(removes)
    assert ex.anchor_line(exp, script, tmp_path) == 2           # the first line it removes
    with pytest.raises(ValueError, match="^e: the line"):
        ex.anchor_line(exp, "a = 1\n", tmp_path)
    with pytest.raises(ValueError, match="^e: its anchor"):
        ex.anchor_line(ex.Experiment(**{**exp.__dict__, "anchor": "nowhere"}), script, tmp_path)


def test_a_manifest_with_a_mistake_is_refused(tmp_path):
    (tmp_path / ex.HERE).mkdir(parents=True)
    (tmp_path / "simcse.py").write_text("")
    entry = 'name = "{}"\nscript = "simcse.py"\ntitle = "t"\nquestion = "q"\nfigures = ["loss"]\n'
    manifest = tmp_path / ex.HERE / ex.MANIFEST
    manifest.write_text(f"[[experiment]]\n{entry.format('a')}flags = ['--tau', '1']\n")
    assert [e.name for e in ex.load_experiments(tmp_path)] == ["a"]
    manifest.write_text(f"[[experiment]]\n{entry.format('a')}")                   # no patch, no flags
    with pytest.raises(common.UserError, match="a: neither flags nor a patch"):
        ex.load_experiments(tmp_path)
    manifest.write_text(f"[[experiment]]\n{entry.format('a')}flags = ['--x']\n" * 2)
    with pytest.raises(common.UserError, match="the name a is given twice"):
        ex.load_experiments(tmp_path)


def test_a_patch_is_applied_to_a_copy_inside_another_repository(tmp_path):
    """--runs is inside the clone by default, where a plain `git apply` would patch the clone's own path
    (or quietly skip it): the copy is patched, and the clone's script is not."""
    repo = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "s.py").write_text("a = 1\nb = 2\n")
    copy = repo / "runs" / "code" / "x"
    copy.mkdir(parents=True)
    (copy / "s.py").write_text("a = 1\nb = 2\n")
    patch = tmp_path / "e.patch"
    # git's own header, as docs/experiments' patches have it: inside a repository, git reads its paths
    # from the repository's top, and skips those outside the current folder with exit status 0
    patch.write_text("diff --git a/s.py b/s.py\n--- a/s.py\n+++ b/s.py\n@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n"
                     "+b = 4\n")
    assert ex.apply_patch(patch, copy).returncode == 0
    assert (copy / "s.py").read_text() == "a = 1\nb = 4\n"
    assert (repo / "s.py").read_text() == "a = 1\nb = 2\n"


def test_flags_merge_a_later_flag_over_an_earlier_one():
    assert ex.merge(["--phi", "0.01", "--lr", "3e-5"], ["--phi", "-0.01"]) == ["--lr", "3e-5", "--phi",
                                                                              "-0.01"]
    assert ex.merge(["--phi", "0.01"], ["--phi"]) == ["--phi"]
    assert ex.merge(["--modulate"], ["--no-modulate"]) == ["--no-modulate"]
    assert ex.agrees({"phi": [-0.01], "lr": 3e-05, "modulate": False, "no_mlp": True},
                     ["--phi", "-0.01", "--lr", "3e-5", "--no-modulate", "--no_mlp"])
    assert not ex.agrees({"phi": [0.01]}, ["--phi", "-0.01"])
    assert not ex.agrees({"phi": [0.01]}, ["--phi"])
    assert not ex.agrees({"tau": 0.05}, ["--m", "0"])


# ------------------------------------------------------------------------------------
# Each changed arm, from its own copy of the committed code, two steps on the tiny model
# ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_testbed(tmp_path_factory, tiny_bert, corpus, small_sts, parallel):
    """The testbed at two steps, on the tiny BERT and the synthetic data; Multi30k's two files are
    the parallel fixture's English and pseudo-German."""
    multi30k = tmp_path_factory.mktemp("multi30k")
    for lang in ("en", "de"):
        (multi30k / f"train.{lang}").write_text((parallel / f"{lang}.txt").read_text(encoding="utf-8"))
    cache = tmp_path_factory.mktemp("cache")
    return ex.Testbed(model=str(tiny_bert), data=str(corpus), sts_dir=str(small_sts), multi30k=str(multi30k),
                      steps=2, extra=["--batch_size", "8", "--cache_dir", str(cache)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=[e.name for e in EXPERIMENTS])
def test_each_changed_arm_runs_two_steps_from_its_copy(exp, tiny_testbed, runs):
    control, changed = ex.arms(exp, tiny_testbed, runs)
    done = ex.run_arm(changed, 1, runs, env=ENV, quiet=True, say=lambda line: None)
    run = done["run"]
    assert not done["reused"] and done["wall_s"] > 0
    assert (run / "best" / "test_metrics.json").is_file() and (run / "args.json").is_file()
    assert run.parent == runs / "arms"
    # the run recorded the copy's code, relative to the copy: the patched script where there is a patch
    code = json.loads((run / "run.json").read_text())["code"]
    assert code == {k: v for k, v in ex.code_files(changed.code, exp.script).items() if k in code}
    assert {exp.script, "common.py"} <= set(code)
    committed = hashlib.sha256((control.code / exp.script).read_bytes()).hexdigest()
    assert (code[exp.script] != committed) == ex.patch_path(exp).is_file()
    flags = ex.merge(exp.settings, exp.flags, ["--seed", "1"])
    assert ex.agrees(json.loads((run / "args.json").read_text()), flags)
    # its wall time is kept beside the run folders, not in them
    assert ex.wall_times(runs)[run.name]["seconds"] == done["wall_s"]
    stages = {p.name for p in run.glob("entropy_phi*")}
    assert {p.name for p in run.iterdir()} <= {"args.json", "run.json", "metrics.jsonl", "code", "best",
                                               "run.lock", *stages}
    got = ex.read_run(run, exp.figures)
    assert 0 < got["avg"] < 100 and got["stsb_dev"] is not None
    # the figures the experiment is about are in the changed arm's log
    assert got["figures"], f"{exp.name}: none of {exp.figures} in the changed arm's log"


# ------------------------------------------------------------------------------------
# The summary, on run folders written by hand
# ------------------------------------------------------------------------------------

def fake_run(folder: Path, avg: float, dev: float, train: list[dict], evals: list[dict] = (),
             stages: dict[str, list[dict]] | None = None) -> Path:
    (folder / "best").mkdir(parents=True)
    test = {"avg": avg, "STSBenchmark": {"spearman": 1.0}}
    (folder / "best" / "test_metrics.json").write_text(json.dumps(test))
    (folder / "best" / "dev_metrics.json").write_text(json.dumps({"stsb_dev": dev}))
    records = sorted([*train, *evals], key=lambda r: r["step"])
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for stage, recs in (stages or {}).items():
        (folder / stage).mkdir()
        (folder / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder


def test_a_run_is_read_first_to_last_and_its_stages_by_their_glob(tmp_path):
    run = fake_run(tmp_path / "r", 75.5, 80.1,
                   [{"step": 5, "loss": 2.0, "s_n": 0.4}, {"step": 10, "loss": 1.0, "s_n": 0.3},
                    {"step": 20, "loss": 0.5, "s_n": 0.1}],
                   [{"step": 10, "stsb_dev": 79.0, "alignment": 0.2}, {"step": 20, "stsb_dev": 80.1,
                                                                        "alignment": 0.3}],
                   {"entropy_phi0.01": [{"step": 5, "entropy": 0.6}, {"step": 10, "entropy": 0.4}],
                    "entropy_phi0.04": [{"step": 5, "entropy": 0.8}, {"step": 10, "entropy": 0.2}]})
    got = ex.read_run(run, ["loss", "alignment", "entropy_phi*/entropy", "hard_frac"])
    assert got["avg"] == 75.5 and got["stsb_dev"] == 80.1
    assert (got["figures"]["loss"]["first"], got["figures"]["loss"]["last"]) == (2.0, 0.5)
    assert got["figures"]["loss"]["curves"][0]["step"] == [5, 10, 20]
    assert (got["figures"]["alignment"]["first"], got["figures"]["alignment"]["last"]) == (0.2, 0.3)
    ent = got["figures"]["entropy_phi*/entropy"]
    assert [c["log"] for c in ent["curves"]] == ["entropy_phi0.01/metrics.jsonl",
                                                 "entropy_phi0.04/metrics.jsonl"]
    assert ent["first"] == pytest.approx(0.7) and ent["last"] == pytest.approx(0.3)
    assert "hard_frac" not in got["figures"]


def measured(control_avgs, changed_avgs, root: Path) -> dict:
    out = {}
    for role, avgs in (("control", control_avgs), ("changed", changed_avgs)):
        out[role] = {}
        for seed, avg in enumerate(avgs, 1):
            loss = [3.0, 1.0] if role == "control" else [3.0, 2.0 + seed]       # changed: 3 -> 3 and 3 -> 4
            run = fake_run(root / f"{role}{seed}", avg, 80.0 + seed,
                           [{"step": 5, "loss": loss[0]}, {"step": 40, "loss": loss[1]}],
                           [{"step": 40, "stsb_dev": 80.0, "alignment": 0.25}] if role == "control" else [])
            out[role][seed] = {**ex.read_run(run, ["loss", "alignment"]), "run": run, "wall_s": 100.0 + seed}
    return out


def test_the_table_gives_the_seed_spread_and_first_to_last(tmp_path):
    exp = ex.Experiment(name="simcse-tau-x10", script="simcse.py", title="t", question="q",
                        figures=["loss", "alignment"])
    text = ex.table(exp, measured([75.0, 76.0], [74.0, 75.5], tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| c")]
    assert rows[0].startswith("| control: simcse.py as committed | 75.50 ± 0.71 | 81.50 ± 0.71 | 3 → 1 | "
                              "0.25 → 0.25 | 1.7 min |")
    assert rows[1].startswith("| changed: simcse-tau-x10.patch | 74.75 ± 1.06 | 81.50 ± 0.71 | 3 → 3.5 | - |")
    assert "changed minus control -0.75 (difference of the means): within the seed spread" in text
    assert "(control 75.00 to 76.00, changed 74.00 to 75.50)" in text


def test_the_spread_line_says_within_or_outside():
    assert "changed minus control +0.00 (difference" in ex.spread_line([75.57, 75.58], [75.566, 75.58])
    assert ex.spread_line([75.0, 75.2], [75.1, 75.4]).endswith(
        "+0.15 (difference of the means): within the seed spread, the two arms' seeds overlap "
        "(control 75.00 to 75.20, changed 75.10 to 75.40).")
    assert ex.spread_line([75.0, 75.2], [74.0, 74.4]).endswith(
        "-0.90 (difference of the means): outside the seed spread, the two arms' seeds do not overlap "
        "(control 75.00 to 75.20, changed 74.00 to 74.40).")
    assert "one seed an arm" in ex.spread_line([75.0], [74.0])
    assert ex.mean_std([1.0, 2.0, 3.0]) == "2.00 ± 1.00" and ex.mean_std([]) == "-"


def test_what_the_pages_read_of_an_experiment_comes_from_the_tool():
    """The folded block's means, a patch's size and a time are the tool's, as the docs sections' are."""
    entry = {"arms": {"control": {"seeds": {"1": {"avg": 75.0}, "2": {"avg": 76.0}}},
                      "changed": {"seeds": {"1": {"avg": 74.0}, "2": {"avg": None}}}}}
    assert ex.arm_means(entry) == {"control": 75.5, "changed": 74.0} and ex.arm_means({}) == {}
    patch = ("--- a/simcse.py\n+++ b/simcse.py\n@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n+y = 3\n+z = 4\n")
    assert ex.patch_size(patch) == 3
    assert (ex.minutes(75), ex.minutes(204), ex.minutes(None)) == ("75 s", "3.4 min", "-")
    assert ex.mean_minutes([200.0, None, 208.0]) == "3.4 min" and ex.mean_minutes([None]) == "-"


def test_the_plot_draws_a_panel_per_figure(tmp_path):
    exp = ex.Experiment(name="x", script="simcse.py", title="A title", question="q",
                        figures=["loss", "alignment"])
    ex.plot(exp, measured([75.0, 76.0], [74.0, 74.5], tmp_path), tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_finished_control_is_reused_and_another_is_not(tmp_path, monkeypatch):
    exp = next(e for e in EXPERIMENTS if e.name == "focal-m0")
    tb = ex.Testbed(model="models/m", data="data/d.txt", sts_dir="data/sts", multi30k="data/multi30k")
    control, _ = ex.arms(exp, tb, tmp_path)
    started, real = [], subprocess.run

    def run(cmd, **kw):           # git as usual; a script is not started, and "fails"
        if cmd[0] == "git":
            return real(cmd, **kw)
        started.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "not started in this test")
    monkeypatch.setattr(ex.subprocess, "run", run)

    def finish(seed, code=None, flags=None):
        folder = control.folder(tmp_path, seed)
        fake_run(folder, 75.0, 80.0, [{"step": 5, "loss": 1.0}])
        files = ex.code_files(control.code, exp.script)
        (folder / "run.json").write_text(json.dumps(
            {"code": code or {k: files[k] for k in ("focal_infonce.py", "common.py", "plumbing/flags.py")}}))
        argv = control.argv(tmp_path, seed)
        (folder / "args.json").write_text(json.dumps(flags or {
            "model": "models/m", "data": "data/d.txt", "sts_dir": "data/sts", "max_steps": 40,
            "eval_every": 20, "log_every": 5, "seed": seed,
            "output_dir": argv[argv.index("--output_dir") + 1]}))
        return folder

    folder = finish(1)
    ex.keep_wall_time(tmp_path, folder, 123.4, [])
    said = []
    got = ex.run_arm(control, 1, tmp_path, say=said.append)
    assert got == {"run": folder, "reused": True, "wall_s": 123.4} and not started
    assert "reused" in said[0]
    # the same control for another experiment of the script with the same settings: the same folder
    other = next(e for e in EXPERIMENTS if e.name == "focal-no-negative-modulation")
    assert ex.arms(other, tb, tmp_path)[0].folder(tmp_path, 1) == folder
    # of other code, or other flags: run again (here: the process that would run it fails)
    for spoilt in (lambda: finish(2, code={"focal_infonce.py": "0" * 64}),
                   lambda: finish(2, flags={"model": "models/m", "seed": 3})):
        shutil_rmtree(control.folder(tmp_path, 2))
        spoilt()
        with pytest.raises(common.UserError, match="exit status 1"):
            ex.run_arm(control, 2, tmp_path, say=lambda line: None, quiet=True)
    assert len(started) == 2
    # an unfinished run that a process still trains in is left alone
    folder = control.folder(tmp_path, 3)
    (folder / "best").mkdir(parents=True)
    held = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(common.UserError, match="in use by another process"):
            ex.run_arm(control, 3, tmp_path, say=lambda line: None)
    finally:
        os.close(held)
    assert folder.is_dir() and len(started) == 2


def shutil_rmtree(folder: Path) -> None:
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------
# --check: which experiments to measure again
# ------------------------------------------------------------------------------------

def current_figures(tmp_path) -> dict:
    """A figures.json as --record writes it for every experiment, measured on the scripts as they are."""
    out = {}
    for exp in EXPERIMENTS:
        got = measured([75.0, 75.1], [75.0, 75.2], tmp_path / exp.name)
        tb = ex.Testbed(model="models/m", data="data/d.txt", sts_dir="data/sts", multi30k="data/multi30k")
        out[exp.name] = json.loads(json.dumps(ex.entry(exp, got, tb), default=str))
        # the checkout's script, which the commit holds unless an edit is in progress
        out[exp.name]["code"] = {exp.script: hashlib.sha256((ROOT / exp.script).read_bytes()).hexdigest()}
    return out


def test_check_names_what_to_measure_again(tmp_path, capsys):
    figures = current_figures(tmp_path)
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(figures))
    assert ex.main(["--check", "--figures", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"all {len(EXPERIMENTS)} experiments measured are current")
    figures["focal-m0"]["code"]["focal_infonce.py"] = "0" * 64
    figures["focal-m0"]["commit"] = "abc1234"
    del figures["ifcl-eps1"]
    figures["rcl-phi-negative"]["change"]["flags"] = ["--phi", "-0.02"]
    path.write_text(json.dumps(figures))
    assert ex.main(["--check", "--figures", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "focal-m0: measure again: focal_infonce.py changed since it was measured at commit abc1234: "
        "`python tools/experiment.py focal-m0 --record`",
        "rcl-phi-negative: measure again: its patch, flags or settings changed since it was measured at "
        f"commit {figures['rcl-phi-negative']['commit']}: "
        "`python tools/experiment.py rcl-phi-negative --record`"]
    # experiments not measured yet are a note beside a pass, not a failure
    del figures["focal-m0"], figures["rcl-phi-negative"]
    path.write_text(json.dumps(figures))
    assert ex.main(["--check", "--figures", str(path)]) == 0
    assert "note: not measured yet (3): focal-m0, ifcl-eps1, rcl-phi-negative" in capsys.readouterr().out


def test_check_names_a_patch_that_no_longer_applies(tmp_path, capsys):
    root = tmp_path / "repo"
    (root / ex.HERE).mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "s.py").write_text("a = 1\nb = 2\n")
    (root / ex.HERE / ex.MANIFEST).write_text('[[experiment]]\nname = "e"\nscript = "s.py"\ntitle = "t"\n'
                                              'question = "q"\nfigures = ["loss"]\n')
    stale = "--- a/s.py\n+++ b/s.py\n@@ -1,2 +1,2 @@\n a = 1\n-b = 3\n+b = 4\n"        # b is 2 now
    (root / ex.HERE / "e.patch").write_text(stale)
    lines = ex.check(root)
    assert lines[0].startswith("e: docs/experiments/e.patch no longer applies to s.py") and len(lines) == 1
