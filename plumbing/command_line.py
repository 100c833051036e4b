"""Every command's main under run_main: it ends in one line and an exit status, never a traceback
for what the user can act on: a refused input (2), the GPU out of memory (3), a failed write (4),
Ctrl-C (130), SIGTERM (143), SIGHUP (129), each saying what to run next; the run folder is let go
whatever happens."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable

import torch

from plumbing import interrupts, run_folder
from plumbing.errors import UserError, WriteFailed
from plumbing.progress import Screen
from plumbing.run_folder import release_run_folders


def after_a_stop() -> str:
    """What run_main's line after a signal says to run: --resume once start() has recorded the run
    (args.json: --resume accepts it), else the same command (a --resume stopped that early changed
    nothing in its folder; a new run's --resume would be refused)."""
    run = run_folder.recorded()
    if run is not None:
        return (f"What was already written in {run} is kept; the same command plus --resume "
                f"continues the run (from its last checkpoint, if one was written).")
    if run_folder.resuming is not None:
        return (f"Nothing in {run_folder.resuming} was changed yet. Run the same command again: it "
                f"continues the run.")
    return "The run was not recorded yet: there is nothing for --resume to continue. Run the same command " \
        "again."


def say(line: str) -> None:
    """run_main's last line, on stderr (progress.Screen: one that cannot be written changes no exit
    status); the progress bars were closed on the way out of their `with` blocks."""
    print(line, file=sys.stderr, flush=True)


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Call `main(argv)`, and end in one line: a UserError (exit 2) or a failed write (4), the GPU
    out of memory (3), Ctrl-C (130), SIGTERM (143) or SIGHUP (129), each with what to do next; held
    folders let go. A signal whose exception was dropped on the way still ends the command here."""
    run_folder.recorded_run = run_folder.resuming = None       # common.start records this command's run
    handlers = interrupts.take_over() if threading.current_thread() is threading.main_thread() else {}
    stderr, sys.stderr = sys.stderr, Screen(sys.stderr)
    try:
        main(sys.argv[1:] if argv is None else argv)
        interrupts.stop_if_signalled()
    except UserError as e:
        say(f"error: {e}")
        sys.exit(2)
    except WriteFailed as e:
        kept = run_folder.checkpoint_kept(run_folder.recorded_run)
        say(f"error: {e.line(kept, run_folder.next_command())}")
        sys.exit(4)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, interrupts.Stopped) else signal.SIGINT
        say(f"\n{interrupts.WHAT[signum]}. {after_a_stop()}")
        sys.exit(128 + signum)
    except torch.cuda.OutOfMemoryError:
        say("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the batch "
            "over more GPUs with `torchrun --nproc_per_node K ...` (the contrastive loss still sees "
            "the whole batch).")
        sys.exit(3)
    finally:
        sys.stderr = stderr
        release_run_folders()
        if handlers:
            interrupts.give_back(handlers)
