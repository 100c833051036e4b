"""What keeps a run safe and fast, apart from what a reader of the papers needs (common.py and the
method scripts): a module for each thing it holds.

    errors         the one-line errors: a refused input, a failed write
    ranks          torchrun: the process group and this process's GPU, its rank, a wait for every
                   rank, the global batch every loss sees (gather)
    progress       the progress bars, a stderr that cannot fail a run, the log's running means
    flags          argparse from an @dataclass of arg() fields; the flags a run changed, the
                   paper rows they reproduce (select_rows)
    inputs         the files a run is given, read and checked; the token cache
    kept_rows      the untrained encoder's row, evaluated once for its weights and code
    downloads      SimCSE's data into data/, each file proven whole before it is kept
                   (on first use, or tools/download.py)
    atomic_writes  folders and files written whole or not at all
    export         a model folder that transformers and sentence-transformers both load, and the
                   commands that use it at the end of a run
    run_folder     the run folder: its name, admission, the lock, the record, a stop's line, stages
    checkpoint     last/ and best/: what they hold (Checkpoint), whose they are, verified before load
    start          a run's start: every flag and file checked before anything is written
    report         a run's end: best/ on the 7 STS tasks beside the paper's rows, kept
    sts_data       SentEval's STS files as its readers parse them, checked whole
    tokens         the training text as token ids, tokenised once, cached
    compiled_step  torch.compile with CUDA graphs, DDP, the attention kernels; on a CPU, the
                   batch encoded in length-sorted parts
    translation    IFCL's German file, made with a seq2seq model (tools/translate.py), and
                   ifcl.py's one call for it (fraternal_file)
    command_line   every command's end: one line and its exit status
    interrupts     Ctrl-C, SIGTERM and SIGHUP from a script's first line (its imports) to its
                   last: one line; none inside a checkpoint's two renames
    code_record    the code that ran: each module's bytes kept as Python compiles them, for the
                   run's record (loaded here, first, so that it sees every module after it)
"""

from plumbing import code_record  # noqa: F401  (first: it must see the modules imported after it)
