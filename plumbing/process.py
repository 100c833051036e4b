"""This process: its place under torchrun, the progress bars it draws, the run folder it recorded,
and the two errors that end it in one line (a refused input, exit status 2; a failed write, exit
status 4, which names what is intact and what to run once it can be written again)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm  # comes with transformers


class UserError(Exception):
    """A problem with the user's input (a file, a flag): printed as one clear message, exit 2."""


class WriteFailed(Exception):
    """A write that failed (disk full, quota, read-only, permission): one line, exit status 4."""


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every rank under torchrun; nothing in one process."""
    if world()[1] > 1:
        dist.barrier()


def progress(total: int | None, desc: str, unit: str = "it", disable: bool = False, initial: int = 0,
             leave: bool = True, delay: float = 0.0):
    """The progress bar of every long loop (tokenising, downloading, training, translating,
    evaluating), on stderr: the screen's, never the results' (stdout). A count of bytes (unit
    "B") reads as kB, MB, GB. `leave=False`: erased when done; `delay`: drawn only once the loop
    has run that many seconds."""
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable, leave=leave,
                delay=delay, unit_scale=unit == "B", dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


# the bars of the evaluations running now (innermost last): make_encode's batches move the last on
_evaluating: list = []
# seconds an evaluation runs before its bar is drawn: a short one (a tiny model, a test) draws none
EVAL_DELAY = 1.0


@contextlib.contextmanager
def evaluating(desc: str, total: int):
    """A bar over the `total` sentences an evaluation encodes: rank 0 only, drawn after EVAL_DELAY
    seconds and erased when done (the figures are printed after it); encoded(n) moves it on.
    The caller labels it (set_description(refresh=False): a refresh would draw it at once)."""
    bar = progress(total, desc, "sent", disable=world()[0] != 0, leave=False, delay=EVAL_DELAY)
    _evaluating.append(bar)
    try:
        yield bar
    finally:
        _evaluating.remove(bar)
        bar.close()


def encoded(n: int) -> None:
    """`n` more sentences encoded: the bar of the evaluation running now, if any, moves on."""
    if _evaluating:
        _evaluating[-1].update(n)


class Screen:
    """stderr while run_main runs a command: a write that fails (a closed terminal: EIO; a file over
    `ulimit -f`: EFBIG) is dropped, not raised: the screen stops no run and changes no exit status."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            return self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def close_bars() -> None:
    """Close the progress bars still drawn (a bar ends in no newline): a closing line then starts
    a line of its own instead of being glued to the bar's end, and no bar is drawn after it. A bar
    drawn below another (an evaluation's under training's) is closed first and wiped: closed after
    the bar above it, it would stay on the screen, stale, under the closing line."""
    for bar in sorted(getattr(tqdm, "_instances", ()), key=lambda b: -abs(getattr(b, "pos", 0))):
        if getattr(bar, "pos", 0):
            bar.leave = False
        bar.close()


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


# the run folder whose record (args.json) common.start wrote for this command, if any: what a
# failed write or a Ctrl-C says is intact and what to run next
recorded_run: Path | None = None
# the run folder a --resume command goes on with, until its record is checked: a stop before
# then changed nothing in it
resuming: Path | None = None
NO_CHECKPOINT = "no checkpoint was written yet"


def intact(step: int, last: Path) -> str:
    return f"the last complete checkpoint, step {step}, is intact in {last}"


def checkpoint_kept(out: str | Path | None) -> str:
    """What a failed write leaves intact in run folder `out`: last/'s step (read without its
    tensors), or that no checkpoint was written yet."""
    if out is None or not (last := Path(out) / "last" / "state.pt").is_file():
        return NO_CHECKPOINT
    try:
        step = torch.load(last, map_location="cpu", mmap=True, weights_only=True)["step"]
    except Exception:
        return f"{last.parent} is as it was"
    return intact(step, last.parent)


def recorded() -> Path | None:
    """The run folder this command recorded, once its record (args.json) is there: the folder
    --resume accepts. None before (--resume would be refused: the same command starts the run)."""
    return recorded_run if recorded_run is not None and (recorded_run / "args.json").is_file() else None


def tool(name: str) -> str:
    """A tool's path as typed from the working folder: tools/compare.py in the repository, else
    the whole path."""
    path = Path(__file__).resolve().parents[1] / "tools" / name
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else Path(relative).as_posix()


def what_next(best: Path, model: str, pooler: str, sts_dir: str) -> str:
    """The end of a run: where its best model is, and the commands to run next, as typed from the
    working folder: the run beside the untrained encoder, best/ evaluated again, best/ loaded."""
    q = shlex.quote
    sts = "" if Path(sts_dir) == Path("data/sts") else f" --sts_dir {q(sts_dir)}"
    # Python inside the shell's single quotes: its strings in double quotes
    folder, pair = json.dumps(str(best)), '["A man is playing a guitar.", "Someone plays music."]'
    if (best / "modules.json").is_file():          # written for the poolers sentence-transformers has
        load = (f"from sentence_transformers import SentenceTransformer; m = SentenceTransformer({folder}); "
                f"e = m.encode({pair}); print(m.similarity(e[:1], e[1:]))")
        how = "in sentence-transformers: the cosine of two sentences"
    else:
        load = (f"from transformers import AutoModel, AutoTokenizer; t = AutoTokenizer.from_pretrained("
                f"{folder}); m = AutoModel.from_pretrained({folder}); print(m(**t({pair}, padding=True, "
                f'return_tensors="pt"), output_hidden_states=True).hidden_states[-1].shape)')
        how = f"in transformers: sentence-transformers has no {pooler} pooling (common.pool has)"
    return "\n".join([
        f"best model: {best} (the figures above: its test_metrics.json); next:",
        f"  python {tool('compare.py')} {q(str(best.parent))} --baseline {q(model)} --pooler {pooler}{sts}"
        f"   # beside the untrained encoder",
        f"  python {tool('eval.py')} --model {q(str(best))} --pooler {pooler}{sts}   # the 7 tasks again",
        f"  python -c {q(load)}   # {how}"])


def next_command() -> str:
    """What to run once a command stopped by a failed write can go on."""
    return "the same command plus --resume continues" if recorded() else "the same command starts the run"


@contextlib.contextmanager
def writing(what: str, kept: str | None = None, then: str | None = None):
    """A write the system refuses inside (refused_write) becomes WriteFailed: what, why, what is
    intact (`kept`; by default the recorded run's checkpoint), what next (`then`; by default
    next_command()). Any other exception passes as it is."""
    try:
        yield
    except Exception as e:
        refused = refused_write(e)
        if refused is None:
            raise
        code, reason = refused
        remedy = REMEDY.get(code, "free space, a writable place")
        kept = checkpoint_kept(recorded_run) if kept is None else kept
        raise WriteFailed(f"could not write {what}: {reason}. {kept}; once it can be written again "
                          f"({remedy}), {then or next_command()}.") from e
