r"""Experiments to try: one change to one script, run beside the unchanged script on the laptop testbed.

    python tools/experiment.py --list                    # every experiment: script, title, measured?, time
    python tools/experiment.py simcse-no-negatives       # both arms, seeds 1 and 2: a table and the curves
    python tools/experiment.py focal-m0 ifcl-eps1 --seeds 1 2 3
    python tools/experiment.py --all                     # all of them (a control they share runs once)
    python tools/experiment.py --check                   # which experiments to measure again (CI runs it)
    python tools/experiment.py --all --record            # maintainers: into docs/experiments/

docs/experiments/experiments.toml lists the experiments (its header says what each field means).
Each changes one part of one script: a patch (docs/experiments/NAME.patch, which you can also apply
to your checkout yourself with `git apply`, and undo with `git apply -R`), or a flag the paper names,
or both. An experiment has two arms, run with each seed:
    control   the script as committed, with the testbed's flags and the experiment's `settings`
    changed   the same, with the patch applied and the experiment's `flags` added
Both arms run from a copy of the committed code (`git archive HEAD`) under --runs, never from your
checkout, so that an edit you are making never leaks into a measurement: the changed arm's copy is
the one the patch is applied to. Where your working tree's script differs from the commit, one line
says so; the arms still run the committed code.

Nothing is run twice. A run folder (--runs/arms/) is named after its script, its code (the sha256
of the script, common.py and plumbing/ in its copy: what a run imports) and its flags, so an arm
that finished before (best/test_metrics.json there, its run.json naming the same code, its
args.json the same flags) is reused, not run again, and says "reused"; that also shares a control
between every experiment of a script with the same settings, and keeps a run of one script across
a commit that changed another. A run that did not finish (stopped, or failed) is started again
from its first step. The wall time of each run
(seconds around the process, on whatever else the machine was doing) is kept in
--runs/wall_times.json, beside the run folders, not in them.

What it prints, per experiment: a table (Markdown) with one row per arm: the 7-task STS average of
best/ (mean ± sample std over the seeds), STS-B dev of best/, each of the experiment's figures as
"first → last" (its first and last value in metrics.jsonl, mean over the seeds; "-" where an arm
does not log it), and the wall time of one run; then one line: whether the 7-task difference is
within the seed spread (the two arms' seeds overlap) and the difference of the means. A plot draws
each figure over the steps, one colour an arm, one line a seed. Both go to --runs/NAME/ (table.md,
NAME.png, figures.json); --record writes them to docs/experiments/ instead, for the docs to show.

--check (no training): exit status 1 with one line per experiment to measure again (its script
changed since the commit it was measured at, or its patch or flags changed since), per patch that
no longer applies to its script, and per docs/<method>.md whose experiments section is not what
--docs writes; else 0, one line, and a note naming the experiments not measured yet.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import hashlib
import io
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/experiment.py` from anywhere
from plumbing.errors import UserError  # noqa: E402
from plumbing.flags import arg, parse_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]          # the checkout: its committed code is what the arms run
HERE = Path("docs") / "experiments"                  # the manifest, the patches and the figures, under a root
MANIFEST = "experiments.toml"
FIGURES = "figures.json"
MINILM = "all-MiniLM-L6-v2"

# ------------------------------------------------------------------------------------------------
# The laptop testbed (docs/results.md's, at 40 steps): what every run adds to its script's defaults.
# {model}, {data}, {sts_dir} and {multi30k} are this tool's flags of those names; "every run" comes
# first, then the script's own. IFCL trains on Multi30k's English-German pairs, with the encoder's own
# embedding layer as the fraternal one; RCL trains at SimCSE's lr; both read raw [CLS], as the others do
# by default. --steps N (a check of the tool, not a measurement) replaces the 40 steps.
# ------------------------------------------------------------------------------------------------
TESTBED = {
    "every run": ["--model", "{model}", "--sts_dir", "{sts_dir}",
                  "--max_steps", "40", "--eval_every", "20", "--log_every", "5"],
    "simcse.py": ["--data", "{data}"],
    "focal_infonce.py": ["--data", "{data}"],
    "conisi.py": ["--data", "{data}"],
    "rcl.py": ["--data", "{data}", "--pooler", "cls_before_pooler", "--lr", "3e-5"],
    "ifcl.py": ["--data", "{multi30k}/train.en", "--fraternal_data", "{multi30k}/train.de",
                "--fraternal_model", "{model}", "--pooler", "cls_before_pooler"],
}
SEEDS = [1, 2]


def default_model() -> str:
    """The local copy of the testbed's encoder where there is one, else its hub name."""
    local = Path("models") / MINILM
    return str(local) if (ROOT / local).is_dir() else f"sentence-transformers/{MINILM}"


def testbed_text() -> str:
    """The testbed, as --help states it."""
    every = " ".join(TESTBED["every run"])
    own = "\n".join(f"  {script:17s} {' '.join(flags)}" for script, flags in TESTBED.items()
                    if script != "every run")
    return (f"The testbed (TESTBED in this file): every run gets\n  {every}\nand its script's own "
            f"flags:\n{own}\nseeds {' '.join(map(str, SEEDS))}; {{model}} etc. are the flags below.")


