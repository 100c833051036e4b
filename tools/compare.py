r"""Finished runs side by side: the 7 STS tasks and their average, one row a configuration.

    python tools/compare.py runs/simcse runs/focal_infonce     # every run under these folders
    python tools/compare.py runs/simcse-s1 runs/simcse-s2 runs/focal --markdown table.md --plot dev.png
    python tools/compare.py runs/simcse-s1 runs/simcse-edited --code_diff   # what their code differs in
    python tools/compare.py runs/tb/simcse-s* --baseline sentence-transformers/all-MiniLM-L6-v2 \
        --pooler cls_before_pooler --sts_dir data/sts

A folder that holds runs rather than being one (runs/simcse, where a script's default --output_dir
puts each run) stands for every run folder under it; its unfinished runs (no best/test_metrics.json:
still going, or stopped) are left out, named in one note (--plot still draws those with a log). A
run named by itself must have finished.

Runs that started from the same code and whose args.json agree on everything but --seed and the
flags that say where and how a run is written, not what it trains (common.NOT_TRAINING:
--output_dir, --resume, --log_every, --sts_dir, --cache_dir, --compile, --eval_untrained) form one
row: mean ± sample std over its n seeds; a run that differs only in where its STS data lives, or in
whether its step was compiled, is one more seed of the same row. A row is labelled with the script
that made it (run.json), the flags that tell it apart from the other rows, and in brackets the
pooler of its final evaluation.
--baseline adds the untrained encoder's row and, with --plot, its point in the second panel, joined
to the first evaluation of every run evaluated with its --pooler: where those runs started.

A run's code is every module of this repository it ran (the script, common.py, plumbing/; run.json
records their sha256, code/ keeps a copy; a run of an earlier version recorded the script and
common.py only): an edited copy is a row of its own, never a seed of the original. Where a
script's rows differ in code, each label names it against the code committed in this checkout
(git HEAD), so that it reads the same whatever the working tree holds: `as committed (664f320)`,
`simcse.py edited`, `simcse.py, plumbing/inputs.py edited` (the files whose bytes are not the
commit's), `plumbing/x.py not committed`; two different edits of the same files are `(edit 1)` and
`(edit 2)`, in the order their runs started; `plumbing/ not recorded` marks an earlier version's
record, `code not recorded` a run from before code was recorded (never merged with known code).
Outside a git checkout the codes are numbered in the order their runs started, `code 1`, `code 2:
simcse.py differs from code 1`, and the note under the table says why. --code_diff prints,
instead of the table, a unified diff of each file that differs between two runs' code/ copies, or
between the committed file and one run's copy, after checking every copy against run.json.

Under the table, one line where a row is a single seed (n = 1), and one for each two rows whose
averages differ by less than two seeds of their script ended apart on the laptop testbed: a
difference seed noise can make. Each line gives that spread, the figures it comes from and the
page that prints them (docs/results.md, README.md).

Below the table, a second one shows what each method's own part did: the figures its script
logs of its mechanism (MECHANISM below: IFCL's innate margin and twins gap, Focal-InfoNCE's
modulated similarities, ConIsI's interactive accuracy and share of the loss, RCL's phi * H beside
each entropy model's loss and its regulators beside the contrastive term), from the first and the
last training record of metrics.jsonl, mean ± std over the seeds. A mechanism that never engaged,
or that a term of the loss drowns, shows there whatever the STS figures say.

--plot FILE draws two panels side by side, one colour a configuration in both: each run's STS-B
dev curve over the steps, and SimCSE's Fig. 2 (Gao et al. 2021): l_align (y) against l_uniform (x),
lower is better for both, on STS-B test as the log records them at each evaluation; one
trajectory a run (each seed its own, labelled with it) in training order, the first evaluation
hollow, arrows along the way. An unfinished run or RCL's entropy_phi*/ folders are drawn too,
though they have no row. A log from before alignment and uniformity were recorded is left out
of the second panel (with a note); when no run has them, the dev curves are drawn alone.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/compare.py` from anywhere
import common  # noqa: E402
from common import POOLERS, STS_TASKS, UserError, arg  # noqa: E402
from plumbing import inputs, run_folder  # noqa: E402
from plumbing.atomic_writes import sha256_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]   # this checkout: a run's code is named against its commit

# NOTE(ours): runs that differ only in these are seeds of one configuration: the seed, and
# common's one list of flags that say where and how a run is written, not what it trains
IGNORED = ("seed", *common.NOT_TRAINING)
SHORT = {"STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}
NOTE = ("Spearman x100 of cosine similarity on the test sets; [..] = the pooler of the final "
        "evaluation; n seeds: mean ± sample std (ddof=1).")
DIFF_HINT = "What differs: `python tools/compare.py RUN_A RUN_B --code_diff`."

# NOTE(ours): how far apart two seeds of one configuration ended on the 7-task average, measured
# for each script on the laptop testbed (all-MiniLM-L6-v2, 40 steps at batch 64, raw [CLS]), and
# the printed figures it comes from. Two seeds whose sample std is s are s * sqrt(2) apart.
SEED_SPREAD = {
    "simcse.py": (0.24, "seed 42: 75.67, README.md's results table; seeds 1 and 2: 75.43 ± 0.00, "
                  "docs/results.md"),
    "focal_infonce.py": (0.07, "seeds 1 and 2: 75.80 ± 0.05 and, --no-modulate, 75.31 ± 0.05, "
                         "docs/results.md"),
    "ifcl.py": (0.03, "seeds 1 and 2, --no_fraternal --no_twins --no_queue: 74.58 ± 0.02, docs/results.md"),
    "conisi.py": (0.71, "seeds 1 and 2, --lam 0: 74.61 ± 0.50, docs/results.md"),
    "rcl.py": (0.11, "seeds 1 and 2, --phi 0 0: 75.47 ± 0.08, docs/results.md"),
}


@dataclass
class Args:
    runs: list[str] = arg([], "run folders (a training script's --output_dir)", positional=True)
    baseline: str = arg("", "also evaluate this untrained encoder (hub name or folder), as the first row")
    pooler: str = arg("cls_before_pooler", "pooler of the --baseline row", "SimCSE official code",
                      choices=POOLERS)
    sts_dir: str = arg(common.in_data("sts"), "STS/ and SICK/ for the --baseline row (SentEval's layout)")
    batch_size: int = arg(128, "sentences per forward pass of the --baseline evaluation", ge=1)
    markdown: str = arg("", "also write the table as Markdown to this file (for the README)")
    plot: str = arg("", "draw into this image (.png, .pdf or .svg; needs matplotlib) each run's STS-B "
                    "dev curve over the steps and, beside it, its alignment against uniformity over "
                    "training (SimCSE Fig. 2)")
    code_diff: bool = arg(False, "instead of the table: what differs between two runs' code (a unified diff "
                          "of their code/ copies, each checked against run.json), or between one run's and "
                          "the code committed in this checkout")


def _read_json(path: Path) -> dict:
    """A run's JSON file, or one line that names it, says why it is no JSON object and what to do."""
    try:
        return inputs.read_json_object(path)
    except ValueError as e:
        raise UserError(f"{path}: not a readable JSON object ({e}). Was the file cut short or edited by "
                        f"hand? Train the run again, or leave it out.")


