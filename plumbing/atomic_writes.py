"""Writes that a kill, a crash, a signal or a full disk never leave half done: a folder filled
beside its place and swapped in with two renames (a signal waits until both are done), a small file
through a temporary name, each synced to the disk first so that a full disk is told at the write;
what a kill between the renames leaves, put back. Nothing is written through a symbolic link (a
link planted where a file goes is an error: ELOOP). Used for last/, best/, the run's record and
every file a run keeps."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from plumbing import interrupts


def no_follow(path: str | Path, flags: int) -> int:
    """open()'s opener for a file of a run or a cache: a symbolic link at `path` is refused (ELOOP),
    never written through."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)


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
        # between the renames there is no `final`: a signal waits until the swap is done (the old
        # one removed), and whatever else stops it (a failed rename, a bug) puts the old one back
        with interrupts.deferred():
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


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a file through a temporary name beside it (`write(f)` fills it), synced, then renamed
    into place: a kill leaves the old file or the new one; a failed write leaves no temporary file;
    a link at either name is replaced, not written through, and another name of the old file (a hard
    link) keeps the old content. The temporary name is this process's own (ranks under torchrun may
    write one file at once); one that a killed process left is removed."""
    path = Path(path)
    for left in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):    # a killed writer's leftover
        if not alive(left.name.split(".")[-2]):
            left.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)                  # a link planted there
    try:
        with open(tmp, "xb", opener=no_follow) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def alive(pid: str) -> bool:
    """Whether process `pid` (a temporary file's writer) still runs; unknown (not POSIX): yes."""
    if os.name != "posix" or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write_text_atomic(path: str | Path, text: str) -> None:
    """A small text file (UTF-8) written whole or not at all: write_atomic."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def unshared(path: Path) -> Path:
    """`path`, made this name's alone before it is written in place (appended to, cut back): a file
    that shares its content with another name (a hard link: `cp -al run run.snap`) is copied and the
    copy renamed over it, so the other name keeps what it had."""
    if os.path.lexists(path) and os.lstat(path).st_nlink > 1:
        with open(path, "rb", opener=no_follow) as src:
            write_atomic(path, lambda f: shutil.copyfileobj(src, f))
    return path


def recover_dir(final: Path) -> Path:
    """What a kill during _atomic_dir leaves: between the two renames the old folder is still
    whole (put back); after them, the old one not yet removed (dropped); a temporary folder never
    swapped in (dropped: it holds a full copy)."""
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
