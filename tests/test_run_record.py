"""A run's record tells the truth: the run folder is changed only by the run it holds.

On simcse.py's real runs (tiny BERT, small STS, CPU):
- --resume with other training flags, or other data, stops before anything is written (exit 2),
  naming each difference with both values; flags that only say where and how a run is written
  (common.NOT_TRAINING) may change;
- a last/state.pt that is not this run's checkpoint (cut short, empty, text, another model's, one
  that carries code) is refused in one line (exit 2), naming what is still good, and the folder is
  left byte for byte as it was; a pickled callable is never run;
- a write that fails (ENOSPC) in last/, best/ (the final test_metrics.json too), metrics.jsonl or
  the token cache ends the run in one line (exit 4) naming what failed and the intact
  checkpoint, and the same command plus --resume then gives the uninterrupted run's log; an
  --output_dir that cannot be written is refused at the start (exit 2);
- SIGTERM ends a run like Ctrl-C (exit 143, one line with --resume) and lets go of the folder at
  once: a second process takes it while the first is still alive; a stop before the run is
  recorded says to run the same command again (--resume would be refused);
- the four rules with the real file or fault: a user's folder (or /) refused and left as it was, no
  run.lock left; a best/ of another run refused; too few file descriptors, and under torchrun a rank that ends
  because another did, in one line; a stop said once;
- what a run records of its code: an edited script's run is a run of its own, --resume of a run
  whose code changed names the file; a finished run resumed trains nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kill_resume import _records, _same_run

import common
import rcl
import simcse
from conftest import ENV, ROOT, Held, Shell, cpu_env, script
from plumbing import atomic_writes, checkpoint, command_line, inputs, report, run_folder

ENOSPC = "No space left on device"
# every run here: checkpoints (last/, and best/ when the best) at steps 2, 4 and 6, a training
# record every step: the log reads 1, 2, 2 (eval), 3, 4, 4 (eval), 5, 6, 6 (eval)
FLAGS = ["--batch_size", "8", "--max_steps", "6", "--eval_every", "2", "--log_every", "1",
         "--lr", "1e-3", "--max_len", "16"]


# one thread (conftest): every run here and its reference compute alike (the resumed runs are
# compared with the uninterrupted one record for record), and a tiny model is quicker on busy cores
pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(out: Path, tiny_bert: Path, data: Path, sts: Path, cache: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts), "--output_dir", str(out),
            "--cache_dir", str(cache), *FLAGS, *extra]


def _run(argv: list[str], capsys, main=simcse.main) -> tuple[int, str]:
    """simcse.py's main (or another) under common.run_main, as `python simcse.py ARGV` runs it:
    (exit status, stderr). run_main's SIGTERM handler is put back as it was, for the rest of the session."""
    handler = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    code = 0
    try:
        common.run_main(main, argv)
    except SystemExit as e:
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, capsys.readouterr().err


def _error(err: str) -> str:
    """The one error message of a run's stderr (from `error: ` to the end, progress bars left out),
    no traceback. (Where the message starts on the screen: test_an_error_starts_a_line_of_its_own.)"""
    assert "Traceback" not in err, err[-3000:]
    assert err.count("error: ") == 1, err[-3000:]
    lines = re.split(r"\r|\n", err[err.index("error: "):])     # a progress bar redraws after \r
    return "\n".join(line for line in lines if line and not line.startswith("simcse:"))


def _one_line_error(err: str) -> str:
    message = _error(err)
    assert "\n" not in message.strip(), message
    return message