def result_tasks(res: dict) -> list[str]:
    """The tasks of an evaluate_sts result, the 7 STS tasks first, in their order."""
    got = [k for k, v in res.items() if isinstance(v, dict) and "spearman" in v]
    return [t for t in STS_TASKS if t in got] + sorted(t for t in got if t not in STS_TASKS)


def is_run_folder(p: Path) -> bool:
    return (p / "args.json").is_file() or (p / "metrics.jsonl").is_file()


def is_finished(p: Path) -> bool:
    """A run that ended: its flags and its final result (a finished run need not keep last/)."""
    return (p / "args.json").is_file() and (p / "best" / "test_metrics.json").is_file()


def run_folders(folder: str | Path, depth: int = 3) -> list[Path]:
    """`folder` itself if it is a run folder; else every run folder under it (up to `depth` levels,
    in name order: runs/simcse holds runs/simcse/default, runs/simcse/tau0.1, ...); else [folder],
    which read_run then refuses with what to pass. A run folder's own subfolders (best/, RCL's
    entropy_phi*/) are not runs of their own."""
    p = Path(folder)
    if not p.is_dir() or is_run_folder(p) or depth == 0:
        return [p]
    found = [r for sub in sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))
             for r in run_folders(sub, depth - 1) if is_run_folder(r)]
    return found or [p]


def read_run(folder: str | Path, plot: bool = False) -> dict:
    """One folder: {"path", "args" (args.json or None), "script", "code" ({file: sha256}, or None:
    not recorded), "started" (started), "test" (the 7-task result, or None: drawn only), "pooler"}.
    Anything else is a UserError that names it and what to do."""
    p = Path(folder)
    args_f, test_f, log_f = p / "args.json", p / "best" / "test_metrics.json", p / "metrics.jsonl"
    if not p.is_dir():
        raise UserError(f"{p}: no such folder. Pass the --output_dir of a training run.")
    if p.name == "best" and (p.parent / "args.json").is_file():
        raise UserError(f"{p}: this is a run's checkpoint folder; pass the run folder {p.parent} instead.")
    if not args_f.is_file() and not log_f.is_file():
        raise UserError(f"{p}: not a run folder (no args.json, no metrics.jsonl in it, nor in a folder "
                        f"under it). Pass the --output_dir of a training run, or a folder that holds runs.")
    finished = is_finished(p)
    if not finished and not plot and not args_f.is_file():
        raise UserError(f"{p}: no args.json, so not the --output_dir of a run (RCL's entropy_phi*/ "
                        f"folders are part of one). Its STS-B dev curve can be drawn with --plot FILE.png.")
    if not finished and not plot:
        raise UserError(f"{p}: unfinished run: no best/test_metrics.json, which a run writes when it "
                        f"ends (this one is still going, was interrupted, or stopped on a NaN loss). "
                        f"Finish it with its command plus --resume, or leave it out (--plot still draws it).")
    if not finished and not log_f.is_file():
        raise UserError(f"{p}: unfinished run with no metrics.jsonl yet: nothing to table or draw. "
                        f"Leave it out.")
    record = _read_json(p / "run.json") if (p / "run.json").is_file() else {}
    run = {"path": p, "args": _read_json(args_f) if args_f.is_file() else None, "test": None,
           "script": record.get("script"), "code": recorded_code(p / "run.json", record),
           "started": started(p)}
    if finished:
        run["test"] = _read_json(test_f)
        if not result_tasks(run["test"]) or not isinstance(run["test"].get("avg"), (int, float)):
            raise UserError(f"{test_f}: no STS task results and average in it. Is it the file a run wrote?")
    # NOTE(ours): runs from before the pooler was recorded: every script that has a --pooler
    # flag evaluates with it; the others (ifcl.py, conisi.py) stay unknown
    run["pooler"] = (run["test"] or {}).get("pooler") or (run["args"] or {}).get("pooler")
    return run


def started(folder: Path) -> float:
    """When a run started, as far as its folder tells: its record's time (run.json and args.json are
    written once, as it starts); 0 where it has neither."""
    times = [(folder / f).stat().st_mtime for f in ("run.json", "args.json") if (folder / f).is_file()]
    return min(times, default=0.0)


def recorded_code(run_json: Path, record: dict) -> dict[str, str] | None:
    """The code a run started with, as its run.json records it: {file: sha256}, the script first;
    None for a run from before code was recorded (its code is unknown: a row of its own)."""
    code = record.get("code")
    if code is None:
        return None
    if not isinstance(code, dict) or not code or not all(
            isinstance(name, str) and _plain_path(name) and isinstance(sha, str)
            and re.fullmatch("[0-9a-f]{64}", sha) for name, sha in code.items()):
        raise UserError(f"{run_json}: its \"code\" is not {{file: sha256 hex}} as a run records it. Was the "
                        f"file edited by hand? Train the run again, or leave it out.")
    return dict(code)


def _plain_path(name: str) -> bool:
    """A file of the repository by its relative path: no absolute path, no `..`, nothing empty."""
    return "\\" not in name and all(part not in ("", ".", "..") for part in name.split("/"))


