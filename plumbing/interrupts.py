"""Ctrl-C, SIGTERM and SIGHUP: one line and an exit status, however a signal lands.

Each script imports this module first, before the seconds that torch's import takes. Until run_main
(plumbing/command_line.py) takes the signals over, a signal ends the process at once with one line and
exit status 128 + its number (130, 143, 129), not a library's traceback (Ctrl-C) or no word at all
(SIGTERM); nothing is written yet, so the same command is what to run again. Under run_main a signal
raises KeyboardInterrupt where the program is (Stopped for SIGTERM and SIGHUP). One that lands between
the two renames of a checkpoint's swap leaves the old folder beside it, put back at the next start
(atomic_writes.recover_dir). NOTE(ours): an earlier version held such a signal until both renames were
done, machinery for a window of microseconds that recover_dir covers anyway. Standard library only.
"""

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]      # the repository
WHAT = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}
if hasattr(signal, "SIGHUP"):                    # not on Windows
    WHAT[signal.SIGHUP] = "hung up (SIGHUP: the terminal or session closed)"


def while_starting(signum: int, frame) -> None:
    with contextlib.suppress(OSError):        # SIGHUP: the terminal may be gone
        sys.stderr.write(f"\n{WHAT[signum]} while starting; nothing was written. Run the same command "
                         f"again.\n")
        sys.stderr.flush()
    os._exit(128 + signum)      # at once: an import left half done has nothing to unwind or save


# Only in a process started as one of the repository's scripts (python simcse.py, torchrun rcl.py, tools/):
# a program that imports a script (the tests) keeps its own handlers. A signal the process was started
# ignoring stays ignored (`cmd &` in a shell script ignores Ctrl-C, `nohup` the hang-up).
_main = getattr(sys.modules.get("__main__"), "__file__", None)
SCRIPT = bool(_main) and Path(_main).resolve().parent in (HERE, HERE / "tools")
if SCRIPT:
    for _signum in WHAT:
        if signal.getsignal(_signum) is not signal.SIG_IGN:
            signal.signal(_signum, while_starting)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP under run_main, handled as Ctrl-C is: the run ends where it is, in one line."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def on_signal(signum: int, frame) -> None:
    if frame is not None and frame.f_code.co_name == "__del__":   # raised there, Python would drop it:
        return threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()  # sent again once it is done
    raise KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def take_over() -> dict:
    """run_main's start: the signals raise (on_signal), but those the process was started ignoring.
    Returns the handlers it replaced, for give_back."""
    before = {s: signal.getsignal(s) for s in WHAT}
    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, on_signal)
    return before


def give_back(before: dict) -> None:
    """run_main's end: a script's process ignores the signals from here (early in Python's shutdown each
    gets back its default action: to end the process without a word); a caller gets its handlers back."""
    for signum, handler in before.items():
        signal.signal(signum, signal.SIG_IGN if SCRIPT else handler)
