r"""A whole training run timed phase by phase: the command as a user runs it, with a clock around
the real calls (a benchmark, not a test).

    python tools/bench_run.py simcse.py --model sentence-transformers/all-MiniLM-L6-v2 \
        --data data/wiki1m_head.txt --max_steps 40 --eval_every 10 --eval_untrained

Everything after `tools/bench_run.py` is the command to time, as it would be typed after
`python`; it runs in this process, unchanged. `--code DIR` runs another checkout's script and
common.py (a clone at an earlier commit) under the same clock, so that two versions are timed
side by side with the same command. Each phase is the wall time inside its calls, less the
phases called inside it:

    start-up            imports, the flags and files checked, the run folder (what no phase holds
                        before the first one starts)
    tokenising          common.tokenize (the token cache read, or the sentences tokenised)
    loading the encoder common.load_encoder for training
    training steps      common.train_step (forward, backward, clip, AdamW)
    dev evaluations     common.dev_figures (STS-B dev, SICK-R trial, alignment and uniformity)
    checkpoints         plumbing/checkpoint.py's save_last and save_best (last/ and best/ written)
    final evaluation    plumbing/report.py's final: best/ reloaded, the 7 tasks (less the untrained row)
    untrained row       plumbing/kept_rows.py's untrained (evaluated, or read back where it is kept)

(An earlier checkout's names for the last three, common.final_report, common.untrained_figures and
RunFolder's methods, are timed where that checkout has them.)
    other               the rest: the loop, the log, the report

`--json FILE` appends the phases and the total, with the command, as one JSON line.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()     # before torch's import: the start-up phase counts it

import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

PHASES = ["start-up", "tokenising", "loading the encoder", "training steps", "dev evaluations",
          "checkpoints", "final evaluation", "untrained row", "other"]


class Clock:
    """Exclusive wall time per phase: a call's time, less the timed calls inside it."""

    def __init__(self):
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.stack: list[list] = []          # [phase, start, time of the calls inside]
        self.first = None                    # when the first phase began: start-up ends there

    def wrap(self, fn, phase: str, outermost_only: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if outermost_only and self.stack:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            self.first = self.first or t
            self.stack.append([phase, t, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                _, start, inner = self.stack.pop()
                took = time.perf_counter() - start
                self.spent[phase] += took - inner
                if self.stack:
                    self.stack[-1][2] += took
        return timed


def main(argv: list[str]) -> None:
    code = Path(__file__).resolve().parents[1]
    out = ""
    while argv and argv[0] in ("--code", "--json"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        code, out = (Path(value).resolve(), out) if flag == "--code" else (code, value)
    if not argv or not argv[0].endswith(".py"):
        sys.exit("usage: python tools/bench_run.py [--code DIR] [--json FILE] SCRIPT.py [its flags]")
    script = code / Path(argv[0]).name
    sys.path.insert(0, str(code))
    sys.argv = [str(script), *argv[1:]]
    clock = Clock()
    timed = [("common tokenize", "tokenising", False), ("common load_encoder", "loading the encoder", True),
             ("common train_step", "training steps", False), ("common dev_figures", "dev evaluations", False),
             ("plumbing.report final", "final evaluation", False),
             ("common final_report", "final evaluation", False),
             ("plumbing.kept_rows untrained", "untrained row", False),
             ("common untrained_figures", "untrained row", False),
             *((f"plumbing.checkpoint {name}", "checkpoints", False) for name in ("save_last", "save_best")),
             *((f"plumbing.run_folder RunFolder.{name}", "checkpoints", False) for name in ("save_last",
                                                                                            "save_best"))]
    for where, phase, outer in timed:      # each name this checkout has
        module, name = where.split()
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        *path, name = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(owner, name):
            setattr(owner, name, clock.wrap(getattr(owner, name), phase, outer))
    status = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    total = time.perf_counter() - T0
    clock.spent["start-up"] = (clock.first or time.perf_counter()) - T0
    clock.spent["other"] = total - sum(v for k, v in clock.spent.items() if k != "other")
    lines = [f"{'phase':22s} {'seconds':>8s} {'share':>6s}"]
    lines += [f"{k:22s} {v:8.1f} {v / total:6.0%}" for k, v in clock.spent.items()]
    lines.append(f"{'total':22s} {total:8.1f}   (code: {code}; exit {status}; "
                 f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at the end)")
    print("\n".join(lines), file=sys.__stderr__)
    if out:
        with contextlib.suppress(OSError), open(out, "a") as f:
            f.write(json.dumps({"command": argv, "code": str(code), "exit": status, "total": total,
                                **clock.spent}) + "\n")
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
