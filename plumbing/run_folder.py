"""The run folder (--output_dir): one process holds it; its record (args.json, run.json: the flags
and a fingerprint of the data) is written once and --resume is held to it; metrics.jsonl is only
appended to; last/ is the one commit point (the checkpoint train() builds, with a checksum beside
it, refused if it carries another run's identity); best/ is the model train() chose; a run that
trains several models (rcl.py) keeps each in a stage of its own. The folder holds only what its
run wrote: an entry that is a link (or a pipe, a device) is refused, nothing is written through
one. Every write ends, if the system refuses it, in one line that names what is intact."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import torch

from plumbing import atomic_writes, interrupts
from plumbing.atomic_writes import atomic_dir, recover_dir, sha256_file, sync_to_disk, write_text_atomic
from plumbing.errors import UserError, writing
from plumbing.export import save_pretrained_dir
from plumbing.flags import NOT_TRAINING, script_name
from plumbing.inputs import model_folder_problem, read_json_object
from plumbing.ranks import barrier, world

try:
    import fcntl  # POSIX: the run-folder lock (hold_run_folder)
except ImportError:                    # Windows
    fcntl = None

CHECKSUM = "state.pt.sha256"    # beside last/state.pt: the SHA-256 of its bytes, checked by --resume
DONE = "DONE.json"              # a stage's summary, written once the stage is complete
LOCK = "run.lock"               # names the process that holds the folder

# the run folder whose record (args.json) common.start wrote for this command, if any: what a
# failed write or a Ctrl-C says is intact and what to run next
recorded_run: Path | None = None
# the run folder a --resume command goes on with, until its record is checked: a stop before
# then changed nothing in it
resuming: Path | None = None
NO_CHECKPOINT = "no checkpoint was written yet"


def intact(step: int, last: Path) -> str:
    return f"the last complete checkpoint, step {step}, is intact in {last}"


def checkpoint_kept(out: str | Path | None) -> str:
    """What a failed write leaves intact in run folder `out`: last/'s step (read without its
    tensors), or that no checkpoint was written yet."""
    if out is None or not (last := Path(out) / "last" / "state.pt").is_file():
        return NO_CHECKPOINT
    try:
        step = torch.load(last, map_location="cpu", mmap=True, weights_only=True)["step"]
    except Exception:
        return f"{last.parent} is as it was"
    return intact(step, last.parent)


def recorded() -> Path | None:
    """The run folder this command recorded, once its record (args.json) is there: the folder
    --resume accepts. None before (--resume would be refused: the same command starts the run)."""
    return recorded_run if recorded_run is not None and (recorded_run / "args.json").is_file() else None


def next_command() -> str:
    """What to run once a command stopped by a failed write can go on."""
    return "the same command plus --resume continues" if recorded() else "the same command starts the run"



# -------------------------------------------------------------------------------------
# One process a run folder; the run's record
# -------------------------------------------------------------------------------------

# the run folders this process holds: resolved path -> (the folder's descriptor, the open lock file);
# their flocks live with them
held_locks: dict[str, tuple[int, Any]] = {}


def _in_use(folder: str | Path) -> UserError:
    """The line for a folder another process holds, named by run.lock (read without following a link)."""
    try:
        with open(Path(folder) / LOCK, opener=atomic_writes.no_follow) as f:
            holder = f.read().strip()
    except (OSError, ValueError):
        holder = ""
    return UserError(f"--output_dir {folder} is in use by {holder or 'another process'}. One process at a "
                     f"time trains in a run folder: wait for that one to end (or stop it), then continue "
                     f"the run with --resume; or choose another --output_dir.")


def hold_run_folder(folder: str | Path) -> None:
    """Take `folder` for this process: a flock on the folder itself and on <folder>/run.lock (which
    names this process), both dropped by the system when the process ends however it ends (kill -9
    too), so a dead run blocks no --resume, and a run.lock deleted under a live run frees nothing.
    A second process stops here, told which process holds it; a folder that cannot be written, or
    whose run.lock is a link, refuses the command. The stages inside a run folder are held with it.
    NOTE(ours): no fcntl (Windows), no lock; a file system that cannot lock a folder (NFS) is held
    by run.lock alone."""
    key = str(Path(folder).resolve())
    if key in held_locks or fcntl is None:
        return
    unwritable = f"--output_dir {folder}: cannot be written ({{}}). Choose a folder you can write to."
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise UserError(unwritable.format(e.strerror or e))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(folder) from None
        except OSError:
            pass                           # a folder this file system cannot lock: run.lock alone
        if problem := strange_entry(Path(folder) / LOCK):
            raise problem
        try:                               # "a+": a process that loses leaves the holder's line
            f = open(Path(folder) / LOCK, "a+", opener=atomic_writes.no_follow)
        except OSError as e:
            raise UserError(unwritable.format(e.strerror or e))
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise _in_use(folder) from None
        try:
            f.truncate(0)
            f.write(f"process {os.getpid()} ({shlex.join([Path(sys.executable).name] + sys.argv)})\n")
            f.flush()
        except OSError as e:            # a full disk: the lock's line is the run's first write
            with contextlib.suppress(OSError):
                (Path(folder) / LOCK).unlink()        # held: no other process has its line there
            with contextlib.suppress(OSError):
                f.close()
            raise UserError(unwritable.format(e.strerror or e))
    except BaseException:
        os.close(fd)
        raise
    held_locks[key] = (fd, f)


def release_run_folders(*folders: str | Path) -> None:
    """Let go of the given run folders (all, with none given): a process training several runs."""
    for k in [str(Path(f).resolve()) for f in folders] if folders else list(held_locks):
        if k in held_locks:
            fd, f = held_locks.pop(k)
            f.close()                   # closing drops the flocks
            os.close(fd)


def strange_entry(path: Path) -> UserError | None:
    """The refusal of an entry of a run folder that its run cannot have written (a symbolic link,
    a pipe, a device), or None: a run writes nothing through a link, and trusts nothing it did not
    write."""
    if not os.path.lexists(path):
        return None
    mode = os.lstat(path).st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    what = f"a symbolic link (to {os.readlink(path)})" if stat.S_ISLNK(mode) else \
        "not a file or a folder (a pipe, a device or a socket)"
    folder = next((p for p in path.parents if str(p.resolve()) in held_locks), path.parent)
    return UserError(f"--output_dir {folder}: {path} is {what}. A run folder holds only what its own "
                     f"run wrote, and a run never writes through a link: remove it (or put a copy of "
                     f"what it points to in its place), or choose another --output_dir.")


def prepare_output_dir(output_dir: str | Path, resume: bool) -> Path:
    """Hold the run folder (a second process stops here); refuse a folder with an entry that is a
    link, an earlier run's folder unless --resume, and a folder that cannot be written."""
    out = Path(output_dir)
    new = not out.exists()
    try:
        hold_run_folder(out)
    except UserError:
        if new:                                     # the folder this call made, if it is empty
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    started = (out / "args.json").exists() or (out / "metrics.jsonl").exists()
    stages = any(out.glob("*/metrics.jsonl")) or any(out.glob(f"*/{DONE}"))      # rcl.py's entropy models
    linked = next((e for root, dirs, files in os.walk(out) for name in dirs + files
                   if (e := strange_entry(Path(root) / name))), None)
    if linked is not None:
        error = linked
    elif not resume and ((out / "metrics.jsonl").exists() or (out / "best").exists() or stages):
        error = UserError(f"--output_dir {out} already holds a run. Add --resume to continue it, or "
                          f"choose another --output_dir (or delete the folder) to start afresh.")
    # a run stopped before its first checkpoint resumes from step 0 (train() empties its log)
    elif resume and not (out / "last" / "state.pt").exists() and not (out / ".last.old").exists() \
            and not started:
        error = UserError(f"--resume: no checkpoint to resume in {out / 'last'}. Run without "
                          f"--resume to start, or point --output_dir at the earlier run.")
    elif not os.access(out, os.W_OK):
        error = UserError(f"--output_dir {out}: cannot be written. Choose a folder you can write to.")
    else:
        return out
    if new:                                         # the folder this call made for its lock
        release_run_folders(out)
        shutil.rmtree(out, ignore_errors=True)
    raise error