@dataclass(frozen=True)
class Committed:
    """The code committed at a git checkout's HEAD: what a row's code is named against."""
    root: Path
    commit: str       # HEAD's full hash
    short: str        # as git abbreviates it
    prefix: str       # the checkout's place inside its repository ("" at its top)

    def blob(self, name: str) -> bytes | None:
        """The bytes of `name` (a path relative to the checkout) at this commit; None: not in it."""
        return _git_blob(self.root, f"{self.commit}:{self.prefix}{name}")

    def sha256(self, name: str) -> str | None:
        data = self.blob(name)
        return None if data is None else hashlib.sha256(data).hexdigest()


def _git(root: Path, *argv: str) -> subprocess.CompletedProcess:
    # NOTE(ours): GIT_DIR and its kind (set inside a git hook) would point git at another repository
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, env=env, timeout=60)


@functools.lru_cache(maxsize=None)
def _git_blob(root: Path, spec: str) -> bytes | None:
    r = _git(root, "cat-file", "blob", spec)
    return r.stdout if r.returncode == 0 else None


def committed(root: Path | None = None) -> Committed | str:
    """The code committed at the HEAD of `root` (this checkout), or, where there is none to name a
    code against, why not, in a few words."""
    root = ROOT if root is None else root
    try:
        where = _git(root, "rev-parse", "--show-prefix")
        if where.returncode != 0:
            why = where.stderr.decode(errors="replace").strip().splitlines() or ["?"]
            return ("not a git checkout" if "not a git repository" in why[0]
                    else f"git cannot read this checkout ({why[0]})")
        head = _git(root, "rev-parse", "--verify", "-q", "HEAD")
        if head.returncode != 0:
            return "a git checkout without a commit yet"
        short = _git(root, "rev-parse", "--short", "HEAD").stdout.decode().strip()
    except FileNotFoundError:
        return "git is not installed"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"git could not be run ({e})"
    ref = Committed(root, head.stdout.decode().strip(), short, where.stdout.decode().strip())
    if ref.blob("common.py") is None:     # a folder inside some other repository, not this project's
        return f"the git repository around it has no common.py committed at {short}"
    return ref


def _code_key(code: dict | None) -> str:
    return json.dumps(code, sort_keys=True)


def _earlier_record(code: dict) -> bool:
    """A record of an earlier version: the script and common.py, no plumbing/ module."""
    return not any(name.startswith("plumbing/") for name in code)


def code_labels(codes: list[tuple[str | None, dict | None]], ref: Committed | str) -> dict[str, str]:
    """The code part of a label of each code (_code_key -> text); `codes` = (script, code) in the
    order their runs started. Against a commit (ref): `as committed (664f320)`, `simcse.py edited`,
    `simcse.py, plumbing/inputs.py edited`, `plumbing/x.py not committed`; different edits of the
    same files `(edit 1)`, `(edit 2)` in that order. Outside a git checkout (ref: why not): `code
    1`, `code 2: simcse.py differs from code 1`, numbered within a script. An earlier version's
    record adds `plumbing/ not recorded`; a run from before code was recorded: `code not recorded`."""
    found: dict[str, tuple[str | None, dict | None]] = {}
    for script, code in codes:
        found.setdefault(_code_key(code), (script, code))
    what, edit = {}, {}                      # key -> the label's text; key -> the edit it names
    if isinstance(ref, Committed):
        for key, (_, code) in found.items():
            if code is None:
                continue
            shas = {name: ref.sha256(name) for name in code}
            edited = [name for name in code if shas[name] not in (None, code[name])]
            new = [name for name in code if shas[name] is None]
            parts = ([f"{', '.join(edited)} edited"] * bool(edited)
                     + [f"{', '.join(new)} not committed"] * bool(new))
            what[key] = ", ".join(parts) or f"as committed ({ref.short}"   # its bracket closed below
            edit[key] = tuple((name, code[name]) for name in edited + new)
    else:
        firsts: dict[str | None, list[str]] = {}          # a script's codes, code 1 first
        for key, (script, code) in found.items():
            if code is None:
                continue
            keys = firsts.setdefault(script, [])
            keys.append(key)
            one = found[keys[0]][1]
            differ = [name for name in dict.fromkeys([*one, *code]) if one.get(name) != code.get(name)]
            what[key] = f"code {len(keys)}" + (f": {', '.join(differ)} differ{'s' * (len(differ) == 1)} from "
                                               f"code 1" if differ else "")
    out = {}
    for key, (_, code) in found.items():
        if code is None:
            out[key] = "code not recorded"
            continue
        # the different edits of the same files, in the order their runs started
        edits = list(dict.fromkeys(edit[k] for k in what if what[k] == what[key] and edit.get(k)))
        quals = [f"edit {edits.index(edit[key]) + 1}"] if len(edits) > 1 and edit.get(key) else []
        quals += ["plumbing/ not recorded"] * _earlier_record(code)
        if what[key].startswith("as committed ("):      # `as committed (664f320; plumbing/ not recorded)`
            out[key] = "; ".join([what[key], *quals]) + ")"
        else:
            out[key] = what[key] + (f" ({'; '.join(quals)})" if quals else "")
    for key, label in out.items():          # the same edit, other modules recorded (a run that imported more)
        alike = [k for k in out if out[k] == label and k != key]
        if alike and found[key][1] is not None:
            code = found[key][1]
            extra = sorted(set(code) - set.intersection(*(set(found[k][1] or {}) for k in alike)))
            out[key] = label + (f" (also {', '.join(extra)})" if extra else " (fewer modules)")
    return out


def code_note(ref: Committed | str) -> str:
    """The line under a table whose labels name code: what they are named against."""
    if isinstance(ref, Committed):
        return (f"code: the modules a run ran (run.json's sha256 of each; a copy in the run's code/), "
                f"named against the code committed at {ref.short} (git HEAD): as committed, or the files "
                f"edited from it; edit 1, edit 2: different edits of the same files, in the order their runs "
                f"started. {DIFF_HINT}")
    return (f"code 1, code 2: the modules a run ran (run.json's sha256 of each; a copy in the run's code/), "
            f"numbered in the order their runs started; this folder is {ref}, so there is no committed code "
            f"to name them against. {DIFF_HINT}")


