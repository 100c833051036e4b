"""The run folder (--output_dir), named and opened by common.start (RunFolder.named, .open), where
train() keeps its log, last/ and best/ (RunFolder.of). Its record: args.json (the flags), run.json
(the script; the data's fingerprint and the code's: the script and common.py) and code/ (copies of
both as the run started). Four rules:
1. A run writes only into a folder it made, an empty one, or its own run folder (run.json, and
   nothing but what a run writes): any other is refused before anything is written; nothing is
   written in place while another name shares the file (a hard link).
2. A refused command changes nothing on disk: every check comes before the first write.
3. Nothing is loaded before it is verified: last/state.pt's checksum before torch.load; a
   checkpoint or a best/ that cannot be shown to be this run's (its identity: script, stage,
   flags, data, code) is refused with what to do.
4. A write the system refuses ends in one line that names what is intact (errors.writing).
A run that trains several models (rcl.py) keeps each in a stage of its own (Stage)."""

from __future__ import annotations

import contextlib
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

import torch

from plumbing import atomic_writes, code_record
from plumbing.atomic_writes import atomic_dir, no_follow, recover_dir, sha256_file, write_text_atomic
from plumbing.errors import UserError, writing
from plumbing.export import save_pretrained_dir
from plumbing.flags import NOT_TRAINING, default_output_dir, script_name
from plumbing.inputs import describe_entry, model_folder_problem, read_json_object
from plumbing.ranks import barrier, world

try:
    import fcntl  # POSIX: the run-folder lock
except ImportError:                    # Windows: no lock
    fcntl = None

CHECKSUM = "state.pt.sha256"    # beside last/state.pt: the SHA-256 of its bytes, checked by --resume
DONE = "DONE.json"              # a stage's summary, written once the stage is complete
LOCK = "run.lock"               # names the process that holds the folder
CODE = "code"                   # copies of the files that shape training, as the run started
FORMAT = 3                      # this version's record and checkpoints: all the code that ran, the inputs
# what a run writes into its folder, and into a stage's; their hidden temporaries are named after them
RUN_ENTRIES = {"args.json", "run.json", "metrics.jsonl", LOCK, CODE, "last", "best"}
STAGE_ENTRIES = {"metrics.jsonl", "last", "best", "end", DONE}
TEMPORARY = re.compile(r"\.(.+?)(\.old|\.tmp-\w+|\.\d+\.tmp)")
CHECKPOINT_KEYS = {"model", "opt", "sched", "step", "best", "best_step", "dev", "log_bytes", "rng_cpu", "run"}
NO_CHECKPOINT = "no checkpoint was written yet"
UNWRITABLE = "--output_dir {}: cannot be written ({}). Choose a folder you can write to."

# the run folder this command named (common.start): what a stop or a failed write says is intact,
# where train() writes; its lock lives with it
_held: dict[str, RunFolder] = {}


def code_files(args: Any) -> dict[str, Path]:
    """The code a run records, by its path in the repository: its script, common.py and plumbing/ (which
    decides which sentences train and what best/ holds); code_record keeps the bytes that ran."""
    return code_record.modules(sys.modules[type(args).__module__].__file__)


def code_of(args: Any) -> dict[str, str]:
    """The SHA-256 of each file of code_files() as it ran: the code's identity."""
    return {name: hashlib.sha256(code_record.ran(p)).hexdigest() for name, p in code_files(args).items()}


def code_id(code: dict[str, str], digits: int = 6) -> str:
    """The hex digits that name a version of the code: a default folder's suffix, compare's label."""
    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()[:digits]


def flags_of(args: Any, leave_out: tuple[str, ...] = ()) -> dict:
    """The flags as args.json holds them, but those in `leave_out`."""
    flags = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    return {k: v for k, v in flags.items() if k not in leave_out}


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
    k = next(k for k in range(2, 10**6) if not _try(out.with_name(f"{out.name}-{k}").exists))
    return f"choose another --output_dir, e.g. {out.with_name(f'{out.name}-{k}')}"