def read_record(path: Path, remedy: str = "Put the file back, or train the run again in another "
                                          "--output_dir.") -> dict:
    """A JSON object of the run's record (args.json, run.json, a stage's DONE.json), or one line
    that names it as damaged, and what to do (`remedy`)."""
    try:
        return read_json_object(path)
    except ValueError as e:
        raise UserError(f"{path}: cut short or damaged ({e}), and left as it is: what this run was cannot "
                        f"be checked against it. {remedy}")


@functools.lru_cache(maxsize=4)
def _fingerprint(path: str, stamp: tuple) -> str:
    return sha256_file(path)


def data_fingerprint(path: str | Path) -> str:
    """The SHA-256 of --data's content, computed once while the file is unchanged."""
    st = os.stat(path)
    return _fingerprint(str(Path(path).resolve()), (st.st_size, st.st_mtime_ns, st.st_ino))


def training_flags(args: Any) -> dict:
    """The flags that say what a run trains, as args.json holds them: all but NOT_TRAINING, and
    --data, whose content the identity holds (its fingerprint), not its path."""
    flags = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    return {k: v for k, v in flags.items() if k not in (*NOT_TRAINING, "data")}


def record_run(out: Path, args: Any) -> None:
    """args.json (the flags) and run.json (the script, and a fingerprint of --data's content)
    are written once, when the run starts. On --resume the command is held to them first:
    any flag but those of NOT_TRAINING, or other data, stops it before anything is written."""
    flags = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    run = {"script": f"{script_name(args)}.py", "data_sha256": data_fingerprint(args.data)}
    if args.resume and (out / "args.json").is_file():
        then = read_record(out / "args.json")
        then_run = read_record(out / "run.json") if (out / "run.json").is_file() else {}
        diffs = [f"  --{k}: the run has {then.get(k)!r}, this command {v!r}" for k, v in flags.items()
                 if k not in NOT_TRAINING and then.get(k) != v]
        if then_run.get("data_sha256", run["data_sha256"]) != run["data_sha256"]:
            diffs.append(f"  --data {args.data}: its content is not the data the run started with")
        if then_run.get("script", run["script"]) != run["script"]:
            diffs.append(f"  the script: the run is {then_run['script']}'s, this command {run['script']}")
        if diffs:
            raise UserError(f"--resume: this command would train another run than the one in {out}, "
                            f"which is left as it is:\n" + "\n".join(diffs) + "\nTo train with these "
                            "flags, start a new run: leave out --resume and --output_dir (the default "
                            "folder is named after the flags) or give another --output_dir.")
        if then_run:
            return
        # a folder from before run.json: its data cannot be checked; from now on it is held to these
        print(f"note: {out} has no run.json (written by an earlier version): --data {args.data} cannot be "
              f"checked against the data the run started with; its fingerprint is recorded now",
              file=sys.stderr)
        with writing(str(out / "run.json"), checkpoint_kept(out)):
            write_text_atomic(out / "run.json", json.dumps(run, indent=2))
        return
    # run.json first, and no args.json of an earlier start left beside it: a folder whose args.json
    # --resume accepts always holds the fingerprint of the data that run trained on
    (out / "args.json").unlink(missing_ok=True)
    for name, record in (("run.json", run), ("args.json", flags)):
        with writing(str(out / name), NO_CHECKPOINT, "the same command starts the run"):
            write_text_atomic(out / name, json.dumps(record, indent=2))


