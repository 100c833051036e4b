"""A run's record is the code that ran and the files it trained on: an edit saved after the launch is
never recorded as what ran; an edit of any of the repository's modules (plumbing/ too) makes --resume
refuse, naming the file; IFCL's German file edited between a stop and --resume is refused; a signal
that lands inside torch.save is a stop (exit 143, its line with the command that continues), not a
failed write; and the smaller points of the record (a folder holding only a lock, a linked script, a
finished run's last/ left by a kill)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_record import _clone, _run

import common
import ifcl
import simcse
from conftest import ENV, ROOT, Held
from plumbing import checkpoint, run_folder

pytestmark = pytest.mark.usefixtures("one_thread")
LOSS_LINE = "    return F.cross_entropy(sim / tau, labels)"                 # simcse_loss's last line


def _argv(tiny_bert: Path, data: Path, sts: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts), "--cache_dir",
            str(tmp_path / "cache"), "--batch_size", "8", "--max_steps", "2", "--eval_every", "2", *extra]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_edit_saved_while_a_run_starts_is_not_recorded_as_what_ran(tmp_path, tiny_bert, data, small_sts):
    """The habit the record must survive: launch, keep editing, save. The run is held after its imports
    and before its record; simcse.py's loss is then edited to raise, and common.py and plumbing/inputs.py
    are saved too. The run trains the original (it ends well), records the original's bytes and hashes,
    and says that the files changed since. --resume with the edits in place is refused naming each;
    with the files put back it is this run again."""
    clone, out = _clone(tmp_path), tmp_path / "run"
    start_py = (clone / "plumbing" / "start.py").read_text()      # common.start's checks, then the record
    hold = "    run.open()              # held by this process"
    assert hold in start_py
    (clone / "plumbing" / "start.py").write_text(start_py.replace(hold, (
        "    import os as _o, time as _t\n"
        "    if _o.environ.get('HOLD'):\n"
        "        open(_o.environ['HOLD'] + '.held', 'w').close()\n"
        "        while not _o.path.exists(_o.environ['HOLD'] + '.go'):\n"
        "            _t.sleep(0.05)\n") + hold, 1))
    originals = {f: (clone / f).read_bytes() for f in ("simcse.py", "common.py", "plumbing/inputs.py")}
    argv = _argv(tiny_bert, data, small_sts, tmp_path, "--output_dir", str(out))
    proc = subprocess.Popen([sys.executable, str(clone / "simcse.py"), *argv], cwd=tmp_path,
                            env=dict(ENV, HOLD=str(tmp_path / "hold")), stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (tmp_path / "hold.held").exists():
        assert proc.poll() is None and time.time() - t0 < 300, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    source = originals["simcse.py"].decode()
    assert LOSS_LINE in source
    (clone / "simcse.py").write_text(source.replace(LOSS_LINE, '    raise RuntimeError("the edit ran")', 1))
    (clone / "common.py").write_text((clone / "common.py").read_text() + "# saved later\n")
    (clone / "plumbing" / "inputs.py").write_text((clone / "plumbing" / "inputs.py").read_text() + "# x\n")
    (tmp_path / "hold.go").write_text("")
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0 and "the edit ran" not in err, err[-3000:]
    record = json.loads((out / "run.json").read_text())
    for f, data_ran in originals.items():
        assert (out / "code" / f).read_bytes() == data_ran, f
        assert record["code"][f] == hashlib.sha256(data_ran).hexdigest(), f
        assert f"note: {clone / f} was saved after this run started" in err, err[-3000:]
    assert {f for f in record["code"] if f.startswith("plumbing/")} >= {"plumbing/run_folder.py",
                                                                         "plumbing/inputs.py"}

    def resume() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(clone / "simcse.py"), *argv, "--resume"], cwd=tmp_path,
                              env=ENV, capture_output=True, text=True, timeout=600)

    refused = resume()
    message = refused.stderr[refused.stderr.index("error: "):]
    assert refused.returncode == 2, refused.stderr[-3000:]
    for f in originals:
        assert f"{f}: changed since the run started (its copy: {out / 'code' / f})" in message, message
    for f, data_ran in originals.items():
        (clone / f).write_bytes(data_ran)
    again = resume()
    assert again.returncode == 0 and "had finished: nothing to train" in again.stderr, again.stderr[-3000:]


def test_a_signal_inside_torch_save_is_a_stop_with_the_command_that_continues(tmp_path, tiny_bert, data,
                                                                             small_sts):
    """A real SIGTERM, sent by the process to itself from inside torch.save (its third write of last/
    state.pt): exit status 143 and the stop line, which prints the command that continues; no word of a
    failed write, no half checkpoint, and that command then finishes the run."""
    out = tmp_path / "run"
    before = ("import os, signal, torch\n"
              "real = torch.save\n"
              "class Writer:\n"
              "    def __init__(self, f):\n"
              "        self.f, self.n = f, 0\n"
              "    def write(self, b):\n"
              "        self.n += 1\n"
              "        if self.n == 3:\n"
              "            os.kill(os.getpid(), signal.SIGTERM)\n"
              "        return self.f.write(b)\n"
              "    def flush(self):\n"
              "        return self.f.flush()\n"
              "torch.save = lambda obj, f, *a, **k: real(obj, Writer(f), *a, **k)\n")
    argv = _argv(tiny_bert, data, small_sts, tmp_path, "--output_dir", str(out))
    with Held(tmp_path / "held", "simcse.py", argv, at=0, before=before) as run:
        ended = run.end()
    assert ended.returncode == 143, ended.stderr[-3000:]
    last = ended.stderr.strip().splitlines()[-1]
    command = f"python {ROOT / 'simcse.py'} {' '.join(argv)} --resume"      # as typed: its path in full
    assert last == f"terminated (SIGTERM). What was already written in {out} is kept. To continue the run " \
                   f"(no checkpoint yet: --resume starts from step 0): {command}", last
    assert "could not write" not in ended.stderr
    assert not (out / "last").exists() and not list(out.glob(".last*"))
    again = subprocess.run(command.split(), cwd=Path.cwd(), env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and (out / "best" / "test_metrics.json").is_file(), again.stderr[-3000:]


def test_the_german_file_edited_between_a_stop_and_resume_is_refused(tmp_path, tiny_bert, tiny_mbert,
                                                                      parallel, small_sts, capsys):
    """IFCL's --fraternal_data is part of the run's identity, as --data is: the German file shifted by one
    line after a stop (still parallel to --data, so nothing else notices) and --resume is refused in one
    naming the flag and the file; the run folder is left as it was."""
    german, out = tmp_path / "de.txt", tmp_path / "run"
    shutil.copy(parallel / "de.txt", german)
    argv = ["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert), "--data",
            str(parallel / "en.txt"), "--fraternal_data", str(german), "--sts_dir", str(small_sts),
            "--output_dir", str(out),
            "--max_steps", "4", "--eval_every", "2", "--batch_size", "8", "--queue_len", "16",
            "--cache_dir", str(tmp_path / "cache")]
    real = common.train_step

    def stop_at_3(*a, **k):
        if common.train_step.calls == 3:
            raise KeyboardInterrupt
        common.train_step.calls += 1
        return real(*a, **k)

    stop_at_3.calls = 0
    common.train_step = stop_at_3
    try:
        code, err = _run(argv, capsys, ifcl.main)
    finally:
        common.train_step = real
    assert code == 130 and (out / "last" / "state.pt").is_file(), err[-3000:]
    recorded = json.loads((out / "run.json").read_text())["inputs"]
    assert recorded == {"fraternal_data": _sha(german)}
    lines = german.read_text(encoding="utf-8").splitlines()
    german.write_text("\n".join(lines[1:] + lines[:1]) + "\n", encoding="utf-8")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    code, err = _run(argv + ["--resume"], capsys, ifcl.main)
    assert code == 2, err[-3000:]
    assert f"--fraternal_data {german}: its content is not the file the run started with" in err, err[-3000:]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"} == before


def test_a_finished_runs_last_left_by_a_kill_is_dropped_on_the_next_start(tmp_path, tiny_bert, data,
                                                                          small_sts, capsys, monkeypatch):
    """A kill between best/test_metrics.json and the removal of last/ left last/; the next --resume, which
    finds the run finished, drops it."""
    out = tmp_path / "run"
    argv = _argv(tiny_bert, data, small_sts, tmp_path, "--output_dir", str(out))
    with monkeypatch.context() as mp:
        mp.setattr(checkpoint, "drop_last", lambda run: None)
        assert _run(argv, capsys)[0] == 0
    assert (out / "last" / "state.pt").is_file()
    code, err = _run(argv + ["--resume"], capsys)
    assert code == 0 and "had finished: nothing to train" in err, err[-3000:]
    assert not (out / "last").exists()


def test_a_default_folder_holding_only_a_lock_is_taken_as_empty(tmp_path, tiny_bert, data, small_sts, capsys,
                                                                monkeypatch):
    """A run stopped at once leaves its default folder with run.lock alone: the same command with the
    same code goes there, with no note of other code."""
    monkeypatch.chdir(tmp_path)
    argv = _argv(tiny_bert, data, small_sts, tmp_path)
    default = Path(run_folder.default_output_dir(common.parse_args(simcse.Args, argv)))
    default.mkdir(parents=True)
    (default / run_folder.LOCK).write_text("process 1 (python simcse.py)\n")
    code, err = _run(argv, capsys)
    assert code == 0, err[-3000:]
    assert "holds a run of other code" not in err and (default / "run.json").is_file(), err[-3000:]


def test_a_linked_script_is_recorded_under_its_own_name(tmp_path, tiny_bert, data, small_sts):
    """`python mine.py` where mine.py links to simcse.py: the record names simcse.py, so that compare does
    not split identical runs by the name of a link."""
    clone, out = _clone(tmp_path), tmp_path / "run"
    (clone / "mine.py").symlink_to(clone / "simcse.py")
    done = subprocess.run([sys.executable, str(clone / "mine.py"),
                           *_argv(tiny_bert, data, small_sts, tmp_path, "--output_dir", str(out))],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["script"] == "simcse.py" and "simcse.py" in record["code"], record
    assert "mine.py" not in record["code"], record


