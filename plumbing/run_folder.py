"""The run folder (--output_dir): its name, who may write into it, the lock, the record, and the line a
stop ends in. Opened by plumbing/start.py (RunFolder.named, then open), handed down from there: common.start
returns it, common.train writes into it, rcl.py trains its entropy models in its stages (RunFolder.stage).
What a checkpoint holds and how it is read back is plumbing/checkpoint.py's.

    args.json    the flags, as resolved (written last: a folder with args.json holds the whole record)
    run.json     the script, this version's FORMAT, the SHA-256 of the data, of each other input and of
                 each module of the code that ran
    code/        copies of that code, as it ran: what `diff` compares an edit with
    metrics.jsonl, last/, best/   the log and the checkpoints (plumbing/checkpoint.py)
    run.lock     who holds the folder (the lock itself is the system's, on the folder)

The rules, and the function that keeps each:
1. A run writes only into a folder it made, an empty one, or its own run folder, and nothing else is
   in it (refuse_unless_ours, foreign_entry): a mistyped --output_dir (a folder of yours, a home
   folder) is refused, never filled or, worse, cleaned up.
2. A refused command changes nothing on disk: every check comes before the first write (open: the folder
   made, held, checked, then the record; a refusal removes the folder it made).
3. --resume continues this run and no other: the flags, data, inputs, script and code must be the ones
   the record holds (refuse_unless_ours). An edited script is another run: in the default folder it
   goes to a folder of its own (named), so that an edit and its original never mix in one log.
4. One process at a time (hold): the system's lock on the folder, which dies with the process
   (kill -9 too), so a dead run never blocks its --resume.
5. The record tells the truth (write_record): the code as it ran (code_record), not as it is on the
   disk now; written once, when the run starts.
6. A stop or a failed write ends in one line that says what is intact and what to run next (after_a_stop,
   kept, kept_in, next_command); a NaN loss says where the best model is (nan_error).
A run that trains several models (rcl.py) keeps each but its own in a stage (Stage), a folder inside
the run folder with its own log and checkpoints, reused by --resume once finished.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from plumbing import atomic_writes, checkpoint, code_record
from plumbing.atomic_writes import recover_dir, sha256_file, write_text_atomic
from plumbing.checkpoint import FORMAT
from plumbing.errors import UserError, writing
from plumbing.export import save_pretrained_dir
from plumbing.flags import NOT_TRAINING, default_output_dir, flags_of, script_name
from plumbing.inputs import read_json_object
from plumbing.ranks import barrier, world

try:
    import fcntl  # POSIX: the run-folder lock
except ImportError:                    # Windows: no lock
    fcntl = None

DONE = "DONE.json"              # a stage's summary, written once the stage is complete
LOCK = "run.lock"               # names the process that holds the folder
CODE = "code"                   # copies of the files that shape training, as the run started
# what a run writes into its folder, and into a stage's; their hidden temporaries are named after them
RUN_ENTRIES = {"args.json", "run.json", "metrics.jsonl", LOCK, CODE, "last", "best"}
STAGE_ENTRIES = {"metrics.jsonl", "last", "best", "end", DONE}
TEMPORARY = re.compile(r"\.(.+?)(\.old|\.tmp-\w+|\.\d+\.tmp)")
NO_CHECKPOINT = "no checkpoint was written yet"
UNWRITABLE = "--output_dir {}: cannot be written ({}). Choose a folder you can write to."


# -------------------------------------------------------------------------------------
# Naming: the code a run records, and the folder a run goes to
# -------------------------------------------------------------------------------------

def code_files(args: Any) -> dict[str, Path]:
    """The code a run records, by its path in the repository: its script, common.py and plumbing/."""
    return code_record.modules(sys.modules[type(args).__module__].__file__)


def code_of(args: Any) -> dict[str, str]:
    """The SHA-256 of each file of code_files() as it ran: the code's identity."""
    return {name: hashlib.sha256(code_record.ran(p)).hexdigest() for name, p in code_files(args).items()}


def code_id(code: dict[str, str], digits: int = 6) -> str:
    """The hex digits that name a version of the code: a default folder's suffix, compare's label."""
    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()[:digits]


