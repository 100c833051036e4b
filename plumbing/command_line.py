"""Every command's main under run_main: it ends in one line and an exit status, never a traceback
for what the user can act on: a refused input (2), the GPU out of memory (3), a failed write (4),
Ctrl-C (130), SIGTERM (143), each saying what to run next; the run folder is let go whatever
happens."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable

import torch

from plumbing import process
from plumbing.process import UserError, WriteFailed, close_bars
from plumbing.run_folder import release_run_folders


class Terminated(KeyboardInterrupt):
    """SIGTERM, which `timeout` and job schedulers send before a kill: handled as Ctrl-C is."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def after_a_stop() -> str:
    """What run_main's line after Ctrl-C or SIGTERM says to run: --resume once start() has recorded
    the run (args.json: --resume accepts it), else the same command (--resume would be refused)."""
    run = process.recorded()
    if run is not None:
        return (f"What was already written in {run} is kept; the same command plus --resume "
                f"continues the run (from its last checkpoint, if one was written).")
    return "The run was not recorded yet: there is nothing for --resume to continue. Run the same command " \
        "again."


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Call `main(argv)`, and end in one line: a UserError (exit 2), a failed write (4), the GPU out
    of memory (3), Ctrl-C (130) or SIGTERM (143), each with what to do next; held folders let go."""
    process.recorded_run = None                            # common.start records this command's run
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:   # Ctrl-C back from plumbing/interrupts.py
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        close_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except WriteFailed as e:
        close_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(4)
    except KeyboardInterrupt as e:
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
        print(f"\n{what}. {after_a_stop()}", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except torch.cuda.OutOfMemoryError:
        print("error: the GPU ran out of memory. Lower --batch_size or --max_len, or spread the "
              "batch over more GPUs with `torchrun --nproc_per_node K ...` (the contrastive "
              "loss still sees the whole batch).", file=sys.stderr)
        sys.exit(3)
    finally:
        release_run_folders()
