"""Ctrl-C and SIGTERM while a script starts: one line, not a traceback from inside an import.

Each script imports this module first. Its imports (torch, transformers, scipy) take seconds; a
Ctrl-C then ends in a KeyboardInterrupt traceback from whichever library was loading, and a
SIGTERM (`timeout`, a job scheduler) ends the process without a word. From here until run_main
(plumbing/command_line.py) takes the two signals over, when the script's main starts, either one
ends the process at once with one line and exit status 130 or 143. Nothing is written before main
starts, so the same command is what to run again. Standard library only: it is in place before
the slow imports begin.
"""

import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]      # the repository
WHAT = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}


def while_starting(signum: int, frame) -> None:
    sys.stderr.write(f"\n{WHAT[signum]} while starting; nothing was written. Run the same command again.\n")
    sys.stderr.flush()
    os._exit(128 + signum)      # at once: an import left half done has nothing to unwind or save


# Only in a process started as one of the repository's scripts (python simcse.py, torchrun rcl.py,
# python tools/translate.py): a program that imports a script (the tests) keeps its own handlers.
# A signal the process was started ignoring stays ignored (`cmd &` in a shell script ignores Ctrl-C).
_main = getattr(sys.modules.get("__main__"), "__file__", None)
if _main and Path(_main).resolve().parent in (HERE, HERE / "tools"):
    for _signum in WHAT:
        if signal.getsignal(_signum) is not signal.SIG_IGN:
            signal.signal(_signum, while_starting)