def code_of(folder: Path) -> dict[str, str] | None:
    """A run folder's recorded code (recorded_code), finished or not; None where it has none."""
    if not folder.is_dir() or not is_run_folder(folder):
        raise UserError(f"{folder}: not a run folder (no args.json, no metrics.jsonl). Pass the --output_dir "
                        f"of a training run.")
    run_json = folder / "run.json"
    return recorded_code(run_json, _read_json(run_json)) if run_json.is_file() else None


@dataclass
class _Side:
    """One side of --code_diff: a run's recorded code and its code/ copies, or the committed code
    (or, outside a git checkout, this folder's files) of the files that run recorded."""
    who: str                                   # the name it goes by in a line
    code: dict[str, str | None]                # file -> sha256 (None: it has no such file)
    read: Callable[[str], bytes | None]        # a file's bytes (None: missing)
    name: Callable[[str], str]                 # a file's name in the diff's header


def _run_side(folder: Path, code: dict[str, str]) -> _Side:
    def read(name: str) -> bytes | None:
        path = folder / run_folder.CODE / name
        return path.read_bytes() if path.is_file() else None
    return _Side(str(folder), dict(code), read, lambda name: str(folder / run_folder.CODE / name))


def _reference_side(names: list[str]) -> _Side:
    """The committed code (git HEAD) of `names`; outside a git checkout, this folder's files."""
    ref = committed()
    if isinstance(ref, Committed):
        return _Side(f"the code committed at {ref.short}", {name: ref.sha256(name) for name in names},
                     ref.blob, lambda name: f"{name} (committed at {ref.short})")

    def read(name: str) -> bytes | None:
        return (ROOT / name).read_bytes() if (ROOT / name).is_file() else None
    return _Side(f"this folder's files ({ref})", {name: sha256_file(ROOT / name) if (ROOT / name).is_file()
                                                  else None for name in names},
                 read, lambda name: f"{name} (this folder)")


def check_copies(folder: Path, code: dict[str, str]) -> list[str]:
    """One note for each copy in a run's code/ that is missing or is not the file run.json records."""
    notes = []
    for name, sha in code.items():
        path = folder / run_folder.CODE / name
        if not path.is_file():
            notes.append(f"note: {path}: missing, though {folder / 'run.json'} records it: its lines cannot "
                         f"be shown")
        elif sha256_file(path) != sha:
            notes.append(f"note: {path}: not the file {folder / 'run.json'} records (changed after the run "
                         f"started?): run.json's sha256 is what ran; a diff below shows this copy's lines")
    return notes


def _lines(data: bytes | None) -> list[str]:
    return [] if data is None else data.decode("utf-8", errors="replace").splitlines()


def code_diff(a: Path, b: Path | None = None) -> str:
    """What differs between run a's code and run b's: first a note for each copy in code/ that is
    not what run.json records (check_copies), then a unified diff (a's lines -, b's +) of each
    recorded file whose sha256 differs, plumbing/ included, named by run. One run: the committed
    file (git HEAD; outside a git checkout, this folder's) -, the run's copy +, so that the edit a
    run was made with reads as one. A run without a record says so."""
    codes = {a: code_of(a)} | ({} if b is None else {b: code_of(b)})
    unknown = [f"{p}: no record of its code (no run.json with \"code\": a run of an earlier version); "
               f"nothing to diff" for p, c in codes.items() if c is None]
    if unknown:
        return "\n".join(unknown)
    notes = [note for p, c in codes.items() for note in check_copies(p, c)]
    old = _run_side(a, codes[a]) if b is not None else _reference_side(list(codes[a]))
    new = _run_side(b, codes[b]) if b is not None else _run_side(a, codes[a])
    out, same, only = [], [], {old.who: [], new.who: []}
    for name in dict.fromkeys([*old.code, *new.code]):
        sha_old, sha_new = old.code.get(name), new.code.get(name)
        if sha_old == sha_new:
            same.append(name)
        elif sha_old is None or sha_new is None:
            only[new.who if sha_old is None else old.who].append(name)
        else:
            out += difflib.unified_diff(_lines(old.read(name)), _lines(new.read(name)), old.name(name),
                                        new.name(name), lineterm="")
    for who, names in only.items():
        if names:
            other = next(s for s in (old, new) if s.who != who)
            earlier = b is not None and _earlier_record(other.code)
            out.append(f"only in {who}'s code: {', '.join(names)}" + (
                f" ({other.who}'s run.json records {', '.join(other.code)} only: an earlier version's "
                f"record)" if earlier else ""))
    if not out and notes:
        return "\n".join(notes + [f"{old.who} and {new.who}: run.json records the same sha256 for each file "
                                  f"({', '.join(same)}), but a copy in code/ is not that file (above)"])
    if not out:
        return f"{old.who} and {new.who}: the same code ({', '.join(same)})"
    return "\n".join(notes + out + ([f"the same in both: {', '.join(same)}"] if same else []))


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else ",".join(map(_fmt, v)) if isinstance(v, list) else str(v)