def open_run(args: Any) -> None:
    """common.start's last step, on rank 0: hold --output_dir, check or write its record, put back
    what a kill between two renames left; every rank then waits. From here a failed write or a
    Ctrl-C names this folder (recorded_run)."""
    if world()[0] == 0:
        out = prepare_output_dir(args.output_dir, args.resume)
        record_run(out, args)
        recover_dir(out / "best")
        recover_dir(out / "last")
    barrier()
    global recorded_run
    recorded_run = Path(args.output_dir)


def held_to_record(folder: Path) -> bool:
    """Whether `folder` is the run this command recorded (its flags held to args.json), or a stage of it."""
    run = recorded()
    return run is not None and run.resolve() in (folder.resolve(), folder.resolve().parent)


def run_identity(args: Any) -> dict:
    """What makes a run this run, which train() puts into each checkpoint: its script, its stage
    (rcl.py's entropy models: the folder's name inside the recorded run; "" for the run itself),
    the flags that say what it trains, and its data's fingerprint."""
    out, run = Path(args.output_dir).resolve(), recorded_run
    stage = out.name if run is not None and out.parent == run.resolve() else ""
    return {"script": f"{script_name(args)}.py", "stage": stage, "data_sha256": data_fingerprint(args.data),
            "flags": training_flags(args)}


def kept_in(folder: Path) -> str:
    """What a failed write in `folder` leaves intact: its last checkpoint and, for a stage of the
    recorded run, the stages already complete beside it."""
    kept = checkpoint_kept(folder)
    if recorded_run is None or folder.parent != recorded_run:
        return kept
    kept += f" in {folder.name}" if kept == NO_CHECKPOINT else ""
    finished = [d.name for d in sorted(folder.parent.iterdir()) if (d / DONE).is_file()]
    return kept + (f"; finished and kept: {', '.join(finished)}" if finished else "")


