"""Every phase shows progress: the evaluations' bars (labelled with the task, on stderr, rank 0
only, none for an evaluation under a second), and a download's bar in bytes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

import common
import simcse
from plumbing import downloads, process
from tools import compare
from tools import eval as eval_tool


@pytest.fixture
def drawn(monkeypatch):
    """Every bar drawn at once and at each update, as a slow machine draws them over minutes."""
    real = process.tqdm
    monkeypatch.setattr(process, "tqdm", lambda *a, **k: real(*a, **{**k, "mininterval": 0, "delay": 0,
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
    monkeypatch.setattr(process, "world", lambda: (1, 2))             # under torchrun, rank 1
    assert common.evaluate_sts(encode, small_sts, desc="checking") == res
    assert capsys.readouterr() == ("", "")


def test_an_encode_of_ones_own_still_shows_its_task_and_no_quick_evaluation_draws(small_sts, capsys,
                                                                                    monkeypatch):
    """evaluate_sts(encode) with an encode not made by make_encode: the bar moves task by task,
    each named, once the evaluation has taken a second (process.EVAL_DELAY); one under a second
    draws nothing (the tests' own evaluations, a tiny model's); rank 1 draws nothing."""
    def encode(sentences):                                      # (n, 2): length and a letter count
        return np.array([[len(s), s.count("e") + 1] for s in sentences], np.float32)

    def slow(sentences):
        time.sleep(1.2)
        return encode(sentences)

    quick = common.evaluate_sts(encode, small_sts, split="dev", desc="mine")
    assert capsys.readouterr() == ("", "")
    assert common.evaluate_sts(slow, small_sts, split="dev", desc="mine") == quick
    out, err = capsys.readouterr()
    total = sum(distinct_sentences(small_sts, t, "dev") for t in ("STSBenchmark", "SICKRelatedness"))
    assert out == "" and "mine: STS-B dev (1/2)" in err and f"/{total} " in err
    monkeypatch.setattr(process, "world", lambda: (1, 2))
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
