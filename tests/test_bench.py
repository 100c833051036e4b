"""`python tools/bench.py`: a method's training step timed beside the plain fp32 eager step."""

from __future__ import annotations

import json
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
