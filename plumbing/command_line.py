"""Every command's main under run_main: it ends in one line and an exit status, never a traceback for
what the user can act on.

The rules, and the function that keeps each:
1. One line and a status a way to end (run_main, say): a refused input (2), the GPU out of memory (3),
   a failed write (4), Ctrl-C (130), SIGTERM (143), SIGHUP (129); under torchrun, said once, and a
   rank stopped by another's end says so (1). A traceback is for a bug, and reads as one.
2. The line after a stop or a failed write says what is intact and what to run next (run_main, with
   the run folder's after_a_stop, kept and next_command).
3. The run folder is let go whatever happens (let_go): its lock, in this process, for the next command.

The one place where the run is not handed down (opened): a signal raises wherever the program is, and a
failed write wherever it writes, and main() does not return then, so the line of rule 2 cannot be given
the run folder by a caller. plumbing/start.py hands it here as it names it; run_main reads it only on
those two paths.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from plumbing import interrupts
from plumbing.errors import NothingToDo, UserError, WriteFailed
from plumbing.progress import Screen
from plumbing.ranks import world

if TYPE_CHECKING:
    from plumbing.run_folder import RunFolder

_run: RunFolder | None = None      # the run folder this command opened (opened()), for the error paths


def opened(run: RunFolder) -> None:
    """plumbing/start.py's call as it names the run folder. An earlier command's (a test's) is let go."""
    global _run
    let_go()
    _run = run


def let_go() -> None:
    """The run folder's lock released and forgotten: run_main's end, a test's."""
    global _run
    if _run is not None:
        _run.release()
    _run = None


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Rules 1-3 around `main(argv)`."""
    let_go()                                               # plumbing/start.py names this command's run
    handlers = interrupts.take_over() if threading.current_thread() is threading.main_thread() else {}
    stderr, sys.stderr = sys.stderr, Screen(sys.stderr)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except NothingToDo as e:
        say(str(e))
    except UserError as e:
        say(f"error: {e}", 2)
    except WriteFailed as e:
        say(f"error: {e.line(_run.kept(), _run.next_command()) if _run else e}", 4)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, interrupts.Stopped) else signal.SIGINT
        command = typed(main, argv)
        again = _run.after_a_stop(command) if _run else (f"The run was not recorded yet: there is nothing "
                                                         f"for --resume to continue. To start it again: "
                                                         f"{shlex.join(command)}")
        say(f"\n{interrupts.WHAT[signum]}. {again}", 128 + signum)
    except torch.cuda.OutOfMemoryError:
        say("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the batch over "
            "more GPUs with `torchrun --nproc_per_node K ...` (the contrastive loss still sees the whole "
            "batch).", 3)
    except OSError as e:            # what could not be read or opened, whatever the reason
        say(f"error: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}.", 2)
    except RuntimeError as e:       # under torchrun: a collective that lost the process at its other end
        if world()[1] == 1 or not re.search(r"gloo|NCCL|Connection (reset|closed) by peer", str(e)):
            raise
        say(f"rank {world()[0]}: stopped, because another process of this run ended (its own line says "
            f"why).", 1)
    finally:
        sys.stderr = stderr
        let_go()
        if handlers:
            interrupts.give_back(handlers)


def typed(main: Callable, argv: list[str] | None) -> list[str]:
    """This command as typed (python or torchrun, the script, its flags), for a line that says what to run."""
    script = sys.argv[0] if argv is None else os.path.relpath(sys.modules[main.__module__].__file__)
    launcher = ["python"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        launcher = ["torchrun", "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "1")]
    return [*launcher, script, *(sys.argv[1:] if argv is None else argv)]


def say(line: str, status: int = 0) -> None:
    """The command's last line, on stderr (Screen: one that cannot be written changes no exit status),
    said once under torchrun (rank 0's, but a rank's own stop); then its exit status, unless 0."""
    if world()[0] == 0 or line.startswith("rank "):
        print(line, file=sys.stderr, flush=True)
    if status:
        sys.exit(status)
