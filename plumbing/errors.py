"""The two errors that end a command in one line: a refused input (UserError, exit status 2) and
a write the system refused (WriteFailed, exit status 4, naming what is intact and what to run
once it can be written again). Libraries report a refused write in their own words; refused_write
finds the system's reason in them."""

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
    """A write that failed (disk full, quota, read-only, permission): one line, exit status 4.
    `kept` (what is intact) and `then` (what to run next) are the writer's, where it knows them;
    else the run folder's (line())."""

    def __init__(self, what: str, reason: str, remedy: str, kept: str | None = None, then: str | None = None):
        super().__init__(what)
        self.what, self.reason, self.remedy, self.kept, self.then = what, reason, remedy, kept, then

    def line(self, kept: str = "nothing written before was lost", then: str = "run the same command again"
             ) -> str:
        return (f"could not write {self.what}: {self.reason}. {self.kept or kept}; once it can be written "
                f"again ({self.remedy}), {self.then or then}.")

    def __str__(self) -> str:
        return self.line()


# The libraries' own exceptions for a write the system refused, beside OSError: torch.save raises
# RuntimeError ("[enforce fail at inline_container.cc:672] . unexpected pos N vs M", chained on
# "basic_ios::clear: iostream error"), safetensors its SafetensorError and the tokenizers a bare
# Exception, both ending in "(os error 28)". Any other exception is a bug: its traceback stays.
TORCH_IO = ("inline_container.cc", "iostream error")
OS_ERROR = re.compile(r"\(os error (\d+)\)")
# what to make possible again, by the system's reason
REMEDY = {errno.ENOSPC: "free space", errno.EDQUOT: "free space, or a larger quota",
          errno.EFBIG: "a larger file size limit: ulimit -f", errno.EROFS: "the disk writable again",
          errno.EIO: "a disk that works again: the system's log says what failed"}


def refused_write(e: BaseException) -> tuple[int | None, str] | None:
    """(errno, the system's words) for an exception that says the system refused a write: an
    OSError, or a library's error above (the errno found in it or in what it was raised from).
    None for any other exception."""
    if not (isinstance(e, OSError) or OS_ERROR.search(str(e))
            or isinstance(e, RuntimeError) and any(s in str(e) for s in TORCH_IO)):
        return None
    seen = []
    while e is not None and e not in seen and len(seen) < 8:
        seen.append(e)
        if isinstance(e, OSError):
            return e.errno, e.strerror or str(e)
        if m := OS_ERROR.search(str(e)):
            return int(m[1]), os.strerror(int(m[1]))
        e = e.__cause__ or e.__context__
    return None, "an I/O error (the library did not say which)"


@contextlib.contextmanager
def writing(what: str, kept: str | Callable[[], str] | None = None, then: str | None = None):
    """A write the system refuses inside (refused_write) becomes WriteFailed: what, why, what is
    intact (`kept`, or a function that says it, asked only then) and what next (`then`), the last
    two filled in by the run folder where the writer leaves them out. Any other exception passes
    as it is."""
    try:
        yield
    except Exception as e:
        refused = refused_write(e)
        if refused is None:
            raise
        code, reason = refused
        kept = kept() if callable(kept) else kept
        raise WriteFailed(what, reason, REMEDY.get(code, "free space, a writable place"), kept, then) from e
