"""`python tools/compare.py`: fabricated run folders (fast), the --baseline row with the tiny
BERT, and one real tiny run compared end to end."""

from __future__ import annotations

import json
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
             pooler: str | None = "cls_before_pooler", curve: list[tuple[int, float]] = ((2, 50.0), (4, 55.0)),
             tasks: list[str] = TASKS) -> Path:
    """A run folder written by hand: args.json, run.json, metrics.jsonl, best/test_metrics.json.
    `scores` = one figure a task (avg = their mean); None leaves the run unfinished."""
    folder.mkdir(parents=True)
    if args is not None:
        (folder / "args.json").write_text(json.dumps({**args, "output_dir": str(folder)}))
    if script is not None:
        (folder / "run.json").write_text(json.dumps({"script": script}))
    lines = []
    for step, dev in curve:
        lines.append(json.dumps({"step": step - 1, "loss": 1.0, "lr": 1e-5, "sent_per_s": 9.0, "epoch": 0}))
        lines.append(json.dumps({"step": step, "stsb_dev": dev, "sickr_dev": dev - 5, "avg_dev": dev - 2}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if scores is not None:
        (folder / "best").mkdir()
        res = {t: {"spearman": s, "n": 100} for t, s in zip(tasks, scores)}
        res["avg"] = float(np.mean(scores))
        if pooler is not None:
            res["pooler"] = pooler
        (folder / "best" / "test_metrics.json").write_text(json.dumps(res))
    return folder


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
    assert f"{runs['s2'] / 'args.json'}: not readable JSON" in err
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
    assert json.loads((run / "run.json").read_text()) == {"script": "simcse.py"}
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
