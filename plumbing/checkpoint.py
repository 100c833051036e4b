"""last/ and best/: what a checkpoint holds, whose it is, how it is written, and how it is read back.

train() (common.py) decides what a checkpoint keeps, which model is best and when to stop; this module
writes them and reads them back. A change to how checkpoints are written opens this file and train().

    last/state.pt   a Checkpoint: the model, AdamW and its schedule, the loop's state, the random
                    state, rcl.py's early stop; the run's identity; the log's length when written
    last/state.pt.sha256   its SHA-256, swapped in with it
    best/           the best model by STS-B dev, as a model folder (plumbing/export.py), with
                    args.json and dev_metrics.json (its dev figures and the run's identity)

The rules, and the function that keeps each:
1. One commit point (save_last): last/ is swapped in whole, after the log it refers to is synced, so a
   kill at any moment leaves the old checkpoint or the new one, and --resume cuts the log back to the
   checkpoint's length (resumed, cut_log): the log reads as one run.
2. Nothing is loaded before it is verified (load_last): the SHA-256 before torch.load, data only
   (weights_only) before anything is put back, the identity before the state is used. A checkpoint
   that fails any of them is one line that says what is still good (damaged); nothing is changed.
3. A checkpoint and best/ are this run's or refused (identity, not_mine): the script, the stage, the
   flags that say what it trains, the data and the code. A last/ copied from a run with another seed
   or another script, or left by edited code, would continue a run that never was.
4. best/ is what last/ says it is (best_problem): the model of the best step, with its figure. On
   --resume a best/ that fell behind last/ is saved again from the model (resumed); one that cannot be
   made again (an earlier step's) is refused. The final report loads best/ only once it is shown to be
   this run's (verified_best).
5. A finished run drops last/ (drop_last): the weights and AdamW's moments, about 3x the model, only
   served to continue it; best/ and the record stay. A --resume of it shows its figures (finished).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from plumbing.atomic_writes import atomic_dir, sha256_file, sync_to_disk
from plumbing.errors import UserError, writing
from plumbing.export import save_pretrained_dir
from plumbing.flags import NOT_TRAINING, flags_of, script_name
from plumbing.inputs import model_folder_problem, read_json_object

# the run folder handed down (plumbing/run_folder.py's RunFolder, or a Stage of it); not imported, since
# run_folder imports this module
RunFolder = Any
CHECKSUM = "state.pt.sha256"    # beside last/state.pt: the SHA-256 of its bytes, checked by --resume
# this version's record (run.json) and checkpoints: the code that ran, every input. An earlier version's
# recorded less, so it cannot be shown to be the same run: refused with what to do
FORMAT = 3


@dataclasses.dataclass
class Checkpoint:
    """What last/state.pt holds: all that train() needs to go on as if the run had not stopped. train()
    fills the first fields (what to keep is the loop's to decide); save_last adds the last two, which only
    plumbing knows. Saved as a dict of these names, so that torch.load(weights_only=True) reads it back."""
    model: dict                     # model.state_dict(): the encoder and the method's own modules
    opt: dict                       # AdamW's moments
    sched: dict                     # where the learning rate's schedule is
    step: int                       # steps done
    dev: dict | None                # the last evaluation's record: best/ is saved again from it
    best: float                     # the best STS-B dev so far, and its step: what best/ must hold
    best_step: int
    stopped_early: bool             # should_stop fired: a --resume trains no further
    rng_cpu: torch.Tensor           # the random state: dropout's masks go on as they would have
    rng_cuda: torch.Tensor | None
    should_stop: dict | None = None     # rcl.py's early stop: its count and the loss since its last check
    run: dict = dataclasses.field(default_factory=dict)     # identity(): whose checkpoint this is
    log_bytes: int = 0              # metrics.jsonl's length when it was written: --resume cuts back to it


# the fields a checkpoint must hold to be put back (those with a default may be absent from an old one)
NEEDED = {f.name for f in dataclasses.fields(Checkpoint) if f.default is dataclasses.MISSING
          and f.default_factory is dataclasses.MISSING} | {"run", "log_bytes"}


# -------------------------------------------------------------------------------------
# Rule 3: whose checkpoint (and best/) it is
# -------------------------------------------------------------------------------------

def identity(run: RunFolder) -> dict:
    """What every checkpoint and best/ carry: the script, the stage, the flags that say what it trains
    (not those --resume may change, nor --data's path: its content counts), the data's and the code's
    SHA-256. Two runs with the same identity train the same numbers."""
    return {"format": FORMAT, "script": f"{script_name(run.args)}.py", "stage": run.stage_name,
            "data_sha256": run.data_sha256, "inputs": run.inputs, "code": run.code,
            "flags": flags_of(run.args, (*NOT_TRAINING, "data"))}


def not_mine(run: RunFolder, then: Any) -> list[str]:
    """How an identity (a checkpoint's, best/'s) differs from this run's, each as a line says it: [] when
    it is this run's."""
    now, then = identity(run), then if isinstance(then, dict) else {}
    if then.get("format") != FORMAT:
        return ["written by an earlier version of this project, which did not record the code"]
    stage = f"the stage {then.get('stage')}" if then.get("stage") else "the run's own model"
    diffs = [what for key, what in (("script", f"the script {then.get('script')}"), ("stage", stage),
                                    ("data_sha256", "other data")) if then.get(key) != now[key]]
    flags, code, files = (then.get(k) if isinstance(then.get(k), dict) else {} for k in
                          ("flags", "code", "inputs"))
    diffs += [f"--{k} {flags.get(k)!r} (this run: {v!r})" for k, v in now["flags"].items()
              if flags.get(k) != v]
    diffs += [f"--{k} {getattr(run.args, k)}: its content changed since" for k, v in
              now["inputs"].items() if files.get(k) != v]
    return diffs + [f"{f} of other code" for f in now["code"] if code.get(f) != now["code"][f]]


# -------------------------------------------------------------------------------------
# Rules 1 and 4: writing last/ and best/
# -------------------------------------------------------------------------------------

def save_last(run: RunFolder, state: Checkpoint) -> None:
    """last/, the one commit point: `state` with the run's identity and the log's length, the log synced
    first (a --resume cuts the log back to that length, so the log must hold it on the disk), its SHA-256
    beside it; swapped in whole (atomic_dir), so a kill leaves the old checkpoint or the new one."""
    with writing(str(run.log), run.kept):
        sync_to_disk(run.log)
    state = dataclasses.replace(state, run=identity(run), log_bytes=run.log.stat().st_size)
    with writing(str(run.out / "last"), run.kept), atomic_dir(run.out / "last") as tmp:
        with open(tmp / "state.pt", "wb") as f:
            # a file, not a path: the system's error (ENOSPC, ...) reaches here, not torch's own words
            torch.save({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, f)
        # its fingerprint, swapped in with it (`sha256sum -c state.pt.sha256` in last/ checks it too)
        (tmp / CHECKSUM).write_text(f"{sha256_file(tmp / 'state.pt')}  state.pt\n")
    run.step = state.step


def save_best(run: RunFolder, record: dict, saved: tuple) -> None:
    """best/: the encoder (and MLP) as a model folder (`saved`: encoder, tokenizer, pooler, mlp), with the
    flags and its dev figures, which carry the run's identity (rule 4 reads them back)."""
    extra = {"args.json": flags_of(run.args), "dev_metrics.json": {**record, "run": identity(run)}}
    with writing(str(run.out / "best"), run.kept):
        save_pretrained_dir(run.out / "best", *saved, extra=extra)


def drop_last(run: RunFolder) -> None:
    """Rule 5: a finished run (or stage) keeps best/ and its records; last/ only served to continue it."""
    if run.main:
        shutil.rmtree(run.out / "last", ignore_errors=True)


# -------------------------------------------------------------------------------------
# Rule 2: reading last/ back, verified
# -------------------------------------------------------------------------------------

def load_last(run: RunFolder) -> Checkpoint | None:
    """--resume: last/'s checkpoint, verified in this order (its checksum, then data only, then the run's
    identity), or None for a run stopped before its first one (its log emptied: it starts from step 0).
    The checksum comes first because torch.load of a damaged file may fail in any way, or not at all."""
    last = run.out / "last" / "state.pt"
    if not last.exists():
        if run.main:
            cut_log(run, 0)
            print(f"no checkpoint in {last.parent} yet: training starts from step 0", file=sys.stderr)
        return None
    recorded, whole = last.with_name(CHECKSUM), (
        f"If you know state.pt is whole, write its checksum again (`sha256sum state.pt > {CHECKSUM}` in "
        f"{last.parent}); else train the run again in another --output_dir.")
    try:
        digest = (recorded.read_bytes().split() or [b""])[0]
    except OSError:
        digest = b""
    if not re.fullmatch(rb"[0-9a-f]{64}", digest):
        raise UserError(f"{recorded}: missing, or not a SHA-256 line, so {last} cannot be shown whole; "
                        f"both are left as they are. {whole}")
    if digest.decode() != sha256_file(last):       # damaged on the disk, or replaced: not unpickled
        raise UserError(damaged(run, f"its SHA-256 is not the one in {CHECKSUM}, written with it: "
                                     f"damaged on the disk, or replaced"))
    try:    # onto the CPU: the random states stay CPU byte tensors; load_state_dict moves the rest
        state = torch.load(last, map_location="cpu", weights_only=True)
    except Exception as e:      # not a checkpoint: UnpicklingError, EOFError, IndexError, struct.error
        raise UserError(damaged(run, e))
    if not isinstance(state, dict) or not NEEDED <= state.keys():
        raise UserError(damaged(run, "it lacks what a checkpoint of this version holds"))
    if diffs := not_mine(run, state["run"]):
        raise UserError(damaged(run, f"it is another run's checkpoint: {', '.join(diffs[:4])}"))
    names = {f.name for f in dataclasses.fields(Checkpoint)}
    return Checkpoint(**{k: v for k, v in state.items() if k in names})


@contextlib.contextmanager
def restoring(run: RunFolder):
    """Where train() puts last/'s state back: a state that does not fit the model (another model's, one
    of other shapes) is the one line of damaged(), not a traceback."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise UserError(damaged(run, e)) from e


def resumed(run: RunFolder, state: Checkpoint, saved: tuple) -> None:
    """After train() put `state` back: best/ checked (rule 4: lost, or another run's: one line; one that
    fell behind last/ saved again from `saved`), the log cut back to last/'s length (rule 1)."""
    step, best_step = state.step, state.best_step
    problem = best_problem(run, best_step, state.best) if run.main and best_step else None
    if problem and (best_step != step or "another run's" in problem):
        lost = f" The model of step {best_step}, the best STS-B dev, was kept only there (last/ holds " \
               f"step {step})." if best_step != step else ""
        raise UserError(f"{run.out / 'best'}: {problem}.{lost} Train the run again in another "
                        f"--output_dir (or move {run.out} away first).")
    if run.main:
        cut_log(run, state.log_bytes)
        if problem:     # best/ is of the step last/ holds: the same model, saved again
            save_best(run, state.dev, saved)
        print(f"resuming {run.out} at step {step} (best STS-B dev {state.best:.2f} at step "
              f"{best_step})", file=sys.stderr)
    run.step = step


def cut_log(run: RunFolder, size: int) -> None:
    """metrics.jsonl cut back to its length when last/ was written, to the end of a whole line: the steps
    after the checkpoint are trained again, and logged once."""
    if not os.path.lexists(run.log):
        return
    with writing(str(run.log), run.kept), run.own_log("rb+") as f:
        log = f.read()
        if len(log) < size:
            print(f"note: {run.log} is shorter than when {run.out / 'last'} was written (edited or "
                  f"replaced?); it is kept as it is, but for a last line cut short", file=sys.stderr)
        os.ftruncate(f.fileno(), log.rfind(b"\n", 0, size) + 1)


def damaged(run: RunFolder, e: Exception | str) -> str:
    """The one line for a last/state.pt that cannot be this run's checkpoint (`e`: why), saying what is
    still good: a user who cannot continue keeps the best model and the log."""
    last = run.out / "last" / "state.pt"
    reason = e if isinstance(e, str) else (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    if "Weights only load failed" in str(e):
        reason = "it holds objects other than tensors and numbers, which loading would run as code"
    try:
        step = read_json_object(run.out / "best" / "dev_metrics.json")["step"]
    except (ValueError, KeyError):
        step = None
    good = f"{run.out / 'best'} (the model of step {step}) and " if step is not None else ""
    return (f"{last}: not a checkpoint of this run ({reason}). Still good, and left as they are: "
            f"{good}{run.log}. This run cannot continue from it: train it again in another "
            f"--output_dir (or move {run.out} away first).")


# -------------------------------------------------------------------------------------
# Rule 4: best/, shown to be this run's
# -------------------------------------------------------------------------------------

def best_problem(run: RunFolder, best_step: int, best: float) -> str | None:
    """What is wrong with best/ as this run's model of step `best_step` (STS-B dev `best`), or None."""
    folder = run.out / "best"
    if problem := model_folder_problem(folder):
        return problem
    try:
        saved = read_json_object(folder / "dev_metrics.json")
    except ValueError:
        return f"{folder / 'dev_metrics.json'} is missing or damaged"
    if diffs := not_mine(run, saved.get("run")):
        return f"it is another run's model ({', '.join(diffs[:3])})"
    if saved.get("step") != best_step or saved.get("stsb_dev") != best:
        return f"it holds the model of step {saved.get('step')} (STS-B dev {saved.get('stsb_dev')}), " \
               f"not of step {best_step} ({best})"
    return None


def verified_best(run: RunFolder, best_step: int, best: float) -> Path:
    """best/, shown to be this run's model of step `best_step`: what the final report loads."""
    if problem := best_problem(run, best_step, best):
        raise UserError(f"{run.out / 'best'}: {problem}. This run's best model is lost: train the run "
                        f"again in another --output_dir.")
    return run.out / "best"


def finished(run: RunFolder) -> dict | None:
    """Rule 5: the final figures of a run that had ended (best/test_metrics.json), once best/ is shown to
    be this run's model; None for a run that goes on."""
    best = run.out / "best"
    try:
        figures, dev = (read_json_object(best / f"{n}_metrics.json") for n in ("test", "dev"))
    except ValueError:
        return None
    if diffs := not_mine(run, dev.get("run")):
        raise UserError(f"{best}: not this run's model ({', '.join(diffs[:3])}); it is left as it is. "
                        f"Train the run again in another --output_dir.")
    return figures