@dataclass
class Args:
    # NOTE(ours): `builtins.list`, because the field named `list` (the --list flag) would otherwise be what
    # `list[str]` means inside this class when the shared parser reads its type hints
    names: builtins.list[str] = arg([], "the experiments to run (--list names them)", positional=True)
    all: bool = arg(False, "run every experiment of docs/experiments/experiments.toml")
    list: bool = arg(False, "list the experiments: script, title, whether measured, time of a run")
    check: bool = arg(False, "no training: name each experiment to measure again and each patch that no "
                             "longer applies (exit status 1), else one line (exit status 0)")
    record: bool = arg(False, "maintainers: write the figures to docs/experiments/figures.json and the plots "
                              "to docs/experiments/NAME.png (the paths of the testbed must be relative ones)")
    seeds: builtins.list[int] = arg([*SEEDS], "the seeds each arm runs with")
    model: str = arg("", f"the encoder (default: models/{MINILM} where that folder exists, else "
                         f"sentence-transformers/{MINILM})")
    data: str = arg("data/wiki1m_head.txt", "the sentences of every script but IFCL (docs/results.md "
                                            "makes this file)")
    sts_dir: str = arg("data/sts", "SentEval's STS/ and SICK/ folders")
    multi30k: str = arg("data/multi30k", "IFCL's Multi30k folder: train.en and train.de (docs/results.md)")
    runs: str = arg("runs/experiments", "where the code copies, the run folders, the wall times and each "
                                        "experiment's table and plot go")
    docs: bool = arg(False, "no training: write each docs/<method>.md's experiments section from "
                            "docs/experiments/ (--record does it too)")
    steps: int = arg(0, "a shorter run than the testbed's 40 steps, to check that the tool works (not a "
                        "measurement; refused with --record); 0 = the testbed's", ge=0)
    figures: str = arg("", f"the figures file that --check reads and --record writes (default: "
                           f"{(HERE / FIGURES).as_posix()})")


# ------------------------------------------------------------------------------------------------
# The manifest: docs/experiments/experiments.toml, read into Experiment objects (tools/pages.py
# builds the "Try it" blocks from these, with anchor_line, command, patch_path and read_figures)
# ------------------------------------------------------------------------------------------------

@dataclass
class Experiment:
    name: str                       # docs/experiments/NAME.patch, if it has one
    script: str                     # the script it changes: simcse.py, ...
    title: str                      # what the change is, in a few words
    question: str                   # what the paper says the part does
    figures: list[str]              # metrics.jsonl keys it acts on; "STAGE_GLOB/key" reads a stage's log
    flags: list[str] = field(default_factory=list)      # the changed arm's own flags
    settings: list[str] = field(default_factory=list)   # flags of both arms beyond the testbed's
    anchor: str = ""                # a string of the line it is about (else the patch's first change)


KEYS = {f.name for f in dataclasses.fields(Experiment)}


def read_toml(path: Path) -> dict:
    """A TOML file (tomllib is Python 3.11's; on 3.10 the same parser is the package tomli)."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise UserError(f"reading {path} needs Python 3.11 or newer, or `pip install tomli`.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: cannot be read as TOML ({e}). Put back the committed file "
                        f"(`git checkout {path.as_posix()}`) or mend the line it names.")


def load_experiments(root: Path = ROOT) -> builtins.list[Experiment]:
    """Every experiment of the manifest, in its order; each checked on its own (a name given once, a
    script that exists, a patch or flags, figures to read), or a UserError naming it."""
    path = root / HERE / MANIFEST
    out: builtins.list[Experiment] = []
    for i, entry in enumerate(read_toml(path).get("experiment", []), 1):
        name = entry.get("name", f"experiment {i}")
        if unknown := sorted(set(entry) - KEYS):
            raise UserError(f"{path}: {name}: unknown field {', '.join(unknown)} (the header lists the "
                            f"fields).")
        missing = [k for k in ("name", "script", "title", "question", "figures") if not entry.get(k)]
        if missing:
            raise UserError(f"{path}: {name}: no {', '.join(missing)}.")
        exp = Experiment(**{k: list(v) if isinstance(v, builtins.list) else v for k, v in entry.items()})
        if any(e.name == exp.name for e in out):
            raise UserError(f"{path}: the name {exp.name} is given twice.")
        if not (root / exp.script).is_file():
            raise UserError(f"{path}: {exp.name}: no script {exp.script} in {root}.")
        if not exp.flags and not patch_path(exp, root).is_file():
            raise UserError(f"{path}: {exp.name}: neither flags nor a patch {patch_path(exp, root)}.")
        out.append(exp)
    return out


def patch_path(exp: Experiment, root: Path = ROOT) -> Path:
    """Where the experiment's patch is (docs/experiments/NAME.patch), whether or not it has one."""
    return root / HERE / f"{exp.name}.patch"


def command(exp: Experiment) -> str:
    """The one command that runs the experiment, both arms, and prints what it measured."""
    return f"python tools/experiment.py {exp.name}"


def by_hand(exp: Experiment, seed: int = SEEDS[0], root: Path = ROOT) -> str:
    """The changed arm as a student runs it in a checkout of their own: the patch applied, then the
    script with the testbed's flags (the defaults of this tool's flags) and the experiment's. The
    encoder by its hub name, whatever this machine keeps in models/: the pages show this command."""
    tb = Testbed(model=f"sentence-transformers/{MINILM}", data="data/wiki1m_head.txt", sts_dir="data/sts",
                 multi30k="data/multi30k")
    argv = merge(tb.flags(exp.script), exp.settings, exp.flags, ["--seed", str(seed)])
    has = patch_path(exp, root).is_file()
    patch = f"git apply {(HERE / f'{exp.name}.patch').as_posix()} && " if has else ""
    return f"{patch}python {exp.script} {shlex.join(argv)}"


def anchor_line(exp: Experiment, script_text: str, root: Path = ROOT) -> int:
    """The line (1-based) of `script_text` that the experiment is about: the first line containing its
    `anchor`; without one, the first line its patch removes or, for a patch that only adds, the line
    it adds before (found by its text, nearest the hunk's line number, so that lines added above
    since the patch was made do not move it). ValueError, naming the experiment, if there is none."""
    lines = script_text.splitlines()
    if exp.anchor:
        hit = next((i for i, line in enumerate(lines, 1) if exp.anchor in line), None)
        if hit is None:
            raise ValueError(f"{exp.name}: its anchor {exp.anchor!r} is on no line of {exp.script}: "
                             f"mend `anchor` in {(HERE / MANIFEST).as_posix()}")
        return hit
    patch = patch_path(exp, root)
    if not patch.is_file():
        raise ValueError(f"{exp.name}: no anchor and no patch: give it an `anchor` in "
                         f"{(HERE / MANIFEST).as_posix()}")
    number, text = first_change(patch.read_text(encoding="utf-8"))
    if text is None:
        raise ValueError(f"{exp.name}: {patch.name} changes no line of {exp.script}")
    hits = [i for i, line in enumerate(lines, 1) if line == text]
    if not hits:
        raise ValueError(f"{exp.name}: the line {patch.name} changes ({text.strip()!r}) is no longer in "
                         f"{exp.script}: the patch needs remaking")
    return min(hits, key=lambda i: abs(i - number))


