"""A run's end, as the user reads it: best/ evaluated on the 7 STS tasks, printed beside the paper's rows
that the run's flags select (and the untrained encoder's, with --eval_untrained), kept in
best/test_metrics.json, and what to run next.

The rules, and the function that keeps each:
1. The figures are best/'s as a user reloads it (final): the model folder loaded back from the disk,
   not the weights in memory, so that the table is what `python tools/eval.py` gives for best/ later.
2. A paper's row stands beside a run's only where the run's flags reproduce it (plumbing/flags.py's
   select_rows), with the row's own note (a mean over seeds, our reading of a table): a row trained
   otherwise would read as a failed reproduction.
3. What is printed is what is kept (report): best/test_metrics.json holds the figures, the pooler, the
   rows and the untrained row as printed, so that a --resume of the finished run (finished) prints the
   same table again without evaluating, and tools/compare.py reads the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from plumbing import export, kept_rows
from plumbing.errors import NothingToDo
from plumbing.flags import select_rows
from plumbing.ranks import world
from plumbing.run_folder import RunFolder, write_json
from plumbing.sts_data import STS_TASKS, TASK_SHORT


def format_sts_table(res: dict, others: Sequence[tuple[str, dict]] = (), name: str = "this run") -> str:
    """The STS table of a result, other rows (label, {task: figure}) beside it ('-': none given)."""
    tasks = [t for t in STS_TASKS if t in res]
    rows = [(name, {**{t: res[t]["spearman"] for t in tasks}, "avg": res["avg"]}), *others]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{'':{width}s}" + "".join(f"{TASK_SHORT[t]:>8s}" for t in tasks) + f"{'Avg.':>8s}"]
    for label, figures in rows:
        cells = [f"{figures[t]:8.2f}" if t in figures else f"{'-':>8s}" for t in tasks + ["avg"]]
        lines.append(f"{label:{width}s}" + "".join(cells))
    lines.append("Spearman x100 of cosine similarity; STS12-16 report 'all' (one correlation over "
                 "each task's pairs); STS-B and SICK-R their test sets, unless the dev split is asked for.")
    return "\n".join(lines)


def paper_report(res: dict, rows: list[dict], note: str, dev_best: float | None,
                 untrained: dict | None = None) -> str:
    """The end of a run: the note; the 7 STS tasks beside the untrained encoder's (kept_rows.untrained's
    result, if given) and the `rows` on test sets (common.PaperRow's fields and its "label", as
    test_metrics.json keeps them); alignment and uniformity (STS-B test) and STS-B dev (best), each beside
    the rows that give them."""
    lines = [f"note: {note}"] if note else []
    sts_rows = [(r["label"], r["figures"]) for r in rows if r["split"] == "test"
                and set(r["figures"]) - {"alignment", "uniformity"}]
    if untrained:       # the row a run starts from, first under the run's
        figures = {t: untrained[t]["spearman"] for t in STS_TASKS if t in untrained}
        sts_rows.insert(0, (untrained["label"], {**figures, "avg": untrained["avg"]}))
    lines.append(format_sts_table(res, sts_rows))
    if untrained and untrained.get("kept_in"):
        how = ("kept from an earlier run of the same weights, pooler, STS data and evaluation code:"
               if untrained.get("reused") else "evaluated now, kept for the next run of this model in")
        lines.append(f"({untrained['label']}: {how} {untrained['kept_in']})")
    if "alignment" in res:
        beside = [f"; {r['label']}: {r['figures']['alignment']:.3f} / {r['figures']['uniformity']:.3f}"
                  for r in rows if r["split"] == "test" and "alignment" in r["figures"]]
        if untrained:
            beside.insert(0, f"; {untrained['label']}: {untrained['alignment']:.3f} / "
                             f"{untrained['uniformity']:.3f}")
        lines.append(f"alignment / uniformity on STS-B test (lower is better): this run "
                     f"{res['alignment']:.3f} / {res['uniformity']:.3f}" + "".join(beside))
    beside = [f"; {r['label']}: {r['figures']['STSBenchmark']:.2f}" for r in rows if r["split"] == "dev"]
    if beside and dev_best is not None:
        lines.append(f"STS-B dev: this run {dev_best:.2f} (the best evaluation, kept in best/)"
                     + "".join(beside))
    lines += [f"({r['label']}: {r['note']})" for r in rows if r["note"]]
    return "\n".join(lines)


def final(best_dir: Path, args: Any, pooler: str, paper_rows: Sequence[Any],
          evaluate: Callable[[str, str, str, str], dict]) -> dict:
    """Rules 1-3 at a run's end (`evaluate`: common.saved_figures; with --eval_untrained, the untrained
    --model's row too, read off with the same pooler). Returns best/'s figures."""
    res = evaluate(str(best_dir), pooler, args.sts_dir, "final evaluation of best/")
    picked, note = select_rows(args, list(paper_rows))
    rows = [{"label": label, **dataclasses.asdict(r)} for label, r in picked]
    kept = {**res, "pooler": pooler, "paper_rows": rows, "paper_note": note}
    if args.eval_untrained:
        kept["untrained"] = kept_rows.untrained(args, pooler, evaluate)
    report(best_dir, args, kept)
    return res


def report(best_dir: Path, args: Any, kept: dict, write: bool = True) -> None:
    """Rule 3: print `kept` (best/test_metrics.json's figures and rows), keep it, say what to run next."""
    dev = json.loads((best_dir / "dev_metrics.json").read_text()).get("stsb_dev")
    print(paper_report(kept, kept["paper_rows"], kept["paper_note"], dev, kept.get("untrained")))
    if write:
        write_json(best_dir / "test_metrics.json", kept)
    print(export.what_next(best_dir, args.model, kept["pooler"], args.sts_dir), file=sys.stderr)


def finished(run: RunFolder, args: Any, kept: dict, evaluate: Callable[[str, str, str, str], dict]) -> None:
    """--resume of a run that had finished: nothing to train. Its figures again, as kept (with
    --eval_untrained, the untrained encoder's beside them, evaluated now), then stop (exit status 0)."""
    if world()[0] == 0:
        new = args.eval_untrained and "untrained" not in kept
        if new:
            kept["untrained"] = kept_rows.untrained(args, kept["pooler"], evaluate)
        report(run.out / "best", args, kept, write=new)
    raise NothingToDo(f"{run.out} had finished: nothing to train; the figures above are the ones it kept in "
                      f"{run.out / 'best' / 'test_metrics.json'}.")
