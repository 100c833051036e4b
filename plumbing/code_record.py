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
   import of plumbing (read_script), each script's first line, a few milliseconds after Python read
   them. NOTE(ours): an edit saved inside those milliseconds would be recorded as what ran; an earlier
   version compiled the bytes again to catch it, a guard against a race no editor's habit meets.
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
        spec.loader = KeptLoader(name, spec.origin)
        return spec


# ---- rule 2: the script, read at plumbing's first import -----------------------------------------------

def read_script() -> None:
    """The running script's bytes (`python simcse.py`), kept; nothing for python -c, runpy or a test."""
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    if file and Path(file).is_file():
        ran(file)


# ---- rule 3: what a record keeps ---------------------------------------------------------------------

def ran(path: str | Path) -> bytes:
    """The bytes module `path` was compiled from (read now, once, for one loaded before this module)."""
    path = Path(path).resolve()
    if path not in _kept:
        _kept[path] = path.read_bytes()
    return _kept[path]


def changed(path: str | Path) -> bool:
    """Whether the file on disk no longer holds the bytes that ran (edited since)."""
    return Path(path).read_bytes() != ran(path)


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