def first_change(patch: str) -> tuple[int, str | None]:
    """(the old file's line number, its text) of a patch's first removed line; for a first hunk that
    only adds, the line the addition goes before (or, at a hunk's end, the line after its last one)."""
    old, added_at = 0, None
    for line in patch.splitlines():
        if line.startswith("@@"):
            if added_at is not None:
                return added_at, None
            old = int(line.split()[1].lstrip("-").split(",")[0])   # "@@ -110,8 +110,9 @@": 110
        elif line.startswith(("---", "+++", "diff ", "index ")) or not old:
            continue
        elif line.startswith("-"):
            return old, line[1:]
        elif line.startswith("+"):
            added_at = old if added_at is None else added_at
        elif added_at is not None:                                 # the context after the addition
            return added_at, line[1:]
        else:
            old += 1
    return (added_at or 0), None


def read_figures(root: Path = ROOT, path: Path | None = None) -> dict:
    """docs/experiments/figures.json: experiment name -> what --record kept of it ({} if none yet)."""
    path = path or root / HERE / FIGURES
    if not path.is_file():
        return {}
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e}). Put back the committed file, or record again.")
    if not isinstance(figures, dict):
        raise UserError(f"{path}: not a JSON object of experiments. Put back the committed file.")
    return figures


def laptop_seconds(entry: dict) -> float | None:
    """The wall time of an experiment as recorded: every run of both arms (None where one is unknown)."""
    times = [run.get("wall_s") for arm in entry.get("arms", {}).values() for run in arm["seeds"].values()]
    return sum(times) if times and None not in times else None


def arm_means(entry: dict) -> dict[str, float]:
    """Each recorded arm's 7-task average, the mean over its seeds ({} before it is measured): what the
    pages fold a "Try it" block to."""
    means = {}
    for role, arm in entry.get("arms", {}).items():
        avgs = [run["avg"] for run in arm["seeds"].values() if run.get("avg") is not None]
        if avgs:
            means[role] = statistics.fmean(avgs)
    return means


def patch_size(patch: str) -> int:
    """The lines a unified diff changes (added and removed), its headers left out."""
    return sum(1 for line in patch.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))


# ------------------------------------------------------------------------------------------------
# Flags: a command line as groups (a flag and its values), so that the changed arm's flags replace
# the same flags of the settings (rcl-phi-negative: --phi 0.01 becomes --phi -0.01)
# ------------------------------------------------------------------------------------------------

def groups(argv: builtins.list[str]) -> builtins.list[builtins.list[str]]:
    """["--phi", "0.01", "-0.04", "--no_mlp"] -> [["--phi", "0.01", "-0.04"], ["--no_mlp"]]."""
    out: builtins.list[builtins.list[str]] = []
    for word in argv:
        if word.startswith("--") or not out:
            out.append([word])
        else:
            out[-1].append(word)
    return out


def dest(flag: str) -> str:
    """The Args field a flag sets: --tau -> tau, --no-modulate -> modulate (--no_mlp is a field)."""
    name = flag[2:]
    return name[3:] if name.startswith("no-") else name


def merge(*argvs: builtins.list[str]) -> builtins.list[str]:
    """The command lines one after another, a later flag replacing the same flag given before."""
    kept: dict[str, builtins.list[str]] = {}
    for argv in argvs:
        for g in groups(list(argv)):
            kept.pop(dest(g[0]), None)          # moved to the end: the order a reader expects
            kept[dest(g[0])] = g
    return [word for g in kept.values() for word in g]


def agrees(args_json: dict, argv: builtins.list[str]) -> bool:
    """Whether a run's args.json holds what `argv` sets (a number compared as a number)."""
    def same(have: Any, want: str) -> bool:
        try:
            return float(have) == float(want)
        except (TypeError, ValueError):
            return str(have) == want
    for flag, *values in groups(argv):
        name = dest(flag)
        if name not in args_json:
            return False
        have = args_json[name]
        if isinstance(have, bool):
            ok = have == (not flag.startswith("--no-")) and not values
        elif isinstance(have, builtins.list):
            ok = len(have) == len(values) and all(map(same, have, values))
        else:
            ok = len(values) == 1 and same(have, values[0])
        if not ok:
            return False
    return True


@dataclass
class Testbed:
    """The flags every run gets (TESTBED, filled in); `extra` after them (the tests: a tiny batch)."""
    model: str
    data: str
    sts_dir: str
    multi30k: str
    steps: int = 0                 # 0: the testbed's 40
    extra: builtins.list[str] = field(default_factory=list)

    def flags(self, script: str) -> builtins.list[str]:
        fill = {"model": self.model, "data": self.data, "sts_dir": self.sts_dir,
                "multi30k": self.multi30k.rstrip("/")}
        argv = [word.format(**fill) for word in TESTBED["every run"] + TESTBED[script]]
        if self.steps:
            argv = merge(argv, ["--max_steps", str(self.steps), "--eval_every", str(min(20, self.steps))])
        return merge(argv, self.extra)


# ------------------------------------------------------------------------------------------------
# The code an arm runs: a copy of the commit's code (git archive HEAD), the patch applied to the
# changed arm's copy; never the user's checkout
# ------------------------------------------------------------------------------------------------

