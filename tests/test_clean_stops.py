"""What a stop or a failure leaves: after Ctrl-C the last line on the screen is the one that says
what to run next, no progress bar drawn or left stale under it; a failed download leaves no
empty folder it made; a translation's .part file is never written through a link."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import common
from conftest import Held
from plumbing import command_line, downloads
from plumbing.progress import progress
from plumbing.sts_data import check_sts


def screen(stream: str, width: int = 200) -> list[str]:
    """What a terminal shows after `stream` (a command's stderr): lines written over by a carriage
    return, the cursor moved up by a bar drawn below another (ESC [A), trailing blank lines dropped."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[A|\r|\n|[^\r\n\x1b]+|\x1b", stream):
        if token == "\x1b[A":
            row = max(0, row - 1)
        elif token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            rows.extend([] for _ in range(row + 1 - len(rows)))
        else:
            line = rows[row]
            line.extend(" " for _ in range(col - len(line)))
            line[col:col + len(token)] = token
            col += len(token)
    shown = ["".join(r).rstrip() for r in rows]
    while shown and not shown[-1]:
        shown.pop()
    return shown


def test_the_line_after_a_stop_comes_below_every_bar_and_none_is_left_stale(monkeypatch):
    """Training's bar and an evaluation's drawn below it, each a `with` block, open when Ctrl-C
    comes: the stop closes the inner one first (wiped) and then training's, so the screen ends with
    training's bar and then the line, nothing between."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(KeyboardInterrupt):
        with progress(100, "simcse", "step") as outer:
            outer.update(7)
            with progress(40, "evaluating", "batch", leave=False) as inner:
                inner.update(12)
                inner.refresh()
                raise KeyboardInterrupt
    command_line.say("\ninterrupted (Ctrl-C). What was already written in runs/x is kept.")
    shown = screen(err.getvalue())
    assert shown[-1] == "interrupted (Ctrl-C). What was already written in runs/x is kept.", shown
    assert shown[-3].startswith("simcse:") and " 7/100 " in shown[-3] and shown[-2] == "", shown
    assert not any("evaluating" in line for line in shown), shown


def test_ctrl_c_in_a_real_run_ends_the_screen_with_the_line_that_says_what_next(tmp_path, tiny_bert, corpus,
                                                                               small_sts):
    """`python simcse.py` held mid-step with an evaluation's bar drawn under training's, then a
    real SIGINT: exit status 130; the screen's last line says --resume, training's bar above it,
    the evaluation's wiped, and nothing drawn after."""
    hold = tmp_path / "hold"
    at_hold = (f"import time\nfrom pathlib import Path\nfrom plumbing.progress import progress\n"
               f"with progress(40, 'evaluating', 'batch', leave=False) as bar:\n    bar.update(12)\n"
               f"    bar.refresh()\n    Path({str(hold / 'inner')!r}).write_text('')\n"
               f"    while True:\n        time.sleep(0.05)\n")
    argv = ["--model", str(tiny_bert), "--data", str(corpus), "--sts_dir", str(small_sts), "--output_dir",
            str(tmp_path / "run"), "--batch_size", "8", "--max_steps", "20", "--eval_every", "10",
            "--cache_dir", str(tmp_path / "cache")]
    with Held(hold, "simcse.py", argv, at=3, at_hold=at_hold) as run:
        run.wait("inner")
        os.kill(run.proc.pid, signal.SIGINT)
        err = run.proc.stderr.buffer.read().decode()     # as written: its \r not read as line ends
        code = run.proc.wait(timeout=300)
    shown = screen(err)
    assert code == 130, err[-2000:]
    assert shown[-1].startswith("interrupted (Ctrl-C). What was already written in ") and \
        "--resume" in shown[-1], shown[-6:]
    assert shown[-3].startswith("simcse:") and "2/20" in shown[-3] and shown[-2] == "", shown[-6:]
    assert not any("evaluating" in line for line in shown), shown[-6:]


# -------------------------------------------------------------------------------------
# A failed download, a link where a translation writes
# -------------------------------------------------------------------------------------

def closed_address() -> str:
    with socket.socket() as s:                       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("what", ["wiki1m", "nli", "sts"])
def test_a_failed_download_leaves_nothing_of_it(what, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.UserError, match="could not download"):
        downloads.download("fresh/data", check_sts, closed_address(), what=[what])
    assert not list((tmp_path / "fresh" / "data").iterdir())      # the folder it goes to, empty
    (tmp_path / "data").mkdir()                      # a folder that was there stays, and what it holds
    (tmp_path / "data" / "mine.txt").write_text("kept\n")
    with pytest.raises(common.UserError, match="could not download"):
        downloads.download("data", check_sts, closed_address(), what=[what])
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["mine.txt"]


def test_the_free_space_named_is_where_the_download_goes(tmp_path):
    """The STS archive is fetched into a temporary folder, gone once it fails: not the one named."""
    with pytest.raises(common.UserError, match=rf"the free disk space in {tmp_path / 'data'}, or fetch"):
        downloads.download(tmp_path / "data", check_sts, closed_address(), what=["sts"])


def test_a_script_the_suite_starts_meets_ctrl_c_and_a_hangup_as_from_a_terminal():
    """Even when the suite itself runs in the background with SIGINT and SIGHUP ignored (nohup,
    `cmd &` in a shell script), the processes it starts begin with both at their default, so the
    real-signal tests here test what a user's Ctrl-C does (conftest.py)."""
    probe = ("import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
             "signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["True", "True"]


def test_a_signal_that_lands_inside_a_finalizer_still_stops_the_command(tmp_path):
    """Python drops an exception raised in a __del__ ("Exception ignored in ..."): a SIGTERM handled
    while one runs (a progress bar's, as a run ends) would be lost. It is sent again once the
    finalizer is done, and stops the command as any other."""
    code = ("import os, signal, sys, time\n"
            f"sys.path.insert(0, {str(Path(common.__file__).parent)!r})\n"
            "from plumbing import interrupts\n"
            "signal.signal(signal.SIGTERM, interrupts.on_signal)\n"
            "class Bar:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        sum(range(1000))\n"
            "Bar()\n"
            "try:\n"
            "    time.sleep(10)\n"
            "    print('not stopped')\n"
            "except interrupts.Stopped as e:\n"
            "    print('stopped', e.signum)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["stopped", str(int(signal.SIGTERM))], (r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr, r.stderr
