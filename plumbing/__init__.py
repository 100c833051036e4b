"""What keeps a run safe and fast, apart from what a reader of the papers needs (common.py and the
method scripts): a module for each thing it holds; each opens with its rules and the function that
keeps each.

    errors, command_line, interrupts   how a command ends: one line and an exit status
    flags, inputs, downloads, sts_data, tokens, translation   what a run is given, checked first
    start, run_folder, checkpoint, atomic_writes, code_record   the run folder and what it keeps
    report, kept_rows, export   a run's end: its table, the untrained row, the model folder
    ranks, compiled_step, progress   torchrun, the fast step, what the screen shows
"""

from plumbing import code_record  # noqa: F401  (first: it must see the modules imported after it)