def git(*argv: str, root: Path = ROOT, check: bool = True, **kw) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["git", *argv], cwd=root, capture_output=True, **kw)
    except FileNotFoundError:
        raise UserError("this tool needs git (it copies the committed code): install it, and run the tool "
                        "in a clone of the repository.")
    if check and done.returncode:
        err = done.stderr.decode(errors="replace") if isinstance(done.stderr, bytes) else done.stderr
        raise UserError(f"`git {' '.join(argv)}` failed in {root}: {err.strip()}. Run the tool in a clone "
                        f"of the repository, with at least one commit.")
    return done


def commit(root: Path = ROOT) -> str:
    """The commit the arms run (HEAD), by its short hash."""
    return git("rev-parse", "--short=7", "HEAD", root=root, text=True).stdout.strip()


def committed_bytes(path: str, root: Path = ROOT) -> bytes:
    """A file as the commit holds it."""
    return git("show", f"HEAD:{path}", root=root).stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_files(folder: Path, script: str) -> dict[str, str]:
    """What a run of `script` can import in a copy (method scripts never import each other): the script,
    common.py and plumbing/, by sha256. An edit of another script leaves this one's runs reusable."""
    files = sorted([folder / script, folder / "common.py", *folder.glob("plumbing/*.py")])
    return {p.relative_to(folder).as_posix(): sha256(p.read_bytes()) for p in files}


