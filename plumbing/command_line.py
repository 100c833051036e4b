"""Every command's main under run_main: it ends in one line and an exit status, never a traceback for
what the user can act on: a refused input (2), the GPU out of memory (3), a failed write (4), Ctrl-C
(130), SIGTERM (143), SIGHUP (129), each saying what to run next; the run folder let go whatever happens."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import sys
import threading
from typing import Any, Callable

import torch

from plumbing import interrupts, run_folder
from plumbing.errors import REMEDY, NothingToDo, UserError, WriteFailed
from plumbing.progress import Screen
from plumbing.ranks import world
from plumbing.run_folder import release_run_folders


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Call `main(argv)` and end in one line and an exit status (say()); under torchrun a rank stopped
    because another one ended says so; the run folder let go."""
    release_run_folders()                                  # common.start names this command's run
    handlers = interrupts.take_over() if threading.current_thread() is threading.main_thread() else {}
    stderr, sys.stderr = sys.stderr, Screen(sys.stderr)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except NothingToDo as e:
        say(str(e))
    except UserError as e:
        say(f"error: {e}", 2)
    except WriteFailed as e:
        run = run_folder.current()
        say(f"error: {e.line(run.kept(), run.next_command()) if run else e}", 4)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, interrupts.Stopped) else signal.SIGINT
        command = typed(main, argv)
        run = run_folder.current()
        again = run.after_a_stop(command) if run else (f"The run was not recorded yet: there is nothing for "
                                                       f"--resume to continue. To start it again: "
                                                       f"{shlex.join(command)}")
        say(f"\n{interrupts.WHAT[signum]}. {again}", 128 + signum)
    except torch.cuda.OutOfMemoryError:
        say("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the batch over "
            "more GPUs with `torchrun --nproc_per_node K ...` (the contrastive loss still sees the whole "
            "batch).", 3)
    except OSError as e:            # what could not be read or opened, whatever the reason
        where = f"{e.filename}: " if e.filename else ""
        limit = f"; it needs {REMEDY[e.errno]}" if e.errno in (errno.EMFILE, errno.ENFILE) else ""
        say(f"error: {where}{e.strerror or e}{limit}.", 2)
    except RuntimeError as e:       # under torchrun: a collective that lost the process at its other end
        if world()[1] == 1 or not re.search(r"gloo|NCCL|Connection (reset|closed) by peer", str(e)):
            raise
        say(f"rank {world()[0]}: stopped, because another process of this run ended (its own line says "
            f"why).", 1)
    finally:
        sys.stderr = stderr
        release_run_folders()
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
