"""Writes that a kill, a crash or a full disk never leave half done: a folder filled beside its
place and swapped in with two renames, a small file through a temporary name, each synced to the
disk first so that a full disk is told at the write; what a kill between the renames leaves,
put back. Used for last/, best/, the run's record and every file a run keeps."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def sync_to_disk(path: Path) -> None:
    """Make `path` (a file, or a folder's list of names) reach the disk now: a full disk is told
    at the write, not later (a network disk, say, reports it only when its data are sent), and a
    crash of the machine cannot leave a committed checkpoint empty."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_dir(final: Path) -> tuple[Path, Callable[[], None]]:
    """A temporary folder beside `final` and a commit() that swaps it into place: a run
    killed at any moment leaves either the old folder or the new one, never half of one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))

    def commit():
        for p in [*sorted(tmp.rglob("*")), tmp]:
            sync_to_disk(p)
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists():
                os.replace(old, final)
            raise
        sync_to_disk(final.parent)
        if old.exists():
            shutil.rmtree(old)

    return tmp, commit


@contextlib.contextmanager
def atomic_dir(final: Path):
    """_atomic_dir as a block: the temporary folder is filled inside and swapped in at its end; a
    write that fails removes it (a partial copy would hold the space a full disk needs back)."""
    tmp, commit = _atomic_dir(final)
    try:
        yield tmp
        commit()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small file through a temporary name: a kill leaves the old file or the new one; a
    failed write leaves no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def recover_dir(final: Path) -> Path:
    """What a kill during _atomic_dir leaves: between the two renames the old folder is still
    whole (put back); a temporary folder never swapped in is dropped (it holds a full copy)."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)
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