def apply_patch(patch: Path, folder: Path) -> subprocess.CompletedProcess:
    """`git apply PATCH` inside `folder`, a folder of plain files: git told not to look above it for a
    repository (inside one, `git apply` would patch that repository's paths, or quietly skip them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    env["GIT_CEILING_DIRECTORIES"] = str(folder.resolve().parent)
    return subprocess.run(["git", "apply", str(patch.resolve())], cwd=folder, env=env, capture_output=True,
                          text=True)


def code_copy(runs: Path, exp: Experiment | None = None, root: Path = ROOT) -> Path:
    """The committed code (the top-level .py files, plumbing/ and tools/*.py: the commands a run prints
    at its end work in the copy too) in runs/code/<commit>/, or, for an
    experiment with a patch, in runs/code/<commit>-<name>-<patch's sha256>/ with the patch applied.
    Made once (in a temporary folder, then renamed: a copy that is there is whole), reused after."""
    patch = patch_path(exp, root) if exp is not None and patch_path(exp, root).is_file() else None
    name = commit(root) + (f"-{exp.name}-{sha256(patch.read_bytes())[:8]}" if patch else "")
    folder = runs / "code" / name
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    top = git("ls-tree", "--name-only", "HEAD", root=root, text=True).stdout.split()
    paths = [p for p in top if p.endswith(".py")] + [p for p in ("plumbing", "tools/*.py") if
                                                      p.split("/")[0] in top]
    tar = git("archive", "--format=tar", "HEAD", "--", *paths, root=root).stdout
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            try:
                t.extractall(tmp, filter="data")
            except TypeError:                   # a Python before tarfile's filters: the archive is git's own
                t.extractall(tmp)
        if patch:
            before = (tmp / exp.script).read_bytes()
            done = apply_patch(patch, tmp)
            if done.returncode or (tmp / exp.script).read_bytes() == before:
                raise UserError(f"{patch} does not apply to the committed {exp.script} ({commit(root)}): "
                                f"{done.stderr.strip() or 'it changed nothing'}. The patch needs remaking "
                                f"against the script as it is now.")
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def shown(path: Path, root: Path = ROOT) -> str:
    """A path as printed: from the repository root where it is inside it, else whole."""
    path = Path(path).resolve()
    return path.relative_to(root.resolve()).as_posix() if path.is_relative_to(root.resolve()) else str(path)


def differs_from_commit(script: str, root: Path = ROOT) -> bool:
    """Whether the checkout's script is not the committed one (an edit not committed yet)."""
    try:
        return (root / script).read_bytes() != committed_bytes(script, root)
    except (OSError, UserError):
        return True


# ------------------------------------------------------------------------------------------------
# An arm's run: `python <copy>/<script> <flags> --seed S --output_dir <runs>/arms/...`, from the
# repository root (the data's relative paths), timed; or the run that finished before, reused
# ------------------------------------------------------------------------------------------------

@dataclass
class Arm:
    role: str                       # "control" or "changed"
    script: str
    code: Path                      # the copy it runs
    flags: builtins.list[str]       # the testbed's, then the settings (and the changed arm's flags)

    def folder(self, runs: Path, seed: int) -> Path:
        """Its run folder: the script, its code (code_files) and the flags name it."""
        made_of = json.dumps({"script": self.script, "code": code_files(self.code, self.script),
                              "flags": self.flags})
        return runs / "arms" / f"{Path(self.script).stem}-{sha256(made_of.encode())[:10]}-s{seed}"

    def argv(self, runs: Path, seed: int) -> builtins.list[str]:
        return merge(self.flags, ["--seed", str(seed), "--output_dir", str(self.folder(runs, seed))])


def arms(exp: Experiment, testbed: Testbed, runs: Path, root: Path = ROOT) -> tuple[Arm, Arm]:
    """The control (committed code, the testbed and the settings) and the changed arm (the patched copy,
    and the experiment's flags over the settings)."""
    base = testbed.flags(exp.script)
    control = Arm("control", exp.script, code_copy(runs, None, root), merge(base, exp.settings))
    changed = Arm("changed", exp.script, code_copy(runs, exp, root), merge(base, exp.settings, exp.flags))
    return control, changed


def finished(folder: Path, arm: Arm, argv: builtins.list[str]) -> str | None:
    """Why the run in `folder` cannot stand for this arm (None: it can, it is reused): not finished, of
    other code (run.json's, against the copy's files) or of other flags (args.json's)."""
    if not (folder / "best" / "test_metrics.json").is_file():
        return "not finished"
    try:
        code = json.loads((folder / "run.json").read_text(encoding="utf-8"))["code"]
        flags = json.loads((folder / "args.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable run.json and args.json"
    mine = code_files(arm.code, arm.script)
    if arm.script not in code or any(mine.get(path) != sha for path, sha in code.items()):
        return "of other code"
    if not agrees(flags, argv):
        return "of other flags"
    return None


def in_use(folder: Path) -> bool:
    """Whether a process trains in `folder` now: it holds a flock on the folder itself (plumbing/
    run_folder.py), which the system drops when that process ends, however it ends."""
    try:
        import fcntl
    except ImportError:                             # Windows: no lock to ask
        return False
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:                                 # a file system without locks
        return False
    finally:
        os.close(fd)                                # closing drops this probe's own flock


def wall_times(runs: Path) -> dict:
    path = runs / "wall_times.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def keep_wall_time(runs: Path, folder: Path, seconds: float, argv: builtins.list[str]) -> None:
    """One run's wall time into runs/wall_times.json (written whole: a new file renamed over the old)."""
    times = wall_times(runs)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    times[folder.name] = {"seconds": round(seconds, 1), "argv": argv, "finished": now}
    tmp = runs / f".wall_times.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, runs / "wall_times.json")


def run_arm(arm: Arm, seed: int, runs: Path, root: Path = ROOT, env: dict | None = None, quiet: bool = False,
            say: Callable[[str], None] = print) -> dict:
    """One run of an arm with one seed, or the finished one reused: {"run", "reused", "wall_s"}.
    The script's own output goes to this terminal (`quiet`: kept, and shown only if it fails)."""
    folder, argv = arm.folder(runs, seed), arm.argv(runs, seed)
    why = finished(folder, arm, argv) if folder.exists() else "new"
    rel = shown(folder, root)
    if why is None:
        seconds = wall_times(runs).get(folder.name, {}).get("seconds")
        say(f"  {arm.role}, seed {seed}: {rel}: reused (finished before"
            f"{f', {seconds:.0f} s' if seconds is not None else ''})")
        return {"run": folder, "reused": True, "wall_s": seconds}
    if why != "new":
        # NOTE(ours): the folder's name is its script, code and flags, so a run here that is not finished
        # was stopped or failed: it starts again from step 0, so that its wall time is a whole run's
        if in_use(folder):
            raise UserError(f"{rel} is in use by another process (its run.lock names it): wait for it to "
                            f"end, then run the same command again.")
        say(f"  {arm.role}, seed {seed}: {rel} holds a run {why}: started again")
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(arm.code / arm.script), *argv]
    say(f"  {arm.role}, seed {seed}: {rel}\n    {shlex.join(['python', shown(Path(cmd[1]), root), *argv])}")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=quiet, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        tail = f"\n{(done.stdout or '')[-2000:]}{(done.stderr or '')[-4000:]}" if quiet else ""
        raise UserError(f"the {arm.role} arm of seed {seed} ended with exit status {done.returncode} (its "
                        f"own line says why){tail}\nIts command, from {root}: {shlex.join(cmd)}")
    if not (folder / "best" / "test_metrics.json").is_file():
        raise UserError(f"the {arm.role} arm of seed {seed} ended without best/test_metrics.json in "
                        f"{folder}.")
    keep_wall_time(runs, folder, seconds, argv)
    say(f"    done in {seconds:.0f} s")
    return {"run": folder, "reused": False, "wall_s": round(seconds, 1)}


# ------------------------------------------------------------------------------------------------
# What a run measured: best/'s figures and each figure's curve from metrics.jsonl
# ------------------------------------------------------------------------------------------------

def read_log(path: Path) -> builtins.list[dict]:
    """metrics.jsonl's records (a line that is not JSON is left out)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def curves(run: Path, key: str) -> builtins.list[dict]:
    """A figure's curves in a run: {"log", "step", "value"} from each record that carries it. A key
    "STAGE_GLOB/name" reads each matching stage's log (RCL's entropy_phi*/metrics.jsonl), one curve
    each; a plain key reads the run's own log. [] where no record carries it."""
    stage, _, name = key.rpartition("/")
    logs = sorted(run.glob(f"{stage}/metrics.jsonl")) if stage else [run / "metrics.jsonl"]
    out = []
    for log in logs:
        recs = [r for r in read_log(log) if isinstance(r.get(name), (int, float)) and "step" in r]
        if recs:
            out.append({"log": log.relative_to(run).as_posix(), "step": [r["step"] for r in recs],
                        "value": [r[name] for r in recs]})
    return out


def read_run(run: Path, figures: builtins.list[str]) -> dict:
    """One finished run: its 7-task average and STS-B dev (of best/), and for each figure its curves and
    first and last value (the mean over the curves, where a stage glob matched several)."""
    test = json.loads((run / "best" / "test_metrics.json").read_text(encoding="utf-8"))
    dev_file = run / "best" / "dev_metrics.json"
    dev = json.loads(dev_file.read_text(encoding="utf-8")).get("stsb_dev") if dev_file.is_file() else None
    if dev is None:      # best/ was chosen by STS-B dev: the highest the log shows
        dev = max((r["stsb_dev"] for r in read_log(run / "metrics.jsonl") if "stsb_dev" in r), default=None)
    out: dict[str, Any] = {"avg": test.get("avg"), "stsb_dev": dev, "figures": {}}
    for key in figures:
        cs = curves(run, key)
        if cs:
            out["figures"][key] = {"first": statistics.fmean(c["value"][0] for c in cs),
                                   "last": statistics.fmean(c["value"][-1] for c in cs), "curves": cs}
    return out


# ------------------------------------------------------------------------------------------------
# The summary: the table, the line about the seed spread, the plot
# ------------------------------------------------------------------------------------------------