def recorded_code(folder: Path) -> Any:
    """The code a run folder's run.json records, or None where there is none to read."""
    try:
        return read_json_object(folder / "run.json").get("code")
    except ValueError:
        return None


def read_record(path: Path, remedy: str = "Put the file back, or train the run again in another "
                                          "--output_dir.") -> dict:
    """A JSON object of the run's record (args.json, run.json, a stage's DONE.json), or one line
    that names it as damaged, and what to do (`remedy`)."""
    try:
        return read_json_object(path)
    except ValueError as e:
        raise UserError(f"{path}: cut short or damaged ({e}), and left as it is: what this run was cannot "
                        f"be checked against it. {remedy}")


def elsewhere(out: Path) -> str:
    """What to do instead: another folder beside `out` that does not exist yet (out-2, out-3, ...)."""
    out = out if out.name else out / "run"
    k = next(k for k in range(2, 10**6) if not os.path.lexists(out.with_name(f"{out.name}-{k}")))
    return f"choose another --output_dir, e.g. {out.with_name(f'{out.name}-{k}')}"


# -------------------------------------------------------------------------------------
# Admission (rules 1-3): which folders a run may write into
# -------------------------------------------------------------------------------------

def holds_nothing(folder: Path) -> bool:
    """A folder that is not there, or holds only a lock or temporary names (a run stopped at once)."""
    return not os.path.lexists(folder) or folder.is_dir() and not folder.is_symlink() and all(
        p.name == LOCK or TEMPORARY.fullmatch(p.name) for p in folder.iterdir())


def foreign_entry(folder: Path, allowed: set[str], depth: int = 0) -> str | None:
    """The first entry of `folder` that no run writes there (another folder is a stage), or None."""
    for entry in sorted(folder.iterdir()):
        name = m[1] if (m := TEMPORARY.fullmatch(entry.name)) else entry.name
        if name not in allowed and not (depth == 0 and entry.is_dir() and not m
                                          and foreign_entry(entry, STAGE_ENTRIES, 1) is None):
            return f"{entry} is not a file a run writes"
    return None