def _tree(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` (hidden ones too) with its content's sha256. run.lock is
    left out: it is the lock, which names whichever process took the folder last."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*")) if p.name != run_folder.LOCK}


def _interrupt_at_step(n: int):
    """A train_step that raises KeyboardInterrupt (Ctrl-C) on its n-th call."""
    real, calls = common.train_step, [0]

    def step(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(*a, **k)
    return step


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_bert, data, small_sts, one_thread) -> Path:
    """A finished 6-step run: the reference of every resumed run here."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cache = out.parent / "cache"
    assert simcse.main(_argv(out, tiny_bert, data, small_sts, cache))["steps"] == 6
    command_line.let_go()
    return out


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, tiny_bert, data, small_sts, one_thread) -> Path:
    """The same run stopped (Ctrl-C) inside step 4: last/ holds step 2, the log steps 1-3."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    cache = out.parent / "cache"
    mp = pytest.MonkeyPatch()
    mp.setattr(common, "train_step", _interrupt_at_step(4))
    try:
        with pytest.raises(KeyboardInterrupt):
            simcse.main(_argv(out, tiny_bert, data, small_sts, cache))
    finally:
        mp.undo()
        command_line.let_go()
    assert [r["step"] for r in _records(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    return out


@pytest.fixture(scope="module")
def unreported(tmp_path_factory, tiny_bert, data, small_sts, one_thread) -> Path:
    """The same run stopped (Ctrl-C) as its final report began: last/ holds step 6, best/ step 4."""
    out = tmp_path_factory.mktemp("unreported") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr(report, "final", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        with pytest.raises(KeyboardInterrupt):
            simcse.main(_argv(out, tiny_bert, data, small_sts, out.parent / "cache"))
    finally:
        mp.undo()
        command_line.let_go()
    assert torch.load(out / "last" / "state.pt", weights_only=True)["step"] == 6
    assert json.loads((out / "best" / "dev_metrics.json").read_text())["step"] == 4
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    """A copy of a module run to change (output_dir is not a training flag: --resume accepts it)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# ------------------------------------------------------------------------------------
# --resume is held to the run's record
# ------------------------------------------------------------------------------------

def test_resume_with_other_flags_is_refused_and_changes_nothing(
        tmp_path, tiny_bert, data, small_sts, finished, capsys):
    out = _copy(finished, tmp_path)
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume", "--lr", "0.01",
                           "--max_steps", "12"), capsys)
    assert code == 2, err[-3000:]
    message = _error(err)
    # one line per difference, with both values; then how to start a new run instead
    assert "--lr: the run has 0.001, this command 0.01" in message, message
    assert "--max_steps: the run has 6, this command 12" in message, message
    assert sum(line.startswith("  --") for line in message.splitlines()) == 2, message
    assert "start a new run" in message and "--output_dir" in message, message
    assert _tree(out) == before           # args.json, run.json, metrics.jsonl, last/, best/ as they were
    assert not (tmp_path / "cache").exists(), "refused after the data were tokenised"


def test_resume_with_other_data_is_refused_and_changes_nothing(tmp_path, tiny_bert, data, small_sts,
                                                               capsys):
    mine = tmp_path / "sentences.txt"
    shutil.copy(data, mine)
    out, cache = tmp_path / "run", tmp_path / "cache"
    code, err = _run(_argv(out, tiny_bert, mine, small_sts, cache, "--max_steps", "2"), capsys)
    assert code == 0, err[-3000:]
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["script"] == "simcse.py" and run_json["format"] == checkpoint.FORMAT
    assert run_json["data_sha256"] == hashlib.sha256(mine.read_bytes()).hexdigest()
    # the code that ran: the script, common.py and the plumbing/ modules imported (here, by the tests too)
    assert {"simcse.py", "common.py", "plumbing/run_folder.py", "plumbing/inputs.py"} <= set(run_json["code"])
    assert run_json["code"] == {name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest()
                                for name in run_json["code"]}
    # the same file name, other content: 200 of its 300 lines
    mine.write_text("\n".join(mine.read_text(encoding="utf-8").splitlines()[:200]) + "\n", encoding="utf-8")
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, mine, small_sts, cache, "--max_steps", "2", "--resume"), capsys)
    assert code == 2, err[-3000:]
    message = _error(err)
    assert f"--data {mine}: its content is not the data the run started with" in message, message
    assert sum(line.startswith("  --") for line in message.splitlines()) == 1, message
    assert "start a new run" in message, message
    assert _tree(out) == before


def test_a_run_of_an_earlier_version_is_refused_and_nothing_is_written(tmp_path, tiny_bert, data, small_sts,
                                                                       interrupted, capsys):
    """A folder from before run.json (args.json alone), or with a run.json that records no code: what
    it trained on cannot be checked, so --resume is refused in one line, and nothing is written (an
    earlier version wrote run.json first, and a refusal then held the folder to edited data)."""
    for spoil in (lambda out: (out / "run.json").unlink(),
                  lambda out: (out / "run.json").write_text(json.dumps({"script": "simcse.py"}))):
        out = _copy(interrupted, tmp_path / str(len(list(tmp_path.iterdir()))))
        spoil(out)
        before = _tree(out)
        code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
        assert code == 2, err[-3000:]
        message = _one_line_error(err)
        assert f"--output_dir {out}: an earlier version of this project started this run" in message, message
        assert f"another --output_dir, e.g. {out}-2" in message, message
        assert _tree(out) == before


def test_resume_may_change_where_and_how_a_run_is_written(tmp_path, tiny_bert, data, small_sts,
                                                          interrupted, finished, capsys):
    """--log_every, --cache_dir and --compile (NOT_TRAINING) say nothing about what is trained:
    accepted; args.json keeps the values the run started with."""
    out = _copy(interrupted, tmp_path)
    args_before = (out / "args.json").read_bytes()
    cache = tmp_path / "other_cache"
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache, "--resume", "--log_every", "3",
                           "--no-compile"), capsys)
    assert code == 0, err[-3000:]
    assert f"resuming {out} at step 2 " in err, err[-3000:]
    assert list(cache.glob("tok-*.npz")), "the new --cache_dir was not used"
    assert (out / "args.json").read_bytes() == args_before
    recs = _records(out / "metrics.jsonl")
    # steps 1-2 logged every step, then every 3rd from the resume on (and at every evaluation)
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 6]
    assert [r["step"] for r in recs if "stsb_dev" in r] == [2, 4, 6]
    want = {r["step"]: r["loss"] for r in _records(finished / "metrics.jsonl") if "loss" in r}
    # the same steps trained: steps 1-4 logged one step each, as the reference logged them
    assert all(r["loss"] == want[r["step"]] for r in recs if "loss" in r and r["step"] <= 4)


# ------------------------------------------------------------------------------------
# A last/state.pt that is not this run's checkpoint
# ------------------------------------------------------------------------------------

DAMAGES = {
    "cut to half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "a text file": lambda p: p.write_text("step 4, loss 0.12\n"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_refused_in_one_line_and_nothing_changes(
        tmp_path, tiny_bert, data, small_sts, interrupted, capsys, damage):
    out = _copy(interrupted, tmp_path)
    state = out / "last" / "state.pt"
    DAMAGES[damage](state)
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"{state}: not a checkpoint of this run" in message, message
    # what is still good: best/ and the log; what to do
    assert f"Still good, and left as they are: {out / 'best'} (its dev_metrics.json names its step) and " \
           f"{out / 'metrics.jsonl'}" in message, message
    assert "another --output_dir" in message, message
    assert _tree(out) == before


@pytest.mark.parametrize("payload", ["os.system", "print"])
def test_a_checkpoint_that_carries_code_is_refused_and_the_code_never_runs(
        tmp_path, tiny_bert, data, small_sts, interrupted, capsys, payload):
    """Loading data only (weights_only) refuses it."""
    out = _copy(interrupted, tmp_path)
    state_pt = out / "last" / "state.pt"
    marker, armed = tmp_path / "marker", tmp_path / "armed"
    payload_object = Shell(f"touch {marker}") if payload == "os.system" else print
    _resave(state_pt, lambda state: state.update(x=payload_object))
    if payload == "os.system":                 # the payload is live: a plain torch.load runs it
        probe = tmp_path / "probe.pt"
        torch.save({"x": Shell(f"touch {armed}")}, probe)
        torch.load(probe, weights_only=False)
        assert armed.exists()
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"{state_pt}: not a checkpoint of this run (" in message, message
    assert not marker.exists(), "loading the checkpoint ran the code it carries"
    assert _tree(out) == before


def _resave(path: Path, change) -> None:
    """last/state.pt changed by `change(state)` and saved again: a whole, well-formed checkpoint that
    only what it holds gives away."""
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def test_a_checkpoint_that_lacks_a_field_is_refused_and_nothing_changes(
        tmp_path, tiny_bert, data, small_sts, interrupted, capsys):
    """A state.pt without a field a Checkpoint needs (its step, here) cannot be put back: refused in one
    line, the folder as it was."""
    out = _copy(interrupted, tmp_path)
    _resave(out / "last" / "state.pt", lambda state: state.pop("step"))
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2, err[-3000:]
    assert f"{out / 'last' / 'state.pt'}: not a checkpoint of this run (" in _one_line_error(err)
    assert "'step'" in _one_line_error(err)
    assert _tree(out) == before


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# what a damaged part of a run's record does to --resume: (the damage, the file the line names and how)
RECORDS = {
    "args.json cut short": (lambda out: _cut(out / "args.json"), "args.json: cut short or damaged ("),
    "run.json cut short": (lambda out: _cut(out / "run.json"), "run.json: cut short or damaged ("),
}


@pytest.mark.parametrize("damage", list(RECORDS))
def test_a_damaged_record_is_named_in_one_line_and_nothing_changes(tmp_path, tiny_bert, data, small_sts,
                                                                   interrupted, capsys, damage):
    out = _copy(interrupted, tmp_path)
    spoil, said = RECORDS[damage]
    spoil(out)
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2, err[-3000:]
    assert f"error: {out}/{said}" in _one_line_error(err)
    assert _tree(out) == before


def test_a_best_that_is_lost_is_named_in_one_line(tmp_path, tiny_bert, data, small_sts, unreported, capsys):
    """A run stopped before its final report: best/ is step 4's, last/ step 6's, so nothing can make
    best/ again. The line names best/ (not the --model flag that final_report's load would have
    blamed)."""
    out = _copy(unreported, tmp_path)
    shutil.rmtree(out / "best")
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert message.startswith(f"error: {out / 'best'}: ") and "The model of step 4, the best STS-B dev, " \
        "was kept only there (last/ holds step 6)" in message, message
    assert "--model" not in message and _tree(out) == before


def test_a_best_that_fell_behind_last_is_saved_again(tmp_path, tiny_bert, data, small_sts, interrupted,
                                                     capsys, monkeypatch):
    """A kill between last/'s commit at step 2, the best so far, and best/'s save (train() saves last/
    first): --resume saves the restored model as best/ before it trains (here it is stopped at its
    first step)."""
    out = _copy(interrupted, tmp_path)
    shutil.rmtree(out / "best")
    with monkeypatch.context() as mp:
        mp.setattr(common, "train_step", _interrupt_at_step(1))
        code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 130, err[-3000:]
    for name in ("model.safetensors", "dev_metrics.json"):
        assert (out / "best" / name).read_bytes() == (interrupted / "best" / name).read_bytes()


def test_a_log_line_cut_short_is_dropped_on_resume(tmp_path, tiny_bert, data, small_sts, interrupted, capsys):
    """metrics.jsonl cut inside the part last/ recorded (the last line half gone): the half line is
    dropped, not glued to the next record."""
    out = _copy(interrupted, tmp_path)
    size = torch.load(out / "last" / "state.pt", weights_only=True)["log_bytes"]
    log = out / "metrics.jsonl"
    log.write_bytes(log.read_bytes()[: size - 20])
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 0, err[-3000:]
    recs = _records(log)                                    # every line whole
    assert [r["step"] for r in recs if "stsb_dev" in r] == [4, 6]   # step 2's, cut, is gone


def test_what_a_kill_after_a_commit_left_is_removed(tmp_path, tiny_bert, data, small_sts, interrupted,
                                                    capsys):
    """A kill in the last removal of a commit leaves .last.old beside a whole last/ (a copy of the
    model and AdamW's moments): the next start removes it."""
    out = _copy(interrupted, tmp_path)
    shutil.copytree(out / "last", out / ".last.old")
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert not list(out.glob(".*"))


def test_a_resume_stopped_before_its_record_is_checked_says_its_folder_is_unchanged(
        tmp_path, tiny_bert, data, small_sts, interrupted, capsys, monkeypatch):
    """A real SIGINT while a --resume still checks its input: the folder holds a run, which the
    line must not deny ("nothing for --resume to continue"); the same command continues it."""
    out = _copy(interrupted, tmp_path)
    before = _tree(out)
    with monkeypatch.context() as mp:
        mp.setattr(inputs, "encoder_positions", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT))
        code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 130, err[-3000:]
    command = shlex.join(["python", os.path.relpath(ROOT / "simcse.py"),
                          *_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume")])
    assert [line for line in err.splitlines() if line.strip()] == \
        [f"interrupted (Ctrl-C). Nothing in {out} was changed yet. To continue the run: {command}"], \
        err[-3000:]
    assert _tree(out) == before


@pytest.fixture(scope="module")
def rcl_finished(tmp_path_factory, tiny_bert, data, small_sts, one_thread) -> Path:
    """An rcl.py run whose one entropy model (2 steps) finished, stopped (Ctrl-C) as its final
    model began."""
    out = tmp_path_factory.mktemp("rcl") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr(rcl, "train_final", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        with pytest.raises(KeyboardInterrupt):
            rcl.main(_rcl_argv(out, tiny_bert, data, small_sts))
    finally:
        mp.undo()
        command_line.let_go()
    assert (out / "entropy_phi0.01" / run_folder.DONE).is_file()
    return out


def _rcl_argv(out: Path, tiny_bert: Path, data: Path, sts: Path, *extra: str) -> list[str]:
    return [*_argv(out, tiny_bert, data, sts, out.parent / "cache", "--max_steps", "2", "--phi", "0.01",
                   "--patience", "0", "--pooler", "cls_before_pooler"), *extra]


@pytest.mark.parametrize("part", ["DONE.json"])
def test_a_damaged_part_of_a_finished_entropy_model_is_named_in_one_line(tmp_path, tiny_bert, data, small_sts,
                                                                         rcl_finished, capsys, part):
    """rcl.py's --resume reuses a finished entropy model: its summary, cut short, is named in one
    line with what to do, and nothing changes."""
    out = _copy(rcl_finished, tmp_path)
    stage = out / "entropy_phi0.01"
    _cut(stage / part)
    before = _tree(out)
    code, err = _run(_rcl_argv(out, tiny_bert, data, small_sts, "--resume"), capsys, rcl.main)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"{stage / part}: cut short or damaged (" in message and "another --output_dir" in message, message
    assert _tree(out) == before


def _not_json(model: Path) -> None:
    (model / "tokenizer.json").write_text("{not json")


def _code_in_weights(model: Path) -> None:
    from safetensors.torch import load_file
    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**state, "x": Shell(f"touch {model / 'marker'}")}, model / "pytorch_model.bin")


# a --model folder a user was given: (what is wrong, what the line says of which file)
MODELS = {"a tokenizer.json that is not JSON": (_not_json, "tokenizer.json is cut short or damaged (not "
                                                "JSON"),
          "model.safetensors cut short": (lambda m: _cut(m / "model.safetensors"),
                                          "model.safetensors is cut short or damaged ("),
          "a pytorch_model.bin that carries code": (_code_in_weights, "pytorch_model.bin is cut short or "
                                                    "damaged (")}


@pytest.mark.parametrize("damage", list(MODELS))
def test_a_damaged_model_folder_is_refused_before_anything_is_written(tmp_path, tiny_bert, data, small_sts,
                                                                      capsys, damage):
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_bert, model)
    spoil, said = MODELS[damage]
    spoil(model)
    code, err = _run([*_argv(out, model, data, small_sts, tmp_path / "cache")], capsys)
    assert code == 2, err[-3000:]
    assert f"error: --model {model}: {model}/{said}" in _one_line_error(err)
    assert not out.exists() and not (model / "marker").exists()


def test_an_sts_dir_without_its_files_is_refused_before_training(tmp_path, tiny_bert, data, capsys):
    """STS/ and SICK/ there, but empty: refused at the start, not after training (FileNotFoundError)."""
    sts, out = tmp_path / "sts", tmp_path / "run"
    for name in ("STS", "SICK"):
        (sts / name).mkdir(parents=True)
    code, err = _run(_argv(out, tiny_bert, data, sts, tmp_path / "cache"), capsys)
    assert code == 2, err[-3000:]
    assert f"error: --sts_dir {sts}: STS12 (test) cannot be read (" in _one_line_error(err)
    assert not out.exists()


def test_a_pipe_as_data_is_not_called_missing(tmp_path, tiny_bert, small_sts, capsys):
    fifo = tmp_path / "sentences.fifo"
    os.mkfifo(fifo)
    code, err = _run(_argv(tmp_path / "run", tiny_bert, fifo, small_sts, tmp_path / "cache"), capsys)
    assert code == 2, err[-3000:]
    assert f"--data {fifo}: not a regular file (a pipe, a device or a socket)" in _one_line_error(err)


def test_a_csv_with_a_byte_order_mark_is_read(tmp_path, nli_csv):
    """Spreadsheets save UTF-8 with a byte order mark before the header: it is no part of it."""
    from plumbing import inputs
    mine = tmp_path / "nli.csv"
    mine.write_bytes(b"\xef\xbb\xbf" + nli_csv.read_bytes())
    assert inputs.read_csv_columns(mine) == inputs.read_csv_columns(nli_csv)


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")
def test_resume_puts_the_checkpoint_back_onto_the_models_device(tmp_path, tiny_bert, data, small_sts,
                                                                unreported, monkeypatch):
    """On a GPU the model lives on cuda, and a checkpoint loaded onto the model's device put the
    RNG states there too: torch.set_rng_state refused them (TypeError: RNG state must be a
    torch.ByteTensor) and every --resume crashed. Here the model lives on the meta device, as
    foreign to the CPU as a GPU: train()'s resume puts the weights and AdamW's moments there
    through load_state_dict, and the RNG state back as the CPU's own."""
    out = _copy(unreported, tmp_path)
    argv = _argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume")
    args = common.parse_args(simcse.Args, argv)
    tokenizer, encoder = common.load_encoder(args.model)
    model = simcse.SimCSE(encoder, args.tau, supervised=False).to("meta")
    made, real = [], common.make_optimizer
    monkeypatch.setattr(common, "make_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    data_ = common.tokenize_columns(args, tokenizer, common.load_columns(args.data))
    saved = torch.load(out / "last" / "state.pt", weights_only=True)["rng_cpu"]
    torch.manual_seed(12345)                                 # anything but the checkpoint's state
    assert common.train(args, run_folder.RunFolder(args), model, data_, tokenizer, args.pooler,
                        final_eval=False)["steps"] == 6
    assert torch.equal(torch.get_rng_state(), saved)
    opt = made[0][0]
    assert all(s[k].device.type == "meta" for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------------------------------
# A write that fails: one line, exit 4; then --resume gives the uninterrupted run
# ------------------------------------------------------------------------------------

def _no_space() -> OSError:
    return OSError(errno.ENOSPC, ENOSPC)


def _fail_last(monkeypatch, out: Path) -> str:
    """torch.save of last/state.pt fails at the second checkpoint (step 4)."""
    real, calls = torch.save, [0]

    def save(obj, f, *a, **k):
        if Path(getattr(f, "name", f)).name == "state.pt":       # a path, or the open file
            calls[0] += 1
            if calls[0] == 2:
                raise _no_space()
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    return f"could not write {out / 'last'}: {ENOSPC}. the last complete checkpoint, step 2, is intact"


def _fail_best(monkeypatch, out: Path) -> str:
    """best/ fails to save at step 2, after last/ of step 2 was committed: its temporary folder
    begun, as a disk that fills up mid-save leaves it."""
    def save(path, *a, **k):
        (Path(path).parent / f".{Path(path).name}.tmp-begun").mkdir()
        raise _no_space()
    monkeypatch.setattr(checkpoint, "save_pretrained_dir", save)
    return f"could not write {out / 'best'}: {ENOSPC}. the last complete checkpoint, step 2, is intact"


def _fail_log(monkeypatch, out: Path) -> str:
    """The 4th append to metrics.jsonl (step 3's training record) fails, after step 2's checkpoint."""
    calls = [0]

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise _no_space()

    def fake_open(file, mode="r", *a, **k):
        f = open(file, mode, *a, **k)
        if Path(file).name == "metrics.jsonl" and "a" in mode:
            calls[0] += 1
            if calls[0] == 4:
                return Full(f)
        return f
    monkeypatch.setattr(run_folder, "open", fake_open, raising=False)     # common's open() finds it first
    return f"could not write {out / 'metrics.jsonl'}: {ENOSPC}. the last complete checkpoint, step 2, " \
        f"is intact"


def _fail_cache(monkeypatch, out: Path) -> str:
    """np.savez of the token cache fails (on a resume with a new --cache_dir, after step 2's checkpoint)."""
    def savez(*a, **k):
        raise _no_space()
    monkeypatch.setattr(np, "savez", savez)
    return f"{ENOSPC}. {out / 'last'}, the last checkpoint, is as it was"


FAILS = {"last/": _fail_last, "best/": _fail_best, "metrics.jsonl": _fail_log, "the token cache": _fail_cache}


@pytest.mark.parametrize("place", list(FAILS))
def test_a_failed_write_ends_in_one_line_and_resume_completes_the_run(
        tmp_path, tiny_bert, data, small_sts, interrupted, finished, capsys, monkeypatch, place):
    out, cache = tmp_path / "run", tmp_path / "cache"
    if place == "the token cache":
        # the cache is written before training: on a resume (step 2 kept) that tokenises anew
        out = _copy(interrupted, tmp_path)
        argv = _argv(out, tiny_bert, data, small_sts, cache, "--resume")
    else:
        argv = _argv(out, tiny_bert, data, small_sts, cache)
    with monkeypatch.context() as mp:
        want = FAILS[place](mp, out)
        code, err = _run(argv, capsys)
    assert code == 4, err[-3000:]
    message = _one_line_error(err)
    assert want in message, message
    if place == "the token cache":
        assert f"could not write the token cache {cache}" in message, message
    assert "the same command plus --resume continues" in message, message
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache, "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert "resuming " in err and " at step 2 " in err, err[-3000:]
    _same_run(out, finished, log_every=1, eval_every=2)
    assert json.loads((out / "best" / "dev_metrics.json").read_text()) == \
        json.loads((finished / "best" / "dev_metrics.json").read_text())
    assert not list(out.glob(".*")), "a temporary folder or file left behind"


def test_a_final_report_that_cannot_be_written_ends_in_one_line_and_resume_writes_it(
        tmp_path, tiny_bert, data, small_sts, finished, capsys, monkeypatch):
    """The last write of a run, best/test_metrics.json after the 7 STS tasks: one line, exit 4,
    the finished checkpoint named; --resume then only evaluates and writes it."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    real = atomic_writes.write_text_atomic

    def write(path, text):
        if Path(path).name == "test_metrics.json":
            raise _no_space()
        return real(path, text)
    with monkeypatch.context() as mp:
        mp.setattr(run_folder, "write_text_atomic", write)
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 4, err[-3000:]
    message = _one_line_error(err)
    assert (f"could not write {out / 'best' / 'test_metrics.json'}: {ENOSPC}. the last complete "
            f"checkpoint, step 6, is intact") in message, message
    assert "the same command plus --resume continues" in message, message
    assert not (out / "best" / "test_metrics.json").exists()
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache, "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert json.loads((out / "best" / "test_metrics.json").read_text()) == \
        json.loads((finished / "best" / "test_metrics.json").read_text())
    _same_run(out, finished, log_every=1, eval_every=2)


def test_a_token_cache_that_cannot_be_written_on_a_new_run_says_no_checkpoint_was_written(
        tmp_path, tiny_bert, data, small_sts, finished, capsys, monkeypatch):
    """At a new run's start args.json and run.json are written already: the message must not say
    the folder is unchanged; it says that no checkpoint was written yet."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    with monkeypatch.context() as mp:
        mp.setattr(np, "savez", lambda *a, **k: (_ for _ in ()).throw(_no_space()))
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 4, err[-3000:]
    message = _one_line_error(err)
    assert f"could not write the token cache {cache}" in message and ENOSPC in message, message
    assert "no checkpoint was written yet" in message, message
    assert "the same command plus --resume continues" in message, message
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache, "--resume"), capsys)
    assert code == 0, err[-3000:]
    _same_run(out, finished, log_every=1, eval_every=2)


def test_an_error_during_training_starts_a_line_of_its_own(tmp_path, tiny_bert, data, small_sts,
                                                           capsys, monkeypatch):
    """The progress bar is drawn with \\r and no newline: an error printed after it without one is
    glued to the end of the bar on the screen ("...sent_s=280]error: could not write ...")."""
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        _fail_log(mp, out)
        code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache"), capsys)
    assert code == 4, err[-3000:]
    assert err.startswith("error: ") or "\nerror: " in err, err[-3000:]


def test_an_args_json_that_cannot_be_written_says_what_to_run(tmp_path, tiny_bert, data, small_sts,
                                                              finished, capsys, monkeypatch):
    """A new run whose args.json cannot be written (the disk full at the start): one line, exit 4,
    and the command it names (the same command, plus --resume only if it says so) trains the run."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    real = atomic_writes.write_atomic

    def write(path, fill):
        if Path(path).name == "args.json":
            raise _no_space()
        real(path, fill)
    with monkeypatch.context() as mp:
        mp.setattr(atomic_writes, "write_atomic", write)
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 4, err[-3000:]
    message = _one_line_error(err)
    assert f"could not write {out / 'args.json'}: {ENOSPC}" in message, message
    assert "no checkpoint was written yet" in message, message
    again = ["--resume"] if "plus --resume" in message else []
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache, *again), capsys)
    assert code == 0, err[-3000:]
    _same_run(out, finished, log_every=1, eval_every=2)


def test_an_output_dir_on_a_full_disk_is_refused_at_the_start(tmp_path, tiny_bert, data, small_sts,
                                                              capsys, monkeypatch):
    """The first write of a run is the lock file's line (the holder's pid): on a full disk it
    fails, and the run is refused there in one line."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    real = atomic_writes.write_text_atomic

    def write(path, text):
        if Path(path).name == run_folder.LOCK:
            raise _no_space()
        real(path, text)
    with monkeypatch.context() as mp:
        mp.setattr(run_folder, "write_text_atomic", write)
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"--output_dir {out}: cannot be written ({ENOSPC})" in message, message
    assert not cache.exists(), "refused only after the data were tokenised"
    assert not out.exists()


def test_an_output_dir_under_a_file_is_refused_at_the_start(tmp_path, tiny_bert, data, small_sts, capsys):
    """Works as root too: no permission lets a folder be made inside a file (ENOTDIR)."""
    (tmp_path / "a_file").write_text("not a folder\n")
    out, cache = tmp_path / "a_file" / "run", tmp_path / "cache"
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"--output_dir {out}: cannot be written" in message and "Choose a folder" in message, message
    assert not cache.exists(), "refused only after the data were tokenised"
    assert (tmp_path / "a_file").read_text() == "not a folder\n"


def test_an_output_dir_in_a_read_only_folder_is_refused_at_the_start(tmp_path, tiny_bert, data, small_sts,
                                                                     capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    out, cache = ro / "run", tmp_path / "cache"
    if os.access(ro, os.W_OK):   # root: chmod does not stop it, so the system's answer is played
        real_mkdir = os.mkdir

        def mkdir(path, *a, **k):
            if Path(path) == out:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_mkdir(path, *a, **k)
        monkeypatch.setattr(os, "mkdir", mkdir)
    try:
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
        assert code == 2, err[-3000:]
        message = _one_line_error(err)
        assert f"--output_dir {out}: cannot be written" in message, message
        assert not cache.exists() and not out.exists()
    finally:
        ro.chmod(0o755)


def test_a_stop_before_the_run_is_recorded_says_to_run_the_same_command_again(
        tmp_path, tiny_bert, data, small_sts, finished, capsys, monkeypatch):
    """Ctrl-C while start() still checks the input, before args.json: --resume would be refused
    (nothing to continue), so the line says to run the same command; that command trains the run."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    with monkeypatch.context() as mp:
        mp.setattr(inputs, "encoder_positions", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 130, err[-3000:]
    command = shlex.join(["python", os.path.relpath(ROOT / "simcse.py"),
                          *_argv(out, tiny_bert, data, small_sts, cache)])
    assert [line for line in err.splitlines() if line.strip()] == \
        ["interrupted (Ctrl-C). The run was not recorded yet: there is nothing for --resume to continue. "
         f"To start it again: {command}"], err[-3000:]
    code, err = _run(_argv(out, tiny_bert, data, small_sts, cache), capsys)
    assert code == 0, err[-3000:]
    _same_run(out, finished, log_every=1, eval_every=2)


# ------------------------------------------------------------------------------------
# SIGTERM: Ctrl-C's handling; the folder let go at once
# ------------------------------------------------------------------------------------

def test_sigterm_ends_the_run_in_one_line_and_lets_go_of_the_folder(
        tmp_path, tiny_bert, data, small_sts, finished):
    """The first process, stopped by SIGTERM, stays alive once run_main has ended its command (it
    lingers): a second process must take its folder while it still exists (a lock that only the
    process's end let go of would stop it)."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    argv = _argv(out, tiny_bert, data, small_sts, cache)
    with Held(tmp_path / "held", "simcse.py", argv, linger=True) as first:
        first.wait()                                        # before step 3: step 2's checkpoint is kept
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait("ended", timeout=120) == "143"
        # the first process is still alive: its run folder must be free already
        second = script("simcse.py", [*argv, "--resume"])
        assert first.proc.poll() is None, "the first process ended before the second one took its folder"
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"resuming {out} at step 2 " in second.stderr, second.stderr[-3000:]
        first.go("exit")
        r = first.end(timeout=120)
    assert r.returncode == 143, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "SIGTERM" in line]
    assert len(said) == 1 and said[0].endswith(" --resume"), r.stderr[-3000:]
    assert f"is kept. To continue the run: python {ROOT / 'simcse.py'} --model" in said[0], said
    _same_run(out, finished, log_every=1, eval_every=2)


# ------------------------------------------------------------------------------------
# Rules 1 and 2: a folder that is not a run's own is refused, and nothing in it changes
# ------------------------------------------------------------------------------------

def _users_folder(out: Path) -> None:
    """What a user keeps in a folder of their own, under the names a run writes."""
    (out / "last").mkdir(parents=True)
    (out / "last" / "thesis.tex").write_text("\\chapter{Results}\n")
    (out / "args.json").write_text('{"title": "my thesis"}\n')
    (out / "run.json").write_text('{"deadline": "Friday"}\n')


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_a_users_folder_is_refused_and_nothing_in_it_changes(tmp_path, tiny_bert, data, small_sts, capsys,
                                                             resume):
    out = tmp_path / "mine"
    _users_folder(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", *resume), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert f"--output_dir {out}: {out / 'run.json'} is not a run's record, so it is not a run folder of " \
           f"this project" in message, message
    assert f"choose another --output_dir, e.g. {out}-2" in message, message
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before      # no run.lock either


def test_a_run_json_that_is_no_runs_record_is_refused(tmp_path, tiny_bert, data, small_sts, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "run.json").write_text('{"deadline": "Friday"}\n')
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 2 and f"{out / 'run.json'} is not a run's record" in _one_line_error(err), err[-3000:]
    assert [p.name for p in out.iterdir()] == ["run.json"]


def test_the_root_folder_is_refused_and_no_lock_is_left_there(tmp_path, tiny_bert, data, small_sts, capsys):
    """`--output_dir /` took a lock at /run.lock, left it, and advised removing /sbin."""
    assert not os.path.lexists("/run.lock")
    code, err = _run(_argv(Path("/"), tiny_bert, data, small_sts, tmp_path / "cache"), capsys)
    assert code == 2, err[-3000:]
    message = _one_line_error(err)
    assert message.startswith("error: --output_dir /: ") and "not a run folder of this project" in message
    assert not os.path.lexists("/run.lock")


def test_an_empty_folder_of_the_users_is_taken(tmp_path, tiny_bert, data, small_sts, capsys):
    out = tmp_path / "made-by-hand"
    out.mkdir()
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--max_steps", "2"), capsys)
    assert code == 0, err[-3000:]
    assert (out / "best" / "test_metrics.json").is_file() and not (out / "last").exists()


# ------------------------------------------------------------------------------------
# Rule 4: one line, whatever the reason
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [5, 6])
def test_too_few_file_descriptors_end_in_one_line(tmp_path, tiny_bert, data, small_sts, limit):
    """`ulimit -n 5` (or 6): wherever the limit is met, one line and no traceback."""
    def limited():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    r = subprocess.run([sys.executable, str(ROOT / "simcse.py"),
                        *_argv(tmp_path / "run", tiny_bert, data, small_sts, tmp_path / "cache")],
                       env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=limited)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if r.returncode:          # met reading (2) or writing (4): the one line names it
        assert r.returncode in (2, 4) and "Too many open files" in r.stderr, r.stderr[-3000:]


def _torchrun(tmp_path: Path, argv: list[str], die_at: int = 0) -> subprocess.Popen:
    """simcse.py under `torchrun --nproc_per_node 2` on the CPU (gloo); with `die_at`, rank 0 is
    killed (SIGKILL) before that training step, as an out-of-memory killer would."""
    wrapper = tmp_path / "ranks.py"
    wrapper.write_text(f"""
import os, runpy, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import common
real, calls = common.train_step, [0]
def step(*a, **k):
    calls[0] += 1
    if calls[0] == {die_at} and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if calls[0] == 3:
        open({str(tmp_path / "stepping")!r}, "w").close()
    return real(*a, **k)
common.train_step = step
sys.argv = [{str(ROOT / "simcse.py")!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    env = cpu_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")           # two ranks: gloo on the CPU
    # the launcher looks at its workers every 2 s, not every 0.1 s: a rank that lost its peer then meets
    # the lost peer in its next collective (and says so) before the launcher ends it; at 0.1 s the two
    # race, and the rank may be ended first, its line unsaid (the launcher's own report says why)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--monitor-interval", "2", "--nproc_per_node", "2", str(wrapper), *argv],
                            env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_under_torchrun_a_rank_that_ends_because_another_did_says_so(tmp_path, tiny_bert, data, small_sts):
    run = _torchrun(tmp_path, _argv(tmp_path / "run", tiny_bert, data, small_sts, tmp_path / "cache",
                                    "--max_steps", "30"), die_at=4)
    err = run.communicate(timeout=600)[1]
    assert run.returncode != 0
    assert "rank 1: stopped, because another process of this run ended (its own line says why)." in err, \
        err[-3000:]
    assert "[rank1]: Traceback" not in err, err[-3000:]


def test_under_torchrun_a_sigterm_is_said_once(tmp_path, tiny_bert, data, small_sts):
    run = _torchrun(tmp_path, _argv(tmp_path / "run", tiny_bert, data, small_sts, tmp_path / "cache",
                                    "--max_steps", "1000", "--eval_every", "500"))
    t0 = time.time()
    while not (tmp_path / "stepping").exists():
        assert run.poll() is None and time.time() - t0 < 300, run.stderr.read()[-3000:]
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    err = run.communicate(timeout=300)[1]
    said = [line for line in err.splitlines() if line.startswith("terminated (SIGTERM)")]
    assert len(said) == 1, err[-3000:]


# ------------------------------------------------------------------------------------
# The edit loop: a run records its code
# ------------------------------------------------------------------------------------

def _clone(tmp_path: Path) -> Path:
    """The scripts, common.py and plumbing/ in a folder of their own: a student's copy to edit."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for p in ROOT.glob("*.py"):
        shutil.copy(p, clone / p.name)
    shutil.copytree(ROOT / "plumbing", clone / "plumbing", ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def _simcse(clone: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(clone / "simcse.py"), *argv], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)


def test_an_edited_script_is_a_run_of_its_own_and_resume_names_what_changed(tmp_path, tiny_bert, data,
                                                                            small_sts):
    """The same command before and after an edit of simcse.py: the default folder of the first run is
    left alone and the edited code gets a folder named after it; --resume of the first run with the
    edited code is refused in one line naming simcse.py, its copy and the diff to see; a new start
    in it is refused without suggesting --resume."""
    clone, work = _clone(tmp_path), tmp_path / "work"
    work.mkdir()
    argv = ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(small_sts), "--cache_dir",
            str(tmp_path / "cache"), "--batch_size", "8", "--max_steps", "2", "--eval_every", "2"]
    first = _simcse(clone, work, *argv)
    assert first.returncode == 0, first.stderr[-3000:]
    [original] = list((work / "runs" / "simcse").iterdir())
    recorded = json.loads((original / "run.json").read_text())["code"]
    assert (original / "code" / "simcse.py").read_bytes() == (clone / "simcse.py").read_bytes()
    assert {"simcse.py", "common.py", "plumbing/inputs.py", "plumbing/run_folder.py"} <= set(recorded)
    assert all(f in ("simcse.py", "common.py") or f.startswith("plumbing/") for f in recorded), recorded

    source = (clone / "simcse.py").read_text()
    line = "    return F.cross_entropy(sim / tau, labels)"                 # simcse_loss's last line
    assert line in source
    (clone / "simcse.py").write_text(source.replace(line, line.replace("/ tau", "/ (2 * tau)"), 1))
    second = _simcse(clone, work, *argv)
    assert second.returncode == 0, second.stderr[-3000:]
    edited = next(p for p in (work / "runs" / "simcse").iterdir() if p != original)
    assert edited.name.startswith(f"{original.name}-code")
    assert f"note: runs/simcse/{original.name} holds a run of other code: this one goes to " \
           f"runs/simcse/{edited.name}" in second.stderr
    assert json.loads((edited / "run.json").read_text())["code"]["simcse.py"] != recorded["simcse.py"]

    before = _tree(original)
    resumed = _simcse(clone, work, *argv, "--output_dir", str(original), "--resume")
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    message = resumed.stderr[resumed.stderr.index("error: "):]
    copy = original / "code" / "simcse.py"
    assert f"simcse.py: changed since the run started (its copy: {copy})" in message, message
    assert f"`diff {original / 'code' / 'simcse.py'} {clone / 'simcse.py'}` shows how" in message, message
    again = _simcse(clone, work, *argv, "--output_dir", str(original))
    assert again.returncode == 2 and "already holds another run" in again.stderr, again.stderr[-3000:]
    assert "--resume" not in again.stderr[again.stderr.index("error: "):], again.stderr
    assert _tree(original) == before


def test_a_finished_run_resumed_says_so_and_trains_nothing(tmp_path, tiny_bert, data, small_sts, finished,
                                                          capsys):
    out = _copy(finished, tmp_path)
    before = _tree(out)
    code, err = _run(_argv(out, tiny_bert, data, small_sts, tmp_path / "cache", "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert f"{out} had finished: nothing to train; the figures above are the ones it kept in " \
           f"{out / 'best' / 'test_metrics.json'}." in err, err[-3000:]
    assert "resuming" not in err and _tree(out) == before