def mean_std(xs: builtins.list[float], fmt: str = ".2f") -> str:
    """mean ± sample std (ddof 1) over the seeds; the value alone for one seed; "-" for none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:{fmt}}"
    return f"{statistics.fmean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"


def figure_cell(seeds: builtins.list[dict], key: str) -> str:
    """A figure's "first → last", each the mean over the seeds that log it; "-" where none does."""
    have = [s["figures"][key] for s in seeds if key in s["figures"]]
    if not have:
        return "-"
    first, last = (statistics.fmean(f[k] for f in have) for k in ("first", "last"))
    return f"{first:.3g} → {last:.3g}"


def minutes(seconds: float | None) -> str:
    """A wall time as the docs and the pages show it: 3.4 min, 75 s; "-" where it is unknown."""
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def mean_minutes(seconds: builtins.list[float | None]) -> str:
    """minutes() of the mean of the runs' times that are known."""
    known = [s for s in seconds if s is not None]
    return minutes(statistics.fmean(known)) if known else "-"


def spread_line(control: builtins.list[float], changed: builtins.list[float]) -> str:
    """Whether the 7-task difference is within the seed spread (the two arms' seeds overlap), and the
    difference of the means (changed minus control)."""
    diff = round(statistics.fmean(changed) - statistics.fmean(control), 2) + 0.0   # + 0.0: no "-0.00"
    head = f"7-task average: changed minus control {diff:+.2f} (difference of the means)"
    if min(len(control), len(changed)) < 2:
        return f"{head}; one seed an arm, so no seed spread to judge it against: run two or more seeds."
    ranges = (f"control {min(control):.2f} to {max(control):.2f}, "
              f"changed {min(changed):.2f} to {max(changed):.2f}")
    if max(min(control), min(changed)) <= min(max(control), max(changed)):
        return f"{head}: within the seed spread, the two arms' seeds overlap ({ranges})."
    return f"{head}: outside the seed spread, the two arms' seeds do not overlap ({ranges})."


def arm_label(exp: Experiment, role: str, root: Path = ROOT) -> str:
    if role == "control":
        return f"control: {exp.script} as committed" + (f", {' '.join(exp.settings)}" if exp.settings else "")
    change = [f"{exp.name}.patch"] if patch_path(exp, root).is_file() else []
    return "changed: " + ", ".join(change + ([" ".join(exp.flags)] if exp.flags else []))


def table(exp: Experiment, measured: dict[str, dict[int, dict]], root: Path = ROOT) -> str:
    """The Markdown table of both arms (`measured`: role -> seed -> read_run's dict with "wall_s"),
    then the line about the seed spread."""
    head = ["arm", "7-task avg", "STS-B dev", *exp.figures, "wall time per run"]
    rows = []
    for role in ("control", "changed"):
        seeds = list(measured[role].values())
        rows.append([arm_label(exp, role, root), mean_std([s["avg"] for s in seeds]),
                     mean_std([s["stsb_dev"] for s in seeds]), *(figure_cell(seeds, k) for k in exp.figures),
                     mean_minutes([s.get("wall_s") for s in seeds])])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    avgs = {role: [s["avg"] for s in measured[role].values() if s["avg"] is not None] for role in measured}
    seeds = ", ".join(map(str, measured["control"]))
    both = avgs["control"] and avgs["changed"]
    note = f"\n\n{spread_line(avgs['control'], avgs['changed'])}" if both else ""
    return ("\n".join(lines) + f"\n\nSeeds {seeds}; 7-task avg and STS-B dev: Spearman x100 of best/ on raw "
            f"[CLS], mean ± sample std; figures: first → last value in metrics.jsonl, mean over the seeds."
            + note + "\n")


def recorded_table(exp: Experiment, got: dict, root: Path = ROOT) -> str:
    """table() of an experiment as figures.json recorded it (`got`: its entry), from its arms' figures."""
    return table(exp, {role: arm["seeds"] for role, arm in got["arms"].items()}, root)