class RunFolder:
    """This command's run folder, a stage inside it (Stage), or a bare folder (train() called alone, in a
    test). Rank 0 writes."""

    def __init__(self, args: Any, out: str | Path | None = None, stage: str = "", device: Any = None):
        self.args, self.out, self.stage_name = args, Path(out or args.output_dir), stage
        self.device = device                  # set by plumbing/start.py: the one this process trains on
        self.log = self.out / "metrics.jsonl"
        self.main = world()[0] == 0
        self.resuming = bool(getattr(args, "resume", False))
        self.code = code_of(args)
        self.record: dict | None = None       # run.json, once written or held to
        self.lock: int | None = None          # the held folder's (or its run.lock's) descriptor
        self.step: int | None = None          # last/'s, once this process wrote or read it
        self.fresh: Path | None = None        # where this code starts without --resume (the default)
        self._inputs: dict[str, str] = {}     # Args.INPUTS' fingerprints, once read (inputs)

    @functools.cached_property
    def data_sha256(self) -> str:             # read once, after common.start fetched a default file
        return sha256_file(self.args.data)

    @property
    def inputs(self) -> dict[str, str]:
        """The SHA-256 of each file the script trains on beside --data (Args.INPUTS: ifcl.py's German
        file), read once it exists: a file the run makes is fingerprinted before its first checkpoint."""
        for flag in getattr(self.args, "INPUTS", ()):
            path = getattr(self.args, flag)
            if flag not in self._inputs and path and Path(path).is_file():
                self._inputs[flag] = sha256_file(path)
        return self._inputs

    # ---------------------------------------------------------------------------------
    # Naming, admission and the lock (rules 1-4), then the record (rule 5)
    # ---------------------------------------------------------------------------------

    @classmethod
    def named(cls, args: Any) -> RunFolder:
        """Rule 3's naming: --output_dir, or runs/<script>/<the flags that differ>; when that holds a run of
        other code, the one named after this code beside it (runs/simcse/default-code3f2a1c)."""
        run, base = cls(args), Path(default_output_dir(args))
        if not args.output_dir:
            fresh = base.with_name(f"{base.name}-code{code_id(run.code)}")
            mine = [f for f in (base, fresh) if recorded_code(f) == run.code]
            run.out = mine[0] if mine else base if holds_nothing(base) or args.resume else fresh
            args.output_dir, run.log, run.fresh = str(run.out), run.out / "metrics.jsonl", fresh
            if run.out == fresh and run.main:
                print(f"note: {base} holds a run of other code: this one goes to {fresh}", file=sys.stderr)
        return run

    def open(self) -> None:
        """common.start's last step, in rule 2's order: rank 0 holds the folder, checks it, writes the record
        (or, on --resume, puts back what a kill between two renames left). Every rank waits."""
        if self.main:
            made = not os.path.lexists(self.out)
            if made or not self.out.is_dir():
                self.refuse_unless_ours(made)       # --resume of nothing, a file: refused, nothing made
                try:
                    self.out.mkdir(parents=True)
                except OSError as e:
                    raise UserError(UNWRITABLE.format(self.out, e.strerror or e))
            try:
                self.hold()
                self.refuse_unless_ours(made)
                self.write_record()
            except BaseException:
                self.release()
                if made:
                    shutil.rmtree(self.out, ignore_errors=True)
                raise
            recover_dir(self.out / "best")
            recover_dir(self.out / "last")
            for left in self.out.glob("**/.*.*.tmp"):   # a killed writer's (write_atomic): none runs now
                left.unlink()
        self.record = self.record or {"code": self.code}
        barrier()

    def hold(self) -> None:
        """Rule 4, a flock on the folder itself: a deleted run.lock frees nothing.
        NOTE(ours): where a folder cannot be locked (Windows, NFS) the run goes on unlocked."""
        if fcntl is None:
            return
        try:
            self.lock = os.open(self.out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise UserError(UNWRITABLE.format(self.out, e.strerror or e))
        try:
            return fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
        except OSError:
            return
        raise UserError(f"--output_dir {self.out} is in use by another process ({self.out / LOCK} says "
                        f"which). One process at a time trains in a run folder: wait for that one to end (or "
                        f"stop it), then continue the run with --resume; or choose another --output_dir.")

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)                 # closing drops the flock
            self.lock = None

    def refuse_unless_ours(self, made: bool) -> None:
        """Rules 1-3: refuse a folder that is neither new, empty nor this run's own, and a --resume that is
        not this run's."""
        out = self.out
        if made or holds_nothing(out):
            if self.resuming:
                raise UserError(f"--resume: no run in {out} to continue. Run without --resume to start, "
                                f"or point --output_dir at the earlier run.")
            return
        if not out.is_dir():
            raise UserError(f"--output_dir {out}: is a file; it must be a folder (the run folder). Pass a "
                            f"new folder's path, or that of a run to --resume.")
        has = {name: (out / name).is_file() for name in ("run.json", "args.json")}
        try:
            record = read_json_object(out / "run.json")
        except ValueError:          # missing, or damaged: read_record says which below
            record = {}
        why = foreign_entry(out, RUN_ENTRIES)
        if not (has["run.json"] and (not record or "script" in record) or has["args.json"] and not record):
            why = why or (f"{out / 'run.json'} is not a run's record" if has["run.json"] else "no run.json")
            raise UserError(f"--output_dir {out}: {why}, so it is not a run folder of this project. A run "
                            f"writes only into a new or empty folder, or its own, so that nothing else is "
                            f"overwritten: {elsewhere(out)}.")
        if why:
            raise UserError(f"--output_dir {out}: {why}. A run folder holds only what its own run wrote, so "
                            f"that a run never writes over a file of yours: remove it, or {elsewhere(out)}.")
        if not has["run.json"] or record and ("code" not in record or record.get("format") != FORMAT):
            raise UserError(f"--output_dir {out}: an earlier version of this project started this run and "
                            f"did not record its code as this one does (every module that ran, and every "
                            f"file it trained on), so this cannot be shown to be the same run; it is "
                            f"left as it is (its best/ loads as any model). To train again, "
                            f"{elsewhere(out)}.")
        run, then = read_record(out / "run.json"), read_record(out / "args.json")
        diffs = [f"--{k}: the run has {then.get(k)!r}, this command {v!r}"
                 for k, v in flags_of(self.args, NOT_TRAINING).items() if then.get(k) != v]
        if run.get("data_sha256") != self.data_sha256:
            diffs.append(f"--data {self.args.data}: its content is not the data the run started with")
        recorded = run.get("inputs") if isinstance(run.get("inputs"), dict) else {}
        diffs += [f"--{k} {getattr(self.args, k, '')}: its content is not the file the run started with"
                  for k, v in recorded.items() if self.inputs.get(k) != v]
        if run.get("script") != (script := f"{script_name(self.args)}.py"):
            diffs.append(f"the script: the run is {run.get('script')}'s, this command {script}'s")
        code = sorted(f for f in {*self.code, *run["code"]} if run["code"].get(f) != self.code.get(f))
        diffs += [f"{f}: changed since the run started (its copy: {out / CODE / f})" for f in code]
        listed = "".join(f"\n  {d}" for d in diffs)
        if not self.resuming:       # with other code or flags, --resume would be refused: not suggested
            what = f"another run:{listed}\nTo start this one, " if diffs else \
                "a run. Add --resume to continue it, or to start afresh, "
            raise UserError(f"--output_dir {out} already holds {what}{elsewhere(out)} (or delete the "
                            f"folder).")
        if diffs:
            now = code_files(self.args).get(code[0], code[0]) if code else ""
            how = f"\n(`diff {out / CODE / code[0]} {now}` shows how; put it back to continue the run)" \
                if code else ""
            start = f"leave out --resume: it starts in {self.fresh}" if code and self.fresh else \
                f"start a new run: {elsewhere(out)}"
            raise UserError(f"--resume: this command would train another run than the one in {out}, which "
                            f"is left as it is:{listed}{how}\nTo train this, {start}.")
        self.record = run

    def write_record(self) -> None:
        """Rule 5: run.lock (the holder: a full disk is refused here, at the first write), then a new run's
        run.json, code/ and args.json."""
        if self.lock is not None:
            try:
                write_text_atomic(self.out / LOCK, f"process {os.getpid()} "
                                  f"({shlex.join([Path(sys.executable).name] + sys.argv)})\n")
            except OSError as e:
                raise UserError(UNWRITABLE.format(self.out, e.strerror or e))
        if self.record is not None:
            return
        self.record = {"script": f"{script_name(self.args)}.py", "format": FORMAT,
                       "data_sha256": self.data_sha256, "inputs": self.inputs, "code": self.code}
        ran = {f"{CODE}/{f}": code_record.ran(p) for f, p in code_files(self.args).items()}
        for f, p in code_files(self.args).items():
            if code_record.changed(p):
                print(f"note: {p} was saved after this run started; the run trains the code as it was at "
                      f"the start, and its record keeps that ({self.out / CODE / f})", file=sys.stderr)
        files = {"run.json": json.dumps(self.record, indent=2).encode(), **ran,
                 "args.json": json.dumps(flags_of(self.args), indent=2).encode()}
        for name, data in files.items():
            with writing(str(self.out / name), NO_CHECKPOINT, "the same command starts the run"):
                (self.out / name).parent.mkdir(parents=True, exist_ok=True)
                atomic_writes.write_atomic(self.out / name, lambda f, data=data: f.write(data))

    # ---------------------------------------------------------------------------------
    # The log: metrics.jsonl, one JSON record a line
    # ---------------------------------------------------------------------------------

    def write(self, record: dict) -> None:
        """One record of metrics.jsonl, appended to this name's own file."""
        if self.main:
            with writing(str(self.log), self.kept), open(self.log, "a") as f:
                f.write(json.dumps(record) + "\n")

    def stage(self, name: str, settings: dict) -> Stage:
        """A model this run trains before its own (rcl.py's entropy models), in its folder `name`."""
        return Stage(self, name, settings)

    # ---------------------------------------------------------------------------------
    # What a stop says (rule 6): what is intact, and what to run next
    # ---------------------------------------------------------------------------------

    def after_a_stop(self, command: list[str]) -> str:
        """Rule 6 after Ctrl-C, SIGTERM, SIGHUP (`command`: this one as typed)."""
        again = shlex.join(command + ([] if "--resume" in command else ["--resume"]))
        if self.record is not None:
            checkpoints = [*self.out.glob("last/state.pt"), *self.out.glob("*/last/state.pt"),
                           *self.out.glob(f"*/{DONE}")]
            since = "" if checkpoints else " (no checkpoint yet: --resume starts from step 0)"
            return f"What was already written in {self.out} is kept. To continue the run{since}: {again}"
        if self.resuming:
            return f"Nothing in {self.out} was changed yet. To continue the run: {again}"
        return f"The run was not recorded yet: there is nothing for --resume to continue. To start it " \
               f"again: {shlex.join(command)}"

    def kept(self) -> str:          # what a failed write leaves intact
        return kept_in(self.out, self.step)

    def next_command(self) -> str:
        return f"the same command {'plus --resume continues' if self.record else 'starts the run'}"

    def nan_error(self, step: int, best_step: int) -> UserError:
        kept = f"is kept in {self.out / 'best'}" if best_step else "was not saved yet"
        return UserError(f"the loss became NaN or infinite by step {step}. Training stopped; the best "
                         f"checkpoint so far {kept}. Try a lower --lr, or check the data for bad lines.")


