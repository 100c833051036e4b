"""Every phase shows progress, and a run says where it went and what next: the evaluations' bars
(labelled with the task, on stderr, rank 0 only, none for an evaluation under a second), a
download's bar in bytes, the run folder as a run starts, the commands it prints at the end (each
one run here, as a user would), and --eval_untrained's row beside the run's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import common
import ifcl
import rcl
import simcse
from conftest import ENV, ROOT
from plumbing import downloads, export, flags
from plumbing import progress as progress_bars
from tools import compare
from tools import eval as eval_tool


@pytest.fixture
def drawn(monkeypatch):
    """Every bar drawn at once and at each update, as a slow machine draws them over minutes."""
    real = progress_bars.tqdm
    monkeypatch.setattr(progress_bars, "tqdm", lambda *a, **k: real(*a, **{**k, "mininterval": 0, "delay": 0,
                                                                      "miniters": 1}))


def distinct_sentences(sts_dir: Path, task: str, split: str = "test") -> int:
    return len({s for a, b, _ in common.load_sts_pairs(sts_dir, task, split).values() for s in a + b})


def run_argv(tiny_bert, data, sts_dir, out, cache_dir, *extra) -> list[str]:
    return ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts_dir),
            "--output_dir", str(out), "--cache_dir", str(cache_dir), "--max_steps", "2", "--eval_every", "2",
            "--batch_size", "8", *extra]


def test_an_evaluation_shows_each_task_batch_by_batch_then_its_figure(drawn, tiny_bert, small_sts, capsys,
                                                                     monkeypatch):
    """The 7 tasks: the bar names the task (and how many are left), counts the sentences encoded
    batch by batch up to all of them, and shows the last task's figure; on stderr only. Another
    rank draws nothing."""
    tokenizer, encoder = common.load_encoder(str(tiny_bert))
    encode = common.make_encode(encoder, tokenizer, "avg", batch_size=16)
    res = common.evaluate_sts(encode, small_sts, desc="checking")
    out, err = capsys.readouterr()
    assert out == ""
    for k, task in enumerate(common.STS_TASKS):
        assert f"checking: {common.TASK_SHORT[task]} test ({k + 1}/7)" in err
    for before, task in zip(common.STS_TASKS, common.STS_TASKS[1:]):   # a task's figure beside the next one
        assert re.search(rf"checking: {common.TASK_SHORT[task]} test .*\b{common.TASK_SHORT[before]} "
                         rf"{res[before]['spearman']:.2f}\]", err)
    total = sum(distinct_sentences(small_sts, t) for t in common.STS_TASKS)
    counts = [int(n) for n in re.findall(rf"\b(\d+)/{total}\b", err)]
    assert counts == sorted(counts) and counts[-1] == total
    assert len(set(counts)) > 2 * len(common.STS_TASKS)              # batch by batch, not task by task
    monkeypatch.setattr(common, "world", lambda: (1, 2))             # under torchrun, rank 1
    assert common.evaluate_sts(encode, small_sts, desc="checking") == res
    assert capsys.readouterr() == ("", "")


def test_an_encode_of_ones_own_still_shows_its_task_and_no_quick_evaluation_draws(small_sts, capsys,
                                                                                    monkeypatch):
    """evaluate_sts(encode) with an encode not made by make_encode, which reports each task's
    sentences at once: the bar moves task by task, each named, once the evaluation has taken a
    second; one under a second draws nothing (the tests' own evaluations, a tiny model's); rank 1
    draws nothing."""
    def encode(sentences, on_batch):                            # (n, 2): length and a letter count
        on_batch(len(sentences))
        return np.array([[len(s), s.count("e") + 1] for s in sentences], np.float32)

    def slow(sentences, on_batch):
        time.sleep(1.2)
        return encode(sentences, on_batch)

    quick = common.evaluate_sts(encode, small_sts, split="dev", desc="mine")
    assert capsys.readouterr() == ("", "")
    assert common.evaluate_sts(slow, small_sts, split="dev", desc="mine") == quick
    out, err = capsys.readouterr()
    total = sum(distinct_sentences(small_sts, t, "dev") for t in ("STSBenchmark", "SICKRelatedness"))
    assert out == "" and "mine: STS-B dev (1/2)" in err and f"/{total} " in err
    monkeypatch.setattr(common, "world", lambda: (1, 2))
    common.evaluate_sts(slow, small_sts, split="dev", desc="mine")
    assert capsys.readouterr() == ("", "")


def test_training_labels_each_dev_evaluation_and_the_final_one(drawn, tmp_path, tiny_bert, corpus, small_sts,
                                                               cache_dir, capsys):
    """Each dev evaluation's bar says the step and the task, the final one each of the 7 tasks, and
    both their alignment and uniformity pass; stdout holds the table alone; the STS-B dev a run
    records is best/'s, evaluated again."""
    out = tmp_path / "run"
    res = simcse.main(run_argv(tiny_bert, corpus, small_sts, out, cache_dir, "--max_steps", "4"))
    printed, err = capsys.readouterr()
    for step in (2, 4):
        for label in ("STS-B dev (1/2)", "SICK-R dev (2/2)", "alignment and uniformity, STS-B test"):
            assert f"step {step}, evaluating: {label}" in err
    for k, task in enumerate(common.STS_TASKS):
        assert f"final evaluation of best/: {common.TASK_SHORT[task]} test ({k + 1}/7)" in err
    assert "final evaluation of best/: alignment and uniformity, STS-B test" in err
    assert "\r" not in printed and "sent/s" not in printed and "this run" in printed
    again = common.evaluate_encoder(str(out / "best"), "cls_before_pooler", small_sts, split="dev")
    assert again["STSBenchmark"]["spearman"] == res["best_dev"]


