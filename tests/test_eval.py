"""`python tools/eval.py`: a saved encoder on the STS tasks, the same figures as common's
evaluator, its table, its --output JSON, its --help, and its exit statuses through run_main."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import common
from conftest import ROOT, cpu_env
from tools import eval as eval_tool


def test_eval_scores_a_saved_encoder_as_common_does(tiny_bert, small_sts, tmp_path, capsys):
    out = tmp_path / "res.json"
    res = eval_tool.main(["--model", str(tiny_bert), "--pooler", "avg", "--sts_dir", str(small_sts),
                          "--output", str(out)])
    assert res == common.evaluate_encoder(str(tiny_bert), "avg", small_sts)
    assert json.loads(out.read_text())["avg"] == pytest.approx(res["avg"])
    table = capsys.readouterr().out
    assert f"{tiny_bert.name} [avg]" in table and "STS-B" in table and "SICK-R" in table
    dev = eval_tool.main(["--model", str(tiny_bert), "--sts_dir", str(small_sts), "--split", "dev",
                          "--tasks", "STSBenchmark"])
    assert set(dev) == {"STSBenchmark", "avg"}


def test_eval_runs_from_the_command_line(tmp_path):
    """--help, and a missing --sts_dir: exit 2, one line that names the flag and the download
    command (not the evaluation that failed), no traceback."""
    tool = str(ROOT / "tools" / "eval.py")
    r = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: python tools/eval.py" in r.stdout and "--pooler" in r.stdout
    r = subprocess.run([sys.executable, tool, "--sts_dir", str(tmp_path / "no-sts")], capture_output=True,
                       text=True, timeout=300, env=cpu_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--sts_dir {tmp_path / 'no-sts'}: expected STS/ and SICK/" in r.stderr
    assert "python tools/download.py --what sts" in r.stderr