def holds_nothing(folder: Path) -> bool:
    """A folder that is not there, or holds only a lock or temporary names (a run stopped at once)."""
    return not os.path.lexists(folder) or folder.is_dir() and not folder.is_symlink() and all(
        p.name == LOCK or TEMPORARY.fullmatch(p.name) for p in folder.iterdir())


def foreign_entry(folder: Path, allowed: set[str], depth: int = 0) -> str | None:
    """The first entry of `folder` that no run writes there (another folder is a stage), or None."""
    for entry in sorted(folder.iterdir()):
        name = m[1] if (m := TEMPORARY.fullmatch(entry.name)) else entry.name
        if (what := describe_entry(entry)) is not None:
            return f"{entry} is {what}"
        if name in allowed and name in ("last", CODE) and entry.is_dir():
            # last/: its two files; code/: copies of the modules that ran (*.py, plumbing/*.py)
            copies = [p for p in sorted(entry.rglob("*")) if describe_entry(p) is None and (
                p.is_file() and p.suffix == ".py" and p.parent in (entry, entry / "plumbing")
                or p == entry / "plumbing" and p.is_dir())]
            inside = {entry / "state.pt", entry / CHECKSUM} if name == "last" else set(copies)
            if stray := next((p for p in sorted(entry.rglob("*")) if p not in inside), None):
                return f"{stray} is not a file a run writes"
        elif name not in allowed and not (depth == 0 and entry.is_dir() and not m
                                          and foreign_entry(entry, STAGE_ENTRIES, 1) is None):
            return f"{entry} is not a file a run writes"
    return None