def test_the_tools_label_their_evaluations_too(drawn, tmp_path, tiny_bert, corpus, small_sts, cache_dir,
                                              capsys):
    """tools/eval.py and tools/compare.py --baseline: each task named beside the encoder; the
    tables alone on stdout."""
    eval_tool.main(["--model", str(tiny_bert), "--pooler", "avg", "--sts_dir", str(small_sts)])
    out, err = capsys.readouterr()
    name = Path(tiny_bert).name
    assert all(f"{name} [avg]: {common.TASK_SHORT[t]} test ({k + 1}/7)" in err
               for k, t in enumerate(common.STS_TASKS))
    assert "\r" not in out and "sent/s" not in out
    simcse.main(run_argv(tiny_bert, corpus, small_sts, tmp_path / "run", cache_dir))
    capsys.readouterr()
    compare.main([tmp_path / "run", "--baseline", tiny_bert, "--pooler", "avg", "--sts_dir", small_sts,
                  "--plot", tmp_path / "p.png"])
    out, err = capsys.readouterr()
    assert all(f"{name} untrained [avg]: {common.TASK_SHORT[t]} test ({k + 1}/7)" in err
               for k, t in enumerate(common.STS_TASKS))
    assert f"{name} untrained [avg]: alignment and uniformity, STS-B test" in err
    assert "\r" not in out and "sent/s" not in out


def test_a_download_counts_bytes_in_kb_mb_gb(tmp_path, capsys):
    src = tmp_path / "wiki.txt"
    src.write_bytes(b"x" * 3_000_000)
    downloads.fetch(src.as_uri(), tmp_path / "copy.txt")
    assert (tmp_path / "copy.txt").read_bytes() == src.read_bytes()
    err = capsys.readouterr().err
    assert "3.00M/3.00M" in err and "B/s" in err


def test_a_tool_is_named_as_typed_from_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert export.tool("compare.py") == "tools/compare.py"
    monkeypatch.chdir(tmp_path)                                  # elsewhere: the whole path
    assert export.tool("eval.py") == (ROOT / "tools" / "eval.py").as_posix()


