"""Writes that a kill, a crash, a signal or a full disk never leave half done: a run may stop at any
instant (Ctrl-C, a scheduler's SIGTERM, a laptop's battery), and what it wrote before must stay usable.

The rules, and the function that keeps each:
1. A folder (last/, best/) is swapped in whole (atomic_dir): written beside it, synced, then two renames;
   a kill or a signal leaves the old or the new, and what it left beside them is put back or removed at
   the next start (recover_dir).
2. A file is written under a temporary name of this process's, synced, then renamed over (write_atomic):
   torchrun's ranks may write one file at once. A kill -9 inside the write leaves its temporary file
   (.NAME.PID.tmp), hidden and never read: a run folder's go when it is next opened (RunFolder.open).
   NOTE(ours): the token cache's folder keeps them; an earlier version swept dead processes' there.
3. What is on the disk is on the disk (sync_to_disk): a full disk is told at the write, not later, and
   a crash cannot leave a checkpoint empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from plumbing import interrupts


def sync_to_disk(path: Path) -> None:
    """Rule 3 for `path` (a file, or a folder's list of names); a network disk tells a full disk only
    when the data are sent."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Rule 1: a temporary folder beside `final`, filled by the block and swapped in at its end."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        for p in [*sorted(tmp.rglob("*")), tmp]:
            sync_to_disk(p)
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        # between the renames there is no `final`: a failed rename puts the old back, a kill leaves it
        # as .old, which recover_dir puts back at the next start
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old.exists() and not final.exists():
                os.replace(old, final)
            raise
        sync_to_disk(final.parent)
        if old.exists():
            shutil.rmtree(old)
    finally:                    # swapped in, or a partial copy holding the space a full disk needs back
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Rule 2: `write(f)` fills this process's temporary name beside `path`, synced, renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)                  # an earlier process's of the same pid
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """A small text file (UTF-8) written whole or not at all: write_atomic."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def recover_dir(final: Path) -> Path:
    """Undo a kill during atomic_dir: the old folder put back (or dropped), any temporary folder dropped."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks (any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
