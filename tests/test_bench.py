"""`python tools/bench.py`: a method's training step timed beside the plain fp32 eager step."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env
from tools import bench


def test_bench_runs_on_cpu(tmp_path):
    trace = tmp_path / "prof" / "trace.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--config", "tiny",
                        "--batch_size", "4", "--max_len", "8", "--steps", "2", "--warmup", "1",
                        "--profile", str(trace)], capture_output=True, text=True, timeout=300,
                       env=cpu_env())
    assert r.returncode == 0, r.stderr
    assert "ms/step" in r.stdout and "plain fp32 eager step" in r.stdout and "speed-up" in r.stdout
    assert "aten::mm" in r.stdout or "aten::addmm" in r.stdout    # the profiler's table of ops
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("method", bench.METHODS)
def test_bench_times_every_methods_step(method, capsys):
    """Any method's step: its model over a random encoder, its columns, one timed step."""
    bench.main(["--method", method, "--config", "tiny", "--batch_size", "4", "--max_len", "8",
                "--steps", "1", "--warmup", "1", "--no-baseline"])
    out = capsys.readouterr().out
    assert out.startswith(f"{method} on tiny") and "project step" in out and "ms/step" in out


def test_bench_builds_a_float16_config_in_float32(tmp_path, capsys):
    """Hub models often ship a float16 config (all-MiniLM-L6-v2 does): the bench builds fp32
    weights all the same (bf16 comes from autocast on a GPU), so the CPU can run it."""
    cfg = bench.config_from("tiny")
    cfg.dtype = "float16"
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
    bench.main(["--config", str(tmp_path / "config.json"), "--batch_size", "4", "--max_len", "8",
                "--steps", "1", "--warmup", "0"])
    assert "speed-up over the plain fp32 eager step" in capsys.readouterr().out


def test_flops_formula_bert_base():
    """Issue 7's definition on bert-base: 2 x non-embedding weights + 4 x layers x L x d."""
    cfg = bench.config_from("bert-base-uncased")
    f = bench.forward_flops_per_token(cfg, 32)
    # 12 layers x 7,087,872 weights; embeddings and the pooler (one token a sentence) not counted
    assert f == 2 * 85_054_464 + 4 * 12 * 32 * 768


def test_bench_run_times_a_runs_phases(tmp_path, tiny_bert, corpus, small_sts):
    """`python tools/bench_run.py simcse.py ...`: the run as typed, each phase's seconds and the total
    on stderr, one JSON line with --json; the second run reads the untrained row back."""
    argv = [sys.executable, str(ROOT / "tools" / "bench_run.py"), "--json", str(tmp_path / "t.jsonl"),
            "simcse.py", "--model", str(tiny_bert), "--data", str(corpus), "--sts_dir", str(small_sts),
            "--max_steps", "2", "--eval_every", "1", "--batch_size", "8", "--eval_untrained",
            "--cache_dir", str(tmp_path / "cache")]
    for k in (1, 2):
        r = subprocess.run([*argv, "--output_dir", str(tmp_path / f"run{k}")], capture_output=True, text=True,
                           timeout=300, env=cpu_env(), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp_path / f"run{k}" / "best" / "test_metrics.json").is_file()
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    phases = ["start-up", "tokenising", "loading the encoder", "training steps", "dev evaluations",
              "checkpoints", "final evaluation", "untrained row", "other"]
    assert all(line["exit"] == 0 and all(line[p] >= 0 for p in phases[:-1]) for line in lines)
    assert all(abs(sum(line[p] for p in phases) - line["total"]) < 1e-6 for line in lines)
    assert lines[0]["training steps"] > 0 and lines[0]["dev evaluations"] > 0
    assert lines[1]["untrained row"] < lines[0]["untrained row"]          # read back, not evaluated
    assert all(re.search(rf"^{p} +\d+\.\d +\d+%$", r.stderr, re.M) for p in phases)
    assert "kept from an earlier run" in r.stdout