def user_command(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command a run printed, run as the user pastes it into bash (its trailing # comment too)."""
    env = dict(ENV, PATH=os.pathsep.join([str(Path(sys.executable).parent), ENV.get("PATH", "")]))
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_says_where_it_goes_and_each_next_command_runs(tmp_path, tiny_bert, corpus, small_sts):
    """`python simcse.py ...` as a user runs it: the run folder as it starts (and on --resume);
    at the end best/'s path and three commands, each of which runs: compare beside the untrained
    encoder, eval.py on best/, best/ loaded in sentence-transformers. --eval_untrained, which
    --resume may add, puts the untrained row in the table."""
    argv = [sys.executable, str(ROOT / "simcse.py"),
            *run_argv(tiny_bert, corpus, small_sts, "run", tmp_path / "cache")]
    first = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [line for line in re.split(r"[\r\n]", first.stderr) if line.strip()]
    assert lines[0] == ("run folder: run (the flags in args.json, the log in metrics.jsonl; last/ at each "
                        "evaluation, best/ at the best STS-B dev)")
    end = lines.index("best model: run/best (the figures above: its test_metrics.json); next:")
    commands = lines[end + 1:]
    assert [c.split()[:2] for c in commands] == [["python", (ROOT / "tools" / "compare.py").as_posix()],
                                                 ["python", (ROOT / "tools" / "eval.py").as_posix()],
                                                 ["python", "-c"]]
    assert f"run --baseline {tiny_bert} --pooler cls_before_pooler --sts_dir {small_sts}" in commands[0]
    assert f"--model run/best --pooler cls_before_pooler --sts_dir {small_sts}" in commands[1]
    compare, evaluate, load = (user_command(c, tmp_path) for c in commands)
    assert compare.returncode == evaluate.returncode == load.returncode == 0, \
        (compare.stderr[-2000:], evaluate.stderr[-2000:], load.stderr[-2000:])
    name = Path(tiny_bert).name
    assert re.search(rf"^{name} untrained \[cls_before_pooler\] +- ", compare.stdout, re.M)
    assert re.search(r"^simcse.py \[cls_before_pooler\] +1 ", compare.stdout, re.M)
    stored = json.loads((tmp_path / "run" / "best" / "test_metrics.json").read_text())
    assert f"{stored['avg']:.2f}" in re.search(r"^best \[cls_before_pooler\] .*$", evaluate.stdout, re.M)[0]
    assert re.fullmatch(r"tensor\(\[\[-?[01]\.\d{4}\]\]\)\n", load.stdout)
    again = subprocess.run(argv + ["--resume", "--eval_untrained"], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run folder: run (--resume: the run goes on there from its last checkpoint)" in again.stderr
    assert re.search(rf"^untrained {name} \[cls_before_pooler\] ", again.stdout, re.M)
    assert "best model: run/best" in again.stderr


def table_row(printed: str, label: str) -> list[float]:
    line = next(line for line in printed.splitlines() if line.startswith(label + "  "))
    return [float(x) for x in line[len(label):].split()]


@pytest.mark.parametrize("pooler,shown", [("cls_before_pooler", "cls_before_pooler"),
                                          ("cls", "cls: its pretrained pooler")])
def test_eval_untrained_prints_and_keeps_the_untrained_row(tmp_path, tiny_bert, corpus, small_sts, cache_dir,
                                                           capsys, pooler, shown):
    """--eval_untrained: the untrained --model read off with the run's pooler (for `cls`, its own
    pretrained pooler layer, as tools/eval.py reads it), in the table between the run and the
    paper's rows, and in best/test_metrics.json under "untrained"; the run itself is unchanged
    and its default folder name leaves the flag out."""
    out, label = tmp_path / "run", f"untrained {Path(tiny_bert).name} [{shown}]"
    res = simcse.main(run_argv(tiny_bert, corpus, small_sts, out, cache_dir, "--pooler", pooler,
                               "--eval_untrained"))
    printed = capsys.readouterr().out
    stored = json.loads((out / "best" / "test_metrics.json").read_text())["untrained"]
    expected = common.evaluate_encoder(str(tiny_bert), pooler, small_sts)
    assert stored["label"] == label and stored["model"] == str(tiny_bert) and stored["pooler"] == pooler
    tasks = [*common.STS_TASKS, "avg"]
    assert {t: stored[t] for t in tasks} == {t: expected[t] for t in tasks}
    assert {"alignment", "uniformity"} <= set(stored)
    figures = [expected[t]["spearman"] for t in common.STS_TASKS] + [expected["avg"]]
    assert table_row(printed, label) == [round(x, 2) for x in figures]
    names = [line.split("  ")[0] for line in printed.splitlines()]
    assert names.index("this run") + 1 == names.index(label)
    assert f"; {label}: {stored['alignment']:.3f} / {stored['uniformity']:.3f}" in printed
    plain = simcse.main(run_argv(tiny_bert, corpus, small_sts, tmp_path / "plain", cache_dir,
                                 "--pooler", pooler))
    assert plain["test"] == res["test"] and "untrained" not in capsys.readouterr().out
    args = flags.parse_args(simcse.Args, ["--eval_untrained"])
    assert flags.default_output_dir(args) == "runs/simcse/default"


@pytest.mark.parametrize("script", ["ifcl", "rcl"])
def test_eval_untrained_reads_the_scripts_start_with_its_pooler(tmp_path, tiny_bert, corpus, nli_csv,
                                                                small_sts, cache_dir, script):
    """IFCL evaluates with its --pooler (avg by default) and RCL's final model starts from --model
    too: the untrained row is --model read off with that pooler."""
    out = tmp_path / "run"
    if script == "ifcl":
        ifcl.main(run_argv(tiny_bert, corpus, small_sts, out, cache_dir, "--no_fraternal", "--no_queue",
                           "--eval_untrained"))
    else:
        rcl.main(run_argv(tiny_bert, nli_csv, small_sts, out, cache_dir, "--phi", "0.01", "--eval_untrained"))
    stored = json.loads((out / "best" / "test_metrics.json").read_text())["untrained"]
    label = f"untrained {Path(tiny_bert).name} [avg]"
    assert (stored["model"], stored["pooler"], stored["label"]) == (str(tiny_bert), "avg", label)
    assert stored["avg"] == common.evaluate_encoder(str(tiny_bert), "avg", small_sts)["avg"]