def plot(exp: Experiment, measured: dict[str, dict[int, dict]], path: Path) -> None:
    """One panel per figure, x the step: one colour an arm, one line a seed (and a stage, for a glob)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(exp.figures)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colours = {"control": "tab:blue", "changed": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    for ax, key in zip(axes.flat, exp.figures):
        drawn = False
        for role, seeds in measured.items():
            for i, (seed, run) in enumerate(seeds.items()):
                for c in run["figures"].get(key, {}).get("curves", []):
                    stage = f" {c['log'].split('/')[0]}" if "/" in c["log"] else ""
                    ax.plot(c["step"], c["value"], styles[i % len(styles)], color=colours[role], marker=".",
                            label=f"{role}, seed {seed}{stage}")
                    drawn = True
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "logged by neither arm", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"{exp.title} ({exp.script}; {exp.name})", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# An experiment from end to end, the record, the check
# ------------------------------------------------------------------------------------------------

def run_experiment(exp: Experiment, testbed: Testbed, seeds: builtins.list[int], runs: Path,
                   root: Path = ROOT, env: dict | None = None, quiet: bool = False,
                   say: Callable[[str], None] = print) -> dict:
    """Both arms with every seed (reused where finished), read back: role -> seed -> figures."""
    control, changed = arms(exp, testbed, runs, root)
    measured: dict[str, dict[int, dict]] = {}
    for arm in (control, changed):
        measured[arm.role] = {}
        for seed in seeds:
            done = run_arm(arm, seed, runs, root, env, quiet, say)
            measured[arm.role][seed] = {**read_run(done["run"], exp.figures), "run": done["run"],
                                        "reused": done["reused"], "wall_s": done["wall_s"]}
    return measured


def entry(exp: Experiment, measured: dict, testbed: Testbed, root: Path = ROOT) -> dict:
    """What --record keeps of an experiment: the code measured (the committed script's sha256 and the
    commit), its change, the command, the testbed, the seeds, per arm and seed the figures (its table is
    made from them: recorded_table)."""
    patch = patch_path(exp, root)
    arms_ = {role: {"label": arm_label(exp, role, root),
                    "seeds": {str(seed): {"run": shown(r["run"], root), "avg": r["avg"],
                                          "stsb_dev": r["stsb_dev"], "wall_s": r["wall_s"],
                                          "figures": r["figures"]}
                              for seed, r in seeds.items()}}
             for role, seeds in measured.items()}
    return {"code": {exp.script: sha256(committed_bytes(exp.script, root))}, "commit": commit(root),
            "change": {"patch": sha256(patch.read_bytes()) if patch.is_file() else None,
                       "flags": exp.flags, "settings": exp.settings},
            "command": command(exp), "testbed": testbed.flags(exp.script), "seeds": list(next(iter(
                measured.values()))), "arms": arms_,
            "date": datetime.date.today().isoformat()}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def check(root: Path = ROOT, figures_path: Path | None = None) -> builtins.list[str]:
    """What --check finds: each experiment to measure again, and each patch that no longer applies to
    its script as it is in the checkout (CI's checkout: the commit). [] when all is current."""
    figures = read_figures(root, figures_path)
    problems = []
    for exp in load_experiments(root):
        patch = patch_path(exp, root)
        if patch.is_file():
            done = git("apply", "--check", str(patch.relative_to(root)), root=root, check=False, text=True)
            if done.returncode:
                why = (done.stderr or "").strip().splitlines()[-1:] or ["git apply --check failed"]
                problems.append(f"{exp.name}: {patch.relative_to(root).as_posix()} no longer applies to "
                                f"{exp.script} ({why[0]}): remake it")
        got = figures.get(exp.name)
        if got is None:
            continue            # not measured yet: --list says so; the docs show the command instead
        now = sha256((root / exp.script).read_bytes())
        if got.get("code", {}).get(exp.script) != now:
            problems.append(f"{exp.name}: measure again: {exp.script} changed since it was measured at "
                            f"commit {got.get('commit', '?')}: `{command(exp)} --record`")
        change = {"patch": sha256(patch.read_bytes()) if patch.is_file() else None, "flags": exp.flags,
                  "settings": exp.settings}
        if got.get("change", change) != change:
            problems.append(f"{exp.name}: measure again: its patch, flags or settings changed since it was "
                            f"measured at commit {got.get('commit', '?')}: `{command(exp)} --record`")
    if figures_path is None:
        for path, text in method_pages(root).items():
            if path.read_text(encoding="utf-8") != text:
                problems.append(f"{path.relative_to(root).as_posix()}: its experiments section is not what "
                                f"docs/experiments/ makes: `python tools/experiment.py --docs`")
    return problems


def list_lines(root: Path = ROOT, figures_path: Path | None = None) -> builtins.list[str]:
    figures = read_figures(root, figures_path)
    exps = load_experiments(root)
    w = max(len(e.name) for e in exps)
    out = []
    for exp in exps:
        got = figures.get(exp.name)
        if got is None:
            state = "not measured"
        elif got.get("code", {}).get(exp.script) != sha256((root / exp.script).read_bytes()):
            state = f"measured on an earlier {exp.script} ({got.get('commit', '?')})"
        else:
            state = f"measured ({got.get('commit', '?')})"
        times = {role: mean_minutes([r.get("wall_s") for r in arm["seeds"].values()])
                 for role, arm in (got or {}).get("arms", {}).items()}
        took = f"; a run: control {times['control']}, changed {times['changed']}" if len(times) == 2 else ""
        out.append(f"{exp.name:{w}s}  {exp.script:16s}  {exp.title}  [{state}{took}]")
    return out


# ------------------------------------------------------------------------------------------------
# Each method's page, docs/<script>.md: a section of its experiments, made from the manifest and
# figures.json (--record and --docs write it; --check names it when it is not what they would write)
# ------------------------------------------------------------------------------------------------

BEGIN = "<!-- experiments: made by `python tools/experiment.py --docs` from docs/experiments/; edit those -->"
END = "<!-- experiments: end -->"


def docs_section(script: str, root: Path = ROOT, figures: dict | None = None) -> str:
    """The "Experiments to try" section of docs/<script's stem>.md, between its two markers."""
    figures = read_figures(root) if figures is None else figures
    sha = sha256((root / script).read_bytes())
    out = [BEGIN, "## Experiments to try", "",
           f"Each experiment changes one part of `{script}` and runs it beside the unchanged script on the "
           "laptop testbed: all-MiniLM-L6-v2 read on raw [CLS], 40 steps at batch 64, STS-B dev at steps 20 "
           "and 40, seeds 1 and 2 (every flag: `python tools/experiment.py --help`). The annotated page "
           f"shows each one beside the line it changes ([pages/{Path(script).stem}.html](pages/"
           f"{Path(script).stem}.html)); all of them, with their times: "
           "[the index](pages/index.html#experiments). A wall time is one run's, on two CPU cores that no "
           "other run or test shared (an editor or a page build sometimes did).",
           ""]
    for exp in load_experiments(root):
        if exp.script != script:
            continue
        out += [f"### {exp.title}", "", " ".join(exp.question.split()), ""]
        patch = patch_path(exp, root)
        if patch.is_file():
            rel = patch.relative_to(root / "docs").as_posix()
            out.append(f"- The change: [{rel}]({rel}); by hand, `git apply docs/{rel}`, and `git apply -R "
                       f"docs/{rel}` undoes it.")
        if exp.flags:
            out.append(f"- The changed arm adds `{' '.join(exp.flags)}`" + (
                f"; both arms run with `{' '.join(exp.settings)}`." if exp.settings else "."))
        elif exp.settings:
            out.append(f"- Both arms run with `{' '.join(exp.settings)}`.")
        out += [f"- Both arms, both seeds (a control already run is reused): `{command(exp)}`", ""]
        got = figures.get(exp.name)
        if got is None:
            out += ["Not measured yet: the command above measures it.", ""]
            continue
        if got.get("code", {}).get(script) != sha:
            out += [f"Measured on an earlier `{script}` (commit {got.get('commit', '?')}): the command above "
                    "measures it again.", ""]
        out += [f"Measured at commit {got.get('commit', '?')}:", "", recorded_table(exp, got, root).strip(),
                ""]
        if (root / HERE / f"{exp.name}.png").is_file():
            out += [f"![{exp.title}: its figures step by step, both arms, both seeds](experiments/"
                    f"{exp.name}.png)", ""]
    out.append(END)
    return "\n".join(out) + "\n"


def with_section(text: str, section: str) -> str:
    """A method page's text with its experiments section in place: between the markers, else at the end."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + section + rest.split(END, 1)[1].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + section


def method_pages(root: Path = ROOT) -> dict[Path, str]:
    """Each docs/<stem>.md that has experiments -> its text with the section as the figures make it."""
    figures = read_figures(root)
    pages = {}
    for script in dict.fromkeys(e.script for e in load_experiments(root)):
        path = root / "docs" / f"{Path(script).stem}.md"
        if path.is_file():
            pages[path] = with_section(path.read_text(encoding="utf-8"), docs_section(script, root, figures))
    return pages


def inside(path: str) -> str:
    """A path given from another folder, as a path from the repository root (the arms run there)."""
    p = Path(path)
    if p.is_absolute() or Path.cwd().resolve() == ROOT or not p.exists():
        return path
    full = p.resolve()
    return full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else str(full)


def main(argv: builtins.list[str]) -> int:
    args = parse_args(Args, argv, description=f"{__doc__}\n{testbed_text()}",
                      prog="python tools/experiment.py")
    figures_path = Path(args.figures) if args.figures else ROOT / HERE / FIGURES
    if args.list:
        print("\n".join(list_lines(ROOT, figures_path)))
        return 0
    if args.docs:
        for path, text in method_pages(ROOT).items():
            path.write_text(text, encoding="utf-8")
            print(f"{shown(path)}: its experiments section written")
        return 0
    if args.check:
        problems = check(ROOT, figures_path)
        if problems:
            print("\n".join(problems))
            return 1
        recorded = read_figures(ROOT, figures_path)
        waiting = [e.name for e in load_experiments(ROOT) if e.name not in recorded]
        print(f"all {len(load_experiments(ROOT)) - len(waiting)} experiments measured are current: each was "
              f"measured on its script as it is now, and each patch applies.")
        if waiting:
            print(f"note: not measured yet ({len(waiting)}): {', '.join(waiting)}; "
                  f"`python tools/experiment.py NAME --record` measures one.")
        return 0
    exps = load_experiments(ROOT)
    known = {e.name: e for e in exps}
    if args.all == bool(args.names):
        raise UserError("name the experiments to run (`python tools/experiment.py --list` lists them), or "
                        "pass --all.")
    for name in args.names:
        if name not in known:
            raise UserError(f"{name}: no such experiment. `python tools/experiment.py --list` lists them.")
    chosen = exps if args.all else [known[n] for n in dict.fromkeys(args.names)]
    testbed = Testbed(model=inside(args.model or default_model()), data=inside(args.data),
                      sts_dir=inside(args.sts_dir), multi30k=inside(args.multi30k), steps=args.steps)
    if args.record:
        if args.steps:
            raise UserError("--steps with --record: the docs show the testbed's 40 steps; leave out --steps.")
        paths = (testbed.model, testbed.data, testbed.sts_dir, testbed.multi30k)
        if outside := [p for p in paths if Path(p).is_absolute()]:
            raise UserError(f"--record keeps the testbed's flags as a user types them in a clone: "
                            f"{', '.join(outside)} is not a path in the repository. Put the data and the "
                            f"model in data/ and models/ (links will do), and pass them as relative paths.")
    need = {testbed.data: any(e.script != "ifcl.py" for e in chosen),
            f"{testbed.multi30k}/train.en": any(e.script == "ifcl.py" for e in chosen),
            f"{testbed.multi30k}/train.de": any(e.script == "ifcl.py" for e in chosen)}
    if missing := [p for p, needed in need.items() if needed and not (ROOT / p).is_file()]:
        raise UserError(f"{', '.join(missing)}: not there. docs/results.md (A small testbed on two CPU "
                        f"cores) has the commands that make the testbed's data; or pass --data / --multi30k.")
    runs = ROOT / inside(args.runs)         # an absolute path stays itself
    for script in dict.fromkeys(e.script for e in chosen):
        if differs_from_commit(script):
            print(f"note: your {script} differs from the commit ({commit()}): both arms run the committed "
                  f"code.")
    recorded = read_figures(ROOT, figures_path) if args.record else {}
    for exp in chosen:
        print(f"\n## {exp.name}: {exp.title} ({exp.script})")
        measured = run_experiment(exp, testbed, args.seeds, runs)
        text = table(exp, measured)
        print("\n" + text)
        done = entry(exp, measured, testbed)
        if args.record:
            recorded[exp.name] = done
            write_json(figures_path, recorded)
            image = ROOT / HERE / f"{exp.name}.png"
            plot(exp, measured, image)
            print(f"recorded: {shown(figures_path)} ({exp.name}), {shown(image)}")
            for path, text in method_pages(ROOT).items():
                path.write_text(text, encoding="utf-8")
        else:
            out = runs / exp.name
            out.mkdir(parents=True, exist_ok=True)
            (out / "table.md").write_text(f"# {exp.title}\n\n`{command(exp)}`\n\n{text}", encoding="utf-8")
            write_json(out / "figures.json", done)
            plot(exp, measured, out / f"{exp.name}.png")
            print(f"table, figures and plot: {shown(out)}/ (table.md, figures.json, {exp.name}.png)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nstopped. The same command again reuses every run that had finished.", file=sys.stderr)
        sys.exit(130)