def _short_paths(values: list[str]) -> dict[str, str]:
    """The fewest trailing path parts that still tell the values apart (model and data paths)."""
    uniq = sorted(set(values))
    for n in range(1, max(len(Path(v).parts) for v in uniq) + 1):
        short = {v: "/".join(Path(v).parts[-n:]) for v in uniq}
        if len(set(short.values())) == len(uniq):
            return short
    return {v: v for v in uniq}


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs with the same script, code, pooler and args.json but for IGNORED form one group, in
    the order first given: {"runs", "label", "finished", "code_shown"}. A label names the script
    (or, for a run from before scripts were recorded, its folder), the flags whose values differ
    between groups, the pooler of the final evaluation, and where the groups of its script started
    with different code, its code (code_labels, against this checkout's commit; "code_note" says
    so under the table): an edit shows as a row, not as seed noise."""
    groups: dict[Any, dict] = {}
    for r in runs:
        trained = None if r["args"] is None else {k: v for k, v in r["args"].items() if k not in IGNORED}
        key = (("folder", str(r["path"])) if trained is None else   # drawn only: a group of its own
               (r["test"] is not None, r["script"], r["pooler"], _code_key(r["code"]),
                json.dumps(trained, sort_keys=True, default=str)))
        groups.setdefault(key, {"runs": [], "finished": r["test"] is not None})["runs"].append(r)
    out = list(groups.values())
    firsts = [g["runs"][0]["args"] for g in out if g["runs"][0]["args"] is not None]
    differing = {}   # the flags that tell groups apart: a value not the same in every group that has it
    for k in sorted({k for args in firsts for k in args} - set(IGNORED) - {"pooler"}):
        strs = [_fmt(args[k]) for args in firsts if k in args]
        if len({json.dumps(args[k], sort_keys=True, default=str) for args in firsts if k in args}) > 1:
            differing[k] = _short_paths(strs) if any("/" in s for s in strs) else {s: s for s in strs}
    # the scripts whose groups started with different code (a run whose code is unknown included)
    codes_of: dict[Any, set] = {}
    for g in (g for g in out if g["runs"][0]["args"] is not None):
        codes_of.setdefault(g["runs"][0]["script"], set()).add(_code_key(g["runs"][0]["code"]))
    shown = any(len(keys) > 1 for keys in codes_of.values())
    ref = committed() if shown else ""
    by_start = sorted((r for r in runs if r["args"] is not None),
                      key=lambda r: (r["started"], str(r["path"])))
    labels = code_labels([(r["script"], r["code"]) for r in by_start], ref) if shown else {}
    for g in out:
        first = g["runs"][0]
        g["code_shown"] = first["args"] is not None and len(codes_of[first["script"]]) > 1
        g["code_note"] = code_note(ref) if g["code_shown"] else None
        if first["args"] is None:
            parent = first["path"].parent
            run_json = parent / "run.json"
            script = _read_json(run_json).get("script") if run_json.is_file() else None
            g["label"] = f"{script or parent.name} {first['path'].name}"
            continue
        names = [str(r["path"]) for r in g["runs"]]
        head = first["script"] or (os.path.commonprefix(names).rstrip("-_./") or names[0])
        flags = [f"{k}={differing[k][_fmt(first['args'][k])]}" for k in differing if k in first["args"]]
        code = [labels[_code_key(first["code"])]] if g["code_shown"] else []
        g["label"] = " ".join([head, *flags, f"[{first['pooler'] or 'pooler not recorded'}]", *code]) \
            + ("" if g["finished"] else " (unfinished)")
    return out


def compare_table(groups: list[dict], baseline: tuple[str, dict] | None = None) -> dict:
    """{"tasks", "rows": [{"label", "script", "n", "runs", "mean": {task: x}, "std": {task: x or None}}],
    "code_note", "noise"}: a group's mean over its seeds of each task and of the average, with the
    sample std (ddof=1) from two seeds on; the line under the table that says what its code labels
    are named against (or None); noise_lines. Every run must hold the same tasks."""
    finished, tasks, first = [g for g in groups if g["finished"]], None, None
    for r in (r for g in finished for r in g["runs"]):
        t = result_tasks(r["test"])
        if tasks is None:
            tasks, first = t, r["path"]
        elif t != tasks:
            raise UserError(f"{r['path']}: its best/test_metrics.json holds {', '.join(t)}, but {first}'s "
                            f"holds {', '.join(tasks)}. Compare runs evaluated on the same tasks (in "
                            f"separate commands), or re-evaluate one with `python tools/eval.py --model "
                            f"{r['path']}/best --output ...`.")
    tasks = tasks or (result_tasks(baseline[1]) if baseline else list(STS_TASKS))
    rows = []
    if baseline:
        rows.append({"label": baseline[0], "script": None, "n": None, "runs": [],
                     "std": {t: None for t in tasks + ["avg"]},
                     "mean": {**{t: baseline[1][t]["spearman"] for t in tasks}, "avg": baseline[1]["avg"]}})
    for g in finished:
        per_run = np.array([[r["test"][t]["spearman"] for t in tasks] + [r["test"]["avg"]]
                            for r in g["runs"]], dtype=np.float64)            # (n, tasks + 1)
        std = per_run.std(0, ddof=1).tolist() if len(per_run) >= 2 else [None] * per_run.shape[1]
        rows.append({"label": g["label"], "script": g["runs"][0]["script"], "n": len(per_run),
                     "runs": [r["path"] for r in g["runs"]],
                     "mean": dict(zip(tasks + ["avg"], per_run.mean(0).tolist())),
                     "std": dict(zip(tasks + ["avg"], std))})
    return {"tasks": tasks, "rows": rows, "noise": noise_lines(rows),
            "code_note": next((g["code_note"] for g in finished if g["code_shown"]), None)}


def seed_spread(script: str | None) -> str:
    """How far apart two seeds of `script` ended on the laptop testbed, and where that is printed."""
    if script not in SEED_SPREAD:
        return f"no seed spread was measured for {script or 'this row'}"
    spread, where = SEED_SPREAD[script]
    return f"two seeds of {script} ended {spread:.2f} apart on the laptop testbed ({where})"


def noise_lines(rows: list[dict]) -> list[str]:
    """What the table cannot tell from seed noise, one line each: the rows of a single seed (n = 1),
    and every two rows whose averages differ by less than two seeds of their script ended apart
    on the laptop testbed (SEED_SPREAD; the larger of two scripts'). Nothing for a table of one row."""
    if len(rows) < 2:
        return []
    lines, one = [], [r for r in rows if r["n"] == 1]
    if one:
        scripts = dict.fromkeys(r["script"] for r in one)
        which = ("every row is" if len(one) == sum(r["n"] is not None for r in rows) else
                 f"{'; '.join(r['label'] for r in one)} {'is' if len(one) == 1 else 'are each'}")
        lines.append(f"one seed: {which} one run (n = 1), and one seed cannot tell a difference from seed "
                     f"noise: " + "; ".join(seed_spread(s) for s in scripts))
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            known = [s for s in dict.fromkeys((a["script"], b["script"])) if s in SEED_SPREAD]
            if not known:
                continue
            script = max(known, key=lambda s: SEED_SPREAD[s][0])
            diff = b["mean"]["avg"] - a["mean"]["avg"]
            if abs(diff) < SEED_SPREAD[script][0]:
                lines.append(f"within seed noise: {b['label']} against {a['label']}: {diff:+.2f} on the "
                             f"average, less than {seed_spread(script)}")
    return lines


def _cells(table: dict) -> tuple[list[str], list[list[str]]]:
    """Column names, and one list of cells a row: 'mean' or 'mean ± std'."""
    cells = [[f"{r['mean'][t]:.2f}" + ("" if r["std"][t] is None else f" ± {r['std'][t]:.2f}")
              for t in table["tasks"] + ["avg"]] for r in table["rows"]]
    return [SHORT.get(t, t) for t in table["tasks"]] + ["Avg."], cells


def format_compare(table: dict) -> str:
    """The table as plain text, one row a group."""
    cols, cells = _cells(table)
    lw = max([3] + [len(r["label"]) for r in table["rows"]])
    cw = max([len(c) for c in cols] + [len(c) for row in cells for c in row]) + 2
    lines = [f"{'run':{lw}s}{'n':>4s}" + "".join(f"{c:>{cw}s}" for c in cols)]
    lines += [f"{r['label']:{lw}s}{'-' if r['n'] is None else r['n']:>4}"
              + "".join(f"{c:>{cw}s}" for c in row) for r, row in zip(table["rows"], cells)]
    notes = [NOTE] + ([table["code_note"]] if table.get("code_note") else [])
    return "\n".join(lines + notes + table.get("noise", []))


def format_markdown(table: dict, command: str) -> str:
    """The table as Markdown, with the command that made it."""
    cols, cells = _cells(table)
    lines = ["| " + " | ".join(["run", "n"] + cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for r, row in zip(table["rows"], cells):
        n = "-" if r["n"] is None else str(r["n"])
        lines.append("| " + " | ".join([r["label"].replace("|", "\\|"), n] + row) + " |")
    code_note = f" {table['code_note']}" if table.get("code_note") else ""
    noise = "".join(f"\n- {line}" for line in table.get("noise", []))
    return "\n".join(lines) + f"\n\n{NOTE}{code_note} Made with `{command}`.\n" + (noise and f"{noise}\n")


# What each method's own part acts on, as its script logs it in every training record of
# metrics.jsonl (a script not named here has no figure of its own: SimCSE's dropout shows in Fig. 2)
MECHANISM = {
    "ifcl.py": ("margin", "twins_gap", "cos_identical", "cos_fraternal", "l_twins", "l_fraternal"),
    "focal_infonce.py": ("s_p", "s_n", "hard_frac"),
    "conisi.py": ("acc_interactive", "loss_interactive", "share_interactive"),
    "rcl.py": ("contrastive", "regulators"),
}
# rcl.py's entropy models, each in an entropy_phi<phi>/ folder of the run: Eq. (2)'s phi * H beside
# the loss it is part of
STAGE_MECHANISM = ("loss", "phi_entropy", "entropy")


def log_records(folder: Path, wanted: Callable[[dict], bool]) -> list[dict]:
    """The records of a run's metrics.jsonl that `wanted` keeps, one a step, in step order: a step
    logged twice (as after a --resume) keeps its last record; a line cut short by an interruption,
    or one without a step, is skipped. compare's one reader of the log."""
    by_step, path = {}, folder / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and wanted(record):
                by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def training_records(folder: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl (those with a learning rate), in step order."""
    return log_records(folder, lambda record: "lr" in record)


def _steps(records: list[dict], i: int) -> str:
    """The steps record i's means cover: from the step after the record before it."""
    return f"{records[i - 1]['step'] + 1 if i > 0 else 1}-{records[i]['step']}"


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3g}"
    return f"{np.mean(values):.3g}±{np.std(values, ddof=1):.1g}"


def mechanism_rows(groups: list[dict]) -> list[dict]:
    """[{"label", "kind", "steps", "figures": {figure: "start → end"}}]: for every finished group of
    a script in MECHANISM, its figures in the first and in the last training record, mean±std over
    the group's runs; for RCL, a row too for each entropy model (kind "rcl.py entropy models")."""
    rows = []
    for g in (g for g in groups if g["finished"] and g["runs"][0]["script"] in MECHANISM):
        script = g["runs"][0]["script"]
        parts = [(g["label"], script, Path(), MECHANISM[script])]
        parts += [(f"{g['label']} / {d.name}", f"{script} entropy models", Path(d.name), STAGE_MECHANISM)
                  for d in sorted(g["runs"][0]["path"].glob("entropy_phi*")) if d.is_dir()]
        for label, kind, sub, keys in parts:
            logs = [training_records(r["path"] / sub) for r in g["runs"]]
            if not all(logs):
                continue
            figures = {k: " → ".join(_mean_std([log[i][k] for log in logs]) for i in (0, -1))
                       for k in keys if all(k in log[0] and k in log[-1] for log in logs)}
            if figures:
                rows.append({"label": label, "kind": kind, "figures": figures,
                             "steps": f"{_steps(logs[0], 0)} → {_steps(logs[0], len(logs[0]) - 1)}"})
    return rows


MECHANISM_NOTE = ("What each method's own part did, as metrics.jsonl logs it: the first training record "
                  "(the mean over its steps) → the last; n seeds: mean±sample std.")


def format_mechanism(rows: list[dict], markdown: bool = False) -> str:
    """The mechanism tables: one a kind of row (a script, or RCL's entropy models), one column a
    figure it logs ('-' where a row has none: an ablation that drops the term)."""
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        some = [r for r in rows if r["kind"] == kind]
        keys = list(dict.fromkeys(k for r in some for k in r["figures"]))
        head = ["run", "steps", *keys]
        cells = [[r["label"], r["steps"], *(r["figures"].get(k, "-") for k in keys)] for r in some]
        if markdown:
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        else:
            w = [max(len(x) for x in [h] + [row[i] for row in cells]) for i, h in enumerate(head)]
            lines = ["  ".join([f"{row[0]:<{w[0]}s}", *(f"{x:>{n}s}" for x, n in zip(row[1:], w[1:]))])
                     for row in [head, *cells]]
        out.append("\n".join(lines))
    return "\n\n".join(out) + f"\n\n{MECHANISM_NOTE}" + ("\n" if markdown else "")


def _evaluations(folder: Path, keys: tuple[str, ...]) -> tuple[list[int], list[list[float]]]:
    """The evaluation records of a run's metrics.jsonl that hold a number for every one of `keys`,
    in training order: (steps, one list of values a key)."""
    def wanted(record: dict) -> bool:
        return all(isinstance(record.get(k), (int, float)) for k in keys)
    records = log_records(folder, wanted)
    return [int(r["step"]) for r in records], [[float(r[k]) for r in records] for k in keys]


def dev_curve(folder: Path) -> tuple[list[int], list[float]]:
    """(steps, STS-B dev) from a run's metrics.jsonl: the records that have "stsb_dev"."""
    steps, (dev,) = _evaluations(folder, ("stsb_dev",))
    return steps, dev


def align_uniform_curve(folder: Path) -> tuple[list[int], list[float], list[float]]:
    """(steps, l_align, l_uniform) from a run's metrics.jsonl, in training order: the evaluation
    records that have "alignment" and "uniformity" (Wang & Isola 2020, on STS-B test). A log from
    before they were recorded has none; the untrained encoder (step 0) is never in a log."""
    steps, (align, uniform) = _evaluations(folder, ("alignment", "uniformity"))
    return steps, align, uniform


def _pyplot():
    """matplotlib's pyplot (no display needed), or a UserError that says how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed: `pip install matplotlib` "
                        "(nothing else in this project needs it), or leave out --plot.")
    return plt


def _run_label(g: dict, r: dict) -> str:
    """A run's own name in a legend: its group's label (the table's row) and its seed."""
    seed = (r["args"] or {}).get("seed")
    return g["label"] if seed is None else f"{g['label']}, seed {seed}"


def _draw_dev_curves(ax, groups: list[dict]) -> None:
    """Each run's STS-B dev curve over the steps, one colour a group (every seed drawn: the
    spread shows), labelled as the table labels its rows."""
    for i, g in enumerate(groups):
        for j, r in enumerate(g["runs"]):
            ax.plot(*dev_curve(r["path"]), marker="o", markersize=3, color=f"C{i % 10}",
                    alpha=1.0 if len(g["runs"]) == 1 else 0.7,
                    label=f"{g['label']}, n={len(g['runs'])}" if j == 0 else None)
    ax.set(xlabel="step", ylabel="STS-B dev (Spearman x100)", title="STS-B dev over training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


SEED_MARKERS = "os^Dvp*hX"   # one marker shape a seed within a group; the colour is the group's


def _draw_align_uniform(ax, groups: list[dict], start: dict | None = None) -> None:
    """SimCSE's Fig. 2 (Gao et al. 2021): l_uniform on x, l_align on y, lower is better for both,
    so a run heads for the lower left. One trajectory a run (seeds not averaged) through its
    evaluations in training order: a marker at each, the first one hollow, arrows along the way.
    `start` (--baseline): the untrained encoder {"label", "alignment", "uniformity", "pooler"},
    a black star, joined by a dashed line to the first evaluation of every run evaluated with
    its pooler, since that is where each of them began."""
    # NOTE(ours): the paper plots a checkpoint every 10 steps; a log holds one every --eval_every
    if start:
        ax.plot([start["uniformity"]], [start["alignment"]], marker="*", markersize=14, color="black",
                linestyle="none", label=start["label"], zorder=3)
    for i, g in enumerate(groups):
        for j, r in enumerate(g["runs"]):
            steps, align, uniform = align_uniform_curve(r["path"])
            if not steps:
                continue   # a log from before alignment/uniformity were recorded: main says so
            color, marker = f"C{i % 10}", SEED_MARKERS[j % len(SEED_MARKERS)]
            ax.plot(uniform, align, marker=marker, markersize=4, linewidth=1, color=color,
                    label=_run_label(g, r))
            if start and r["pooler"] == start["pooler"]:   # from the untrained encoder, its start
                ax.plot([start["uniformity"], uniform[0]], [start["alignment"], align[0]], color=color,
                        linestyle="--", linewidth=0.8, alpha=0.6, label="_from_untrained")
            # the start: the first evaluation (not the untrained encoder, which no log holds)
            ax.plot(uniform[:1], align[:1], marker=marker, markersize=9, linestyle="none",
                    markerfacecolor="white", markeredgecolor=color, label="_start")
            # arrows: the direction of training, on about 8 segments however many there are (the
            # last one among them)
            segments = len(steps) - 1
            for k in sorted({*range(0, segments, max(1, segments // 8)), segments - 1} - {-1}):
                ax.annotate("", xy=(uniform[k + 1], align[k + 1]), xytext=(uniform[k], align[k]),
                            arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.2,
                                        "mutation_scale": 14, "shrinkA": 2, "shrinkB": 2})
    ax.set(xlabel=r"$\ell_{\mathrm{uniform}}$ (STS-B test; lower is better)",
           ylabel=r"$\ell_{\mathrm{align}}$ (STS-B pairs with gold > 4; lower is better)",
           title="alignment against uniformity over training (SimCSE Fig. 2)\n"
                 "hollow marker: first evaluation; arrows: direction of training"
                 + ("; star: untrained" if start else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def figure(groups: list[dict], start: dict | None = None):
    """The --plot figure: STS-B dev over the steps | l_align against l_uniform (SimCSE's Fig. 2,
    from the untrained encoder `start` when given), side by side with one colour a group in both;
    the dev curves alone when no run logged alignment and uniformity. Returns the Figure."""
    # NOTE(ours): one file, two panels rather than a second file: --plot names one image (the
    # README shows one a command), and a reader sees where a run's dev score peaks and, beside it
    # in the same colour, how its alignment and uniformity moved meanwhile
    plt = _pyplot()
    fig2 = any(align_uniform_curve(r["path"])[0] for g in groups for r in g["runs"])
    fig, axes = plt.subplots(1, 2 if fig2 else 1, figsize=(17, 6.5) if fig2 else (9, 5.5), squeeze=False)
    _draw_dev_curves(axes[0, 0], groups)
    if fig2:
        _draw_align_uniform(axes[0, 1], groups, start)
    fig.tight_layout()
    return fig


def plot_runs(groups: list[dict], path: str | Path, start: dict | None = None) -> bool:
    """Writes figure(groups, start) to `path`; True when it has the alignment-uniformity panel."""
    fig = figure(groups, start)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return len(fig.axes) == 2


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else [str(x) for x in argv]
    args = common.parse_args(Args, argv, description=__doc__, prog="python tools/compare.py")
    if not args.runs:
        raise UserError("give at least one run folder, e.g. `python tools/compare.py runs/simcse "
                        "runs/focal_infonce` (to score an encoder alone: `python tools/eval.py`).")
    if args.pooler != "cls_before_pooler" and not args.baseline:
        raise UserError("--pooler applies to the --baseline row only: add --baseline MODEL, or drop "
                        "--pooler.")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UserError(f"--plot {args.plot}: give a file name ending in .png, .pdf or .svg.")
    expanded = [(f, run_folders(f)) for f in args.runs]
    seen, folders = set(), [r for _, rs in expanded for r in rs]
    found = {r for f, rs in expanded for r in rs if r != Path(f)}   # in a folder of runs, not named
    for f in folders:
        if Path(f).resolve() in seen:
            raise UserError(f"{f}: given twice. Give each run folder once.")
        seen.add(Path(f).resolve())
    if args.code_diff:
        if args.plot or args.markdown or args.baseline:
            raise UserError("--code_diff shows code, not results: leave out --plot, --markdown and "
                            "--baseline (run compare again without --code_diff for those).")
        if len(folders) > 2:
            raise UserError(f"--code_diff: {len(folders)} run folders ({', '.join(map(str, folders))}); give "
                            f"two runs, or one to hold against the committed code.")
        print(code_diff(*map(Path, folders)))
        return
    # NOTE(ours): a folder of runs stands for those that finished; its unfinished ones (a Ctrl-C'd
    # run) are left out with one note, not a stop. A run named by itself is still refused
    left = [f for f in folders if f in found and not is_finished(f)
            and not (args.plot and (f / "metrics.jsonl").is_file())]      # --plot draws these
    folders = [f for f in folders if f not in left]
    left_note = (f"left out, unfinished (no best/test_metrics.json): {', '.join(map(str, left))} — finish "
                 f"each with its command plus --resume")
    if not folders:
        raise UserError(f"no finished run to compare: {left_note}" + (
            " (they have no metrics.jsonl yet to draw)." if args.plot
            else ", or draw their STS-B dev curves with --plot FILE.png."))
    # everything is read and checked before anything is written or printed; the --baseline's
    # STS data, then whether its encoder can be had (in seconds, offline too), before it loads
    runs = [read_run(f, plot=bool(args.plot)) for f in folders]
    if args.baseline:
        inputs.check_sts_dir(args.sts_dir)
        inputs.where_from(args.baseline, "--baseline")
        inputs.check_model_folder(args.baseline, "--baseline")
    groups = group_runs(runs)
    table = compare_table(groups) if any(g["finished"] for g in groups) else None
    if args.markdown and table is None:
        raise UserError(f"--markdown {args.markdown}: none of the runs has finished: there is no table "
                        f"to write.")
    if left:
        print(f"note: {left_note}", file=sys.stderr)
    if args.plot:
        _pyplot()   # a missing matplotlib is said now, not after the table is out
        for r in runs:
            if r["test"] is None:
                print(f"note: {r['path']}: no final result; its curve is drawn, it is not in the table",
                      file=sys.stderr)
            if not dev_curve(r["path"])[0]:
                print(f"note: {r['path']}: no STS-B dev evaluation in metrics.jsonl: no curve",
                      file=sys.stderr)
            if not align_uniform_curve(r["path"])[0]:
                print(f"note: {r['path']}: no alignment/uniformity in metrics.jsonl (a log from before "
                      f"they were recorded): left out of the alignment-uniformity panel", file=sys.stderr)
    start = None
    if args.baseline:   # the untrained encoder, evaluated as `python tools/eval.py` does
        tasks = table["tasks"] if table else None
        encode = common.saved_encoder(args.baseline, args.pooler, args.batch_size)
        label = f"{Path(args.baseline).name or args.baseline} untrained [{args.pooler}]"
        res = common.evaluate_sts(encode, args.sts_dir, tasks=tasks, split="test", desc=label)
        table = compare_table(groups, (label, res))
        if args.plot:   # where the runs evaluated with its pooler start in Fig. 2
            start = {"label": label, "pooler": args.pooler,
                     **common.alignment_uniformity(encode, args.sts_dir, desc=label)}
            print(f"{label}: alignment {start['alignment']:.3f} / uniformity {start['uniformity']:.3f} "
                  f"on STS-B test (the star in the second panel)", file=sys.stderr)
    mechanism = mechanism_rows(groups)
    if table is not None:
        print(format_compare(table))
        if mechanism:
            print("\n" + format_mechanism(mechanism))
        for g in (g for g in groups if g["finished"]):   # which folders (and seeds) each row is made of
            seeds = [r["args"].get("seed") for r in g["runs"]]
            print(f"  {g['label']}: " + ", ".join(f"{r['path']} (seed {s})" for r, s in zip(g["runs"], seeds))
                  + ("  NOTE: the same seed twice" if len(set(seeds)) < len(seeds) else ""), file=sys.stderr)
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            command = " ".join(["python tools/compare.py"] + [shlex.quote(x) for x in argv])
            text = format_markdown(table, command)
            if mechanism:
                text += "\n" + format_mechanism(mechanism, markdown=True)
            Path(args.markdown).write_text(text, encoding="utf-8")
            print(f"Markdown table: {args.markdown}", file=sys.stderr)
    if args.plot:
        both = plot_runs(groups, args.plot, start)
        print(f"STS-B dev curves{' | alignment against uniformity (SimCSE Fig. 2)' if both else ''}: "
              f"{args.plot}", file=sys.stderr)


if __name__ == "__main__":
    common.run_main(main)
