"""The errors that end a command in one line: a refused input (UserError, exit status 2) and a write the
system refused (WriteFailed, exit status 4).

The rules, and the function that keeps each:
1. A failed write is told as one (writing, refused_write), whatever library wrote: torch.save and
   safetensors say a full disk in their own words, which would read as a bug in a traceback.
2. A signal inside torch.save is a stop, not a failed write (stopped): torch turns it into its own I/O
   error, and a user who pressed Ctrl-C must not be told the disk failed.
3. The line says what is intact and what to run next (WriteFailed.line): the writer's words where it
   knows them (the run folder's kept()), else the safe default.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Callable


class UserError(Exception):
    """A problem with the user's input (a file, a flag): printed as one clear message, exit 2."""


class NothingToDo(Exception):
    """A command with nothing left to do (a finished run resumed): its line, exit status 0."""


class WriteFailed(Exception):
    """A write the system refused (disk full, quota, read-only, permission): one line, exit status 4.
    `kept` (what is intact) and `then` (what to run next): the writer's where it knows them, else line()'s."""

    def __init__(self, what: str, reason: str, remedy: str, kept: str | None = None, then: str | None = None):
        super().__init__(what)
        self.what, self.reason, self.remedy, self.kept, self.then = what, reason, remedy, kept, then

    def line(self, kept: str = "nothing written before was lost", then: str = "run the same command again"
             ) -> str:
        return (f"could not write {self.what}: {self.reason}. {self.kept or kept}; once it can be written "
                f"again ({self.remedy}), {self.then or then}.")

    __str__ = line                              # its defaults where no run folder says what is intact


# A write the system refused, in the libraries' words beside OSError: torch.save's RuntimeError
# ("[enforce fail at inline_container.cc:672] ...", from "basic_ios::clear: iostream error"), and
# safetensors' and the tokenizers' errors that end in "(os error 28)". Any other exception is a bug.
TORCH_IO = ("inline_container.cc", "iostream error")
OS_ERROR = re.compile(r"\(os error (\d+)\)")
REMEDY = {errno.ENOSPC: "free space", errno.EDQUOT: "free space, or a larger quota",  # to make possible again
          errno.EFBIG: "a larger file size limit: ulimit -f", errno.EROFS: "the disk writable again"}


def refused_write(e: BaseException) -> tuple[int | None, str] | None:
    """(errno, the system's words) where `e`, or what it came from, says a write was refused; else None."""
    if not (isinstance(e, OSError) or OS_ERROR.search(str(e))
            or isinstance(e, RuntimeError) and any(s in str(e) for s in TORCH_IO)):
        return None
    for _ in range(8):                          # down the chain, 8 deep at most: a chain may loop
        if isinstance(e, OSError):
            return e.errno, e.strerror or str(e)
        if m := OS_ERROR.search(str(e)):
            return int(m[1]), os.strerror(int(m[1]))
        e = e.__cause__ or e.__context__
        if e is None:
            break
    return None, "an I/O error (the library did not say which)"


def stopped(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (interrupts.Stopped) that `e` came from, or None. A signal that lands inside
    torch.save raises in its Python part, and torch's writer turns that into its own I/O error
    ("inline_container.cc ... unexpected pos"), which alone would read as a disk fault."""
    for _ in range(8):                          # down the chain, 8 deep at most: a chain may loop
        e = e.__cause__ or e.__context__
        if e is None or isinstance(e, KeyboardInterrupt):
            return e
    return None


@contextlib.contextmanager
def writing(what: str, kept: str | Callable[[], str] | None = None, then: str | None = None):
    """A write the system refuses inside becomes WriteFailed: what, why, what is intact (`kept`, or a
    function asked only then), what next (`then`). Any other exception passes as it is."""
    try:
        yield
    except Exception as e:
        if (stop := stopped(e)) is not None:      # Ctrl-C or SIGTERM inside torch.save: a stop, not a fault
            raise stop from None
        if (refused := refused_write(e)) is None:
            raise
        code, reason = refused
        kept = kept() if callable(kept) else kept
        raise WriteFailed(what, reason, REMEDY.get(code, "free space, a writable place"), kept, then) from e
