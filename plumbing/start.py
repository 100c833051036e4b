"""A run's start (common.start delegates here): every flag and file checked before anything is written,
then the run folder opened and handed back with the device on it.

The rules, and the function that keeps each (all in start()):
1. Nothing is written before everything is checked: the flags on their own (Args.check), the data
   (downloaded on first use, else named at once with every other missing piece: a user offline learns
   all that is missing in one line, not one piece per try), the batch against the data, the STS files,
   the encoder's files and positions. Only then is the run folder opened (RunFolder.open), so that a
   refused command leaves no folder behind, and an hour's run does not die at its first evaluation
   for a file that was never there.
2. The run folder is named first (RunFolder.named), before any check: a refusal or a stop can then say
   where the run goes, and the command line's error path knows it (command_line.opened).
3. A --resume of a run that had finished trains nothing: it shows the figures it kept (report.finished)
   and ends with status 0; a last/ that a kill left behind is dropped first (checkpoint.drop_last).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from plumbing import checkpoint, command_line, downloads, inputs, report
from plumbing.errors import UserError
from plumbing.ranks import barrier, init_distributed, world
from plumbing.run_folder import RunFolder
from plumbing.sts_data import check_sts, check_sts_files


def start(args: Any, models: dict[str, tuple[str, str]] | None,
          evaluate: Callable[[str, str, str, str], dict]) -> RunFolder:
    """The rules above, in their order, before a script loads a model. `models`: a script's own, {flag:
    (name, one more way out)}; `evaluate`: common.saved_figures, for a finished run's untrained row."""
    device = init_distributed()
    args.check()                                    # the flags on their own
    run = RunFolder.named(args)                     # --output_dir, or the default for these flags and code
    run.device = device
    command_line.opened(run)
    if world()[0] == 0:     # the default data into data/ on first use, else what is missing named at once
        downloads.missing_pieces(args.data, args.sts_dir, check_sts,
                                 {"--model": (args.model, ""), **(models or {})})
    barrier()
    # a missing, empty or non-UTF-8 --data stops here (with the line), then too small a one
    rows = len(next(iter(inputs.read_columns(args.data).values())))
    inputs.check_batch(rows, args.batch_size, args.data, world()[1])
    inputs.check_sts_dir(args.sts_dir)
    check_sts_files(args.sts_dir)
    inputs.check_model_folder(args.model)           # a local folder's files whole (weights, JSON)
    positions = inputs.encoder_positions(args.model)
    if args.max_len > positions:
        raise UserError(f"--max_len {args.max_len}: {args.model} has {positions} positions. "
                        f"Pass --max_len {positions} or less.")
    args.settle(rows)
    run.open()              # held by this process; its record written, or --resume held to it
    if world()[0] == 0:     # the default folder's name is long: where the run goes, said once
        what = ("--resume: the run goes on there from its last checkpoint" if args.resume else
                "the flags in args.json, the log in metrics.jsonl; last/ at each evaluation, best/ at "
                "the best STS-B dev")
        print(f"run folder: {args.output_dir} ({what})", file=sys.stderr)
    if args.resume and (figures := checkpoint.finished(run)) is not None:
        checkpoint.drop_last(run)   # a kill between its figures and this left it: a finished run cannot go on
        report.finished(run, args, figures, evaluate)
    return run
