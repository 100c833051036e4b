"""The code that ran: the bytes of each module of this repository that a run imports, read once, at the
moment Python compiles them, so that what a run records (run.json's hashes, the copies in code/) is the
code that trained, whatever an editor saves to the files after the launch.

The habit this serves: start a run, go on editing, save. Reading a file again when the record is
written (seconds later, or minutes after a first download) would record the edit as what ran; compare
would then file the run as a seed of the edit, and --resume would hold the run to code that never
trained. Standard library only: this module is loaded by plumbing/__init__.py, before any other.

The rules, and what keeps each:
1. A module of the repository (common.py, plumbing/) is compiled from the bytes kept for it, never
   from a .pyc and never read twice: KeptLoader.get_code, installed as the first finder (Finder).
2. The script itself is compiled by Python before any of this runs. Its bytes are read at the first
   import of plumbing (each script's first line), and compiled again to check that they are the code
   Python runs (read_script); an edit saved in between is found, and the run refuses to record it
   (launch_problem): it cannot know what trained.
3. A record keeps the kept bytes (ran), and names each file that differs on disk by then (changed).
A module loaded before plumbing (a test that imports common first) has no kept bytes: it is read when
first asked for, as before this module existed.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]                   # the repository
_kept: dict[Path, bytes] = {}       # a module's resolved path -> the bytes it was compiled from
_launch: dict[Path, str] = {}       # the script -> why its bytes cannot be shown to be what runs


# ---- rule 1: the repository's modules, compiled from the bytes kept for them ---------------------------

class KeptLoader(importlib.machinery.SourceFileLoader):
    """Rule 1: the standard loader of a .py file but for its code's source (a .pyc is valid for a file's
    size and mtime in seconds, not for its bytes)."""

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        data = self.get_data(path)
        _kept[Path(path).resolve()] = data
        return self.source_to_code(data, path)


class Finder:
    """First on sys.meta_path: common and plumbing.* get a KeptLoader; every other import is left to the
    finders after it at once (torch's thousands of modules cost one string test each)."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        if name != "common" and not name.startswith("plumbing."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None
        if Path(spec.origin).resolve().parent not in (HERE, HERE / "plumbing"):
            return None                                 # a module of that name elsewhere: not ours
        spec.loader = KeptLoader(name, spec.origin)
        return spec


# ---- rule 2: the script, read at plumbing's first import and checked against what Python compiled -----

def read_script() -> None:
    """The running script's bytes (`python simcse.py`), kept, if its module code is on the stack: compiled
    again, they must give the code Python is running, else the file changed since the launch."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if not file or frame is None:                   # python -c, runpy, a test: nothing to check against
        return
    path = Path(file).resolve()
    try:
        data = path.read_bytes()
        same = compile(data, frame.f_code.co_filename, "exec", dont_inherit=True) == frame.f_code
    except (OSError, SyntaxError, ValueError):      # gone, or saved half written
        data, same = b"", False
    _kept[path] = data
    if not same:
        _launch[path] = f"{path.name} was saved while this command started, so the code it runs cannot be " \
                        f"told from the file; nothing was written. Run the command again."


def launch_problem(path: Path) -> str | None:
    """Why the record cannot name the code `path` ran (rule 2), or None."""
    return _launch.get(Path(path).resolve())


# ---- rule 3: what a record keeps ---------------------------------------------------------------------

def ran(path: str | Path) -> bytes:
    """The bytes module `path` was compiled from (read now, once, for one loaded before this module)."""
    path = Path(path).resolve()
    if path not in _kept:
        _kept[path] = path.read_bytes()
    return _kept[path]


def changed(path: str | Path) -> bool:
    """Whether the file on disk no longer holds the bytes that ran (edited, or gone, since)."""
    try:
        return Path(path).read_bytes() != ran(path)
    except OSError:
        return True


def modules(script: str | Path) -> dict[str, Path]:
    """What shapes a run's figures, by its path in the repository: the script, common.py and every
    plumbing/ module imported by now (a script outside the repository: by its name)."""
    files = [Path(script).resolve()]
    for name, module in sorted(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and (name == "common" or name == "plumbing" or name.startswith("plumbing.")):
            files.append(Path(file).resolve())
    return {(p.relative_to(HERE).as_posix() if p.is_relative_to(HERE) else p.name): p for p in files}


for _p in (HERE / "plumbing" / "__init__.py", Path(__file__)):       # compiled a moment ago, before Finder
    ran(_p)
sys.meta_path.insert(0, Finder)
read_script()