def kept_in(folder: Path, step: int | None = None) -> str:
    """What a failed write leaves intact: last/ (its step, once known), and beside a stage, the others."""
    last = folder / "last" / "state.pt"
    if step is None and last.is_file():
        return f"{last.parent}, the last checkpoint, is as it was"
    kept = f"the last complete checkpoint, step {step}, is intact in {last.parent}" if step is not None \
        else NO_CHECKPOINT
    if not (folder.parent / "run.json").is_file():            # the run itself, not a stage of it
        return kept
    finished = [d.name for d in sorted(folder.parent.iterdir()) if (d / DONE).is_file()]
    return kept + (f" in {folder.name}" if step is None else "") + \
        (f"; finished and kept: {', '.join(finished)}" if finished else "")


def write_json(path: Path, obj: Any) -> None:
    """A small JSON file of the run, written whole or not at all; a failed write: one line."""
    with writing(str(path)):
        write_text_atomic(path, json.dumps(obj, indent=2))


# -------------------------------------------------------------------------------------
# Stages: the models a run trains before its own
# -------------------------------------------------------------------------------------

class Stage(RunFolder):
    """A model a run trains before its own (rcl.py: one entropy model per phi), in a folder of the run's,
    held with it (one lock, one record); common.train writes its log and checkpoints as it does the run's.
    Complete (end/, DONE.json, which keeps its `settings`), it is reused by --resume: the run's record
    has held the --resume to the same flags, data and code already."""

    def __init__(self, run: RunFolder, name: str, settings: dict):
        super().__init__(dataclasses.replace(run.args, output_dir=str(run.out / name)), run.out / name, name,
                         run.device)
        self.settings = settings
        self.record = run.record        # recorded with the run: a stop inside it says --resume continues

    def finished(self) -> dict | None:
        """Its summary if complete (DONE.json), or None."""
        if not (self.out / DONE).is_file():
            return None
        summary = read_record(self.out / DONE)
        checkpoint.drop_last(self)      # if a kill came between DONE.json and last/'s drop
        return summary

    def open(self) -> None:
        """Before the stage trains: what a kill during a commit left, put back; its folder made."""
        if world()[0] == 0:
            for kept in ("best", "end", "last"):       # a stage with no last/ starts again from step 0
                recover_dir(self.out / kept)
            with writing(str(self.out), lambda: kept_in(self.out)):
                self.out.mkdir(parents=True, exist_ok=True)
        barrier()

    def finish(self, summary: dict, encoder, tokenizer, pooler: str) -> None:
        """The stage complete, in the order a kill may interrupt: end/, DONE.json, last/ dropped."""
        if world()[0] == 0:
            kept = kept_in(self.out, summary.get("steps"))       # last/ holds the step it ended at
            with writing(str(self.out / "end"), kept):
                save_pretrained_dir(self.out / "end", encoder, tokenizer, pooler)
            with writing(str(self.out / DONE), kept):
                write_text_atomic(self.out / DONE, json.dumps({**self.settings, **summary}, indent=2))
        checkpoint.drop_last(self)
        barrier()