def write_json(path: Path, obj: Any) -> None:
    """A small JSON file of the run, written whole or not at all; a failed write: one line."""
    with writing(str(path)):
        write_text_atomic(path, json.dumps(obj, indent=2))


# -------------------------------------------------------------------------------------
# What train() keeps: the log, last/, best/
# -------------------------------------------------------------------------------------

# what every checkpoint holds, whichever version of this code wrote it
CHECKPOINT_KEYS = {"model", "opt", "sched", "step", "best", "best_step", "dev", "log_bytes", "rng_cpu"}


class RunFolder:
    """Where train() keeps what it decided: metrics.jsonl (appended to only), last/ (the checkpoint
    train() builds: all --resume needs, the one commit point) and best/ (the model it chose).
    `saved`: (encoder, tokenizer, pooler, mlp) for best/. Rank 0 writes. Each write: a signal whose
    exception was dropped stops the run first; a write the system refuses ends it in one line."""

    def __init__(self, args: Any, saved: tuple):
        self.args, self.saved = args, saved
        self.out = Path(args.output_dir)
        self.log = self.out / "metrics.jsonl"
        self.main = world()[0] == 0
        self.kept = kept_in(self.out)            # what a failed write leaves intact
        self.identity = run_identity(args)

    def write(self, record: dict) -> None:
        """One record of metrics.jsonl."""
        interrupts.stop_if_signalled()
        if self.main:
            with writing(str(self.log), self.kept), open(self.log, "a", opener=atomic_writes.no_follow) as f:
                f.write(json.dumps(record) + "\n")

    def save_last(self, state: dict) -> None:
        """last/, the one commit point: `state` (train()'s checkpoint) with the log's length, the log
        synced first (a resume cuts the log back there), its SHA-256 beside it; swapped in whole."""
        interrupts.stop_if_signalled()
        with writing(str(self.log), self.kept):
            sync_to_disk(self.log)
        state = {**state, "log_bytes": self.log.stat().st_size}
        with writing(str(self.out / "last"), self.kept), atomic_dir(self.out / "last") as tmp:
            with open(tmp / "state.pt", "wb") as f:
                torch.save(state, f)    # a file, not a path: the system's error (ENOSPC, ...) reaches here
            # its fingerprint, swapped in with it (`sha256sum -c state.pt.sha256` in last/ checks it too)
            (tmp / CHECKSUM).write_text(f"{sha256_file(tmp / 'state.pt')}  state.pt\n")
        self.kept = intact(state["step"], self.out / "last")

    def save_best(self, record: dict) -> None:
        """best/: the encoder (and MLP) as a model folder, with the flags and its dev figures."""
        interrupts.stop_if_signalled()
        extra = {"args.json": dataclasses.asdict(self.args), "dev_metrics.json": record}
        with writing(str(self.out / "best"), self.kept):
            save_pretrained_dir(self.out / "best", *self.saved, extra=extra)

    def load_last(self) -> dict | None:
        """--resume: the checkpoint save_last() kept, or None for a run stopped before its first one
        (its log emptied: training starts from step 0). Data only (weights_only), its checksum and
        the run's identity checked: anything else ends here in one line, the folder as it was."""
        last = self.out / "last" / "state.pt"
        if not last.exists():
            if self.main:
                self.cut_log(0)
                print(f"no checkpoint in {last.parent} yet: training starts from step 0", file=sys.stderr)
            return None
        try:
            # onto the CPU: the RNG states must stay CPU byte tensors (set_rng_state refuses
            # others), and load_state_dict copies weights and AdamW's moments to the model's device
            state = torch.load(last, map_location="cpu", weights_only=True)
        except Exception as e:      # no checkpoint: UnpicklingError, EOFError, IndexError, struct.error
            raise UserError(self.damaged(last, e))
        self.check_sum(last)
        if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
            raise UserError(self.damaged(last, "it lacks what a checkpoint holds"))
        self.check_identity(last, state.get("run"))
        return state

    def check_sum(self, last: Path) -> None:
        """Bytes damaged on the disk (tensor data load without a word) or another file put in its
        place. A checkpoint of an earlier version of this code has no checksum beside it."""
        recorded = last.with_name(CHECKSUM)
        if not recorded.is_file():
            return
        digest = (recorded.read_bytes().split() or [b""])[0]
        if not re.fullmatch(rb"[0-9a-f]{64}", digest):
            raise UserError(f"{recorded}: not a SHA-256 line (empty, or damaged), so {last} cannot be "
                            f"checked against it; both are left as they are. If you know state.pt is "
                            f"whole, delete {recorded.name} and --resume loads it unchecked; else train the "
                            f"run again in another --output_dir.")
        if digest.decode() != sha256_file(last):
            raise UserError(self.damaged(last, f"its SHA-256 is not the one in {recorded.name}, written with "
                                               f"it: damaged on the disk, or replaced"))

    def check_identity(self, last: Path, then: Any) -> None:
        """The checkpoint is this run's: the same script, stage and data, and (in a folder whose
        record this command was held to) the same training flags. One written before checkpoints
        carried an identity is taken as this run's, with a note."""
        if then is None:
            print(f"note: {last} carries no run identity (an earlier version wrote it): it cannot be "
                  f"checked to be this run's; the next checkpoint carries it", file=sys.stderr)
            return
        now, then = self.identity, then if isinstance(then, dict) else {}
        diffs = []
        if then.get("script") != now["script"]:
            diffs.append(f"the script {then.get('script')}")
        if then.get("stage") != now["stage"]:
            diffs.append(f"the stage {then['stage']}" if then.get("stage") else "the run's own model")
        if then.get("data_sha256") != now["data_sha256"]:
            diffs.append("other data")
        if held_to_record(self.out):        # the record held this command's flags: so is last/
            flags = then.get("flags") or {}
            diffs += [f"--{k} {flags.get(k)!r} (this run: {v!r})" for k, v in now["flags"].items()
                      if flags.get(k) != v]
        if diffs:
            raise UserError(self.damaged(last, f"it is another run's checkpoint: {', '.join(diffs[:4])}"))

    @contextlib.contextmanager
    def restoring(self):
        """The block where train() puts last/'s state back into the model, AdamW, the schedule and
        the RNGs: a state that does not fit them (another model's weights, an RNG state of another
        kind) ends in one line; nothing in the folder has changed yet."""
        try:
            yield
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise UserError(self.damaged(self.out / "last" / "state.pt", e)) from e

    def resumed(self, state: dict) -> None:
        """After train() put last/'s `state` back: best/ checked first (the model of an earlier step,
        missing or damaged, is lost: one line; one that fell behind last/ is saved again from the
        restored model), then the log cut back to last/'s length, so it reads as one run."""
        step, best_step = state["step"], state["best_step"]
        problem = self.best_problem(best_step) if self.main and best_step else None
        if problem and best_step != step:
            raise UserError(f"{self.out / 'best'}: {problem}. The model of step {best_step}, the best STS-B "
                            f"dev, was kept only there (last/ holds step {step}). Train the run again in "
                            f"another --output_dir (or move {self.out} away first).")
        if self.main:
            self.cut_log(state["log_bytes"])
            if problem:
                self.save_best(state["dev"])
            print(f"resuming {self.out} at step {step} (best STS-B dev {state['best']:.2f} at step "
                  f"{best_step})", file=sys.stderr)
        self.kept = intact(step, self.out / "last")

    def best_problem(self, best_step: int) -> str | None:
        """What is wrong with best/ as the model of step `best_step`, or None."""
        best = self.out / "best"
        if problem := model_folder_problem(best):
            return problem
        try:
            saved = json.loads((best / "dev_metrics.json").read_bytes())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{best / 'dev_metrics.json'} is missing or damaged"
        return None if saved == best_step else f"it holds the model of step {saved}, not of step {best_step}"

    def cut_log(self, size: int) -> None:
        """metrics.jsonl cut back to `size` bytes (its length when last/ was written: records of
        steps trained again go), and a last line cut short dropped, so that the next record starts a
        line of its own."""
        if not os.path.lexists(self.log):
            return
        with writing(str(self.log), self.kept), open(self.log, "rb+", opener=atomic_writes.no_follow) as f:
            now = os.fstat(f.fileno()).st_size
            if now < size:
                print(f"note: {self.log} is shorter than when {self.out / 'last'} was written (edited or "
                      f"replaced?); it is kept as it is, but for a last line cut short", file=sys.stderr)
            keep = min(size, now)
            while keep > 0:                    # back to the end of the last whole line
                f.seek(max(0, keep - 4096))
                tail = f.read(keep - max(0, keep - 4096))
                if b"\n" in tail:
                    keep = max(0, keep - 4096) + tail.rindex(b"\n") + 1
                    break
                keep = max(0, keep - 4096)
            os.ftruncate(f.fileno(), keep)

    def damaged(self, last: Path, e: Exception | str) -> str:
        """The one line for a last/state.pt that cannot be this run's checkpoint (`e`: why)."""
        reason = e if isinstance(e, str) else str(e).strip().splitlines()[0][:160] if str(e).strip() \
            else type(e).__name__
        if "Weights only load failed" in str(e):
            reason = "it holds objects other than tensors and numbers, which loading would run as code"
        best = self.out / "best" / "dev_metrics.json"
        try:
            good = f"{best.parent} (the model of step {json.loads(best.read_bytes())['step']}) and "
        except (OSError, ValueError, KeyError, TypeError):
            good = ""
        return (f"{last}: not a checkpoint of this run ({reason}). Still good, and left as they are: "
                f"{good}{self.log}. This run cannot continue from it: train it again in another "
                f"--output_dir (or move {self.out} away first).")

    def nan_error(self, step: int, best_step: int) -> UserError:
        """The line for a loss that became NaN or infinite: training stops, best/ is what is kept."""
        kept = f"is kept in {self.out / 'best'}" if best_step else "was not saved yet"
        return UserError(f"the loss became NaN or infinite by step {step}. Training stopped; the best "
                         f"checkpoint so far {kept}. Try a lower --lr, or check the data for degenerate "
                         f"lines.")