class RunFolder:
    """This command's run folder (common.start), a stage inside it (rcl.py's entropy models), or a bare
    folder (train() called alone, in a test). Rank 0 writes; a refused write ends in one line."""

    def __init__(self, args: Any, out: str | Path | None = None, stage: str = ""):
        self.args, self.out, self.stage = args, Path(out or args.output_dir), stage
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
        """The SHA-256 of each file the script trains on beside --data (its Args.INPUTS: ifcl.py's German
        file), each read once it exists: a file the run makes itself is fingerprinted once made, before
        the first checkpoint, which carries it. An edit of it between a stop and --resume is refused."""
        for flag in getattr(self.args, "INPUTS", ()):
            path = getattr(self.args, flag)
            if flag not in self._inputs and path and Path(path).is_file():
                self._inputs[flag] = sha256_file(path)
        return self._inputs

    @classmethod
    def named(cls, args: Any) -> RunFolder:
        """This command's run folder: --output_dir, or runs/<script>/<the flags that differ>; when that
        default folder holds a run of other code, the one named after this code beside it (runs/simcse/
        default-code3f2a1c): an edited script and its original are two runs. Named before any check,
        so that a stop says what is where."""
        run, base = cls(args), Path(default_output_dir(args))
        if problem := code_record.launch_problem(sys.modules[type(args).__module__].__file__):
            raise UserError(problem)                # the script saved during the launch: what ran is unknown
        if not args.output_dir:
            fresh = base.with_name(f"{base.name}-code{code_id(run.code)}")
            mine = [f for f in (base, fresh) if _try(lambda: read_json_object(f / "run.json")["code"]) ==
                    run.code]
            run.out = mine[0] if mine else base if holds_nothing(base) or args.resume else fresh
            args.output_dir, run.log, run.fresh = str(run.out), run.out / "metrics.jsonl", fresh
            if run.out == fresh and run.main:
                print(f"note: {base} holds a run of other code: this one goes to {fresh}", file=sys.stderr)
        release_run_folders()                               # an earlier command's in this process
        _held[str(run.out.resolve())] = run
        return run

    def open(self) -> None:
        """common.start's last step: rank 0 holds the folder (a second process stops here), checks it
        (rules 1-3), then writes the record of a new run, or, on --resume, puts back what a kill
        between two renames left. Every rank waits."""
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
        self.record = self.record or {"code": self.code}
        barrier()

    def hold(self) -> None:
        """A flock on the folder itself, which the system drops when the process ends however it ends
        (kill -9 too): a dead run blocks no --resume, and a deleted run.lock frees nothing.
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

        def holder() -> str:
            with open(self.out / LOCK, opener=no_follow) as f:
                return f.read(500).strip()
        raise UserError(f"--output_dir {self.out} is in use by {_try(holder) or 'another process'}. One "
                        f"process at a time trains in a run folder: wait for that one to end (or stop it), "
                        f"then continue the run with --resume; or choose another --output_dir.")

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)                 # closing drops the flock
            self.lock = None

    def refuse_unless_ours(self, made: bool) -> None:
        """Rules 1 and 2: refuse, before anything is written, a folder that is neither new, empty nor
        this run's own, and a --resume that is not this run's (flags, data, script or code)."""
        out = self.out
        if made or holds_nothing(out):
            if self.resuming:
                raise UserError(f"--resume: no run in {out} to continue. Run without --resume to start, "
                                f"or point --output_dir at the earlier run.")
            return
        if not out.is_dir() or describe_entry(out) is not None:
            raise UserError(f"--output_dir {out}: is a file; it must be a folder (the run folder). Pass a "
                            f"new folder's path, or that of a run to --resume.")
        has = {name: (out / name).is_file() for name in ("run.json", "args.json")}
        record = _try(lambda: read_json_object(out / "run.json")) or {}      # damaged: read_record says so
        why = foreign_entry(out, RUN_ENTRIES)
        if not (has["run.json"] and (not record or "script" in record) or has["args.json"] and not record):
            why = why or (f"{out / 'run.json'} is not a run's record" if has["run.json"] else "no run.json")
            raise UserError(f"--output_dir {out}: {why}, so it is not a run folder of this project. A run "
                            f"writes only into a new or empty folder, or its own, so that nothing else is "
                            f"overwritten: {elsewhere(out)}.")
        if why:
            raise UserError(f"--output_dir {out}: {why}. A run folder holds only what its own run wrote, and "
                            f"a run never writes through a link or over a file of yours: remove it (or put "
                            f"a copy of what a link points to in its place), or {elsewhere(out)}.")
        if record and not isinstance(record.get("code", {}), dict):
            raise UserError(f"{out / 'run.json'}: damaged (its \"code\" is not a list of files and their "
                            f"SHA-256), and left as it is: what this run was cannot be checked against it. "
                            f"To train again, {elsewhere(out)}.")
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
        # a run's second evaluation record comes after its first checkpoint was committed
        if self.log.is_file() and self.log.read_text("latin-1").count('"stsb_dev"') > 1 and not any(
                (out / d / "state.pt").is_file() for d in ("last", ".last.old")) and self.finished() is None:
            raise UserError(f"--resume: {out} wrote checkpoints (its log records evaluations), but "
                            f"{out / 'last'} is gone and the run had not finished: there is nothing to "
                            f"continue from. To train again, {elsewhere(out)}.")

    def write_record(self) -> None:
        """run.lock (the holder: on a full disk, a refusal at the first write), then a new run's run.json,
        code/ and args.json last (a folder with args.json holds the whole record)."""
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
        # the bytes that ran (code_record), not the files as they are now: an edit saved since the launch
        # is not what trains, and is said so
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

    def after_a_stop(self, command: list[str]) -> str:
        """The line after Ctrl-C, SIGTERM, SIGHUP: what is kept, and the command that goes on from there
        (`command`: this one as typed), printed whole; --resume added where it continues the run."""
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

    def finished(self) -> dict | None:
        """The final figures of a run that had ended (best/test_metrics.json), once best/ is shown to be
        this run's model; None for a run that goes on."""
        best = self.out / "best"
        figures, dev = (_try(lambda n=n: read_json_object(best / f"{n}_metrics.json"))
                        for n in ["test", "dev"])
        if figures is None or dev is None:
            return None
        if diffs := self.not_mine(dev.get("run")):
            raise UserError(f"{best}: not this run's model ({', '.join(diffs[:3])}); it is left as it is. "
                            f"Train the run again in another --output_dir.")
        return figures

    @classmethod
    def of(cls, args: Any) -> RunFolder:
        """The folder train() writes into: this command's, a stage inside it, or a bare one."""
        path = Path(args.output_dir).resolve()
        for run in _held.values():
            if path == run.out.resolve():
                return run
            if path.parent == run.out.resolve():
                stage = cls(args, path, path.name)
                stage.record = run.record
                return stage
        return cls(args)

    @property
    def identity(self) -> dict:
        """What every checkpoint and best/ carry: the script, stage, training flags, data and code."""
        return {"format": FORMAT, "script": f"{script_name(self.args)}.py", "stage": self.stage,
                "data_sha256": self.data_sha256, "inputs": self.inputs, "code": self.code,
                "flags": flags_of(self.args, (*NOT_TRAINING, "data"))}

    def write(self, record: dict) -> None:
        """One record of metrics.jsonl, appended to this name's own file."""
        if self.main:
            with writing(str(self.log), self.kept), self.own_log("a") as f:
                f.write(json.dumps(record) + "\n")

    def own_log(self, mode: str):
        """metrics.jsonl to write in place: this name's alone (a hard link keeps its content), no link."""
        return open(atomic_writes.unshared(self.log), mode, opener=no_follow)

    def save_last(self, state: dict) -> None:
        """last/, the one commit point: `state` (train()'s checkpoint) with the log's length, the log
        synced first (a resume cuts the log back there), its SHA-256 beside it; swapped in whole."""
        with writing(str(self.log), self.kept):
            atomic_writes.sync_to_disk(self.log)
        state = {**state, "log_bytes": self.log.stat().st_size}
        with writing(str(self.out / "last"), self.kept), atomic_dir(self.out / "last") as tmp:
            with open(tmp / "state.pt", "wb") as f:
                torch.save(state, f)    # a file, not a path: the system's error (ENOSPC, ...) reaches here
            # its fingerprint, swapped in with it (`sha256sum -c state.pt.sha256` in last/ checks it too)
            (tmp / CHECKSUM).write_text(f"{sha256_file(tmp / 'state.pt')}  state.pt\n")
        self.step = state["step"]

    def save_best(self, record: dict, saved: tuple) -> None:
        """best/: the encoder (and MLP) as a model folder (`saved`: encoder, tokenizer, pooler, mlp),
        with the flags and its dev figures, which carry the run's identity."""
        extra = {"args.json": flags_of(self.args), "dev_metrics.json": {**record, "run": self.identity}}
        with writing(str(self.out / "best"), self.kept):
            save_pretrained_dir(self.out / "best", *saved, extra=extra)

    def drop_last(self) -> None:
        """A finished run keeps best/ and its records; last/ (about 3x the model) served to continue it."""
        if self.main:
            shutil.rmtree(self.out / "last", ignore_errors=True)

    def load_last(self) -> dict | None:
        """--resume: last/'s checkpoint, verified (its checksum, then data only, then the run's identity),
        or None for a run stopped before its first one (its log emptied: it starts from step 0)."""
        last = self.out / "last" / "state.pt"
        if not last.exists():
            if self.main:
                self.cut_log(0)
                print(f"no checkpoint in {last.parent} yet: training starts from step 0", file=sys.stderr)
            return None
        recorded, whole = last.with_name(CHECKSUM), (
            f"If you know state.pt is whole, write its checksum again (`sha256sum state.pt > {CHECKSUM}` in "
            f"{last.parent}); else train the run again in another --output_dir.")
        digest = _try(lambda: (recorded.read_bytes().split() or [b""])[0])
        if digest is None or not re.fullmatch(rb"[0-9a-f]{64}", digest):
            raise UserError(f"{recorded}: missing, or not a SHA-256 line, so {last} cannot be shown whole; "
                            f"both are left as they are. {whole}")
        if digest.decode() != sha256_file(last):       # damaged on the disk, or replaced: not unpickled
            raise UserError(self.damaged(last, f"its SHA-256 is not the one in {CHECKSUM}, written with it: "
                                               f"damaged on the disk, or replaced"))
        try:    # onto the CPU: RNG states stay CPU byte tensors; load_state_dict moves the rest
            state = torch.load(last, map_location="cpu", weights_only=True)
        except Exception as e:      # no checkpoint: UnpicklingError, EOFError, IndexError, struct.error
            raise UserError(self.damaged(last, e))
        if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
            raise UserError(self.damaged(last, "it lacks what a checkpoint of this version holds"))
        if diffs := self.not_mine(state["run"]):
            raise UserError(self.damaged(last, f"it is another run's checkpoint: {', '.join(diffs[:4])}"))
        return state

    def not_mine(self, then: Any) -> list[str]:
        """How an identity (a checkpoint's, best/'s) differs from this run's: [] when it is this run's."""
        now, then = self.identity, then if isinstance(then, dict) else {}
        if then.get("format") != FORMAT:
            return ["written by an earlier version of this project, which did not record the code"]
        stage = f"the stage {then.get('stage')}" if then.get("stage") else "the run's own model"
        diffs = [what for key, what in (("script", f"the script {then.get('script')}"), ("stage", stage),
                                        ("data_sha256", "other data")) if then.get(key) != now[key]]
        flags, code, files = (then.get(k) if isinstance(then.get(k), dict) else {} for k in
                              ("flags", "code", "inputs"))
        diffs += [f"--{k} {flags.get(k)!r} (this run: {v!r})" for k, v in now["flags"].items()
                  if flags.get(k) != v]
        diffs += [f"--{k} {getattr(self.args, k)}: its content changed since" for k, v in
                  now["inputs"].items() if files.get(k) != v]
        return diffs + [f"{f} of other code" for f in now["code"] if code.get(f) != now["code"][f]]

    @contextlib.contextmanager
    def restoring(self):
        """Where train() puts last/'s state back: one that does not fit (another model's) is one line."""
        try:
            yield
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise UserError(self.damaged(self.out / "last" / "state.pt", e)) from e

    def resumed(self, state: dict, saved: tuple) -> None:
        """After train() put `state` back: best/ checked (lost, or another run's: one line; one that fell
        behind last/ saved again from `saved`), the log cut back to last/'s length: one run."""
        step, best_step = state["step"], state["best_step"]
        problem = self.best_problem(best_step, state["best"]) if self.main and best_step else None
        if problem and (best_step != step or "another run's" in problem):
            lost = f" The model of step {best_step}, the best STS-B dev, was kept only there (last/ holds " \
                   f"step {step})." if best_step != step else ""
            raise UserError(f"{self.out / 'best'}: {problem}.{lost} Train the run again in another "
                            f"--output_dir (or move {self.out} away first).")
        if self.main:
            self.cut_log(state["log_bytes"])
            if problem:
                self.save_best(state["dev"], saved)
            print(f"resuming {self.out} at step {step} (best STS-B dev {state['best']:.2f} at step "
                  f"{best_step})", file=sys.stderr)
        self.step = step

    def best_problem(self, best_step: int, best: float) -> str | None:
        """What is wrong with best/ as this run's model of step `best_step` (STS-B dev `best`), or None."""
        folder = self.out / "best"
        if problem := model_folder_problem(folder):
            return problem
        saved = _try(lambda: read_json_object(folder / "dev_metrics.json"))
        if saved is None:
            return f"{folder / 'dev_metrics.json'} is missing or damaged"
        if diffs := self.not_mine(saved.get("run")):
            return f"it is another run's model ({', '.join(diffs[:3])})"
        if saved.get("step") != best_step or saved.get("stsb_dev") != best:
            return f"it holds the model of step {saved.get('step')} (STS-B dev {saved.get('stsb_dev')}), " \
                   f"not of step {best_step} ({best})"
        return None

    def verified_best(self, best_step: int, best: float) -> Path:
        """best/, shown to be this run's model of step `best_step`: what the final report loads."""
        if problem := self.best_problem(best_step, best):
            raise UserError(f"{self.out / 'best'}: {problem}. This run's best model is lost: train the run "
                            f"again in another --output_dir.")
        return self.out / "best"

    def cut_log(self, size: int) -> None:
        """metrics.jsonl cut back to its length when last/ was written, to the end of a whole line."""
        if not os.path.lexists(self.log):
            return
        with writing(str(self.log), self.kept), self.own_log("rb+") as f:
            log = f.read()
            if len(log) < size:
                print(f"note: {self.log} is shorter than when {self.out / 'last'} was written (edited or "
                      f"replaced?); it is kept as it is, but for a last line cut short", file=sys.stderr)
            os.ftruncate(f.fileno(), log.rfind(b"\n", 0, size) + 1)

    def damaged(self, last: Path, e: Exception | str) -> str:
        """The one line for a last/state.pt that cannot be this run's checkpoint (`e`: why)."""
        reason = e if isinstance(e, str) else (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if "Weights only load failed" in str(e):
            reason = "it holds objects other than tensors and numbers, which loading would run as code"
        step = _try(lambda: read_json_object(self.out / "best" / "dev_metrics.json")["step"])
        good = f"{self.out / 'best'} (the model of step {step}) and " if step is not None else ""
        return (f"{last}: not a checkpoint of this run ({reason}). Still good, and left as they are: "
                f"{good}{self.log}. This run cannot continue from it: train it again in another "
                f"--output_dir (or move {self.out} away first).")

    def nan_error(self, step: int, best_step: int) -> UserError:
        kept = f"is kept in {self.out / 'best'}" if best_step else "was not saved yet"
        return UserError(f"the loss became NaN or infinite by step {step}. Training stopped; the best "
                         f"checkpoint so far {kept}. Try a lower --lr, or check the data for bad lines.")


def _try(read: Any) -> Any:
    """read(), or None when what it reads is missing or not what it should be."""
    try:
        return read()
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


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


def current() -> RunFolder | None:        # the run folder this command named (common.start), if any
    return next(iter(_held.values()), None)


def release_run_folders() -> None:
    """Let go of the run folder this command held (run_main's end, a test's)."""
    for run in _held.values():
        run.release()
    _held.clear()


def write_json(path: Path, obj: Any) -> None:
    """A small JSON file of the run, written whole or not at all; a failed write: one line."""
    with writing(str(path)):
        write_text_atomic(path, json.dumps(obj, indent=2))


class Stage:
    """A model a run trains before its own (rcl.py: one entropy model per phi), in a folder of its own
    in the run folder. Complete (end/, DONE.json), it is reused by --resume, held to its settings;
    unfinished, it continues from its last/, or starts again."""

    def __init__(self, out: str | Path, name: str, settings: dict):
        self.path, self.settings = Path(out) / name, settings

    def finished(self) -> dict | None:
        """Its summary if complete (DONE.json), or None; refused if trained with other settings."""
        if not (self.path / DONE).is_file():
            return None
        again = f"Delete {self.path} to train this model again (the run's other parts are kept), or use " \
                f"another --output_dir."
        summary = read_record(self.path / DONE, again)
        for kept in ("end", "best"):        # the weights a finished stage hands on
            if (problem := model_folder_problem(self.path / kept)) and (self.path / kept).exists():
                raise UserError(f"--resume: {problem}. {again}")
        if diff := [k for k in self.settings if k != "seed" and summary.get(k) != self.settings[k]]:
            raise UserError(f"--resume: {self.path} was trained with a different "
                            f"{', '.join(f'--{k} ({summary.get(k)})' for k in diff)}. Use another "
                            f"--output_dir, or delete {self.path} to train it again.")
        if world()[0] == 0:
            shutil.rmtree(self.path / "last", ignore_errors=True)   # if a kill came before its removal
        return summary

    def open(self) -> None:
        """Before the stage trains: what a kill during a commit left, put back; its folder made."""
        if world()[0] == 0:
            for kept in ("best", "end", "last"):       # a stage with no last/ starts again from step 0
                recover_dir(self.path / kept)
            with writing(str(self.path), lambda: kept_in(self.path)):
                self.path.mkdir(parents=True, exist_ok=True)
        barrier()

    def finish(self, summary: dict, encoder, tokenizer, pooler: str) -> None:
        """The stage complete, in the order a kill may interrupt: end/, DONE.json, last/ dropped."""
        if world()[0] == 0:
            kept = kept_in(self.path, summary.get("steps"))       # last/ holds the step it ended at
            with writing(str(self.path / "end"), kept):
                save_pretrained_dir(self.path / "end", encoder, tokenizer, pooler)
            with writing(str(self.path / DONE), kept):
                write_text_atomic(self.path / DONE, json.dumps({**self.settings, **summary}, indent=2))
            shutil.rmtree(self.path / "last", ignore_errors=True)
        barrier()
