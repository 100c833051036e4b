"""last/ and best/: what a checkpoint holds, whose it is, how it is written, and how it is read back.

train() (common.py) decides what a checkpoint keeps, which model is best and when to stop; this module
writes them and reads them back. A change to how checkpoints are written opens this file and train().

    last/state.pt   a Checkpoint: the model, AdamW and its schedule, the loop's state, the random
                    state, rcl.py's early stop; the log's length when written
    best/           the best model by STS-B dev, as a model folder (plumbing/export.py), with
                    args.json and dev_metrics.json (its step and dev figures)

The rules, and the function that keeps each:
1. One commit point (save_last): last/ is swapped in whole, after the log it refers to is synced, so a
   kill at any moment leaves the old checkpoint or the new one, and --resume cuts the log back to the
   checkpoint's length (resumed, cut_log): the log reads as one run.
2. Nothing is used before it is verified (load_last): loaded as data only (weights_only, so a pickle
   never runs code), and it must hold a Checkpoint's fields. A checkpoint that fails either is one line
   that says what is still good (damaged); nothing is changed. NOTE(ours): a state whose tensors do not
   fit the model could only be made by hand (run.json holds --resume to the same flags and code).
3. Whose checkpoint it is, is the run folder's to say: --resume is refused unless the flags, the data
   and the code are the ones run.json recorded (run_folder.py's rule 3), and a folder holds only what
   its own run wrote. NOTE(ours): a last/ or best/ copied in by hand from another run is not caught;
   an earlier version checked an identity kept in each checkpoint, a guard against the hand alone.
4. best/ is what last/ says it is (best_problem): the model of the best step, with its figure. On
   --resume a best/ that fell behind last/ (a kill between the two saves) is saved again from the
   model (resumed); one that cannot be made again (an earlier step's) is refused. The final report
   loads best/ only once it holds the step last/ names (verified_best).
5. A finished run drops last/ (drop_last): the weights and AdamW's moments, about 3x the model, only
   served to continue it; best/ and the record stay. A --resume of it shows its figures (finished).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from plumbing.atomic_writes import atomic_dir, sync_to_disk
from plumbing.errors import UserError, writing
from plumbing.export import save_pretrained_dir
from plumbing.flags import flags_of
from plumbing.inputs import read_json_object

RunFolder = Any                 # plumbing/run_folder.py's, which imports this module
# this version's record (run.json) and checkpoints: the code that ran, every input. An earlier version's
# recorded less, so it cannot be shown to be the same run: refused with what to do
FORMAT = 3


@dataclasses.dataclass
class Checkpoint:
    """What last/state.pt holds: all that train() needs to go on as if the run had not stopped. train()
    fills the first fields; save_last adds the last one. Saved as a dict, which weights_only reads."""
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
    log_bytes: int = 0              # metrics.jsonl's length when it was written: --resume cuts back to it


# -------------------------------------------------------------------------------------
# Rules 1 and 4: writing last/ and best/
# -------------------------------------------------------------------------------------

def save_last(run: RunFolder, state: Checkpoint) -> None:
    """Rule 1: `state` with the log's length, the log synced first (a --resume cuts the log back to that
    length, so the log must hold it on the disk)."""
    with writing(str(run.log), run.kept):
        sync_to_disk(run.log)
    state = dataclasses.replace(state, log_bytes=run.log.stat().st_size)
    with writing(str(run.out / "last"), run.kept), atomic_dir(run.out / "last") as tmp:
        with open(tmp / "state.pt", "wb") as f:
            # a file, not a path: the system's error (ENOSPC, ...) reaches here, not torch's own words
            torch.save({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, f)
    run.step = state.step


def save_best(run: RunFolder, record: dict, saved: tuple) -> None:
    """best/ as a model folder (`saved`: encoder, tokenizer, pooler, mlp), with the flags and its dev
    figures."""
    extra = {"args.json": flags_of(run.args), "dev_metrics.json": record}
    with writing(str(run.out / "best"), run.kept):
        save_pretrained_dir(run.out / "best", *saved, extra=extra)


def drop_last(run: RunFolder) -> None:
    """Rule 5, for a run or a stage."""
    if run.main:
        shutil.rmtree(run.out / "last", ignore_errors=True)


# -------------------------------------------------------------------------------------
# Rule 2: reading last/ back, verified
# -------------------------------------------------------------------------------------

def load_last(run: RunFolder) -> Checkpoint | None:
    """Rule 2 on --resume: last/'s checkpoint, or None for a run stopped before its first one (its log
    emptied: it starts from step 0)."""
    last = run.out / "last" / "state.pt"
    if not last.exists():
        if run.main:
            cut_log(run, 0)
            print(f"no checkpoint in {last.parent} yet: training starts from step 0", file=sys.stderr)
        return None
    try:    # onto the CPU: the random states stay CPU byte tensors; load_state_dict moves the rest
        return Checkpoint(**torch.load(last, map_location="cpu", weights_only=True))
    except Exception as e:      # UnpicklingError, EOFError, struct.error; TypeError: other fields
        raise UserError(damaged(run, e))


def resumed(run: RunFolder, state: Checkpoint, saved: tuple) -> None:
    """After train() put `state` back: rule 4 for best/ (saved again from `saved` where it fell behind),
    rule 1 for the log."""
    step, best_step = state.step, state.best_step
    problem = best_problem(run, best_step, state.best) if run.main and best_step else None
    if problem and best_step != step:
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
    """Rule 1: the log cut back to last/'s `size`, to the end of a whole line: the steps after the
    checkpoint are trained again, and logged once."""
    if not os.path.lexists(run.log):
        return
    with writing(str(run.log), run.kept), open(run.log, "rb+") as f:
        os.ftruncate(f.fileno(), f.read().rfind(b"\n", 0, size) + 1)


def damaged(run: RunFolder, e: Exception) -> str:
    """Rule 2's line for a last/state.pt that is not this run's checkpoint (`e`: why)."""
    last = run.out / "last" / "state.pt"
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return (f"{last}: not a checkpoint of this run ({reason}). Still good, and left as they are: "
            f"{run.out / 'best'} (its dev_metrics.json names its step) and {run.log}. This run cannot "
            f"continue from it: train it again in another --output_dir (or move {run.out} away first).")


# -------------------------------------------------------------------------------------
# Rule 4: best/, shown to be this run's
# -------------------------------------------------------------------------------------

def best_problem(run: RunFolder, best_step: int, best: float) -> str | None:
    """What is wrong with best/ as this run's model of step `best_step` (STS-B dev `best`), or None."""
    folder = run.out / "best"
    try:
        saved = read_json_object(folder / "dev_metrics.json")
    except ValueError:
        return f"{folder / 'dev_metrics.json'} is missing or damaged"
    if saved.get("step") != best_step or saved.get("stsb_dev") != best:
        return f"it holds the model of step {saved.get('step')} (STS-B dev {saved.get('stsb_dev')}), " \
               f"not of step {best_step} ({best})"
    return None


def verified_best(run: RunFolder, best_step: int, best: float) -> Path:
    """best/, shown to hold this run's model of step `best_step`, for the final report."""
    if problem := best_problem(run, best_step, best):
        raise UserError(f"{run.out / 'best'}: {problem}. This run's best model is lost: train the run "
                        f"again in another --output_dir.")
    return run.out / "best"


def finished(run: RunFolder) -> dict | None:
    """Rule 5: a finished run's figures (best/test_metrics.json); None for a run that goes on."""
    try:
        return read_json_object(run.out / "best" / "test_metrics.json")
    except ValueError:
        return None