# -------------------------------------------------------------------------------------
# Stages: a run that trains several models in one folder (rcl.py's entropy models)
# -------------------------------------------------------------------------------------

class Stage:
    """A model a run trains before its own (rcl.py: one entropy model per phi), in a folder of its
    own inside the held run folder, where train() keeps its log, last/ and best/ as for any run.
    finish() completes it: end/ (the weights it ended with), then DONE.json (its summary and the
    settings it was trained with), then last/ dropped. A complete stage is reused by --resume,
    held to those settings; an unfinished one continues from its last/, or starts again."""

    def __init__(self, out: str | Path, name: str, settings: dict):
        self.path = Path(out) / name
        self.settings = settings

    def finished(self) -> dict | None:
        """The summary of this stage completed earlier (its DONE.json), or None. Trained with other
        settings (the seed aside), it is refused rather than reused silently."""
        done = self.path / DONE
        if not done.is_file():
            return None
        again = f"Delete {self.path} to train this model again (the run's other parts are kept), or use " \
                f"another --output_dir."
        summary = read_record(done, again)
        for kept in ("end", "best"):        # the weights a finished stage hands on
            if (problem := model_folder_problem(self.path / kept)) and (self.path / kept).exists():
                raise UserError(f"--resume: {problem}. {again}")
        diff = [k for k in self.settings if k != "seed" and summary.get(k) != self.settings[k]]
        if diff:
            raise UserError(f"--resume: {self.path} was trained with a different "
                            f"{', '.join(f'--{k} ({summary.get(k)})' for k in diff)}. Use another "
                            f"--output_dir, or delete {self.path} to train it again.")
        if world()[0] == 0:
            shutil.rmtree(self.path / "last", ignore_errors=True)   # if a kill came before its removal
        return summary

    def open(self) -> None:
        """Before the stage trains: what a kill during a commit left, put back; a stage killed
        before its first checkpoint, started again; its folder made. Every rank waits."""
        if world()[0] == 0:
            if self.path.exists():
                for kept in ("best", "end"):
                    recover_dir(self.path / kept)
                if not (recover_dir(self.path / "last") / "state.pt").exists():
                    shutil.rmtree(self.path)       # nothing of it to keep
            with writing(str(self.path), kept_in(self.path)):
                self.path.mkdir(parents=True, exist_ok=True)
        barrier()

    def finish(self, summary: dict, encoder, tokenizer, pooler: str) -> None:
        """The stage complete, in the order a kill may interrupt: end/, DONE.json, last/ dropped
        (weights and AdamW's moments, ~3x the model: only an unfinished stage resumes from it).
        Every rank waits."""
        if world()[0] == 0:
            kept = kept_in(self.path)
            with writing(str(self.path / "end"), kept):
                save_pretrained_dir(self.path / "end", encoder, tokenizer, pooler)
            with writing(str(self.path / DONE), kept):
                write_text_atomic(self.path / DONE, json.dumps({**self.settings, **summary}, indent=2))
            shutil.rmtree(self.path / "last", ignore_errors=True)
        barrier()
